"""The trained models and the engines that serve them: model, loss, trainer, critic, LoRA,
generator, weight sync and the distillation teacher (the rest of the tree: sections.py).

Every field has a safe default and a docstring (the string literal right below it), from
which the config reference (docs/config.md) is generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")
"""The mixture-of-experts values of `model.family`."""


@dataclass
class ModelConfig:
    family: Literal["qwen3", "qwen3_moe", "llama3", "deepseek_v3"] = "qwen3"
    """Model family from TorchTitan's registry. `qwen3_moe` and `deepseek_v3` are mixture-of-experts."""
    path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + *.safetensors) to start from. None: initialise from scratch with the sizes below."""
    tokenizer: str | None = None
    """Local Hugging Face tokenizer directory. None: the checkpoint directory if `path` is set, else meshrl's built-in character tokenizer."""
    vocab_size: int = 128
    """Vocabulary size (from-scratch models only). Must cover the tokenizer, at least its len() (its highest token id + 1; checked before the run where its tokenizer.json says): the built-in character tokenizer has 99 tokens, and 128 fits it."""
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

    @property
    def moe(self) -> bool:
        """Whether `family` is a mixture-of-experts one (MOE_FAMILIES)."""
        return self.family in MOE_FAMILIES


@dataclass
class LossConfig:
    advantage: Literal["grpo", "grpo_no_std", "rloo", "gae"] = "grpo"
    """Group advantage: `grpo` (reward minus group mean, over group std), `grpo_no_std` (Dr.GRPO: no std division), `rloo` (leave-one-out mean). `gae`: PPO with a learned critic instead of a group baseline: a value model on a proc of its own scores each batch, GAE(critic.gamma, critic.lam) gives every model token its advantage, and the critic trains on the same batch while the policy does (the `critic` section; docs/coevolve.md)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses reduce: mean over all tokens, mean over sequences of token means, or mean over sequences of token sums (Dr.GRPO)."""
    clip_low: float = 0.2
    """PPO clip epsilon below 1: ratios under 1 - clip_low are clipped."""
    clip_high: float = 0.28
    """PPO clip epsilon above 1 (clip-higher: set above clip_low to keep exploration)."""
    clip_against: Literal["versions", "sampler", "proximal"] = "versions"
    """The old policy the PPO clip measures its ratio against. `versions`: the log-probs of the policy that sampled each token (pi_theta / mu), with one trust region per version of the token's lag k: a token gets no more gradient once its probability has moved past (1 + clip_high)^(k+1) (positive advantage) or under (1 - clip_low)^(k+1) (negative) since it was sampled; on-policy tokens clip as PPO's. `sampler`: the same ratio with one trust region across the whole lag, (1 + clip_high) and (1 - clip_low) however many versions trained in between; on a sparse outcome it stopped the stale rewarded tokens and async runs trailed sync by 0.19 per sample against 0.05 (benchmarks/README.md section 18). `proximal`: the trainer's own log-probs before this optimizer step (pi_theta / pi_prox); with one optimizer step per batch that ratio is 1, so the clip never acts and nothing bounds how far stale batches push the policy (async runs drifted and collapsed this way, issue 34). The correction's IS weight applies either way."""
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
class PaceConfig:
    """On which steps a trainer updates its weights. Every step it takes its batch, and its
    version moves on with the run's; on a step off its pace it computes its loss and metrics
    without gradients (`trainer/updated` 0) and keeps its weights and optimizer state, so
    its generators go on sampling the weights of its last update under the new version
    number (relabelled to it where they hold those weights, nothing loaded). Step s (1, 2,
    ...: the version it makes) updates when (s - 1 - offset) mod every < steps. Models beside
    the policy train at paces of their own (docs/coevolve.md "Models at different paces")."""

    every: int = 1
    """The period, in steps. 1: every step updates."""
    steps: int = 1
    """How many consecutive steps of each period update (1 to `every`): `every: 20, steps: 10` trains ten steps, then holds ten."""
    offset: int = 0
    """The step of each period where the updates start (0 to `every` - 1): two models at `every: 2`, offsets 0 and 1, take turns."""
    accumulate: bool = False
    """On a step off the pace, also run the backward and keep the gradients: the next update steps as on all those steps' rows together (the loss's mean over all their tokens). In a synchronous run every one of those rows was sampled by the weights being trained (held since), so a model updating every 4th step trains on 4 steps' rows at its own rate. Costs a backward on held steps and keeps the gradients between steps (colocated on GPUs the memory plan counts them). Snapshots for a heal are taken at updates only, and a heal restores the newest state at or before the last update; a resume from a checkpoint written between updates starts without the held gradients."""

    def updates(self, version: int) -> bool:
        """Whether the step that makes `version` (1, 2, ...) updates the weights."""
        return (version - 1 - self.offset) % self.every < self.steps

    def last_update(self, version: int) -> int:
        """The newest step at or before `version` that updated the weights (0: none)."""
        return next((s for s in range(version, max(0, version - self.every), -1) if self.updates(s)), 0)


