"""The task each Slurm node runs: Monarch's worker, under a parent that turns Slurm's
SIGTERM into a note for the controller.

    srun python -m meshrl.launch.slurm_worker --notify DIR -c '<Monarch worker bootstrap>'

Slurm announces the end of an allocation (the `--signal=TERM@N` warning before the time
limit, `scancel`, preemption's grace time) by sending SIGTERM to every process of the job's
steps: the worker and every proc it spawned (trainer, generators, episode queue). Left to
their default, they would all die before the run could checkpoint. So this parent starts
the worker with SIGTERM ignored, which every proc the worker spawns inherits, and catches
SIGTERM itself: it writes `DIR/signaled-$SLURM_JOB_ID`, which the controller watches
(`meshrl.launch.slurm.SignalWatch`). The controller then checkpoints, stops its meshes and
cancels the job; procs still stop on Monarch's own stop and on Slurm's SIGKILL.

Only the standard library here: this runs before anything else on the node.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

SIGNALED_PREFIX = "signaled-"
"""`DIR/signaled-JOBID`: written when Slurm sent SIGTERM to job JOBID on some node."""


def notify_path(directory: str, job_id: str) -> str:
    return os.path.join(directory, f"{SIGNALED_PREFIX}{job_id}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshrl.launch.slurm_worker")
    p.add_argument("--notify", required=True, metavar="DIR", help="where to write signaled-$SLURM_JOB_ID on SIGTERM")
    p.add_argument("-c", dest="code", required=True, help="the worker's Python code (Monarch's bootstrap)")
    args = p.parse_args(argv)
    path = notify_path(args.notify, os.environ.get("SLURM_JOB_ID", "unknown"))

    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the worker and its procs
    worker = subprocess.Popen([sys.executable, "-c", args.code])
    signal.signal(signal.SIGTERM, old)

    def on_sigterm(signum, frame) -> None:
        node = os.environ.get("SLURM_NODEID", "?")
        try:
            with open(path, "a") as f:
                f.write(f"{time.time():.3f} node {node} ({os.uname().nodename})\n")
        except OSError as e:  # the worker goes on; the controller then learns of the end from its hosts
            print(f"meshrl.launch.slurm_worker: could not write {path}: {e}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_sigterm)
    while True:
        try:
            return worker.wait()
        except InterruptedError:  # pragma: no cover - wait() retries EINTR itself since PEP 475
            continue


if __name__ == "__main__":
    sys.exit(main())
