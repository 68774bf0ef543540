"""Async vs sync: the same run (config, seed, steps, batch, group size, completion length)
in synchronous on-policy mode (configs/sync.yaml) and in async mode (configs/default.yaml).

Per mode: wall-clock per step, samples/s, trainer and generator idle fractions, reward
against samples. From the sync run's own metrics (a sync step is generate G, then train T)
it derives the ideal overlap bound (G + T) / max(G, T) and reports the fraction of it that
async reaches. Steady-state numbers cover the steps after `--warmup`: samples/s and idle
fractions from their totals (the mean step), per-step costs as means.

Both modes run once per seed (`--seeds`, default 3). Speed figures are means over the
seeds. Reward per sample is compared seed by seed (the same initial weights and prompts),
and the noise is the spread of those paired gaps: an async run's reward curve varies from
run to run with its timing, so one pair of runs cannot tell a gap from noise.

    python benchmarks/async_vs_sync.py [--steps 24] [--lr 2e-4] [--max-new-tokens 48] [--seeds 3]
    python benchmarks/async_vs_sync.py --task calc --set rollout.tool_parser=compact ...   # multi-turn (run_all: multi_turn)

Prints a table, writes benchmarks/results/async_vs_sync.json and .png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time

from common import RESULTS, ROOT, SEED_STYLES, SYSTEM_COLORS, bench_model, machine


MODE_CONFIGS = {"sync": "configs/sync.yaml", "async": "configs/default.yaml", "colocate": "configs/colocate.yaml"}
ROW_KEYS = (
    "time/step_s",
    "trainer/wait_s",
    "trainer/step_time_s",
    "trainer/idle_frac",
    "generator/idle_frac",
    "generator/tokens_per_s",
    "sync/publish_s",
    "sync/update_s",
    "sync/previous_update_s",
    "sync/previous_update_wait_s",
    "reward/mean",
    "reward/success_rate",
    "episode/count",
    "trainer/reward_mean",
    "trainer/staleness_mean",
    "trainer/staleness_max",
    "trainer/logprob_mismatch",
    "trainer/tokens",
    "buffer/straggler_s",
)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady-state figures")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument(
        "--lr",
        type=float,
        default=2e-4,
        help="AdamW lr (default 2e-4: the digits climb from 0.1 to 0.9 spans 15-20 of the 24 sync steps; at 1e-3 it takes 5-9, see benchmarks/README.md)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        action="append",
        metavar="KEY=INT",
        help="override a BENCH_MODEL size for every run, TRL's included (e.g. --model dim=384 --model n_heads=12)",
    )
    p.add_argument("--task", default="digits", help="built-in task (meshrl/tasks.py)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="bfloat16" if machine()["amx"] else "float32",  # AMX multiplies bf16 in hardware: faster on both sides
        help="model.dtype (generator weights) and trainer.compute_dtype (default: bfloat16 on CPUs with AMX, else float32)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generator.compile and trainer.compile: vLLM's compiled model and TorchTitan's compiled blocks "
        "(default on: 1.35x decode and 1.4x training step in bf16, for ~20 s more start-up)",
    )
    p.add_argument("--trainer-cpus", default="auto", help="trainer.cpus (default: the shipped 'auto' placement; '' shares all cores)")
    p.add_argument("--generator-cpus", default="auto", help="generator.cpus (default: the shipped 'auto' placement; '' shares all cores)")
    p.add_argument(
        "--async-batches-in-flight",
        type=int,
        default=2,
        help="async only: generator.max_num_seqs = this many batches (sync decodes one batch at a time by construction)",
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra config override for every run (e.g. a multi-turn task's rollout.*)")
    p.add_argument("--sync-set", action="append", metavar="KEY=VALUE", help="extra config override for the sync run only")
    p.add_argument("--async-set", action="append", metavar="KEY=VALUE", help="extra config override for the async run only")
    p.add_argument(
        "--reward-level", type=float, default=0.7, help="report each run's training time until its trained batches' reward (3-step mean) reaches this level"
    )
    p.add_argument("--modes", default="sync,async", help="which modes to run")
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="run each mode with seeds seed .. seed + N - 1: means over them, and the spread of the paired reward gaps is the noise",
    )


def bench_config(mode: str, args: argparse.Namespace, run_dir: str):
    """The mode's shipped config with the shared problem size on top."""
    from meshrl.resume import as_config

    overrides = [
        f"steps={args.steps}",
        f"seed={args.seed}",
        f"batch_groups={args.batch_groups}",
        f"generator.group_size={args.group_size}",
        f"generator.max_new_tokens={args.max_new_tokens}",
        f"trainer.lr={args.lr}",
        f"data.source=task:{args.task}",
        f"model.dtype={args.dtype}",
        f"trainer.compute_dtype={args.dtype}",
        f"generator.compile={str(args.compile).lower()}",
        f"trainer.compile={str(args.compile).lower()}",
        # one micro-batch per step, as TRL's per-device batch of the same size
        f"trainer.micro_batch_size={args.batch_groups * args.group_size}",
        f"trainer.cpus='{args.trainer_cpus}'",
        f"generator.cpus='{args.generator_cpus}'",
        f"logging.run_dir={run_dir}",
        "logging.tensorboard=false",
        "logging.progress=false",
        "logging.plot=false",
    ] + [f"model.{k}={v}" for k, v in bench_model(args).items()]
    if mode == "async":
        # Async keeps generating while the trainer trains, so the engine can hold the next
        # batches too: vLLM's cost per decode step is mostly fixed on CPU, so decoding 128
        # sequences at once takes about 1.6x the time of 64 (measured), not 2x.
        overrides.append(f"generator.max_num_seqs={args.async_batches_in_flight * args.batch_groups * args.group_size}")
    overrides += (getattr(args, "set", None) or []) + (getattr(args, f"{mode}_set", None) or [])
    return as_config(os.path.join(ROOT, MODE_CONFIGS[mode]), overrides)


