"""How long after a proc is SIGKILLed a call to its actor fails (docs/healing.md).

A heal or a replacement starts when a call to the dead proc fails, and Monarch fails it when
its mesh controller's supervision poll finds the proc gone
(`HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY`). meshrl sets 1 s as it is imported
(`compat.monarch_prompt_supervision`); Monarch's default, the reference measured in the same
invocation, is 10 s. Each trial runs in a fresh process: spawn one proc with one actor, start a
call that would take a minute, kill the proc, time until the call fails.

    python benchmarks/supervision.py [--trials 3] [--out benchmarks/results/supervision.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from common import machine, write_result

TRIAL = """
import asyncio, json, os, signal, time
import meshrl  # applies compat.monarch_prompt_supervision, unless the environment names a poll
from monarch.actor import Actor, endpoint, this_host
import monarch.actor

monarch.actor.unhandled_fault_hook = lambda failure: None  # the failure this trial causes


class Sleeper(Actor):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def sleep(self) -> None:
        await asyncio.sleep(60)


async def main():
    procs = this_host().spawn_procs(per_host={"procs": 1})
    actor = procs.spawn("sleeper", Sleeper)
    pid = await actor.pid.call_one()
    call = asyncio.ensure_future(actor.sleep.call_one())
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        await asyncio.wait_for(call, 120)
        failed = None
    except Exception as e:  # noqa: BLE001 - the failure being timed
        failed = type(e).__name__
    print(json.dumps({"failed_after_s": time.monotonic() - t0, "error": failed}))
    os._exit(0)  # the trial's meshes are gone with its proc; no orderly stop to wait for


asyncio.run(main())
"""


def trial(poll: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"}
    if poll is not None:
        env["HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY"] = poll
    out = subprocess.run([sys.executable, "-c", TRIAL], capture_output=True, text=True, timeout=300, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/supervision.json")
    args = ap.parse_args()

    result = {"machine": machine(), "args": vars(args), "meshrl": [], "monarch_default": []}
    for _ in range(args.trials):  # interleaved
        for arm, poll in (("meshrl", None), ("monarch_default", "10s")):
            result[arm].append(trial(poll))
            print(arm, result[arm][-1], flush=True)
    medians = {arm: statistics.median(t["failed_after_s"] for t in result[arm]) for arm in ("meshrl", "monarch_default")}
    result["median_failed_after_s"] = medians
    result["ratio_meshrl_over_default"] = medians["meshrl"] / medians["monarch_default"]
    print(json.dumps({k: result[k] for k in ("median_failed_after_s", "ratio_meshrl_over_default")}))
    write_result(result, args.out)


if __name__ == "__main__":
    main()
