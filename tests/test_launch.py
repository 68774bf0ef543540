"""The launcher: host plans, ProcessJob hosts end to end, Slurm and TorchX dry runs, cleanup."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from monarch.actor import Actor, endpoint

from meshrl.config import Config, ConfigError
from meshrl.launch import allocate, describe_job, plan_hosts, render_sbatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Whoami(Actor):
    @endpoint
    def whoami(self, role: str) -> tuple[int, int, str]:
        return os.getpid(), os.getppid(), role


def _config(tmp_path, **launcher) -> Config:
    return Config.from_dict({"launcher": launcher, "trainer": {"procs": 2}, "logging": {"run_dir": str(tmp_path / "run")}})


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """The pids still running (not zombies) after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone, also between a look and the next
        return False


# ---- the host plan -------------------------------------------------------------------------
def test_meshrl_worker_says_what_its_address_must_be(capsys):
    """`meshrl worker --address` with no port, a port that is no number, a wildcard or a port
    out of range: one line saying what to give, exit status 2 (it printed int()'s and
    ipaddress' own words: "invalid literal for int() with base 10: 'abc'")."""
    from meshrl import cli

    for address, said in (
        ("127.0.0.1", "is not IP:PORT: give this host's own address and a port"),
        ("127.0.0.1:abc", "is not IP:PORT"),
        ("host.example:26600", "is not IP:PORT"),
        ("0.0.0.0:26600", "refusing the wildcard address"),
        ("127.0.0.1:70000", "port 70000 is out of range"),
    ):
        assert cli.main(["worker", "--address", address]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (address, err)


def test_a_worker_address_must_be_what_gloo_binds_on_its_interface(monkeypatch):
    """`meshrl worker --address IP` gives gloo IP's interface, and gloo binds that interface's
    first address: a second address on it left gloo's groups on the first one (a public one,
    say). Such an address is refused, naming the one gloo would bind."""
    import socket
    from types import SimpleNamespace

    from meshrl.host import interface_of

    addrs = {"lo": [SimpleNamespace(family=socket.AF_INET, address="127.0.0.1")]}
    addrs["eth0"] = [
        SimpleNamespace(family=socket.AF_PACKET, address="aa:bb"),
        *(SimpleNamespace(family=socket.AF_INET, address=a) for a in ("10.1.1.1", "10.2.2.2")),
    ]
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: addrs)
    assert interface_of("10.1.1.1", first=True) == "eth0" and interface_of("10.2.2.2") == "eth0"
    with pytest.raises(ValueError, match="10.2.2.2 is not the first address of interface eth0: gloo binds that one \\(10.1.1.1\\)"):
        interface_of("10.2.2.2", first=True)


def test_plan_hosts_splits_roles(tmp_path):
    assert plan_hosts(_config(tmp_path, kind="process", hosts=1)) == {"hosts": 1}
    # CPU hosts: in proportion to procs (2 trainer, 1 generator)
    assert plan_hosts(_config(tmp_path, kind="process", hosts=3)) == {"trainer": 2, "generator": 1}
    gpu = Config.from_dict(
        {
            "model": {"n_heads": 4, "dim": 128},
            "trainer": {"procs": 16},
            "generator": {"replicas": 4, "tp": 4},
            "launcher": {"kind": "slurm", "hosts": 4, "gpus_per_host": 8},
        }
    )
    assert plan_hosts(gpu) == {"trainer": 2, "generator": 2}
    too_few = Config.from_dict({"trainer": {"procs": 16}, "launcher": {"kind": "slurm", "hosts": 2, "gpus_per_host": 8}})
    with pytest.raises(ConfigError, match="launcher.hosts"):
        plan_hosts(too_few)
    uneven = Config.from_dict({"trainer": {"procs": 3}, "generator": {"replicas": 2}, "launcher": {"kind": "process", "hosts": 3}})
    with pytest.raises(ConfigError, match="trainer.procs"):
        plan_hosts(uneven)
    # a cluster recipe's hosts with launcher.kind=local: every role is on this machine, and two would share a GPU
    with pytest.raises(ConfigError, match="launcher.kind=local runs every role on this machine") as info:
        Config.from_dict({"launcher": {"kind": "local", "hosts": 2, "gpus_per_host": 8}})
    assert info.value.field_path == "launcher.hosts"


