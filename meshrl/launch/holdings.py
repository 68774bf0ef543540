"""What one proc of the device plan holds on its GPU, worked out from the model's shape and
the run's settings (meshrl/launch/memory.py adds these up per GPU).

What is counted, per GPU (bytes; `P` parameters, `N` the procs a parameter is sharded over,
FSDP's data-parallel shards x CP x TP):
- trainer rank: float32 weights `4P/N`; gradients `4P/N` and AdamW's two moments `8P/N`
  (trainable parameters only: LoRA's adapters); the KL reference's float32 weights `4P/N`;
  the blocks FSDP gathers (two blocks in the compute dtype in flight, one block's float32
  gradient before its reduce-scatter, and the LM head); activations at the micro-batch's
  tokens (`activation_bytes_per_token_layer`, by checkpointing mode, divided over CP); the LM
  head's float32 chunk (meshrl/trainer/logprobs.py: 1024 tokens x vocabulary, three
  buffers) and the gathered hidden states; on rank 0, weight-sync staging slots on the GPU
  (two copies in `model.dtype` of what each version sends: the model, or LoRA's adapters)
  and the one gathered tensor being copied.
- generator replica, per TP worker: vLLM's budget (`generator.gpu_memory_utilization` of the
  GPU), inside which the weights `P x dtype / tp` and the KV cache sit; with the collective
  transport, the receive buffers outside it (two copies of what each version sends per worker).
- each proc: its CUDA context (`CUDA_CONTEXT`).
- `trainer.compute_dtype=float32` on GPU: attention falls back to SDPA's math kernel, which
  keeps each layer's float32 scores and softmax (tokens x attended positions x heads).

Activations per token per layer are a count of the tensors a TorchTitan Qwen3/Llama block
saves for backward (`activation_bytes_per_token_layer`); benchmarks/long_rows.py measured the
whole step at 1.05x this count on CPU without checkpointing (fp32, dim 512).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshrl.config import Config
from meshrl.launch.shape import DTYPE_BYTES, Shape, model_shape

GiB = float(1 << 30)
CUDA_CONTEXT = 0.5 * GiB
"""A CUDA context and its kernels' workspace (cuBLAS, NCCL): about this much on recent GPUs."""
LOGIT_CHUNK = 1024
"""Tokens per LM-head chunk (meshrl/trainer/logprobs.py `token_logprobs`' chunk_size)."""


