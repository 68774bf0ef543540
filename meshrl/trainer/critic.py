"""The critic for PPO: a value model and a single-rank trainer for it, in plain PyTorch.

The value model is the policy's TorchTitan model (meshrl/trainer/model.py) with its LM head
replaced by a one-output Linear(dim, 1) with a bias (verl's critic is the same thing: a
one-label token-classification head on the transformer). The head starts at zero, so a
fresh critic says V = 0 everywhere and its first advantages are the plain returns; the trunk
can start from the policy's weights (`init_from`: a state dict or a HF checkpoint dir).

Values are read where verl reads them: the value of the state before token t is the head's
output at position t-1 (`token_values`), so V_t has seen exactly the context the policy had
when it sampled token t, env turns included.

`CriticTrainer` is one rank: the value model, AdamW with a linear warm-up, the clipped
value loss over micro-batches with global denominators (meshrl/trainer/values.py), `epochs`
optimizer steps per batch (one by default), and a version counter (one per batch). Built
in an initialised process group of several ranks (`critic.procs`), it shards the value
model with FSDP2 as `PolicyTrainer` does: each rank values and trains on its share of the
rows (per-rank micro-batch plans), the values are summed across ranks, and the metrics'
`_sum`/`_max` parts are all-reduced in one place.

Flow per batch (the caller's, e.g. the trainer actor):

    old_values = critic.values(batch)                         # no grad, the critic's version v
    returns = ppo_advantages(batch, old_values, gamma, lam)    # writes batch["token_advantage"]
    policy.train_step(batch); critic.train_step(batch, returns, old_values)
"""

from __future__ import annotations

import math
import os
import re
import time
import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from meshrl.config import ModelConfig, TrainerConfig
from meshrl.episode import trim
from meshrl.trainer.head import float32_logits, head_logits
from meshrl.trainer.logprobs import hidden_states
from meshrl.trainer.packing import row_lengths
from meshrl.trainer.parallelize import full_tensor
from meshrl.trainer.values import ppo_advantages, reduce_value_metrics, value_loss  # noqa: F401 (ppo_advantages: re-exported)

HEAD = "lm_head"
"""The value head keeps the LM head's attribute name: TorchTitan's forward (and its
`_skip_lm_head` switch) call it, so `model(tokens)` returns [B, T, 1]."""


def value_head(dim: int, device: torch.device | str = "cpu") -> nn.Module:
    """A TorchTitan Linear(dim, 1) with a bias, initialised (and re-initialised by
    `init_weights`, as a model materialised from the meta device is) to zero."""
    from torchtitan.models.common import Linear

    cfg = Linear.Config(in_features=dim, out_features=1, bias=True, param_init={"weight": nn.init.zeros_, "bias": nn.init.zeros_})
    with torch.device(device):
        head = cfg.build()
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    float32_logits(head)  # values from float32 hidden states, whatever the trunk computes in
    return head


def build_value_model(
    model_config: ModelConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
    init_from: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
    hf_overrides: dict | None = None,
):
    """The value model: `build_model(model_config)` with a zero value head; returns (module, ModelSpecs).
    On the meta device nothing is loaded (`load_value_weights` after sharding does).

    `init_from`: a TorchTitan-named state dict (a policy's `model.state_dict()`) or a HF
    checkpoint directory; every weight but the LM head is loaded from it (the head is the
    value head's own), and a one-label classifier's `score` head (a critic's, a reward
    model's) becomes the value head. None with `model_config.path` set: that checkpoint, its sizes read
    from its config.json, as PolicyTrainer does. Tied embeddings are untied (the head no
    longer shares the embedding's shape). `specs.hf_config` still describes a causal LM;
    `export_value_model_hf` writes the value model's own.
    """
    from meshrl.config.hf import model_args_from_hf
    from meshrl.trainer.model import build_model

    cfg, overrides = model_config, dict(hf_overrides or {})
    if model_config.path is not None:
        cfg, read = model_args_from_hf(model_config.path)
        overrides = {**read, **overrides}
        init_from = model_config.path if init_from is None else init_from
    model, specs = build_model(cfg, device, seed=seed, hf_overrides=overrides)
    if model.enable_weight_tying:
        model.enable_weight_tying = False
        model.tok_embeddings.weight = nn.Parameter(model.tok_embeddings.weight.detach().clone())
    setattr(model, HEAD, value_head(model.lm_head.in_features, device))
    if init_from is not None and torch.device(device).type != "meta":
        load_value_weights(model, specs, init_from)
    return model, specs


