"""An interactive Session as a script: each block below is one IPython cell.

    python examples/repl/session.py                                   # the CPU variant (small.yaml), a few minutes
    python examples/repl/session.py examples/repl/config.yaml model.path=/data/Qwen3-0.6B --scale 2

The arguments: a config, then section.field=value overrides; --scale N: the generator
replicas to scale to halfway (default 2; on GPUs at most the replicas the device plan
holds GPUs for, so scale down there); --prompt TEXT (repeatable): what to sample from
halfway (default "q:" and "a:", the digits task's kind); --out FILE: a JSON summary (the suite reads it).
The meshes live across the calls and every call is bounded, as in IPython.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import meshrl

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv: list[str]) -> tuple[str, list[str], int, str | None, list[str]]:
    parser = argparse.ArgumentParser(description="An interactive Session as a script (see its docstring).")
    parser.add_argument("args", nargs="*", metavar="CONFIG | section.field=value", help="a config (default: small.yaml), then overrides")
    parser.add_argument("--scale", type=int, default=2, help="generator replicas to scale to halfway (default 2)")
    parser.add_argument("--prompt", action="append", default=[], help="what to sample from halfway (repeatable)")
    parser.add_argument("--out", help="a JSON summary")
    ns = parser.parse_intermixed_args(argv)
    configs, overrides = [a for a in ns.args if "=" not in a], [a for a in ns.args if "=" in a]
    if len(configs) > 1:
        parser.error(f"one config, got {configs}")
    return (configs or [os.path.join(HERE, "small.yaml")])[0], overrides, ns.scale, ns.out, ns.prompt or ["q:", "a:"]


def mean(rows: list[dict], key: str = "trainer/reward_mean") -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / max(1, len(values))


def main(argv: list[str]) -> dict:
    config, overrides, scale, out, prompts = parse(argv)

    # cell 1: start. Meshes, the trainer, the generators, the episode queue and the rollout
    # workers come up; generation begins. Everything is checked before any of it starts.
    s = meshrl.Session(config, overrides=overrides)
    s.start()
    try:
        total = s.config.steps
        first = total // 2

        # cell 2: train half the steps; each row is one step's metrics
        rows = s.step(first)
        print(f"steps 1-{first}: reward {rows[0]['trainer/reward_mean']:.3f} -> {rows[-1]['trainer/reward_mean']:.3f}")

        # cell 3: look at samples of the current policy (a group per prompt)
        for prompt, group in zip(prompts, s.generate(prompts)):
            print(f"{prompt!r} -> {group[:4]}")

        # cell 4: change knobs between steps: halve the learning rate
        lr = s.loop.config.trainer.lr / 2
        s.set(lr=lr)

        # cell 5: scale the generators; groups on a removed replica are played again
        s.scale_generators(scale)
        queue = s.buffer_state()
        print(f"generator replicas: {len(s.loop.generators.replicas)}; groups ready {queue['buffer/groups']:.0f}, running {queue['buffer/running']:.0f}")

        # cell 6: train the rest on the new settings
        rows += s.step(total - first)
        print(f"steps {first + 1}-{total}: reward {rows[first]['trainer/reward_mean']:.3f} -> {rows[-1]['trainer/reward_mean']:.3f}")

        # cell 7: checkpoint (resumable with `meshrl run --resume RUN_DIR`)
        checkpoint = s.checkpoint()
        print(f"checkpoint: {checkpoint}")
        summary = {
            "run_dir": s.run_dir,
            "rewards": [r["trainer/reward_mean"] for r in rows],
            "staleness_max": max(r["trainer/staleness_max"] for r in rows),
            "lr": s.loop.config.trainer.lr,
            "replicas": len(s.loop.generators.replicas),
            "checkpoint": checkpoint,
        }
    finally:
        # cell 8: shut every mesh and engine down (also what leaving `with Session(...)` does)
        s.stop()
    if out:
        with open(out, "w") as f:
            json.dump(summary, f)
    return summary


if __name__ == "__main__":  # meshrl's engines start workers with spawn: keep the guard
    main(sys.argv[1:])
