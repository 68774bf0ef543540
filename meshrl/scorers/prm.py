"""PRIME's implicit process reward model: a causal LM that scores every model token and
trains online, in its own scorer proc, on the outcomes of the episodes it scores.

    q_t = beta x (log pi_prm(y_t | y_<t) - log pi_ref(y_t | y_<t))      for each model token t
    loss = BCE(sigmoid(sum_t q_t), outcome)                               per episode, batch mean

pi_ref is a frozen copy of the PRM's starting weights: the policy's (its checkpoint, or the
same seeded initialisation) or the scorer's own `path`, which must share the policy's
tokenizer, because the PRM reads the episode's own token ids. Env tokens (tool results, an
env's replies) are context, never scored.

Why it trains here, in the scorer proc, and not on a trainer mesh of its own: what it needs
(every episode's ids and outcome) is what the rollout workers already send it, its only
consumer is itself, so no weight sync is needed, and one optimizer step per scored batch
costs a forward and backward of a model the size of the policy, on one proc. One replica
only (config/checks.py refuses more): replicas would each train on a share of the episodes
and drift apart.

Versions. `version` counts the PRM's optimizer steps. Each request is one whole group
(`EpisodeScorers.score_group`), and `PRMService` (scorers/service.py) never splits a request across batches, so
every episode of a group is scored by one version: the leave-one-out baselines of
meshrl/scorers/process.py compare scores of one PRM. Groups of one trained batch may come
from different versions; each group's baseline is its own, so that does not mix them.

`update`: `after` (the default) scores a batch with version v and then trains on it (its
scores never saw its outcomes, and `loss` / `accuracy` are measured on episodes the PRM has
not trained on); `before` trains first, as PRIME's recipe does, and scores with v + 1.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import time

import torch
import torch.nn.functional as F

from meshrl.config import Config, ScorerConfig
from meshrl.launch.devices import planned_gpu


def build_causal_lm(config: Config, spec: ScorerConfig, device: str = "cpu"):
    """The PRM's starting model on `device` and its specs: `spec.path` (a HF causal LM), else the
    policy's starting weights (model.path, or build_model's seeded initialisation, as the trainer makes it)."""
    from meshrl.config.hf import model_args_from_hf
    from meshrl.trainer.checkpoint import load_hf
    from meshrl.trainer.model import build_model

    path = spec.path or config.model.path
    cfg, overrides = config.model, None
    if path is not None:
        cfg, overrides = model_args_from_hf(path)
    model, specs = build_model(cfg, device, seed=config.seed, hf_overrides=overrides)
    if path is not None:
        load_hf(model, specs, path)
    return model, specs


def group_items(episodes) -> list[dict]:
    """What the PRM is sent for each of a group's episodes: its token ids, the positions of
    its model tokens (the ones it scores), and its outcome, the env's reward."""
    items = []
    for ep in episodes:
        positions, at = [], 0
        for turn in ep.turns:
            if turn.role == "model":
                positions += range(at, at + len(turn.token_ids))
            at += len(turn.token_ids)
        items.append({"token_ids": list(ep.token_ids), "positions": positions, "outcome": float(ep.signals.get("env", ep.reward)), "group": ep.group_id})
    return items


def in_band(items: list[dict], band) -> torch.Tensor:
    """[B] True for each item whose group's share of successful episodes (outcome > 0.5)
    lies in the closed range `band` (PRIME's accuracy filter); items without a group are one group each."""
    groups: dict = {}
    for i, it in enumerate(items):
        groups.setdefault(it.get("group", ("item", i)), []).append(float(it["outcome"]) > 0.5)
    share = {g: sum(wins) / len(wins) for g, wins in groups.items()}
    low, high = band
    return torch.tensor([low <= share[it.get("group", ("item", i))] <= high for i, it in enumerate(items)])


def note_process_terms(group, episodes, name: str) -> None:
    """Each trained episode's mean |process term| over its trained tokens (its per-token
    advantage less its outcome advantage), as `scoring/NAME/process_abs`: the PRM's rewards
    reached the loss when it is above 0."""
    term = (group["token_advantage"] - group["advantage"][:, None]).abs()
    mask = group["loss_mask"]
    for i, ep in enumerate(episodes):
        if ep.finish_reason != "failed" and bool(mask[i].any()):
            ep.signals[f"{name}/process_abs"] = float(term[i][mask[i]].mean())


