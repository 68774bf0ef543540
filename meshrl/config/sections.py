"""The run configuration: a tree of typed dataclasses, plain data.

Every field has a safe default and a docstring (the string literal right below it); the
config reference (`meshrl config docs`, docs/config.md) is generated from those
docstrings, so it cannot drift from the code. Configs load from YAML, from a dict, or in
code, and take dotted command-line overrides (`trainer.lr=1e-5`). Building a `Config`
checks what the values alone can show (config/checks.py); what needs the tasks, user code
or this machine's files is checked beside its component, before a run (meshrl/preflight.py).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from meshrl.config.checks import validate
from meshrl.config.loading import ConfigError, apply_overrides, build, dump_yaml, load_yaml
from meshrl.config.models import (  # noqa: F401 (MOE_FAMILIES: re-exported)
    MOE_FAMILIES,
    CriticConfig,
    DistillConfig,
    GeneratorConfig,
    LoRAConfig,
    LossConfig,
    ModelConfig,
    PaceConfig,
    TrainerConfig,
    WeightSyncConfig,
)


@dataclass
class BufferConfig:
    depth: int = 2
    """Batches admitted beyond the one the trainer trains next: 0 synchronous (on-policy), 1 a double buffer, K a bounded queue of K batches. Admission also never runs further ahead than `max_lag`."""
    max_lag: int | None = 2
    """The staleness bound: no trained token is more than this many versions behind the trainer. Admission is derived from it (with `depth`), and tokens still too stale at sample time are masked or dropped. A model held by its `trainer.pace` counts its lag in its own weight updates there, not in the versions its held steps relabelled (docs/coevolve.md). None: no bound at sample time; admission is bounded by `depth` alone, so a straggling group (or one `sampling: random` draws late) can be trained staler than `depth`."""
    lag_granularity: Literal["token", "sequence"] = "token"
    """`token`: stale tokens are masked out of the loss; `sequence`: a group whose oldest token is too stale is dropped whole (and replaced)."""
    sampling: str = "fifo"
    """Which finished groups a batch takes: `fifo` the oldest (by the oldest version among their model tokens, then by arrival: a group claimed earlier that finished later is not overtaken, nor left to go stale), `random` any, uniformly (with `max_lag`, a group not drawn in time goes stale and is masked or dropped: more generation per batch), or an import path `module:callable(groups, n, rng) -> indices`, given the groups oldest first."""
    get_timeout_s: float = 600.0
    """Longest the trainer waits for a batch before failing."""
    dynamic_sampling: bool = False
    """Dynamic sampling (DAPO): a finished group that carries no gradient (its trained episodes all scored the same, so every advantage is 0) is dropped at the queue, not trained, and admission starts a replacement, so a batch is made of groups with signal. Bounded by `max_dropped_per_batch`. Its episodes still count in `reward/mean` and `buffer/sampled_reward_mean`; `trainer/reward_mean` then covers only the groups with signal. Off by default: on the tool-use config it sped the first climb but drove the policy entropy to 0.01 nats and one run to reward 0 (docs/stability.md has the runs)."""
    max_dropped_per_batch: int | None = None
    """Dynamic sampling's bound: at most this many groups are dropped for carrying no signal between two batches the trainer takes; past it they are kept and trained (counted in `buffer/kept_zero_variance_groups`), so a task where every episode scores the same costs at most this much extra generation per batch and never stalls. None: `batch_groups` (at most twice the generation per batch). 0 drops nothing."""


