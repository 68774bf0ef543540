"""Run every benchmark once, in order, each bounded in time; results land in benchmarks/results/.

    python benchmarks/run_all.py            # about 19 minutes on a 2-core CPU machine
    python benchmarks/run_all.py --only async_vs_sync,scaling_model

Each benchmark runs as its own process (one set of meshes and engines at a time: the
machine has 2 cores), with a wall-clock limit; a failed or timed-out one is reported and
the rest still run. trl_peer reuses the meshrl runs async_vs_sync just made (same problem
size, same invocation) instead of repeating them. Writes results/run_all.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

from common import RESULTS, ROOT, machine
from step_floor import SMALL_MODEL  # the small problem, one definition

HERE = os.path.dirname(os.path.abspath(__file__))

# (name, arguments, time limit in s); small sizes so that all of them fit in about 25 minutes
BENCHMARKS = [
    (
        "weight_sync",
        [
            "weight_sync.py",
            "--sizes",
            "tiny,10M,100M,500M",
            "--transports",
            "rdma,collective,files,shm",
            "--versions",
            "3",
            "--out",
            os.path.join(RESULTS, "weight_sync.json"),
        ],
        600,
    ),
    ("generator_overhead", ["generator_overhead.py", "--out", os.path.join(RESULTS, "generator_overhead.json")], 300),
    ("trainer_throughput", ["trainer_throughput.py", "--steps", "3"], 300),
    ("async_vs_sync", ["async_vs_sync.py"], 900),
    ("trl_peer", ["trl_peer.py", "--meshrl-json", os.path.join(RESULTS, "async_vs_sync.json")], 600),
    ("scaling_model", ["scaling_model.py"], 120),
    # multi-turn episodes (configs/tool-use.yaml's task and model): a tool call, then an answer
    (
        "multi_turn",
        [
            "async_vs_sync.py",
            "--task",
            "calc",
            "--set",
            "rollout.tool_parser=compact",
            "--set",
            "rollout.max_turns=3",
            "--max-new-tokens",
            "6",
            "--lr",
            "5e-3",
            "--steps",
            "60",
            "--seeds",
            "2",
            "--no-compile",
            "--dtype",
            "float32",
            "--reward-level",
            "0.4",
            "--model",
            "dim=64",
            "--model",
            "n_layers=2",
            "--model",
            "n_heads=2",
            "--model",
            "n_kv_heads=1",
            "--model",
            "ffn_dim=128",
            "--out",
            os.path.join(RESULTS, "multi_turn.json"),
        ],
        900,
    ),
    # where a step's time and CPU go; then the small problem side by side with TRL
    ("step_floor", ["step_floor.py", "--out", os.path.join(RESULTS, "step_floor.json")], 900),
    (
        "trl_small",
        [
            "trl_peer.py",
            "--seeds",
            "1",
            "--steps",
            "40",
            "--max-new-tokens",
            "8",
            "--dtype",
            "float32",
            "--no-compile",
            "--modes",
            "sync,async,colocate",
            *[a for k, v in SMALL_MODEL.items() for a in ("--model", f"{k}={v}")],
            "--trl-settings",
            "float32,float32+compile",
            "--out",
            os.path.join(RESULTS, "trl_small.json"),
        ],
        1500,
    ),
    # heavy-tailed answer lengths: sync, keep, abort, drain and TRL
    ("long_tail", ["long_tail.py", "--out", os.path.join(RESULTS, "long_tail.json")], 1200),
    # on-policy distillation against RL alone: a teacher trained by RL, then students taught each way
    ("distill", ["distill.py", "--out", os.path.join(RESULTS, "distill.json")], 2400),
    # a reward model as the only reward against the verifier, and a scorer proc's cost per step
    ("scorers", ["scorers.py", "--seeds", "3", "--out", os.path.join(RESULTS, "scorers.json")], 1800),
    # long rows in the trainer: activation memory per checkpointing mode, packed vs padded micro-batches, one 32k row
    ("long_rows", ["long_rows.py", "--out", os.path.join(RESULTS, "long_rows.json")], 1800),
    # every shipped CPU config at 2x its steps, async and sync, 3 seeds: collapses, best and final reward, entropy
    ("stability", ["stability.py", "--out", os.path.join(RESULTS, "stability.json")], 5400),
]


def run_one(name: str, argv: list[str], limit: float) -> dict:
    print(f"\n==== {name} (limit {limit:.0f} s) ====", flush=True)
    t0 = time.monotonic()
    cmd = [sys.executable, os.path.join(HERE, argv[0]), *argv[1:]]
    # own process group, so that a timeout also ends the procs and engines it started
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    # a silent, hung benchmark must not hold the read below forever: a timer kills it
    timed_out = threading.Event()
    watchdog = threading.Timer(limit, lambda: (timed_out.set(), _kill(proc.pid)))
    watchdog.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if _worth_showing(line):
                print(line, end="", flush=True)
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _kill(proc.pid)
        proc.wait(30)
        rc = "timeout"
    finally:
        watchdog.cancel()
    if timed_out.is_set():
        rc = "timeout"
    wall = time.monotonic() - t0
    if name == "trainer_throughput" and rc == 0:  # it prints its result as a JSON line
        for line in reversed(lines):
            if line.startswith("{") and '"trainer_throughput"' in line:
                with open(os.path.join(RESULTS, "trainer_throughput.json"), "w") as f:
                    json.dump(json.loads(line), f, indent=2)
                break
    print(f"---- {name}: rc={rc} in {wall:.0f} s", flush=True)
    return {
        "name": name,
        "rc": rc,
        "wall_s": wall,
        "command": " ".join(["python", "benchmarks/" + argv[0], *argv[1:]]),
        "tail": "".join(lines[-15:]) if rc != 0 else "",
    }


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _worth_showing(line: str) -> bool:
    """The benchmarks' own tables, not the engines' logs."""
    noisy = ("INFO", "WARNING", "Warning", "warn(", "[actor=", "(EngineCore", "(Worker", "(MainProcess", "W1121", "I1121")
    return not any(n in line for n in noisy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma list of " + ",".join(b[0] for b in BENCHMARKS))
    args = p.parse_args()
    only = set(args.only.split(",")) if args.only else None
    os.makedirs(RESULTS, exist_ok=True)
    measured_on = machine()
    t0 = time.monotonic()
    runs = [run_one(*b) for b in BENCHMARKS if only is None or b[0] in only]
    print("\n| benchmark | rc | wall s |\n|---|---|---|")
    for r in runs:
        print(f"| {r['name']} | {r['rc']} | {r['wall_s']:.0f} |")
    with open(os.path.join(RESULTS, "run_all.json"), "w") as f:
        json.dump({"runs": runs, "machine": measured_on, "loadavg_end": os.getloadavg(), "cpus": os.cpu_count(), "wall_s": time.monotonic() - t0}, f, indent=2)
    print(f"total {time.monotonic() - t0:.0f} s")
    if any(r["rc"] != 0 for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
