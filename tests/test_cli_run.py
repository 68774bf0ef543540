"""`meshrl run` as a new user meets it: a quiet console, SIGTERM that checkpoints, and a
resume that keeps step numbering without duplicate metric rows; and a single-host run
that opens no socket another host could reach (docs/security.md)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import is_loopback, watch_listeners

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["batch_groups=4", "generator.group_size=4", "generator.max_num_seqs=16", "trainer.micro_batch_size=16"]
LIBRARY_LINE = re.compile(r"\b(INFO|WARNING|DEBUG)\b \d\d-\d\d|nanobind|terminate called|Traceback|leaked")


def quiet_env() -> dict:
    env = dict(os.environ)
    env.pop("MESHRL_VERBOSE", None)  # the user's default: library output to RUN_DIR/logs
    return env


def console_lines(text: str) -> list[str]:
    """Lines as a terminal shows them: the progress bar redraws one line with \\r."""
    return [line.split("\r")[-1] for line in text.split("\n") if line.split("\r")[-1].strip()]


def steps_in(run_dir) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [int(json.loads(line)["step"]) for line in f if line.strip().endswith("}")]


def leftovers(since: float) -> list[psutil.Process]:
    """Monarch procs and vLLM engines started since `since` that still run."""
    found = []
    for p in psutil.process_iter(["name", "cmdline", "create_time"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if (p.info["create_time"] or 0) >= since and ("bootstrap_main" in cmd or (p.info["name"] or "").startswith("VLLM")):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except psutil.Error:
                pass
    return found


def test_sigterm_checkpoints_and_resume_keeps_numbering_with_a_quiet_console_listening_on_loopback(tmp_path):
    """A game with two trained models, stopped by SIGTERM in a step and resumed. While it
    trains, the listening sockets of its whole process tree (the controller with the
    weight-sync stores, each model's trainer and generator, the queue and worker procs,
    vLLM's engine processes) are looked at every half second: any bound to a wildcard
    (0.0.0.0, ::) or a routable address fails the test, named."""
    from meshrl.controller.checkpoint import latest_state
    from meshrl.trainer.checkpoint import checkpoint_step

    run_dir = tmp_path / "run"
    started = time.time()
    seen: dict[tuple[str, str, int], str] = {}  # (protocol, address, port) -> its process
    # weight_sync.transport=collective: the transport that listens most, a store in the
    # controller and a gloo group (a one-host run's default, shm, opens no socket for weights).
    # steps=1000: SIGTERM ends it; a run of 60 fast steps had ended between two looks.
    # configs/coevolve.yaml's game: two trained models, so the step SIGTERM lands in has the
    # proposer's trainer waiting for the policy's batch, and the checkpoint must hold both at one version.
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrl", "run", "configs/coevolve.yaml", f"logging.run_dir={run_dir}", "steps=1000", "weight_sync.transport=collective"],
        cwd=ROOT,
        env=quiet_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 400
        root = psutil.Process(proc.pid)
        # until step 6 and a look that found the controller's store: a run's first steps can
        # come and go between two looks, each of which lists every proc's sockets
        controller_seen = lambda: any(owner.startswith(f"{proc.pid} ") for owner in seen.values())  # noqa: E731
        while (len(steps_in(run_dir)) < 6 or not controller_seen()) and proc.poll() is None and time.monotonic() < deadline:
            watch_listeners(root, seen)
            time.sleep(0.5)
        assert proc.poll() is None, f"the run ended before it was stopped: {proc.stdout.read().decode()}"
        assert len(steps_in(run_dir)) >= 6, "the run did not reach step 6"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=180)[0].decode()  # bytes: text mode would turn the bar's \r into lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = console_lines(out)
    assert proc.returncode == 143, out
    assert not any(LIBRARY_LINE.search(line) for line in lines), out
    assert len(lines) <= 4, out  # start line, progress bar, the stop line
    stop = re.search(r"stopped at step (\d+) by SIGTERM: checkpoint at step \1; continue with: meshrl run --resume", lines[-1])
    assert stop, lines[-1]
    stopped_at = int(stop.group(1))
    assert steps_in(run_dir) == list(range(1, stopped_at + 1)), "the step in flight lost its row or a row was doubled"
    state = latest_state(str(run_dir))  # the checkpoint holds both models at the step it names
    assert state["version"] == stopped_at and checkpoint_step(state["models"]["proposer"]) == checkpoint_step(state["trainer_dir"]) == stopped_at
    logs = os.listdir(run_dir / "logs")
    assert {"controller.log", "trainer-0.log", "generator-0.log", "queue.log", "worker-0.log"} <= set(logs), logs
    assert "INFO" in (run_dir / "logs" / "generator-0.log").read_text(), "vLLM's lines did not reach its log"
    deadline = time.monotonic() + 60
    while leftovers(started) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers(started), "procs outlived the stopped run"
    # The controller hosts the weight-sync store for the whole run: if the watch did not
    # see it, it saw nothing.
    assert controller_seen(), f"no listener of the controller was seen: {seen}"
    exposed = [f"{proto} {ip}:{port} (pid {owner})" for (proto, ip, port), owner in sorted(seen.items()) if not is_loopback(ip)]
    assert not exposed, "sockets reachable from other hosts:\n" + "\n".join(exposed)

    # A crash after the checkpoint left rows of steps that will be trained again: resume cuts them.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": stopped_at + 1, "trainer/loss": 0.0}) + "\n" + '{"step": 99, "trainer/lo')
    target = stopped_at + 4
    resumed = subprocess.run(
        [sys.executable, "-m", "meshrl", "run", "--resume", str(run_dir), f"steps={target}"], cwd=ROOT, env=quiet_env(), capture_output=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert steps_in(run_dir) == list(range(1, target + 1))
    lines = console_lines((resumed.stdout + resumed.stderr).decode())
    assert not any(LIBRARY_LINE.search(line) for line in lines), lines
    last_row = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][-1]
    summary = re.search(r"step (\d+) reached .* -> ([0-9.]+) \(step (\d+)\)", lines[-1])
    assert summary and int(summary.group(1)) == target, lines[-1]
    # a game's summary: the policy's own reward (its trainer's rows), then the proposer's
    assert summary.group(2) == f"{last_row['trainer/reward_mean']:.3f}", (lines[-1], last_row)
    assert "proposer's " in lines[-1] and f"-> {last_row['proposer/trainer/reward_mean']:.3f}" in lines[-1], lines[-1]
    assert "nan" not in lines[-1]


def test_the_summary_line_gives_each_models_own_reward_in_a_game():
    """A game's batch mixes every model's rows: the summary gives the policy's trainer reward
    and each other model's, not the mixed batch's."""
    from types import SimpleNamespace

    from meshrl.cli import summary_line

    rows = [
        {"step": 1, "trainer/reward_mean": 0.01, "teller/trainer/reward_mean": 0.08, "buffer/sampled_reward_mean": 0.04},
        {"step": 16, "trainer/reward_mean": 0.02, "teller/trainer/reward_mean": 0.62, "buffer/sampled_reward_mean": 0.31},
    ]
    line = summary_line(SimpleNamespace(metrics=rows, run_dir="runs/g"), 24.0)
    assert "reward 0.010 (step 1) -> 0.020 (step 16), teller's 0.080 -> 0.620;" in line, line
    alone = summary_line(SimpleNamespace(metrics=[{k: v for k, v in r.items() if not k.startswith("teller/")} for r in rows], run_dir="runs/g"), 24.0)
    assert "reward 0.040 (step 1) -> 0.310 (step 16);" in alone, alone  # one model: the sampled batch's, as before
    late = [{k: v for k, v in rows[0].items() if not k.startswith("teller/")}, {**rows[1], "step": 2}, {**rows[1], "step": 3}]
    assert "teller's 0.620 (step 2) -> 0.620;" in summary_line(SimpleNamespace(metrics=late, run_dir="runs/g"), 24.0)  # from its first step that has it
