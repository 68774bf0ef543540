"""Contracts with user code (docs/contracts.md): envs, reward functions and data checked
before the run (one line, exit 2) and on every call during it; failures told in one line;
the failure breaker. The envs and rewards below are the user's code, from outside meshrl."""

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

from meshrl.cli import main
from meshrl.config import Config, ConfigError
from meshrl.data import DataError, check_source, load_records
from meshrl.errors import UserCodeError, describe, one_line
from meshrl.queue import EpisodeQueue
from meshrl.rollout.env import ContractError, ModelTurn, StepResult, as_observation, as_reward, as_step_result, call_bounded
from meshrl.agent.summary import summarize
from meshrl.agent.worker import RolloutWorker
from tests.conftest import ScriptedGenerator, replies_in_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = "tests/test_contracts.py"


def line_of(fn) -> int:
    return fn.__code__.co_firstlineno


# ---- the user's code --------------------------------------------------------------------------
class GymDigitsEnv:
    """The digits task as a gym-style env: `reset` gives gymnasium's (observation, info),
    `step` the 4-tuple (observation, reward, done, info)."""

    def reset(self, sample):
        return sample["prompt"], {}

    def step(self, turn):
        return None, sum(ch.isdigit() for ch in turn.text[:8]) / 8, True, {"seen": len(turn.text)}


class SlowStepEnv(GymDigitsEnv):
    """A step that takes a minute on the record asking for it; counts that record's closes."""

    closed = 0

    async def step(self, turn):
        if self.prompt == "slow:":
            await asyncio.sleep(60)
        return super().step(turn)

    def reset(self, sample):
        self.prompt = sample["prompt"]
        return super().reset(sample)

    def close(self):
        SlowStepEnv.closed += getattr(self, "prompt", None) == "slow:"


class GymnasiumEnv:
    """Two turns, gymnasium's 5-tuple (observation, reward, terminated, truncated, info)."""

    def reset(self, sample):
        return sample["prompt"]

    def step(self, turn):
        if turn.index == 0:
            return "again:", 0.25, False, False, {}
        return "", 0.5, False, True, None


class DictStepEnv:
    def reset(self, sample):
        return sample["prompt"]

    def step(self, turn):
        return {"reward": 1.0, "done": True}


class IntResetEnv:
    def reset(self, sample):
        return 3

    def step(self, turn):
        return StepResult(reward=1.0)


class StepRaisesEnv:
    """Resets fine, and every step divides by zero."""

    def reset(self, sample):
        return sample["prompt"]

    def step(self, turn):
        return len(turn.text) / 0


class NoStep:
    def reset(self, sample):
        return sample["prompt"]


class OutOfVocabularyEnv:
    """Answers the model with token ids past the model's vocabulary."""

    def reset(self, sample):
        return sample["prompt"]

    def step(self, turn):
        return [5, 100000], 0.0, False, {}


class BudgetEnv:
    """The next turn's budget from the record: `max_new_tokens` (-1, or 0)."""

    def reset(self, sample):
        self.max_new_tokens = sample["budget"]
        return sample["prompt"]

    def step(self, turn):
        return StepResult(reward=1.0, done=True)


class SlowToMakeEnv(GymDigitsEnv):
    """A constructor that blocks (a dataset it loads, a server it connects to): `made` says how long."""

    made = 0.5
    closed = 0

    def __init__(self):
        time.sleep(SlowToMakeEnv.made)

    def close(self):
        SlowToMakeEnv.closed += 1


class LoopInConstructorEnv(GymDigitsEnv):
    """A constructor that needs the running event loop (an aiohttp session, say): a worker makes
    its env on a thread of its own, where there is none."""

    def __init__(self):
        asyncio.get_running_loop()


def reward_text(prompt, response, sample):
    return "1.0"


def reward_nan(prompt, response, sample):
    return math.nan


def reward_raises(prompt, response, sample):
    return {}["score"]


async def reward_slow(prompt, response, sample):
    await asyncio.sleep(30)
    return 1.0


def reward_after_a_while(prompt, response, sample):
    time.sleep(1.5)
    return 1.0


def reward_two_args(prompt, response):
    return 1.0


def bad_policy(groups, n, rng):
    return [0] * n  # the same group n times


# ---- the env contract, one call at a time -------------------------------------------------------
def test_step_takes_a_step_result_or_either_gym_tuple():
    env = GymDigitsEnv()
    assert as_step_result(env.step(ModelTurn("12ab", [], "stop")), env) == StepResult(None, 0.25, True, {"seen": 4})
    env = GymnasiumEnv()
    assert as_step_result(env.step(ModelTurn("", [], "stop", 0)), env) == StepResult("again:", 0.25, False, {})
    assert as_step_result(env.step(ModelTurn("", [], "stop", 1)), env) == StepResult("", 0.5, True, {}, truncated=True)  # truncated: done
    assert as_step_result(("", 0.5, True, True, None), env) == StepResult("", 0.5, True, {})  # terminated wins
    assert as_step_result(("", 0.5, True, {"TimeLimit.truncated": True}), env).truncated  # gym's TimeLimit
    result = StepResult([{"role": "user", "content": "+"}], 1, False, {"tool_calls": 1})
    assert as_step_result(result, env) == result
    import numpy as np

    assert as_step_result((None, np.float32(0.5), np.bool_(True), {}), env).reward == 0.5


@pytest.mark.parametrize(
    "returned, words",
    [
        ({"reward": 1.0, "done": True}, "step returned {'reward': 1.0, 'done': True} (dict): expected a StepResult, the gym tuple"),
        ((None, 1.0, True), "step returned (None, 1.0, True) (tuple): expected a StepResult"),
        (None, "step returned None (NoneType)"),
        ((None, "1", True, {}), "step's reward returned '1' (str): expected a finite number"),
        ((None, math.inf, True, {}), "step's reward returned inf: expected a finite number"),
        ((None, 1.0, "yes", {}), "step returned done='yes' (str): expected a bool"),
        ((None, 1.0, True, []), "step returned info=[] (list): expected a dict or None"),
        ((None, 1.0, False, {}), "step returned done=False with observation None (NoneType): expected text"),
        ((None, 1.0, 2, False, {}), "terminated=2 (int), truncated=False (bool): expected bools"),
    ],
)
def test_a_step_that_breaks_the_contract_is_one_line_naming_env_method_value_and_want(returned, words):
    env = GymDigitsEnv()
    with pytest.raises(ContractError) as info:
        as_step_result(returned, env)
    message = str(info.value)
    assert message.startswith("env tests.test_contracts:GymDigitsEnv: ") and words in message and "\n" not in message
    assert info.value.where == f"{HERE}:{line_of(GymDigitsEnv.step)}"


