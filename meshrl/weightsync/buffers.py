"""Receive buffers of a subscriber: the one handed out stays untouched until the next fetch."""

from __future__ import annotations

import threading

import torch

from meshrl.weightsync.layout import Layout, allocate, unpack


class ReceiveBuffers:
    """Up to three flat buffers for one layout: handed out (the caller's tensors view it),
    latest complete (collective receives ahead of fetch), and one being filled."""

    def __init__(self, shared_memory: bool = False):
        self.shared_memory = shared_memory
        self.layout: Layout | None = None
        self._free: list[torch.Tensor] = []
        self.handed_out: tuple[int, torch.Tensor, dict[str, torch.Tensor]] | None = None
        self.latest: tuple[int, torch.Tensor] | None = None  # (version, buffer), not yet handed out
        self.lock = threading.Condition()

    def set_layout(self, layout: Layout) -> None:
        with self.lock:
            if self.layout is None or self.layout.layout_id != layout.layout_id:
                # Same-size buffers are kept: allocating (and first touching) a big one is slow.
                self._free = [b for b in self._free if b.numel() == layout.total_bytes]
                self.layout, self.latest = layout, None

    def take(self) -> torch.Tensor:
        """A buffer nobody reads: neither handed out nor the latest complete one."""
        with self.lock:
            assert self.layout is not None
            return self._free.pop() if self._free else allocate(self.layout, self.shared_memory)

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

    def hand_out(self, version: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Give `flat` to the caller; the previously handed out buffer becomes free."""
        with self.lock:
            assert self.layout is not None
            if self.handed_out is not None and self.handed_out[1].numel() == self.layout.total_bytes:
                self._free.append(self.handed_out[1])
            views = unpack(flat, self.layout)
            self.handed_out = (version, flat, views)
            return views