@dataclass
class Holding:
    """What one proc keeps on one GPU: (item, bytes) lines that add up, and notes that do not."""

    role: str
    index: int
    lines: list[tuple[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kept: set[str] | None = None
    """Colocated trainer: the lines it keeps while the engines generate (None: all)."""

    @property
    def total(self) -> float:
        return sum(b for _, b in self.lines)

    @property
    def while_generating(self) -> float:
        return sum(b for w, b in self.lines if self.kept is None or w in self.kept)


def shards(config: Config) -> int:
    """Procs one parameter is split over: FSDP's data-parallel shards x CP x TP."""
    t = config.trainer
    dp = t.procs // (t.tp * t.cp)
    return (dp if t.dp_shard == -1 else t.dp_shard) * t.cp * t.tp


def trainer_holding(config: Config, shape: Shape, rank: int, staging_on_gpu: bool) -> Holding:
    t, m = config.trainer, config.model
    cb = 4 if t.compute_dtype == "float32" else 2  # auto on GPU: bfloat16
    db = DTYPE_BYTES[m.dtype]
    P, n = shape.params, shards(config)
    trainable = P if config.lora.rank == 0 else lora_params(config, shape)
    h = Holding("trainer", rank)
    h.lines += [("weights (float32)", 4 * P / n), ("gradients (float32)", 4 * trainable / n), ("AdamW moments (2 x float32)", 8 * trainable / n)]
    if t.loss.kl_coef > 0:
        h.lines.append(("KL reference weights (float32)", 4 * P / n))
    head = shape.vocab * shape.dim
    h.lines.append(("blocks gathered by FSDP", (2 * shape.layer_params * cb + shape.layer_params * 4 + head * cb) / t.tp))
    tokens = (t.micro_batch_tokens or t.micro_batch_size * m.max_seq_len) / t.cp
    activations = tokens * shape.layers * shape.activation_bytes_per_token_layer(t.activation_checkpoint, cb)
    if t.activation_checkpoint == "full":  # the block being recomputed holds its activations once
        activations += tokens * shape.activation_bytes_per_token_layer("none", cb)
    h.lines.append((f"activations ({t.activation_checkpoint} checkpointing, {tokens:.0f} tokens)", activations))
    if t.compute_dtype == "float32":  # flash and cuDNN attention take half precision: SDPA falls back to its math kernel
        kept_layers = 1 if t.activation_checkpoint == "full" else shape.layers
        scores = tokens * min(m.max_seq_len, tokens * t.cp) * shape.heads / t.tp * 4 * 2 * kept_layers  # scores and softmax, per kept layer
        h.lines.append(("attention scores (float32 compute: the math kernel)", scores))
    h.lines.append(("LM head chunk and hidden states", 3 * LOGIT_CHUNK * shape.vocab * 4 + tokens * shape.dim * 4))
    if staging_on_gpu and rank == 0:
        h.lines += [
            ("weight-sync staging (2 slots)", 2 * synced_params(config, shape) * db),
            ("one gathered tensor", (head if config.lora.rank == 0 else 0) * db),
        ]
    h.lines.append(("CUDA context", CUDA_CONTEXT))
    h.kept = {"weights (float32)", "KL reference weights (float32)", "weight-sync staging (2 slots)", "CUDA context", "AdamW moments (2 x float32)"}
    if t.pace.accumulate:  # a held step's gradients wait for the next update
        h.kept.add("gradients (float32)")
    return h


def critic_checkpointing(config: Config) -> str:
    """The critic's activation checkpointing: the policy's trainer.activation_checkpoint, but
    `full` for `memory_budget`, which needs compiled blocks (the critic's are not compiled)."""
    mode = config.trainer.activation_checkpoint
    return "full" if mode == "memory_budget" else mode


def critic_holding(config: Config, shape: Shape, rank: int = 0) -> Holding:
    """PPO's critic: the policy's shape with a one-value head, trained in full, sharded by
    FSDP over its `critic.procs` procs, checkpointed as `critic_checkpointing` says, its rows
    packed to trainer.micro_batch_tokens where that is set (else critic.micro_batch_size rows
    a forward), no KL reference, nothing staged for weight sync. Counted as a trainer rank of
    that kind (its LM head counted whole: a little over), at the shape of `critic.path` where
    it names a checkpoint of its own."""
    if config.critic.path is not None:
        shape = model_shape(config, config.critic.path)
    return _one_proc_holding(
        config,
        shape,
        "critic",
        rank,
        config.critic.micro_batch_size,
        reference=False,
        dtype=config.trainer.compute_dtype,
        procs=config.critic.procs,
        checkpointing=critic_checkpointing(config),
        tokens=config.trainer.micro_batch_tokens,
    )


def _one_proc_holding(
    config: Config, shape: Shape, role: str, index: int, rows: int, reference: bool, dtype: str, procs: int = 1, checkpointing: str = "none", tokens: int = 0
) -> Holding:
    """A model trained in full beside the trainer (the critic, an implicit PRM): a trainer
    rank's holding, sharded over `procs` (1: unsharded), `rows` rows of model.max_seq_len a
    forward (or `tokens` packed), a frozen float32 reference copy where it keeps one, computing
    in `dtype`, nothing staged."""
    t = replace(config.trainer, procs=procs, tp=1, cp=1, dp_shard=-1, activation_checkpoint=checkpointing, micro_batch_size=rows, micro_batch_tokens=tokens)
    t = replace(t, compute_dtype=dtype, loss=replace(t.loss, kl_coef=1.0 if reference else 0.0))
    h = trainer_holding(replace(config, trainer=t, lora=replace(config.lora, rank=0)), shape, 0, staging_on_gpu=False)
    return replace(h, role=role, index=index)


def synced_params(config: Config, shape: Shape) -> int:
    """Parameters weight sync sends each version: the whole model, or under LoRA the
    adapters alone (on GPUs vLLM runs every family's adapters: compat.vllm_runs_lora_on)."""
    return shape.params if config.lora.rank == 0 else lora_params(config, shape)


def lora_params(config: Config, shape: Shape) -> int:
    """LoRA adapter parameters: rank x (in + out) per targeted projection and layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sizes = {
        "q_proj": (shape.dim, q),
        "k_proj": (shape.dim, kv),
        "v_proj": (shape.dim, kv),
        "o_proj": (q, shape.dim),
        "gate_proj": (shape.dim, shape.ffn),
        "up_proj": (shape.dim, shape.ffn),
        "down_proj": (shape.ffn, shape.dim),
    }
    return shape.layers * sum(config.lora.rank * (i + o) for name, (i, o) in sizes.items() if name in config.lora.targets)


def generator_holding(config: Config, shape: Shape, role: str, index: int, capacity: float, receive_on_gpu: bool) -> Holding:
    g, db = config.generator, DTYPE_BYTES[config.model.dtype]
    budget = g.gpu_memory_utilization * capacity
    weights = shape.params * db / g.tp
    kv = budget - weights - ENGINE_WORKSPACE
    h = Holding(role, index, [(f"vLLM budget ({g.gpu_memory_utilization:.0%} of the GPU)", budget), ("CUDA context", CUDA_CONTEXT)])
    h.notes.append(
        f"in the budget: weights {weights / GiB:.2f} GiB (1/{g.tp}), KV cache {max(kv, 0) / GiB:.2f} GiB = "
        f"{max(kv, 0) / (shape.kv_bytes_per_token(db) / g.tp):,.0f} tokens"
    )
    if receive_on_gpu:
        what = "model copies" if config.lora.rank == 0 else "adapter copies"
        h.lines.append((f"weight receive buffers (2 {what}, outside vLLM's budget)", 2 * synced_params(config, shape) * db))
    return h


def scorer_holding(config: Config, index: int, capacity: float) -> Holding:
    """Scorer slot `index`: a judge is a vLLM engine on its checkpoint (as a generator, never
    updated); a reward model its weights as loaded (its files: `dtype="auto"` keeps their
    dtype) and one batch's activations. Either may be of a family the trainer does not build:
    its shape is then read no further than config.json (a judge: vLLM's budget alone)."""
    import json
    import os

    from meshrl.launch.devices import scorer_slots

    spec = config.scoring.scorers[scorer_slots(config)[index][0]]
    if spec.kind == "prm":  # trains in float32 on its share of each batch, beside its frozen starting copy (pi_ref), over `procs`
        shape = model_shape(config, spec.path) if spec.path else model_shape(config)
        rows = max(spec.batch_size, config.generator.group_size)  # a batch holds whole groups, at least one
        return _one_proc_holding(config, shape, "scorer", index, -(-rows // spec.procs), reference=True, dtype="float32", procs=spec.procs)
    if spec.kind == "judge":
        try:
            one_gpu = replace(config, generator=replace(config.generator, tp=1))  # its engine's (scorers/backends.Judge)
            return generator_holding(one_gpu, model_shape(config, spec.path), "scorer", index, capacity, False)
        except ValueError:  # not a trainer family: no weights and KV breakdown, the budget holds either way
            g = config.generator
            return Holding(
                "scorer",
                index,
                [(f"vLLM budget ({g.gpu_memory_utilization:.0%} of the GPU)", g.gpu_memory_utilization * capacity), ("CUDA context", CUDA_CONTEXT)],
            )
    with open(os.path.join(spec.path, "config.json")) as f:
        hidden = json.load(f).get("hidden_size", 0)
    db = DTYPE_BYTES[config.model.dtype]
    return Holding(
        "scorer",
        index,
        [
            ("reward model weights", float(checkpoint_bytes(spec.path))),
            ("CUDA context", CUDA_CONTEXT),
            (f"one batch's activations ({spec.batch_size} x {spec.max_len} tokens)", spec.batch_size * spec.max_len * hidden * db * 4),
        ],
    )


ENGINE_WORKSPACE = 1.0 * GiB
"""What vLLM's profiling run takes inside its budget beside weights and KV cache (activations,
sampler, CUDA graphs) at small batch sizes; the KV estimate leaves it out."""


def checkpoint_bytes(path: str) -> int:
    import os

    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
