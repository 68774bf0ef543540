"""Staging slots: snapshots of published versions that readers lease while they copy.

The trainer never hands out live parameters. `publish` copies a version into a free slot
(a flat buffer per `layout.Layout`), then makes it the latest. A reader leases a slot
before reading it and releases it after; a leased slot is never overwritten, so what a
reader copies is exactly one published version. A lease that outlives `lease_timeout_s`
(a dead reader) expires and its slot may be reused; `release` then returns False so the
reader knows its copy may be torn. The pool grows to `max_slots` under contention and
waits (bounded) for a release beyond that.

A background writer in the publishing process may also lease the version still being
copied (`filling=True`) and follow the copy with `wait_packed`, so writing overlaps it.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from meshrl.compat import cuda_present
from meshrl.weightsync.errors import WeightSyncTimeout
from meshrl.weightsync.layout import Layout, allocate, pack


@dataclass
class Slot:
    index: int
    layout: Layout
    flat: torch.Tensor
    version: int = -1
    generation: int = 0  # bumped whenever the bytes start changing
    packed: int = 0  # every byte below this holds `version` (the whole buffer once published)
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> deadline (monotonic)
    transport_state: dict = field(default_factory=dict)  # e.g. RDMA buffer handles of this slot

    def live_leases(self, now: float) -> bool:
        for lease_id, deadline in list(self.leases.items()):
            if deadline < now:
                del self.leases[lease_id]  # expired: the reader is presumed dead
        return bool(self.leases)


@dataclass(frozen=True)
class Lease:
    lease_id: int
    slot: Slot
    version: int
    generation: int
    granted: float  # monotonic time the lease started; it lives lease_timeout_s from here


class StagingPool:
    def __init__(self, lease_timeout_s: float, max_slots: int = 4, shared_memory: bool = False, pinned: bool | None = None):
        assert max_slots >= 2, "two slots at least: one being read, one being written"
        self.lease_timeout_s = lease_timeout_s
        self.max_slots = max_slots
        self.shared_memory = shared_memory
        self.pinned = cuda_present() if pinned is None else pinned
        """Page-locked slots (the default where CUDA is): a GPU trainer's copy into staging
        runs at the link's speed, and RDMA or a broadcast reads them without a bounce."""
        self.device: torch.device | None = None
        """GPU-resident slots (`use_device`): an NCCL broadcast's sources, packed at the GPU's
        speed with no host hop; None: host memory."""
        self.slots: list[Slot] = []
        self.latest: Slot | None = None
        self.filling: Slot | None = None  # the slot `publish` is copying into
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._by_id: dict[int, Lease] = {}  # for remote readers, which only keep the id
        self._watchers: set[Callable[[], None]] = set()

    def use_device(self, device: torch.device | None, max_slots: int | None = None) -> None:
        """Stage on `device` (None: host memory) from the next publish on; slots elsewhere are
        dropped once their leases end. `max_slots` caps copies of the model kept there."""
        with self._lock:
            if device != self.device:
                self.device, self.slots, self.latest = device, [], None
            if max_slots is not None:
                self.max_slots = max_slots

    # ---- writer side ----------------------------------------------------------------------
    def publish(self, version: int, layout: Layout, named: Iterable[tuple[str, torch.Tensor]]) -> Slot:
        """Copy `named` into a free slot and make it the latest version. Blocks only to copy,
        or (bounded by the lease timeout) when every slot is held by readers."""
        if self.latest is not None and version <= self.latest.version:
            raise ValueError(f"version {version} is not newer than the published {self.latest.version}")
        slot = self._claim(layout)
        with self._lock:
            slot.version, slot.packed, self.filling = version, 0, slot
            self._lock.notify_all()
        try:
            pack(slot.flat, layout, named, progress=lambda end: self._packed(slot, end))
        except BaseException:
            with self._lock:
                # Abandoned: a lease taken on it while filling now reads as torn.
                slot.version, slot.generation, self.filling = -1, slot.generation + 1, None
                self._lock.notify_all()
            raise
        with self._lock:
            slot.packed, self.latest, self.filling = layout.total_bytes, slot, None
            self._lock.notify_all()
            watchers = list(self._watchers)
        for notify in watchers:
            notify()
        return slot

    def _packed(self, slot: Slot, end: int) -> None:
        with self._lock:
            slot.packed = end
            self._lock.notify_all()

    def watch(self, notify: Callable[[], None]) -> Callable[[], None]:
        """Call `notify()` (in the publishing thread, so it must be quick and thread-safe)
        after every publish, until the returned function is called. Lets waiters that are
        not threads (asyncio endpoints) wake on a publish instead of polling."""
        with self._lock:
            self._watchers.add(notify)

        def unwatch() -> None:
            with self._lock:
                self._watchers.discard(notify)

        return unwatch

    def _claim(self, layout: Layout) -> Slot:
        deadline = time.monotonic() + self.lease_timeout_s
        with self._lock:
            # leases never released (their reader died, or its read failed) are let go here: each
            # held its slot, and with it a whole version's buffer (a GPU's, when staged there)
            now = time.monotonic()
            for i in [i for i, lease in self._by_id.items() if lease.granted + self.lease_timeout_s < now]:
                del self._by_id[i]
            if self.slots and self.slots[0].layout.layout_id != layout.layout_id:
                # New shapes: old slots stay alive through their leases, new ones are allocated.
                self.slots, self.latest = [], None
            while True:
                now = time.monotonic()
                for slot in self.slots:
                    if slot is not self.latest and not slot.live_leases(now):
                        slot.generation += 1  # any expired lease on it now reads as torn
                        slot.version = -1
                        return slot
                if len(self.slots) < self.max_slots:
                    slot = Slot(len(self.slots), layout, allocate(layout, self.shared_memory, self.pinned, self.device))
                    self.slots.append(slot)
                    return slot
                if now >= deadline:
                    raise WeightSyncTimeout(f"all {self.max_slots} staging slots stayed leased for {self.lease_timeout_s:.0f}s")
                self._lock.wait(min(0.05, deadline - now))

    # ---- reader side ----------------------------------------------------------------------
    def acquire(self, min_version: int = -1, filling: bool = False) -> Lease | None:
        """Lease the latest slot if it holds a version >= `min_version`, else None. With
        `filling`, the version being published is leased if there is one (its bytes are
        final only below `slot.packed`: see `wait_packed`)."""
        with self._lock:
            slot = self.filling if filling and self.filling is not None else self.latest
            if slot is None or slot.version < min_version:
                return None
            lease = Lease(next(self._ids), slot, slot.version, slot.generation, time.monotonic())
            slot.leases[lease.lease_id] = lease.granted + self.lease_timeout_s
            self._by_id[lease.lease_id] = lease
            return lease

    def wait_acquire(self, min_version: int, timeout: float, filling: bool = False) -> Lease | None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                lease = self.acquire(min_version, filling)
                remaining = deadline - time.monotonic()
                if lease is not None or remaining <= 0:
                    return lease
                self._lock.wait(remaining)

    def wait_packed(self, lease: Lease, end: int) -> bool:
        """Wait until the leased slot's bytes below `end` hold the leased version; False if
        its publish failed, so they never will. Bounded by the lease timeout."""
        deadline = time.monotonic() + self.lease_timeout_s
        with self._lock:
            while lease.slot.generation == lease.generation and lease.slot.packed < end:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WeightSyncTimeout(f"version {lease.version} was not copied within {self.lease_timeout_s:.0f}s")
                self._lock.wait(remaining)
            return lease.slot.generation == lease.generation

    def release(self, lease: Lease | int) -> bool:
        """End a lease (or lease id); True if the slot still held the leased bytes, i.e. the
        reader's copy is exactly one version."""
        with self._lock:
            lease = self._by_id.pop(lease if isinstance(lease, int) else lease.lease_id, None)
            if lease is None:
                return False
            held = lease.slot.leases.pop(lease.lease_id, None) is not None
            intact = held and lease.slot.generation == lease.generation
            self._lock.notify_all()
            return intact
