"""The sandbox's cost per call: latency and calls per second, against a bare subprocess.

Two programs: `pass` (trivial) and a 100 ms busy loop. Four ways to run each, one call at a
time unless said:
  - bare:      `python3 -I -c CODE` as a plain asyncio subprocess (no isolation, no limits);
  - warm:      SandboxPool with pool_size 2, each call finding a sandbox already started
               (the pool refills between calls, untimed);
  - cold:      pool_size 0: every call makes its sandbox (namespaces, mounts, interpreter);
  - sustained: pool_size 2, calls back to back, so refills race the calls (what a rollout
               worker sees when the tool is busy);
and `concurrent`: 4 callers at once on a pool of 4 (calls/s only).
The overhead ratio is the sandbox's p50 over bare's p50 for the same program.

    python benchmarks/sandbox.py [--calls 60]

Writes benchmarks/results/sandbox.json (with the CPU flags and versions) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time

from common import ROOT, machine

from meshrl.config import SandboxConfig  # noqa: E402
from meshrl.rollout.sandbox import SandboxPool, interpreter  # noqa: E402

PROGRAMS = {
    "trivial": "pass",
    "100ms": "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 0.1:\n    pass",
}


def sandbox_machine() -> dict:
    """The common machine record, plus what decides the sandbox's cost: the kernel and bubblewrap."""
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    return {**machine(), "kernel": platform.release(), "bwrap": bwrap}


def stats(latencies: list[float], wall: float) -> dict:
    ordered = sorted(latencies)
    return {
        "calls": len(latencies),
        "calls_per_s": len(latencies) / wall,
        "p50_ms": 1000 * statistics.median(ordered),
        "p95_ms": 1000 * ordered[int(0.95 * (len(ordered) - 1))],
        "mean_ms": 1000 * statistics.fmean(ordered),
    }


async def bare(python: str, code: str, calls: int) -> dict:
    latencies = []
    start = time.perf_counter()
    for _ in range(calls):
        t = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(python, "-I", "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        await proc.communicate()
        assert proc.returncode == 0
        latencies.append(time.perf_counter() - t)
    return stats(latencies, time.perf_counter() - start)


async def sandboxed(code: str, calls: int, pool_size: int, refill_between: bool) -> dict:
    pool = SandboxPool(SandboxConfig(pool_size=pool_size, wall_timeout_s=10))
    await pool.warm()
    latencies, timed = [], 0.0
    for _ in range(calls):
        t = time.perf_counter()
        result = await pool.run(code)
        dt = time.perf_counter() - t
        assert result.ok, result
        latencies.append(dt)
        timed += dt
        if refill_between:
            await pool.warm()
    out = stats(latencies, timed)
    out["cold_starts"] = pool.cold_starts
    await pool.close()
    return out


async def concurrent(code: str, calls: int, callers: int = 4) -> dict:
    pool = SandboxPool(SandboxConfig(pool_size=callers, max_concurrent=callers, wall_timeout_s=10))
    await pool.warm()
    latencies: list[float] = []

    async def caller(n: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            result = await pool.run(code)
            assert result.ok, result
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(caller(calls // callers) for _ in range(callers)))
    out = stats(latencies, time.perf_counter() - start)
    out["callers"] = callers
    await pool.close()
    return out


async def main(calls: int) -> dict:
    python, _ = interpreter(SandboxConfig())
    results: dict = {"machine": sandbox_machine(), "calls": calls, "python": python, "programs": PROGRAMS, "cases": {}}
    for name, code in PROGRAMS.items():
        await bare(python, code, 5)  # page cache
        case = {
            "bare": await bare(python, code, calls),
            "warm": await sandboxed(code, calls, 2, refill_between=True),
            "cold": await sandboxed(code, calls, 0, refill_between=False),
            "sustained": await sandboxed(code, calls, 2, refill_between=False),
            "concurrent": await concurrent(code, calls),
        }
        for mode in ("warm", "cold", "sustained"):
            case[mode]["overhead_p50_x_bare"] = case[mode]["p50_ms"] / case["bare"]["p50_ms"]
        results["cases"][name] = case
    results["machine_after"] = sandbox_machine()
    return results


def table(results: dict) -> str:
    lines = ["| program | mode | calls/s | p50 ms | p95 ms | p50 / bare |", "|---|---|---|---|---|---|"]
    for name, case in results["cases"].items():
        for mode, s in case.items():
            ratio = f"{s['overhead_p50_x_bare']:.2f}x" if "overhead_p50_x_bare" in s else ("1x" if mode == "bare" else "")
            lines.append(f"| {name} | {mode} | {s['calls_per_s']:.1f} | {s['p50_ms']:.1f} | {s['p95_ms']:.1f} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "sandbox.json"))
    args = parser.parse_args()
    results = asyncio.run(main(args.calls))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"cpu flags: {' '.join(results['machine']['cpu_flags'])}; {results['machine']['cpus']} cpus; {results['machine']['bwrap']}")
    print(table(results))
