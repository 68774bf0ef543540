"""Long, variable-length rollouts and stragglers: task:longtail in every mode, side by side.

Answer lengths follow `data.lengths` (lognormal, median 8 tokens, clipped at 160: a tail
like reasoning traces), each prompt with its own token budget. In one invocation, seed by
seed, the same problem runs as:
  sync    configs/sync.yaml: generate a batch, then train on it; the longest answer gates it
  keep    async, weight updates swap between decode steps (partial rollouts kept)
  abort   async, in-flight requests aborted at an update and resumed from their prefix
  drain   async without partial rollouts: an update waits for every in-flight request, so a
          completion never spans two versions (it still overlaps training and generation)
  trl     TRL GRPOTrainer on the same initial weights, task, batch and per-prompt budgets

Per mode: samples/s, trained and generated tokens/s, trainer and generator idle fractions,
straggler time (buffer/straggler_s: the trainer's wait after half its batch had arrived),
staleness, reward per sample (paired with sync at equal policy samples) and per training
second. From the sync runs: the overlap bound (G + T) / max(G, T), and how much more not
waiting on stragglers allows, max(G, T) / max(G - S, T). The scaling model's engine
simulation (benchmarks/scaling_model.py) is checked against these runs, then predicts 7B and
32B on H100s with 8K and 32K traces.

    python benchmarks/long_tail.py [--seeds 2] [--steps 30] [--modes sync,keep,abort,drain] [--no-trl]

Writes benchmarks/results/long_tail.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from common import RESULTS, SYSTEM_COLORS, machine

from async_vs_sync import (  # noqa: E402
    add_common_args,
    bench_seeds,
    mean_gap,
    mode_means,
    reward_gap,
    run_mode,
    time_to_reward,
)

from meshrl.config import ModelConfig  # noqa: E402  (importable once common put the repo root on the path)

TARGET_SPEEDUP = 2.0
MODEL_SIZES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
"""Taken from the embedded default's model: generation, not training, is the bottleneck, as in RL at scale."""
COLORS = {**SYSTEM_COLORS, "keep": "tab:red", "abort": "tab:orange", "drain": "tab:purple"}


def mode_args(args: argparse.Namespace, mode: str, seed: int) -> argparse.Namespace:
    extra = [] if mode == "sync" else [f"generator.update_mode={mode}"]
    return argparse.Namespace(**{**vars(args), "seed": seed, "async_set": (args.async_set or []) + extra})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_extras(run: dict, warmup: int) -> dict:
    """Figures async_vs_sync's summary does not carry: lengths, stragglers, tokens/s."""
    steady = run["rows"][warmup:] or run["rows"]
    lengths = [n for r in run["rows"] for n in r["response_lengths"]]
    wall = sum(r["time/step_s"] for r in steady)
    return {
        "lengths": lengths,
        "length_median": percentile(lengths, 0.5),
        "length_p95": percentile(lengths, 0.95),
        "length_max": max(lengths, default=0),
        "straggler_s": statistics.mean(r.get("buffer/straggler_s", 0.0) for r in steady),
        "trained_tokens_per_s": sum(r.get("trainer/tokens", 0.0) for r in steady) / wall,
        # the batches' longest answers: a sync step generates exactly the episodes it trains
        "longest_per_step": statistics.mean(max(r["response_lengths"], default=0) for r in steady),
    }


def run_trl_seeds(args: argparse.Namespace, seeds: list[int], root: str) -> list[dict]:
    from trl_peer import export_initial_policy, run_trl

    from async_vs_sync import bench_config

    runs = []
    for seed in seeds:
        seed_args = mode_args(args, "sync", seed)
        hf_v0, tokenizer_dir = export_initial_policy(seed_args, os.path.join(root, f"trl-init-{seed}"))
        cfg = bench_config("sync", seed_args, os.path.join(root, "unused"))
        run = run_trl(hf_v0, tokenizer_dir, cfg, args.steps, os.path.join(root, f"trl-{seed}"), args.dtype)
        run.update(
            base_mode="trl",
            seed=seed,
            mode="trl" if seed == seeds[0] else f"trl-seed{seed}",
            reward_last=statistics.mean(r["reward"] for r in run["rows"][-4:]),
            time_to_reward_s=time_to_reward(run["rows"], args.reward_level),
        )
        runs.append(run)
    return runs


