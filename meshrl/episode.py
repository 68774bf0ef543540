"""Episodes: the unit of work, and the one TensorDict format the trainer reads.

An episode is a sequence of turns. A turn is token ids with a role: `model` (sampled by
the generator: each token has its sampler log-prob and the policy version that produced
it) or `env` (the prompt, tool results, the env's replies and the chat template's glue).
Token in, token out: sampled ids are kept exactly and env output is tokenized and
appended, so the episode's ids are the very context every model turn saw.

    turn -> Episode (one env instance, one conversation) -> group (n episodes of one prompt)

A group packs into a rollout TensorDict, one row per episode, right-padded to T tokens:

| key              | shape        | dtype   | meaning                                                      |
|------------------|--------------|---------|--------------------------------------------------------------|
| tokens           | [B, T]       | int64   | every token of the episode (pad: 0)                          |
| loss_mask        | [B, T]       | bool    | True on model tokens that count in the loss (env tokens never)|
| sampler_logprobs | [B, T]       | float32 | log-prob of each model token under its sampling distribution |
| versions         | [B, T]       | int64   | policy version of each model token (PAD_VERSION elsewhere)    |
| dense_reward     | [B, T]       | float32 | a turn's reward at its last model token (0 elsewhere; rows sum to reward) |
| reward           | [B]          | float32 | the episode's reward: the sum of its turns' rewards          |
| advantage        | [B]          | float32 | group-normalised advantage                                   |
| teacher_logprobs | [B, T]       | float32 | optional (distillation): teacher's log-prob of each model token (0 elsewhere) |
| token_advantage  | [B, T]       | float32 | optional (distillation, process rewards, GAE): per-token advantage; the loss uses it instead of `advantage` |
| process_reward   | [B, T]       | float32 | optional (process rewards under GAE): each step's weighted score at its last token, added to dense_reward by GAE |
| group_id         | [B]          | int64   | id shared by the episodes of one prompt                      |
| sample_id        | [B]          | int64   | unique id of the episode                                     |
| finish_reason    | [B]          | int64   | one of FINISH_REASONS' codes                                 |
| model_turns      | [B]          | int64   | model turns in the episode                                   |
| prompt_len       | [B]          | int64   | tokens before the first model token                          |
| routed_experts   | [B, T, L, K] | int32   | optional: MoE expert ids per model token and layer           |
| model            | [B]          | int64   | games only: the trained model of the row (config.model_names() index) |

Rows of one group are adjacent and travel together. A game's episode (meshrl/rollout/game.py)
has threads, one conversation each, spoken by one trained model: each thread is a row of its
own, tagged with its `model`, so every model token carries (model, version); each model
trains on its rows, their advantages normalised within (group, model). The two optional distillation keys
come from meshrl/distill.py: `pack` writes `teacher_logprobs` when the model turns carry
a teacher's scores, `assign_distill_advantages` adds `token_advantage`.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Sequence

import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from meshrl.config import PaceConfig

FINISH_REASONS = {"stop": 0, "length": 1, "abort": 2, "failed": 3}
"""`stop`: the env ended the episode; `length`: out of tokens or turns; `abort`: cut by a
shutdown; `failed`: the env raised or timed out (reward 0)."""
PAD_VERSION = -1
Role = Literal["model", "env"]


@dataclass
class Turn:
    role: Role
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    """model turns: the sampler's log-prob of each token."""
    versions: list[int] = field(default_factory=list)
    """model turns: the policy version of each token (a turn can span versions)."""
    reward: float = 0.0
    """the env's reward for this (model) turn."""
    finish_reason: str | None = None
    routed_experts: torch.Tensor | None = None
    """model turns: [len, L, K] expert ids, when the engine returned them."""
    teacher_logprobs: list[float] | None = None
    """model turns, on-policy distillation: a teacher's log-prob of each token given the
    episode's tokens before it (see meshrl/distill.py); None: not scored."""

    def __post_init__(self) -> None:
        if self.role == "model" and not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(f"model turn: {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs and {len(self.versions)} versions")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.teacher_logprobs)} teacher log-probs")


