"""Packing named tensors into one flat byte buffer cut into buckets.

The trainer's tensors are copied into a flat uint8 buffer (the staging snapshot); the
generator receives the same bytes into its own flat buffer and gets back views. A `Layout`
says where every tensor lives; it is computed once, sent once, and cached by its
`layout_id` (a fingerprint of names, shapes, dtypes and offsets), so a version moves bytes
only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from meshrl.weightsync.bytecopy import copy_pieces

ALIGN = 64
"""Every tensor starts on a 64-byte boundary, so views of any dtype are aligned."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    offset: int  # byte offset in the flat buffer
    nbytes: int


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorMeta, ...]
    buckets: tuple[tuple[int, int], ...]  # [start, end) byte ranges covering the buffer
    total_bytes: int
    layout_id: str

    def bucket_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The buckets of `flat` as 1-D contiguous uint8 slices (what RDMA and broadcasts move)."""
        return [flat[a:b] for a, b in self.buckets]

    def to_json(self) -> dict:
        """Plain data for a header another process reads (JSON: nothing in it runs when read)."""
        return {
            "tensors": [dataclasses.astuple(t) for t in self.tensors],
            "buckets": self.buckets,
            "total_bytes": self.total_bytes,
            "layout_id": self.layout_id,
        }

    @classmethod
    def from_json(cls, data: dict) -> "Layout":
        """`to_json`'s inverse; a field of the wrong kind (or an unknown dtype) raises ValueError."""
        try:
            tensors = tuple(TensorMeta(str(n), tuple(int(d) for d in shape), str(dt), int(o), int(b)) for n, shape, dt, o, b in data["tensors"])
            for t in tensors:
                dtype_from_name(t.dtype)
            return cls(tensors, tuple((int(a), int(b)) for a, b in data["buckets"]), int(data["total_bytes"]), str(data["layout_id"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a weight layout: {e}") from None


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Layout:
    """Place tensors in order, closing a bucket before the one that would overflow it.

    A tensor larger than `bucket_bytes` gets a bucket of its own; tensors are never split,
    so a bucket boundary is always a tensor start.
    """
    metas: list[TensorMeta] = []
    buckets: list[tuple[int, int]] = []
    bucket_start = offset = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        offset = _align(offset)
        if offset > bucket_start and offset + nbytes - bucket_start > bucket_bytes:
            buckets.append((bucket_start, offset))
            bucket_start = offset
        metas.append(TensorMeta(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), offset, nbytes))
        offset += nbytes
    total = max(_align(offset), ALIGN)
    buckets.append((bucket_start, total))
    digest = hashlib.sha1(repr((metas, buckets)).encode()).hexdigest()[:16]
    return Layout(tuple(metas), tuple(buckets), total, digest)


def allocate(layout: Layout, shared_memory: bool = False, pinned: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """A flat uint8 buffer for `layout`; in shared memory if another process must map it.
    `pinned`: page-locked, so copies from GPU tensors into it run at the link's speed
    (pageable memory goes through a bounce buffer); needs CUDA. `device`: a GPU-resident
    buffer (an NCCL broadcast's bucket source or target) instead of host memory."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    if shared_memory:
        flat = shared_file_buffer(layout.total_bytes)
        if pinned:
            _register_pinned(flat)
        return flat
    return torch.empty(layout.total_bytes, dtype=torch.uint8, pin_memory=pinned)


def _register_pinned(flat: torch.Tensor) -> None:
    """Page-lock memory torch did not allocate (a memfd mapping) for as long as it lives."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = flat.data_ptr(), flat.numel()
    status = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (status {int(status)})")
    weakref.finalize(flat.untyped_storage(), cudart.cudaHostUnregister, ptr)


def shared_file_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 buffer in an anonymous shared-memory file (memfd) that other processes on
    this host can map by name, `buffer.untyped_storage().filename` (/proc/<pid>/fd/<fd>),
    e.g. to load it into vLLM without a copy. The file has no directory entry, so nothing is
    left behind in /dev/shm even when the process is killed; the fd (and so the name) lives
    exactly as long as some tensor views the buffer."""
    fd = os.memfd_create("meshrl-weights")  # close-on-exec: spawned processes open it by name
    try:
        os.ftruncate(fd, nbytes)
        flat = torch.from_file(f"/proc/{os.getpid()}/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    # torch keeps one Python object per live storage, so this runs when the last view is gone.
    weakref.finalize(flat.untyped_storage(), os.close, fd)
    return flat


def pack(flat: torch.Tensor, layout: Layout, named: Iterable[tuple[str, torch.Tensor]], progress: Callable[[int], None] | None = None) -> None:
    """Copy `named` (same order, names, shapes and dtypes as `layout`) into `flat`.
    `progress(end)`, if given, is called as the copy advances: every byte of `flat` below
    `end` holds its final value."""
    host = []  # (dst, src) byte arrays, copied together at the end (see bytecopy)
    host_starts = []  # offset of each host tensor in `flat`
    count = 0
    device_copies = False
    named = iter(named)
    for meta, (name, t) in zip(layout.tensors, named):
        if name != meta.name or tuple(t.shape) != meta.shape or str(t.dtype).removeprefix("torch.") != meta.dtype:
            raise ValueError(f"tensor {name} {tuple(t.shape)} {t.dtype} does not match the layout entry {meta}")
        # Copy as raw bytes: a typed copy into a view of a big uint8 buffer took ~3 ms per
        # tensor whatever its size (measured); the byte copy runs at memcpy speed.
        src = t.detach().contiguous().view(-1).view(torch.uint8)
        dst = flat[meta.offset : meta.offset + meta.nbytes]
        if src.device.type == "cpu" and flat.device.type == "cpu":
            host.append((dst.numpy(), src.numpy()))
            host_starts.append(meta.offset)
        else:
            # a GPU on either side: queued without waiting (into pinned memory, or on the GPU
            # itself; the stream runs them in order), synchronised once below before any host
            # copy or progress report
            dst.copy_(src, non_blocking=flat.is_pinned() or flat.is_cuda)
            device_copies = True
        count += 1
    if count != len(layout.tensors):
        raise ValueError(f"got {count} tensors, the layout has {len(layout.tensors)}")
    extra = next(named, None)
    if extra is not None:
        raise ValueError(f"got tensor {extra[0]} beyond the layout's {len(layout.tensors)}")
    if device_copies:
        # this stream's copies only: a device-wide synchronize would also wait for a broadcast
        # that NCCL runs on its own stream from another slot
        torch.cuda.current_stream(flat.device if flat.is_cuda else None).synchronize()
    host_starts.append(layout.total_bytes)
    copy_pieces(host, None if progress is None else lambda done: progress(host_starts[done]))


def unpack(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views of every tensor in `flat` (no copy)."""
    out = {}
    for m in layout.tensors:
        out[m.name] = flat[m.offset : m.offset + m.nbytes].view(dtype_from_name(m.dtype)).view(m.shape)
    return out
