"""A small cost model of the async loop, fitted to this machine's measurements.

Inputs (benchmarks/results/*.json, written by the other benchmarks):
  async_vs_sync.json  G, T per step of the sync run (generation and training of one batch),
                      the generator's decode rate while busy, the async step actually reached
  weight_sync.json    sync time per version against bytes, per transport: fixed + bytes / bw

Model, for a batch of B samples, R generator replicas (each on its own device), a model of
N parameters (N0 = the benchmark model):
  G(R, N) = G0 * (N / N0) / R          generation: compute per token grows with N, split over R
  T(N)    = T0 * (N / N0)               training: 6 N flops per token on a fixed trainer
  S(N, R) = s0 + k(R) * bytes(N) / bw   weight sync; k = 1 for a broadcast, R for pulls from one source
  sync step  = G + T + S                async step = max(G, T + S_block), S_block = the staging copy
  idle: trainer 1 - T / step, generator 1 - G / step
Linear-in-N costs are the compute-bound limit: for models this small a decode step is
dominated by fixed per-step overhead, so G grows slower than N here (stated, not hidden).
Checked against the measured points: the weight-sync fit against each measured size, and
the predicted async step max(G, T + S_block) against the async step measured on 2 shared cores.

    python benchmarks/scaling_model.py    # prints tables, writes results/scaling_model.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from common import RESULTS


def load(name: str) -> dict:
    path = os.path.join(RESULTS, name)
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: run `python benchmarks/run_all.py` (or the benchmark itself) first")
    with open(path) as f:
        return json.load(f)


def fit_sync(rows: list[dict], transport: str) -> dict:
    """sync_s = fixed + bytes / bw: fixed from the smallest size (the per-version overhead),
    bw from the largest (where bytes dominate); the middle sizes check the line."""
    pts = sorted((r["bytes"], r["sync_s"]) for r in rows if r["transport"] == transport)
    (b_small, s_small), (b_big, s_big) = pts[0], pts[-1]
    per_byte = max(1e-15, (s_big - s_small) / (b_big - b_small))
    fixed = max(0.0, s_small - b_small * per_byte)
    check = [{"bytes": x, "measured_s": y, "model_s": fixed + per_byte * x, "error": (fixed + per_byte * x) / y - 1} for x, y in pts]
    return {"transport": transport, "fixed_s": fixed, "GBps": 1e-9 / per_byte, "check": check}


def predict(G0: float, T0: float, n_ratio: float, replicas: int, bytes_: float, sync: dict, pulls: bool, block_s: float) -> dict:
    G = G0 * n_ratio / replicas
    T = T0 * n_ratio
    S = sync["fixed_s"] + (replicas if pulls else 1) * bytes_ / (sync["GBps"] * 1e9)
    sync_step = G + T + S
    async_step = max(G, T + block_s * n_ratio)
    return {
        "replicas": replicas,
        "n_ratio": n_ratio,
        "G_s": G,
        "T_s": T,
        "S_s": S,
        "sync_step_s": sync_step,
        "async_step_s": async_step,
        "speedup": sync_step / async_step,
        "trainer_idle_async": 1 - T / async_step,
        "generator_idle_async": 1 - G / async_step,
        "bottleneck": "generation" if G > T + S else ("weight sync" if S > T else "training"),
    }


# ---- length distributions ---------------------------------------------------------------------
# A decode step advances every running sequence by one token. On a GPU a decode step is
# memory-bound: it costs about the same at any occupancy, so an engine's tokens/s scale with
# how full it is, and a batch waiting on its longest sequences runs mostly empty.
GPU_SCENARIOS = {
    # tokens/s of one H100 generating long traces, from the survey's figures (512 rollouts of
    # 32K tokens: about 45 min for 7B, 3.7 h for 32B); KV cache room in tokens: 80 GB less
    # bf16 weights and working memory, over K/V bytes per token (7B: 28 layers x 4 KV heads x
    # 128 x 2 x 2 B = 57 KB; 32B: 64 x 8 x 128 x 2 x 2 B = 262 KB)
    "7B": {"params": 7.6e9, "decode_tokens_per_s": 6300.0, "kv_tokens": 960_000},
    "32B": {"params": 32.8e9, "decode_tokens_per_s": 1260.0, "kv_tokens": 38_000},
}
H100_BF16_FLOPS, TRAIN_MFU = 989e12, 0.4
GPU_BATCH, MAX_SEQS = 512, 256  # rollouts per step (64 prompts x 8), vLLM's default max_num_seqs


def batch_makespan(lengths: list[int], capacity: int) -> int:
    """Decode steps to generate `lengths` alone on `capacity` slots (a sync step)."""
    import heapq

    running: list[int] = []
    for n in lengths:
        start = heapq.heappop(running) if len(running) == capacity else 0
        heapq.heappush(running, start + n)
    return max(running)


def stream_steps_per_batch(lengths: list[int], capacity: int, batch: int, drain: bool) -> float:
    """Decode steps per `batch` finished sequences when a freed slot takes the next sequence
    at once (async, keep or abort: the weight update swaps between decode steps). `drain`:
    once per batch (each weight update) nothing is admitted until every running sequence has
    finished, so a request never spans two versions."""
    import heapq
    from collections import deque

    pending, running, now, done, ends = deque(lengths), [], 0, 0, []
    while pending or running:
        while pending and len(running) < capacity:
            heapq.heappush(running, now + pending.popleft())
        now = heapq.heappop(running)
        done += 1
        if done % batch == 0:
            ends.append(now)
            while drain and running:
                now = heapq.heappop(running)
                done += 1
                if done % batch == 0:
                    ends.append(now)
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else float(now)


def lognormal_lengths(median: float, sigma: float, longest: int, count: int, seed: int = 0) -> list[int]:
    """The longtail task's length law (meshrl/tasks.py target_length) at another scale."""
    import math
    import random

    rng = random.Random(seed)
    return [max(1, min(longest, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(count)]


def length_predictions(sigma: float, tail_ratio: float, batches: int = 40) -> list[dict]:
    """Sync, async keep and async drain at GPU scale: one H100 generating, one training, for
    7B and 32B models and traces of at most 8K and 32K tokens (median = max / tail_ratio)."""
    rows = []
    for name, m in GPU_SCENARIOS.items():
        for longest in (8192, 32768):
            lengths = lognormal_lengths(longest / tail_ratio, sigma, longest, GPU_BATCH * batches)
            mean_len = sum(lengths) / len(lengths)
            capacity = max(1, min(MAX_SEQS, int(m["kv_tokens"] / mean_len)))
            step_s = capacity / m["decode_tokens_per_s"]  # one decode step of a full engine
            G = {
                "sync": statistics.mean(batch_makespan(lengths[i : i + GPU_BATCH], capacity) for i in range(0, len(lengths), GPU_BATCH)),
                "keep": stream_steps_per_batch(lengths, capacity, GPU_BATCH, drain=False),
                "drain": stream_steps_per_batch(lengths, capacity, GPU_BATCH, drain=True),
            }
            G = {k: v * step_s for k, v in G.items()}
            T = GPU_BATCH * mean_len * 6 * m["params"] / (H100_BF16_FLOPS * TRAIN_MFU)
            step = {"sync": G["sync"] + T, "keep": max(G["keep"], T), "drain": max(G["drain"], T)}
            rows.append(
                {
                    "model": name,
                    "max_tokens": longest,
                    "median_tokens": longest / tail_ratio,
                    "mean_tokens": mean_len,
                    "engine_seqs": capacity,
                    "G_s": G,
                    "T_s": T,
                    "step_s": step,
                    "trainer_idle": {k: 1 - T / v for k, v in step.items()},
                    "generator_idle": {"sync": T / step["sync"], "keep": 1 - G["keep"] / step["keep"], "drain": 1 - G["drain"] / step["drain"]},
                    "keep_over_sync": step["sync"] / step["keep"],
                    "drain_over_sync": step["sync"] / step["drain"],
                    "overlap_bound": (G["sync"] + T) / max(G["sync"], T),
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", default="collective", choices=["rdma", "collective", "files"])
    p.add_argument("--out", default=os.path.join(RESULTS, "scaling_model.json"))
    args = p.parse_args()
    avs = load("async_vs_sync.json")
    ws = load("weight_sync.json")
    sync_run, async_run = (next(r for r in avs["results"] if r["mode"] == m) for m in ("sync", "async"))
    G0, T0 = avs["overlap"]["G_s"], avs["overlap"]["T_s"]
    m = avs["model"]
    # parameters of the benchmark model (qwen3, untied embeddings, vocab 128)
    dim, layers, ffn, vocab = m["dim"], m["n_layers"], m["ffn_dim"], 128
    kv_dim = dim // m["n_heads"] * m["n_kv_heads"]
    n0 = 2 * vocab * dim + layers * (2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn)
    bytes0 = 4 * n0  # float32, as the benchmark runs

    fits = {t: fit_sync(ws["rows"], t) for t in sorted({r["transport"] for r in ws["rows"]})}
    fit = fits[args.transport]
    pulls = args.transport == "rdma"
    block_s = 0.0  # the staging copy (sync/publish_s) is already inside T0; pulls overlap generation

    # check 1: the loop's own points
    predicted_async = max(G0, T0)
    check_loop = {
        "sync_step_measured_s": sync_run["step_s"],
        "sync_step_model_s": G0 + T0 + avs["overlap"]["other_s"],
        "async_step_measured_s": async_run["step_s"],
        "async_step_model_s": predicted_async,
        "async_model_error": predicted_async / async_run["step_s"] - 1,
        "contention_G": avs["overlap"]["G_inflation"],
        "contention_T": avs["overlap"]["T_inflation"],
    }
    grid = []
    for n_ratio in (1, 10, 100):
        for replicas in (1, 2, 4, 8):
            grid.append(predict(G0, T0, n_ratio, replicas, bytes0 * n_ratio, fit, pulls, block_s))

    busy_rate = sync_run["generator_tokens_per_s"] * sync_run["step_s"] / G0 if G0 else 0.0
    print(f"benchmark model: {n0 / 1e6:.2f}M params; sync step G0={G0:.3f} s, T0={T0:.3f} s; one replica decodes {busy_rate:.0f} tok/s while busy")
    print("\nweight-sync fit: sync_s = fixed + bytes / bandwidth")
    print(f"{'transport':<11}{'fixed ms':>10}{'GB/s':>8}   model/measured - 1 per size")
    for t, f in fits.items():
        errs = " ".join(f"{c['bytes'] / 2**20:.0f}MiB:{100 * c['error']:+.0f}%" for c in f["check"])
        print(f"{t:<11}{1e3 * f['fixed_s']:>10.1f}{f['GBps']:>8.2f}   {errs}")
    print(
        f"\nloop check: async step model max(G,T) = {predicted_async:.3f} s vs measured {async_run['step_s']:.3f} s "
        f"({100 * check_loop['async_model_error']:+.0f}%): on 2 shared cores G grew x{check_loop['contention_G']:.2f} "
        f"and T x{check_loop['contention_T']:.2f} when they overlapped"
    )
    print(f"\npredictions ({args.transport} sync; each replica and the trainer on their own devices)")
    print(
        f"{'N/N0':>6}{'R':>4}{'G s':>9}{'T s':>9}{'sync s':>9}{'sync step':>11}{'async step':>12}{'speedup':>9}{'trainer idle':>14}{'gen idle':>10}  bottleneck"
    )
    for g in grid:
        print(
            f"{g['n_ratio']:>6}{g['replicas']:>4}{g['G_s']:>9.3f}{g['T_s']:>9.3f}{g['S_s']:>9.3f}{g['sync_step_s']:>11.3f}"
            f"{g['async_step_s']:>12.3f}{g['speedup']:>9.2f}{g['trainer_idle_async']:>14.2f}{g['generator_idle_async']:>10.2f}  {g['bottleneck']}"
        )
    payload = {
        "params_N0": n0,
        "generator_busy_tokens_per_s": busy_rate,
        "bytes_N0": bytes0,
        "G0_s": G0,
        "T0_s": T0,
        "sync_fits": fits,
        "transport": args.transport,
        "check_loop": check_loop,
        "grid": grid,
        # measures nothing itself: the machines are those of its inputs
        "inputs_machine": {"async_vs_sync": avs.get("machine_before"), "weight_sync": ws.get("machine")},
    }
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    png = plot(grid, os.path.splitext(args.out)[0] + ".png")
    print(f"\nwrote {args.out} and {png}")


def plot(grid: list[dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_i) = plt.subplots(1, 2, figsize=(10, 3.6))
    for n_ratio in sorted({g["n_ratio"] for g in grid}):
        pts = [g for g in grid if g["n_ratio"] == n_ratio]
        r = [g["replicas"] for g in pts]
        ax_s.plot(r, [g["async_step_s"] / pts[0]["async_step_s"] for g in pts], marker="o", label=f"async, N={n_ratio}xN0")
        ax_s.plot(r, [g["sync_step_s"] / pts[0]["async_step_s"] for g in pts], marker="x", ls="--", label=f"sync, N={n_ratio}xN0")
        ax_i.plot(r, [g["trainer_idle_async"] for g in pts], marker="o", label=f"trainer, N={n_ratio}xN0")
        ax_i.plot(r, [g["generator_idle_async"] for g in pts], marker="x", ls="--", label=f"generator, N={n_ratio}xN0")
    ax_s.set_title("step time (relative to async, 1 replica)")
    ax_i.set_title("idle fraction, async")
    for ax in (ax_s, ax_i):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("generator replicas")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