def test_reset_takes_an_observation_or_gymnasiums_pair():
    env = GymDigitsEnv()
    for obs in ("q:", [{"role": "user", "content": "hi"}], [1, 2, 3]):
        assert as_observation(obs, env) == obs
        assert as_observation((obs, {"seed": 1}), env) == obs
    for bad in (3, ("q:", "info"), ("q:", {}, {}), {"prompt": "q:"}, [("q", 1)]):
        with pytest.raises(
            ContractError,
            match=r"^env tests.test_contracts:GymDigitsEnv: reset returned .* expected text, "
            r"a list of chat messages .* or gymnasium's \(observation, info\)$",
        ):
            as_observation(bad, env)
    for empty in ("", [], ("", {})):  # a data row's empty prompt, an env's: the episode fails, not the replica
        with pytest.raises(ContractError, match="reset returned an empty observation: the first turn needs a prompt") as info:
            as_observation(empty, env)
        assert info.value.where == f"{HERE}:{line_of(GymDigitsEnv.reset)}"


def test_a_reward_is_a_finite_number():
    assert as_reward(True, "r") == 1.0 and as_reward(3, "r") == 3.0
    import torch

    assert as_reward(torch.tensor(0.5), "r") == 0.5
    for bad, words in (
        ("0.5", "returned '0.5' (str)"),
        (None, "returned None"),
        (math.nan, "returned nan"),
        ([1.0], "returned [1.0] (list)"),
        (torch.ones(2), "(Tensor)"),
    ):
        with pytest.raises(ContractError, match=re.escape(words)):
            as_reward(bad, "reward function f")


def test_each_reward_call_is_under_the_contract():
    from meshrl.rollout.env import SingleTurnEnv

    def one_step(fn, timeout_s=5.0):
        env = SingleTurnEnv(fn, timeout_s)
        asyncio.run(env.reset({"prompt": "q:", "answer": ""}))
        with pytest.raises(Exception) as info:
            asyncio.run(env.step(ModelTurn("a", [], "stop")))
        return describe(info.value, "worker-0")

    assert one_step(reward_two_args) == (
        f"worker-0: TypeError: reward_two_args() takes 2 positional arguments but 3 were given ({HERE}:{line_of(reward_two_args)})"
    )  # the call itself failed: the function's line
    assert one_step(reward_nan) == (
        f"worker-0: ContractError: reward function tests.test_contracts:reward_nan returned nan: expected a finite number ({HERE}:{line_of(reward_nan)})"
    )
    assert one_step(reward_slow, 0.2).startswith(  # (then this test's own line: it is the caller here)
        "worker-0: TimeoutError: reward function tests.test_contracts:reward_slow took longer than scoring.timeout_s=0.2s"
    )


# ---- one line for a failure of the user's code ----------------------------------------------------
def test_calls_that_never_return_do_not_hold_up_later_ones():
    """A sync reward or env call that hangs is abandoned at its bound; in asyncio's shared
    thread pool a handful of them left every later call queued behind them, to time out too."""
    import threading

    release = threading.Event()

    async def main():
        for _ in range(3 * ((os.cpu_count() or 1) + 4)):  # more than the shared pool's threads
            with pytest.raises(asyncio.TimeoutError):
                await call_bounded(lambda: release.wait(20), timeout=0.01)
        return await call_bounded(lambda: 7, timeout=5)

    try:
        assert asyncio.run(main()) == 7
    finally:
        release.set()


def test_a_calls_bound_starts_when_it_runs_not_while_it_waits_for_a_thread(monkeypatch):
    """More sync calls at once than env.LIVE_CALLS (a slow HTTP judge at scale): those waiting
    for a thread are not timed out for it, where each call well within its bound failed as
    slower than scoring.timeout_s once the queue ahead of it was long."""
    import meshrl.rollout.env as env

    monkeypatch.setattr(env, "LIVE_CALLS", 2)

    async def main():
        return await asyncio.gather(*(call_bounded(lambda i=i: time.sleep(0.2) or i, timeout=1.0) for i in range(12)))

    assert asyncio.run(main()) == list(range(12))  # six rounds of two: 1.2 s of waiting for the last


def test_user_code_that_calls_exit_fails_its_call_not_the_worker():
    """A reward, env method or tool that calls sys.exit() (argparse, model-written code run by a
    tool): its call fails with a RuntimeError, where SystemExit left the worker's event loop and
    ended its proc, and the record requeued ended the next one too. Sync or async alike."""
    import sys

    async def exits():
        sys.exit(3)

    async def main():
        for fn in (sys.exit, exits, lambda: exits()):
            with pytest.raises(RuntimeError, match=r"called exit\("):
                await call_bounded(fn, timeout=5)
        return await call_bounded(lambda: 7, timeout=5)  # the loop turns on

    assert asyncio.run(main()) == 7


