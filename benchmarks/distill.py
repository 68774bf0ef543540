"""On-policy distillation against RL alone: the same student, steps and task, taught by a
teacher's per-token log-probs or by the task reward.

In one invocation:
  1. A teacher trains with plain RL from scratch, on the first of `--tasks` whose trained
     reward (mean of the last 10 steps) reaches `--teacher-level` within `--teacher-steps`
     (the candidates before it are recorded: where RL from scratch is slow, distillation
     would matter most, but then no teacher comes out of RL either). Its RUN_DIR/hf/final
     export (tokenizer included) is the teacher.
  2. Per seed, students with the same shapes train from scratch for `--steps` steps each:
       distill   distill.kl_weight=1, reward_weight=0 (the teacher's per-token reverse KL only)
       rl        kl_weight=0, reward_weight=1: plain RL, the teacher only measures the KL
       mixed     kl_weight=1, reward_weight=1
       rl_plain  no teacher at all: the reference for the teacher's scoring overhead
Per arm: `trainer/distill_reverse_kl` (log mu - log pi_teacher per trained token) and
`trainer/reward_mean`, first and last 3 steps; the greedy accuracy of the held-out eval at
the last step (`eval.every` = steps); the steady step time, mean and median (steps after
`--warmup`, the last, which also runs the eval, left out), over rl's and rl_plain's of the
same seed; and the trained samples until the 3-step mean reward first reaches `--reward-level`.

    python benchmarks/distill.py [--tasks count,copy,letters,digits] [--steps 30] [--seeds 2]

Writes benchmarks/results/distill.json and .png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time

from common import RESULTS, SEED_STYLES, machine

from async_vs_sync import time_to_reward  # noqa: E402
from meshrl.config import Config  # noqa: E402  (importable once common put the repo root on the path)

ARMS = {"distill": (1.0, 0.0), "rl": (0.0, 1.0), "mixed": (1.0, 1.0), "rl_plain": None}
"""arm -> (distill.kl_weight, distill.reward_weight); None: no teacher."""
COLORS = {"distill": "tab:red", "rl": "tab:blue", "mixed": "tab:purple", "rl_plain": "tab:gray"}
BATCH = Config().batch_groups * Config().generator.group_size  # the embedded default's samples per step


def train(task: str, steps: int, seed: int, run_dir: str, teacher: str | None = None, weights=None) -> dict:
    """One meshrl.run of the embedded default (tiny Qwen3, character tokenizer, async) on a task."""
    import meshrl

    overrides = [
        f"data.source=task:{task}",
        f"steps={steps}",
        f"seed={seed}",
        f"eval.every={steps}",
        f"logging.run_dir={run_dir}",
        "logging.tensorboard=false",
        "logging.progress=false",
        "logging.plot=false",
    ]
    if weights:
        overrides += [f"distill.teacher={teacher}", f"distill.kl_weight={weights[0]}", f"distill.reward_weight={weights[1]}"]
    t0 = time.monotonic()
    res = meshrl.run(overrides=overrides)
    rows = [
        {"step": int(r["version"]), "step_s": r["time/step_s"], "reward": r["trainer/reward_mean"], "kl": r.get("trainer/distill_reverse_kl")}
        for r in res.metrics
        if "time/step_s" in r
    ]
    evals = [r for r in res.metrics if "eval/greedy_accuracy" in r]
    return {"rows": rows, "greedy_accuracy": evals[-1]["eval/greedy_accuracy"] if evals else None, "hf": res.hf_export, "wall_s": time.monotonic() - t0}


def pick_teacher(args: argparse.Namespace, root: str) -> tuple[str, dict, list[dict]]:
    tried = []
    for task in args.tasks.split(","):
        run = train(task, args.teacher_steps, args.teacher_seed, os.path.join(root, f"teacher-{task}"))
        level = statistics.mean(r["reward"] for r in run["rows"][-10:])
        tried.append(
            {
                "task": task,
                "steps": args.teacher_steps,
                "reward_last10": level,
                "greedy_accuracy": run["greedy_accuracy"],
                "reward_by_10_steps": [round(statistics.mean(r["reward"] for r in run["rows"][i : i + 10]), 3) for i in range(0, len(run["rows"]), 10)],
                "wall_s": run["wall_s"],
            }
        )
        print(f"teacher on {task}: reward (last 10 steps) {level:.3f}, greedy accuracy {run['greedy_accuracy']}", flush=True)
        if level >= args.teacher_level:
            return task, run, tried
    raise SystemExit(f"no task of {args.tasks} gave a teacher with reward {args.teacher_level} in {args.teacher_steps} steps")


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.mean(values) if values else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summarize(run: dict, args: argparse.Namespace) -> dict:
    rows = run["rows"]
    steady = [r["step_s"] for r in rows[args.warmup : -1]]
    # time_to_reward sums a row's "time/step_s": fed the batch size, it sums trained samples
    as_samples = [{"time/step_s": BATCH, "reward": r["reward"]} for r in rows]
    return {
        "kl_first3": mean_of(rows[:3], "kl"),
        "kl_last3": mean_of(rows[-3:], "kl"),
        "reward_first3": mean_of(rows[:3], "reward"),
        "reward_last3": mean_of(rows[-3:], "reward"),
        "reward_all": mean_of(rows, "reward"),
        "greedy_accuracy": run["greedy_accuracy"],
        "step_s": statistics.mean(steady),
        "step_s_median": statistics.median(steady),
        "samples_to_reward": time_to_reward(as_samples, args.reward_level),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="count,copy,letters,digits", help="teacher candidates, in order (built-in tasks)")
    p.add_argument("--teacher-steps", type=int, default=150)
    p.add_argument("--teacher-level", type=float, default=0.8, help="trained reward (last 10 steps) a teacher must reach")
    p.add_argument("--teacher-seed", type=int, default=100, help="apart from the students' seeds: no student starts as the teacher did")
    p.add_argument("--steps", type=int, default=30, help="student steps per arm")
    p.add_argument("--seeds", type=int, default=2, help="student seeds 0 .. N-1")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the step time")
    p.add_argument("--reward-level", type=float, default=0.9, help="report trained samples until the 3-step mean reward reaches this")
    p.add_argument("--out", default=os.path.join(RESULTS, "distill.json"))
    args = p.parse_args()
    t0, machine_before = time.monotonic(), machine()
    arms, runs = args.arms.split(","), []
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-") as root:
        task, teacher, tried = pick_teacher(args, root)
        for seed in range(args.seeds):  # seed by seed, the arms side by side: the machine's drift spreads over all
            for arm in arms:
                run = train(task, args.steps, seed, os.path.join(root, f"{arm}-{seed}"), teacher["hf"], ARMS[arm])
                run.update(arm=arm, seed=seed, **summarize(run, args))
                runs.append(run)
                print(
                    f"{arm} seed {seed}: KL {fmt(run['kl_first3'], '.3f')} -> {fmt(run['kl_last3'], '.3f')}, "
                    f"reward {run['reward_first3']:.3f} -> {run['reward_last3']:.3f}, greedy {run['greedy_accuracy']}, "
                    f"step {run['step_s']:.3f} s",
                    flush=True,
                )
    for run in runs:  # step time (mean; median: less moved by other load) over the reference arms of the same seed
        for ref, stat in itertools.product(("rl", "rl_plain"), ("", "_median")):
            other = next((r for r in runs if r["arm"] == ref and r["seed"] == run["seed"]), None)
            run[f"step{stat}_over_{ref}"] = run[f"step_s{stat}"] / other[f"step_s{stat}"] if other else None
    keys = (
        "kl_first3",
        "kl_last3",
        "reward_first3",
        "reward_last3",
        "reward_all",
        "greedy_accuracy",
        "step_s",
        "step_s_median",
        "step_over_rl",
        "step_over_rl_plain",
        "step_median_over_rl",
        "step_median_over_rl_plain",
    )
    means = {arm: {k: mean_of([r for r in runs if r["arm"] == arm], k) for k in keys} for arm in arms}
    for arm in arms:
        reached = [r["samples_to_reward"] for r in runs if r["arm"] == arm]
        means[arm]["samples_to_reward"] = statistics.mean(reached) if None not in reached else None
        means[arm]["samples_to_reward_runs"] = reached
    print(f"\nteacher: task {task}, seed {args.teacher_seed}, {args.teacher_steps} steps, greedy accuracy {teacher['greedy_accuracy']}")
    print(
        f"{'arm':<10}{'KL first 3':>11}{'KL last 3':>11}{'reward first 3':>16}{'reward last 3':>15}{'greedy acc':>12}"
        f"{'step s':>8}{'median':>8}{'median / rl':>13}{' / rl_plain':>12}{f'samples to {args.reward_level}':>18}"
    )
    for arm, m in means.items():
        print(
            f"{arm:<10}{fmt(m['kl_first3'], '.3f'):>11}{fmt(m['kl_last3'], '.3f'):>11}{fmt(m['reward_first3'], '.3f'):>16}"
            f"{fmt(m['reward_last3'], '.3f'):>15}{fmt(m['greedy_accuracy'], '.2f'):>12}{m['step_s']:>8.3f}{m['step_s_median']:>8.3f}"
            f"{fmt(m['step_median_over_rl'], '.2f'):>13}{fmt(m['step_median_over_rl_plain'], '.2f'):>12}{str(m['samples_to_reward_runs']):>18}"
        )
    for run in runs:
        run.pop("hf")
    payload = {
        "args": vars(args),
        "machine_before": machine_before,
        "machine_after": machine(),
        "task": task,
        "teacher": {"task": task, "seed": args.teacher_seed, "steps": args.teacher_steps, "greedy_accuracy": teacher["greedy_accuracy"]},
        "teacher_candidates": tried,
        "runs": runs,
        "means": means,
        "wall_s": time.monotonic() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    png = plot(runs, payload, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} and {png} in {time.monotonic() - t0:.0f} s")


def plot(runs: list[dict], payload: dict, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        style = {"color": COLORS.get(run["arm"], "k"), "linestyle": SEED_STYLES[run["seed"] % len(SEED_STYLES)], "label": f"{run['arm']} seed {run['seed']}"}
        steps = [r["step"] for r in run["rows"]]
        if any(r["kl"] is not None for r in run["rows"]):
            ax_kl.plot(steps, [r["kl"] for r in run["rows"]], **style)
        ax_r.plot(steps, [r["reward"] for r in run["rows"]], **style)
    ax_kl.set(title="per-token reverse KL to the teacher (trained batch)", xlabel="step", ylabel="nats / token")
    ax_kl.set_yscale("symlog", linthresh=0.01)
    ax_r.set(title="trained batch reward", xlabel="step", ylabel="reward")
    for ax in (ax_kl, ax_r):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"task:{payload['task']}, teacher {payload['teacher']['steps']} RL steps; {payload['machine_before'].get('cpu_model', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    main()