def run_mode(mode: str, args: argparse.Namespace, run_dir: str) -> dict:
    """Start a run, take `args.steps` steps, stop it; the per-step rows and the summary."""
    from meshrl.api import Session

    config = bench_config(mode, args, run_dir)
    t0 = time.monotonic()
    session = Session(config)
    try:
        session.start()
        startup = time.monotonic() - t0
        raw = session.step(args.steps)
        # the version-0 policy the run exported for its generators (RUN_DIR/hf/v0)
        hf_v0, tokenizer_dir = os.path.join(session.run_dir, "hf", "v0"), session.loop.tokenizer_dir
    finally:
        session.stop()
    rows, samples = [], 0.0
    for r in raw:
        samples += r.get("episode/count", 0.0)  # episodes finished (scored) since the last step
        row = {
            "step": int(r["version"]),
            "samples": samples,
            **{k: float(r[k]) for k in ROW_KEYS if k in r},
            "response_lengths": r.get("response_lengths", []),
        }  # of the episodes finished since the last step
        # The trained batch's own reward and mean version: in async mode the scorer's
        # reward/mean covers the samples scored since the last step, newer than the batch.
        row["reward"] = row["trainer/reward_mean"]
        row["policy_samples"] = policy_samples(row["step"], row.get("trainer/staleness_mean", 0.0), args.batch_groups * args.group_size)
        rows.append(row)
    batch = args.batch_groups * args.group_size
    return {
        "mode": mode,
        "startup_s": startup,
        "total_s": time.monotonic() - t0,
        "hf_v0": hf_v0,
        "tokenizer_dir": tokenizer_dir,
        **summarize(rows, batch, args.warmup),
        "time_to_reward_s": time_to_reward(rows, args.reward_level),
        "rows": rows,
    }


def policy_samples(step: int, staleness: float, batch: int) -> float:
    """Samples the policy that generated step `step`'s batch had been trained on.

    Step k trains on tokens from version k - 1 - staleness on the token-weighted mean
    (version v has seen v batches).
    Comparing rewards at equal policy samples measures learning per trained sample; the
    reward of a trained batch in async mode otherwise shows a policy that is `staleness`
    versions old, a lag in the measurement, not in learning.
    """
    return max(0.0, step - 1 - staleness) * batch


def reward_gap(rows: list[dict], reference: list[dict]) -> dict:
    """Mean reward of `rows` minus the reference's reward interpolated at the same policy
    samples (only where the reference covers them), with its standard error."""
    ref = sorted((r["policy_samples"], r["reward"]) for r in reference)
    gaps = []
    for r in rows:
        x = r["policy_samples"]
        if not ref or not ref[0][0] <= x <= ref[-1][0]:
            continue
        for (x0, y0), (x1, y1) in zip(ref, ref[1:]):
            if x0 <= x <= x1:
                gaps.append(r["reward"] - (y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)))
                break
    if not gaps:
        return {"gap": float("nan"), "stderr": float("nan"), "points": 0}
    stderr = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
    return {
        "gap": statistics.mean(gaps),
        "stderr": stderr,
        "points": len(gaps),
        "within_noise_or_better": statistics.mean(gaps) >= -2 * (stderr if stderr == stderr else 0.0),
    }


