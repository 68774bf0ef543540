"""Trainer side: `Publisher` stages each version and serves it over the chosen transport.

Use it inside the trainer actor on the publishing rank (see meshrl/weightsync/__init__.py
for the wiring). `publish` only copies into a staging slot; the transport (RDMA reads
served by a sidecar actor, a broadcast thread, a file-writer thread; with `shm` the
generators lease and map the slot itself) runs in the background, so the next training step overlaps the transfer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Iterable

import torch
from monarch.actor import Actor, concurrent_endpoint

from meshrl.compat import spawn_owned_by_caller
from meshrl.config import WeightSyncConfig
from meshrl.weightsync.rdma import serve_acquire
from meshrl.weightsync.shared import serve_acquire_shared
from meshrl.weightsync.collective import CollectiveSender
from meshrl.weightsync.errors import WeightSyncError
from meshrl.weightsync.files import FileWriter
from meshrl.weightsync.layout import Layout, plan_layout
from meshrl.weightsync.spec import SyncSpec
from meshrl.weightsync.staging import StagingPool

logger = logging.getLogger(__name__)

_PUBLISHERS: dict[str, "Publisher"] = {}  # the sidecar agent finds its Publisher here (same process)
_ids = itertools.count()


class Publisher:
    def __init__(self, cfg: WeightSyncConfig, max_slots: int = 4):
        self.cfg = cfg
        # shm: the slots are shared-memory files the generators on this host map and load from
        self.pool = StagingPool(lease_timeout_s=cfg.timeout_s, max_slots=max_slots, shared_memory=cfg.transport == "shm")
        self.layout: Layout | None = None
        self.spec: SyncSpec | None = None
        self._background: CollectiveSender | FileWriter | None = None
        self.key = f"{os.getpid()}-{next(_ids)}"
        _PUBLISHERS[self.key] = self
        # A sidecar actor in this process (`publisher_agent`, spawned by the controller) serves
        # subscribers and the controller, so those calls never queue behind the trainer
        # actor's own (long) endpoints.

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], stream: bool = False) -> float:
        """Copy the full HF-named tensors into a staging slot and make `version` available.
        Returns the seconds spent copying (the only synchronous part). Never raises for a
        transport failure (training goes on; see `check` and WeightSync.status).

        `stream`: the caller's tensors keep the names, shapes and dtypes of its previous
        version (the trainer's do, for a whole run). Each is then copied into the slot as it
        arrives and dropped, so a GPU trainer holds one gathered tensor at a time beside the
        slots, never the whole model again; a version that breaks the promise is not
        published (one warning) and the next is laid out afresh. Without it, the tensors
        are collected first and laid out anew whenever they change."""
        t0 = time.perf_counter()
        if not stream or self.layout is None:
            # collected whole to lay them out: in host memory where the slots are there (a GPU
            # trainer would hold every gathered tensor of the model on its GPU at once)
            named = [(n, t.cpu() if t.is_cuda and self.pool.device is None else t) for n, t in named_tensors]
            layout = plan_layout(named, self.cfg.bucket_mb << 20)
            if self.layout is None or layout.layout_id != self.layout.layout_id:
                self.layout = layout  # new metadata: subscribers receive it with the next version
            self.pool.publish(version, self.layout, named)
            return time.perf_counter() - t0
        named = iter(named_tensors)
        try:
            self.pool.publish(version, self.layout, named)
        except ValueError as e:  # the tensors no longer match the layout
            for _ in named:  # the gathers are collective: walk them to the end with the other ranks
                pass
            self.layout = None
            logger.warning("weight sync: version %d was not published (%s); the next version is laid out afresh", version, e)
        return time.perf_counter() - t0

    @property
    def latest_version(self) -> int:
        return self.pool.latest.version if self.pool.latest is not None else -1

    def configure(self, spec: SyncSpec) -> None:
        """(Re)connect to subscribers; called by the controller through the sidecar."""
        self.close_transport()
        # On GPUs: stage in GPU buckets on this rank's GPU (two copies of the model at most),
        # so a version never leaves the GPU; else host slots (pinned where CUDA is).
        self.pool.use_device(torch.device("cuda", 0) if spec.on_gpu else None, 2 if spec.on_gpu else None)
        if spec.transport == "collective":
            self._background = CollectiveSender(self.pool, spec)  # blocks until every rank joined
        elif spec.transport == "files":
            self._background = FileWriter(self.pool, spec.files_dir)
        elif spec.transport not in ("rdma", "shm"):
            raise WeightSyncError(f"unknown transport {spec.transport!r}")
        self.spec = spec

    def close_transport(self) -> None:
        if self._background is not None:
            self._background.close()
            self._background = None

    def close(self) -> None:
        self.close_transport()
        _PUBLISHERS.pop(self.key, None)


def publisher_agent(procs, key: str):
    """Spawn the sidecar of the Publisher `key` on `procs` (a one-proc mesh: the publishing
    rank's), from the controller: the agent's mesh is then owned by the controller's
    process, which outlives every trainer proc (`meshrl.compat.spawn_owned_by_caller` says why)."""
    return spawn_owned_by_caller(procs, "weightsync_publisher", PublisherAgent, key)


class PublisherAgent(Actor):
    """Sidecar of a Publisher: every endpoint is concurrent, so waiting readers never block."""

    def __init__(self, key: str):
        self.key = key

    @property
    def publisher(self) -> Publisher:
        return _PUBLISHERS[self.key]

    @concurrent_endpoint
    async def configure(self, spec: SyncSpec) -> int:
        await asyncio.to_thread(self.publisher.configure, spec)
        return os.getpid()

    @concurrent_endpoint
    async def acquire(self, min_version: int, have_layout: str | None, have_slots: list[int], wait_s: float):
        return await serve_acquire(self.publisher.pool, min_version, have_layout, have_slots, wait_s)

    @concurrent_endpoint
    async def acquire_shared(self, min_version: int, wait_s: float):
        return await serve_acquire_shared(self.publisher.pool, min_version, wait_s)

    @concurrent_endpoint
    async def release(self, lease_id: int) -> bool:
        return self.publisher.pool.release(lease_id)

    @concurrent_endpoint
    async def status(self) -> dict:
        p = self.publisher
        err = p._background.error if p._background is not None else None
        return {"latest_version": p.latest_version, "slots": len(p.pool.slots), "error": repr(err) if err else None, "pid": os.getpid()}
