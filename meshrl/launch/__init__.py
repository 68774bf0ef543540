"""Host meshes for a run: where the trainer, generator and coordinator procs live.

The loop asks for one host mesh per role and spawns its proc meshes on it:

    async with allocate(config) as alloc:
        trainer_procs = alloc.spawn_procs("trainer", config.trainer.procs)
        ...

`config.launcher.kind` picks where the hosts come from:

- `local`: this machine (`this_host()`) for every role.
- `process`: `launcher.hosts` local worker processes, each standing in for one Slurm host
  (Monarch's `ProcessJob`). Same host plan and code path as `slurm`, runnable anywhere.
- `slurm`: one sbatch allocation of `launcher.hosts` nodes through Monarch's `SlurmJob`;
  this process is the controller (run it on a login node) and attaches to the workers.
  Slurm's SIGTERM to the job (time-limit warning, preemption, scancel) reaches it through
  the nodes (`slurm_worker.py`), and it checkpoints, stops, and may resubmit itself.
- `torchx`: this process already runs inside a job launched from
  `meshrl/torchx_component.py:train`, which asks for one host; meshes use that host.
- `workers`: hosts already running `meshrl worker --address IP:PORT` (`run_worker`), listed
  in `launcher.workers`. This process attaches to them over Monarch's TCP transport, as
  Monarch attaches to a Slurm allocation's workers, and listens on `launcher.address` only.
  Each worker's procs bind what they serve to their host's address (`host_address()`).

Host plan (`plan_hosts`): one host holds every role. With more hosts, the trainer and the
generators get disjoint hosts (trainer hosts = ceil(trainer.procs / gpus_per_host) when
hosts have GPUs, else a share proportional to procs), and the coordinator (the episode
queue's proc and the rollout workers, which host the envs) shares the first generator
host rather than taking a whole node: the rollout workers ask the generators for every
model turn, and only finished groups travel on to the trainer.

Procs on attached hosts outlive a controller that exits or crashes, so `Allocation.stop()`
stops every proc mesh spawned through it, shuts the host meshes down and kills the job, on
every exit path of `async with`; an atexit hook and a SIGTERM handler back it up.

The package, a module per path: `hosts.py` (the host plan, pure), `allocation.py` (the
`Allocation` every run goes through: local, process, torchx), `slurm.py` (Monarch's
SlurmJob, the SIGTERM relay's controller side), `slurm_worker.py` (each Slurm node's task),
`workers.py` (`meshrl worker` hosts), `signals.py` (SIGTERM as SystemExit), `devices.py` (the
device plan: which GPUs every proc holds, pure).
"""

import importlib

_WHERE = {
    "Allocation": "allocation",
    "allocate": "allocation",
    "describe_job": "allocation",
    "with_env": "allocation",
    "ROLES": "hosts",
    "plan_hosts": "hosts",
    "DevicePlan": "devices",
    "plan_devices": "devices",
    "exit_on_sigterm": "signals",
    "render_sbatch": "slurm",
    "run_worker": "workers",
}
"""Each public name and its module, imported on first use: `meshrl.launch.hosts` (the pure
host plan) must not start Monarch, which the allocation imports."""

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'meshrl.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"meshrl.launch.{_WHERE[name]}"), name)
