"""How many threads each rank's TensorFlow and OpenMP pools get: the ranks on one host split its cores.

Each rank decides this itself at start-up, before TensorFlow is imported, from the CPUs it may use on
its own host and the number of ranks its launcher placed there (HOROVOD_LOCAL_SIZE from horovodrun,
OMPI_COMM_WORLD_LOCAL_SIZE from mpirun). The launcher cannot know it: it may run on a login node with
another core count, hosts in one job may differ, and a batch scheduler or container may give a rank
fewer CPUs than the machine has. Asking every host over ssh before the launch would cost an ssh round
per host on every run and still not see the CPU set the rank itself gets.

Variables the user set (on the launcher host, forwarded by horovodrun or mpirun, or on the rank's host)
are never changed.
"""
from __future__ import annotations

import os
from typing import Mapping, MutableMapping

from launcher import env as ev

INTEROP_THREADS = "2"  # a training step has few independent ops at a time; 2 lets them overlap


def thread_defaults(env: Mapping[str, str], cpus: int, local_size: int) -> dict[str, str]:
    """The thread variables a rank should add to `env`: its host's `cpus` split over the `local_size`
    ranks there (oversubscribed pools made 2 ranks on 2 cores several times slower), except those
    already in `env`."""
    threads = str(max(1, cpus // max(1, local_size)))
    defaults = {
        ev.TF_NUM_INTRAOP_THREADS: threads,
        ev.OMP_NUM_THREADS: threads,
        ev.TF_NUM_INTEROP_THREADS: INTEROP_THREADS,
    }
    return {key: value for key, value in defaults.items() if key not in env}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: what taskset, cgroup cpusets and Slurm give
    it), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def local_size_from_env(env: Mapping[str, str]) -> int:
    """Ranks on this host, as the launcher that started this rank tells it; 1 without a launcher."""
    for key in (ev.HOROVOD_LOCAL_SIZE, ev.OMPI_COMM_WORLD_LOCAL_SIZE):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 1


def local_rank_from_env(env: Mapping[str, str]) -> int:
    """This rank's index among the ranks on its host, before Horovod starts; 0 without a launcher."""
    for key in (ev.HOROVOD_LOCAL_RANK, ev.OMPI_COMM_WORLD_LOCAL_RANK):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def apply_thread_defaults(environ: MutableMapping[str, str]) -> str:
    """Sets this rank's thread variables in `environ` (call before importing TensorFlow) and returns
    one line saying what the rank uses and why, for the log."""
    cpus, local_size = usable_cpus(), local_size_from_env(environ)
    added = thread_defaults(environ, cpus, local_size)
    environ.update(added)
    settings = ", ".join(f"{key}={environ[key]}{'' if key in added else ' (yours)'}"
                         for key in (ev.TF_NUM_INTRAOP_THREADS, ev.OMP_NUM_THREADS, ev.TF_NUM_INTEROP_THREADS))
    return (f"{cpus} usable CPU{'s' if cpus != 1 else ''} for {local_size} rank{'s' if local_size != 1 else ''} "
            f"on this host: {settings}")
