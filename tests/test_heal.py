"""A trainer proc that dies mid-run is healed (docs/healing.md, meshrl/controller/heal.py):
real Monarch meshes, a real vLLM generator and TorchTitan trainer; and a snapshot write
killed part-way never restores wrong (real DCP writes in a process that is SIGKILLed)."""

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import meshrl
from meshrl.futures import awaited
from meshrl.trainer.snapshot import load_snapshot, newest_complete, snapshot_root, snapshot_step
from tests import conftest
from tests.test_loop import tiny, trained_groups, wait_no_children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GROUPS = 6, 4
KILL_AT = 3  # the trainer is killed while it writes this step's snapshot (or, missing that, right after)
CHECKPOINT_AT = 4  # the single proc's run: killed again in a checkpoint call after this step


def run_and_kill(run_dir, procs: int, kill_ranks: list[int], checkpoint_kill: bool = False, kill_host: bool = False, **sections) -> dict:
    """A short default-like run (asynchronous, buffer depth 2) whose trainer ranks
    `kill_ranks` are SIGKILLed during step KILL_AT's snapshot (with `kill_host`, the process
    launcher's stand-in host they run on too; and, with `checkpoint_kill`, the trainer again
    inside a checkpoint call after step CHECKPOINT_AT); returns what the tests check."""
    cfg = tiny(run_dir, steps=STEPS, batch_groups=GROUPS, trainer={"checkpoint_every": 0, "procs": procs}, **sections)
    session = meshrl.Session(cfg)
    checkpointed = None
    try:
        session.start()
        rows = session.step(KILL_AT - 1)
        pids = [info["pid"] for info in session._call(session.loop.trainer.shard_info(), 60)]
        hosts = {name: state.pid for name, state in session.loop.alloc._job._host_to_pid.items()} if kill_host else {}
        killer = conftest.kill_during_snapshot(session.run_dir, [pids[r] for r in kill_ranks] + [hosts[h] for h in hosts if h.startswith("trainer")], KILL_AT)
        if checkpoint_kill:
            rows += session.step(CHECKPOINT_AT - session.version)
            loop = session.loop
            pid = session._call(loop.trainer.shard_info(), 60)[0]["pid"]
            root = os.path.join(session.run_dir, "checkpoints", "trainer")
            checkpointed = conftest.kill_during_checkpoint(session, pid, root, lambda: loop.healer.restarts)
        rows += session.step(STEPS - session.version)
        killer.join(5)
        new_pids = [info["pid"] for info in session._call(session.loop.trainer.shard_info(), 60)]
        new_hosts = [psutil.Process(pid).ppid() for pid in new_pids]
        spares_left = session.loop.alloc.spares_left()
        queue = session._call(awaited(session.loop.queue.state_dict.call_one()), 60)
        sync = session.loop.weight_sync
        result = session.finish()
    finally:
        session.stop()
    return {
        "rows": rows,
        "history": result.metrics,
        "pids": pids,
        "new_pids": new_pids,
        "hosts": hosts,
        "new_hosts": new_hosts,
        "spares_left": spares_left,
        "queue": queue,
        "during_write": killer.seen.get("during_write"),
        "checkpointed": checkpointed,
        "leftovers": wait_no_children(),
        "run_dir": str(run_dir),
        "weight_sync": sync,
    }


