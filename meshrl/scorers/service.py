"""One scorer replica's service: requests from every rollout worker, scored in batches.

    service = ScorerService(backend, spec)
    results = await service.score(items)     # one dict per item, when its batch is scored

A request's items join one queue (each on its own, or the request whole where the
service keeps requests whole: the PRM's groups). A batch is taken when `batch_size` items
wait, or when the oldest has waited `batch_wait_s`; batches run one after another, and requests keep
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
import os
import time

from typing import TYPE_CHECKING

from meshrl.config import ScorerConfig
from meshrl.errors import first_line
from meshrl.futures import awaited, bounded, by_rank
from meshrl.scorers.backends import Failed, Judged

if TYPE_CHECKING:
    from meshrl.scorers.prm import ImplicitPRM


WEDGED_AFTER = 3.0
"""A batch still running after this many times the scorer's `timeout_s` (every caller has given
up on it: a hung backend) wedges the replica: its items and every later request fail at once,
and the controller's health check (ScorerPool.check) replaces it."""


class ScorerService:
    """A replica's queue of requests, scored in batches (see the module's docstring).

    `whole_requests`: False, a request's items may be split across batches (each item
    queues on its own); True, a request is never split (the PRM's groups, scorers/prm.py)."""

    whole_requests = False

    def __init__(self, backend, spec: ScorerConfig):
        self.backend, self.spec = backend, spec
        self._waiting: list[tuple[list[dict], asyncio.Future, float]] = []  # (a request's items, its future, when it arrived)
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.items = 0
        self.busy_s = 0.0
        self.abandoned = 0  # items dropped unscored, their callers gone (`_drop_abandoned`)
        self._batch_s = (0.0, 0.0)  # how long the last two batches took
        self.wedged = False

    async def score(self, items: list[dict]) -> list[dict]:
        if self.wedged:
            return self._failed(items)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        loop, now = asyncio.get_running_loop(), time.monotonic()
        requests = [items] if self.whole_requests else [[item] for item in items]
        futures = [loop.create_future() for _ in requests]
        self._waiting += [(request, f, now) for request, f in zip(requests, futures)]
        self._arrived.set()
        return [result for answer in await asyncio.gather(*futures) for result in answer]

    def _waiting_items(self) -> int:
        return sum(len(request) for request, _, _ in self._waiting)

    def _take(self) -> list[tuple[list[dict], asyncio.Future, float]]:
        """Whole requests from the front, at least one, up to batch_size items."""
        taken, n = [], 0
        while self._waiting and (not taken or n + len(self._waiting[0][0]) <= self.spec.batch_size):
            taken.append(self._waiting.pop(0))
            n += len(taken[-1][0])
        return taken

    async def _run(self) -> None:
        while True:
            if not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            oldest = self._waiting[0][2]
            while self._waiting_items() < self.spec.batch_size:
                left = oldest + self.spec.batch_wait_s - time.monotonic()
                if left <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            self._drop_abandoned()
            if not self._waiting:
                continue
            batch = self._take()
            items = [item for request, _, _ in batch for item in request]
            start = time.monotonic()
            results = self._failed(items) if self.wedged else await self._score(items)  # (batches queued before it was wedged: not to the hung backend either)
            took = time.monotonic() - start
            self._batch_s = (self._batch_s[-1], took)
            self.batches += 1
            self.items += len(items)
            self.busy_s += took
            at = 0
            for request, future, arrived in batch:
                mine, at = results[at : at + len(request)], at + len(request)
                if not future.done():
                    future.set_result([{**r, "queue_s": start - arrived, "score_s": took, "batch": len(items)} for r in mine])

    def _drop_abandoned(self) -> None:
        """Requests that would be answered past the scorer's `timeout_s` (ScorerClients wait
        that long from when they asked), were the batch about to start as long as the shorter
        of the last two (one may have saved a PRM's state): answered failed, unscored, rather
        than scored for nobody ahead of live ones (and, by a PRM, trained on). Batches as long
        as `timeout_s` predict nothing: those requests are scored, as the next may be quicker."""
        now, live, t = time.monotonic(), [], self.spec.timeout_s
        batch_s = min(self._batch_s)
        for request, future, arrived in self._waiting:
            if now - arrived + (batch_s if batch_s < t else 0.0) < t:
                live.append((request, future, arrived))
                continue
            self.abandoned += len(request)
            if not future.done():
                why = f"queued past timeout_s={t:g}s: its caller gave up on it"
                if now - arrived < t:
                    why = f"queued {now - arrived:.1f}s, where a batch takes {batch_s:.1f}s and timeout_s={t:g}s: its caller gives up on it first"
                future.set_result([{"score": None, "error": why, "unparsable": False, "queue_s": now - arrived} for _ in request])
        self._waiting = live

    async def _score(self, items: list[dict]) -> list[dict]:
        """One result dict per item (score, error, unparsable, a judge's reply)."""
        try:
            results = await self._within_bound(self.backend.score(items))
        except Exception as e:  # noqa: BLE001 - a batch that fails fails its items, not the scorer
            results = [Failed(f"{type(e).__name__}: {str(e)[:200]}")] * len(items)
        if results is None:
            return self._failed(items)
        out = []
        for result in results:
            reply = result.reply if isinstance(result, Judged) else None
            result = result.value if isinstance(result, Judged) else result
            failed = isinstance(result, Failed)
            out.append(
                {
                    "score": None if failed else result,
                    "error": result.reason if failed else None,
                    "unparsable": failed and result.unparsable,
                    **({"reply": reply} if reply is not None else {}),
                }
            )
        return out

    async def _within_bound(self, call, extra_s: float = 0.0):
        """`call`'s answer within WEDGED_AFTER x timeout_s (plus `extra_s`); past it None, and the
        replica is wedged (a backend's thread may still run the call: no batch beside it)."""
        try:
            return await asyncio.wait_for(call, WEDGED_AFTER * self.spec.timeout_s + extra_s)
        except asyncio.TimeoutError:
            self.wedged = True
            return None

    def _failed(self, items: list[dict]) -> list[dict]:
        why = f"the replica is wedged (a batch ran past {WEDGED_AFTER:g} x timeout_s={self.spec.timeout_s:g}s) and is being replaced"
        return [{"score": None, "error": why, "unparsable": False, "wedged": True} for _ in items]  # the client asks another

    def stats(self) -> dict:
        return {
            "batches": self.batches,
            "items": self.items,
            "busy_s": self.busy_s,
            "waiting": self._waiting_items(),
            "abandoned": self.abandoned,
            "wedged": self.wedged,
        }


