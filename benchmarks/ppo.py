"""PPO with a learned critic beside GRPO at equal samples (configs/ppo.yaml, the default task).

Arms, each run once per seed (same steps, batch and group size, same seed: the same initial
weights and prompts), synchronously (buffer depth 0, lag 0, update_mode block), as the
suite's learning tests run, so that the arms differ in the advantage alone:

- `ppo`:  configs/ppo.yaml: every model token's advantage from the critic (GAE);
- `grpo`: the same config with `trainer.loss.advantage: grpo` (no critic);
- `ppo-v0` (`--arms`): `ppo` with a critic that never learns (lr 1e-12: V = 0, so each
  token's advantage is its episode's return whitened over the batch), to tell the critic's
  values from the estimator around them;
- `ppo-vcppo`, `ppo-vapo` (`--arms`): `ppo` with decoupled GAE, the critic's returns at
  lambda 1 and the policy's advantages at lambda 0.95 (VC-PPO) or at VAPO's length-adaptive
  lambda, 1 - 1 / (0.05 x the answer's tokens). The default task's answers are 8 tokens,
  for which VAPO's lambda is 0: that arm's advantages are the critic's one-step estimates
  alone (its values' errors, unaveraged), the far end from `ppo`'s lambda 1.

Per run: the trained batch's mean reward at each step, the first step reaching `--reach`,
the mean over all steps (area under the curve per sample), and for PPO the critic's
explained variance on batches it had not trained on yet (mean over the steps before the
rewards saturate, where it is defined), its version lag, and each run's mean step time after
its first three steps. Synchronous runs' wall clocks and step times are stored, not compared:
`--async` runs the arms as the config ships instead, for what the critic costs in step time
(`--critic-epochs N` sets its optimizer steps per batch).

    python benchmarks/ppo.py [--steps 24] [--seeds 0 1 2]

Prints a table, writes benchmarks/results/ppo.json with the machine record.

`--ceiling` measures instead what a value model can explain on this task, without a run:
a stream of batches shaped as the task's (64 answers of 8 characters, each a digit with
probability p, the reward the share of digits), p rising from 0.1 to 0.95 over the steps as
the policy's reward does. Per step, each on the batch before anything trains on it (as the
run reports): the explained variance of the oracle, E[R | the characters so far] with the
batch's true p; of the same oracle with the previous batch's p (a value model that has not
seen the batch's p yet); and of meshrl's critic (`CriticTrainer`, configs/ppo.yaml's lr
and epochs) trained on the stream. Writes benchmarks/results/ppo_ceiling.json. With
`--task digits_sparse` the reward is that task's (1 when at least 2 of the first 4
characters are digits), and `--p P` holds every batch at digit probability P (a policy
that does not move): ppo_ceiling[_sparse][_pP].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import yaml

from common import ROOT, machine

SYNC = {"buffer.depth": 0, "buffer.max_lag": 0, "generator.update_mode": "block"}


def run_arm(
    arm: str, steps: int, seed: int, run_dir: str, task: str | None = None, policy_lr: float | None = None, critic_epochs: int | None = None, sync: bool = True
) -> dict:
    import meshrl
    from meshrl.config.loading import apply_overrides

    cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "ppo.yaml")))
    if arm == "grpo":
        cfg.pop("critic", None)
        cfg["trainer"]["loss"]["advantage"] = "grpo"
    if arm == "ppo-v0":  # the critic never moves from its zero head: V = 0, the advantages are the whitened returns
        cfg["critic"]["lr"] = 1e-12
    if arm == "ppo-vcppo":  # decoupled GAE: the policy's advantages at lambda 0.95, the critic's returns at 1
        cfg["critic"].update(lam=0.95, value_lam=1.0)
    if arm == "ppo-vapo":  # VAPO's length-adaptive lambda (alpha 0.05) for the advantages, the returns at 1
        cfg["critic"].update(adaptive_lam=0.05, value_lam=1.0)
    if critic_epochs is not None and "critic" in cfg:
        cfg["critic"]["epochs"] = critic_epochs
    over = {**(SYNC if sync else {}), "steps": steps, "seed": seed, "logging.run_dir": run_dir}
    if task is not None:  # another built-in task than the config's (the default one)
        over["data.source"] = f"task:{task}"
    if policy_lr is not None:  # a policy that learns slower (or faster) than the config's
        over["trainer.lr"] = policy_lr
    over.update({"logging.progress": "false", "logging.plot": "false", "logging.tensorboard": "false"})
    start = time.time()
    rows = [r for r in meshrl.run(apply_overrides(cfg, [f"{k}={v}" for k, v in over.items()])).metrics if "trainer/reward_mean" in r]
    reward = [r["trainer/reward_mean"] for r in rows]
    out = {"arm": arm, "seed": seed, "wall_s": time.time() - start, "reward": reward}
    out["step_s"] = statistics.fmean(r["time/step_s"] for r in rows[3:] or rows)  # start-up's first steps left out
    if arm.startswith("ppo"):
        unsaturated = [r for r in rows if r["trainer/reward_mean"] < 0.95]
        out["explained_variance"] = [r.get("critic/explained_variance") for r in rows]
        out["ev_mean_unsaturated"] = statistics.fmean(r["critic/explained_variance"] for r in unsaturated[1:]) if len(unsaturated) > 1 else None
        out["version_lag_max"] = max(r.get("critic/version_lag", 0) for r in rows)
        out["critic_step_s"] = statistics.fmean(r["critic/step_time_s"] for r in rows[3:] or rows if "critic/step_time_s" in r)
    return out


def ceiling(steps: int, seed: int, rows: int = 64, length: int = 8, sparse: bool = False, fixed_p: float | None = None) -> dict:
    """One stream of `--ceiling` (module docstring): per-step explained variances; `sparse`:
    digits_sparse's reward; `fixed_p`: every batch at that digit probability."""
    import random
    from math import comb

    import torch

    from meshrl.config import ModelConfig
    from meshrl.episode import Episode, Turn, pack
    from meshrl.trainer.critic import CriticTrainer
    from meshrl.trainer.values import gae, reduce_value_metrics, value_metric_sums

    critic_cfg = yaml.safe_load(open(os.path.join(ROOT, "configs", "ppo.yaml")))["critic"]
    critic = CriticTrainer(ModelConfig(), lr=critic_cfg["lr"], epochs=critic_cfg["epochs"], value_clip=critic_cfg["value_clip"], seed=seed)
    rng = random.Random(seed)

    def ev(values, returns, mask):
        return reduce_value_metrics([value_metric_sums(values, returns, mask)])["explained_variance"]

    def expected(digits, k, p):  # E[R | the first k characters]
        if not sparse:
            return (sum(digits[:k]) + (length - k) * p) / length
        left, need = max(0, 4 - k), max(0, 2 - sum(digits[: min(k, 4)]))  # at least 2 digits among the first 4
        return sum(comb(left, j) * p**j * (1 - p) ** (left - j) for j in range(need, left + 1))

    def oracle(digit_rows, mask, p):  # at each answer position
        v = torch.zeros(mask.shape)
        for i, digits in enumerate(digit_rows):
            for k, t in enumerate(mask[i].nonzero().flatten().tolist()):
                v[i, t] = expected(digits, k, p)
        return v

    out = {"seed": seed, "p": [], "reward": [], "oracle": [], "oracle_one_behind": [], "critic": []}
    previous_p = 0.1
    for step in range(steps):
        p = fixed_p if fixed_p is not None else 0.1 + 0.85 * step / max(steps - 1, 1)
        digit_rows = [[rng.random() < p for _ in range(length)] for _ in range(rows)]
        answers = [[ord(rng.choice("0123456789" if d else "abcdefghij")) for d in row] for row in digit_rows]
        episodes = [
            Episode(i // 8, i, [Turn("env", [ord("q"), ord(":")]), Turn("model", ids, [0.0] * length, [0] * length, reward=expected(row, length, p))])
            for i, (row, ids) in enumerate(zip(digit_rows, answers))
        ]
        batch = pack(episodes)
        mask = batch["loss_mask"].bool()
        returns, old = critic.advantages(batch)
        target = gae(old, batch["dense_reward"], mask)[1]
        out["p"].append(p)
        out["reward"].append(float(batch["reward"].mean()))
        out["oracle"].append(ev(oracle(digit_rows, mask, p), target, mask))
        out["oracle_one_behind"].append(ev(oracle(digit_rows, mask, previous_p), target, mask))
        out["critic"].append(ev(old, target, mask))
        critic.train_step(batch, returns, old)
        previous_p = p
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
    p.add_argument("--arms", nargs="+", default=["ppo", "grpo"], help="ppo, grpo, ppo-v0 (a critic that never learns), ppo-vcppo, ppo-vapo (decoupled lambdas)")
    p.add_argument("--task", default=None, help="a built-in task for both arms instead of the default (e.g. digits_sparse)")
    p.add_argument("--policy-lr", type=float, default=None, help="the policy's trainer.lr for every arm (default: the config's)")
    p.add_argument("--critic-epochs", type=int, default=None, help="the critic's optimizer steps per batch (default: the config's)")
    p.add_argument("--async", dest="asynchronous", action="store_true", help="run as the config ships (asynchronous): for step times, not curves")
    p.add_argument("--ceiling", action="store_true", help="what a value model can explain on this task (module docstring)")
    p.add_argument("--p", type=float, default=None, help="--ceiling: every batch at this digit probability (a policy that does not move)")
    a = p.parse_args()
    if a.ceiling:
        if a.task not in (None, "digits", "digits_sparse"):
            p.error("--ceiling knows the tasks digits and digits_sparse")
        streams = [ceiling(a.steps, seed, sparse=a.task == "digits_sparse", fixed_p=a.p) for seed in a.seeds]
        for s in streams:  # after half the stream (the critic has had that long to learn), and its last quarter;
            # steps whose batch is near all-correct (reward >= 0.95) left out, as the runs' means: no variance to explain
            for name, start in (("second half", len(s["p"]) // 2), ("last quarter", len(s["p"]) * 3 // 4)):
                kept = [i for i in range(start, len(s["p"])) if s["reward"][i] < 0.95]
                means = {k: round(statistics.fmean(s[k][i] for i in kept), 3) if kept else None for k in ("oracle", "oracle_one_behind", "critic")}
                print(json.dumps({"seed": s["seed"], f"mean over the {name}, {len(kept)} steps": means}), flush=True)
        name = "ppo_ceiling" + ("_sparse" if a.task == "digits_sparse" else "") + ("" if a.p is None else f"_p{a.p:g}")
        with open(a.out.replace("ppo.json", f"{name}.json"), "w") as f:
            json.dump({"machine": machine(), "task": a.task or "digits", "p": a.p, "steps": a.steps, "streams": streams}, f, indent=1)
        return
    runs = []
    for seed in a.seeds:
        for arm in a.arms:  # interleaved: a change in the machine's load hits both alike
            r = run_arm(arm, a.steps, seed, os.path.join(a.run_dir, f"{arm}-{seed}"), a.task, a.policy_lr, a.critic_epochs, not a.asynchronous)
            r["step_reaching"] = reach(r["reward"], a.reach)
            r["mean_reward"] = statistics.fmean(r["reward"])
            runs.append(r)
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k not in ("reward", "explained_variance")}
            print(json.dumps(shown), "reward", " ".join(f"{x:.2f}" for x in r["reward"]), flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(
            {
                "machine": machine(),
                "task": a.task or "digits",
                "policy_lr": a.policy_lr,
                "critic_epochs": a.critic_epochs,
                "asynchronous": a.asynchronous,
                "steps": a.steps,
                "reach": a.reach,
                "runs": runs,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
