"""Weight sync: time from "step done" (publish called) to "every subscriber holds the new
version", per transport and model size, next to the raw speed of the same transport moving
the same bytes in one piece (one big RDMA read, one broadcast of one flat buffer, one file
written then read; for `shm`, whose subscribers map the publisher's snapshot, one copy into
a shared-memory file), measured right after each timed version, under the same conditions
(the page cache and this VM's memory make single transfers vary several-fold), into a
destination buffer that is reused, as a subscriber's are. Both are reported as medians.

    python benchmarks/weight_sync.py --sizes tiny,10M,100M,500M --transports rdma,collective,files,shm

Prints a table and writes JSON (--out). `tiny` (about 0.1M parameters) gives the fixed
per-version overhead. Models are random tensors with the shapes of a Qwen3-like dense model.
With `--lora-rank R`, each size also gets a row for LoRA's adapter-only sync (rank R on the
seven projections of every layer, PEFT names), timed in the same run right after the full
model, with `adapter_over_full_time` (its sync time over the full model's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from monarch.actor import Actor, endpoint, this_host

from meshrl.config import WeightSyncConfig
from meshrl.weightsync.connect import WeightSync, sidecars
from meshrl.weightsync.publisher import Publisher, publisher_agent
from meshrl.weightsync.subscriber import Subscriber, subscriber_agent
from meshrl.weightsync.collective import broadcast_buckets, make_group

# name -> (dim, ffn, layers, vocab); about the named number of parameters
SIZES = {
    "tiny": (64, 128, 2, 512),
    "10M": (256, 1024, 6, 8192),
    "100M": (768, 2048, 8, 32000),
    "500M": (1536, 4096, 16, 32000),
}


def model_shapes(size: str) -> list[tuple[str, tuple[int, ...]]]:
    dim, ffn, layers, vocab = SIZES[size]
    kv = dim // 2
    shapes = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (dim,)),
            (p + "post_attention_layernorm.weight", (dim,)),
            (p + "self_attn.q_proj.weight", (dim, dim)),
            (p + "self_attn.k_proj.weight", (kv, dim)),
            (p + "self_attn.v_proj.weight", (kv, dim)),
            (p + "self_attn.o_proj.weight", (dim, dim)),
            (p + "self_attn.q_norm.weight", (64,)),
            (p + "self_attn.k_norm.weight", (64,)),
            (p + "mlp.gate_proj.weight", (ffn, dim)),
            (p + "mlp.up_proj.weight", (ffn, dim)),
            (p + "mlp.down_proj.weight", (dim, ffn)),
        ]
    return shapes + [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]


def adapter_shapes(size: str, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """A rank-`rank` LoRA adapter on every projection of `size`, as meshrl syncs it (PEFT names)."""
    out = []
    for name, shape in model_shapes(size):
        if name.endswith("_proj.weight"):
            module = "base_model.model." + name.removesuffix(".weight")
            out += [(module + ".lora_A.weight", (rank, shape[1])), (module + ".lora_B.weight", (shape[0], rank))]
    return out


class BenchTrainer(Actor):
    def __init__(self, cfg: dict):
        self.publisher = Publisher(WeightSyncConfig(**cfg))
        self.params: list[tuple[str, torch.Tensor]] = []

    @endpoint
    def weight_sync_key(self):
        return self.publisher.key

    @endpoint
    def build(self, size: str, dtype: str, lora_rank: int = 0) -> dict:
        self.params = []  # free the previous model first
        shapes = adapter_shapes(size, lora_rank) if lora_rank else model_shapes(size)
        self.params = [(n, torch.empty(s, dtype=getattr(torch, dtype)).normal_()) for n, s in shapes]
        return {"params": sum(t.numel() for _, t in self.params), "bytes": sum(t.numel() * t.element_size() for _, t in self.params)}

    @endpoint
    def publish(self, version: int) -> tuple[float, float]:
        """(wall time when publish was called, seconds publish blocked the caller)."""
        for _, p in self.params:
            p.add_(1)  # the "step" that made this version changes the live weights
        # Not after publish: on 2 cores the next step's CPU work would slow the transfer
        # down, which measures CPU contention rather than the transport (raw runs alone).
        start = time.time()
        copy_s = self.publisher.publish(version, self.params)
        return start, copy_s

    # ---- raw transport, same bytes in one piece --------------------------------------------
    def _flat(self) -> torch.Tensor:
        return self.publisher.pool.latest.flat

    @endpoint
    def raw_rdma_buffer(self):
        from monarch.rdma import RDMABuffer

        return RDMABuffer(self._flat())

    @endpoint
    def raw_group(self, spec) -> None:
        self._raw_store, self._raw_pg = make_group(spec, 0)

    @endpoint
    def raw_broadcast(self) -> float:
        broadcast_buckets(self._raw_pg, [self._flat()], 300.0)
        return time.time()

    @endpoint
    def raw_file_write(self, path: str) -> float:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(self._flat().numpy()))
        return time.perf_counter() - t0


class BenchGenerator(Actor):
    def __init__(self, cfg: dict):
        self.subscriber = Subscriber(WeightSyncConfig(**cfg), shared_memory=True)  # as the real generator
        self._dst = torch.empty(0, dtype=torch.uint8)

    def _raw_dst(self, nbytes: int) -> torch.Tensor:
        """The raw transfers' destination, allocated (and first touched) once per size."""
        if self._dst.numel() != nbytes:
            self._dst = torch.zeros(nbytes, dtype=torch.uint8)
        return self._dst

    @endpoint
    async def weight_sync_key(self):
        return self.subscriber.key

    @endpoint
    async def fetch(self, version: int) -> float:
        v, _ = await self.subscriber.fetch(version)
        assert v == version, (v, version)
        return time.time()

    @endpoint
    async def raw_rdma_read(self, buf, nbytes: int) -> float:
        dst = self._raw_dst(nbytes)
        t0 = time.perf_counter()
        await buf.read_into(dst, timeout=300)
        return time.perf_counter() - t0

    @endpoint
    async def raw_group(self, spec, rank: int) -> None:
        self._raw_store, self._raw_pg = await asyncio.to_thread(make_group, spec, rank)

    @endpoint
    async def raw_broadcast(self, nbytes: int) -> float:
        dst = self._raw_dst(nbytes)
        await asyncio.to_thread(broadcast_buckets, self._raw_pg, [dst], 300.0)
        return time.time()

    @endpoint
    async def raw_file_read(self, path: str) -> float:
        from meshrl.weightsync.files import read_into

        dst = self._raw_dst(os.path.getsize(path))
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            read_into(f, dst, dst.numel())
        return time.perf_counter() - t0