def test_stop_iteration_or_a_cancelled_await_in_user_code_fails_its_call_at_once():
    """A sync call's StopIteration (`next()` run dry) cannot be handed to a future: the call read
    as timed out at its whole bound. An async call that awaited a cancelled future raised
    CancelledError past the worker's `except Exception`: its group was never delivered nor
    handed out again. Each fails its call at once, naming the file and line; the call's own
    bound and a cancelled caller still cancel it."""

    def dry():
        return next(iter([]))

    async def awaits_cancelled():
        done = asyncio.get_running_loop().create_future()
        done.cancel()
        await done

    async def main():
        for fn, name in ((dry, "StopIteration"), (awaits_cancelled, "CancelledError")):
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match=f"raised {name}") as failed:
                await call_bounded(fn, timeout=5)
            assert time.monotonic() - t0 < 2 and failed.value.where.startswith(f"{HERE}:")
        with pytest.raises(TimeoutError):
            await call_bounded(asyncio.sleep, 5, timeout=0.1)
        task = asyncio.create_task(call_bounded(asyncio.sleep, 5, timeout=5))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_failure_is_one_line_with_the_users_file_and_line_and_the_log():
    try:
        reward_raises("p", "r", {})
    except KeyError as e:
        line = describe(e, "worker-3", "/runs/x/logs/worker-3.log")
    assert line == f"worker-3: KeyError: 'score' ({HERE}:{line_of(reward_raises) + 1}; log: /runs/x/logs/worker-3.log)"
    # carried across an actor boundary: the controller finds it inside Monarch's wrapper
    from monarch.actor import ActorError

    assert one_line(ActorError(UserCodeError(line))) == line
    assert one_line(ActorError(ActorError(UserCodeError(line)))) == line
    assert one_line(RuntimeError("plain")) is None


# ---- the rollout worker applies the contract to every call ------------------------------------------
@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.delenv("MESHRL_VERBOSE", raising=False)  # the user's default: each role's output in its log


def play(tokenizer_dir, env: str, replies: list[str], **rollout):
    config = Config.from_dict(
        {"data": {"source": "task:digits"}, "rollout": {"env": f"tests.test_contracts:{env}", **rollout}, "logging": {"run_dir": "/runs/x"}}
    )
    worker = RolloutWorker(config, tokenizer_dir, worker=2)
    worker.set_generators([ScriptedGenerator(replies_in_order(worker.tokenizer, replies))])
    return worker, asyncio.run(worker.play_episode(0, 0, {"prompt": "q:", "answer": ""}, 0, 0))


def test_a_sampled_id_past_the_tokenizers_reads_as_a_replacement_character(tokenizer_dir, quiet):
    """The default model has 128 rows for the character tokenizer's 99 ids, and an untrained one
    samples the others; the tokenizer dropped them, so `qqq` plus one such id read as `qqq` and
    earned task:count's exact match."""
    from meshrl.tokenizer import load_tokenizer, reply_text

    tok = load_tokenizer(tokenizer_dir)
    q = tok.encode("q", add_special_tokens=False)
    assert reply_text(tok, q * 3 + [120] + q) == "qqq\ufffdq" and reply_text(tok, q + [tok.eos_token_id]) == "q"
    config = Config.from_dict({"data": {"source": "task:count"}, "logging": {"run_dir": "/runs/x"}})
    worker = RolloutWorker(config, tokenizer_dir, worker=2)
    worker.set_generators([ScriptedGenerator(lambda ids: q * 3 + [120, tok.eos_token_id])])
    ep = asyncio.run(worker.play_episode(0, 0, {"prompt": "q*3=", "answer": "qqq"}, 0, 0))
    assert ep.failure is None and ep.reward == 0.375  # 3 of 4 characters right, halved: not the exact match


def test_worker_plays_gym_envs_and_fails_contract_breaks_in_one_line(tokenizer_dir, quiet):
    _, ep = play(tokenizer_dir, "GymDigitsEnv", ["1234"])
    assert ep.finish_reason == "stop" and ep.reward == 0.5 and ep.failure is None
    _, ep = play(tokenizer_dir, "GymnasiumEnv", ["a", "b"])
    assert ep.finish_reason == "length" and ep.reward == 0.75 and len(ep.model_turns) == 2  # truncated by the env: out of turns
    worker, ep = play(tokenizer_dir, "DictStepEnv", ["a"])
    assert ep.finish_reason == "failed" and ep.reward == 0.0
    assert ep.failure == (
        "worker-2: ContractError: env tests.test_contracts:DictStepEnv: step returned {'reward': 1.0, 'done': True} (dict): "
        "expected a StepResult, the gym tuple (observation, reward, done, info) or gymnasium's "
        f"(observation, reward, terminated, truncated, info) ({HERE}:{line_of(DictStepEnv.step)}; log: /runs/x/logs/worker-2.log)"
    )
    _, ep = play(tokenizer_dir, "StepRaisesEnv", ["a"])
    assert ep.failure == f"worker-2: ZeroDivisionError: division by zero ({HERE}:{line_of(StepRaisesEnv.step) + 1}; log: /runs/x/logs/worker-2.log)"


def test_an_envs_bad_ids_or_budget_fail_its_episode_not_a_generator(tokenizer_dir, quiet):
    """Token ids past the vocabulary, or a negative budget, reached the generator, which refused
    the request as a replica's failure: the replica was held and the group played again. They
    fail the episode now; a budget of 0 ends it, as the model's length would."""
    _, ep = play(tokenizer_dir, "OutOfVocabularyEnv", ["a", "b"], max_turns=2)
    assert ep.finish_reason == "failed" and "token id 100000, outside the model's vocabulary (0..127)" in ep.failure
    for budget, reason in ((-1, "failed"), (0, "length")):
        config = Config.from_dict({"data": {"source": "task:digits"}, "rollout": {"env": "tests.test_contracts:BudgetEnv"}, "logging": {"run_dir": "/runs/x"}})
        worker = RolloutWorker(config, tokenizer_dir, worker=2)
        worker.set_generators([ScriptedGenerator(replies_in_order(worker.tokenizer, ["a"]))])
        ep = asyncio.run(worker.play_episode(0, 0, {"prompt": "q:", "answer": "", "budget": budget}, 0, 0))
        assert ep.finish_reason == reason and not ep.model_turns, (budget, ep.finish_reason, ep.failure)
        assert budget == 0 or "BudgetEnv: max_new_tokens is -1" in ep.failure, ep.failure
    import numpy as np

    from meshrl.rollout.env import env_budget

    for asked, want in ((np.int64(5), 5), (512.0, 512), (None, None)):  # numpy's, a data file's float
        env = BudgetEnv()
        env.max_new_tokens = asked
        assert env_budget(env) == want and (want is None or type(env_budget(env)) is int)
    env.max_new_tokens = 2.5
    with pytest.raises(ContractError, match="max_new_tokens is 2.5"):
        env_budget(env)


