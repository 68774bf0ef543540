"""OpenEnv environments through `meshrl.rollout.openenv:OpenEnvEnv`: in this process, against
a real OpenEnv server on loopback (one WebSocket session per episode), and in a real run.

The env under test is defined here: guess a 4-digit number in three tries, each wrong guess
answered "higher" or "lower". Its secret comes from reset's seed, so the adapter's choice of
passing the record's `seed` shows in which number an episode plays for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import sys
import threading
import time
from typing import Optional

import pytest

pytest.importorskip("openenv", reason="needs openenv-core: pip install 'meshrl[envs]'")

from openenv.core.client_types import StepResult as OpenEnvResult  # noqa: E402
from openenv.core.env_client import EnvClient  # noqa: E402
from openenv.core.env_server.http_server import create_fastapi_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from meshrl.rollout.env import ModelTurn, call_bounded  # noqa: E402
from meshrl.rollout.openenv import OpenEnvEnv, action_class, observation_text, text_field  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ---- the env: an OpenEnv Environment, its types and its client -----------------------------------
class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    text: str = ""
    guesses_left: int = 0


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess the seed's 4-digit number in TRIES guesses; reward 1 for the number, else 0.1
    per digit guessed (so a random model's rewards differ within a group)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    TRIES = 3
    live: set[int] = set()
    """ids of instances not yet closed: here, and in a server run by this process."""

    def __init__(self, tries: int = TRIES):
        super().__init__()
        self.tries = tries
        self.threads = {threading.get_ident()}
        GuessEnv.live.add(id(self))

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs) -> GuessObservation:
        self.threads.add(threading.get_ident())
        self.secret = secret(seed)
        self.left = self.tries
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="guess 4 digits", guesses_left=self.left)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs) -> GuessObservation:
        self.threads.add(threading.get_ident())
        self.left -= 1
        self._state.step_count += 1
        digits = "".join(ch for ch in action.guess if ch.isdigit())
        if digits == str(self.secret):
            return GuessObservation(text="yes", done=True, reward=1.0)
        hint = "higher" if digits and int(digits) < self.secret else "lower" if digits else "digits"
        return GuessObservation(text=hint, guesses_left=self.left, done=self.left == 0, reward=0.1 * min(len(digits), 4))

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        self.threads.add(threading.get_ident())
        GuessEnv.live.discard(id(self))


class AsyncGuessEnv(GuessEnv):
    """The same game with its own async step: played on the worker's event loop."""

    async def step_async(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs) -> GuessObservation:
        await asyncio.sleep(0)
        return self.step(action)


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action: GuessAction) -> dict:
        return {"guess": action.guess}

    def _parse_result(self, payload: dict) -> OpenEnvResult[GuessObservation]:
        obs = GuessObservation(**payload.get("observation", {}), done=payload.get("done", False), reward=payload.get("reward"))
        return OpenEnvResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


def secret(seed) -> int:
    return random.Random(seed).randrange(1000, 10000)


# hooks named by import path
def bracketed_guess(turn: ModelTurn) -> GuessAction:
    return GuessAction(guess=turn.text.strip("[] "))


def hint_and_tries(obs: GuessObservation) -> str:
    return f"{obs.text} ({obs.guesses_left} left)"


def turn(text: str, index: int = 0) -> ModelTurn:
    return ModelTurn(text, [], "stop", index)


async def play(env: OpenEnvEnv, record: dict, guesses: list[str]):
    """reset, then one step per guess until done, as a rollout worker plays (each call
    bounded, close() at the end whatever happens); (first observation, step results)."""
    results = []
    try:
        first = await call_bounded(env.reset, record, timeout=30)
        for i, guess in enumerate(guesses):
            results.append(await call_bounded(env.step, turn(guess, i), timeout=30))
            if results[-1].done:
                break
    finally:
        await call_bounded(env.close, timeout=30)
    return first, results


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- (a) in process -------------------------------------------------------------------------------
def test_in_process_episode_maps_text_reward_and_done():
    GuessEnv.live.clear()
    n = secret(7)
    env = OpenEnvEnv(env="tests.test_openenv:GuessEnv")
    first, results = asyncio.run(play(env, {"prompt": "ignored", "seed": 7}, ["1000", "99999", f"it is {n}", "never sent"]))
    assert first == user("guess 4 digits")
    assert [r.done for r in results] == [False, False, True]
    assert results[0].observation == user("higher") and results[0].reward == pytest.approx(0.4)
    assert results[1].observation == user("lower") and results[1].reward == pytest.approx(0.4)  # 5 digits, 4 count
    assert results[2].reward == 1.0 and results[2].observation is None
    assert not GuessEnv.live, "the episode's env was not closed"


