"""`shm` transport (one host): generators read the trainer's staging slot where it lies.

The publisher's staging slots are anonymous shared-memory files (memfd). A subscriber leases
the newest slot through the publisher's sidecar, maps it by name (`/proc/PID/fd/N`) and
hands out views of it: nothing is copied between the trainer's snapshot and the engine's
own load (vLLM's engine core maps the same file, `generator/weight_loading.py`). The lease
is held while the views are in use: until `release` (the generator calls it once its
engine has loaded them) or the next fetch, and a leased slot is never rewritten, so the
engine loads exactly one version. Procs on other hosts cannot map the file: the config
check refuses `shm` with more than one host.

On one GPU shared by the trainer and the engine (SyncSpec.on_gpu), the slots are GPU memory
and the lease names a CUDA IPC handle of the slot instead: the engine's worker opens it and
loads from the trainer's GPU bucket with no host hop (`GpuSlot`).
"""

from __future__ import annotations

import pickle
import time
import uuid

import torch

from meshrl.weightsync.errors import WeightSyncError
from meshrl.weightsync.layout import Layout, unpack
from meshrl.weightsync.rdma import _bounded, wait_for_lease
from meshrl.weightsync.spec import GpuSlot
from meshrl.weightsync.staging import Slot, StagingPool


def ipc_handle(flat: torch.Tensor) -> bytes:
    """A CUDA IPC handle of GPU buffer `flat`, pickled: a process on this host that sees the
    same GPU opens it with `open_ipc` (no copy). The buffer must outlive every reader."""
    from torch.multiprocessing.reductions import reduce_tensor

    # Each handle keeps its buffer in torch's sent-data limbo until the reader lets go; a
    # slot dropped since (new shapes, a device change) is freed only once collected here.
    torch.cuda.ipc_collect()
    return pickle.dumps(reduce_tensor(flat))


def open_ipc(blob: bytes) -> torch.Tensor:
    """The GPU buffer an `ipc_handle` names, mapped into this process."""
    rebuild, args = pickle.loads(blob)
    return rebuild(*args)


def slot_name(slot: Slot) -> tuple[str, str]:
    """(path another process maps the slot by, a key unique to this slot's buffer): the path
    alone is not unique, as a closed slot's fd number is reused by the next allocation."""
    key = slot.transport_state.get("shm")
    if key is None:
        key = slot.transport_state["shm"] = uuid.uuid4().hex
    path = slot.flat.untyped_storage().filename
    if path is None:
        raise WeightSyncError("the staging slot is not in shared memory: the publisher was not made for the shm transport")
    return path, key


async def serve_acquire_shared(pool: StagingPool, min_version: int, wait_s: float) -> dict | None:
    """Publisher side: lease a version >= min_version (waiting up to wait_s) and name its slot."""
    lease = await wait_for_lease(pool, min_version, wait_s)
    if lease is None:
        return None
    if lease.slot.flat.is_cuda:
        return {"lease_id": lease.lease_id, "version": lease.version, "layout": lease.slot.layout, "ipc": ipc_handle(lease.slot.flat)}
    path, key = slot_name(lease.slot)
    return {"lease_id": lease.lease_id, "version": lease.version, "layout": lease.slot.layout, "path": path, "key": key, "nbytes": lease.slot.flat.numel()}


INHERITED_RELEASE_S = 5.0
"""The longest a reader waits on the publisher it was reconnected away from to end a lease held across."""


class SharedReader:
    """Subscriber side: the slots it has mapped and the lease it holds."""

    def __init__(self, agent, before: "SharedReader | None" = None):
        self.agent = agent
        self.mapped: dict[str, torch.Tensor] = {}  # slot key -> its mapping
        self.lease_id: int | None = None
        # the lease a reader replaced by a reconnect held (views an engine may still be loading):
        # ended, through that reader's publisher, with this one's next release; else the trainer's
        # publish would wait for it to expire once its slots were all leased
        self.inherited = (before.agent, before.lease_id) if before is not None and before.lease_id is not None else None

    async def fetch(self, min_version: int, wait_s: float, timeout_s: float) -> tuple[int, dict[str, torch.Tensor] | GpuSlot] | None:
        """Lease the newest version >= min_version and view its tensors in place (a GPU slot:
        its IPC handle, for the engine to open); None if none appeared within wait_s. The
        lease of the previous fetch ends once this one is held."""
        reply = await _bounded(self.agent.acquire_shared.call_one(min_version, wait_s), wait_s + timeout_s, "lease a staged version")
        if reply is None:
            return None
        await self.release(timeout_s, quiet=True)
        self.lease_id = reply["lease_id"]
        if "ipc" in reply:
            return reply["version"], GpuSlot(reply["version"], pickle.dumps((reply["ipc"], reply["layout"])))
        flat = self.mapped.get(reply["key"])
        if flat is None:
            flat = torch.from_file(reply["path"], shared=True, size=reply["nbytes"], dtype=torch.uint8)
            if len(self.mapped) >= 8:  # slots of an older layout: their files close with the mapping
                self.mapped.pop(next(iter(self.mapped)))
            self.mapped[reply["key"]] = flat
        layout: Layout = reply["layout"]
        return reply["version"], unpack(flat, layout)

    async def release(self, timeout_s: float, quiet: bool = False) -> None:
        """End the lease held (its views must no longer be read). Raises WeightSyncError if it
        had expired (held past weight_sync.timeout_s), as the slot may then have been rewritten
        while it was read; `quiet`: the views were dropped unread, nothing to report."""
        lease_id, self.lease_id = self.lease_id, None
        try:
            if lease_id is None:
                return
            t0 = time.monotonic()
            intact = await _bounded(self.agent.release.call_one(lease_id), timeout_s, "release the lease")
            if not intact and not quiet:
                raise WeightSyncError(
                    f"the lease on a staged version expired while it was read ({time.monotonic() - t0:.1f}s to release): raise weight_sync.timeout_s"
                )
        finally:  # its own first: a publisher that hangs (a healed trainer's) holds up no lease of the new one
            await self._release_inherited(min(timeout_s, INHERITED_RELEASE_S))

    async def _release_inherited(self, timeout_s: float) -> None:
        if self.inherited is not None:
            (agent, inherited), self.inherited = self.inherited, None
            try:  # its publisher may be gone: nothing then holds its slot
                await _bounded(agent.release.call_one(inherited), timeout_s, "release a lease held across a reconnect")
            except WeightSyncError:
                pass
