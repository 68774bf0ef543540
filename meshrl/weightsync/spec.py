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
    on_gpu: bool = False
    """Every peer holds a GPU: the versions stay in GPU memory. `collective` broadcasts GPU
    buckets over NCCL (else gloo between host buffers); `shm` hands the engines CUDA IPC
    handles of the trainer's GPU slot (else they map its shared-memory file)."""


@dataclass(frozen=True)
class GpuSlot:
    """What `Subscriber.fetch` hands out with `shm` when the trainer's staging slot is on the
    GPU the engine shares (placement=colocate on one GPU): a CUDA IPC handle of the slot with
    its layout, pickled (`shared.ipc_handle`). The engine opens it and loads in place
    (`VLLMEngine.load_gpu_slot`); it is valid while the subscriber holds the lease."""

    version: int
    blob: bytes


@dataclass(frozen=True)
class ReceivedInEngine:
    """What `Subscriber.fetch` hands out when the collective receiver lives in the engine's
    workers: the tensors stay there (on the GPU, on a GPU run) and the engine loads them in
    place (`VLLMEngine.load_received`)."""

    version: int
