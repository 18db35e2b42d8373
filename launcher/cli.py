"""`lms-launch`: train a recipe on N ranks, plan LMS for it, or write TFRecord files.

    lms-launch RECIPE [--np N] [-H host:slots,...] [--hostfile FILE] [--backend gloo|mpi]
                      [--set key.path=value ...] [--run-dir DIR] [--dry-run]
    lms-launch plan RECIPE [--set ...] [--device-memory 16GiB] [--host-memory 512GiB] [--link L] [--device D]
                    [--out DIR] [--plot]
    lms-launch tfrecord --kind images|volumes --out DIR ...

Exit status: 0 on success, 2 for bad usage or a bad recipe (nothing started, nothing written),
the ranks' status (non-zero) when any rank fails.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import yaml

from launcher.command import HostsError, LaunchSpec, build_launch, parse_hostfile, parse_hosts, worker_argv
from launcher.config import Recipe
from launcher.recipe import RecipeError, load_recipe, recipe_to_dict

USAGE_ERROR = 2
SUBCOMMANDS = ("plan", "tfrecord")


class UsageError(Exception):
    """Bad command-line use; printed as it is, exit 2."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # subcommands that load TensorFlow: no INFO noise
    try:
        if argv and argv[0] == "plan":
            from launcher.plan_command import main as plan_main

            return plan_main(argv[1:])
        if argv and argv[0] == "tfrecord":
            from launcher.data.convert import main as tfrecord_main

            return tfrecord_main(argv[1:])
        return train_main(argv)
    except (RecipeError, HostsError, UsageError) as err:
        print(f"lms-launch: error: {err}", file=sys.stderr)
        return USAGE_ERROR


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on its own; this keeps one error format for every usage error."""

    def error(self, message: str):
        raise UsageError(f"{message} (see lms-launch --help)")


def train_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lms-launch",
        description="Train a YAML recipe data-parallel with Horovod, with Large Model Support. "
                    "Other commands: 'lms-launch plan RECIPE' (LMS plan and memory estimate, no training), "
                    "'lms-launch tfrecord' (write training data files).",
        epilog="Precedence: recipe defaults < the YAML file < --set and the flags above. "
               "Exit status: 0 success, 2 bad usage or recipe, non-zero when a rank fails.")
    parser.add_argument("recipe", help="YAML recipe, e.g. recipes/resnet50-cpu.yaml")
    parser.add_argument("--np", type=int, help="total ranks (distributed.np)")
    parser.add_argument("-H", "--hosts", help="host:slots,... as for horovodrun (distributed.hosts)")
    parser.add_argument("--hostfile", help="file of 'host slots=N' lines (distributed.hostfile)")
    parser.add_argument("--backend", choices=("gloo", "mpi"), help="distributed.backend")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set train.batch_size=64 (repeatable)")
    parser.add_argument("--run-dir", help="where metrics, the resolved recipe and plans go "
                                          "(default: runs/<recipe>-<time>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved recipe and each rank's command and environment; start nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as `--set` entries, after the recipe's own --set ones: flags win."""
    overrides = list(args.overrides)
    if args.np is not None:
        overrides.append(f"distributed.np={args.np}")
    if args.hosts is not None:
        overrides.append(f"distributed.hosts={args.hosts}")
    if args.hostfile is not None:
        overrides.append(f"distributed.hostfile={args.hostfile}")
    if args.backend is not None:
        overrides.append(f"distributed.backend={args.backend}")
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


def check_run_dir(run_dir: Path) -> None:
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UsageError(f"--run-dir {run_dir} already holds files; give a new directory or remove it")


def check_backend(recipe: Recipe, spec: LaunchSpec) -> None:
    """Fails before starting anything when the launch tool the command needs is missing."""
    tool = spec.argv[0]
    if tool in ("horovodrun", "mpirun") or tool.endswith("/horovodrun"):
        if shutil.which(tool) is None:
            hint = ("install Open MPI (apt-get install openmpi-bin) or use --backend gloo" if tool == "mpirun"
                    else "run scripts/install.sh, which builds Horovod")
            raise UsageError(f"distributed.backend={recipe.distributed.backend} needs '{tool}' on PATH; {hint}")


def find_horovodrun() -> str:
    """horovodrun from the interpreter's own environment, even when that venv is not on PATH."""
    beside = Path(sys.executable).parent / "horovodrun"
    return str(beside) if beside.exists() else "horovodrun"


def train_main(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    overrides = flag_overrides(args)
    recipe = load_recipe(args.recipe, overrides)
    hosts = resolve_hosts(recipe)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.recipe)
    worker = worker_argv(sys.executable, str(Path(args.recipe).resolve()), str(run_dir.resolve()), overrides)
    spec = build_launch(recipe.distributed, hosts, worker, user_env=os.environ, host_cpus=os.cpu_count() or 1,
                        as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    if spec.argv[0] == "horovodrun":
        spec.argv[0] = find_horovodrun()

    if args.dry_run:
        print_dry_run(recipe, spec)
        return 0
    check_run_dir(run_dir)
    check_backend(recipe, spec)

    from launcher.spawn import run_ranks
    from launcher.worker import METRICS_FILE, SUMMARY_FILE

    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"lms-launch: {recipe.model.name}, {recipe.distributed.np} rank(s) "
          f"({recipe.distributed.backend if len(spec.argv) != len(worker) else 'no launcher'}), "
          f"batch {recipe.train.batch_size}/rank, {recipe.train.steps} steps, LMS "
          f"{'on' if recipe.lms.enabled else 'off'}; run dir {run_dir}", flush=True)
    status = run_ranks(spec.argv, spec.env, run_dir / METRICS_FILE, recipe.train.steps,
                       progress=recipe.logging.progress and not args.no_progress)
    summary_path = run_dir / SUMMARY_FILE
    if status != 0:
        print(f"lms-launch: a rank failed (exit status {status}); partial results in {run_dir}", file=sys.stderr)
        return status if status != USAGE_ERROR else 1  # 2 means bad usage only
    if not summary_path.exists():
        print(f"lms-launch: ranks finished but {summary_path} was not written", file=sys.stderr)
        return 1
    from launcher.metrics import format_summary_table

    print(format_summary_table(json.loads(summary_path.read_text())))
    print(f"lms-launch: metrics in {run_dir / METRICS_FILE}, summary in {summary_path}")
    return 0


def print_dry_run(recipe: Recipe, spec: LaunchSpec) -> None:
    print("# resolved recipe")
    print(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).rstrip())
    print("\n# command")
    print(shlex.join(spec.argv))
    print("\n# added to the launcher's environment (inherited by every rank)")
    for key, value in sorted(spec.env.items()):
        print(f"{key}={shlex.quote(value)}")
    print("\n# each rank's environment beyond what it inherits")
    for slot, env in zip(spec.slots, spec.rank_envs):
        extra = {k: v for k, v in env.items() if k not in spec.env}
        identity = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(extra.items())) or "(none: no launcher)"
        print(f"rank {slot.rank} on {slot.host} (local rank {slot.local_rank}): {identity}")


if __name__ == "__main__":
    sys.exit(main())
