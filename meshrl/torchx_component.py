"""TorchX component: run `meshrl run CONFIG [overrides]` as a TorchX job.

    torchx run --scheduler local_cwd meshrl/torchx_component.py:train --config configs/default.yaml
    torchx run --scheduler slurm --dryrun meshrl/torchx_component.py:train --config configs/default.yaml trainer.lr=1e-4
    torchx run --scheduler slurm -cfg partition=gpu,time=60 meshrl/torchx_component.py:train --config my.yaml

The job is one host running the meshrl controller with `launcher.kind=torchx`, which puts
every role's procs on that host (meshrl.launch). Its resources come from the config: GPUs
= `launcher.gpus_per_host` (0, the default, asks for none: the job then trains on CPU, and
`trainer.device=cuda` is refused at submit time). On Slurm it is a real sbatch job (tests/test_slurm.py submits
one to a two-node cluster and trains in it).

Why one host: a run over several hosts needs a Monarch worker on each host and a
controller that knows every worker's address and Monarch service identity. Monarch 0.7.0
hands those over only in the job it submits itself (`SlurmJob`: its own sbatch script
exports the identities, and the controller, outside the job, reads the hosts from
`squeue`). TorchX's Slurm scheduler writes a different script (one heterogeneous srun
group per role, the same entrypoint in every replica, `--kill-on-bad-exit`, its own
requeue), and Monarch ships no TorchX component or bootstrap that turns a TorchX job's
replicas into a host mesh. Multi-host runs use `launcher.kind=slurm` from a login node.
"""

from typing import Optional

import torchx
import torchx.specs as specs

from meshrl.config import Config, apply_overrides, load_yaml
from meshrl.preflight import check


def train(
    *overrides: str,
    config: str = "configs/default.yaml",
    image: str = torchx.IMAGE,
    cpu: int = 16,
    memMB: int = 65536,
    h: Optional[str] = None,  # TorchX's component linter reads Optional[...], not `X | None`
    python: str = "python",
    max_retries: int = 0,
) -> specs.AppDef:
    """Train with meshrl: one host running `python -m meshrl run CONFIG [overrides]`.

    Args:
        overrides: config overrides, section.field=value
        config: the run's YAML config, relative to the job's working directory
        image: image or working directory (ignored by the local_cwd and slurm schedulers)
        cpu: CPUs for the host
        memMB: host memory in MB
        h: a registered TorchX named resource (takes precedence over cpu, memMB and the config's GPUs)
        python: the Python interpreter on the host
        max_retries: scheduler retries on failure; each continues from the run's last checkpoint
    """
    # what the job runs (its launcher.kind=torchx last), checked at submit time, not on the cluster
    resolved = Config.from_dict(apply_overrides(load_yaml(config), [*overrides, "launcher.kind=torchx"]))
    check(resolved)
    if resolved.launcher.hosts != 1:
        raise ValueError(
            f"launcher.hosts={resolved.launcher.hosts}: a TorchX job runs meshrl on one host (Monarch 0.7.0 turns only its own SlurmJob's "
            "hosts into a host mesh, not a TorchX job's replicas); use launcher.kind=slurm for several"
        )
    if h is None and resolved.launcher.gpus_per_host == 0 and resolved.trainer.device == "cuda":  # (0 asks the scheduler for no GPU)
        raise ValueError(
            "trainer.device=cuda with launcher.gpus_per_host=0: the job would ask the scheduler for no GPU; "
            "set launcher.gpus_per_host to the GPUs its host needs, or pass a named resource (-h)"
        )
    return specs.AppDef(
        name="meshrl",
        roles=[
            specs.Role(
                name="meshrl",
                image=image,
                entrypoint=python,
                # the last override wins: inside the job, meshes go on the job's own host; a
                # retry (max_retries) or a requeue of this job (its app id: TorchX's Slurm jobs are
                # requeued on a node's failure or a preemption whatever max_retries says) continues
                # from the run's checkpoint, not step 0
                args=["-m", "meshrl", "run", config, *overrides, "launcher.kind=torchx", "--auto-resume", specs.macros.app_id],
                num_replicas=1,
                resource=specs.resource(cpu=cpu, gpu=resolved.launcher.gpus_per_host, memMB=memMB, h=h),
                max_retries=max_retries,
            )
        ],
    )
