"""What ranks started by srun need from the launcher while they run: Horovod's Gloo rendezvous, and
the host file that tells srun where each task goes.

horovodrun serves a rendezvous (an HTTP key-value store that Gloo ranks exchange their addresses
through) for the ranks it starts; srun has none, so for `--backend srun` the launcher serves Horovod's
own (`horovod.runner.http.http_server.RendezvousServer`, initialised with the same slots as
horovodrun's), on an address every node can reach, for as long as the ranks run.
"""
from __future__ import annotations

import contextlib
import ipaddress
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from launcher import env as ev
from launcher.config import DistributedConfig
from launcher.launch.command import HostsError, LaunchSpec


def rendezvous_address(network_interface: str | None) -> str:
    """An IPv4 address of this host that the other nodes reach: the first interface of
    distributed.network_interface, else what this host's name resolves to (not a loopback address,
    which Debian's /etc/hosts gives a host's own name)."""
    import psutil

    if network_interface:
        name = network_interface.split(",")[0]
        addresses = psutil.net_if_addrs().get(name)
        if addresses is None:
            raise HostsError(f"distributed.network_interface: this host has no interface {name!r} (it has "
                             f"{', '.join(sorted(psutil.net_if_addrs()))})")
        for entry in addresses:
            if entry.family == socket.AF_INET:
                return entry.address
        raise HostsError(f"distributed.network_interface: {name} has no IPv4 address for the rendezvous")
    hostname = socket.gethostname()
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(hostname, None, socket.AF_INET)}
    except socket.gaierror:
        resolved = set()
    usable = sorted(address for address in resolved if not ipaddress.ip_address(address).is_loopback)
    if not usable:
        raise HostsError(f"the ranks meet at a rendezvous on this host, but its name {hostname!r} resolves to "
                         f"{', '.join(sorted(resolved)) or 'nothing'}, which other nodes cannot reach: give "
                         f"--network-interface IF (the interface the nodes share, e.g. eth0 or ib0)")
    return usable[0]


@contextlib.contextmanager
def served(spec: LaunchSpec, dist: DistributedConfig) -> Iterator[dict[str, str]]:
    """The launcher's environment additions for the launch, with what the launch needs served while
    the block runs: for --backend srun, the rendezvous and srun's host file; nothing otherwise."""
    if dist.backend != "srun" or spec.direct:
        yield dict(spec.env)
        return
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    from launcher.launch.slurm import srun_hostfile

    address = rendezvous_address(dist.network_interface)
    server = RendezvousServer()
    port = server.start()
    server.init([SlotInfo(hostname=slot.host, rank=slot.rank, local_rank=slot.local_rank,
                          cross_rank=slot.cross_rank, size=len(spec.slots), local_size=slot.local_size,
                          cross_size=slot.cross_size) for slot in spec.slots])
    try:
        with tempfile.TemporaryDirectory(prefix="lms-launch-srun-") as folder:
            hostfile = Path(folder) / "hosts"
            hostfile.write_text(srun_hostfile(spec.slots))
            yield {**spec.env, ev.HOROVOD_GLOO_RENDEZVOUS_ADDR: address, ev.HOROVOD_GLOO_RENDEZVOUS_PORT: str(port),
                   ev.SLURM_HOSTFILE: str(hostfile)}
    finally:
        server.stop()
