"""The generation loop of one replica: prompt groups in, versioned completions out.

Plain asyncio around a `VLLMEngine`, so it runs inside the Monarch actor (actor.py) and in
unit tests alike. Each sample of a group is its own vLLM request (n=1), which lets one
sample be aborted and resumed from its prefix without touching the others.

Weight updates (`update_weights`) follow generator.update_mode:
- keep:  freeze the scheduler with requests in place, load, bump the version, resume.
         Sequences continue; tokens decoded afterwards carry the new version.
- abort: end in-flight requests, load, resume; every aborted sample is resubmitted as
         prompt + tokens so far with the remaining budget, its tokens keeping their
         original versions and log-probs.
- drain: stop admitting requests, let in-flight ones finish, load, resume.
- block: stop admitting groups, wait until every admitted group is finished AND handed
         to the sink, load, resume: each group comes from exactly one version.
In every mode the engine runs no forward pass while weights load (it is paused or idle),
so no step mixes two versions' parameters.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import torch

from meshrl.config import Config
from meshrl.generator.engine import RequestResult, VLLMEngine
from meshrl.rollout import Completion, Prompt

IDLE_POLL_S = 0.05
"""Pause before asking again when no prompt came at all."""

UPDATE_MODES = ("keep", "abort", "drain", "block")
SAMPLE_ID_STRIDE = 1 << 40
"""sample ids are replica * SAMPLE_ID_STRIDE + a per-replica counter: unique across replicas."""


@dataclass
class _Sample:
    """A completion being built, possibly over several vLLM requests (abort-and-resume)."""

    prompt: Prompt
    sample_id: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    experts: list[torch.Tensor]
    finish_reason: str | None = None
    resumes: int = 0


class Generator:
    """One replica's engine, versions, update modes and continuous generation loop."""

    def __init__(self, config: Config, checkpoint_dir: str, replica: int = 0):
        self.config = config
        self.gen = config.generator
        if self.gen.update_mode not in UPDATE_MODES:
            raise ValueError(f"generator.update_mode must be one of {UPDATE_MODES}")
        self.engine = VLLMEngine(
            self.gen,
            checkpoint_dir,
            dtype=config.model.dtype,
            max_model_len=config.model.max_seq_len,
            seed=config.seed + replica,
        )
        self.replica = replica
        self._ids = itertools.count(replica * SAMPLE_ID_STRIDE)
        self._request_ids = itertools.count()
        # Admission gate: cleared while paused, updating or stopping; requests wait on it.
        self._open = asyncio.Event()
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._capacity = asyncio.Condition()
        self._seqs_in_flight = 0  # vLLM requests submitted and not finished
        self._reserved = 0  # request slots the loop has reserved for admitted groups
        self._groups_in_flight = 0  # groups admitted and not yet handed to the sink
        self._fetching = 0  # slots reserved while their prompt is being fetched
        self._stopping = False
        self._user_paused = False
        self._loop_task: asyncio.Task | None = None
        self._group_tasks: set[asyncio.Task] = set()
        self._loop_error: BaseException | None = None
        # stats
        self._t_start = time.monotonic()
        self._tokens_at_reset = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._groups_done = 0
        self._groups_dropped = 0
        self._resumed = 0
        self.update_pauses: list[tuple[str, int, float]] = []
        """(mode, version, seconds generation was held) for each update."""

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self, version: int = 0) -> float:
        return await self.engine.start(version)

    @property
    def version(self) -> int:
        return self.engine.version

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- one sample, one group ------------------------------------------------------------
    async def _run_sample(self, sample: _Sample, temperature: float | None, max_new_tokens: int | None) -> _Sample:
        budget = min(max_new_tokens or self.gen.max_new_tokens, self.config.model.max_seq_len - len(sample.prompt.prompt_ids))
        if budget <= 0:
            raise ValueError(f"prompt of group {sample.prompt.group_id} leaves no room under model.max_seq_len")
        while True:
            remaining = budget - len(sample.tokens)
            if remaining <= 0:
                sample.finish_reason = "length"
                return sample
            await self._open.wait()
            if self._stopping:
                sample.finish_reason = "abort"
                return sample
            request_id = f"r{self.replica}-{sample.sample_id}-{next(self._request_ids)}"
            self._seq_started()
            try:
                result: RequestResult = await self.engine.run_request(
                    request_id, sample.prompt.prompt_ids + sample.tokens, remaining, temperature
                )
            finally:
                self._seq_ended()
                await self._notify()
            sample.tokens += result.token_ids
            sample.logprobs += result.logprobs
            sample.versions += result.versions
            if result.routed_experts is not None:
                sample.experts.append(result.routed_experts)
            if result.finish_reason == "abort" and not self._stopping:
                # Aborted by an abort-mode update: resume from the prefix under the new weights.
                sample.resumes += 1
                self._resumed += 1
                continue
            sample.finish_reason = result.finish_reason
            return sample

    async def _run_group(self, prompt: Prompt, temperature: float | None = None, max_new_tokens: int | None = None) -> list[Completion]:
        samples = [_Sample(prompt, next(self._ids), [], [], [], []) for _ in range(self.gen.group_size)]
        done = await asyncio.gather(*(self._run_sample(s, temperature, max_new_tokens) for s in samples))
        return [self._completion(s) for s in done]

    @staticmethod
    def _completion(s: _Sample) -> Completion:
        reason = s.finish_reason if s.finish_reason in ("stop", "length", "abort") else "abort"
        experts = torch.cat(s.experts) if s.experts else None
        return Completion(
            prompt_ids=list(s.prompt.prompt_ids),
            response_ids=s.tokens,
            logprobs=s.logprobs,
            versions=s.versions,
            finish_reason=reason,
            group_id=s.prompt.group_id,
            sample_id=s.sample_id,
            routed_experts=experts if experts is not None and experts.shape[0] == len(s.tokens) else None,
            extra=dict(s.prompt.extra),
        )

    async def generate(
        self, prompts: list[Prompt], temperature: float | None = None, max_new_tokens: int | None = None
    ) -> list[Completion]:
        """One-shot: all groups of `prompts`, in order (n = group_size completions each).
        `temperature` / `max_new_tokens` override the config for this call (tests, evals)."""
        self._groups_in_flight += len(prompts)
        try:
            groups = await asyncio.gather(*(self._run_group(p, temperature, max_new_tokens) for p in prompts))
        finally:
            self._groups_in_flight -= len(prompts)
        self._groups_done += len(prompts)
        return [c for g in groups for c in g]

    # ---- continuous generation ------------------------------------------------------------
    def start_loop(self, next_prompt: Callable[[], Awaitable[Prompt | None]], put: Callable[[list[Completion]], Awaitable]) -> None:
        """Start the background loop: admit groups as capacity frees, push finished groups."""
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError("generation loop already running")
        self._stopping = False
        self._loop_error = None
        self._loop_task = asyncio.create_task(self._loop(next_prompt, put))

    async def _loop(self, next_prompt, put) -> None:
        n = self.gen.group_size
        # Groups generated but not yet accepted by the sink count against capacity too, so a
        # full buffer (backpressure) stops admission instead of piling up finished groups.
        max_groups = max(1, self.gen.max_num_seqs // n)
        try:
            while not self._stopping:
                await self._open.wait()
                async with self._capacity:
                    await self._capacity.wait_for(
                        lambda: self._stopping or (self._reserved + n <= self.gen.max_num_seqs
                                                   and self._groups_in_flight + self._fetching < 2 * max_groups)
                    )
                if self._stopping:
                    break
                # One fetch per free slot, each group started the moment its prompt arrives.
                # The source holds a call while admission is closed; awaiting a slot's fetch
                # together with the others left prompts that had come waiting for the slowest
                # (the source's poll interval, about 1 s, every other step: measured).
                self._reserved += n
                self._fetching += 1
                task = asyncio.create_task(self._fetch_group(next_prompt, put))
                self._group_tasks.add(task)
                task.add_done_callback(self._group_tasks.discard)
            if self._group_tasks:
                await asyncio.gather(*list(self._group_tasks), return_exceptions=True)
        except BaseException as e:  # surfaced by stats() and stop()
            self._loop_error = e
            raise

    async def _fetch_group(self, next_prompt, put) -> None:
        """Fill one reserved slot: fetch a prompt and generate its group, or give the slot back."""
        admitted = False
        try:
            # None means "no prompt now" (the source holds a call at most a poll interval
            # while admission is closed); the slot is given back and asked for again.
            prompt = await next_prompt()
            if prompt is None:
                await asyncio.sleep(IDLE_POLL_S)  # a source that answers None at once is not spun on
                return
            # An update may have closed the gate while the prompt was fetched: start the group
            # only once it reopens (block mode counts admitted groups).
            await self._open.wait()
            if self._stopping:
                self._groups_dropped += 1
                return
            self._groups_in_flight += 1
            admitted = True
        except Exception as e:  # a source that failed or timed out ends the loop
            self._loop_error = e
            self._stopping = True
            return
        finally:
            self._fetching -= 1
            if not admitted:
                self._reserved -= self.gen.group_size
            await self._notify()
        await self._group_to_sink(prompt, put)

    async def _group_to_sink(self, prompt: Prompt, put) -> None:
        try:
            try:
                completions = await self._run_group(prompt)
            finally:
                self._reserved -= self.gen.group_size  # generation done: slots free for new groups
                await self._notify()
            if self._stopping and any(c.finish_reason == "abort" for c in completions):
                self._groups_dropped += 1
                return
            await put(completions)  # may wait long: the buffer's backpressure
            self._groups_done += 1
        except Exception as e:
            # A failed generation or a sink that timed out ends the loop; stats() reports it.
            self._loop_error = e
            self._stopping = True
        finally:
            self._groups_in_flight -= 1
            await self._notify()

    async def _notify(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    def _seq_started(self) -> None:
        if self._seqs_in_flight == 0 and self._busy_since is None:
            self._busy_since = time.monotonic()
        self._seqs_in_flight += 1

    def _seq_ended(self) -> None:
        self._seqs_in_flight -= 1
        if self._seqs_in_flight == 0 and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    async def pause(self) -> None:
        """Hold generation: no new requests, in-flight requests frozen (engine keep-pause)."""
        async with self._update_lock:
            self._user_paused = True
            self._open.clear()
            await self.engine.pause("keep")

    async def resume(self) -> None:
        async with self._update_lock:
            self._user_paused = False
            await self.engine.resume()
            self._open.set()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop: abort in-flight requests (their groups are dropped), bounded."""
        self._stopping = True
        self._user_paused = False
        self._open.set()  # wake waiters so they see _stopping
        await self._notify()
        if self._loop_task is None:
            return
        try:
            await asyncio.wait_for(self.engine.pause("abort"), timeout_s)
            await self.engine.resume()
            await asyncio.wait_for(asyncio.shield(self._loop_task), timeout_s)
        except asyncio.TimeoutError:
            self._loop_task.cancel()
            for t in list(self._group_tasks):
                t.cancel()
            raise TimeoutError(f"generation loop did not stop within {timeout_s}s")
        finally:
            self._stopping = False

    @property
    def stopping(self) -> bool:
        """stop() was called: the loop admits nothing more."""
        return self._stopping

    @property
    def loop_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ---- weights --------------------------------------------------------------------------
    async def update_weights(self, version: int, tensors: dict[str, torch.Tensor], mode: str | None = None) -> float:
        """Apply full HF-named tensors as `version`; returns seconds generation was held."""
        return await self._update(version, lambda: self.engine.load_tensors(tensors, self.config.weight_sync.timeout_s), mode)

    async def update_weights_from_files_fallback(self, version: int, checkpoint_dir: str, mode: str | None = None) -> float:
        """Named fallback: apply a safetensors checkpoint directory on disk as `version`."""
        return await self._update(
            version, lambda: self.engine.reload_from_files_fallback(checkpoint_dir, self.config.weight_sync.timeout_s), mode
        )

    async def _update(self, version: int, load: Callable[[], Awaitable], mode: str | None) -> float:
        mode = mode or self.gen.update_mode
        if mode not in UPDATE_MODES:
            raise ValueError(f"update mode must be one of {UPDATE_MODES}, got {mode!r}")
        timeout = self.config.weight_sync.timeout_s
        async with self._update_lock:
            self._open.clear()  # no new requests (or resumed prefixes) until the new version
            t0 = time.monotonic()
            try:
                if mode == "keep":
                    await self.engine.pause("keep")
                elif mode == "abort":
                    await self.engine.pause("abort")
                elif mode == "drain":
                    # Our own drain (the gate is closed, so nothing new is submitted): every
                    # request we submitted has finished. Then freeze the idle engine for the load.
                    await asyncio.wait_for(self._wait_idle(lambda: self._seqs_in_flight == 0), timeout)
                    await self.engine.pause("keep")
                else:  # block: every admitted group finished AND delivered to the sink
                    await asyncio.wait_for(self._wait_idle(lambda: self._groups_in_flight == 0 and self._seqs_in_flight == 0), timeout)
                    await self.engine.pause("keep")
                await load()
                await self.engine.set_version(version)
            finally:
                if self._user_paused:  # paused by the user before the update: stay paused
                    await self.engine.pause("keep")
                else:
                    await self.engine.resume()
                    self._open.set()
            held = time.monotonic() - t0
            self.update_pauses.append((mode, version, held))
            return held

    async def _wait_idle(self, predicate: Callable[[], bool]) -> None:
        async with self._capacity:
            await self._capacity.wait_for(predicate)

    # ---- stats ----------------------------------------------------------------------------
    def stats(self) -> dict:
        now = time.monotonic()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        wall = now - self._t_start
        tokens = self.engine.tokens_generated - self._tokens_at_reset
        return {
            "version": self.version,
            "tokens_generated": tokens,
            "tokens_per_s": tokens / busy if busy > 0 else 0.0,
            "busy_s": busy,
            "idle_s": max(0.0, wall - busy),
            "requests_in_flight": max(0, self._seqs_in_flight),
            "groups_in_flight": self._groups_in_flight,
            "groups_done": self._groups_done,
            "groups_dropped_on_stop": self._groups_dropped,
            "samples_resumed": self._resumed,
            "updates": [{"mode": m, "version": v, "held_s": h} for m, v, h in self.update_pauses],
            "loop_running": self.loop_running,
            "loop_error": repr(self._loop_error) if self._loop_error else None,
        }

    def reset_stats(self) -> None:
        self._t_start = time.monotonic()
        self._tokens_at_reset = self.engine.tokens_generated
        self._busy_s = 0.0
        self._busy_since = time.monotonic() if self._seqs_in_flight > 0 else None
