"""Checks of the trained models' sections (config/models.py) that their values answer alone:
the model's sizes, the trainer's parallelism, the loss, the generator, weight sync, the
distillation teacher, the critic and LoRA. `validate` (config/checks.py) runs them in order
with the rest of the tree's.
"""

from __future__ import annotations

import os
import typing

from meshrl.config.cpus import parse_cpu_lists
from meshrl.config.loading import need

if typing.TYPE_CHECKING:
    from meshrl.config import Config


VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU and GPU attention backends accept."""


def _check_model(c: Config) -> None:
    """The model's sizes: what TorchTitan builds and vLLM serves."""
    model = c.model
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "num_experts", "experts_top_k", "max_seq_len"):
        need(getattr(model, name) >= 1, f"model.{name}", f"must be at least 1, got {getattr(model, name)}")
    need(model.dim % model.n_heads == 0, "model.dim", f"{model.dim} is not divisible by model.n_heads={model.n_heads}: pick a multiple")
    head_dim = model.dim // model.n_heads
    need(
        head_dim in VLLM_HEAD_SIZES,
        "model.n_heads",
        f"head size model.dim / model.n_heads = {head_dim} is not one vLLM supports ({', '.join(map(str, VLLM_HEAD_SIZES))}): change dim or n_heads",
    )
    need(model.n_heads % model.n_kv_heads == 0, "model.n_kv_heads", f"{model.n_kv_heads} does not divide model.n_heads={model.n_heads}")
    need(model.experts_top_k <= model.num_experts, "model.experts_top_k", f"{model.experts_top_k} exceeds model.num_experts={model.num_experts}")
    need(
        model.max_seq_len > c.generator.max_new_tokens,
        "model.max_seq_len",
        f"{model.max_seq_len} leaves no room for prompts after generator.max_new_tokens={c.generator.max_new_tokens}: raise it",
    )


