"""GPU checks of the weight path's pure cores, torch only: skipped where there is no CUDA.

On a GPU machine with torch and this source tree (no Monarch or vLLM needed):

    python -m pytest -q tests/test_cuda.py

They pin what the CPU suite cannot: packing into GPU-resident buckets, GPU staging slots,
and the collective transport between GPU buckets in two processes (NCCL with two GPUs or
more; with one, gloo moving the same CUDA tensors, as NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from meshrl.weightsync.buffers import ReceiveBuffers
from meshrl.weightsync.collective import CollectiveReceiver, CollectiveSender, wait_latest
from meshrl.weightsync.layout import allocate, pack, plan_layout, unpack
from meshrl.weightsync.spec import SyncSpec
from meshrl.weightsync.staging import StagingPool
from tests.conftest import child_process

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def model(version: int, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    shapes = [(512, 256), (256,), (1000, 64), (3, 5, 7)]
    return [(f"layer{i}.w", (torch.randn(s, generator=g) * (version + 1)).to(torch.bfloat16).to(device)) for i, s in enumerate(shapes)]


def published_on_gpu(version: int):
    """A staging pool on GPU 0 (two slots, as a GPU run's publisher keeps) holding `version`."""
    pool = StagingPool(lease_timeout_s=60.0)
    pool.use_device(torch.device("cuda", 0), max_slots=2)
    named = model(version, "cuda")
    layout = plan_layout(named, 1 << 18)
    pool.publish(version, layout, named)
    return pool, named, layout


def test_packing_into_a_gpu_bucket_equals_packing_into_host_memory():
    for device in ("cuda", "cpu"):  # GPU tensors, and host tensors into a GPU bucket
        named = model(1, device)
        layout = plan_layout(named, 1 << 18)
        host = allocate(layout)
        pack(host, layout, [(n, t.cpu()) for n, t in named])
        bucket = allocate(layout, device=torch.device("cuda"))
        assert bucket.is_cuda
        pack(bucket, layout, named)
        assert torch.equal(bucket.cpu(), host)
        assert all(torch.equal(v.cpu(), t.cpu()) for v, (_, t) in zip(unpack(bucket, layout).values(), named))


def test_gpu_staging_slots_hold_each_version_apart():
    pool, named, layout = published_on_gpu(1)
    lease = pool.acquire(1)
    pool.publish(2, layout, model(2, "cuda"))  # the leased slot is not overwritten
    assert lease.slot.flat.is_cuda and lease.version == 1
    assert torch.equal(unpack(lease.slot.flat, layout)["layer0.w"], named[0][1])
    assert pool.release(lease)


def _receive(spec: SyncSpec, device: int, out) -> None:
    torch.cuda.set_device(device)
    buffers = ReceiveBuffers(device=torch.device("cuda", device), max_buffers=2)
    receiver = CollectiveReceiver(spec, 1, buffers)
    import time

    version, flat = wait_latest(buffers, receiver, 3, time.monotonic() + 60)
    views = buffers.hand_out(version, flat)
    out.put((version, flat.is_cuda, {k: v.float().sum().item() for k, v in views.items()}))
    receiver.close()


def test_a_version_moves_between_gpu_buckets_in_two_processes():
    from meshrl.compat import tcp_store_listening_on

    two = torch.cuda.device_count() >= 2
    store = tcp_store_listening_on("127.0.0.1", timedelta(seconds=60))
    spec = SyncSpec("collective", 60.0, store_host="127.0.0.1", store_port=store.port, world_size=2, group_name="cuda-test/", on_gpu=two)
    with child_process(_receive, spec, 1 if two else 0) as out:
        pool = StagingPool(lease_timeout_s=60.0)
        pool.use_device(torch.device("cuda", 0), max_slots=2)
        sender = CollectiveSender(pool, spec)  # returns once both ranks joined
        for version in (1, 2, 3):
            named = model(version, "cuda")
            pool.publish(version, plan_layout(named, 1 << 18), named)
        version, on_gpu, sums = out.get(timeout=120)
        assert version == 3 and on_gpu
        assert sums == {n: t.float().sum().item() for n, t in model(3, "cuda")}
        assert sender.error is None
        sender.close()


def _open_and_sum(blob: bytes, out) -> None:
    import pickle

    from meshrl.weightsync.shared import open_ipc

    handle, layout = pickle.loads(blob)
    flat = open_ipc(handle)
    out.put((flat.is_cuda, {k: v.float().sum().item() for k, v in unpack(flat, layout).items()}))


def test_a_gpu_slot_is_read_in_another_process_through_a_cuda_ipc_handle():
    """placement=colocate on one GPU: the engine's worker opens the trainer's GPU staging slot
    by its IPC handle (weightsync.spec.GpuSlot) and reads that version, with no host copy."""
    import pickle

    from meshrl.weightsync.shared import ipc_handle

    pool, named, layout = published_on_gpu(4)
    lease = pool.acquire(4)
    try:
        with child_process(_open_and_sum, pickle.dumps((ipc_handle(lease.slot.flat), layout))) as out:
            on_gpu, sums = out.get(timeout=120)
            assert on_gpu and sums == {n: t.float().sum().item() for n, t in named}
    finally:
        pool.release(lease)


def test_a_head_with_a_bias_returns_float32_from_half_weights():
    """The critic's value head has a bias: it fell back to bf16's F.linear, and a sharded
    critic's values came in steps of 0.004 near 1 while an unsharded one's were float32."""
    from meshrl.trainer.head import float32_logits

    head = torch.nn.Linear(64, 1, bias=True).to("cuda", torch.bfloat16)
    with torch.no_grad():
        head.bias.fill_(0.3)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    float32_logits(head)
    out = head(x)
    want = x.float() @ head.weight.float().t() + head.bias.float()
    assert out.dtype == torch.float32 and torch.allclose(out, want, atol=1e-3)
    out.sum().backward()
    assert head.bias.grad.dtype == torch.bfloat16 and head.bias.grad.item() == 8.0 and x.grad.dtype == torch.bfloat16
