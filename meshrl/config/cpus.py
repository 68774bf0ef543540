"""CPU lists, as in `taskset -c`: `"0-3"`, `"0,2,5-7"`, `|` between the lists of a host's procs.

Pure parsing, for the config checks and the procs that pin themselves (meshrl/pinning.py).
"""

from __future__ import annotations

AUTO = "auto"


def parse_cpu_lists(spec: str) -> list[list[int]]:
    """`"0-1|2,3"` -> [[0, 1], [2, 3]]; `""` -> []. Raises ValueError on bad syntax."""
    if not spec.strip() or spec == AUTO:
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


def trainer_cpus(spec: str, launcher_kind: str, rank: int, local_rank: int) -> list[int] | None:
    """The cores trainer rank `rank` pins itself to under `trainer.cpus`: its host's
    `local_rank`-th list, but the `rank`-th under the process launcher, whose stand-in hosts are
    all this machine (`auto` gives each rank a list of its own of its cores, where by local rank
    the first rank of every stand-in took the same one, and the other lists' cores sat idle)."""
    return cpus_for(spec, rank if launcher_kind == "process" else local_rank)