@dataclass
class AlarmConfig:
    enabled: bool = True
    """Watch the run for a cliff and say so on the console in one line, naming the step of the last good checkpoint (meshrl/stability.py). It only reports: training goes on."""
    window: int = 10
    """Steps per window: reward and entropy are judged on their mean over the last `window` steps."""
    reward_drop: float = 0.5
    """Reward cliff: the last window's mean reward (`buffer/sampled_reward_mean`) falls under this fraction of the best window mean so far. In a game each trained model's own `trainer/reward_mean` is watched (`NAME/trainer/reward_mean`), and its alarm names it."""
    min_best_reward: float = 0.1
    """A reward cliff needs a best window mean of at least this: a run that has not learned anything yet cannot fall."""
    entropy_floor: float = 0.02
    """Entropy cliff: the last window's mean policy entropy (`trainer/entropy`, nats per trained token) falls under this. A policy that learns its task legitimately gets sharp, so the floor sits under what the shipped tool-use config's policies reach (0.05 to 0.6 at 150-300 steps; with dynamic sampling on they went to 0.01, and the alarm fired); 0 turns the entropy alarm off."""
    divergence_window: int = 10
    """Divergence alarm (a reward being gamed): steps per window. Wherever the run has a signal it does not train on (the env's reward beside scorers when `scoring.env_weight` is 0, a scorer at weight 0, the held-out evaluation's reward), the trained reward is watched against it, window by window (docs/stability.md). The evaluation's points are one per evaluation: its windows hold divergence_window / eval.every of them, at least 2."""
    divergence_z: float = 4.0
    """Divergence: from the reference's best window so far to the last window, the trained reward's mean rose and the reference's fell, each by more than this many times the noise of that difference (measured from each series' own step-to-step changes). Measured (benchmarks/reward_hacking.py): no alarm in 3 seeds each of the default and tool-use configs at any z from 2 to 6 (divergence_min_move decides there); a planted reward model's game flagged 6 to 15 steps after the verifier's peak (docs/stability.md)."""
    divergence_min_move: float = 0.25
    """Divergence: each of the two moves must also be at least this fraction of the signal's size: its mean in the reference's best window, or its spread across a step's episodes (`reward/std`, `scoring/NAME/std`; the evaluation's taken as the trained reward's) where that is larger. A signal all but constant (a guard at 1.0 but for an episode or two) has next to no noise, and its fall from 1.000 to 0.998 is no news: at 0 all 6 measured healthy runs raised an alarm, at 0.1 one did, at 0.25 none."""
    divergence_corr: float = -0.25
    """Divergence: the mean over the last window of the rank correlation between the trained reward and the reference across each step's episodes (`scoring/NAME/corr_trained`) is under this. Measured: down to -0.15 in healthy runs (a repetition guard at weight 0 on the tool-use config), -0.23 to -0.42 in gamed ones. -1 turns this test off."""
    on_divergence: Literal["warn", "stop"] = "warn"
    """What a divergence alarm does: `warn` (its line, training goes on) or `stop` (the run checkpoints and exits with the line, status 1; resume or go back to the last checkpoint where the signals agreed)."""


@dataclass
class SandboxConfig:
    backend: Literal["bwrap"] = "bwrap"
    """Isolation tool for model-written code (the `python` tool, coding tasks' hidden tests): `bwrap` (bubblewrap; Debian package `bubblewrap`). There is no unsandboxed mode: a missing or broken tool stops the run at preflight."""
    python: str = "auto"
    """Interpreter inside the sandbox. `auto`: the system's /usr/bin/python3, else this Python's installation (its prefix mounted read-only). A path outside /usr must be under `ro_paths`."""
    ro_paths: list[str] = field(default_factory=list)
    """Extra host paths mounted read-only inside (a virtual environment with the packages the code may import). Nothing else of the host's files is visible besides /usr and the few entries of /etc the loader and Python read (meshrl/rollout/bwrap.py `ETC`)."""
    pool_size: int = 2
    """Sandboxes kept started and waiting (namespaces made, interpreter loaded) per rollout worker; each runs one call and is replaced. 0: every call starts its own."""
    max_concurrent: int = 4
    """Calls running at once per rollout worker; more wait their turn."""
    wall_timeout_s: float = 5.0
    """Wall-clock limit of one call (from the moment the code is handed over); the whole sandbox is killed then."""
    cpu_time_s: int = 3
    """CPU-time limit of each process in the sandbox (RLIMIT_CPU), in seconds."""
    memory_mb: int = 512
    """Address-space limit of each process in the sandbox (RLIMIT_AS), in MiB."""
    max_processes: int = 32
    """Processes and threads the sandbox may hold at once (RLIMIT_NPROC, counted in its own user namespace as an unprivileged uid)."""
    max_file_mb: int = 16
    """Largest file a sandboxed process may write (RLIMIT_FSIZE), in MiB."""
    workspace_mb: int = 32
    """Size of the private tmpfs workspace (/tmp, the working directory), in MiB."""
    max_output_bytes: int = 65536
    """Bytes of stdout plus stderr kept from one call; a program that writes more is killed (limit `output`)."""
    uid: int = 65534
    """When meshrl runs as root: the unprivileged uid that bubblewrap and the code run as (root is exempt from RLIMIT_NPROC). Ignored otherwise (the sandbox runs as the calling user)."""


