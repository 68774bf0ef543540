"""Receive buffers of a subscriber: the one handed out stays untouched until the next fetch
(or until `drop_handed_out` says it was loaded)."""

from __future__ import annotations

import threading

import torch

from meshrl.weightsync.layout import Layout, allocate, unpack


class ReceiveBuffers:
    """Up to three flat buffers for one layout: handed out (the caller's tensors view it),
    latest complete (collective receives ahead of fetch), and one being filled.

    `max_buffers=2` (a GPU receiver, where each buffer is a copy of the model in the engine's
    GPU memory): the next receive then goes into the latest unfetched version's buffer when
    no other is free, so a newer version replaces it a little earlier than it would."""

    def __init__(self, shared_memory: bool = False, device: torch.device | None = None, max_buffers: int = 3):
        assert max_buffers >= 2, "two buffers at least: one handed out, one being filled"
        self.shared_memory = shared_memory
        self.device = device
        """Where the buffers live: host memory (None, cpu) or a GPU (an NCCL receiver's)."""
        self.max_buffers = max_buffers
        self.layout: Layout | None = None
        self._free: list[torch.Tensor] = []
        self._count = 0  # buffers of the current layout allocated
        self.handed_out: tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None = None
        self.latest: tuple[int, torch.Tensor] | None = None  # (version, buffer), not yet handed out
        self.lock = threading.Condition()

    def set_layout(self, layout: Layout) -> None:
        with self.lock:
            if self.layout is None or self.layout.layout_id != layout.layout_id:
                # Same-size buffers are kept: allocating (and first touching) a big one is slow.
                self._free = [b for b in self._free if b.numel() == layout.total_bytes]
                self.layout, self.latest, self._count = layout, None, len(self._free)

    def take(self) -> torch.Tensor:
        """A buffer nobody reads: neither handed out nor the latest complete one."""
        with self.lock:
            assert self.layout is not None
            if self._free:
                return self._free.pop()
            if self._count >= self.max_buffers and self.latest is not None:
                flat, self.latest = self.latest[1], None  # superseded by the version about to arrive
                return flat
            self._count += 1
            return allocate(self.layout, self.shared_memory, device=self.device)

    def give_back(self, flat: torch.Tensor) -> None:
        with self.lock:
            if self.layout is not None and flat.numel() == self.layout.total_bytes:
                self._free.append(flat)

    def complete(self, version: int, flat: torch.Tensor) -> None:
        """A received version, ready for the next fetch (replaces an older unfetched one)."""
        with self.lock:
            if self.latest is not None:
                self._free.append(self.latest[1])
            self.latest = (version, flat)
            self.lock.notify_all()

    def take_latest(self, min_version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Hand out the latest complete version if it is >= min_version, without waiting; else None."""
        with self.lock:
            if self.latest is None or self.latest[0] < min_version:
                return None
            (version, flat), self.latest = self.latest, None
            return version, self.hand_out(version, flat)

    def drop_handed_out(self) -> None:
        """The handed-out tensors were loaded and will not be read again: free their buffer
        for the next receive (with max_buffers=2, the receiver then keeps the latest)."""
        with self.lock:
            if self.handed_out is not None:
                self.give_back(self.handed_out[1])
                self.handed_out = None

    def hand_out(self, version: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Give `flat` to the caller; the previously handed out buffer becomes free."""
        with self.lock:
            assert self.layout is not None
            if self.handed_out is not None and self.handed_out[1].numel() == self.layout.total_bytes:
                self._free.append(self.handed_out[1])
            views = unpack(flat, self.layout)
            self.handed_out = (version, flat, views)
            return views
