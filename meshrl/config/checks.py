"""Checks a config's values can answer alone: ranges, and relations between fields.

`validate` runs inside `Config.from_dict`, so every config built anywhere (the CLI, the
API, each actor rebuilding its copy from a dict) is consistent: sizes that divide, bounds
that hold, CPU lists that parse and, on this machine, name cores it has. It reads no
file and imports nothing of meshrl's domain; what needs the tasks, user code, optional
packages or the files a config names is checked once, before a run, beside its component
(listed in order by meshrl/preflight.py).
The first problem found is raised as one `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import math

import ipaddress
import os
import typing

from meshrl.config.cpus import parse_cpu_lists
from meshrl.config.loading import ConfigError

if typing.TYPE_CHECKING:
    from meshrl.config import Config


VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU and GPU attention backends accept."""


def source_kind(source: str) -> str:
    """`task`, `reasoning_gym`, `file` (.jsonl / .parquet) or `dataset` (a save_to_disk directory)."""
    if source.startswith("task:"):
        return "task"
    if source.startswith("reasoning_gym:"):
        return "reasoning_gym"
    return "file" if source.endswith((".jsonl", ".parquet")) else "dataset"


def ip_and_port(address: str) -> tuple[str, int]:
    """`IP:PORT` (`[IPv6]:PORT` too) as (IP, port); ValueError for a name, a wildcard or a bad port."""
    host, _, port = address.rpartition(":")
    ip = host.strip("[]")
    if ipaddress.ip_address(ip).is_unspecified:
        raise ValueError(f"refusing the wildcard address {ip!r}: give a host's own address")
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is out of range")
    return ip, int(port)


def validate(c: Config) -> None:
    """Check values and relations that types alone cannot; raise the first problem found."""
    for check in _SECTIONS:
        check(c)


def _need(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise ConfigError(path, message)


def _check_run(c: Config) -> None:
    """The run's own sizes."""
    _need(c.steps >= 1, "steps", f"must be at least 1, got {c.steps}")
    _need(c.batch_groups >= 1, "batch_groups", f"must be at least 1, got {c.batch_groups}")


def _check_model(c: Config) -> None:
    """The model's sizes: what TorchTitan builds and vLLM serves."""
    model = c.model
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "num_experts", "experts_top_k", "max_seq_len"):
        _need(getattr(model, name) >= 1, f"model.{name}", f"must be at least 1, got {getattr(model, name)}")
    _need(model.dim % model.n_heads == 0, "model.dim", f"{model.dim} is not divisible by model.n_heads={model.n_heads}: pick a multiple")
    head_dim = model.dim // model.n_heads
    _need(
        head_dim in VLLM_HEAD_SIZES,
        "model.n_heads",
        f"head size model.dim / model.n_heads = {head_dim} is not one vLLM supports ({', '.join(map(str, VLLM_HEAD_SIZES))}): change dim or n_heads",
    )
    _need(model.n_heads % model.n_kv_heads == 0, "model.n_kv_heads", f"{model.n_kv_heads} does not divide model.n_heads={model.n_heads}")
    _need(model.experts_top_k <= model.num_experts, "model.experts_top_k", f"{model.experts_top_k} exceeds model.num_experts={model.num_experts}")
    _need(
        model.max_seq_len > c.generator.max_new_tokens,
        "model.max_seq_len",
        f"{model.max_seq_len} leaves no room for prompts after generator.max_new_tokens={c.generator.max_new_tokens}: raise it",
    )


