"""`meshrl doctor` on this machine: every CPU path tried for real, one table, exit status 0;
a broken path fails its row with the fix and the command exits 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshrl import doctor


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_doctor_passes_every_cpu_path(tmp_path):
    p = subprocess.run([sys.executable, "-m", "meshrl", "doctor", "--keep", str(tmp_path)], capture_output=True, text=True, timeout=380)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = {line.split("  ")[0].strip(): line for line in p.stdout.splitlines()[1:] if "  " in line and not line.startswith("meshrl doctor")}
    want = ("GPUs", "Monarch procs", "colocated sync run", "split async run", "sandbox (bubblewrap)", "Slurm")
    for path in want:
        line = next((line for name, line in rows.items() if name.startswith(path)), None)
        assert line is not None and (" passed " in line or " skipped " in line), (path, p.stdout)
    assert "log-prob mismatch" in rows[next(n for n in rows if n.startswith("colocated"))]
    assert "6 of 6 paths passed or skipped" in p.stdout


def test_a_broken_path_fails_its_row_with_the_fix_and_the_exit_status(monkeypatch, capsys):
    import meshrl.rollout.sandbox as sandbox_module
    from meshrl.cli import main

    monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: None)
    row = doctor._try("sandbox (bubblewrap)", doctor.sandbox, "install bubblewrap")
    assert row.status == "failed" and "bubblewrap (bwrap) is not installed" in row.detail and "fix: install bubblewrap" in row.detail
    monkeypatch.setattr(doctor, "run_doctor", lambda keep=None: [doctor.Row("GPUs", "skipped", 0.0, "no GPU"), row])
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "failed" in out and "1 of 2 paths passed or skipped" in out and "failed: sandbox (bubblewrap)" in out


def test_on_gpus_the_split_row_is_synchronous_and_checks_the_log_probs(monkeypatch):
    """The NCCL split row ran asynchronously with the log-prob check off: weights delivered wrong
    passed. On GPUs it is a synchronous run, checked as the colocated one is; on CPU it stays
    the asynchronous path."""
    import meshrl.launch.devices as devices

    runs = {}
    monkeypatch.setattr(doctor, "short_run", lambda root, name, overrides, on_policy=True: runs.setdefault(name, (overrides, on_policy)) and ("passed", ""))
    for fn in ("gpus", "monarch_procs", "sandbox", "slurm"):
        monkeypatch.setattr(doctor, fn, lambda: ("passed", ""))
    for n, synchronous in ((2, True), (0, False)):
        runs.clear()
        monkeypatch.setattr(devices, "detected_gpus", lambda n=n: n)
        doctor.run_doctor()
        overrides, on_policy = runs["split"]
        assert on_policy is synchronous and (overrides.get("buffer") == {"depth": 0, "max_lag": 0}) is synchronous, overrides


def test_the_slurm_row_asks_the_controller_as_a_slurm_run_would(tmp_path, monkeypatch):
    """The row said passed for Slurm's commands on PATH, where a run was then refused because
    `sinfo` could not reach a controller; it asks `sinfo` now, as launcher.kind=slurm's check does."""
    import os

    from meshrl import doctor

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "squeue", "scancel", "sinfo"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (bin_dir / "sinfo").write_text("#!/bin/sh\necho 'sinfo: fatal: Could not establish a configuration source' >&2\nexit 1\n")
    status, detail = doctor.slurm()
    assert status == "skipped" and "Could not establish a configuration source" in detail and "launcher.kind=slurm is refused here" in detail
    (bin_dir / "sinfo").write_text("#!/bin/sh\necho 'debug*'\necho gpu\n")
    assert doctor.slurm() == ("passed", f"sbatch, squeue, scancel, sinfo at {bin_dir}; partitions debug*, gpu")
