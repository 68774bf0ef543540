"""The GPU memory plan: what each proc of the device plan will hold on its GPU, and the host
RAM that loading and export take, worked out from the model's shape and the run's settings
before any mesh starts. A plan that cannot fit is refused in one line naming the field to
change (`check_memory`); `meshrl config plan` prints it under the device plan.

What one proc holds (trainer rank, critic, generator replica, scorer) is counted in
meshrl/launch/holdings.py; here those holdings are added up per GPU.
Colocated (one GPU shared, vLLM asleep while the trainer steps): the GPU's peak is the
larger of the training phase (the trainer's whole step; the engine asleep holds its context)
and the generation phase (the engine's budget beside what the trainer keeps: its weights and
staging slots, with gradients freed and its allocator cache emptied, and AdamW's state
unless it is offloaded to host memory, `trainer.offload_optimizer`). Trained models beside
the policy share the same GPUs: their engines generate at once, their trainers step in turn,
each beside what the others keep.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

from meshrl.compat import cuda_present
from meshrl.config import Config, ConfigError
from meshrl.launch.holdings import (
    CUDA_CONTEXT,
    ENGINE_WORKSPACE,
    GiB,
    Holding,
    checkpoint_bytes,
    critic_holding,
    generator_holding,
    scorer_holding,
    synced_params,
    trainer_holding,
)
from meshrl.launch.shape import DTYPE_BYTES, Shape, model_shape

HEADROOM = 0.95
"""Plans are held to this share of a GPU: the allocator's fragmentation and what is not counted."""


@dataclass
class GPUPlan:
    where: tuple[str, int, int]
    """(host mesh, host, GPU index)."""
    holdings: list[Holding] = field(default_factory=list)

    @property
    def colocated(self) -> bool:
        return len({_trains(h) for h in self.holdings}) > 1

    @property
    def engines(self) -> list[Holding]:
        """The generator replicas' holdings: colocated, they sleep while the trainers step."""
        return [h for h in self.holdings if _sleeps(h)]

    @property
    def resident(self) -> float:
        """What never sleeps beside the trainers and engines (a judge, a reward model, a PRM)."""
        return sum(h.total for h in self.holdings if _resident(h))

    @property
    def peak(self) -> float:
        if not self.colocated:
            return sum(h.total for h in self.holdings)
        trainers = [h for h in self.holdings if _trains(h)]
        engines = self.engines
        asleep = CUDA_CONTEXT * len(engines)  # level-2 sleep frees the engine's weights and KV cache
        kept = sum(h.while_generating for h in trainers) + self.resident  # what trainers keep while the engines generate
        # trained models' trainers step in turn, each freeing its step's memory before the next
        stepping = max(h.total - h.while_generating for h in trainers) + kept + asleep
        return max(stepping, kept + sum(h.total for h in engines))


def _trains(h: Holding) -> bool:
    """A trainer rank's holding: the policy's (`trainer`) or a trained model's (`NAME/trainer`)."""
    return h.role.rpartition("/")[2] == "trainer"


def _sleeps(h: Holding) -> bool:
    """A generator replica's holding (the policy's, a trained or a frozen model's): colocated,
    it sleeps while the trainers step (controller/loop.py `_pools`)."""
    return h.role.rpartition("/")[2] == "generator"


def _resident(h: Holding) -> bool:
    """Neither: a scorer (a judge, a reward model, a PRM), a teacher, a critic: held throughout."""
    return not (_trains(h) or _sleeps(h))


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
                kept = f"; keeps {h.while_generating / GiB:.2f} GiB while the engines generate" if gpu.colocated and _trains(h) else ""
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


def gpu_capacity(config: Config) -> float:
    """Bytes per GPU: `launcher.gpu_memory_gib`, else the first visible GPU's (NVML; 0 when none)."""
    if config.launcher.gpu_memory_gib > 0:
        return config.launcher.gpu_memory_gib * GiB
    return float(nvml_gpu_memory() or 0)


def nvml_gpu_memory() -> int | None:
    """Bytes of memory of this process's first GPU, read through NVML (CUDA stays
    uninitialised, see `compat.cuda_present`); None without a GPU or NVML."""
    if not cuda_present():
        return None
    try:
        import pynvml  # nvidia-ml-py: vLLM depends on it

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        handle = pynvml.nvmlDeviceGetHandleByUUID(visible) if visible.startswith("GPU-") else pynvml.nvmlDeviceGetHandleByIndex(int(visible))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # noqa: BLE001 - no NVML library or an unreadable device: size unknown
        return None