def _check_trainer(c: Config) -> None:
    """Parallelism that divides the procs, the optimizer, micro-batches, checkpoints."""
    model = c.model
    trainer = c.trainer
    need(trainer.procs >= 1, "trainer.procs", f"must be at least 1, got {trainer.procs}")
    need(trainer.dp_shard == -1 or trainer.dp_shard >= 1, "trainer.dp_shard", f"must be -1 (all procs) or at least 1, got {trainer.dp_shard}")
    need(trainer.ep >= 1, "trainer.ep", f"must be at least 1, got {trainer.ep}")
    dp = trainer.procs if trainer.dp_shard == -1 else trainer.dp_shard
    need(trainer.procs % dp == 0, "trainer.procs", f"{trainer.procs} procs are not divisible by trainer.dp_shard={dp}: make procs a multiple of dp_shard")
    need(trainer.procs % trainer.ep == 0, "trainer.procs", f"{trainer.procs} procs are not divisible by trainer.ep={trainer.ep}: make procs a multiple of ep")
    pace = trainer.pace
    need(pace.every >= 1, "trainer.pace.every", f"a period of steps must be at least 1, got {pace.every}")
    need(
        1 <= pace.steps <= pace.every,
        "trainer.pace.steps",
        f"must be 1 to trainer.pace.every={pace.every} (the steps of a period that update), got {pace.steps}",
    )
    need(0 <= pace.offset < pace.every, "trainer.pace.offset", f"must be 0 to trainer.pace.every - 1 = {pace.every - 1}, got {pace.offset}")
    need(
        pace.offset < c.steps,
        "trainer.pace.offset",
        f"its first update is step {pace.offset + 1}, past the run's steps={c.steps}: nothing would train; lower it, or raise steps",
    )
    need(trainer.tp >= 1, "trainer.tp", f"must be at least 1, got {trainer.tp}")
    need(trainer.cp >= 1, "trainer.cp", f"must be at least 1, got {trainer.cp}")
    together = trainer.tp * trainer.cp  # procs that train the same rows: data parallel runs over procs / together
    if together > 1:
        need(
            trainer.procs % together == 0,
            "trainer.procs",
            f"{trainer.procs} procs are not divisible by trainer.tp x trainer.cp = {trainer.tp} x {trainer.cp}: make procs a multiple of it",
        )
        dp = trainer.procs // together if trainer.dp_shard == -1 else trainer.dp_shard
        need(
            (trainer.procs // together) % dp == 0,
            "trainer.dp_shard",
            f"{dp} does not divide the {trainer.procs // together} data-parallel procs left after trainer.tp x trainer.cp = {trainer.tp} x {trainer.cp}",
        )
    if trainer.tp > 1:
        need(
            not model.moe and model.family != "deepseek_v3",
            "trainer.tp",
            f"tensor parallel is built for the dense families (qwen3, llama), not {model.family!r}: use trainer.ep for experts, or tp=1",
        )
        need(c.lora.rank == 0, "trainer.tp", "LoRA adapters are not tensor-parallel: set trainer.tp=1 with lora.rank > 0")
        need(
            model.path is not None or model.n_heads % trainer.tp == 0 and model.n_kv_heads % trainer.tp == 0,
            "trainer.tp",  # a checkpoint's: at preflight
            f"{trainer.tp} must divide model.n_heads={model.n_heads} and model.n_kv_heads={model.n_kv_heads} (each proc holds whole heads): pick a divisor",
        )
    if trainer.cp > 1:
        need(
            not model.moe and model.family != "deepseek_v3",
            "trainer.cp",
            f"context parallel is built for the dense families (qwen3, llama), not {model.family!r}: set trainer.cp=1",
        )
        need(c.lora.rank == 0, "trainer.cp", "LoRA adapters are not context-parallel here: set trainer.cp=1 with lora.rank > 0")
        need(
            trainer.compute_dtype != "float32",
            "trainer.compute_dtype",
            "context parallel's ring attention shards CUDA's flash and cuDNN kernels, which take half precision; "
            "in float32 attention falls to the math kernel, which torch does not shard: set it to bfloat16 (auto: bfloat16 on CUDA)",
        )
        need(
            trainer.micro_batch_tokens == 0,
            "trainer.cp",
            "context parallel splits one padded row's positions over procs, and its ring attention has no "
            "mask to keep packed rows apart: set trainer.micro_batch_tokens=0, or trainer.cp=1",
        )
    if trainer.ep > 1 and model.path is None:  # a checkpoint's family and experts: trainer/checks.py's check_model
        need(model.moe, "trainer.ep", f"expert parallelism needs a MoE model.family, not {model.family!r}: set ep=1")
        need(model.num_experts % trainer.ep == 0, "trainer.ep", f"{trainer.ep} does not divide model.num_experts={model.num_experts}")
    need(trainer.lr > 0, "trainer.lr", f"must be positive, got {trainer.lr}")
    need(trainer.weight_decay >= 0, "trainer.weight_decay", f"must be at least 0, got {trainer.weight_decay}")
    need(trainer.warmup_steps >= 0, "trainer.warmup_steps", f"must be at least 0, got {trainer.warmup_steps}")
    need(trainer.grad_clip >= 0, "trainer.grad_clip", f"must be at least 0 (0 disables), got {trainer.grad_clip}")
    need(trainer.micro_batch_size >= 1, "trainer.micro_batch_size", f"must be at least 1, got {trainer.micro_batch_size}")
    need(
        trainer.micro_batch_tokens >= 0,
        "trainer.micro_batch_tokens",
        f"must be at least 0 (0 = rows of micro_batch_size, padded), got {trainer.micro_batch_tokens}",
    )
    need(
        trainer.micro_batch_tokens == 0 or trainer.micro_batch_tokens >= model.max_seq_len,
        "trainer.micro_batch_tokens",
        f"{trainer.micro_batch_tokens} cannot hold one row of model.max_seq_len={model.max_seq_len} tokens: "
        f"raise it to at least {model.max_seq_len}, or lower model.max_seq_len",
    )
    need(
        not (trainer.compile and trainer.micro_batch_tokens > 0),
        "trainer.micro_batch_tokens",
        "packed rows run attention row by row, and trainer.compile's whole-block graphs would recompile for every new set of "
        "row lengths: set trainer.compile=false, or micro_batch_tokens=0",
    )
    need(0 < trainer.ac_memory_budget <= 1, "trainer.ac_memory_budget", f"must be in (0, 1], got {trainer.ac_memory_budget}")
    need(
        trainer.activation_checkpoint != "memory_budget" or trainer.compile,
        "trainer.activation_checkpoint",
        "memory_budget is chosen by the compiler and needs trainer.compile=true: set it, or use full or selective",
    )
    need(
        trainer.collective_timeout_s > c.buffer.get_timeout_s,
        "trainer.collective_timeout_s",
        f"{trainer.collective_timeout_s:.0f}s must exceed buffer.get_timeout_s={c.buffer.get_timeout_s:.0f}s (the other ranks wait in a collective "
        "while rank 0 waits for a batch): raise it",
    )
    need(c.launcher.gpu_memory_gib >= 0, "launcher.gpu_memory_gib", f"must be at least 0 (0 = the GPU this machine has), got {c.launcher.gpu_memory_gib}")
    need(trainer.checkpoint_every >= 0, "trainer.checkpoint_every", f"must be at least 0, got {trainer.checkpoint_every}")
    need(trainer.checkpoint_every_s >= 0, "trainer.checkpoint_every_s", f"must be at least 0 (0 = off), got {trainer.checkpoint_every_s}")
    need(trainer.keep_checkpoints >= 0, "trainer.keep_checkpoints", f"must be at least 0 (0 = keep every one), got {trainer.keep_checkpoints}")
    need(trainer.snapshot_every >= 0, "trainer.snapshot_every", f"must be at least 0 (0 = off), got {trainer.snapshot_every}")
    need(
        0 <= trainer.snapshot_budget <= 1, "trainer.snapshot_budget", f"must be in [0, 1] (a share of the step; 0 = no spacing), got {trainer.snapshot_budget}"
    )
    need(trainer.max_restarts >= 0, "trainer.max_restarts", f"must be at least 0 (0 = a dead trainer stops the run), got {trainer.max_restarts}")
    need(trainer.restart_timeout_s > 0, "trainer.restart_timeout_s", f"must be positive, got {trainer.restart_timeout_s}")
    need(
        trainer.interrupt_checkpoint_timeout_s > 0, "trainer.interrupt_checkpoint_timeout_s", f"must be positive, got {trainer.interrupt_checkpoint_timeout_s}"
    )


def _check_loss(c: Config) -> None:
    """The loss's clips and coefficients."""
    loss = c.trainer.loss
    need(0 <= loss.clip_low < 1, "trainer.loss.clip_low", f"must be in [0, 1), got {loss.clip_low}")
    need(loss.clip_high >= 0, "trainer.loss.clip_high", f"must be at least 0, got {loss.clip_high}")
    need(loss.is_cap >= 1, "trainer.loss.is_cap", f"must be at least 1, got {loss.is_cap}")
    need(
        0 < loss.icepop_low < 1 < loss.icepop_high,
        "trainer.loss.icepop_low",
        f"the band [{loss.icepop_low}, {loss.icepop_high}] must contain 1 with a positive lower edge",
    )
    need(loss.kl_coef >= 0, "trainer.loss.kl_coef", f"must be at least 0, got {loss.kl_coef}")


def _check_generator(c: Config) -> None:
    """Replicas, sampling, and the cores the engines are pinned to."""
    trainer = c.trainer
    loss = c.trainer.loss
    gen = c.generator
    need(gen.replicas >= 1, "generator.replicas", f"must be at least 1, got {gen.replicas}")
    need(gen.tp >= 1, "generator.tp", f"must be at least 1, got {gen.tp}")
    if c.model.path is None:  # a checkpoint's heads: trainer/checks.py's check_model
        need(engine_splits_heads(c.model.n_heads, c.model.n_kv_heads, gen.tp), "generator.tp", engine_tp_fix(c.model.n_heads, c.model.n_kv_heads, gen.tp))
    one = loss.advantage in ("grpo_no_std", "gae")  # no group statistic that one completion leaves undefined
    need(
        gen.group_size >= 2 or one and gen.group_size >= 1,
        "generator.group_size",
        f"must be at least 1, got {gen.group_size}" if one else f"group advantages need at least 2 completions per prompt, got {gen.group_size}",
    )
    if loss.advantage == "rloo":
        need(gen.group_size >= 2, "generator.group_size", "rloo needs at least 2 completions per prompt")
    if loss.advantage == "grpo_no_std" and gen.group_size == 1 and not any(s.kind == "prm" for s in c.scoring.scorers):  # (a PRM's check says why)
        need(
            c.distill.teacher is not None,
            "generator.group_size",
            "grpo_no_std on one completion per prompt makes every advantage 0: use 2 or more, or a distill.teacher",
        )
    need(gen.max_new_tokens >= 1, "generator.max_new_tokens", f"must be at least 1, got {gen.max_new_tokens}")
    need(
        gen.temperature >= 0.01,  # vLLM raises a lower one to 0.01 and samples there, while the trainer would score at it
        "generator.temperature",
        f"must be at least 0.01 (vLLM's floor), got {gen.temperature}: use 0.01 for near-greedy sampling",
    )
    need(0 < gen.top_p <= 1, "generator.top_p", f"must be in (0, 1], got {gen.top_p}")
    need(gen.top_k == -1 or gen.top_k >= 1, "generator.top_k", f"must be -1 (off) or at least 1, got {gen.top_k}")
    need(gen.max_num_seqs >= gen.group_size, "generator.max_num_seqs", f"{gen.max_num_seqs} cannot hold one group of generator.group_size={gen.group_size}")
    need(0 < gen.gpu_memory_utilization <= 1, "generator.gpu_memory_utilization", f"must be in (0, 1], got {gen.gpu_memory_utilization}")
    need(gen.startup_timeout_s > 0, "generator.startup_timeout_s", f"must be positive, got {gen.startup_timeout_s}")
    need(gen.stall_timeout_s >= 0, "generator.stall_timeout_s", f"must be 0 (off) or positive, got {gen.stall_timeout_s}")
    here = c.launcher.kind in ("local", "process")  # these hosts are this machine: check the cores exist
    _check_cpus("trainer.cpus", trainer.cpus, 1, here)
    _check_cpus("generator.cpus", gen.cpus, gen.tp, here)


def _check_weight_sync(c: Config) -> None:
    """The weight transport against the layout and the hosts."""
    sync = c.weight_sync
    hosts = len(c.launcher.workers) if c.launcher.kind == "workers" else c.launcher.hosts
    if c.placement == "colocate":
        need(
            hosts == 1,
            "placement",
            f"colocate shares one host's devices between trainer and generators, and the run has {hosts} hosts: set launcher.hosts=1, or placement=split",
        )
        need(
            not c.distill.teacher, "placement", "colocate runs no distillation teacher (it would need a third engine on the same devices): set placement=split"
        )
        need(
            sync.transport in ("auto", "shm"),
            "weight_sync.transport",
            f"placement=colocate hands weights over through shared memory, not {sync.transport}: set auto or shm",
        )
    need(
        sync.transport != "shm" or hosts == 1,
        "weight_sync.transport",
        f"shm maps the trainer's memory, so trainer and generators must share a host, and the run has {hosts} hosts: use auto, collective or rdma",
    )
    need(sync.bucket_mb >= 1, "weight_sync.bucket_mb", f"must be at least 1, got {sync.bucket_mb}")
    need(sync.timeout_s > 0, "weight_sync.timeout_s", f"must be positive, got {sync.timeout_s}")


def _check_distill(c: Config) -> None:
    """The distillation teacher's weights and cores."""
    here = c.launcher.kind in ("local", "process")  # these hosts are this machine: check the cores exist
    distill = c.distill
    if distill.teacher is not None:
        need(
            distill.kl_weight >= 0 and distill.reward_weight >= 0,
            "distill.kl_weight",
            f"weights must be at least 0, got kl_weight={distill.kl_weight}, reward_weight={distill.reward_weight}",
        )
        need(distill.kl_weight > 0 or distill.reward_weight > 0, "distill.kl_weight", "kl_weight and reward_weight are both 0: nothing to learn from")
        _check_cpus("distill.cpus", distill.cpus, c.generator.tp, here)  # the teacher's engine runs generator.tp workers


def _check_critic(c: Config) -> None:
    """PPO's critic (trainer.loss.advantage=gae): its ranges, and what it cannot run beside."""
    critic = c.critic
    if c.trainer.loss.advantage != "gae":  # read by a model beside the policy that trains by gae, or by none
        trained = [mode for i, mode in enumerate(c.advantage_modes()) if i not in c.frozen_models()]
        need(critic == type(critic)() or "gae" in trained, "critic", "only PPO's critic reads this section: set trainer.loss.advantage=gae, or drop it")
        _check_critic_ranges(c)  # here too, so that a bad value is named critic.X, not under a model's view
        return
    _check_critic_ranges(c)
    waited = c.buffer.get_timeout_s + critic.timeout_s
    need(
        c.trainer.collective_timeout_s > waited,
        "trainer.collective_timeout_s",
        f"{c.trainer.collective_timeout_s:.0f}s must exceed buffer.get_timeout_s + critic.timeout_s = {waited:.0f}s "
        "(the other ranks wait in a collective while rank 0 waits for a batch and its critic's advantages): raise it",
    )
    # what cannot combine, one line each
    need(
        not c.distill.teacher, "distill.teacher", "distillation and PPO's critic (trainer.loss.advantage=gae) both set every token's advantage: use one of them"
    )
    need(
        c.lora.rank == 0,
        "lora.rank",
        "the critic is a second whole model trained in full beside the adapters (there is no LoRA critic yet): set lora.rank=0 with trainer.loss.advantage=gae",
    )
    need(
        c.placement != "colocate",
        "placement",
        "the critic trains on a proc (and GPU) of its own at the same time as the trainer, and colocate hands the "
        "devices to one role at a time: set placement=split (or auto)",
    )
    need(
        not c.buffer.dynamic_sampling,
        "buffer.dynamic_sampling",
        "drops groups whose episodes all scored the same, which still carry the critic's signal "
        "(A = return - V is not 0 where V is wrong): set it to false with trainer.loss.advantage=gae",
    )


def _check_critic_ranges(c: Config) -> None:
    """The critic section's own values, wherever a trained model reads it."""
    critic = c.critic
    need(critic.path is None or critic.init == "policy", "critic.init", "critic.path already says where the critic starts: drop init=scratch, or the path")
    need(critic.procs >= 1, "critic.procs", f"must be at least 1, got {critic.procs}")
    need(critic.lr > 0, "critic.lr", f"must be positive, got {critic.lr}")
    need(critic.weight_decay >= 0, "critic.weight_decay", f"must be at least 0, got {critic.weight_decay}")
    need(critic.warmup_steps >= 0, "critic.warmup_steps", f"must be at least 0, got {critic.warmup_steps}")
    need(critic.grad_clip >= 0, "critic.grad_clip", f"must be at least 0 (0 disables), got {critic.grad_clip}")
    need(critic.value_clip is None or critic.value_clip > 0, "critic.value_clip", f"must be positive (or null for no clip), got {critic.value_clip}")
    need(0 < critic.gamma <= 1, "critic.gamma", f"must be in (0, 1], got {critic.gamma}")
    need(0 <= critic.lam <= 1, "critic.lam", f"must be in [0, 1], got {critic.lam}")
    need(critic.value_lam is None or 0 <= critic.value_lam <= 1, "critic.value_lam", f"must be in [0, 1] (or null: lam), got {critic.value_lam}")
    need(critic.adaptive_lam >= 0, "critic.adaptive_lam", f"must be at least 0 (0: off; VAPO uses 0.05), got {critic.adaptive_lam}")
    need(
        0 <= critic.policy_warmup < c.steps,
        "critic.policy_warmup",
        f"must be from 0 to steps - 1 ({c.steps - 1}), got {critic.policy_warmup}: the policy would never train on the critic's advantages",
    )
    need(critic.epochs >= 1, "critic.epochs", f"must be at least 1, got {critic.epochs}")
    need(critic.micro_batch_size >= 1, "critic.micro_batch_size", f"must be at least 1, got {critic.micro_batch_size}")
    need(critic.timeout_s > 0, "critic.timeout_s", f"must be positive, got {critic.timeout_s}")


def _check_lora(c: Config) -> None:
    """LoRA adapters: rank, targets, families."""
    model = c.model
    lora = c.lora
    need(0 <= lora.rank <= 512, "lora.rank", f"must be in [0, 512] (0 = off; vLLM's LoRA kernels go up to 512), got {lora.rank}")
    if lora.rank > 0:
        need(lora.alpha > 0, "lora.alpha", f"must be positive, got {lora.alpha}")
        need(0 <= lora.dropout < 1, "lora.dropout", f"must be in [0, 1), got {lora.dropout}")
        need(bool(lora.targets), "lora.targets", "name at least one projection, or set lora.rank=0")
        need(
            ("k_proj" in lora.targets) == ("v_proj" in lora.targets),
            "lora.targets",
            "k_proj and v_proj go together (TorchTitan builds both from one config): list both or neither",
        )
        need(model.family != "deepseek_v3", "lora.targets", "LoRA is not mapped onto deepseek_v3's MLA projections: use qwen3, llama3 or qwen3_moe")


def _check_cpus(path: str, spec: str, min_per_list: int, on_this_machine: bool) -> None:
    if not spec.strip() or spec == "auto":
        return
    try:
        lists = parse_cpu_lists(spec)
    except ValueError as e:
        need(False, path, f"{e}: write a CPU list like '0-3' or '0,2', '|' between procs")
    allowed = sorted(os.sched_getaffinity(0))
    for cpus in lists:
        need(len(cpus) >= min_per_list, path, f"each list needs at least {min_per_list} cores (one per generator.tp worker), got {cpus}")
        if on_this_machine:
            need(
                set(cpus) <= set(allowed),
                path,
                f"cores {sorted(set(cpus) - set(allowed))} do not exist here (this machine has {allowed}): use those, or empty for no pinning",
            )


def engine_splits_heads(n_heads: int, n_kv_heads: int, tp: int) -> bool:
    """vLLM's rule for generator.tp: it divides the attention heads, and divides the KV heads or
    is a multiple of them (each shard then holds a copy of one)."""
    return n_heads % tp == 0 and (n_kv_heads % tp == 0 or tp % n_kv_heads == 0)


def engine_tp_fix(n_heads: int, n_kv_heads: int, tp: int) -> str:
    return (
        f"{tp} must divide the model's {n_heads} attention heads, and divide its {n_kv_heads} KV heads or be a multiple of them (vLLM's rule): pick a divisor"
    )
