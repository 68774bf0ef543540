"""`rdma` transport: subscribers read the publisher's staging slots with Monarch RDMABuffers.

Each staging slot is registered once, cut into chunks of at most `CHUNK_BYTES` (many reads
in flight beat one big read on the TCP fallback: STACK.md). A reader leases the latest
slot through a small endpoint call, reads every chunk in one batched RDMA action, and
releases the lease; the reply to `release` says whether the bytes stayed untouched. The
handles and the layout travel only the first time a reader meets a slot or a layout.
"""

from __future__ import annotations

import asyncio
import math
import time

import torch
from monarch.rdma import RDMAAction, RDMABuffer

from meshrl.weightsync.buffers import ReceiveBuffers
from meshrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from meshrl.weightsync.layout import Layout
from meshrl.weightsync.staging import Slot, StagingPool

CHUNK_BYTES = 16 << 20


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
    deadline = time.monotonic() + wait_s
    while (lease := pool.acquire(min_version)) is None:
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.005)
    slot = lease.slot
    same_layout = have_layout == slot.layout.layout_id
    return {
        "lease_id": lease.lease_id,
        "version": lease.version,
        "layout_id": slot.layout.layout_id,
        "slot": slot.index,
        "layout": None if same_layout else slot.layout,
        "buffers": None if same_layout and slot.index in have_slots else slot_buffers(slot),
    }


class RdmaReader:
    """Subscriber side: the cached layout and slot handles of one publisher."""

    def __init__(self, agent, buffers: ReceiveBuffers):
        self.agent, self.buffers = agent, buffers
        self.layout: Layout | None = None
        self.handles: dict[int, list[RDMABuffer]] = {}

    async def fetch(self, min_version: int, wait_s: float, timeout_s: float) -> tuple[int, torch.Tensor] | None:
        """Read the newest version >= min_version (waiting up to wait_s for one to appear) into
        a free buffer; None if none appeared. The transfer itself is bounded by timeout_s."""
        deadline = time.monotonic() + wait_s
        while True:
            wait = max(deadline - time.monotonic(), 0.0)
            reply = await _bounded(
                self.agent.acquire.call_one(min_version, self.layout.layout_id if self.layout else None, list(self.handles), wait),
                wait + timeout_s, "lease a staged version",
            )
            if reply is None:
                return None
            if reply["layout"] is not None:
                self.layout, self.handles = reply["layout"], {}
                self.buffers.set_layout(self.layout)
            if reply["buffers"] is not None:
                self.handles[reply["slot"]] = reply["buffers"]
            flat = self.buffers.take()
            ok = False
            try:
                action = RDMAAction()
                for (a, b), handle in zip(chunk_ranges(self.layout), self.handles[reply["slot"]]):
                    action.read_remote(flat[a:b], handle)
                read_deadline = time.monotonic() + timeout_s
                await _bounded(action.submit(timeout=math.ceil(timeout_s)), timeout_s, f"read version {reply['version']}")
                ok = await _bounded(self.agent.release.call_one(reply["lease_id"]), max(read_deadline - time.monotonic(), 1.0), "release the lease")
            finally:
                if not ok:
                    self.buffers.give_back(flat)
            if ok:
                return reply["version"], flat
            # The lease expired under us (slower than timeout_s): the copy may be torn; retry.


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
