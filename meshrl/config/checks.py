"""Checks a config's values can answer alone: ranges, and relations between fields.

`validate` runs inside `Config.from_dict`, so every config built anywhere (the CLI, the
API, each actor rebuilding its copy from a dict) is consistent: sizes that divide, bounds
that hold, CPU lists that parse and, on this machine, name cores it has. It reads no
file and imports nothing of meshrl's domain; what needs the tasks, user code, optional
packages or the files a config names is checked once, before a run, by meshrl/preflight.py.
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

    def need(ok: bool, path: str, message: str) -> None:
        if not ok:
            raise ConfigError(path, message)

    need(c.steps >= 1, "steps", f"must be at least 1, got {c.steps}")
    need(c.batch_groups >= 1, "batch_groups", f"must be at least 1, got {c.batch_groups}")
    m = c.model
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "num_experts", "experts_top_k", "max_seq_len"):
        need(getattr(m, name) >= 1, f"model.{name}", f"must be at least 1, got {getattr(m, name)}")
    need(m.dim % m.n_heads == 0, "model.dim", f"{m.dim} is not divisible by model.n_heads={m.n_heads}: pick a multiple")
    head_dim = m.dim // m.n_heads
    need(head_dim in VLLM_HEAD_SIZES, "model.n_heads", f"head size model.dim / model.n_heads = {head_dim} is not one vLLM supports ({', '.join(map(str, VLLM_HEAD_SIZES))}): change dim or n_heads")
    need(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", f"{m.n_kv_heads} does not divide model.n_heads={m.n_heads}")
    need(m.experts_top_k <= m.num_experts, "model.experts_top_k", f"{m.experts_top_k} exceeds model.num_experts={m.num_experts}")
    need(m.max_seq_len > c.generator.max_new_tokens, "model.max_seq_len", f"{m.max_seq_len} leaves no room for prompts after generator.max_new_tokens={c.generator.max_new_tokens}: raise it")

    t = c.trainer
    need(t.procs >= 1, "trainer.procs", f"must be at least 1, got {t.procs}")
    need(t.dp_shard == -1 or t.dp_shard >= 1, "trainer.dp_shard", f"must be -1 (all procs) or at least 1, got {t.dp_shard}")
    need(t.ep >= 1, "trainer.ep", f"must be at least 1, got {t.ep}")
    dp = t.procs if t.dp_shard == -1 else t.dp_shard
    need(t.procs % dp == 0, "trainer.procs", f"{t.procs} procs are not divisible by trainer.dp_shard={dp}: make procs a multiple of dp_shard")
    need(t.procs % t.ep == 0, "trainer.procs", f"{t.procs} procs are not divisible by trainer.ep={t.ep}: make procs a multiple of ep")
    need(t.tp >= 1, "trainer.tp", f"must be at least 1, got {t.tp}")
    need(t.cp >= 1, "trainer.cp", f"must be at least 1, got {t.cp}")
    together = t.tp * t.cp  # procs that train the same rows: data parallel runs over procs / together
    if together > 1:
        need(t.procs % together == 0, "trainer.procs", f"{t.procs} procs are not divisible by trainer.tp x trainer.cp = {t.tp} x {t.cp}: make procs a multiple of it")
        dp = t.procs // together if t.dp_shard == -1 else t.dp_shard
        need((t.procs // together) % dp == 0, "trainer.dp_shard", f"{dp} does not divide the {t.procs // together} data-parallel procs left after trainer.tp x trainer.cp = {t.tp} x {t.cp}")
    if t.tp > 1:
        need(not m.moe and m.family != "deepseek_v3", "trainer.tp", f"tensor parallel is built for the dense families (qwen3, llama), not {m.family!r}: use trainer.ep for experts, or tp=1")
        need(c.lora.rank == 0, "trainer.tp", "LoRA adapters are not tensor-parallel: set trainer.tp=1 with lora.rank > 0")
        need(m.path is not None or m.n_heads % t.tp == 0 and m.n_kv_heads % t.tp == 0, "trainer.tp",  # a checkpoint's: at preflight
             f"{t.tp} must divide model.n_heads={m.n_heads} and model.n_kv_heads={m.n_kv_heads} (each proc holds whole heads): pick a divisor")
    if t.cp > 1:
        need(not m.moe and m.family != "deepseek_v3", "trainer.cp", f"context parallel is built for the dense families (qwen3, llama), not {m.family!r}: set trainer.cp=1")
        need(c.lora.rank == 0, "trainer.cp", "LoRA adapters are not context-parallel here: set trainer.cp=1 with lora.rank > 0")
        need(t.micro_batch_tokens == 0, "trainer.cp", "context parallel splits one padded row's positions over procs, and its ring attention has no "
                                                      "mask to keep packed rows apart: set trainer.micro_batch_tokens=0, or trainer.cp=1")
    if t.ep > 1:
        need(m.moe, "trainer.ep", f"expert parallelism needs a MoE model.family, not {m.family!r}: set ep=1")
        need(m.num_experts % t.ep == 0, "trainer.ep", f"{t.ep} does not divide model.num_experts={m.num_experts}")
    need(t.lr > 0, "trainer.lr", f"must be positive, got {t.lr}")
    need(t.weight_decay >= 0, "trainer.weight_decay", f"must be at least 0, got {t.weight_decay}")
    need(t.warmup_steps >= 0, "trainer.warmup_steps", f"must be at least 0, got {t.warmup_steps}")
    need(t.grad_clip >= 0, "trainer.grad_clip", f"must be at least 0 (0 disables), got {t.grad_clip}")
    need(t.micro_batch_size >= 1, "trainer.micro_batch_size", f"must be at least 1, got {t.micro_batch_size}")
    need(t.micro_batch_tokens >= 0, "trainer.micro_batch_tokens", f"must be at least 0 (0 = rows of micro_batch_size, padded), got {t.micro_batch_tokens}")
    need(t.micro_batch_tokens == 0 or t.micro_batch_tokens >= m.max_seq_len, "trainer.micro_batch_tokens",
         f"{t.micro_batch_tokens} cannot hold one row of model.max_seq_len={m.max_seq_len} tokens: raise it to at least {m.max_seq_len}, or lower model.max_seq_len")
    need(not (t.compile and t.micro_batch_tokens > 0), "trainer.micro_batch_tokens",
         "packed rows run attention row by row, and trainer.compile's whole-block graphs would recompile for every new set of "
         "row lengths: set trainer.compile=false, or micro_batch_tokens=0")
    need(0 < t.ac_memory_budget <= 1, "trainer.ac_memory_budget", f"must be in (0, 1], got {t.ac_memory_budget}")
    need(t.activation_checkpoint != "memory_budget" or t.compile, "trainer.activation_checkpoint",
         "memory_budget is chosen by the compiler and needs trainer.compile=true: set it, or use full or selective")
    need(t.collective_timeout_s > c.buffer.get_timeout_s, "trainer.collective_timeout_s",
         f"{t.collective_timeout_s:.0f}s must exceed buffer.get_timeout_s={c.buffer.get_timeout_s:.0f}s (the other ranks wait in a collective "
         "while rank 0 waits for a batch): raise it")
    need(c.launcher.gpu_memory_gib >= 0, "launcher.gpu_memory_gib", f"must be at least 0 (0 = the GPU this machine has), got {c.launcher.gpu_memory_gib}")
    need(t.checkpoint_every >= 0, "trainer.checkpoint_every", f"must be at least 0, got {t.checkpoint_every}")
    need(t.checkpoint_every_s >= 0, "trainer.checkpoint_every_s", f"must be at least 0 (0 = off), got {t.checkpoint_every_s}")
    need(t.interrupt_checkpoint_timeout_s > 0, "trainer.interrupt_checkpoint_timeout_s", f"must be positive, got {t.interrupt_checkpoint_timeout_s}")
    loss = t.loss
    need(0 <= loss.clip_low < 1, "trainer.loss.clip_low", f"must be in [0, 1), got {loss.clip_low}")
    need(loss.clip_high >= 0, "trainer.loss.clip_high", f"must be at least 0, got {loss.clip_high}")
    need(loss.is_cap >= 1, "trainer.loss.is_cap", f"must be at least 1, got {loss.is_cap}")
    need(0 < loss.icepop_low < 1 < loss.icepop_high, "trainer.loss.icepop_low", f"the band [{loss.icepop_low}, {loss.icepop_high}] must contain 1 with a positive lower edge")
    need(loss.kl_coef >= 0, "trainer.loss.kl_coef", f"must be at least 0, got {loss.kl_coef}")

    g = c.generator
    need(g.replicas >= 1, "generator.replicas", f"must be at least 1, got {g.replicas}")
    need(g.tp >= 1, "generator.tp", f"must be at least 1, got {g.tp}")
    need(g.group_size >= 2 or loss.advantage == "grpo_no_std" and g.group_size >= 1, "generator.group_size", f"group advantages need at least 2 completions per prompt, got {g.group_size}")
    if loss.advantage == "rloo":
        need(g.group_size >= 2, "generator.group_size", "rloo needs at least 2 completions per prompt")
    need(g.max_new_tokens >= 1, "generator.max_new_tokens", f"must be at least 1, got {g.max_new_tokens}")
    need(g.temperature > 0, "generator.temperature", f"must be positive, got {g.temperature}: use a small value for near-greedy sampling")
    need(0 < g.top_p <= 1, "generator.top_p", f"must be in (0, 1], got {g.top_p}")
    need(g.top_k == -1 or g.top_k >= 1, "generator.top_k", f"must be -1 (off) or at least 1, got {g.top_k}")
    need(g.max_num_seqs >= g.group_size, "generator.max_num_seqs", f"{g.max_num_seqs} cannot hold one group of generator.group_size={g.group_size}")
    need(0 < g.gpu_memory_utilization <= 1, "generator.gpu_memory_utilization", f"must be in (0, 1], got {g.gpu_memory_utilization}")
    need(g.startup_timeout_s > 0, "generator.startup_timeout_s", f"must be positive, got {g.startup_timeout_s}")
    here = c.launcher.kind in ("local", "process")  # these hosts are this machine: check the cores exist
    _check_cpus(need, "trainer.cpus", t.cpus, 1, here)
    _check_cpus(need, "generator.cpus", g.cpus, g.tp, here)

    b = c.buffer
    need(b.depth >= 0, "buffer.depth", f"must be at least 0 (0 = synchronous), got {b.depth}")
    need(b.max_lag is None or b.max_lag >= 0, "buffer.max_lag", f"a staleness bound must be at least 0 (or null for none), got {b.max_lag}")
    need(b.get_timeout_s > 0, "buffer.get_timeout_s", f"must be positive, got {b.get_timeout_s}")
    need(b.max_dropped_per_batch is None or b.max_dropped_per_batch >= 0, "buffer.max_dropped_per_batch",
         f"must be at least 0 (or null for batch_groups), got {b.max_dropped_per_batch}")
    a = c.alarm
    need(a.window >= 1, "alarm.window", f"must be at least 1, got {a.window}")
    need(0 < a.reward_drop < 1, "alarm.reward_drop", f"a fraction of the best window's reward, in (0, 1), got {a.reward_drop}")
    need(a.min_best_reward >= 0, "alarm.min_best_reward", f"must be at least 0, got {a.min_best_reward}")
    need(a.entropy_floor >= 0, "alarm.entropy_floor", f"must be at least 0 (0 = off), got {a.entropy_floor}")
    if b.depth == 0:
        need(g.update_mode == "block", "generator.update_mode", f"buffer.depth=0 is synchronous on-policy training and needs update_mode 'block', got {g.update_mode!r}")

    w = c.weight_sync
    hosts = len(c.launcher.workers) if c.launcher.kind == "workers" else c.launcher.hosts
    if c.placement == "colocate":
        need(hosts == 1, "placement", f"colocate shares one host's devices between trainer and generators, and the run has {hosts} hosts: set launcher.hosts=1, or placement=split")
        need(not c.distill.teacher, "placement", "colocate runs no distillation teacher (it would need a third engine on the same devices): set placement=split")
        need(w.transport in ("auto", "shm"), "weight_sync.transport", f"placement=colocate hands weights over through shared memory, not {w.transport}: set auto or shm")
    need(w.transport != "shm" or hosts == 1, "weight_sync.transport",
         f"shm maps the trainer's memory, so trainer and generators must share a host, and the run has {hosts} hosts: use auto, collective or rdma")
    need(w.bucket_mb >= 1, "weight_sync.bucket_mb", f"must be at least 1, got {w.bucket_mb}")
    need(w.timeout_s > 0, "weight_sync.timeout_s", f"must be positive, got {w.timeout_s}")

    s = c.scoring
    need(s.timeout_s > 0, "scoring.timeout_s", f"must be positive, got {s.timeout_s}")
    need(not (s.reward_fn and s.reward_model), "scoring.reward_model", "set either scoring.reward_fn or scoring.reward_model, not both")
    need(math.isfinite(s.env_weight), "scoring.env_weight", f"must be a finite number, got {s.env_weight}")
    need(s.env_weight == 1.0 or s.scorers, "scoring.env_weight", f"is {s.env_weight:g}, and it weighs the env's reward against scoring.scorers, "
                                                                  "of which there are none: add a scorer, or leave env_weight at 1")
    need(math.isfinite(s.process_weight), "scoring.process_weight", f"must be a finite number, got {s.process_weight}")
    for i, sc in enumerate(s.scorers):
        _check_scorer(need, sc, f"scoring.scorers[{i}]")
    if s.scorers:
        names = s.scorer_names()
        dup = sorted({n for n in names if names.count(n) > 1} | ({"env"} & set(names)))
        need(not dup, "scoring.scorers", f"names {dup} are taken (by another scorer, or `env`, the env's reward): give each scorer its own `name`")

    k = c.contracts
    need(k.data_check_s >= 0, "contracts.data_check_s", f"must be at least 0 (0 = no check before the run), got {k.data_check_s}")
    need(0 <= k.warn_failed_frac <= 1, "contracts.warn_failed_frac", f"must be in [0, 1] (1 = never warn), got {k.warn_failed_frac}")
    need(k.stop_after_failed_steps >= 0, "contracts.stop_after_failed_steps", f"must be at least 0 (0 = never stop), got {k.stop_after_failed_steps}")

    d = c.data
    need(d.num_prompts >= 1, "data.num_prompts", f"must be at least 1, got {d.num_prompts}")
    need(not d.task_args or source_kind(d.source) == "reasoning_gym", "data.task_args", f"only a reasoning_gym: source takes task arguments, not {d.source!r}: drop them")
    if d.source in ("task:longtail", "task:longtail_chat"):
        n = d.lengths
        need(n.median >= 1, "data.lengths.median", f"must be at least 1, got {n.median}")
        need(n.max >= n.median, "data.lengths.max", f"must be at least data.lengths.median ({n.median}), got {n.max}")
        need(n.sigma >= 0, "data.lengths.sigma", f"must be at least 0, got {n.sigma}")
        need(n.slack >= 0, "data.lengths.slack", f"must be at least 0, got {n.slack}")
        need(1 <= n.turns_max <= c.rollout.max_turns, "data.lengths.turns_max",
             f"must be from 1 to rollout.max_turns ({c.rollout.max_turns}), got {n.turns_max}")

    e = c.eval
    need(e.every >= 0, "eval.every", f"must be at least 0 (0 = off), got {e.every}")
    need(e.num_prompts >= 1, "eval.num_prompts", f"must be at least 1, got {e.num_prompts}")
    need(e.k >= 1, "eval.k", f"must be at least 1, got {e.k}")
    if e.source is not None:
        need(not e.task_args or source_kind(e.source) == "reasoning_gym", "eval.task_args", f"only a reasoning_gym: eval.source takes task arguments, not {e.source!r}: drop them")
    else:
        need(not e.task_args, "eval.task_args", "eval.task_args go with an eval.source of its own: set eval.source, or drop them (the training task's data.task_args apply)")
        need(not e.every or source_kind(d.source) in ("task", "reasoning_gym"), "eval.source",
             f"a file or dataset source ({d.source}) has no held-out part of its own: give eval.source a held-out file")

    di = c.distill
    if di.teacher is not None:
        need(di.kl_weight >= 0 and di.reward_weight >= 0, "distill.kl_weight", f"weights must be at least 0, got kl_weight={di.kl_weight}, reward_weight={di.reward_weight}")
        need(di.kl_weight > 0 or di.reward_weight > 0, "distill.kl_weight", "kl_weight and reward_weight are both 0: nothing to learn from")
        _check_cpus(need, "distill.cpus", di.cpus, 1, here)

    lo = c.lora
    need(0 <= lo.rank <= 512, "lora.rank", f"must be in [0, 512] (0 = off; vLLM's LoRA kernels go up to 512), got {lo.rank}")
    if lo.rank > 0:
        need(lo.alpha > 0, "lora.alpha", f"must be positive, got {lo.alpha}")
        need(0 <= lo.dropout < 1, "lora.dropout", f"must be in [0, 1), got {lo.dropout}")
        need(bool(lo.targets), "lora.targets", "name at least one projection, or set lora.rank=0")
        need(("k_proj" in lo.targets) == ("v_proj" in lo.targets), "lora.targets",
             "k_proj and v_proj go together (TorchTitan builds both from one config): list both or neither")
        need(m.family != "deepseek_v3", "lora.targets", "LoRA is not mapped onto deepseek_v3's MLA projections: use qwen3, llama3 or qwen3_moe")

    r = c.rollout
    need(r.workers >= 1, "rollout.workers", f"must be at least 1, got {r.workers}")
    need(r.groups_per_worker >= 0, "rollout.groups_per_worker", f"must be at least 0 (0 = auto), got {r.groups_per_worker}")
    need(r.max_turns >= 1, "rollout.max_turns", f"must be at least 1, got {r.max_turns}")
    need(r.env_timeout_s > 0, "rollout.env_timeout_s", f"must be positive, got {r.env_timeout_s}")
    sb = r.sandbox
    for name, low in (("pool_size", 0), ("max_concurrent", 1), ("cpu_time_s", 1), ("memory_mb", 64), ("max_processes", 4),
                      ("max_file_mb", 1), ("workspace_mb", 1), ("max_output_bytes", 1024)):
        need(getattr(sb, name) >= low, f"rollout.sandbox.{name}", f"must be at least {low}, got {getattr(sb, name)}")
    need(0 < sb.wall_timeout_s <= 3600, "rollout.sandbox.wall_timeout_s", f"must be in (0, 3600], got {sb.wall_timeout_s}")
    need(sb.uid > 0, "rollout.sandbox.uid", f"must be an unprivileged uid (not 0), got {sb.uid}")

    la = c.launcher
    need(la.hosts >= 1, "launcher.hosts", f"must be at least 1, got {la.hosts}")
    if la.kind == "workers":
        _check_workers(need, c)
    else:
        need(not la.workers, "launcher.workers", f"only launcher.kind=workers attaches to workers, not {la.kind!r}: set the kind or drop the list")
    need(la.gpus_per_host >= 0, "launcher.gpus_per_host", f"must be at least 0, got {la.gpus_per_host}")
    need(la.start_timeout_s > 0, "launcher.start_timeout_s", f"must be positive, got {la.start_timeout_s}")
    parts = la.time_limit.split(":")
    need(len(parts) == 3 and all(p.isdigit() for p in parts), "launcher.time_limit", f"{la.time_limit!r} must look like HH:MM:SS")
    need(la.max_resubmits >= 0, "launcher.max_resubmits", f"must be at least 0, got {la.max_resubmits}")
    need(la.max_resubmits == 0 or la.kind == "slurm", "launcher.max_resubmits", f"only launcher.kind=slurm resubmits itself, not {la.kind!r}: set it to 0")
    if la.kind == "slurm":
        limit_s = int(parts[0]) * 3600 + int(parts[1]) * 60 + int(parts[2])
        need(0 < la.signal_before_s < limit_s, "launcher.signal_before_s", f"must be positive and below the time limit ({la.time_limit} = {limit_s} s), got {la.signal_before_s}")
        need(la.signal_before_s > c.trainer.interrupt_checkpoint_timeout_s, "launcher.signal_before_s",
             f"{la.signal_before_s} s leaves no time to stop after the interrupt checkpoint (trainer.interrupt_checkpoint_timeout_s={c.trainer.interrupt_checkpoint_timeout_s:g}): raise it or lower that timeout")


def _check_cpus(need, path: str, spec: str, min_per_list: int, on_this_machine: bool) -> None:
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
            need(set(cpus) <= set(allowed), path, f"cores {sorted(set(cpus) - set(allowed))} do not exist here (this machine has {allowed}): use those, or empty for no pinning")


def _check_workers(need, c: Config) -> None:
    """Hosts given as `meshrl worker` addresses, and this controller's own address on their network."""
    la = c.launcher
    need(len(la.workers) >= 1, "launcher.workers", "launcher.kind=workers needs the IP:PORT of at least one `meshrl worker`")
    need(la.hosts in (1, len(la.workers)), "launcher.hosts", f"is {la.hosts} but launcher.workers lists {len(la.workers)}: drop launcher.hosts (the workers are the hosts)")
    for i, w in enumerate(la.workers):
        try:
            ip_and_port(w)
            bad = False
        except ValueError:
            bad = True
        need(not bad, f"launcher.workers[{i}]", f"{w!r} must be IP:PORT of a `meshrl worker` (an address of its host, not a wildcard or a name)")
    need(la.address is not None, "launcher.address", "launcher.kind=workers needs this controller's own IP, as the workers reach it")
    try:
        ok = not ipaddress.ip_address(la.address).is_unspecified
    except ValueError:
        ok = False
    need(ok, "launcher.address", f"{la.address!r} must be an IP of this controller (not a wildcard or a name)")