@dataclass
class TrainerConfig:
    procs: int = 1
    """Trainer processes (one GPU each on GPU machines)."""
    dp_shard: int = -1
    """FSDP2 data-parallel shard degree. -1: all trainer procs."""
    ep: int = 1
    """Expert-parallel degree for MoE models. Must divide `trainer.procs` and `model.num_experts`."""
    tp: int = 1
    """Tensor-parallel degree (TorchTitan's plan, sequence parallel on): each layer's weights split over `tp` procs, which train the same rows; data parallel runs over `trainer.procs / tp`. Must divide `trainer.procs`, `model.n_heads` and `model.n_kv_heads`. Dense families (qwen3, llama) only."""
    cp: int = 1
    """Context-parallel degree (TorchTitan's CP: ring attention over `cp` procs): each row's positions split over `cp` procs (head-tail balanced), which train the same rows, for rows too long for one GPU's activations; data parallel runs over `trainer.procs / (tp x cp)`. GPU only (the ring attention kernels are CUDA's); rows padded per micro-batch (`micro_batch_tokens=0`); dense families (qwen3, llama) only; not with LoRA."""
    lr: float = 5e-3
    """AdamW learning rate. The default suits the tiny from-scratch default model; pretrained checkpoints want about 1e-6 to 1e-5."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    grad_clip: float = 1.0
    """Gradient norm clip. 0 disables clipping."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; gradients accumulate over micro-batches. Unused when `micro_batch_tokens` is set."""
    micro_batch_tokens: int = 0
    """Token budget of one forward/backward: the rows of a micro-batch are packed back to back up to this many tokens, with no padding (attention kept within each row, positions restarting on each row), and the trainer's ranks get whole groups balanced by tokens. Must hold one row of `model.max_seq_len` tokens. Losses and gradients equal the padded path's to float tolerance. 0: `micro_batch_size` rows per micro-batch, each padded to its longest row."""
    activation_checkpoint: Literal["none", "selective", "full", "memory_budget"] = "none"
    """TorchTitan activation checkpointing of each transformer block: `full` keeps only each block's input and recomputes the block in backward (the least memory, for long rows); `selective` keeps the outputs of matmuls and attention but every second matmul; `memory_budget` lets the compiler choose within `ac_memory_budget` (needs `trainer.compile`). `none` keeps every activation: the fastest, and the default because the default run's rows are short (benchmarks/README.md: bytes per token per layer for each mode)."""
    ac_memory_budget: float = 0.5
    """With activation_checkpoint=memory_budget: the share of activation memory to keep, in (0, 1]."""
    offload_optimizer: Literal["auto", "always", "never"] = "auto"
    """Colocated on GPUs (placement=colocate): while the engines generate on the trainer's GPU, AdamW's state waits in host memory and returns before the next step (gradients are freed and the allocator's cache emptied either way). `auto`: when the memory plan does not fit without it. Each step then moves 8 bytes per trainable parameter (over its shard) to the host and back."""
    collective_timeout_s: float = 1800.0
    """How long a trainer rank waits for the others in a collective before the process group (NCCL's watchdog) aborts the run. Must exceed buffer.get_timeout_s: rank 0 waits that long for a batch while the other ranks wait for it in a broadcast (and rank 0's checkpoint and export writes, while the others wait at a barrier). The controller bounds the trainer's setup (checkpoint loading), export and checkpoint calls by it too, and a training call by it plus buffer.get_timeout_s."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs. `auto`: CUDA when available, else CPU."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of forward/backward compute; master weights, optimizer state and gradient reduction stay float32. `auto`: bfloat16 on CUDA (FSDP2 mixed precision), float32 on CPU. `bfloat16` on CPU autocasts the matmuls (attention and RMSNorm stay float32) and pays on CPUs with AMX (Sapphire Rapids and later: about 1.9x per step on the benchmark model); float32 keeps trainer and generator log-probs closest."""
    compile: bool = False
    """torch.compile each transformer block (TorchTitan's per-block compile), with dynamic shapes because RL batches change length every step. The compile runs in setup, alongside the generators' start-up (about 10 s on a CPU core for the benchmark model; cached under ~/.cache/meshrl/torchinductor unless TORCHINDUCTOR_CACHE_DIR names another). It makes a training step about 1.4x faster on CPU in bf16 and 1.1x in float32 (benchmark model). Off by default because short runs and tests are dominated by start-up."""
    cpus: str = "auto"
    """CPU cores the trainer procs are pinned to, as a Linux CPU list (`0-3`, `0,2`); `|` separates the lists of a host's procs by local rank (`0-3|4-7`; under the process launcher, whose stand-in hosts are all this machine, by rank). `auto`: a CPU trainer on this machine gets the cores the generators do not (half), each proc's thread pool sized to its cores; a GPU trainer is not pinned. Empty: no pinning. See meshrl/pinning.py."""
    checkpoint_every: int = 0
    """Save a distributed checkpoint every this many steps. 0: by time only (`checkpoint_every_s`), and at the end of the run."""
    checkpoint_every_s: float = 1800.0
    """Also save one when this many seconds have passed since the last, so a crash loses at most that much training whatever a step costs. 0: off."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints: after each save, older ones are removed whole (their loop state and every trained state only they name: the trainer's, the critic's, each model's), and with them the states of saves not kept (torn or deferred: a model at another version). Each holds the optimizer's state too, so a long run fills a disk without it (TorchTitan's keep_latest_k, TRL's save_total_limit). Never removed: the one `latest` names, the last good one an alarm named, and those past `latest` (a run resumed from an earlier one). 0: keep every one (an earlier one to go back to: docs/stability.md)."""
    interrupt_checkpoint_timeout_s: float = 120.0
    """On Ctrl-C or SIGTERM (scheduler preemption) the run lets the step in flight finish and checkpoints, within this many seconds, then stops; `meshrl run --resume` continues from there. Keep it under the scheduler's grace period (Slurm's KillWait)."""
    snapshot_every: int = 1
    """Keep the trainer's state (weights, optimizer, lr schedule, step, random generators) restorable every this many steps, in RUN_DIR/snapshots/ (a CPU rank copies its shards into files reused from snapshot to snapshot; a GPU trainer stages them to host memory for DCP), written in the background while the new version is published and the next batch awaited, complete before the next optimizer step. A trainer proc that dies is healed from the newest one (docs/healing.md), losing at most this many steps; they are trained again from the batches the queue kept. PPO's critic keeps its own the same way (RUN_DIR/critic/snapshots/). 0: off (a heal restores the last checkpoint)."""
    snapshot_budget: float = 0.05
    """The largest share of a step's time the snapshot writes may cost where the trainer shares its cores with the generators (`placement: colocate` on CPU): there each write is made in the trainer's own turn, on the step's path. When one write takes more than this share of the step's period, the next snapshots are spaced out to keep their average within it, up to 10 steps apart (metric `trainer/snapshot_spacing`), and a heal may lose that many steps. With cores of its own (`split`) the trainer writes while it waits for its next batch, and snapshots keep `snapshot_every`. 0: never spaced out."""
    max_restarts: int = 3
    """How many times a run replaces a dead trainer mesh, counted for each (the policy's, PPO's critic, each trained model's; docs/healing.md) from each start: a resume counts afresh (a Slurm run resubmitted is bounded by `launcher.max_resubmits`), and so do `trainer/restarts` and `critic/restarts`. Past it the run stops, resumably (`meshrl run --resume`). 0: a dead trainer stops the run."""
    restart_timeout_s: float = 600.0
    """The longest one heal may take (stop the dead mesh, spawn a new one, restore, reconnect weight sync); past it the run stops, resumably."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss and its off-policy corrections."""
    pace: PaceConfig = field(default_factory=PaceConfig)
    """On which steps the weights update (every step by default); a model beside the policy may set a pace of its own."""


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
    """Sampling temperature, at least 0.01 (vLLM samples a lower one at 0.01). The trainer scores tokens at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling. -1 disables it."""
    update_mode: Literal["keep", "abort", "drain", "block"] = "keep"
    """How a new policy version is applied while generating: keep in-flight requests across the swap, abort and resume them from their prefix, drain them first (those still running after half of weight_sync.timeout_s are kept across it instead, counted in the generator's `drains_cut`), or block (synchronous)."""
    max_num_seqs: int = 64
    """Most sequences one engine decodes at once."""
    compile: bool = False
    """Run vLLM's compiled model (torch.compile, plus CUDA graphs on GPU) instead of eager mode. On a CPU it decodes the benchmark model about 1.35x faster for 15-30 s more start-up per engine (compiled code is cached in ~/.cache/vllm). Off by default: short runs and tests are dominated by start-up."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory a vLLM engine may take (GPU only)."""
    return_routed_experts: bool = False
    """MoE only: return the expert ids each sampled token was routed to, per layer, for routing replay (trainer.loss.routing_replay). On GPU vLLM returns them (model runner V2); on CPU meshrl's worker extension records them from vLLM's router hook (meshrl/generator/routing_capture.py). A model beside the policy inherits it (`models[i].generator` overrides): every model that returns them must be MoE with the policy's [layers, top_k], since one batch packs every model's routes."""
    startup_timeout_s: float = 300.0
    """Seconds an engine may take to start before the run fails."""
    stall_timeout_s: float = 300.0
    """A replica with requests in flight that has produced no token and scored no sequence for this long, while generating (not paused, updating or asleep), is wedged (alive, not generating: a hung engine core or device) and replaced as a dead one is, its requests asked again of the others. Keep it above the longest prefill the run can ask for (the batch's prompts at model.max_seq_len) on the slowest device. 0: off (a wedged replica is then replaced only when its next weight update times out, weight_sync.timeout_s)."""
    cpus: str = "auto"
    """CPU cores the replicas are pinned to (their vLLM CPU workers bind their threads there), as a Linux CPU list; `|` separates per-replica lists, replica i taking list i modulo their count (`4-5|6-7`). `auto`: with a CPU trainer on this machine, half the cores, split between replicas (at least `tp` each). Empty: no pinning, vLLM binds its threads itself."""