def test_spare_hosts_join_the_job_and_must_hold_the_whole_trainer(tmp_path):
    """launcher.spare_hosts: an idle mesh the job holds beside the plan's, as many hosts as
    the trainer's (it moves whole); refused in one line where it cannot serve."""
    from meshrl.launch.hosts import job_meshes

    assert job_meshes(_config(tmp_path, kind="process", hosts=3, spare_hosts=2)) == {"trainer": 2, "generator": 1, "spare": 2}
    assert job_meshes(_config(tmp_path, kind="process", hosts=3)) == plan_hosts(_config(tmp_path, kind="process", hosts=3))
    assert "spare=2" in describe_job(_config(tmp_path, kind="slurm", hosts=3, spare_hosts=2))
    assert "coord on the first generator host" in describe_job(_config(tmp_path, kind="slurm", hosts=3))  # role_meshes puts it there
    assert "#SBATCH --nodes=5" in render_sbatch(_config(tmp_path, kind="slurm", hosts=3, spare_hosts=2))
    with pytest.raises(ConfigError, match="launcher.spare_hosts.*set it to 2"):
        job_meshes(_config(tmp_path, kind="process", hosts=3, spare_hosts=1))
    with pytest.raises(ConfigError, match="launcher.spare_hosts.*episode queue"):  # the plan refuses it: preflight's device plan too
        plan_hosts(_config(tmp_path, kind="process", hosts=1, spare_hosts=1))
    with pytest.raises(ConfigError, match="launcher.spare_hosts.*no hosts to spare"):
        _config(tmp_path, kind="local", spare_hosts=1)
    with pytest.raises(ConfigError, match="launcher.spare_hosts.*at least 0"):
        _config(tmp_path, kind="process", spare_hosts=-1)
    workers = dict(kind="workers", address="127.0.0.1", workers=["127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"], spare_hosts=1)
    assert job_meshes(_config(tmp_path, **workers)) == {"trainer": 1, "generator": 1, "spare": 1}  # the last worker listed is the spare


# ---- ProcessJob hosts: the Slurm code path on this machine ---------------------------------
@pytest.mark.slow  # ProcessJob hosts and a proc mesh per role
@pytest.mark.timeout(120)
def test_process_hosts_run_each_role_and_stop(tmp_path):
    config = _config(tmp_path, kind="process", hosts=3)

    async def main():
        async with allocate(config) as alloc:
            workers = {name: state.pid for name, state in alloc._job._host_to_pid.items()}
            assert sorted(workers) == ["generator_0", "trainer_0", "trainer_1"]
            assert [alloc.hosts(r) for r in ("trainer", "generator", "coord")] == [2, 1, 1]
            seen = {}
            for role, n in (("trainer", 2), ("generator", 1), ("coord", 1)):
                procs = alloc.spawn_procs(role, n)
                answers = await asyncio.wait_for(procs.spawn("whoami", Whoami).whoami.call(role), 60)
                seen[role] = [value for _, value in answers.items()]
        return workers, seen

    workers, seen = asyncio.run(main())
    rows = [row for rows in seen.values() for row in rows]
    assert [role for _, _, role in rows] == ["trainer", "trainer", "generator", "coord"]
    pids = [pid for pid, _, _ in rows]
    assert len(set(pids)) == 4 and os.getpid() not in pids  # four distinct procs, none of them us
    # each proc runs under the worker ("host") its role was given
    assert {ppid for _, ppid, _ in seen["trainer"]} == {workers["trainer_0"], workers["trainer_1"]}
    assert seen["generator"][0][1] == workers["generator_0"]
    assert seen["coord"][0][1] == workers["generator_0"]  # the coordinator shares the first generator host
    assert _wait_gone(pids + list(workers.values())) == []


