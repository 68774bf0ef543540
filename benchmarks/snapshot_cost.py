"""What keeping the trainer restorable every step costs, and how long a heal takes (docs/healing.md).

Three parts, each a ratio against a reference measured in the same invocation:
1. `--part store`: one trainer rank (PolicyTrainer, single proc, CPU), per model size: a
   training step, then the ways to keep its state: torch DCP `async_save` (a GPU trainer's
   snapshot: the staging copy, then the wait for the write after the version's gather that
   overlaps it), this rank's shards copied into its slot's file in the caller (a CPU trainer's
   snapshot, `blocking`; its two slots written once each before the measured ones), a blocking DCP `save`, and an in-memory copy held by an actor on
   another proc (the state sent over Monarch).
2. `--part runs`: whole runs of a config with trainer.snapshot_every=1 and 0, interleaved,
   `--repeats` each: the median step time's ratio.
3. `--part heal`: one run whose trainer proc is SIGKILLed between two steps: trainer/restart_s
   and the seconds from the kill to the end of the next trained step.

    python benchmarks/snapshot_cost.py [--part store,runs,heal] [--steps 16] [--repeats 2] [--size default|25M]
        [--snapshot-budget B] [--out benchmarks/results/snapshot_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

import torch

from common import machine, write_result

from trainer_throughput import make_batch  # noqa: E402
from meshrl.config import Config  # noqa: E402

SIZES = {
    "default": {},  # configs/default.yaml's model
    "25M": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 1536},  # benchmarks/README.md section 14's trainer-bound model
}


TRAINER_BOUND = {"generator": {"max_new_tokens": 8}, "trainer": {"compile": False}}  # benchmarks/README.md section 14's problem


def _keeper_class():
    """An actor that holds the last state it was sent (the in-memory candidate)."""
    from monarch.actor import Actor, endpoint

    class StateKeeper(Actor):
        def __init__(self):
            self.state = None

        @endpoint
        async def keep(self, state) -> int:
            self.state = state
            return sum(t.numel() for t in state.values() if torch.is_tensor(t))

    return StateKeeper


def flat_state(trainer) -> dict:
    from meshrl.trainer.checkpoint import _train_state

    out = {}
    state = _train_state(trainer.model, trainer.optimizer)
    for k, v in state["model"].items():
        out[f"model.{k}"] = v.detach().clone()
    for pk, group in state["optim"]["state"].items():
        for k, v in group.items():
            if torch.is_tensor(v):
                out[f"optim.{pk}.{k}"] = v.clone()
    return out


def store_part(reps: int) -> dict:
    from monarch.actor import this_host

    import torch.distributed.checkpoint as dcp

    from meshrl.trainer.checkpoint import _train_state
    from meshrl.trainer.policy import PolicyTrainer
    from meshrl.trainer.snapshot import Snapshots

    procs = this_host().spawn_procs(per_host={"procs": 1})
    keeper = procs.spawn("keeper", _keeper_class())
    results = {}
    try:
        for size, model in SIZES.items():
            cfg = Config.from_dict({"model": model, "trainer": {"micro_batch_size": 16}})
            trainer = PolicyTrainer(cfg, torch.device("cpu"), 0, 1)
            params = sum(p.numel() for p in trainer.model.parameters())
            batch = make_batch(8, 8, 16, 8, 0)
            root = tempfile.mkdtemp(prefix="snapshot_cost_")
            asynchronous, blocking = Snapshots(root + "/a", 1), Snapshots(root + "/b", 1, blocking=True)
            t = {"step_s": [], "publish_s": [], "async_stage_s": [], "async_wait_s": [], "blocking_s": [], "dcp_blocking_s": [], "in_memory_s": []}
            for i in range(reps + 2):
                t0 = time.perf_counter()
                trainer.train_step(batch, trainer.step)
                step_s = time.perf_counter() - t0
                asynchronous.start(trainer.step, trainer.model, trainer.optimizer, trainer.scheduler)
                t1 = time.perf_counter()
                for _ in trainer.sync_state_dict(torch.float32):  # the version's gather, which the write overlaps
                    pass
                publish_s = time.perf_counter() - t1
                asynchronous.finish()
                t2 = time.perf_counter()
                blocking.start(trainer.step, trainer.model, trainer.optimizer, trainer.scheduler)
                blocking.finish()
                blocking_s = time.perf_counter() - t2
                t_dcp = time.perf_counter()
                dcp.save(_train_state(trainer.model, trainer.optimizer), storage_writer=dcp.FileSystemWriter(f"{root}/dcp{i}", sync_files=False), no_dist=True)
                dcp_blocking_s = time.perf_counter() - t_dcp
                t3 = time.perf_counter()
                keeper.keep.call_one(flat_state(trainer)).get()
                in_memory_s = time.perf_counter() - t3
                if i < 2:
                    continue  # warm-up: both of the blocking snapshot's slots exist from here on
                for key, value in (
                    ("step_s", step_s),
                    ("publish_s", publish_s),
                    ("async_stage_s", asynchronous.stage_s),
                    ("async_wait_s", asynchronous.wait_s),
                    ("blocking_s", blocking_s),
                    ("dcp_blocking_s", dcp_blocking_s),
                    ("in_memory_s", in_memory_s),
                ):
                    t[key].append(value)
            med = {k: statistics.median(v) for k, v in t.items()}
            # what the trainer waits for beyond its step and gather: staging plus the write's
            # tail after the gather (async); the whole write (blocking); the send (in memory)
            results[size] = {
                "params": params,
                **med,
                "async_cost_vs_step": (med["async_stage_s"] + med["async_wait_s"]) / med["step_s"],
                "blocking_cost_vs_step": med["blocking_s"] / med["step_s"],
                "dcp_blocking_cost_vs_step": med["dcp_blocking_s"] / med["step_s"],
                "in_memory_cost_vs_step": med["in_memory_s"] / med["step_s"],
            }
            print(json.dumps({size: results[size]}), flush=True)
    finally:
        procs.stop().get()
    return results


def _run(config: str, steps: int, snapshot_every: int, root: str, extra: dict | None = None) -> dict:
    import meshrl

    cfg = Config.from_yaml(config).to_dict() if config else {}
    cfg.update({"steps": steps})
    cfg.setdefault("trainer", {}).update({"snapshot_every": snapshot_every, "checkpoint_every": 0})
    cfg.setdefault("logging", {}).update({"run_dir": root, "progress": False, "plot": False, "tensorboard": False})
    cfg.setdefault("generator", {})["startup_timeout_s"] = 1200.0  # a loaded machine starts vLLM slowly
    for key, value in (extra or {}).items():
        cfg.setdefault(key, {}).update(value)
    rows = meshrl.run(cfg).metrics
    rows = rows[2:]  # past the first steps' warm-up
    steps_s = [r["time/step_s"] for r in rows]
    out = {"snapshot_every": snapshot_every, "median_step_s": statistics.median(steps_s), "mean_step_s": statistics.mean(steps_s), "steps": len(rows) + 2}
    if snapshot_every:  # the snapshot's share of each step, from the same rows
        snap = [r.get("trainer/snapshot_stage_s", 0.0) + r.get("trainer/snapshot_wait_s", 0.0) for r in rows]
        out["snapshot_s_mean"] = statistics.mean(snap)
        out["snapshot_frac_of_step"] = sum(snap) / sum(steps_s)
        written = [r["trainer/snapshot_write_s"] for r in rows if r.get("trainer/snapshot_write_s")]
        out["snapshots_written"] = len(written)  # trainer.snapshot_budget spaces them out when the writes cost more
        out["write_s_mean"] = statistics.mean(written) if written else None
        out["spacing_last"] = next((r["trainer/snapshot_spacing"] for r in reversed(rows) if "trainer/snapshot_spacing" in r), None)
    return out


def runs_part(config: str, steps: int, repeats: int, extra: dict | None = None) -> dict:
    with_, without = [], []
    for r in range(repeats):
        for every, out in ((0, without), (1, with_)):
            out.append(_run(config, steps, every, tempfile.mkdtemp(prefix=f"snapshot_run{every}_"), extra))
            print(json.dumps(out[-1]), flush=True)
    a, b = statistics.median(x["median_step_s"] for x in with_), statistics.median(x["median_step_s"] for x in without)
    frac = statistics.mean(x["snapshot_frac_of_step"] for x in with_)
    return {"with": with_, "without": without, "ratio_step_s": a / b, "snapshot_frac_of_step": frac}


def heal_part(steps: int) -> dict:
    import meshrl

    root = tempfile.mkdtemp(prefix="snapshot_heal_")
    cfg = {"steps": steps, "logging": {"run_dir": root, "progress": False}, "trainer": {"checkpoint_every": 0}, "generator": {"startup_timeout_s": 1200.0}}
    session = meshrl.Session(cfg)
    try:
        session.start()
        session.step(3)
        pid = session._call(session.loop.trainer.shard_info(), 60)[0]["pid"]
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # between two steps: the next step's call finds it dead
        row = session.step(1)[0]
        to_next_step_s = time.monotonic() - killed_at
    finally:
        session.stop()
    return {"restart_s": row.get("trainer/restart_s"), "steps_lost": row.get("trainer/steps_lost"), "kill_to_next_step_s": to_next_step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="store,runs,heal")
    ap.add_argument("--reps", type=int, default=5, help="store part: measured repetitions per size")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config", default="", help="runs part: a config file (default: the embedded default)")
    ap.add_argument("--size", choices=list(SIZES), default="default", help="runs part: the model (25M: section 14's trainer-bound problem, short answers)")
    ap.add_argument("--snapshot-budget", type=float, default=None, help="runs part: trainer.snapshot_budget (default: the config's; 0 writes every step)")
    ap.add_argument("--out", default="benchmarks/results/snapshot_cost.json")
    args = ap.parse_args()
    parts = args.part.split(",")
    out = {"machine": machine(), "args": vars(args)}
    if "store" in parts:
        out["store"] = store_part(args.reps)
    if "runs" in parts:
        extra = {} if args.size == "default" else TRAINER_BOUND | {"model": {**SIZES[args.size], "dtype": "float32"}}
        if args.snapshot_budget is not None:
            extra = extra | {"trainer": {**extra.get("trainer", {}), "snapshot_budget": args.snapshot_budget}}
        out["runs_default"] = runs_part(args.config, args.steps, args.repeats, extra)
        r = out["runs_default"]
        print(f"default config: median step with snapshots / without = {r['ratio_step_s']:.3f}; snapshot share of a step {r['snapshot_frac_of_step']:.3f}")
    if "heal" in parts:
        out["heal"] = heal_part(args.steps)
        print(json.dumps(out["heal"]))
    write_result(out, args.out)


if __name__ == "__main__":
    main()
