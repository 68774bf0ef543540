"""MoE routing replay: the trainer's MoE layers route each token to the experts the sampler chose.

Why: the sampler (vLLM) and the trainer compute the router scores with different kernels
and precision, so a token near a top-k edge can go to different experts in the two. Its
log-prob then differs by far more than numeric noise, and the importance ratio mixes
policy change with routing noise. Replay (as in slime, verl, SkyRL) takes the expert *ids*
from the sampler but the gate *weights* from the trainer's live router: the scores are
computed as usual, gathered at the replayed ids, then normalised (`route_norm`) and scaled
(`route_scale`) exactly as TorchTitan's `TokenChoiceTopKRouter` does, so gradients still
reach the router weight.

How: a forward hook on every `TokenChoiceTopKRouter` rewrites its outputs
(topk_scores, topk_expert_ids, scores). The MoE module dispatches tokens (all-to-all under
expert parallelism) only after the router returns, so EP sees the replayed ids with no
change to TorchTitan. The hook is installed once per router and stays; `replay_routing`
only sets and clears the ids it reads, so a `torch.compile`d block sees the same hook
every call (two graph variants at most: replay on and off) instead of a new one per step.

Layout of `routed_experts` [B, T, L, K] (int, -1 = no data):
- row [b, t] is the routing of the forward at *input position* t (the router's view);
  `input_positions` converts the rollout batch's per-sampled-token layout to it.
- L is either every decoder layer, indexed by layer number (vLLM's layout: its capturer
  buffer has `get_total_num_hidden_layers()` rows and writes row `extract_layer_index`
  of each FusedMoE layer, leaving dense layers' rows unwritten), or the MoE layers only,
  in order. The two coincide when every layer is MoE.
- A token whose row for a layer has any -1 (prompt tokens, padding, dense-layer rows) or
  any id out of range keeps the live router's own top-k in that layer: prompt tokens are
  not trained on, and a partial row has no meaning as a top-k set.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_REPLAY = "_meshrl_replay_ids"  # [B, T, K] long, or None: this router's ids for the current forward
_RECORD = "_meshrl_record"  # list collecting this router's chosen ids, or None
_CHANGED = "_meshrl_changed"  # list collecting where replay overrode this router's own choice, or None


def moe_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router) for every MoE layer of a TorchTitan model, in layer order."""
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    found = []
    for name, module in model.named_modules():
        if isinstance(module, TokenChoiceTopKRouter):
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"MoE router {name!r} is not under a numbered decoder layer")
            found.append((int(match.group(1)), module))
    return sorted(found, key=lambda item: item[0])


def _num_layers(model: nn.Module) -> int:
    layers = getattr(model, "layers", None)
    return len(layers) if layers is not None else 0


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        # Router outputs are DTensors only under tensor/sequence parallelism (token dim sharded
        # over TP), which meshrl does not build; replay ids would need the same sharding.
        raise NotImplementedError("routing replay does not support a tensor-parallel router (DTensor outputs)")
    return t


def _router_hook(router: nn.Module, args, output):
    """Forward hook: replace the router's top-k ids (where replay data is valid) and recompute
    the gate weights from its live scores; record the ids it ends up with."""
    replay = getattr(router, _REPLAY, None)
    record = getattr(router, _RECORD, None)
    if replay is None and record is None:
        return None
    topk_scores, topk_ids, scores = output
    if replay is not None:
        _local(scores)
        if replay.shape != topk_ids.shape:
            raise ValueError(f"replayed routing {tuple(replay.shape)} does not match the router's top-k {tuple(topk_ids.shape)}")
        replay = replay.to(topk_ids.device)
        valid = ((replay >= 0) & (replay < router.num_experts)).all(dim=-1, keepdim=True)
        changed = getattr(router, _CHANGED, None)
        if changed is not None:
            own = topk_ids.sort(dim=-1).values != replay.sort(dim=-1).values
            changed.append((own.any(dim=-1) & valid.squeeze(-1)).detach())
        topk_ids = torch.where(valid, replay, topk_ids)
        # TokenChoiceTopKRouter.forward's steps after the top-k choice, on the chosen ids.
        topk_scores = scores.gather(dim=-1, index=topk_ids)
        if router.route_norm:
            topk_scores = topk_scores / (topk_scores.sum(dim=-1, keepdim=True) + 1e-20)
        topk_scores = topk_scores * router.route_scale
    if record is not None:
        record.append(_local(topk_ids).detach())
    return topk_scores, topk_ids, scores


def _install(router: nn.Module) -> None:
    if not getattr(router, "_meshrl_routing_hook", False):
        router.register_forward_hook(_router_hook)
        router._meshrl_routing_hook = True
        setattr(router, _REPLAY, None)
        setattr(router, _RECORD, None)
        setattr(router, _CHANGED, None)


