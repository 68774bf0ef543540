"""Two co-evolving trained models against one model playing both roles (configs/coevolve.yaml).

Arms, each run once per seed at equal samples (same steps, batch, group size and game):

- `two-models`: configs/coevolve.yaml as shipped: the proposer (`models[0]`) and the solver
  (the policy), each with its own trainer proc, optimizer, vLLM engine and weight sync;
- `self-play`:  the same game with `models: []`: the policy proposes and solves (one trainer
  trains every row, one engine serves every turn), the reference measured in the same
  invocation;
- `paced`: two models, the proposer updating on one step in `--pace-every`
  (`models[0].trainer.pace.every`; docs/coevolve.md "Models at different paces");
- `accumulate`: as `paced`, the proposer's update taking the rows of the steps it held too
  (`pace.accumulate`): as many updates, on `--pace-every` times the rows each.

Per run: the mean step time after the first three steps (start-up excluded), the mean time of
the proposer's engine's weight move (`proposer/sync/previous_update_s`), the run's wall
clock, each model's reward in its first and last tenth of the steps, the largest staleness
of each model's trained tokens, and the stale tokens the queue masked. The cost of the second
trained model is the ratio of the two arms' mean step times, seed by seed.

    python benchmarks/coevolve.py [--steps 30] [--seeds 0 1 2] [--arms two-models self-play paced accumulate --pace-every 4]

Prints a table, writes benchmarks/results/coevolve.json with the machine record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import yaml

from common import ROOT, machine


def run_arm(arm: str, steps: int, seed: int, run_dir: str, pace_every: int = 4) -> dict:
    import meshrl
    from meshrl.config.loading import apply_overrides

    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "coevolve.yaml")))
    if arm == "self-play":
        cfg["models"] = []
    if arm in ("paced", "accumulate"):
        trainer = cfg["models"][0].setdefault("trainer", {})
        trainer["pace"] = {"every": pace_every, "accumulate": arm == "accumulate"}
    over = {"steps": steps, "seed": seed, "logging.run_dir": run_dir, "logging.progress": "false", "logging.plot": "false", "logging.tensorboard": "false"}
    cfg = apply_overrides(cfg, [f"{k}={v}" for k, v in over.items()])
    start = time.time()
    rows = [r for r in meshrl.run(cfg).metrics if "version" in r]
    out = {"arm": arm, "seed": seed, "wall_s": time.time() - start, "step_s": statistics.fmean(r["time/step_s"] for r in rows[3:])}
    for name, prefix in (("solver", ""), ("proposer", "proposer/")):
        scored = [r[f"{prefix}reward/mean"] for r in rows if f"{prefix}reward/mean" in r]
        if scored:
            k = max(1, len(scored) // 10)
            out[f"{name}_first_tenth"], out[f"{name}_last_tenth"] = statistics.fmean(scored[:k]), statistics.fmean(scored[-k:])
        if f"{prefix}trainer/staleness_max" in rows[-1]:
            out[f"{name}_staleness_max"] = max(r[f"{prefix}trainer/staleness_max"] for r in rows if f"{prefix}trainer/staleness_max" in r)
    out["masked_stale_tokens"] = rows[-1]["buffer/masked_stale_tokens"]
    moves = [r["proposer/sync/previous_update_s"] for r in rows[3:] if "proposer/sync/previous_update_s" in r]
    if moves:  # its engine's weight move, each step (a relabel on a step its trainer held)
        out["proposer_update_s"] = statistics.fmean(moves)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=["two-models", "self-play"], choices=["two-models", "self-play", "paced", "accumulate"])
    p.add_argument("--pace-every", type=int, default=4, help="the paced arm's proposer updates on one step in this many")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "coevolve.json"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "runs", "bench-coevolve"))
    a = p.parse_args()
    runs = []
    for seed in a.seeds:
        for arm in a.arms:  # interleaved, so that a change in the machine's load hits both arms alike
            r = run_arm(arm, a.steps, seed, os.path.join(a.run_dir, f"{arm}-{seed}"), a.pace_every)
            runs.append(r)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    by = {(r["arm"], r["seed"]): r for r in runs}
    ratios = [by["two-models", s]["step_s"] / by["self-play", s]["step_s"] for s in a.seeds if ("two-models", s) in by and ("self-play", s) in by]
    summary = {"step_time_ratio_two_over_one": ratios, "mean_ratio": statistics.fmean(ratios) if ratios else None}
    for arm in ("paced", "accumulate"):
        held = [by[arm, s]["step_s"] / by["self-play", s]["step_s"] for s in a.seeds if (arm, s) in by and ("self-play", s) in by]
        if held:
            summary.update({"pace_every": a.pace_every, f"step_time_ratio_{arm}_over_one": held, f"mean_ratio_{arm}": statistics.fmean(held)})
    print(json.dumps(summary))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"machine": machine(), "steps": a.steps, "arms": a.arms, "runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
