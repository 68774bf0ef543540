"""The run configuration: a tree of typed dataclasses.

Every field has a safe default and a docstring (the string literal right below it); the
config reference (`meshrl config docs`, docs/config.md) is generated from those
docstrings, so it cannot drift from the code. Configs load from YAML, from a dict, or in
code, and take dotted command-line overrides (`trainer.lr=1e-5`). Every problem is raised
as one `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml


VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU and GPU attention backends accept."""


class ConfigError(ValueError):
    """A bad config value: `field` names the dotted path, the message says the fix."""

    def __init__(self, field_path: str, message: str):
        self.field_path = field_path
        super().__init__(f"{field_path}: {message}" if field_path else message)


@dataclass
class ModelConfig:
    family: Literal["qwen3", "qwen3_moe", "llama3", "deepseek_v3"] = "qwen3"
    """Model family from TorchTitan's registry. `qwen3_moe` and `deepseek_v3` are mixture-of-experts."""
    path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + *.safetensors) to start from. None: initialise from scratch with the sizes below."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory. None: the checkpoint directory if `path` is set, else meshrl's built-in character tokenizer."""
    vocab_size: int = 128
    """Vocabulary size (from-scratch models only). Must cover the tokenizer; 128 fits the built-in character tokenizer."""
    dim: int = 64
    """Hidden size (from-scratch models only; a checkpoint brings its own)."""
    n_layers: int = 2
    """Number of transformer blocks (from-scratch models only)."""
    n_heads: int = 2
    """Attention heads (from-scratch models only). Must divide `dim`; the head size dim / n_heads must be one vLLM's attention supports (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)."""
    n_kv_heads: int = 1
    """Key/value heads for grouped-query attention (from-scratch models only). Must divide `n_heads`."""
    ffn_dim: int = 128
    """Feed-forward hidden size (from-scratch models only); per expert for MoE families."""
    num_experts: int = 4
    """Routed experts per MoE layer (MoE families only)."""
    experts_top_k: int = 2
    """Experts each token is routed to (MoE families only). At most `num_experts`."""
    max_seq_len: int = 256
    """Longest prompt + response, in tokens."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the generator copy and exported checkpoints. The trainer keeps float32 master weights."""


@dataclass
class LossConfig:
    advantage: Literal["grpo", "grpo_no_std", "rloo"] = "grpo"
    """Group advantage: `grpo` (reward minus group mean, over group std), `grpo_no_std` (Dr.GRPO: no std division), `rloo` (leave-one-out mean)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses reduce: mean over all tokens, mean over sequences of token means, or mean over sequences of token sums (Dr.GRPO)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1: ratios under 1 - clip_low are clipped."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (clip-higher: set above clip_low to keep exploration)."""
    clip_against: Literal["sampler", "proximal"] = "sampler"
    """The old policy the PPO clip measures its ratio against. `sampler`: the log-probs of the policy that sampled each token (pi_theta / mu), so the trust region spans the whole staleness lag: a token whose probability has already moved past 1 + clip_high (positive advantage) or under 1 - clip_low (negative) since it was sampled gets no more gradient, however many versions trained in between. `proximal`: the trainer's own log-probs before this optimizer step (pi_theta / pi_prox); with one optimizer step per batch that ratio is 1, so the clip never acts and nothing bounds how far stale batches push the policy (async runs collapsed this way, issue 34). The correction's IS weight applies either way."""
    correction: Literal["none", "tis", "mis_token", "mis_seq", "icepop", "decoupled", "opsm"] = "tis"
    """Off-policy correction against the sampler's log-probs: truncated IS, masked IS (token or sequence), IcePop band mask, decoupled PPO with a proximal policy, or off-policy sequence masking."""
    is_cap: float = 2.0
    """Cap C for TIS weights and threshold for MIS masks."""
    icepop_low: float = 0.5
    """Lower edge of IcePop's kept band of IS ratios."""
    icepop_high: float = 5.0
    """Upper edge of IcePop's kept band of IS ratios."""
    opsm_delta: float = 1e-4
    """OPSM: drop a negative-advantage sequence when its mean log(mu / pi) exceeds this."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy. 0 disables it and the reference model."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus. 0 disables it."""
    sampling_mask: bool = True
    """Score each trained token under the distribution the sampler drew it from: with generator.top_k / top_p, the logits at generator.temperature truncated by vLLM's rule and renormalised, as the sampler's processed log-probs are. IS ratios then compare like with like, and the policy trained is the one that samples. No effect at top_p=1, top_k=-1. Off: the full-vocabulary log-prob (the truncation shows up as off-policy mismatch)."""
    routing_replay: bool = True
    """MoE only: the trainer's routers send each token to the experts the sampler chose (ids from generator.return_routed_experts), with gate weights from the trainer's live router scores, so gradients still reach the router. Tokens without sampler data (prompt, padding) route live. No effect without routed_experts in the batch."""