def test_an_env_is_made_off_the_workers_loop_within_the_env_bound(tokenizer_dir, quiet, monkeypatch):
    """The constructor ran on the worker's event loop with no bound: while one blocked, no other
    episode of the worker moved, and one that hung held the worker for good."""

    async def ticks_while_played(worker):
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        ep = await worker.play_episode(0, 0, {"prompt": "q:", "answer": ""}, 0, 0)
        ticker.cancel()
        return ep, ticks

    worker, _ = play(tokenizer_dir, "SlowToMakeEnv", ["1234"])
    worker.set_generators([ScriptedGenerator(replies_in_order(worker.tokenizer, ["1234"]))])
    ep, ticks = asyncio.run(ticks_while_played(worker))
    assert ep.failure is None and ep.reward == 0.5
    assert ticks >= 10  # the loop went on through the constructor's 0.5 s (on the loop: 0 ticks)
    monkeypatch.setattr(SlowToMakeEnv, "made", 5.0)
    worker, ep = play(tokenizer_dir, "SlowToMakeEnv", ["1234"], env_timeout_s=0.3)
    assert ep.finish_reason == "failed" and "TimeoutError: making the env took longer than rollout.env_timeout_s=0.3s" in ep.failure
    # one made after all, once its episode failed, is closed (a container or server it started), not leaked
    monkeypatch.setattr(SlowToMakeEnv, "made", 0.6)
    monkeypatch.setattr(SlowToMakeEnv, "closed", 0)

    async def fails_then_waits():
        ep = await worker.play_episode(0, 0, {"prompt": "q:", "answer": ""}, 0, 0)
        for _ in range(200):
            if SlowToMakeEnv.closed:
                break
            await asyncio.sleep(0.05)
        return ep

    ep = asyncio.run(fails_then_waits())
    assert ep.finish_reason == "failed" and SlowToMakeEnv.closed == 1


def test_a_failed_evaluation_stops_its_other_episodes(tokenizer_dir, quiet, monkeypatch):
    """An evaluation whose one record fails (its generator calls failing three times): the
    other records' episodes are cancelled and their envs closed, where they played on, holding
    envs, sandboxes and replica load, for results thrown away."""
    import meshrl.agent.worker as worker_module
    from meshrl.agent.turns import GenerationFailed

    monkeypatch.setattr(worker_module, "RETRY_AFTER_S", 0.0)
    monkeypatch.setattr(SlowStepEnv, "closed", 0)
    worker, _ = play(tokenizer_dir, "SlowStepEnv", ["1234"] * 4)

    def reply(ids):
        if worker.tokenizer.decode(ids).endswith("fails:"):
            raise RuntimeError("the replica is gone")
        return worker.tokenizer.encode("1234")

    worker.set_generators([ScriptedGenerator(reply)])

    async def main():
        with pytest.raises(GenerationFailed):
            await asyncio.wait_for(worker.evaluate([{"prompt": "slow:", "answer": ""}, {"prompt": "fails:", "answer": ""}], 0, 1), 30)
        assert SlowStepEnv.closed == 2  # the slow record's greedy and sampled episodes, cancelled in their step, before the failure is raised

    asyncio.run(main())


def test_a_step_gets_its_own_bounded_work_beyond_the_env_bound(tokenizer_dir, quiet):
    """A reward within scoring.timeout_s, or tool calls within their own bound, ran inside a
    step that rollout.env_timeout_s cut short first: the episode failed, naming a knob the user
    never set."""
    from meshrl.rollout.coding import CodeEnv

    config = Config.from_dict(
        {
            "data": {"source": "task:digits"},
            "scoring": {"reward_fn": "tests.test_contracts:reward_after_a_while", "timeout_s": 10},
            "rollout": {"env_timeout_s": 0.5},
            "logging": {"run_dir": "/runs/x"},
        }
    )
    worker = RolloutWorker(config, tokenizer_dir, worker=2)
    worker.set_generators([ScriptedGenerator(replies_in_order(worker.tokenizer, ["7"]))])
    ep = asyncio.run(worker.play_episode(0, 0, {"prompt": "q:", "answer": "7"}, 0, 0))
    assert ep.finish_reason == "stop" and ep.reward == 1.0, ep.failure
    code = CodeEnv(Config.from_dict({"rollout": {"sandbox": {"wall_timeout_s": 5, "max_concurrent": 2}}}), max_tool_calls=1)
    code.reset({"prompt": "p", "tests": [{"input": "1", "output": "1"}] * 4 + ["assert True"]})
    assert code.step_timeout_s == 3 * (5 + 20)  # 5 sandbox runs, 2 at a time, each within its wall time and start
    assert code.max_tool_calls == 1 and code.tool_timeout_s == 35 and code.call_bound() == 35
    # a python call behind five others in the worker's pool (two at a time): its bound counts their rounds
    code.waiting = lambda: 5
    assert code.call_bound() == 3 * (5 + 20) and code.step_timeout_s >= code.call_bound()


def test_worker_carries_the_first_failure_to_the_metrics(tokenizer_dir, quiet):
    from tests.test_data_scoring import EndpointsOf, play_through_queue

    config = Config.from_dict(
        {
            "batch_groups": 1,
            "buffer": {"depth": 0},
            "generator": {"group_size": 4, "update_mode": "block"},
            "data": {"source": "task:letters"},
            "logging": {"run_dir": "/runs/x"},
        }
    )
    worker = RolloutWorker(config, tokenizer_dir, reward_fn=reward_text)
    worker.set_generators([ScriptedGenerator(replies_in_order(worker.tokenizer, ["a", "b", "c", "d"]))])
    asyncio.run(play_through_queue(worker, EpisodeQueue(config), 4))
    row = summarize(worker.metrics(), worker.failed_total, worker.take_first_failure())
    assert row["episode/failed"] == 4 and worker.take_first_failure() is None  # taken once per window
    assert row["episode/first_failure"] == (
        "worker-0: ContractError: reward function tests.test_contracts:reward_text returned '1.0' (str): "
        f"expected a finite number ({HERE}:{line_of(reward_text)}; log: /runs/x/logs/worker-0.log)"
    )
    assert EndpointsOf  # the queue behind the actor calling convention, as the worker sees it


