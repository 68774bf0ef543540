"""One scorer replica's service: requests from every rollout worker, scored in batches.

    service = ScorerService(backend, spec)
    results = await service.score(items)     # one dict per item, when its batch is scored

A request's items join one queue. A batch is taken when `batch_size` items wait, or when
the oldest has waited `batch_wait_s`; batches run one after another, and requests keep
arriving meanwhile, so a busy scorer makes bigger batches rather than a longer queue.
Each result says how long its item queued and how long its batch took to score: the
rollout workers log both (`scoring/NAME/queue_s`, `scoring/NAME/score_s`), so a slow scorer
shows as such.

    result = {"score": float | [float, ...] | None, "error": str | None,
              "unparsable": bool, "queue_s": float, "score_s": float, "batch": int,
              "reply": str}   # a judge's reply, as it was parsed
"""

from __future__ import annotations

import asyncio
import time

from meshrl.config import ScorerConfig
from meshrl.scorers.backends import Failed, Judged


class ScorerService:
    def __init__(self, backend, spec: ScorerConfig):
        self.backend, self.spec = backend, spec
        self._waiting: list[tuple[dict, asyncio.Future, float]] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.items = 0
        self.busy_s = 0.0

    async def score(self, items: list[dict]) -> list[dict]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        futures = [loop.create_future() for _ in items]
        self._waiting += [(item, f, now) for item, f in zip(items, futures)]
        self._arrived.set()
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        while True:
            if not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            oldest = self._waiting[0][2]
            while len(self._waiting) < self.spec.batch_size:
                left = oldest + self.spec.batch_wait_s - time.monotonic()
                if left <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch, self._waiting = self._waiting[: self.spec.batch_size], self._waiting[self.spec.batch_size :]
            start = time.monotonic()
            try:
                results = await self.backend.score([item for item, _, _ in batch])
            except Exception as e:  # noqa: BLE001 - a batch that fails fails its items, not the scorer
                results = [Failed(f"{type(e).__name__}: {str(e)[:200]}")] * len(batch)
            took = time.monotonic() - start
            self.batches += 1
            self.items += len(batch)
            self.busy_s += took
            for (_, future, arrived), result in zip(batch, results):
                if future.done():
                    continue
                reply = result.reply if isinstance(result, Judged) else None
                result = result.value if isinstance(result, Judged) else result
                failed = isinstance(result, Failed)
                future.set_result(
                    {
                        "score": None if failed else result,
                        "error": result.reason if failed else None,
                        "unparsable": failed and result.unparsable,
                        "queue_s": start - arrived,
                        "score_s": took,
                        "batch": len(batch),
                        **({"reply": reply} if reply is not None else {}),
                    }
                )

    def stats(self) -> dict:
        return {"batches": self.batches, "items": self.items, "busy_s": self.busy_s, "waiting": len(self._waiting)}