def plan_memory(config: Config, capacity: float | None = None, plan=None) -> MemoryPlan | None:
    """The memory plan of `config`'s device plan (`plan`: the allocation's, else worked out
    here); None on a CPU plan, or when the GPUs' size is unknown (no GPU here and
    `launcher.gpu_memory_gib` unset)."""
    from meshrl.launch.devices import plan_devices, resolve_placement, resolve_transport

    plan = plan or plan_devices(config)
    if plan.layout == "cpu":  # before asking NVML, whose binding comes with torch (compat.py)
        return None
    if "auto" in (config.placement, config.weight_sync.transport):  # as the run settles them (pinning.settle_layout), before
        config = copy.deepcopy(config)  # each model's view inherits them: one model's view alone may resolve otherwise
        config.placement = resolve_placement(config)[0]
        config.weight_sync.transport = resolve_transport(config)
    capacity = gpu_capacity(config) if capacity is None else capacity
    if capacity <= 0:
        return None
    out = _one_model(config, capacity, plan.view("policy"))
    for i, m in enumerate(config.models):  # each trained model beside the policy: on GPUs of its own, or colocated on the policy's
        mine = _one_model(config.for_model(m.name), capacity, plan.view(m.name), frozen=m.frozen)
        for gpu in mine.gpus:
            for h in gpu.holdings:
                h.role = f"{m.name}/{h.role}"
            shared = next((g for g in out.gpus if g.where == gpu.where), None)
            if shared is not None:
                shared.holdings.extend(gpu.holdings)
            else:
                out.gpus.append(gpu)
        out.offload_optimizer |= mine.offload_optimizer  # colocated: one setting for every model (`_colocated_models`)
        for where, items in mine.host_ram.items():
            out.host_ram.setdefault(where, []).extend((f"{m.name}'s {what}", b) for what, b in items)
        own = ("model", "trainer", "generator")  # the sections a trained model sets for itself; the rest are the run's
        out.problems += [(f"models[{i}].{f}" if f.partition(".")[0] in own else f, f"trained model {m.name}: {why}") for f, why in mine.problems]
    if config.models and plan.layout == "colocated":
        _colocated_models(config, out)
    return out


def _colocated_models(config: Config, out: MemoryPlan) -> None:
    """Every trained model on the same GPUs (placement=colocate): AdamW's state offloaded
    while the engines generate where the shared GPU needs it (`trainer.offload_optimizer`
    auto), and a GPU that still does not fit refused, naming what shares it."""
    over = any(g.peak > HEADROOM * out.capacity for g in out.gpus)
    if out.offload_optimizer or over and config.trainer.offload_optimizer == "auto":  # one model's plan offloads: each model's does
        out.offload_optimizer = True
        for h in (h for g in out.gpus for h in g.holdings if h.kept is not None):
            h.kept.discard("AdamW moments (2 x float32)")
    gpu = next((g for g in out.gpus if g.peak > HEADROOM * out.capacity), None)
    if gpu is None:
        return
    cap, (mesh, host, index) = HEADROOM * out.capacity, gpu.where
    engines, resident = gpu.engines, gpu.resident
    generating = sum(h.while_generating for h in gpu.holdings if _trains(h)) + resident + sum(h.total for h in engines)
    offload = "" if out.offload_optimizer else ", set trainer.offload_optimizer=always"
    if generating > cap:  # what the engines' budgets may take beside the trainers' kept memory and the engines' own
        budgets = sum(b for h in engines for w, b in h.lines if w.startswith("vLLM budget"))
        share = max((cap - (generating - budgets)) / max(len(engines), 1) / out.capacity - 0.005, 0)
        scorers = f" and the scorers ({resident / GiB:.1f} GiB, never asleep)" if resident else ""
        fix = f"their {len(engines)} engines generate at once beside what each trainer keeps{scorers}): "
        fix += f"lower each model's generator.gpu_memory_utilization to at most {share:.2f}{offload}"
    else:
        fix = f"a trainer's step beside what the other trainers keep): shard the models over more trainer procs{offload}"
    names = ", ".join(["policy", *(m.name for m in config.models)])
    at = f"{mesh}[{host}] GPU {index} needs {gpu.peak / GiB:.1f} GiB of {out.capacity / GiB:.0f} GiB with every trained model on it ({names}: "
    out.problems.append(("placement", f"{at}{fix}, or give the models GPUs of their own (placement=split)"))


