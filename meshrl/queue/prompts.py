"""The prompt stream the episode queue draws from: a torchdata node over one source's records.

`PromptNode` shuffles each epoch with the run seed (stored sources; generated tasks are random
already); its state is (epoch, index), so a resumed run continues exactly where it stopped.
The records themselves come from meshrl/data.py.
"""

from __future__ import annotations

import os
import random

from torchdata.nodes import BaseNode

from meshrl.config import DataConfig
from meshrl.data import generator, load_records


class PromptNode(BaseNode[dict]):
    """Endless, per-epoch shuffled records of one source; state = (epoch, index)."""

    def __init__(self, cfg: DataConfig, seed: int):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.records = load_records(cfg)
        self.generate = None if self.records is not None else generator(cfg, str(seed), cfg.num_prompts)
        self.size = len(self.records) if self.records is not None else cfg.num_prompts

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.epoch = initial_state["epoch"] if initial_state else 0
        self.index = initial_state["index"] if initial_state else 0
        self.changed: str | None = None  # why a restored position no longer holds
        saved = (initial_state or {}).get("order")
        if saved is not None and saved not in (self._order_key(), self._order_key(real=False)):  # (as the config names it: keys saved before real paths)
            # another order under the same index would repeat some of the epoch's prompts and skip others
            self.changed = f"the data's order changed since the checkpoint ({saved} -> {self._order_key()}): epoch {self.epoch} starts over, in the new order"
            self.index = 0
        self._order = self._permutation(self.epoch)

    def _order_key(self, real: bool = True) -> str:
        """What the order of prompts depends on: the source, its size, and the seed that shuffles or generates it."""
        shuffled, source = self.cfg.shuffle or self.records is None, self.cfg.source
        source = os.path.realpath(source) if real and self.records is not None and os.path.exists(source) else source  # one file however named
        return f"{source}, {self.size} records" + (f", seed {self.seed}" if shuffled else "")

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.cfg.shuffle and self.records is not None:  # generated records are random already
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self) -> dict:
        if self.index >= self.size:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        i = self._order[self.index]
        self.index += 1
        if self.records is not None:
            return dict(self.records[i])
        return self.generate(self.epoch, i)

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "order": self._order_key()}
