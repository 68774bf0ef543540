"""deepseek_v3: a from-scratch TorchTitan model exports to a HF checkpoint that transformers'
DeepseekV3ForCausalLM loads with the same logits, and that reads back into TorchTitan.

The routing is made to matter: the expert (correction) bias is random and nonzero, the
router gates are scaled up so the sigmoid scores spread, and the norms are perturbed. Each
MoE layer's routes (experts and weights) are compared with transformers' router on the same
input, so a dropped bias, a wrong score function, group limit, normalisation or scale fails
there even where it would move the logits little; a wrong RoPE layout or MLA shape fails
the logits.

The routed experts keep their small initial scale: TorchTitan's GroupedExperts runs its
matmuls in bfloat16 whatever the parameter dtype, so scaled-up experts would carry bf16
rounding (about 1e-3 relative) into logits that transformers computes in float32.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from meshrl.config import ModelConfig
from meshrl.trainer import checkpoint as ckpt
from meshrl.trainer.model import build_model, model_args_from_hf

# Settings beyond ModelConfig's sizes, as build_model overrides (HF config.json names):
# the from-scratch defaults, and a model that exercises every other mapped setting.
SETTINGS = {
    "defaults": {},
    "grouped-lora-scaled": dict(
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        q_lora_rank=16,
        kv_lora_rank=32,
        first_k_dense_replace=2,
        intermediate_size=96,
        n_shared_experts=2,
        rope_theta=5000.0,
        norm_eps=1e-5,
    ),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        biases = [b for name, b in model.named_buffers() if name.endswith("moe.expert_bias_E")]
        assert biases, "the MoE layers carry no expert bias buffer"
        for b in biases:
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
            if "router.gate" in name:
                p.mul_(20)  # spread the sigmoid scores: the bias and the group limit then decide close calls


def _tokens(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (3, 20), generator=g), torch.randint(3, 128, (1, 7), generator=g)]


def _sorted_routes(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, k) expert ids in ascending order with their weights: top-k order is unspecified."""
    ids, order = ids.reshape(-1, ids.shape[-1]).sort(-1)
    return ids, weights.reshape(-1, weights.shape[-1]).gather(-1, order)


@pytest.fixture(scope="module", params=list(SETTINGS))
def exported(request, tmp_path_factory):
    """(TorchTitan model, ModelConfig, overrides, HF dir) for one settings case."""
    overrides = SETTINGS[request.param]
    cfg = ModelConfig(family="deepseek_v3", n_layers=3)
    model, specs = build_model(cfg, seed=1, hf_overrides=overrides)
    _perturb(model, seed=2)
    model.eval()
    out = ckpt.export_hf(model, specs, tmp_path_factory.mktemp(request.param) / "hf")
    return model, cfg, overrides, out


def test_export_loads_in_transformers_with_equal_logits(exported):
    from transformers import AutoModelForCausalLM

    model, cfg, overrides, out = exported
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "deepseek_v3"
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    hf.eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        for tokens in _tokens():
            torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=1e-4)
        # the routes themselves, on each MoE layer's own input
        moe_inputs = {}
        hooks = [
            block.moe.register_forward_pre_hook(lambda mod, args, i=int(i): moe_inputs.__setitem__(i, args[0]))
            for i, block in model.layers.items()
            if block.moe_enabled
        ]
        try:
            model(_tokens()[0])
        finally:
            for h in hooks:
                h.remove()
        assert sorted(moe_inputs) == list(range(hf.config.first_k_dense_replace, cfg.n_layers))
        flipped = 0
        for i, x in moe_inputs.items():
            moe, gate = model.layers[str(i)].moe, hf.model.layers[i].mlp.gate
            ids, weights = _sorted_routes(*moe.router(x, moe.expert_bias_E)[1::-1])
            _, hf_weights, hf_ids = gate(x)
            hf_ids, hf_weights = _sorted_routes(hf_ids, hf_weights)
            assert torch.equal(ids, hf_ids)
            torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-5)
            unbiased, _ = _sorted_routes(*moe.router(x, torch.zeros_like(moe.expert_bias_E))[1::-1])
            flipped += (unbiased != ids).any(-1).sum().item()
        assert flipped > 0, "the correction bias changes no route: the test would not see it dropped"
        # and the bias that decides them is the one transformers loaded
        for i in moe_inputs:
            torch.testing.assert_close(hf.model.layers[i].mlp.gate.e_score_correction_bias, model.layers[str(i)].moe.expert_bias_E, atol=0, rtol=0)


def test_the_router_bias_stays_float32_in_a_bfloat16_sync(exported):
    """Weights travel in model.dtype; the router's bias was rounded to it too, where vLLM keeps
    it in float32: the sampler then routed near-ties otherwise than the trainer."""
    model, cfg, overrides, out = exported
    specs = build_model(cfg, seed=1, hf_overrides=overrides)[1]
    dtypes = {name: t.dtype for name, t in ckpt.hf_state_dict(model, specs, torch.bfloat16)}
    biases = [name for name in dtypes if name.endswith("e_score_correction_bias")]
    assert biases and all(dtypes[name] == torch.float32 for name in biases)
    assert {d for name, d in dtypes.items() if name not in biases} == {torch.bfloat16}


def test_config_round_trip_and_load_back_into_torchtitan(exported):
    model, cfg, overrides, out = exported
    cfg2, overrides2 = model_args_from_hf(out)
    # MLA has no grouped kv heads: the HF config says num_key_value_heads == num_attention_heads
    # and ModelConfig.n_kv_heads is unused for deepseek_v3
    assert dataclasses.replace(cfg2, path=None, n_kv_heads=cfg.n_kv_heads) == cfg
    assert cfg2.n_kv_heads == cfg.n_heads
    # only settings a from-scratch model would not have come back (topk_group=1 is its default)
    assert overrides2.items() <= ({"rope_theta": 10000.0, "norm_eps": 1e-6} | overrides).items()
    model2, specs2 = build_model(cfg2, seed=9, hf_overrides=overrides2)
    ckpt.load_hf(model2, specs2, out)
    model2.eval()
    with torch.no_grad():
        for tokens in _tokens():
            assert torch.equal(model2(tokens), model(tokens))
    # the rebuilt model exports the same config.json
    with open(os.path.join(out, "config.json")) as f:
        assert specs2.hf_config == json.load(f)


def test_unmapped_hf_settings_are_refused_as_value_errors(exported, tmp_path):
    """config validation reports ValueErrors from model_args_from_hf against model.path."""
    _, _, _, out = exported
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    for change in ({"rope_parameters": yarn}, {"rope_interleave": False}, {"tie_word_embeddings": True}):
        with open(tmp_path / "config.json", "w") as f:
            json.dump(config | change, f)
        with pytest.raises(ValueError, match="deepseek_v3"):
            model_args_from_hf(tmp_path)
