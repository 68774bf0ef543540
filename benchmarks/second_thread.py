"""What a second thread entering ATen's thread pool costs a proc's training (docs/healing.md).

torch's CPU ops split work over an OpenMP team; a parallel region entered from another thread
of the same proc gets a team of its own. Two places in meshrl had a second thread doing
tensor work: the trainer's snapshot write (its copy, in a background thread) and PPO's
critic (values on the actor's thread, steps on a training thread). Two parts, each a ratio
against a reference measured in the same invocation, on section 14's 25M-parameter model:

1. `policy`: a PolicyTrainer's step time alone, with a snapshot after each step as meshrl
   writes it now (bytes copied by numpy in the snapshot's thread), and after one small op
   (`add_` over 1M floats) ran once in another thread that stays alive.
2. `critic`: a CriticTrainer's values and step, with the values computed on the calling
   thread and the step on a worker thread (as before), against both on the worker thread.
   Each variant runs in a fresh process, so one cannot leave a team behind for the other.

    python benchmarks/second_thread.py [--steps 6] [--out benchmarks/results/second_thread.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from common import machine, write_result

MODEL = {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1536, "dtype": "float32"}  # section 14's


def policy_part(steps: int) -> dict:
    import torch

    from trainer_throughput import make_batch
    from meshrl.config import Config
    from meshrl.trainer.policy import PolicyTrainer
    from meshrl.trainer.snapshot import Snapshots

    trainer = PolicyTrainer(Config.from_dict({"model": MODEL, "trainer": {"micro_batch_size": 16}}), torch.device("cpu"), 0, 1)
    batch = make_batch(8, 8, 16, 8, 0)
    snaps = Snapshots(tempfile.mkdtemp(prefix="second_thread_"), 1, blocking=True)

    def median_step(snapshot: bool) -> float:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            trainer.train_step(batch, trainer.step)
            times.append(time.perf_counter() - t0)
            if snapshot:
                snaps.start(trainer.step, trainer.model, trainer.optimizer, trainer.scheduler)
                snaps.finish()
        return statistics.median(times[1:])

    alone = median_step(False)
    with_snapshots = median_step(True)
    side = ThreadPoolExecutor(1)  # alive while the steps are timed, as the snapshot's and the critic's threads are
    side.submit(lambda: torch.ones(1 << 20).add_(1)).result()  # one op, once, on another thread
    after_op = median_step(False)
    side.shutdown()
    return {"step_s": alone, "step_s_with_snapshots": with_snapshots, "step_s_after_one_op_elsewhere": after_op}


def critic_variant(steps: int, one_thread: bool) -> dict:
    from trainer_throughput import make_batch
    from meshrl.config import ModelConfig
    from meshrl.trainer.critic import CriticTrainer

    pool = ThreadPoolExecutor(1)
    fields = {k: v for k, v in MODEL.items() if k != "dtype"}

    def build():
        return CriticTrainer(ModelConfig(**fields), lr=1e-4, micro_batch_size=16)

    critic = pool.submit(build).result() if one_thread else build()
    batch = make_batch(8, 8, 16, 8, 0)
    values_s, step_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        returns, old = pool.submit(critic.advantages, batch.clone()).result() if one_thread else critic.advantages(batch.clone())
        t1 = time.perf_counter()
        pool.submit(critic.train_step, batch, returns, old).result()
        values_s.append(t1 - t0)
        step_s.append(time.perf_counter() - t1)
    return {"values_s": statistics.median(values_s[1:]), "step_s": statistics.median(step_s[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results/second_thread.json")
    ap.add_argument("--variant", choices=["policy", "critic-two", "critic-one"], help=argparse.SUPPRESS)  # one part, in this process
    args = ap.parse_args()
    if args.variant:
        out = policy_part(args.steps) if args.variant == "policy" else critic_variant(args.steps, args.variant == "critic-one")
        print(json.dumps(out))
        return
    result = {"machine": machine(), "args": vars(args)}
    for variant in ("policy", "critic-two", "critic-one", "critic-two", "critic-one"):
        line = subprocess.run([sys.executable, __file__, "--variant", variant, "--steps", str(args.steps)], capture_output=True, text=True, check=True).stdout
        result.setdefault(variant, []).append(json.loads(line.strip().splitlines()[-1]))
        print(variant, result[variant][-1], flush=True)
    p = result["policy"][0]
    two, one = result["critic-two"], result["critic-one"]
    result["ratios"] = {
        "policy_step_with_snapshots": p["step_s_with_snapshots"] / p["step_s"],
        "policy_step_after_one_op_elsewhere": p["step_s_after_one_op_elsewhere"] / p["step_s"],
        "critic_values_two_threads_over_one": statistics.mean(a["values_s"] / b["values_s"] for a, b in zip(two, one)),
        "critic_step_two_threads_over_one": statistics.mean(a["step_s"] / b["step_s"] for a, b in zip(two, one)),
    }
    print(json.dumps(result["ratios"]))
    write_result(result, args.out)


if __name__ == "__main__":
    main()