@dataclass
class Episode:
    group_id: int
    sample_id: int
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = "stop"
    tool_calls: int = 0
    env_s: float = 0.0
    """Seconds spent in the env's reset and step calls."""
    failure: str | None = None
    """Why it failed, in one line (meshrl/errors.py), when finish_reason is `failed`."""
    signals: dict[str, float] = field(default_factory=dict)
    """scoring.scorers: each signal's raw score (and `env`, the env's reward), for the metrics."""
    process: list[tuple[int, float]] = field(default_factory=list)
    """Process rewards: (position of a step's last token, weighted step score); see
    meshrl/scorers/process.py."""
    model: int = 0
    """The trained model that speaks in it (its index in config.model_names()): a game's thread."""
    threads: list["Episode"] = field(default_factory=list)
    """A game's episode: its threads, each a row of its own (`rows`); empty for an env's."""
    opening: Any = None
    """A game's thread: the observation that opened it (what its model's scorers are sent as the prompt)."""
    role: str | None = None
    """A game's thread: the part it plays (`Ask.role`), for its advantage baseline (`baseline_groups`)."""
    info: dict[str, float] = field(default_factory=dict)
    """A game's episode: the numbers of its Outcome's `info`, reported as `game/KEY` (meshrl/agent/game.py)."""

    @property
    def rows(self) -> list["Episode"]:
        """What packs into the batch: the threads of a game's episode, else the episode."""
        return self.threads or [self]

    @property
    def token_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    def __len__(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns)

    @property
    def model_turns(self) -> list[Turn]:
        return [t for t in self.turns if t.role == "model"]

    @property
    def reward(self) -> float:
        return 0.0 if self.finish_reason == "failed" else sum(t.reward for t in self.turns)

    @property
    def env_tokens(self) -> int:
        """Tokens the env added after the prompt (tool results, replies, template glue)."""
        first_model = next((i for i, t in enumerate(self.turns) if t.role == "model"), len(self.turns))
        return sum(len(t.token_ids) for t in self.turns[first_model:] if t.role == "env")

    @property
    def prompt_len(self) -> int:
        n = 0
        for turn in self.turns:
            if turn.role == "model":
                break
            n += len(turn.token_ids)
        return n


def pack(episodes: Sequence[Episode]) -> TensorDict:
    """Episodes (rows keep their order) as a rollout TensorDict; see the module docstring.

    `teacher_logprobs` is written when any model turn carries a teacher's scores; then every
    model turn of a row that did not fail must carry them, else a ValueError: a silent 0
    would read as a confident teacher. A failed row leaves the loss, so its turns may be
    unscored, and so may a game's rows of a model the teacher does not score (only the
    policy is distilled: meshrl/distill.py)."""
    if not episodes:
        raise ValueError("pack needs at least one episode")
    game = any(e.threads for e in episodes)
    episodes = [row for e in episodes for row in e.rows]
    B = len(episodes)
    T = max(max(len(e) for e in episodes), 1)
    tokens = torch.zeros(B, T, dtype=torch.int64)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), PAD_VERSION, dtype=torch.int64)
    dense = torch.zeros(B, T, dtype=torch.float32)
    expert_shapes = {tuple(t.routed_experts.shape[1:]) for e in episodes for t in e.model_turns if t.routed_experts is not None}
    experts = None
    if expert_shapes:
        if len(expert_shapes) != 1:
            raise ValueError(f"routed_experts of one batch must share one [L, K] shape, got {sorted(expert_shapes)}")
        experts = torch.full((B, T, *expert_shapes.pop()), -1, dtype=torch.int32)
    teacher = None
    if any(t.teacher_logprobs is not None for e in episodes for t in e.model_turns):
        teacher = torch.zeros(B, T, dtype=torch.float32)
        students = {e.model for e in episodes if any(t.teacher_logprobs is not None for t in e.model_turns)}
        for e in episodes:
            unscored = [t for t in e.model_turns if t.teacher_logprobs is None and t.token_ids]
            if unscored and e.finish_reason != "failed" and e.model in students:
                raise ValueError(f"episode {e.sample_id}: {len(unscored)} model turn(s) without teacher log-probs")
    for i, episode in enumerate(episodes):
        at = 0
        for turn in episode.turns:
            n = len(turn.token_ids)
            if n:
                tokens[i, at : at + n] = torch.as_tensor(turn.token_ids, dtype=torch.int64)
            if turn.role == "model" and n:
                loss_mask[i, at : at + n] = True
                logprobs[i, at : at + n] = torch.as_tensor(turn.logprobs, dtype=torch.float32)
                versions[i, at : at + n] = torch.as_tensor(turn.versions, dtype=torch.int64)
                if episode.finish_reason != "failed":  # a failed episode earns nothing, turn by turn too
                    dense[i, at + n - 1] = turn.reward
                if experts is not None and turn.routed_experts is not None and turn.routed_experts.shape[0] == n:
                    experts[i, at : at + n] = turn.routed_experts.to(torch.int32)
                if teacher is not None and turn.teacher_logprobs is not None:
                    teacher[i, at : at + n] = torch.as_tensor(turn.teacher_logprobs, dtype=torch.float32)
            at += n
    td = TensorDict(
        {
            "tokens": tokens,
            "loss_mask": loss_mask,
            "sampler_logprobs": logprobs,
            "versions": versions,
            "dense_reward": dense,
            "reward": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            "advantage": torch.zeros(B, dtype=torch.float32),
            "group_id": torch.tensor([e.group_id for e in episodes], dtype=torch.int64),
            "sample_id": torch.tensor([e.sample_id for e in episodes], dtype=torch.int64),
            "finish_reason": torch.tensor([FINISH_REASONS[e.finish_reason] for e in episodes], dtype=torch.int64),
            "model_turns": torch.tensor([len(e.model_turns) for e in episodes], dtype=torch.int64),
            "prompt_len": torch.tensor([e.prompt_len for e in episodes], dtype=torch.int64),
        },
        batch_size=[B],
    )
    if game:
        td["model"] = torch.tensor([e.model for e in episodes], dtype=torch.int64)
        td["role"] = torch.tensor([role_key(e.role) for e in episodes], dtype=torch.int64)
    if experts is not None:
        td["routed_experts"] = experts
    if teacher is not None:
        td["teacher_logprobs"] = teacher
    return td


