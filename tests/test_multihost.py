"""One run across two hosts: network namespaces A and B joined by a veth pair (tests/conftest.py).

Each host runs `meshrl worker`; the controller (`meshrl run`, inside A) attaches to both
over Monarch's TCP transport (launcher.kind=workers). The trainer trains on A; the
generators, the episode queue and the rollout workers run on B, so rollouts and weights
cross the link. While a run trains, `ss` inside each namespace lists every listener, and
the test fails on any bound to an address other than the host's own. Skipped, with the
reason, where namespaces cannot be made (not root).
"""

import json
import os
import signal
import sys
import time

import pytest
import yaml

from meshrl.cli import last_checkpoint_step
from tests import conftest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_TIMEOUT_S = 300.0
PORT = 26600


def two_host_config(run_dir, hosts, **sections) -> dict:
    a, b = hosts.ADDRESSES["a"], hosts.ADDRESSES["b"]
    launcher = {"kind": "workers", "workers": [f"{a}:{PORT}", f"{b}:{PORT}"], "address": a, "start_timeout_s": 120}
    return conftest.two_host_config(run_dir, 120, {"steps": 16, "launcher": launcher}, **sections)


def start_run(hosts, tmp_path, cfg: dict, name: str, resume: bool = False, overrides: tuple[str, ...] = (), env: dict | None = None):
    """Both workers, then the controller inside A (`overrides` after a resume's run
    directory; `env` for all three); returns the controller's process."""
    for h in ("a", "b"):
        hosts.worker(h, PORT, tmp_path / f"{name}-worker-{h}.log", env)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["--resume", cfg["logging"]["run_dir"], *overrides] if resume else [str(path)]
    return hosts.run("a", [sys.executable, "-m", "meshrl", "run", *args], tmp_path / f"{name}-controller.log", env)


def watch(hosts, controller, timeout: float, each=None) -> dict[str, set]:
    """Every listener seen in each namespace until the controller exits (bounded); `each()`
    is called on every look."""
    seen = {"a": set(), "b": set()}
    deadline = time.monotonic() + timeout
    while controller.poll() is None and time.monotonic() < deadline:
        for h in seen:
            seen[h] |= hosts.listeners(h)
        if each is not None:
            each()
        time.sleep(0.5)
    if controller.poll() is None:
        controller.kill()
        pytest.fail(f"the run did not end within {timeout:.0f}s")
    return seen


def rows_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_empty(hosts, timeout: float = 60) -> dict[str, list[int]]:
    """The processes left in each namespace once the run has ended (they should stop by themselves)."""
    deadline = time.monotonic() + timeout
    while any(hosts.pids(h) for h in ("a", "b")) and time.monotonic() < deadline:
        time.sleep(0.5)
    return {h: hosts.pids(h) for h in ("a", "b")}


def test_two_hosts_train_across_the_link(two_hosts, tmp_path):
    """A broadcast group across the link (`collective`, what `auto` picks across hosts); the
    two co-evolving models below move theirs by Monarch RDMA."""
    run_dir, transport = tmp_path / "run", "collective"
    # synchronous (tests/README.md): every batch is sampled by the version the trainer holds,
    # so each step's log-prob match checks that step's weights arrived whole across the link
    cfg = two_host_config(run_dir, two_hosts, weight_sync={"transport": transport}, buffer={"depth": 0, "max_lag": 0}, generator={"update_mode": "block"})
    controller = start_run(two_hosts, tmp_path, cfg, transport)
    seen = watch(two_hosts, controller, RUN_TIMEOUT_S)
    log = (tmp_path / f"{transport}-controller.log").read_text()
    assert controller.returncode == 0, log[-3000:]
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 17))
    # weights crossed the link every step: host B's generators serve newer and newer versions
    versions = [r["generator/version"] for r in rows if "generator/version" in r]
    assert versions == sorted(versions) and versions[-1] >= 12, versions
    assert all(r["trainer/staleness_max"] == 0 for r in rows)
    mismatch = [r["trainer/logprob_mismatch"] for r in rows]
    assert max(mismatch) < 2e-3, mismatch
    # Measured over 3 runs of each transport (a 4th, in a full suite run, passed): the last 3 steps'
    # reward 0.735-0.761 above the first 3's, the log-prob mismatch about 1e-7.
    first, last = (sum(r["trainer/reward_mean"] for r in part) / 3 for part in (rows[:3], rows[-3:]))
    assert last > first + 0.35, [round(r["trainer/reward_mean"], 3) for r in rows]
    # nothing listened anywhere but on the address its host was given: not a wildcard, not loopback
    for h, listeners in seen.items():
        assert listeners == {("tcp", two_hosts.ADDRESSES[h])}, f"host {h} listened on {sorted(listeners)}"
    assert wait_empty(two_hosts) == {"a": [], "b": []}, "processes outlived the run"