def check_healed(run: dict, heals: int = 1) -> None:
    # a step a heal lost is trained again: its version's later row is the one the run kept
    rows = list({int(r["version"]): r for r in run["rows"]}.values())
    assert [int(r["version"]) for r in rows] == list(range(1, STEPS + 1)), "the run did not train every step asked"
    assert len(run["rows"]) - len(rows) == sum(r.get("trainer/steps_lost", 0) for r in run["rows"])
    healed = [r for r in run["rows"] if "trainer/steps_lost" in r]
    assert [r["trainer/restarts"] for r in healed] == list(range(1, heals + 1)), [r.get("trainer/restarts") for r in run["rows"]]
    assert all(r["trainer/steps_lost"] <= 1 and r["trainer/restart_s"] > 0 for r in healed)
    assert rows[-1]["trainer/restarts"] == heals
    assert not set(run["pids"]) & set(run["new_pids"]), "the trainer was not replaced"
    groups = trained_groups(rows)
    assert len(groups) == len(set(groups)) == STEPS * GROUPS, "a group was trained twice or lost"
    consumed = run["queue"]["consumed"]
    assert len(consumed) == len(set(consumed)) and sorted(consumed) == sorted(groups)
    if run["during_write"]:  # the batch in flight went back to the queue and was trained once
        assert healed[0]["buffer/retaken_groups"] >= GROUPS
    # the curve goes on: every step after the heal trained on real episodes with a finite loss
    for r in rows[KILL_AT - 1 :]:
        assert r["trainer/loss"] == r["trainer/loss"] and abs(r["trainer/loss"]) < 1e3, r["trainer/loss"]
    assert not run["leftovers"], "procs outlived the healed run"


@pytest.fixture(scope="module")
def healed_single(tmp_path_factory):
    return run_and_kill(tmp_path_factory.mktemp("heal1") / "run", procs=1, kill_ranks=[0], checkpoint_kill=True)


def test_killed_single_trainer_proc_is_healed_and_the_run_finishes(healed_single):
    check_healed(healed_single, heals=2)


def test_trainer_killed_inside_a_checkpoint_call_is_healed_and_the_call_saves(healed_single):
    """The trainer dies in a checkpoint call (its write under way, or before the call):
    the call heals it and saves the restored state, at most one step older, which the run
    trains again; the checkpoint it returns is complete and holds that version."""
    from meshrl.trainer.checkpoint import checkpoint_step

    done = healed_single["checkpointed"]

    assert done["heals"] == 1, done
    assert done["version"] in (CHECKPOINT_AT - 1, CHECKPOINT_AT), done
    state = torch.load(done["path"], weights_only=False)
    assert state["version"] == done["version"] and checkpoint_step(state["trainer_dir"]) == done["version"]
    assert os.path.basename(done["path"]).startswith(f"step_{done['version']:06d}_")


def test_fsdp_trainer_with_one_proc_killed_is_healed(tmp_path):
    check_healed(run_and_kill(tmp_path / "run", procs=2, kill_ranks=[1]))


def test_lost_trainer_host_is_healed_on_a_spare_host(tmp_path):
    """The process launcher's ProcessJob hosts (the Slurm path without a cluster), a trainer
    host, a generator host and a spare (launcher.spare_hosts=1): the trainer's whole host is
    SIGKILLed, its host agent with its proc. The heal finds the host silent and spawns the
    new trainer on the spare. The weights cross to the generators' host by the collective
    transport, whose group the heal re-creates while a generator may be taking a version
    from the dead trainer."""
    # launcher.host_timeout_s 10: the stand-in hosts are this machine's processes, whose agents
    # answer in milliseconds; at Monarch's 60 s the silent host took a minute to be reported
    launcher = {"kind": "process", "hosts": 2, "spare_hosts": 1, "host_timeout_s": 10}
    run = run_and_kill(tmp_path / "run", procs=1, kill_ranks=[0], kill_host=True, launcher=launcher)
    check_healed(run)
    assert set(run["hosts"]) == {"trainer_0", "generator_0", "spare_0"}
    assert run["new_hosts"] == [run["hosts"]["spare_0"]] and run["spares_left"] == 0, run
    assert run["weight_sync"].cfg.transport == "collective" and run["weight_sync"]._store is None  # no listener outlives the run


