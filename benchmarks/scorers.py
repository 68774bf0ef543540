"""A reward model as the only reward, against the verifier; and what a scorer proc costs.

In one invocation:
  1. A small reward model is trained on preference pairs of the default task (`digits`),
     ordered by its verifier (meshrl/scorers/preference.py), and saved as a checkpoint.
  2. Per seed, three runs of the embedded default (async, `auto` placement), side by side:
       verifier   the task's verifier is the reward (the default run)
       rm_only    scoring.env_weight=0 + the reward model on its own scorer proc: the run
                  learns from the reward model alone; the verifier is only logged
       rm_logged  the verifier is the reward, the reward model scores every episode with
                  weight 0 on its scorer proc: the same learning signal as `verifier`, so
                  its step time over verifier's is the scorer proc's cost
Per run: the verifier's reward per step (`reward/mean` for verifier; `scoring/env/mean`
otherwise), its first and last 3 steps, the steps until its 3-step mean first reaches
`--level`, and the steady step time (steps after `--warmup`), mean and median, with the
ratio over the verifier run of the same seed. The scorer's own timings are kept too.

    python benchmarks/scorers.py [--steps 40] [--seeds 2]

Writes benchmarks/results/scorers.json and scorers.png (verifier reward per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from common import RESULTS, machine

ARMS = ("verifier", "rm_only", "rm_logged")
COLORS = {"verifier": "tab:gray", "rm_only": "tab:red", "rm_logged": "tab:blue"}


def train_rm(root: str) -> tuple[str, dict]:
    from meshrl.scorers.preference import build_reward_model, task_preferences, train_reward_model
    from meshrl.tokenizer import build_char_tokenizer

    t0 = time.monotonic()
    path = build_reward_model(os.path.join(root, "rm"), build_char_tokenizer(os.path.join(root, "tok")))
    stats = train_reward_model(path, task_preferences("digits", 4000, seed=0), steps=300)
    stats["train_s"] = time.monotonic() - t0
    return path, stats


def run(arm: str, steps: int, seed: int, run_dir: str, rm: str) -> dict:
    import meshrl

    overrides = [
        f"steps={steps}",
        f"seed={seed}",
        f"logging.run_dir={run_dir}",
        "logging.tensorboard=false",
        "logging.progress=false",
        "logging.plot=false",
        "trainer.checkpoint_every=0",
    ]
    if arm == "rm_only":
        overrides += ["scoring.env_weight=0", f"scoring.scorers=[{{kind: reward_model, name: rm, path: {rm}}}]"]
    elif arm == "rm_logged":
        overrides += [f"scoring.scorers=[{{kind: reward_model, name: rm, path: {rm}, weight: 0}}]"]
    t0 = time.monotonic()
    res = meshrl.run(overrides=overrides)
    verifier_key = "reward/mean" if arm == "verifier" else "scoring/env/mean"
    rows = [
        {
            "step": int(r["version"]),
            "step_s": r["time/step_s"],
            "verifier": r.get(verifier_key),
            "rm": r.get("scoring/rm/mean"),
            "queue_s": r.get("scoring/rm/queue_s"),
            "score_s": r.get("scoring/rm/score_s"),
            "wait_s": r.get("scoring/rm/wait_s"),
        }
        for r in res.metrics
        if "time/step_s" in r
    ]
    return {"arm": arm, "seed": seed, "rows": rows, "wall_s": time.monotonic() - t0}


def mean_of(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def steps_to(rows: list[dict], level: float) -> int | None:
    """The first step whose 3-step mean verifier reward (that step and the two before) reaches `level`."""
    v = [r["verifier"] for r in rows]
    for i in range(2, len(v)):
        window = [x for x in v[i - 2 : i + 1] if x is not None]
        if len(window) == 3 and statistics.mean(window) >= level:
            return rows[i]["step"]
    return None


def summarize(r: dict, warmup: int, level: float) -> dict:
    rows = r["rows"]
    steady = [x["step_s"] for x in rows[warmup:]]
    return {
        "verifier_first3": mean_of(x["verifier"] for x in rows[:3]),
        "verifier_last3": mean_of(x["verifier"] for x in rows[-3:]),
        "steps_to_level": steps_to(rows, level),
        "step_s": statistics.mean(steady),
        "step_s_median": statistics.median(steady),
        "rm_queue_s": mean_of(x["queue_s"] for x in rows),
        "rm_score_s": mean_of(x["score_s"] for x in rows),
        "rm_wait_s": mean_of(x["wait_s"] for x in rows),
    }


def plot(runs: list[dict], path: str, level: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        xs = [x["step"] for x in r["rows"] if x["verifier"] is not None]
        ys = [x["verifier"] for x in r["rows"] if x["verifier"] is not None]
        ax.plot(xs, ys, color=COLORS[r["arm"]], alpha=0.85, linestyle=("-", "--", ":")[r["seed"] % 3], label=f"{r['arm']} (seed {r['seed']})")
    ax.axhline(level, color="black", linewidth=0.6, linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("verifier reward (digits)")
    ax.set_title("rewarded by the verifier, or by a reward model alone")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the step time")
    p.add_argument("--level", type=float, default=0.8, help="verifier reward the runs are timed to")
    p.add_argument("--out", default=os.path.join(RESULTS, "scorers.json"))
    args = p.parse_args()
    t0, machine_before = time.monotonic(), machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-") as root:
        rm, rm_stats = train_rm(root)
        print(f"reward model: held-out pairwise accuracy {rm_stats['accuracy']:.3f}, trained in {rm_stats['train_s']:.1f} s", flush=True)
        for seed in range(args.seeds):  # seed by seed, the arms side by side: the machine's drift spreads over all
            for arm in ARMS:
                r = run(arm, args.steps, seed, os.path.join(root, f"{arm}-{seed}"), rm)
                r.update(summarize(r, args.warmup, args.level))
                runs.append(r)
                print(
                    f"{arm} seed {seed}: verifier {r['verifier_first3']:.3f} -> {r['verifier_last3']:.3f}, "
                    f"reaches {args.level} at step {r['steps_to_level']}, step {r['step_s']:.3f} s (median {r['step_s_median']:.3f})",
                    flush=True,
                )
    for r in runs:
        ref = next(x for x in runs if x["arm"] == "verifier" and x["seed"] == r["seed"])
        r["step_over_verifier"] = r["step_s"] / ref["step_s"]
        r["step_median_over_verifier"] = r["step_s_median"] / ref["step_s_median"]
    keys = (
        "verifier_first3",
        "verifier_last3",
        "step_s",
        "step_s_median",
        "step_over_verifier",
        "step_median_over_verifier",
        "rm_queue_s",
        "rm_score_s",
        "rm_wait_s",
    )
    means = {arm: {k: mean_of(r[k] for r in runs if r["arm"] == arm) for k in keys} for arm in ARMS}
    for arm in ARMS:
        means[arm]["steps_to_level_runs"] = [r["steps_to_level"] for r in runs if r["arm"] == arm]
    print(
        f"\n{'arm':<11}{'verifier first 3':>17}{'last 3':>8}{f'steps to {args.level}':>14}{'step s':>8}{'median':>8}"
        f"{'/ verifier':>11}{'median /':>10}{'rm wait s':>11}"
    )
    for arm, m in means.items():
        wait = "-" if m["rm_wait_s"] is None else f"{m['rm_wait_s']:.3f}"
        print(
            f"{arm:<11}{m['verifier_first3']:>17.3f}{m['verifier_last3']:>8.3f}{str(m['steps_to_level_runs']):>14}{m['step_s']:>8.3f}"
            f"{m['step_s_median']:>8.3f}{m['step_over_verifier']:>11.3f}{m['step_median_over_verifier']:>10.3f}{wait:>11}"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    plot(runs, args.out.removesuffix(".json") + ".png", args.level)
    with open(args.out, "w") as f:
        json.dump(
            {
                "machine_before": machine_before,
                "machine_after": machine(),
                "wall_s": time.monotonic() - t0,
                "args": vars(args),
                "reward_model": rm_stats,
                "means": means,
                "runs": runs,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