@dataclass
class RolloutConfig:
    workers: int = 1
    """Rollout worker procs. Each plays groups of episodes and hosts their env instances: together they are the env pool."""
    groups_per_worker: int = 0
    """Groups one worker plays at once. 0: enough to keep every generator slot busy (2 x generator.replicas x generator.max_num_seqs / group_size / workers)."""
    env: str | None = None
    """Import path `module:Class` of an environment (reset/step, see meshrl/rollout/env.py), one instance per episode. None: the task's own env, or a single-turn env around the reward."""
    env_args: dict = field(default_factory=dict)
    """Keyword arguments for `env`'s constructor (or its classmethod `from_config(config, **env_args)`, where it has one)."""
    max_turns: int = 8
    """Most model turns in one episode; an episode still going then ends with finish_reason `length`. In a game (docs/coevolve.md), this times the number of models, each Ask of a list counting one; a game cut there ends unscored (every thread's reward 0)."""
    env_timeout_s: float = 30.0
    """Longest one env call (its construction, reset or step) may take; a timeout or exception fails that episode (reward 0) and the run goes on. A step also gets the time its env says its own bounded work may take (`step_timeout_s`: a reward within `scoring.timeout_s`, tool calls, sandbox runs of hidden tests)."""
    tool_parser: str = "hermes"
    """How tool calls are read from model turns (tool envs): `hermes` (`<tool_call>{json}</tool_call>` after the turn's `</think>`, Qwen/Hermes; the tags are read where a tokenizer marks them special too), `compact` (a turn `!ARG` calls the env's first tool: for tiny models trained from scratch), or an import path `module:callable(text) -> list[ToolCall]`."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Where model-written code runs (meshrl/rollout/sandbox.py): isolation, limits, the warm pool."""


