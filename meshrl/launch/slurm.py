"""`launcher.kind=slurm`: one sbatch allocation through Monarch's `SlurmJob`, and its script.

This process is the controller (run it on a login node); it submits the job and attaches
to the allocation's workers. `render_sbatch` shows the script without submitting it;
`check_slurm` (at preflight) asks Slurm, before anything is submitted, that it is there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from typing import Any
from unittest import mock

from meshrl.config import Config, ConfigError
from meshrl.launch.hosts import job_meshes

logger = logging.getLogger("meshrl.launch")
SQUEUE_TRIES, SQUEUE_RETRY_S = 3, 5.0
"""A failed `squeue` is asked this many times, this far apart, before a job never seen is taken for gone."""


def slurm_dir(config: Config) -> str:
    """RUN_DIR/slurm: the job's output files and the workers' signal notes (a shared filesystem)."""
    return os.path.abspath(os.path.join(config.logging.run_dir, "slurm"))


def _slurm_job_class() -> type:
    """Monarch's SlurmJob, reading Slurm 22.05's `squeue --json` too (meshrl.compat), and
    saying why a job that did not start in time waited (its pending reason) when it gives up."""
    from monarch.job import SlurmJob

    from meshrl.compat import squeue_json_job

    class MeshrlSlurmJob(SlurmJob):
        _pending_reason: str = ""
        _last_job: dict | None = None
        _failed = 0  # squeue calls failed in a row

        def _get_job_info_json(self, job_id: str):
            """The job's squeue entry; None when squeue answered without it (SlurmJob then
            cancels the job), "Invalid job id" included. A failed squeue (a busy slurmctld) is
            asked again, and answered with its last entry where there is one, up to SQUEUE_TRIES
            failures in a row: one failure is not a job gone from the queue."""
            for attempt in range(SQUEUE_TRIES):
                try:
                    out = subprocess.run(["squeue", "--job", job_id, "--json"], capture_output=True, text=True, check=True, timeout=60)
                    job = squeue_json_job(out.stdout, job_id)
                    break
                except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError) as e:
                    logger.warning("launcher: squeue on job %s failed: %s", job_id, getattr(e, "stderr", None) or e)
                    if "invalid job id" in str(getattr(e, "stderr", None) or "").lower():  # purged: gone
                        job = None
                        break
                    self._failed += 1
                    if self._last_job is not None and self._failed < SQUEUE_TRIES:
                        return self._last_job
                    if attempt + 1 < SQUEUE_TRIES:
                        time.sleep(SQUEUE_RETRY_S)
            else:
                return None
            self._last_job, self._failed = job, 0
            if job:
                self._pending_reason = str(job.get("state_reason") or "")
            return job

        def _wait_for_job_start(self, job_id: str, expected_nodes: int, timeout: int | None = None):
            try:
                return super()._wait_for_job_start(job_id, expected_nodes, timeout)
            except RuntimeError as e:  # SlurmJob cancelled the job before raising
                if str(e).startswith("Timeout waiting"):
                    reason = f", pending: {self._pending_reason}" if self._pending_reason not in ("", "None") else ""
                    raise TimeoutError(
                        f"Slurm job {job_id} did not start within launcher.start_timeout_s={timeout} s{reason}; "
                        "it was cancelled: raise launcher.start_timeout_s, or choose another launcher.partition"
                    ) from None
                raise

    return MeshrlSlurmJob


def slurm_job(config: Config) -> Any:
    la = config.launcher
    return _slurm_job_class()(
        meshes=job_meshes(config),
        # the controller's interpreter (a venv on a shared filesystem), running Monarch's worker
        # under slurm_worker, which relays Slurm's SIGTERM to the controller (SignalWatch)
        python_exe=f"{sys.executable} -m meshrl.launch.slurm_worker --notify {shlex.quote(slurm_dir(config))}",
        # SIGTERM ahead of the time limit; no requeue by Slurm: a requeued job would start
        # workers that no controller attaches to (meshrl resubmits itself instead)
        slurm_args=[f"--signal=TERM@{la.signal_before_s}", "--no-requeue"],
        job_name="meshrl",
        time_limit=la.time_limit,
        partition=la.partition,
        account=la.account,
        gpus_per_node=la.gpus_per_host or None,
        log_dir=slurm_dir(config),
        job_start_timeout=int(la.start_timeout_s),
    )


def render_sbatch(config: Config) -> str:
    """The sbatch script `launcher.kind=slurm` would submit, built by Monarch's own SlurmJob.

    SlurmJob has no public dry run: its submit method builds the script and pipes it to
    `sbatch`. We call that method with the `subprocess` it sees replaced by a recorder, so
    the script is Monarch's, nothing is submitted and no sbatch binary is needed. (It still
    creates the log directory, RUN_DIR/slurm.)
    """
    import monarch.config
    from monarch._src.job import slurm as monarch_slurm

    scripts: list[str] = []

    def record(cmd: list[str], input: str | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        scripts.append(input or "")
        return subprocess.CompletedProcess(cmd, 0, stdout="Submitted batch job 0\n", stderr="")

    fake_subprocess = types.SimpleNamespace(run=record, CalledProcessError=subprocess.CalledProcessError)
    # SlurmJob() switches this process's default transport to TCP; `configured()` restores it,
    # so a dry run leaves local meshes as they were.
    with (
        monarch.config.configured(),
        mock.patch.object(monarch_slurm, "subprocess", fake_subprocess),
        mock.patch.object(monarch_slurm.logger, "disabled", True),  # it would log "Submitting SLURM job"
    ):
        job = slurm_job(config)
        job._submit_slurm_job(sum(job_meshes(config).values()))
    return scripts[0]


# ---- before submitting: Slurm answers here ---------------------------------------------------
SLURM_COMMANDS = ("sbatch", "squeue", "scancel", "sinfo")
"""What launcher.kind=slurm runs on the controller's machine: submit, watch, cancel, and list partitions."""


