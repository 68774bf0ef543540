"""One vLLM `AsyncLLM` engine serving token-id prompts, with versioned in-place weight updates.

Log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, so the log-prob it
returns for a sampled token is taken from the distribution the token was actually drawn
from (after temperature, top-k and top-p). With top_p=1 and top_k=-1 this equals
log_softmax(logits / T), which is what the trainer computes at the same temperature; with
top-k/top-p the trainer applies the same truncation (trainer.loss.sampling_mask,
meshrl/trainer/logprobs.py).

Scoring (`score`, for a distillation teacher): vLLM's prompt log-probs give the log-prob
of every token of a sequence given the ones before it, in one prefill. They are computed
from the model's logits with no sampling step (no temperature, top-k or top-p, whatever the
request's sampling parameters), so a teacher that must score at generator.temperature
scales its logits by 1/T in the model itself (`set_logit_temperature`). Prompt log-probs
exist only for positions the engine computes in that request (none for a prefix served
from the prefix cache), so `score` sets `skip_reading_prefix_cache` (vLLM's default with
`prompt_logprobs`): every position is prefilled and scored. Its blocks are still written to
the cache (salted by version, as generation's are). The last token is scored at the
request's one sampling step (`logprob_token_ids`): a sequence as long as the context fits.
The prefill materialises float32 logits [prefill chunk tokens x vocab] for the prompt rows.

Versions: vLLM stamps every engine step's outputs with the engine's current "weight
version" and reports, on a request's final output, the spans of output tokens produced
under each version. Weights and version change only while the scheduler is paused, so a
token decoded before a pause keeps the old version even when it is delivered afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
import torch

from meshrl.compat import cuda_present
from meshrl.config import GeneratorConfig
from meshrl.generator.weight_loading import to_shared_memory

WORKER_EXTENSION = "meshrl.generator.weight_loading.MeshrlWorkerExtension"
ADAPTER_ID = 1
"""vLLM's id of the policy's LoRA adapter: one adapter, replaced in place at each version."""
RECEIVED_POLL_S = 0.005
"""How often `take_received` asks the workers for a received version while it waits."""
RPC_MIN_S = 5.0
"""The least time a bounded worker RPC is given, even past its caller's deadline: the engine
core answers between steps, so a caller with no time left (a non-blocking poll) still gets
its answer."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts."""


@dataclass
class RequestResult:
    """What one vLLM request produced (its response tokens only)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    routed_experts: torch.Tensor | None = None
    """[R, L, K] expert ids of the response tokens, when the engine returns them."""


def eos_token_ids(checkpoint_dir: str) -> list[int]:
    """EOS ids from the checkpoint's config: with skip_tokenizer_init vLLM knows no EOS."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(checkpoint_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                ids += eos if isinstance(eos, list) else [eos]
    return sorted(set(ids))