def cpu_check(sync_runs: list[dict], means: dict, capacity: int, batch: int, warmup: int) -> dict:
    """The scaling model's engine simulation on this machine's figures, against the runs.

    A decode step here costs step_s + token_s per running sequence: fitted on the sync
    steps, whose generator busy time is step_s x (decode steps: the batch's longest answer)
    + token_s x (tokens: the batch's answers summed). The simulation then predicts the
    decode steps of keep and drain from the answer lengths the sync runs produced."""
    from scaling_model import batch_makespan, stream_steps_per_batch

    xs, ys = [], []
    for run in sync_runs:
        for row in run["rows"][warmup:]:
            if row["response_lengths"] and "generator/idle_frac" in row:
                xs.append((max(row["response_lengths"]), sum(row["response_lengths"])))
                ys.append((1 - row["generator/idle_frac"]) * row["time/step_s"])
    # least squares without an intercept: y = a x0 + b x1
    s00, s01, s11 = sum(x[0] ** 2 for x in xs), sum(x[0] * x[1] for x in xs), sum(x[1] ** 2 for x in xs)
    t0, t1 = sum(x[0] * y for x, y in zip(xs, ys)), sum(x[1] * y for x, y in zip(xs, ys))
    det = s00 * s11 - s01**2
    step_s, token_s = (s11 * t0 - s01 * t1) / det, (s00 * t1 - s01 * t0) / det
    lengths = [int(n) for r in sync_runs for n in r["lengths"]]
    tokens = statistics.mean(lengths) * batch
    steps = {
        "sync": statistics.mean(batch_makespan(lengths[i : i + batch], batch) for i in range(0, len(lengths) - batch + 1, batch)),
        "keep": stream_steps_per_batch(lengths, capacity, batch, drain=False),
        "drain": stream_steps_per_batch(lengths, capacity, batch, drain=True),
    }
    G = {k: step_s * v + token_s * tokens for k, v in steps.items()}
    T = means["sync"]["T_s"]
    predicted = {"sync": G["sync"] + T, "keep": max(G["keep"], T), "drain": max(G["drain"], T)}
    out = {
        "decode_step_s": step_s,
        "per_sequence_s": token_s,
        "share_per_sequence_full_engine": token_s * capacity / (step_s + token_s * capacity),
        "engine_seqs": capacity,
        "decode_steps": steps,
        "G_s": G,
        "T_s": T,
        "step_s": predicted,
    }
    for mode in ("keep", "drain"):
        if mode in means:
            ratio, measured = predicted["sync"] / predicted[mode], means["sync"]["step_s"] / means[mode]["step_s"]
            out[f"{mode}_over_sync"] = {"model": ratio, "measured": measured, "error": ratio / measured - 1}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.set_defaults(
        task="longtail",
        steps=30,
        seeds=2,
        lr=5e-3,
        max_new_tokens=208,
        compile=False,
        reward_level=0.5,
        modes="sync,keep,abort,drain",
        model=[f"{k}={getattr(ModelConfig(), k)}" for k in MODEL_SIZES],
    )
    p.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True, help="also run TRL GRPOTrainer (needs the bench extra)")
    p.add_argument("--out", default=os.path.join(RESULTS, "long_tail.json"))
    args = p.parse_args()
    t0 = time.monotonic()
    load_before = machine()
    modes, seeds = args.modes.split(","), bench_seeds(args)
    batch = args.batch_groups * args.group_size
    results = []
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-") as root:
        for seed in seeds:  # seed by seed, the modes side by side: the machine's drift spreads over all
            for mode in modes:
                name = mode if seed == seeds[0] else f"{mode}-seed{seed}"
                run = run_mode("sync" if mode == "sync" else "async", mode_args(args, mode, seed), os.path.join(root, name))
                run.update(mode=name, base_mode=mode, seed=seed, **run_extras(run, args.warmup))
                run.pop("hf_v0"), run.pop("tokenizer_dir")
                results.append(run)
                print(
                    f"{name}: {run['step_s']:.3f} s/step, lengths median {run['length_median']:.0f} p95 {run['length_p95']:.0f}, "
                    f"straggler {run['straggler_s']:.3f} s, reward {run['reward_last']:.3f}",
                    flush=True,
                )
        if args.trl:
            results += run_trl_seeds(args, seeds, root)
    systems = modes + (["trl"] if args.trl else [])
    means = {m: mode_means([r for r in results if r["base_mode"] == m], batch) for m in systems}
    for m in modes:
        runs = [r for r in results if r["base_mode"] == m]
        for key in ("straggler_s", "trained_tokens_per_s", "generator_tokens_per_s"):
            means[m][key] = statistics.mean(r[key] for r in runs)
    for r in results:  # reward per sample against sync's, same seed (same initial weights and prompts)
        ref = next((s for s in results if s["base_mode"] == "sync" and s["seed"] == r["seed"]), None)
        r["reward_vs_sync"] = reward_gap(r["rows"], ref["rows"]) if ref is not None and r is not ref else None
    gaps = {
        m: mean_gap([r["reward_vs_sync"] for r in results if r["base_mode"] == m and r["reward_vs_sync"] and r["reward_vs_sync"]["points"]])
        for m in systems
        if m != "sync"
    }
    verdict, bounds = report(args, results, means, gaps, modes, batch)
    for r in results:
        r.pop("lengths", None)
    payload = {
        "args": vars(args),
        "machine_before": load_before,
        "machine_after": machine(),
        "results": results,
        "means": means,
        "reward_vs_sync": gaps,
        "bounds": bounds,
        "verdict": verdict,
        "wall_s": time.monotonic() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    png = plot(results, payload, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} and {png} in {time.monotonic() - t0:.0f} s")


def report(args, results: list[dict], means: dict, gaps: dict, modes: list[str], batch: int) -> tuple[dict, dict]:
    """Print the table and the verdict; the verdict and the bounds."""
    from scaling_model import length_predictions

    from meshrl.config import LengthTailConfig

    lengths = [n for r in results if r["base_mode"] in modes for n in r.get("lengths", [])]
    median, p95 = percentile(lengths, 0.5), percentile(lengths, 0.95)
    print(
        f"\nanswer lengths produced, all meshrl runs: median {median:.0f}, p95 {p95:.0f} ({p95 / max(median, 1):.1f}x), "
        f"max {max(lengths, default=0):.0f} tokens"
    )
    print(
        f"\n{'mode':<8}{'s/step':>8}{'samples/s':>11}{'trained tok/s':>15}{'gen tok/s':>11}{'trainer idle':>14}{'gen idle':>10}"
        f"{'straggler s':>13}{'staleness':>11}{'reward - sync':>18}{'t to reward':>13}"
    )
    for m, v in means.items():
        g = gaps.get(m)
        vs = f"{g['gap']:+.3f} +- {g['stderr']:.3f}" if g and g["seeds"] else "reference"
        reach = "never" if v["time_to_reward_s"] is None else f"{v['time_to_reward_s']:.1f} s"
        print(
            f"{m:<8}{v['step_s']:>8.3f}{v['samples_per_s']:>11.1f}{v.get('trained_tokens_per_s', 0.0):>15.0f}"
            f"{v.get('generator_tokens_per_s', 0.0):>11.0f}{v.get('trainer_idle_frac', 0.0):>14.2f}{v.get('generator_idle_frac', 0.0):>10.2f}"
            f"{v.get('straggler_s', 0.0):>13.3f}{v.get('staleness_mean', 0.0):>11.2f}{vs:>18}{reach:>13}"
        )
    sync = means["sync"]
    G, T, S = sync["G_s"], sync["T_s"], sync["straggler_s"]
    bounds = {
        "G_s": G,
        "T_s": T,
        "straggler_s": S,
        "overlap_bound": (G + T) / max(G, T),
        "straggler_factor": max(G, T) / max(G - S, T),
        "overlap_and_stragglers_bound": (G + T) / max(G - S, T),
    }
    sps = {m: v["samples_per_s"] for m, v in means.items()}
    speedup = sps["keep"] / sps["sync"] if "keep" in sps else float("nan")
    bounds["keep_over_overlap_bound"] = speedup / bounds["overlap_bound"]
    print(f"\nsync step: G {G:.3f} s generating (of which {S:.3f} s waiting on the batch's stragglers) + T {T:.3f} s training")
    print(
        f"overlap alone bounds async at (G + T) / max(G, T) = {bounds['overlap_bound']:.2f}x; not waiting on stragglers allows "
        f"{bounds['straggler_factor']:.2f}x more, {bounds['overlap_and_stragglers_bound']:.2f}x in all; keep reached {speedup:.2f}x, "
        f"{bounds['keep_over_overlap_bound']:.2f}x the overlap bound"
    )
    capacity = args.async_batches_in_flight * batch
    bounds["cpu_check"] = check = cpu_check([r for r in results if r["base_mode"] == "sync"], means, capacity, batch, args.warmup)
    print(
        f"a decode step here: {1e3 * check['decode_step_s']:.2f} ms + {1e3 * check['per_sequence_s']:.3f} ms per running sequence "
        f"({100 * check['share_per_sequence_full_engine']:.0f}% of a full engine's step is per sequence; a GPU's is near 0 until compute-bound)"
    )
    for m in ("keep", "drain"):
        if f"{m}_over_sync" in check:
            c = check[f"{m}_over_sync"]
            print(f"scaling model on this machine's figures: {m} / sync {c['model']:.2f}x, measured {c['measured']:.2f}x ({100 * c['error']:+.0f}%)")
    law = LengthTailConfig()  # this run's length law (the task's defaults), at GPU scale
    bounds["gpu_predictions"] = predictions = length_predictions(law.sigma, law.max / law.median)
    print(
        f"\npredicted at GPU scale (one H100 generating, one training; lognormal sigma {law.sigma}, median = max / "
        f"{law.max / law.median:.0f} as here; see scaling_model.py):"
    )
    print(
        f"{'model':<7}{'max tok':>9}{'engine seqs':>13}{'sync s':>9}{'keep s':>9}{'drain s':>9}{'keep/sync':>11}{'drain/sync':>12}"
        f"{'trainer idle sync/keep':>24}"
    )
    for r in predictions:
        s = r["step_s"]
        print(
            f"{r['model']:<7}{r['max_tokens']:>9}{r['engine_seqs']:>13}{s['sync']:>9.0f}{s['keep']:>9.0f}{s['drain']:>9.0f}"
            f"{r['keep_over_sync']:>11.2f}{r['drain_over_sync']:>12.2f}{r['trainer_idle']['sync']:>13.2f} / {r['trainer_idle']['keep']:.2f}"
        )
    keep_gap = gaps.get("keep", {})
    reward_ok = bool(keep_gap.get("within_noise_or_better"))
    verdict = {
        "length_p95_over_median": p95 / max(median, 1),
        "length_median": median,
        "length_p95": p95,
        "async_over_sync_samples_per_s": speedup,
        **{f"{m}_over_sync_samples_per_s": sps[m] / sps["sync"] for m in sps if m not in ("sync", "keep")},
        "keep_over_drain_samples_per_s": sps["keep"] / sps["drain"] if {"keep", "drain"} <= set(sps) else None,
        "reward_keep_minus_sync": keep_gap.get("gap"),
        "reward_keep_minus_sync_stderr": keep_gap.get("stderr"),
        "reward_keep_minus_sync_per_seed": keep_gap.get("per_seed"),
        "seeds": len(bench_seeds(args)),
        "time_to_reward_s": {m: v["time_to_reward_s"] for m, v in means.items()},
        "target_speed_met": speedup >= TARGET_SPEEDUP,
        "target_reward_met": reward_ok,
        "target_met": speedup >= TARGET_SPEEDUP and reward_ok,
    }
    if "trl" in sps:
        verdict["keep_over_trl_samples_per_s"] = sps["keep"] / sps["trl"]
    print(
        f"\nasync (keep) / sync samples/s = {speedup:.2f}x (target {TARGET_SPEEDUP:.0f}x: {'met' if verdict['target_speed_met'] else 'NOT met'}); "
        f"reward per sample keep - sync {keep_gap.get('gap', float('nan')):+.3f} +- {keep_gap.get('stderr', float('nan')):.3f} over "
        f"{verdict['seeds']} seed(s): {'within noise or better' if reward_ok else 'WORSE'}"
    )
    if verdict["keep_over_drain_samples_per_s"]:
        print(f"partial rollouts: keep / drain (async without them) = {verdict['keep_over_drain_samples_per_s']:.2f}x")
    return verdict, bounds


def plot(results: list[dict], payload: dict, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_len, ax_str), (ax_samples, ax_time) = axes
    firsts = [r for r in results if r["mode"] == r["base_mode"]]
    for r in firsts:
        color = COLORS.get(r["base_mode"], "k")
        steps = [row["step"] for row in r["rows"]]
        if r["base_mode"] != "trl":
            lengths = [n for row in r["rows"] for n in row["response_lengths"]]
            bins = [2 ** (k / 2) for k in range(0, 17)]
            ax_len.hist(lengths, bins=bins, histtype="step", color=color, label=r["mode"])
            ax_str.plot(steps, [row.get("buffer/straggler_s", 0.0) for row in r["rows"]], color=color, label=r["mode"])
        ax_samples.plot([row["policy_samples"] for row in r["rows"]], [row["reward"] for row in r["rows"]], color=color, label=r["mode"])
        elapsed = [sum(x["time/step_s"] for x in r["rows"][: i + 1]) for i in range(len(r["rows"]))]
        ax_time.plot(elapsed, [row["reward"] for row in r["rows"]], color=color, label=r["mode"])
    v = payload["verdict"]
    ax_len.set(xscale="log", title=f"answer lengths (p95 / median {v['length_p95_over_median']:.1f}x)", xlabel="tokens", ylabel="episodes")
    ax_str.set(title="straggler time per step (trainer's wait after half its batch)", xlabel="step", ylabel="s")
    ax_samples.set(title="trained batch reward vs samples the policy was trained on", xlabel="samples", ylabel="reward")
    ax_time.set(title=f"reward vs training time (keep {v['async_over_sync_samples_per_s']:.2f}x sync samples/s)", xlabel="s", ylabel="reward")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"task:longtail, first seed; {payload['machine_before'].get('cpu_model', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
