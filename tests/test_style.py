"""The code base is formatted and linted by ruff, with the settings in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["meshrl", "tests", "benchmarks", "scripts", "examples"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_code_is_formatted():
    out = _ruff("format", "--check")
    assert out.returncode == 0, f"run `ruff format {' '.join(PATHS)}`:\n{out.stdout[-3000:]}{out.stderr[-2000:]}"


def test_the_code_passes_the_linter():
    out = _ruff("check")
    assert out.returncode == 0, f"`ruff check` finds:\n{out.stdout[-3000:]}{out.stderr[-2000:]}"
