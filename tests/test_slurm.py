"""meshrl on a real Slurm cluster: two nodes in network namespaces (tests/conftest.py's
`slurm_cluster`: munged, slurmctld, one slurmd per node, a slurm.conf of the run's own).

The controller (`meshrl run ... launcher.kind=slurm`) runs on node a, as on a login node
that is also in the cluster: it submits through Monarch's SlurmJob, attaches to the
allocation's workers and trains across both nodes; every test that submits checks that
the allocation is released (squeue empty) and that no process is left on either node.
The cluster's tests are skipped, with the reason, where it cannot be made (not root, Slurm
not installed: `bash scripts/setup-slurm.sh`).
"""

import json
import os
import signal
import sys
import time

import pytest
import yaml

from meshrl.controller.checkpoint import saved_models
from tests.conftest import REWARD_GATE_ENV, rewards_held, trainer_pid, two_host_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

RUN_TIMEOUT_S = 600.0
DAEMONS = ("munged", "slurmctld", "slurmd", ": slurmscriptd")  # slurmscriptd names itself ": slurmscriptd"


def slurm_config(run_dir, **sections) -> dict:
    launcher = {"kind": "slurm", "hosts": 2, "time_limit": "00:30:00", "start_timeout_s": 300}
    return two_host_config(run_dir, 300, {"steps": 10, "launcher": launcher}, **sections)


