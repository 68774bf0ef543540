"""One member of a pool (a generator or scorer replica, a rollout worker): its own proc mesh
and actor, and its processes on its host. Whether it still runs (by pid, no round trip), the
leftovers a killed one leaves (vLLM's orphaned engine processes, shared-memory names in
/dev/shm), starting or stopping several at once, and how a member's death is reported
(`MeshFailureLog`, in place of Monarch's interrupt).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field

from meshrl.errors import first_line
from meshrl.futures import settled, settled_value
from meshrl.host import running_process

log = logging.getLogger("meshrl")


def _shared_memory_segments(pid: int) -> set[str]:
    """POSIX shared-memory files Python made (`psm_*`) that process `pid` has mapped."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if "/dev/shm/psm_" in line}
    except (OSError, IndexError):
        return set()


@dataclass
class Member:
    """One replica or worker: its own proc mesh and actor, and its processes on its host."""

    index: int
    procs: object
    actor: object
    host: str = ""
    pids: list[tuple[int, float]] = field(default_factory=list)
    """(pid, start time): the member's procs first, then (replicas) its vLLM engine processes."""
    own: int = 1
    """How many of `pids` are the member's own procs (a sharded PRM's ranks; else 1)."""
    last_stats: dict = field(default_factory=dict)
    last_stats_at: float | None = None
    ident: int = -1
    """Workers: the id the episode queue knows this one by; scorer replicas: their incarnation,
    which the workers' clients tell replicas apart by."""
    weight_sync: object = None
    """Generator replicas: the sidecar agent of their weight-sync subscriber (None: a teacher)."""

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """Whether the member's own procs all still run (on this host; no round trip)."""
        return bool(self.pids) and all(running_process(*p) is not None for p in self.pids[: self.own])

    async def gone(self, endpoint: str) -> bool:
        """Whether the member is gone: by its pid on this host, else by asking `endpoint`
        (no answer in 30 s: gone)."""
        if self.on_this_host():
            return not self.alive()
        return await settled(getattr(self.actor, endpoint).call_one(), 30) is not None

    async def gone_or_wedged(self) -> tuple[bool, bool]:
        """(gone, wedged), from one question: one on this host is gone by its pid, one elsewhere
        when its `stats` do not come in 30 s; wedged, when they say so."""
        if self.on_this_host() and not self.alive():
            return True, False
        stats = await settled_value(self.actor.stats.call_one(), 30)
        if isinstance(stats, BaseException):
            return not self.on_this_host(), False
        return False, isinstance(stats, dict) and bool(stats.get("wedged"))

    def kill_leftovers(self) -> int:
        """SIGKILL what is still alive of the member's processes on this host, and unlink the
        shared-memory names they held (vLLM's queues are unlinked by their maker, which was
        killed; memory is freed once the last mapping is gone). Returns how many."""
        import psutil

        if not self.on_this_host():
            return 0  # on another host: its host mesh's shutdown ends them
        killed, segments = 0, set()
        for pid, started in self.pids:
            proc = running_process(pid, started)
            if proc is None:
                continue
            try:
                segments |= _shared_memory_segments(proc.pid)
                proc.kill()
                killed += 1
            except psutil.Error:
                pass
        for path in segments:
            try:
                os.unlink(path)
            except OSError:
                pass
        return killed

    async def stop(self, timeout_s: float = 60.0) -> None:
        await settled(self.procs.stop(), timeout_s)  # a failure: already gone
        self.kill_leftovers()


async def stop_members(members: list[Member], stop_s: float = 60.0, engines: bool = True) -> None:
    """Each replica's engine, then its proc, all at once: a teardown waits for the slowest
    (a dead host's, up to its bounds), not for their sum. `stop_s` bounds each call: shorter
    after a host was lost, whose procs answer nothing and whose stops only wait out
    Monarch's bound (those on this host are then killed, the launcher's host shutdown ends
    the rest). A replica whose proc is known dead is not asked."""
    if engines:  # False: stopped already (`stop_engines`)
        await stop_engines(members, stop_s)
    await asyncio.gather(*(m.stop(stop_s) for m in members))


async def stop_engines(members: list[Member], stop_s: float = 60.0) -> None:
    """Each live replica's engine at once (`stop_members`' first half); asked again, a stopped
    engine answers at once."""
    live = [m for m in members if not m.on_this_host() or m.alive()]
    await asyncio.gather(*(settled(m.actor.shutdown_engine.call_one(), min(30.0, stop_s)) for m in live))


async def all_ended(*starts) -> None:
    """Await `starts` at once; once every one has ended, raise the first failure in the
    order given (the caller's stop then stops what each got to)."""
    failed = [e for e in await asyncio.gather(*starts, return_exceptions=True) if isinstance(e, BaseException)]
    if failed:
        raise failed[0]


async def in_order(*starts) -> None:
    """Await `starts` one after another, the first failure raised at once (the caller's stop
    then stops what each got to). For engines that share a GPU (trained models colocated on
    one): vLLM sizes an engine's KV cache from the memory it finds free as it profiles, so
    two engines profiling one GPU at once would each count the other's passing use."""
    pending = list(starts)
    try:
        while pending:
            await pending.pop(0)
    finally:
        for start in pending:  # never started: closed, not left unawaited
            start.close()


async def start_all(spawns) -> list[Member]:
    """Members started at once (a pool's replicas import and load concurrently, not one after
    another). If any fails, the others are stopped and the first failure is raised."""
    started = await asyncio.gather(*spawns, return_exceptions=True)
    failed = [m for m in started if isinstance(m, BaseException)]
    if failed:
        await asyncio.gather(*(m.stop() for m in started if isinstance(m, Member)))
        raise failed[0]
    return started


class MeshFailureLog:
    """Monarch's default answer to a proc that dies is to interrupt the client. A run
    replaces dead generators and workers and reports a dead trainer itself, so from
    `install` on, failures are only logged (a warning, on the console) and surface as errors
    of the calls that touch the dead procs. Once the run stops (`quiet`), the procs it stops
    report as failing too, one stopped while its actor still starts among them: those go to
    the log file alone. `restore` puts Monarch's hook back."""

    def __init__(self):
        self.previous, self.installed, self.stopping = None, False, False

    def install(self) -> None:
        import monarch.actor

        self.previous, self.installed = monarch.actor.unhandled_fault_hook, True
        monarch.actor.unhandled_fault_hook = self.log

    def log(self, failure) -> None:
        (log.info if self.stopping else log.warning)("mesh failure: %s", first_line(str(failure)))

    def quiet(self) -> None:
        self.stopping = True

    def restore(self) -> None:
        import monarch.actor

        if self.installed and self.previous is not None and monarch.actor.unhandled_fault_hook == self.log:  # not another run's
            monarch.actor.unhandled_fault_hook = self.previous
        self.installed = False
