"""Pure functions: settings -> the command that starts the ranks, rank -> its environment.

Nothing here starts a process or reads the environment, so `--dry-run` and the tests see exactly what
`launcher.launch.spawn` will run. Four shapes of launch:

- one rank on this machine: the worker runs directly, no Horovod launcher (hvd.init() gives size 1);
- Gloo: `horovodrun --gloo -np N -H host:slots,...`, which starts the ranks (over ssh for other hosts),
  forwards the launcher's whole environment, and gives each rank its identity through HOROVOD_* variables;
- MPI: `mpirun -np N -H host:slots,...` with `-x` for every variable the ranks need (mpirun forwards
  nothing else);
- srun, inside a Slurm job: `srun --ntasks=N ...` starts the ranks as the tasks of a job step, each of
  which takes its identity from Slurm's and meets the others at the launcher's Gloo rendezvous
  (launcher/launch/slurm.py).

Which hosts are this machine is an input (`local_hosts`): the CLI finds out, these functions only use it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from launcher import env as ev
from launcher.config import DistributedConfig
from launcher.launch.threads import thread_defaults

LOCAL_HOST = "localhost"
LOCAL_NAMES = frozenset({LOCAL_HOST, "127.0.0.1"})  # this machine, whatever else it is called
RENDEZVOUS_PLACEHOLDER = "<chosen by horovodrun at start>"
SERVED_PLACEHOLDER = "<chosen by lms-launch at start>"  # what --backend srun's launcher serves: launch/rendezvous.py
REMOTE_THREADS_PLACEHOLDER = "<usable CPUs on {host} / {local_size}: set by the rank at start>"
_HOST_SLOTS = re.compile(r"^([A-Za-z0-9_.\-\[\]:]+?):(\d+)$")


class HostsError(ValueError):
    """A host list or hostfile cannot be used; the message names the entry."""


@dataclass(frozen=True)
class Slot:
    """Where one rank runs and who it is among the others (the Horovod rank identity)."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start a run: the command, the variables added to its environment, and
    the environment each rank will see (for --dry-run, logs and tests)."""

    argv: list[str]
    env: dict[str, str]
    slots: list[Slot]
    rank_envs: list[dict[str, str]]
    direct: bool
    """True when the one rank runs as a plain child of the launcher, with no horovodrun or mpirun."""

    @property
    def rank0_host(self) -> str:
        """The host whose rank 0 writes the run directory."""
        return self.slots[0].host


def parse_hosts(hosts: str) -> list[tuple[str, int]]:
    """`"a:2,b:4"` -> [("a", 2), ("b", 4)], as horovodrun -H reads it."""
    result = []
    for entry in (part.strip() for part in hosts.split(",")):
        if not entry:
            continue
        match = _HOST_SLOTS.match(entry)
        if not match or int(match.group(2)) < 1:
            raise HostsError(f"distributed.hosts: {entry!r} is not host:slots with slots >= 1 (e.g. node1:4)")
        result.append((match.group(1), int(match.group(2))))
    if not result:
        raise HostsError("distributed.hosts: empty host list; give host:slots,... (e.g. node1:4,node2:4)")
    return result


def parse_hostfile(text: str, name: str = "hostfile") -> list[tuple[str, int]]:
    """Lines `host slots=N` (MPI style) or `host:N`; `#` starts a comment."""
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        mpi_style = re.match(r"^(\S+)\s+slots\s*=\s*(\d+)$", line)
        if mpi_style:
            line = f"{mpi_style.group(1)}:{mpi_style.group(2)}"
        elif ":" not in line and " " not in line:
            line = f"{line}:1"
        try:
            hosts += parse_hosts(line)
        except HostsError:
            raise HostsError(f"{name}:{number}: {line!r} is not 'host slots=N' or 'host:N'") from None
    if not hosts:
        raise HostsError(f"{name}: no hosts in it")
    return hosts


def assign_slots(hosts: list[tuple[str, int]], np: int) -> list[Slot]:
    """Fills hosts in order, as horovodrun does: ranks 0..k-1 on the first host, and so on."""
    capacity = sum(slots for _, slots in hosts)
    if np > capacity:
        listed = ",".join(f"{h}:{s}" for h, s in hosts)
        raise HostsError(f"distributed.np: {np} ranks but the hosts ({listed}) offer {capacity} slots; "
                         f"lower np or add slots")
    placed: list[tuple[str, int]] = []  # (host, local_rank)
    for host, slots in hosts:
        for local_rank in range(slots):
            if len(placed) < np:
                placed.append((host, local_rank))
    used_hosts = list(dict.fromkeys(host for host, _ in placed))
    local_sizes = {host: sum(1 for h, _ in placed if h == host) for host in used_hosts}
    slots_out = []
    for rank, (host, local_rank) in enumerate(placed):
        # Cross rank: this rank's index among the ranks with the same local rank (one per host).
        peers = [h for h in used_hosts if local_sizes[h] > local_rank]
        slots_out.append(Slot(rank=rank, host=host, local_rank=local_rank, local_size=local_sizes[host],
                              cross_rank=peers.index(host), cross_size=len(peers)))
    return slots_out


def hosts_in_use(slots: list[Slot]) -> list[tuple[str, int]]:
    """The hosts that hold a rank, in order, each with the ranks it holds."""
    counts: dict[str, int] = {}
    for slot in slots:
        counts[slot.host] = counts.get(slot.host, 0) + 1
    return list(counts.items())


def runs_without_launcher(np: int, slots: list[Slot], local_hosts: frozenset[str] = LOCAL_NAMES) -> bool:
    """The one place that decides the one-rank special case: a single rank on this machine needs no
    horovodrun or mpirun (hvd.init() then gives size 1). It looks at where the rank is placed, not at
    the host list, so `np=1 -H localhost:1,node2:1` runs directly: node2 gets no rank."""
    return np == 1 and slots[0].host in local_hosts


def worker_argv(python: str, recipe_path: str, run_dir: str, overrides: list[str]) -> list[str]:
    """The per-rank command. Each rank resolves the same recipe and overrides itself, so no rank
    depends on a file the launcher wrote (other hosts may not share the run directory)."""
    argv = [python, "-m", "launcher.worker", recipe_path, "--run-dir", run_dir]
    for item in overrides:
        argv += ["--set", item]
    return argv


def launcher_env_defaults(user_env: Mapping[str, str]) -> dict[str, str]:
    """Variables the launcher adds to its own environment, which every rank inherits, unless the user
    set them: quiet TensorFlow logs, and unbuffered output so rank lines arrive as they are printed.
    (Thread counts are per host and set by each rank: launcher/launch/threads.py.)"""
    defaults = {ev.TF_CPP_MIN_LOG_LEVEL: "1", ev.PYTHONUNBUFFERED: "1"}
    return {key: value for key, value in defaults.items() if key not in user_env}


def ssh_options(dist: DistributedConfig) -> list[str]:
    """The ssh options of the run's ssh settings, as horovodrun passes them (`-p PORT -i FILE`); used
    for mpirun's plm_rsh_args and for fetching results back."""
    options = []
    if dist.ssh_port is not None:
        options += ["-p", str(dist.ssh_port)]
    if dist.ssh_identity_file:
        options += ["-i", dist.ssh_identity_file]
    return options