def _layer_slot(index: int, ordinal: int, n_layers: int, n_moe: int, L: int) -> int:
    if L == n_layers:
        return index
    if L == n_moe:
        return ordinal
    raise ValueError(f"routed_experts has {L} layers; the model has {n_layers} decoder layers, {n_moe} of them MoE")


@contextmanager
def replay_routing(model: nn.Module, routed_experts: torch.Tensor | None, changed: list | None = None) -> Iterator[None]:
    """Within the block, every MoE router of `model` routes token [b, t] in layer l to
    `routed_experts[b, t, l]` (see the module docstring for the layout and the -1 rule).

    `routed_experts`: [B, T, L, K] ints matching the forward's tokens [B, T]; None (or a
    model without MoE layers) makes this a no-op. Keep the block open over every forward
    that must replay, including a recomputation in backward (activation checkpointing).
    `changed`, a list, gets one [B, T] bool appended at the block's end: the positions where
    the replayed experts differ from the router's own choice in at least one layer (of the
    block's first forward).
    """
    routers = moe_routers(model) if routed_experts is not None else []
    if not routers:
        yield
        return
    if routed_experts.dim() != 4:
        raise ValueError(f"routed_experts must be [B, T, L, K], got shape {tuple(routed_experts.shape)}")
    n_layers, L = _num_layers(model), routed_experts.shape[2]
    ids = routed_experts.long()
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    try:
        for ordinal, (index, router) in enumerate(routers):
            _install(router)
            setattr(router, _REPLAY, ids[:, :, _layer_slot(index, ordinal, n_layers, len(routers), L)])
            setattr(router, _CHANGED, seen[ordinal] if changed is not None else None)
        yield
    finally:
        for _, router in routers:
            setattr(router, _REPLAY, None)
            setattr(router, _CHANGED, None)
    if changed is not None and all(seen):
        flags = torch.stack([calls[0].reshape(ids.shape[:2]) for calls in seen])
        changed.append(flags.any(dim=0))


class RoutingRecord:
    """The expert ids the routers chose in the forwards run inside `record_routing`."""

    def __init__(self, n_layers: int, slots: list[int]):
        self._n_layers = n_layers
        self._slots = slots
        self._calls: list[list[torch.Tensor]] = [[] for _ in slots]

    @property
    def experts(self) -> torch.Tensor:
        """[B, T, n_layers, K] int32, ids sorted along K, -1 in dense layers; the last forward's
        routing (vLLM's all-layers layout, so it can be fed straight back to `replay_routing`)."""
        if not self._calls or not all(self._calls):
            raise RuntimeError("no MoE forward ran inside record_routing")
        last = [calls[-1] for calls in self._calls]
        B, T, K = last[0].shape
        out = torch.full((B, T, self._n_layers, K), -1, dtype=torch.int32, device=last[0].device)
        for slot, ids in zip(self._slots, last):
            out[:, :, slot] = ids.sort(dim=-1).values.to(torch.int32)
        return out


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Record the expert ids every MoE router of `model` uses in the forwards run inside the
    block (after replay, when `replay_routing` is also active)."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError("the model has no MoE layers")
    record = RoutingRecord(max(_num_layers(model), routers[-1][0] + 1), [index for index, _ in routers])
    try:
        for (_, router), calls in zip(routers, record._calls):
            _install(router)
            setattr(router, _RECORD, calls)
        yield record
    finally:
        for _, router in routers:
            setattr(router, _RECORD, None)


def routing_differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: tokens whose expert set differs in at least one layer where both `a` and
    `b` ([B, T, L, K], same layout) have data (no -1 in either row)."""
    if a.shape != b.shape:
        raise ValueError(f"routing shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a_sorted, b_sorted = a.sort(dim=-1).values, b.sort(dim=-1).values
    both = ((a >= 0) & (b >= 0)).all(dim=-1)  # [B, T, L]
    return ((a_sorted != b_sorted).any(dim=-1) & both).any(dim=-1)


def input_positions(routed_experts: torch.Tensor) -> torch.Tensor:
    """The rollout batch's `routed_experts` (meshrl/episode.py: row t belongs to sampled token
    t) re-laid by input position, for `replay_routing`.

    vLLM returns one row per *input* position 0 .. num_tokens - 2 (the last sampled token is
    never fed back); meshrl's engine keeps the last n rows for n sampled tokens, so the row
    packed at sampled token t is the routing of the forward at position t - 1, the one that
    produced t. Shifting left by one puts it at position t - 1; the last position gets -1.
    """
    pad = torch.full_like(routed_experts[:, :1], -1)
    return torch.cat([routed_experts[:, 1:], pad], dim=1)