def test_two_co_evolving_models_train_across_the_link(two_hosts, tmp_path):
    """configs/coevolve.yaml's game on `meshrl worker` hosts: the solver's (the policy's) and
    the proposer's trainers on A, both models' engines on B, each model's weights crossing
    the link every step by Monarch RDMA. Each model trains by PPO with a critic of its own
    (procs on A); the proposer's critic is killed two steps in and healed, and the run is
    resumed for a step."""
    run_dir = tmp_path / "run"
    # synchronous, as above: each step's log-prob match checks each model's weights arrived whole;
    # 12 steps of 4 groups: the assertions hold from the second step, the kill lands after the
    # second, between two looks of `watch` (each lists both hosts' sockets): 10 steps to spare
    cfg = two_host_config(
        run_dir,
        two_hosts,
        steps=12,
        batch_groups=4,
        data={"source": "task:propose"},
        models=[{"name": "proposer"}],  # it inherits the policy's gae: a critic of its own
        trainer={"loss": {"advantage": "gae"}},
        buffer={"depth": 0, "max_lag": 0},
        generator={"group_size": 4, "update_mode": "block"},
        weight_sync={"transport": "rdma"},
    )
    # the quiet default (not the suite's MESHRL_VERBOSE): every proc's output in RUN_DIR's logs,
    # so that the proposer's critic is the proc on A writing models/proposer/logs/critic.log
    controller = start_run(two_hosts, tmp_path, cfg, "models", env={"MESHRL_VERBOSE": "0"})
    killed = []

    def kill_the_proposers_critic():
        if killed or not os.path.isfile(run_dir / "metrics.jsonl") or len(rows_of(run_dir)) < 2:
            return
        log = str(run_dir / "models" / "proposer" / "logs" / "critic.log")
        for pid in two_hosts.pids("a"):
            try:
                if os.readlink(f"/proc/{pid}/fd/1") == log:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            except OSError:
                pass

    seen = watch(two_hosts, controller, RUN_TIMEOUT_S, kill_the_proposers_critic)
    log = (tmp_path / "models-controller.log").read_text()
    assert controller.returncode == 0, log[-3000:]
    assert len(killed) == 1, killed
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for prefix in ("", "proposer/"):
        assert all(r[f"{prefix}trainer/tokens"] > 0 for r in rows), prefix  # each model trained on its own rows every step
        assert all(r[f"{prefix}trainer/staleness_max"] == 0 for r in rows), prefix
        mismatch = [r[f"{prefix}trainer/logprob_mismatch"] for r in rows]
        assert max(mismatch) < 2e-3, (prefix, mismatch)  # the sampler on B held the weights its trainer on A had
        # each critic valued its model's rows of every batch, one version behind at most, and its
        # model trained on its advantages from the first step (critic.policy_warmup 0)
        assert all(r[f"{prefix}critic/gae_trained"] == 1 and r[f"{prefix}critic/version_lag"] <= 1 for r in rows), prefix
        assert all(r.get(f"{prefix}critic/value_nonfinite", 0) == 0 for r in rows), prefix
    versions = [r["generator/version"] for r in rows if "generator/version" in r]  # the policy's engines on B, newer and newer
    assert versions == sorted(versions) and versions[-1] >= 10, versions
    # the proposer's critic healed once, losing at most its last step; the solver's untouched
    healed = [r for r in rows if "proposer/critic/steps_lost" in r]
    assert len(healed) == 1 and healed[0]["proposer/critic/steps_lost"] <= 1 and healed[0]["proposer/critic/restart_s"] > 0
    assert rows[-1]["proposer/critic/restarts"] == 1 and rows[-1]["critic/restarts"] == 0
    assert sum(1 for line in log.splitlines() if "trained model proposer's critic" in line and "healed in" in line) == 1, log[-3000:]
    for export in ("final-proposer", "final-critic", "final-proposer-critic"):
        assert os.path.isdir(run_dir / "hf" / export), export
    for h, listeners in seen.items():
        assert listeners == {("tcp", two_hosts.ADDRESSES[h])}, f"host {h} listened on {sorted(listeners)}"
    assert wait_empty(two_hosts) == {"a": [], "b": []}, "processes outlived the run"
    # resumed for one more step: each critic restored from the final checkpoint, one step on
    controller = start_run(two_hosts, tmp_path, cfg, "models-resumed", resume=True, overrides=("steps=13",), env={"MESHRL_VERBOSE": "0"})
    watch(two_hosts, controller, RUN_TIMEOUT_S)
    assert controller.returncode == 0, (tmp_path / "models-resumed-controller.log").read_text()[-3000:]
    last, after = rows[-1], rows_of(run_dir)[-1]
    assert after["step"] == 13 and after["proposer/critic/restarts"] == 0
    for key in ("critic/version", "proposer/critic/version"):
        assert after[key] == last[key] + 1, (key, last[key], after[key])
    assert wait_empty(two_hosts) == {"a": [], "b": []}, "processes outlived the resumed run"


