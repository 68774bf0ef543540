"""One trainer rank as plain PyTorch: the model, the policy loss step, the optimizer, exports.

`PolicyTrainer` holds one rank's model (sharded with FSDP2/EP when world > 1), AdamW and
its warm-up schedule, and the policy version. `train_step` splits the batch over
data-parallel ranks by whole groups, accumulates micro-batch gradients normalised by
global counts, clips and steps. It imports torch, TorchTitan and meshrl's pure modules,
never Monarch or vLLM: tests, benchmarks and GPU checks build it directly, and
`meshrl/trainer/actor.py` is the Monarch shell around it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from tensordict import TensorDict

from meshrl.compat import titan_float32_islands_under_cpu_autocast, vllm_runs_lora_on
from meshrl.config import MOE_FAMILIES, Config
from meshrl.episode import FINISH_REASONS, PAD_VERSION, group_slices, trim, weight_lags
from meshrl.trainer import checkpoint as ckpt, lora
from meshrl.trainer.drift import drift_metrics, drift_sums
from meshrl.trainer.logprobs import token_logprobs
from meshrl.trainer.losses import policy_loss, reduce_metrics
from meshrl.config.hf import model_args_from_hf
from meshrl.trainer.model import build_model
from meshrl.trainer.offload import OptimizerOffload
from meshrl.trainer.packing import micro_batch_plans, row_lengths
from meshrl.trainer.parallelize import ac_config, compile_config, compile_unsharded, compute_dtype, parallelism_config, parallelize, reshard
from meshrl.trainer.routing import input_positions
from meshrl.trainer.snapshot import is_snapshot, load_snapshot


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """A model built on the meta device and sharded: real (local) storage on `device`, its
    buffers (RoPE tables) computed and its parameters initialised (a checkpoint's load
    overwrites them; LoRA's adapters keep theirs)."""
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded DTensor parameter; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class PolicyTrainer:
    """One rank of the trainer: model (sharded when world > 1), AdamW, warm-up schedule, version."""

    def __init__(self, config: Config, device: torch.device, rank: int = 0, world_size: int = 1):
        self.config, self.device, self.rank, self.world = config, device, rank, world_size
        mcfg, tcfg = config.model, config.trainer
        overrides: dict = {}
        if mcfg.path is not None:
            mcfg, overrides = model_args_from_hf(mcfg.path)
        self.model_config = mcfg
        self.parallelism = parallelism_config(tcfg, world_size)
        # A checkpoint's model on a trainer mesh is built on the meta device, sharded, then materialised and
        # loaded shard by shard (as TorchTitan's trainer does): no rank ever holds the whole model. A
        # from-scratch model is built whole with the seed, so every rank and world size starts from the same weights.
        on_meta = mcfg.path is not None and dist.is_initialized()
        build_on = torch.device("meta") if on_meta else device
        self.model, self.specs = build_model(mcfg, build_on, seed=config.seed, hf_overrides=overrides, parallelism=self.parallelism, lora=config.lora)
        if mcfg.path is not None and not on_meta:
            ckpt.load_hf(self.model, self.specs, mcfg.path)
        self.ref_model = None
        if tcfg.loss.kl_coef > 0:  # frozen copy of the initial policy for the KL penalty
            self.ref_model, _ = build_model(mcfg, build_on, seed=config.seed, hf_overrides=overrides, parallelism=self.parallelism, lora=config.lora)
            if not on_meta:
                self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.requires_grad_(False)
            self.ref_model.eval()  # a reference, not a policy in training (LoRA's dropout stays off)
        self.compute_dtype = compute_dtype(tcfg, device.type)
        if device.type == "cpu" and self.compute_dtype != torch.float32:
            for model in (self.model, self.ref_model):
                if model is not None:
                    titan_float32_islands_under_cpu_autocast(model)
        self.dims = None
        compile_cfg, ac_cfg = compile_config(tcfg), ac_config(tcfg)
        if dist.is_initialized():
            from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

            self.model, self.dims = parallelize(
                self.model, self.specs.parallelize_fn, self.parallelism, world_size, device.type, self.compute_dtype, compile_cfg, ac_cfg
            )
            if on_meta:
                materialize(self.model, device, config.seed)
                ckpt.load_hf(self.model, self.specs, mcfg.path)
            # losses are normalised by global token/sequence counts: ranks' gradients must
            # add up, not average (TorchTitan's own trainer does the same)
            disable_fsdp_gradient_division(self.model)
            if self.ref_model is not None:
                self.ref_model, _ = parallelize(
                    self.ref_model, self.specs.parallelize_fn, self.parallelism, world_size, device.type, self.compute_dtype, compile_cfg
                )
                if on_meta:  # the same shards as the policy's: copied locally, buffers too (DeepSeek-V3's router bias)
                    materialize(self.ref_model, device, config.seed)
                    with torch.no_grad():
                        for mine, policy in zip(self.ref_model.state_dict().values(), self.model.state_dict().values()):
                            local_shard(mine).copy_(local_shard(policy))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # what building and sharding freed goes back to the driver
        else:
            compile_unsharded(self.model, self.parallelism, compile_cfg, ac_cfg)
            if self.ref_model is not None:  # scored without grad: nothing to checkpoint
                compile_unsharded(self.ref_model, self.parallelism, compile_cfg)
        # Data parallel runs over the `batch` mesh (trainer.procs / (tp x cp)): the procs of one
        # TP or CP group train the same rows, and their metrics count once.
        self.dp_rank, self.dp_world, self._dp_group = rank, world_size, None
        self.cp_mesh = self.dims.get_mesh("cp") if self.dims is not None and self.dims.cp_enabled else None
        if self.dims is not None and (self.dims.tp_enabled or self.dims.cp_enabled):
            if world_size == self.dims.tp * self.dims.cp:  # no data parallel: one rank
                self.dp_rank, self.dp_world = 0, 1
            else:
                batch_mesh = self.dims.get_mesh("batch")
                self.dp_rank, self.dp_world, self._dp_group = batch_mesh.get_local_rank(), batch_mesh.size(), batch_mesh.get_group()
        self.model.train()
        # with LoRA only the adapters train: the optimizer (and its state) holds them alone
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=tcfg.lr, weight_decay=tcfg.weight_decay, foreach=True)
        warmup = tcfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.step = 0
        """Optimizer steps taken = the version of the current weights."""
        self.held = 0  # held steps whose gradients wait for the next update (trainer.pace.accumulate)
        self._held_count = 0  # their loss denominators (tokens, or sequences), summed
        self._offload = OptimizerOffload()
        self._base_exported: str | None = None  # LoRA: where the base weights were exported
        self._lora_layouts: dict = {}  # LoRA: each projection's HF row and column order (lora.hf_layout), found once

    # ---- scoring ------------------------------------------------------------------------
    def _logprobs(
        self,
        model,
        packed: TensorDict,
        with_entropy: bool = False,
        score_mask=None,
        misses: list | None = None,
        replay: bool = True,
        replay_changed: list | None = None,
        keep_replay: contextlib.ExitStack | None = None,
    ):
        tokens = packed["tokens"].to(self.device)
        mask = (packed["loss_mask"] if score_mask is None else score_mask).to(self.device)
        g = self.config.generator
        top_k, top_p = (g.top_k, g.top_p) if self.config.trainer.loss.sampling_mask else (-1, 1.0)
        routed = None  # MoE routing replay: the policy's routers take the sampler's expert choices
        if replay and self.config.trainer.loss.routing_replay and "routed_experts" in packed.keys():
            routed = input_positions(packed["routed_experts"]).to(self.device)
        lengths = row_lengths(packed) if self.config.trainer.micro_batch_tokens > 0 else None
        with self.autocast():
            return token_logprobs(
                model,
                tokens,
                mask,
                g.temperature,
                with_entropy=with_entropy,
                top_k=top_k,
                top_p=top_p,
                misses=misses,
                routed_experts=routed,
                replay_changed=replay_changed,
                lengths=lengths,
                keep_replay=keep_replay,
                cp_mesh=self.cp_mesh,
            )

    def autocast(self):
        """Autocast to `trainer.compute_dtype` where FSDP2's param dtype does not already
        give it (CPU, or an unsharded GPU proc). Log-probs come out float32 either way."""
        on = self.compute_dtype != torch.float32 and (self.device.type == "cpu" or self.dims is None)
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=on)

    def warm_up(self) -> None:
        """Run forward and backward once on a dummy batch, leaving weights, optimizer and step
        as they were: with `trainer.compile` the blocks compile here, in setup, while the
        generators start, rather than in the first step. Every rank calls it (collectives)."""
        # About a real micro-batch's shape (a 16-token prompt plus the full response, capped
        # at 512): inductor guards some kernels on the element count, and a [3, 17] warm-up
        # recompiled at the first step. rows != length, since dynamo ties equal sizes
        # together. No RNG draws.
        c = self.config
        rows = min(c.trainer.micro_batch_size, c.batch_groups * c.generator.group_size)
        length = min(c.generator.max_new_tokens + 16, 512)
        length += length == rows
        tokens = (torch.arange(rows * length, device=self.device) % self.model_config.vocab_size).view(rows, length)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        with self.autocast():
            logprobs, _ = token_logprobs(self.model, tokens, mask, self.config.generator.temperature, cp_mesh=self.cp_mesh)
            if self.ref_model is not None:
                with torch.no_grad():
                    token_logprobs(self.ref_model, tokens, mask, self.config.generator.temperature, cp_mesh=self.cp_mesh)
        logprobs.sum().backward()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def compute_logprobs(self, batch: TensorDict) -> tuple[list[int], torch.Tensor]:
        """This rank's share of `batch`: (row indices, [rows, T] log-probs of every model token)."""
        plan = self._plans(batch)[self.dp_rank]
        T = batch["tokens"].shape[1]
        outs = []
        for idx in plan:
            part = batch[torch.tensor(idx or [0])]  # a rank with no rows left still runs the collectives
            lp, _ = self._logprobs(self.model, part, score_mask=part["versions"] != PAD_VERSION)
            if idx:
                outs.append(lp.cpu())
        return [i for idx in plan for i in idx], torch.cat(outs) if outs else torch.zeros(0, T)

    def _plans(self, batch: TensorDict) -> list[list[list[int]]]:
        t = self.config.trainer
        return micro_batch_plans(batch, self.dp_world, t.micro_batch_size, t.micro_batch_tokens)

    # ---- training -----------------------------------------------------------------------
    def train_step(self, batch: TensorDict, current_version: int | None = None) -> dict[str, float]:
        """One optimizer step on `batch` (the full batch; every rank gets the same one); on a
        step off `trainer.pace` the same loss and metrics without gradients, the weights kept,
        or with `pace.accumulate` its gradients kept for the next update, which then steps as
        on the rows of all those steps together (the loss's mean over all their tokens, or
        sequences, by `loss.aggregation`).

        Returns metrics and `version`, the policy version the step produced (= steps taken).
        """
        t0 = time.perf_counter()
        tcfg, lcfg = self.config.trainer, self.config.trainer.loss
        version = self.step if current_version is None else current_version
        update = tcfg.pace.updates(self.step + 1)
        grads = update or tcfg.pace.accumulate
        # global denominators, so that micro-batch losses on all ranks sum to the batch loss
        token_count = int(batch["loss_mask"].sum())
        seq_count = int(batch["loss_mask"].any(dim=1).sum())
        self._offload.restore()  # AdamW's state, if it waited in host memory while colocated engines generated
        count = token_count if lcfg.aggregation == "token_mean" else seq_count  # the loss's denominator
        # Nothing to learn from (every row failed, or a game's model had none of its own) and no
        # held gradients: no update, which AdamW's momentum and decay would make on a zero gradient.
        update = update and bool(count or self.held)
        if not self.held:
            self.optimizer.zero_grad(set_to_none=True)
        elif count:  # the held steps' gradient x held count / count: this step's then adds as over their rows together
            self._scale_grads(self._held_count / count)
        metrics: list[dict[str, torch.Tensor]] = []
        lag_sum, lag_max = torch.zeros(()), torch.zeros(())
        gaps: list[torch.Tensor] = []  # log pi - log mu of this rank's loss tokens, for quantiles
        plans = self._plans(batch)
        for idx in plans[self.dp_rank]:
            packed = trim(batch[torch.tensor(idx or [0])]).to(self.device)
            lag = weight_lags(packed["versions"], version, tcfg.pace)  # weight updates since each token was sampled
            want_entropy = True  # the bonus when entropy_coef > 0; the trainer/entropy metric always
            misses: list = []
            replay_changed: list = []
            # MoE routing replay stays on through backward: checkpointed blocks recompute their routers there
            with contextlib.ExitStack() as replaying:
                replaying.enter_context(torch.set_grad_enabled(grads))
                logprobs, entropy = self._logprobs(
                    self.model, packed, with_entropy=want_entropy, misses=misses, replay_changed=replay_changed, keep_replay=replaying
                )
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref, _ = self._logprobs(self.ref_model, packed, replay=False)  # another model: its own routing
                # per-token advantages (distillation, process rewards, GAE) replace the [B] ones
                per_token = "token_advantage" in packed.keys()
                # One optimizer step per batch: the weights before the update are the weights of
                # this forward, so pi_prox is its detached value (no second forward needed).
                loss, m = policy_loss(
                    logprobs,
                    packed["sampler_logprobs"],
                    packed["token_advantage" if per_token else "advantage"],
                    packed["loss_mask"],
                    lcfg,
                    prox_logprobs=logprobs.detach(),
                    ref_logprobs=ref,
                    entropy=entropy,
                    lags=lag,
                    token_count=token_count,
                    seq_count=seq_count,
                )
                if self.config.trainer.loss.sampling_mask and (self.config.generator.top_k > 0 or self.config.generator.top_p < 1):
                    m["sampling_mask_miss_sum"] = misses[0]  # sampled tokens outside the trainer's kept set
                if "teacher_logprobs" in packed.keys():  # reduce_metrics: distill_reverse_kl, the token mean of log mu - log pi_teacher
                    gap = packed["sampler_logprobs"] - packed["teacher_logprobs"]
                    m["distill_reverse_kl_sum"] = torch.where(packed["loss_mask"], gap, 0.0).sum().detach()
                m.update(drift_sums(logprobs.detach(), packed, lag))
                if idx:
                    gaps.append(torch.where(packed["loss_mask"], logprobs.detach() - packed["sampler_logprobs"].float(), 0.0)[packed["loss_mask"]].cpu())
                if not idx:  # padding micro-batch: gradient of zero, metrics of nothing
                    loss = loss * 0.0
                    m = {k: torch.zeros_like(v) for k, v in m.items()}
                if grads:
                    loss.backward()
            if replay_changed:  # trained tokens whose forward replay moved off the live routers' choice
                at_token = torch.zeros_like(packed["loss_mask"])
                at_token[:, 1:] = replay_changed[0][:, :-1]
                m["routing_replay_changed_sum"] = (at_token & packed["loss_mask"]).sum().float() * float(bool(idx))
                covered = (packed["routed_experts"][..., 0, 0] >= 0) & packed["loss_mask"]  # a row of -1: the sampler's routes lost
                m["routing_replay_covered_sum"] = covered.sum().float() * float(bool(idx))
            metrics.append({k: v.detach().cpu() for k, v in m.items()})
            if idx:
                mask, lag = packed["loss_mask"].cpu(), lag.cpu()
                lag_sum += (lag * mask).sum()
                lag_max = torch.maximum(lag_max, torch.where(mask, lag, 0).max() if mask.any() else lag_max)
        trained_steps = self.held + 1 if update else 0  # the steps whose rows this update trains on
        if self.held and count:  # back to a mean over every row of those steps
            self._scale_grads(count / (self._held_count + count))
        self.held, self._held_count = (0, 0) if update or not grads else (self.held + bool(count), self._held_count + count)
        grad_norm = self._clip_grads(tcfg.grad_clip) if update else 0.0
        # a bad batch (a NaN sampler log-prob, a loss past float32) writes no NaN into AdamW and the
        # weights: the update is skipped, as the critic's and the PRM's are (the norm is every rank's)
        nonfinite = update and not math.isfinite(float(grad_norm))
        if update:
            if nonfinite:
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.optimizer.step()
            self.scheduler.step()
        elif not grads:
            reshard(self.model)  # what FSDP keeps gathered after a forward, which only a backward reshards
        self.step += 1
        merged = self._reduce_across_ranks(metrics, lag_sum, lag_max)
        out = reduce_metrics([merged])
        out.pop("lag_max", None)
        tokens = max(out.get("tokens", 0.0), 1.0)
        out.update(
            version=self.step,
            grad_norm=float(grad_norm),
            updated=float(update and not nonfinite),
            nonfinite=float(nonfinite),
            weight_version=float(weight_lags(torch.tensor(0), self.step, tcfg.pace)),  # its own version: the updates it has made
            **({"update_steps": float(trained_steps)} if tcfg.pace.accumulate else {}),
            logprob_mismatch=out.get("mismatch", 0.0),
            staleness_mean=float(merged["lag_sum"]) / tokens,
            staleness_max=float(merged["lag_max"]),
            # the reward of the very episodes this step trained on (reward/mean covers those
            # finished since the last step, newer in async mode); failed ones did not train
            reward_mean=_trained_reward(batch),
            lr=self.scheduler.get_last_lr()[0],
            step_time_s=time.perf_counter() - t0,
            tokens_per_s=token_count / (time.perf_counter() - t0),
        )
        out.update(drift_metrics(merged, torch.cat(gaps) if gaps else torch.zeros(0)))
        out["zero_variance_groups"] = zero_variance_share(batch)
        out.update(self._layout_metrics(batch, plans))
        return out

    def _layout_metrics(self, batch: TensorDict, plans: list[list[list[int]]]) -> dict[str, float]:
        """row_tokens_max: the longest row trained; useful_token_frac: real tokens over the
        tokens the model ran on every rank (1 when packed; padding lowers it); micro_batches:
        per rank."""
        t = self.config.trainer
        lengths = row_lengths(batch)
        ran = sum(int(lengths[mb].sum()) if t.micro_batch_tokens > 0 else len(mb) * int(lengths[mb].max()) for plan in plans for mb in plan if mb)
        return {"row_tokens_max": float(lengths.max()), "useful_token_frac": float(lengths.sum()) / max(ran, 1), "micro_batches": float(len(plans[0]))}

    def _scale_grads(self, factor: float) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def _clip_grads(self, max_norm: float) -> torch.Tensor:
        from torchtitan.distributed.utils import clip_grad_norm_

        params = [p for p in self.model.parameters() if p.grad is not None]
        ep = self.dims is not None and self.dims.ep_enabled
        return clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True, ep_enabled=ep).detach().cpu()

    def _reduce_across_ranks(self, metrics: list[dict[str, torch.Tensor]], lag_sum, lag_max) -> dict[str, torch.Tensor]:
        keys = sorted(metrics[0])
        sums = torch.stack([sum(m[k] for m in metrics).float() for k in keys if k.endswith("_sum")] + [lag_sum.float()])
        maxes = torch.stack([max(m[k] for m in metrics).float() for k in keys if k.endswith("_max")] + [lag_max.float()])
        if dist.is_initialized() and self.dp_world > 1:
            sums, maxes = sums.to(self.device), maxes.to(self.device)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self._dp_group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self._dp_group)
            sums, maxes = sums.cpu(), maxes.cpu()
        out = dict(zip([k for k in keys if k.endswith("_sum")] + ["lag_sum"], sums))
        out.update(zip([k for k in keys if k.endswith("_max")] + ["lag_max"], maxes))
        return out

    # ---- weights out and in -------------------------------------------------------------
    def hf_state_dict(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights, one tensor at a time (collective: iterate on every rank)."""
        return ckpt.hf_state_dict(self.model, self.specs, dtype)

    def sync_state_dict(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """What weight sync publishes each version: the full HF-named weights, or with LoRA
        the PEFT-named adapter alone where the generators run it (compat.vllm_runs_lora_on;
        elsewhere the merged weights). Collective: iterate on every rank."""
        if self.config.lora.rank > 0 and vllm_runs_lora_on(moe=self.model_config.family in MOE_FAMILIES):
            return self.adapter_state_dict(dtype)
        return self.hf_state_dict(dtype)

    def adapter_state_dict(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter, PEFT-named (collective)."""
        return lora.adapter_state_dict(self.model, self.specs.adapter_cls(self.specs.titan_config, None), dtype, self._lora_layouts)

    def export_hf(self, path: str, dtype: torch.dtype | None = None, base_dir: str | None = None) -> str:
        """A HF checkpoint of the current policy at `path` (LoRA: merged), and with LoRA its
        PEFT adapter in `path/adapter`, over the base model: `model.path`, or the from-scratch
        base weights exported once to `base_dir`. Collective."""
        dtype = dtype or getattr(torch, self.config.model.dtype)
        source = os.path.join(self.config.model.path, "config.json") if self.config.model.path else None
        out = ckpt.export_hf(self.model, self.specs, path, dtype, source_config=source)
        if self.config.lora.rank > 0:
            base = self.config.model.path and os.path.abspath(self.config.model.path)  # what loads it from any directory
            if base is None:
                if base_dir is None:
                    raise ValueError("a from-scratch LoRA model needs base_dir to export its base weights to")
                base = os.path.abspath(base_dir)
                if base != self._base_exported:  # the base never changes: once per place (every rank alike)
                    ckpt.export_hf(self.model, self.specs, base, dtype, merge_lora=False)
                    self._base_exported = base
            tensors = dict(self.adapter_state_dict(dtype))
            if self.rank == 0:
                lora.write_adapter(os.path.join(out, "adapter"), tensors, self.config.lora, base)
        return out

    def release_memory(self, offload_optimizer: bool = False) -> dict[str, float]:
        """Before colocated engines wake on this GPU: free the gradients, optionally move AdamW's
        state to host memory (back at the next step), and hand the allocator's cache back to
        the driver, so the engine's KV cache finds the memory the memory plan counted on. Held
        steps' gradients (`trainer.pace.accumulate`) stay: the plan counts them as kept."""
        if not self.held:
            self.optimizer.zero_grad(set_to_none=True)
        moved = self._offload.offload(self.optimizer) if offload_optimizer else 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {
            "colocate/offloaded_gb": moved / 1e9,
            "colocate/trainer_reserved_gb": torch.cuda.memory_reserved(self.device) / 1e9 if self.device.type == "cuda" else 0.0,
        }

    def save_checkpoint(self, root: str) -> str:  # an offloaded AdamW state is saved from host memory
        return ckpt.save_checkpoint(root, self.step, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: str) -> int:
        """A checkpoint, or a per-step snapshot (trainer/snapshot.py, what a healed trainer restores)."""
        self._offload.restore()
        self.held = self._held_count = 0  # held gradients are in no snapshot or checkpoint (a snapshot is taken where none are)
        self.optimizer.zero_grad(set_to_none=True)
        if is_snapshot(path):
            self.step = load_snapshot(path, self.model, self.optimizer, self.scheduler)
        else:
            self.step = int(ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler)["step"])
        return self.step

    def shard_info(self) -> dict[str, Any]:
        """Local vs full parameter counts (and routed experts held here, for MoE)."""
        local = sum(local_shard(p).numel() for p in self.model.parameters())
        full = sum(p.numel() for p in self.model.parameters())
        info = {"rank": self.rank, "world": self.world, "local_params": local, "full_params": full, "pid": os.getpid()}
        if self.model_config.family in MOE_FAMILIES:
            for name, p in self.model.named_parameters():
                if "experts" in name and name.endswith("w1_EFD"):
                    info["local_experts"] = int(local_shard(p).shape[0])
                    info["num_experts"] = int(p.shape[0])
                    info["expert_placements"] = str(getattr(p, "placements", None))
                    break
        return info


def zero_variance_share(batch: TensorDict) -> float:
    """Share of the batch's groups that carry no policy gradient: with per-token advantages (GAE's
    return less the critic's value, a teacher's, a PRM's) those whose trained tokens' are all 0;
    else those whose trained episodes all have the same reward (`episode.without_signal`)."""
    from meshrl.episode import without_signal

    slices = group_slices(batch)
    if "token_advantage" in batch.keys():
        flat = lambda g: bool((g["token_advantage"][g["loss_mask"]] == 0).all())  # noqa: E731
        return sum(flat(batch[s]) for s in slices) / max(len(slices), 1)
    return sum(without_signal(batch[s]) for s in slices) / max(len(slices), 1)


def _trained_reward(batch: TensorDict) -> float:
    """Mean reward over the batch's episodes that trained (not failed); 0 if none did."""
    ok = batch["finish_reason"] != FINISH_REASONS["failed"]
    return float(batch["reward"][ok].mean()) if ok.any() else 0.0