MADE: list[GuessEnv] = []


def make_guess_env(**kwargs) -> GuessEnv:
    """An env factory function rather than a class (env_args.env may name either)."""
    MADE.append(GuessEnv(**kwargs))
    return MADE[-1]


def test_in_process_env_lives_on_one_thread_of_its_own_and_tries_run_out():
    MADE.clear()
    env = OpenEnvEnv(env="tests.test_openenv:make_guess_env", env_kwargs={"tries": 2}, action="tests.test_openenv:GuessAction")
    _, results = asyncio.run(play(env, {"prompt": "", "seed": 1}, ["x", "y", "z"]))
    assert [(r.done, r.reward) for r in results] == [(False, 0.0), (True, 0.0)]
    assert results[0].observation == user("digits")
    assert len(MADE[0].threads) == 1 and threading.get_ident() not in MADE[0].threads


class SlowGuessEnv(GuessEnv):
    def __init__(self):
        time.sleep(0.5)
        super().__init__()


def test_in_process_env_made_after_reset_timed_out_is_still_closed():
    GuessEnv.live.clear()
    env = OpenEnvEnv(env="tests.test_openenv:SlowGuessEnv")

    async def main():  # the worker's path: reset times out while the env is made, then close()
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await call_bounded(env.reset, {"prompt": "", "seed": 1}, timeout=0.1)
        await call_bounded(env.close, timeout=30)

    asyncio.run(main())
    assert not GuessEnv.live, "the env made after the timeout was not closed"


def test_same_seed_same_game_and_other_record_fields_reach_reset_as_asked():
    async def first_reply(env, record):
        await env.reset(record)
        try:
            return (await env.step(turn("5000"))).observation
        finally:
            await env.close()

    seeds = [s for s in range(50) if secret(s) > 5000][:1] + [s for s in range(50) if secret(s) < 5000][:1]
    for s, hint in zip(seeds, ["higher", "lower"]):
        for _ in range(2):  # two episodes of one record (a group) play the same number
            assert asyncio.run(first_reply(OpenEnvEnv(env="tests.test_openenv:GuessEnv"), {"prompt": "", "seed": s})) == user(hint)
    # a fixed reset kwarg, and a record field by another name; kwargs reset does not take are dropped
    env = OpenEnvEnv(env="tests.test_openenv:GuessEnv", reset_fields=["level"], reset_kwargs={"seed": seeds[0], "unknown": 1})
    assert asyncio.run(first_reply(env, {"prompt": "", "seed": seeds[1], "level": 3})) == user("higher")


def test_hooks_system_prompt_record_prompt_and_plain_text():
    n = secret(3)
    env = OpenEnvEnv(
        env="tests.test_openenv:GuessEnv",
        action_fn="tests.test_openenv:bracketed_guess",
        observation_fn="tests.test_openenv:hint_and_tries",
        system_prompt="Answer with 4 digits.",
    )
    first, results = asyncio.run(play(env, {"seed": 3}, ["[1000]", f"[{n}]"]))
    assert first == [{"role": "system", "content": "Answer with 4 digits."}, *user("guess 4 digits (3 left)")]
    assert results[0].observation == user(f"{'higher' if n > 1000 else 'lower'} (2 left)")
    assert results[1].done and results[1].reward == 1.0

    env = OpenEnvEnv(env="tests.test_openenv:GuessEnv", chat=False, prompt_from="record", observation_field="text")
    first, results = asyncio.run(play(env, {"prompt": "Guess my number: ", "seed": 3}, ["0"]))
    assert first == "Guess my number: " and results[0].observation == "higher"

    env = OpenEnvEnv(env="tests.test_openenv:AsyncGuessEnv")  # its own step_async, on the event loop
    first, results = asyncio.run(play(env, {"prompt": "", "seed": 3, "max_new_tokens": 5}, [str(n)]))
    assert results[0].done and results[0].reward == 1.0
    assert env.max_new_tokens == 5  # the record's budget for the model's turns, as SingleTurnEnv takes it