@pytest.mark.timeout(120)
def test_process_hosts_are_killed_when_the_body_raises(tmp_path):
    config = _config(tmp_path, kind="process", hosts=2)
    pids: list[int] = []

    async def main():
        async with allocate(config) as alloc:
            pids.extend(s.pid for s in alloc._job._host_to_pid.values())
            procs = alloc.spawn_procs("trainer", 2)
            answers = await asyncio.wait_for(procs.spawn("whoami", Whoami).whoami.call("trainer"), 60)
            pids.extend(pid for _, (pid, _, _) in answers.items())
            raise RuntimeError("the loop failed")

    with pytest.raises(RuntimeError, match="the loop failed"):
        asyncio.run(main())
    assert len(pids) == 4
    assert _wait_gone(pids) == []


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from meshrl.config import Config
    from meshrl.launch import allocate

    async def main():
        config = Config.from_dict({"launcher": {"kind": "process", "hosts": 2}, "logging": {"run_dir": sys.argv[1]}})
        async with allocate(config) as alloc:
            print(" ".join(str(s.pid) for s in alloc._job._host_to_pid.values()), flush=True)
            await asyncio.sleep(120)  # until the scheduler's SIGTERM

    if __name__ == "__main__":
        asyncio.run(main())
    """
)


@pytest.mark.timeout(120)
def test_sigterm_to_the_controller_kills_its_hosts(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(SIGTERM_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        workers = [int(p) for p in line.split()]
        assert len(workers) == 2 and all(psutil.pid_exists(p) for p in workers)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert _wait_gone(workers) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


ENGINE_UNDER_SLURM = """
import os, signal, sys, threading, time
from meshrl.compat import vllm_engine_holds_sigterm
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as slurm_worker starts every proc of the job


def vllm_handler(signum, frame):  # what vLLM's engine core installs over it: shut down
    print("engine shut down", flush=True)
    sys.exit(3)


signal.signal(signal.SIGTERM, vllm_handler)
holder, off_main = type("Worker", (), {})(), []
thread = threading.Thread(target=lambda: off_main.append(vllm_engine_holds_sigterm(holder, True)))
thread.start()
thread.join(10)
print("off the main thread:", off_main, flush=True)
assert vllm_engine_holds_sigterm(holder, True)
os.kill(os.getpid(), signal.SIGTERM)  # Slurm's warning
time.sleep(0.2)
print("engine alive", flush=True)
assert vllm_engine_holds_sigterm(holder, False)  # before meshrl shuts it down
os.kill(os.getpid(), signal.SIGTERM)  # vLLM's own shutdown
time.sleep(2)
print("not reached", flush=True)
"""


def test_an_engine_under_slurm_outlives_the_warning_sigterm_and_still_stops_on_its_own():
    """compat.vllm_engine_holds_sigterm in a process shaped like vLLM's engine core under
    slurm_worker: SIGTERM ignored from the start, then vLLM's handler over it. Held, Slurm's
    SIGTERM leaves it running; released, vLLM's handler is back for its shutdown; off the
    main thread nothing can be set and it says so."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ENGINE_UNDER_SLURM], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["off the main thread: [False]", "engine alive", "engine shut down"], out.stdout


def test_local_gives_this_host_to_every_role(tmp_path):
    async def main():
        alloc = allocate(_config(tmp_path, kind="local"))
        with pytest.raises(RuntimeError, match="not running"):
            alloc.host_mesh("trainer")
        async with alloc:
            assert [alloc.hosts(r) for r in ("trainer", "generator", "coord")] == [1, 1, 1]
            assert alloc.host("generator", 5) is alloc.host_mesh("generator")
            with pytest.raises(KeyError):
                alloc.host_mesh("critic")

    asyncio.run(main())


