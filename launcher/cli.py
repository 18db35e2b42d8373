"""`lms-launch`: train a recipe on N ranks with Large Model Support, plan LMS for it, find the largest
size that fits, write TFRecord files, or pack an offline GPU runtime. `lms-launch --help` lists the
commands and the training options; `lms-launch help COMMAND` shows a command's own.

Exit status: 0 on success, 1 when a rank fails, 2 for bad usage or a bad recipe (nothing started,
nothing written), 130 after Ctrl-C and 143 after SIGTERM (the ranks stop after the same step and save
a checkpoint when checkpoint.dir is set).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import yaml

from launcher import __version__
from launcher.launch.command import (HostsError, LaunchSpec, build_launch, parse_hostfile, parse_hosts, ssh_options,
                              worker_argv)
from launcher.arguments import USAGE_STATUS, UsageError, UsageParser
from launcher.config import BACKENDS, Recipe
from launcher.recipe import RecipeError, load_recipe, recipe_to_dict

# The other commands, each `main(argv) -> exit status` in its own module, imported when asked for
# (they load TensorFlow; `lms-launch RECIPE` itself does not), and what each does, in one line.
SUBCOMMANDS = {"plan": "launcher.lms.plan_command", "bench": "launcher.bench.command",
               "tfrecord": "launcher.rank.data.convert", "bundle": "launcher.bundle"}
SUMMARIES = {
    "RECIPE": "train a YAML recipe data-parallel on N ranks, LMS in every rank (options: lms-launch --help)",
    "plan": "will it fit? trace a recipe's step, plan LMS for a device, estimate its memory; no GPU, no training",
    "bench": "the largest batch or input that fits: without swapping, with TensorFlow's and with lms-launch's",
    "tfrecord": "write training data as TFRecord files (images, volumes, token sequences: docs/data.md)",
    "bundle": "pack TensorFlow and its CUDA libraries for a GPU machine without network (docs/gpu-bundle.md)",
    "help": "this overview, or one command's options: lms-launch help plan",
}
OVERVIEW = "\n".join(
    ["Train TensorFlow 2 models data-parallel with Horovod, with Large Model Support: activations parked",
     "in host memory during the forward pass and brought back just before the backward op that needs them.",
     "", "commands:"]
    + [f"  {name:<10}{line}" for name, line in SUMMARIES.items()]
    + ["", "examples:",
       "  lms-launch recipes/unet3d-cpu.yaml                  2 ranks on this machine's CPU, LMS on",
       "  lms-launch recipes/resnet50.yaml --np 4             4 GPUs of this node, one rank per GPU",
       "  lms-launch recipes/resnet50.yaml -H n1:4,n2:4       8 GPUs on two nodes (ssh to each)",
       "  lms-launch plan recipes/resnet50.yaml --device-memory 16GiB --link pcie4",
       "  lms-launch recipes/resnet50.yaml --set train.batch_size=128 --set lms.enabled=false"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # subcommands that load TensorFlow: no INFO noise
    try:
        if not argv:  # what there is to run, not an error about a missing recipe
            print(short_help(), file=sys.stderr)
            return USAGE_STATUS
        if argv[:1] == ["--version"]:
            print(version_line())
            return 0
        if argv[:1] == ["help"]:
            return help_main(argv[1:])
        if argv and argv[0] in SUBCOMMANDS:
            return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        return train_main(argv)
    except (RecipeError, HostsError, UsageError) as err:
        print(f"lms-launch: error: {err}", file=sys.stderr)
        return USAGE_STATUS


def help_main(argv: list[str]) -> int:
    """`lms-launch help [COMMAND]`: the overview with the training options, or COMMAND's --help."""
    if len(argv) > 1:
        raise UsageError(f"help takes one command at most; got {' '.join(argv)}")
    command = argv[0] if argv else "train"
    if command == "help":
        print(short_help())
        return 0
    if command in ("train", "RECIPE"):
        train_parser().print_help()
        return 0
    if command not in SUBCOMMANDS:
        raise UsageError(f"help: no command {command!r}; the commands are {', '.join(SUBCOMMANDS)} "
                         f"(and train, the default: lms-launch RECIPE)")
    try:
        return importlib.import_module(SUBCOMMANDS[command]).main(["--help"])
    except SystemExit as done:  # argparse's --help exits once it has printed
        return int(done.code or 0)


