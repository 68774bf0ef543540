"""Monarch calls awaited like coroutines: bounded, settled, read rank by rank.

A Monarch endpoint call returns a future that starts only when awaited and is not a
coroutine, and a mesh's answers come back keyed by each point's coordinates. These few
helpers make every bounded, concurrent or best-effort wait in meshrl read the same.
"""

from __future__ import annotations

import asyncio
import contextlib

from meshrl.errors import ProcLost


async def awaited(future):
    """A Monarch future as a coroutine.

    Monarch futures start only when awaited and are not coroutines: `asyncio.create_task`
    and `ensure_future` refuse them, and a future handed to `wait_for` or `gather` before
    it is awaited has not started its call. Wrapping it here makes a bounded or concurrent
    wait on an endpoint call behave like any coroutine's.
    """
    return await future


async def bounded(future, timeout_s: float, what: str):
    """Await a Monarch future (or a coroutine) for at most `timeout_s`: its answer, its own
    failure, or a TimeoutError that says which call (`what`) did not answer."""
    try:
        async with asyncio.timeout(timeout_s) as bound:
            return await awaited(future)
    except TimeoutError:
        if not bound.expired():  # the call's own TimeoutError (the queue's BatchTimeout is one): its own
            raise
        raise TimeoutError(f"{what} did not answer within {timeout_s:g}s") from None


async def unless_lost(future, lost, poll_s: float = 1.0):
    """Await a Monarch future (or a coroutine) until it answers, or until `lost()` says a proc it
    waits on is gone: then it is cancelled and ProcLost raised. A message sent to a proc killed
    moments before (before Monarch's supervision saw it) fails only at Monarch's delivery
    timeout; the heal that follows need not wait for it."""
    call = asyncio.ensure_future(awaited(future))
    try:
        while not (await asyncio.wait({call}, timeout=poll_s))[0]:
            if lost():
                raise ProcLost("a proc of the call is gone (found on its host while the call waited)")
        return call.result()
    finally:
        if not call.done():
            call.cancel()
            call.add_done_callback(lambda f: f.cancelled() or f.exception())


async def all_or_none(*coroutines) -> list:
    """Their results, awaited at once; when one fails (or this is cancelled) the others are
    cancelled and awaited before the failure is raised: asyncio.gather leaves them running."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def by_rank(values) -> list:
    """The answers of a Monarch ValueMesh (what `endpoint.call` returns) in rank order.

    A ValueMesh yields (point, value) pairs keyed by each point's coordinates, not by rank,
    and its order is not documented; a caller that wants rank 0's answer, or each rank's in
    turn, reads the rank off each point here.
    """
    return [v for _, v in sorted(values.items(), key=lambda kv: kv[0].rank)]


async def settled(future, timeout_s: float) -> Exception | None:
    """Await a Monarch future (or a coroutine) for at most `timeout_s`; its failure, or the
    timeout, is returned instead of raised. For teardown, which goes on whatever one part
    did: a dead proc's or host's call fails or times out here."""
    outcome = await settled_value(future, timeout_s)
    return outcome if isinstance(outcome, Exception) else None


async def settled_value(future, timeout_s: float):
    """As `settled`, for a call whose answer is wanted: its answer, or its failure (the
    timeout's included) as the value. For health checks that ask several members at once."""
    try:
        return await asyncio.wait_for(awaited(future), timeout_s)
    except Exception as e:  # noqa: BLE001 - dead, unreachable or too slow: the caller decides
        return e


@contextlib.asynccontextmanager
async def stopped_on_failure(procs, timeout_s: float = 60.0):
    """Stop `procs` (a Monarch proc mesh just spawned) if the block fails, then re-raise the
    block's failure: a stop that fails or times out (a proc that never came up answers
    nothing) must not replace the error the user needs to see."""
    try:
        yield
    except BaseException:
        await settled(procs.stop(), timeout_s)
        raise