def rows(items: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] token ids, [B, T] True at each item's model tokens, [B] lengths
    and [B] outcomes (clipped to [0, 1]) of `items` ({"token_ids", "positions", "outcome"})."""
    width = max(len(it["token_ids"]) for it in items)
    tokens = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    for i, it in enumerate(items):
        tokens[i, : len(it["token_ids"])] = torch.tensor(it["token_ids"], dtype=torch.long)
        mask[i, list(it["positions"])] = True
    mask[:, 0] = False  # nothing predicts the first token
    lengths = torch.tensor([len(it["token_ids"]) for it in items])
    outcome = torch.tensor([min(1.0, max(0.0, float(it["outcome"]))) for it in items])
    return tokens, mask, lengths, outcome


class ImplicitPRM:
    """The PRM and its frozen reference on this proc, its AdamW and its version."""

    def __init__(self, spec: ScorerConfig, config: Config, name: str, restore: bool = False):
        self.spec, self.beta = spec, spec.beta
        # the GPU the device plan started this proc seeing (beside a GPU trainer), else the CPU; float32 either way
        self.device = torch.device("cuda", 0) if planned_gpu() else torch.device("cpu")
        self.model, self.specs = build_causal_lm(config, spec, str(self.device))
        self.model.train()
        self.start_path = spec.path or config.model.path  # pi_ref's checkpoint, where it has one
        self.ref = copy.deepcopy(self.model).eval()
        for p in self.ref.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, weight_decay=0.0)
        self.grad_clip = config.trainer.grad_clip
        self.version = 0
        self.dir = os.path.join(config.logging.run_dir, "checkpoints", f"prm-{name}")
        self.save_every_s = config.trainer.checkpoint_every_s
        self._saved_at = time.monotonic()
        self._lock = threading.RLock()  # a save (the run's checkpoint, asked from another thread) never sees half a step
        self.restored = self.load() if restore else None

    def load(self) -> int | None:
        """Its newest saved state, where there is one (a resumed run, or this replica replacing a
        dead one): the version it restored, else None. pi_ref stays the starting weights."""
        path = os.path.join(self.dir, "state.pt")
        if not os.path.isfile(path):
            return None
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        return self.version

    def rewards(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T] q_t on `mask`, 0 elsewhere; differentiable through the PRM when grad is on."""
        from meshrl.trainer.logprobs import token_logprobs

        lp, _ = token_logprobs(self.model, tokens, mask)
        with torch.no_grad():
            ref, _ = token_logprobs(self.ref, tokens, mask)
        return torch.where(mask, self.beta * (lp - ref), torch.zeros_like(lp))

    def train(self, tokens: torch.Tensor, mask: torch.Tensor, outcome: torch.Tensor, keep: torch.Tensor | None = None) -> dict:
        """One AdamW step of BCE(sigmoid(sum_t q_t), outcome) over the batch's rows `keep`
        (default all; PRIME's accuracy filter, `in_band`); version + 1. No row kept: no step."""
        if keep is not None:
            if not bool(keep.any()):
                return {"trained_frac": 0.0}
            frac = float(keep.float().mean())
            tokens, mask, outcome = tokens[keep], mask[keep], outcome[keep]
        else:
            frac = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        logit = self.rewards(tokens, mask).sum(1)
        loss = F.binary_cross_entropy_with_logits(logit, outcome)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.version += 1
        return {"train_loss": loss.item(), "grad_norm": norm.item(), "trained_frac": frac}

    def score_batch(self, items: list[dict]) -> tuple[list[dict], dict]:
        """Per item {"score": [q_t at each of its positions], "version", "loss", "accuracy",
        "prob"}; and the batch's training metrics. Scored and trained as `update` says."""
        with self._lock:
            return self._score_batch(items)

    def _score_batch(self, items: list[dict]) -> tuple[list[dict], dict]:
        tokens, mask, _, outcome = (t.to(self.device) for t in rows(items))
        keep = None if list(self.spec.train_accuracy) == [0.0, 1.0] else in_band(items, self.spec.train_accuracy).to(self.device)
        trained: dict = {}
        if self.spec.update == "before":
            trained = self.train(tokens, mask, outcome, keep)
        version = self.version
        with torch.no_grad():
            q = self.rewards(tokens, mask)
        q, outcome = q.cpu(), outcome.cpu()  # read item by item below
        logit = q.sum(1)
        loss = F.binary_cross_entropy_with_logits(logit, outcome, reduction="none")
        correct = (logit > 0) == (outcome > 0.5)
        if self.spec.update == "after":
            trained = self.train(tokens, mask, outcome, keep)
        results = []
        for i, it in enumerate(items):
            values = [float(q[i, p]) if p > 0 else 0.0 for p in it["positions"]]
            if not all(math.isfinite(v) for v in values):
                results.append({"score": None, "error": f"non-finite PRM reward at version {version}"})
                continue
            results.append(
                {
                    "score": values,
                    "version": version,
                    "latest": self.version,
                    "loss": float(loss[i]),
                    "accuracy": float(correct[i]),
                    "prob": float(torch.sigmoid(logit[i])),
                }
            )
        if time.monotonic() - self._saved_at >= self.save_every_s:
            self.save()
        return results, trained

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version}

    def save(self) -> str:
        """The PRM's state (model, AdamW, version) as RUN_DIR/checkpoints/prm-NAME/state.pt,
        written to a temp file and renamed, so a crash leaves the previous one whole. Saved
        every trainer.checkpoint_every_s, with each of the run's checkpoints, and at its stop."""
        with self._lock:
            os.makedirs(self.dir, exist_ok=True)
            path = os.path.join(self.dir, "state.pt")
            torch.save(self.state(), path + ".tmp")
            os.replace(path + ".tmp", path)
            self._saved_at = time.monotonic()
            return path

    def export_hf(self, path: str) -> dict:
        """The PRM at its current version as a Hugging Face causal LM at `path` (float32, as it
        trains), and `path/implicit_prm.json`: beta, the version, and pi_ref, without which its
        log-probs are no reward. pi_ref is the checkpoint the PRM started from, or, where it
        started from the policy's seeded initialisation, that frozen copy exported beside it
        (`path`-reference). Returns {"path", "reference", "version"}."""
        from meshrl.trainer.checkpoint import export_hf, write_atomic

        with self._lock:
            source = os.path.join(self.start_path, "config.json") if self.start_path else None
            reference = os.path.abspath(self.start_path) if self.start_path else export_hf(self.ref, self.specs, path + "-reference", torch.float32)
            out = export_hf(self.model, self.specs, path, torch.float32, source_config=source)
            info = {"beta": self.beta, "version": self.version, "reference": reference}
            write_atomic(os.path.join(out, "implicit_prm.json"), json.dumps(info, indent=2))
            return {"path": out, "reference": reference, "version": self.version}

    def shutdown(self) -> None:
        self.save()