def time_to_reward(rows: list[dict], level: float, window: int = 3) -> float | None:
    """Training seconds (start-up excluded) until the trained batches' reward, averaged over
    `window` steps, first reaches `level`; None if it never does.

    The wait a user sees for a given reward. In async mode it includes the pipeline's lag: a
    trained batch shows the policy of `staleness` versions before, not the current one."""
    elapsed = 0.0
    for i, row in enumerate(rows):
        elapsed += row["time/step_s"]
        recent = [r["reward"] for r in rows[max(0, i + 1 - window) : i + 1]]
        if len(recent) == window and statistics.mean(recent) >= level:
            return elapsed
    return None


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else 0.0


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.mean(values) if values else 0.0


def summarize(rows: list[dict], batch: int, warmup: int) -> dict:
    """Steady-state figures; G and T per step as the sync loop runs them one after the other.

    Throughput and idle fractions are totals over the steady steps (mean step time), not
    medians: async steps can alternate short and long (a wait for the next batch every
    other step), and a median of such steps would overstate samples/s."""
    steady = rows[warmup:] or rows
    wall = sum(r["time/step_s"] for r in steady)
    step_s = wall / len(steady)
    gen_busy = [(1 - r["generator/idle_frac"]) * r["time/step_s"] for r in steady if "generator/idle_frac" in r]
    return {
        "step_s": step_s,
        "step_s_median": _median(steady, "time/step_s"),
        "samples_per_s": batch / step_s,
        "trainer_idle_frac": sum(r.get("trainer/wait_s", 0.0) for r in steady) / wall,
        "generator_idle_frac": 1 - sum(gen_busy) / wall if gen_busy else 0.0,
        "generator_tokens_per_s": _median(steady, "generator/tokens_per_s"),
        # G: generator busy time per step (at least one request in flight); T: the trainer's
        # forward/backward/optimizer step plus staging the new version for weight sync
        "G_s": statistics.mean(gen_busy) if gen_busy else 0.0,
        "T_s": _mean(steady, "trainer/step_time_s") + _mean(steady, "sync/publish_s"),
        "trainer_wait_s": _mean(steady, "trainer/wait_s"),
        # the generators' weight update: runs in the background of the next step, reported there
        "update_s": _median(steady, "sync/update_s") or _median(steady, "sync/previous_update_s"),
        "staleness_mean": _mean(steady, "trainer/staleness_mean"),
        # mean |log mu - log pi| per trained token: the sampler/trainer numerics in sync mode,
        # plus the policy's drift over the batch's staleness in async mode
        "mismatch_mean": _mean(rows, "trainer/logprob_mismatch"),
        "reward_last": statistics.mean(r["reward"] for r in rows[-4:]) if rows else 0.0,
        "reward_mean": statistics.mean(r["reward"] for r in rows) if rows else 0.0,
    }


def overlap_bound(sync: dict, asyn: dict) -> dict:
    """Ideal async speedup from the sync run's own G and T, and how much of it async reaches."""
    G, T = sync["G_s"], sync["T_s"]
    bound = (G + T) / max(G, T)
    speedup = sync["step_s"] / asyn["step_s"]
    return {
        "G_s": G,
        "T_s": T,
        "other_s": max(0.0, sync["step_s"] - G - T),
        "bound": bound,
        "speedup": speedup,
        "fraction_of_bound": (speedup - 1) / (bound - 1) if bound > 1 else 0.0,
        "speedup_over_bound": speedup / bound,
        # contention: the same work measured while the other side runs on the same 2 cores
        "G_inflation": asyn["G_s"] / G if G else 0.0,
        "T_inflation": asyn["T_s"] / T if T else 0.0,
    }


