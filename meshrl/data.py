"""Prompts: from the built-in tasks or JSONL/Parquet files, through torchdata, resumable.

`PromptNode` is a torchdata `BaseNode` over one source's records, shuffled per epoch with
the run seed; its state is (epoch, index), so a resumed run continues exactly where it
stopped. A record is a dict with `prompt` (text, or a list of chat messages) and `answer`,
plus whatever else the source holds; the episode queue (meshrl/queue.py) hands records
out to rollout workers, whose env turns them into episodes.
"""

from __future__ import annotations

import json
import random
from typing import Any

from torchdata.nodes import BaseNode

from meshrl.config import DataConfig
from meshrl.tasks import get_task


def load_records(cfg: DataConfig) -> list[dict[str, Any]] | None:
    """Records of a file source as dicts with "prompt" and "answer"; None for a task source."""
    if cfg.source.startswith("task:"):
        get_task(cfg.source.removeprefix("task:"))  # fail early on a bad name
        return None
    if cfg.source.endswith(".jsonl"):
        with open(cfg.source) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        import pyarrow.parquet as pq

        rows = pq.read_table(cfg.source).to_pylist()
    records = []
    for i, row in enumerate(rows):
        if cfg.prompt_key not in row:
            raise KeyError(f"{cfg.source} record {i} has no {cfg.prompt_key!r} field (data.prompt_key)")
        extra = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key)}
        prompt = row[cfg.prompt_key]
        records.append({"prompt": prompt if isinstance(prompt, list) else str(prompt), "answer": row.get(cfg.answer_key), **extra})
    if not records:
        raise ValueError(f"{cfg.source} holds no records")
    return records


class PromptNode(BaseNode[dict]):
    """Endless, per-epoch shuffled records of one source; state = (epoch, index)."""

    def __init__(self, cfg: DataConfig, seed: int):
        super().__init__()
        self.cfg, self.seed = cfg, seed
        self.records = load_records(cfg)
        self.task = None if self.records is not None else get_task(cfg.source.removeprefix("task:"))
        self.size = len(self.records) if self.records is not None else cfg.num_prompts

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.epoch = initial_state["epoch"] if initial_state else 0
        self.index = initial_state["index"] if initial_state else 0
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.cfg.shuffle and self.records is not None:
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
        # A task prompt is a pure function of (seed, epoch, i): nothing to store.
        return self.task.sample(random.Random(f"{self.seed}/{self.epoch}/{i}"), self.cfg)

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}