def _one_model(config: Config, capacity: float, plan, frozen: bool = False) -> MemoryPlan:
    """The memory plan of one model's slots (`plan`: its view of the device plan; `frozen`: its
    replicas alone, with no weight sync to receive)."""
    from meshrl.launch.devices import resolve_transport, weights_on_gpu

    shape = model_shape(config)
    teacher = model_shape(config, config.distill.teacher) if config.distill.teacher else shape
    transport = resolve_transport(config)
    staging_on_gpu = weights_on_gpu(plan, transport)
    receive_on_gpu = transport == "collective" and staging_on_gpu and not frozen
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
    out = MemoryPlan(capacity, list(gpus.values()), host_ram(config, shape, plan, "none" if frozen else transport, staging_on_gpu, receive_on_gpu), False, [])
    colocated = [g for g in out.gpus if g.colocated]
    offload = config.trainer.offload_optimizer
    if offload == "always" or offload == "auto" and any(g.peak > HEADROOM * capacity for g in colocated):
        out.offload_optimizer = bool(colocated)
        for g in colocated:
            for h in g.holdings:
                if h.kept is not None:
                    h.kept.discard("AdamW moments (2 x float32)")
    out.problems = problems(config, shape, out, teacher)
    return out


def host_ram(config: Config, shape: Shape, plan, transport: str, staging_on_gpu: bool, receive_on_gpu: bool) -> dict[tuple[str, int], list[tuple[str, float]]]:
    """Per trainer host: the checkpoint's files, mapped once (the page cache every rank of the
    host reads), the float32 copy of its largest tensor each rank makes while loading, and on
    rank 0's host the export's whole-model copy in `model.dtype` and, staged in host memory
    (any transport but a GPU collective), weight sync's slots (up to 4 copies of what it sends,
    meshrl/weightsync/staging.py). Per generator host, what its replicas receive into host
    memory: `rdma` and `files` up to 3 copies per replica, a `collective` whose peers are not
    all on GPUs up to 3 per engine proc (meshrl/weightsync/buffers.py); `shm` loads from the
    trainer's slots. (`files` also keeps versions in weight_sync.files_dir, on disk or tmpfs.)"""
    db = DTYPE_BYTES[config.model.dtype]
    out: dict[tuple[str, int], list[tuple[str, float]]] = {}
    largest, synced = shape.vocab * shape.dim * 4, synced_params(config, shape) * db
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
                if not staging_on_gpu:
                    items.append(("weight-sync staging on rank 0 (up to 4 slots)", 4 * synced))
        items[[w for w, _ in items].index("loading, per rank")] = ("loading, per rank", largest)
    per_proc = {"rdma": 3, "files": 3, "collective": 0 if receive_on_gpu else 3}.get(transport, 0)  # copies each receiving proc holds
    receiving: dict[tuple[str, int], tuple[int, float]] = {}
    for slot in plan.slots:
        if slot.role == "generator" and per_proc:  # rdma, files: the replica's proc; a collective: each of its engine's procs
            replicas, held = receiving.get((slot.mesh, slot.host), (0, 0.0))
            procs = max(len(slot.gpus), 1) if transport == "collective" else 1
            receiving[(slot.mesh, slot.host)] = (replicas + 1, held + per_proc * procs * synced)
    for where, (replicas, held) in receiving.items():
        of = f"{replicas} replica{'s' if replicas > 1 else ''}"
        out.setdefault(where, []).append((f"weight receive buffers of {of} (up to {per_proc} copies per receiving proc)", held))
    return out


def _engine_problems(config: Config, shape: Shape, cap: float, tp: int, whose: str, bigger: str, context: int | None = None) -> list[tuple[str, str]]:
    """An engine's weights (`shape`, over `tp` GPUs) and one sequence's KV cache (`context`
    tokens, default model.max_seq_len) in vLLM's budget."""
    g, db = config.generator, DTYPE_BYTES[config.model.dtype]
    weights, budget = shape.params * db / tp, g.gpu_memory_utilization * cap
    context = context or config.model.max_seq_len
    one_sequence = shape.kv_bytes_per_token(db) / tp * context
    if weights + ENGINE_WORKSPACE > budget:
        need = (weights + ENGINE_WORKSPACE + one_sequence) / cap
        return [
            (
                "generator.gpu_memory_utilization",
                f"vLLM's budget of {budget / GiB:.1f} GiB cannot hold {whose} weights ({weights / GiB:.1f} GiB per GPU at tp={tp}) "
                f"and a KV cache: raise it to {min(need, 0.95):.2f}" + (f" or {bigger}" if need > 0.95 else ""),
            )
        ]
    if budget - weights - ENGINE_WORKSPACE < one_sequence:
        return [
            (
                "generator.gpu_memory_utilization",
                f"after {whose} weights, vLLM's budget of {budget / GiB:.1f} GiB holds less KV cache than one sequence of "
                f"{context} tokens: raise it, or lower "
                + ("model.max_seq_len" if context == config.model.max_seq_len else "the judge's max_len or max_new_tokens"),
            )
        ]
    return []