def _check_trainer(c: Config) -> None:
    """Parallelism that divides the procs, the optimizer, micro-batches, checkpoints."""
    model = c.model
    trainer = c.trainer
    _need(trainer.procs >= 1, "trainer.procs", f"must be at least 1, got {trainer.procs}")
    _need(trainer.dp_shard == -1 or trainer.dp_shard >= 1, "trainer.dp_shard", f"must be -1 (all procs) or at least 1, got {trainer.dp_shard}")
    _need(trainer.ep >= 1, "trainer.ep", f"must be at least 1, got {trainer.ep}")
    dp = trainer.procs if trainer.dp_shard == -1 else trainer.dp_shard
    _need(trainer.procs % dp == 0, "trainer.procs", f"{trainer.procs} procs are not divisible by trainer.dp_shard={dp}: make procs a multiple of dp_shard")
    _need(trainer.procs % trainer.ep == 0, "trainer.procs", f"{trainer.procs} procs are not divisible by trainer.ep={trainer.ep}: make procs a multiple of ep")
    _need(trainer.tp >= 1, "trainer.tp", f"must be at least 1, got {trainer.tp}")
    _need(trainer.cp >= 1, "trainer.cp", f"must be at least 1, got {trainer.cp}")
    together = trainer.tp * trainer.cp  # procs that train the same rows: data parallel runs over procs / together
    if together > 1:
        _need(
            trainer.procs % together == 0,
            "trainer.procs",
            f"{trainer.procs} procs are not divisible by trainer.tp x trainer.cp = {trainer.tp} x {trainer.cp}: make procs a multiple of it",
        )
        dp = trainer.procs // together if trainer.dp_shard == -1 else trainer.dp_shard
        _need(
            (trainer.procs // together) % dp == 0,
            "trainer.dp_shard",
            f"{dp} does not divide the {trainer.procs // together} data-parallel procs left after trainer.tp x trainer.cp = {trainer.tp} x {trainer.cp}",
        )
    if trainer.tp > 1:
        _need(
            not model.moe and model.family != "deepseek_v3",
            "trainer.tp",
            f"tensor parallel is built for the dense families (qwen3, llama), not {model.family!r}: use trainer.ep for experts, or tp=1",
        )
        _need(c.lora.rank == 0, "trainer.tp", "LoRA adapters are not tensor-parallel: set trainer.tp=1 with lora.rank > 0")
        _need(
            model.path is not None or model.n_heads % trainer.tp == 0 and model.n_kv_heads % trainer.tp == 0,
            "trainer.tp",  # a checkpoint's: at preflight
            f"{trainer.tp} must divide model.n_heads={model.n_heads} and model.n_kv_heads={model.n_kv_heads} (each proc holds whole heads): pick a divisor",
        )
    if trainer.cp > 1:
        _need(
            not model.moe and model.family != "deepseek_v3",
            "trainer.cp",
            f"context parallel is built for the dense families (qwen3, llama), not {model.family!r}: set trainer.cp=1",
        )
        _need(c.lora.rank == 0, "trainer.cp", "LoRA adapters are not context-parallel here: set trainer.cp=1 with lora.rank > 0")
        _need(
            trainer.micro_batch_tokens == 0,
            "trainer.cp",
            "context parallel splits one padded row's positions over procs, and its ring attention has no "
            "mask to keep packed rows apart: set trainer.micro_batch_tokens=0, or trainer.cp=1",
        )
    if trainer.ep > 1:
        _need(model.moe, "trainer.ep", f"expert parallelism needs a MoE model.family, not {model.family!r}: set ep=1")
        _need(model.num_experts % trainer.ep == 0, "trainer.ep", f"{trainer.ep} does not divide model.num_experts={model.num_experts}")
    _need(trainer.lr > 0, "trainer.lr", f"must be positive, got {trainer.lr}")
    _need(trainer.weight_decay >= 0, "trainer.weight_decay", f"must be at least 0, got {trainer.weight_decay}")
    _need(trainer.warmup_steps >= 0, "trainer.warmup_steps", f"must be at least 0, got {trainer.warmup_steps}")
    _need(trainer.grad_clip >= 0, "trainer.grad_clip", f"must be at least 0 (0 disables), got {trainer.grad_clip}")
    _need(trainer.micro_batch_size >= 1, "trainer.micro_batch_size", f"must be at least 1, got {trainer.micro_batch_size}")
    _need(
        trainer.micro_batch_tokens >= 0,
        "trainer.micro_batch_tokens",
        f"must be at least 0 (0 = rows of micro_batch_size, padded), got {trainer.micro_batch_tokens}",
    )
    _need(
        trainer.micro_batch_tokens == 0 or trainer.micro_batch_tokens >= model.max_seq_len,
        "trainer.micro_batch_tokens",
        f"{trainer.micro_batch_tokens} cannot hold one row of model.max_seq_len={model.max_seq_len} tokens: "
        f"raise it to at least {model.max_seq_len}, or lower model.max_seq_len",
    )
    _need(
        not (trainer.compile and trainer.micro_batch_tokens > 0),
        "trainer.micro_batch_tokens",
        "packed rows run attention row by row, and trainer.compile's whole-block graphs would recompile for every new set of "
        "row lengths: set trainer.compile=false, or micro_batch_tokens=0",
    )
    _need(0 < trainer.ac_memory_budget <= 1, "trainer.ac_memory_budget", f"must be in (0, 1], got {trainer.ac_memory_budget}")
    _need(
        trainer.activation_checkpoint != "memory_budget" or trainer.compile,
        "trainer.activation_checkpoint",
        "memory_budget is chosen by the compiler and needs trainer.compile=true: set it, or use full or selective",
    )
    _need(
        trainer.collective_timeout_s > c.buffer.get_timeout_s,
        "trainer.collective_timeout_s",
        f"{trainer.collective_timeout_s:.0f}s must exceed buffer.get_timeout_s={c.buffer.get_timeout_s:.0f}s (the other ranks wait in a collective "
        "while rank 0 waits for a batch): raise it",
    )
    _need(c.launcher.gpu_memory_gib >= 0, "launcher.gpu_memory_gib", f"must be at least 0 (0 = the GPU this machine has), got {c.launcher.gpu_memory_gib}")
    _need(trainer.checkpoint_every >= 0, "trainer.checkpoint_every", f"must be at least 0, got {trainer.checkpoint_every}")
    _need(trainer.checkpoint_every_s >= 0, "trainer.checkpoint_every_s", f"must be at least 0 (0 = off), got {trainer.checkpoint_every_s}")
    _need(
        trainer.interrupt_checkpoint_timeout_s > 0, "trainer.interrupt_checkpoint_timeout_s", f"must be positive, got {trainer.interrupt_checkpoint_timeout_s}"
    )


def _check_loss(c: Config) -> None:
    """The loss's clips and coefficients."""
    loss = c.trainer.loss
    _need(0 <= loss.clip_low < 1, "trainer.loss.clip_low", f"must be in [0, 1), got {loss.clip_low}")
    _need(loss.clip_high >= 0, "trainer.loss.clip_high", f"must be at least 0, got {loss.clip_high}")
    _need(loss.is_cap >= 1, "trainer.loss.is_cap", f"must be at least 1, got {loss.is_cap}")
    _need(
        0 < loss.icepop_low < 1 < loss.icepop_high,
        "trainer.loss.icepop_low",
        f"the band [{loss.icepop_low}, {loss.icepop_high}] must contain 1 with a positive lower edge",
    )
    _need(loss.kl_coef >= 0, "trainer.loss.kl_coef", f"must be at least 0, got {loss.kl_coef}")


def _check_generator(c: Config) -> None:
    """Replicas, sampling, and the cores the engines are pinned to."""
    trainer = c.trainer
    loss = c.trainer.loss
    gen = c.generator
    _need(gen.replicas >= 1, "generator.replicas", f"must be at least 1, got {gen.replicas}")
    _need(gen.tp >= 1, "generator.tp", f"must be at least 1, got {gen.tp}")
    _need(
        gen.group_size >= 2 or loss.advantage in ("grpo_no_std", "gae") and gen.group_size >= 1,
        "generator.group_size",
        f"group advantages need at least 2 completions per prompt, got {gen.group_size}",
    )
    if loss.advantage == "rloo":
        _need(gen.group_size >= 2, "generator.group_size", "rloo needs at least 2 completions per prompt")
    _need(gen.max_new_tokens >= 1, "generator.max_new_tokens", f"must be at least 1, got {gen.max_new_tokens}")
    _need(gen.temperature > 0, "generator.temperature", f"must be positive, got {gen.temperature}: use a small value for near-greedy sampling")
    _need(0 < gen.top_p <= 1, "generator.top_p", f"must be in (0, 1], got {gen.top_p}")
    _need(gen.top_k == -1 or gen.top_k >= 1, "generator.top_k", f"must be -1 (off) or at least 1, got {gen.top_k}")
    _need(gen.max_num_seqs >= gen.group_size, "generator.max_num_seqs", f"{gen.max_num_seqs} cannot hold one group of generator.group_size={gen.group_size}")
    _need(0 < gen.gpu_memory_utilization <= 1, "generator.gpu_memory_utilization", f"must be in (0, 1], got {gen.gpu_memory_utilization}")
    _need(gen.startup_timeout_s > 0, "generator.startup_timeout_s", f"must be positive, got {gen.startup_timeout_s}")
    here = c.launcher.kind in ("local", "process")  # these hosts are this machine: check the cores exist
    _check_cpus("trainer.cpus", trainer.cpus, 1, here)
    _check_cpus("generator.cpus", gen.cpus, gen.tp, here)


def _check_buffer(c: Config) -> None:
    """The episode queue's depth and staleness bound."""
    buffer = c.buffer
    _need(buffer.depth >= 0, "buffer.depth", f"must be at least 0 (0 = synchronous), got {buffer.depth}")
    _need(buffer.max_lag is None or buffer.max_lag >= 0, "buffer.max_lag", f"a staleness bound must be at least 0 (or null for none), got {buffer.max_lag}")
    _need(buffer.get_timeout_s > 0, "buffer.get_timeout_s", f"must be positive, got {buffer.get_timeout_s}")
    _need(
        buffer.max_dropped_per_batch is None or buffer.max_dropped_per_batch >= 0,
        "buffer.max_dropped_per_batch",
        f"must be at least 0 (or null for batch_groups), got {buffer.max_dropped_per_batch}",
    )


def _check_alarm(c: Config) -> None:
    """The run-level alarm's window and thresholds."""
    alarm = c.alarm
    _need(alarm.window >= 1, "alarm.window", f"must be at least 1, got {alarm.window}")
    _need(0 < alarm.reward_drop < 1, "alarm.reward_drop", f"a fraction of the best window's reward, in (0, 1), got {alarm.reward_drop}")
    _need(alarm.min_best_reward >= 0, "alarm.min_best_reward", f"must be at least 0, got {alarm.min_best_reward}")
    _need(alarm.entropy_floor >= 0, "alarm.entropy_floor", f"must be at least 0 (0 = off), got {alarm.entropy_floor}")


def _check_sync_mode(c: Config) -> None:
    """buffer.depth=0 (synchronous) with the update mode it needs."""
    buffer = c.buffer
    gen = c.generator
    if buffer.depth == 0:
        _need(
            gen.update_mode == "block",
            "generator.update_mode",
            f"buffer.depth=0 is synchronous on-policy training and needs update_mode 'block', got {gen.update_mode!r}",
        )


def _check_weight_sync(c: Config) -> None:
    """The weight transport against the layout and the hosts."""
    sync = c.weight_sync
    hosts = len(c.launcher.workers) if c.launcher.kind == "workers" else c.launcher.hosts
    if c.placement == "colocate":
        _need(
            hosts == 1,
            "placement",
            f"colocate shares one host's devices between trainer and generators, and the run has {hosts} hosts: set launcher.hosts=1, or placement=split",
        )
        _need(
            not c.distill.teacher, "placement", "colocate runs no distillation teacher (it would need a third engine on the same devices): set placement=split"
        )
        _need(
            sync.transport in ("auto", "shm"),
            "weight_sync.transport",
            f"placement=colocate hands weights over through shared memory, not {sync.transport}: set auto or shm",
        )
    _need(
        sync.transport != "shm" or hosts == 1,
        "weight_sync.transport",
        f"shm maps the trainer's memory, so trainer and generators must share a host, and the run has {hosts} hosts: use auto, collective or rdma",
    )
    _need(sync.bucket_mb >= 1, "weight_sync.bucket_mb", f"must be at least 1, got {sync.bucket_mb}")
    _need(sync.timeout_s > 0, "weight_sync.timeout_s", f"must be positive, got {sync.timeout_s}")


def _check_scoring(c: Config) -> None:
    """Scorers, their weights and names."""
    scoring = c.scoring
    _need(scoring.timeout_s > 0, "scoring.timeout_s", f"must be positive, got {scoring.timeout_s}")
    _need(not (scoring.reward_fn and scoring.reward_model), "scoring.reward_model", "set either scoring.reward_fn or scoring.reward_model, not both")
    _need(math.isfinite(scoring.env_weight), "scoring.env_weight", f"must be a finite number, got {scoring.env_weight}")
    _need(
        scoring.env_weight == 1.0 or scoring.scorers,
        "scoring.env_weight",
        f"is {scoring.env_weight:g}, and it weighs the env's reward against scoring.scorers, of which there are none: add a scorer, or leave env_weight at 1",
    )
    _need(math.isfinite(scoring.process_weight), "scoring.process_weight", f"must be a finite number, got {scoring.process_weight}")
    for i, sc in enumerate(scoring.scorers):
        _check_scorer(sc, f"scoring.scorers[{i}]")
    if scoring.scorers:
        names = scoring.scorer_names()
        dup = sorted({n for n in names if names.count(n) > 1} | ({"env"} & set(names)))
        _need(not dup, "scoring.scorers", f"names {dup} are taken (by another scorer, or `env`, the env's reward): give each scorer its own `name`")


def _check_contracts(c: Config) -> None:
    """The user-code contract checks' bounds."""
    contracts = c.contracts
    _need(contracts.data_check_s >= 0, "contracts.data_check_s", f"must be at least 0 (0 = no check before the run), got {contracts.data_check_s}")
    _need(0 <= contracts.warn_failed_frac <= 1, "contracts.warn_failed_frac", f"must be in [0, 1] (1 = never warn), got {contracts.warn_failed_frac}")
    _need(
        contracts.stop_after_failed_steps >= 0,
        "contracts.stop_after_failed_steps",
        f"must be at least 0 (0 = never stop), got {contracts.stop_after_failed_steps}",
    )


def _check_data(c: Config) -> None:
    """The prompt source and its arguments."""
    data = c.data
    _need(data.num_prompts >= 1, "data.num_prompts", f"must be at least 1, got {data.num_prompts}")
    _need(
        not data.task_args or source_kind(data.source) == "reasoning_gym",
        "data.task_args",
        f"only a reasoning_gym: source takes task arguments, not {data.source!r}: drop them",
    )
    if data.source in ("task:longtail", "task:longtail_chat"):
        n = data.lengths
        _need(n.median >= 1, "data.lengths.median", f"must be at least 1, got {n.median}")
        _need(n.max >= n.median, "data.lengths.max", f"must be at least data.lengths.median ({n.median}), got {n.max}")
        _need(n.sigma >= 0, "data.lengths.sigma", f"must be at least 0, got {n.sigma}")
        _need(n.slack >= 0, "data.lengths.slack", f"must be at least 0, got {n.slack}")
        _need(
            1 <= n.turns_max <= c.rollout.max_turns, "data.lengths.turns_max", f"must be from 1 to rollout.max_turns ({c.rollout.max_turns}), got {n.turns_max}"
        )


def _check_eval(c: Config) -> None:
    """Held-out evaluation: its cadence and source."""
    data = c.data
    ev = c.eval
    _need(ev.every >= 0, "eval.every", f"must be at least 0 (0 = off), got {ev.every}")
    _need(ev.num_prompts >= 1, "eval.num_prompts", f"must be at least 1, got {ev.num_prompts}")
    _need(ev.k >= 1, "eval.k", f"must be at least 1, got {ev.k}")
    if ev.source is not None:
        _need(
            not ev.task_args or source_kind(ev.source) == "reasoning_gym",
            "eval.task_args",
            f"only a reasoning_gym: eval.source takes task arguments, not {ev.source!r}: drop them",
        )
    else:
        _need(
            not ev.task_args,
            "eval.task_args",
            "eval.task_args go with an eval.source of its own: set eval.source, or drop them (the training task's data.task_args apply)",
        )
        _need(
            not ev.every or source_kind(data.source) in ("task", "reasoning_gym"),
            "eval.source",
            f"a file or dataset source ({data.source}) has no held-out part of its own: give eval.source a held-out file",
        )


def _check_distill(c: Config) -> None:
    """The distillation teacher's weights and cores."""
    here = c.launcher.kind in ("local", "process")  # these hosts are this machine: check the cores exist
    distill = c.distill
    if distill.teacher is not None:
        _need(
            distill.kl_weight >= 0 and distill.reward_weight >= 0,
            "distill.kl_weight",
            f"weights must be at least 0, got kl_weight={distill.kl_weight}, reward_weight={distill.reward_weight}",
        )
        _need(distill.kl_weight > 0 or distill.reward_weight > 0, "distill.kl_weight", "kl_weight and reward_weight are both 0: nothing to learn from")
        _check_cpus("distill.cpus", distill.cpus, 1, here)


def _check_critic(c: Config) -> None:
    """PPO's critic (trainer.loss.advantage=gae): its ranges, and what it cannot run beside."""
    critic = c.critic
    if c.trainer.loss.advantage != "gae":
        _need(critic == type(critic)(), "critic", "only PPO's critic reads this section: set trainer.loss.advantage=gae, or drop it")
        return
    _need(critic.lr > 0, "critic.lr", f"must be positive, got {critic.lr}")
    _need(critic.weight_decay >= 0, "critic.weight_decay", f"must be at least 0, got {critic.weight_decay}")
    _need(critic.warmup_steps >= 0, "critic.warmup_steps", f"must be at least 0, got {critic.warmup_steps}")
    _need(critic.grad_clip >= 0, "critic.grad_clip", f"must be at least 0 (0 disables), got {critic.grad_clip}")
    _need(critic.value_clip is None or critic.value_clip > 0, "critic.value_clip", f"must be positive (or null for no clip), got {critic.value_clip}")
    _need(0 < critic.gamma <= 1, "critic.gamma", f"must be in (0, 1], got {critic.gamma}")
    _need(0 <= critic.lam <= 1, "critic.lam", f"must be in [0, 1], got {critic.lam}")
    _need(
        0 <= critic.policy_warmup < c.steps,
        "critic.policy_warmup",
        f"must be from 0 to steps - 1 ({c.steps - 1}), got {critic.policy_warmup}: the policy would never train on the critic's advantages",
    )
    _need(critic.epochs >= 1, "critic.epochs", f"must be at least 1, got {critic.epochs}")
    _need(critic.micro_batch_size >= 1, "critic.micro_batch_size", f"must be at least 1, got {critic.micro_batch_size}")
    _need(critic.timeout_s > 0, "critic.timeout_s", f"must be positive, got {critic.timeout_s}")
    waited = c.buffer.get_timeout_s + critic.timeout_s
    _need(
        c.trainer.collective_timeout_s > waited,
        "trainer.collective_timeout_s",
        f"{c.trainer.collective_timeout_s:.0f}s must exceed buffer.get_timeout_s + critic.timeout_s = {waited:.0f}s "
        "(the other ranks wait in a collective while rank 0 waits for a batch and its critic's advantages): raise it",
    )
    # what cannot combine, one line each
    _need(
        not c.distill.teacher, "distill.teacher", "distillation and PPO's critic (trainer.loss.advantage=gae) both set every token's advantage: use one of them"
    )
    for i, sc in enumerate(c.scoring.scorers):
        _need(
            sc.process == "none",
            f"scoring.scorers[{i}].process",
            "process rewards and PPO's critic (trainer.loss.advantage=gae) both set every token's advantage: "
            "set process=none (an outcome score trains through the critic's returns), or a group advantage",
        )
    _need(
        c.lora.rank == 0,
        "lora.rank",
        "the critic is a second whole model trained in full beside the adapters (there is no LoRA critic yet): set lora.rank=0 with trainer.loss.advantage=gae",
    )
    _need(
        c.placement != "colocate",
        "placement",
        "the critic runs on CPU procs only here, beside the trainer's, and colocate hands the host's cores "
        "to one role at a time: set placement=split (or auto)",
    )
    gpu_trainer = c.trainer.device == "cuda" or c.trainer.device == "auto" and c.launcher.gpus_per_host > 0
    _need(
        not gpu_trainer,
        "trainer.device",
        "the critic runs on CPU procs only here (the device and memory plans do not cover it yet), "
        "beside a CPU trainer: set trainer.device=cpu, or a group advantage",
    )
    _need(
        not c.buffer.dynamic_sampling,
        "buffer.dynamic_sampling",
        "drops groups whose episodes all scored the same, which still carry the critic's signal "
        "(A = return - V is not 0 where V is wrong): set it to false with trainer.loss.advantage=gae",
    )


def _check_lora(c: Config) -> None:
    """LoRA adapters: rank, targets, families."""
    model = c.model
    lora = c.lora
    _need(0 <= lora.rank <= 512, "lora.rank", f"must be in [0, 512] (0 = off; vLLM's LoRA kernels go up to 512), got {lora.rank}")
    if lora.rank > 0:
        _need(lora.alpha > 0, "lora.alpha", f"must be positive, got {lora.alpha}")
        _need(0 <= lora.dropout < 1, "lora.dropout", f"must be in [0, 1), got {lora.dropout}")
        _need(bool(lora.targets), "lora.targets", "name at least one projection, or set lora.rank=0")
        _need(
            ("k_proj" in lora.targets) == ("v_proj" in lora.targets),
            "lora.targets",
            "k_proj and v_proj go together (TorchTitan builds both from one config): list both or neither",
        )
        _need(model.family != "deepseek_v3", "lora.targets", "LoRA is not mapped onto deepseek_v3's MLA projections: use qwen3, llama3 or qwen3_moe")


def _check_rollout(c: Config) -> None:
    """Rollout workers, turns, and the sandbox's limits."""
    rollout = c.rollout
    _need(rollout.workers >= 1, "rollout.workers", f"must be at least 1, got {rollout.workers}")
    _need(rollout.groups_per_worker >= 0, "rollout.groups_per_worker", f"must be at least 0 (0 = auto), got {rollout.groups_per_worker}")
    _need(rollout.max_turns >= 1, "rollout.max_turns", f"must be at least 1, got {rollout.max_turns}")
    _need(rollout.env_timeout_s > 0, "rollout.env_timeout_s", f"must be positive, got {rollout.env_timeout_s}")
    sandbox = rollout.sandbox
    for name, low in (
        ("pool_size", 0),
        ("max_concurrent", 1),
        ("cpu_time_s", 1),
        ("memory_mb", 64),
        ("max_processes", 4),
        ("max_file_mb", 1),
        ("workspace_mb", 1),
        ("max_output_bytes", 1024),
    ):
        _need(getattr(sandbox, name) >= low, f"rollout.sandbox.{name}", f"must be at least {low}, got {getattr(sandbox, name)}")
    _need(0 < sandbox.wall_timeout_s <= 3600, "rollout.sandbox.wall_timeout_s", f"must be in (0, 3600], got {sandbox.wall_timeout_s}")
    _need(sandbox.uid > 0, "rollout.sandbox.uid", f"must be an unprivileged uid (not 0), got {sandbox.uid}")


def _check_launcher(c: Config) -> None:
    """Hosts, workers, and Slurm's time limit and signal."""
    launcher = c.launcher
    _need(launcher.hosts >= 1, "launcher.hosts", f"must be at least 1, got {launcher.hosts}")
    if launcher.kind == "workers":
        _check_workers(c)
    else:
        _need(not launcher.workers, "launcher.workers", f"only launcher.kind=workers attaches to workers, not {launcher.kind!r}: set the kind or drop the list")
    _need(launcher.gpus_per_host >= 0, "launcher.gpus_per_host", f"must be at least 0, got {launcher.gpus_per_host}")
    _need(launcher.start_timeout_s > 0, "launcher.start_timeout_s", f"must be positive, got {launcher.start_timeout_s}")
    parts = launcher.time_limit.split(":")
    _need(len(parts) == 3 and all(p.isdigit() for p in parts), "launcher.time_limit", f"{launcher.time_limit!r} must look like HH:MM:SS")
    _need(launcher.max_resubmits >= 0, "launcher.max_resubmits", f"must be at least 0, got {launcher.max_resubmits}")
    _need(
        launcher.max_resubmits == 0 or launcher.kind == "slurm",
        "launcher.max_resubmits",
        f"only launcher.kind=slurm resubmits itself, not {launcher.kind!r}: set it to 0",
    )
    if launcher.kind == "slurm":
        limit_s = int(parts[0]) * 3600 + int(parts[1]) * 60 + int(parts[2])
        _need(
            0 < launcher.signal_before_s < limit_s,
            "launcher.signal_before_s",
            f"must be positive and below the time limit ({launcher.time_limit} = {limit_s} s), got {launcher.signal_before_s}",
        )
        _need(
            launcher.signal_before_s > c.trainer.interrupt_checkpoint_timeout_s,
            "launcher.signal_before_s",
            f"{launcher.signal_before_s} s leaves no time to stop after the interrupt checkpoint "
            f"(trainer.interrupt_checkpoint_timeout_s={c.trainer.interrupt_checkpoint_timeout_s:g}): raise it or lower that timeout",
        )


_SECTIONS = (
    _check_run,
    _check_model,
    _check_trainer,
    _check_loss,
    _check_generator,
    _check_buffer,
    _check_alarm,
    _check_sync_mode,
    _check_weight_sync,
    _check_scoring,
    _check_contracts,
    _check_data,
    _check_eval,
    _check_distill,
    _check_lora,
    _check_rollout,
    _check_launcher,
    _check_critic,
)
"""In the order the problems are reported: the first found is raised."""


def _check_cpus(path: str, spec: str, min_per_list: int, on_this_machine: bool) -> None:
    if not spec.strip() or spec == "auto":
        return
    try:
        lists = parse_cpu_lists(spec)
    except ValueError as e:
        _need(False, path, f"{e}: write a CPU list like '0-3' or '0,2', '|' between procs")
    allowed = sorted(os.sched_getaffinity(0))
    for cpus in lists:
        _need(len(cpus) >= min_per_list, path, f"each list needs at least {min_per_list} cores (one per generator.tp worker), got {cpus}")
        if on_this_machine:
            _need(
                set(cpus) <= set(allowed),
                path,
                f"cores {sorted(set(cpus) - set(allowed))} do not exist here (this machine has {allowed}): use those, or empty for no pinning",
            )


def _check_workers(c: Config) -> None:
    """Hosts given as `meshrl worker` addresses, and this controller's own address on their network."""
    launcher = c.launcher
    _need(len(launcher.workers) >= 1, "launcher.workers", "launcher.kind=workers needs the IP:PORT of at least one `meshrl worker`")
    _need(
        launcher.hosts in (1, len(launcher.workers)),
        "launcher.hosts",
        f"is {launcher.hosts} but launcher.workers lists {len(launcher.workers)}: drop launcher.hosts (the workers are the hosts)",
    )
    for i, w in enumerate(launcher.workers):
        try:
            ip_and_port(w)
            bad = False
        except ValueError:
            bad = True
        _need(not bad, f"launcher.workers[{i}]", f"{w!r} must be IP:PORT of a `meshrl worker` (an address of its host, not a wildcard or a name)")
    _need(launcher.address is not None, "launcher.address", "launcher.kind=workers needs this controller's own IP, as the workers reach it")
    try:
        ok = not ipaddress.ip_address(launcher.address).is_unspecified
    except ValueError:
        ok = False
    _need(ok, "launcher.address", f"{launcher.address!r} must be an IP of this controller (not a wildcard or a name)")


def _check_scorer(sc, path: str) -> None:
    """One scoring.scorers entry's values (its files and code are checked at preflight)."""
    if sc.kind in ("function", "reward_model", "judge"):
        what = "an import path module:function" if sc.kind == "function" else "a local checkpoint directory"
        _need(bool(sc.path), f"{path}.path", f"a {sc.kind} scorer needs `path`: {what}")
    if sc.kind == "remote":
        _need(
            bool(sc.url) and str(sc.url).startswith(("http://", "https://")),
            f"{path}.url",
            f"a remote scorer needs `url`, an http:// or https:// address, got {sc.url!r}",
        )
    _need(math.isfinite(sc.weight), f"{path}.weight", f"must be a finite number, got {sc.weight}")
    _need(sc.batch_size >= 1, f"{path}.batch_size", f"must be at least 1, got {sc.batch_size}")
    _need(sc.batch_wait_s >= 0, f"{path}.batch_wait_s", f"must be at least 0, got {sc.batch_wait_s}")
    _need(sc.timeout_s > 0, f"{path}.timeout_s", f"must be positive, got {sc.timeout_s}")
    _need(sc.retries >= 0, f"{path}.retries", f"must be at least 0, got {sc.retries}")
    _need(sc.replicas >= 1, f"{path}.replicas", f"must be at least 1, got {sc.replicas}")
    _need(sc.max_len >= 8, f"{path}.max_len", f"must be at least 8 tokens, got {sc.max_len}")
    _need(sc.max_new_tokens >= 1, f"{path}.max_new_tokens", f"must be at least 1, got {sc.max_new_tokens}")
    _need(sc.unparsable is None or math.isfinite(sc.unparsable), f"{path}.unparsable", f"must be a finite number or null, got {sc.unparsable}")
    _need(
        sc.kind != "judge" or sc.process == "none",
        f"{path}.process",
        "a judge scores whole episodes: use process=none, or a reward model, function or remote server for step scores",
    )
    _need(sc.process != "step" or bool(sc.step_delimiter), f"{path}.step_delimiter", "process=step needs a delimiter that ends a step, e.g. '\\n'")
