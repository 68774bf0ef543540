"""The generation service of one replica: token ids in; tokens, log-probs and versions out.

Plain asyncio around a `VLLMEngine`, so it runs inside the Monarch actor (actor.py) and in
unit tests alike. Rollout workers call `generate` for every model turn of every live
episode at once; vLLM batches them continuously. Each call is one sample (n=1), so one
can be aborted and resumed from its prefix without touching the others.

Versions: a call names the oldest policy version it accepts (`min_version`, from the
episode queue's admission); it waits until this replica's weights are at least that new.
Every returned token carries the version that produced it.

Weight updates (`update_weights`) follow generator.update_mode, per request:
- keep:  freeze the scheduler with requests in place, load, bump the version, resume.
         Requests continue; tokens decoded afterwards carry the new version.
- abort: end in-flight requests, load, resume; every aborted request is resubmitted as
         prompt + tokens so far with the remaining budget, its tokens keeping their
         original versions and log-probs.
- drain: admit no new request, let in-flight ones finish, load, resume: every request
         comes from one version.
- block: as drain. Synchronous runs (buffer.depth=0) use it: the episode queue admits a
         batch only at the trainer's version, so no request waits across an update.
In every mode the engine runs no forward pass while weights load (it is paused or idle),
so no step mixes two versions' parameters.

Scoring (`score`): the log-prob of every token of a sequence, for on-policy distillation.
A teacher is a replica built with `teacher=True` on the teacher's checkpoint: it scores at
generator.temperature (its logits are divided by it, so it must not sample for the
student), and it never receives weights.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import os
import time
import torch

from meshrl.compat import vllm_runs_lora_on
from meshrl.config import MOE_FAMILIES, Config
from meshrl.generator.engine import RequestResult, VLLMEngine
from meshrl.weightsync.spec import GpuSlot, ReceivedInEngine

UPDATE_MODES = ("keep", "abort", "drain", "block")
DRAIN_SHARE = 0.5
"""A `drain` update waits at most this share of weight_sync.timeout_s for the requests in flight."""
UPDATE_SLACK_S = 30.0


def update_bound_s(config: Config) -> float:
    """Longest a replica's weight update may take, each of its parts at its own bound: the fetch
    and the load (weight_sync.timeout_s each), the drain between them (DRAIN_SHARE of it), and
    UPDATE_SLACK_S for the calls around them. The controller takes a replica slower than this for
    dead, and a request waits this long for its `min_version`."""
    t = config.weight_sync.timeout_s
    return t + DRAIN_SHARE * t + t + UPDATE_SLACK_S


UPDATES_KEPT = 64  # the newest updates `stats` reports (each held time, for the metrics and tests)


def runs_lora(checkpoint_dir: str) -> bool:
    """Whether a LoRA policy's generator runs its adapter: see compat.vllm_runs_lora_on."""
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    return vllm_runs_lora_on(moe=model_type in MOE_FAMILIES)


class ReplicaStopping(RuntimeError):
    """A request reached a replica that is stopping: the replica's, not the request's, failure."""


