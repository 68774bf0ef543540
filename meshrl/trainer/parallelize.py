"""Shard a TorchTitan model over the trainer's ranks with TorchTitan's own parallelize functions.

FSDP2 over the data-parallel dim and, for MoE families, expert parallelism (experts split
across `trainer.ep` ranks, tokens moved with all-to-all). gloo on CPU, NCCL on GPU: the
process group is created by the caller; the DeviceMesh is built on it here.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from meshrl.compat import titan_force_sum_reduction, titan_use_cpu_device_type
from meshrl.config import TrainerConfig


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a sharded DTensor (a collective: every rank calls it in step);
    a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def parallelism_config(tcfg: TrainerConfig, world_size: int):
    """TorchTitan's ParallelismConfig for the trainer mesh: FSDP over the data-parallel ranks
    (all of them, or dp_shard) x CP x TP x EP."""
    from torchtitan.config import ParallelismConfig

    tp, cp = (tcfg.tp, tcfg.cp) if world_size > 1 else (1, 1)
    dp = world_size // (tp * cp)
    dp_shard = dp if tcfg.dp_shard == -1 else tcfg.dp_shard
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=dp // dp_shard,
        data_parallel_shard_degree=dp_shard,
        tensor_parallel_degree=tp,
        context_parallel_degree=cp,
        expert_parallel_degree=tcfg.ep,
        # the classic FSDP2 + DTensor EP path: the default `spmd_types` backend type-checks a
        # multi-dimensional SPMD mesh that the gloo/CPU path does not build
        spmd_backend="partial_dtensor",
    )
    return parallelism


def compute_dtype(tcfg: TrainerConfig, device_type: str) -> torch.dtype:
    """The dtype forward/backward compute in (`trainer.compute_dtype` resolved for the device)."""
    if tcfg.compute_dtype == "auto":
        return torch.float32 if device_type == "cpu" else torch.bfloat16
    return getattr(torch, tcfg.compute_dtype)


def ac_config(tcfg: TrainerConfig):
    """TorchTitan's activation-checkpointing config for `trainer.activation_checkpoint` (None: off)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

    mode = tcfg.activation_checkpoint
    if mode == "none":
        return None
    if mode == "memory_budget":
        return MemoryBudgetAC.Config(memory_budget=tcfg.ac_memory_budget)
    return {"full": FullAC, "selective": SelectiveAC}[mode].Config()


def compile_config(tcfg: TrainerConfig):
    """TorchTitan's CompileConfig for `trainer.compile` (the model's blocks; meshrl has its own loss)."""
    from torchtitan.config import CompileConfig

    return CompileConfig(enable=tcfg.compile, components=["model"])


def _before_compiling() -> None:
    # TorchTitan compiles blocks for pretraining's fixed sequence length. RL batches change
    # length and micro-batch rows every step, and each new static shape recompiled until
    # dynamo marked that dim dynamic. So this proc's compiles treat shapes as dynamic from
    # the start; parameters stay static.
    torch._dynamo.config.assume_static_by_default = False
    # Inductor caches the code it generates, and imports it, from /tmp/torchinductor_$USER: a
    # path any local user can make first and fill. This user's own directory instead.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path = os.path.join(os.path.expanduser("~"), ".cache", "meshrl", "torchinductor")
        os.makedirs(path, mode=0o700, exist_ok=True)


def compile_unsharded(model: nn.Module, parallelism, compile_cfg, ac_cfg=None) -> None:
    """TorchTitan's activation checkpointing, then its per-block compile (TorchTitan's order),
    for a model that `parallelize` does not see (no torch.distributed: a single process
    outside a trainer mesh)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile

    if ac_cfg is not None:
        ac_cfg.build(dump_folder="/tmp").apply(model)
    if compile_cfg.enable:
        _before_compiling()
        apply_compile(model, compile_config=compile_cfg, parallel_dims=ParallelDims.from_config(parallelism, 1))


def parallelize(
    model: nn.Module, parallelize_fn, parallelism, world_size: int, device_type: str, dtype: torch.dtype = torch.float32, compile_cfg=None, ac_cfg=None
):
    """Apply the family's TorchTitan parallelize function; returns (model, ParallelDims).

    Needs torch.distributed initialised. Parameters become DTensors sharded over the
    `fsdp` mesh dim (experts over `ep` x `efsdp` for MoE). `compile_cfg`: a CompileConfig
    (`compile_config`), applied by TorchTitan per block before FSDP wraps them.
    """
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend(parallelism.spmd_backend)  # runtime helpers (MoE dispatch) read it, as in TorchTitan's trainer
    if device_type == "cpu":
        titan_use_cpu_device_type()
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    # GPU: FSDP2 mixed precision (params cast to `dtype`, float32 reduction), as TorchTitan
    # trains. CPU: params stay float32 and the trainer autocasts instead, so that a single
    # unsharded proc gets the same bf16 compute (see PolicyTrainer.autocast).
    param_dtype = "float32" if device_type == "cpu" else str(dtype).removeprefix("torch.")
    training = TrainingConfig(mixed_precision_param=param_dtype)
    if compile_cfg is not None and compile_cfg.enable:
        _before_compiling()
    model = parallelize_fn(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_cfg or CompileConfig(enable=False),
        ac_config=ac_cfg,
        dump_folder="/tmp",
    )
    if device_type == "cpu":
        titan_force_sum_reduction(model)
    return model, dims


def shard_over_ranks(model: nn.Module, parallelize_fn, device_type: str, dtype: torch.dtype) -> nn.Module:
    """FSDP2 over every rank of the default process group (TorchTitan's parallelize function for
    the family; no TP, CP or EP), for a model trained beside the policy (PPO's critic, a PRM):
    each rank keeps 1/world of the weights, gradients and AdamW state and trains on its share of
    the rows. FSDP's gradient division is off: the callers normalise their losses by the whole
    batch's counts, so the ranks' gradients add up instead of averaging."""
    import torch.distributed as dist
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division

    world = dist.get_world_size()
    model, _ = parallelize(model, parallelize_fn, parallelism_config(TrainerConfig(procs=world), world), world, device_type, dtype)
    disable_fsdp_gradient_division(model)
    return model


def reshard(model: nn.Module) -> None:
    """Every FSDP2 module of `model` back to its shards. FSDP reshards in backward what it
    keeps gathered after a forward (TorchTitan's root: the final norm and the output head); a
    forward with no backward (a step off trainer.pace) leaves it gathered until the next
    step's backward, through generation on a shared GPU. No-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
