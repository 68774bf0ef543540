"""LoRA on the TorchTitan policy: adapters, their PEFT names, merging and the PEFT export.

TorchTitan's own `LoRAConverter` rewrites the model config before it is built: each target
projection becomes a LoRA linear (the frozen base weight plus `lora_a` [r, in] and `lora_b`
[out, r], `lora_b` starting at zero, output `base(x) + alpha/r * lora_b(lora_a(x))`), and
every other parameter is built frozen. So FSDP2 shards adapters with their block, and under
EP the routed experts (grouped weights, not linears) stay frozen and sharded as before.

Outside the trainer an adapter is named as PEFT names it (`base_model.model.<HF module>
.lora_A.weight`, `lora_B`), the names vLLM's LoRA loader and `peft` read. The HF module of
each adapted projection comes from the family's TorchTitan state-dict adapter, the same map
the full weights use.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from meshrl.config import LoRAConfig
from meshrl.trainer.parallelize import full_tensor

TITAN_NAMES = {"q_proj": "wq", "k_proj": "wkv", "v_proj": "wkv", "o_proj": "wo", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
"""HF projection name -> the name of the TorchTitan config it is built from. TorchTitan
builds the key and value projections from one config (`wkv`), so they are adapted together."""
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def convert_config(titan_config, lora: LoRAConfig):
    """The model config with LoRA linears at `lora.targets` and everything else frozen."""
    from torchtitan.components.lora import LoRAConverter

    targets = sorted({TITAN_NAMES[t] for t in lora.targets})
    converter = LoRAConverter(LoRAConverter.Config(rank=lora.rank, alpha=lora.alpha, target_modules=targets))
    return converter.convert(titan_config)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """TorchTitan FQN -> LoRA linear, in module order. The FQN is the state dict's: without
    the wrapper level that activation checkpointing adds to the module tree."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return {name.replace(_CHECKPOINT_PREFIX, ""): m for name, m in model.named_modules() if hasattr(m, "lora_a") and hasattr(m, "lora_b")}


def add_dropout(model: nn.Module, p: float) -> None:
    """Dropout on each adapter's input in training mode (TorchTitan's LoRA linear has none)."""
    if p <= 0:
        return
    for module in lora_modules(model).values():
        module.lora_a.register_forward_pre_hook(lambda m, args: (F.dropout(args[0], p, m.training),) + args[1:])


def hf_module_names(model: nn.Module, adapter) -> dict[str, str]:
    """TorchTitan FQN of each LoRA linear -> its HF module name (through the family's
    state-dict adapter, on a meta tensor of the base weight's shape)."""
    names = {}
    for fqn, module in lora_modules(model).items():
        hf = list(adapter.to_hf({f"{fqn}.weight": torch.empty(module.weight.shape, device="meta")}))
        if len(hf) != 1 or not hf[0].endswith(".weight"):
            raise ValueError(f"{fqn}: the state-dict adapter maps it to {hf}, not one HF weight")
        names[fqn] = hf[0].removesuffix(".weight")
    return names


def merged_weight(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (the module's full base weight) with its adapter folded in: W + alpha/r B A.
    Collective under FSDP (the adapters are gathered)."""
    a, b = full_tensor(module.lora_a.weight.detach()), full_tensor(module.lora_b.weight.detach())
    return weight + module._lora_scaling * (b.float() @ a.float()).to(weight.dtype)


def hf_layout(adapter, fqn: str, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The row and column orders the state-dict adapter gives weight `fqn` on its way to HF:
    HF[i, j] = W[rows[i], cols[j]]. Llama's adapter reorders q and k rows per head (rotary
    halves against TorchTitan's interleaved pairs), so a LoRA B exported without the same row
    order would rotate wrongly in `peft` and vLLM. Found by sending index tensors through it."""
    rows = torch.arange(shape[0], dtype=torch.float32)[:, None].expand(shape).contiguous()
    cols = torch.arange(shape[1], dtype=torch.float32)[None, :].expand(shape).contiguous()
    out_rows, out_cols = (next(iter(adapter.to_hf({f"{fqn}.weight": t}).values())) for t in (rows, cols))
    row_order, col_order = out_rows[:, 0].long(), out_cols[0, :].long()
    if out_rows.shape != shape or not (torch.equal(out_rows, rows[row_order]) and torch.equal(out_cols, cols[:, col_order])):
        raise ValueError(f"{fqn}: the state-dict adapter changes it beyond reordering rows and columns, which a LoRA export cannot follow")
    return row_order, col_order


def adapter_state_dict(model: nn.Module, adapter, dtype: torch.dtype | None = None, layouts: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full tensor) of every adapter matrix, A then B per module, in HF's row and
    column order of the base weight (`hf_layout`, kept in `layouts` across calls: weight sync
    asks every version). Collective under FSDP: iterate it to its end on every rank."""
    modules = lora_modules(model)
    layouts = {} if layouts is None else layouts
    for fqn, hf in hf_module_names(model, adapter).items():
        module = modules[fqn]
        kind = (re.sub(r"\.\d+\.", ".N.", fqn), tuple(module.weight.shape))  # one layout per projection of each layer
        if kind not in layouts:
            layouts[kind] = hf_layout(adapter, fqn, module.weight.shape)
        row_order, col_order = layouts[kind]
        a, b = full_tensor(module.lora_a.weight.detach()), full_tensor(module.lora_b.weight.detach())
        for peft, t in (("lora_A", a[:, col_order.to(a.device)]), ("lora_B", b[row_order.to(b.device)])):
            yield f"{PEFT_PREFIX}{hf}.{peft}.weight", (t if dtype is None else t.to(dtype)).contiguous()


def peft_config(lora: LoRAConfig, base_model: str | None, targets: list[str]) -> dict:
    """adapter_config.json for `peft` and vLLM: plain LoRA on `targets` (the HF projections
    adapted: a MoE's MLP targets name no module and are not listed), no bias."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "base_model_name_or_path": base_model,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter(out_dir: str, tensors: dict[str, torch.Tensor], lora: LoRAConfig, base_model: str | None) -> str:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, os.path.join(out_dir, ADAPTER_FILE), metadata={"format": "pt"})
    targets = sorted({name.split(".")[-3] for name in tensors})  # ....<projection>.lora_A.weight
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(lora, base_model, targets), f, indent=2)
    return out_dir
