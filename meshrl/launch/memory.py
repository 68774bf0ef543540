"""The GPU memory plan: what each proc of the device plan will hold on its GPU, and the host
RAM that loading and export take, worked out from the model's shape and the run's settings
before any mesh starts. A plan that cannot fit is refused in one line naming the field to
change (`check_memory`); `meshrl config plan` prints it under the device plan.

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
Colocated (one GPU shared, vLLM asleep while the trainer steps): the GPU's peak is the
larger of the training phase (the trainer's whole step; the engine asleep holds its context)
and the generation phase (the engine's budget beside what the trainer keeps: its weights and
staging slots, with gradients freed and its allocator cache emptied, and AdamW's state
unless it is offloaded to host memory, `trainer.offload_optimizer`).

Activations per token per layer are a count of the tensors a TorchTitan Qwen3/Llama block
saves for backward (`activation_bytes_per_token_layer`); benchmarks/long_rows.py measured the
whole step at 1.05x this count on CPU without checkpointing (fp32, dim 512).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshrl.config import Config, ConfigError
from meshrl.launch.shape import DTYPE_BYTES, Shape, model_shape

GiB = float(1 << 30)
CUDA_CONTEXT = 0.5 * GiB
"""A CUDA context and its kernels' workspace (cuBLAS, NCCL): about this much on recent GPUs."""
LOGIT_CHUNK = 1024
"""Tokens per LM-head chunk (meshrl/trainer/logprobs.py `token_logprobs`' chunk_size)."""
HEADROOM = 0.95
"""Plans are held to this share of a GPU: the allocator's fragmentation and what is not counted."""


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


@dataclass
class GPUPlan:
    where: tuple[str, int, int]
    """(host mesh, host, GPU index)."""
    holdings: list[Holding] = field(default_factory=list)

    @property
    def colocated(self) -> bool:
        return len({h.role == "trainer" for h in self.holdings}) > 1

    @property
    def peak(self) -> float:
        if not self.colocated:
            return sum(h.total for h in self.holdings)
        trainer = [h for h in self.holdings if h.role == "trainer"]
        engines = [h for h in self.holdings if h.role != "trainer"]
        asleep = CUDA_CONTEXT * len(engines)  # level-2 sleep frees the engine's weights and KV cache
        return max(sum(h.total for h in trainer) + asleep, sum(h.while_generating for h in trainer) + sum(h.total for h in engines))


@dataclass
class MemoryPlan:
    capacity: float
    """Bytes per GPU (`launcher.gpu_memory_gib`, else the GPU's own)."""
    gpus: list[GPUPlan]
    host_ram: dict[tuple[str, int], list[tuple[str, float]]]
    offload_optimizer: bool
    problems: list[tuple[str, str]]
    """(field, what does not fit and the fix), most important first."""

    def gpu(self, mesh: str, host: int, index: int) -> GPUPlan:
        return next(g for g in self.gpus if g.where == (mesh, host, index))

    def table(self) -> str:
        lines = [
            f"memory plan: {self.capacity / GiB:.1f} GiB per GPU (held to {HEADROOM:.0%})"
            + ("; AdamW state offloaded to host memory while the engines generate" if self.offload_optimizer else "")
        ]
        groups: list[list[GPUPlan]] = []  # GPUs holding the same things are listed once
        for gpu in self.gpus:
            same = groups and groups[-1][0].where[:2] == gpu.where[:2] and _contents(groups[-1][0]) == _contents(gpu)
            groups[-1].append(gpu) if same else groups.append([gpu])
        for group in groups:
            gpu, (mesh, host, _) = group[0], group[0].where
            which = f"GPU {gpu.where[2]}" if len(group) == 1 else f"GPUs {group[0].where[2]}-{group[-1].where[2]}, each"
            lines.append(f"  {mesh}[{host}] {which}: peak {gpu.peak / GiB:.2f} GiB" + (" (colocated)" if gpu.colocated else ""))
            for i, h in enumerate(gpu.holdings):
                kept = f"; keeps {h.while_generating / GiB:.2f} GiB while the engines generate" if gpu.colocated and h.role == "trainer" else ""
                indices = sorted({g.holdings[i].index for g in group})
                who = str(indices[0]) if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"
                lines.append(f"    {h.role} {who}: {h.total / GiB:.2f} GiB{kept}")
                lines += [f"      {what}: {b / GiB:.2f} GiB" for what, b in h.lines if b > 0]
                lines += [f"      ({note})" for note in h.notes]
        for (mesh, host), items in self.host_ram.items():
            lines.append(f"  {mesh}[{host}] host RAM: " + "; ".join(f"{what} {b / GiB:.1f} GiB" for what, b in items))
        lines += [f"does not fit: {f}: {why}" for f, why in self.problems]
        return "\n".join(lines) + "\n"