@dataclass
class TrainerConfig:
    procs: int = 1
    """Trainer processes (one GPU each on GPU machines)."""
    dp_shard: int = -1
    """FSDP2 data-parallel shard degree. -1: all trainer procs."""
    ep: int = 1
    """Expert-parallel degree for MoE models. Must divide `trainer.procs` and `model.num_experts`."""
    lr: float = 5e-3
    """AdamW learning rate. The default suits the tiny from-scratch default model; pretrained checkpoints want about 1e-6 to 1e-5."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    grad_clip: float = 1.0
    """Gradient norm clip. 0 disables clipping."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; gradients accumulate over micro-batches."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs. `auto`: CUDA when available, else CPU."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of forward/backward compute; master weights, optimizer state and gradient reduction stay float32. `auto`: bfloat16 on CUDA (FSDP2 mixed precision), float32 on CPU. `bfloat16` on CPU autocasts the matmuls (attention and RMSNorm stay float32) and pays on CPUs with AMX (Sapphire Rapids and later: about 1.9x per step on the benchmark model); float32 keeps trainer and generator log-probs closest."""
    compile: bool = False
    """torch.compile each transformer block (TorchTitan's per-block compile), with dynamic shapes because RL batches change length every step. The compile runs in setup, alongside the generators' start-up (about 10 s on a CPU core for the benchmark model; cached under /tmp/torchinductor_$USER). It makes a training step about 1.4x faster on CPU in bf16 and 1.1x in float32 (benchmark model). Off by default because short runs and tests are dominated by start-up."""
    cpus: str = "auto"
    """CPU cores the trainer procs are pinned to, as a Linux CPU list (`0-3`, `0,2`); `|` separates the lists of a host's procs by local rank (`0-3|4-7`). `auto`: a CPU trainer on this machine gets the cores the generators do not (half), each proc's thread pool sized to its cores; a GPU trainer is not pinned. Empty: no pinning. See meshrl/placement.py."""
    checkpoint_every: int = 0
    """Save a distributed checkpoint every this many steps. 0: by time only (`checkpoint_every_s`), and at the end of the run."""
    checkpoint_every_s: float = 1800.0
    """Also save one when this many seconds have passed since the last, so a crash loses at most that much training whatever a step costs. 0: off."""
    interrupt_checkpoint_timeout_s: float = 120.0
    """On Ctrl-C or SIGTERM (scheduler preemption) the run lets the step in flight finish and checkpoints, within this many seconds, then stops; `meshrl run --resume` continues from there. Keep it under the scheduler's grace period (Slurm's KillWait)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss and its off-policy corrections."""


@dataclass
class GeneratorConfig:
    replicas: int = 1
    """vLLM engine replicas, each an actor on the generator mesh."""
    tp: int = 1
    """Tensor-parallel degree inside one replica."""
    group_size: int = 8
    """Completions per prompt (the GRPO group size, vLLM's `n`)."""
    max_new_tokens: int = 8
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Sampling temperature. The trainer scores tokens at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling. -1 disables it."""
    update_mode: Literal["keep", "abort", "drain", "block"] = "keep"
    """How a new policy version is applied while generating: keep in-flight requests across the swap, abort and resume them from their prefix, drain them first, or block (synchronous)."""
    max_num_seqs: int = 64
    """Most sequences one engine decodes at once."""
    compile: bool = False
    """Run vLLM's compiled model (torch.compile, plus CUDA graphs on GPU) instead of eager mode. On a CPU it decodes the benchmark model about 1.35x faster for 15-30 s more start-up per engine (compiled code is cached in ~/.cache/vllm). Off by default: short runs and tests are dominated by start-up."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory a vLLM engine may take (GPU only)."""
    return_routed_experts: bool = False
    """MoE only: return the expert ids each sampled token was routed to, per layer, for routing replay (trainer.loss.routing_replay). On GPU vLLM returns them (model runner V2); on CPU meshrl's worker extension records them from vLLM's router hook (meshrl/generator/routing_capture.py)."""
    startup_timeout_s: float = 300.0
    """Seconds an engine may take to start before the run fails."""
    cpus: str = "auto"
    """CPU cores the replicas are pinned to (their vLLM CPU workers bind their threads there), as a Linux CPU list; `|` separates per-replica lists, replica i taking list i modulo their count (`4-5|6-7`). `auto`: with a CPU trainer on this machine, half the cores, split between replicas (at least `tp` each). Empty: no pinning, vLLM binds its threads itself."""


@dataclass
class BufferConfig:
    depth: int = 2
    """Batches admitted beyond the one the trainer trains next: 0 synchronous (on-policy), 1 a double buffer, K a bounded queue of K batches. Admission also never runs further ahead than `max_lag`."""
    max_lag: int | None = 2
    """The staleness bound: no trained token is more than this many versions behind the trainer. Admission is derived from it (with `depth`), and tokens still too stale at sample time are masked or dropped. None: bounded by `depth` alone."""
    lag_granularity: Literal["token", "sequence"] = "token"
    """`token`: stale tokens are masked out of the loss; `sequence`: a group whose oldest token is too stale is dropped whole (and replaced)."""
    sampling: str = "fifo"
    """Which finished groups a batch takes: `fifo`, `random`, or an import path `module:callable(groups, n, rng) -> indices`."""
    get_timeout_s: float = 600.0
    """Longest the trainer waits for a batch before failing."""


