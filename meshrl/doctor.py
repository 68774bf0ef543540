"""`meshrl doctor`: the paths this machine can take, each tried for real, in one table.

Run it first on a new machine. With a tiny model made on the spot (the embedded default's),
it starts what a run starts and checks what a run relies on: Monarch procs, the vLLM engine,
a synchronous colocated run (the engine sleeping while the trainer steps, then waking on the
new version handed over in shared memory; on one GPU, CUDA IPC) whose sampler log-probs must
match the trainer's on every step, an asynchronous split run on the machine's devices (on
two or more GPUs: NCCL from the trainer into the engine's workers; skipped on one GPU, where
the two cannot hold a GPU each), the bubblewrap sandbox and Slurm's commands. Each row says passed, failed or
skipped (not possible here), how long it took, and for a failure the fix. Exits 1 on any
failure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from meshrl.errors import first_line

MISMATCH = 2e-3
"""Largest mean |log pi - log mu| a synchronous step may show: on-policy, trainer and
engine score the same weights (the multihost test's bound)."""


@dataclass
class Row:
    path: str
    status: str
    """passed, failed or skipped."""
    seconds: float
    detail: str


def _try(path: str, check: Callable[[], tuple[str, str]], fix: str) -> Row:
    t0 = time.monotonic()
    try:
        status, detail = check()
    except Exception as e:  # noqa: BLE001 - every failure becomes a row, with its fix
        first = first_line(str(e), 160) or type(e).__name__
        status, detail = "failed", f"{type(e).__name__}: {first} -> fix: {fix}"
    return Row(path, status, time.monotonic() - t0, detail)


def gpus() -> tuple[str, str]:
    from meshrl.launch.devices import detected_gpus
    from meshrl.launch.memory import nvml_gpu_memory

    n = detected_gpus()
    if n == 0:
        return "skipped", "no GPU: the CPU paths are tried"
    memory = nvml_gpu_memory()
    return "passed", f"{n} GPU(s) of {memory / 2**30:.0f} GiB" if memory else f"{n} GPU(s)"


def monarch_procs() -> tuple[str, str]:
    from monarch.actor import Actor, endpoint, this_host

    class Echo(Actor):
        @endpoint
        async def pid(self) -> int:
            return os.getpid()

    async def run() -> list[int]:
        procs = this_host().spawn_procs(per_host={"procs": 2})
        try:
            return list((await asyncio.wait_for(procs.spawn("doctor_echo", Echo).pid.call(), 60)).values())
        finally:
            await asyncio.wait_for(procs.stop(), 60)

    pids = asyncio.run(run())
    if len(set(pids)) != 2:
        raise RuntimeError(f"2 procs answered with pids {pids}")
    return "passed", "2 procs spawned, called and stopped"


def sandbox() -> tuple[str, str]:
    from meshrl.config import SandboxConfig
    from meshrl.rollout.sandbox import Sandbox, bwrap_path

    if bwrap_path() is None:
        raise RuntimeError("bubblewrap (bwrap) is not installed")

    async def run():
        box = await Sandbox.start(SandboxConfig())
        try:
            return await box.run("print(6 * 7)")
        finally:
            await box.kill()

    result = asyncio.run(run())
    if not result.ok or result.stdout.strip() != "42":
        raise RuntimeError(f"the sandboxed program did not print 42: {result.summary(160)}")
    return "passed", "model-written code ran under bubblewrap"


def slurm() -> tuple[str, str]:
    from meshrl.config import ConfigError
    from meshrl.launch.slurm import SLURM_COMMANDS, slurm_partitions  # what launcher.kind=slurm's preflight asks for

    found = [c for c in SLURM_COMMANDS if shutil.which(c)]
    if not found:
        return "skipped", "no Slurm commands on PATH (launcher.kind=slurm needs them)"
    if len(found) < len(SLURM_COMMANDS):
        raise RuntimeError(f"only {', '.join(found)} on PATH, not {', '.join(c for c in SLURM_COMMANDS if c not in found)}")
    try:  # the commands alone said passed where launcher.kind=slurm was then refused
        partitions = slurm_partitions()
    except ConfigError as e:
        return "skipped", f"Slurm's commands are on PATH, but {e.message}: launcher.kind=slurm is refused here"
    return "passed", f"{', '.join(SLURM_COMMANDS)} at {os.path.dirname(shutil.which('sbatch'))}; partitions {', '.join(partitions) or '(none)'}"


def short_run(root: str, name: str, overrides: dict, steps: int = 3, on_policy: bool = True) -> tuple[str, str]:
    """A real run of the embedded default for `steps` steps: engine started, weights updated
    every step; `on_policy`: each step's batch sampled by the weights it trains, so the
    trainer's and the engine's log-probs must agree."""
    from meshrl.api import Session
    from meshrl.config import Config

    config = Config.from_dict(
        {"logging": {"run_dir": os.path.join(root, name), "progress": False, "plot": False, "tensorboard": False}, "steps": steps, **overrides}
    )
    t0 = time.monotonic()
    with Session(config) as session:
        started = time.monotonic() - t0
        rows = session.step(steps)
    versions = [int(r["version"]) for r in rows]
    if versions != list(range(1, steps + 1)):
        raise RuntimeError(f"versions {versions}, expected 1..{steps}")
    worst = max(r.get("trainer/logprob_mismatch", 0.0) for r in rows)
    if on_policy and worst > MISMATCH:
        raise RuntimeError(f"trainer and engine log-probs differ by {worst:.2e} on an on-policy step: the weights did not reach the engine whole")
    return "passed", f"engine up in {started:.0f}s; {steps} steps, versions {versions[0]}..{versions[-1]}, log-prob mismatch {worst:.1e}"


SYNC = {"buffer": {"depth": 0, "max_lag": 0}, "generator": {"update_mode": "block"}}
"""A synchronous run: each step's batch sampled by the weights it trains."""


def run_doctor(keep: str | None = None) -> list[Row]:
    from meshrl.launch.devices import detected_gpus

    root = keep or tempfile.mkdtemp(prefix="meshrl-doctor-")
    n = detected_gpus()
    rows = [_try("GPUs", gpus, "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")]
    rows.append(_try("Monarch procs", monarch_procs, "pip install torchmonarch (the version in constraints.txt); check that this host may open loopback ports"))
    colocated = "engine, sleep/wake, weight handoff" + (" (CUDA IPC)" if n else " (shared memory)")
    rows.append(
        _try(
            f"colocated sync run: {colocated}, log-prob match",
            lambda: short_run(root, "colocated", {"placement": "colocate", "buffer": {"max_lag": 0}}),
            "read the run's logs in " + os.path.join(root, "colocated") + " (vLLM's engine log first)",
        )
    )
    if n == 1:
        rows.append(Row("split run", "skipped", 0.0, "one GPU: trainer and generator cannot hold GPUs of their own"))
    else:
        # on GPUs synchronous, so that weights NCCL delivered wrong show as a log-prob mismatch
        # (async, a stale batch's mismatch is no fault); on CPU the asynchronous path's versions
        split, overrides = (
            ("split sync run: NCCL into the engine's workers, log-prob match", {"weight_sync": {"transport": "collective"}, **SYNC})
            if n >= 2
            else ("split async run: weights synced while generating", {"weight_sync": {"transport": "auto"}})
        )
        rows.append(
            _try(
                split,
                lambda: short_run(root, "split", {"placement": "split", **overrides}, on_policy=n >= 2),
                "read the run's logs in " + os.path.join(root, "split"),
            )
        )
    rows.append(_try("sandbox (bubblewrap)", sandbox, "install bubblewrap (apt install bubblewrap) and allow unprivileged user namespaces"))
    rows.append(_try("Slurm", slurm, "install the Slurm client commands, or use launcher.kind=local|process"))
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def table(rows: list[Row]) -> str:
    width = max(len(r.path) for r in rows)
    lines = [f"{'path'.ljust(width)}  {'result':7}  {'time':>6}  detail"]
    lines += [f"{r.path.ljust(width)}  {r.status:7}  {r.seconds:5.1f}s  {r.detail}" for r in rows]
    return "\n".join(lines) + "\n"