def _contents(gpu: GPUPlan) -> list:
    return [(h.role, h.lines, h.notes) for h in gpu.holdings]


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
    return h


def critic_holding(config: Config, shape: Shape, rank: int = 0) -> Holding:
    """PPO's critic: the policy's shape with a one-value head, trained in full, sharded by
    FSDP over its `critic.procs` procs, no activation checkpointing, no KL reference, nothing
    staged for weight sync. Counted as a trainer rank of that kind (its LM head counted
    whole: a little over), at the shape of `critic.path` where it names a checkpoint of its own."""
    if config.critic.path is not None:
        shape = model_shape(config, config.critic.path)
    return _one_proc_holding(
        config, shape, "critic", rank, config.critic.micro_batch_size, reference=False, dtype=config.trainer.compute_dtype, procs=config.critic.procs
    )


def _one_proc_holding(config: Config, shape: Shape, role: str, index: int, rows: int, reference: bool, dtype: str, procs: int = 1) -> Holding:
    """A model trained in full beside the trainer (the critic, an implicit PRM): a trainer
    rank's holding, sharded over `procs` (1: unsharded), `rows` rows of model.max_seq_len a
    forward, a frozen float32 reference copy where it keeps one, computing in `dtype`, nothing staged."""
    t = replace(config.trainer, procs=procs, tp=1, cp=1, dp_shard=-1, activation_checkpoint="none", micro_batch_size=rows, micro_batch_tokens=0)
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
        return _one_proc_holding(config, shape, "scorer", index, -(-spec.batch_size // spec.procs), reference=True, dtype="float32", procs=spec.procs)
    if spec.kind == "judge":
        try:
            return generator_holding(config, model_shape(config, spec.path), "scorer", index, capacity, False)
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


def gpu_capacity(config: Config) -> float:
    """Bytes per GPU: `launcher.gpu_memory_gib`, else the first visible GPU's (NVML; 0 when none)."""
    if config.launcher.gpu_memory_gib > 0:
        return config.launcher.gpu_memory_gib * GiB
    from meshrl.compat import nvml_gpu_memory

    return float(nvml_gpu_memory() or 0)


def plan_memory(config: Config, capacity: float | None = None, plan=None) -> MemoryPlan | None:
    """The memory plan of `config`'s device plan (`plan`: the allocation's, else worked out
    here); None on a CPU plan, or when the GPUs' size is unknown (no GPU here and
    `launcher.gpu_memory_gib` unset)."""
    from meshrl.launch.devices import plan_devices

    plan = plan or plan_devices(config)
    capacity = gpu_capacity(config) if capacity is None else capacity
    if plan.layout == "cpu" or capacity <= 0:
        return None
    out = _one_model(config, capacity, plan.view("policy"))
    for i, m in enumerate(config.models):  # each trained model beside the policy, on GPUs of its own (placement split)
        mine = _one_model(config.for_model(m.name), capacity, plan.view(m.name))
        for h in (h for gpu in mine.gpus for h in gpu.holdings):
            h.role = f"{m.name}/{h.role}"
        out.gpus += mine.gpus
        for where, items in mine.host_ram.items():
            out.host_ram.setdefault(where, []).extend((f"{m.name}'s {what}", b) for what, b in items)
        own = ("model", "trainer", "generator")  # the sections a trained model sets for itself; the rest are the run's
        out.problems += [(f"models[{i}].{f}" if f.partition(".")[0] in own else f, f"trained model {m.name}: {why}") for f, why in mine.problems]
    return out


def _one_model(config: Config, capacity: float, plan) -> MemoryPlan:
    """The memory plan of one trained model's slots (`plan`: its view of the device plan)."""
    from meshrl.launch.devices import resolve_transport, weights_on_gpu

    shape = model_shape(config)
    teacher = model_shape(config, config.distill.teacher) if config.distill.teacher else shape
    transport = resolve_transport(config)
    staging_on_gpu = weights_on_gpu(plan, transport)
    receive_on_gpu = transport == "collective" and staging_on_gpu
    gpus: dict[tuple[str, int, int], GPUPlan] = {}
    for slot in plan.slots:
        for gpu in slot.gpus:
            where = (slot.mesh, slot.host, gpu)
            holding = (
                trainer_holding(config, shape, slot.index, staging_on_gpu)
                if slot.role == "trainer"
                else critic_holding(config, shape, slot.index)
                if slot.role == "critic"
                else scorer_holding(config, slot.index, capacity)
                if slot.role == "scorer"
                else generator_holding(
                    config, teacher if slot.role == "teacher" else shape, slot.role, slot.index, capacity, receive_on_gpu and slot.role != "teacher"
                )
            )  # a teacher's weights never change
            gpus.setdefault(where, GPUPlan(where)).holdings.append(holding)
    out = MemoryPlan(capacity, list(gpus.values()), host_ram(config, shape, plan), False, [])
    colocated = [g for g in out.gpus if g.colocated]
    offload = config.trainer.offload_optimizer
    if offload == "always" or offload == "auto" and any(g.peak > HEADROOM * capacity for g in colocated):
        out.offload_optimizer = bool(colocated)
        for g in colocated:
            for h in g.holdings:
                if h.kept is not None:
                    h.kept.discard("AdamW moments (2 x float32)")
    out.problems = problems(config, shape, out)
    return out


def host_ram(config: Config, shape: Shape, plan) -> dict[tuple[str, int], list[tuple[str, float]]]:
    """Per trainer host: the checkpoint's files, mapped once (the page cache every rank of the
    host reads), the float32 copy of its largest tensor each rank makes while loading, and on
    rank 0's host the export's whole-model copy in `model.dtype`."""
    db = DTYPE_BYTES[config.model.dtype]
    out: dict[tuple[str, int], list[tuple[str, float]]] = {}
    largest = shape.vocab * shape.dim * 4
    for slot in plan.slots:
        if slot.role != "trainer":
            continue
        items = out.setdefault((slot.mesh, slot.host), [])
        if not items:
            if config.model.path is not None:
                items.append(("checkpoint files mapped", float(checkpoint_bytes(config.model.path))))
            items.append(("loading, per rank", 0.0))
            if slot.index == 0:
                items.append(("export on rank 0", shape.params * db))
        items[[w for w, _ in items].index("loading, per rank")] = ("loading, per rank", largest)
    return out


def checkpoint_bytes(path: str) -> int:
    import os

    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def problems(config: Config, shape: Shape, plan: MemoryPlan) -> list[tuple[str, str]]:
    """What does not fit, each as (field, the fix): the first GPU's line for each field."""
    cap, g, db = plan.capacity, config.generator, DTYPE_BYTES[config.model.dtype]
    out: list[tuple[str, str]] = []
    weights = shape.params * db / g.tp
    budget = g.gpu_memory_utilization * cap
    if weights + ENGINE_WORKSPACE > budget:
        need = (weights + ENGINE_WORKSPACE + shape.kv_bytes_per_token(db) / g.tp * config.model.max_seq_len) / cap
        out.append(
            (
                "generator.gpu_memory_utilization",
                f"vLLM's budget of {budget / GiB:.1f} GiB cannot hold the model's weights ({weights / GiB:.1f} GiB per GPU at generator.tp={g.tp}) "
                f"and a KV cache: raise it to {min(need, 0.95):.2f}" + (" or raise generator.tp" if need > 0.95 else ""),
            )
        )
    elif budget - weights - ENGINE_WORKSPACE < shape.kv_bytes_per_token(db) / g.tp * config.model.max_seq_len:
        out.append(
            (
                "generator.gpu_memory_utilization",
                f"after the weights, vLLM's budget of {budget / GiB:.1f} GiB holds less KV cache than one sequence of "
                f"model.max_seq_len={config.model.max_seq_len} tokens: raise it, or lower model.max_seq_len",
            )
        )
    for gpu in plan.gpus:
        if gpu.peak <= HEADROOM * cap:
            continue
        mesh, host, index = gpu.where
        at = f"{mesh}[{host}] GPU {index} needs {gpu.peak / GiB:.1f} GiB of {cap / GiB:.0f} GiB"
        trainer = next((h for h in gpu.holdings if h.role == "trainer"), None)
        if gpu.colocated:
            engines = [h for h in gpu.holdings if h.role != "trainer"]
            if trainer.total + CUDA_CONTEXT * len(engines) > HEADROOM * cap:  # the engines asleep
                out.append(_trainer_fix(config, trainer, at + " for the trainer's step alone", cap))
            else:
                # what the engines' budgets may take beside the trainer's share and their own contexts
                room = HEADROOM * cap - trainer.while_generating - sum(h.total - budget for h in engines)
                out.append(
                    (
                        "generator.gpu_memory_utilization",
                        f"{at} while the engines generate beside what the trainer keeps ({trainer.while_generating / GiB:.1f} GiB"
                        + (", AdamW state offloaded" if plan.offload_optimizer else "")
                        + f"): lower it to at most {max(room / cap / len(engines), 0):.2f}"
                        + ("" if plan.offload_optimizer else ", or set trainer.offload_optimizer=always")
                        + ", or give trainer and generators GPUs of their own (placement=split)",
                    )
                )
        elif trainer is not None:
            out.append(_trainer_fix(config, trainer, at, cap))
        elif gpu.holdings[0].role == "critic":
            out.append(
                (
                    "critic.procs",
                    f"{at} for the critic's step: shard it over more procs (critic.procs={2 * config.critic.procs}), lower critic.micro_batch_size, "
                    "or set trainer.device=cpu (the critic beside a CPU trainer)",
                )
            )
        else:
            out.append(
                (
                    "weight_sync.transport",
                    f"{at}: the collective transport's receive buffers hold two copies of the whole model "
                    "on every generator GPU beside vLLM's budget: lower generator.gpu_memory_utilization, or "
                    "use weight_sync.transport=rdma (host buffers)",
                )
            )
    firsts: dict[str, str] = {}
    for f, why in out:
        firsts.setdefault(f, why)
    return list(firsts.items())


def _trainer_fix(config: Config, trainer: Holding, at: str, cap: float) -> tuple[str, str]:
    """The field whose change shrinks the trainer's largest share."""
    lines = dict(trainer.lines)
    state = sum(b for w, b in lines.items() if w.startswith(("weights", "gradients", "AdamW", "KL reference")))
    activations = sum(b for w, b in lines.items() if w.startswith("activations"))
    biggest = f"(weights, gradients and AdamW state {state / GiB:.1f} GiB, activations {activations / GiB:.1f} GiB)"
    t = config.trainer
    scores = lines.get("attention scores (float32 compute: the math kernel)", 0.0)
    if scores > max(state, activations):
        return "trainer.compute_dtype", (
            f"{at}, {scores / GiB:.1f} GiB of it float32 attention scores (flash and cuDNN attention take only half precision): set it to bfloat16 (or auto)"
        )
    staging = lines.get("weight-sync staging (2 slots)", 0.0)
    if staging and trainer.total - staging <= HEADROOM * cap:  # fits but for the slots
        return "weight_sync.transport", (
            f"{at}: rank 0 stages two whole copies of the model ({staging / GiB:.1f} GiB) on its GPU for the "
            "collective transport's broadcast: use weight_sync.transport=rdma (host buffers)"
        )
    if activations > state:
        if t.activation_checkpoint != "full":
            return "trainer.activation_checkpoint", f"{at} {biggest}: set it to full, or lower the micro-batch's tokens"
        return ("trainer.micro_batch_tokens" if t.micro_batch_tokens else "trainer.micro_batch_size"), f"{at} {biggest}: lower it" + (
            "" if t.cp > 1 else ", or split long rows over GPUs with trainer.cp"
        )
    lora = config.trainer.loss.advantage != "gae"  # a critic refuses adapters
    return "trainer.procs", f"{at} {biggest}: shard them over more trainer procs (GPUs)" + (", or train LoRA adapters (lora.rank)" if lora else "")


def check_memory(config: Config, devices=None) -> MemoryPlan | None:
    """Refuse, in one line naming the field, a GPU plan that cannot fit; the plan otherwise.
    `devices`: the device plan, where the caller has it."""
    plan = plan_memory(config, plan=devices)
    if plan is not None and plan.problems:
        raise ConfigError(*plan.problems[0])
    return plan