@dataclass
class RolloutConfig:
    workers: int = 1
    """Rollout worker procs. Each plays groups of episodes and hosts their env instances: together they are the env pool."""
    groups_per_worker: int = 0
    """Groups one worker plays at once. 0: enough to keep every generator slot busy (2 x generator.replicas x generator.max_num_seqs / group_size / workers)."""
    env: str | None = None
    """Import path `module:Class` of an environment (reset/step, see meshrl/rollout/env.py), one instance per episode. None: the task's own env, or a single-turn env around the reward."""
    env_args: dict = field(default_factory=dict)
    """Keyword arguments for `env`'s constructor."""
    max_turns: int = 8
    """Most model turns in one episode; an episode still going then ends with finish_reason `length`."""
    env_timeout_s: float = 30.0
    """Longest one env call (reset or step) may take; a timeout or exception fails that episode (reward 0) and the run goes on."""
    tool_parser: str = "hermes"
    """How tool calls are read from model turns (tool envs): `hermes` (`<tool_call>{json}</tool_call>`, Qwen/Hermes), `compact` (a turn `!ARG` calls the env's first tool: for tiny models trained from scratch), or an import path `module:callable(text) -> list[ToolCall]`."""


@dataclass
class WeightSyncConfig:
    transport: Literal["rdma", "collective", "files"] = "collective"
    """How weights travel: Monarch RDMA buffers, a NCCL/gloo broadcast group, or (named fallback) safetensors files."""
    bucket_mb: int = 256
    """Size of the packed transfer buckets, in MiB."""
    timeout_s: float = 120.0
    """Longest one version's transfer may take before it is an error."""
    files_dir: str | None = None
    """Directory for the `files` transport. None: a folder in the run directory."""


@dataclass
class ScoringConfig:
    reward_fn: str | None = None
    """Import path `module:function` of a reward function (prompt, response, sample) -> float, sync or async. None: the task's built-in exact reward."""
    reward_model: str | None = None
    """Local checkpoint directory of a reward model scored behind the same interface. None: no reward model."""
    timeout_s: float = 30.0
    """Longest one reward call may take; a timeout or exception fails the episode (reward 0) and the run goes on."""


@dataclass
class LengthTailConfig:
    median: int = 8
    """Median target length, in tokens, of the longtail tasks' answers."""
    sigma: float = 1.4
    """Spread of the target length: lognormal with this sigma, so the 95th percentile is exp(1.645 sigma) times the median (1.0: 5.2x, 1.2: 7.2x, 1.4: 10x). Early in a run answers run to their budgets, which lifts the short ones most, so the produced tail is thinner than the targets'."""
    max: int = 160
    """Longest target length in tokens; longer draws are clipped to it. At least 20x the median gives a reasoning-like tail."""
    slack: float = 0.25
    """Each answer's token budget: its target length x (1 + slack) + 2. A model that does not stop is cut there (finish_reason `length`)."""
    turns_max: int = 4
    """task:longtail_chat: rounds per episode, from 1 to this, heavy-tailed too (P(k) proportional to 1/k^2)."""


@dataclass
class DataConfig:
    source: str = "task:digits"
    """Prompts: `task:NAME` for a built-in task (single-turn digits, letters, count, add, copy, longtail with heavy-tailed lengths; multi-turn calc with a tool, guess, longtail_chat: see meshrl/tasks.py), `reasoning_gym:NAME` for a reasoning-gym task scored by its own verifier (`pip install 'meshrl[reasoning]'`; configured by `data.task_args`), a local .jsonl / .parquet file, or a directory written by `datasets`' `save_to_disk`."""
    prompt_key: str = "prompt"
    """Field holding the prompt in file sources: text, or a list of chat messages (system, user and earlier turns, rendered with the tokenizer's chat template). With `messages`-style rows whose last message is the assistant's, that message is the reference answer (when the row has no `answer_key` field) and is not part of the prompt."""
    answer_key: str = "answer"
    """Field holding the reference answer in file sources (passed to the reward function)."""
    shuffle: bool = True
    """Shuffle prompts (with the run seed)."""
    num_prompts: int = 100000
    """Prompts a built-in or reasoning-gym task generates per epoch."""
    task_args: dict = field(default_factory=dict)
    """Keyword arguments of a `reasoning_gym:NAME` task's config (e.g. `{min_digits: 1, max_digits: 2}` for basic_arithmetic); its `seed` and `size` come from the run's seed and `num_prompts`."""
    lengths: LengthTailConfig = field(default_factory=LengthTailConfig)
    """Heavy-tailed answer lengths of task:longtail and task:longtail_chat (ignored by the other sources)."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate the policy on held-out prompts every this many steps, and at the last step. 0: off. Evaluation plays episodes on the generators beside training, so training slows only by the generation it needs."""
    source: str | None = None
    """Held-out prompts, in any form `data.source` takes (read with data's `prompt_key` and `answer_key`). None: the training task (`task:` or `reasoning_gym:`) drawn from a seed stream of its own; a file or dataset source needs one given here. A `task:` or `reasoning_gym:` eval source is scored by its own reward; any other by the run's."""
    task_args: dict = field(default_factory=dict)
    """Keyword arguments of a `reasoning_gym:` eval.source's config (as `data.task_args` for training); only with eval.source set."""
    num_prompts: int = 32
    """Prompts per evaluation (the first of the held-out source, in its order)."""
    k: int = 4
    """Samples per prompt at `generator.temperature` for pass@k and the mean sampled reward; one greedy answer per prompt gives the accuracy."""


