"""Process rewards: scores per turn or per step of a response, as per-token advantages.

A scorer with `process: turn` scores the episode after each model turn; with `process:
step`, after each `step_delimiter` inside the model's text too (a model turn's end always
ends a step). Step k ends at token e_k and scores s_k (weighted by its scorer; several
process scorers add up). Its group's trained episodes give one baseline b, the mean of
their step scores, and each token t of the model's text gets

    return (PRIME-style):  A_t = A_group + w * sum over steps k with e_k >= t of (s_k - b)
    step   (turn-level):   A_t = A_group + w * (s_k - b)    for the step k that holds t

with w = scoring.process_weight and A_group the outcome reward's group advantage (the
outcome counts each process scorer's last step score). An implicit PRM (meshrl/scorers/prm.py)
makes every model token a step, adds nothing to the outcome, and replaces b by each episode's
leave-one-out baseline (PRIME's: the other episodes' mean per-token score). Either way the advantage is constant
inside a step and changes only right after a step's last token. In a game the rows are its
threads: a scorer steps through the threads of the model it names, and each model's rows of
a group are a group of their own (as for the outcome's advantage). The result is the batch's
per-token `token_advantage`, which the loss trains on (as distillation's; both add up).

Under PPO's critic (`trainer.loss.advantage: gae`) the step scores are rewards instead, as
Math-Shepherd trains PPO on a PRM's step rewards: `process_reward` holds w * s_k at e_k,
GAE adds it to the turns' rewards (meshrl/trainer/values.py), and the critic's value of each
state is the baseline, so no group baseline is taken. With gamma = lambda = 1 that is the
`return` form with V_t in place of b.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict

from meshrl.episode import FINISH_REASONS, Episode, baseline_groups
from meshrl.tokenizer import reply_text


def step_ends(episode: Episode, tokenizer, process: str, delimiter: str) -> list[int]:
    """Episode positions of the last token of each step, in order."""
    ends, at = [], 0
    for turn in episode.turns:
        ids, n = turn.token_ids, len(turn.token_ids)
        if turn.role == "model" and n:
            if process == "step" and delimiter:
                # only where a token could close a delimiter (a few: one character's bytes)
                closes = [j for j in range(n - 1) if delimiter[-1] in tokenizer.decode(ids[max(0, j - 3) : j + 1]) and _closes(tokenizer, ids, j, delimiter)]
                if closes and tokenizer.decode(ids[closes[-1] + 1 :], skip_special_tokens=True) == "":
                    closes.pop()  # nothing but the end-of-turn token after it: one last step, not two of one text
                ends += [at + j for j in closes]
            ends.append(at + n - 1)
        at += n
    return ends


def _closes(tokenizer, ids: Sequence[int], j: int, delimiter: str) -> bool:
    """Whether the text of ids[: j + 1] ends with `delimiter`, read from the fewest tokens before
    j that decode to a few characters more than it: what a window's first token decodes to on its
    own (a space dropped, a character cut in its bytes) stays out of the compared end, and a turn
    costs time linear in its length (decoding each prefix whole was quadratic, on the worker's loop)."""
    width = len(delimiter) + 1
    while True:
        start = max(0, j + 1 - width)
        text = tokenizer.decode(ids[start : j + 1])
        if start == 0 or len(text) > len(delimiter) + 4:
            return text.endswith(delimiter)
        width *= 2


def step_texts(episode: Episode, tokenizer, ends: Sequence[int]) -> list[str]:
    """The response (everything after the prompt) cut after each step's last token."""
    ids, start = episode.token_ids, episode.prompt_len
    return [reply_text(tokenizer, ids[start : e + 1]) for e in ends]  # as the response reads (an id past the tokenizer's: U+FFFD)


def process_tensors(episodes: Sequence[Episode], T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] step scores at the steps' last tokens, and [B, T] True there; from each
    episode's `process` list of (position, weighted score)."""
    scores = torch.zeros(len(episodes), T)
    ends = torch.zeros(len(episodes), T, dtype=torch.bool)
    for i, ep in enumerate(episodes):
        for pos, value in ep.process:
            scores[i, pos] += value
            ends[i, pos] = True
    return scores, ends


def loo_baselines(scores: torch.Tensor, ends: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """PRIME's leave-one-out baseline of each of `rows` (a [B] mask, one group's trained
    episodes): the mean over the group's other episodes of their mean step score. [B], or
    None when fewer than two of the rows have steps (their process term is then 0)."""
    counts = (ends & rows[:, None]).sum(1)
    has = rows & (counts > 0)
    k = int(has.sum())
    if k < 2:
        return None
    means = torch.where(has, (scores * ends).sum(1) / counts.clamp(min=1), torch.zeros(()))
    return (means[has].sum() - means) / (k - 1)


def split_process(td: TensorDict, scores: torch.Tensor, ends: torch.Tensor, weight: float, gae_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's critic's rows (`gae_rows`, [B]): their weighted step scores as `process_reward`
    [B, T] in `td` (0 elsewhere); returns the other rows' (scores, ends), for
    `assign_process_advantages`."""
    T = td["tokens"].shape[1]
    scores, ends = scores[:, :T], ends[:, :T]
    mine = ends & gae_rows[:, None]
    td["process_reward"] = torch.where(mine, weight * scores, torch.zeros(())).to(torch.float32)
    return torch.where(mine, torch.zeros(()), scores), ends & ~mine


def assign_process_advantages(td: TensorDict, scores: torch.Tensor, ends: torch.Tensor, weight: float, mode: str, baseline: str = "mean") -> TensorDict:
    """Add the process term to `token_advantage` (made from `advantage` when absent); in
    place, returns td. `scores` and `ends` as `process_tensors` gives them. `baseline`:
    `mean`, the group's mean step score; `loo` (an implicit PRM's), each episode's own
    leave-one-out baseline (`loo_baselines`), as its outcome's is under `rloo`."""
    T = td["tokens"].shape[1]
    scores, ends = scores[:, :T], ends[:, :T]
    trained = td["finish_reason"] != FINISH_REASONS["failed"]
    gid = baseline_groups(td)  # a game: each model's (and role's) rows of a group apart
    centred = torch.zeros_like(scores)
    for g in torch.unique(gid):
        rows = (gid == g) & trained
        steps = ends & rows[:, None]
        if baseline == "loo":
            b = loo_baselines(scores, ends, rows)
            if b is not None:
                centred = torch.where(steps, scores - b[:, None], centred)
        elif steps.any():
            centred[steps] = scores[steps] - scores[steps].mean()
    if mode == "return":
        term = centred.flip(1).cumsum(1).flip(1)
    elif mode == "step":
        term = torch.zeros_like(centred)
        for i in range(term.shape[0]):
            start = 0
            for e in ends[i].nonzero().flatten().tolist():
                term[i, start : e + 1] = centred[i, e]
                start = e + 1
    else:
        raise ValueError(f"unknown process_advantage {mode!r}: use 'return' or 'step'")
    base = td["token_advantage"] if "token_advantage" in td.keys() else td["advantage"][:, None].expand(-1, T)
    per_token = base + weight * term
    mask = td["loss_mask"]
    td["token_advantage"] = torch.where(mask, per_token, torch.zeros_like(per_token)).to(torch.float32)
    return td
