"""The rollout batch: the one format between generator, scorer, buffer and trainer.

A rollout batch is a TensorDict with one row per sampled completion (batch dim B),
right-padded along the prompt (P) and response (R) token dims:

| key                 | shape       | dtype   | meaning                                                     |
|---------------------|-------------|---------|-------------------------------------------------------------|
| prompt_ids          | [B, P]      | int64   | prompt token ids (pad: 0)                                   |
| prompt_mask         | [B, P]      | bool    | True on real prompt tokens                                  |
| response_ids        | [B, R]      | int64   | sampled token ids (pad: 0)                                  |
| response_mask       | [B, R]      | bool    | True on tokens that count in the loss                       |
| sampler_logprobs    | [B, R]      | float32 | log-prob of each token under the distribution it was drawn from |
| versions            | [B, R]      | int64   | policy version that produced each token (pad: -1)           |
| reward              | [B]         | float32 | scalar reward (NaN until scored)                            |
| advantage           | [B]         | float32 | group-normalised advantage                                  |
| group_id            | [B]         | int64   | id shared by the completions of one prompt                  |
| sample_id           | [B]         | int64   | unique id of the completion                                 |
| finish_reason       | [B]         | int64   | one of FINISH_REASONS' codes                                |
| routed_experts      | [B, R, L, K]| int32   | optional: MoE expert ids per token and layer (routing replay) |
| sampling_kept       | [B, R]      | int32   | optional: size of the top-k/top-p kept set at each token ("keep sampling mask") |

Rows of one group are always adjacent and travel together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
from tensordict import TensorDict

FINISH_REASONS = {"stop": 0, "length": 1, "abort": 2, "failed": 3}
"""Codes stored in `finish_reason`. `failed`: scoring raised or timed out (reward 0)."""

PAD_VERSION = -1



@dataclass
class Prompt:
    """One prompt as the data source hands it to a generator; its completions form group `group_id`."""

    prompt_ids: list[int]
    group_id: int
    text: str = ""
    extra: dict = field(default_factory=dict)
    """Task data the scorer needs (e.g. the reference answer)."""


@dataclass
class Completion:
    """One finished completion as a generator produces it (before batching)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    group_id: int
    sample_id: int
    reward: float = float("nan")
    routed_experts: torch.Tensor | None = None
    """[R, L, K] expert ids, when the engine returned them."""
    sampling_kept: list[int] | None = None
    extra: dict = field(default_factory=dict)
    """Task data the scorer needs (e.g. the reference answer); not batched."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"completion {self.sample_id}: {n} tokens but {len(self.logprobs)} logprobs and {len(self.versions)} versions"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} not in {sorted(FINISH_REASONS)}")


def _pad_2d(rows: Sequence[Sequence], width: int, pad, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def from_completions(completions: Sequence[Completion]) -> TensorDict:
    """Batch completions into a rollout TensorDict (rows keep their order)."""
    if not completions:
        raise ValueError("from_completions needs at least one completion")
    B = len(completions)
    P = max(len(c.prompt_ids) for c in completions)
    R = max(max(len(c.response_ids) for c in completions), 1)
    prompt_lens = torch.tensor([len(c.prompt_ids) for c in completions])
    resp_lens = torch.tensor([len(c.response_ids) for c in completions])
    td = TensorDict(
        {
            "prompt_ids": _pad_2d([c.prompt_ids for c in completions], P, 0, torch.int64),
            "prompt_mask": torch.arange(P)[None, :] < prompt_lens[:, None],
            "response_ids": _pad_2d([c.response_ids for c in completions], R, 0, torch.int64),
            "response_mask": torch.arange(R)[None, :] < resp_lens[:, None],
            "sampler_logprobs": _pad_2d([c.logprobs for c in completions], R, 0.0, torch.float32),
            "versions": _pad_2d([c.versions for c in completions], R, PAD_VERSION, torch.int64),
            "reward": torch.tensor([c.reward for c in completions], dtype=torch.float32),
            "advantage": torch.zeros(B, dtype=torch.float32),
            "group_id": torch.tensor([c.group_id for c in completions], dtype=torch.int64),
            "sample_id": torch.tensor([c.sample_id for c in completions], dtype=torch.int64),
            "finish_reason": torch.tensor([FINISH_REASONS[c.finish_reason] for c in completions], dtype=torch.int64),
        },
        batch_size=[B],
    )
    if any(c.routed_experts is not None for c in completions):
        shapes = {tuple(c.routed_experts.shape[1:]) for c in completions if c.routed_experts is not None}
        if len(shapes) != 1 or any(c.routed_experts is None for c in completions):
            raise ValueError("routed_experts must be given for every completion with one [L, K] shape")
        L, K = shapes.pop()
        experts = torch.full((B, R, L, K), -1, dtype=torch.int32)
        for i, c in enumerate(completions):
            experts[i, : c.routed_experts.shape[0]] = c.routed_experts.to(torch.int32)
        td["routed_experts"] = experts
    if any(c.sampling_kept is not None for c in completions):
        td["sampling_kept"] = _pad_2d([c.sampling_kept or [] for c in completions], R, 0, torch.int32)
    return td


def _pad_to(t: torch.Tensor, dim: int, width: int, value) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype)], dim=dim)


_PAD_VALUES = {
    "prompt_ids": 0, "prompt_mask": False, "response_ids": 0, "response_mask": False,
    "sampler_logprobs": 0.0, "versions": PAD_VERSION, "routed_experts": -1, "sampling_kept": 0,
}


def concat(batches: Sequence[TensorDict]) -> TensorDict:
    """Concatenate rollout batches along B, padding token dims to the widest."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    P = max(b["prompt_ids"].shape[1] for b in batches)
    R = max(b["response_ids"].shape[1] for b in batches)
    keys = set(batches[0].keys())
    if any(set(b.keys()) != keys for b in batches):
        raise ValueError("cannot concat rollout batches with different keys")
    return torch.cat([_pad_batch(b, P, R) for b in batches], dim=0)