@dataclass
class DistillConfig:
    teacher: str | None = None
    """On-policy distillation: a local Hugging Face checkpoint of the teacher, run on a vLLM engine of its own, which scores every token of the student's episodes. Each model token's advantage becomes `kl_weight x (teacher log-prob - student log-prob)` (reverse KL, per token), plus `reward_weight x` the task's group advantage. None: off (plain RL)."""
    kl_weight: float = 1.0
    """Weight of the per-token reverse-KL advantage."""
    reward_weight: float = 0.0
    """Weight of the task reward's group advantage mixed in (0: pure distillation)."""
    cpus: str = ""
    """CPU cores the teacher's engine is pinned to (Linux CPU list). Empty: not pinned."""


@dataclass
class LoRAConfig:
    rank: int = 0
    """LoRA rank. 0: off (full fine-tuning). Above 0: the base weights are frozen, the trainer's optimizer holds the adapters only, and weight sync sends the adapter alone, loaded through vLLM's LoRA support."""
    alpha: float = 16.0
    """Scaling numerator: an adapter's update is scaled by alpha / rank."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Projections that get an adapter, by Hugging Face module name (attention: q_proj, k_proj, v_proj, o_proj; MLP: gate_proj, up_proj, down_proj). MoE families adapt attention and their dense and shared-expert MLPs; routed experts stay frozen."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (the generator samples without it)."""


@dataclass
class LauncherConfig:
    kind: Literal["local", "process", "slurm", "torchx", "workers"] = "local"
    """Where meshes run: `local` (this machine), `process` (`launcher.hosts` local worker processes standing in for Slurm hosts: the Slurm code path, testable anywhere), `slurm` (an allocation submitted through Monarch's SlurmJob), `torchx` (this process already runs inside a job launched from `meshrl/torchx_component.py:train`; meshes use its host), or `workers` (hosts already running `meshrl worker --address IP:PORT`, listed in `launcher.workers`; this process attaches to them over Monarch's TCP transport, as to a Slurm allocation's; see docs/multihost.md)."""
    hosts: int = 1
    """Hosts to allocate (process/slurm; with `workers`, the number of `launcher.workers`). One host holds every role; with more, hosts split between trainer and generator (by GPUs when `gpus_per_host` > 0, else in proportion to their procs), and the coordinator (episode queue, rollout workers and their envs) shares the first generator host, where every model turn is asked for."""
    workers: list[str] = field(default_factory=list)
    """launcher.kind=workers: `IP:PORT` of each host's `meshrl worker`, in host order (the trainer hosts first, then the generator hosts)."""
    address: str | None = None
    """launcher.kind=workers: this controller's own IP as the hosts reach it. Its Monarch channel and the weight-sync store listen on it and nowhere else. Required with `workers`; must be an address of this machine."""
    gpus_per_host: int = 0
    """GPUs per host (slurm/torchx). 0 on CPU-only clusters."""
    partition: str | None = None
    """Slurm partition. None: the cluster default."""
    time_limit: str = "01:00:00"
    """Slurm wall-clock limit, HH:MM:SS."""
    dry_run: bool = False
    """Render the job (sbatch script or TorchX AppDef) and print it instead of submitting."""
    account: str | None = None
    """Slurm account to charge (`#SBATCH --account`). None: the cluster default."""
    start_timeout_s: float = 1800.0
    """Longest wait for the allocation to start running and its hosts to connect (queueing included); then the job is cancelled."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/latest"
    """Where metrics, TensorBoard events, checkpoints and exports go."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    progress: bool = True
    """Show a console progress bar."""
    plot: bool = True
    """Draw reward, staleness and utilisation curves to PNG at the end of the run."""
    wandb: bool = False
    """Also log every step's metrics to Weights & Biases (the `wandb` package torchtitan brings), into RUN_DIR/wandb."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline`: write the W&B run to disk only (sync it later with `wandb sync RUN_DIR/wandb/offline-run-*`); `online`: send it to the W&B server the environment names (WANDB_API_KEY, WANDB_BASE_URL)."""
    wandb_project: str = "meshrl"
    """W&B project name."""
    verbose: bool = False
    """Leave library output (vLLM, Monarch, torch) on the terminal. Off: each proc's output goes to RUN_DIR/logs/ROLE.log and the console shows meshrl's own lines (`meshrl run --verbose` turns it on; so does MESHRL_VERBOSE=1)."""