def test_a_dead_host_stops_the_run_resumably(two_hosts, tmp_path):
    """Host B (generators, queue, rollout workers) dies mid-run: the run stops within its
    timeouts with one line naming the checkpoint, and `--resume` on fresh workers finishes it."""
    run_dir = tmp_path / "run"
    # launcher.host_timeout_s 15: the hosts are network namespaces of this machine, whose agents
    # answer in milliseconds; at Monarch's 60 s the run stopped 62 s after host B died, at 15 s 36 s
    cfg = two_host_config(
        run_dir,
        two_hosts,
        steps=12,
        trainer={"checkpoint_every": 2},
        launcher={"host_timeout_s": 15},
        scoring={"reward_fn": "tests.conftest:gated_digits_reward"},
    )
    controller = start_run(two_hosts, tmp_path, cfg, "down")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while controller.poll() is None and time.monotonic() < deadline:
        if os.path.isfile(run_dir / "metrics.jsonl") and len(rows_of(run_dir)) >= 5:
            break
        time.sleep(0.2)
    assert controller.poll() is None, "the run ended before host B was taken down"
    two_hosts.kill("b")
    t0 = time.monotonic()
    watch(two_hosts, controller, RUN_TIMEOUT_S)
    stopped_s = time.monotonic() - t0
    log = (tmp_path / "down-controller.log").read_text()
    assert controller.returncode != 0, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("meshrl:")]
    failed = [line for line in lines if "run failed" in line]
    assert len(failed) == 1 and "episode queue stopped answering" in failed[0] and f"meshrl run --resume {run_dir}" in failed[0], log[-3000:]
    assert os.path.isfile(run_dir / "checkpoints" / "latest")
    assert wait_empty(two_hosts) == {"a": [], "b": []}, "processes outlived the stopped run"
    done = len(rows_of(run_dir))
    assert 4 <= done < 12

    # fresh workers on both hosts; the run continues from its last checkpoint, and its trainer
    # proc on host A is SIGKILLed two steps in: the heal spawns the new one through host A's
    # `meshrl worker` (docs/healing.md) and the run finishes. The kill comes as the row of an
    # even step is written, so it often lands in that step's checkpoint call, healed as well.
    # Its rewards are held (the gate file) from there until the kill, and it runs 8 steps past
    # its checkpoint: the batches scored before the gate (depth 2: up to 3) leave steps to go
    # however fast the steps are and wherever the first run stopped.
    resumed_at, started, gate = last_checkpoint_step(str(run_dir)), time.time(), tmp_path / "gate"
    last = resumed_at + 8
    env = {conftest.REWARD_GATE_ENV: str(gate)}
    controller = start_run(two_hosts, tmp_path, cfg, "resumed", resume=True, overrides=(f"steps={last}",), env=env)
    # two steps the resumed run wrote: the first run's rows past its checkpoint are still in the
    # file until the resumed run cuts them, and counting those found no trainer proc yet
    wait_rows(controller, run_dir, resumed_at + 2, since=started)
    with conftest.rewards_held(gate):
        victim = conftest.trainer_pid(two_hosts.pids("a"), "worker")
        assert victim is not None, "not one trainer proc on host A"
        assert len(rows_of(run_dir)) < last, "the run ended before its trainer could be killed"
        os.kill(victim, signal.SIGKILL)
    watch(two_hosts, controller, RUN_TIMEOUT_S)
    log = (tmp_path / "resumed-controller.log").read_text()
    assert controller.returncode == 0, log[-3000:]
    rows = rows_of(run_dir)
    kept = {r["step"]: r for r in rows}  # a step the heal lost is cut from the file and written again, once
    assert sorted(kept) == list(range(1, last + 1)) and len(rows) == len(kept), [r["step"] for r in rows]
    assert max(r.get("trainer/steps_lost", 0) for r in rows) <= 1
    healed = [line for line in log.splitlines() if line.startswith("meshrl: trainer rank 0") and f"(pid {victim}) died" in line]
    assert len(healed) == 1 and "healed in" in healed[0], log[-3000:]
    assert kept[last]["trainer/restarts"] == 1
    assert wait_empty(two_hosts) == {"a": [], "b": []}
    print(f"host B down: the run stopped {stopped_s:.0f} s later, at step {done}; {healed[0]}")


def wait_rows(controller, run_dir, n: int, timeout: float = RUN_TIMEOUT_S, since: float = 0.0) -> None:
    """Until the run has written `n` metric rows, the file last written after `since` (a
    wall-clock time; bounded; fails if the run ends first)."""
    deadline, path = time.monotonic() + timeout, run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and controller.poll() is None:
        if os.path.isfile(path) and os.path.getmtime(path) > since and len(rows_of(run_dir)) >= n:
            return
        time.sleep(0.2)
    pytest.fail(f"the run wrote fewer than {n} rows (exit {controller.poll()})")
