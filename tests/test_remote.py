"""Which host names are this machine (the launcher decides from it whether rank 0's run directory must
be fetched), checked against this machine's real interfaces."""
from __future__ import annotations

import ipaddress
import socket

from launcher.launch.remote import is_this_host, local_addresses, local_host_names, ssh_argv


def test_loopback_names_and_this_machines_own_addresses_are_this_host():
    assert is_this_host("localhost") and is_this_host("127.0.0.1")
    assert is_this_host(socket.gethostname())
    ours = [a for a in local_addresses() if not ipaddress.ip_address(a).is_loopback]
    for address in ours:
        assert is_this_host(address), address


def test_other_addresses_and_unknown_names_are_not():
    ours = local_addresses()
    stranger = next(str(a) for a in ipaddress.ip_network("198.51.100.0/24").hosts() if str(a) not in ours)
    assert not is_this_host(stranger)
    assert not is_this_host("no-such-host.invalid")  # .invalid never resolves (RFC 2606)


def test_local_host_names_keeps_only_the_local_ones():
    names = local_host_names(["localhost", "no-such-host.invalid", socket.gethostname()])
    assert socket.gethostname() in names and "no-such-host.invalid" not in names


def test_the_fetch_ssh_never_prompts_and_quotes_the_remote_command():
    argv = ssh_argv("node1", ["-p", "2222"], 15, ["tar", "-C", "/runs/my run", "-cf", "-", "."])
    assert argv == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-p", "2222", "node1", "--",
                    "tar -C '/runs/my run' -cf - ."]
