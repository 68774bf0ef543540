"""CPU placement: pin a role's processes to a set of cores.

On a GPU cluster the trainer and the generators own separate devices, and that is what
lets asynchronous RL overlap generation with training. On a CPU machine they otherwise
share every core, so overlapping them only trades time (STACK.md: each ran about 2x
slower next to the other). `trainer.cpus` and `generator.cpus` give each role its own
cores, the CPU analogue of device placement.

Syntax (Linux CPU lists, as in `taskset -c`): `"0-3"`, `"0,2,5-7"`; `|` separates the lists
of the processes of one host, by local index: `"0-3|4-7"` pins the first trainer proc (or
generator replica) of each host to cores 0-3 and the second to 4-7. One list is shared by
all of a host's procs.
"""

from __future__ import annotations

import os

import torch


def parse_cpu_lists(spec: str) -> list[list[int]]:
    """`"0-1|2,3"` -> [[0, 1], [2, 3]]; `""` -> []. Raises ValueError on bad syntax."""
    if not spec.strip():
        return []
    lists = []
    for part in spec.split("|"):
        cpus: list[int] = []
        for item in part.split(","):
            item = item.strip()
            lo, sep, hi = item.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise ValueError(f"{item!r} is not a core id or range like 0-3")
            first, last = int(lo), int(hi) if sep else int(lo)
            if last < first:
                raise ValueError(f"range {item!r} runs backwards")
            cpus += range(first, last + 1)
        lists.append(sorted(set(cpus)))
    return lists


def cpus_for(spec: str, local_index: int) -> list[int] | None:
    """The cores of the `local_index`-th proc of a host under `spec`; None: no pinning."""
    lists = parse_cpu_lists(spec)
    return lists[local_index % len(lists)] if lists else None


def pin_this_process(cpus: list[int]) -> None:
    """Pin every thread of this process (and so every thread and child it starts later) to `cpus`.

    `os.sched_setaffinity(0, ...)` moves only the calling thread on Linux, and Monarch's
    runtime and torch's thread pool already run, so each thread of the process is moved.
    """
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"cores {missing} are not available on this host (it has {sorted(allowed)})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass  # the thread exited meanwhile
    torch.set_num_threads(len(cpus))


def vllm_threads_bind(cpus: list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers on `cpus`: an even split, `|`-separated."""
    if len(cpus) < tp:
        raise ValueError(f"{len(cpus)} cores cannot hold {tp} tensor-parallel workers")
    per = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(tp))