def short_help() -> str:
    """The usage and the commands, without the training options."""
    return f"{train_parser().format_usage()}\n{OVERVIEW}\n\nEvery training option: lms-launch --help."


def version_line() -> str:
    """`lms-launch X (Python P; tensorflow T, horovod H)` from the installed distributions' metadata,
    without importing them (so it answers at once, and where TensorFlow is broken too)."""
    from importlib import metadata

    def installed(*names: str) -> str:
        for name in names:
            try:
                return f"{name} {metadata.version(name)}"
            except metadata.PackageNotFoundError:
                continue
        return f"{names[0]} not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return (f"lms-launch {__version__} (Python {python}; {installed('tensorflow', 'tensorflow-cpu')}, "
            f"{installed('horovod')})")


def train_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="lms-launch",
        usage="\n".join(["lms-launch RECIPE [--np N] [-H HOST:SLOTS,... | --hostfile FILE] [--set KEY=VALUE ...] "
                         "[options]",
                         f"       lms-launch {{{','.join(SUBCOMMANDS)}}} ...",
                         "       lms-launch help [COMMAND] | --version"]),
        description=OVERVIEW,
        epilog="Precedence: recipe defaults < the YAML file < --set < the flags above.\n"
               "Exit status: 0 success, 1 a rank failed, 2 bad usage or recipe (nothing started),\n"
               "130 Ctrl-C, 143 SIGTERM. Documentation: README.md and docs/ in the repository.")
    parser.add_argument("recipe", help="the YAML recipe to train, e.g. recipes/resnet50.yaml")
    parser.add_argument("--np", type=int, help="total ranks, one per GPU (distributed.np; default 1)")
    parser.add_argument("-H", "--hosts", help="host:slots,... as for horovodrun; ranks fill the hosts in order "
                                              "(distributed.hosts; default: all on this machine)")
    parser.add_argument("--hostfile", help="file of 'host slots=N' lines (distributed.hostfile)")
    parser.add_argument("--backend", choices=BACKENDS, help="distributed.backend")
    parser.add_argument("--network-interface", metavar="IF",
                        help="interface(s) the ranks talk over, e.g. eth0 or ib0,eth0 (distributed.network_interface)")
    parser.add_argument("--ssh-port", type=int, metavar="PORT",
                        help="sshd port on the other hosts (distributed.ssh_port)")
    parser.add_argument("--ssh-identity-file", metavar="KEY",
                        help="private key for ssh to the other hosts (distributed.ssh_identity_file)")
    parser.add_argument("--start-timeout", type=int, metavar="S",
                        help="seconds the ranks may take to start on all hosts (distributed.start_timeout)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--run-dir", help="where metrics, the resolved recipe and plans go "
                                          "(default: runs/<recipe>-<time>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved recipe and each rank's command and environment; start nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in checkpoint.dir (rank 0 loads it "
                             "and broadcasts it; training goes on at the step after it)")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print lms-launch's version (and Python's, TensorFlow's, Horovod's) and exit")
    return parser


# The flags that stand for a recipe key, and that key. Flags win over the recipe and --set.
FLAG_KEYS = {"np": "distributed.np", "hosts": "distributed.hosts", "hostfile": "distributed.hostfile",
             "backend": "distributed.backend", "network_interface": "distributed.network_interface",
             "ssh_port": "distributed.ssh_port", "ssh_identity_file": "distributed.ssh_identity_file",
             "start_timeout": "distributed.start_timeout"}


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as `--set` entries, after the recipe's own --set ones: flags win."""
    overrides = list(args.overrides)
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if flag == "ssh_identity_file":  # horovodrun and mpirun get a path that works from any directory
            value = Path(value).expanduser().absolute()
        overrides.append(f"{key}={value}")
    return overrides


def resolve_hosts(recipe: Recipe) -> list[tuple[str, int]]:
    dist = recipe.distributed
    if dist.hosts:
        return parse_hosts(dist.hosts)
    if dist.hostfile:
        path = Path(dist.hostfile)
        if not path.is_file():
            raise HostsError(f"distributed.hostfile: {path} does not exist")
        return parse_hostfile(path.read_text(), name=str(path))
    return [("localhost", dist.np)]


def default_run_dir(recipe_path: str) -> Path:
    return Path("runs") / f"{Path(recipe_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_identity_file(recipe: Recipe) -> None:
    """The key is read on this host (by horovodrun's or mpirun's ssh, and by the fetch): it must be here."""
    key = recipe.distributed.ssh_identity_file
    if key and not Path(key).expanduser().is_file():
        raise UsageError(f"distributed.ssh_identity_file: {key} is not a file on this host; give the private key "
                         f"ssh should use (ssh -i)")


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UsageError(f"--run-dir {run_dir} already holds files; give a new directory or remove it")


