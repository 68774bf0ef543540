"""Weight sync across a link against within one host, per transport, in one invocation.

Two network namespaces joined by a veth pair stand in for two hosts (the test suite's
`NetnsHosts`, tests/conftest.py; needs root). For each transport (the gloo collective,
Monarch RDMA over its TCP fallback), the same short run goes twice through
`launcher.kind=workers`: once on one host (every role on A), once across the link (the
trainer on A; generators, queue and rollout workers on B). Reported per run: the
generators' weight update per version (`sync/previous_update_s`: fetch and load, in the
background of the next step), the trainer's publish (`sync/publish_s`) and the step time;
then across / within for each transport. The link is a veth pair on one machine: no wire
latency or bandwidth limit, so this measures what crossing a host boundary costs the
software path (TCP instead of Unix sockets and loopback), not a network.

    python benchmarks/multihost.py [--steps 10] [--model dim=384 ...]

Writes benchmarks/results/multihost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import yaml

from common import RESULTS, bench_model, machine

from tests.conftest import NetnsHosts, netns_unavailable  # noqa: E402

PORT = 26700


def run_once(hosts: NetnsHosts, root: str, name: str, transport: str, across: bool, args) -> dict:
    a, b = hosts.ADDRESSES["a"], hosts.ADDRESSES["b"]
    workers = [f"{a}:{PORT}", f"{b}:{PORT}"] if across else [f"{a}:{PORT}"]
    run_dir = os.path.join(root, name)
    cfg = {
        "steps": args.steps,
        "batch_groups": 4,
        "model": bench_model(args),
        "generator": {"group_size": 4, "max_new_tokens": 8, "max_num_seqs": 32},
        "trainer": {"micro_batch_size": 16, "checkpoint_every": 0},
        "weight_sync": {"transport": transport},
        "launcher": {"kind": "workers", "workers": workers, "address": a},
        "logging": {"run_dir": run_dir, "progress": False, "tensorboard": False, "plot": False},
    }
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    for h in ("a", "b") if across else ("a",):
        hosts.worker(h, PORT, os.path.join(root, f"{name}-worker-{h}.log"))
    controller = hosts.run("a", [sys.executable, "-m", "meshrl", "run", path], os.path.join(root, f"{name}-controller.log"))
    try:
        controller.wait(timeout=args.timeout)
    except Exception:
        controller.kill()
        raise SystemExit(f"{name}: the run did not end within {args.timeout} s (see {root})")
    if controller.returncode != 0:
        with open(os.path.join(root, f"{name}-controller.log")) as f:
            raise SystemExit(f"{name} failed:\n{f.read()[-2000:]}")
    deadline = time.monotonic() + 60
    while any(hosts.pids(h) for h in ("a", "b")) and time.monotonic() < deadline:
        time.sleep(0.5)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()][args.warmup :]

    def median(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else float("nan")

    return {
        "name": name,
        "transport": transport,
        "across": across,
        "update_s": median("sync/previous_update_s"),
        "publish_s": median("sync/publish_s"),
        "step_s": median("time/step_s"),
        "steps": len(rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--transports", default="collective,rdma")
    p.add_argument("--model", action="append", metavar="KEY=INT", help="override a BENCH_MODEL size (default: the 10.7M benchmark model)")
    p.add_argument("--timeout", type=float, default=400.0, help="longest one run may take, in s")
    p.add_argument("--out", default=os.path.join(RESULTS, "multihost.json"))
    args = p.parse_args()
    why = netns_unavailable()
    if why:
        raise SystemExit(f"multihost benchmark: {why}")
    t0 = time.monotonic()
    rows = []
    hosts = NetnsHosts().start()
    try:
        with tempfile.TemporaryDirectory(prefix="meshrl-bench-") as root:
            for transport in args.transports.split(","):
                for across in (False, True):
                    name = f"{transport}-{'across' if across else 'within'}"
                    rows.append(run_once(hosts, root, name, transport, across, args))
                    r = rows[-1]
                    print(f"{name:<22} update {1e3 * r['update_s']:8.1f} ms  publish {1e3 * r['publish_s']:7.1f} ms  step {r['step_s']:.3f} s", flush=True)
    finally:
        hosts.stop()
    ratios = {}
    for transport in args.transports.split(","):
        within, across = (next(r for r in rows if r["transport"] == transport and r["across"] == a) for a in (False, True))
        ratios[transport] = {
            "update_across_over_within": across["update_s"] / within["update_s"],
            "step_across_over_within": across["step_s"] / within["step_s"],
        }
        print(
            f"{transport}: weight update across the link / within one host = {ratios[transport]['update_across_over_within']:.2f}x; "
            f"step {ratios[transport]['step_across_over_within']:.2f}x"
        )
    payload = {"args": vars(args), "machine": machine(), "rows": rows, "ratios": ratios, "wall_s": time.monotonic() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
