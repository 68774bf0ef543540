"""Prompts: from the built-in tasks or JSONL/Parquet files, through torchdata, resumable.

`PromptNode` is a torchdata `BaseNode` over one source's records, shuffled per epoch with
the run seed; its state is (epoch, index), so a resumed run continues exactly where it
stopped. `PromptSource` adds what the RL loop needs on top: tokenization, group ids,
admission gated by the trainer's version (synchronous runs hand out one batch per
version), tracking of prompts handed out but not yet in the buffer, and re-queueing of
the prompts a crashed generator held. `PromptSourceActor` serves it on a proc mesh.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import deque
from typing import Any

from monarch.actor import Actor, concurrent_endpoint
from torchdata.nodes import BaseNode

from meshrl.config import Config, DataConfig
from meshrl.rollout import Prompt
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
        records.append({"prompt": str(row[cfg.prompt_key]), "answer": row.get(cfg.answer_key), **extra})
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
        text, answer = self.task.make(random.Random(f"{self.seed}/{self.epoch}/{i}"))
        return {"prompt": text, "answer": answer}

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


SCORER = -1
"""Holder id of groups that reached the scorer (outstanding until they are in the buffer)."""


class PromptSource:
    """Tokenized prompts with group ids, gated by version, with re-queue. Thread-safe."""

    def __init__(self, config: Config, tokenizer_dir: str):
        from meshrl.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.node = PromptNode(config.data, config.seed)
        self.node.reset()
        # Admission control: how many groups may be handed out ahead of the trainer. With
        # depth 0 that is one batch per version (synchronous); with depth K, K+1 batches
        # plus what the generators hold.
        self.batch_groups = config.batch_groups
        self.ahead = config.buffer.depth + 1
        self.version = 0
        self.next_group_id = 0
        self.handed_out = 0
        self.requeued: deque[Prompt] = deque()
        self.outstanding: dict[int, tuple[Prompt, int]] = {}  # handed out, not acknowledged: (prompt, consumer)
        self.consumed: list[int] = []  # group ids acknowledged, in order
        self._cond = threading.Condition()
        self._closed = False

    def _admissible(self) -> bool:
        return self.handed_out < (self.version + self.ahead) * self.batch_groups

    def next_prompt(self, timeout: float, consumer: int = 0) -> Prompt | None:
        """The next prompt for generator `consumer`; waits (at most `timeout` s) while the
        trainer is too far behind. Returns None when closed or timed out, so a generator can
        re-check its own state and call again."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self.requeued or self._admissible(), timeout):
                return None
            if self._closed:
                return None
            if self.requeued:
                prompt = self.requeued.popleft()
            else:
                record = next(self.node)
                text = record.pop("prompt")
                prompt = Prompt(
                    prompt_ids=self.tokenizer.encode(text, add_special_tokens=False),
                    group_id=self.next_group_id,
                    text=text,
                    extra=record,
                )
                self.next_group_id += 1
                self.handed_out += 1
            self.outstanding[prompt.group_id] = (prompt, consumer)
            return prompt

    def received(self, group_ids: list[int]) -> None:
        """The scorer holds these groups now: a later failure of the generator that made
        them must not re-queue them (they would be trained twice)."""
        with self._cond:
            for gid in group_ids:
                if gid in self.outstanding:
                    self.outstanding[gid] = (self.outstanding[gid][0], SCORER)

    def acknowledge(self, group_ids: list[int]) -> None:
        """These groups reached the buffer (or were dropped there): no longer in flight."""
        with self._cond:
            for gid in group_ids:
                if self.outstanding.pop(gid, None) is not None:
                    self.consumed.append(gid)

    def requeue(self, consumer: int | None = None, group_ids: list[int] | None = None) -> int:
        """Hand outstanding prompts out again first: those held by `consumer` (a generator
        that died), or the given group ids, or all. Returns how many."""
        with self._cond:
            ids = [
                gid for gid, (_, holder) in self.outstanding.items()
                if (consumer is None or holder == consumer) and (group_ids is None or gid in group_ids)
            ]
            for gid in sorted(ids):
                self.requeued.append(self.outstanding.pop(gid)[0])
            self._cond.notify_all()
            return len(ids)

    def set_version(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def state_dict(self) -> dict:
        """Iteration state plus every prompt handed out and not yet in the buffer: a resumed
        run hands those out again, so no prompt is skipped or repeated."""
        with self._cond:
            pending = list(self.requeued) + [p for p, _ in self.outstanding.values()]
            return {
                "node": self.node.state_dict(),
                "next_group_id": self.next_group_id,
                "handed_out": self.handed_out,
                "pending": [p.__dict__ for p in sorted(pending, key=lambda p: p.group_id)],
                "consumed": list(self.consumed),
            }

    def load_state_dict(self, state: dict, skip_group_ids: set[int] = frozenset()) -> None:
        """Restore; pending prompts whose groups are in `skip_group_ids` (already in the
        restored buffer: put but not yet acknowledged at checkpoint time) are not re-issued."""
        with self._cond:
            self.node.reset(state["node"])
            self.next_group_id = state["next_group_id"]
            self.handed_out = state["handed_out"]
            self.requeued = deque(Prompt(**p) for p in state["pending"] if p["group_id"] not in skip_group_ids)
            self.outstanding = {}
            self.consumed = list(state["consumed"])
            self._cond.notify_all()


class PromptSourceActor(Actor):
    """Serves a PromptSource; generators call `next_prompt`, scorers `acknowledge`."""

    def __init__(self, config: dict, tokenizer_dir: str):
        self.source = PromptSource(Config.from_dict(config), tokenizer_dir)

    @concurrent_endpoint
    async def next_prompt(self, timeout: float = 1.0, consumer: int = 0) -> Prompt | None:
        return await asyncio.to_thread(self.source.next_prompt, timeout, consumer)

    @concurrent_endpoint
    async def received(self, group_ids: list[int]) -> None:
        self.source.received(group_ids)

    @concurrent_endpoint
    async def acknowledge(self, group_ids: list[int]) -> None:
        self.source.acknowledge(group_ids)

    @concurrent_endpoint
    async def requeue(self, consumer: int | None = None, group_ids: list[int] | None = None) -> int:
        return self.source.requeue(consumer, group_ids)

    @concurrent_endpoint
    async def set_version(self, version: int) -> None:
        self.source.set_version(version)

    @concurrent_endpoint
    async def close(self) -> None:
        self.source.close()

    @concurrent_endpoint
    async def consumed(self) -> list[int]:
        with self.source._cond:
            return list(self.source.consumed)

    @concurrent_endpoint
    async def state_dict(self) -> dict:
        return self.source.state_dict()

    @concurrent_endpoint
    async def load_state_dict(self, state: dict, skip_group_ids: list[int] = ()) -> None:
        self.source.load_state_dict(state, set(skip_group_ids))