_PAD_VALUES = {
    "tokens": 0,
    "loss_mask": False,
    "sampler_logprobs": 0.0,
    "versions": PAD_VERSION,
    "dense_reward": 0.0,
    "routed_experts": -1,
    "teacher_logprobs": 0.0,
    "token_advantage": 0.0,
    "process_reward": 0.0,
}


def concat(batches: Sequence[TensorDict]) -> TensorDict:
    """Concatenate rollout batches along B, padding the token dim to the widest."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    T = max(b["tokens"].shape[1] for b in batches)
    # Keys a batch may lack: process rewards (a group queued before a run had them: none), a
    # game's `model` and `role` (a group whose every episode failed before any turn has no threads: its
    # rows, all failed, are the policy's, as `Episode.rows` packs them), and what model turns
    # carry (MoE routing, a teacher's scores) in a group with none (every prompt too long, every
    # reset failed): routed live (-1), and no loss token a teacher's 0 could reach
    experts = next((b["routed_experts"] for b in batches if "routed_experts" in b.keys()), None)
    missing = {
        "process_reward": lambda b: torch.zeros(b["tokens"].shape, dtype=torch.float32),
        "model": lambda b: torch.zeros(b.batch_size, dtype=torch.int64),
        "role": lambda b: torch.zeros(b.batch_size, dtype=torch.int64),
        "routed_experts": lambda b: torch.full((*b["tokens"].shape, *experts.shape[2:]), -1, dtype=torch.int32),
        "teacher_logprobs": lambda b: None if b["loss_mask"].any() else torch.zeros(b["tokens"].shape, dtype=torch.float32),
    }
    for key, fill in missing.items():
        if any(key in b.keys() for b in batches):
            batches = [b if key in b.keys() or (value := fill(b)) is None else b.clone(recurse=False).set(key, value) for b in batches]
    keys = set(batches[0].keys())
    if any(set(b.keys()) != keys for b in batches):
        raise ValueError("cannot concat rollout batches with different keys")
    return torch.cat([pad_tokens(b, T) for b in batches], dim=0)


def pad_tokens(b: TensorDict, T: int) -> TensorDict:
    """`b` with every per-token tensor right-padded (or cut) to T tokens."""
    out = {}
    for key, value in b.items():
        if key in _PAD_VALUES:
            missing = T - value.shape[1]
            if missing > 0:
                shape = list(value.shape)
                shape[1] = missing
                value = torch.cat([value, torch.full(shape, _PAD_VALUES[key], dtype=value.dtype)], dim=1)
            else:
                value = value[:, :T]
        out[key] = value
    return TensorDict(out, batch_size=b.batch_size)


def trim(td: TensorDict) -> TensorDict:
    """Cut trailing columns no row uses (a micro-batch of short rows from a long batch)."""
    # An episode ends on a model turn, so its last model token is its last token.
    cols = (td["versions"] != PAD_VERSION).any(dim=0).nonzero()
    T = int(cols.max()) + 1 if cols.numel() else 1
    return pad_tokens(td, T)


def group_advantages(reward: torch.Tensor, group_id: torch.Tensor, mode: Literal["grpo", "grpo_no_std", "rloo"] = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Per-episode advantages normalised within each group.

    grpo: (r - mean) / (std + eps), std unbiased; a group with zero variance gets 0.
    grpo_no_std: r - mean (Dr.GRPO).
    rloo: r - mean of the other episodes of the group = n/(n-1) * (r - mean).
    """
    # In float64, and exactly 0 in a group of equal rewards: a float32 mean of 8 x 1.2 is not
    # 1.2, and grpo divided that rounding by its own std into an advantage of about 0.1.
    reward = reward.to(torch.float64)
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    G = counts.numel()
    sums = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, reward)
    n = counts.to(torch.float64)
    mean = sums / n
    low = torch.full((G,), math.inf, dtype=torch.float64).scatter_reduce(0, inverse, reward, "amin")
    high = torch.full((G,), -math.inf, dtype=torch.float64).scatter_reduce(0, inverse, reward, "amax")
    centred = torch.where((low == high)[inverse], 0.0, reward - mean[inverse])
    if mode == "grpo_no_std":
        return centred.float()
    if mode == "rloo":
        if (counts < 2).any():
            raise ValueError("rloo needs at least 2 samples per group")
        return (centred * (n / (n - 1))[inverse]).float()
    if mode == "grpo":
        sq = torch.zeros(G, dtype=torch.float64).index_add_(0, inverse, centred**2)
        std = torch.sqrt(sq / (n - 1).clamp(min=1))
        return (centred / (std[inverse] + eps)).float()
    raise ValueError(f"unknown advantage mode {mode!r}")