@dataclass
class Config:
    """A whole meshrl run."""

    steps: int = 40
    """Optimizer steps (policy versions) to train."""
    batch_groups: int = 8
    """Prompt groups per training batch (batch size = batch_groups * generator.group_size)."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer mesh."""
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    """The generator mesh."""
    buffer: BufferConfig = field(default_factory=BufferConfig)
    """The episode queue between rollout workers and trainer: admission and the staleness bound."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers, environments and tools."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight transfer from trainer to generators."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Rewards."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompt source."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on held-out prompts during training."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher checkpoint."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters: train and sync only them."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Where the meshes run."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and outputs."""

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Config":
        config = _build(cls, data or {}, "")
        validate(config)
        return config

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> "Config":
        return cls.from_dict(apply_overrides(load_yaml(path), overrides or []))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---- loading ------------------------------------------------------------------------------
def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError("", f"config file {str(path)!r} not found: pass the path of a YAML file (see configs/)")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError("", f"{path} is not valid YAML{where}: fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping of config sections, not a {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) onto a nested dict copy."""
    data = _deepcopy_dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("", f"override {item!r} must look like section.field=value")
        node = data
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section: remove the trailing keys")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            node[parts[-1]] = raw
    return data


def _deepcopy_dict(data: dict) -> dict:
    return {k: _deepcopy_dict(v) if isinstance(v, dict) else v for k, v in data.items()}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping of fields, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = _closest(str(key), names)
            hint = f"; did you mean {close!r}?" if close else f"; known fields: {', '.join(names)}"
            raise ConfigError(_join(prefix, str(key)), f"unknown field{hint}")
    kwargs = {}
    for name in names:
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], _join(prefix, name))
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(path, f"expected a mapping, got {_describe(value)}")
    if origin is list:
        if isinstance(value, (list, tuple)):
            (item,) = typing.get_args(tp)
            return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(path, f"expected a list, got {_describe(value)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected an integer, got {_describe(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(path, f"expected a number, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # YAML reads `cpus: 3` or `x=3` as a number; the text is meant
        raise ConfigError(path, f"expected a string, got {_describe(value)}")
    raise ConfigError(path, f"unsupported type {tp!r}")  # a meshrl bug, not a user error


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "null"


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    return " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args) + " or null"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _closest(name: str, candidates: list[str]) -> str | None:
    import difflib

    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


# ---- validation of relations between fields ----------------------------------------------
def _check_cpus(need, path: str, spec: str, min_per_list: int, on_this_machine: bool) -> None:
    from meshrl.placement import parse_cpu_lists

    try:
        lists = parse_cpu_lists(spec)
    except ValueError as e:
        need(False, path, f"{e}: write a CPU list like '0-3' or '0,2', '|' between procs")
    allowed = sorted(os.sched_getaffinity(0))
    for cpus in lists:
        need(len(cpus) >= min_per_list, path, f"each list needs at least {min_per_list} cores (one per generator.tp worker), got {cpus}")
        if on_this_machine:
            need(set(cpus) <= set(allowed), path, f"cores {sorted(set(cpus) - set(allowed))} do not exist here (this machine has {allowed}): use those, or empty for no pinning")


def _check_import(need, path: str, value: str, what: str) -> None:
    """`value` must be an import path `module:name` that imports, naming `what` it should be."""
    import importlib

    module, sep, attr = value.partition(":")
    need(bool(sep and module and attr), path, f"{value!r} is not an import path 'module:name' of {what}")
    try:
        found = hasattr(importlib.import_module(module), attr)
        problem = f"module {module!r} has no {attr!r}"
    except Exception as e:  # noqa: BLE001 - any import failure is the user's path to fix
        found, problem = False, f"cannot import module {module!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    need(found, path, f"{value!r}: {problem}: give an importable 'module:name' of {what}")


def validate(c: Config) -> None:
    """Check values and relations that types alone cannot; raise the first problem found."""

    def need(ok: bool, path: str, message: str) -> None:
        if not ok:
            raise ConfigError(path, message)

    need(c.steps >= 1, "steps", f"must be at least 1, got {c.steps}")
    need(c.batch_groups >= 1, "batch_groups", f"must be at least 1, got {c.batch_groups}")
    m = c.model
    if m.path is not None:
        need(os.path.isdir(m.path), "model.path", f"directory {m.path!r} not found: give a local Hugging Face checkpoint directory, or null to initialise from scratch")
        need(os.path.isfile(os.path.join(m.path, "config.json")), "model.path", f"{m.path!r} has no config.json: point it at a Hugging Face checkpoint directory")
    if m.tokenizer is not None:
        need(os.path.isdir(m.tokenizer), "model.tokenizer", f"directory {m.tokenizer!r} not found: give a local tokenizer directory, or null for the default")
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
    if t.ep > 1:
        need(m.family in ("qwen3_moe", "deepseek_v3"), "trainer.ep", f"expert parallelism needs a MoE model.family, not {m.family!r}: set ep=1")
        need(m.num_experts % t.ep == 0, "trainer.ep", f"{t.ep} does not divide model.num_experts={m.num_experts}")
    need(t.lr > 0, "trainer.lr", f"must be positive, got {t.lr}")
    need(t.weight_decay >= 0, "trainer.weight_decay", f"must be at least 0, got {t.weight_decay}")
    need(t.warmup_steps >= 0, "trainer.warmup_steps", f"must be at least 0, got {t.warmup_steps}")
    need(t.grad_clip >= 0, "trainer.grad_clip", f"must be at least 0 (0 disables), got {t.grad_clip}")
    need(t.micro_batch_size >= 1, "trainer.micro_batch_size", f"must be at least 1, got {t.micro_batch_size}")
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
    if b.depth == 0:
        need(g.update_mode == "block", "generator.update_mode", f"buffer.depth=0 is synchronous on-policy training and needs update_mode 'block', got {g.update_mode!r}")
    if b.sampling not in ("fifo", "random"):
        _check_import(need, "buffer.sampling", b.sampling, "'fifo', 'random' or a sampling function")

    w = c.weight_sync
    need(w.bucket_mb >= 1, "weight_sync.bucket_mb", f"must be at least 1, got {w.bucket_mb}")
    need(w.timeout_s > 0, "weight_sync.timeout_s", f"must be positive, got {w.timeout_s}")

    s = c.scoring
    if s.reward_fn is not None:
        _check_import(need, "scoring.reward_fn", s.reward_fn, "a reward function")
    if s.reward_model is not None:
        need(os.path.isdir(s.reward_model), "scoring.reward_model", f"directory {s.reward_model!r} not found: give a local checkpoint directory or null")
    need(s.timeout_s > 0, "scoring.timeout_s", f"must be positive, got {s.timeout_s}")

    need(not (s.reward_fn and s.reward_model), "scoring.reward_model", "set either scoring.reward_fn or scoring.reward_model, not both")
    d = c.data
    _check_source(need, c, "data.source", d.source, d.task_args)
    if source_kind(d.source) == "task":
        from meshrl.tasks import TASKS

        name = d.source.removeprefix("task:")
        if TASKS[name].env is not None and c.rollout.env is None:
            need(not (s.reward_fn or s.reward_model), "scoring.reward_fn",
                 f"task:{name} is multi-turn and its env gives the reward: unset scoring.reward_fn / reward_model, or set rollout.env")
    elif source_kind(d.source) in ("file", "dataset"):
        need(s.reward_fn is not None or s.reward_model is not None or c.rollout.env is not None, "scoring.reward_fn",
             f"a file data source ({d.source}) needs a reward: set scoring.reward_fn, scoring.reward_model or rollout.env")
    need(d.num_prompts >= 1, "data.num_prompts", f"must be at least 1, got {d.num_prompts}")
    need(not d.task_args or source_kind(d.source) == "reasoning_gym", "data.task_args", f"only a reasoning_gym: source takes task arguments, not {d.source!r}: drop them")
    if d.source in ("task:longtail", "task:longtail_chat"):
        _check_lengths(need, c)

    e = c.eval
    need(e.every >= 0, "eval.every", f"must be at least 0 (0 = off), got {e.every}")
    need(e.num_prompts >= 1, "eval.num_prompts", f"must be at least 1, got {e.num_prompts}")
    need(e.k >= 1, "eval.k", f"must be at least 1, got {e.k}")
    if e.source is not None:
        _check_source(need, c, "eval.source", e.source, e.task_args)
        need(not e.task_args or source_kind(e.source) == "reasoning_gym", "eval.task_args", f"only a reasoning_gym: eval.source takes task arguments, not {e.source!r}: drop them")
    else:
        need(not e.task_args, "eval.task_args", "eval.task_args go with an eval.source of its own: set eval.source, or drop them (the training task's data.task_args apply)")
        need(not e.every or source_kind(d.source) in ("task", "reasoning_gym"), "eval.source",
             f"a file or dataset source ({d.source}) has no held-out part of its own: give eval.source a held-out file")

    di = c.distill
    if di.teacher is not None:
        need(os.path.isfile(os.path.join(di.teacher, "config.json")), "distill.teacher", f"{di.teacher!r} is not a Hugging Face checkpoint directory (no config.json): give the teacher's local checkpoint, or null")
        need(di.kl_weight >= 0 and di.reward_weight >= 0, "distill.kl_weight", f"weights must be at least 0, got kl_weight={di.kl_weight}, reward_weight={di.reward_weight}")
        need(di.kl_weight > 0 or di.reward_weight > 0, "distill.kl_weight", "kl_weight and reward_weight are both 0: nothing to learn from")
        _check_cpus(need, "distill.cpus", di.cpus, 1, c.launcher.kind in ("local", "process"))

    lo = c.lora
    need(0 <= lo.rank <= 512, "lora.rank", f"must be in [0, 512] (0 = off; vLLM's LoRA kernels go up to 512), got {lo.rank}")
    if lo.rank > 0:
        from meshrl.trainer.lora import TITAN_NAMES

        need(lo.alpha > 0, "lora.alpha", f"must be positive, got {lo.alpha}")
        need(0 <= lo.dropout < 1, "lora.dropout", f"must be in [0, 1), got {lo.dropout}")
        need(bool(lo.targets), "lora.targets", "name at least one projection, or set lora.rank=0")
        unknown = sorted(set(lo.targets) - set(TITAN_NAMES))
        need(not unknown, "lora.targets", f"unknown {unknown}: choose from {sorted(TITAN_NAMES)}")
        need(("k_proj" in lo.targets) == ("v_proj" in lo.targets), "lora.targets",
             "k_proj and v_proj go together (TorchTitan builds both from one config): list both or neither")
        need(c.model.family != "deepseek_v3", "lora.targets", "LoRA is not mapped onto deepseek_v3's MLA projections: use qwen3, llama3 or qwen3_moe")

    r = c.rollout
    need(r.workers >= 1, "rollout.workers", f"must be at least 1, got {r.workers}")
    need(r.groups_per_worker >= 0, "rollout.groups_per_worker", f"must be at least 0 (0 = auto), got {r.groups_per_worker}")
    need(r.max_turns >= 1, "rollout.max_turns", f"must be at least 1, got {r.max_turns}")
    need(r.env_timeout_s > 0, "rollout.env_timeout_s", f"must be positive, got {r.env_timeout_s}")
    if r.env is not None:
        _check_import(need, "rollout.env", r.env, "an env class")
    if r.tool_parser not in ("hermes", "compact"):
        _check_import(need, "rollout.tool_parser", r.tool_parser, "'hermes', 'compact' or a parser function")

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


EXTRAS = {"reasoning_gym": "reasoning", "math_verify": "math", "openenv": "envs"}
"""Optional packages and the meshrl extra that installs each."""


def missing_extra(module: str) -> str | None:
    """None when `module` imports; else the one line telling how to install its extra."""
    import importlib.util

    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken parent
        pass
    return f"needs the optional package {module!r}: pip install 'meshrl[{EXTRAS.get(module, module)}]'"


def source_kind(source: str) -> str:
    """`task`, `reasoning_gym`, `file` (.jsonl / .parquet) or `dataset` (a save_to_disk directory)."""
    if source.startswith("task:"):
        return "task"
    if source.startswith("reasoning_gym:"):
        return "reasoning_gym"
    return "file" if source.endswith((".jsonl", ".parquet")) else "dataset"


def _check_source(need, c: Config, path: str, source: str, task_args: dict) -> None:
    """A prompt source that exists and whose package is installed."""
    kind = source_kind(source)
    if kind == "task":
        from meshrl.tasks import TASKS

        name = source.removeprefix("task:")
        need(name in TASKS, path, f"unknown built-in task {name!r}: use one of {', '.join('task:' + t for t in TASKS)}")
    elif kind == "reasoning_gym":
        problem = missing_extra("reasoning_gym")
        need(problem is None, path, f"{source} {problem}")
        from reasoning_gym.factory import DATASETS

        name = source.removeprefix("reasoning_gym:")
        need(name in DATASETS, path, f"reasoning-gym has no task {name!r}: see reasoning_gym.factory.DATASETS (e.g. basic_arithmetic, chain_sum, leg_counting)")
        from meshrl.data import reasoning_gym_dataset

        reasoning_gym_dataset(name, task_args, c.seed, 1, path.replace("source", "task_args"))  # bad ones: a ConfigError naming them
    elif kind == "file":
        need(os.path.isfile(source), path, f"file {source!r} not found: give a local .jsonl or .parquet file")
    else:
        need(os.path.isdir(source), path, f"{source!r} must be 'task:NAME', 'reasoning_gym:NAME', a .jsonl/.parquet file or a datasets save_to_disk directory")
        need(os.path.isfile(os.path.join(source, "dataset_info.json")) or os.path.isfile(os.path.join(source, "dataset_dict.json")), path,
             f"directory {source!r} is not a datasets save_to_disk directory (no dataset_info.json): save it with Dataset.save_to_disk")


def _check_workers(need, c: Config) -> None:
    """Hosts given as `meshrl worker` addresses, and this controller's own address on their network."""
    import ipaddress

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


def ip_and_port(address: str) -> tuple[str, int]:
    """`IP:PORT` (`[IPv6]:PORT` too) as (IP, port); ValueError for a name, a wildcard or a bad port."""
    import ipaddress

    host, _, port = address.rpartition(":")
    ip = host.strip("[]")
    if ipaddress.ip_address(ip).is_unspecified:
        raise ValueError(f"refusing the wildcard address {ip!r}: give a host's own address")
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is out of range")
    return ip, int(port)


def _local_addresses() -> set[str]:
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs if a.family.name in ("AF_INET", "AF_INET6")}


