"""Run meshrl on a Slurm cluster. Copy config.yaml beside this file, edit its `launcher:`
section (partition, account, time limit), then on a login node:

    python examples/slurm/launch.py --dry-run                          # the host plan and the sbatch script; submit nothing
    python examples/slurm/launch.py model.path=/data/Qwen3-0.6B        # submit, wait for the nodes, train, release them
    python examples/slurm/launch.py other.yaml section.field=value     # another config, more overrides

This process is the controller: it submits one sbatch job (Monarch's SlurmJob) whose nodes
run Monarch workers, attaches to them, and runs the trainer, generator and coordinator procs
there. Keep it running for the whole run (use tmux/screen, or submit it as its own small
job). When it ends, normally, on an error, on Ctrl-C or on SIGTERM, it cancels the worker job;
only a SIGKILL leaves the job to run out its time limit: then `scancel --name meshrl_<PID>`.

The nodes need the same Python environment at the same path (a venv on a shared
filesystem) and must reach each other and this node over TCP (Monarch's port 22222).
Worker logs go to RUN_DIR/slurm/.
"""

import os
import sys

from meshrl.config import Config
from meshrl.launch import describe_job

# launcher.kind=slurm, hosts, gpus_per_host, partition, time_limit, resubmits: in the config.
# Trainer nodes = trainer.procs / gpus_per_host, rounded up; the other nodes run generators.
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--dry-run"]
    paths = [a for a in args if "=" not in a]
    config = Config.from_yaml(paths[0] if paths else CONFIG, [a for a in args if "=" in a])
    if "--dry-run" in sys.argv[1:]:
        print(describe_job(config), end="")
        return
    from meshrl.api import run

    result = run(config)
    print(f"run finished: {result.run_dir}")


if __name__ == "__main__":  # meshrl's engines start workers with spawn: keep the guard
    main()