def test_the_breaker_warns_once_per_failure_and_stops_after_k_failed_steps(tmp_path, caplog):
    """The controller's rule on each step's row (the loop's own method; its checkpoint, which
    needs the meshes, is recorded instead: the whole run is test_a_run_whose_every_episode_fails...)."""
    from meshrl.controller.loop import RLLoop
    from meshrl.errors import EpisodesFailed

    loop = RLLoop(Config.from_dict({"contracts": {"warn_failed_frac": 0.5, "stop_after_failed_steps": 2}, "logging": {"run_dir": str(tmp_path)}}))
    saved = []

    async def checkpoint():  # its path, or None where checkpoints.save defers it (trained models ahead of the policy)
        saved.append(loop.version)
        if loop.version == 11:  # a trainer healed in the call: the state saved is its restored one
            loop.version = 10
        return None if loop.version == 9 else f"step_{loop.version}"

    loop.checkpoint = checkpoint
    first = "worker-0: KeyError: 'x17' (envs.py:3; log: L)"

    def step(version, count, failed, reason=first):
        loop.version = version
        row = {"episode/count": float(count), "episode/failed": float(failed)}
        if failed:
            row["episode/first_failure"] = reason
        asyncio.run(loop._watch_failures(row))
        # the loop's own warnings (threads left by earlier tests in this process may log too)
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "meshrl"]

    assert step(1, 8, 4) == []  # half: not more than warn_failed_frac
    assert step(2, 8, 5) == [f"step 2: 5 of 8 episodes failed; the first: {first}"]
    assert len(step(3, 8, 8, first.replace("17", "18"))) == 1  # the same failure on another record: not again
    assert len(step(4, 8, 7, "worker-0: TypeError: bad (envs.py:9; log: L)")) == 2  # a new one is shown
    assert step(5, 0, 0) and saved == []  # nothing finished: counts neither way
    step(6, 8, 8)
    with pytest.raises(
        EpisodesFailed,
        match=r"^every episode of the last 2 steps failed; the first of step 7: worker-0: KeyError: 'x17' .*"
        r"continue from the checkpoint at step 7 with: meshrl run --resume ",
    ):
        step(7, 4, 4)
    assert saved == [7]
    with pytest.raises(
        EpisodesFailed, match=r"fix it, then no checkpoint was written yet \(step 9's was not kept: its trained models were at different versions"
    ):
        step(9, 4, 4)  # a deferred checkpoint is not named as one to go on from
    with pytest.raises(EpisodesFailed, match=r"the first of step 11: .*continue from the checkpoint at step 10 with"):
        step(11, 4, 4)  # the step it tripped on, and the checkpoint it wrote