def role_key(role: str | None) -> int:
    """A thread's role as a number for the rollout batch (0: none)."""
    return 0 if role is None else 1 + zlib.crc32(role.encode()) % (2**31)


def baseline_groups(td: TensorDict) -> torch.Tensor:
    """[B] each row's advantage baseline group: its prompt's group, apart by model and, in a
    game, by the role its thread plays (`Ask.role`), so that self-play's proposer is not
    measured against its solver's rows (nor their rewards' scale)."""
    zero = torch.zeros_like(td["group_id"])
    keys = torch.stack([td["group_id"], row_models(td), td["role"] if "role" in td.keys() else zero], dim=1)
    return torch.unique(keys, dim=0, return_inverse=True)[1]


def row_models(td: TensorDict) -> torch.Tensor:
    """[B] each row's model (its index in `config.model_names()`): a game's `model` key, else 0 (the policy's)."""
    return td["model"] if "model" in td.keys() else torch.zeros_like(td["group_id"])


def policys_played(td: TensorDict) -> torch.Tensor:
    """[B] the policy's rows that did not fail (a game's other models, frozen ones too, report their own rewards)."""
    return (td["finish_reason"] != FINISH_REASONS["failed"]) & (row_models(td) == 0)


def assign_advantages(td: TensorDict, mode: str | Sequence[str]) -> TensorDict:
    """Fill `advantage` from `reward` and `group_id` (in place; returns td).

    A failed episode (its env raised or timed out) says nothing about the policy: it takes
    no part in its group's statistics, and its tokens leave the loss (advantage 0, mask off).
    A group with fewer than two episodes left gets advantage 0 under `rloo`. `gae` (PPO with a
    critic) fills `grpo`'s: the policy trains on it during `critic.policy_warmup`, and on the
    critic's per-token advantages, written at the trainer, after. A game's rows are
    normalised within (group, model, role) (`baseline_groups`): each model against its own rows
    of the prompt, by its own mode where `mode` is a list (one per model, by its index in
    `config.model_names()`), and each role its threads play apart."""
    failed = td["finish_reason"] == FINISH_REASONS["failed"]
    advantage = torch.zeros_like(td["reward"])
    ok = ~failed
    model, gid = row_models(td), baseline_groups(td)
    for m in torch.unique(model[ok]).tolist():
        rows = ok & (model == m)
        how = mode if isinstance(mode, str) else mode[m]
        how = "grpo" if how == "gae" else how
        reward, g = td["reward"][rows], gid[rows]
        if how == "rloo":
            _, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)
            alone = counts[inverse] < 2
            adv = torch.zeros_like(reward)
            if (~alone).any():
                adv[~alone] = group_advantages(reward[~alone], g[~alone], how)
        else:
            adv = group_advantages(reward, g, how)
        advantage[rows] = adv
    td["advantage"] = advantage
    td["loss_mask"] = td["loss_mask"] & ok[:, None]
    return td