def start_controller(cluster, tmp_path, name: str, args: list[str], env: dict | None = None):
    """`meshrl run ARGS` on node a, with this checkout on PYTHONPATH and `env` added (the
    job's workers get the controller's environment, as sbatch exports it)."""
    env = {**cluster.env, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return cluster.hosts.run("a", [sys.executable, "-m", "meshrl", "run", *args], tmp_path / f"{name}.log", env=env)


def write_config(tmp_path, name: str, cfg: dict) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def wait_exit(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except Exception:
        proc.kill()
        pytest.fail(f"the controller did not end within {timeout:.0f}s")


def rows_of(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def leftovers(cluster, timeout: float = 60) -> dict[str, list[str]]:
    """Jobs squeue still lists and processes other than the cluster's daemons on each node,
    once they have had `timeout` to go."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = cluster.jobs()
        procs = {h: cluster.processes(h, exclude=DAEMONS) for h in ("a", "b")}
        if (not jobs and not any(procs.values())) or time.monotonic() > deadline:
            return {"jobs": jobs, **procs}
        time.sleep(0.5)


def job_ids(cluster) -> list[str]:
    return [line.split()[0] for line in cluster.jobs()]


def wait_rows(run_dir, controller, n: int, timeout: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while controller.poll() is None and time.monotonic() < deadline and len(rows_of(run_dir)) < n:
        time.sleep(0.2)
    assert controller.poll() is None and len(rows_of(run_dir)) >= n, f"the run ended or stalled before step {n}"


def test_two_nodes_train_and_resubmit_after_slurms_sigterm(slurm_cluster, tmp_path):
    """`meshrl run ... launcher.kind=slurm launcher.hosts=2` on node a: sbatch, attach, the
    trainer on node a and the generators on node b, weights crossing every step. Then
    `scancel --signal=TERM` mid-run (what the `--signal` warning before the time limit and
    preemption send): the run finishes its step, checkpoints, releases the allocation and,
    with launcher.max_resubmits, submits a fresh one that continues to the last step with
    the same step numbering. In that second allocation the trainer's proc on node a is
    SIGKILLed: the run heals it through the job's Monarch worker (docs/healing.md) and
    finishes; a metric row comes twice only for a step the heal lost."""
    run_dir = tmp_path / "run"
    # Slurm's SIGTERM reaches the run some steps after scancel (five on a fast machine): 24
    # steps leave the second allocation steps to go. Its rewards are then held (the gate file)
    # from its first row until the trainer is killed, so the kill lands mid-run however fast
    # the steps are (without it a run stopped at step 8 of 10 had finished before the kill);
    # the batches scored before the gate (up to 3) still train.
    steps = 24
    gate = tmp_path / "gate"
    cfg = slurm_config(run_dir, steps=steps, launcher={"max_resubmits": 1}, scoring={"reward_fn": "tests.conftest:gated_digits_reward"})
    t0 = time.monotonic()
    controller = start_controller(slurm_cluster, tmp_path, "preempt", [write_config(tmp_path, "preempt", cfg)], env={REWARD_GATE_ENV: str(gate)})
    wait_rows(run_dir, controller, 3)
    # node b runs the slurm_worker task, Monarch's worker and the procs spawned there (generator, episode queue)
    on_b = [p for p in slurm_cluster.processes("b", exclude=DAEMONS + ("slurmstepd",)) if "python" in p]
    assert len(on_b) >= 4, on_b
    (first_job,) = job_ids(slurm_cluster)
    slurm_cluster.cmd("scancel", "--signal=TERM", first_job)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while "meshrl: resubmitting" not in (tmp_path / "preempt.log").read_text() and controller.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    stopped_at = len(rows_of(run_dir))
    assert stopped_at + 5 < steps, f"Slurm's SIGTERM stopped the run at step {stopped_at} of {steps}: too late to kill its trainer mid-run"
    wait_rows(run_dir, controller, stopped_at + 1)  # a step into the second allocation
    with rewards_held(gate):
        victim = trainer_pid(slurm_cluster.hosts.pids("a"), "slurm_worker")
        assert victim is not None, slurm_cluster.processes("a", exclude=DAEMONS)
        assert len(rows_of(run_dir)) < steps, "the run ended before its trainer could be killed"
        os.kill(victim, signal.SIGKILL)
    rc = wait_exit(controller, RUN_TIMEOUT_S)
    log = (tmp_path / "preempt.log").read_text()
    assert rc == 0, log[-4000:] + slurm_cluster.logs()
    stopped = [line for line in log.splitlines() if line.startswith("meshrl: stopped at step")]
    assert len(stopped) == 1 and "by Slurm's SIGTERM to the allocation: checkpoint at step" in stopped[0], log[-3000:]
    assert "meshrl: resubmitting (1 of launcher.max_resubmits=1)" in log
    healed = [line for line in log.splitlines() if line.startswith("meshrl: trainer rank 0") and f"(pid {victim}) died" in line]
    assert len(healed) == 1 and "healed in" in healed[0], log[-3000:]
    rows = rows_of(run_dir)
    kept = {r["step"]: r for r in rows}  # a step the heal lost is cut from the file and written again, once
    assert sorted(kept) == list(range(1, steps + 1)) and len(rows) == len(kept), [r["step"] for r in rows]
    assert sum(r.get("trainer/steps_lost", 0) for r in rows) <= 1, [r["step"] for r in rows]
    assert kept[steps]["trainer/restarts"] == 1
    versions = [r["generator/version"] for r in rows if "generator/version" in r]
    assert versions == sorted(versions) and versions[-1] >= 5, versions  # node b's generators got every new version
    jobs = sorted(f.split("_")[1] for f in os.listdir(run_dir / "slurm") if f.endswith(".out"))
    assert len(jobs) == 2 and first_job in jobs, jobs  # a second allocation finished the run
    # Slurm's SIGTERM did not stop the first allocation's vLLM engine (its own handler did that,
    # aborting its requests, before compat.vllm_engine_holds_sigterm): the engine core's only
    # SIGTERM is the one vLLM's shutdown sent when meshrl stopped it, after its requests ended
    first = "".join(open(run_dir / "slurm" / f).read() for f in os.listdir(run_dir / "slurm") if f.startswith(f"slurm_{first_job}_"))
    assert "(EngineCore pid=" in first, first[-3000:]  # the engine core's own lines are here
    stopped_by = first.count("EngineCore: trigger received signal=SIGTERM")
    assert stopped_by <= first.count("Process manager: send sigterm to process EngineCore"), first[-3000:]
    assert "aborting in-flight requests" not in first, first[-3000:]
    assert leftovers(slurm_cluster) == {"jobs": [], "a": [], "b": []}
    print(f"Slurm SIGTERM at step {stopped[0].split()[4]}, resubmitted, trainer healed ({healed[0]}), finished: {time.monotonic() - t0:.0f} s")


def meshrl_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("meshrl:")]


def test_no_slurm_on_path_is_one_line(tmp_path):
    """Where Slurm's commands are missing, launcher.kind=slurm says so in one line, exit 2."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "meshrl", "run", "launcher.kind=slurm", "launcher.hosts=2", f"logging.run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrl: config error: launcher.kind: slurm needs Slurm's commands on PATH"), out.stderr


def test_unknown_partition_is_one_line(slurm_cluster, tmp_path):
    controller = start_controller(
        slurm_cluster, tmp_path, "nopart", ["launcher.kind=slurm", "launcher.hosts=2", "launcher.partition=gpu", f"logging.run_dir={tmp_path / 'run'}"]
    )
    assert wait_exit(controller, 120) == 2
    lines = meshrl_lines((tmp_path / "nopart.log").read_text())
    assert lines == [
        f"meshrl: config error: launcher.partition: no partition 'gpu' on this cluster: give one of "
        f"{slurm_cluster.PARTITION}, {slurm_cluster.CLOSED_PARTITION}, or null for the default"
    ], lines
    assert slurm_cluster.jobs() == []


def test_a_job_that_never_starts_is_cancelled(slurm_cluster, tmp_path):
    """A partition whose nodes never come (here: one that is down): after
    launcher.start_timeout_s the job is cancelled, not left queued, and the run fails in one line."""
    cfg = slurm_config(tmp_path / "run", launcher={"partition": slurm_cluster.CLOSED_PARTITION, "start_timeout_s": 8})
    t0 = time.monotonic()
    controller = start_controller(slurm_cluster, tmp_path, "never", [write_config(tmp_path, "never", cfg)])
    rc = wait_exit(controller, 180)
    waited = time.monotonic() - t0
    log = (tmp_path / "never.log").read_text()
    assert rc == 1, log[-3000:]
    failed = [line for line in meshrl_lines(log) if "run failed" in line]
    assert len(failed) == 1 and "did not start within launcher.start_timeout_s=8 s, pending: PartitionDown; it was cancelled" in failed[0], log[-3000:]
    assert leftovers(slurm_cluster, timeout=20) == {"jobs": [], "a": [], "b": []}
    print(f"never-starting job cancelled; the run ended {waited:.0f} s after it started")


def test_torchx_job_trains_on_slurm(slurm_cluster, tmp_path):
    """`torchx run -s slurm meshrl/torchx_component.py:train`: a real sbatch job that trains
    on one node (launcher.kind=torchx inside it); the component refuses several hosts."""
    import subprocess

    run_dir = tmp_path / "run"
    cfg = slurm_config(run_dir, steps=4)
    cfg.pop("launcher")
    config = write_config(tmp_path, "torchx", cfg)
    component = os.path.join(os.getcwd(), "meshrl", "torchx_component.py")
    env = {**os.environ, **slurm_cluster.env, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    cmd = [
        sys.executable,
        "-m",
        "torchx.cli.main",
        "run",
        "-s",
        "slurm",
        "-cfg",
        f"partition={slurm_cluster.PARTITION}",
        f"{component}:train",
        "--config",
        config,
        "--cpu",
        "2",
        "--python",
        sys.executable,
    ]
    out = subprocess.run(slurm_cluster.command("a", cmd), capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert "Launched app: slurm://torchx/" in out.stderr, out.stdout + out.stderr
    # After submitting, `torchx run` asks the job's status from sacct, which needs Slurm's
    # accounting (slurmdbd); this cluster has none, so that last call fails, and only it.
    assert out.returncode == 0 or "Command '['sacct', '--parsable2'" in out.stderr, out.stdout + out.stderr
    t0 = time.monotonic()
    assert leftovers(slurm_cluster, timeout=RUN_TIMEOUT_S)["jobs"] == [], "the TorchX job did not end"
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("slurm-*.err"))
    assert [r["step"] for r in rows_of(run_dir)] == [1, 2, 3, 4], logs
    assert leftovers(slurm_cluster) == {"jobs": [], "a": [], "b": []}
    print(f"TorchX job on Slurm: {time.monotonic() - t0:.0f} s after submission")


def test_a_lost_node_stops_the_run_resumably(slurm_cluster, tmp_path):
    """Two co-evolving models (configs/coevolve.yaml's proposer and solver), each training
    LoRA adapters, across the two nodes: both trainers on node a, both models' engines on
    node b, each model's adapters crossing every step. Node b (generators, episode queue, rollout workers) dies mid-run,
    slurmd and all: the run stops with one line naming `meshrl run --resume RUN_DIR`, a
    checkpoint of both models is there, and once the node is back nothing of the job is
    left. (Last in this module: it takes a node down.)"""
    run_dir = tmp_path / "run"
    # launcher.host_timeout_s 15: the nodes are network namespaces of this machine (see test_multihost.py)
    cfg = slurm_config(
        run_dir,
        steps=10,
        batch_groups=4,
        data={"source": "task:propose"},
        generator={"group_size": 4, "update_mode": "block"},
        buffer={"depth": 0, "max_lag": 0},  # synchronous: every token sampled by the adapters its step trains
        lora={"rank": 8},
        models=[{"name": "proposer", "trainer": {"lr": 0.005}}],
        trainer={"checkpoint_every": 2, "interrupt_checkpoint_timeout_s": 30},
        launcher={"host_timeout_s": 15},
    )
    controller = start_controller(slurm_cluster, tmp_path, "lost", [write_config(tmp_path, "lost", cfg)])
    wait_rows(run_dir, controller, 5)
    slurm_cluster.hosts.kill("b")
    t0 = time.monotonic()
    rc = wait_exit(controller, RUN_TIMEOUT_S)
    stopped_s = time.monotonic() - t0
    log = (tmp_path / "lost.log").read_text()
    assert rc != 0, log[-3000:]
    resumable = [line for line in meshrl_lines(log) if f"meshrl run --resume {run_dir}" in line]
    assert len(resumable) == 1, log[-3000:]
    assert os.path.isfile(run_dir / "checkpoints" / "latest")
    rows = rows_of(run_dir)
    done = len(rows)
    assert 5 <= done < 10
    assert all(r["proposer/trainer/tokens"] > 0 for r in rows), rows  # the proposer trained on its own rows every step
    # each model's engine on node b sampled with the adapters its trainer on node a had just trained
    # (non-zero from step 2: LoRA's B starts at 0): the trainer's log-probs are the sampler's
    for key in ("trainer/logprob_mismatch", "proposer/trainer/logprob_mismatch"):
        assert all(r[key] < 1e-3 for r in rows), [r[key] for r in rows]
    assert os.path.isdir(run_dir / "models" / "proposer" / "hf" / "base")  # the proposer's frozen base, its own
    models = saved_models(str(run_dir))  # the latest checkpoint's models beside the policy
    assert set(models) == {"proposer"} and os.path.isdir(models["proposer"][0]) and models["proposer"][1] is None, models
    slurm_cluster.restart_node("b")
    assert leftovers(slurm_cluster) == {"jobs": [], "a": [], "b": []}
    print(f"node b lost at step {done}: the run stopped {stopped_s:.0f} s later: {resumable[0]}")