def test_a_trainer_killed_while_it_waits_for_its_batch_loses_no_group(tmp_path, monkeypatch):
    """Synchronous, so the trainer waits in the queue's `sample` while each batch is generated.
    With the next batch's rewards held (the gate, created once the batch before is complete, so
    that none of the next can be), its proc is SIGKILLed while it waits. The heal's `retake`
    ends that wait inside the queue: it takes no batch and does not move the version on, and
    its answer to the dead proc is dropped without failing the queue. Once the rewards flow,
    the new trainer takes the batch and the run trains every group once."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(conftest.REWARD_GATE_ENV, str(gate))  # the workers' procs inherit it
    sync = {"buffer": {"depth": 0, "max_lag": 0, "get_timeout_s": 120}, "generator": {"update_mode": "block"}}
    reward = {"reward_fn": "tests.conftest:gated_digits_reward", "timeout_s": 300}  # held longer than the heal takes
    cfg = tiny(tmp_path / "run", steps=5, trainer={"checkpoint_every": 0, "snapshot_every": 1}, scoring=reward, **sync)
    session, out = meshrl.Session(cfg), []

    def ready() -> float:
        return session._call(awaited(session.loop.queue.metrics.call_one()), 60)["buffer/groups"]

    try:
        session.start()
        rows = session.step(2)
        deadline = time.monotonic() + 120
        while ready() < GROUPS and time.monotonic() < deadline:  # step 3's batch complete before the gate
            time.sleep(0.05)
        with conftest.rewards_held(gate):
            rows += session.step(1)  # step 3, on its batch; step 4's cannot be complete now
            loop = session.loop
            (info,) = session._call(loop.trainer.shard_info(), 60)
            while ((done := newest_complete(snapshot_root(session.run_dir))) is None or snapshot_step(done) != 3) and time.monotonic() < deadline:
                time.sleep(0.05)  # the heal restores step 3's snapshot: no step lost
            stepping = threading.Thread(target=lambda: out.extend(session.step(1)), daemon=True)
            stepping.start()
            time.sleep(2.0)  # its call waits in `sample`
            assert ready() < GROUPS and not out
            os.kill(info["pid"], signal.SIGKILL)
            while "trainer/restart_s" not in loop.healer.pending_metrics and time.monotonic() < deadline + 120:
                time.sleep(0.1)  # healed, with the rewards still held
            assert "trainer/restart_s" in loop.healer.pending_metrics and not out
        stepping.join(180)
        assert out and out[0]["trainer/restarts"] == 1 and out[0]["trainer/steps_lost"] == 0, out
        rows += out + session.step(5 - session.version)
        queue = session._call(awaited(loop.queue.state_dict.call_one()), 60)
    finally:
        session.stop()
    kept = list({int(r["version"]): r for r in rows}.values())
    assert [int(r["version"]) for r in kept] == [1, 2, 3, 4, 5] and len(rows) == 5
    groups = trained_groups(kept)
    assert len(groups) == len(set(groups)) == 5 * GROUPS and sorted(queue["consumed"]) == sorted(groups), "a group was lost or trained twice"
    assert not wait_no_children(), "procs outlived the healed run"


# ---- a snapshot write killed part-way -----------------------------------------------------------
WRITER = """
import sys, torch
from torch import nn
from meshrl.trainer.snapshot import Snapshots
model = nn.Linear(1024, 1024)
opt = torch.optim.AdamW(model.parameters())
snaps = Snapshots(sys.argv[1], 1, blocking=sys.argv[2] == "blocking")
step = 0
while True:
    step += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    snaps.start(step, model, opt)
    snaps.finish()
    print(step, flush=True)
