"""Build the policy as a TorchTitan model from TorchTitan's own registry.

Each family reuses its registry module: the per-layer config builders (with the family's
own initialisers) sized from `ModelConfig`, the model class, and the state-dict adapter
that maps TorchTitan names to Hugging Face names. meshrl writes no model code.

QKV projections are built unfused (`wq`/`wk`/`wv` parameters): then the module tree, the
DCP checkpoint and the HF export all use the same names with no save/load hooks in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from meshrl.compat import titan_use_sdpa_attention
from meshrl.trainer.attention import document_sdpa
from meshrl.config import ModelConfig
from meshrl.config.hf import DSV3_KEYS, LLAMA3_ROPE_KEYS, dsv3_settings, model_args_from_hf  # noqa: F401 (model_args_from_hf: re-exported)
from meshrl.trainer import lora as adapters
from meshrl.trainer.head import float32_logits


@dataclass
class ModelSpecs:
    """What the trainer needs besides the module: the TorchTitan config and the HF mapping."""

    family: str
    titan_config: Any
    """The TorchTitan model Config the module was built from."""
    adapter_cls: type
    """The family's TorchTitan StateDictAdapter (TorchTitan names <-> HF names)."""
    parallelize_fn: Any
    """The family's TorchTitan parallelize function."""
    hf_config: dict
    """config.json contents for an exported HF checkpoint."""


def _qwen3_config(cfg: ModelConfig, tie: bool = False, rope_theta: float = 1e6, norm_eps: float = 1e-6, head_dim: int | None = None):
    import torchtitan.models.qwen3 as q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    head_dim = head_dim or cfg.dim // cfg.n_heads
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=cfg.max_seq_len, theta=rope_theta)
    common = dict(
        n_layers=cfg.n_layers, dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=head_dim, fuse_qkv=False, attn_backend="flex", rope=rope
    )
    if cfg.family == "qwen3_moe":
        layers = q._build_qwen3_moe_layers(
            **common, moe_hidden_dim=cfg.ffn_dim, num_experts=cfg.num_experts, top_k=cfg.experts_top_k, moe_comm_backend="standard"
        )
    else:
        layers = q._build_qwen3_layers(**common, hidden_dim=cfg.ffn_dim)
    norm = q.RMSNorm.Config(normalized_shape=cfg.dim, eps=norm_eps, param_init=q._NORM_INIT)
    for layer in layers:  # the registry's norms carry its default eps; a checkpoint may differ
        layer.attention_norm.eps = layer.ffn_norm.eps = layer.attention.qk_norm.eps = norm_eps
    return (
        q.Qwen3Model.Config(
            vocab_size=cfg.vocab_size,
            dim=cfg.dim,
            norm=norm,
            enable_weight_tying=tie,
            tok_embeddings=Embedding.Config(
                num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim, param_init=q._EMBEDDING_SKIP_INIT if tie else q._EMBEDDING_INIT
            ),
            lm_head=Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size, param_init=q._LINEAR_INIT),
            layers=layers,
        ),
        q.Qwen3StateDictAdapter,
        q.parallelize_qwen3,
    )