@dataclass
class ScorerConfig:
    """One scoring signal beside the env's reward (meshrl/scorers/, docs/scoring.md)."""

    kind: Literal["function", "reward_model", "judge", "remote", "prm"] = "reward_model"
    """`function`: a Python reward function, called in each rollout worker; `reward_model`: a Hugging Face sequence-classification checkpoint (one logit); `judge`: a vLLM engine on a causal-LM checkpoint, prompted with `template`, its reply read by `parser`; `remote`: a user's reward server over HTTP (POST of a JSON batch); `prm`: PRIME's implicit process reward model, a causal LM trained online on the episodes' outcomes, its per-token rewards through the process-advantage path (docs/coevolve.md). Every kind but `function` runs on scorer procs of its own, shared by all rollout workers."""
    name: str | None = None
    """Name of the signal in the metrics (`scoring/NAME/...`). None: the kind, numbered when two scorers of a kind have no name."""
    weight: float = 1.0
    """The signal's weight in the trained reward: reward = scoring.env_weight x the env's reward + the sum of weight x score. 0: logged, not trained on."""
    model: str = "policy"
    """The trained model whose episodes it scores: `policy`, or the name of one of `models` (docs/coevolve.md). In a game each thread that model speaks in is scored on its own: its opening observation is the prompt, its text after that the response, and the score joins that thread's reward (`scoring.env_weight` x the game's reward for the thread + weight x score), reported as `NAME/scoring/SCORER/...` for a model beside the policy. A process scorer's steps are that thread's, its baseline its model's rows of the group; a `prm` scores the policy's threads alone."""
    path: str | None = None
    """`function`: import path `module:function` (prompt, response, sample) -> float, or a list of floats (one per step) with `process`; `reward_model` / `judge`: a local checkpoint directory (its own tokenizer and chat template); `prm`: a causal-LM checkpoint directory with the policy's tokenizer, or None for the policy's starting weights (model.path, or the same seeded initialisation)."""
    url: str | None = None
    """`remote`: the endpoint that takes `{"items": [{"prompt", "response", "sample"}, ...]}` and answers `{"scores": [...]}` (a number per item, or a list per item with `process`)."""
    template: str = (
        "Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {response}\nReference: {answer}\nReply with the score only.\nScore:"
    )
    """`judge`: the judge's prompt, a Python format string over `{prompt}`, `{response}` and `{answer}` (the record's reference, empty if none); sent as a user message through the judge's chat template when it has one."""
    parser: str = "number"
    """`judge`: reads the reply as a score, after a thinking judge's `<think>...</think>` (a reply cut inside it is unparsable). `number`: the number after the reply's last `final score:`, else its first `score:` that is no maximum (`Score: 7`), else its first number; `yes_no`: 1 for a reply whose first word is yes, 0 for no; or an import path `module:function(text)` returning a number, or None for an unparsable reply."""
    scale: float | None = None
    """`judge`: the parsed number is multiplied by this. None: 0.1 for the default template read by the `number` parser, which maps its 0-10 rating to 0-1, a verifier's range (at 1.0 a 0-10 judge outweighed a 0/1 verifier ten to one), and 1.0 for a template of your own or another parser (`yes_no`'s 0 or 1)."""
    unparsable: float | None = 0.0
    """`judge`: the score of a reply the parser cannot read; counted in `scoring/NAME/unparsable`. None: the episode fails instead (reward 0, out of the loss)."""
    probe_reply: str = "7"
    """`judge`: a reply the parser must read as a finite number at preflight (catches a parser that cannot parse its own judge's format)."""
    max_new_tokens: int = 16
    """`judge`: the reply's token budget (greedy decoding)."""
    max_len: int = 1024
    """`reward_model` / `judge`: the longest input in tokens; a longer one keeps its last max_len tokens (a judge: within its checkpoint's max_position_embeddings, less max_new_tokens)."""
    batch_size: int = 32
    """Items scored together; requests from every rollout worker are batched up to this size."""
    batch_wait_s: float = 0.05
    """Longest a request waits for others to fill a batch: a batch is scored when it is full or its first request has waited this long."""
    timeout_s: float = 60.0
    """Longest one request (one episode's score, queueing included) may take; a remote call is retried within it."""
    retries: int = 2
    """`remote`: further tries after a failed HTTP call (with 0.5 s, 1 s, ... between them); a request still failing fails its episode and is counted in `scoring/NAME/failed`."""
    replicas: int = 1
    """Scorer procs of this signal (requests go to the least loaded); a dead one is replaced and its requests asked again. Ignored for `function`."""
    procs: int = 1
    """`prm`: procs of its one replica. Above 1, the PRM, its frozen reference and its AdamW state are sharded over them (FSDP2), each scoring and training on its share of every batch's rows, so a PRM the size of the policy fits where the policy's trainer does (a GPU each beside a GPU trainer). Every other kind: 1 (they scale by `replicas`)."""
    process: Literal["none", "turn", "step"] = "none"
    """Process reward: `turn` scores the episode after each model turn, `step` after each `step_delimiter` inside the model's text (a reward model scores each prefix; a function or remote server returns a list, one score per step). The step scores become per-token advantages (scoring.process_advantage), or under PPO's critic (`trainer.loss.advantage: gae`) rewards at each step's last token that GAE adds up; the outcome score is the last step's."""
    step_delimiter: str = "\n"
    """`process: step`: the text that ends a step (the response's end always ends the last)."""
    beta: float = 0.05
    """`prm`: the per-token reward is q_t = beta x (log pi_prm(y_t) - log pi_ref(y_t)), pi_ref the PRM's frozen starting weights; the PRM trains on BCE(sigmoid(sum_t q_t), outcome) (PRIME's 0.05)."""
    lr: float = 1e-3
    """`prm`: AdamW learning rate of the PRM's one step per scored batch (1e-3 suits the tiny default model; PRIME used 1e-6 on 7B checkpoints)."""
    update: Literal["after", "before"] = "after"
    """`prm`: when the PRM trains on a batch's outcomes: `after` scoring it (its scores come from a PRM that has not seen those outcomes), or `before` (PRIME's default: the PRM fits the batch, then scores it)."""
    train_accuracy: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """`prm`: PRIME's accuracy filter. The PRM trains only on the groups whose share of successful episodes (outcome above 0.5) lies in this closed range [low, high]; every group is still scored. PRIME used [0.2, 0.8]: a group all right or all wrong says nothing about which of its steps mattered. A batch with no such group takes no step (the version stays). [0, 1]: every group (the default). With one completion per prompt (PPO's `generator.group_size=1`) a group is all right or all wrong, so a range that holds neither 0 nor 1 is refused."""

    def judge_scale(self) -> float:
        """`scale`, or where None its default: 0.1 for the default template's 0-10 rating read by the `number` parser, else 1.0."""
        if self.scale is not None:
            return self.scale
        default = type(self).__dataclass_fields__["template"].default
        return 0.1 if self.parser == "number" and self.template == default else 1.0

    def judge_context(self) -> int:
        """A judge engine's context: `max_len` + `max_new_tokens`, never past its checkpoint's positions."""
        import json

        with open(os.path.join(self.path, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings") or self.max_len + self.max_new_tokens
        return min(self.max_len + self.max_new_tokens, positions)


@dataclass
class ScoringConfig:
    reward_fn: str | None = None
    """Import path `module:function` of a reward function (prompt, response, sample) -> float, sync or async. None: the task's built-in exact reward."""
    reward_model: str | None = None
    """Local checkpoint directory of a reward model scored behind the same interface. None: no reward model."""
    timeout_s: float = 30.0
    """Longest one reward call may take; a timeout or exception fails the episode (reward 0) and the run goes on."""
    scorers: list[ScorerConfig] = field(default_factory=list)
    """More signals, scored as each episode finishes (reward models, LLM judges, remote servers, functions): see ScorerConfig and docs/scoring.md. Each is logged as `scoring/NAME/mean`, with its time and queueing."""
    env_weight: float = 1.0
    """Weight of the env's reward (the task's verifier, scoring.reward_fn or reward_model, or rollout.env's rewards) in the trained reward. 0 with scorers: the env's reward is only logged (`scoring/env/mean`), so the run learns from the scorers alone."""
    process_advantage: Literal["return", "step"] = "return"
    """How step scores (a scorer with `process`) become per-token advantages. `return` (PRIME-style): each token gets the group advantage plus the sum of the group-centred step scores from its own step to the end; `step` (turn-level): each token gets the group advantage plus its own step's group-centred score. A model trained by PPO's critic (`gae`) takes the step scores as rewards instead, its critic's values their baseline (neither form applies)."""
    process_weight: float = 1.0
    """Weight of the process term in the per-token advantage (under PPO's critic: of the step scores as rewards)."""

    def scorer_names(self) -> list[str]:
        """Each scorer's name in the metrics: its `name`, else its kind (numbered from 1 when
        more than one scorer of that kind has no name)."""
        kinds = [s.kind for s in self.scorers if not s.name]
        seen: dict[str, int] = {}
        names = []
        for spec in self.scorers:
            if spec.name:
                names.append(spec.name)
                continue
            seen[spec.kind] = seen.get(spec.kind, 0) + 1
            names.append(spec.kind if kinds.count(spec.kind) == 1 else f"{spec.kind}-{seen[spec.kind]}")
        return names


@dataclass
class ContractsConfig:
    probe: bool = True
    """Before any mesh starts, call the user's code once on the first data record: construct a `rollout.env` and `reset` it, call a reward function (`scoring.reward_fn`, or one passed in code) on the record's answer as the response. A wrong return, an exception or a timeout (`rollout.env_timeout_s`, `scoring.timeout_s`) stops the run with one line, exit 2. Off: for an env too costly to construct twice; the same checks still apply to every call during the run. See docs/contracts.md."""
    data_check_s: float = 60.0
    """Seconds the check before the run may spend reading a `.jsonl`, `.parquet` or `datasets` source row by row (each parsed, its prompt field checked); the first bad row stops the run as `FILE:LINE: what is wrong`, exit 2. A source too big to finish in time is checked that far, and the rest when the episode queue reads it (a bad row then ends the run with the same line). 0: no check before the run."""
    warn_failed_frac: float = 0.25
    """A step in which more than this share of the episodes failed (an env or reward that raised, timed out or broke its contract) gets one warning line on the console, with the first failure and its log file: once per distinct failure. 1: never."""
    stop_after_failed_steps: int = 3
    """When every episode of this many consecutive steps failed, the run checkpoints (resumable with `meshrl run --resume`) and stops with the first failure, exit 1. 0: never stop."""


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
    """Prompts: `task:NAME` for a built-in task (single-turn digits, digits_sparse (1 or 0), letters, count, add, copy, longtail with heavy-tailed lengths; multi-turn calc with a tool, pyexpr with a sandboxed python tool, code with hidden tests run in the sandbox, guess, longtail_chat: see meshrl/tasks.py), `reasoning_gym:NAME` for a reasoning-gym task scored by its own verifier (`pip install 'meshrl[reasoning]'`; configured by `data.task_args`), a local .jsonl / .parquet file, or a directory written by `datasets`' `save_to_disk`."""
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
    """Held-out prompts, in any form `data.source` takes (read with data's `prompt_key` and `answer_key`). None: the training task (`task:` or `reasoning_gym:`) drawn from a seed stream of its own; a file or dataset source needs one given here (not its own file: refused). A `datasets` directory of several splits is read at its `test` split, else `validation`, else as `data.source` reads one (`train`). A `task:` or `reasoning_gym:` eval source is scored by its own reward; any other by the run's. With `models`: required, a `task:` or `reasoning_gym:` source that is no game, which the policy plays alone."""
    task_args: dict = field(default_factory=dict)
    """Keyword arguments of a `reasoning_gym:` eval.source's config (as `data.task_args` for training); only with eval.source set."""
    num_prompts: int = 32
    """Prompts per evaluation (the first of the held-out source, in its order)."""
    k: int = 4
    """Samples per prompt at `generator.temperature` for pass@k and the mean sampled reward; one greedy answer per prompt gives the accuracy."""


@dataclass
class LauncherConfig:
    kind: Literal["local", "process", "slurm", "torchx", "workers"] = "local"
    """Where meshes run: `local` (this machine), `process` (`launcher.hosts` local worker processes standing in for Slurm hosts: the Slurm code path, testable anywhere), `slurm` (an allocation submitted through Monarch's SlurmJob), `torchx` (this process already runs inside a job launched from `meshrl/torchx_component.py:train`; meshes use its host), or `workers` (hosts already running `meshrl worker --address IP:PORT`, listed in `launcher.workers`; this process attaches to them over Monarch's TCP transport, as to a Slurm allocation's; see docs/multihost.md)."""
    hosts: int = 1
    """Hosts to allocate (process/slurm; with `workers`, the number of `launcher.workers`). One host holds every role; with more, hosts split between trainer and generator (by GPUs when `gpus_per_host` > 0, else in proportion to their procs), and the coordinator (episode queue, rollout workers and their envs) shares the first generator host, where every model turn is asked for."""
    workers: list[str] = field(default_factory=list)
    """launcher.kind=workers: `IP:PORT` of each host's `meshrl worker`, in host order (the trainer hosts first, then the generator hosts, then `launcher.spare_hosts` spares)."""
    address: str | None = None
    """launcher.kind=workers: this controller's own IP as the hosts reach it. Its Monarch channel and the weight-sync store listen on it and nowhere else. Required with `workers`; must be an address of this machine."""
    gpus_per_host: int = 0
    """GPUs per host, for the device plan (`meshrl config plan`) and the Slurm job. 0: for `local`, `process` and `torchx` runs (the job's one host, whose GPUs a TorchX named resource `h` may give) the GPUs this host has (none on a CPU machine); elsewhere none (a CPU-only cluster)."""
    gpu_memory_gib: float = 0.0
    """Memory of each GPU, for the memory plan (`meshrl config plan`): what every proc will hold is checked against it before any mesh starts. 0: the GPU this machine has (NVML); with none (planning a cluster's run from a CPU machine), the memory plan is skipped."""
    partition: str | None = None
    """Slurm partition. None: the cluster default."""
    time_limit: str = "01:00:00"
    """Slurm wall-clock limit, HH:MM:SS."""
    dry_run: bool = False
    """Run every check, then print the job instead of starting it: under `launcher.kind=slurm` the sbatch script, else where each role would run (`meshrl config plan` prints the device plan). Writes nothing but, under slurm, an empty RUN_DIR/slurm/ (the script's --output directory)."""
    account: str | None = None
    """Slurm account to charge (`#SBATCH --account`). None: the cluster default."""
    start_timeout_s: float = 1800.0
    """Longest wait for the allocation to start running and its hosts to connect (queueing included); then the job is cancelled."""
    signal_before_s: int = 180
    """Slurm: ask for SIGTERM this many seconds before the time limit (`#SBATCH --signal=TERM@N`). On it, as on `scancel` or preemption, the run lets the step in flight finish, checkpoints within trainer.interrupt_checkpoint_timeout_s, and releases the allocation; keep it above that timeout. Slurm may send it up to a minute early."""
    spare_hosts: int = 0
    """Hosts the job holds beyond `launcher.hosts`, idle, for the trainer (process, slurm and workers launchers; with `workers`, the last ones listed). When a trainer host is lost (its procs dead and its host no longer answers), the healed trainer is spawned on the spare hosts instead of its own (docs/healing.md). The trainer moves whole, so it needs as many spares as it has hosts; each heal that moves uses them up. 0: a lost trainer host stops the run, resumably."""
    host_timeout_s: float = 60.0
    """How long a host may leave Monarch's state queries unanswered before the procs on it count as lost (Monarch's `get_proc_state_max_idle`, whose default this is): a trainer whose host went silent is healed this long after at the soonest, and a heal then gives a host this long (at most 20 s) to start a bare proc before moving the trainer to `spare_hosts`. Lower heals a lost host sooner; too low takes a host that is only slow (an overloaded node, a network hiccup) for lost, and replaces a trainer that was alive. A proc killed on a live host is seen within Monarch's supervision poll (1 s, as meshrl sets `HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY`; Monarch's default is 10 s) whatever this is."""
    max_resubmits: int = 0
    """Slurm: after Slurm signaled the allocation and the run checkpointed, submit a fresh allocation and continue the run from that checkpoint (same step numbering), up to this many times. 0: stop, and print the `meshrl run --resume RUN_DIR` that continues it. The `meshrl run` command's (it replaces its own process by the resumed run); `meshrl.run()` from Python raises `meshrl.api.Interrupted` (a KeyboardInterrupt) instead, whose `run_dir` a `meshrl.run(resume=...)` continues."""

    @property
    def working_hosts(self) -> int:
        """The hosts the roles run on: `hosts`, or with `workers` those listed less the spares."""
        return len(self.workers) - self.spare_hosts if self.kind == "workers" else self.hosts


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
    """Also log every step's metrics to Weights & Biases (the `wandb` package torchtitan brings), into RUN_DIR/wandb. A resumed run goes on in the same W&B run, which keeps what it was sent: the steps past the checkpoint, trained again, are there twice (metrics.jsonl and TensorBoard keep only the later rows)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline`: write the W&B run to disk only (sync it later with `wandb sync RUN_DIR/wandb/offline-run-*`); `online`: send it to the W&B server the environment names (WANDB_API_KEY, WANDB_BASE_URL)."""
    wandb_project: str = "meshrl"
    """W&B project name."""
    verbose: bool = False
    """Leave library output (vLLM, Monarch, torch) on the terminal. Off: each proc's output goes to RUN_DIR/logs/ROLE.log and the console shows meshrl's own lines (`meshrl run --verbose` turns it on; so does MESHRL_VERBOSE=1)."""


@dataclass
class TrainedModelConfig:
    """A model beside the policy (co-evolving policies, docs/coevolve.md): trained, with its own trainer mesh, optimizer, generators and weight sync, stepping at the run's version (one counter; `trainer.pace` holds a model's weights on steps off its pace); or served alone (`frozen`). Each section here overrides the policy's section of that name, key by key; the rest is the policy's."""

    name: str = ""
    """The model's name: what a game env's `Ask.model` says (the policy is `policy`), the prefix of its metrics (`NAME/trainer/...`, `NAME/reward/mean`) and its directory under the run's (`models/NAME/`: its logs and first export; its checkpoint goes under `checkpoints/models/NAME`, its final export to `hf/final-NAME`)."""
    model: dict[str, Any] = field(default_factory=dict, metadata={"overrides": ModelConfig})
    """Overrides of the policy's `model` section (e.g. `path` for its own checkpoint, or its own shapes); empty: the policy's architecture. A model without a `path` is initialised from seed + 1 + its index in `models` (a start of its own, whatever it overrides), and its generators sample with that seed too. Every model shares the policy's tokenizer and token ids: a `tokenizer` other than the policy's is refused, and its vocabulary (its checkpoint's, or `vocab_size`) must cover the policy's."""
    trainer: dict[str, Any] = field(default_factory=dict, metadata={"overrides": TrainerConfig})
    """Overrides of the policy's `trainer` section (e.g. `lr`, `procs`, `loss: {clip_high: 0.3}`). With `loss.advantage: gae` (set here, or the policy's inherited) the model trains by PPO with a critic of its own (the `critic` section's settings, from its own weights; `NAME/critic/...`, `hf/final-NAME-critic`); `loss: {advantage: grpo}` keeps a model on a group advantage beside a PPO policy."""
    generator: dict[str, Any] = field(default_factory=dict, metadata={"overrides": GeneratorConfig})
    """Overrides of the policy's `generator` section (e.g. `replicas`, `temperature`); `group_size` is the run's."""
    frozen: bool = False
    """Served, never trained (a fixed opponent, an LLM user simulator): its generators serve `model.path` (a checkpoint that shares the policy's tokenizer) with no trainer, optimizer, weight sync, checkpoint or export of its own; its threads are played, scored and reported (`NAME/reward/mean`) but left out of every loss, and its tokens stay at version 0 without counting as stale. Set no `trainer` section for it."""


@dataclass
class Config:
    """A whole meshrl run."""

    steps: int = 40
    """Optimizer steps (policy versions) to train."""
    batch_groups: int = 8
    """Prompt groups per training batch (batch size = batch_groups * generator.group_size)."""
    seed: int = 0
    """Seed for data order, sampling and initialisation: 0 to 2**31 - 1 (the engines seed numpy with it plus their index)."""
    placement: Literal["auto", "split", "colocate"] = "auto"
    """Where the roles run relative to each other. `split`: trainer and generators on devices (GPUs, or cores on CPU: trainer.cpus, generator.cpus) of their own, generation overlapping training as `buffer` allows. `colocate` (one host): they share the same GPUs (or all the cores), time-sliced: generation never runs during a training step, vLLM sleeps there on GPU (its KV cache and weights freed) and wakes before generating, and new weights reach the engine through shared memory (weight_sync.transport=shm) with no transfer. In this mode `buffer.depth` has no effect (a batch is admitted when the trainer reaches its version) and `buffer.max_lag` is 0 (synchronous: each version is loaded while the engines sleep and they wake on it, so each batch is generated by the version it trains) or 1 (one step off, on CPU: the next batch starts at once on the weights the generators hold and the new version loads while they generate; tokens are then at most one version old); larger or null means 1. On GPUs colocated runs are always synchronous: vLLM's sleep drops the engine's weights (level 2) instead of copying them to host memory and back, and the new version is loaded before the KV cache is back. With `models`, every model's engines sleep and wake together and the trainers step in turn, the policy's first (docs/coevolve.md). `auto`: on GPUs, `colocate` on a one-host run whose roles (every trained model's too) do not fit its GPUs one each, else `split`; on one CPU host (without `models`: with them, `split`), `colocate` when a training step is estimated to outweigh generating its batch (a trainer-bound run: more than 25 GFLOP a step, from the model's size and the batch's tokens), else `split` (the roles overlapping on cores of their own), and the console says which and why (meshrl/launch/devices.py)."""
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
    contracts: ContractsConfig = field(default_factory=ContractsConfig)
    """Checks of the user's env, reward and data: before the run, and the failure breaker during it."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompt source."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on held-out prompts during training."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher checkpoint."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's learned critic, used with trainer.loss.advantage=gae."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters: train and sync only them."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Where the meshes run."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and outputs."""
    alarm: AlarmConfig = field(default_factory=AlarmConfig)
    """The run-level alarm: one console line when the reward or the policy entropy falls off a cliff."""
    models: list[TrainedModelConfig] = field(default_factory=list)
    """More trained models beside the policy, co-evolving in one asynchronous run: a game env (meshrl/rollout/game.py) says which model speaks each turn; every model trains on its own turns, with its own rewards, on the same batches as the policy and at its version (each updating at its own `trainer.pace`; docs/coevolve.md). Empty: the policy alone."""

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "Config":
        """The config from nested sections, typed and checked as far as its values go;
        meshrl.preflight checks what needs the tasks, user code or files."""
        config = build(cls, data or {})
        validate(config)
        return config

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> "Config":
        return cls.from_dict(apply_overrides(load_yaml(path), overrides or []))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def model_names(self) -> list[str]:
        """The models, the policy first: their index is the `model` key of a game's rows."""
        return ["policy"] + [m.name for m in self.models]

    def advantage_modes(self) -> list[str]:
        """Each model's `trainer.loss.advantage`, by its index in `model_names`: a model's own
        override, else the policy's. Read from the overrides, not from `for_model`'s whole view,
        which also checks the model's cores against the proc that builds it."""
        mode = self.trainer.loss.advantage
        return [mode] + [_section(m.trainer, "loss").get("advantage", mode) for m in self.models]

    def paces(self) -> list[PaceConfig]:
        """Each model's `trainer.pace`, by its index in `model_names`: a model's own override
        (merged over the policy's), else the policy's."""
        own = [_merged(dataclasses.asdict(self.trainer.pace), _section(m.trainer, "pace")) for m in self.models]
        return [self.trainer.pace] + [build(PaceConfig, p) for p in own]

    def frozen_models(self) -> set[int]:
        """The indices (in `model_names`) of the models served and never trained (`models[i].frozen`)."""
        return {i + 1 for i, m in enumerate(self.models) if m.frozen}

    def for_model(self, name: str) -> "Config":
        """The run as the trained model `name` sees it: its model, trainer and generator
        sections (the policy's, with its overrides), the run directory models/NAME/ for its
        logs and checkpoints, no other models, no scorers (the rollout workers score each
        model's threads with the run's `scoring`, meshrl/scorers/client.py) and no distillation
        teacher (it distills the policy alone). `policy`: this config."""
        if name == "policy":
            return self
        index, spec = next((i, m) for i, m in enumerate(self.models) if m.name == name)
        data = self.to_dict()
        for section in ("model", "trainer", "generator"):
            data[section] = _merged(data[section], getattr(spec, section))
        data["seed"] = self.seed + 1 + index  # a start of its own (without a `path`) and its own sampling streams
        data["generator"]["group_size"] = self.generator.group_size
        data["logging"]["run_dir"] = os.path.join(self.logging.run_dir, "models", name)
        if spec.frozen:  # it serves its checkpoint whole: no adapters of its own
            data["lora"] = {**data["lora"], "rank": 0}
        if _section(data["trainer"], "loss").get("advantage") != "gae":  # no critic of its own: the section is another model's
            data.pop("critic")
        data["models"] = []
        data.pop("scoring")
        data.pop("distill")
        try:
            return Config.from_dict(data)
        except ConfigError as e:
            if e.field_path.split(".")[0].split("[")[0] in ("model", "trainer", "generator"):  # the sections a model overrides
                raise e.under(f"models[{index}]") from None
            raise ConfigError(e.field_path, f"{e.message} (with models[{index}], {name})", e.kind) from None  # a run-wide field

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())


def _section(overrides: dict, key: str) -> dict:
    """A model's override of section `key` (e.g. its `trainer`'s `loss`); {} where it is not a
    mapping, which `for_model` then refuses in one line, naming the field."""
    value = overrides.get(key, {}) if isinstance(overrides, dict) else {}
    return value if isinstance(value, dict) else {}


def _merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` applied key by key, nested mappings merged."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
