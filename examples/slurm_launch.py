"""Run meshrl on a Slurm cluster. Copy this file, edit CONFIG and OVERRIDES, then on a login node:

    python slurm_launch.py --dry-run   # print the host plan and the sbatch script; submit nothing
    python slurm_launch.py             # submit, wait for the nodes, train, release the nodes

This process is the controller: it submits one sbatch job (Monarch's SlurmJob) whose nodes
run Monarch workers, attaches to them, and runs the trainer, generator and coordinator procs
there. Keep it running for the whole run (use tmux/screen, or submit it as its own small
job). When it ends, normally, on an error, on Ctrl-C or on SIGTERM, it cancels the worker job;
only a SIGKILL leaves the job to run out its time limit: then `scancel --name meshrl_<PID>`.

The nodes need the same Python environment at the same path (a venv on a shared
filesystem) and must reach each other and this node over TCP (Monarch's port 22222).
Worker logs go to RUN_DIR/slurm/.
"""

import sys

from meshrl.config import Config
from meshrl.launch import describe_job

CONFIG = "configs/qwen3-0.6b-gpu.yaml"  # a recipe; its `launcher:` section can hold the settings below
OVERRIDES = [
    "launcher.kind=slurm",
    "launcher.hosts=2",  # split: trainer.procs / gpus_per_host trainer nodes, the rest run generators
    "launcher.gpus_per_host=8",
    "launcher.partition=gpu",  # your cluster's partition; null for its default
    # "launcher.account=my_account",
    "launcher.time_limit='24:00:00'",  # quoted: YAML reads bare 24:00:00 as the integer 86400
    "launcher.start_timeout_s=3600",  # give up (and cancel) if the job queues longer than this
    "logging.run_dir=runs/qwen3-0.6b",
]


def main() -> None:
    config = Config.from_yaml(CONFIG, OVERRIDES)
    if "--dry-run" in sys.argv[1:]:
        print(describe_job(config), end="")
        return
    from meshrl.api import run

    result = run(config)
    print(f"run finished: {result.run_dir}")


if __name__ == "__main__":  # meshrl's engines start workers with spawn: keep the guard
    main()
