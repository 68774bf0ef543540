"""The per-step floor: where one step's time and CPU go, on the embedded default and on a
small problem (a 0.8M-parameter Qwen3, 64 completions of about 7 tokens per step).

For each problem and mode (async: the default; sync: configs/sync.yaml), with the shipped
`auto` placement, one run of `--steps` steps. After `--warmup` steps it reads:
  - the step's parts from the metrics rows: the trainer's wait for its batch, its compute,
    the weight publish, the rest of its call (actor round trips, the queue's version), the
    controller's time between calls (metrics, starting the generators' update), and the
    generators' weight apply (in the background);
  - CPU seconds per step of each role's processes (trainer, generator front-end and vLLM
    engine core, rollout worker, queue, controller), found by the log file each proc
    writes to (RUN_DIR/logs/ROLE.log).
The framework's share is what is neither training math nor decoding.

    python benchmarks/step_floor.py [--steps 40] [--problems default,small] [--modes async,sync]

The side-by-side comparison with TRL on the small problem is `trl_peer.py` with the small
model (benchmarks/README.md, section 6, gives the command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from common import RESULTS, ROOT, machine

SMALL_MODEL = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384}
"""About 0.8M parameters with the 128-token character vocabulary."""
PROBLEMS = {
    "default": [],
    "small": [f"model.{k}={v}" for k, v in SMALL_MODEL.items()],
}
PARTS = {
    "trainer wait for batch": "trainer/wait_s",
    "trainer compute": "trainer/step_time_s",
    "weight publish": "sync/publish_s",
    "controller between calls": "time/controller_s",
    "generator weight apply (background)": "sync/previous_update_s",
}


def role_of(proc) -> str | None:
    """A run's proc by the log its stdout was sent to; vLLM's engine core inherits it."""
    try:
        target = os.readlink(f"/proc/{proc.pid}/fd/1")
        name = proc.name()
    except OSError:
        return None
    if not target.endswith(".log"):
        return None
    role = os.path.basename(target)[:-4].rsplit("-", 1)[0]
    return "engine-core" if name.startswith("VLLM") else role


def cpu_by_role() -> dict[str, float]:
    import psutil

    me = psutil.Process()
    totals: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        role = "controller" if proc.pid == me.pid else role_of(proc)  # the Session's loop runs here
        if role is None:
            continue
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        totals[role] = totals.get(role, 0.0) + t.user + t.system
    return totals


def run_one(problem: str, mode: str, args, root: str) -> dict:
    from meshrl.api import Session
    from meshrl.resume import as_config

    run_dir = os.path.join(root, f"{problem}-{mode}")
    overrides = [
        *PROBLEMS[problem],
        f"steps={args.steps}",
        f"logging.run_dir={run_dir}",
        "logging.progress=false",
        "logging.plot=false",
        "logging.tensorboard=false",
    ]
    config = as_config(os.path.join(ROOT, "configs", "sync.yaml") if mode == "sync" else None, overrides)
    with Session(config) as s:
        s.step(args.warmup)
        cpu0, t0 = cpu_by_role(), time.monotonic()
        rows = s.step(args.steps - args.warmup)
        wall, cpu1 = time.monotonic() - t0, cpu_by_role()
        placement = {"trainer.cpus": s.config.trainer.cpus, "generator.cpus": s.config.generator.cpus}
    n = len(rows)
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in rows)  # noqa: E731
    step_s = wall / n
    parts = {name: mean(key) for name, key in PARTS.items()}
    parts["trainer call, rest (round trips, queue version)"] = max(
        0.0, mean("time/trainer_call_s") - parts["trainer wait for batch"] - parts["trainer compute"] - parts["weight publish"]
    )
    cpu = {role: (cpu1.get(role, 0.0) - cpu0.get(role, 0.0)) / n for role in sorted(cpu1)}
    samples = sum(r.get("trainer/seqs", 0.0) for r in rows)
    return {
        "problem": problem,
        "mode": mode,
        "steps_measured": n,
        "step_s": step_s,
        "samples_per_s": samples / wall,
        "parts_s": parts,
        "cpu_s_per_step": cpu,
        "cpu_s_per_step_total": sum(cpu.values()),
        "generator_idle_frac": mean("generator/idle_frac"),
        "trainer_idle_frac": mean("trainer/idle_frac"),
        "tokens_per_step": mean("trainer/tokens"),
        "reward_last": rows[-1].get("trainer/reward_mean"),
        "placement": placement,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out (start-up, first weight updates)")
    p.add_argument("--problems", default="default,small")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--out", default=os.path.join(RESULTS, "step_floor.json"))
    args = p.parse_args()
    os.environ.pop("MESHRL_VERBOSE", None)  # procs write RUN_DIR/logs/ROLE.log: that is how roles are found
    measured_on = machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="meshrl-floor-") as root:
        for problem in args.problems.split(","):
            for mode in args.modes.split(","):
                runs.append(run_one(problem, mode, args, root))
                r = runs[-1]
                print(
                    f"{problem:>8} {mode:>5}: {r['step_s']:.3f} s/step, {r['samples_per_s']:.0f} samples/s, "
                    f"CPU {r['cpu_s_per_step_total']:.3f} s/step " + " ".join(f"{k}={v:.3f}" for k, v in r["cpu_s_per_step"].items())
                )
    verdict = {}
    for problem in args.problems.split(","):
        by_mode = {r["mode"]: r for r in runs if r["problem"] == problem}
        if {"async", "sync"} <= set(by_mode):
            verdict[f"{problem}_async_over_sync_step"] = by_mode["sync"]["step_s"] / by_mode["async"]["step_s"]
    with open(args.out, "w") as f:
        json.dump({"machine": measured_on, "args": vars(args), "runs": runs, "verdict": verdict}, f, indent=2)
    print(json.dumps(verdict, indent=2))


if __name__ == "__main__":
    main()
