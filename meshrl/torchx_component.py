"""TorchX component: run `meshrl run CONFIG [overrides]` as a TorchX job.

    torchx run --scheduler local_cwd meshrl/torchx_component.py:train --config configs/default.yaml
    torchx run --scheduler slurm --dryrun meshrl/torchx_component.py:train --config configs/default.yaml trainer.lr=1e-4
    torchx run --scheduler slurm -cfg partition=gpu,time=60 meshrl/torchx_component.py:train --config my.yaml

The job is one host running the meshrl controller with `launcher.kind=torchx`, which puts
every role's procs on that host (meshrl.launch). Its resources come from the config: GPUs
= `launcher.gpus_per_host`. Multi-host runs use `launcher.kind=slurm` (Monarch's SlurmJob)
instead: a TorchX job does not tell the controller where its other hosts' Monarch workers
listen. (Monarch 0.7.0 ships no TorchX component of its own.)
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
        max_retries: scheduler retries on failure
    """
    resolved = Config.from_dict(apply_overrides(load_yaml(config), list(overrides)))
    check(resolved)  # fail at submit time, not on the cluster
    if resolved.launcher.hosts != 1:
        raise ValueError(f"launcher.hosts={resolved.launcher.hosts}: a TorchX job runs meshrl on one host; use launcher.kind=slurm for several")
    return specs.AppDef(
        name="meshrl",
        roles=[
            specs.Role(
                name="meshrl",
                image=image,
                entrypoint=python,
                # the last override wins: inside the job, meshes go on the job's own host
                args=["-m", "meshrl", "run", config, *overrides, "launcher.kind=torchx"],
                num_replicas=1,
                resource=specs.resource(cpu=cpu, gpu=resolved.launcher.gpus_per_host, memMB=memMB, h=h),
                max_retries=max_retries,
            )
        ],
    )
