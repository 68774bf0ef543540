"""Policy checkpoints: HF safetensors export/import, the HF-named weight stream, and DCP.

- `hf_state_dict(model, specs)`: (HF name, full tensor) pairs, one parameter at a time,
  for weight sync and export. Collective under FSDP: every rank must iterate it in step.
- `export_hf` / `load_hf`: a Hugging Face checkpoint directory (config.json + safetensors)
  that transformers' AutoModelForCausalLM and vLLM load.
- `save_checkpoint` / `load_checkpoint`: torch.distributed.checkpoint of model + optimizer
  + lr scheduler + step, each rank writing its own shards and its random generators. Atomic: written into a temp
  dir, fsynced, completed with a marker, renamed to `step-XXXXXXXX`, then the `latest`
  pointer file is replaced atomically. A crash at any point leaves either the previous
  checkpoint as `latest` or the new one complete; never a half-written one that loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshrl.trainer.lora import lora_modules, merged_weight
from meshrl.trainer.model import ModelSpecs
from meshrl.trainer.parallelize import full_tensor

LATEST = "latest"
COMPLETE_MARKER = "meshrl_complete.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- HF names ------------------------------------------------------------------------------
def hf_state_dict(model: nn.Module, specs: ModelSpecs, dtype: torch.dtype | None = None, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full unsharded tensor) for every weight of `model`, one parameter at a time.

    DTensors are gathered with `.full_tensor()` per entry (peak extra memory: one full
    parameter). Collective under FSDP/EP: call it on every rank and exhaust it everywhere.
    A LoRA model yields its merged weights (W + alpha/r B A) under the base names, or with
    `merge_lora=False` its base weights.
    """
    adapter = specs.adapter_cls(specs.titan_config, None)
    adapted = {f"{fqn}.weight": m for fqn, m in lora_modules(model).items()} if merge_lora else {}
    # buffers keep their dtype: DeepSeek-V3's float32 router bias, which vLLM keeps in float32 too
    buffers = {state_name(name) for name, _ in model.named_buffers()}
    for name, tensor in model.state_dict().items():
        if ".lora_a." in name or ".lora_b." in name:
            continue  # folded into the base weight below
        full = full_tensor(tensor.detach())
        if name in adapted:
            full = merged_weight(adapted[name], full)
        for hf_name, hf_tensor in adapter.to_hf({name: full}).items():
            yield hf_name, (hf_tensor if dtype is None or name in buffers else hf_tensor.to(dtype)).contiguous()


def export_hf(
    model: nn.Module,
    specs: ModelSpecs,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    source_config: str | os.PathLike | None = None,
    merge_lora: bool = True,
) -> str:
    """Write `out_dir` (config.json + model.safetensors) from the current weights; returns the path.

    Collective under FSDP: call on every rank; rank 0 writes. The directory appears
    complete or not at all (written beside it, then renamed). `source_config`: a HF
    config.json to start from (a checkpoint the model was loaded from keeps its settings).
    """
    # gathering is collective (every rank walks it); only rank 0, the writer, keeps a host copy
    rank0 = _rank() == 0
    tensors = {name: t.cpu() if rank0 else None for name, t in hf_state_dict(model, specs, dtype, merge_lora)}
    out_dir = os.path.abspath(out_dir)
    if rank0:
        write_hf_dir(tensors, hf_config(specs, dtype, source_config), out_dir)
    _barrier()
    return out_dir


def hf_config(specs: ModelSpecs, dtype: torch.dtype, source_config: str | os.PathLike | None = None) -> dict:
    """The config.json of an export: the one the model was loaded from, else its family's."""
    config = dict(specs.hf_config)
    if source_config is not None:
        with open(source_config) as f:
            config = json.load(f)
    if not config:
        raise NotImplementedError(f"no HF config for family {specs.family!r}")
    # both keys: transformers 5 writes and reads `dtype` first, older readers `torch_dtype`; a
    # source config saved by transformers 5 would otherwise name its own dtype, not the export's
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


def write_hf_dir(tensors: dict[str, torch.Tensor], config: dict, out_dir: str) -> None:
    """`out_dir` (model.safetensors + config.json), complete or not at all: written beside it, then renamed."""
    from safetensors.torch import save_file

    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    fsync_tree(tmp)
    replace_dir(tmp, out_dir)


