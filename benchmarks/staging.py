"""Staging a version's weights: meshrl's pack against a raw copy of the same bytes, torch only.

    python benchmarks/staging.py --size 8B --repeats 5 --out benchmarks/results/staging.json

Tensors with the shapes of a Qwen3 dense model of the named size, in bfloat16, on the GPU
when there is one (else on the CPU: only the host rows run). Rows, each a median over
`--repeats`, each beside its reference measured in the same run:
- `pack_pageable` / `pack_pinned`: `weightsync.layout.pack` into a host buffer allocated as
  the staging pool allocates it without and with page-locking, against `raw_pinned`: one
  copy of the same bytes from one device buffer into pinned memory (the link's speed).
- `pack_device`: the same pack into one GPU-resident buffer, against `raw_device`: one
  device-to-device copy of the same bytes (GPU only).
- `ipc_handoff`: a second process on the same GPU, already running with its CUDA context,
  opens the packed buffer through a CUDA IPC handle and reads a strided sample of it;
  `ipc_read_in_child` is the read alone (GPU only).
Needs nothing of meshrl but its pure weight path (no Monarch, no vLLM), so it runs on a
bare machine with torch. The CPU flags and the device name are recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from meshrl.weightsync import plan_layout
from meshrl.weightsync.layout import allocate, pack

# name -> (dim, ffn, layers, vocab, kv heads x head dim)
SIZES = {"100M": (768, 2048, 8, 32000, 256), "1B": (2048, 6144, 16, 151936, 1024), "8B": (4096, 12288, 36, 151936, 1024)}


def model(size: str, device: str) -> list[tuple[str, torch.Tensor]]:
    dim, ffn, layers, vocab, kv = SIZES[size]
    shapes = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (dim, dim)),
            (p + "self_attn.k_proj.weight", (kv, dim)),
            (p + "self_attn.v_proj.weight", (kv, dim)),
            (p + "self_attn.o_proj.weight", (dim, dim)),
            (p + "mlp.gate_proj.weight", (ffn, dim)),
            (p + "mlp.up_proj.weight", (ffn, dim)),
            (p + "mlp.down_proj.weight", (dim, ffn)),
            (p + "input_layernorm.weight", (dim,)),
            (p + "post_attention_layernorm.weight", (dim,)),
        ]
    shapes += [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]
    return [(name, torch.empty(shape, dtype=torch.bfloat16, device=device).normal_()) for name, shape in shapes]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up allocations and kernels
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _ipc_child(queue, done) -> None:
    torch.cuda.init()
    done.put("ready")  # timing starts once this process and its CUDA context are up
    flat = queue.get()  # rebuilt from its CUDA IPC handle: the parent's memory, no copy
    t0 = time.perf_counter()
    total = float(flat[:: 1 << 20].float().sum())
    torch.cuda.synchronize()
    done.put((time.perf_counter() - t0, total))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8B", choices=sorted(SIZES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    named = model(args.size, device)
    layout = plan_layout(named, 512 << 20)
    gb = layout.total_bytes / 1e9
    rows: dict[str, float] = {}

    source = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    pageable = allocate(layout)
    rows["pack_pageable"] = timed(lambda: pack(pageable, layout, named), args.repeats)
    if cuda:
        pinned = allocate(layout, pinned=True)
        rows["raw_pinned"] = timed(lambda: pinned.copy_(source, non_blocking=True), args.repeats)
        rows["pack_pinned"] = timed(lambda: pack(pinned, layout, named), args.repeats)
        on_device = torch.empty(layout.total_bytes, dtype=torch.uint8, device="cuda")
        rows["raw_device"] = timed(lambda: on_device.copy_(source), args.repeats)
        rows["pack_device"] = timed(lambda: pack(on_device, layout, named), args.repeats)
        ctx = mp.get_context("spawn")
        queue, done = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_ipc_child, args=(queue, done))
        child.start()
        assert done.get(timeout=300) == "ready"
        t0 = time.perf_counter()
        queue.put(on_device)
        read_s, _ = done.get(timeout=300)
        rows["ipc_handoff"] = time.perf_counter() - t0
        rows["ipc_read_in_child"] = read_s
        child.join(60)
    else:
        raw = torch.empty(layout.total_bytes, dtype=torch.uint8)
        rows["raw_host"] = timed(lambda: raw.copy_(source), args.repeats)

    ratios = {}
    if cuda:
        ratios["pack_pinned_over_raw_pinned_speed"] = rows["raw_pinned"] / rows["pack_pinned"]
        ratios["pack_pageable_over_raw_pinned_speed"] = rows["raw_pinned"] / rows["pack_pageable"]
        ratios["pack_device_over_raw_device_speed"] = rows["raw_device"] / rows["pack_device"]
    else:
        ratios["pack_over_raw_host_speed"] = rows["raw_host"] / rows["pack_pageable"]
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split() if platform.system() == "Linux" else []
    result = {
        "size": args.size,
        "tensors": len(named),
        "gigabytes": gb,
        "seconds": rows,
        "gb_per_s": {k: gb / v for k, v in rows.items() if k != "ipc_read_in_child"},
        "ratios": ratios,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cpu_flags": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")),
    }
    for k, v in rows.items():
        print(f"{k:>20}: {v * 1e3:9.1f} ms  {gb / v:8.1f} GB/s")
    for k, v in ratios.items():
        print(f"{k:>40}: {v:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