# ---- data: every row checked, the first bad one as FILE:LINE ----------------------------------------
def test_a_bad_row_is_file_and_line(tmp_path):
    from meshrl.config import DataConfig

    rows = tmp_path / "rows.jsonl"
    good = json.dumps({"prompt": "a:", "answer": "1"})
    cases = [
        (f'{good}\n\n{{"prompt": "b:"\n', "rows.jsonl:3: not valid JSON (Expecting ',' delimiter at column 16)"),
        (f"{good}\n{json.dumps({'question': 'b'})}\n", "rows.jsonl:2: no 'prompt' field (data.prompt_key); the row's fields: 'question'"),
        (f"{good}\n[1, 2]\n", "rows.jsonl:2: a list where a record (an object with a 'prompt' field) is expected"),
        (f"{good}\n{json.dumps({'prompt': None})}\n", "rows.jsonl:2: 'prompt' is null: expected text or a list of chat messages"),
        (
            f"{json.dumps({'prompt': [{'content': 'x'}]})}\n",
            "rows.jsonl:1: 'prompt' holds {'content': 'x'}, not a chat message (a dict with 'role' and 'content')",
        ),
        ("\n", "rows.jsonl: holds no records"),
    ]
    for text, want in cases:
        rows.write_text(text)
        for read in (lambda: load_records(DataConfig(source=str(rows))), lambda: check_source(DataConfig(source=str(rows)), 60)):
            with pytest.raises(DataError) as info:
                read()
            assert str(info.value).startswith(str(tmp_path / want.split(":")[0]) + ":") and str(info.value).endswith(want.split(":", 1)[1]), (
                str(info.value),
                want,
            )
    rows.write_bytes(good.encode() + b"\n\xff\n")
    with pytest.raises(DataError, match=r"rows.jsonl:2: not UTF-8 text"):
        check_source(DataConfig(source=str(rows)), 60)

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["a:"] * 2500 + [None], "answer": ["1"] * 2501})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=1000)
    with pytest.raises(DataError, match=r"rows.parquet:2501: 'prompt' is null"):
        check_source(DataConfig(source=str(tmp_path / "rows.parquet")), 60)
    from datasets import Dataset

    Dataset.from_dict({"text": ["a:", "b:"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"saved:1: no 'prompt' field \(data.prompt_key\); the row's fields: 'text'"):
        check_source(DataConfig(source=str(tmp_path / "saved")), 60)
    first, n, complete = check_source(DataConfig(source=str(tmp_path / "saved"), prompt_key="text"), 60)
    assert first == {"prompt": "a:", "answer": None} and (n, complete) == (2, True)


def test_a_big_source_is_checked_within_its_time_bound(tmp_path):
    from meshrl.config import DataConfig

    rows = tmp_path / "big.jsonl"
    rows.write_text((json.dumps({"prompt": "a:"}) + "\n") * 20000 + "{bad\n")
    t0 = time.monotonic()
    first, n, complete = check_source(DataConfig(source=str(rows)), 0.0)
    assert not complete and n < 20000 and first["prompt"] == "a:" and time.monotonic() - t0 < 5
    with pytest.raises(DataError, match="big.jsonl:20001: not valid JSON"):
        check_source(DataConfig(source=str(rows)), 60)


# ---- the episode queue: a failure of the user's code there closes it on its one line ----------------
def test_queue_fails_on_a_bad_generated_record_and_a_bad_sampling_policy(monkeypatch):
    monkeypatch.delenv("MESHRL_VERBOSE", raising=False)  # the user's default: each role's output in its log
    config = Config.from_dict(
        {"batch_groups": 2, "generator": {"group_size": 2}, "buffer": {"sampling": "tests.test_contracts:bad_policy"}, "logging": {"run_dir": "/runs/x"}}
    )
    q = EpisodeQueue(config)
    from meshrl import episode
    from meshrl.episode import Episode, Turn

    for _ in range(2):
        claim = q.claim(0, 1.0)
        eps = [Episode(claim.group_id, i, [Turn("env", [1]), Turn("model", [3], [-0.1], [0], reward=float(i))]) for i in range(2)]
        assert q.put(claim.group_id, episode.assign_advantages(episode.pack(eps), "grpo"), claim.token)
    want = "queue: ValueError: sampling policy 'tests.test_contracts:bad_policy' returned [0, 0]: expected 2 distinct indices"
    with pytest.raises(UserCodeError, match=re.escape(want)):
        q.sample(2, 0, 1.0)
    with pytest.raises(UserCodeError, match=re.escape(want)):  # closed on it: every later call says the same
        q.claim(0, 1.0)
    assert q.failure.startswith(want) and q.failure.endswith("(log: /runs/x/logs/queue.log)")

    q = EpisodeQueue(Config.from_dict({"logging": {"run_dir": "/runs/x"}}))

    def broken_source():  # a remote or generated source failing on its 2nd record
        yield {"prompt": "a:", "answer": ""}
        raise ConnectionError("the dataset server went away")

    q.node = broken_source()
    assert q.claim(0, 1.0).sample["prompt"] == "a:"
    with pytest.raises(UserCodeError) as info:
        q.claim(0, 1.0)
    assert str(info.value) == f"queue: ConnectionError: the dataset server went away ({HERE}:{line_of(broken_source) + 2}; log: /runs/x/logs/queue.log)"


# ---- before the run: one line, exit 2, nothing started --------------------------------------------
def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MESHRL_VERBOSE"}
    return subprocess.run([sys.executable, "-m", "meshrl", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)


def test_cli_refuses_the_issues_cases_in_one_line_before_any_mesh(tmp_path):
    """What a new user met (issue 33), now: one line on stderr and exit 2, no run started."""
    run_dir = tmp_path / "run"
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a:", "answer": "1"}\n{"prompt": "b:", "answer": 2\n')
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"question": "a:", "answer": "1"}\n')
    cases = [
        (["rollout.env=json:loads"], "meshrl: contract error: rollout.env: 'json:loads' cannot make an env from rollout.env_args {}"),
        (
            ["scoring.reward_fn=json:dumps"],
            "meshrl: contract error: scoring.reward_fn: reward function json:dumps cannot be called as (prompt, response, sample)",
        ),
        (
            [f"data.source={bad_json}", "scoring.reward_fn=tests.conftest:exact_answer"],
            f"meshrl: data error: {bad_json}:2: not valid JSON (Expecting ',' delimiter at column 29)",
        ),
        (
            [f"data.source={no_prompt}", "scoring.reward_fn=tests.conftest:exact_answer"],
            f"meshrl: data error: {no_prompt}:1: no 'prompt' field (data.prompt_key); the row's fields: 'question', 'answer'",
        ),
    ]
    for args, want in cases:
        out = cli("run", *args, f"logging.run_dir={run_dir}")
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(want), (args, out.stderr)
        assert not (run_dir / "logs").exists(), "something started"


@pytest.mark.parametrize(
    "args, want",
    [
        (["rollout.env=tests.test_contracts:NoStep"], "rollout.env: 'tests.test_contracts:NoStep' is a class without step: expected an env class"),
        (
            ["rollout.env=tests.test_contracts:GymDigitsEnv", "rollout.env_args={size: 3}"],
            "rollout.env: 'tests.test_contracts:GymDigitsEnv' cannot make an env from rollout.env_args {'size': 3}: its constructor says",
        ),
        (
            ["rollout.env=tests.test_contracts:IntResetEnv"],
            f"rollout.env: env tests.test_contracts:IntResetEnv: reset returned 3 (int): expected text, a list of chat messages "
            f"({{'role', 'content'}} dicts) or a list of token ids, or gymnasium's (observation, info) ({HERE}:{line_of(IntResetEnv.reset)})",
        ),
        (
            ["rollout.env=tests.test_contracts:DictStepEnv"],
            "rollout.env: env tests.test_contracts:DictStepEnv: step returned {'reward': 1.0, 'done': True} (dict): expected a StepResult",
        ),
        (
            ["scoring.reward_fn=tests.test_contracts:reward_text"],
            f"scoring.reward_fn: reward function tests.test_contracts:reward_text returned '1.0' (str): expected a finite number, "
            f"on the first record of task:digits ({HERE}:{line_of(reward_text)})",
        ),
        (["scoring.reward_fn=tests.test_contracts:reward_nan"], "reward function tests.test_contracts:reward_nan returned nan: expected a finite number"),
        (
            ["scoring.reward_fn=tests.test_contracts:reward_raises"],
            f"scoring.reward_fn: reward function tests.test_contracts:reward_raises, on the first record of task:digits, raised KeyError: 'score' "
            f"({HERE}:{line_of(reward_raises) + 1})",
        ),
        (
            ["scoring.reward_fn=tests.test_contracts:reward_slow", "scoring.timeout_s=0.5"],
            "scoring.reward_fn: reward function tests.test_contracts:reward_slow took longer than scoring.timeout_s=0.5s, on the first record of task:digits",
        ),
        (["scoring.reward_fn=tests.test_contracts:reward_two_args"], "cannot be called as (prompt, response, sample): too many positional arguments"),
        (  # made as a worker makes it (on a thread of its own): the probe ran it on its event loop, and passed it
            ["rollout.env=tests.test_contracts:LoopInConstructorEnv"],
            "rollout.env: making the env 'tests.test_contracts:LoopInConstructorEnv' with rollout.env_args {} raised RuntimeError: no running event loop",
        ),
        (["contracts.stop_after_failed_steps=-1"], "config error: contracts.stop_after_failed_steps: must be at least 0"),
    ],
)
def test_contract_checks_before_the_run_are_one_line_and_exit_2(args, want, tmp_path, capsys):
    """The rest of docs/contracts.md's table, through the CLI's own entry point (in this
    process: each would cost a fresh interpreter)."""
    assert main(["run", *args, f"logging.run_dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], lines
    assert not (tmp_path / "run" / "logs").exists()


def test_the_cli_resolves_user_code_from_its_directory_first_as_the_procs_do(tmp_path, monkeypatch, capsys):
    """A local run's procs start in the command's directory with it first on their import path
    (Monarch's bootstrap is `python -m`); the CLI's own checks put it first too, so that a
    user's module shadowing an installed one is the same module in both."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))] + [str(tmp_path)])  # (last, as PYTHONPATH may put it)
    assert main(["config", "show"]) == 0
    assert sys.path[0] == str(tmp_path)
    capsys.readouterr()


def test_the_probe_can_be_switched_off_and_a_code_passed_reward_is_probed(tmp_path):
    from meshrl.preflight import preflight

    config = Config.from_dict(
        {"rollout": {"env": "tests.test_contracts:IntResetEnv"}, "contracts": {"probe": False}, "logging": {"run_dir": str(tmp_path / "run")}}
    )
    preflight(config)  # the run's own calls are checked instead
    with pytest.raises(ConfigError, match="reward_fn: reward function tests.test_contracts:reward_text returned '1.0'"):
        preflight(Config.from_dict({"logging": {"run_dir": str(tmp_path / "run")}}), reward_fn=reward_text)


# ---- whole runs ---------------------------------------------------------------------------------
SMALL = ["batch_groups=4", "generator.group_size=4", "generator.max_num_seqs=16", "trainer.micro_batch_size=16", "logging.progress=false", "logging.plot=false"]


def rows_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def console_of(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_gym_tuple_env_from_outside_meshrl_trains(tmp_path):
    run_dir = tmp_path / "run"
    out = cli("run", "rollout.env=tests.test_contracts:GymDigitsEnv", "steps=3", *SMALL, f"logging.run_dir={run_dir}", timeout=540)
    lines = console_of(out)
    assert out.returncode == 0, lines
    assert not any("WARNING" in line or "failed" in line for line in lines), lines
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r.get("episode/count", 0) for r in rows) > 0 and all(r.get("episode/failed", 0) == 0 for r in rows)
    assert any(r.get("reward/mean", 0) > 0 for r in rows)  # the env's rewards reached the trainer


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_every_episode_fails_warns_once_then_stops_resumably(tmp_path):
    run_dir = tmp_path / "run"
    out = cli(
        "run",
        "rollout.env=tests.test_contracts:StepRaisesEnv",
        "contracts.stop_after_failed_steps=2",
        "steps=20",
        *SMALL,
        f"logging.run_dir={run_dir}",
        timeout=540,
    )
    lines = console_of(out)
    assert out.returncode == 1, lines
    reason = f"worker-0: ZeroDivisionError: division by zero ({HERE}:{line_of(StepRaisesEnv.step) + 1}; log: {run_dir / 'logs' / 'worker-0.log'})"
    warnings = [line for line in lines if "WARNING" in line]
    assert len(warnings) == 1 and re.search(r"step \d+: \d+ of \d+ episodes failed; the first: " + re.escape(reason), warnings[0]), lines
    assert re.fullmatch(
        r"meshrl: run failed: every episode of the last 2 steps failed; the first of step (\d+): "
        + re.escape(reason)
        + r"; fix it, then continue from the checkpoint at step \1 with: meshrl run --resume "
        + re.escape(str(run_dir)),
        lines[-1],
    ), lines[-1]
    assert not any(re.search(r"Traceback|MeshFailure|SupervisionError", line) for line in lines), lines
    stopped = int(re.search(r"step (\d+):", lines[-1]).group(1))
    rows = rows_of(run_dir)
    assert rows[-1]["step"] == stopped and rows[-1]["episode/failed"] == rows[-1]["episode/count"] > 0
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped:06d}_loop_state.pt" and (run_dir / "checkpoints" / latest).is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_bad_row_found_by_the_queue_is_one_line_not_a_supervision_trace(tmp_path):
    """With the check before the run off, the episode queue meets the bad line itself: the
    run ends with the same FILE:LINE, told as the queue's one line, exit 1."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a:", "answer": "1"}\n{"prompt": "b:", "answer": "2"}\n{"prompt": "c:", answer: 3}\n')
    run_dir = tmp_path / "run"
    out = cli(
        "run",
        f"data.source={rows}",
        "scoring.reward_fn=tests.conftest:exact_answer",
        "contracts.data_check_s=0",
        "steps=2",
        *SMALL,
        f"logging.run_dir={run_dir}",
        timeout=540,
    )
    lines = console_of(out)
    assert out.returncode == 1, lines
    assert lines[-1] == (
        f"meshrl: run failed: queue: DataError: {rows}:3: not valid JSON (Expecting property name enclosed in double quotes "
        f"at column 18) (log: {run_dir / 'logs' / 'queue.log'})"
    ), lines
    assert not any(re.search(r"Traceback|MeshFailure|SupervisionError", line) for line in lines), lines


# ---- a model's vocabulary, the models' tokenizer, weight_sync.files_dir: one line, exit 2 ----------
def refused(capsys, config: str, *args: str) -> str:
    """The one line `meshrl run CONFIG ARGS launcher.dry_run=true` refuses the config with, after checking it exits 2."""
    assert main(["run", os.path.join(ROOT, "configs", config), *args, "launcher.dry_run=true"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_from_scratch_vocab_size_covers_the_tokenizer(tokenizer_dir, tmp_path, capsys):
    """model.vocab_size below the tokenizer's len() (the built-in one's, or model.tokenizer's),
    and a model's beside the policy below the policy's, are refused before anything starts."""
    from meshrl.preflight import check
    from meshrl.tokenizer import char_vocab, load_tokenizer

    assert len(char_vocab()) == len(load_tokenizer(tokenizer_dir)) == 99
    run = f"logging.run_dir={tmp_path / 'run'}"
    line = refused(capsys, "default.yaml", "model.vocab_size=10", run)
    assert line.startswith("meshrl: config error: model.vocab_size: its vocabulary (10) is smaller than that of meshrl's built-in character tokenizer (99"), (
        line
    )
    line = refused(capsys, "default.yaml", "model.vocab_size=98", f"model.tokenizer={tokenizer_dir}", run)
    assert line.startswith(
        f"meshrl: config error: model.vocab_size: its vocabulary (98) is smaller than that of the tokenizer at model.tokenizer={tokenizer_dir!r}"
    ), line
    line = refused(capsys, "coevolve.yaml", "model.vocab_size=256", "models=[{name: proposer, model: {vocab_size: 128}}]", run)
    assert line.startswith("meshrl: config error: models[0].model.vocab_size: 128 is smaller than the policy's (256)"), line
    check(Config.from_dict({"model": {"vocab_size": 99}}))
    check(Config.from_dict({"data": {"source": "task:propose"}, "model": {"vocab_size": 99}, "models": [{"name": "proposer", "model": {"vocab_size": 128}}]}))
    assert not (tmp_path / "run").exists()


def test_a_prm_checkpoint_covers_the_policys_vocabulary(tokenizer_dir, tmp_path, capsys):
    """scoring.scorers[].path of a prm reads the policy's token ids: a smaller vocabulary is refused as critic.path's is."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from meshrl.preflight import check

    for vocab in (64, 128):
        shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, **shape)).save_pretrained(str(tmp_path / f"prm{vocab}"))
        shutil.copytree(tokenizer_dir, tmp_path / f"prm{vocab}", dirs_exist_ok=True)
    capsys.readouterr()  # transformers' progress bars
    line = refused(capsys, "prime.yaml", f"scoring.scorers=[{{kind: prm, path: {tmp_path / 'prm64'}}}]", f"logging.run_dir={tmp_path / 'run'}")
    assert line.startswith(
        "meshrl: config error: scoring.scorers[0].path: its vocabulary (64) is smaller than the policy's (128): the PRM reads the policy's token ids"
    ), line
    check(Config.from_yaml(os.path.join(ROOT, "configs", "prime.yaml"), [f"scoring.scorers=[{{kind: prm, path: {tmp_path / 'prm128'}}}]"]))


def test_every_model_shares_the_policys_tokenizer(tokenizer_dir, tmp_path, capsys):
    """models[i].model.tokenizer, which the run would ignore, is refused unless it is the policy's."""
    from meshrl.preflight import check

    for own in ("/nonexistent", tokenizer_dir):
        line = refused(capsys, "coevolve.yaml", f"models=[{{name: proposer, model: {{tokenizer: {own}}}}}]", f"logging.run_dir={tmp_path / 'run'}")
        assert line.startswith(
            f"meshrl: config error: models[0].model.tokenizer: {own!r} is not the policy's: every model shares the policy's tokenizer (model.tokenizer"
        ), line
    same = {"data": {"source": "task:propose"}, "model": {"tokenizer": tokenizer_dir}, "models": [{"name": "proposer", "model": {"tokenizer": tokenizer_dir}}]}
    check(Config.from_dict(same))


def test_weight_sync_files_dir_is_writable(tmp_path, capsys):
    """weight_sync.files_dir, for the files transport, can be written (or made) before any mesh starts."""
    from meshrl.weightsync.connect import check_files_dir

    run = f"logging.run_dir={tmp_path / 'run'}"
    line = refused(capsys, "default.yaml", "weight_sync.transport=files", "weight_sync.files_dir=/proc/nonexistent", run)
    assert line.startswith("meshrl: config error: weight_sync.files_dir: cannot make '/proc/nonexistent': '/proc', the nearest of its folders that exists"), (
        line
    )
    (tmp_path / "file").write_text("")
    line = refused(capsys, "default.yaml", "weight_sync.transport=files", f"weight_sync.files_dir={tmp_path / 'file'}", run)
    assert line.startswith(f"meshrl: config error: weight_sync.files_dir: {str(tmp_path / 'file')!r} is not a directory"), line
    check_files_dir(Config.from_dict({"weight_sync": {"transport": "files", "files_dir": str(tmp_path / "new" / "weights")}}))
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the probe leaves nothing behind


def test_a_rescale_gives_the_workers_more_groups_at_once_and_a_resume_its_replicas(tokenizer_dir, tmp_path):
    """Scaling 1 -> 4 replicas kept each worker's groups in flight at what one replica needed,
    so the new ones idled; and config.yaml kept the old count, which a resume started."""
    import yaml

    from meshrl.controller.control import remember

    config = Config.from_dict({"data": {"source": "task:digits"}, "logging": {"run_dir": "/runs/x"}, "rollout": {"workers": 1}})
    worker = RolloutWorker(config, tokenizer_dir, worker=2)
    worker._slots = worker.slots()
    worker._free = asyncio.Semaphore(worker._slots)
    before = worker._slots
    worker.set_generators([ScriptedGenerator(lambda ids: [2])] * 4)
    assert worker._slots == 4 * before and worker._free._value == 4 * before
    worker.set_generators([ScriptedGenerator(lambda ids: [2])] * 2)  # down: none taken back, none added
    assert worker._slots == 4 * before and worker._free._value == 4 * before
    (tmp_path / "config.yaml").write_text("generator:\n  replicas: 1\n")
    remember(str(tmp_path), None, None, 1e-4, replicas=4)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["generator"]["replicas"] == 4