def replace_dir(src: str, dst: str) -> None:
    """`src` renamed to `dst`, whose former content is set aside by a rename and removed once
    `src` is in place: a kill in the removal (slow: gigabytes) leaves `dst` whole."""
    old = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.old")
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(dst):
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_dir(os.path.dirname(dst))
    shutil.rmtree(old, ignore_errors=True)


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def read_hf_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files in a HF checkpoint directory, by HF name.

    The files are memory-mapped and the tensors are views of the mapping, read-only: the
    bytes are read from disk as they are used and live once in the page cache, shared by
    every rank of the host, where reading them (safetensors' load_file) gave each rank a
    private copy of the whole checkpoint."""
    import mmap
    import struct
    import warnings

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with open(os.path.join(path, name), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        base = 8 + size
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], info["shape"]
            start, end = info["data_offsets"]
            if end == start:
                tensors[key] = torch.empty(shape, dtype=dtype)
                continue
            with warnings.catch_warnings():  # "non-writable buffer": the views are only read
                warnings.simplefilter("ignore", UserWarning)
                tensors[key] = torch.frombuffer(mapped, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start).view(shape)
    return tensors


def state_name(name: str) -> str:
    """A parameter's or buffer's name as the model's state dict has it: `named_parameters` keeps
    the wrapper modules of activation checkpointing and torch.compile in it, the state dict not."""
    return re.sub(r"(_checkpoint_wrapped_module|_orig_mod)\.", "", name)


def load_hf(model: nn.Module, specs: ModelSpecs, path: str | os.PathLike) -> None:
    """Load a HF checkpoint directory into `model` (plain or sharded), through the TorchTitan adapter."""
    adapter = specs.adapter_cls(specs.titan_config, str(path))
    titan = adapter.from_hf(read_hf_tensors(path))
    own = model.state_dict()
    # buffers (RoPE caches, MoE load-balancing biases) are not HF weights; LoRA adapters
    # keep their initialisation (B = 0: the loaded model is the checkpoint's)
    missing = [name for name in (state_name(n) for n, _ in model.named_parameters()) if name not in titan and ".lora_" not in name]
    if missing:
        raise KeyError(f"{path} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, target in own.items():
            if name in titan:
                copy_whole_into(target, titan[name])


def copy_whole_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """`full` (the whole tensor, the same on every rank) into `target`: a plain tensor, or
    this rank's shard of a DTensor, cut locally with no communication."""
    full = full.to(dtype=target.dtype)
    if isinstance(target, DTensor):
        full = distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(full.to_local())
    else:
        target.copy_(full.to(target.device))


# ---- DCP training checkpoints --------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def write_atomic(path: str, text: str) -> None:
    """Write a small text file so that readers see the old or the new content, never a part."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def rng_state() -> dict[str, Any]:
    """This rank's random number generators: the CPU's, and each CUDA device's once CUDA is
    up (a LoRA adapter's dropout draws from them)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_rng(directory: str, state: dict[str, Any] | None = None) -> None:
    """This rank's generators (`state`, default now) into `directory` (rng-RANK.pt)."""
    torch.save(state if state is not None else rng_state(), os.path.join(directory, f"rng-{_rank()}.pt"))


def load_rng(directory: str) -> bool:
    """Put back this rank's generators saved in `directory`; False where none were saved (a
    state written before they were kept: the generators stay as seeded)."""
    path = os.path.join(directory, f"rng-{_rank()}.pt")
    if not os.path.isfile(path):
        return False
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    return True


def _stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer has taken a step (AdamW keeps no state before its first).
    Every rank steps together, so every rank answers the same."""
    return any(bool(s) for s in optimizer.state.values())


def _train_state(model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool = True) -> dict[str, Any]:
    """The DCP state: the model's, and the optimizer's where it has one. torch's
    `get_optimizer_state_dict` makes an optimizer that has not stepped yet a state by a
    step of lr 0, on the live optimizer: AdamW's next real step would then be its second,
    its bias correction making it 0.74 of a first step. So a state saved before the first
    step (a checkpoint at version 0) holds the model alone, and restoring it leaves the
    optimizer without state, as a fresh one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if with_optimizer:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_checkpoint(
    root: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, extra: dict | None = None
) -> str:
    """Save a DCP checkpoint of step `step` under `root` and point `root/latest` at it.

    Collective: call on every rank. Returns the checkpoint directory.
    """
    import torch.distributed.checkpoint as dcp

    root = os.path.abspath(root)
    name = f"step-{step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".{name}.tmp")
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save of the same step
        os.makedirs(tmp)
    _barrier()
    stepped = _stepped(optimizer)
    dcp.save(_train_state(model, optimizer, stepped), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    save_rng(tmp)
    _barrier()
    if _rank() == 0:
        meta = {"step": step, "scheduler": scheduler.state_dict() if scheduler is not None else None, "extra": extra or {}, "optimizer_state": stepped}
        write_atomic(os.path.join(tmp, COMPLETE_MARKER), json.dumps(meta))
        fsync_tree(tmp)
        # The same step saved again (a run's last step, then its final checkpoint): the one a
        # loop state names is set aside by a rename, not deleted, until the new one is in place.
        replace_dir(tmp, final)
        write_atomic(os.path.join(root, LATEST), name)
    _barrier()
    return final


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """A checkpoint directory from either itself or a root holding a `latest` pointer."""
    path = os.path.abspath(path)
    pointer = os.path.join(path, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(path, f.read().strip())
    aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")  # a save of the same step cut short between its renames
    if not os.path.isdir(path) and os.path.isfile(os.path.join(aside, COMPLETE_MARKER)):
        path = aside
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise FileNotFoundError(f"{path} is not a complete meshrl checkpoint (no {COMPLETE_MARKER})")
    return path


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step a complete checkpoint directory holds."""
    with open(os.path.join(resolve_checkpoint(path), COMPLETE_MARKER)) as f:
        return int(json.load(f)["step"])


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> dict:
    """Restore model, optimizer (and scheduler) in place from a checkpoint dir or root; returns its metadata.

    Collective: call on every rank, with the model sharded as when it was saved.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = resolve_checkpoint(path)
    with open(os.path.join(path, COMPLETE_MARKER)) as f:
        meta = json.load(f)
    stepped = meta.get("optimizer_state", True)  # checkpoints written before the flag hold one
    if not stepped:
        optimizer.state.clear()  # saved before the first step: as a fresh optimizer
    state = _train_state(model, optimizer, stepped)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_model_state_dict(model, state["model"])
    with configured_lr(optimizer, scheduler):
        if stepped:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(meta["scheduler"])
    load_rng(path)
    return meta


@contextmanager
def configured_lr(optimizer: torch.optim.Optimizer, scheduler: Any):
    """A restore of the optimizer's and the schedule's state inside it keeps the learning rate
    they were built with (the run's configured one: a resume's `lr` overrides the saved one), at
    the restored schedule position. The same rate: the saved lr stays, bit for bit. Each group's
    weight decay is the configured one too (a loaded optimizer state carries the saved one)."""
    configured = _base_lrs(optimizer, scheduler)
    decays = [group.get("weight_decay") for group in optimizer.param_groups]
    yield
    if _base_lrs(optimizer, scheduler) != configured:
        set_lr(optimizer, scheduler, configured)
    for group, decay in zip(optimizer.param_groups, decays, strict=True):
        if decay is not None:
            group["weight_decay"] = decay


def _base_lrs(optimizer: torch.optim.Optimizer, scheduler: Any) -> list[float]:
    return list(scheduler.base_lrs) if scheduler is not None else [group["lr"] for group in optimizer.param_groups]


def set_lr(optimizer: torch.optim.Optimizer, scheduler: Any, lr: float | list[float]) -> None:
    """Make `lr` (one rate, or one per param group) the base learning rate, the schedule's
    position kept: each group's lr is its base times the scheduler's factor now (a LambdaLR's,
    as every meshrl trainer's; 1 without a scheduler), and the scheduler's later steps start
    from it. What a restore over a rate the run now configures does (`configured_lr`), and the rule of a live change (the trainer actor's `set_lr`)."""
    groups = optimizer.param_groups
    bases = [float(b) for b in lr] if isinstance(lr, (list, tuple)) else [float(lr)] * len(groups)
    for i, (group, base) in enumerate(zip(groups, bases, strict=True)):
        group["lr"] = base * scheduler.lr_lambdas[i](scheduler.last_epoch) if scheduler is not None else base
        if "initial_lr" in group:  # what a scheduler built over this optimizer later would start from
            group["initial_lr"] = base
    if scheduler is not None:
        scheduler.base_lrs = bases
        scheduler._last_lr = [group["lr"] for group in groups]  # get_last_lr() before the next step
