"""`launcher.kind=workers`: hosts that run `meshrl worker --address IP:PORT`, attached over TCP.

`run_worker` is the host side; `attach_workers` the controller's, which listens on
`launcher.address` only. Each worker's procs bind what they serve to their host's
address (`meshrl.host.host_address()`). `check_address` (at preflight) refuses an address
that is not this machine's.
"""

from __future__ import annotations

import os
import socket

from meshrl.config import Config, ConfigError, ip_and_port
from meshrl.host import HOST_ADDRESS_ENV, interface_of
from meshrl.launch.devices import NCCL_IFNAME_ENV
from meshrl.launch.hosts import job_meshes
from meshrl.launch.signals import exit_on_sigterm


def check_address(c: Config) -> None:
    """launcher.address is an address of this machine: the controller listens there."""
    local = _local_addresses()
    if c.launcher.address not in local:
        raise ConfigError("launcher.address", f"{c.launcher.address!r} is not an address of this machine: give one of {', '.join(sorted(local))}")


def _local_addresses() -> set[str]:
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs if a.family.name in ("AF_INET", "AF_INET6")}


def unreachable(workers: list[str], timeout_s: float = 3.0) -> list[str]:
    """The `IP:PORT`s of `workers` where nothing accepts a TCP connection (no `meshrl worker` there)."""
    gone = []
    for w in workers:
        try:
            socket.create_connection(ip_and_port(w), timeout=timeout_s).close()
        except OSError:
            gone.append(w)
    return gone


def attach_workers(config: Config) -> dict:
    """Host meshes over the running `meshrl worker`s, in plan order (trainer hosts first, spares last).
    The controller's own Monarch channel listens on `launcher.address` only."""
    from monarch.actor import attach_to_workers, enable_transport

    la = config.launcher
    enable_transport(f"tcp://{la.address}:0")
    meshes, first = {}, 0
    for name, count in job_meshes(config).items():
        workers = [f"tcp://{w}" for w in la.workers[first : first + count]]
        meshes[name] = attach_to_workers(name=name, ca="trust_all_connections", workers=workers)
        first += count
    return meshes


def run_worker(address: str) -> None:
    """Serve this host to a controller (`launcher.kind=workers`) until it shuts the host down.

    Monarch's host agent listens on `address` (IP:PORT of this host, never a wildcard); the
    procs it spawns use Unix sockets and send to other hosts from this address; what they
    serve themselves (gloo, torch.distributed stores) they bind to it too (`host_address()`).
    """
    ip, port = ip_and_port(address)
    url = f"[{ip}]" if ":" in ip else ip
    os.environ[HOST_ADDRESS_ENV] = ip
    # what the procs of this host serve on Monarch's default transport, and gloo's default device
    os.environ["HYPERACTOR_MESH_DEFAULT_TRANSPORT"] = f"tcp://{url}:0"
    os.environ["GLOO_SOCKET_IFNAME"] = interface_of(ip, first=True)  # (gloo binds its first address: the named one)
    os.environ.setdefault(NCCL_IFNAME_ENV, interface_of(ip))  # NCCL's bootstrap, on GPU hosts: the same interface unless the user named one
    from monarch.actor import run_worker_loop_forever

    exit_on_sigterm()
    run_worker_loop_forever(address=f"tcp://{url}:{port}", ca="trust_all_connections")