EXIT_RANKS_OUT_OF_STEP = 75
"""A sharded PRM's rank 0 ends its proc with this status when a collective call failed (PRMService.lead)."""


class PRMService(ScorerService):
    """The PRM replica's queue: ScorerService's, with requests (one group each) never split,
    and each batch scored (and trained on) by one PRM version in a thread. Results as
    ScorerService's, plus version, loss and accuracy.

    A PRM sharded over several procs runs this on rank 0, which leads the others (`followers`,
    their ScorerActor.follow) through every collective call (a batch, a save, an export, the
    stop) one at a time: each message reaches them in the order it was sent, so every rank
    makes the same calls in the same order."""

    whole_requests = True

    def __init__(self, backend: ImplicitPRM, spec: ScorerConfig, followers=None, follow_timeout_s: float = 1800.0):
        super().__init__(backend, spec)
        self.last_trained: dict = {}
        self.followers, self.follow_timeout_s = followers, follow_timeout_s
        self._turn = asyncio.Lock()

    async def lead(self, op: str, *args):
        """The backend's `op(*args)` on this rank (in a thread) and on every follower at once:
        this rank's answer, and the followers' in rank order.

        Sharded, a call that fails on any rank (a rank died, or its collective failed) leaves the
        ranks' collectives out of step for good: this proc then ends itself, so the health check
        replaces the replica whole from its last save, and the rollout workers ask the new one
        (they ask again when a call fails, as for any dead replica). So does a follower that has
        not answered within a bound after this rank finished the call (the scorer's `timeout_s`
        for a batch, by when each of its requests has failed; `follow_timeout_s`,
        trainer.collective_timeout_s, for a save or an export): every collective of the call is
        behind this rank then, so that follower is wedged (alive, and answering nothing), and
        this rank's `stats` alone would not show it."""
        async with self._turn:
            return await self._lead(op, *args)

    async def _lead(self, op: str, *args):
        """`lead`, its turn taken."""
        if self.followers is None:
            return await asyncio.to_thread(getattr(self.backend, op), *args), []
        # a Monarch call is sent when awaited (futures.awaited): as a task, it goes while this rank works
        theirs = asyncio.create_task(awaited(self.followers.follow.call(op, *args)))
        try:
            mine = await asyncio.to_thread(getattr(self.backend, op), *args)
            bound = self.spec.timeout_s if op == "score_rows" else self.follow_timeout_s
            return mine, by_rank(await bounded(theirs, bound, f"the PRM's ranks 1.. at {op}"))
        except Exception as e:  # noqa: BLE001 - see above
            print(f"meshrl: the PRM's {op} failed across its ranks ({first_line(str(e) or type(e).__name__, 300)}); ending rank 0", flush=True)
            os._exit(EXIT_RANKS_OUT_OF_STEP)

    async def _score(self, items: list[dict]) -> list[dict]:
        try:  # a PRM hung in its thread wedges the replica too; a save rides on the batch, with its own bound
            async with self._turn:  # (a save the run's checkpoint asked for, under way, is no part of this batch's time)
                save = self.backend.save_due()
                answer = await self._within_bound(
                    self._lead("score_rows", items, save), self.follow_timeout_s if save else 0.0
                )  # one proc: an error fails the batch
            if answer is None:
                return self._failed(items)
            (rows, self.last_trained), others = answer
            results = [r for _, r in sorted(rows + [row for theirs, _ in others for row in theirs], key=lambda row: row[0])]
        except Exception as e:  # noqa: BLE001 - a batch that fails fails its items, not the scorer
            results = [{"score": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}] * len(items)
        return [{"error": None, "unparsable": False, **self.last_trained, **r} for r in results]

    def stats(self) -> dict:
        return {**super().stats(), "version": self.backend.version}