async def raw_time(transport: str, trainer, gens, ws: WeightSync, nbytes: int, n_gens: int, tmpdir: str) -> float:
    """Seconds for the same bytes, in one piece, to reach every subscriber."""
    if transport == "rdma":
        buf = await trainer.raw_rdma_buffer.call_one()
        return max(t for _, t in (await gens.raw_rdma_read.call(buf, nbytes)).items())
    if transport == "collective":
        t0 = time.time()
        ends = await asyncio.gather(trainer.raw_broadcast.call_one(), gens.raw_broadcast.call(nbytes))
        return max([ends[0]] + [t for _, t in ends[1].items()]) - t0
    if transport == "shm":  # the least a handoff through shared memory costs: one copy into a shared file
        path = os.path.join("/dev/shm", f"meshrl-raw-{os.getpid()}.bin")
        write_s = await trainer.raw_file_write.call_one(path)
        os.remove(path)
        return write_s
    path = os.path.join(tmpdir, "raw.bin")
    write_s = await trainer.raw_file_write.call_one(path)
    read_s = max(t for _, t in (await gens.raw_file_read.call(path)).items())
    os.remove(path)
    return write_s + read_s


async def bench_transport(transport: str, sizes: list[str], args) -> list[dict]:
    tmpdir = tempfile.mkdtemp(prefix="meshrl-bench-")
    cfg = dict(transport=transport, bucket_mb=args.bucket_mb, timeout_s=120.0, files_dir=os.path.join(tmpdir, "w"))
    trainer_procs = this_host().spawn_procs(per_host={"procs": 1})
    gen_procs = this_host().spawn_procs(per_host={"procs": args.subscribers})
    rows = []
    try:
        trainer = trainer_procs.spawn("trainer", BenchTrainer, cfg)
        gens = gen_procs.spawn("gens", BenchGenerator, cfg)
        pub = publisher_agent(trainer_procs, await trainer.weight_sync_key.call_one())
        subs = sidecars(gen_procs, await gens.weight_sync_key.call(), subscriber_agent)
        ws = await WeightSync(WeightSyncConfig(**cfg)).connect(pub, subs)
        if transport == "collective":
            spec = ws.spec(args.subscribers)
            await asyncio.gather(
                trainer.raw_group.call_one(spec), *[g.raw_group.call_one(spec, r + 1) for r, g in enumerate(subs_actors(gens, args.subscribers))]
            )
        version = 0
        runs = [(size, rank) for size in sizes for rank in ([0, args.lora_rank] if args.lora_rank else [0])]
        for size, rank in runs:
            info = await trainer.build.call_one(size, args.dtype, rank)
            times, copies, raws = [], [], []
            for i in range(args.versions + 2):  # two warm-up versions: both staging slots allocated, registered
                version += 1
                waiting = gens.fetch.call(version)
                await asyncio.sleep(0.05)  # subscribers are waiting when the step ends
                start, copy_s = await trainer.publish.call_one(version)
                done = max(t for _, t in (await waiting).items())
                if i > 1:
                    times.append(done - start)
                    copies.append(copy_s)
                    raws.append(await raw_time(transport, trainer, gens, ws, info["bytes"], args.subscribers, tmpdir))
            raw = statistics.median(raws)
            sync_s = statistics.median(times)
            row = {
                "transport": transport,
                "size": f"{size}+lora{rank}" if rank else size,
                "params": info["params"],
                "bytes": info["bytes"],
                "sync_s": sync_s,
                "sync_min_s": min(times),
                "sync_times_s": times,
                "publish_copy_s": statistics.median(copies),
                "raw_s": raw,
                "raw_min_s": min(raws),
                "raw_times_s": raws,
                "sync_GBps": info["bytes"] * args.subscribers / sync_s / 1e9,
                "raw_GBps": info["bytes"] * args.subscribers / raw / 1e9,
                "fraction_of_raw": raw / sync_s,
            }
            if rank:  # the full model of this size was timed just before, in this run
                full = next(r for r in reversed(rows) if r["size"] == size)
                row.update(adapter_over_full_time=sync_s / full["sync_s"], adapter_over_full_bytes=info["bytes"] / full["bytes"])
            rows.append(row)
            print(
                f"{transport:10s} {row['size']:>5s} {info['params'] / 1e6:8.1f}M {info['bytes'] / 2**20:9.1f} MiB "
                f"sync {sync_s * 1e3:8.1f} ms  copy {row['publish_copy_s'] * 1e3:7.1f} ms  raw {raw * 1e3:8.1f} ms  "
                f"fraction {row['fraction_of_raw']:5.2f}",
                flush=True,
            )
    finally:
        await gen_procs.stop()
        await trainer_procs.stop()
        shutil.rmtree(tmpdir, ignore_errors=True)
    return rows