def mpirun_ssh_args(dist: DistributedConfig) -> str:
    """Open MPI's plm_rsh_args: the ssh options as one string (as horovodrun builds it), plus
    ConnectTimeout for --start-timeout: a host that accepts the connection but never answers would
    otherwise hold mpirun forever (orte_startup_timeout does not cover a hanging ssh; measured)."""
    options = ssh_options(dist)
    if dist.start_timeout is not None:
        options += ["-o", f"ConnectTimeout={dist.start_timeout}"]
    return " ".join(options)


def mpi_forwarded(names: list[str] | set[str]) -> list[str]:
    """Which of the launcher's variables mpirun must pass on to every rank with -x (launcher/env.py
    says which and why)."""
    return sorted(name for name in set(names)
                  if name != ev.CUDA_VISIBLE_DEVICES
                  and (name in ev.MPI_FORWARD_NAMES or name.startswith(ev.MPI_FORWARD_PREFIXES)))


def build_launch(dist: DistributedConfig, hosts: list[tuple[str, int]], worker: list[str],
                 user_env: Mapping[str, str], local_cpus: int, local_hosts: frozenset[str] = LOCAL_NAMES,
                 as_root: bool = False) -> LaunchSpec:
    """The whole launch as data. `hosts` is already parsed (from -H, a hostfile, or localhost:np);
    `local_cpus` only fills in --dry-run's view of ranks on this machine."""
    slots = assign_slots(hosts, dist.np)
    added = launcher_env_defaults(user_env)
    # The slots the plan fills, not all that were offered: horovodrun --gloo starts a rank in every slot
    # of -H whatever -np says (Horovod 0.28.1's gloo_run), so -np 3 -H a:2,b:2 would start 4.
    host_list = ",".join(f"{host}:{count}" for host, count in hosts_in_use(slots))
    direct = runs_without_launcher(dist.np, slots, local_hosts)

    if direct:
        argv = list(worker)
    elif dist.backend == "gloo":
        argv = ["horovodrun", "--gloo", "-np", str(dist.np), "-H", host_list]
        if dist.network_interface:
            argv += ["--network-interfaces", dist.network_interface]
        if dist.ssh_port is not None:
            argv += ["--ssh-port", str(dist.ssh_port)]
        if dist.ssh_identity_file:
            argv += ["--ssh-identity-file", dist.ssh_identity_file]
        if dist.start_timeout is not None:
            argv += ["--start-timeout", str(dist.start_timeout)]
        argv += worker  # horovodrun forwards the whole environment to every rank itself
    elif dist.backend == "srun":
        from launcher.launch.slurm import srun_argv

        argv = srun_argv(dist.np) + worker  # the rest of what srun needs is in its environment (srun_environment)
        added = {**added, **srun_environment(dist)}
    else:
        # --tag-output marks each line with its rank ([1,N]<stderr>:), as horovodrun does ([N]<stderr>:):
        # the launcher names a failed rank and shows its last lines from those marks (launcher/launch/spawn.py).
        argv = ["mpirun", "-np", str(dist.np), "-H", host_list, "-bind-to", "none", "-map-by", "slot", "--tag-output"]
        if as_root:
            argv.append("--allow-run-as-root")  # containers often run as root; Open MPI refuses it otherwise
        if dist.network_interface:
            # btl: the ranks' own traffic; oob: mpirun's control channel to the daemons on each host.
            argv += ["-mca", "btl_tcp_if_include", dist.network_interface,
                     "-mca", "oob_tcp_if_include", dist.network_interface]
        if mpirun_ssh_args(dist):
            argv += ["-mca", "plm_rsh_args", mpirun_ssh_args(dist)]
        for key in mpi_forwarded([*user_env, *added]):
            argv += ["-x", key]  # mpirun forwards only the variables named with -x
        argv += worker

    rank_envs = [rank_environment(slot, dist, added, direct, user_env, local_cpus, local_hosts) for slot in slots]
    return LaunchSpec(argv=argv, env=added, slots=slots, rank_envs=rank_envs, direct=direct)