def _check_scorer(need, sc, path: str) -> None:
    """One scoring.scorers entry's values (its files and code are checked at preflight)."""
    if sc.kind in ("function", "reward_model", "judge"):
        what = "an import path module:function" if sc.kind == "function" else "a local checkpoint directory"
        need(bool(sc.path), f"{path}.path", f"a {sc.kind} scorer needs `path`: {what}")
    if sc.kind == "remote":
        need(bool(sc.url) and str(sc.url).startswith(("http://", "https://")), f"{path}.url",
             f"a remote scorer needs `url`, an http:// or https:// address, got {sc.url!r}")
    need(math.isfinite(sc.weight), f"{path}.weight", f"must be a finite number, got {sc.weight}")
    need(sc.batch_size >= 1, f"{path}.batch_size", f"must be at least 1, got {sc.batch_size}")
    need(sc.batch_wait_s >= 0, f"{path}.batch_wait_s", f"must be at least 0, got {sc.batch_wait_s}")
    need(sc.timeout_s > 0, f"{path}.timeout_s", f"must be positive, got {sc.timeout_s}")
    need(sc.retries >= 0, f"{path}.retries", f"must be at least 0, got {sc.retries}")
    need(sc.replicas >= 1, f"{path}.replicas", f"must be at least 1, got {sc.replicas}")
    need(sc.max_len >= 8, f"{path}.max_len", f"must be at least 8 tokens, got {sc.max_len}")
    need(sc.max_new_tokens >= 1, f"{path}.max_new_tokens", f"must be at least 1, got {sc.max_new_tokens}")
    need(sc.unparsable is None or math.isfinite(sc.unparsable), f"{path}.unparsable", f"must be a finite number or null, got {sc.unparsable}")
    need(sc.kind != "judge" or sc.process == "none", f"{path}.process",
         "a judge scores whole episodes: use process=none, or a reward model, function or remote server for step scores")
    need(sc.process != "step" or bool(sc.step_delimiter), f"{path}.step_delimiter", "process=step needs a delimiter that ends a step, e.g. '\\n'")
