"""A real Slurm on the network-namespace hosts of tests/netns_cluster.py, for the Slurm tests.

Debian's own daemons, as a cluster's administrator would run them: `munged` (the credentials every
Slurm message carries), `slurmctld` on the `login` host (the controller, where jobs are submitted) and
`slurmd` on each rank host, all from one slurm.conf. Nothing is mocked; only the paths are the test's:

- every file the daemons write (state, spool, logs, pid files, the munge key and socket) is under the
  test's temporary directory, and SLURM_CONF points every Slurm command at the test's slurm.conf;
- one `munged` serves every host: its socket is a file, and the namespaces share the filesystem (a
  Unix socket bound to a path is reachable from any network namespace);
- `proctrack/pgid` and `task/none`: no cgroups, which a container may not delegate. Slurm then finds a
  step's processes by their process group, which is all these tests need (`scancel`, killed steps).

`SlurmCluster.stop()` ends the daemons; `Cluster.close()` then kills whatever is left in the
namespaces (jobs included) and removes them.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.netns_cluster import Cluster, ClusterUnavailable

DAEMONS = {"munged": "/usr/sbin/munged", "mungekey": "/usr/sbin/mungekey", "slurmctld": "/usr/sbin/slurmctld",
           "slurmd": "/usr/sbin/slurmd", "slurmstepd": "/usr/sbin/slurmstepd"}
CLIENTS = ("sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
PARTITION = "lms"
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE")


def check_slurm_installed() -> None:
    """Raises ClusterUnavailable naming what is missing (scripts/install.sh installs all of it)."""
    missing = [name for name, path in DAEMONS.items() if not os.access(path, os.X_OK)]
    missing += [name for name in CLIENTS if shutil.which(name) is None]
    if missing:
        raise ClusterUnavailable(f"Slurm is not installed ({', '.join(missing)} missing): install slurmctld, slurmd, "
                                 f"slurm-client and munge (scripts/install.sh does)")


class SlurmCluster:
    """munged, slurmctld and slurmd on a built `Cluster`; `start()` returns once every node is idle."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.root = cluster.root / "slurm"
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.daemons: list[tuple[str, subprocess.Popen]] = []

    @property
    def env(self) -> dict[str, str]:
        """What a user's shell needs beyond the cluster's: the Slurm configuration to use."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        self.root.mkdir()
        self._start_munge()
        self._write_conf()
        self._daemon("slurmctld", "login", [DAEMONS["slurmctld"], "-D", "-f", str(self.conf)])
        for node in self.cluster.nodes:
            self._start_slurmd(node)
        self._wait_for_idle_nodes(timeout_s)
        return self

    def _start_munge(self) -> None:
        (self.root / "munge").mkdir(mode=0o700)
        key = self.root / "munge" / "munge.key"
        subprocess.run([DAEMONS["mungekey"], "--create", f"--keyfile={key}"], check=True, capture_output=True)
        self._daemon("munged", "login", [
            DAEMONS["munged"], "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self.root / 'munge' / 'munged.pid'}", f"--log-file={self.root / 'munge' / 'munged.log'}",
            f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.log('munged')}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        login = self.cluster.hosts["login"]
        nodes = "".join(f"NodeName={n.name} NodeAddr={n.address} CPUs={len(n.cpus)} State=UNKNOWN\n"
                        for n in self.cluster.nodes)
        self.conf.write_text(
            f"ClusterName=lmstest\nSlurmctldHost=login({login.address})\n"
            "SlurmUser=root\nSlurmdUser=root\nSlurmctldPort=6817\nSlurmdPort=6818\n"
            f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={self.munge_socket}\n"
            f"StateSaveLocation={self.root / 'state'}\nSlurmdSpoolDir={self.root / 'spool-%n'}\n"
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}\nSlurmdPidFile={self.root / 'slurmd-%n.pid'}\n"
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}\nSlurmdLogFile={self.root / 'slurmd-%n.log'}\n"
            "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\nMpiDefault=none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSchedulerType=sched/builtin\n"
            "SlurmdParameters=config_overrides\nReturnToService=2\n"
            # KillWait: seconds between scancel's SIGTERM and its SIGKILL; time for a checkpoint.
            "KillWait=30\nInactiveLimit=0\nMinJobAge=600\nSlurmctldTimeout=30\n"
            # SlurmdTimeout: seconds without an answer before slurmctld declares a node lost (300 by default);
            # generous, so a loaded machine never loses a node by accident (the test that loses one says so).
            "SlurmdTimeout=60\n"
            f"{nodes}PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")
        (self.root / "state").mkdir()
        for node in self.cluster.nodes:
            (self.root / f"spool-{node.name}").mkdir()
        # slurmd loads a cgroup plugin even when no plugin it runs uses cgroups, and `ip netns exec`
        # leaves no cgroup filesystem under /sys: cgroup/v1 over an empty folder of the test's.
        (self.root / "cgroup").mkdir()
        (self.root / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={self.root / 'cgroup'}\n")

    def _start_slurmd(self, node) -> None:
        self._daemon(f"slurmd-{node.name}", node.name, [DAEMONS["slurmd"], "-D", "-N", node.name, "-f", str(self.conf)])

    def crash(self, name: str) -> None:
        """What the others see of a node that dies: every process on it ends at once (SIGKILL), its
        slurmd included. Only its sshd, the test's way in and no part of Slurm, stays."""
        host = self.cluster.hosts[name]
        pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout.split()
        for pid in map(int, pids):
            if pid != host.sshd.pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def revive(self, name: str, timeout_s: float = 60) -> None:
        """Starts the node's slurmd again; the node rejoins once it registers (ReturnToService=2)."""
        self.daemons = [(daemon, p) for daemon, p in self.daemons if daemon != f"slurmd-{name}"]
        self._start_slurmd(self.cluster.hosts[name])
        self._wait_for_idle_nodes(timeout_s)

    def _daemon(self, name: str, host: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "w")
        process = subprocess.Popen(self.cluster.on(host, argv, cwd=str(self.root)), stdout=log,
                                   stderr=subprocess.STDOUT, env=self.user_env())
        log.close()
        self.daemons.append((name, process))

    def user_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return self.cluster.launcher_env({**self.env, **(extra or {})})

    def run(self, argv: list[str], check: bool = True, env: dict[str, str] | None = None,
            cwd: str = "/") -> subprocess.CompletedProcess:
        """A Slurm command run on the login host, as a user there would."""
        done = subprocess.run(self.cluster.on("login", argv, cwd=cwd), capture_output=True, text=True,
                              env=self.user_env(env), timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}\n{self.logs()}")
        return done

    def _wait_for_idle_nodes(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            for name, process in self.daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with status {process.returncode}\n{self.logs()}")
            done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False)
            states = done.stdout.strip()
            lines = states.splitlines()
            if len(lines) == len(self.cluster.nodes) and all(line.split()[1] == "idle" for line in lines):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout_s} s: {states!r}\n{self.logs()}")

    def sbatch(self, options: list[str], script: Path, args: list[str], cwd: str,
               env: dict[str, str] | None = None) -> str:
        """`sbatch OPTIONS SCRIPT ARGS` from `cwd` on the login host; returns the job id."""
        done = self.run(["sbatch", "--parsable", *options, str(script), *args], env=env, cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        done = self.run(["scontrol", "show", "job", job_id], check=False)
        match = re.search(r"JobState=(\S+)", done.stdout)
        return match.group(1) if match else "UNKNOWN"

    def wait_for_job(self, job_id: str, timeout_s: float) -> str:
        """Waits until the job has ended; returns its final state (COMPLETED, FAILED, CANCELLED, ...)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in TERMINAL_STATES:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {self.job_state(job_id)} after {timeout_s} s\n{self.logs()}")

    def queue(self) -> list[str]:
        """Jobs still pending or running (`squeue`)."""
        return self.run(["squeue", "--noheader", "--format=%i %T"]).stdout.split("\n")[:-1]

    def log(self, name: str) -> str:
        for path in (self.root / f"{name}.log", self.root / "munge" / f"{name}.log", self.root / f"{name}.out"):
            if path.exists():
                return path.read_text()[-3000:]
        return ""

    def logs(self) -> str:
        names = ["slurmctld", *(f"slurmd-{n.name}" for n in self.cluster.nodes)]
        return "\n".join(f"--- {name}\n{self.log(name)}" for name in names)

    def stop(self) -> None:
        """SIGTERM to the daemons (slurmd ends its steps' bookkeeping, slurmctld saves its state)."""
        for _, process in reversed(self.daemons):
            if process.poll() is None:
                process.terminate()
        for _, process in reversed(self.daemons):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