def plot(results: list[dict], out: str, extra_title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_w, ax_t, ax_i) = plt.subplots(1, 4, figsize=(18, 3.8))
    seeds = sorted({res.get("seed", 0) for res in results})
    for res in results:
        rows = res["rows"]
        # one colour per system, one line style per seed: the seeds of a mode read as a band
        system = res.get("base_mode") or ("probe" if res["mode"].endswith("-probe") else res["mode"].split("-")[0])
        style = {
            "color": SYSTEM_COLORS.get(system, "0.6"),
            "linestyle": SEED_STYLES[seeds.index(res.get("seed", 0)) % len(SEED_STYLES)],
            "marker": ".",
            "markersize": 3,
            "linewidth": 1 if system == "probe" else 1.5,
            "label": res["mode"],
        }
        ax_r.plot([r["policy_samples"] for r in rows], [r["reward"] for r in rows], **style)
        ax_w.plot(list(itertools.accumulate(r["time/step_s"] for r in rows)), [r["reward"] for r in rows], **style)
        ax_t.plot([r.get("step", i + 1) for i, r in enumerate(rows)], [r["time/step_s"] for r in rows], **style)
    names = [r["mode"] for r in results if "trainer_idle_frac" in r]
    x = range(len(names))
    ax_i.bar([i - 0.2 for i in x], [r["trainer_idle_frac"] for r in results if "trainer_idle_frac" in r], 0.4, label="trainer")
    ax_i.bar([i + 0.2 for i in x], [r["generator_idle_frac"] for r in results if "trainer_idle_frac" in r], 0.4, label="generator")
    ax_i.set_xticks(list(x), names, rotation=30, fontsize=7)
    for ax, title, xl in (
        (ax_r, "reward vs samples the policy was trained on", "samples"),
        (ax_w, "reward of the trained batch vs training time", "s after start-up"),
        (ax_t, "wall-clock per step", "step"),
        (ax_i, "idle fraction (of the steady steps)", ""),
    ):
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("s")
    fig.suptitle(extra_title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def print_table(results: list[dict]) -> None:
    print(
        f"\n{'mode':<14}{'mean step s':>12}{'samples/s':>11}{'trainer idle':>14}{'gen idle':>10}{'G s':>8}{'T s':>8}"
        f"{'staleness':>11}{'|log mu/pi|':>13}{'reward (last 4)':>17}{'s to reward':>13}{'start-up s':>12}"
    )
    for r in results:
        print(
            f"{r['mode']:<14}{r['step_s']:>12.3f}{r['samples_per_s']:>11.1f}{r.get('trainer_idle_frac', float('nan')):>14.2f}"
            f"{r.get('generator_idle_frac', float('nan')):>10.2f}{r.get('G_s', float('nan')):>8.3f}{r.get('T_s', float('nan')):>8.3f}"
            f"{r.get('staleness_mean', 0.0):>11.2f}{r.get('mismatch_mean', float('nan')):>13.3f}{r['reward_last']:>17.3f}"
            f"{_seconds(r.get('time_to_reward_s')):>13}{r.get('startup_s', 0.0):>12.1f}"
        )


def _seconds(t: float | None) -> str:
    return "never" if t is None else f"{t:.1f}"


def mode_means(runs: list[dict], batch: int) -> dict:
    """One mode's figures averaged over its runs (one per seed); samples/s from the mean step."""
    keys = ("step_s", "trainer_idle_frac", "generator_idle_frac", "G_s", "T_s", "staleness_mean", "mismatch_mean", "startup_s")
    out = {k: statistics.mean(r[k] for r in runs) for k in keys if all(k in r for r in runs)}
    out["samples_per_s"] = batch / out["step_s"]
    out["samples_per_s_runs"] = [r["samples_per_s"] for r in runs]
    reached = [r.get("time_to_reward_s") for r in runs]
    # only a mean over runs that all got there: one that never did has no time to average
    out["time_to_reward_s"] = statistics.mean(reached) if all(t is not None for t in reached) else None
    out["time_to_reward_s_runs"] = reached
    out["runs"] = len(runs)
    return out


def mean_gap(gaps: list[dict]) -> dict:
    """The mean of per-seed reward gaps (`reward_gap` results), its standard error from their
    spread between seeds (one seed: that run's within-run error), and whether the mean is
    no worse than -2 standard errors."""
    if not gaps:
        return {"gap": float("nan"), "stderr": float("nan"), "per_seed": [], "seeds": 0, "within_noise_or_better": False}
    values = [g["gap"] for g in gaps]
    stderr = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else gaps[0]["stderr"]
    mean = statistics.mean(values)
    return {
        "gap": mean,
        "stderr": stderr,
        "per_seed": values,
        "seeds": len(values),
        "within_noise_or_better": mean >= -2 * (stderr if stderr == stderr else 0.0),
    }


def paired_reward_gap(results: list[dict], seeds: list[int]) -> dict:
    """Per seed, async's reward minus sync's at equal policy samples (same initial weights and
    prompts), summarised by `mean_gap`: the spread between seeds is the run-to-run noise,
    which one pair's within-run error does not see."""
    per_seed = []
    for seed in seeds:
        pair = {r["base_mode"]: r for r in results if r["seed"] == seed}
        if "sync" in pair and "async" in pair:
            g = reward_gap(pair["async"]["rows"], pair["sync"]["rows"])
            if g["points"]:
                per_seed.append(g)
    return mean_gap(per_seed)


def bench_seeds(args: argparse.Namespace) -> list[int]:
    return [args.seed + i for i in range(max(1, args.seeds))]


def run_seeds(args: argparse.Namespace, modes: list[str], root: str) -> list[dict]:
    """Every mode at every seed of `--seeds`, seed by seed with the modes side by side (the
    VM's speed drifts, and this spreads the drift over all modes). The first seed's runs
    are named by their mode, the others `mode-seedN`."""
    results = []
    for i, seed in enumerate(bench_seeds(args)):
        seed_args = argparse.Namespace(**{**vars(args), "seed": seed})
        for mode in modes:
            name = mode if i == 0 else f"{mode}-seed{seed}"
            results.append({**run_mode(mode, seed_args, os.path.join(root, name)), "mode": name, "base_mode": mode, "seed": seed})
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--out", default=os.path.join(RESULTS, "async_vs_sync.json"))
    args = p.parse_args()
    t0 = time.monotonic()
    load_before = machine()
    modes = args.modes.split(",")
    seeds = bench_seeds(args)
    batch = args.batch_groups * args.group_size
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-") as root:
        results = run_seeds(args, modes, root)
    means = {m: mode_means([r for r in results if r["base_mode"] == m], batch) for m in modes}
    print_table(results)
    bound = {}
    if {"sync", "async"} <= set(modes):
        bound = report_overlap(means, results, seeds, args.reward_level)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for r in results:
        r.pop("hf_v0", None)
        r.pop("tokenizer_dir", None)
    payload = {
        "args": vars(args),
        "model": bench_model(args),
        "machine_before": load_before,
        "machine_after": machine(),
        "results": results,
        "means": means,
        "overlap": bound,
        "wall_s": time.monotonic() - t0,
    }
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    title = f"async vs sync over {len(seeds)} seed(s)"
    if bound:
        title += f": {bound['speedup']:.2f}x of an ideal {bound['bound']:.2f}x"
    png = plot(results, os.path.splitext(args.out)[0] + ".png", title)
    print(f"wrote {args.out} and {png} in {time.monotonic() - t0:.0f} s")


def report_overlap(means: dict, results: list[dict], seeds: list[int], reward_level: float) -> dict:
    """The overlap bound, async's share of it and the paired reward gap, printed and returned."""
    sync, asyn = means["sync"], means["async"]
    bound = overlap_bound(sync, asyn)
    gap = bound["reward_async_vs_sync"] = paired_reward_gap(results, seeds)
    print(
        f"\nmeans over {len(seeds)} seed(s): sync {sync['samples_per_s']:.1f} samples/s, async {asyn['samples_per_s']:.1f} "
        f"(trainer idle {asyn['trainer_idle_frac']:.2f}, generator idle {asyn['generator_idle_frac']:.2f})"
    )
    print(
        f"sync step = G {bound['G_s']:.3f} s + T {bound['T_s']:.3f} s + other {bound['other_s']:.3f} s; "
        f"ideal async speedup (G+T)/max(G,T) = {bound['bound']:.2f}x; measured {bound['speedup']:.2f}x "
        f"= {100 * bound['fraction_of_bound']:.0f}% of the possible gain"
    )
    print(f"contention: G x{bound['G_inflation']:.2f}, T x{bound['T_inflation']:.2f} when both run at once on {os.cpu_count()} cores")
    ts, ta = sync["time_to_reward_s"], asyn["time_to_reward_s"]
    bound["time_to_reward_sync_over_async"] = ts / ta if ts and ta else None
    print(
        f"training time to a trained-batch reward of {reward_level}: sync {_seconds(ts)} s, async {_seconds(ta)} s"
        + (f" (sync / async {ts / ta:.2f}x)" if ts and ta else "")
    )
    print(
        f"reward at equal policy samples, async - sync, per seed: {', '.join(f'{g:+.3f}' for g in gap['per_seed'])}; "
        f"mean {gap['gap']:+.3f} +- {gap['stderr']:.3f}: {'within noise or better' if gap['within_noise_or_better'] else 'WORSE'}"
    )
    return bound


if __name__ == "__main__":
    main()
