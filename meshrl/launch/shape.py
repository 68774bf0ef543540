"""A decoder's sizes, read from the config or a checkpoint's config.json, and what the memory
plan (memory.py) derives from them: parameters, activations a block keeps for backward, KV
cache bytes. Pure: the standard library and the config."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.config import Config

SELECTIVE_KEEPS = 0.39
"""Share of a block's saved activations that TorchTitan's selective (op) checkpointing keeps:
measured (benchmarks/README.md section 14: 21.6 of 55.7 KB per token per layer)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """A decoder's sizes (dense, or MoE with `experts` of `ffn` each and `top_k` active)."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.dim * (q + 2 * kv) + q * self.dim + 2 * self.head_dim  # q, k, v, o and Qwen3's q/k norms
        mlp = 3 * self.dim * self.ffn * max(self.experts, 1) + self.dim * self.experts  # experts and router
        return attention + mlp + 2 * self.dim  # two RMSNorms

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.dim * (1 if self.tied else 2) + self.dim

    def activation_bytes_per_token_layer(self, mode: str, dtype_bytes: int) -> float:
        """Bytes a block keeps for backward per token: without checkpointing, the two norms'
        inputs and outputs (4 dim), q/k/v and their normed and rotated copies with the
        attention output (6 q + 4 kv, GQA's k and v repeated to q's heads), and the MLP's
        gate, up, activation and product (4 ffn, x top_k for MoE). `full` keeps each block's
        input alone (the block recomputed in backward is counted once, by the caller)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        none = (4 * self.dim + 6 * q + 4 * kv + 4 * self.ffn * max(self.top_k, 1)) * dtype_bytes
        return {"none": none, "selective": SELECTIVE_KEEPS * none, "memory_budget": none, "full": self.dim * dtype_bytes}[mode]

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def model_shape(config: Config, path: str | None = None) -> Shape:
    """The policy's Shape: the checkpoint's config.json where `model.path` is set; `path`:
    another checkpoint's (a distillation teacher's)."""
    m, head_dim, tied = config.model, None, False
    path = path or m.path
    if path is not None:
        from meshrl.config.hf import model_args_from_hf

        m, overrides = model_args_from_hf(path)
        head_dim, tied = overrides.get("head_dim"), overrides.get("tie", False)
    return Shape(
        vocab=m.vocab_size,
        dim=m.dim,
        layers=m.n_layers,
        heads=m.n_heads,
        kv_heads=m.n_kv_heads,
        head_dim=head_dim or m.dim // m.n_heads,
        ffn=m.ffn_dim,
        tied=tied,
        experts=m.num_experts if m.moe else 0,
        top_k=m.experts_top_k if m.moe else 0,
    )
