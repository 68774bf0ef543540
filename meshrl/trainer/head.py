"""The LM head's logits in float32, whatever precision the rest of the model computes in.

Log-probs feed every importance ratio, and rounding logits to bf16 moves them: on an H200,
bf16 logits of a 151,936-token vocabulary (|logit| up to about 44) put the target token's
log-prob off by 0.037 nats on average and 0.15 at most against float32 logits of the same
bf16 operands, where this head's float32 output is off by at most 0.0003
(benchmarks/results/gpu_torch_checks.json, `lm_head_logits`). So the head
never rounds its output: where FSDP2 hands it bf16 weights on a GPU its matmul accumulates
into and returns float32 (`torch.mm(..., out_dtype=float32)`, a CUDA kernel); with float32
weights (CPU, an unsharded proc) the caller runs it outside autocast on float32 inputs.
Under tensor parallel the head keeps TorchTitan's own forward (its DTensor input and
vocabulary-sharded weight run through TorchTitan's redistribution, which this forward does
not reproduce), and its logits stay in the weight's dtype: the one path not covered.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def _float32_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's argument name
    w = self.weight
    if input.is_cuda and w.dtype in (torch.bfloat16, torch.float16):
        flat = input.reshape(-1, input.shape[-1]).to(w.dtype)
        out = _Float32OutMM.apply(flat, w).view(*input.shape[:-1], w.shape[0])
        return out if self.bias is None else out + self.bias.float()  # (the critic's value head has one)
    return F.linear(input.to(w.dtype), w, self.bias)


class _Float32OutMM(torch.autograd.Function):
    """x @ w.T with float32 output from half operands (torch's `mm(out_dtype=)` has no
    derivative): the backward's products accumulate in float32 too, and the gradients come
    back in the operands' dtype, as autograd and FSDP expect."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g = grad.to(w.dtype)
        gx = torch.mm(g, w, out_dtype=torch.float32).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = torch.mm(g.t(), x, out_dtype=torch.float32).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def float32_logits(lm_head: nn.Module) -> None:
    """Make `lm_head` (an nn.Linear, not tensor-parallel) return float32 logits from
    half-precision weights on GPU, in place; its parameters, hooks and state dict are unchanged."""
    if isinstance(lm_head, nn.Linear):
        lm_head.forward = types.MethodType(_float32_forward, lm_head)


def head_logits(lm_head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[N, V] float32 logits of `hidden` [N, D] (the head's result as it returns it: a
    vocabulary-sharded DTensor under TP, gathered by the caller)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return lm_head(hidden.float())
