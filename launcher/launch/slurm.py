"""Slurm: the hosts and slots of the job a launch runs in, and `--backend srun`, which starts the ranks
as the tasks of one job step instead of over ssh.

Inside an allocation (sbatch, salloc) Slurm tells the job's processes which nodes it holds
(SLURM_JOB_NODELIST, a compressed host list such as `gpu[01-04,07]`) and how many tasks each node runs
(SLURM_TASKS_PER_NODE, such as `4(x3),2`). `job_from_env` reads them and `SlurmJob.hosts` turns them
into the `host:slots` list every backend takes, so a launch inside a job needs no -H and no host file.

`--backend srun` starts one task per rank with `srun`, which reaches the nodes through Slurm's own
daemons: no ssh between nodes. srun puts each task on the node the launch planned (`assign_slots`, as
for horovodrun; srun reads the plan from a host file, --distribution=arbitrary), passes on the
launcher's whole environment (--export=ALL, as horovodrun does), marks each output line with the task
(--label) and ends the step as soon as one task fails (--kill-on-bad-exit). Each task takes its Horovod
identity from Slurm's (`rank_identity`: its rank is SLURM_PROCID, checked against the node srun put it
on), and the ranks meet at the Gloo rendezvous the launcher serves while they run
(launcher/launch/rendezvous.py), as horovodrun's ranks meet at horovodrun's.

Everything here is a pure function of its inputs; the CLI passes in the environment.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Mapping

from launcher import env as ev
from launcher.config import DistributedConfig
from launcher.launch.command import HostsError, Slot, assign_slots, horovod_identity, parse_hosts

SRUN = "srun"
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")  # one entry of SLURM_TASKS_PER_NODE: 4 or 4(x3)
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")  # one entry inside brackets: 7 or 01-04


class SlurmError(HostsError):
    """Slurm's description of the job cannot be used, or the launch asks for what the job cannot give."""


