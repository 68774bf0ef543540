"""`launcher.kind=slurm`: one sbatch allocation through Monarch's `SlurmJob`, and its script.

This process is the controller (run it on a login node); it submits the job and attaches
to the allocation's workers. `render_sbatch` shows the script without submitting it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any
from unittest import mock

from meshrl.config import Config
from meshrl.launch.hosts import plan_hosts


def slurm_job(config: Config) -> Any:
    from meshrl.compat import slurm_job_class

    SlurmJob = slurm_job_class()
    la = config.launcher
    return SlurmJob(
        meshes=plan_hosts(config),
        python_exe=sys.executable,  # the controller's interpreter: a venv on a shared filesystem
        job_name="meshrl",
        time_limit=la.time_limit,
        partition=la.partition,
        account=la.account,
        gpus_per_node=la.gpus_per_host or None,
        log_dir=os.path.abspath(os.path.join(config.logging.run_dir, "slurm")),
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
        job._submit_slurm_job(sum(plan_hosts(config).values()))
    return scripts[0]