@dataclass
class WeightSyncConfig:
    transport: Literal["auto", "rdma", "collective", "files", "shm"] = "auto"
    """How weights travel: Monarch RDMA buffers, a broadcast group (`collective`: the vLLM workers join it and receive, into their GPU's memory where every peer holds a GPU, else into host memory), `shm` (one host only: the generators map the trainer's staging snapshot, a shared-memory file, and load from it, with no transfer and no receive copy; placement=colocate's handoff; colocated on one GPU, the snapshot is a bucket on that GPU that the engine opens through a CUDA IPC handle), or (named fallback) safetensors files. `auto`: `collective` across hosts, or on one host whose trainer and generators hold GPUs of their own (NCCL between GPU-resident buckets, received by the vLLM workers on their GPUs); else `shm`. The collective group is NCCL when every peer holds a GPU, else gloo, received into host memory."""
    bucket_mb: int = 256
    """Size of the packed transfer buckets, in MiB."""
    timeout_s: float = 120.0
    """Longest one version's transfer may take before it is an error, and its load into an engine. A generator replica's whole update (the transfer, a `drain` of half this, the load) may take 2.5 times this plus 30 s before the controller replaces it as dead; a request waits as long for the version it needs."""
    files_dir: str | None = None
    """Directory for the `files` transport, made if missing; it, or its nearest existing parent, must be writable (checked before the run). Each model of each run writes its versions in a new directory of its own in it, named `meshrl-weights-HOST-PID-*` (`tempfile.mkdtemp`, PID the controller's), so that none reads another's; a run's start removes those of this host's controllers that are gone (killed before their exit removed them). None: the system's temporary directory ($TMPDIR, else /tmp)."""


