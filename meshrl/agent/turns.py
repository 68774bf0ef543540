"""Model turns to generator replicas: which replica plays a group, and one message per burst.

Every episode of a group sticks to one replica (its prefix cache stays warm); a new group
goes to the least-loaded replica, skipping those whose calls failed (a dead replica
answers at once, and would otherwise draw every new group until it is replaced). Model
turns asked for within `COALESCE_S` of the first go to a replica in one `generate_many`
message: a group's episodes ask together, so a replica receives one message, not
`group_size`. A failed call fails each of its turns with `GenerationFailed`, and the
worker plays the group again. A call none of whose turns is still wanted (their group
failed) is aborted on its replica, whose slots go to the turns still wanted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time

from meshrl.config import Config
from meshrl.futures import awaited

COALESCE_S = 0.002
"""Model turns asked for within this long of the first go to a replica in one message."""
MIN_DECODE_TOKENS_PER_S = 2.0
"""The slowest a live replica may decode one sequence: a call's bound grows by its longest turn's
budget at this rate (a long reasoning turn on a busy replica is no lost call; a dead or wedged
replica is the health check's to find, `generator.stall_timeout_s`)."""
ABORT_TIMEOUT_S = 10.0
"""Longest an abandoned call's abort may take (the replica stops the call's requests)."""
FAILED_SKIP_S = 30.0
"""How long a replica whose call failed gets no new group (unless every replica failed): long
enough for the controller's health check to replace a dead one, short enough that a live
replica's passing error (a slow update's wait timing out) does not idle it for the run."""


class GenerationFailed(RuntimeError):
    """A generator call failed: the group is re-queued, not trained."""


class TurnBatcher:
    """The worker's link to the generator replicas (Monarch actor handles, or anything with
    a `generate_many.call_one(requests, call_id=...)` that returns a future, and optionally an
    `abort_many.call_one(call_id)`)."""

    def __init__(self, config: Config, startup_timeout_s: float | None = None):
        self.config = config
        # a call's bound, beside its turns' decoding: a weight update and a replica's start may come first (its model's own start)
        self.call_timeout_s = config.weight_sync.timeout_s + (config.generator.startup_timeout_s if startup_timeout_s is None else startup_timeout_s)
        self.generators: list = []
        self.load: list[int] = []  # groups playing on each replica, for the least-loaded choice
        self._failed: dict[int, float] = {}  # replica -> when a call failed: skipped for FAILED_SKIP_S, or until one succeeds
        self._waiting: dict[int, list] = {}  # replica -> model turns not yet sent, with their futures
        self._calls: set[asyncio.Task] = set()  # generate_many calls in flight, and aborts of those abandoned
        self._name, self._call_ids = f"{os.getpid()}.{id(self):x}", itertools.count()  # unique among a replica's callers

    def set_generators(self, generators: list) -> None:
        """The replicas to send model turns to (after a replacement or a rescale)."""
        self.generators = list(generators)
        self.load = (self.load + [0] * len(self.generators))[: len(self.generators)]
        self._failed = {}

    def acquire(self) -> int:
        """A replica for a new group: the least-loaded, preferring those whose calls have not
        failed. Hand it back with `release` when the group is done."""
        if not self.generators:
            raise GenerationFailed("no generator replica")
        now = time.monotonic()
        healthy = [i for i in range(len(self.generators)) if now - self._failed.get(i, -FAILED_SKIP_S) >= FAILED_SKIP_S] or list(range(len(self.generators)))
        replica = min(healthy, key=self.load.__getitem__)
        self.load[replica] += 1
        return replica

    def release(self, replica: int) -> None:
        if replica < len(self.load):
            self.load[replica] = max(0, self.load[replica] - 1)

    async def generate(self, replica: int, ids: list[int], budget: int, version: int, temperature: float | None = None):
        """One model turn on `replica` (at `temperature`; None: generator.temperature). Turns
        asked for within COALESCE_S of each other go to the replica in one `generate_many`
        message: a group's episodes ask together."""
        if replica >= len(self.generators):
            raise GenerationFailed("its generator replica was removed")
        future = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(replica, [])
        waiting.append(((ids, budget, temperature, version), future))
        if len(waiting) == 1:
            asyncio.get_running_loop().call_later(COALESCE_S, self._send, replica)
        out = await future
        if isinstance(out, str):  # this sample failed on the replica: the group is played again
            self._failed[replica] = time.monotonic()
            raise GenerationFailed(f"generator replica {replica}: {out}")
        self._failed.pop(replica, None)
        return out

    def _send(self, replica: int) -> None:
        batch = self._waiting.pop(replica, [])
        if not batch:
            return
        call_id = f"{self._name}-{next(self._call_ids)}"
        task = asyncio.ensure_future(self._call_many(replica, batch, call_id))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

        def abandon(_) -> None:  # every episode waiting on the call is gone (its group failed): the replica stops it too
            if all(future.done() for _, future in batch) and not task.done() and not task.cancelling():
                task.cancel()
                self._spawn(self._abort(replica, call_id))

        for _, future in batch:
            future.add_done_callback(abandon)

    def _spawn(self, coro) -> None:
        """Run `coro` beside the calls, held until it ends (stopped with them)."""
        task = asyncio.ensure_future(coro)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _abort(self, replica: int, call_id: str) -> None:
        """Best effort: a replica gone, or one without the endpoint (a stand-in), ends its call itself."""
        endpoint = getattr(self.generators[replica], "abort_many", None) if replica < len(self.generators) else None
        if endpoint is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(awaited(endpoint.call_one(call_id)), ABORT_TIMEOUT_S)

    async def _call_many(self, replica: int, batch: list, call_id: str) -> None:
        try:
            if replica >= len(self.generators):
                raise GenerationFailed("its generator replica was removed")
            call = self.generators[replica].generate_many.call_one([r for r, _ in batch], call_id=call_id)
            longest = max(budget for (_, budget, _, _), _ in batch)
            results = await asyncio.wait_for(awaited(call), self.call_timeout_s + longest / MIN_DECODE_TOKENS_PER_S)
        except asyncio.CancelledError:  # the worker is stopping
            for _, future in batch:
                future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the call fails each of its samples
            results = [f"{type(e).__name__}: {str(e).strip()[:200]}"] * len(batch)
            if isinstance(e, TimeoutError):  # given up on here, its requests would go on generating there for a group played again
                self._spawn(self._abort(replica, call_id))
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)
