"""PRIME's implicit PRM beside outcome-only GRPO on the sparse task (configs/prime.yaml,
task:digits_sparse: 1 when at least 2 of the first 4 characters are digits, else 0).

Arms, each run once per seed at equal samples (same steps, batch and group size, same
seed, so the same initial weights and prompts):

- `grpo`:        outcome only, trainer.loss.advantage=grpo, no scorer;
- `rloo`:        outcome only with prime.yaml's leave-one-out outcome baseline (rloo);
- `prime-sync`:  configs/prime.yaml synchronously (buffer depth 0, lag 0, update_mode block);
- `prime-async`: configs/prime.yaml as shipped (the default's depth 2, lag 2, update_mode keep);
- `grpo-async`, `rloo-async`: the outcome-only arms as shipped, asynchronous: what asynchrony
  alone costs on this task, for the PRM's async-minus-sync gap to be read against;
- `ppo`, `prime-ppo`: PPO with configs/ppo.yaml's critic (trainer.loss.advantage=gae),
  synchronously, outcome only and with the PRM, whose per-token q are then rewards GAE adds up
  (Math-Shepherd's way of training PPO on a PRM): whether the PRM helps a critic's run;
- `prime-sync-procs2`: `prime-sync` with its PRM sharded over two procs (scoring.scorers[0].procs=2):
  the same steps as one proc, so the same curve within noise, at what cost per step;
- an async arm with `-sampler`, `-versions` or `-proximal` appended (`grpo-async-versions`):
  that `trainer.loss.clip_against`, the anchor of the PPO clip for stale tokens.

Per arm: the reward per sample (the trained batch's mean env reward at each step, against
the samples generated so far), the first step whose reward reaches `--reach`, the mean
reward over all steps (the area under the curve per sample), and for the PRM its loss and
accuracy on batches it had not trained on yet, its version and version lag. The async run
is compared with the sync run seed by seed: the mean of the paired gaps against their
spread. Each run's wall clock is printed and stored, not compared (the machine is shared).

    python benchmarks/prime.py [--steps 16] [--seeds 0 1 2] [--arms grpo rloo prime-sync prime-async]

Prints a table, writes benchmarks/results/prime.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time

import yaml

from common import RESULTS, ROOT, machine

SYNC = {"buffer.depth": 0, "buffer.max_lag": 0, "generator.update_mode": "block"}


def arm_config(arm: str, steps: int, seed: int, run_dir: str) -> dict:
    from meshrl.config.loading import apply_overrides

    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "prime.yaml")))
    base = arm.split("-")[0]
    if base in ("grpo", "rloo", "ppo"):  # outcome only
        cfg["scoring"] = {}
    if base in ("grpo", "rloo"):
        cfg["trainer"]["loss"]["advantage"] = base
    if "ppo" in arm.split("-"):  # PPO's critic, as configs/ppo.yaml sets it
        cfg["trainer"]["loss"]["advantage"] = "gae"
        cfg["critic"] = yaml.safe_load(open(os.path.join(ROOT, "configs", "ppo.yaml")))["critic"]
    over = {"steps": steps, "seed": seed, "logging.run_dir": run_dir, "logging.progress": "false", "logging.plot": "false", "logging.tensorboard": "false"}
    if "-async" not in arm:
        over.update(SYNC)
    anchor = arm.rsplit("-", 1)[-1]
    if "-async-" in arm and anchor in ("sampler", "versions", "proximal"):
        over["trainer.loss.clip_against"] = anchor
    lr = re.search(r"-lr(\d+(?:\.\d+)?(?:e-?\d+)?)", arm)
    if lr is not None:  # e.g. prime-sync-lr1e-3: the PRM's lr
        cfg["scoring"]["scorers"][0]["lr"] = float(lr.group(1))
    if arm.endswith("-procs2"):
        cfg["scoring"]["scorers"][0]["procs"] = 2
    return apply_overrides(cfg, [f"{k}={v}" for k, v in over.items()])


def run_arm(arm: str, steps: int, seed: int, run_dir: str) -> dict:
    import meshrl
    from meshrl.config import Config

    cfg = arm_config(arm, steps, seed, run_dir)
    start = time.time()
    result = meshrl.run(cfg)
    rows = [r for r in result.metrics if "trainer/reward_mean" in r]
    c = Config.from_dict(cfg)
    per_step, group = c.batch_groups, c.generator.group_size
    out = {
        "arm": arm,
        "seed": seed,
        "wall_s": time.time() - start,
        "samples": [(i + 1) * per_step * group for i in range(len(rows))],
        "reward": [r["trainer/reward_mean"] for r in rows],
        "staleness_max": max(r.get("trainer/staleness_max", 0) for r in rows),
        "step_s": [r.get("time/step_s") for r in rows],
        "clip_frac": [r.get("trainer/clip_frac") for r in rows],
    }
    for key in ("loss", "accuracy", "version", "version_lag", "process_abs", "score_s"):
        out[f"prm_{key}"] = [r.get(f"scoring/prm/{key}") for r in rows]
    return out


def reach(rewards: list[float], level: float) -> int | None:
    return next((i + 1 for i, r in enumerate(rewards) if r >= level), None)


def _median_after_start(values: list | None) -> float | None:
    kept = [x for x in (values or [])[3:] if x is not None]
    return statistics.median(kept) if kept else None


def summary(runs: list[dict], level: float) -> dict:
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], []).append(r)
    table = {}
    for arm, rs in by_arm.items():
        means = [statistics.fmean(r["reward"]) for r in rs]
        table[arm] = {
            "seeds": [r["seed"] for r in rs],
            "mean_reward_per_run": means,
            "mean_reward": statistics.fmean(means),
            "final_reward": [r["reward"][-1] for r in rs],
            "step_reaching": [reach(r["reward"], level) for r in rs],
            "wall_s": [round(r["wall_s"], 1) for r in rs],
            # after the first 3 steps (start-up); the PRM's time per batch scored and trained
            "step_s_median": [_median_after_start(r.get("step_s")) for r in rs],
            "prm_score_s_median": [_median_after_start(r.get("prm_score_s")) for r in rs],
        }
    for arm in [a for a in by_arm if "-async" in a]:
        base = arm.split("-")[0]
        sync_arm = "prime-sync" if base == "prime" else base
        if sync_arm in by_arm:
            sync = {r["seed"]: statistics.fmean(r["reward"]) for r in by_arm[sync_arm]}
            gaps = [statistics.fmean(r["reward"]) - sync[r["seed"]] for r in by_arm[arm] if r["seed"] in sync]
            table[f"{arm}_minus_sync"] = {
                "gaps": gaps,
                "mean": statistics.fmean(gaps) if gaps else None,
                "stdev": statistics.stdev(gaps) if len(gaps) > 1 else None,
            }
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=["grpo", "rloo", "prime-sync", "prime-async"])
    p.add_argument("--reach", type=float, default=0.9, help="the reward level whose first step is reported")
    p.add_argument("--out", default=os.path.join(RESULTS, "prime.json"))
    p.add_argument("--merge", action="store_true", help="add these runs to --out's (another invocation's arms)")
    p.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "bench-prime"))
    args = p.parse_args()
    runs = json.load(open(args.out))["runs"] if args.merge and os.path.exists(args.out) else []
    for seed in args.seeds:
        for arm in args.arms:
            r = run_arm(arm, args.steps, seed, os.path.join(args.run_dir, f"{arm}-{seed}"))
            runs.append(r)
            print(f"{arm:12s} seed {seed}: reward {' '.join(f'{x:.2f}' for x in r['reward'])}  ({r['wall_s']:.0f}s)", flush=True)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"steps": args.steps, "machine": machine(), "runs": runs, "summary": summary(runs, args.reach)}, f, indent=1)
    table = summary(runs, args.reach)
    print(f"\n{'arm':12s} {'mean reward/sample':>20s} {'final':>18s} {f'step >= {args.reach}':>16s}")
    for arm, row in table.items():
        if arm.endswith("_minus_sync"):
            continue
        print(f"{arm:12s} {row['mean_reward']:20.3f} {' '.join(f'{x:.2f}' for x in row['final_reward']):>18s} {str(row['step_reaching']):>16s}")
    for key, gap in table.items():
        if key.endswith("_minus_sync"):
            print(f"{key}: mean reward per run, paired by seed: {[round(g, 3) for g in gap['gaps']]} (mean {gap['mean']:.3f})")


if __name__ == "__main__":
    main()