"""


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_a_snapshot_write_killed_part_way_restores_the_previous_complete_one(tmp_path, mode):
    """A process writes a snapshot every step (every weight = the step's number) and is
    SIGKILLed at moments spread over its writes; after each kill the newest complete snapshot
    loads, and holds exactly its own step's weights. `blocking`: a CPU trainer's write;
    `async`: a GPU trainer's (staged, written by a thread)."""
    from torch import nn

    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    cut_writes = 0
    for attempt in range(4):
        root = str(tmp_path / f"snapshots{attempt}")
        proc = subprocess.Popen([sys.executable, str(script), root, mode], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
        proc.stdout.readline()  # one snapshot written: the next ones are under way
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(n.endswith(".tmp") and n.startswith(".step-") for n in os.listdir(root)):
            pass  # the moment a write is seen under way
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        cut_writes += any(n.endswith(".tmp") and n.startswith(".step-") for n in os.listdir(root))
        path = newest_complete(root)
        assert path is not None
        model = nn.Linear(1024, 1024)
        opt = torch.optim.AdamW(model.parameters())
        step = snapshot_step(path)
        assert load_snapshot(path, model, opt) == step
        assert all(bool((p == float(step)).all()) for p in model.parameters()), f"snapshot {path} holds another step's weights"
        if cut_writes:
            break
    assert cut_writes >= 1, "no kill landed during a write: the test did not test it"


# ---- the heal's parts, with the meshes stood in for ------------------------------------------
def test_a_model_healed_in_its_step_moves_its_generators_to_each_step_it_trains_again(tmp_path):
    """A trained model beside the policy whose trainer is healed in a step from an older state
    trains the lost steps again (`TrainedModel.train`). Its generators follow each of them at
    once: the next batch's turns ask its engines for the version before the step's, which
    otherwise they would reach only once the step (waiting for that batch) had ended."""
    import asyncio

    from meshrl.config import Config
    from meshrl.controller.partners import TrainedModel

    model = TrainedModel(Config.from_dict({"models": [{"name": "proposer"}], "logging": {"run_dir": str(tmp_path)}}), "proposer", None, None)
    moved, made = [], iter([None, 6, 7, 8])  # dies in its step to 8; restored at 5, then makes 6, 7 and 8

    class Generators:
        replaced = 0

        async def update(self, version, weights_id):
            moved.append(version)

    class Trainer:
        version = 7

        async def train_from_queue(self, *args):
            made_now = next(made)
            if made_now is None:
                raise RuntimeError("supervision: proc exited")
            return {"version": made_now, "weights_id": f"w{made_now}"}

    async def heal(error, version):  # as TrainedModel.heal leaves it: the restored version, its generators moved there
        model.update(5)
        return 5

    async def step():
        out = await model.train(None, 4, 30.0, 7)
        await model.finish_update()
        return out

    model.generators, model.trainer, model.heal = Generators(), Trainer(), heal
    assert asyncio.run(step())["version"] == 8
    assert moved == [5, 6, 7]  # 8: the loop's move at the step's end
    assert model.weights == (8, "w8")


def test_a_restore_that_fails_stops_the_mesh_the_heal_spawned(tmp_path, monkeypatch):
    """`replace_trainer`: where the new mesh's restore raises (or the heal's bound cancels it),
    that mesh is stopped before the failure goes on, not left holding its procs and memory."""
    import asyncio
    import types

    from meshrl.config import Config
    from meshrl.controller import heal

    stopped = []

    class Mesh:
        def __init__(self, name):
            self.name = name

        async def stop(self, teardown=True):
            stopped.append(self.name)

        async def load_checkpoint(self, path):
            raise OSError(f"{path}: unreadable")

    async def spawn_trainer(*args, **kwargs):
        return Mesh("new")

    monkeypatch.setattr(heal, "spawn_trainer", spawn_trainer)
    monkeypatch.setattr(heal, "newest_state", lambda *args, **kwargs: (str(tmp_path / "step-3"), 3))
    alloc = types.SimpleNamespace(spares_left=lambda: False, host_mesh=lambda role: None, hosts=lambda role: None, plan=None)
    config = Config.from_dict({"logging": {"run_dir": str(tmp_path)}})
    with pytest.raises(OSError, match="unreadable"):
        asyncio.run(heal.replace_trainer(config, alloc, Mesh("old"), [], str(tmp_path), 0, at_most=3))
    assert stopped == ["old", "new"]


def test_a_checkpoint_waits_on_the_episode_queue_within_its_bound(tmp_path):
    """Saving asked the episode queue for its state with no bound: a coordinator host lost as a
    checkpoint came due held the run until the step's outer bound, whose line named no queue."""
    import asyncio
    import json

    from meshrl.controller import checkpoint
    from meshrl.trainer.checkpoint import COMPLETE_MARKER

    class Trainer:
        version = 3

        async def save_checkpoint(self, root):
            os.makedirs(os.path.join(root, "step-3"))
            with open(os.path.join(root, "step-3", COMPLETE_MARKER), "w") as f:
                json.dump({"step": 3}, f)
            return os.path.join(root, "step-3")

    async def never():
        await asyncio.sleep(3600)

    queue = type("Queue", (), {"state_dict": type("Endpoint", (), {"call_one": staticmethod(never)})()})()
    with pytest.raises(TimeoutError, match="the episode queue, saving its state did not answer within 0.2s"):
        asyncio.run(asyncio.wait_for(checkpoint.save(str(tmp_path), Trainer(), queue, 3, [], timeout_s=0.2), 30))
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints", "latest"))


def test_only_the_newest_checkpoints_are_kept_each_whole(tmp_path):
    """trainer.keep_checkpoints: every save kept a whole copy of every trained state, optimizer
    included, and a long run filled its disk. Older checkpoints go whole: the loop state and
    the trainer's, critic's and each model's states no kept one names; `latest` and the last good
    one an alarm named always stay. Those past `latest` (a run resumed from an earlier one) are
    neither counted nor removed: the one it went back to is not taken for the oldest. A save
    not kept (torn or deferred) left its states, named by no loop state, for good: they go too."""
    from meshrl.controller.checkpoint import prune

    def run(name: str, latest: int):
        root = tmp_path / name / "checkpoints"
        for step in (2, 4, 6, 1000000):
            dirs = {
                "trainer": root / "trainer" / f"step-{step}",
                "critic": root / "critic" / f"step-{step}",
                "proposer": root / "models" / "proposer" / f"step-{step}",
            }
            for d in dirs.values():
                d.mkdir(parents=True)
                (d / "shard").write_bytes(b"weights and optimizer")
            state = {"version": step, "trainer_dir": str(dirs["trainer"]), "critic_dir": str(dirs["critic"]), "models": {"proposer": str(dirs["proposer"])}}
            torch.save({**state, "model_critics": {}}, root / f"step_{step:06d}_loop_state.pt")
        (root / "latest").write_text(f"step_{latest:06d}_loop_state.pt")
        return str(tmp_path / name), root

    run_dir, root = run("a", latest=2)  # a resume pointed `latest` back at an older one
    assert prune(run_dir, 0) == [] and prune(run_dir, 4) == [] and prune(run_dir, 1) == []
    (root / "latest").write_text("step_000006_loop_state.pt")  # the resumed run saved at 6, over the abandoned one
    # saves not kept (torn: a model at another step; deferred), and a crashed save's debris: no loop state names them
    for debris in ("trainer/step-3", "models/proposer/step-3", "models/proposer-critic/step-5", "trainer/.step-5.tmp", "trainer/step-7", "critic/step-1"):
        (root / debris).mkdir(parents=True)
    (root / "critic" / "latest").write_text("step-1")  # a state root's own pointer stays
    assert prune(run_dir, 2) == [2]
    left = sorted(p.name for p in root.iterdir())
    assert left == ["critic", "latest", "models", "step_000004_loop_state.pt", "step_000006_loop_state.pt", "step_1000000_loop_state.pt", "trainer"]
    for sub in ("trainer", "critic", os.path.join("models", "proposer")):
        extra = {"trainer": ["step-7"], "critic": ["latest", "step-1"]}.get(sub, [])  # past latest's step; named by its pointer
        assert sorted(p.name for p in (root / sub).iterdir()) == sorted(["step-1000000", "step-4", "step-6", *extra]), sub
    assert not os.listdir(root / "models" / "proposer-critic")
    run_dir, root = run("b", latest=1000000)
    assert prune(run_dir, 1, spare={4}) == [2, 6]
    assert sorted(p.name for p in (root / "trainer").iterdir()) == ["step-1000000", "step-4"]


def test_a_save_that_prunes_leaves_the_alarms_only_checkpoints_still_there(tmp_path):
    """The watches list every checkpoint written; with trainer.keep_checkpoints an alarm to come
    would have named one already removed. The one a raised alarm named stays, and stays listed."""
    import asyncio
    import json
    import types

    from meshrl.controller import checkpoint
    from meshrl.trainer.checkpoint import COMPLETE_MARKER

    class Trainer:
        version = 0

        async def save_checkpoint(self, root):
            d = os.path.join(root, f"step-{self.version}")
            os.makedirs(d)
            with open(os.path.join(d, COMPLETE_MARKER), "w") as f:
                json.dump({"step": self.version}, f)
            return d

    async def state():
        return {}

    queue = types.SimpleNamespace(state_dict=types.SimpleNamespace(call_one=state))
    trainer = Trainer()
    cliff = types.SimpleNamespace(checkpoints=[], raised=[])
    for step in (2, 4, 6):
        trainer.version = step
        asyncio.run(checkpoint.save(str(tmp_path), trainer, queue, step, [], keep=1, alarms=(cliff, None)))
        cliff.checkpoints.append(step)  # as RLLoop.checkpoint tells each watch
        if step == 2:
            cliff.raised = [types.SimpleNamespace(good_checkpoint=2)]  # an alarm named step 2
    assert cliff.checkpoints == [2, 6] and sorted(os.listdir(tmp_path / "checkpoints" / "trainer")) == ["step-2", "step-6"]


def test_a_start_keeps_its_own_export_and_the_runs_first_not_every_resumes(tmp_path):
    """Each start exported its generators' first weights to hf/vN and left them: a preempted run
    resubmitted 20 times kept 20 copies of its model. The run's first (v0), the final export and
    anything else in hf/ stay."""
    from meshrl.controller.checkpoint import start_export

    for name in ("v0", "v12", "v30", "final", "base", "vintage"):
        (tmp_path / "hf" / name).mkdir(parents=True)
    assert start_export(str(tmp_path), 45) == str(tmp_path / "hf" / "v45")
    assert sorted(os.listdir(tmp_path / "hf")) == ["base", "final", "v0", "vintage"]
    assert start_export(str(tmp_path / "fresh"), 0) == str(tmp_path / "fresh" / "hf" / "v0")  # nothing there yet


def test_a_run_sent_back_sets_the_checkpoints_it_went_back_from_aside(tmp_path):
    """Sent back from step 160 to 125 (`latest` edited, docs/stability.md), the resumed run's
    saves at 140 and 170 were pruned beside the abandoned 160 as if it were its own: 125 and
    140 removed, the abandoned 160 kept, and an alarm could name it. The resume moves the
    loop states past its step aside, so only its own count."""
    from meshrl.controller.checkpoint import prune, set_aside_later

    root = tmp_path / "checkpoints"
    root.mkdir()

    def save(step):
        d = root / "trainer" / f"step-{step}"
        d.mkdir(parents=True)
        torch.save({"version": step, "trainer_dir": str(d), "critic_dir": None, "models": {}, "model_critics": {}}, root / f"step_{step:06d}_loop_state.pt")
        (root / "latest").write_text(f"step_{step:06d}_loop_state.pt")

    for step in (100, 125, 149, 160):
        save(step)
    (root / "latest").write_text("step_000125_loop_state.pt")
    aside = set_aside_later(str(root), 125)
    assert sorted(os.listdir(aside)) == ["step_000149_loop_state.pt", "step_000160_loop_state.pt"]
    assert set_aside_later(str(root), 125) is None  # nothing more past it
    for step in (140, 170):
        save(step)
        prune(str(tmp_path), 2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000140_loop_state.pt", "step_000170_loop_state.pt"]