def load_value_weights(model: nn.Module, specs, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
    """`source` into the value model (plain or sharded; every rank reads the whole source):
    a HF checkpoint directory's trunk, and a one-label classifier's `score` head as the value
    head; or a TorchTitan-named state dict's trunk."""
    if isinstance(source, (str, os.PathLike)):
        from meshrl.trainer.checkpoint import read_hf_tensors

        tensors = read_hf_tensors(source)
        score = {k[len("score.") :]: tensors.pop(k) for k in [k for k in tensors if k.startswith("score.")]}
        adapter = specs.adapter_cls(specs.titan_config, str(source))
        load_trunk(model, adapter.from_hf(tensors), str(source))
        if score:  # a one-label classifier's head: a critic's (with its bias) or a reward model's (none: 0)
            load_head(getattr(model, HEAD), score, str(source))
    else:
        load_trunk(model, source, "the state dict")


def export_value_model_hf(model: nn.Module, specs, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, source_config=None) -> str:
    """The value model as a Hugging Face token-classification checkpoint with one label
    (`<Family>ForTokenClassification`, `num_labels` 1: the form verl's and TRL's critics
    load): the trunk under the causal LM's names, the value head as `score`. Its logits at
    position t value the state after token t, which `token_values` reads at t + 1. Sharded:
    a collective, every rank calls it, rank 0 writes; returns the directory."""
    from meshrl.trainer.checkpoint import hf_config, write_hf_dir

    adapter = specs.adapter_cls(specs.titan_config, None)
    tensors = {}
    for name, t in model.state_dict().items():
        full = full_tensor(t.detach()).to(dtype).cpu()
        if name.startswith(HEAD + "."):
            tensors["score." + name[len(HEAD) + 1 :]] = full.contiguous()
        else:
            tensors.update({k: v.contiguous() for k, v in adapter.to_hf({name: full}).items()})
    if dist.is_initialized() and dist.get_rank() != 0:  # every rank gathered the shards; rank 0 writes them
        return os.path.abspath(out_dir)
    config = hf_config(specs, dtype, source_config)
    # from a causal LM's config, or a reward model's (a sequence classifier) the critic started from
    config["architectures"] = [re.sub(r"For\w+$", "ForTokenClassification", a) for a in config.get("architectures", [])]
    config.update(num_labels=1, id2label={"0": "VALUE"}, label2id={"VALUE": 0}, tie_word_embeddings=False)
    out = os.path.abspath(out_dir)
    write_hf_dir(tensors, config, out)
    return out


def load_head(head: nn.Module, score: Mapping[str, torch.Tensor], source: str) -> None:
    """A HF classifier's `score` weights (and bias, where it has one) into the value head."""
    from meshrl.trainer.checkpoint import copy_whole_into

    weight = score["weight"]
    if tuple(weight.shape) != tuple(head.weight.shape):
        raise ValueError(f"{source}: its score head is {tuple(weight.shape)}, a value head is {tuple(head.weight.shape)} (one label over the hidden size)")
    with torch.no_grad():
        copy_whole_into(head.weight, weight)
        copy_whole_into(head.bias, score["bias"] if "bias" in score else torch.zeros(tuple(head.bias.shape)))


def load_trunk(model: nn.Module, tensors: Mapping[str, torch.Tensor], source: str = "the state dict") -> None:
    """Copy every parameter (and matching buffer) but the head from TorchTitan-named
    `tensors` into `model`, in place; a missing or misshapen trunk weight is an error."""
    from meshrl.trainer.checkpoint import copy_whole_into, state_name

    missing = [n for n in (state_name(n) for n, _ in model.named_parameters()) if not n.startswith(HEAD + ".") and n not in tensors]
    if missing:
        raise KeyError(f"{source} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    with torch.no_grad():
        for name, target in model.state_dict().items():
            if name.startswith(HEAD + ".") or name not in tensors:
                continue
            src = full_tensor(tensors[name])
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"{source}: {name} is {tuple(src.shape)}, the value model's is {tuple(target.shape)}")
            copy_whole_into(target, src)


def token_values(model: nn.Module, batch: TensorDict, *, packed: bool = False) -> torch.Tensor:
    """[B, T] float32 values aligned to tokens: out[:, t] = the head at position t-1 (the
    state before token t), out[:, 0] = 0 (no state precedes it), and 0 off `loss_mask`.
    Differentiable when grad is enabled. `packed`: run the rows back to back with no
    padding (meshrl/trainer/packing.py), for the same values."""
    device = next(model.parameters()).device
    tokens, mask = batch["tokens"].to(device), batch["loss_mask"].to(device)
    lengths = row_lengths(batch) if packed else None
    h = hidden_states(model, tokens, lengths)  # [B, T, D]
    v = head_logits(getattr(model, HEAD), h[:, :-1]).squeeze(-1)  # [B, T-1]: the state before tokens 1..T-1
    out = torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1)
    return torch.where(mask, out, 0.0)


