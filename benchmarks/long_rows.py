"""Long rows in the trainer: activation memory per checkpointing mode, and packed against padded
micro-batches on long-tail lengths. One `PolicyTrainer` step in one process (no mesh).

- memory: peak RSS growth of one step on ROWS x LEN tokens for each `trainer.activation_checkpoint`
  mode, each in a fresh process, and bytes per token per layer.
- padding: batches with configs/long-tail.yaml's lengths; the useful-token share of the padded
  micro-batches against packed ones, and trainer tokens/s of both at equal loss.
- single row: one row of --single-len tokens with full checkpointing.
- tp (only when asked: `--only tp`): the default task, synchronous, 40 steps at trainer.tp=2
  against tp=1, seeds 0 and 1: step-1 loss and reward.

    python benchmarks/long_rows.py                       # all three, about 15 minutes on 2 cores
    python benchmarks/long_rows.py --only padding --out benchmarks/results/long_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

import psutil
import torch

# Qwen3-shaped, about 27M parameters (issue 39's model): dim 512, 8 layers, 8 heads, ffn 1536
MODEL = {"family": "qwen3", "dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 1536, "vocab_size": 128}


def cpu_flags() -> str:
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    keep = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))
    return f"{model}; {os.cpu_count()} cores; {' '.join(keep)}"


def batch_of(lengths: list[tuple[int, int]], group_size: int, seed: int = 0):
    """A scored batch: one (prompt length, response length) per group, `group_size` episodes each."""
    from meshrl.episode import Episode, Turn, assign_advantages, pack

    rng = random.Random(seed)
    episodes = []
    for g, (p, r) in enumerate(lengths):
        prompt = [1] + [rng.randrange(3, 100) for _ in range(p - 1)]
        for k in range(group_size):
            resp = [rng.randrange(3, 100) for _ in range(r)]
            episodes.append(Episode(g, g * group_size + k, [Turn("env", prompt), Turn("model", resp, [-2.0] * r, [0] * r, reward=rng.random())]))
    return assign_advantages(pack(episodes), "grpo")


def config(max_seq_len: int, **trainer):
    from meshrl.config import Config

    return Config.from_dict({"model": {**MODEL, "max_seq_len": max_seq_len}, "trainer": trainer})


def one_memory(mode: str, rows: int, length: int) -> dict:
    """One step in this process: peak RSS growth over the RSS before it (weights, batch built)."""
    from meshrl.trainer.policy import PolicyTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    batch = batch_of([(16, length - 16)] * 1, rows)
    batch["advantage"] = torch.linspace(-1.0, 1.0, rows) if rows > 1 else torch.ones(1)  # a gradient even for one row
    trainer = PolicyTrainer(config(length, activation_checkpoint=mode, micro_batch_size=rows), torch.device("cpu"))
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    out = trainer.train_step(batch)
    step_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = rows * length
    growth = peak - before
    return {
        "mode": mode,
        "rows": rows,
        "len": length,
        "peak_growth_gb": round(growth / 2**30, 3),
        "step_s": round(step_s, 1),
        "bytes_per_token_per_layer": round(growth / tokens / MODEL["n_layers"]),
        "loss": out["loss"],
    }


def memory(modes: list[str], rows: int, length: int) -> list[dict]:
    out = []
    for mode in modes:
        done = subprocess.run(
            [sys.executable, __file__, "--one", mode, "--rows", str(rows), "--len", str(length)], capture_output=True, text=True, timeout=1800
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(out[-1], flush=True)
    return out


def long_tail_lengths(groups: int, seed: int) -> list[tuple[int, int]]:
    """configs/long-tail.yaml's answers, early in a run (each to its budget), after a 16-token prompt."""
    from meshrl.config import Config
    from meshrl.tasks import answer_budget, target_length

    lengths = Config.from_dict({"data": {"source": "task:longtail", "lengths": {"median": 8, "sigma": 1.4, "max": 160, "slack": 0.25}}}).data.lengths
    rng = random.Random(seed)
    return [(16, answer_budget(target_length(rng, lengths), lengths.slack)) for _ in range(groups)]