def test_defaults_find_the_action_field_and_the_observation_text():
    assert action_class(GuessEnv, "step") is GuessAction and action_class(GuessClient, "_step_payload") is GuessAction
    assert text_field(GuessAction) == "guess"

    class Two(Action):
        a: str
        b: str = ""

    class Ambiguous(Action):
        a: str
        b: str

    assert text_field(Two) == "a"
    with pytest.raises(ValueError, match="action_field"):
        text_field(Ambiguous)
    assert observation_text({"prompt": "", "text": "t", "n": 1}) == "t"  # the first non-empty text field
    assert observation_text({"echoed_message": "hi", "length": 2}) == "hi"  # its only text field
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    assert observation_text({"messages": chat}) == chat
    assert observation_text({"messages": chat}, first=False) == user("more")
    with pytest.raises(ValueError, match="observation_fn"):
        observation_text({"a": "x", "b": "y"})


def test_bad_env_args_say_what_to_set():
    with pytest.raises(ValueError, match="exactly one"):
        OpenEnvEnv()
    with pytest.raises(ValueError, match="exactly one"):
        OpenEnvEnv(env="tests.test_openenv:GuessEnv", base_url="http://127.0.0.1:1")
    with pytest.raises(TypeError, match="EnvClient"):
        OpenEnvEnv(base_url="http://127.0.0.1:1", client="tests.test_openenv:GuessEnv")
    with pytest.raises(ImportError, match="cannot import"):
        OpenEnvEnv(env="tests.test_openenv:NoSuchEnv")


def test_without_openenv_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "meshrl.rollout.openenv")
    with pytest.raises(ImportError, match=r"pip install 'meshrl\[envs\]'"):
        import meshrl.rollout.openenv  # noqa: F401