class CriticTrainer:
    """One rank of the critic: value model, AdamW, warm-up schedule, version.

    Args: model_config (the policy's sizes, or `path` to start from a checkpoint); lr,
    weight_decay, warmup_steps (linear warm-up of lr over that many steps), grad_clip (0: off),
    value_clip (verl's cliprange_value; None: unclipped), gamma / lam / value_lam / adaptive_lam
    (for `advantages`: values.ppo_advantages), aggregation (as the policy loss's),
    micro_batch_size (rows per forward) or
    micro_batch_tokens (> 0: a token budget, rows packed), epochs (optimizer steps per
    batch, verl's critic ppo_epochs), seed, device, init_from (see `build_value_model`),
    compute_dtype (autocast on CPU; float32 master weights), hf_overrides (build_model's,
    for a checkpoint's shapes built from scratch), activation_checkpoint (TorchTitan's, of each
    block: `full` or `selective`; the policy's trainer.activation_checkpoint, so that long rows
    fit the value model, the policy's size, as they fit the policy).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        value_clip: float | None = 0.5,
        gamma: float = 1.0,
        lam: float = 1.0,
        value_lam: float | None = None,
        adaptive_lam: float = 0.0,
        aggregation: str = "token_mean",
        micro_batch_size: int = 16,
        micro_batch_tokens: int = 0,
        epochs: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
        init_from: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
        compute_dtype: torch.dtype = torch.float32,
        hf_overrides: dict | None = None,
        activation_checkpoint: str = "none",
    ):
        self.device = torch.device(device)
        self.value_clip, self.gamma, self.lam, self.aggregation = value_clip, gamma, lam, aggregation
        self.value_lam, self.adaptive_lam = value_lam, adaptive_lam
        self.grad_clip, self.micro_batch_size, self.micro_batch_tokens = grad_clip, micro_batch_size, micro_batch_tokens
        self.epochs = epochs
        # Sharded and started from a checkpoint, the model is built on the meta device, sharded,
        # then materialised and loaded shard by shard, as PolicyTrainer does: no rank holds
        # the whole critic on its device. From the seed it is built whole, the same on every rank.
        sharded = dist.is_initialized() and dist.get_world_size() > 1
        source = init_from if init_from is not None else model_config.path
        on_meta = sharded and source is not None
        build_on = torch.device("meta") if on_meta else self.device
        self.model, self.specs = build_value_model(model_config, seed=seed, device=build_on, init_from=init_from, hf_overrides=hf_overrides)
        self.compute_dtype = compute_dtype
        if self.device.type == "cpu" and compute_dtype != torch.float32:
            from meshrl.compat import titan_float32_islands_under_cpu_autocast

            titan_float32_islands_under_cpu_autocast(self.model)
        self.dp_rank, self.dp_world, self._dp_group = 0, 1, None
        if activation_checkpoint != "none":  # TorchTitan's order: checkpointing, then sharding
            from meshrl.trainer.parallelize import ac_config

            ac_config(TrainerConfig(activation_checkpoint=activation_checkpoint)).build(dump_folder="/tmp").apply(self.model)
        if sharded:
            self._shard()
        if on_meta:
            from meshrl.trainer.policy import materialize

            materialize(self.model, self.device, seed)
            load_value_weights(self.model, self.specs, source)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
        self.version = 0
        """train_step calls taken = the version of the current weights."""
        self._source_config = os.path.join(model_config.path, "config.json") if model_config.path else None

    def _shard(self) -> None:
        """FSDP2 over every rank of the critic's process group (`shard_over_ranks`)."""
        from meshrl.trainer.parallelize import shard_over_ranks

        self.model = shard_over_ranks(self.model, self.specs.parallelize_fn, self.device.type, self.compute_dtype)
        self.dp_rank, self.dp_world = dist.get_rank(), dist.get_world_size()

    def autocast(self):
        on = self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=on)

    def _plans(self, batch: TensorDict) -> list[list[list[int]]]:
        from meshrl.trainer.packing import micro_batch_plans

        return micro_batch_plans(batch, self.dp_world, self.micro_batch_size, self.micro_batch_tokens)

    # ---- values -------------------------------------------------------------------------
    @torch.no_grad()
    def values(self, batch: TensorDict) -> torch.Tensor:
        """[B, T] float32 values of the whole batch under the current weights (0 off
        `loss_mask`), on the CPU: the V_old of the GAE on the batch the policy trains on."""
        B, T = batch["tokens"].shape
        out = torch.zeros(B, T, dtype=torch.float32)
        for idx in self._plans(batch)[self.dp_rank]:
            if not idx and self.dp_world == 1:
                continue
            part = trim(batch[torch.tensor(idx or [0])])  # a rank with no rows left still runs FSDP's gathers
            with self.autocast():
                v = token_values(self.model, part, packed=self.micro_batch_tokens > 0)
            if idx:
                out[torch.tensor(idx), : v.shape[1]] = v.float().cpu()
        if self.dp_world > 1:  # each rank valued its own rows: the sum is the whole batch's, on every rank
            out = out.to(self.device)
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self._dp_group)
            out = out.cpu()
        return out

    def advantages(self, batch: TensorDict, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`values` then `ppo_advantages` with this critic's gamma and lambdas: writes
        batch["token_advantage"] (and drops failed episodes from `loss_mask`); returns
        (returns, old_values), the arguments of `train_step`."""
        old = self.values(batch)
        return ppo_advantages(batch, old, self.gamma, self.lam, whiten, self.value_lam, self.adaptive_lam), old

    # ---- training -----------------------------------------------------------------------
    def train_step(self, batch: TensorDict, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """`epochs` optimizer steps of the clipped value loss on `batch` ([B, T] `returns` and
        `old_values` aligned with it), each over the whole batch in micro-batches normalised
        by its token (or sequence) counts. The value clip only acts from the second epoch
        on: the first pass's values are the old ones.

        A batch with no model token to learn from (every episode failed, or a game's model
        had no row of its own) makes no update. A non-finite loss or gradient norm skips that update (weights and AdamW's state stay
        as the previous epoch left them), ends the step and reports value_nonfinite = 1; the
        version and the lr schedule advance once per batch either way, so the critic stays in
        step with the policy.
        Metrics, of the last pass: value_loss, value_clip_frac, value_mean, return_mean,
        explained_variance (of the values before that pass's update: with one epoch, the
        values that scored the batch), value_tokens, value_abs_max, grad_norm; and lr,
        value_nonfinite, version, step_time_s.
        """
        t0 = time.perf_counter()
        for _ in range(self.epochs):
            out, grad_norm, finite = self._update(batch, returns, old_values)
            if not finite or not batch["loss_mask"].any():  # nothing to learn from: one pass for its metrics
                break
        with warnings.catch_warnings():  # a first step skipped: torch warns that the schedule steps first
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()  # the schedule follows the version, skipped steps included
        self.version += 1
        out.update(
            grad_norm=float(grad_norm),
            lr=self.scheduler.get_last_lr()[0],
            value_nonfinite=float(not finite),
            version=self.version,
            step_time_s=time.perf_counter() - t0,
        )
        return out

    def _update(self, batch: TensorDict, returns: torch.Tensor, old_values: torch.Tensor) -> tuple[dict[str, float], torch.Tensor, bool]:
        """One pass over the batch and an optimizer step unless its loss or gradient is not
        finite: (the pass's metrics, its gradient norm, whether it stepped)."""
        mask = batch["loss_mask"]
        token_count, seq_count = int(mask.sum()), int(mask.any(dim=1).sum())
        self.optimizer.zero_grad(set_to_none=True)
        sums: list[dict[str, torch.Tensor]] = []
        for idx in self._plans(batch)[self.dp_rank]:
            rows = torch.tensor(idx or [0])  # a rank with no rows left still runs the collectives
            part = trim(batch[rows]).to(self.device)
            Tm = part["tokens"].shape[1]
            ret, old = returns[rows, :Tm].to(self.device), old_values[rows, :Tm].to(self.device)
            with self.autocast():
                v = token_values(self.model, part, packed=self.micro_batch_tokens > 0)
            loss, m = value_loss(v, old, ret, part["loss_mask"], self.value_clip, self.aggregation, token_count=token_count, seq_count=seq_count)
            if not idx:  # padding micro-batch: gradient of zero, metrics of nothing
                loss = loss * 0.0
                m = {k: torch.zeros_like(t) for k, t in m.items()}
            loss.backward()
            sums.append({k: t.detach().cpu() for k, t in m.items()})
        out = reduce_value_metrics([self._reduce_across_ranks(sums)])
        grad_norm = self._clip_grads()
        finite = math.isfinite(out.get("value_loss", 0.0)) and math.isfinite(float(grad_norm))
        if finite and token_count:  # no rows to learn from (all failed, a game's model with none): no update,
            self.optimizer.step()  # which AdamW's momentum and decay would make on a zero gradient
        self.optimizer.zero_grad(set_to_none=True)
        return out, grad_norm, finite

    def _clip_grads(self) -> torch.Tensor:
        from torchtitan.distributed.utils import clip_grad_norm_

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros(())
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        return clip_grad_norm_(params, max_norm, foreach=True).detach().cpu()

    def _reduce_across_ranks(self, sums: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        keys = sorted(sums[0])
        adds = [k for k in keys if k.endswith("_sum")]
        maxes = [k for k in keys if k.endswith("_max")]
        a = torch.stack([sum(m[k] for m in sums).double() for k in adds])
        x = torch.stack([max(m[k] for m in sums).double() for k in maxes])
        if dist.is_initialized() and self.dp_world > 1:
            a, x = a.to(self.device), x.to(self.device)
            dist.all_reduce(a, op=dist.ReduceOp.SUM, group=self._dp_group)
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self._dp_group)
            a, x = a.cpu(), x.cpu()
        return {**dict(zip(adds, a)), **dict(zip(maxes, x))}

    # ---- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Model, AdamW, scheduler and version (one rank, in memory; `save_checkpoint` for DCP)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])

    def save_checkpoint(self, root: str) -> str:
        """An atomic DCP checkpoint under `root` (meshrl/trainer/checkpoint.py), as the policy's."""
        from meshrl.trainer import checkpoint as ckpt

        return ckpt.save_checkpoint(root, self.version, self.model, self.optimizer, self.scheduler)

    def export_hf(self, path: str, dtype: torch.dtype = torch.float32) -> str:
        """The current value model as a HF token-classification checkpoint (`export_value_model_hf`)."""
        return export_value_model_hf(self.model, self.specs, path, dtype, self._source_config)

    def load_checkpoint(self, path: str) -> int:
        """A checkpoint's state, or a per-step snapshot's (meshrl/trainer/snapshot.py); its version."""
        from meshrl.trainer import checkpoint as ckpt
        from meshrl.trainer.snapshot import is_snapshot, load_snapshot

        if is_snapshot(path):
            self.version = load_snapshot(path, self.model, self.optimizer, self.scheduler)
        else:
            self.version = int(ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler)["step"])
        return self.version