def check_backend(recipe: Recipe, spec: LaunchSpec) -> None:
    """Fails before starting anything when the launch tool the command needs is missing."""
    tool = spec.argv[0]
    if tool in ("horovodrun", "mpirun", "srun") or tool.endswith("/horovodrun"):
        if shutil.which(tool) is None:
            hint = {"mpirun": "install Open MPI (apt-get install openmpi-bin) or use --backend gloo",
                    "srun": "run lms-launch on a node of the job, where Slurm's commands are installed"}.get(
                        tool, "Horovod is not installed: scripts/install.sh builds it where g++ and make are (it says "
                              "what is missing); one rank needs none: --np 1")
            raise UsageError(f"distributed.backend={recipe.distributed.backend} needs '{tool}' on PATH; {hint}")
    if tool == "srun":
        from launcher.launch.rendezvous import rendezvous_address

        rendezvous_address(recipe.distributed.network_interface)  # the ranks must reach it: fail now if they cannot


def check_checkpoint_dir(recipe: Recipe, resume: bool) -> None:
    """--resume needs a complete checkpoint in checkpoint.dir, and a new run must not write among
    another run's. Checked before anything starts when rank 0, which reads and writes that folder,
    runs on this host (a relative path means the same here as for rank 0); rank 0 checks again."""
    from launcher.rank.checkpoint import CheckpointError, check_folder

    try:
        check_folder(recipe.checkpoint, resume)
    except CheckpointError as err:
        raise UsageError(str(err)) from None


def with_slurm_job_hosts(recipe_path: str, recipe: Recipe, overrides: list[str]) -> Recipe:
    """Inside a Slurm job with no hosts named, the job's hosts (and rank count) join `overrides` as --set
    entries, so the resolved recipe and every rank see them; the line saying so is printed."""
    from launcher.launch.slurm import job_overrides, np_on_command_line

    from_job, line = job_overrides(recipe.distributed, np_on_command_line(overrides), os.environ)
    if not from_job:
        return recipe
    overrides += from_job
    print(line, flush=True)
    return load_recipe(recipe_path, overrides)


def find_horovodrun() -> str:
    """horovodrun from the interpreter's own environment, even when that venv is not on PATH."""
    beside = Path(sys.executable).parent / "horovodrun"
    return str(beside) if beside.exists() else "horovodrun"


def train_main(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    overrides = flag_overrides(args)
    recipe = with_slurm_job_hosts(args.recipe, load_recipe(args.recipe, overrides), overrides)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.recipe)
    spec, local_hosts = launch_spec(args, recipe, overrides, run_dir)
    if args.dry_run:
        print_dry_run(recipe, spec)
        return 0
    check_identity_file(recipe)
    check_run_dir(run_dir)
    check_backend(recipe, spec)
    if spec.rank0_host in local_hosts:
        check_checkpoint_dir(recipe, args.resume)
    return launch(args, recipe, spec, run_dir, rank0_here=spec.rank0_host in local_hosts)


