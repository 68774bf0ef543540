"""CPU pinning: each role's processes on cores of their own (`trainer.cpus`, `generator.cpus`).

"Placement" is the other idea: whether the roles run split or colocated
(`placement`, decided by `resolve_placement` in meshrl/launch/devices.py); pinning then
says which cores each proc of a role may use.

On a GPU cluster the trainer and the generators own separate devices, and that is what
lets asynchronous RL overlap generation with training. On a CPU machine they otherwise
share every core, so overlapping them only trades time (STACK.md: each ran about 2x
slower next to the other). `trainer.cpus` and `generator.cpus` give each role its own
cores, the CPU analogue of device placement.

Syntax (Linux CPU lists, as in `taskset -c`, parsed by meshrl/config/cpus.py): `"0-3"`, `"0,2,5-7"`; `|` separates the lists
of the processes of one host, by local index: `"0-3|4-7"` pins the first trainer proc (or
generator replica) of each host to cores 0-3 and the second to 4-7. One list is shared by
all of a host's procs. `""` pins nothing.

`"auto"` (the default) splits this host's cores when the trainer runs on CPU: the
generators take half (at least `tp` per replica), the trainer the rest, and each process
sizes its thread pools to its own cores; the queue and rollout-worker procs share the
trainer's cores. This holds in synchronous mode too, where the roles take turns: an idle
role's thread pools still spin-wait and poll on every core, and each role ran faster alone
on its half than sharing all of them (measurements in benchmarks/README.md, section 6).
With a GPU trainer, or hosts this process cannot see (Slurm, TorchX), `auto` pins nothing.
Under `placement=colocate` the roles take turns (generation never runs during a training
step), so `auto` gives every role all of this host's cores.
"""

from __future__ import annotations

import os

import torch

from meshrl.compat import cuda_present
from meshrl.config.cpus import AUTO, cpus_for, parse_cpu_lists
from meshrl.launch.devices import gpus_per_host, resolve_placement, resolve_transport
from meshrl.logs import console


def settle_layout(config) -> None:
    """The run's `auto` choices made for this host, in place: its placement (said on the
    console where it was chosen on CPU, and why), its weight transport and each role's cores."""
    c = config
    if c.launcher.kind in ("slurm", "workers") and c.launcher.gpus_per_host == 0 and c.trainer.device == "auto":
        job = ", and the Slurm job asks for none" if c.launcher.kind == "slurm" else ""
        why = f"this {c.launcher.kind} run plans no GPUs (every role on CPU{job}); set it to the hosts' GPUs for a GPU run"
        print(f"meshrl: launcher.gpus_per_host=0: {why}", file=console())
    placement, why = resolve_placement(c)
    if c.placement == "auto" and gpus_per_host(c) == 0:
        print(f"meshrl: placement auto -> {placement} ({why})", file=console())
    c.placement, c.weight_sync.transport = placement, resolve_transport(c)
    c.trainer.cpus, c.generator.cpus = resolve_cpus(c)


def resolve_cpus(config, cores: list[int] | None = None) -> tuple[str, str]:
    """`(trainer.cpus, generator.cpus)` with each `auto` resolved for this host (`cores`:
    the cores this process may use). Explicit settings are returned unchanged."""
    t, g = config.trainer, config.generator
    if AUTO not in (t.cpus, g.cpus):
        return t.cpus, g.cpus
    cuda = t.device == "cuda" or (t.device == "auto" and cuda_present())
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if cuda or config.launcher.kind not in ("local", "process"):
        return ("" if t.cpus == AUTO else t.cpus), ("" if g.cpus == AUTO else g.cpus)
    if config.placement == "colocate":  # the roles take turns: each gets every core in its turn
        every = _cpu_list(cores)
        return (every if t.cpus == AUTO else t.cpus), (every if g.cpus == AUTO else g.cpus)
    # cores an explicit setting took are not handed out again
    taken = {c for spec in (t.cpus, g.cpus) if spec != AUTO for cpus in parse_cpu_lists(spec) for c in cpus}
    free = [c for c in cores if c not in taken]
    share = len(free) // 2 if t.cpus == AUTO else len(free)  # with the trainer placed, the rest
    per_replica = max(g.tp, share // g.replicas) if g.cpus == AUTO else 0
    gen_cores = free[len(free) - per_replica * g.replicas :] if per_replica else []
    train_cores = free[: len(free) - len(gen_cores)] if t.cpus == AUTO else []
    if g.cpus == AUTO:
        g_spec = "|".join(_cpu_list(gen_cores[i * per_replica : (i + 1) * per_replica]) for i in range(g.replicas))
        if len(free) < per_replica * g.replicas + (1 if t.cpus == AUTO else 0):
            g_spec = ""  # too few cores to give each role its own
    else:
        g_spec = g.cpus
    if t.cpus == AUTO:
        t_spec = _split_evenly(train_cores, t.procs) if g_spec else ""
    else:
        t_spec = t.cpus
    return t_spec, g_spec


def _split_evenly(cores: list[int], procs: int) -> str:
    """One list per proc when there are enough cores; else one list the procs share."""
    if len(cores) < procs or procs == 1:
        return _cpu_list(cores)
    per = len(cores) // procs
    return "|".join(_cpu_list(cores[i * per : (i + 1) * per]) for i in range(procs))


def _cpu_list(cores: list[int]) -> str:
    return ",".join(map(str, cores))


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


def place_light_process(config) -> None:
    """For the coordinator and rollout-worker procs, which do no heavy tensor math: one
    intra-op thread, and with the trainer pinned, its first proc's cores. Their work (env
    steps, packing, messages) then never takes the generators' cores, where decoding is the
    step's critical path, and the trainer, which waits while they work, has room for it."""
    cpus = cpus_for(config.trainer.cpus, 0)
    if cpus is not None and set(cpus) <= os.sched_getaffinity(0):
        pin_this_process(cpus)
    torch.set_num_threads(1)


def vllm_threads_bind(cpus: list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers on `cpus`: an even split, `|`-separated."""
    if len(cpus) < tp:
        raise ValueError(f"{len(cpus)} cores cannot hold {tp} tensor-parallel workers")
    per = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(tp))