class VLLMEngine:
    """An `AsyncLLM` built from a local HF checkpoint; call `start` inside an event loop."""

    def __init__(
        self,
        gen: GeneratorConfig,
        checkpoint_dir: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 256,
        seed: int = 0,
        max_num_seqs: int | None = None,
        adapter_dir: str | None = None,
        sleep_mode: bool = False,
    ):
        self.gen = gen
        self.sleep_mode = sleep_mode and cuda_present()
        """vLLM's sleep mode (GPU only: its CuMem allocator): `sleep` frees the engine's GPU
        memory for a colocated trainer. On CPU there is nothing to free and `sleep` pauses."""
        self.adapter_dir = adapter_dir
        self.adapter_config: dict | None = None
        """The PEFT config of the LoRA adapter every request runs with (None: no adapter)."""
        if adapter_dir is not None:
            with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
                self.adapter_config = json.load(f)
            checkpoint_dir = self.adapter_config["base_model_name_or_path"]
        self.checkpoint_dir = checkpoint_dir
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.seed = seed
        self.max_num_seqs = max_num_seqs or gen.max_num_seqs
        self.stop_token_ids = eos_token_ids(checkpoint_dir)
        self.llm = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.version = 0
        self.tokens_generated = 0
        """Tokens received so far, counted as they stream in (live progress for stats)."""
        self.tokens_scored = 0
        """Tokens scored by `score` so far."""
        self.logit_temperature = 1.0
        """The model's logits are divided by this (`set_logit_temperature`)."""
        self.capture_routing = gen.return_routed_experts and not cuda_present()
        """Routed experts come from meshrl's capture on the worker (routing_capture.py: vLLM's
        V1 runner, the CPU one, returns none) instead of vLLM's own (runner V2, GPU)."""
        self.routing_shape: tuple[int, int] | None = None
        """[layers, top-k] of one token's captured routing (set by `start`)."""
        self.holds_sigterm = False
        """Whether the engine's processes keep SIGTERM ignored (`start`, compat.vllm_engine_holds_sigterm)."""

    # ---- lifecycle ------------------------------------------------------------------------
    def engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        from meshrl.compat import vllm_cpu_single_worker_executor

        return AsyncEngineArgs(
            model=self.checkpoint_dir,
            skip_tokenizer_init=True,  # token-id prompts in, token ids out
            enforce_eager=not self.gen.compile,
            dtype=self.dtype,
            tensor_parallel_size=self.gen.tp,
            distributed_executor_backend=vllm_cpu_single_worker_executor(self.gen.tp),
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gen.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            enable_return_routed_experts=self.gen.return_routed_experts and not self.capture_routing,
            worker_extension_cls=WORKER_EXTENSION,
            seed=self.seed,
            # vLLM's own per-step stats (Prometheus, iteration logs) cost its front-end, which
            # shares the engine's core on CPU, 12% of the decode time of 128 sequences on
            # one core (measured). meshrl keeps its own generator stats.
            disable_log_stats=True,
            enable_sleep_mode=self.sleep_mode,
            **self._lora_args(),
        )

    def _lora_args(self) -> dict:
        if self.adapter_config is None:
            return {}
        rank = self.adapter_config["r"]
        # vLLM sizes its LoRA buffers by max_lora_rank, one of a fixed set of values
        return dict(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in LORA_RANKS if r >= rank))

    def lora_request(self):
        """The policy's adapter, named by every generation request (None: no adapter). Its path
        is the adapter the engine starts on; later versions replace it in place (load_adapter)."""
        if self.adapter_config is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest("meshrl-policy", ADAPTER_ID, self.adapter_dir)

    async def start(self, version: int = 0) -> float:
        """Start the engine (bounded by generator.startup_timeout_s); returns seconds taken."""
        from meshrl.compat import vllm_async_llm, vllm_cpu_defaults
        from meshrl.host import gloo_on_this_host

        vllm_cpu_defaults(self.gen.startup_timeout_s)

        t0 = time.monotonic()
        # Blocking construction: vLLM bounds the engine handshake by VLLM_ENGINE_READY_TIMEOUT_S,
        # which vllm_cpu_defaults set from startup_timeout_s (before vLLM was imported here).
        # vLLM's groups span this engine's own processes only, all on this host: loopback, or
        # on a host `meshrl worker` serves, its named address (the worker set gloo's interface).
        with gloo_on_this_host():
            self.llm = vllm_async_llm(self.engine_args())  # on CPU its engine core is forked (compat.py)
        elapsed = time.monotonic() - t0
        if elapsed > self.gen.startup_timeout_s:
            self.shutdown()
            raise TimeoutError(f"vLLM engine took {elapsed:.0f}s to start (generator.startup_timeout_s={self.gen.startup_timeout_s})")
        self.loop = asyncio.get_running_loop()  # the loop `self.llm` serves (other threads submit to it)
        await self.llm.collective_rpc("meshrl_no_collection_at_exit")
        if not cuda_present():  # before the first request, which would compile the sampler's rank count
            await self.llm.collective_rpc("meshrl_eager_token_ranks")
        if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # SIGTERM is the controller's (launch/slurm_worker.py): the engine keeps it so
            self.holds_sigterm = all(await self.llm.collective_rpc("meshrl_hold_sigterm", args=(True,)))
        if self.capture_routing:
            self.routing_shape = tuple((await self.llm.collective_rpc("meshrl_capture_routing"))[0])
        await self.set_version(version)
        return elapsed

    async def release_sigterm(self, timeout_s: float = 5.0) -> None:
        """vLLM's own SIGTERM handler back in the engine's processes, before `shutdown` stops
        them with SIGTERM (else they would wait out vLLM's grace and be killed)."""
        if self.llm is not None and self.holds_sigterm:
            try:
                await asyncio.wait_for(self.llm.collective_rpc("meshrl_hold_sigterm", args=(False,)), timeout_s)
                self.holds_sigterm = False
            except Exception:  # noqa: BLE001 - a dead or stuck engine is killed by vLLM's shutdown anyway
                pass

    def shutdown(self) -> None:
        """Stop the engine's processes. A one-worker CPU engine's are killed right after vLLM's
        SIGTERM: its teardown (a full collection of its heap, its KV cache freed) would only
        delay processes about to exit, which hold no shared memory (this process's weights)."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.shutdown(timeout=0 if self.gen.tp == 1 and not cuda_present() else None)

    # ---- generation -----------------------------------------------------------------------
    def sampling_params(self, max_tokens: int, temperature: float | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        t = self.gen.temperature if temperature is None else temperature
        return SamplingParams(
            n=1,  # one request per sample: each can be aborted and resumed on its own
            temperature=t,
            top_p=self.gen.top_p if t > 0 else 1.0,
            top_k=self.gen.top_k if t > 0 else -1,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=self.stop_token_ids,
            output_kind=RequestOutputKind.DELTA,
        )

    async def run_request(self, request_id: str, token_ids: list[int], max_tokens: int, temperature: float | None = None) -> RequestResult:
        """Run one request to its end (finished, length, or aborted) and collect its tokens."""
        from vllm.inputs import TokensPrompt

        # cache_salt: a new version never reuses prefix-cache blocks computed by old weights.
        prompt = TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=f"v{self.version}")
        result = RequestResult()
        async for out in self.llm.generate(prompt, self.sampling_params(max_tokens, temperature), request_id, lora_request=self.lora_request()):
            c = out.outputs[0]
            new = list(c.token_ids)
            result.token_ids += new
            self.tokens_generated += len(new)
            if c.logprobs:
                result.logprobs += [step[tok].logprob for tok, step in zip(new, c.logprobs)]
            if out.finished:
                result.finish_reason = c.finish_reason or "abort"
                result.versions = _versions_from_spans(c.weight_versions, len(result.token_ids), self.version)
                if c.routed_experts is not None:
                    experts = torch.as_tensor(c.routed_experts)
                    result.routed_experts = experts[-len(result.token_ids) :] if result.token_ids else experts[:0]
        if self.capture_routing:
            result.routed_experts = await self.captured_routing(request_id, len(result.token_ids))
        if len(result.logprobs) != len(result.token_ids):
            raise RuntimeError(f"request {request_id}: {len(result.token_ids)} tokens but {len(result.logprobs)} logprobs")
        return result

    async def captured_routing(self, request_id: str, n: int) -> torch.Tensor | None:
        """[n, L, K] expert ids of a finished request's n sampled tokens, from the worker's capture."""
        data = (await self.llm.collective_rpc("meshrl_routed_experts", args=([(request_id, n)],)))[0][0]
        if data is None:
            return None
        if not n:
            return torch.zeros(0, *self.routing_shape, dtype=torch.int16)
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(n, *self.routing_shape)

    # ---- scoring --------------------------------------------------------------------------
    def scoring_params(self, last_token: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            # The one token vLLM must generate is thrown away, but its step scores `last_token`:
            # at temperature 1 with no top-k/top-p its processed log-probs are log_softmax of
            # the logits, as the prompt rows' are.
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_tokens=1,
            prompt_logprobs=0,  # the log-prob of each prompt token itself, no alternatives
            logprob_token_ids=[last_token],
            skip_reading_prefix_cache=True,  # cached positions would have no log-probs (module doc)
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def score(self, request_id: str, token_ids: list[int]) -> list[float]:
        """The log-prob of each of `token_ids` given the ones before it, under this engine's
        weights at its logit temperature (1 unless `set_logit_temperature`). Position 0 has
        no predecessor and gets 0.0, as in the trainer's `token_logprobs`.

        One request: all tokens but the last are its prompt, scored by vLLM's prompt
        log-probs (one prefill); the last is scored at the request's one sampling step
        (`logprob_token_ids`). So a sequence of max_model_len tokens fits, as a generated
        episode can be that long, where a prompt of all of them would be refused (vLLM
        must leave room for one new token). Base weights only: scoring engines (teachers) run
        no adapter, and vLLM's CPU LoRA kernels fail on prompt log-prob rows."""
        from vllm.inputs import TokensPrompt

        if len(token_ids) < 2:
            return [0.0] * len(token_ids)
        prompt = TokensPrompt(prompt_token_ids=list(token_ids[:-1]), cache_salt=f"v{self.version}")
        final = None
        async for out in self.llm.generate(prompt, self.scoring_params(token_ids[-1]), request_id):
            final = out
        plp = final.prompt_logprobs if final is not None else None
        step = final.outputs[0].logprobs if final is not None and final.outputs else None
        if plp is None or len(plp) != len(token_ids) - 1 or not step or token_ids[-1] not in step[0]:
            raise RuntimeError(f"request {request_id}: no log-probs for its {len(token_ids)} tokens (aborted?)")
        # plp[i]: {token id: Logprob} at prompt position i (None at 0); with prompt_logprobs=0
        # it holds the actual token (and nothing else, unless the token is also the top-1).
        scores = [0.0] + [plp[i][tok].logprob for i, tok in enumerate(token_ids[:-1]) if i > 0]
        scores.append(step[0][token_ids[-1]].logprob)
        self.tokens_scored += len(token_ids)
        return scores

    async def set_logit_temperature(self, temperature: float) -> None:
        """Divide the model's logits by `temperature` (every worker, until changed again): prompt
        log-probs, which skip the sampler's temperature, are then log_softmax(logits / T), the
        trainer's `token_logprobs` at T. Sampling then applies its own temperature on top: meant
        for an engine that only scores (a distillation teacher)."""
        if temperature <= 0:
            raise ValueError(f"logit temperature must be positive, got {temperature}")
        await self.llm.collective_rpc("meshrl_set_logit_scale", args=(1.0 / temperature,))
        self.logit_temperature = temperature

    # ---- pausing and weights ----------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        """vLLM scheduler pause: "keep" freezes requests, "abort" ends them, "wait" drains."""
        if mode == "keep":
            # The frozen requests' KV stays valid for them. `pause_generation` adds a fixed
            # 20 ms sleep after the engine has paused, for output ordering only (its own
            # comment: not needed for correctness); versions are stamped in the engine, so
            # meshrl does not need it, and it was 30% of every keep-mode update (measured).
            await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            return
        # Other modes drop the stale caches.
        await self.llm.pause_generation(mode=mode, clear_cache=True)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def sleep(self, keep_weights: bool = True) -> bool:
        """Stop generating and, with sleep mode (GPU), free the engine's GPU memory for a
        colocated trainer: the KV cache, and the weights: moved to host memory (level 1,
        `keep_weights`), or dropped (level 2; returns True) when a new version is loaded before
        it runs again (`wake_weights`, the load, `wake_up`), saving the copy out and back.
        Requests in flight are aborted (the loop sleeps it once its batch is done: none). An
        engine running a LoRA adapter keeps its weights: a version replaces the adapter alone."""
        drop = self.sleep_mode and not keep_weights and self.adapter_config is None
        if self.sleep_mode:
            await self.llm.sleep(level=2 if drop else 1, mode="abort")
        else:
            await self.pause("keep")
        return drop

    async def wake_weights(self) -> None:
        """While asleep: give the weights their GPU memory back (and their contents, after
        level 1), the KV cache staying freed and the scheduler paused, so a version can be
        loaded before `wake_up`. Nothing to do on CPU, where a sleeping engine is paused."""
        if self.sleep_mode:
            await self.llm.wake_up(tags=["weights"])

    async def wake_up(self, resume: bool = True) -> None:
        """Undo `sleep` (what `wake_weights` has not): weights and KV cache back on the GPU,
        and scheduling resumed unless `resume` is False (a user's pause outlasts the sleep:
        the engine stays frozen)."""
        if self.sleep_mode:
            await self.llm.wake_up()  # every allocation still asleep; the awake ones stay as they are
            if not resume:
                await self.pause("keep")
        elif resume:
            await self.resume()

    async def set_version(self, version: int) -> None:
        await self.llm.update_weight_version(str(version))
        self.version = version

    async def load_tensors(self, tensors: dict[str, torch.Tensor], timeout_s: float = 120.0) -> int:
        """Load full HF-named tensors through shared memory into the (paused) engine. Tensors
        fetched by weight sync are read by the engine straight from the subscriber's buffer,
        which stays unchanged until the next fetch (after this load has returned)."""
        segments = to_shared_memory(tensors, None if self.load_dtype is None else getattr(torch, self.load_dtype))
        try:
            loaded = await asyncio.wait_for(
                self.llm.collective_rpc("meshrl_load_shared_weights", args=([(s.path, s.nbytes, s.manifest) for s in segments],)),
                timeout_s,
            )
        finally:
            for s in segments:
                s.unlink()
        return int(loaded[0])

    async def load_adapter(self, tensors: dict[str, torch.Tensor], timeout_s: float = 120.0) -> int:
        """Replace the policy's LoRA adapter by PEFT-named `tensors` (the paused engine's
        requests continue with it), through shared memory as `load_tensors` does."""
        if self.adapter_config is None:
            raise RuntimeError("this engine runs no adapter: start it with adapter_dir")
        segments = to_shared_memory(tensors)
        try:
            loaded = await asyncio.wait_for(
                self.llm.collective_rpc("meshrl_load_adapter", args=([(s.path, s.nbytes, s.manifest) for s in segments], self.adapter_config, ADAPTER_ID)),
                timeout_s,
            )
        finally:
            for s in segments:
                s.unlink()
        return int(loaded[0])

    @property
    def load_dtype(self) -> str | None:
        """What floating tensors are cast to before loading: the engine's dtype, if a float one."""
        return self.dtype if self.dtype in ("float32", "bfloat16", "float16") else None

    def _adapter_arg(self) -> tuple | None:
        """(PEFT config, adapter id): a worker load goes into the LoRA adapter; None: the model."""
        return (self.adapter_config, ADAPTER_ID) if self.adapter_config is not None else None

    # ---- weights received by the engine's own workers (weight_sync.transport=collective) -----
    @property
    def receive_ranks(self) -> int:
        """Ranks this engine holds in a weight-sync broadcast group: one per worker."""
        return self.gen.tp

    async def receive_weights(self, spec, first_rank: int) -> None:
        """Have every worker join the broadcast group `spec` (worker i as `first_rank` + i) and
        receive each version into its own device's memory (module weight_loading)."""
        from dataclasses import asdict

        deadline = time.monotonic() + spec.timeout_s
        # vLLM's RPC carries plain data: the spec goes as a dict
        await self._rpc_until(deadline, "meshrl_ws_connect", asdict(spec), first_rank)
        # The group forms once every peer joined; a worker's failed join is an error now,
        # not a publisher left waiting out the timeout.
        while not all(await self._rpc_until(deadline, "meshrl_ws_joined")):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the engine's workers did not join the weight-sync group within {spec.timeout_s:.0f}s")
            await asyncio.sleep(RECEIVED_POLL_S)

    async def _rpc_until(self, deadline: float, method: str, *args) -> list:
        """A worker RPC bounded by `deadline` (time.monotonic()): TimeoutError after it, so a
        stuck engine core never holds its caller."""
        try:
            return await asyncio.wait_for(self.llm.collective_rpc(method, args=args), max(RPC_MIN_S, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise TimeoutError(f"the engine's workers did not answer {method} in time") from None

    async def stop_receiving(self, timeout_s: float = 30.0) -> None:
        await self._rpc_until(time.monotonic() + timeout_s, "meshrl_ws_close")

    async def take_received(self, min_version: int, wait_s: float) -> int | None:
        """The newest version >= min_version every worker has received, handed out for
        `load_received`; None if none arrived within wait_s. Polls the workers (a small RPC
        the engine core answers between steps)."""
        deadline = time.monotonic() + wait_s
        while True:
            # one round trip: each worker hands out its newest version >= min_version
            taken = await self._rpc_until(deadline, "meshrl_ws_take", min_version)
            if min(taken) >= min_version:
                if len(set(taken)) == 1:
                    return taken[0]
                min_version = max(taken)  # tp workers mid-way through a newer one: agree on it
                continue
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(RECEIVED_POLL_S)

    async def load_received(self, version: int, timeout_s: float = 120.0) -> int:
        """Load the handed-out received `version` into the (paused) engine, in place from the
        workers' receive buffers (the LoRA adapter, when the engine runs one)."""
        loaded = await asyncio.wait_for(self.llm.collective_rpc("meshrl_ws_load", args=(version, self.load_dtype, self._adapter_arg())), timeout_s)
        return int(loaded[0])

    async def load_gpu_slot(self, slot, timeout_s: float = 120.0) -> int:
        """Load a version from the trainer's GPU staging slot (a weightsync GpuSlot: one GPU
        shared with the trainer) into the (paused) engine, in place through CUDA IPC."""
        loaded = await asyncio.wait_for(self.llm.collective_rpc("meshrl_load_ipc", args=(slot.blob, self.load_dtype, self._adapter_arg())), timeout_s)
        return int(loaded[0])

    async def weights_checksum(self) -> float:
        return float((await self.llm.collective_rpc("meshrl_weights_checksum"))[0])


def _versions_from_spans(spans, n: int, default: int) -> list[int]:
    """Per-token versions from vLLM's [start, end) weight-version spans."""
    versions = [default] * n
    for span in spans or []:
        try:
            v = int(span.version)
        except ValueError:
            continue  # vLLM's "default" before the first set_version: keep `default`
        for i in range(span.start, min(span.end, n)):
            versions[i] = v
    return versions