def without_signal(group: TensorDict) -> bool:
    """Whether one packed group carries no policy gradient: its trained episodes (failed ones
    left out) all have the same reward, or fewer than two trained, so every group advantage
    is 0; and no per-token advantage (distillation) is non-zero on a trained token. Compared
    on the rewards, not the advantages: equal float rewards can leave a rounding residue in
    a normalised advantage. A game's rows are compared within each baseline group (model and
    role: its advantages are), over every row its baseline was taken over (a row the staleness bound masked whole
    included: the others' advantages are still apart from it), and a frozen model's rows,
    none of them in the loss, not at all."""
    ok = group["finish_reason"] != FINISH_REASONS["failed"]
    baselines = baseline_groups(group)
    for b in torch.unique(baselines[ok & group["loss_mask"].any(1)]).tolist():
        rewards = group["reward"][ok & (baselines == b)]
        if rewards.numel() >= 2 and not bool((rewards == rewards[0]).all()):
            return False
    if "token_advantage" in group.keys():
        return not bool((group["token_advantage"][group["loss_mask"]] != 0).any())
    return True


def staleness(td: TensorDict, current_version: int, paces: Sequence["PaceConfig"] | None = None) -> torch.Tensor:
    """[B, T] lag of each model token behind `current_version` (0 elsewhere): in versions, or,
    with `paces` (each model's `trainer.pace`, by its index in `config.model_names()`), in
    its own model's weight updates (`weight_lags`), so that a model held by its pace counts
    only the steps that moved its weights."""
    versions = td["versions"]
    lag = current_version - versions
    if paces:
        model = row_models(td)
        for m in torch.unique(model).tolist():
            if paces[m].steps < paces[m].every:  # some steps hold its weights
                rows = model == m
                lag[rows] = weight_lags(versions[rows], current_version, paces[m])
    return torch.where(versions == PAD_VERSION, torch.zeros_like(lag), lag)


def weight_lags(versions: torch.Tensor, version: int, pace: "PaceConfig") -> torch.Tensor:
    """Per token, the weight updates between the version that sampled it and `version`: the
    staleness bound's lag (`staleness`), and the trainer's lag k of `clip_against: versions`,
    its staleness metrics and its fresh/previous drift metrics. Where every step updates it
    is `version - versions`; under `trainer.pace` a held step moves the version but not the
    weights, so it is not counted (the run's pace, taken to have held since the tokens were
    sampled)."""

    def updates_through(n):  # updating steps among 1..n: step s updates when (s - 1 - offset) mod every < steps
        def below(m):  # u in [0, m) with u mod every < steps
            return m // pace.every * pace.steps + torch.clamp(m % pace.every, max=pace.steps)

        shift = pace.every - pace.offset  # u = s - 1 - offset + every >= 0 for s >= 1
        return below(torch.as_tensor(n) + shift) - below(torch.as_tensor(shift))

    return (updates_through(version) - updates_through(versions)).clamp(min=0)


def group_slices(td: TensorDict) -> list[slice]:
    """Row ranges of consecutive groups (rows of one group are adjacent)."""
    gid = td["group_id"].tolist()
    slices, start = [], 0
    for i in range(1, len(gid) + 1):
        if i == len(gid) or gid[i] != gid[start]:
            slices.append(slice(start, i))
            start = i
    return slices


def leave_out(td: TensorDict, models: set[int]) -> TensorDict:
    """A game's group with the rows of `models` (frozen: served, never trained) out of every
    loss: they stay in the batch, their loss mask cleared, so that no staleness bound or lag
    counts their tokens (version 0 for good) and no trainer takes them (`model_rows`)."""
    if models and "model" in td.keys():
        frozen = torch.isin(td["model"], torch.tensor(sorted(models)))
        td["loss_mask"] = td["loss_mask"] & ~frozen[:, None]
    return td


def model_rows(td: TensorDict, model: int) -> TensorDict:
    """A game's batch as trained model `model` trains on it: its rows only (a batch without
    the `model` key is the policy's alone). With none of its rows (every one failed before it
    spoke), one failed row of two tokens with nothing in the loss, so that its step still runs
    and counts (two tokens: another model's row may be longer than this model's max_seq_len). The
    teacher's log-probs are the policy's (the student of distillation): another model's rows
    leave them out, and train on their group advantages (`token_advantage` holds them)."""
    if "model" not in td.keys():
        return td
    if model != 0 and "teacher_logprobs" in td.keys():
        td = td.exclude("teacher_logprobs")
    mine = td["model"] == model
    if mine.any():
        return td[mine]
    empty = pad_tokens(td[:1], 2).clone()
    empty["loss_mask"] = torch.zeros_like(empty["loss_mask"])
    empty["reward"] = torch.zeros_like(empty["reward"])  # not another model's reward in this one's metrics
    empty["finish_reason"] = torch.full_like(empty["finish_reason"], FINISH_REASONS["failed"])
    return empty
