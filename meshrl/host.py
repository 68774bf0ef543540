"""This proc's host on the network: the address it serves on, and where gloo groups listen.

A host started by `meshrl worker --address IP:PORT` records IP in the environment
(`HOST_ADDRESS_ENV`), and every proc it spawns binds what it serves (gloo groups,
torch.distributed stores) to that address. A host no worker started (local runs,
ProcessJob, Slurm) has no such address: groups whose members all live on it listen on
loopback. Plain standard library and psutil: trainer, generator and weight-sync cores
read it without importing Monarch.
"""

from __future__ import annotations

import contextlib
import os
import socket

from meshrl.compat import gloo_default_device_on_loopback

HOST_ADDRESS_ENV = "MESHRL_HOST_ADDRESS"
"""Set by `meshrl worker` to the IP it serves on; read by every proc it spawns."""


def host_address() -> str | None:
    """The address this proc's host serves on (set by `meshrl worker`); None on a host
    that `meshrl worker` did not start (local runs, ProcessJob, Slurm)."""
    return os.environ.get(HOST_ADDRESS_ENV) or None


def gloo_on_this_host():
    """A context for gloo groups whose members all run on this host: they listen on
    loopback, or on a host `meshrl worker` serves, on its named address (the worker gave
    gloo that interface already)."""
    return gloo_default_device_on_loopback() if host_address() is None else contextlib.nullcontext()


def interface_of(ip: str, first: bool = False) -> str:
    """The network interface that holds `ip`; ValueError if no interface of this host does.
    `first`: `ip` must also be its interface's first address of its family, the one gloo (and
    NCCL) bind when given the interface alone (GLOO_SOCKET_IFNAME): another would be exposed."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            if first:
                family = socket.AF_INET6 if ":" in ip else socket.AF_INET
                bound = next(a.address.split("%")[0] for a in addrs if a.family == family)
                if bound != ip:
                    raise ValueError(
                        f"{ip} is not the first address of interface {name}: gloo binds that one ({bound}), so give {bound}, "
                        f"or put {ip} on an interface of its own"
                    )
            return name
    raise ValueError(f"{ip} is not an address of this host: give one of its own")


def started(proc=None) -> float:
    """When `proc` (a psutil.Process; None: this one) started, in seconds since this host
    booted. With its pid it tells a proc from a later one given the same pid; unlike psutil's
    `create_time` (since the epoch, from the boot time the clock says now) it does not move
    when the system clock is stepped, so a live proc never reads as gone."""
    import psutil

    proc = psutil.Process() if proc is None else proc
    return proc.create_time() - psutil.boot_time()


def running_process(pid: int, start: float):
    """The psutil handle of `pid` if it still runs and is the process that started at
    `start` (`started`: not a later one given the same pid); None otherwise."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if abs(started(proc) - start) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def proc_alive(pid: int, start: float | None) -> bool:
    if start is None:
        return True  # not on this host: its host mesh's stop ends it
    return running_process(pid, start) is not None


def procs_dead(pids: list[tuple[int, float | None]]) -> bool:
    """Whether a proc of `pids` ((pid, start time) each; None: off this host) on this host is gone."""
    return any(not proc_alive(pid, start) for pid, start in pids)
