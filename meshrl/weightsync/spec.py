"""What the controller tells both ends of a weight transfer (small and picklable)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncSpec:
    transport: str  # "rdma" | "collective" | "files" | "shm"
    timeout_s: float
    files_dir: str | None = None
    # collective only: the controller's TCPStore, the group size and a name unique per
    # (re)connection, so a re-created group never meets the keys of a broken one
    store_host: str | None = None
    store_port: int | None = None
    world_size: int = 0
    group_name: str = ""
    backend: str = "gloo"
    """collective only: "gloo" (host buffers) or "nccl" (GPU-resident buckets, every peer on a GPU)."""


@dataclass(frozen=True)
class ReceivedInEngine:
    """What `Subscriber.fetch` hands out when the collective receiver lives in the engine's
    workers: the tensors stay there (on the GPU, on a GPU run) and the engine loads them in
    place (`VLLMEngine.load_received`)."""

    version: int