def _check_lengths(need, c: Config) -> None:
    """The longtail tasks' length tail must fit the generation budget and the context."""
    from meshrl.tasks import answer_budget

    n = c.data.lengths
    need(n.median >= 1, "data.lengths.median", f"must be at least 1, got {n.median}")
    need(n.max >= n.median, "data.lengths.max", f"must be at least data.lengths.median ({n.median}), got {n.max}")
    need(n.sigma >= 0, "data.lengths.sigma", f"must be at least 0, got {n.sigma}")
    need(n.slack >= 0, "data.lengths.slack", f"must be at least 0, got {n.slack}")
    need(1 <= n.turns_max <= c.rollout.max_turns, "data.lengths.turns_max",
         f"must be from 1 to rollout.max_turns ({c.rollout.max_turns}), got {n.turns_max}")
    budget = answer_budget(n.max, n.slack)
    need(c.generator.max_new_tokens >= budget, "generator.max_new_tokens",
         f"must be at least {budget} (the budget of the longest longtail answer, data.lengths.max x (1 + slack) + 2), got {c.generator.max_new_tokens}; "
         "raise it or lower data.lengths.max")
    need(c.model.max_seq_len >= budget + 16, "model.max_seq_len",
         f"must be at least {budget + 16} (the longest longtail answer's budget plus its prompt), got {c.model.max_seq_len}")


