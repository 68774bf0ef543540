"""`rdma` transport: subscribers read the publisher's staging slots with Monarch RDMABuffers.

Each staging slot is registered once, cut into chunks of at most `CHUNK_BYTES` (many reads
in flight beat one big read on the TCP fallback: STACK.md). A reader leases the latest
slot through a small endpoint call (answered as soon as a publish makes a new version
available), reads every chunk in one batched RDMA action, and releases the lease. The
handles and the layout travel only the first time a reader meets a slot or a layout.

A read that ends well inside the lease (see `SAFE_LEASE_FRACTION`) cannot have seen the
slot change, so its release is sent in the background; only a slow read waits for the
release's answer, which says whether the bytes stayed untouched.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import torch
from monarch.rdma import RDMAAction, RDMABuffer

from meshrl.weightsync.buffers import ReceiveBuffers
from meshrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from meshrl.weightsync.layout import Layout
from meshrl.weightsync.staging import Lease, Slot, StagingPool

log = logging.getLogger(__name__)
CHUNK_BYTES = 16 << 20
SAFE_LEASE_FRACTION = 0.5
"""A lease starts at least `waited_s` after the reader sent `acquire` and lives `lease_s`. A
read that ends less than this fraction of `lease_s` after that point (the reader's own
monotonic clock; the margin covers clock-rate differences between hosts) ran entirely
under a live lease, and a leased slot is never written: the copy is exactly one version."""


def chunk_ranges(layout: Layout, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """The buckets of `layout`, each cut into pieces of at most `chunk_bytes`."""
    out = []
    for a, b in layout.buckets:
        out += [(s, min(s + chunk_bytes, b)) for s in range(a, b, chunk_bytes)]
    return out


def slot_buffers(slot: Slot) -> list[RDMABuffer]:
    """RDMA handles of a slot's chunks, registered on first use (needs an actor context)."""
    bufs = slot.transport_state.get("rdma")
    if bufs is None:
        bufs = [RDMABuffer(slot.flat[a:b]) for a, b in chunk_ranges(slot.layout)]
        slot.transport_state["rdma"] = bufs
    return bufs


async def serve_acquire(pool: StagingPool, min_version: int, have_layout: str | None, have_slots: list[int], wait_s: float):
    """Publisher side of `acquire`: wait (bounded) for a version >= min_version, lease it."""
    started = time.monotonic()
    lease = await wait_for_lease(pool, min_version, wait_s)
    if lease is None:
        return None
    slot = lease.slot
    same_layout = have_layout == slot.layout.layout_id
    return {
        "lease_id": lease.lease_id,
        "lease_s": pool.lease_timeout_s,
        "waited_s": lease.granted - started,  # the lease started at least this long after `acquire` was sent
        "version": lease.version,
        "layout_id": slot.layout.layout_id,
        "slot": slot.index,
        "layout": None if same_layout else slot.layout,
        "buffers": None if same_layout and slot.index in have_slots else slot_buffers(slot),
    }


async def wait_for_lease(pool: StagingPool, min_version: int, wait_s: float) -> Lease | None:
    """Lease a version >= min_version, waking on the publish that makes one available (the
    publishing thread pokes this event loop), or None after wait_s."""
    loop = asyncio.get_running_loop()
    published = asyncio.Event()

    def poke() -> None:
        try:
            loop.call_soon_threadsafe(published.set)
        except RuntimeError:
            pass  # the loop closed (proc shutting down): nobody is waiting any more

    unwatch = pool.watch(poke)
    try:
        deadline = loop.time() + wait_s
        while True:
            published.clear()  # before acquire: a publish after this check sets it again
            lease = pool.acquire(min_version)
            remaining = deadline - loop.time()
            if lease is not None or remaining <= 0:
                return lease
            try:
                await asyncio.wait_for(published.wait(), remaining)
            except asyncio.TimeoutError:
                pass  # one last look at the pool, then None
    finally:
        unwatch()


class RdmaReader:
    """Subscriber side: the cached layout and slot handles of one publisher."""

    def __init__(self, agent, buffers: ReceiveBuffers):
        self.agent, self.buffers = agent, buffers
        self.layout: Layout | None = None
        self.handles: dict[int, list[RDMABuffer]] = {}
        self._releasing: set[asyncio.Task] = set()  # background releases (kept from GC)

    async def fetch(self, min_version: int, wait_s: float, timeout_s: float) -> tuple[int, torch.Tensor] | None:
        """Read the newest version >= min_version (waiting up to wait_s for one to appear) into
        a free buffer; None if none appeared. The transfer itself is bounded by timeout_s."""
        deadline = time.monotonic() + wait_s
        while True:
            wait = max(deadline - time.monotonic(), 0.0)
            sent = time.monotonic()  # before the acquire leaves: the lease starts later
            reply = await _bounded(
                self.agent.acquire.call_one(min_version, self.layout.layout_id if self.layout else None, list(self.handles), wait),
                wait + timeout_s,
                "lease a staged version",
            )
            if reply is None:
                return None
            if reply["layout"] is not None:
                self.layout, self.handles = reply["layout"], {}
                self.buffers.set_layout(self.layout)
            if reply["buffers"] is not None:
                self.handles[reply["slot"]] = reply["buffers"]
            flat = self.buffers.take()
            intact = False
            try:
                read_deadline = time.monotonic() + timeout_s
                await self._read(reply, flat, timeout_s)
                intact = await self._end_lease(reply, sent, read_deadline)
            finally:
                if not intact:
                    self.buffers.give_back(flat)
            if intact:
                return reply["version"], flat
            # The lease expired under us (slower than the lease timeout): the copy may be torn; retry.

    async def _read(self, reply: dict, flat: torch.Tensor, timeout_s: float) -> None:
        action = RDMAAction()
        for (a, b), handle in zip(chunk_ranges(self.layout), self.handles[reply["slot"]]):
            action.read_remote(flat[a:b], handle)
        await _bounded(action.submit(timeout=math.ceil(timeout_s)), timeout_s, f"read version {reply['version']}")

    async def _end_lease(self, reply: dict, sent: float, read_deadline: float) -> bool:
        """Release the lease; True if the copy is intact (exactly the leased version)."""
        now = time.monotonic()
        timeout_s = max(read_deadline - now, 1.0)
        if now - (sent + reply["waited_s"]) < SAFE_LEASE_FRACTION * reply["lease_s"]:
            self._release_in_background(reply["lease_id"], timeout_s)
            return True
        return await _bounded(self.agent.release.call_one(reply["lease_id"]), timeout_s, "release the lease")

    def _release_in_background(self, lease_id: int, timeout_s: float) -> None:
        task = asyncio.ensure_future(self._release_quietly(lease_id, timeout_s))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_quietly(self, lease_id: int, timeout_s: float) -> None:
        try:
            await _bounded(self.agent.release.call_one(lease_id), timeout_s, "release the lease")
        except WeightSyncError as e:  # the lease expires on its own; the publisher may be gone
            log.debug("background lease release failed: %s", e)


async def _bounded(awaitable, timeout: float, what: str):
    try:
        return await asyncio.wait_for(_as_coro(awaitable), timeout)
    except asyncio.TimeoutError:
        raise WeightSyncTimeout(f"could not {what} within {timeout:.1f}s: is the publisher alive?") from None
    except WeightSyncError:
        raise
    except Exception as e:  # ActorError, SupervisionError, RDMA errors: the peer is gone or broken
        raise WeightSyncError(f"could not {what}: {type(e).__name__}: {e}") from e


async def _as_coro(awaitable):
    return await awaitable
