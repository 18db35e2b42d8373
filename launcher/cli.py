"""`lms-launch`: train a recipe on N ranks, plan LMS for it, or write TFRecord files.

    lms-launch RECIPE [--np N] [-H host:slots,...] [--hostfile FILE] [--backend gloo|mpi|srun]
                      [--network-interface IF] [--ssh-port PORT] [--ssh-identity-file KEY] [--start-timeout S]
                      [--set key.path=value ...] [--run-dir DIR] [--dry-run] [--resume]
    lms-launch plan RECIPE [--set ...] [--device-memory 16GiB] [--host-memory 512GiB] [--link L] [--device D]
                    [--out DIR] [--plot]
    lms-launch tfrecord --kind images|volumes --out DIR ...
    lms-launch bench max-batch|max-resolution RECIPE [--judge auto|estimate|run] [--device-memory 16GiB] [--out DIR]
    lms-launch bundle [--have FILE|NAME] [--part-size 56MiB] [--out DIR]   # offline runtime for a GPU machine

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

from launcher.launch.command import (HostsError, LaunchSpec, build_launch, parse_hostfile, parse_hosts, ssh_options,
                              worker_argv)
from launcher.arguments import USAGE_STATUS, UsageError, UsageParser
from launcher.config import BACKENDS, Recipe
from launcher.recipe import RecipeError, load_recipe, recipe_to_dict

# The other commands, each `main(argv) -> exit status` in its own module, imported when asked for
# (they load TensorFlow; `lms-launch RECIPE` itself does not).
SUBCOMMANDS = {"plan": "launcher.lms.plan_command", "bench": "launcher.bench.command",
               "tfrecord": "launcher.rank.data.convert", "bundle": "launcher.bundle"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # subcommands that load TensorFlow: no INFO noise
    try:
        if argv and argv[0] in SUBCOMMANDS:
            return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        return train_main(argv)
    except (RecipeError, HostsError, UsageError) as err:
        print(f"lms-launch: error: {err}", file=sys.stderr)
        return USAGE_STATUS


def train_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="lms-launch",
        description="Train a YAML recipe data-parallel with Horovod, with Large Model Support. "
                    "Other commands: 'lms-launch plan RECIPE' (LMS plan and memory estimate, no training), "
                    "'lms-launch tfrecord' (write training data files), "
                    "'lms-launch bench max-batch|max-resolution RECIPE' (the largest size that fits, side by side).",
        epilog="Precedence: recipe defaults < the YAML file < --set and the flags above. "
               "Exit status: 0 success, 1 a rank failed, 2 bad usage or recipe, 130 Ctrl-C, 143 SIGTERM.")
    parser.add_argument("recipe", help="YAML recipe, e.g. recipes/resnet50-cpu.yaml")
    parser.add_argument("--np", type=int, help="total ranks (distributed.np)")
    parser.add_argument("-H", "--hosts", help="host:slots,... as for horovodrun (distributed.hosts)")
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
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set train.batch_size=64 (repeatable)")
    parser.add_argument("--run-dir", help="where metrics, the resolved recipe and plans go "
                                          "(default: runs/<recipe>-<time>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved recipe and each rank's command and environment; start nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in checkpoint.dir (rank 0 loads it "
                             "and broadcasts it; training goes on at the step after it)")
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
                        tool, "run scripts/install.sh, which builds Horovod")
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
    hosts = resolve_hosts(recipe)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.recipe)
    worker = worker_argv(sys.executable, str(Path(args.recipe).resolve()), str(run_dir.resolve()), overrides)
    if args.resume:
        if not recipe.checkpoint.dir:
            raise UsageError("--resume needs checkpoint.dir: the folder the run to continue saved its checkpoints in "
                             "(in the recipe, or --set checkpoint.dir=DIR)")
        worker.append("--resume")
    from launcher.launch.remote import local_host_names
    from launcher.launch.threads import usable_cpus

    local_hosts = local_host_names([host for host, _ in hosts])
    spec = build_launch(recipe.distributed, hosts, worker, user_env=os.environ, local_cpus=usable_cpus(),
                        local_hosts=local_hosts, as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    if spec.argv[0] == "horovodrun":
        spec.argv[0] = find_horovodrun()

    if args.dry_run:
        print_dry_run(recipe, spec)
        return 0
    check_identity_file(recipe)
    check_run_dir(run_dir)
    check_backend(recipe, spec)
    if spec.rank0_host in local_hosts:
        check_checkpoint_dir(recipe, args.resume)

    from launcher.launch.rendezvous import served
    from launcher.launch.spawn import STOPPED_STATUSES, run_ranks
    from launcher.worker import METRICS_FILE, SUMMARY_FILE

    run_dir.mkdir(parents=True, exist_ok=True)
    rank0_here = spec.rank0_host in local_hosts
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
    from launcher.rank.metrics import format_summary_table

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
