"""A Hugging Face checkpoint's config.json read into meshrl's model settings.

Pure data: the trainer builds from what this returns (meshrl/trainer/model.py), and the
plans (CPU placement, GPU memory) size the model from it before anything starts, so it
lives below both. transformers is imported only to read a deepseek_v3 config.
"""

from __future__ import annotations

import json
import os
from typing import Any

from meshrl.config.models import MOE_FAMILIES, ModelConfig


# DeepSeek-V3 settings that ModelConfig's sizes do not name, under their HF config.json keys.
# `dsv3_settings` fills them for a from-scratch model; a HF checkpoint brings its own
# (model_args_from_hf passes the ones that differ as build_model overrides).
DSV3_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
    "intermediate_size",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
)


def dsv3_settings(cfg: ModelConfig, **overrides) -> dict:
    head = cfg.dim // cfg.n_heads
    settings = dict(
        # No query compression: a tiny model gains nothing from it; both TorchTitan (0) and HF (None) support it.
        q_lora_rank=None,
        # DeepSeek-V3's latent sizes whatever the model's width: vLLM serves deepseek_v3 through
        # its MLA backends, and the CPU one (like FlashMLA) caches only a 512 + 64 = 576 latent.
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        # the per-head sizes that ModelConfig names; MLA's kv_b_proj expands the latent to them
        qk_nope_head_dim=head,
        v_head_dim=head,
        # The first layer dense, the rest MoE (DeepSeek-V3's layout), as long as one MoE layer remains.
        first_k_dense_replace=min(1, cfg.n_layers - 1),
        intermediate_size=cfg.ffn_dim,
        n_shared_experts=1,
        # HF's router always runs group-limited top-k; one group of all experts makes that a plain top-k.
        n_group=1,
        topk_group=1,
        # DeepSeek-V3's noaux_tc routing: sigmoid scores, top-k weights renormalised; a scale of 1
        # keeps a from-scratch model's routed output at the size of one expert's.
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )
    unknown = set(overrides) - set(settings)
    if unknown:
        raise ValueError(f"unknown deepseek_v3 settings {sorted(unknown)}; known: {sorted(settings)}")
    settings.update(overrides)
    return settings


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The settings of HF's `llama3` rope scaling (Llama 3.1, 3.2), in TorchTitan's "llama" RoPE."""


def model_args_from_hf(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Read a local HF checkpoint's config.json into (ModelConfig, hf_overrides for build_model)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    families = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama3", "deepseek_v3": "deepseek_v3"}
    family = families.get(hf.get("model_type"))
    if family is None:
        raise ValueError(f"{path}: model_type {hf.get('model_type')!r} is not one of {sorted(families)}")
    moe = family in MOE_FAMILIES
    cfg = ModelConfig(
        family=family,
        path=str(path),
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_dim=hf["moe_intermediate_size"] if moe else hf["intermediate_size"],
        num_experts=hf.get("num_experts", hf.get("n_routed_experts", 4)) if moe else 4,
        experts_top_k=hf.get("num_experts_per_tok", 2) if moe else 2,
        max_seq_len=hf.get("max_position_embeddings", 256),
    )
    overrides: dict[str, Any] = {}
    if "rope_theta" in hf or "rope_parameters" in hf:
        overrides["rope_theta"] = float(hf.get("rope_theta") or hf["rope_parameters"].get("rope_theta"))
    if family != "deepseek_v3":  # (its own tying and rope: _dsv3_overrides_from_hf)
        overrides["tie"] = bool(hf.get("tie_word_embeddings", False))
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if family == "llama3" and kind == "llama3":  # Llama 3.1 and 3.2's frequency scaling, as TorchTitan's "llama" RoPE
            overrides["rope_scaling"] = {k: rope[k] for k in LLAMA3_ROPE_KEYS if k in rope}
        elif kind != "default":  # vLLM would apply it and the trainer not: every log-prob apart
            raise ValueError(
                f"{path}: {family} rope_type {kind!r} is not mapped onto TorchTitan; only the default rotary embedding (and Llama 3's llama3 scaling) are"
            )
    if family.startswith("qwen3"):
        overrides["norm_eps"] = float(hf.get("rms_norm_eps", 1e-6))
        if hf.get("head_dim") and hf["head_dim"] != cfg.dim // cfg.n_heads:
            overrides["head_dim"] = hf["head_dim"]
    if family == "deepseek_v3":
        overrides.update(_dsv3_overrides_from_hf(path, hf, cfg))
    return cfg, overrides


def _dsv3_overrides_from_hf(path, hf: dict, cfg: ModelConfig) -> dict:
    """The build_model overrides for a deepseek_v3 config.json: the settings that differ from a from-scratch model's."""
    from transformers import DeepseekV3Config

    # Read through transformers' own config class: keys a config.json leaves out take the
    # defaults transformers (and so the checkpoint's authors) would use, and rope settings
    # are normalised into rope_parameters whichever spelling the file uses. Unsupported
    # settings raise ValueError, which config validation reports against model.path.
    try:
        c = DeepseekV3Config.from_dict(hf)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid deepseek_v3 config.json ({e})") from None
    rope = c.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{path}: deepseek_v3 rope_type {rope.get('rope_type')!r} is not mapped onto TorchTitan yet; only the default (unscaled) rotary embedding is"
        )
    if not c.rope_interleave:
        raise ValueError(f"{path}: deepseek_v3 with rope_interleave false is not mapped: TorchTitan rotates adjacent pairs")
    if c.tie_word_embeddings:
        raise ValueError(f"{path}: deepseek_v3 with tied embeddings is not mapped")
    if c.num_key_value_heads != c.num_attention_heads:
        raise ValueError(f"{path}: deepseek_v3 with num_key_value_heads != num_attention_heads is not MLA")
    if c.hidden_act != "silu":
        raise ValueError(f"{path}: deepseek_v3 hidden_act {c.hidden_act!r}: TorchTitan's experts use silu")
    read = {key: getattr(c, key) for key in DSV3_KEYS}
    read["n_group"], read["topk_group"] = read["n_group"] or 1, read["topk_group"] or 1
    defaults = dsv3_settings(cfg)
    overrides: dict[str, Any] = {k: v for k, v in read.items() if v != defaults[k]}
    overrides["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    overrides["norm_eps"] = float(c.rms_norm_eps)
    return overrides