def _llama3_config(cfg: ModelConfig, rope_theta: float = 500000.0, tie: bool = False, rope_scaling: dict | None = None, **_):
    import torchtitan.models.llama3 as l
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear

    # "llama" frequency scaling only from a checkpoint's config (Llama 3.1, 3.2): a from-scratch
    # model has no pretraining length to extend.
    scaling = {}
    if rope_scaling:
        names = dict(zip(LLAMA3_ROPE_KEYS, ("scaling_factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))
        scaling = {"scaling": "llama", **{names[k]: v for k, v in rope_scaling.items()}}
    rope = ComplexRoPE.Config(dim=cfg.dim // cfg.n_heads, max_seq_len=cfg.max_seq_len, theta=rope_theta, **scaling)
    layers = l._build_llama3_layers(
        n_layers=cfg.n_layers,
        dim=cfg.dim,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        hidden_dim=cfg.ffn_dim,
        rope=rope,
        fuse_qkv=False,
        attn_backend="flex",
    )
    return (
        l.Llama3Model.Config(
            dim=cfg.dim,
            vocab_size=cfg.vocab_size,
            enable_weight_tying=tie,  # Llama 3.2 1B and 3B
            tok_embeddings=Embedding.Config(
                num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim, param_init=l._EMBEDDING_SKIP_INIT if tie else l._EMBEDDING_INIT
            ),
            norm=l.RMSNorm.Config(normalized_shape=cfg.dim, param_init=l._NORM_INIT),
            lm_head=Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size, param_init=l._output_linear_init(cfg.dim)),
            layers=layers,
        ),
        l.Llama3StateDictAdapter,
        l.parallelize_llama,
    )


def _deepseek_v3_config(cfg: ModelConfig, rope_theta: float = 10000.0, norm_eps: float = 1e-6, **overrides):
    import torchtitan.models.deepseek_v3 as d
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear

    s = dsv3_settings(cfg, **overrides)
    groups = s["n_group"] if s["n_group"] and s["n_group"] > 1 else None  # one group: no group-limited step
    layers = d._build_dsv3_layers(
        n_layers=cfg.n_layers,
        n_dense_layers=s["first_k_dense_replace"],
        dim=cfg.dim,
        n_heads=cfg.n_heads,
        q_lora_rank=s["q_lora_rank"] or 0,
        kv_lora_rank=s["kv_lora_rank"],
        qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"],
        v_head_dim=s["v_head_dim"],
        mscale=1.0,
        dense_hidden_dim=s["intermediate_size"],
        moe_hidden_dim=cfg.ffn_dim,
        num_experts=cfg.num_experts,
        num_shared_experts=s["n_shared_experts"],
        router_top_k=cfg.experts_top_k,
        # HF's DeepseekV3TopkRouter always scores with a sigmoid and adds e_score_correction_bias
        # for the choice only; TorchTitan's router does the same with the MoE's expert_bias_E
        # buffer (kept by the default load_balance_coeff), which the state-dict adapter maps to
        # e_score_correction_bias in both directions.
        router_score_func="sigmoid",
        router_route_norm=s["norm_topk_prob"],
        router_route_scale=s["routed_scaling_factor"],
        router_num_expert_groups=groups,
        router_num_limited_groups=s["topk_group"] if groups else None,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        # ComplexRoPE rotates adjacent pairs: HF's `rope_interleave: true` layout. No YaRN scaling:
        # a from-scratch model has no pretraining length to extend.
        rope=ComplexRoPE.Config(dim=s["qk_rope_head_dim"], max_seq_len=cfg.max_seq_len, theta=rope_theta),
    )
    for layer in layers:
        # TorchTitan's RMSNorm defaults to eps 1e-5; HF uses rms_norm_eps for the block norms
        # but its MLA latent norms (q_a_layernorm, kv_a_layernorm) keep DeepseekV3RMSNorm's 1e-6.
        layer.attention_norm.eps = layer.ffn_norm.eps = norm_eps
        layer.attention.kv_norm.eps = layer.attention.q_norm.eps = 1e-6
    return (
        d.DeepSeekV3Model.Config(
            vocab_size=cfg.vocab_size,
            dim=cfg.dim,
            tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim, param_init=d._EMBEDDING_INIT),
            norm=d.RMSNorm.Config(normalized_shape=cfg.dim, eps=norm_eps, param_init=d._NORM_INIT),
            lm_head=Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size, param_init=d._output_linear_init(cfg.dim)),
            layers=layers,
            mtp_layers=[],
        ),
        d.DeepSeekV3StateDictAdapter,
        d.parallelize_deepseekv3,
    )


_FAMILIES = {"qwen3": _qwen3_config, "qwen3_moe": _qwen3_config, "llama3": _llama3_config, "deepseek_v3": _deepseek_v3_config}


def hf_config_dict(
    cfg: ModelConfig, tie: bool = False, rope_theta: float | None = None, norm_eps: float = 1e-6, rope_scaling: dict | None = None, **dsv3
) -> dict:
    """The HF config.json matching a from-scratch TorchTitan model of these sizes.

    `dsv3`: deepseek_v3 settings (DSV3_KEYS) that differ from the from-scratch ones.
    """
    base = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=norm_eps,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=cfg.dtype,  # (transformers 5 reads it first; older readers torch_dtype)
        torch_dtype=cfg.dtype,
        attention_bias=False,
    )
    if cfg.family == "qwen3":
        return dict(
            base,
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            intermediate_size=cfg.ffn_dim,
            head_dim=cfg.dim // cfg.n_heads,
            rope_theta=rope_theta or 1e6,
            hidden_act="silu",
        )
    if cfg.family == "qwen3_moe":
        return dict(
            base,
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            intermediate_size=cfg.ffn_dim,
            moe_intermediate_size=cfg.ffn_dim,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_top_k,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            head_dim=cfg.dim // cfg.n_heads,
            rope_theta=rope_theta or 1e6,
            hidden_act="silu",
            output_router_logits=False,
        )
    if cfg.family == "llama3":
        return dict(
            base,
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            intermediate_size=cfg.ffn_dim,
            rope_theta=rope_theta or 500000.0,
            hidden_act="silu",
            rms_norm_eps=1e-5,
            **({"rope_scaling": {"rope_type": "llama3", **rope_scaling}} if rope_scaling else {}),
        )
    if cfg.family == "deepseek_v3":
        if tie:
            raise ValueError("deepseek_v3 is built with untied embeddings")
        theta = rope_theta or 10000.0
        # MLA gives every head its own key and value: HF repeats kv heads by
        # num_attention_heads / num_key_value_heads, so they must be equal (n_kv_heads is unused).
        return dict(
            base,
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            num_key_value_heads=cfg.n_heads,
            moe_intermediate_size=cfg.ffn_dim,
            n_routed_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_top_k,
            **dsv3_settings(cfg, **dsv3),
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            moe_layer_freq=1,
            # the rotary pairs are adjacent dims, as TorchTitan's ComplexRoPE rotates them
            rope_interleave=True,
            rope_theta=theta,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            # no multi-token-prediction layers are built or exported
            num_nextn_predict_layers=0,
            hidden_act="silu",
            attention_dropout=0.0,
        )
    raise NotImplementedError(f"HF export of {cfg.family!r} is not supported yet")


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0, hf_overrides: dict | None = None, parallelism=None, lora=None):
    """Build and initialise a TorchTitan model for `cfg`; returns (module, ModelSpecs).

    The model is materialised and initialised on `device` with `seed` before any
    sharding, so every rank (and every world size) starts from identical weights.
    `hf_overrides` carries checkpoint-only settings (tie, rope_theta, rope_scaling, norm_eps, head_dim).
    `parallelism` (a TorchTitan ParallelismConfig) sets the modules' sharding plans (EP/TP)
    before they are built, as TorchTitan's own trainer does. `lora` (a LoRAConfig with
    rank > 0): adapters on its targets, every other weight frozen (meshrl/trainer/lora.py).
    """
    if cfg.family not in _FAMILIES:
        raise ValueError(f"unknown model family {cfg.family!r}; choose one of {sorted(_FAMILIES)}")
    hf_overrides = hf_overrides or {}
    titan_config, adapter_cls, parallelize_fn = _FAMILIES[cfg.family](cfg, **hf_overrides)
    if lora is not None and lora.rank > 0:
        titan_config = adapters.convert_config(titan_config, lora)
    titan_use_sdpa_attention(titan_config, document_sdpa())
    if parallelism is not None:
        titan_config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    torch.manual_seed(seed)
    with torch.device(device):
        model = titan_config.build()
        model.init_weights(buffer_device=torch.device(device))
    if lora is not None and lora.rank > 0:
        adapters.add_dropout(model, lora.dropout)
    if parallelism is None or parallelism.tensor_parallel_degree == 1:  # TP keeps TorchTitan's head (meshrl/trainer/head.py)
        float32_logits(model.lm_head)  # log-probs from unrounded logits
    hf = hf_config_dict(cfg, **{k: v for k, v in hf_overrides.items() if k in ("tie", "rope_theta", "norm_eps", "rope_scaling") + DSV3_KEYS})
    return model, ModelSpecs(cfg.family, titan_config, adapter_cls, parallelize_fn, hf)
