"""Errors between actors are typed: a component raises its own exception class and a caller
recognises it with `meshrl.errors.find`, through Monarch's ActorError wrapping (one per actor
hop), never by the message's text. Here the queue's BatchTimeout and QueueClosed make the trip
queue -> trainer-like relay -> controller on real procs, as the RL loop sees them. And the
controller's own ends of a run: a queue that stops answering, a signal during the teardown."""

import asyncio
import os
import pickle
import threading

import pytest
from monarch.actor import Actor, ActorError, endpoint, this_host

from meshrl.config import Config
from meshrl.errors import TrainerFailed, UserCodeError, find, one_line
from meshrl.queue import BatchTimeout, EpisodeQueue, QueueClosed
from meshrl.queue.actor import EpisodeQueueActor


def test_the_queue_raises_its_own_types_and_they_pickle():
    q = EpisodeQueue(Config.from_dict({"batch_groups": 1, "buffer": {"dynamic_sampling": False}}))
    with pytest.raises(BatchTimeout, match="rollouts are not arriving") as timeout:
        q.sample(1, 0, timeout=0.05)
    assert isinstance(timeout.value, TimeoutError)  # callers that catch TimeoutError still do
    q.close()
    with pytest.raises(QueueClosed) as closed:
        q.claim(0, 0.0)
    for e in (timeout.value, closed.value):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)


def test_find_looks_through_actor_errors_and_causes():
    inner = BatchTimeout("episode queue had 0 of 1 groups")
    two_hops = pickle.loads(pickle.dumps(ActorError(ActorError(inner))))  # as a caller two actors away receives it
    found = find(two_hops, BatchTimeout)
    assert isinstance(found, BatchTimeout) and str(found) == str(inner)
    assert find(two_hops, QueueClosed) is None
    try:
        try:
            raise QueueClosed("episode queue closed")
        except QueueClosed as e:
            raise RuntimeError("the claim failed") from e
    except RuntimeError as outer:
        assert isinstance(find(outer, QueueClosed), QueueClosed)
    assert one_line(ActorError(UserCodeError("queue: KeyError: 'x' (data.py:3)"))) == "queue: KeyError: 'x' (data.py:3)"


def test_the_loop_tells_a_batch_timeout_by_its_type(tmp_path):
    """The trainer's call fails with the queue's BatchTimeout two hops down: the loop's one line
    says no batch came, whatever the queue's message says."""
    from meshrl.controller.loop import RLLoop

    loop = RLLoop(Config.from_dict({"logging": {"run_dir": str(tmp_path)}, "buffer": {"get_timeout_s": 7}}))
    loop.version = 3

    class Trainer:
        async def train_from_queue(self, queue, num_groups, timeout_s, critic=None):
            raise pickle.loads(pickle.dumps(ActorError(ActorError(BatchTimeout("worded otherwise")))))

    loop.trainer, loop.queue = Trainer(), None
    with pytest.raises(TimeoutError, match=r"^no batch for version 3 within buffer.get_timeout_s=7s: rollouts are not arriving"):
        asyncio.run(loop.step())


def test_a_call_outside_the_step_heals_the_dead_proc_it_met_and_is_made_again(tmp_path):
    """A checkpoint or an export (`RLLoop._healing`) that fails beside a trained model whose
    critic proc is gone (`TrainedModel.dead`: its pid no longer runs as the process that
    started then) heals that model and makes the call again; a failure with every proc
    alive is the call's own, raised as it is."""
    import os
    import subprocess
    import sys
    import types

    from meshrl.controller.heal import local_proc
    from meshrl.controller.loop import RLLoop
    from meshrl.controller.partners import TrainedModel

    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = local_proc(gone.pid, None)
    gone.kill()
    gone.wait()
    alive = local_proc(os.getpid(), None)
    config = Config.from_dict({"models": [{"name": "proposer"}], "logging": {"run_dir": str(tmp_path)}})
    loop = RLLoop(config)
    model = TrainedModel(config, "proposer", None, None)
    model.pids, model.critic = [alive], types.SimpleNamespace(proc_ids=[dead])  # its trainer alive, its critic's proc gone
    healed, calls = [], []

    async def heal_outside_step(error, queue, num_groups, timeout_s, version):
        healed.append((str(error), version))
        model.critic.proc_ids = [alive]  # a new critic proc

    async def save():
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("Endpoint call critic.save_checkpoint() failed")
        return "saved"

    async def fails():
        raise ValueError("disk full")

    model.heal_outside_step = heal_outside_step
    loop.partners, loop.healer.pids, loop.queue, loop.version = [model], [alive], None, 7
    assert model.dead() and not model.trainer_dead()
    assert asyncio.run(loop._healing("checkpoint", save)) == "saved"
    assert healed == [("Endpoint call critic.save_checkpoint() failed", 7)] and len(calls) == 2
    with pytest.raises(ValueError, match="disk full"):
        asyncio.run(loop._healing("checkpoint", fails))
    assert len(healed) == 1


