"""Trainer throughput: a 2-proc FSDP2 Monarch mesh vs one process, same model, same batches.

Prints a table and a JSON line. Tokens/s counts loss tokens (response tokens) per
optimizer step. The single process runs with 1 thread and with all threads; each mesh
proc uses its share of the host's cores (TrainerActor.setup).

    python benchmarks/trainer_throughput.py [--steps 3] [--procs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import torch

from meshrl.config import Config
from meshrl.episode import Episode, Turn, assign_advantages, pack
from meshrl.trainer.actor import spawn_trainer
from meshrl.trainer.policy import PolicyTrainer

MODEL = {"family": "qwen3", "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 768, "vocab_size": 128}


def make_batch(groups: int, group_size: int, prompt_len: int, response_len: int, seed: int):
    """A rollout batch of single-turn episodes (prompt, then one model turn of version 0)."""
    rng = random.Random(seed)
    episodes = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, 100) for _ in range(prompt_len - 1)]
        for k in range(group_size):
            resp = [rng.randrange(3, 100) for _ in range(response_len)]
            turns = [Turn("env", list(prompt)), Turn("model", resp, [-2.0] * response_len, [0] * response_len, reward=rng.random(), finish_reason="length")]
            episodes.append(Episode(g, g * group_size + k, turns, finish_reason="length"))
    return assign_advantages(pack(episodes), "grpo")


def summarize(name: str, times: list[float], tokens: int) -> dict:
    med = statistics.median(times)
    return {"setup": name, "step_s_median": round(med, 4), "tokens_per_step": tokens, "tokens_per_s": round(tokens / med, 1)}


async def bench_mesh(config: Config, batches) -> list[float]:
    mesh = await spawn_trainer(config)
    try:
        await mesh.train_step(batches[0])  # warm-up: first-call costs, allocator
        times = []
        for b in batches[1:]:
            t0 = time.perf_counter()
            await mesh.train_step(b)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        await mesh.stop()


def bench_single(config: Config, batches) -> list[float]:
    trainer = PolicyTrainer(config, torch.device("cpu"))
    trainer.train_step(batches[0])
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        trainer.train_step(b)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=48)
    args = p.parse_args()
    batches = [make_batch(args.groups, args.group_size, args.prompt_len, args.response_len, s) for s in range(args.steps + 1)]
    tokens = int(batches[0]["loss_mask"].sum())
    base = {"model": MODEL, "trainer": {"micro_batch_size": 16, "lr": 1e-4}}
    single_cfg = Config.from_dict({**base, "trainer": {**base["trainer"], "procs": 1}})
    mesh_cfg = Config.from_dict({**base, "trainer": {**base["trainer"], "procs": args.procs}})

    # one process with 1 thread and with all threads: on a busy machine extra intra-op
    # threads can cost more than they bring, so both are shown
    rows = []
    all_threads = torch.get_num_threads()
    for threads in sorted({1, all_threads}):
        torch.set_num_threads(threads)
        rows.append(summarize(f"1 process, {threads} thread(s)", bench_single(single_cfg, batches), tokens))
    torch.set_num_threads(all_threads)
    rows.append(summarize(f"FSDP2 mesh, {args.procs} procs", asyncio.run(bench_mesh(mesh_cfg, batches)), tokens))
    n_params = sum(p.numel() for p in PolicyTrainer(single_cfg, torch.device("cpu")).model.parameters())

    print(
        f"\nqwen3 {n_params / 1e6:.2f}M params, batch {args.groups}x{args.group_size} seqs of "
        f"{args.prompt_len}+{args.response_len} tokens, {args.steps} timed steps\n"
    )
    print(f"{'setup':<28} {'step s (median)':>16} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['setup']:<28} {r['step_s_median']:>16.3f} {r['tokens_per_s']:>10.0f}")
    from common import machine

    print(json.dumps({"benchmark": "trainer_throughput", "machine": machine(), "params": n_params, "results": rows}))


if __name__ == "__main__":
    main()