def padding(steps: int, groups: int, group_size: int, micro_batch_size: int, budget: int) -> dict:
    from meshrl.trainer.packing import row_lengths
    from meshrl.trainer.packing import micro_batch_plans
    from meshrl.trainer.policy import PolicyTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    batches = [batch_of(long_tail_lengths(groups, seed), group_size, seed) for seed in range(steps + 1)]
    useful = {"padded": [], "packed": []}
    for b in batches:
        lengths = row_lengths(b)
        real = int(lengths.sum())
        padded = micro_batch_plans(b, 1, micro_batch_size)[0]
        useful["padded"].append(real / sum(len(mb) * int(lengths[mb].max()) for mb in padded))
        useful["packed"].append(1.0)  # packed rows run no padding at all
    result = {"useful_padded": round(statistics.mean(useful["padded"]), 3), "useful_packed": 1.0}
    for name, knobs in (("padded", {"micro_batch_size": micro_batch_size}), ("packed", {"micro_batch_tokens": budget})):
        trainer = PolicyTrainer(config(256, **knobs), torch.device("cpu"))
        trainer.train_step(batches[0])  # warm-up
        times, losses, tokens = [], [], 0
        for b in batches[1:]:
            t0 = time.perf_counter()
            out = trainer.train_step(b)
            times.append(time.perf_counter() - t0)
            losses.append(out["loss"])
            tokens += int(out["tokens"])
        result[f"{name}_step_s"] = round(statistics.median(times), 3)
        result[f"{name}_loss_tokens_per_s"] = round(tokens / sum(times), 1)
        result[f"{name}_losses"] = [round(x, 6) for x in losses]
        print(name, result[f"{name}_step_s"], "s/step", flush=True)
    result["speedup_packed_over_padded"] = round(result["packed_loss_tokens_per_s"] / result["padded_loss_tokens_per_s"], 3)
    result["max_loss_gap"] = max(abs(a - b) for a, b in zip(result["padded_losses"], result["packed_losses"]))
    return result


def tensor_parallel(steps: int, seeds: list[int], root: str) -> dict:
    """The default task, synchronous, the trainer at tp=2 (2 procs) against tp=1: reward per step."""
    import tempfile

    import meshrl

    out = {}
    for tp in (1, 2):
        for seed in seeds:
            cfg = {
                "steps": steps,
                "seed": seed,
                "model": {"n_kv_heads": 2},
                "trainer": {"procs": tp, "tp": tp, "checkpoint_every": 0},
                "buffer": {"depth": 0, "max_lag": 0},
                "generator": {"update_mode": "block"},
                "logging": {"run_dir": tempfile.mkdtemp(dir=root), "progress": False, "plot": False, "tensorboard": False},
            }
            rows = [r for r in meshrl.run(cfg).metrics if "trainer/reward_mean" in r]
            out[f"tp{tp}_seed{seed}"] = {
                "reward": [round(r["trainer/reward_mean"], 4) for r in rows],
                "loss_step1": rows[0]["trainer/loss"],
                "last10": round(statistics.mean(r["trainer/reward_mean"] for r in rows[-10:]), 4),
            }
            print(f"tp={tp} seed={seed}: step-1 loss {rows[0]['trainer/loss']:.8f}, last 10 steps' reward {out[f'tp{tp}_seed{seed}']['last10']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="memory,padding,single")
    p.add_argument("--modes", default="none,selective,full")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--len", type=int, default=8192)
    p.add_argument("--single-len", type=int, default=32768)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one_memory(a.one, a.rows, a.len)))
        return
    only = a.only.split(",")
    result = {"cpu": cpu_flags(), "model": MODEL, "torch": torch.__version__}
    t0 = time.time()
    if "padding" in only:  # first: the timed part, before anything else has run
        result["padding"] = padding(a.steps, groups=8, group_size=8, micro_batch_size=16, budget=2048)
        print(result["padding"], flush=True)
    if "memory" in only:
        result["memory"] = memory(a.modes.split(","), a.rows, a.len)
    if "tp" in only:
        import tempfile

        result["tensor_parallel"] = tensor_parallel(40, [0, 1], tempfile.mkdtemp())
    if "single" in only:
        result["single_row"] = memory(["full"], 1, a.single_len)
    result["wall_s"] = round(time.time() - t0)
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