# ---- Slurm dry run -------------------------------------------------------------------------
def test_slurm_dry_run_renders_monarchs_sbatch_script(tmp_path):
    import monarch.config

    transport = monarch.config.get_global_config()["default_transport"]
    config = Config.from_dict(
        {
            "trainer": {"procs": 8},
            "generator": {"replicas": 12, "tp": 2},
            "launcher": {"kind": "slurm", "hosts": 4, "gpus_per_host": 8, "partition": "gpu", "time_limit": "02:30:00", "account": "rl", "dry_run": True},
            "logging": {"run_dir": str(tmp_path / "run")},
        }
    )
    script = render_sbatch(config)
    for line in ("#SBATCH --time=02:30:00", "#SBATCH --partition=gpu", "#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --account=rl"):
        assert line in script.splitlines()
    assert "run_worker_loop_forever" in script and script.startswith("#!/bin/bash")
    # SIGTERM ahead of the time limit, relayed to the controller by each node's slurm_worker; meshrl resubmits, Slurm does not requeue
    for line in ("#SBATCH --signal=TERM@180", "#SBATCH --no-requeue"):
        assert line in script.splitlines()
    assert f"-m meshrl.launch.slurm_worker --notify {tmp_path / 'run' / 'slurm'} -c 'import os" in script
    # rendering must not switch this process's Monarch transport (SlurmJob() sets TCP)
    assert monarch.config.get_global_config()["default_transport"] == transport
    text = describe_job(config)
    assert "trainer=1, generator=3" in text and "#SBATCH --nodes=4" in text
    with pytest.raises(ConfigError, match="launcher.dry_run"):
        allocate(config)
    # a run directory the script's lines would split (#SBATCH --output=PATH): refused before anything is submitted
    from meshrl.launch.slurm import check_slurm

    spaced = Config.from_dict({"launcher": {"kind": "slurm"}, "logging": {"run_dir": str(tmp_path / "my run")}})
    with pytest.raises(ConfigError, match=r"^logging.run_dir: the job's output directory .*my run/slurm' holds a space or a quote"):
        check_slurm(spaced)


