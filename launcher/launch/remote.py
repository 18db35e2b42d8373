"""The launcher's own dealings with other hosts: which host names are this machine, and bringing rank 0's
run directory back to the launcher's host when rank 0 ran elsewhere.

Why fetch after the run instead of having rank 0 stream its files to the launcher: the launcher already
reaches every host over ssh with the run's settings (horovodrun and mpirun need exactly that), while a
stream needs a connection from rank 0 back to the launcher, which login nodes and firewalls often refuse,
and a second code path in every rank. One `tar` over ssh at the end also brings everything rank 0 wrote
(recipe, metrics, summary, TensorBoard events, LMS plans, checkpoints, the model), not only what a
stream was written for. On a shared filesystem there is nothing to fetch and nothing is copied.
"""
from __future__ import annotations

import ipaddress
import shlex
import socket
import subprocess
import tempfile
from pathlib import Path

from launcher.launch.command import LOCAL_NAMES

DEFAULT_CONNECT_TIMEOUT_S = 30  # for the fetch when distributed.start_timeout is not set


class FetchError(RuntimeError):
    """The run directory could not be copied back; the message says from where and why."""


def local_addresses() -> set[str]:
    """Every IP address of this machine's network interfaces (this network namespace's, precisely)."""
    import psutil

    addresses = {"127.0.0.1", "::1"}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                addresses.add(entry.address.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    return addresses


def resolve(host: str) -> set[str]:
    """The addresses a host name resolves to here; empty when it does not resolve."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (socket.gaierror, UnicodeError):
        return set()


def is_this_host(host: str, addresses: set[str] | None = None) -> bool:
    """True when `host` names this machine, as horovodrun decides it: one of its addresses is ours
    (or it is a loopback address)."""
    if host in LOCAL_NAMES:
        return True
    addresses = local_addresses() if addresses is None else addresses
    for address in resolve(host):
        if address in addresses or ipaddress.ip_address(address).is_loopback:
            return True
    return False


def local_host_names(hosts: list[str]) -> frozenset[str]:
    """Which of the given host names are this machine, plus the names that always are."""
    addresses = local_addresses()
    return frozenset(LOCAL_NAMES | {host for host in hosts if is_this_host(host, addresses)})


def ssh_argv(host: str, ssh_options: list[str], connect_timeout_s: int, remote_argv: list[str]) -> list[str]:
    """ssh to `host` with the run's options. BatchMode: fail at once instead of asking for a password
    or a host key nobody is there to type."""
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout_s}", *ssh_options, host,
            "--", shlex.join(remote_argv)]


def fetch_run_dir(host: str, remote_dir: str, local_dir: Path, ssh_options: list[str],
                  connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S) -> int:
    """Copies the contents of `remote_dir` on `host` into `local_dir` (tar over ssh) and returns the
    number of files received. Raises FetchError naming the host and ssh's or tar's message."""
    local_dir.mkdir(parents=True, exist_ok=True)
    remote_tar = ["tar", "-C", remote_dir, "-cf", "-", "."]
    with tempfile.TemporaryFile() as sender_errors:  # a file, not a pipe: nobody reads it while tar runs
        sender = subprocess.Popen(ssh_argv(host, ssh_options, connect_timeout_s, remote_tar),
                                  stdout=subprocess.PIPE, stderr=sender_errors)
        receiver = subprocess.run(["tar", "-C", str(local_dir), "-xf", "-"], stdin=sender.stdout,
                                  capture_output=True, text=True)
        sender.stdout.close()
        sender.wait()
        sender_errors.seek(0)
        sent_error = sender_errors.read().decode(errors="replace").strip()
    if sender.returncode != 0:
        raise FetchError(f"could not copy {host}:{remote_dir} here: {sent_error or f'ssh exit status {sender.returncode}'}")
    if receiver.returncode != 0:
        raise FetchError(f"could not unpack {host}:{remote_dir} into {local_dir}: {receiver.stderr.strip()}")
    return sum(1 for path in local_dir.rglob("*") if path.is_file())