def launch_spec(args: argparse.Namespace, recipe: Recipe, overrides: list[str], run_dir: Path):
    """(the launch: command, environment, rank 0's host; this machine's names among the hosts)."""
    from launcher.launch.remote import local_host_names
    from launcher.launch.threads import usable_cpus

    hosts = resolve_hosts(recipe)
    worker = worker_argv(sys.executable, str(Path(args.recipe).resolve()), str(run_dir.resolve()), overrides)
    if args.resume:
        if not recipe.checkpoint.dir:
            raise UsageError("--resume needs checkpoint.dir: the folder the run to continue saved its checkpoints in "
                             "(in the recipe, or --set checkpoint.dir=DIR)")
        worker.append("--resume")
    local_hosts = local_host_names([host for host, _ in hosts])
    spec = build_launch(recipe.distributed, hosts, worker, user_env=os.environ, local_cpus=usable_cpus(),
                        local_hosts=local_hosts, as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    if spec.argv[0] == "horovodrun":
        spec.argv[0] = find_horovodrun()
    return spec, local_hosts


def launch(args: argparse.Namespace, recipe: Recipe, spec: LaunchSpec, run_dir: Path, rank0_here: bool) -> int:
    """Starts the ranks, relays them until they end, brings rank 0's results here and says how it went."""
    from launcher.launch.rendezvous import served
    from launcher.launch.spawn import run_ranks
    from launcher.worker import METRICS_FILE

    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"lms-launch: {recipe.model.name}, {recipe.distributed.np} rank(s) "
          f"({'no launcher' if spec.direct else recipe.distributed.backend}), "
          f"batch {recipe.train.batch_size}/rank, {recipe.train.steps} steps, LMS "
          f"{'on' if recipe.lms.enabled else 'off'}; run dir {run_dir}", flush=True)
    if not rank0_here:
        # The progress bar follows rank 0's metrics.jsonl, which is written on rank 0's host: off. Rank 0
        # still prints a line every interval, and those lines come through horovodrun or mpirun.
        print(f"lms-launch: rank 0 runs on {spec.rank0_host}, not on this host: no progress bar; rank 0's run "
              f"directory is copied here when the ranks finish", flush=True)
    with served(spec, recipe.distributed) as launch_env:  # --backend srun: the rendezvous, while the ranks run
        status = run_ranks(spec.argv, launch_env, run_dir / METRICS_FILE, recipe.train.steps,
                           progress=recipe.logging.progress and not args.no_progress and rank0_here)
    if not rank0_here:
        fetched = fetch_results(recipe, spec.rank0_host, run_dir, after_failure=status != 0)
        if not fetched and status == 0:
            return 1
    return report_end(status, run_dir)


def report_end(status: int, run_dir: Path) -> int:
    """The run's last lines (the summary table, or why there is none) and the launcher's exit status."""
    from launcher.launch.spawn import STOPPED_STATUSES
    from launcher.rank.metrics import format_summary_table
    from launcher.worker import METRICS_FILE, SUMMARY_FILE

    summary_path = run_dir / SUMMARY_FILE
    if status in STOPPED_STATUSES:
        print(f"lms-launch: stopped (exit status {status}); partial results in {run_dir}", file=sys.stderr)
        return status
    if status != 0:
        print(f"lms-launch: a rank failed (exit status {status}); partial results in {run_dir}", file=sys.stderr)
        return status
    if not summary_path.exists():
        print(f"lms-launch: ranks finished but {summary_path} was not written", file=sys.stderr)
        return 1
    print(format_summary_table(json.loads(summary_path.read_text())))
    print(f"lms-launch: metrics in {run_dir / METRICS_FILE}, summary in {summary_path}")
    return 0


def fetch_results(recipe: Recipe, host: str, run_dir: Path, after_failure: bool = False) -> bool:
    """Brings rank 0's run directory from `host` into `run_dir` (which the launcher made empty) unless
    rank 0 already wrote into it here (a shared filesystem). False, with the reason printed, when it
    cannot; after a failed run that is expected when rank 0 never got to write anything."""
    from launcher.launch.remote import DEFAULT_CONNECT_TIMEOUT_S, FetchError, fetch_run_dir

    if any(run_dir.iterdir()):
        return True
    dist = recipe.distributed
    try:
        count = fetch_run_dir(host, str(run_dir.resolve()), run_dir, ssh_options(dist),
                              dist.start_timeout or DEFAULT_CONNECT_TIMEOUT_S)
    except FetchError as err:
        print(f"lms-launch: {'no partial results: ' if after_failure else ''}{err}", file=sys.stderr)
        return False
    print(f"lms-launch: copied {count} file(s) of the run directory from rank 0's host {host}", flush=True)
    return True


def print_dry_run(recipe: Recipe, spec: LaunchSpec) -> None:
    print("# resolved recipe")
    print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).rstrip())
    print("\n# command")
    print(shlex.join(spec.argv))
    print("\n# added to the launcher's environment (inherited by every rank)")
    for key, value in sorted(spec.env.items()):
        print(f"{key}={shlex.quote(value)}")
    print("\n# each rank's environment beyond what it inherits (rank identity; threads the rank sets for itself)")
    for slot, env in zip(spec.slots, spec.rank_envs):
        extra = {k: v for k, v in env.items() if k not in spec.env}
        identity = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra.items())) or "(nothing)"
        how = ", no launcher" if spec.direct else ""
        print(f"rank {slot.rank} on {slot.host} (local rank {slot.local_rank}{how}): {identity}")


if __name__ == "__main__":
    sys.exit(main())
