"""The cyclic garbage collector in meshrl's own processes: fewer passes while they start,
none as they exit.

Each proc of a run (trainer, generator, rollout worker, queue) and the `meshrl` command
import torch, vLLM, TorchTitan and Monarch: several hundred thousand objects that live as
long as the process. Python's default thresholds (700 allocations for a young pass) make
the collector walk that growing heap over a thousand times during the imports, about a
fifth of their time here, to find almost nothing: imported modules are not garbage. And
at exit the interpreter runs one last full pass over every object still alive, which
held each stopped proc for seconds (py-spy: `gc_collect_main` under finalization) while
the run waited for it, although the process's memory is about to be returned whole.

So a meshrl process collects young objects every `YOUNG_THRESHOLD` allocations instead of
700 (cycles are still collected; the step's tensors are freed by reference counting as
before), and freezes what is alive at exit. Nothing else changes: atexit handlers, log
flushes and thread joins run as they did. Objects left uncollected at exit make nanobind
(triton's bindings) print a leak report as the process ends: a proc's goes to its log
file, and the `meshrl` command freezes only once its output goes to the run's log.
"""

from __future__ import annotations

import atexit
import gc
import os

YOUNG_THRESHOLD = 100_000
"""Allocations between young passes in a meshrl process (Python's default: 700)."""

MONARCH_PROC_ENV = "HYPERACTOR_MESH_BOOTSTRAP_MODE"
"""Set by Monarch in every proc it starts: the procs that host meshrl's actors."""


def no_collection_at_exit() -> None:
    """Freeze every live object at exit, so the interpreter's last pass has nothing to walk."""
    atexit.register(gc.freeze)


def fewer_passes() -> None:
    """Young passes every `YOUNG_THRESHOLD` allocations, for the rest of this process."""
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def for_a_monarch_proc() -> None:
    """Fewer collector passes while this proc starts and runs; none at its exit."""
    fewer_passes()
    no_collection_at_exit()


def in_a_monarch_proc() -> bool:
    return MONARCH_PROC_ENV in os.environ