@dataclass
class DistillConfig:
    teacher: str | None = None
    """On-policy distillation: a local Hugging Face checkpoint of the teacher (of the policy's tokenizer: it scores the policy's token ids), run on a vLLM engine of its own, which scores every token of the student's episodes (with `models`, the student is the policy: the teacher scores its threads, and the other models train on their own rewards alone). Each model token's advantage becomes `kl_weight x (teacher log-prob - student log-prob)` (reverse KL, per token), plus `reward_weight x` the task's group advantage. None: off (plain RL)."""
    kl_weight: float = 1.0
    """Weight of the per-token reverse-KL advantage."""
    reward_weight: float = 0.0
    """Weight of the task reward's group advantage mixed in (0: pure distillation)."""
    cpus: str = ""
    """CPU cores the teacher's engine is pinned to (Linux CPU list). Empty: not pinned."""


@dataclass
class CriticConfig:
    """PPO's learned critic (trainer.loss.advantage=gae; docs/coevolve.md): a value model on a proc of its own beside the trainer."""

    init: Literal["policy", "scratch"] = "policy"
    """Where the value model's weights start. `policy`: the policy's starting weights (its `model.path` checkpoint, or the same seeded initialisation as a from-scratch policy) with a zero value head, so the first values are 0 and the first advantages are the returns; `scratch`: the policy's shapes, initialised from `seed` + 1. The value head is a Linear(dim, 1) in place of the LM head either way."""
    path: str | None = None
    """A Hugging Face checkpoint directory the critic starts from instead (its own shape, which may differ from the policy's): a one-label token classifier (a critic exported as `hf/final-critic`, or another framework's) keeps its value head; a one-label sequence classifier (a reward model, as OpenRLHF starts its critic) gives its score head as the value head; a causal LM gives its trunk, under a zero value head. It reads the policy's token ids, so it must share the policy's tokenizer: its vocabulary must cover the policy's and its positions `model.max_seq_len`. null: `init` says."""
    procs: int = 1
    """Procs the critic trains on, on the trainer's first host, its weights, gradients and AdamW state sharded over them by FSDP2 (each proc computes the values and gradients of its share of a batch's rows): a critic too large for one GPU, or a CPU critic given more cores. Beside a GPU trainer each holds a GPU of its own. 1: one unsharded proc."""
    lr: float = 1e-3
    """The critic's AdamW learning rate. The default suits the tiny from-scratch default model (with `epochs` 4; at 5e-3 its values overshoot the mean return for the first steps); pretrained checkpoints want about 1e-6 to 1e-5."""
    weight_decay: float = 0.0
    """The critic's AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up of the critic's learning rate over this many of its steps."""
    grad_clip: float = 1.0
    """The critic's gradient norm clip. 0 disables clipping."""
    value_clip: float | None = 0.5
    """verl's `cliprange_value`: each token's loss is the larger of (V - R)^2 and (V_clip - R)^2, V_clip being V kept within this distance of the values that scored the batch, so one step cannot move a value far from the one its advantage was computed with. null: the plain squared error."""
    gamma: float = 1.0
    """GAE's discount, per model token (env tokens between turns are carried over, not counted). 1: the return is the sum of the rewards to come, as the task's reward is an episode's."""
    lam: float = 1.0
    """GAE's lambda: 1 gives A_t = return - V_t (unbiased, noisier); lower leans on the critic's own estimates of the next state (less variance, biased while the critic is wrong)."""
    value_lam: float | None = None
    """GAE's lambda for the critic's returns alone (VC-PPO's and VAPO's decoupled GAE): 1 keeps the critic's targets the unbiased sums of the rewards to come while `lam` (or `adaptive_lam`) below 1 lowers the variance of the policy's advantages. null: `lam` for both."""
    adaptive_lam: float = 0.0
    """VAPO's length-adaptive lambda for the policy's advantages: each episode's lambda is 1 - 1 / (adaptive_lam x its model tokens), at least 0, in place of `lam`, so a long answer sums more of its own rewards and a short one leans on the critic (VAPO: 0.05, with `value_lam` 1). The critic's returns keep `value_lam` (null: `lam`). 0: off."""
    whiten: bool = True
    """Centre and scale the advantages over each batch's model tokens (verl's default for GAE). The returns the critic regresses on are never whitened."""
    policy_warmup: int = 0
    """The first this many policy steps train on the group advantage (as `grpo`: reward minus its group's mean, over the group's std) instead of the critic's, while the critic learns from those same batches; from then on the policy trains on GAE. Unlike verl's critic_warmup, which skips the actor's update, every step still makes a new policy version: in an asynchronous run the episode queue admits new work by version, so steps without one would stall generation and waste what was already generated. With generator.group_size=1 the group advantage is 0, so those steps move the policy only by the terms that need no advantage (`trainer.loss.entropy_coef`, `kl_coef`, `trainer.weight_decay`; all 0 by default, and then they train the critic alone)."""
    epochs: int = 4
    """Optimizer steps the critic takes on each batch, each over the whole batch (as verl's critic takes one per mini-batch and epoch). The value clip acts from the second on. They run in the background while the policy trains and the next batch is generated, so they cost no step time until they outlast that (`critic/wait_s`). On the default task one step per batch left the critic's explained variance near 0; four reached 0.1-0.2."""
    micro_batch_size: int = 16
    """Rows per critic forward/backward; gradients accumulate over micro-batches (as trainer.micro_batch_size). With trainer.micro_batch_tokens set, the critic packs rows to that token budget instead."""
    timeout_s: float = 600.0
    """Longest the critic may take to set up, to score a batch (including finishing its previous batch's training step) or to write or load its checkpoint, before the run fails."""


@dataclass
class LoRAConfig:
    rank: int = 0
    """LoRA rank. 0: off (full fine-tuning). Above 0: the base weights are frozen, the trainer's optimizer holds the adapters only, and weight sync sends the adapter alone, loaded through vLLM's LoRA support. With `models`, every trained model trains adapters of its own on its own base."""
    alpha: float = 16.0
    """Scaling numerator: an adapter's update is scaled by alpha / rank."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Projections that get an adapter, by Hugging Face module name (attention: q_proj, k_proj, v_proj, o_proj; MLP: gate_proj, up_proj, down_proj). MoE families adapt attention and their dense and shared-expert MLPs; routed experts stay frozen."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (the generator samples without it). Its noise is in the trainer's log-probs, so in the importance ratios against the sampler's and the drift metrics (the fresh tokens' mismatch) too: 0 keeps them exact."""