class Generator:
    """One replica's engine, version, update modes and request accounting."""

    def __init__(self, config: Config, checkpoint_dir: str, replica: int = 0, teacher: bool = False):
        self.config = config
        self.gen = config.generator
        if self.gen.update_mode not in UPDATE_MODES:
            raise ValueError(f"generator.update_mode must be one of {UPDATE_MODES}")
        self.engine = VLLMEngine(
            dataclasses.replace(self.gen, return_routed_experts=False) if teacher else self.gen,  # a teacher only scores: no routes to replay
            checkpoint_dir,
            dtype=config.model.dtype,
            max_model_len=config.model.max_seq_len,
            seed=config.seed + replica,
            # LoRA: the engine runs the base model with the policy's adapter, which the
            # trainer exports beside each checkpoint it hands the generators
            adapter_dir=os.path.join(checkpoint_dir, "adapter") if config.lora.rank > 0 and not teacher and runs_lora(checkpoint_dir) else None,
            sleep_mode=config.placement == "colocate",
        )
        self.replica = replica
        self.teacher = teacher
        self._request_ids = itertools.count()
        self._calls: dict[str, asyncio.Future] = {}  # generate_many and score_many calls by their callers' ids, for abort_many
        # Admission gate: cleared while paused, updating or stopping; requests wait on it.
        self._open = asyncio.Event()
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._changed = asyncio.Condition()  # requests finished, or the version moved
        self._in_flight = 0  # vLLM requests submitted and not finished
        self._stopping = False
        self._user_paused = False  # `pause` until `resume`
        self._asleep = False  # `sleep` until `wake` (placement=colocate)
        # stats
        self._t_start = time.monotonic()
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._requests_done = 0
        self._resumed = 0
        self._sleeps = 0
        self._asleep_from: int | None = None
        self._tokens_asleep = 0
        self.update_pauses: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=UPDATES_KEPT)
        """(mode, version, seconds generation was held) for each of the last UPDATES_KEPT updates:
        `stats`, which the health check asks for every few seconds, sends them all."""
        self.weights_id: str | None = None
        """The trainer's name of the weights loaded (TrainerActor.weights_id); None: not known."""
        self._dropped = False  # weights dropped at a sleep (level 2) and not loaded since
        self.drains_cut = 0  # drain updates whose longest requests were frozen (`keep`) instead of waited for
        self._relabels = 0
        self._progress = (0, 0.0)  # (tokens counted, when the stall clock last started: that count moved, or work began)
        self._held_at: float | None = None  # the engine paused or asleep (a pause, an update's load, a sleep): the stall clock stops

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, version: int = 0) -> float:
        """Start the engine; one that fails (or is cancelled) after vLLM started is shut down, its
        processes with it: they would otherwise outlive the replica, holding its cores or GPU."""
        try:
            elapsed = await self.engine.start(version)
            if self.teacher and self.gen.temperature != 1.0:
                await self.engine.set_logit_temperature(self.gen.temperature)
        except BaseException:
            self.shutdown()
            raise
        return elapsed

    @property
    def version(self) -> int:
        return self.engine.version

    async def release_sigterm(self) -> None:
        await self.engine.release_sigterm()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- the service ----------------------------------------------------------------------
    async def generate(self, token_ids: list[int], max_new_tokens: int | None = None, temperature: float | None = None, min_version: int = 0) -> RequestResult:
        """One sample continuing `token_ids`, at most `max_new_tokens` (default
        generator.max_new_tokens) and never past model.max_seq_len, from weights of
        `min_version` or newer. finish_reason: stop, length (a repetition cut too) or abort (the replica stops)."""
        budget = min(max_new_tokens or self.gen.max_new_tokens, self.config.model.max_seq_len - len(token_ids))
        if budget <= 0:
            raise ValueError(f"a context of {len(token_ids)} tokens leaves no room under model.max_seq_len")
        await self._wait_for_version(min_version)
        out = RequestResult()
        while True:
            remaining = budget - len(out.token_ids)
            if remaining <= 0:
                out.finish_reason = "length"
                return out
            await self._open.wait()
            if self._stopping:
                out.finish_reason = "abort"
                return out
            self._request_started()
            try:
                part = await self.engine.run_request(f"r{self.replica}-{next(self._request_ids)}", token_ids + out.token_ids, remaining, temperature)
            finally:
                await self._request_ended()
            out.token_ids += part.token_ids
            out.logprobs += part.logprobs
            out.versions += part.versions
            if part.routed_experts is not None:
                out.routed_experts = part.routed_experts if out.routed_experts is None else torch.cat([out.routed_experts, part.routed_experts])
            if part.finish_reason == "abort" and not self._stopping:
                self._resumed += 1  # aborted by an abort-mode update: resume from the prefix under the new weights
                continue
            if part.finish_reason not in ("stop", "length", "abort", "repetition"):  # vLLM's `error`: retryable (a KV load failed)
                raise RuntimeError(f"the engine ended the request with finish_reason {part.finish_reason!r}")
            out.finish_reason = "length" if part.finish_reason == "repetition" else part.finish_reason  # (its guard cut a repeating reply)
            return out

    async def generate_many(self, requests: list[tuple], call_id: str | None = None) -> list[RequestResult | str]:
        """`generate` on each of `requests` (its arguments), at once; a sample that fails comes
        back as its error text, the others unaffected. `call_id`: the caller's name for the
        call, which `abort_many` stops."""
        return await self._many([self.generate(*r) for r in requests], call_id)

    async def score_many(self, sequences: list[list[int]], call_id: str | None = None) -> list[list[float] | str]:
        """`score` on each of `sequences`, at once (vLLM batches them), as `generate_many`. A
        replica that is stopping fails the call (ReplicaStopping): its caller asks another."""
        return await self._many([self.score(ids) for ids in sequences], call_id, raise_first=ReplicaStopping)

    async def _many(self, calls: list, call_id: str | None, raise_first: type | None = None) -> list:
        every = asyncio.ensure_future(asyncio.gather(*calls, return_exceptions=True))
        if call_id is not None:
            self._calls[call_id] = every
        try:
            results = await every
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this call itself, not abort_many
                raise
            return ["aborted: its caller gave up on it"] * len(calls)
        finally:
            self._calls.pop(call_id, None)
        failed = next((r for r in results if raise_first is not None and isinstance(r, raise_first)), None)
        if failed is not None:
            raise failed
        return [f"{type(r).__name__}: {str(r).strip()[:200]}" if isinstance(r, BaseException) else r for r in results]

    def abort_many(self, call_id: str) -> bool:
        """Stop the generate_many or score_many call `call_id`, whose caller no longer waits for
        it (its episodes failed or were cancelled, or it timed out): vLLM aborts its requests,
        and their slots and KV cache go to the work still wanted. False if it had ended."""
        calls = self._calls.get(call_id)
        return calls is not None and calls.cancel()

    async def score(self, token_ids: list[int]) -> list[float]:
        """The log-prob of each of `token_ids` given the ones before it (position 0: 0.0), at
        this replica's logit temperature (generator.temperature for a teacher, else 1); see
        VLLMEngine.score. Waits while the replica is paused or updating, like `generate`."""
        await self._open.wait()
        if self._stopping:
            raise ReplicaStopping(f"generator replica {self.replica} is stopping")
        self._request_started()
        try:
            return await self.engine.score(f"s{self.replica}-{next(self._request_ids)}", token_ids)
        except Exception:
            if self._stopping:  # aborted by the stop: the replica's failure, not the sequence's
                raise ReplicaStopping(f"generator replica {self.replica} is stopping") from None
            raise
        finally:
            await self._request_ended()

    async def _wait_for_version(self, version: int) -> None:
        if self.version >= version:
            return
        timeout = update_bound_s(self.config)
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version >= version or self._stopping), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"generator replica {self.replica} is at version {self.version}, not {version}, after {timeout:g}s") from None

    def _request_started(self) -> None:
        if self._in_flight == 0:
            self._progress = (self._progress[0], time.monotonic())  # work begins: so does the stall clock
            if self._busy_since is None:
                self._busy_since = time.monotonic()
        self._in_flight += 1

    async def _request_ended(self) -> None:
        self._in_flight -= 1
        self._requests_done += 1
        if self._in_flight == 0 and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None
        async with self._changed:
            self._changed.notify_all()

    async def pause(self) -> None:
        """Hold generation: no new requests, in-flight requests frozen (engine keep-pause).
        Holds until `resume`, whatever `sleep` and `wake` do in between."""
        async with self._update_lock:
            self._user_paused = True
            self._close()
            if not self._asleep:  # asleep: the engine runs nothing already
                await self.engine.pause("keep")

    async def resume(self) -> None:
        async with self._update_lock:
            self._user_paused = False
            if not (self._asleep or self._dropped):  # asleep: `wake` resumes; weights dropped: the next load does
                await self.engine.resume()
                self._reopen()

    async def sleep(self, keep_weights: bool = True) -> None:
        """placement=colocate, while the trainer steps: no requests, and on GPU the engine's
        memory freed (VLLMEngine.sleep; without `keep_weights` the weights are dropped, for a
        version loaded before `wake`). Requests that arrive wait for `wake`."""
        async with self._update_lock:
            self._asleep = True
            self._close()
            try:
                if await self.engine.sleep(keep_weights):  # dropped (GPU): a relabel would wake on nothing
                    self.weights_id, self._dropped = None, True
            except BaseException:
                if not keep_weights:  # perhaps dropped before it failed
                    self.weights_id, self._dropped = None, True
                raise
            self._sleeps += 1
            self._asleep_from = await self._settled_tokens()

    async def _settled_tokens(self, quiet_s: float = 0.05, bound_s: float = 1.0) -> int:
        """The engine's token count once what it generated before its scheduler stopped has
        reached the requests that count it: vLLM answers the pause as it arrives, and hands the
        outputs of the steps before it on in a task of its own, so they are counted a moment
        later (without this, as tokens generated while asleep). Paused, the count stops moving.
        With no request in flight (the loop's sleep after its batch) nothing is on its way."""
        count, end = self.engine.tokens_generated, time.monotonic() + bound_s
        while self._in_flight and time.monotonic() < end:
            await asyncio.sleep(quiet_s)
            if self.engine.tokens_generated == count:
                break
            count = self.engine.tokens_generated
        return count

    async def wake(self) -> None:
        """Undo `sleep`: the engine's memory is back, and generation resumes unless the user
        paused it (then it stays frozen until `resume`)."""
        async with self._update_lock:
            if self._asleep_from is not None:  # tokens that arrived while asleep: generation overlapped a step
                self._tokens_asleep += self.engine.tokens_generated - self._asleep_from
                self._asleep_from = None
            self._asleep = False
            # weights dropped at the sleep and no load since (the update was cut off: its trainer died) would generate
            # from memory the sleep freed, under the old version: the engine stays paused and the gate closed until a load
            hold = self._user_paused or self._dropped
            await self.engine.wake_up(resume=not hold)
            if not hold:
                self._reopen()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """End every request (they return with finish_reason abort), bounded."""
        self._stopping = True
        self._user_paused = self._asleep = False
        self._open.set()  # wake waiters so they see _stopping
        async with self._changed:
            self._changed.notify_all()
        await asyncio.wait_for(self.engine.pause("abort"), timeout_s)
        await self.engine.resume()

    # ---- weights --------------------------------------------------------------------------
    async def relabel(self, version: int, weights_id: str) -> bool:
        """Run on under `version` without loading anything, where `weights_id` names the weights
        loaded already (a trainer's step off its trainer.pace keeps them); False where it does
        not, or where this engine is past `version`: then a load is needed."""
        async with self._update_lock:
            if weights_id != self.weights_id or self.version > version:
                return False
            await self.engine.set_version(version)
            self._relabels += 1
        async with self._changed:
            self._changed.notify_all()
        return True

    async def update_weights(
        self, version: int, tensors: dict[str, torch.Tensor] | ReceivedInEngine | GpuSlot, mode: str | None = None, weights_id: str | None = None
    ) -> float:
        """Apply `version`'s tensors (full HF-named weights, or with LoRA the PEFT-named
        adapter; ReceivedInEngine: already received by the engine's workers; GpuSlot: the
        trainer's GPU slot, through CUDA IPC), which the trainer names `weights_id`; returns
        seconds generation was held."""
        mode = mode or self.gen.update_mode
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
        timeout = self.config.weight_sync.timeout_s
        async with self._update_lock:
            self._open.clear()  # no new requests (or resumed prefixes) until the new version
            self.weights_id = None  # until the load is done
            t0 = time.monotonic()
            try:
                if self._asleep:
                    await self.engine.wake_weights()  # the weights' memory only: the engine runs again at `wake`
                elif self._user_paused or self._dropped:
                    pass  # frozen (by the user, or after a load that failed): nothing runs, and a drain would wait forever
                elif mode in ("keep", "abort"):
                    self._stop_clock()
                    await self.engine.pause(mode)
                else:
                    # Our own drain (the gate is closed, so nothing new is submitted): every
                    # request we submitted has finished (the engine generates meanwhile: the stall
                    # clock runs). Then freeze the idle engine for the load. Requests longer than
                    # the drain's share of the bound are frozen as they are (`keep`: their tokens
                    # carry each version), not waited for until the controller takes the replica for dead.
                    try:
                        async with self._changed:
                            await asyncio.wait_for(self._changed.wait_for(lambda: self._in_flight == 0), DRAIN_SHARE * timeout)
                    except asyncio.TimeoutError:
                        self.drains_cut += 1
                    self._stop_clock()
                    await self.engine.pause("keep")
                try:
                    if isinstance(tensors, ReceivedInEngine):
                        await self.engine.load_received(tensors.version, timeout)  # already in the workers
                    elif isinstance(tensors, GpuSlot):
                        await self.engine.load_gpu_slot(tensors, timeout)  # the trainer's slot, on the GPU both share
                    elif self.engine.adapter_config is not None:
                        await self.engine.load_adapter(tensors, timeout)  # LoRA: the adapter alone
                    else:
                        await self.engine.load_tensors(tensors, timeout)
                    await self.engine.set_version(version)
                except BaseException:
                    # A load that failed or timed out may have left some layers new (and one timed
                    # out may still be loading): nothing generates on it under the old version's
                    # label until a load succeeds, or the replica is replaced.
                    self._dropped = True
                    raise
                self.weights_id, self._dropped = weights_id, False
            finally:
                if self._asleep:
                    pass  # asleep (paused, on GPU its KV cache freed) until `wake`
                elif self._user_paused or self._dropped:  # frozen before the update, or its load of dropped weights failed
                    await self.engine.pause("keep")
                else:
                    await self.engine.resume()
                    self._reopen()
                async with self._changed:
                    self._changed.notify_all()
            held = time.monotonic() - t0
            self.update_pauses.append((mode, version, held))
            return held

    def _stop_clock(self) -> None:
        if self._held_at is None:
            self._held_at = time.monotonic()

    def _close(self) -> None:
        """No new requests, and the engine about to pause or sleep."""
        self._stop_clock()
        self._open.clear()

    def _reopen(self) -> None:
        """The engine runs again: new requests in, and the stall clock on from where it stopped."""
        if self._held_at is not None:  # the time held does not count as stalled, nor restart the clock
            count, since = self._progress
            self._progress, self._held_at = (count, since + time.monotonic() - self._held_at), None
        self._open.set()

    def stalled_s(self, now: float) -> float:
        """Seconds the engine has had requests in flight, generating, and produced no token nor
        scored one: the time since that count last moved or work began, less the time the engine
        was held (paused, loading an update, asleep: 0 while it is; an update's drain counts, as
        the engine still generates). Measured between two calls of
        `stats` (the controller's health check and metrics read it every few seconds): a count
        that moved since the last call restarts it. An update's aborted and resumed requests
        are no progress: a replica whose engine answers pauses and loads but schedules nothing
        still counts as stalled."""
        count = self.engine.tokens_generated + self.engine.tokens_scored
        if count != self._progress[0]:
            self._progress = (count, now)
        if self._in_flight <= 0 or self._held_at is not None or self._asleep:
            return 0.0
        return max(0.0, now - self._progress[1])

    # ---- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        now = time.monotonic()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        tokens = self.engine.tokens_generated
        return {
            "stalled_s": self.stalled_s(now),
            "version": self.version,
            "tokens_generated": tokens,
            "tokens_scored": self.engine.tokens_scored,
            "tokens_per_s": tokens / busy if busy > 0 else 0.0,
            "busy_s": busy,
            "idle_s": max(0.0, now - self._t_start - busy),
            "requests_in_flight": max(0, self._in_flight),
            "requests_done": self._requests_done,
            "samples_resumed": self._resumed,
            "sleeps": self._sleeps,
            "tokens_while_asleep": self._tokens_asleep,
            "updates": [{"mode": m, "version": v, "held_s": h} for m, v, h in self.update_pauses],
            "relabels": self._relabels,
            "drains_cut": self.drains_cut,
        }
