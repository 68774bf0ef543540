"""AdamW's state out of GPU memory while colocated engines generate, and back before a step.

`offload` copies each state tensor (a plain tensor, or the local shard of an FSDP2 DTensor)
into a pinned host buffer, kept across steps, puts the host copy in the optimizer's state in
its place (so a checkpoint taken while the engines are awake saves it from host memory, as
with FSDP2's CPU offload), and resizes the GPU tensor's storage to nothing, which hands the
memory back to the caching allocator (FSDP2 frees unsharded parameters the same way).
`restore` gives the GPU tensors their storage back, copies the bytes (a checkpoint loaded
meanwhile included) and puts them back in the state.
"""

from __future__ import annotations

import torch


class OptimizerOffload:
    def __init__(self) -> None:
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # pinned host buffers by (parameter, state key), reused every step
        self._moved: list[tuple[dict, str, torch.Tensor, torch.Tensor]] = []  # (state, key, device value, its host local)
        self.offloaded = False

    def offload(self, optimizer: torch.optim.Optimizer, include_cpu: bool = False) -> int:
        """Move the state to host memory and free its GPU storage; returns the bytes moved.
        `include_cpu`: CPU state too (it then moves between host buffers: tests)."""
        if self.offloaded:
            return 0
        moved = []
        for param, state in optimizer.state.items():  # by parameter: a checkpoint's load makes new state dicts
            for key, value in state.items():
                local = _owner(value)
                # only tensors that own their whole storage can give it back
                if (
                    not torch.is_tensor(local)
                    or not local.numel()
                    or not include_cpu
                    and local.device.type == "cpu"
                    or local.storage_offset()
                    or local.untyped_storage().nbytes() != local.numel() * local.element_size()
                ):
                    continue
                host = self._host.get((id(param), key))
                if host is None or host.shape != local.shape or host.dtype != local.dtype:
                    host = self._host[(id(param), key)] = torch.empty(local.shape, dtype=local.dtype, pin_memory=torch.cuda.is_available())
                host.copy_(local, non_blocking=True)
                moved.append((state, key, value, host))
        if moved and torch.cuda.is_available():
            torch.cuda.synchronize()  # every copy landed before its source goes
        for state, key, value, host in moved:
            _owner(value).untyped_storage().resize_(0)
            state[key] = _like(value, host)
        self._moved, self.offloaded = moved, True
        return sum(h.numel() * h.element_size() for *_, h in moved)

    def restore(self) -> None:
        """Give the state its GPU storage back, with the host copies' bytes."""
        if not self.offloaded:
            return
        for state, key, value, host in self._moved:
            local = _owner(value)
            local.untyped_storage().resize_(host.numel() * host.element_size())
            local.copy_(host, non_blocking=True)
            state[key] = value
        if self._moved and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._moved, self.offloaded = [], False


def _owner(value):
    """The tensor that owns `value`'s memory: a DTensor's local shard, or the tensor itself."""
    return getattr(value, "_local_tensor", value)


def _like(value, local: torch.Tensor):
    """`local` in `value`'s form: a DTensor with the same mesh and placements, or itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride(), run_check=False)
    return local