# ---- (b) a real server on loopback -----------------------------------------------------------------
@contextlib.contextmanager
def serve(max_sessions: int):
    """An OpenEnv server of GuessEnv on 127.0.0.1 (a free port), in a thread; stopped on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=max_sessions)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "the OpenEnv server did not stop"


def wait_closed(timeout=10.0) -> set:
    deadline = time.monotonic() + timeout
    while GuessEnv.live and time.monotonic() < deadline:
        time.sleep(0.05)
    return GuessEnv.live


@pytest.fixture(scope="module")
def server():
    with serve(max_sessions=64) as url:
        yield url


def test_client_mode_plays_episodes_over_websocket_sessions(server):
    GuessEnv.live.clear()
    n = secret(11)
    env = OpenEnvEnv(base_url=server, client="tests.test_openenv:GuessClient", system_prompt="Digits only.")
    first, results = asyncio.run(play(env, {"prompt": "", "seed": 11}, ["1000", "99999", str(n)]))
    assert first == [{"role": "system", "content": "Digits only."}, *user("guess 4 digits")]
    assert [(r.done, r.reward) for r in results] == [(False, pytest.approx(0.4)), (False, pytest.approx(0.4)), (True, 1.0)]
    assert results[0].observation == user("higher")
    assert not wait_closed(), "the server still holds the episode's session"

    # the generic client (no env package here): dicts both ways, the action's field named
    env = OpenEnvEnv(base_url=server, action_field="guess")
    first, results = asyncio.run(play(env, {"prompt": "", "seed": 11}, ["1000", str(n)]))
    assert first == user("guess 4 digits") and results[-1].done and results[-1].reward == 1.0
    with pytest.raises(ValueError, match="action_field"):
        asyncio.run(play(OpenEnvEnv(base_url=server), {"prompt": "", "seed": 1}, ["1"]))
    assert not wait_closed(), "a failed episode left its session open"


def test_concurrent_episodes_keep_separate_sessions(server):
    """Two episodes at once on one server, interleaved turn by turn: each its own game."""
    GuessEnv.live.clear()
    seeds = (21, 22)
    envs = [OpenEnvEnv(base_url=server, client="tests.test_openenv:GuessClient") for _ in seeds]

    async def main():
        await asyncio.gather(*(e.reset({"prompt": "", "seed": s}) for e, s in zip(envs, seeds)))
        assert len(GuessEnv.live) == 2
        try:
            wrong = await asyncio.gather(*(e.step(turn("1000")) for e in envs))
            right = await asyncio.gather(*(e.step(turn(str(secret(s)), 1)) for e, s in zip(envs, seeds)))
        finally:
            await asyncio.gather(*(e.close() for e in envs))
        return wrong, right

    wrong, right = asyncio.run(main())
    assert all(not r.done for r in wrong) and all(r.done and r.reward == 1.0 for r in right)
    assert not wait_closed()


def test_full_server_queues_episodes_and_unreachable_one_fails():
    """A one-session server: the second of two concurrent episodes waits for the first's
    session to close, then plays; nothing is left open. No server: reset raises."""
    GuessEnv.live.clear()
    with serve(max_sessions=1) as url:

        async def episode(seed, hold_s):
            env = OpenEnvEnv(base_url=url, client="tests.test_openenv:GuessClient")
            try:
                await call_bounded(env.reset, {"prompt": "", "seed": seed}, timeout=30)
                t = time.monotonic()
                await asyncio.sleep(hold_s)
                result = await call_bounded(env.step, turn(str(secret(seed))), timeout=30)
                return t, result
            finally:
                await call_bounded(env.close, timeout=30)

        async def main():
            first = asyncio.ensure_future(episode(31, 0.5))
            await asyncio.sleep(0.2)
            second = await episode(32, 0.0)
            return await first, second

        (t1, r1), (t2, r2) = asyncio.run(main())
        assert r1.reward == r2.reward == 1.0
        assert t2 >= t1 + 0.5, "the second episode got a session while the first held the only one"
        assert not wait_closed()

    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    env = OpenEnvEnv(base_url=f"http://127.0.0.1:{port}", client="tests.test_openenv:GuessClient")
    with pytest.raises(ConnectionError):
        asyncio.run(play(env, {"prompt": "", "seed": 1}, ["1"]))


def test_a_servers_client_waits_as_long_as_the_env_timeout_allows():
    """As the rollout worker makes it (`from_config`), a server's client waits for an answer up to
    rollout.env_timeout_s, where openenv's own 60 s cut a longer step short; a timeout the
    user set in client_kwargs stands, and an env played in process has no client."""
    from meshrl.config import Config

    config = Config.from_dict({"rollout": {"env_timeout_s": 300}})
    env = OpenEnvEnv.from_config(config, base_url="http://127.0.0.1:1", client="tests.test_openenv:GuessClient")
    client = env._client_cls(base_url=env.base_url, **env.client_kwargs)
    assert client._message_timeout == 300
    kept = OpenEnvEnv.from_config(config, base_url="http://127.0.0.1:1", client_kwargs={"message_timeout_s": 5})
    assert kept.client_kwargs == {"message_timeout_s": 5}
    assert OpenEnvEnv.from_config(config, env="tests.test_openenv:GuessEnv").client_kwargs == {}


# ---- (c) a real run ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_run_plays_openenv_episodes_over_the_server(server, tmp_path):
    import meshrl
    from tests.test_loop import tiny, wait_no_children

    GuessEnv.live.clear()
    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps({"prompt": "", "seed": s}) + "\n" for s in range(16)))
    cfg = tiny(
        tmp_path / "run",
        steps=2,
        trainer={"checkpoint_every": 0},
        data={"source": str(data)},
        rollout={"env": "meshrl.rollout.openenv:OpenEnvEnv", "max_turns": 4, "env_args": {"base_url": server, "client": "tests.test_openenv:GuessClient"}},
        generator={"max_new_tokens": 4},
    )
    rows = meshrl.run(cfg).metrics
    assert [int(r["step"]) for r in rows] == [1, 2]
    played = [r for r in rows if "episode/turns_mean" in r]
    assert played and all(r["episode/failed"] == 0 for r in played), [r.get("episode/failed") for r in rows]
    assert all(r["episode/turns_mean"] == GuessEnv.TRIES for r in played), [r["episode/turns_mean"] for r in played]
    assert all(r["episode/env_tokens_mean"] > 0 for r in played)
    assert not wait_closed(60), f"{len(GuessEnv.live)} server sessions outlived the run"
    assert not wait_no_children()