def _pad_batch(b: TensorDict, P: int, R: int) -> TensorDict:
    out = {}
    for key, value in b.items():
        if key.startswith("prompt_"):
            out[key] = _pad_to(value, 1, P, _PAD_VALUES[key])
        elif key in _PAD_VALUES:
            out[key] = _pad_to(value, 1, R, _PAD_VALUES[key])
        else:
            out[key] = value
    return TensorDict(out, batch_size=b.batch_size)


def group_advantages(
    reward: torch.Tensor, group_id: torch.Tensor, mode: Literal["grpo", "grpo_no_std", "rloo"] = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages normalised within each group.

    grpo: (r - mean) / (std + eps), std unbiased; a group with zero variance gets 0.
    grpo_no_std: r - mean (Dr.GRPO).
    rloo: r - mean of the other samples of the group = n/(n-1) * (r - mean).
    """
    reward = reward.to(torch.float32)
    _, inverse, counts = torch.unique(group_id, return_inverse=True, return_counts=True)
    G = counts.numel()
    sums = torch.zeros(G).index_add_(0, inverse, reward)
    n = counts.to(torch.float32)
    mean = sums / n
    centred = reward - mean[inverse]
    if mode == "grpo_no_std":
        return centred
    if mode == "rloo":
        if (counts < 2).any():
            raise ValueError("rloo needs at least 2 samples per group")
        return centred * (n / (n - 1))[inverse]
    if mode == "grpo":
        sq = torch.zeros(G).index_add_(0, inverse, centred**2)
        std = torch.sqrt(sq / (n - 1).clamp(min=1))
        return centred / (std[inverse] + eps)
    raise ValueError(f"unknown advantage mode {mode!r}")


def assign_advantages(td: TensorDict, mode: str) -> TensorDict:
    """Fill `advantage` from `reward` and `group_id` (in place; returns td)."""
    td["advantage"] = group_advantages(td["reward"], td["group_id"], mode)
    return td


def staleness(td: TensorDict, current_version: int) -> torch.Tensor:
    """[B, R] versions behind `current_version` for each response token (0 on padding)."""
    lag = current_version - td["versions"]
    return torch.where(td["versions"] == PAD_VERSION, torch.zeros_like(lag), lag)


def sequence_staleness(td: TensorDict, current_version: int) -> torch.Tensor:
    """[B] lag of each completion's oldest token."""
    return staleness(td, current_version).amax(dim=1)


def pack_for_trainer(td: TensorDict) -> TensorDict:
    """Lay each row out as one causal sequence `prompt + response`, right-padded to T.

    Returns a TensorDict with batch [B]:
      tokens [B, T]; positions [B, T]; loss_mask [B, T] (True where position t's token is
      a response token that counts, i.e. predicted from the logits at t-1);
      sampler_logprobs, versions [B, T] aligned with tokens; advantage [B];
      routed_experts [B, T, L, K] if present (aligned with tokens).
    """
    B = td.batch_size[0]
    plen = td["prompt_mask"].sum(1)
    rlen = (td["versions"] != PAD_VERSION).sum(1)
    T = int((plen + rlen).max())
    tokens = torch.zeros(B, T, dtype=torch.int64)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), PAD_VERSION, dtype=torch.int64)
    experts = None
    if "routed_experts" in td.keys():
        experts = torch.full((B, T, *td["routed_experts"].shape[2:]), -1, dtype=torch.int32)
    for i in range(B):
        p, r = int(plen[i]), int(rlen[i])
        tokens[i, :p] = td["prompt_ids"][i, :p]
        tokens[i, p : p + r] = td["response_ids"][i, :r]
        loss_mask[i, p : p + r] = td["response_mask"][i, :r]
        logprobs[i, p : p + r] = td["sampler_logprobs"][i, :r]
        versions[i, p : p + r] = td["versions"][i, :r]
        if experts is not None:
            experts[i, p : p + r] = td["routed_experts"][i, :r]
    out = TensorDict(
        {
            "tokens": tokens,
            "positions": torch.arange(T).expand(B, T).clone(),
            "loss_mask": loss_mask,
            "sampler_logprobs": logprobs,
            "versions": versions,
            "advantage": td["advantage"].clone(),
            "response_start": plen.clone(),
        },
        batch_size=[B],
    )
    if experts is not None:
        out["routed_experts"] = experts
    return out


def unpack_token_values(packed_values: torch.Tensor, td: TensorDict) -> torch.Tensor:
    """Inverse of `pack_for_trainer` for one [B, T] per-token tensor: back to [B, R]."""
    B, R = td["response_ids"].shape
    plen = td["prompt_mask"].sum(1)
    out = torch.zeros(B, R, dtype=packed_values.dtype)
    for i in range(B):
        p = int(plen[i])
        r = min(R, packed_values.shape[1] - p)
        out[i, :r] = packed_values[i, p : p + r]
    return out


def group_slices(td: TensorDict) -> list[slice]:
    """Row ranges of consecutive groups (rows of one group are adjacent)."""
    gid = td["group_id"].tolist()
    slices, start = [], 0
    for i in range(1, len(gid) + 1):
        if i == len(gid) or gid[i] != gid[start]:
            slices.append(slice(start, i))
            start = i
    return slices