# ---- the generated reference --------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring below each field of a config dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def reference_markdown() -> str:
    """The config reference as Markdown: every section, field, type, default and docstring."""
    lines = [
        "# meshrl config reference",
        "",
        "Generated from the docstrings in `meshrl/config.py` by `meshrl config docs`; do not edit by hand.",
        "Set fields in YAML (nested sections), in a dict passed to `meshrl.run`, or on the command line as `section.field=value`.",
        "",
    ]

    def section(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        nested = []
        lines.append(f"## `{prefix or 'top level'}`")
        lines.append("")
        lines.append("| field | type | default | meaning |")
        lines.append("|---|---|---|---|")
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                nested.append((tp, _join(prefix, f.name)))
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{_join(prefix, f.name)}` | {_show_type(tp)} | `{yaml.safe_dump(default).strip().removesuffix('...').strip()}` | {docs.get(f.name, '')} |")
        lines.append("")
        for tp, path in nested:
            section(tp, path)

    section(Config, "")
    return "\n".join(lines)


def _show_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_show_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return tp.__name__


# ---- checks against this machine, before any mesh starts ------------------------------------
def preflight(c: Config) -> None:
    """What `validate` cannot see from the values alone: a run directory that can be written,
    and model and tokenizer directories that load. Run once before any mesh starts; raises
    ConfigError naming the field and the fix."""
    run_dir = os.path.abspath(c.logging.run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".meshrl-write-check-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError("logging.run_dir", f"cannot write to {run_dir!r} ({e.strerror or type(e).__name__}): choose a writable directory") from None
    if c.launcher.kind == "workers" and c.launcher.address not in _local_addresses():
        raise ConfigError("launcher.address", f"{c.launcher.address!r} is not an address of this machine: give one of {', '.join(sorted(_local_addresses()))}")
    m = c.model
    if m.path is not None:
        from meshrl.trainer.model import model_args_from_hf

        try:
            family = model_args_from_hf(m.path)[0].family
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError("model.path", f"{m.path!r} does not load as a checkpoint ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                              "point it at a Hugging Face checkpoint directory of a qwen3, qwen3_moe, llama or deepseek_v3 model") from None
        if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(m.path)):
            raise ConfigError("model.path", f"{m.path!r} has a config.json but no weight files (*.safetensors): point it at a complete checkpoint directory")
    else:
        family = m.family
    if c.generator.return_routed_experts and family not in ("qwen3_moe", "deepseek_v3"):
        raise ConfigError("generator.return_routed_experts", f"routed experts exist only in MoE models, and the policy is {family}: set it false")
    tokenizer_dir, field_path = (m.tokenizer, "model.tokenizer") if m.tokenizer else (m.path, "model.path")
    if tokenizer_dir is not None:
        from meshrl.tokenizer import load_tokenizer

        try:
            load_tokenizer(tokenizer_dir)
        except Exception as e:  # noqa: BLE001 - whatever transformers raises, the directory is the user's to fix
            raise ConfigError(field_path, f"no tokenizer loads from {tokenizer_dir!r} ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): "
                              "give a directory holding a Hugging Face tokenizer (tokenizer.json or tokenizer_config.json)") from None