def test_a_queue_silent_on_two_health_checks_in_a_row_stops_the_run_resumably(tmp_path):
    """The episode queue's host goes down mid-step: the health check stops the run on its second
    unanswered call in a row (not when buffer.get_timeout_s runs out), and replaces nothing
    meanwhile; one slow answer between two good ones stops nothing."""
    from meshrl.controller import loop as loop_module

    loop = loop_module.RLLoop(Config.from_dict({"logging": {"run_dir": str(tmp_path)}}))
    loop.version, answers, checked = 4, [], []

    async def queue_answers(timeout_s: float = 10.0) -> bool:
        return answers.pop(0)

    class Pool:
        async def check(self, *args):
            checked.append(args)

        def handles(self):
            return []

    loop._queue_answers, loop.generators, loop.workers = queue_answers, Pool(), Pool()
    answers[:] = [True, False, True, True]
    for _ in range(4):
        asyncio.run(loop.check_health())
    assert len(checked) == 6  # generators and workers, on each answered call only
    answers[:] = [False, False]
    asyncio.run(loop.check_health())
    with pytest.raises(TrainerFailed, match=r"^the episode queue stopped answering at version 4: its host"):
        asyncio.run(loop.check_health())
    assert len(checked) == 6 and loop_module.QUEUE_SILENT_CHECKS == 2

    # the queue's host goes down between the first ask and a replacement's call to the queue (a
    # dead worker's groups re-queued): that call's failure counts as the queue's silence, not
    # as the run's own failure; a failure while the queue answers is raised as it is
    class Requeue(Pool):
        async def check(self, *args):
            raise RuntimeError("Endpoint call queue.requeue() failed")

    loop.workers, loop._queue_silent = Requeue(), 0
    answers[:] = [True, False, False]
    asyncio.run(loop.check_health())  # answered, the replacement failed, then silent: one
    with pytest.raises(TrainerFailed, match=r"^the episode queue stopped answering at version 4"):
        asyncio.run(loop.check_health())
    answers[:] = [True, True]
    with pytest.raises(RuntimeError, match="queue.requeue"):
        asyncio.run(loop.check_health())


def test_a_signal_during_the_teardown_lets_it_finish_and_the_failure_stand(tmp_path):
    """A run fails, and SIGTERM (a scheduler noticing the same lost node) arrives while its
    procs stop: the teardown finishes and the failure, not a bare SystemExit, reaches the caller."""
    import signal

    import meshrl

    session = meshrl.Session({"logging": {"run_dir": str(tmp_path)}})
    stopped = []

    class Loop:
        async def shutdown(self):
            await asyncio.sleep(0.5)
            stopped.append(True)

    def failed_run():
        try:
            raise TrainerFailed("the episode queue stopped answering at version 3")
        finally:
            session.stop()

    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    try:
        session._live.run = Loop()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(TrainerFailed, match="stopped answering"):
            failed_run()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert stopped == [True]


class Relay(Actor):
    """Stands for the trainer: its endpoint calls the queue actor, whose error it raises as is."""

    @endpoint
    async def sample(self, queue, timeout: float):
        return await queue.sample.call_one(1, 0, timeout)

    @endpoint
    async def claim(self, queue):
        return await queue.claim.call_one(0, 1.0)


@pytest.mark.slow  # about 35 s on 2 cores: two fresh procs import torch
@pytest.mark.timeout(180)
def test_the_queues_error_types_survive_two_actor_hops():
    async def main():
        queue_procs = this_host().spawn_procs(per_host={"procs": 1})
        relay_procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            cfg = Config.from_dict({"batch_groups": 1, "buffer": {"dynamic_sampling": False}}).to_dict()
            queue = queue_procs.spawn("queue", EpisodeQueueActor, cfg)
            relay = relay_procs.spawn("relay", Relay)
            with pytest.raises(Exception) as one_hop:  # controller -> queue
                await queue.sample.call_one(1, 0, 0.2)
            with pytest.raises(Exception) as two_hops:  # controller -> relay (a mesh call, like the trainer's) -> queue
                await relay.sample.call(queue, 0.2)
            for e in (one_hop.value, two_hops.value):
                found = find(e, BatchTimeout)
                assert isinstance(found, BatchTimeout), f"{type(e).__name__}: {e}"
                assert "rollouts are not arriving" in str(found)
            await queue.close.call_one()
            with pytest.raises(Exception) as closed:
                await relay.claim.call(queue)
            assert isinstance(find(closed.value, QueueClosed), QueueClosed)
            assert find(closed.value, BatchTimeout) is None
        finally:
            await relay_procs.stop()
            await queue_procs.stop()

    asyncio.run(main())


