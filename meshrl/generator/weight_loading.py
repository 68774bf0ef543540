"""Getting full Hugging Face-named tensors into a running vLLM engine.

`AsyncLLM` always runs its engine core (and, at tp=1, the model) in a separate process,
so new weights must cross a process boundary. Tensors do not survive vLLM's RPC
serialisation, so only a small manifest (names, dtypes, shapes, offsets into shared-memory
segments) goes through `collective_rpc`. Tensors fetched by weight sync already live in a
shared-memory file (the subscriber's receive buffer): they are described where they are,
with no copy. Any other tensor (or one that needs a dtype cast) is packed into ONE new
segment (/dev/shm, RAM, never a disk file). The worker extension below maps the segments,
views each tensor in place (no copy) and runs vLLM's in-place reload (`model_runner.
reload_weights(weights_iterator=...)`), which calls the model's own `load_weights` and
then the backend's post-load processing (the CPU backend repacks linear weights; loading
tensors without that step leaves unusable parameters).
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64  # byte alignment of each tensor inside the segment


@dataclass
class SharedWeights:
    """A shared-memory segment holding tensors of one version; `unlink` when loaded."""

    path: str
    nbytes: int
    manifest: list[tuple[str, str, list[int], int]]
    """(name, dtype name, shape, byte offset) per tensor."""
    owned: bool = True
    """False: someone else's buffer (a weight-sync receive buffer), described in place."""

    def unlink(self) -> None:
        if not self.owned:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


KEEP_FLOAT32 = ("e_score_correction_bias",)
"""Tensors (by the end of their HF name) vLLM holds in float32 whatever the model's dtype, as the
trainer publishes them: DeepSeek-V3's router bias (vLLM's deepseek_v2.py). Cast to the engine's
bfloat16 on the way, its load-balancing updates (about 1e-3) vanished and the engine routed by
another bias than the trainer's."""


