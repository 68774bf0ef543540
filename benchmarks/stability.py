"""Stability: do runs hold what they learn? Every shipped CPU config, async and sync, several seeds.

For each config (configs/default.yaml, tool-use.yaml, long-tail.yaml, sync.yaml, colocate.yaml) at
`--steps-factor` times its own step count (default 2x), seed by seed, in each mode:
  async   buffer.depth 2, max_lag 2, generator.update_mode keep, trainer.loss.correction tis
  sync    buffer.depth 0, max_lag 0, generator.update_mode block, trainer.loss.correction none
Under placement=colocate (colocate.yaml) `async` is one step off the policy (max_lag 2
counts as 1 there) and `sync` synchronous. Everything else is the config as shipped. A
(config, mode) pair whose run would be the same as another's (sync.yaml in sync mode is
default.yaml in sync mode) runs once and is shared.

Per run, on the reward of the policy that sampled each batch (`buffer/sampled_reward_mean`:
the trained batch plus the groups dynamic sampling dropped while it filled; it equals
`trainer/reward_mean` when nothing is dropped): the first, last and best tenth of the steps
(mean reward over each tenth), the steps below half of the best tenth (the trailing
tenth-long mean, counted once the run has first reached half its best), the entropy trace,
the share of zero-variance groups, and the alarms the run raised (meshrl/stability.py). A
collapse is the last tenth's mean under half of the best tenth's. Per config, async's reward
minus sync's at equal policy samples, paired by seed, with the spread between seeds as its
noise.

    python benchmarks/stability.py [--configs default,tool-use,long-tail,sync,colocate] [--modes async,sync]
        [--seeds 3] [--first-seed 0] [--steps-factor 2 | --steps N] [--set KEY=VALUE ...]
    python benchmarks/stability.py --from-json benchmarks/results/stability.json   # summarise again

Prints a table per run and per config, writes benchmarks/results/stability.json and one
plot per config (stability_CONFIG.png).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from common import RESULTS, ROOT, SEED_STYLES, SYSTEM_COLORS, machine

from async_vs_sync import mean_gap, policy_samples, reward_gap  # noqa: E402

CONFIGS = {
    "default": "configs/default.yaml",
    "tool-use": "configs/tool-use.yaml",
    "long-tail": "configs/long-tail.yaml",
    "sync": "configs/sync.yaml",
    "colocate": "configs/colocate.yaml",
}
"""The shipped CPU configs but code-tool.yaml, the sandbox's demonstration, whose 150 steps alone
take about 12 minutes on 2 cores."""
MODES = {
    "async": ["buffer.depth=2", "buffer.max_lag=2", "generator.update_mode=keep", "trainer.loss.correction=tis"],
    "sync": ["buffer.depth=0", "buffer.max_lag=0", "generator.update_mode=block", "trainer.loss.correction=none"],
}
ROW_KEYS = (
    "buffer/sampled_reward_mean",
    "trainer/reward_mean",
    "reward/mean",
    "trainer/entropy",
    "trainer/zero_variance_groups",
    "buffer/dropped_zero_variance_groups",
    "buffer/kept_zero_variance_groups",
    "trainer/logprob_mismatch",
    "trainer/clip_frac",
    "trainer/kl_prev_version",
    "trainer/staleness_mean",
    "episode/count",
    "time/step_s",
)


# ---- the arithmetic (tests/test_benchmark_math.py) ----------------------------------------------
def tenths(values: list[float]) -> list[float]:
    """Means of the ten consecutive tenths of `values` (fewer, of one value each, under ten)."""
    n = len(values)
    cuts = [round(i * n / 10) for i in range(11)] if n >= 10 else list(range(n + 1))
    return [statistics.mean(values[a:b]) for a, b in zip(cuts, cuts[1:])]


def trailing_means(values: list[float], window: int) -> list[float]:
    """Mean of the last `window` values at every step (fewer at the start)."""
    return [statistics.mean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def run_summary(rewards: list[float]) -> dict:
    """First, last and best tenth of a reward trace, steps below half of the best, collapse."""
    parts = tenths(rewards)
    if not parts:
        return {"first_tenth": float("nan"), "last_tenth": float("nan"), "best_tenth": float("nan"), "steps_below_half_best": 0, "collapsed": False}
    best = max(parts)
    window = max(1, len(rewards) // 10)
    below, reached = 0, False
    for m in trailing_means(rewards, window):
        reached = reached or m >= best / 2
        below += reached and m < best / 2
    return {"first_tenth": parts[0], "last_tenth": parts[-1], "best_tenth": best, "steps_below_half_best": below, "collapsed": parts[-1] < best / 2}


# ---- runs -----------------------------------------------------------------------------------------
def run_config(config_name: str, mode: str, seed: int, steps: int, extra: list[str], run_dir: str):
    from meshrl.resume import as_config

    overrides = [
        f"steps={steps}",
        f"seed={seed}",
        f"logging.run_dir={run_dir}",
        "logging.tensorboard=false",
        "logging.progress=false",
        "logging.plot=false",
        *MODES[mode],
        *extra,
    ]
    return as_config(os.path.join(ROOT, CONFIGS[config_name]), overrides)


def shipped_steps(config_name: str) -> int:
    from meshrl.resume import as_config

    return as_config(os.path.join(ROOT, CONFIGS[config_name])).steps


def run_once(config, alarms: list[str]) -> dict:
    """Start a run, take its steps, stop it: the per-step rows and the alarms it raised."""
    import logging

    from meshrl.api import Session

    class Catch(logging.Handler):
        def emit(self, record):
            if "ALARM" in record.getMessage():
                alarms.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logging.getLogger("meshrl").addHandler(handler)
    t0 = time.monotonic()
    session = Session(config)
    try:
        session.start()
        startup = time.monotonic() - t0
        raw = session.step(config.steps)
    finally:
        session.stop()
        logging.getLogger("meshrl").removeHandler(handler)
    rows = []
    for r in raw:
        row = {"step": int(r["version"]), **{k: float(r[k]) for k in ROW_KEYS if k in r}}
        row["reward"] = row.get("buffer/sampled_reward_mean", row.get("trainer/reward_mean", 0.0))
        rows.append(row)
    return {"startup_s": startup, "total_s": time.monotonic() - t0, "rows": rows}


def measure(config_name: str, mode: str, seed: int, steps: int, extra: list[str], root: str, cache: dict) -> dict:
    run_dir = os.path.join(root, f"{config_name}-{mode}-seed{seed}")
    config = run_config(config_name, mode, seed, steps, extra, run_dir)
    key = json.dumps({**config.to_dict(), "logging": None}, sort_keys=True, default=str)
    if key in cache:
        return {**cache[key], "config": config_name, "name": f"{config_name}/{mode}/seed{seed}", "same_run_as": cache[key]["name"]}
    alarms: list[str] = []
    out = run_once(config, alarms)
    rewards = [r["reward"] for r in out["rows"]]
    entropy = [r.get("trainer/entropy", float("nan")) for r in out["rows"]]
    flat = [r.get("trainer/zero_variance_groups", 0.0) for r in out["rows"]]
    result = {
        "name": f"{config_name}/{mode}/seed{seed}",
        "config": config_name,
        "mode": mode,
        "seed": seed,
        "steps": steps,
        **run_summary(rewards),
        "trained_reward": run_summary([r.get("trainer/reward_mean", 0.0) for r in out["rows"]]),
        "entropy_first_tenth": (tenths(entropy) or [float("nan")])[0],
        "entropy_last_tenth": (tenths(entropy) or [float("nan")])[-1],
        "zero_variance_last_tenth": (tenths(flat) or [float("nan")])[-1],
        "dropped_zero_variance": out["rows"][-1].get("buffer/dropped_zero_variance_groups", 0.0) if out["rows"] else 0.0,
        "alarms": alarms,
        **{k: v for k, v in out.items() if k != "rows"},
        "rows": out["rows"],
    }
    cache[key] = result
    print(
        f"{result['name']:<28} first {result['first_tenth']:.3f}  last {result['last_tenth']:.3f}  best {result['best_tenth']:.3f}  "
        f"below-half steps {result['steps_below_half_best']:>3}  entropy {result['entropy_first_tenth']:.2f} -> "
        f"{result['entropy_last_tenth']:.2f}  collapsed {'YES' if result['collapsed'] else 'no'}  ({result['total_s']:.0f} s)",
        flush=True,
    )
    return result


def async_minus_sync(runs: list[dict]) -> dict:
    """Per seed, the async run's sampled reward minus the sync run's at equal policy samples
    (section 1's measure: a batch trained at step k was sampled by version k - 1 - staleness;
    one batch a step in both modes), then `mean_gap` over seeds: the spread between seeds is
    the noise. Seeds without both runs are left out."""
    gaps = []
    for seed in sorted({r["seed"] for r in runs}):
        pair = {r["mode"]: r for r in runs if r["seed"] == seed}
        if "async" in pair and "sync" in pair:
            at_samples = [
                [{"policy_samples": policy_samples(row["step"], row.get("trainer/staleness_mean", 0.0), 1), "reward": row["reward"]} for row in pair[m]["rows"]]
                for m in ("async", "sync")
            ]
            gap = reward_gap(*at_samples)
            if gap["points"]:
                gaps.append(gap)
    return mean_gap(gaps)


def summarize(results: list[dict], configs: list[str], modes: list[str]) -> dict:
    """Per config and mode: mean first/last/best tenth over seeds and the collapses; per config,
    async - sync paired by seed. Printed as a table."""
    per_config = {}
    print(f"\n{'config':<11}{'mode':<7}{'runs':>5}{'collapses':>11}{'first':>8}{'last':>8}{'best':>8}{'async - sync (paired by seed)':>34}")
    for name in configs:
        runs = [r for r in results if r["config"] == name]
        paired = async_minus_sync(runs)
        for mode in modes:
            mine = [r for r in runs if r["mode"] == mode]
            if not mine:
                continue
            summary = {k: statistics.mean(r[k] for r in mine) for k in ("first_tenth", "last_tenth", "best_tenth")}
            summary.update(runs=len(mine), collapses=sum(r["collapsed"] for r in mine))
            per_config[f"{name}/{mode}"] = summary
            vs = f"{paired['gap']:+.3f} +- {paired['stderr']:.3f} ({paired['seeds']} seeds)" if mode == "async" and paired["seeds"] else ""
            print(
                f"{name:<11}{mode:<7}{len(mine):>5}{summary['collapses']:>11}{summary['first_tenth']:>8.3f}"
                f"{summary['last_tenth']:>8.3f}{summary['best_tenth']:>8.3f}{vs:>34}"
            )
        if paired["seeds"]:
            per_config[f"{name}/async_minus_sync"] = paired
    return per_config


def plot(results: list[dict], config_name: str, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e, ax_z) = plt.subplots(1, 3, figsize=(16, 3.8))
    seeds = sorted({r["seed"] for r in results})
    for res in results:
        rows = res["rows"]
        steps = [r["step"] for r in rows]
        style = {
            "color": SYSTEM_COLORS.get(res["mode"], "0.5"),
            "linestyle": SEED_STYLES[seeds.index(res["seed"]) % len(SEED_STYLES)],
            "linewidth": 1.2,
            "label": f"{res['mode']} seed {res['seed']}",
        }
        window = max(1, len(rows) // 10)
        ax_r.plot(steps, trailing_means([r["reward"] for r in rows], window), **style)
        ax_e.plot(steps, [r.get("trainer/entropy", float("nan")) for r in rows], **style)
        ax_z.plot(steps, trailing_means([r.get("trainer/zero_variance_groups", 0.0) for r in rows], window), **style)
    for ax, title in (
        (ax_r, "sampled reward (trailing tenth-long mean)"),
        (ax_e, "policy entropy (nats / trained token)"),
        (ax_z, "zero-variance share of trained groups"),
    ):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{CONFIGS[config_name]}: {len(results)} runs")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ",".join(CONFIGS))
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--seeds", type=int, default=3, help="seeds first-seed .. first-seed + N - 1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps-factor", type=float, default=2.0, help="steps = this x the config's own `steps`")
    p.add_argument("--steps", type=int, default=None, help="steps for every run (instead of --steps-factor)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override for every run")
    p.add_argument("--out", default=os.path.join(RESULTS, "stability.json"))
    p.add_argument("--from-json", default=None, metavar="PATH", help="summarise and plot the runs of an earlier stability.json again, running nothing")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        configs = list(dict.fromkeys(r["config"] for r in saved["results"]))
        saved["per_config"] = summarize(saved["results"], configs, list(dict.fromkeys(r["mode"] for r in saved["results"])))
        with open(args.out, "w") as f:
            json.dump(saved, f, indent=2)
        for name in configs:
            plot([r for r in saved["results"] if r["config"] == name], name, f"{os.path.splitext(args.out)[0]}_{name}.png")
        return
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    t0 = time.monotonic()
    before = machine()
    results, cache = [], {}
    with tempfile.TemporaryDirectory(prefix="meshrl-stability-") as root:
        for name in args.configs.split(","):
            steps = args.steps or max(1, round(args.steps_factor * shipped_steps(name)))
            for seed in seeds:
                for mode in args.modes.split(","):
                    results.append(measure(name, mode, seed, steps, args.set, root, cache))
    per_config = summarize(results, args.configs.split(","), args.modes.split(","))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "seeds": seeds,
                "machine_before": before,
                "machine_after": machine(),
                "per_config": per_config,
                "results": results,
                "wall_s": time.monotonic() - t0,
            },
            f,
            indent=2,
        )
    stem = os.path.splitext(args.out)[0]
    for name in args.configs.split(","):
        runs = [r for r in results if r["config"] == name]
        if runs:
            plot(runs, name, f"{stem}_{name}.png")
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