def test_a_bounded_call_to_the_queue_answers_or_names_the_call_that_did_not():
    """The loop's start and a resume wait on the queue through `bounded`: its answer comes
    back; a call the queue keeps waiting in (a sample with no rollouts) ends at the bound, in
    a TimeoutError that says which call; the call's own failure within the bound is raised as
    it is."""
    from meshrl.futures import bounded

    async def main():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            cfg = Config.from_dict({"batch_groups": 1, "buffer": {"dynamic_sampling": False}}).to_dict()
            queue = procs.spawn("queue", EpisodeQueueActor, cfg)
            assert isinstance(await bounded(queue.metrics.call_one(), 60, "the episode queue"), dict)
            with pytest.raises(TimeoutError, match=r"^the episode queue, sampling did not answer within 0.5s$"):
                await bounded(queue.sample.call_one(1, 0, 5.0), 0.5, "the episode queue, sampling")

            async def own():  # a call's own TimeoutError within the bound stays its own
                raise TimeoutError("its own failure")

            with pytest.raises(TimeoutError, match=r"^its own failure$"):
                await bounded(own(), 30, "the call")
        finally:
            await procs.stop()

    asyncio.run(main())


def test_a_spawn_that_fails_is_reported_by_its_own_error_not_its_stops():
    """A member's setup fails and stopping its procs fails too (a proc that never came up
    answers nothing): the setup's error is the one raised, and the procs were stopped."""
    from meshrl.futures import stopped_on_failure

    class Procs:
        stops = 0

        async def stop(self):
            Procs.stops += 1
            raise TimeoutError("the stop timed out")

    async def spawn():
        async with stopped_on_failure(Procs(), timeout_s=1):
            raise ValueError("setup failed: no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        asyncio.run(spawn())
    assert Procs.stops == 1

    async def fine():
        async with stopped_on_failure(Procs(), timeout_s=1):
            return "up"

    assert asyncio.run(fine()) == "up" and Procs.stops == 1  # a member that came up keeps its procs


def test_starts_made_at_once_all_end_before_the_first_failure_is_raised():
    """RLLoop.start starts the policy's engines, the teacher, the scorers and each trained
    model at once (`all_ended`): a failed start is raised only once every other start has
    ended, so that the stop finds (and stops) what each got to; the first failure given wins."""
    from meshrl.controller.members import all_ended

    ended = []

    async def slow():
        await asyncio.sleep(0.05)
        ended.append("slow")

    async def fails(error: Exception, after_s: float):
        await asyncio.sleep(after_s)
        raise error

    with pytest.raises(RuntimeError, match="the engine failed"):
        asyncio.run(all_ended(fails(RuntimeError("the engine failed"), 0), slow(), fails(ValueError("later"), 0.01)))
    assert ended == ["slow"]
    asyncio.run(all_ended())  # nothing to start
    # engines sharing a GPU (trained models colocated on one) start one after another: the
    # second begins only once the first has ended, and a failure stops what follows unstarted
    from meshrl.controller.members import in_order

    order = []

    async def start(name: str, fail: bool = False):
        order.append(f"{name} begins")
        await asyncio.sleep(0.02)
        if fail:
            raise RuntimeError(f"{name} failed")
        order.append(f"{name} ends")

    asyncio.run(in_order(start("policy"), start("proposer")))
    assert order == ["policy begins", "policy ends", "proposer begins", "proposer ends"]
    order.clear()
    with pytest.raises(RuntimeError, match="policy failed"):
        asyncio.run(in_order(start("policy", fail=True), start("proposer")))
    assert order == ["policy begins"]


def test_a_member_on_several_procs_is_gone_when_any_of_its_own_procs_is():
    """A sharded PRM's replica (Member.own = its procs): the health check replaces it when any
    of its ranks' procs is gone, not only rank 0's; past `own`, pids are engine processes and
    do not count."""
    import os
    import socket
    import subprocess
    import sys

    import psutil

    from meshrl.controller.members import Member
    from meshrl.host import started

    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = (gone.pid, started(psutil.Process(gone.pid)))
    gone.kill()
    gone.wait()
    me = (os.getpid(), started())
    assert not Member(0, None, None, socket.gethostname(), [me, dead], own=2).alive()  # rank 1 gone
    assert Member(0, None, None, socket.gethostname(), [me, dead], own=1).alive()  # a proc of its engine: not its own
    assert Member(0, None, None, socket.gethostname(), [me, me], own=2).alive()


def test_a_live_proc_is_not_taken_for_gone_when_the_system_clock_steps(monkeypatch):
    """A proc's start time is kept in seconds since boot (`host.started`): stepping the system
    clock moves the epoch boot time psutil reads, and a live trainer polled every second
    during its step (`futures.unless_lost`) must not then read as gone and be replaced."""
    import psutil
    import psutil._pslinux as linux

    from meshrl.host import running_process, started

    me = (os.getpid(), started())
    boot = linux.boot_time()
    monkeypatch.setattr(linux, "boot_time", lambda: boot + 3600.0)  # the clock stepped an hour on
    assert abs(psutil.Process().create_time() - (boot + me[1])) > 3000  # the epoch start time moved with it
    assert running_process(*me) is not None and started() == pytest.approx(me[1], abs=1e-3)


def test_a_call_whose_proc_is_found_gone_ends_at_once_and_is_cancelled():
    """`futures.unless_lost`: a call still waiting when its proc is seen gone on its host (a
    message to a proc killed moments before fails only at Monarch's delivery timeout) ends in
    ProcLost at the next poll, the call cancelled; a call that answers gives its answer."""
    from meshrl.errors import ProcLost
    from meshrl.futures import unless_lost

    async def main():
        cancelled, gone = [], []

        async def waits():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        asyncio.get_running_loop().call_later(0.2, gone.append, True)
        with pytest.raises(ProcLost):
            await asyncio.wait_for(unless_lost(waits(), lambda: bool(gone), poll_s=0.05), 10)
        await asyncio.sleep(0)
        assert cancelled == [True]

        async def answers():
            await asyncio.sleep(0.1)
            return "answer"

        assert await unless_lost(answers(), lambda: False, poll_s=0.05) == "answer"

    asyncio.run(main())


def test_a_trained_models_trainer_lost_on_another_host_is_its_own_to_heal(tmp_path):
    """A trained model beside the policy whose trainer procs are on another host (no pid to
    poll here) is taken as lost when Monarch reports a proc lost and it does not answer
    (`TrainedModel.lost_remote`): a call outside the step (`RLLoop._healing`) then heals it,
    not the policy's trainer. One that answers is not healed (the lost proc was another's),
    nor is one whose error its trainer raised, alive."""
    import types

    from meshrl.controller.heal import local_proc, lost_a_proc
    from meshrl.controller.loop import RLLoop
    from meshrl.controller.partners import TrainedModel

    remote, here = [(4242, None)], [local_proc(os.getpid(), None)]
    lost, raised = RuntimeError("actor mesh failed: supervision: proc exited"), ValueError("disk full")
    assert lost_a_proc(remote, lost) and not lost_a_proc(remote, raised) and not lost_a_proc(here, lost)
    config = Config.from_dict({"models": [{"name": "proposer"}], "logging": {"run_dir": str(tmp_path)}})
    loop = RLLoop(config)
    model = TrainedModel(config, "proposer", None, None)
    answering = [False]

    async def answers(timeout_s=10.0):
        return answering[0]

    model.pids, model.trainer, healed, calls = remote, types.SimpleNamespace(answers=answers), [], []

    async def heal_outside_step(error, queue, num_groups, timeout_s, version):
        healed.append(version)

    async def save():
        calls.append(len(calls))
        if len(calls) % 2:
            raise lost
        return "saved"

    model.heal_outside_step = heal_outside_step
    loop.partners, loop.healer.pids, loop.queue, loop.version = [model], here, None, 3
    assert asyncio.run(model.lost_remote(lost)) and not asyncio.run(model.lost_remote(raised))
    assert asyncio.run(loop._healing("checkpoint", save)) == "saved" and healed == [3]
    answering[0] = True  # alive: the proc Monarch lost was not its trainer's
    with pytest.raises(RuntimeError, match="supervision"):
        asyncio.run(loop._healing("checkpoint", save))
    assert healed == [3]


def test_all_or_none_stops_the_others_when_one_fails():
    """asyncio.gather leaves the other awaitables running after one raises: a game's sibling
    turns generated on for an episode that had failed, and could join its threads."""
    from meshrl.futures import all_or_none

    stopped = []

    async def sibling():
        try:
            await asyncio.sleep(60)
        finally:
            stopped.append("sibling")

    async def fails():
        await asyncio.sleep(0.01)
        raise ValueError("a turn failed")

    async def main():
        with pytest.raises(ValueError, match="a turn failed"):
            await all_or_none(sibling(), fails())
        return list(stopped)  # before anything else runs

    assert asyncio.run(main()) == ["sibling"]
    assert asyncio.run(all_or_none(asyncio.sleep(0, result=1), asyncio.sleep(0, result=2))) == [1, 2]


def test_a_last_evaluation_that_never_ends_still_leaves_the_checkpoint_and_export(tmp_path, monkeypatch, caplog):
    """Session.finish waited for the last step's evaluation, which waits for the one before it,
    within one evaluation's bound: its timeout ended `meshrl run` as failed after training had
    finished, with no final checkpoint or export."""
    import types

    import meshrl.api as api
    from meshrl.controller.live import Live
    import meshrl.controller.evaluation as evaluation

    monkeypatch.setattr(evaluation, "eval_timeout_s", lambda config, n: -29.8)  # twice it, plus 60: 0.4 s

    class Loop:
        version, run_dir, history, partners = 3, str(tmp_path), [], []

        async def checkpoint(self):
            return "ckpt"

        async def export(self):
            return "hf"

    async def never(version=None):
        await asyncio.sleep(3600)

    loop = Loop()
    loop.evaluations = types.SimpleNamespace(finish=never)
    session = object.__new__(api.Session)
    session.config = Config.from_dict({"logging": {"plot": False}})
    session._live, session._stopped, session._interrupted = Live(), False, None
    session._thread_loop, session._live.run = session._live.thread_loop, loop
    with caplog.at_level("WARNING", logger="meshrl"):
        result = session.finish()
    assert (result.checkpoint, result.hf_export) == ("ckpt", "hf") and "the last evaluation did not finish" in caplog.text
    session._live.thread_loop.call_soon_threadsafe(session._live.thread_loop.stop)


def test_a_with_block_left_by_a_signal_checkpoints_first(tmp_path, capsys):
    """`with meshrl.Session(...) as s:` left by Ctrl-C or a scheduler's SIGTERM stopped the run
    with no checkpoint (meshrl.run writes one): a preempted script lost everything since its
    last periodic checkpoint. The user's own sys.exit, or any other error, only stops it."""
    import types

    import meshrl.api as api

    calls = []
    session = object.__new__(api.Session)
    session.config, session._stopped = Config.from_dict({"trainer": {"interrupt_checkpoint_timeout_s": 42}}), False
    session._live = types.SimpleNamespace(run=types.SimpleNamespace(version=7, run_dir=str(tmp_path)))
    session._need = lambda: session._live.run
    session.save_on_interrupt = lambda timeout_s: calls.append(("checkpoint", timeout_s))
    session.stop = lambda: calls.append("stop")
    for error, saved in ((KeyboardInterrupt(), True), (SystemExit(143), True), (SystemExit(0), False), (ValueError("mine"), False)):
        calls.clear()
        session.__exit__(type(error), error, None)
        assert calls == ([("checkpoint", 42.0)] if saved else []) + ["stop"], (error, calls)
    assert capsys.readouterr().err.count("meshrl: interrupted at step 7: no checkpoint was written yet") == 2


def test_a_step_ctrl_c_left_running_is_waited_for_until_it_ends(tmp_path, caplog):
    """Session.step after a Ctrl-C waits for the step left running; a second Ctrl-C in that wait
    forgot it, and the next step ran beside it. Its failure went unreported, and a wait that
    outran its bound started a step beside it too."""
    import concurrent.futures
    import types

    import meshrl.api as api
    from meshrl.controller.live import Live

    class Loop:
        version, steps, collect, generators = 0, 0, types.SimpleNamespace(last_step_end=0.0), types.SimpleNamespace(paused=False)
        checkpoints: list = []

        async def check_health(self):
            return None

        async def step(self):
            self.steps += 1
            self.version += 1
            return {"step": self.version}

        async def checkpoint(self):
            self.checkpoints.append(self.version)
            return f"step_{self.version}"

    session = object.__new__(api.Session)
    session.config = Config.from_dict({})
    session._live, session._stopped, loop = Live(), False, Loop()
    session._thread_loop, session._live.run = session._live.thread_loop, loop
    session._step_bound = lambda: 0.2
    ctrl_c = types.SimpleNamespace(result=lambda timeout: (_ for _ in ()).throw(KeyboardInterrupt()), done=lambda: False)
    session._interrupted = ctrl_c
    with pytest.raises(KeyboardInterrupt):
        session.step(1)
    assert session._interrupted is ctrl_c and loop.steps == 0  # still the one to wait for
    session._interrupted = concurrent.futures.Future()  # never ends
    with pytest.raises(TimeoutError, match="still runs"):
        session.step(1)
    assert loop.steps == 0
    failed = concurrent.futures.Future()
    failed.set_exception(TrainerFailed("trainer: its proc died"))
    session._interrupted = failed
    with caplog.at_level("WARNING", logger="meshrl"):
        assert session.step(1) == [{"step": 1}]
    assert "the step Ctrl-C left running failed: trainer: its proc died" in caplog.text and session._interrupted is None
    assert loop.collect.last_step_end > 0  # the first step's wall time counts from the call, not from the cell before
    # a checkpoint (an export, a finish, a knob) after a Ctrl-C waits for that step as well: it ran beside it
    ended, session._step_bound = concurrent.futures.Future(), lambda: 60
    session._interrupted = ended
    threading.Timer(0.1, lambda: (setattr(loop, "version", loop.version + 1), ended.set_result({"step": loop.version}))).start()
    assert session.checkpoint() == "step_2" and loop.checkpoints == [2] and session._interrupted is None
    # paused: a step would wait for its batch until buffer.get_timeout_s, then blame the generators
    loop.generators.paused = True
    with pytest.raises(RuntimeError, match="generation is paused: call resume"):
        session.step(1)
    assert loop.steps == 1
    session._live.thread_loop.call_soon_threadsafe(session._live.thread_loop.stop)


def test_a_shutdown_past_its_bound_runs_its_cleanup_and_an_endless_one_keeps_the_directory_locked(monkeypatch, tmp_path, capsys):
    """Session.stop on a shutdown past SHUTDOWN_S cancelled it and stopped the loop thread at
    once: the cancel was never delivered, so none of its cleanup ran (the job's procs kept
    their GPUs), and the run directory's lock was let go with them alive. Now the cancelled
    shutdown runs its `finally`s; one that does not end even then keeps the lock."""
    from meshrl.controller import live

    monkeypatch.setattr(live, "SHUTDOWN_S", 0.3)
    monkeypatch.setattr(live, "CANCEL_S", 10.0)
    cleaned = []

    class Hung:
        run_dir = str(tmp_path)

        async def shutdown(self):
            try:
                await asyncio.sleep(3600)
            finally:
                cleaned.append("job killed")

    released = []

    class Endless(Hung):
        async def shutdown(self):
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if released:
                        raise

    for loop, ends in ((Hung(), True), (Endless(), False)):
        if not ends:
            monkeypatch.setattr(live, "CANCEL_S", 0.3)
        held = live.Live()
        held.run, held.held = loop, os.open(tmp_path, os.O_RDONLY)
        held.stop()
        assert (held.held is None) == ends
    released.append(True)  # (the endless one ended, on its stopped loop, so that no task is left pending at exit)
    pending = asyncio.all_tasks(held.thread_loop)
    for task in pending:
        task.cancel()
    held.thread_loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    os.close(held.held)
    assert cleaned == ["job killed"] and "its directory stays locked until this Python exits" in capsys.readouterr().err


def test_a_shutdown_cancels_a_step_left_running_before_it_stops_anything():
    """A Session stopped (or dropped, or at exit) after Ctrl-C left a step running: the shutdown
    ran beside it, whose health checks could respawn what the shutdown had just stopped."""
    import types

    from meshrl.controller.loop import RLLoop

    order = []
    loop = object.__new__(RLLoop)
    quiet = types.SimpleNamespace(quiet=lambda: None, restore=lambda: None)
    healer = types.SimpleNamespace(stops=lambda: order.append("stopping meshes") or [], kill_procs=lambda: None)
    loop.__dict__.update(mesh_failures=quiet, collect=None, evaluations=None, _update_task=None, partners=[], workers=None, healer=healer)
    loop.__dict__.update(generators=None, teacher=None, scorers=None, served={})

    async def step():
        loop._stepping = asyncio.current_task()
        try:
            await asyncio.sleep(3600)
        finally:
            order.append("step ended")

    async def main():
        stepping = asyncio.ensure_future(step())
        await asyncio.sleep(0.05)
        await asyncio.wait_for(loop.shutdown(), 30)
        return stepping

    assert asyncio.run(main()).cancelled() and order == ["step ended", "stopping meshes"]


def test_a_colocated_step_without_a_full_batch_leaves_the_engines_awake_and_times_out_once():
    """placement=colocate, no complete batch within buffer.get_timeout_s: a BatchTimeout (the
    loop's 'rollouts are not arriving' line), no engine put to sleep, where the trainer's call
    then waited as long again beside awake engines (on a shared GPU, its memory theirs)."""
    from types import SimpleNamespace

    from meshrl.controller.colocate import sleep_for_trainer

    config = Config.from_dict({"placement": "colocate", "buffer": {"get_timeout_s": 0.1}})
    slept = []

    async def wait_ready(groups, timeout):
        return False

    queue = SimpleNamespace(wait_ready=SimpleNamespace(call_one=wait_ready))
    pool = SimpleNamespace(sleep=lambda keep_weights: slept.append(keep_weights) or asyncio.sleep(0))

    async def watching(future):
        return await future

    with pytest.raises(BatchTimeout, match="no complete batch of") as info:
        asyncio.run(sleep_for_trainer(config, SimpleNamespace(layout="colocated"), queue, [pool], watching, 0.0))
    assert find(info.value, BatchTimeout) is info.value and slept == []


def test_a_colocated_gpu_trainer_frees_its_memory_before_the_engines_load_the_new_version():
    """On a shared GPU the engines load each version asleep, which gives them their weights
    back: they loaded it before the trainer freed its gradients, AdamW state and cached blocks,
    which the memory plan never counted (a plan that just fit the step ran out of memory)."""
    from types import SimpleNamespace

    from meshrl.controller.colocate import after_step

    calls = []

    async def record(what, value=None):
        calls.append(what)
        return value

    trainer = SimpleNamespace(release_memory=lambda offload: record("trainer frees", {}))
    pool = SimpleNamespace(wake=lambda: record("engines wake"))
    loop = SimpleNamespace(
        config=Config.from_dict({"placement": "colocate"}),
        alloc=SimpleNamespace(plan=SimpleNamespace(layout="colocated")),
        trainer=trainer,
        partners=[],
        version=3,
        _offload_optimizer=False,
        _update_generators=lambda version, weights_id: record(f"engines load {version}", 0.0),
        _pools=lambda: [pool],
    )
    out = asyncio.run(after_step(loop, None))
    assert calls == ["trainer frees", "engines load 3", "engines wake"] and {"colocate/load_s", "colocate/wake_s"} <= set(out)


def test_a_failed_start_lets_go_of_its_run_directory(tmp_path, monkeypatch):
    """A start that fails (a generator that never starts) stops what it started: its run
    directory is free again, so a new Session there (a notebook's retry while the failed one
    stays referenced by the traceback) starts instead of being refused as a live run's."""
    import meshrl.controller.loop
    from meshrl import api

    class Failing:
        def __init__(self, config, resume=False, reward_fn=None):
            pass

        async def __aenter__(self):
            raise RuntimeError("the generator did not start")

    monkeypatch.setattr(meshrl.controller.loop, "RLLoop", Failing)
    config = {"steps": 1, "logging": {"run_dir": str(tmp_path / "run"), "progress": False}}
    first, second = api.Session(config), api.Session(config)
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            first.start()
        with pytest.raises(RuntimeError, match="did not start"):  # not "is a live run's"
            second.start()
    finally:
        first.stop()
        second.stop()


def test_sessions_put_back_the_signal_handlers_they_replaced_when_the_last_stops(tmp_path, monkeypatch):
    """A Session made SIGTERM and SIGHUP raise SystemExit (its run's cleanup) and left them so
    for the rest of the program; the handlers now come back when the last live Session (or
    launcher) stops, and not while another still needs its cleanup."""
    import signal

    from meshrl import api
    from meshrl.launch import signals
    from meshrl.launch.signals import _raise_system_exit

    monkeypatch.setattr(signals, "_HELD", {"count": 0, "replaced": {}})  # none held by this process's earlier Sessions
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        first = api.Session({"logging": {"run_dir": str(tmp_path / "a")}})
        second = api.Session({"logging": {"run_dir": str(tmp_path / "b")}})
        assert signal.getsignal(signal.SIGTERM) is _raise_system_exit
        first.stop()
        assert signal.getsignal(signal.SIGTERM) is _raise_system_exit  # the second's run still needs it
        second.stop()
        second.stop()  # twice: nothing more
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_in_the_last_evaluation_leaves_the_checkpoint_the_interrupts_time(tmp_path):
    """SIGTERM (a Slurm time limit) during the evaluation `finish` runs before the final
    checkpoint: it was taken for a step in flight and waited for, half the interrupt's budget
    and then the rest, and the checkpoint got a second. The evaluation is cancelled (a resume
    runs it again) and the checkpoint is written at once."""
    import signal
    import time
    import types

    import meshrl

    session = meshrl.Session({"logging": {"run_dir": str(tmp_path)}})

    async def forever(goal):
        await asyncio.sleep(3600)

    async def checkpoint(heal=True):
        return "checkpoints/step_000003_loop_state.pt"

    async def shutdown():
        pass

    session._live.run = types.SimpleNamespace(version=3, evaluations=types.SimpleNamespace(finish=forever), checkpoint=checkpoint, shutdown=shutdown)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(SystemExit):
            session.finish()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    try:
        t0 = time.monotonic()
        assert session.save_on_interrupt(8.0) == "checkpoints/step_000003_loop_state.pt"
        assert time.monotonic() - t0 < 3.0
    finally:
        session.stop()


def test_session_generate_asks_for_the_steps_weights_and_a_failed_pause_leaves_none_paused(tmp_path):
    """`Session.generate` asked replica 0 for version 0 or newer, so right after a step it sampled
    the weights before it (the update runs in the background); and a pause that failed on one
    replica left the pool marked paused, `generate` refused, while the others were paused."""
    import types

    from meshrl.controller import control
    from meshrl.generator.engine import RequestResult
    from meshrl.tokenizer import build_char_tokenizer

    tokenizer_dir = build_char_tokenizer(tmp_path / "tokenizer")
    asked, resumed = [], []

    async def generate(ids, budget, temperature, min_version):
        asked.append(min_version)
        return RequestResult([5], [-0.5], [min_version], "stop")

    async def pause():
        raise RuntimeError("replica 1 is gone")

    async def resume():
        resumed.append(True)

    replicas = [
        types.SimpleNamespace(
            actor=types.SimpleNamespace(
                generate=types.SimpleNamespace(call_one=generate),
                pause_generation=types.SimpleNamespace(call_one=pause),
                resume_generation=types.SimpleNamespace(call_one=resume),
            )
        )
    ]
    loop = types.SimpleNamespace(
        version=7,
        tokenizer_dir=tokenizer_dir,
        config=Config.from_dict({"generator": {"group_size": 2}}),
        generators=types.SimpleNamespace(replicas=replicas, paused=False),
    )
    assert len(asyncio.run(control.generate_text(loop, ["q:"]))[0]) == 2 and asked == [7, 7]
    with pytest.raises(RuntimeError, match="gone"):
        asyncio.run(control.pause_generation(loop))
    assert loop.generators.paused is False and resumed == [True]


def test_a_replacement_that_fails_between_steps_is_tried_again_not_the_runs_end(tmp_path):
    """The health check between two steps re-raised a replacement's failure (a new engine that
    found the dead one's GPU memory not yet freed), and the run ended without its checkpoint;
    during a step the same failure was logged and tried again. Now between steps too."""
    import types

    from meshrl import api

    session = api.Session({"logging": {"run_dir": str(tmp_path)}})
    checks = []

    async def check_health():
        checks.append(True)
        if len(checks) == 1:
            raise RuntimeError("generator replica 1 failed to start: not enough GPU memory")

    async def step():
        loop.version += 1
        return {"reward/mean": 1.0}

    async def shutdown():
        pass

    loop = types.SimpleNamespace(
        version=0,
        check_health=check_health,
        step=step,
        shutdown=shutdown,
        collect=types.SimpleNamespace(last_step_end=0.0),
        generators=types.SimpleNamespace(paused=False),
    )
    session._live.run = loop
    try:
        assert session.step(2) == [{"reward/mean": 1.0}] * 2 and len(checks) == 2
    finally:
        session.stop()


def test_replicas_a_scale_added_load_their_first_version_whatever_failed_after_them():
    """Scaling 1 -> 3 with the third spawn failing left the second in the pool and in the
    workers' lists without its first version: each of its turns waited out the version gate."""
    import types

    from meshrl.controller.replicas import GeneratorPool

    pool = GeneratorPool.__new__(GeneratorPool)
    loaded, spawned = [], []

    async def spawn(index):
        if spawned:
            raise RuntimeError("its proc did not start")
        spawned.append(index)
        return types.SimpleNamespace(index=index)

    async def first_load(r, version):
        loaded.append((r.index, version))

    async def on_change():
        pass

    pool.alloc = types.SimpleNamespace(plan=types.SimpleNamespace(slots=[], layout="cpu"))
    pool.teacher, pool.model, pool.frozen, pool._lock, pool.replicas = None, "policy", False, asyncio.Lock(), [types.SimpleNamespace(index=0)]
    pool.spawn, pool._first_load, pool.on_change = spawn, first_load, on_change
    with pytest.raises(RuntimeError, match="did not start"):
        asyncio.run(pool.scale(3, 4))
    assert [r.index for r in pool.replicas] == [0, 1] and loaded == [(1, 4)]
    # the first added one's load failing leaves the next its own load (the failed one left the pool)
    spawned.clear()
    pool.spawn = lambda index: asyncio.sleep(0, types.SimpleNamespace(index=index))

    async def first_load_failing_once(r, version):
        loaded.append((r.index, version))
        if len(loaded) == 2:
            raise RuntimeError("its weights did not load")

    pool._first_load = first_load_failing_once
    with pytest.raises(RuntimeError, match="did not load"):
        asyncio.run(pool.scale(4, 5))
    assert loaded[1:] == [(2, 5), (3, 5)]


def test_a_replica_whose_spawn_fails_after_its_engine_started_leaves_no_engine_process():
    """A weight-sync key that timed out after `setup` had started the engine: the proc was
    stopped, and its engine processes (vLLM's, children of it) lived on, holding its GPU."""
    import socket
    import subprocess
    import sys
    import types

    import psutil

    from meshrl.controller.replicas import GeneratorPool
    from meshrl.host import started

    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:

        async def setup(*args):
            return {"processes": {"host": socket.gethostname(), "pids": [(engine.pid, started(psutil.Process(engine.pid)))]}}

        async def key():
            raise TimeoutError("weight_sync_key did not answer")

        async def stop():
            pass

        pool = GeneratorPool.__new__(GeneratorPool)
        pool.config, pool.checkpoint_dir, pool.checkpoint_version, pool.teacher, pool.frozen = Config(), "/ckpt", 0, False, False
        actor = types.SimpleNamespace(setup=types.SimpleNamespace(call_one=setup), weight_sync_key=types.SimpleNamespace(call_one=key))
        pool._warm = {0: (types.SimpleNamespace(stop=stop), actor)}
        with pytest.raises(TimeoutError, match="weight_sync_key"):
            asyncio.run(pool.spawn(0))
        assert engine.wait(timeout=30) == -9
    finally:
        engine.kill()


def test_a_generator_sync_cut_short_by_its_bound_leaves_the_update_going():
    """Session.sync_generators past its bound (weight_sync.timeout_s + 120, where one replica's
    update may take update_bound_s, each model's in turn) cancelled the update itself: its
    replicas were left behind, to be taken for dead. Now the bound covers every model's update
    and a replacement, and a call cut short leaves the updates to the next step."""

    from meshrl.controller.control import wait_for_generators

    async def update(done):
        await asyncio.sleep(0.5)
        done.append(True)
        return 0.5

    async def main():
        done, partner_done = [], []

        class Partner:  # (as controller/partners.py's and loop.py's own)
            pending_update = asyncio.ensure_future(update(partner_done))

            def forget_update(self):
                self.pending_update = None

        class Loop:
            _update_task, partners = asyncio.ensure_future(update(done)), [Partner()]

            async def _finish_update(self):
                task, self._update_task = self._update_task, None
                return await task

        loop = Loop()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(wait_for_generators(loop), 0.1)
        assert loop._update_task is not None and not loop._update_task.cancelled()  # the next step's to finish
        await wait_for_generators(loop)
        return done, partner_done, loop

    done, partner_done, loop = asyncio.run(main())
    assert done == partner_done == [True] and loop._update_task is None and loop.partners[0].pending_update is None
