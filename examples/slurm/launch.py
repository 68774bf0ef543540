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

from meshrl.cli import main

# launcher.kind=slurm, hosts, gpus_per_host, partition, time_limit, resubmits: in the config.
# Trainer nodes = trainer.procs / gpus_per_host, rounded up; the other nodes run generators.
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml")


def launch(argv: list[str]) -> int:
    """`meshrl run CONFIG OVERRIDES...`: the command, not `meshrl.run()`, so that a Slurm
    signal's checkpoint is followed by a fresh job (`launcher.max_resubmits`: the command
    replaces its own process by the resumed run) and its exit status is the command's."""
    args = [a for a in argv if a != "--dry-run"]
    paths = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a] + (["launcher.dry_run=true"] if "--dry-run" in argv else [])
    return main(["run", paths[0] if paths else CONFIG, *overrides])


if __name__ == "__main__":  # meshrl's engines start workers with spawn: keep the guard
    sys.exit(launch(sys.argv[1:]))