def subs_actors(gens, n: int) -> list:
    return [gens.slice(procs=i) for i in range(n)]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,10M,100M,500M", help=f"comma list of {','.join(SIZES)}")
    ap.add_argument("--transports", default="rdma,collective,files,shm")
    ap.add_argument("--subscribers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--lora-rank", type=int, default=0, help="also time each size's rank-R LoRA adapter (0: off)")
    ap.add_argument("--versions", type=int, default=3, help="timed versions per size (after two warm-ups)")
    ap.add_argument("--out", default="benchmarks/results/weight_sync.json")
    args = ap.parse_args()
    from common import machine

    measured_on = machine()
    sizes = args.sizes.split(",")
    rows = []
    t0 = time.monotonic()
    for transport in args.transports.split(","):
        rows += await bench_transport(transport, sizes, args)
    print("\n| transport | size | params | MiB | sync ms | publish copy ms | raw ms | fraction of raw | overhead ms (tiny) |")
    print("|---|---|---|---|---|---|---|---|---|")
    tiny = {r["transport"]: r["sync_s"] for r in rows if r["size"] == "tiny"}
    for r in rows:
        print(
            f"| {r['transport']} | {r['size']} | {r['params'] / 1e6:.1f}M | {r['bytes'] / 2**20:.0f} | {r['sync_s'] * 1e3:.1f} | "
            f"{r['publish_copy_s'] * 1e3:.1f} | {r['raw_s'] * 1e3:.1f} | {r['fraction_of_raw']:.2f} | "
            f"{tiny.get(r['transport'], float('nan')) * 1e3:.1f} |"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": measured_on, "rows": rows, "per_version_overhead_s": tiny, "wall_s": time.monotonic() - t0}, f, indent=2)
    print(f"\nwrote {args.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    asyncio.run(main())
