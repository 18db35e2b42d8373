"""A small cluster on this one machine, for multi-host tests: every host is a network namespace with its
own address, hostname and sshd, all joined by a bridge, as nodes on one switch.

- `switch`: a namespace that holds only the bridge; each host's `eth0` is one end of a veth pair whose
  other end is a bridge port there. Nothing is added to this machine's own network namespace.
- Every host has its own hostname, and an /etc/hosts that names every host of the cluster, as DNS does
  on a real one (Horovod's Gloo aborts when a rank's own hostname does not resolve).
- Rank hosts (`node1`, `node2`): an sshd on port SSH_PORT that accepts only the key made for the test
  (so --ssh-port and --ssh-identity-file must work for a launch to work), their own CPU set (so
  per-host thread counts differ), and a private tmpfs over `node_local/` (a node-local disk: what
  rank 0 writes there, no other host sees).
- `login`: runs no sshd and no rank; a launcher started there is a user on a login node.

The namespaces share this machine's filesystem otherwise, so the repository and .venv sit at the same
path on every host, as the README asks of a real cluster. Host keys are made for the test and listed in
the test's own known_hosts; every ssh goes through an `ssh` wrapper first on PATH that points at the
test's ssh_config, so nothing in ~/.ssh is read or written.

`Cluster.close()` kills every process in the namespaces (`ip netns pids`: only what this cluster started
runs there), reaps the sshds and deletes the namespaces; it runs even when building failed half-way.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SSH_PORT = 2222  # not 22: the launches must pass --ssh-port for anything to work
# Unusual private /24s; the first one that nothing on this machine uses is taken.
CANDIDATE_SUBNETS = ("10.251.37.0/24", "10.243.171.0/24", "172.31.237.0/24")
SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without it (Debian's service creates it)


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the namespaces (no root, no `ip netns`, no sshd); the reason says which."""


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    cpus: list[int]
    sshd: subprocess.Popen | None = None

    @property
    def cpu_list(self) -> str:
        return ",".join(map(str, self.cpus))


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def unused_subnet() -> ipaddress.IPv4Network:
    """The first candidate subnet that no address or route of this machine's namespace overlaps."""
    addresses = _run("ip", "-o", "-4", "addr", "show").stdout.split()
    used = [ipaddress.ip_interface(word).network for word in addresses if "/" in word and word[0].isdigit()]
    for route in _run("ip", "-4", "route", "show").stdout.splitlines():
        destination = route.split()[0] if route.strip() else "default"
        if destination != "default":
            used.append(ipaddress.ip_network(destination, strict=False))
    for candidate in map(ipaddress.ip_network, CANDIDATE_SUBNETS):
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise ClusterUnavailable(f"every candidate subnet ({', '.join(CANDIDATE_SUBNETS)}) is in use here")


