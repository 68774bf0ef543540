"""PPO with a learned critic beside GRPO at equal samples (configs/ppo.yaml, the default task).

Arms, each run once per seed (same steps, batch and group size, same seed: the same initial
weights and prompts), synchronously (buffer depth 0, lag 0, update_mode block), as the
suite's learning tests run, so that the arms differ in the advantage alone:

- `ppo`:  configs/ppo.yaml: every model token's advantage from the critic (GAE);
- `grpo`: the same config with `trainer.loss.advantage: grpo` (no critic).

Per run: the trained batch's mean reward at each step, the first step reaching `--reach`,
the mean over all steps (area under the curve per sample), and for PPO the critic's
explained variance on batches it had not trained on yet (mean over the steps before the
rewards saturate, where it is defined) and its version lag. Each run's wall clock is stored,
not compared.

    python benchmarks/ppo.py [--steps 24] [--seeds 0 1 2]

Prints a table, writes benchmarks/results/ppo.json with the machine record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.async_vs_sync import machine  # noqa: E402

SYNC = {"buffer.depth": 0, "buffer.max_lag": 0, "generator.update_mode": "block"}


def run_arm(arm: str, steps: int, seed: int, run_dir: str) -> dict:
    import meshrl
    from meshrl.config.loading import apply_overrides

    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "ppo.yaml")))
    if arm == "grpo":
        cfg.pop("critic", None)
        cfg["trainer"]["loss"]["advantage"] = "grpo"
    over = {**SYNC, "steps": steps, "seed": seed, "logging.run_dir": run_dir}
    over.update({"logging.progress": "false", "logging.plot": "false", "logging.tensorboard": "false"})
    start = time.time()
    rows = [r for r in meshrl.run(apply_overrides(cfg, [f"{k}={v}" for k, v in over.items()])).metrics if "trainer/reward_mean" in r]
    reward = [r["trainer/reward_mean"] for r in rows]
    out = {"arm": arm, "seed": seed, "wall_s": time.time() - start, "reward": reward}
    if arm == "ppo":
        unsaturated = [r for r in rows if r["trainer/reward_mean"] < 0.95]
        out["explained_variance"] = [r.get("critic/explained_variance") for r in rows]
        out["ev_mean_unsaturated"] = statistics.fmean(r["critic/explained_variance"] for r in unsaturated[1:]) if len(unsaturated) > 1 else None
        out["version_lag_max"] = max(r.get("critic/version_lag", 0) for r in rows)
    return out


def reach(rewards: list[float], level: float) -> int | None:
    return next((i + 1 for i, r in enumerate(rewards) if r >= level), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--reach", type=float, default=0.9)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ppo.json"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "bench-ppo"))
    a = p.parse_args()
    runs = []
    for seed in a.seeds:
        for arm in ("ppo", "grpo"):  # interleaved: a change in the machine's load hits both alike
            r = run_arm(arm, a.steps, seed, os.path.join(a.run_dir, f"{arm}-{seed}"))
            r["step_reaching"] = reach(r["reward"], a.reach)
            r["mean_reward"] = statistics.fmean(r["reward"])
            runs.append(r)
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k not in ("reward", "explained_variance")}
            print(json.dumps(shown), "reward", " ".join(f"{x:.2f}" for x in r["reward"]), flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"machine": machine(), "steps": a.steps, "reach": a.reach, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