def expand_hostlist(text: str) -> list[str]:
    """A Slurm host list as `scontrol show hostnames` expands it: `node[01-03,7],gpu` -> node01,
    node02, node03, node7, gpu. Zero padding follows each range's first number; several bracket groups
    in one name expand left to right (`r[1-2]-n[1-2]` -> r1-n1, r1-n2, r2-n1, r2-n2)."""
    names: list[str] = []
    for entry in _split_top_level(text):
        parts = re.split(r"(\[[^\[\]]*\])", entry)  # text, [group], text, [group], ..., text
        if any("[" in part or "]" in part for part in parts[0::2]):
            raise SlurmError(f"{ev.SLURM_JOB_NODELIST}={text!r}: unbalanced brackets in {entry!r}")
        choices = [_bracket_names(part[1:-1], text) if index % 2 else [part] for index, part in enumerate(parts)]
        names += ["".join(combination) for combination in itertools.product(*choices)]
    if not names:
        raise SlurmError(f"{ev.SLURM_JOB_NODELIST}={text!r}: no nodes in it")
    return names


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas that are not inside brackets."""
    entries, depth, current = [], 0, ""
    for char in text.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    return [entry for entry in [*entries, current] if entry]


def _bracket_names(inside: str, text: str) -> list[str]:
    numbers = []
    for item in inside.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise SlurmError(f"{ev.SLURM_JOB_NODELIST}={text!r}: {item!r} is not a number or a range such as 01-04")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise SlurmError(f"{ev.SLURM_JOB_NODELIST}={text!r}: the range {item!r} runs backwards")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def expand_counts(text: str, name: str = ev.SLURM_TASKS_PER_NODE) -> list[int]:
    """Slurm's per-node counts, `2(x3),1` -> [2, 2, 2, 1]."""
    counts = []
    for entry in text.split(","):
        match = _COUNT.match(entry.strip())
        if not match:
            raise SlurmError(f"{name}={text!r}: {entry!r} is not N or N(xK)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def parse_gpus_per_node(text: str) -> int:
    """SLURM_GPUS_PER_NODE as sbatch --gpus-per-node sets it: `4`, `a100:4`, or `a100:2,v100:1` (summed)."""
    total = 0
    for entry in text.split(","):
        count = entry.strip().rsplit(":", 1)[-1]
        if not count.isdigit():
            raise SlurmError(f"{ev.SLURM_GPUS_PER_NODE}={text!r}: {entry!r} is not [type:]count")
        total += int(count)
    return total


@dataclass(frozen=True)
class SlurmJob:
    """The allocation a launch runs in, as Slurm describes it to the job's processes."""

    job_id: str
    nodelist: str
    """SLURM_JOB_NODELIST as Slurm wrote it (compressed)."""
    nodes: tuple[str, ...]
    tasks_text: str
    """SLURM_TASKS_PER_NODE as Slurm wrote it (`2(x3),1`)."""
    tasks_per_node: tuple[int, ...]
    ntasks: int | None
    """SLURM_NTASKS: the tasks the job asked for (sbatch -n, or --ntasks-per-node x nodes); None when it
    asked for no task count, and Slurm gives it one per node. It may be fewer than the slots: -n 3
    with --ntasks-per-node=2 on 2 nodes holds 2 + 2."""
    gpus_per_node: int | None

    @property
    def slots_from_gpus(self) -> bool:
        """One slot per GPU when the job asked for GPUs per node but no task count: Horovod's one rank
        per GPU. Otherwise one slot per task, whatever the GPUs (the user said how many tasks)."""
        return self.ntasks is None and bool(self.gpus_per_node)

    @property
    def hosts(self) -> list[tuple[str, int]]:
        if self.slots_from_gpus:
            return [(node, self.gpus_per_node) for node in self.nodes]
        return list(zip(self.nodes, self.tasks_per_node))

    @property
    def ranks(self) -> int:
        """The ranks a launch runs unless told otherwise: the tasks the job asked for, else every slot."""
        slots = sum(count for _, count in self.hosts)
        return min(self.ntasks, slots) if self.ntasks and not self.slots_from_gpus else slots

    def describe(self, np: int, np_given: bool) -> str:
        """The one line that says where the hosts and the rank count came from."""
        source = (f"{ev.SLURM_GPUS_PER_NODE}={self.gpus_per_node}, no task count asked" if self.slots_from_gpus
                  else f"{ev.SLURM_TASKS_PER_NODE}={self.tasks_text}")
        slots = sum(count for _, count in self.hosts)
        why = "distributed.np" if np_given else ev.SLURM_NTASKS if np < slots else None
        ranks = f"{np} rank{'s' if np != 1 else ''} " + (f"({why}) of its {slots} slots" if why else "(every slot)")
        return (f"lms-launch: Slurm job {self.job_id}: hosts {format_hosts(self.hosts)} from "
                f"{ev.SLURM_JOB_NODELIST}={self.nodelist} and {source}; {ranks}")


def format_hosts(hosts: list[tuple[str, int]]) -> str:
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


def job_from_env(environ: Mapping[str, str]) -> SlurmJob | None:
    """The job this process runs in; None outside a Slurm allocation."""
    job_id = environ.get(ev.SLURM_JOB_ID)
    if not job_id:
        return None
    nodelist = environ.get(ev.SLURM_JOB_NODELIST, "")
    tasks_text = environ.get(ev.SLURM_TASKS_PER_NODE, "")
    if not nodelist or not tasks_text:
        missing = ev.SLURM_JOB_NODELIST if not nodelist else ev.SLURM_TASKS_PER_NODE
        raise SlurmError(f"{ev.SLURM_JOB_ID}={job_id} is set but {missing} is not: run lms-launch in the job's batch "
                         f"script or salloc shell (not in a copy of its environment), or give -H")
    nodes = expand_hostlist(nodelist)
    tasks = expand_counts(tasks_text)
    if len(tasks) != len(nodes):
        raise SlurmError(f"{ev.SLURM_TASKS_PER_NODE}={tasks_text!r} gives {len(tasks)} node(s) but "
                         f"{ev.SLURM_JOB_NODELIST}={nodelist!r} names {len(nodes)}")
    gpus_text = environ.get(ev.SLURM_GPUS_PER_NODE, "")
    ntasks_text = environ.get(ev.SLURM_NTASKS, "")
    if ntasks_text and not ntasks_text.isdigit():
        raise SlurmError(f"{ev.SLURM_NTASKS}={ntasks_text!r} is not a number of tasks")
    return SlurmJob(job_id=job_id, nodelist=nodelist, nodes=tuple(nodes), tasks_text=tasks_text,
                    tasks_per_node=tuple(tasks), ntasks=int(ntasks_text) if ntasks_text else None,
                    gpus_per_node=parse_gpus_per_node(gpus_text) if gpus_text else None)


def np_on_command_line(overrides: list[str]) -> bool:
    """Whether --np or --set distributed.np=... gave the rank count (flags arrive as --set entries)."""
    return any(item.split("=", 1)[0].strip() == "distributed.np" for item in overrides)


def job_overrides(dist: DistributedConfig, np_given: bool, environ: Mapping[str, str]) -> tuple[list[str], str | None]:
    """The `--set` entries that give a launch inside a Slurm job the job's hosts, and its rank count
    (`SlurmJob.ranks`) unless `np_given`, with the line that says so. Nothing when the launch names its hosts itself
    (-H, --hostfile, the recipe) or runs outside a job. The recipe's distributed.np is the rank count
    for a machine of one's own; inside a job the job says how many ranks it holds."""
    job = job_from_env(environ)
    named = dist.hosts or dist.hostfile
    if dist.backend == SRUN:
        if job is None:
            raise SlurmError("distributed.backend=srun starts the ranks as the tasks of a Slurm job step; this is not "
                             f"inside an allocation ({ev.SLURM_JOB_ID} is not set): run it in an sbatch script or a "
                             f"salloc shell (docs/clusters.md), or use --backend gloo or mpi")
        if named:
            raise SlurmError("distributed.backend=srun runs the ranks on the job's own nodes: leave out -H, --hostfile "
                             "and distributed.hosts/hostfile (--np runs fewer ranks than the job has slots)")
    if job is None or named:
        return [], None
    overrides = [f"distributed.hosts={format_hosts(job.hosts)}"]
    np = dist.np if np_given else job.ranks
    if not np_given:
        overrides.append(f"distributed.np={np}")
    return overrides, job.describe(np, np_given)


def srun_argv(np: int) -> list[str]:
    """srun's part of the launch command (the worker's argv follows it). The host file that places
    each task is named by SLURM_HOSTFILE in srun's environment (`srun_hostfile`)."""
    return [SRUN, f"--ntasks={np}", "--distribution=arbitrary", "--kill-on-bad-exit=1", "--label", "--export=ALL"]


def srun_hostfile(slots: list[Slot]) -> str:
    """The node of each task, in rank order: what srun's --distribution=arbitrary reads."""
    return "".join(f"{slot.host}\n" for slot in slots)


def rank_identity(environ: Mapping[str, str], slots: list[Slot]) -> dict[str, str]:
    """The Horovod identity of the srun task running here: slot SLURM_PROCID of the launch's plan,
    after checking that srun put the task where the plan (and the rendezvous) expects it."""
    try:
        rank, local_id = int(environ[ev.SLURM_PROCID]), int(environ[ev.SLURM_LOCALID])
        node = environ[ev.SLURMD_NODENAME]
    except (KeyError, ValueError):
        raise SlurmError(f"{ev.LMS_LAUNCH_SRUN} is set but this process has no task identity from srun "
                         f"({ev.SLURM_PROCID}, {ev.SLURM_LOCALID}, {ev.SLURMD_NODENAME}): only lms-launch "
                         f"--backend srun should start it") from None
    if rank >= len(slots):
        raise SlurmError(f"srun started task {rank}, but the launch planned {len(slots)} ranks")
    slot = slots[rank]
    if (node, local_id) != (slot.host, slot.local_rank):
        raise SlurmError(f"srun put task {rank} on {node} as its task {local_id} there; the launch planned it on "
                         f"{slot.host} as local rank {slot.local_rank}. Did SLURM_HOSTFILE or "
                         f"--distribution reach srun from elsewhere?")
    return horovod_identity(slot, len(slots))


def srun_task_identity(environ: Mapping[str, str], dist: DistributedConfig) -> dict[str, str]:
    """`rank_identity` with the plan made from the recipe as the launcher resolved it (its
    distributed.hosts are the job's, given to every rank by --set)."""
    return rank_identity(environ, assign_slots(parse_hosts(dist.hosts or ""), dist.np))