def check_can_build() -> None:
    """Raises ClusterUnavailable with the reason when this machine cannot host the namespaces."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces need root (CAP_NET_ADMIN)")
    for tool in ("ip", "unshare", "nsenter", "taskset", "ssh", "ssh-keygen", "tar"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"'{tool}' is not installed")
    if not os.access(SSHD, os.X_OK):
        raise ClusterUnavailable(f"{SSHD} is missing: install openssh-server (scripts/install.sh does)")
    probe = f"lmsmh{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        raise ClusterUnavailable(f"cannot make a network namespace: {made.stderr.strip()}")
    _run("ip", "netns", "del", probe, check=False)
    with tempfile.TemporaryDirectory() as mountpoint:  # a host's own hostname and disk need these
        own = _run("unshare", "--mount", "--uts", "sh", "-c",
                   f"hostname {probe} && mount -t tmpfs {probe} {mountpoint}", check=False)
    if own.returncode != 0:
        raise ClusterUnavailable(f"cannot give a host its own hostname and mounts (unshare): {own.stderr.strip()}")


class Cluster:
    """Builds the namespaces, links and sshds in `root` (a fresh temporary directory)."""

    def __init__(self, root: Path, node_cpus: dict[str, list[int]]):
        self.root = root
        self.prefix = f"lmsmh{os.getpid()}"
        self.subnet = unused_subnet()
        self.switch = f"{self.prefix}-switch"
        self.node_local = root / "node_local"
        self.bin = root / "bin"
        self.key = root / "client_key"
        self.probe_dirs = 0
        addresses = self.subnet.hosts()
        next(addresses)  # .1 left free, as a gateway would have it
        self.hosts: dict[str, Host] = {}
        for name, cpus in [("login", sorted(os.sched_getaffinity(0))), *node_cpus.items()]:
            self.hosts[name] = Host(name, f"{self.prefix}-{name}", str(next(addresses)), cpus)
        self._made_privsep_dir = False
        self._namespaces: list[str] = []

    @property
    def nodes(self) -> list[Host]:
        return [host for name, host in self.hosts.items() if name != "login"]

    def build(self) -> "Cluster":
        self.node_local.mkdir()
        (self.root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{host.address} {host.name}\n" for host in self.hosts.values()))
        self._make_keys_and_ssh_config()
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts.values()):
            self._add_namespace(host.namespace)
            port = f"port{index}"
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                 "netns", host.namespace)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
            _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            self._made_privsep_dir = True
        for host in self.nodes:
            self._start_sshd(host)
        for host in self.nodes:
            self._wait_for_sshd(host)
        return self

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)

    def _make_keys_and_ssh_config(self) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lms-launch test client", "-f", str(self.key))
        (self.root / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        known = []
        for host in self.hosts.values():
            host_key = self.root / f"host_key_{host.name}"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f", str(host_key))
            key_type, key_data = Path(f"{host_key}.pub").read_text().split()[:2]
            known.append(f"[{host.name}]:{SSH_PORT},[{host.address}]:{SSH_PORT} {key_type} {key_data}\n")
        (self.root / "known_hosts").write_text("".join(known))
        (self.root / "ssh_config").write_text(
            "Host *\n"
            f"  UserKnownHostsFile {self.root / 'known_hosts'}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n"
            "  IdentitiesOnly yes\n"
            "  LogLevel ERROR\n")
        self.bin.mkdir()
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {self.root / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)

    def _start_sshd(self, host: Host) -> None:
        config = self.root / f"sshd_config_{host.name}"
        config.write_text(
            f"Port {SSH_PORT}\nListenAddress {host.address}\nHostKey {self.root / f'host_key_{host.name}'}\n"
            f"PidFile {self.root / f'sshd_{host.name}.pid'}\nAuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPrintMotd no\n")
        # unshare: its own hostname and a private mount table, where node_local/ is this host's own disk.
        script = (f"{self._become(host)} && mount -t tmpfs -o size=512m lmsmh-{host.name} {self.node_local} && "
                  f"exec taskset -c {host.cpu_list} {SSHD} -D -e -f {config}")
        log = open(self.root / f"sshd_{host.name}.log", "w")
        host.sshd = subprocess.Popen(["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--uts",
                                      "sh", "-c", script], stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _become(self, host: Host) -> str:
        """Shell commands that give a fresh UTS and mount namespace this host's name and /etc/hosts."""
        return f"hostname {host.name} && mount --bind {self.root / 'hosts'} /etc/hosts"

    def _wait_for_sshd(self, host: Host, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if host.sshd.poll() is not None:
                break
            check = self.ssh(host, ["true"], check=False)
            if check.returncode == 0:
                return
            time.sleep(0.2)
        log = (self.root / f"sshd_{host.name}.log").read_text()
        raise RuntimeError(f"sshd on {host.name} ({host.address}) did not come up: {log.strip()}")

    def ssh(self, host: Host, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """Runs a command on `host`, from the login node, as a user would."""
        return _run(*self.on("login", [str(self.bin / "ssh"), "-p", str(SSH_PORT), "-i", str(self.key), host.name,
                                        *argv], cwd="/"), check=check)

    def launcher_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a user's shell on any host: the test's ssh first on PATH, and a HOME of
        its own (horovodrun caches host checks in ~/.horovod)."""
        home = self.root / "home"
        home.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update({"PATH": f"{self.bin}:{env.get('PATH', '')}", "HOME": str(home)})
        env.update(extra or {})
        return env

    def on(self, host_name: str, argv: list[str], cwd: str) -> list[str]:
        """`argv` as run on that host, in `cwd`: in its network, hostname and mount namespaces (a rank
        host's are its sshd's, joined with nsenter; the login node gets fresh ones), on its CPUs."""
        host = self.hosts[host_name]
        if host.sshd is None:
            return ["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--uts", "sh", "-c",
                    f'{self._become(host)} && cd {cwd} && exec taskset -c {host.cpu_list} "$@"', "sh", *argv]
        enter = ["nsenter", "-t", str(host.sshd.pid), "-n", "-m", "-u", f"--wd={cwd}", "--"]
        return [*enter, "taskset", "-c", host.cpu_list, *argv]

    def env_probe(self) -> tuple[Path, Path]:
        """A directory to put first on PYTHONPATH and the directory where it records, when each rank's
        worker exits, the host it ran on and its environment as the rank saw it (after the worker set
        its own defaults). Nothing of the worker is replaced: site imports sitecustomize at start-up."""
        self.probe_dirs += 1
        probe = self.root / f"probe{self.probe_dirs}"
        out = probe / "records"
        out.mkdir(parents=True)
        (probe / "sitecustomize.py").write_text(
            "import atexit, json, os, socket, sys\n"
            "def _record():\n"
            "    if not sys.argv or not sys.argv[0].endswith(os.path.join('launcher', 'worker.py')):\n"
            "        return\n"
            "    rank = os.environ.get('HOROVOD_RANK') or os.environ.get('OMPI_COMM_WORLD_RANK') or '0'\n"
            f"    with open(os.path.join({str(out)!r}, f'rank{{rank}}.json'), 'w') as f:\n"
            "        json.dump({'host': socket.gethostname(), 'env': dict(os.environ)}, f)\n"
            "atexit.register(_record)\n")
        return probe, out

    def close(self) -> None:
        """Stops everything the cluster started and removes the namespaces; safe after a failed build."""
        for namespace in reversed(self._namespaces):
            self._kill_all_in(namespace)
        for host in self.hosts.values():
            if host.sshd is not None:
                try:
                    host.sshd.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    host.sshd.kill()
                    host.sshd.wait()
        for namespace in reversed(self._namespaces):
            _run("ip", "netns", "del", namespace, check=False)
        self._namespaces.clear()
        others = [line for line in _run("ip", "netns", "list").stdout.splitlines() if line.startswith("lmsmh")]
        if self._made_privsep_dir and not others:
            try:
                PRIVSEP_DIR.rmdir()
            except OSError:
                pass

    @staticmethod
    def _kill_all_in(namespace: str) -> None:
        """SIGTERM to every process in the namespace, SIGKILL to what is left after 5 s."""
        for sig, grace_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            pids = [int(pid) for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and _run("ip", "netns", "pids", namespace, check=False).stdout.split():
                time.sleep(0.1)

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster that still exist and processes still in them (for the test that
        everything is gone)."""
        names = set(_run("ip", "netns", "list").stdout.split())
        return [f"{ns}: pids {_run('ip', 'netns', 'pids', ns, check=False).stdout.split()}"
                for ns in [self.switch, *(h.namespace for h in self.hosts.values())] if ns in names]