def rank_environment(slot: Slot, dist: DistributedConfig, added: Mapping[str, str], direct: bool,
                     user_env: Mapping[str, str], local_cpus: int,
                     local_hosts: frozenset[str] = LOCAL_NAMES) -> dict[str, str]:
    """What one rank finds in its environment beyond what it inherits: the launcher's defaults, the
    rank identity its launcher sets (none when it runs without one), and the thread counts it sets
    itself at start-up (known here for this machine's ranks only)."""
    env = dict(added)
    threads = thread_defaults(user_env, local_cpus, slot.local_size)
    if slot.host not in local_hosts:
        placeholder = REMOTE_THREADS_PLACEHOLDER.format(host=slot.host, local_size=slot.local_size)
        threads = {key: placeholder if key in (ev.TF_NUM_INTRAOP_THREADS, ev.OMP_NUM_THREADS) else value
                   for key, value in threads.items()}
    env.update(threads)
    if direct:
        return env
    if dist.backend in ("gloo", "srun"):
        env.update(horovod_identity(slot, dist.np))
        if dist.backend == "gloo":
            env.update({ev.HOROVOD_CONTROLLER: "gloo", ev.HOROVOD_CPU_OPERATIONS: "gloo",
                        ev.HOROVOD_GLOO_RENDEZVOUS_ADDR: RENDEZVOUS_PLACEHOLDER,
                        ev.HOROVOD_GLOO_RENDEZVOUS_PORT: RENDEZVOUS_PLACEHOLDER})
    else:
        env.update({
            ev.OMPI_COMM_WORLD_RANK: str(slot.rank),
            ev.OMPI_COMM_WORLD_SIZE: str(dist.np),
            ev.OMPI_COMM_WORLD_LOCAL_RANK: str(slot.local_rank),
            ev.OMPI_COMM_WORLD_LOCAL_SIZE: str(slot.local_size),
        })
    return env


def horovod_identity(slot: Slot, np: int) -> dict[str, str]:
    """The variables that tell a Gloo rank who it is, as horovodrun sets them (and as a rank started by
    srun sets them for itself from Slurm's: launcher/launch/slurm.py)."""
    return {
        ev.HOROVOD_HOSTNAME: slot.host,
        ev.HOROVOD_RANK: str(slot.rank),
        ev.HOROVOD_SIZE: str(np),
        ev.HOROVOD_LOCAL_RANK: str(slot.local_rank),
        ev.HOROVOD_LOCAL_SIZE: str(slot.local_size),
        ev.HOROVOD_CROSS_RANK: str(slot.cross_rank),
        ev.HOROVOD_CROSS_SIZE: str(slot.cross_size),
    }


def srun_environment(dist: DistributedConfig) -> dict[str, str]:
    """What --backend srun adds to the launcher's environment, which srun passes on to every task: Gloo
    as Horovod's controller, where its rendezvous is and srun's host file (both known only once the
    launcher serves them), the interface(s) to use, and the mark that makes each rank read its identity
    from Slurm."""
    env = {ev.HOROVOD_CONTROLLER: "gloo", ev.HOROVOD_CPU_OPERATIONS: "gloo",
           ev.HOROVOD_GLOO_RENDEZVOUS_ADDR: SERVED_PLACEHOLDER, ev.HOROVOD_GLOO_RENDEZVOUS_PORT: SERVED_PLACEHOLDER,
           ev.SLURM_HOSTFILE: SERVED_PLACEHOLDER, ev.LMS_LAUNCH_SRUN: "1"}
    if dist.network_interface:
        # As horovodrun sets them: Gloo takes one interface, NCCL the whole list.
        env[ev.HOROVOD_GLOO_IFACE] = dist.network_interface.split(",")[0]
        env[ev.NCCL_SOCKET_IFNAME] = dist.network_interface
    return env
