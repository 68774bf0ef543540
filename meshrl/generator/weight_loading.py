"""Getting full Hugging Face-named tensors into a running vLLM engine.

`AsyncLLM` always runs its engine core (and, at tp=1, the model) in a separate process,
so new weights must cross a process boundary. Tensors do not survive vLLM's RPC
serialisation, so the generator process packs them into ONE shared-memory segment
(/dev/shm, RAM, never a disk file) and sends only a small manifest (names, dtypes, shapes,
offsets) through `collective_rpc`. The worker extension below maps the segment, views
each tensor in place (no copy) and runs vLLM's in-place reload (`model_runner.
reload_weights(weights_iterator=...)`), which calls the model's own `load_weights` and
then the backend's post-load processing (the CPU backend repacks linear weights; loading
tensors without that step leaves unusable parameters).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64  # byte alignment of each tensor inside the segment


@dataclass
class SharedWeights:
    """A packed shared-memory segment holding one version's tensors; unlink when done."""

    path: str
    nbytes: int
    manifest: list[tuple[str, str, list[int], int]]
    """(name, dtype name, shape, byte offset) per tensor."""

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def pack_to_shared_memory(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> SharedWeights:
    """Copy `tensors` (cast to `dtype` when given) into one new shared-memory segment."""
    manifest, offset = [], 0
    prepared = {}
    for name, t in tensors.items():
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous().cpu()
        prepared[name] = t
        manifest.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset += (t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    nbytes = max(offset, _ALIGN)
    base = SHM_DIR if os.path.isdir(SHM_DIR) else None
    path = os.path.join(base or "/tmp", f"meshrl-weights-{os.getpid()}-{uuid.uuid4().hex}")
    segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    for (name, _, _, start), t in zip(manifest, prepared.values()):
        n = t.numel() * t.element_size()
        if n:
            segment[start : start + n].copy_(t.view(-1).view(torch.uint8))
    return SharedWeights(path=path, nbytes=nbytes, manifest=manifest)


def views_of_shared_memory(path: str, nbytes: int, manifest) -> dict[str, torch.Tensor]:
    """Map a segment written by `pack_to_shared_memory` and view each tensor (no copy)."""
    segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    out = {}
    for name, dtype_name, shape, start in manifest:
        dtype = getattr(torch, dtype_name)
        numel = 1
        for s in shape:
            numel *= s
        n = numel * dtype.itemsize
        out[name] = segment[start : start + n].view(dtype).view(shape)
    return out


class MeshrlWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called via collective_rpc.

    Method names carry a `meshrl_` prefix: vLLM refuses extensions whose attributes
    clash with the worker's own.
    """

    def meshrl_load_shared_weights(self, path: str, nbytes: int, manifest: list) -> int:
        """Load tensors from a shared-memory segment into the model; returns tensors loaded."""
        weights = views_of_shared_memory(path, nbytes, manifest)
        # In-place reload: model.load_weights on checkpoint-format tensors, then the
        # backend's process_weights_after_loading (CPU repacking) on the touched layers.
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)

    def meshrl_weights_checksum(self) -> float:
        """Sum of all parameters as float64 (tests: did the weights change?)."""
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum() for p in model.parameters()))