def _as(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `t` is loaded as: floating ones as the engine's `dtype`, but KEEP_FLOAT32's."""
    if dtype is None or not t.is_floating_point() or (t.dtype == torch.float32 and name.endswith(KEEP_FLOAT32)):
        return t.dtype
    return dtype


def to_shared_memory(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[SharedWeights]:
    """Shared-memory segments holding `tensors` (floating ones as `dtype` when given): views
    of a shared file that need no cast are described in place, the rest copied into one
    new segment."""
    in_place: dict[str, SharedWeights] = {}
    to_copy = {}
    for name, t in tensors.items():
        where = _shared_file_of(t, _as(name, t, dtype))
        if where is None:
            to_copy[name] = t
            continue
        path, nbytes, offset = where
        segment = in_place.setdefault(path, SharedWeights(path, nbytes, [], owned=False))
        segment.manifest.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
    segments = list(in_place.values())
    if to_copy:
        segments.append(pack_to_shared_memory(to_copy, dtype))
    return segments


def _shared_file_of(t: torch.Tensor, dtype: torch.dtype) -> tuple[str, int, int] | None:
    """(path, bytes, byte offset of `t`) of the shared file mapping `t` is a plain view of, if
    another process can read `t` from it as is; None otherwise."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    if t.dtype != dtype:
        return None
    storage = t.untyped_storage()
    path = storage.filename  # set only for shared file mappings (torch.from_file(shared=True))
    if path is None:
        return None
    return path, storage.nbytes(), t.storage_offset() * t.element_size()


def pack_to_shared_memory(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> SharedWeights:
    """Copy `tensors` (cast to `dtype` when given) into one new shared-memory segment."""
    manifest, offset = [], 0
    prepared = {}
    for name, t in tensors.items():
        t = t.detach().to(_as(name, t, dtype)).contiguous().cpu()
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
    """Map a segment described by `to_shared_memory` and view each tensor (no copy)."""
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


def _cast(views: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """Floating tensors as `dtype` (the engine's; KEEP_FLOAT32's as they are), the rest as they are."""
    cast = getattr(torch, dtype) if dtype else None
    return {k: v.to(_as(k, v, cast)) for k, v in views.items()}


class WorkerReceive:
    """The collective weight receiver a vLLM worker runs (`meshrl_ws_*`): joins the group in
    a thread, then receives every broadcast version into buffers. Where every peer holds a
    GPU (SyncSpec.on_gpu) the buffers are this GPU's memory and the group NCCL: a version goes
    from the trainer's GPU buckets to this GPU and into the model without touching the host,
    and the GPU keeps two copies of the model's bytes at most (the newest version and the one
    being received), which the memory plan counts outside generator.gpu_memory_utilization.
    Otherwise (a CPU trainer beside GPU engines, or no GPU) they are host memory and the
    group gloo, and the load copies each tensor to the engine's device."""

    def __init__(self, spec, rank: int, device: torch.device):
        from meshrl.weightsync.buffers import ReceiveBuffers

        on_gpu = device.type == "cuda" and spec.on_gpu
        self.buffers = ReceiveBuffers(device=device if on_gpu else None, max_buffers=2 if on_gpu else 3)
        self.receiver = None
        self.error: BaseException | None = None
        self.loaded_version = -1
        self._closed = threading.Event()
        threading.Thread(target=self._join, args=(spec, rank, device), name="meshrl-ws-join", daemon=True).start()

    def _join(self, spec, rank: int, device: torch.device) -> None:
        from meshrl.weightsync.collective import CollectiveReceiver

        try:
            if spec.on_gpu:
                torch.cuda.set_device(device)  # the current device is per thread, NCCL's too
            receiver = CollectiveReceiver(spec, rank, self.buffers)
        except BaseException as e:  # noqa: BLE001 - reported by joined()
            self.error = e
            return
        self.receiver = receiver
        if self._closed.is_set():
            receiver.close()

    def close(self) -> None:
        self._closed.set()
        if self.receiver is not None:
            self.receiver.close()

    def joined(self) -> bool:
        if self.error is not None:
            raise RuntimeError(f"joining the weight-sync group failed: {self.error}")
        return self.receiver is not None

    def take(self, min_version: int) -> int:
        error = self.error or (self.receiver.error if self.receiver is not None else None)
        if error is not None:
            raise RuntimeError(f"weight receive failed: {error}")
        with self.buffers.lock:
            self.buffers.take_latest(min_version)
            held = self.buffers.handed_out
            return held[0] if held is not None and held[0] >= min_version else -1


class MeshrlWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called via collective_rpc.

    Method names carry a `meshrl_` prefix: vLLM refuses extensions whose attributes
    clash with the worker's own.
    """

    def meshrl_load_shared_weights(self, segments: list) -> int:
        """Load tensors from shared-memory segments, given as (path, nbytes, manifest), into
        the model; returns tensors loaded."""
        weights = {}
        for path, nbytes, manifest in segments:
            weights.update(views_of_shared_memory(path, nbytes, manifest))
        return self._meshrl_reload(weights)

    def _meshrl_reload(self, weights: dict) -> int:
        # In-place reload: model.load_weights on checkpoint-format tensors, then the
        # backend's process_weights_after_loading (CPU repacking) on the touched layers.
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from meshrl.compat import vllm_cpu_moe_prepack_after_reload

            vllm_cpu_moe_prepack_after_reload(self.model_runner.get_model(), set(weights))
        return len(weights)

    def meshrl_load_adapter(self, segments: list, peft_config: dict, adapter_id: int) -> int:
        """Replace LoRA adapter `adapter_id` by the PEFT-named tensors in the segments, and
        make it active; returns tensors loaded. Requests naming the adapter use it from the
        engine's next step on (the engine is paused while this runs)."""
        weights = {}
        for path, nbytes, manifest in segments:
            weights.update(views_of_shared_memory(path, nbytes, manifest))
        return self._meshrl_set_adapter(weights, peft_config, adapter_id)

    def _meshrl_set_adapter(self, weights: dict, peft_config: dict, adapter_id: int) -> int:
        # The tensors are cloned: vLLM keeps the adapter's own tensors, while the buffers they
        # came from are reused or unlinked.
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        weights = {k: v.to("cpu", copy=True) for k, v in weights.items()}
        worker_manager = self.model_runner.lora_manager
        helper = PEFTHelper.from_dict(peft_config)
        helper.validate_legal(worker_manager.lora_config)
        # on the host, as vLLM's own loader keeps them: activation copies them into the layers' buffers
        lora = LoRAModel.from_lora_tensors(
            adapter_id, weights, helper, device="cpu", dtype=worker_manager.lora_config.lora_dtype, model_vocab_size=worker_manager.vocab_size
        )
        manager = worker_manager._adapter_manager
        manager.remove_adapter(adapter_id)
        manager.add_adapter(lora)
        manager.activate_adapter(adapter_id)
        return len(weights)

    def meshrl_load_ipc(self, blob: bytes, dtype: str | None, adapter: tuple | None = None) -> int:
        """Load a version from the trainer's GPU staging slot, named by a CUDA IPC handle and
        its layout (weightsync.spec.GpuSlot), in place (floating tensors cast to `dtype`);
        with `adapter` = (peft config, id), into the LoRA adapter. Returns tensors loaded."""
        import pickle

        from meshrl.weightsync.layout import unpack
        from meshrl.weightsync.shared import open_ipc

        handle, layout = pickle.loads(blob)
        flat = open_ipc(handle)
        weights = _cast(unpack(flat, layout), dtype)
        loaded = self._meshrl_set_adapter(weights, *adapter) if adapter else self._meshrl_reload(weights)
        torch.cuda.current_stream().synchronize()  # every copy out of the slot is done before its lease ends
        return loaded

    # ---- weight sync received by the worker itself (the collective transport) ----------------
    def meshrl_ws_connect(self, spec: dict, first_rank: int) -> int:
        """Join the weight-sync broadcast group `spec` (a SyncSpec's fields) as rank
        `first_rank` + this worker's rank, into buffers on this worker's device (its GPU, or
        host memory). The group forms when every peer has joined, so the join runs in a
        thread and the engine serves meanwhile (`meshrl_ws_joined` reports it). Returns the rank."""
        from meshrl.weightsync.spec import SyncSpec

        self.meshrl_ws_close()
        self._meshrl_ws = WorkerReceive(SyncSpec(**spec), first_rank + self.rank, self.device)
        return first_rank + self.rank

    def meshrl_ws_close(self) -> None:
        if getattr(self, "_meshrl_ws", None) is not None:
            self._meshrl_ws.close()
            self._meshrl_ws = None

    def meshrl_ws_joined(self) -> bool:
        """Whether the group has formed (raises the join's error if it failed)."""
        return self._meshrl_ws.joined()

    def meshrl_ws_take(self, min_version: int) -> int:
        """Hand out the newest received version if it is >= min_version, for `meshrl_ws_load`;
        returns the version handed out (the one already handed out, if no newer arrived), or
        -1 if none is >= min_version yet. Raises the receiver's error if it failed."""
        return self._meshrl_ws.take(min_version)

    def meshrl_ws_load(self, version: int, dtype: str | None, adapter: tuple | None = None) -> int:
        """Load the handed-out `version` into the model (or, with `adapter` = (peft config, id),
        into the LoRA adapter) from the receive buffer in place, floating tensors cast to
        `dtype`; then the buffer serves the next receive (after a failed load it stays handed
        out, for a retry). Returns tensors loaded; 0 when `version` is the one loaded last
        (nothing to do)."""
        ws = self._meshrl_ws
        got = ws.buffers.handed_out
        if got is None or got[0] != version:
            if version == ws.loaded_version:
                return 0
            raise RuntimeError(f"weight version {version} was not handed out in this worker (have {got[0] if got else None})")
        weights = _cast(got[2], dtype)
        loaded = self._meshrl_set_adapter(weights, *adapter) if adapter else self._meshrl_reload(weights)
        if ws.buffers.device is not None:
            torch.cuda.current_stream().synchronize()  # every copy out of the buffer is done before the next receive reuses it
        # Only now: a failed load keeps the version handed out, so the generator's retry loads it again.
        ws.buffers.drop_handed_out()
        ws.loaded_version = version
        return loaded

    def meshrl_no_collection_at_exit(self) -> None:
        """The engine's processes exit without a last collector pass, as meshrl's procs do."""
        from meshrl.collector import no_collection_at_exit

        no_collection_at_exit()

    def meshrl_eager_token_ranks(self) -> None:
        """On CPU: the sampler's token ranks counted without torch.compile (compat.py)."""
        from meshrl.compat import vllm_cpu_eager_token_ranks

        vllm_cpu_eager_token_ranks()

    def meshrl_hold_sigterm(self, hold: bool) -> bool:
        """SIGTERM kept ignored in this engine process, or vLLM's handler back (compat.py)."""
        from meshrl.compat import vllm_engine_holds_sigterm

        return vllm_engine_holds_sigterm(self, hold)

    def meshrl_set_logit_scale(self, scale: float) -> int:
        """Multiply the logits by `scale` (relative to the model's own logit scale): a scoring
        engine's logit temperature (VLLMEngine.set_logit_temperature). vLLM's LogitsProcessor
        applies its `scale` after any soft-cap, to the logits both sampling and prompt
        log-probs read. Returns the processors changed; a model with none is an error."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        changed = 0
        for module in self.model_runner.get_model().modules():
            if isinstance(module, LogitsProcessor):
                base = module.__dict__.setdefault("_meshrl_base_scale", module.scale)
                module.scale = base * scale
                changed += 1
        if not changed:
            raise RuntimeError("no LogitsProcessor in the model: cannot scale its logits")
        return changed

    def meshrl_capture_routing(self) -> list[int]:
        """Record every request's routed experts on this V1 worker (generator.routing_capture);
        returns the [layers, top-k] shape of a token's row."""
        from meshrl.generator.routing_capture import RoutingCapture

        if getattr(self, "_meshrl_routing", None) is None:
            self._meshrl_routing = RoutingCapture.install(self.model_runner)
        return list(self._meshrl_routing.step.shape[1:])

    def meshrl_routed_experts(self, requests: list[tuple[str, int]]) -> list[bytes | None]:
        """For each (request id, sampled tokens n): its [n, layers, top-k] int16 expert ids as
        bytes (tensors do not cross vLLM's RPC), or None if this worker saw no such request."""
        capture = self._meshrl_routing
        out = []
        for request_id, n in requests:
            rows = capture.take(request_id, n)
            out.append(None if rows is None else rows.numpy().tobytes())
        return out

    def meshrl_weights_checksum(self) -> float:
        """Sum of all parameters as float64 (tests: did the weights change?)."""
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum() for p in model.parameters()))
