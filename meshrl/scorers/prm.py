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
costs a forward and backward of a model the size of the policy. One replica only
(config/checks.py refuses more): replicas would each train on a share of the episodes and
drift apart. That replica may span `procs` procs: the PRM, pi_ref and AdamW's state are then
sharded over them (FSDP2, as PPO's critic is), every rank gets the whole batch, scores and
trains on its share of the rows (every `procs`-th), and the loss is normalised by the whole
batch's count, so the step is the one a single proc would take. Rank 0 answers the rollout
workers and leads the others through each call in the same order (scorers/service.py).

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
import torch.distributed as dist
import torch.nn.functional as F

from meshrl.config import Config, ScorerConfig
from meshrl.launch.devices import planned_gpu


STATE_FILE = "state.pt"


def state_dir(run_dir: str, name: str) -> str:
    """RUN_DIR/checkpoints/prm-NAME: where the PRM named NAME keeps its state (STATE_FILE)."""
    return os.path.join(run_dir, "checkpoints", f"prm-{name}")


def saved_prms(run_dir: str) -> list[str]:
    """The names of the PRMs whose state RUN_DIR holds."""
    root = os.path.join(run_dir, "checkpoints")
    held = os.listdir(root) if os.path.isdir(root) else []
    return sorted(d.removeprefix("prm-") for d in held if d.startswith("prm-") and os.path.isfile(os.path.join(root, d, STATE_FILE)))


def build_causal_lm(config: Config, spec: ScorerConfig, device: str = "cpu"):
    """The PRM's starting model on `device` and its specs: `spec.path` (a HF causal LM), else the
    policy's starting weights (model.path, or build_model's seeded initialisation, as the trainer
    makes it). Under torch.distributed with several ranks, this rank's FSDP2 shard of it: from a
    checkpoint built on the meta device, sharded, then loaded shard by shard (no rank holds it
    whole); from the seed built whole, the same on every rank, then sharded."""
    from meshrl.config.hf import model_args_from_hf
    from meshrl.trainer.checkpoint import load_hf
    from meshrl.trainer.model import build_model

    path = spec.path or config.model.path
    cfg, overrides = config.model, None
    if path is not None:
        cfg, overrides = model_args_from_hf(path)
    world = dist.get_world_size() if dist.is_initialized() else 1
    on_meta = world > 1 and path is not None
    model, specs = build_model(cfg, "meta" if on_meta else device, seed=config.seed, hf_overrides=overrides)
    if world > 1:
        from meshrl.trainer.parallelize import shard_over_ranks
        from meshrl.trainer.policy import materialize

        model = shard_over_ranks(model, specs.parallelize_fn, torch.device(device).type, torch.float32)  # as PPO's critic
        if on_meta:
            materialize(model, torch.device(device), config.seed)
    if path is not None:
        load_hf(model, specs, path)
    return model, specs


def group_items(episodes) -> list[dict]:
    """What the PRM is sent for each of a group's episodes: its token ids, the positions of
    its model tokens (the ones it scores), its outcome, the env's reward, and its group for the
    accuracy filter (a game thread's role apart)."""
    items = []
    for ep in episodes:
        positions, at = [], 0
        for turn in ep.turns:
            if turn.role == "model":
                positions += range(at, at + len(turn.token_ids))
            at += len(turn.token_ids)
        group = ep.group_id if ep.role is None else f"{ep.group_id}/{ep.role}"  # a self-play role's rows apart (episode.baseline_groups)
        items.append({"token_ids": list(ep.token_ids), "positions": positions, "outcome": float(ep.signals.get("env", ep.reward)), "group": group})
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


def note_process_terms(term, mask, episodes, name: str) -> None:
    """Each trained episode's mean |process term| over its trained tokens, as
    `scoring/NAME/process_abs`: the PRM's rewards reached the loss when it is above 0. `term`
    [B, T]: the per-token advantage less what it was without the PRM (the outcome's advantage,
    or a teacher's per-token one); under PPO's critic, the PRM's rewards GAE adds up."""
    term = term.abs()
    for i, ep in enumerate(episodes):
        if ep.finish_reason != "failed" and name in ep.signals and bool(mask[i].any()):  # the rows it scored (a game's: the policy's)
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
    """The PRM and its frozen reference on this proc (one rank's shards of both where it spans
    several procs), its AdamW and its version."""

    def __init__(self, spec: ScorerConfig, config: Config, name: str, restore: bool = False):
        self.spec, self.beta = spec, spec.beta
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        # the GPU the device plan started this proc seeing (beside a GPU trainer), else the CPU; float32 either way
        self.device = torch.device("cuda", 0) if planned_gpu() else torch.device("cpu")
        self.model, self.specs = build_causal_lm(config, spec, str(self.device))
        self.model.train()
        self.start_path = spec.path or config.model.path  # pi_ref's checkpoint, where it has one
        # sharded, pi_ref is a second sharded build of the same start (a deep copy of an FSDP module is not one)
        self.ref = (copy.deepcopy(self.model) if self.world == 1 else build_causal_lm(config, spec, str(self.device))[0]).eval()
        for p in self.ref.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, weight_decay=0.0)
        self.grad_clip = config.trainer.grad_clip
        self.version = 0
        self.dir = state_dir(config.logging.run_dir, name)
        self.save_every_s = config.trainer.checkpoint_every_s
        self._saved_at = time.monotonic()
        self._lock = threading.RLock()  # a save (the run's checkpoint, asked from another thread) never sees half a step
        self.restored = self.load() if restore else None

    def load(self) -> int | None:
        """Its newest saved state, where there is one (a resumed run, or this replica replacing a
        dead one): the version it restored, else None. pi_ref stays the starting weights. The
        state is whole (`state`), so it loads over any number of procs; each rank reads it and
        keeps its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from meshrl.trainer.checkpoint import configured_lr

        path = os.path.join(self.dir, STATE_FILE)
        if not os.path.isfile(path):
            return None
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mapped: the ranks of one host share its pages
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=options)
        optimizer = state["optimizer"] if state["optimizer"].get("state") else {}  # none before AdamW's first step (`state`)
        if optimizer and all(isinstance(k, int) for k in optimizer["state"]):  # saved by an earlier meshrl: optimizer.state_dict()'s indices
            names = [n for n, _ in self.model.named_parameters()]  # in the order its AdamW was given them
            groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer["param_groups"]]
            optimizer = {"state": {names[i]: v for i, v in optimizer["state"].items()}, "param_groups": groups}
        if optimizer:
            with configured_lr(self.optimizer, None):  # the configured rate, not the saved one (a resume's override)
                set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=options)
        self.version = int(state["version"])
        return self.version

    def rewards(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T] q_t on `mask`, 0 elsewhere; differentiable through the PRM when grad is on."""
        from meshrl.trainer.logprobs import token_logprobs

        lp, _ = token_logprobs(self.model, tokens, mask)
        with torch.no_grad():
            ref, _ = token_logprobs(self.ref, tokens, mask)
        return torch.where(mask, self.beta * (lp - ref), torch.zeros_like(lp))

    def train(self, tokens: torch.Tensor, mask: torch.Tensor, outcome: torch.Tensor, weight: torch.Tensor, kept: int, total: int) -> dict:
        """One AdamW step of BCE(sigmoid(sum_t q_t), outcome), the mean over the `kept` rows of
        the whole batch (of `total`; PRIME's accuracy filter, `in_band`) that pass the filter;
        this rank's rows are those with `weight` > 0. Version + 1; no row kept anywhere: no step.
        Collective where the PRM is sharded: every rank calls it, a rank without a kept row on
        one of its rows with weight 0."""
        from torchtitan.distributed.utils import clip_grad_norm_

        if kept == 0:
            return {"trained_frac": 0.0}
        on = weight > 0
        if not bool(on.any()):
            on[0] = True  # FSDP's gathers run on every rank; this row adds nothing
        tokens, mask, outcome, weight = tokens[on], mask[on], outcome[on], weight[on]
        self.optimizer.zero_grad(set_to_none=True)
        logit = self.rewards(tokens, mask).sum(1)
        loss = (F.binary_cross_entropy_with_logits(logit, outcome, reduction="none") * weight).sum() / kept
        loss.backward()
        norm = clip_grad_norm_(list(self.model.parameters()), self.grad_clip if self.grad_clip > 0 else float("inf"), foreach=True)
        loss = loss.detach()
        if self.world > 1:
            dist.all_reduce(loss)
        if not (math.isfinite(float(norm)) and math.isfinite(loss.item())):  # (the norm is the whole PRM's: every rank agrees)
            # one bad batch must not write NaN into AdamW and the weights: no step, no new version
            self.optimizer.zero_grad(set_to_none=True)
            return {"trained_frac": 0.0, "skipped_nonfinite": 1.0}
        self.optimizer.step()
        self.version += 1
        return {"train_loss": loss.item(), "grad_norm": float(norm), "trained_frac": kept / total}

    def score_batch(self, items: list[dict]) -> tuple[list[dict], dict]:
        """Per item {"score": [q_t at each of its positions], "version", "loss", "accuracy",
        "prob"}; and the batch's training metrics. Scored and trained as `update` says; saved
        when due. One proc only (sharded: `score_rows` on every rank)."""
        mine, trained = self.score_rows(items, self.save_due())
        return [r for _, r in mine], trained

    def save_due(self) -> bool:
        """trainer.checkpoint_every_s since its last save; 0: never by time (as the run's checkpoints)."""
        return bool(self.save_every_s) and time.monotonic() - self._saved_at >= self.save_every_s

    def score_rows(self, items: list[dict], save: bool) -> tuple[list[tuple[int, dict]], dict]:
        """(row, result) for this rank's rows of `items` (every `world`-th from its rank), and
        the batch's training metrics; then the state saved where `save` (decided by rank 0, so
        every rank saves at the same call). Collective where the PRM is sharded."""
        with self._lock:
            out = self._score_rows(items)
            if save:
                self.save()
            return out

    def _score_rows(self, items: list[dict]) -> tuple[list[tuple[int, dict]], dict]:
        tokens, mask, _, outcome = rows(items)
        keep = torch.ones(len(items), dtype=torch.bool) if list(self.spec.train_accuracy) == [0.0, 1.0] else in_band(items, self.spec.train_accuracy)
        mine = list(range(self.rank, len(items), self.world))
        run = torch.tensor(mine or [0])  # a rank without a row runs row 0 for FSDP's gathers; its results are dropped
        weight = (keep[run] & bool(mine)).float().to(self.device)
        tokens, mask, outcome = (t[run].to(self.device) for t in (tokens, mask, outcome))
        step = (tokens, mask, outcome, weight, int(keep.sum()), len(items))
        trained: dict = {}
        if self.spec.update == "before":
            trained = self.train(*step)
        version = self.version
        with torch.no_grad():
            q = self.rewards(tokens, mask)
        q, outcome = q.cpu(), outcome.cpu()  # read item by item below
        logit = q.sum(1)
        loss = F.binary_cross_entropy_with_logits(logit, outcome, reduction="none")
        correct = (logit > 0) == (outcome > 0.5)
        if self.spec.update == "after":
            trained = self.train(*step)
        results = []
        for j, i in enumerate(mine):
            values = [float(q[j, p]) if p > 0 else 0.0 for p in items[i]["positions"]]
            if not all(math.isfinite(v) for v in values):
                results.append((i, {"score": None, "error": f"non-finite PRM reward at version {version}"}))
                continue
            prob, right = float(torch.sigmoid(logit[j])), float(correct[j])
            results.append((i, {"score": values, "version": version, "latest": self.version, "loss": float(loss[j]), "accuracy": right, "prob": prob}))
        return results, trained

    def state(self) -> dict:
        """Model and AdamW state whole (gathered from every rank where sharded: collective; rank 0
        keeps it), on the CPU, keyed by parameter name, and the version. Before AdamW's first
        step its state is {}: torch would make one by a zero step, which skews the first real one."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.model, options=options)
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options) if self.optimizer.state else {}
        return {"model": model, "optimizer": optimizer, "version": self.version}

    def save(self) -> str:
        """The PRM's state (model, AdamW, version) as RUN_DIR/checkpoints/prm-NAME/state.pt,
        written to a temp file and renamed, so a crash leaves the previous one whole. Saved
        every trainer.checkpoint_every_s, with each of the run's checkpoints, and at its stop.
        Collective where the PRM is sharded; rank 0 writes."""
        with self._lock:
            state = self.state()
            path = os.path.join(self.dir, STATE_FILE)
            if self.rank == 0:
                os.makedirs(self.dir, exist_ok=True)
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
            if self.world > 1:
                dist.barrier()
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
            out = export_hf(self.model, self.specs, path, torch.float32, source_config=source)  # collective where sharded: rank 0 writes
            info = {"beta": self.beta, "version": self.version, "reference": reference}
            if self.rank == 0:
                write_atomic(os.path.join(out, "implicit_prm.json"), json.dumps(info, indent=2))
            return {"path": out, "reference": reference, "version": self.version}

    def shutdown(self) -> None:
        self.save()