def check_slurm(c: Config) -> None:
    """Paths the job script can carry, Slurm's commands on PATH, a controller that answers, and
    the partition asked for."""
    for field, what, path in (("logging.run_dir", "the job's output directory", slurm_dir(c)), ("launcher.kind", "this Python", sys.executable)):
        if any(ch.isspace() or ch in "'\"" for ch in path):
            raise ConfigError(
                field, f"{what} {path!r} holds a space or a quote, which the job script's #SBATCH and srun lines split at: use a path without one"
            )
    missing = [cmd for cmd in SLURM_COMMANDS if shutil.which(cmd) is None]
    if missing:
        raise ConfigError(
            "launcher.kind",
            f"slurm needs Slurm's commands on PATH and {', '.join(missing)} is not: run meshrl on a login node of the cluster "
            "(or use launcher.kind=process to try the multi-host path on this machine)",
        )
    listed = slurm_partitions()
    partitions = [p.rstrip("*") for p in listed]
    p = c.launcher.partition
    if p is not None and p not in partitions:
        raise ConfigError(
            "launcher.partition", f"no partition {p!r} on this cluster: give one of {', '.join(partitions) or '(none listed)'}, or null for the default"
        )
    if p is None and not any(name.endswith("*") for name in listed):
        raise ConfigError("launcher.partition", f"this cluster has no default partition: name one of {', '.join(partitions) or '(none listed)'}")


def slurm_partitions() -> list[str]:
    """The cluster's partitions as `sinfo` lists them (the default one ends in `*`): ConfigError
    where Slurm's controller does not answer from this machine."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ConfigError("launcher.kind", "sinfo did not answer within 60 s: Slurm's controller is unreachable from this machine") from None
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise ConfigError("launcher.kind", f"sinfo failed ({why}): Slurm's controller is unreachable from this machine, or SLURM_CONF points elsewhere")
    return out.stdout.split()


# ---- Slurm's SIGTERM, relayed from the nodes ---------------------------------------------------
_SIGNALED = threading.Event()
"""Set once a watched allocation was signaled by Slurm; read by `allocation_signaled()`."""


def allocation_signaled() -> bool:
    """Whether Slurm signaled an allocation of this process (preemption, the time-limit
    warning, scancel), rather than someone stopping the controller itself."""
    return _SIGNALED.is_set()


class SignalWatch:
    """Watches for the note a node's `slurm_worker` writes when Slurm sends the job SIGTERM,
    and then sends this controller SIGTERM: the run stops as on any SIGTERM (the step in
    flight finishes, a checkpoint is written within trainer.interrupt_checkpoint_timeout_s,
    meshes stop, the job is cancelled), and `allocation_signaled()` says why."""

    POLL_S = 1.0

    def __init__(self, directory: str, job_id: str, since: float = 0.0):
        from meshrl.launch.slurm_worker import notify_path

        self.path = notify_path(directory, job_id)
        self.job_id = job_id
        with contextlib.suppress(OSError, ValueError, IndexError):  # one written before `since` (the job's submission) is an
            with open(self.path) as f:  # earlier job's of the same id (ids wrap, a controller reset): not this one's
                if float(f.read().split()[0]) < since:
                    os.remove(self.path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"slurm-signal-{job_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            if os.path.exists(self.path):
                _SIGNALED.set()
                logger.warning("launcher: Slurm sent SIGTERM to job %s (preemption, time limit or scancel): checkpointing and stopping", self.job_id)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def stop(self) -> None:
        self._stop.set()