def problems(config: Config, shape: Shape, plan: MemoryPlan, teacher: Shape | None = None) -> list[tuple[str, str]]:
    """What does not fit, each as (field, the fix): the first GPU's line for each field. `teacher`:
    the distillation teacher's shape, where the plan read it already."""
    cap = plan.capacity
    budget = config.generator.gpu_memory_utilization * cap
    out = _engine_problems(config, shape, cap, config.generator.tp, "the model's", "raise generator.tp")
    if not out and config.distill.teacher:  # the teacher's engine: its own weights, the same budget and tp
        teacher = teacher or model_shape(config, config.distill.teacher)
        out = _engine_problems(config, teacher, cap, config.generator.tp, "the teacher's", "raise generator.tp")
    for i, spec in enumerate(config.scoring.scorers):
        if not out and spec.kind == "judge":  # a judge's engine: one GPU (scorers/backends.Judge)
            try:
                judge = model_shape(config, spec.path)
            except ValueError:  # not a family the trainer builds: its budget alone is known
                continue
            out = _engine_problems(config, judge, cap, 1, f"judge scoring.scorers[{i}]'s", "give the judge a smaller checkpoint", spec.judge_context())
    for gpu in plan.gpus:
        if gpu.peak <= HEADROOM * cap:
            continue
        mesh, host, index = gpu.where
        at = f"{mesh}[{host}] GPU {index} needs {gpu.peak / GiB:.1f} GiB of {cap / GiB:.0f} GiB"
        trainer = next((h for h in gpu.holdings if h.role == "trainer"), None)
        if gpu.colocated:
            engines, resident = gpu.engines, gpu.resident
            beside = f" beside the scorers it shares the GPU with ({resident / GiB:.1f} GiB, never asleep)" if resident else ""
            if trainer.total + CUDA_CONTEXT * len(engines) + resident > HEADROOM * cap:  # the engines asleep
                out.append(_trainer_fix(config, trainer, at + " for the trainer's step" + (beside or " alone"), cap))
            else:
                # what the engines' budgets may take beside the trainer's share, the scorers and their own contexts
                room = HEADROOM * cap - trainer.while_generating - resident - sum(h.total - budget for h in engines)
                out.append(
                    (
                        "generator.gpu_memory_utilization",
                        f"{at} while the engines generate beside what the trainer keeps ({trainer.while_generating / GiB:.1f} GiB"
                        + (", AdamW state offloaded" if plan.offload_optimizer else "")
                        + f"): lower it to at most {max(room / cap / max(len(engines), 1), 0):.2f}"
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
                    f"{at} for the critic's step: shard it over more procs (critic.procs={2 * config.critic.procs}), "
                    + ("lower trainer.micro_batch_tokens (its rows are packed to it)" if config.trainer.micro_batch_tokens else "lower critic.micro_batch_size")
                    + (", set trainer.activation_checkpoint=full" if config.trainer.activation_checkpoint != "full" else "")
                    + ", or set trainer.device=cpu (the critic beside a CPU trainer)",
                )
            )
        else:
            out.append(_engine_fix(gpu, at, cap))
    firsts: dict[str, str] = {}
    for f, why in out:
        firsts.setdefault(f, why)
    return list(firsts.items())


def _engine_fix(gpu, at: str, cap: float) -> tuple[str, str]:
    """The field whose change fits a GPU holding no trainer: a generator's or a teacher's vLLM
    budget (and the collective transport's receive buffers beside it), or a scorer's."""
    lines = [(label, b) for h in gpu.holdings for label, b in h.lines]
    if any(label.startswith("weight receive buffers") for label, _ in lines):
        return (
            "weight_sync.transport",
            f"{at}: the collective transport's receive buffers hold two copies of the whole model "
            "on every generator GPU beside vLLM's budget: lower generator.gpu_memory_utilization, or "
            "use weight_sync.transport=rdma (host buffers)",
        )
    if gpu.holdings[0].role == "scorer":
        return (
            "scoring.scorers",
            f"{at} for a scorer: a reward model's batch_size or max_len, a prm's batch_size (a whole group at least: "
            "generator.group_size) or more of its procs, a judge's generator.gpu_memory_utilization (its vLLM budget)",
        )
    budgets = [b for label, b in lines if label.startswith("vLLM budget")]
    room = HEADROOM * cap - (gpu.peak - sum(budgets))  # what the budgets may take beside the rest (CUDA contexts)
    return (
        "generator.gpu_memory_utilization",
        f"{at}: vLLM's budget and its CUDA context outgrow the GPU: lower it to at most {max(room / cap / max(len(budgets), 1), 0):.2f}",
    )


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