def test_the_slurm_examples_controller_is_the_command(tmp_path):
    """examples/slurm/launch.py runs `meshrl run`, not `meshrl.run()`: the command resubmits
    itself after a Slurm signal (launcher.max_resubmits, which the config sets) and exits with
    its status; --dry-run prints the host plan and Monarch's sbatch script."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "examples/slurm/launch.py", "--dry-run", "data.source=task:digits", f"logging.run_dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "#SBATCH --nodes=2" in out.stdout and "#SBATCH --no-requeue" in out.stdout, out.stderr
    out = subprocess.run([*cmd, "trainer.procs=0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("meshrl: config error: trainer.procs"), out.stderr


# ---- TorchX ----------------------------------------------------------------------------------
def test_torchx_component_renders_slurm_sbatch(tmp_path):
    cmd = [
        sys.executable, "-m", "torchx.cli.main", "run", "--dryrun", "--scheduler", "slurm", "-cfg", "partition=gpu,time=60",
        "meshrl/torchx_component.py:train", "--config", "configs/default.yaml", "trainer.lr=1e-4", "launcher.gpus_per_host=4",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m meshrl run configs/default.yaml trainer.lr=1e-4 launcher.gpus_per_host=4 launcher.kind=torchx --auto-resume" in out.stdout
    assert "--partition=gpu" in out.stdout and "--gpus-per-task=4" in out.stdout  # GPUs from the config


def test_torchx_component_refuses_several_hosts():
    from meshrl.torchx_component import train

    app = train(config=os.path.join(ROOT, "configs/default.yaml"))
    assert app.roles[0].num_replicas == 1 and app.roles[0].resource.gpu == 0
    with pytest.raises(ValueError, match="launcher.kind=slurm"):
        train("launcher.hosts=2", config=os.path.join(ROOT, "configs/default.yaml"))
    # the config the job runs is the one checked: a Slurm-only setting fails at submit, not on the cluster
    with pytest.raises(ConfigError, match="only launcher.kind=slurm") as info:
        train("launcher.kind=slurm", "launcher.max_resubmits=2", config=os.path.join(ROOT, "configs/default.yaml"))
    assert info.value.field_path == "launcher.max_resubmits"
    # a GPU trainer with no GPUs asked for: refused at submit, not queued and refused on the cluster (or trained on its CPUs)
    with pytest.raises(ValueError, match="launcher.gpus_per_host=0: the job would ask the scheduler for no GPU"):
        train("trainer.device=cuda", config=os.path.join(ROOT, "configs/default.yaml"))
    assert train("trainer.device=cuda", "launcher.gpus_per_host=2", config=os.path.join(ROOT, "configs/default.yaml")).roles[0].resource.gpu == 2


def test_a_torchx_retry_resumes_the_run_from_its_checkpoint(tmp_path, monkeypatch):
    """The job's command carries --auto-resume and its app id, with max_retries or without
    (TorchX's Slurm jobs are requeued on a node's failure or a preemption either way): a retry
    or a requeue of the job continues the config's run directory from its last checkpoint (it
    started again from step 0, the first attempt's run moved aside); its first attempt starts
    it, and so does another job in the same directory, which moves the earlier run aside as a
    new run does."""
    import meshrl.api
    import torch

    from meshrl.cli import main
    from meshrl.errors import RunFailed
    from meshrl.torchx_component import train

    for retries in (0, 2):
        assert train(config=os.path.join(ROOT, "configs/default.yaml"), max_retries=retries).roles[0].args[-2:] == ["--auto-resume", "${app_id}"]
    calls = []

    def recorded(config=None, *, resume=None, overrides=None):
        calls.append(resume)
        raise RunFailed("stand-in")

    monkeypatch.setattr(meshrl.api, "run", recorded)
    run = tmp_path / "run"

    def job(app_id: str) -> int:
        return main(["run", "--verbose", f"logging.run_dir={run}", "steps=9", "--auto-resume", app_id])

    assert job("app-1") == 1 and calls == [None]  # nothing to continue: a fresh start
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(Config.from_dict({"steps": 9, "logging": {"run_dir": str(run)}}).to_yaml())
    torch.save({"models": {}, "model_critics": {}, "critic_dir": None, "model_names": ["policy"]}, run / "checkpoints" / "step_000004_loop_state.pt")
    (run / "checkpoints" / "latest").write_text("step_000004_loop_state.pt")
    assert job("app-1") == 1 and calls == [None, str(run)]  # the job's retry continues it
    assert job("app-2") == 1 and calls == [None, str(run), None]  # another job: a new run, the earlier one kept aside
    assert len(list(tmp_path.glob("run.*"))) == 1 and (run / "job_id").read_text() == "app-2"
    assert main(["run", "--auto-resume", "configs/default.yaml"]) == 2  # its value is a job id, never the config
    # overrides after an option are the command's: a wrapper appending them after --auto-resume JOB_ID
    assert main(["run", "--verbose", "--auto-resume", "app-3", f"logging.run_dir={run}", "steps=9"]) == 1 and len(calls) == 4  # (exit 2 before)
    assert (run / "job_id").read_text() == "app-3"


def test_a_slurm_signal_note_of_an_earlier_job_with_the_same_id_stops_nothing(tmp_path, monkeypatch):
    """RUN_DIR/slurm/signaled-JOBID notes stay (every job's end writes one, its cancel sends
    SIGTERM): a resumed run whose new job got a used id was stopped at its first poll."""
    from meshrl.launch import slurm
    from meshrl.launch.slurm_worker import notify_path

    kill, sent = os.kill, []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig) if pid == os.getpid() else kill(pid, sig))  # (not this pytest)
    monkeypatch.setattr(slurm, "_SIGNALED", type(slurm._SIGNALED)())
    note = notify_path(str(tmp_path), "7")
    open(note, "w").write("1700000000.000 node 0 (n1)\n")
    watch = slurm.SignalWatch(str(tmp_path), "7", since=time.time() - 60)
    try:
        time.sleep(2.5 * slurm.SignalWatch.POLL_S)
        assert not slurm.allocation_signaled() and not sent and not os.path.exists(note)
    finally:
        watch.stop()
    # one written since the job was submitted (Slurm signaled it before the watch started) is its own
    open(note, "w").write(f"{time.time():.3f} node 0 (n1)\n")
    watch = slurm.SignalWatch(str(tmp_path), "7", since=time.time() - 60)
    try:
        time.sleep(2.5 * slurm.SignalWatch.POLL_S)
        assert slurm.allocation_signaled() and sent == [signal.SIGTERM]
    finally:
        watch.stop()


def test_a_failed_squeue_is_not_a_job_gone_from_the_queue(monkeypatch):
    """A Slurm job waiting in the queue, and one `squeue` call failing (a busy slurmctld): the
    job's last entry answers, where None made Monarch's SlurmJob cancel the job as not found.
    Before any answer, squeue is asked again; None only when it answered without the job."""
    import json
    import subprocess

    import meshrl.launch.slurm as slurm

    pending = {"job_id": 7, "job_state": ["PENDING"], "state_reason": "Priority"}
    answers = []

    def squeue(*args, **kwargs):
        answer = answers.pop(0)
        if answer == "invalid":
            raise subprocess.CalledProcessError(1, "squeue", stderr="slurm_load_jobs error: Invalid job id specified")
        if answer is None:
            raise subprocess.CalledProcessError(1, "squeue", stderr="slurm_load_jobs error: Socket timed out")
        return subprocess.CompletedProcess(args, 0, stdout=json.dumps({"jobs": answer}))

    monkeypatch.setattr(slurm.subprocess, "run", squeue)
    monkeypatch.setattr(slurm, "SQUEUE_RETRY_S", 0.0)
    job = object.__new__(slurm._slurm_job_class())
    answers[:] = [None, [pending], None]
    assert job._get_job_info_json("7")["job_state"] == ["PENDING"]  # asked again
    assert job._get_job_info_json("7")["job_state"] == ["PENDING"] and job._pending_reason == "Priority"  # its last answer
    answers[:] = [[pending], None, None, None, None, None]  # failing SQUEUE_TRIES times in a row: its last entry no longer stands for it
    assert [job._get_job_info_json("7")["job_state"] for _ in range(3)] == [["PENDING"]] * 3
    assert job._get_job_info_json("7") is None and answers == []
    answers[:] = [[pending], "invalid"]  # purged from Slurm's records: gone, whatever it was last
    assert job._get_job_info_json("7")["job_state"] == ["PENDING"] and job._get_job_info_json("7") is None
    answers[:] = [[]]
    assert job._get_job_info_json("7") is None  # squeue answered: the job is gone
    fresh = object.__new__(slurm._slurm_job_class())
    answers[:] = [None] * slurm.SQUEUE_TRIES
    assert fresh._get_job_info_json("7") is None and answers == []


def test_squeue_json_of_slurm_22_05_reads_as_monarch_expects():
    """Slurm 22.05's `squeue --json` job (state a string, hosts under allocated_nodes) in the
    shape Monarch's SlurmJob reads (24.05's); the newer shape passes through unchanged."""
    import json

    from meshrl.compat import slurm_job_info_newer_shape, squeue_json_job

    finished = {"job_id": 6, "job_state": "COMPLETED", "job_resources": {}}
    listing = json.dumps({"jobs": [finished, {"job_id": 7, "job_state": "PENDING", "job_resources": {}}]})
    assert squeue_json_job(listing, "7")["job_state"] == ["PENDING"]  # 22.05 lists every job, whatever --job says
    assert squeue_json_job(listing, "8") is None
    old = {
        "job_id": 7,
        "job_state": "RUNNING",
        "state_reason": "None",
        "job_resources": {"nodes": "n1,n2", "allocated_hosts": 2, "allocated_nodes": [{"nodename": "n1", "cpus_used": 0}, {"nodename": "n2", "cpus_used": 0}]},
    }
    new = slurm_job_info_newer_shape(old)
    assert new["job_state"] == ["RUNNING"]
    assert [n["name"] for n in new["job_resources"]["nodes"]["allocation"]] == ["n1", "n2"]
    assert old["job_state"] == "RUNNING"  # the input is left as it was
    pending = slurm_job_info_newer_shape({"job_state": "PENDING", "job_resources": {}})
    assert pending["job_state"] == ["PENDING"] and pending["job_resources"]["nodes"]["allocation"] == []
    current = {"job_state": ["RUNNING"], "job_resources": {"nodes": {"allocation": [{"name": "n1"}]}}}
    assert slurm_job_info_newer_shape(current) == current
    assert slurm_job_info_newer_shape(None) is None


def test_slurm_signal_and_resubmit_knobs_are_checked():
    def problem(launcher: dict, **rest) -> str:
        with pytest.raises(ConfigError) as e:
            Config.from_dict({"launcher": launcher, **rest})
        return str(e.value)

    assert Config.from_dict({"launcher": {"kind": "slurm", "hosts": 2, "max_resubmits": 3}}).launcher.signal_before_s == 180
    assert "launcher.signal_before_s" in problem({"kind": "slurm", "time_limit": "00:02:00"})  # the warning would come before the start
    assert "launcher.signal_before_s" in problem({"kind": "slurm", "signal_before_s": 60})  # no time left after the interrupt checkpoint
    assert Config.from_dict({"launcher": {"kind": "slurm", "signal_before_s": 60}, "trainer": {"interrupt_checkpoint_timeout_s": 30}})
    assert "launcher.max_resubmits" in problem({"kind": "local", "max_resubmits": 1})
    assert "launcher.max_resubmits" in problem({"kind": "slurm", "max_resubmits": -1})
    assert "launcher.host_timeout_s" in problem({"kind": "slurm", "host_timeout_s": 0.5})


def test_sighup_runs_cleanup_like_sigterm(tmp_path):
    """A closed terminal or a dropped ssh session sends SIGHUP, whose default action skips
    `finally` and atexit, and with them the shutdown of every mesh. The terminal is gone
    then: what the cleanup prints to a descriptor whose reader is gone goes to /dev/null
    instead of raising; to a live one (this test's pipe, a CI log) it still goes."""
    done = tmp_path / "done"
    code = textwrap.dedent(
        f"""
        import os, signal, time
        from meshrl.launch.signals import exit_on_sigterm
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal's session (under nohup, as CI may run, it is ignored)
        exit_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(30)
        finally:
            print("stopping every mesh", flush=True)
            open({str(done)!r}, "w").write("cleaned up")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 128 + signal.SIGHUP and done.read_text() == "cleaned up", (out.returncode, out.stderr[-500:])
    assert out.stdout == "stopping every mesh\n"  # a live pipe keeps its output


def test_a_signal_while_the_meshes_start_ends_with_one_line_and_its_status(tmp_path):
    """SIGTERM while the run starts (meshrl.run raises SystemExit(143) then) used to leave
    `meshrl run` by a traceback, without its stop line; a Slurm allocation signaled then, with
    a checkpoint to continue from, was not resubmitted either."""
    code = textwrap.dedent(
        f"""
        import sys
        import meshrl.api
        from meshrl.cli import main

        def stopped_while_starting(self):
            raise SystemExit(143)  # as the SIGTERM handler raises it in Session.start

        meshrl.api.Session.start = stopped_while_starting
        sys.exit(main(["run", "--verbose", "logging.run_dir={tmp_path / "run"}"]))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 143, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == "meshrl: stopped while starting by SIGTERM; nothing trained in this start", done.stderr[-2000:]


def test_workers_that_never_connect_are_named_when_the_start_times_out(tmp_path):
    """A typo'd `launcher.workers` port waited out launcher.start_timeout_s and ended in an
    empty TimeoutError; the line now names the addresses nothing listens at. (In a process of
    its own: Monarch takes the workers' TCP transport only before any other call of its API.)"""
    import socket

    with socket.socket() as free:  # a loopback port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import asyncio
        from meshrl.config import Config
        from meshrl.launch import allocate
        launcher = {{"kind": "workers", "workers": ["127.0.0.1:{port}"], "address": "127.0.0.1", "start_timeout_s": 3}}
        config = Config.from_dict({{"launcher": launcher, "logging": {{"run_dir": {str(tmp_path / "run")!r}}}}})
        try:
            asyncio.run(allocate(config).start())
        except TimeoutError as e:
            print(e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert f"within launcher.start_timeout_s=3s; nothing listens at 127.0.0.1:{port}: start" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_a_dry_run_prints_the_job_and_nothing_of_a_run(tmp_path):
    """It said "training ... in RUN_DIR" and "no step trained; results in RUN_DIR", a directory it never made."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "meshrl", "run", "launcher.dry_run=true", f"logging.run_dir={run_dir}"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "launcher.kind=local: trainer, generator and coord on this host" in out.stdout
    assert "training" not in out.stderr and "no step trained" not in out.stderr and not run_dir.exists(), out.stderr[-2000:]
