"""Prompt sources (tasks, JSONL, Parquet; resumable), task rewards and envs, rollout workers
playing episodes against a scripted generator, rewards, metrics and plots."""

import asyncio
import inspect
import json
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from meshrl import episode
from meshrl.config import Config, ConfigError
from meshrl.data import load_records
from meshrl.queue.prompts import PromptNode
from meshrl.generator.engine import RequestResult
from meshrl.metrics import MetricsWriter, read_metrics
from meshrl.queue import Claim, EpisodeQueue
from meshrl.rollout.chat import ChatRenderer
from meshrl.rollout.env import ModelTurn, SingleTurnEnv
from meshrl.agent.turns import GenerationFailed
from meshrl.agent.summary import summarize
from meshrl.agent.envs import env_factory
from meshrl.agent.worker import RolloutWorker
from tests.conftest import ScriptedGenerator, replies_in_order
from meshrl.scoring import resolve_reward
from meshrl.tasks import TASKS, CalcEnv, GuessEnv, LongtailChatEnv, answer_budget

SINGLE_TURN = sorted(name for name, task in TASKS.items() if task.env is None)
MULTI_TURN = sorted(name for name, task in TASKS.items() if task.env is not None)


# ---- tasks ----------------------------------------------------------------------------------------
def test_tasks_are_single_or_multi_turn():
    assert MULTI_TURN == ["calc", "code", "guess", "longtail_chat", "propose", "pyexpr"] and "digits" in SINGLE_TURN
    for name, task in TASKS.items():
        assert (task.reward is None) != (task.env is None), name
        a, b = task.sample(random.Random(5)), task.sample(random.Random(5))
        assert a == b and {"prompt", "answer"} <= set(a), name  # a pure function of the rng
        if task.env is not None and name != "propose":  # a game's prompt is the proposer's text (tests/test_coevolve.py)
            assert isinstance(a["prompt"], list) and a["prompt"][-1]["role"] == "user"  # chat messages


@pytest.mark.parametrize("name", SINGLE_TURN)
def test_single_turn_tasks_reward_their_own_answer_fully(name):
    task = TASKS[name]
    for i in range(20):
        sample = task.sample(random.Random(i))
        prompt, answer = sample["prompt"], sample["answer"]
        if name in ("digits", "digits_sparse"):
            answer = "01234567"  # any digits are right
        if name == "longtail":
            answer = "5" * int(answer)  # any n digits are right
        assert task.reward(prompt, answer, sample) == 1.0
        assert task.reward(prompt, "", sample) == 0.0
        assert 0.0 <= task.reward(prompt, "zz9", sample) < 1.0


async def play_by_hand(env, sample: dict, texts: list[str]):
    """The env's step results for model turns `texts` (stops when the env is done)."""
    obs = env.reset(sample)
    obs = await obs if inspect.isawaitable(obs) else obs
    assert obs == sample["prompt"]
    results = []
    for k, text in enumerate(texts):
        result = env.step(ModelTurn(text, [], "stop", k))
        result = await result if inspect.isawaitable(result) else result
        results.append(result)
        if result.done:
            break
    return results


def test_calc_env_by_hand():
    config = Config.from_dict({"data": {"source": "task:calc"}, "rollout": {"tool_parser": "compact"}})

    def play(sample, texts):
        return asyncio.run(play_by_hand(TASKS["calc"].env(config), sample, texts))

    for i in range(20):
        sample = TASKS["calc"].sample(random.Random(i))
        question, answer = sample["prompt"][-1]["content"], sample["answer"]
        # a perfect episode: call the tool (on the question's own expression, or spelled out), copy its result
        for call in ("!", "!" + question):
            called, answered = play(sample, [call, answer])
            assert not called.done and called.reward == 0.0 and called.info == {"tool_calls": 1}
            assert [(m["role"], m["content"]) for m in called.observation] == [("tool", answer)]
            assert answered.done and answered.reward == 1.0
        # partial credits
        other = str((int(answer) + 1) % 10)
        assert [r.reward for r in play(sample, [answer])] == [0.0]  # no call: no credit
        assert play(sample, ["!" + other, answer])[-1].reward == 0.2  # a call, not on the question
        assert play(sample, ["!", "x"])[-1].reward == 0.5  # the call returned the answer
        assert play(sample, ["!", other])[-1].reward == 0.6  # then a number, the wrong one
        assert play(sample, ["!", "!"])[-1].reward == 0.5  # one call only: the second turn is the answer
    # the hermes format reaches the same tool
    hermes = Config.from_dict({"data": {"source": "task:calc"}})
    sample = {"prompt": [{"role": "user", "content": "7-3"}], "answer": "4"}
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "7-3"}}</tool_call>'
    called, answered = asyncio.run(play_by_hand(CalcEnv(hermes), sample, [call, "4"]))
    assert called.observation[0]["content"] == "4" and answered.reward == 1.0


def test_guess_env_by_hand():
    for secret in map(str, range(10)):
        sample = {"prompt": [{"role": "user", "content": "?"}], "answer": secret}
        [hit] = asyncio.run(play_by_hand(GuessEnv(), sample, [secret]))
        assert hit.done and hit.reward == 1.0  # a perfect episode
        # a binary search: each miss is told higher or lower; 0.1 less per extra guess
        lo, hi, guesses = 0, 9, []
        while True:
            guess = str((lo + hi) // 2)
            guesses.append(guess)
            if guess == secret:
                break
            lo, hi = (int(guess) + 1, hi) if int(guess) < int(secret) else (lo, int(guess) - 1)
        results = asyncio.run(play_by_hand(GuessEnv(), sample, guesses))
        assert len(results) == len(guesses) <= 4
        for guess, r in zip(guesses[:-1], results):
            assert not r.done and r.reward == 0.0
            assert r.observation == [{"role": "user", "content": "+" if int(secret) > int(guess) else "-"}]
        assert results[-1].done and results[-1].reward == pytest.approx(1.0 - 0.1 * (len(guesses) - 1))
    sample = {"prompt": [{"role": "user", "content": "?"}], "answer": "5"}
    results = asyncio.run(play_by_hand(GuessEnv(), sample, ["x", "1", "9", "2", "5"]))
    assert results[0].observation == [{"role": "user", "content": "?"}]  # not a digit
    assert len(results) == 4 and results[-1].done and results[-1].reward == 0.0  # out of guesses


# ---- prompt sources -------------------------------------------------------------------------------
def test_longtail_lengths_have_the_configured_tail():
    """task:longtail's targets: lognormal around the median, 95th percentile >= 5x it, clipped
    at lengths.max (20x), each prompt budgeted its target plus the slack."""
    data = Config.from_dict({"data": {"source": "task:longtail"}, "generator": {"max_new_tokens": 208}}).data
    samples = [TASKS["longtail"].sample(random.Random(i), data) for i in range(4000)]
    lengths = sorted(int(s["answer"]) for s in samples)
    median, p95 = lengths[len(lengths) // 2], lengths[int(0.95 * len(lengths))]
    assert median == data.lengths.median and p95 >= 5 * median
    assert lengths[0] >= 1 and lengths[-1] == data.lengths.max >= 20 * median
    reward = TASKS["longtail"].reward
    for s in samples[:50]:
        n = int(s["answer"])
        assert s["prompt"] == f"{n}:" and s["max_new_tokens"] == answer_budget(n, data.lengths.slack) > n
        assert reward(s["prompt"], "7" * n, s) == 1.0
        assert reward(s["prompt"], "7" * (n + 1), s) < 1.0  # did not stop in time
        assert reward(s["prompt"], "7" * (n - 1), s) < 1.0  # stopped early
        assert reward(s["prompt"], "7" * (n - 1) + "x", s) < 1.0
    # the tail is the config's: no spread, every target is the median
    flat = Config.from_dict({"data": {"source": "task:longtail", "lengths": {"sigma": 0.0, "median": 5, "max": 10}}, "generator": {"max_new_tokens": 16}}).data
    assert {TASKS["longtail"].sample(random.Random(i), flat)["answer"] for i in range(50)} == {"5"}


def test_longtail_chat_env_by_hand():
    config = Config.from_dict({"data": {"source": "task:longtail_chat"}, "generator": {"max_new_tokens": 208}})
    samples = [TASKS["longtail_chat"].sample(random.Random(i), config.data) for i in range(2000)]
    rounds = [len(s["answer"]) for s in samples]
    assert min(rounds) == 1 and max(rounds) == config.data.lengths.turns_max and sum(r == 1 for r in rounds) > len(rounds) / 2
    for sample in samples[:40]:
        env = LongtailChatEnv(config)
        results = asyncio.run(play_by_hand(env, sample, ["5" * n for n in sample["answer"]]))  # a perfect episode
        assert [r.done for r in results] == [False] * (len(sample["answer"]) - 1) + [True]
        assert sum(r.reward for r in results) == pytest.approx(1.0)
        for r, n in zip(results, sample["answer"][1:]):  # each round asks for the next answer
            assert r.observation == [{"role": "user", "content": str(n)}]
        assert env.max_new_tokens == answer_budget(sample["answer"][-1], config.data.lengths.slack)  # each round's own budget
    long = next(s for s in samples if len(s["answer"]) >= 3)
    half = asyncio.run(play_by_hand(LongtailChatEnv(config), long, ["5" * long["answer"][0], "x"]))
    assert half[0].reward == pytest.approx(1 / len(long["answer"])) and half[1].reward == 0.0


def test_task_node_resumes_exactly():
    cfg = Config.from_dict({"data": {"source": "task:add", "num_prompts": 7}})
    a = PromptNode(cfg.data, seed=3)
    first = [next(a) for _ in range(10)]  # crosses an epoch boundary
    state = a.state_dict()
    rest = [next(a) for _ in range(5)]
    b = PromptNode(cfg.data, seed=3)
    b.reset(state)
    assert [next(b) for _ in range(5)] == rest
    assert first[:7] != first[7:] + rest[:4]  # epochs differ


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_file_sources(tmp_path, fmt):
    rows = [
        {"question": f"q{i}?", "solution": str(i), "level": i % 3, "prompt": "not it", "answer": "nor this"} for i in range(5)
    ]  # columns named like a record's own
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = Config.from_dict(
        {
            "data": {"source": str(path), "prompt_key": "question", "answer_key": "solution"},
            "scoring": {"reward_fn": "tests.test_data_scoring:exact"},
        }
    )
    node = PromptNode(cfg.data, seed=0)
    got = [next(node) for _ in range(5)]
    assert sorted(r["prompt"] for r in got) == [f"q{i}?" for i in range(5)]
    assert all(r["answer"] == r["prompt"][1:-1] and "level" in r for r in got)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_chat_rows_read_alike_from_every_file_format(tmp_path, fmt):
    """Arrow gives every row every column and message field, None where a row had none: a chat
    row whose answer is its assistant message lost it to the other rows' `answer` column (None),
    and each message carried `name: None` or `tool_calls: None` into the chat template."""
    rows = [
        {"messages": [{"role": "user", "content": "2+2?", "name": "ann"}], "answer": "4"},
        {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "tool_calls": [{"id": "a"}]}]},
    ]
    path = tmp_path / f"chat.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    records = load_records(Config.from_dict({"data": {"source": str(path), "prompt_key": "messages"}}).data)
    assert [(r["prompt"], r["answer"]) for r in records] == [
        ([{"role": "user", "content": "2+2?", "name": "ann"}], "4"),
        ([{"role": "user", "content": "3+3?"}], "6"),
    ]


def exact(prompt, response, sample):
    return float(response == sample["answer"])


# ---- rollout workers --------------------------------------------------------------------------------
class EndpointsOf:
    """An EpisodeQueue behind the actor calling convention: `q.claim.call_one(...)` is awaitable."""

    def __init__(self, queue: EpisodeQueue):
        self.queue = queue

    def __getattr__(self, name):
        fn = getattr(self.queue, name)
        return SimpleNamespace(call_one=lambda *args: asyncio.to_thread(fn, *args))


async def play_through_queue(worker: RolloutWorker, queue: EpisodeQueue, episodes: int, timeout: float = 30) -> "episode.TensorDict":
    """Run the worker's loop against `queue` until it has delivered `episodes` episodes; the batch trained next."""
    worker.start(EndpointsOf(queue))
    try:
        batch = await asyncio.to_thread(queue.sample, queue.batch_groups, queue.version, timeout)
        deadline = time.monotonic() + 10
        while len(worker.window) < episodes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the put has landed; the worker counts its episodes next
        return batch
    finally:
        await worker.stop()


def single_turn_config(**extra) -> Config:
    return Config.from_dict(
        {"batch_groups": 1, "buffer": {"depth": 0}, "generator": {"group_size": 4, "update_mode": "block"}, "data": {"source": "task:letters"}, **extra}
    )


def texts_of(batch, tok) -> list[str]:
    """Each row's model tokens, decoded (failed rows too: their loss mask is off)."""
    model = batch["versions"] != episode.PAD_VERSION
    return [tok.decode(batch["tokens"][i][model[i]].tolist(), skip_special_tokens=True) for i in range(batch.batch_size[0])]


def test_worker_fails_episodes_whose_reward_raises_or_times_out(tokenizer_dir):
    config = single_turn_config(scoring={"timeout_s": 0.2})

    def flaky(prompt, response, sample):
        assert prompt == sample["prompt"] and sample["finish_reason"] == "stop" and sample["response_ids"][-1] == 2
        if response == "boom":
            raise RuntimeError("bad reward")
        if response == "slow":
            time.sleep(1.0)
        return float(len(response))

    worker = RolloutWorker(config, tokenizer_dir, reward_fn=flaky)
    worker.set_generators([ScriptedGenerator(replies_in_order(worker.tokenizer, ["ab", "boom", "slow", "abcd"]))])
    queue = EpisodeQueue(config)
    batch = asyncio.run(play_through_queue(worker, queue, 4))
    # episodes run concurrently: which row got which reply is not fixed, so match by text
    texts = texts_of(batch, worker.tokenizer)
    assert sorted(texts) == ["ab", "abcd", "boom", "slow"]
    want = {"ab": (2.0, "stop"), "boom": (0.0, "failed"), "slow": (0.0, "failed"), "abcd": (4.0, "stop")}
    assert batch["reward"].tolist() == [want[t][0] for t in texts]
    assert batch["finish_reason"].tolist() == [episode.FINISH_REASONS[want[t][1]] for t in texts]
    assert abs(float(batch["advantage"].sum())) < 1e-5
    failed = [want[t][1] == "failed" for t in texts]  # out of the loss and of the group's statistics
    assert [not row.any() for row in batch["loss_mask"]] == failed
    assert all(a == 0 for a, f in zip(batch["advantage"].tolist(), failed) if f)
    assert worker.failed_total == 2
    m = summarize(worker.metrics(), worker.failed_total)
    assert m["episode/failed"] == 2 and m["episode/failed_total"] == 2 and m["reward/mean"] == 1.5
    assert m["episode/count"] == 4 and worker.window == []


def test_multi_turn_episode_is_token_in_token_out(tokenizer_dir):
    """A guess episode through the character tokenizer's chat template: the episode's ids are
    the prompt's, then each model turn's sampled ids and each env reply's ids, appended."""
    config = Config.from_dict({"data": {"source": "task:guess"}, "generator": {"max_new_tokens": 4}})
    worker = RolloutWorker(config, tokenizer_dir)
    tok = worker.tokenizer
    gen = ScriptedGenerator(replies_in_order(tok, ["3", "7", "5"]), version=4)
    worker.set_generators([gen])
    record = {"prompt": [{"role": "user", "content": "?"}], "answer": "5"}
    ep = asyncio.run(worker.play_episode(7, 71, record, version=2, replica=0))

    renderer = ChatRenderer(tok)
    want = renderer.initial_ids(record["prompt"])
    env_ids = []
    for k, (text, hint) in enumerate(zip("375", ["+", "-", None])):
        context, budget, min_version = gen.calls[k]
        assert context == want and min_version == 2  # each model turn saw exactly the episode so far
        assert budget == 4
        model_ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        want = want + model_ids
        if hint:
            more = renderer.continuation_ids(model_ids, [{"role": "user", "content": hint}])
            env_ids.append(more)
            want = want + more
    assert len(gen.calls) == 3 and ep.token_ids == want
    # ... which is the whole conversation as the chat template writes it
    messages = [
        *record["prompt"],
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "+"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "-"},
        {"role": "assistant", "content": "5"},
    ]
    assert tok.decode(ep.token_ids, skip_special_tokens=False) == tok.apply_chat_template(messages, tokenize=False)
    assert [t.role for t in ep.turns] == ["env", "model", "env", "model", "env", "model"]
    assert len(ep.model_turns) == 3 and [t.reward for t in ep.model_turns] == [0.0, 0.0, pytest.approx(0.8)]
    assert all(t.versions == [4, 4] and t.logprobs == [-0.5, -0.5] for t in ep.model_turns)
    assert ep.reward == pytest.approx(0.8) and ep.finish_reason == "stop" and ep.tool_calls == 0
    assert ep.env_tokens == sum(map(len, env_ids)) and ep.prompt_len == len(renderer.initial_ids(record["prompt"]))
    td = episode.pack([ep])
    assert td["tokens"][0].tolist() == want
    assert td["loss_mask"][0].sum() == 6 and td["model_turns"].tolist() == [3]


def test_tool_episode_counts_calls_and_env_tokens(tokenizer_dir):
    config = Config.from_dict({"data": {"source": "task:calc"}, "rollout": {"tool_parser": "compact"}})
    worker = RolloutWorker(config, tokenizer_dir)
    tok = worker.tokenizer
    gen = ScriptedGenerator(replies_in_order(tok, ["!", "4"]))
    worker.set_generators([gen])
    record = {"prompt": [{"role": "user", "content": "7-3"}], "answer": "4"}
    ep = asyncio.run(worker.play_episode(0, 0, record, version=0, replica=0))
    assert ep.reward == 1.0 and ep.tool_calls == 1 and len(ep.model_turns) == 2 and ep.finish_reason == "stop"
    messages = [*record["prompt"], {"role": "assistant", "content": "!"}, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]
    assert tok.decode(ep.token_ids, skip_special_tokens=False) == tok.apply_chat_template(messages, tokenize=False)
    assert gen.calls[1][0] == ep.token_ids[:-2]  # the answer turn saw the tool's result
    assert ep.env_tokens == len(tok.encode("<bos>T4<eos><bos>A", add_special_tokens=False)) == 6


def test_each_turn_gets_its_envs_token_budget(tokenizer_dir):
    """A record's `max_new_tokens` budgets a single-turn reply; a multi-turn env sets each
    turn's; generator.max_new_tokens caps both."""
    config = Config.from_dict({"data": {"source": "task:longtail_chat", "lengths": {"median": 4, "max": 20}}, "generator": {"max_new_tokens": 30}})
    worker = RolloutWorker(config, tokenizer_dir)
    gen = ScriptedGenerator(replies_in_order(worker.tokenizer, ["11", "22222", "3" * 40]))
    worker.set_generators([gen])
    record = {"prompt": [{"role": "user", "content": "2"}], "answer": [2, 5, 40]}
    ep = asyncio.run(worker.play_episode(0, 0, record, 0, 0))
    assert [budget for _, budget, _ in gen.calls] == [answer_budget(2, 0.25), answer_budget(5, 0.25), 30]
    assert ep.model_turns[-1].finish_reason == "length" and ep.reward == pytest.approx(2 / 3 + 30 / 40 / 3)

    single = RolloutWorker(single_turn_config(generator={"group_size": 4, "update_mode": "block", "max_new_tokens": 20}), tokenizer_dir, reward_fn=exact)
    gen = ScriptedGenerator(lambda ids: [5] * 30)
    single.set_generators([gen])
    for budget, want in ((7, 7), (None, 20), (50, 20)):
        asyncio.run(single.play_episode(0, 0, {"prompt": "q:", "answer": "", "max_new_tokens": budget}, 0, 0))
        assert gen.calls[-1][1] == want


def test_a_prompt_without_room_for_its_answer_is_refused_before_the_run_and_fails_its_episode(tokenizer_dir, tmp_path):
    """A prompt longer than model.max_seq_len used to end its episode at once, as `length`:
    the run trained on nothing and said nothing. Preflight refuses a single-turn source whose
    first prompt leaves its answer budget no room; an env's first observation that leaves
    none fails its episode with the same fix."""
    from meshrl.preflight import check_user_code

    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "q" * 60, "answer": "q"}) + "\n")
    config = Config.from_dict({"data": {"source": str(data)}, "model": {"max_seq_len": 64}, "generator": {"max_new_tokens": 8}})
    with pytest.raises(
        ConfigError, match=r"a prompt of 60 tokens leaves 4 of a model turn's 8 tokens under model.max_seq_len=64: raise it to at least 68"
    ) as e:
        check_user_code(config)
    assert e.value.field_path == "model.max_seq_len" and str(data) in str(e.value)
    check_user_code(Config.from_dict({"data": {"source": str(data)}, "model": {"max_seq_len": 68}, "generator": {"max_new_tokens": 8}}))
    data.write_text(json.dumps({"prompt": "q" * 60, "answer": "q", "max_new_tokens": 100}) + "\n")  # generator.max_new_tokens caps it
    check_user_code(Config.from_dict({"data": {"source": str(data)}, "model": {"max_seq_len": 68}, "generator": {"max_new_tokens": 8}}))

    config = Config.from_dict({"data": {"source": "task:guess"}, "model": {"max_seq_len": 16}, "generator": {"max_new_tokens": 4}})
    worker = RolloutWorker(config, tokenizer_dir)
    gen = ScriptedGenerator(replies_in_order(worker.tokenizer, ["1"]))
    worker.set_generators([gen])
    ep = asyncio.run(worker.play_episode(0, 0, {"prompt": [{"role": "user", "content": "?" * 20}], "answer": "9"}, 0, 0))
    assert ep.finish_reason == "failed" and gen.calls == []
    assert ep.failure.startswith("a prompt of ") and "no room for a model turn under model.max_seq_len=16: raise it to at least" in ep.failure


def test_preflight_loads_the_policys_tokenizer_once(tokenizer_dir, tmp_path, monkeypatch):
    """The tokenizer check and the prompt-room check read the same tokenizer: preflight loads it
    once and hands it on (a real model's tokenizer takes seconds to load)."""
    import meshrl.tokenizer
    from meshrl.preflight import preflight

    loads = []
    load = meshrl.tokenizer.load_tokenizer
    monkeypatch.setattr(meshrl.tokenizer, "load_tokenizer", lambda path: loads.append(path) or load(path))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "q" * 60, "answer": "q"}) + "\n")
    config = {
        "data": {"source": str(data)},
        "scoring": {"reward_fn": "tests.test_data_scoring:exact"},
        "model": {"tokenizer": str(tokenizer_dir)},
        "logging": {"run_dir": str(tmp_path / "run")},
    }
    preflight(Config.from_dict({**config, "generator": {"max_new_tokens": 8}}))
    assert loads == [str(tokenizer_dir)]
    with pytest.raises(ConfigError, match="a prompt of 60 tokens leaves 4 of a model turn's 8 tokens under model.max_seq_len=64"):
        preflight(Config.from_dict({**config, "model": {"tokenizer": str(tokenizer_dir), "max_seq_len": 64}, "generator": {"max_new_tokens": 8}}))
    assert loads == [str(tokenizer_dir)] * 2


def test_an_episode_out_of_turns_ends_on_a_model_turn(tokenizer_dir):
    config = Config.from_dict({"data": {"source": "task:guess"}, "rollout": {"max_turns": 2}})
    worker = RolloutWorker(config, tokenizer_dir)
    worker.set_generators([ScriptedGenerator(replies_in_order(worker.tokenizer, ["1", "2"]))])
    ep = asyncio.run(worker.play_episode(0, 0, {"prompt": [{"role": "user", "content": "?"}], "answer": "9"}, 0, 0))
    assert ep.finish_reason == "length" and ep.reward == 0.0
    assert [t.role for t in ep.turns] == ["env", "model", "env", "model"]  # no reply nobody answers
    td = episode.pack([ep])
    assert episode.trim(td)["tokens"].shape == td["tokens"].shape


def test_a_failing_generator_call_fails_the_group_not_its_episodes(tokenizer_dir):
    config = single_turn_config()
    worker = RolloutWorker(config, tokenizer_dir, reward_fn=exact)
    claim = Claim(3, {"prompt": "a:", "answer": "aa"}, 0)
    calls = []

    def reply(ids):
        calls.append(ids)
        if len(calls) == 2:
            raise RuntimeError("replica died")
        return [5, 5, 2]

    scripted = ScriptedGenerator(reply)
    worker.set_generators([scripted])
    with pytest.raises(GenerationFailed, match="replica 0: RuntimeError: replica died"):
        asyncio.run(worker.play_group(claim))
    # the group's episodes asked for their turns together: one message carried them all
    assert len(calls) == config.generator.group_size and scripted.messages == 1
    # a replica that stops mid-turn (finish_reason abort) fails the group too
    aborting = ScriptedGenerator(lambda ids: [5])
    worker.set_generators([aborting])

    async def aborted(requests, call_id=None):
        return [RequestResult([5], [-0.5], [0], "abort") for _ in requests]

    aborting.generate_many = SimpleNamespace(call_one=aborted)
    with pytest.raises(GenerationFailed, match="stopping"):
        asyncio.run(worker.play_group(claim))
    worker.set_generators([])
    with pytest.raises(GenerationFailed, match="no generator"):
        asyncio.run(worker.play_group(claim))


def test_a_replica_whose_call_failed_gets_groups_again_once_a_call_succeeds_or_a_while_after(monkeypatch):
    """A live replica's passing error (a slow update's version wait timing out) sends new groups
    elsewhere, not for the rest of the run: a call of its that succeeds, or FAILED_SKIP_S,
    ends that."""
    from meshrl.agent import turns

    failing = {0: 1}  # replica -> calls left to fail

    def replica(i):
        async def call(requests, call_id=None):
            if failing.get(i, 0) > 0:
                failing[i] -= 1
                return ["TimeoutError: waited 150s for version 3" for _ in requests]
            return [RequestResult([5], [-0.5], [0], "stop") for _ in requests]

        return SimpleNamespace(generate_many=SimpleNamespace(call_one=call))

    batcher = turns.TurnBatcher(single_turn_config())
    batcher.set_generators([replica(0), replica(1)])

    async def turn(i):
        return await batcher.generate(i, [1, 2], 4, 0)

    with pytest.raises(GenerationFailed, match="replica 0: TimeoutError"):
        asyncio.run(turn(0))
    assert batcher.acquire() == 1 and batcher.acquire() == 1  # replica 0 skipped, though less loaded
    asyncio.run(turn(0))  # a call already on its way to it succeeds
    assert batcher.acquire() == 0
    failing[0] = 1
    with pytest.raises(GenerationFailed):
        asyncio.run(turn(0))
    assert batcher.acquire() == 1
    later = time.monotonic() + turns.FAILED_SKIP_S
    monkeypatch.setattr(turns.time, "monotonic", lambda: later)
    assert batcher.acquire() == 0  # its failure has aged out


def test_a_long_turn_is_no_lost_call():
    """A call's bound was weight_sync.timeout_s + generator.startup_timeout_s whatever its turns'
    budgets: a long reasoning turn on a busy replica timed out, its group was played again, and
    timed out again, for ever. The bound grows with the longest turn's budget."""
    from meshrl.agent import turns

    async def slow(requests, call_id=None):
        await asyncio.sleep(0.6)
        return [RequestResult([5], [-0.5], [0], "length") for _ in requests]

    batcher = turns.TurnBatcher(single_turn_config())
    batcher.call_timeout_s = 0.2  # the part for an update and a start
    batcher.set_generators([SimpleNamespace(generate_many=SimpleNamespace(call_one=slow))])
    assert asyncio.run(batcher.generate(0, [1, 2], 4, 0)).finish_reason == "length"  # 4 tokens: 2 s more


def test_a_call_given_up_on_is_aborted_on_its_replica():
    """A call past its bound failed its turns here while its requests went on generating on the
    replica, for a group played again: each retry left group_size more behind."""
    from meshrl.agent import turns

    aborted = []

    async def never(requests, call_id=None):
        await asyncio.sleep(3600)

    async def abort(call_id):
        aborted.append(call_id)
        return True

    batcher = turns.TurnBatcher(single_turn_config())
    batcher.call_timeout_s = 0.2
    batcher.set_generators([SimpleNamespace(generate_many=SimpleNamespace(call_one=never), abort_many=SimpleNamespace(call_one=abort))])

    async def main():
        with pytest.raises(GenerationFailed, match="TimeoutError"):
            await batcher.generate(0, [1, 2], 1, 0)
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert len(aborted) == 1


def test_a_failing_generator_stops_the_rest_of_its_group(tokenizer_dir):
    """One episode's generator call fails: the group's other episodes are cancelled (their
    envs closed), not left generating for a group that is played again anyway."""
    config = single_turn_config()
    closed = []

    resets = []

    class Env(SingleTurnEnv):
        async def reset(self, sample):
            resets.append(1)
            if len(resets) == 1:  # this episode asks later, in a message of its own
                await asyncio.sleep(0.1)
            return await super().reset(sample)

        def close(self):
            closed.append(1)

    worker = RolloutWorker(config, tokenizer_dir, reward_fn=exact)
    worker.make_env = lambda: Env(exact)
    started = []

    async def call(requests, call_id=None):
        started.extend(requests)
        if len(requests) == 1:  # the late episode's turn fails; the others' never return
            await asyncio.sleep(0.05)
            raise RuntimeError("replica died")
        await asyncio.sleep(30)

    gen = SimpleNamespace(generate_many=SimpleNamespace(call_one=call))
    worker.set_generators([gen])

    async def main():
        t0 = time.monotonic()
        with pytest.raises(GenerationFailed):
            await worker.play_group(Claim(0, {"prompt": "a:", "answer": ""}, 0))
        elapsed = time.monotonic() - t0
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return elapsed, left

    elapsed, left = asyncio.run(main())
    assert elapsed < 5 and left == []
    assert len(started) == 4 and len(closed) == 4  # every env closed, the cancelled ones too
    assert worker.turns.load == [0]


def test_a_requeued_group_is_played_again_from_its_start(tokenizer_dir):
    # every episode answers "a" (equal rewards): dynamic sampling would drop the group
    config = single_turn_config(buffer={"depth": 0, "dynamic_sampling": False})
    worker = RolloutWorker(config, tokenizer_dir, reward_fn=exact)
    failures = [RuntimeError("replica died")]

    def reply(ids):
        if failures:
            raise failures.pop()
        return worker.tokenizer.encode("a", add_special_tokens=False) + [2]

    gen = ScriptedGenerator(reply)
    worker.set_generators([gen])
    queue = EpisodeQueue(config)
    batch = asyncio.run(play_through_queue(worker, queue, 4))
    assert batch["group_id"].tolist() == [0] * 4 and batch["finish_reason"].tolist() == [0] * 4
    assert worker.requeued_total == 1 and queue.metrics()["buffer/requeued"] == 1
    assert queue.consumed == [0] and queue.next_group_id == 1  # the same group, trained once
    assert len(gen.calls) >= 5  # the failed attempt's calls, then all 4 episodes from the start


def test_env_factory_picks_the_env():
    guess = env_factory(Config.from_dict({"data": {"source": "task:guess"}}))
    assert isinstance(guess(), GuessEnv) and guess() is not guess()  # one env per episode
    single = env_factory(Config.from_dict({"data": {"source": "task:letters"}}))()
    assert isinstance(single, SingleTurnEnv) and single.reward_fn.__wrapped__ is TASKS["letters"].reward
    # a reward passed in code is played through a SingleTurnEnv whatever the task
    assert env_factory(Config.from_dict({"data": {"source": "task:letters"}}), reward_fn=exact)().reward_fn is exact
    user = env_factory(Config.from_dict({"rollout": {"env": "tests.test_data_scoring:EchoEnv", "env_args": {"greeting": "hi"}}}))()
    assert isinstance(user, EchoEnv) and user.greeting == "hi"


class EchoEnv:
    def __init__(self, greeting: str):
        self.greeting = greeting

    def reset(self, sample):
        return self.greeting

    def step(self, turn):
        from meshrl.rollout.env import StepResult

        return StepResult(reward=1.0)


def test_summarize_per_episode_windows():
    assert summarize([]) == {}
    windows = [
        {"reward": r, "success": float(r >= 1.0), "failed": f, "response_len": n, "turns": t, "tool_calls": c, "env_tokens": e, "env_s": s, "truncated": 0.0}
        for r, f, n, t, c, e, s in [(1.0, 0.0, 4.0, 2.0, 1.0, 6.0, 0.5), (0.0, 1.0, 2.0, 1.0, 0.0, 0.0, 0.25), (0.5, 0.0, 6.0, 3.0, 2.0, 9.0, 0.25)]
    ]
    m = summarize(windows, failed_total=7.0)
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["reward/std"] == pytest.approx(0.5)  # unbiased: sqrt(((0.5)^2 + (0.5)^2 + 0) / 2)
    assert m["reward/success_rate"] == pytest.approx(1 / 3)
    assert m["response/length_mean"] == pytest.approx(4.0)
    assert m["response_lengths"] == [2.0, 4.0, 6.0] and m["response/length_p50"] == 4.0
    assert m["response/length_p95"] == m["response/length_max"] == 6.0
    assert m["episode/count"] == 3 and m["episode/turns_mean"] == pytest.approx(2.0)
    assert m["episode/tool_calls_mean"] == pytest.approx(1.0) and m["episode/env_tokens_mean"] == pytest.approx(5.0)
    assert m["episode/failed"] == 1 and m["episode/failed_total"] == 7.0 and m["episode/env_s"] == pytest.approx(1.0)
    assert summarize(windows[:1])["reward/std"] == 0.0


def test_success_is_the_verifiers_not_the_scorers():
    """`reward/success_rate` read the trained reward, scorers' scores included: a wrong answer a
    reward model rated 1.2 counted as a success, a right one it rated -0.5 did not."""
    from meshrl.agent.summary import succeeded
    from meshrl.episode import Episode, Turn

    def scored(env: float, trained: float) -> Episode:
        ep = Episode(0, 0, [Turn("env", [1]), Turn("model", [4], [-0.5], [0], reward=trained)])
        ep.signals["env"] = env
        return ep

    assert succeeded(scored(0.0, 1.2), False) == 0.0 and succeeded(scored(1.0, -0.5), False) == 1.0
    assert succeeded(scored(1.0, 1.0), True) == 0.0  # failed: never a success
    unscored = Episode(0, 0, [Turn("env", [1]), Turn("model", [4], [-0.5], [0], reward=1.0)])
    assert succeeded(unscored, False) == 1.0  # without scorers, the env's reward is the trained one
    rounds = Episode(0, 0, [Turn("env", [1])] + [Turn("model", [4], [-0.5], [0], reward=1 / 6) for _ in range(6)])
    assert rounds.reward < 1.0 and succeeded(rounds, False) == 1.0  # six rounds of 1/6, every one right


def test_the_run_totals_keep_a_replaced_or_silent_workers_count():
    """`episode/failed_total` and `rollout/requeued_groups` summed the live workers' own
    counts: a replaced worker's failures vanished from the total, and one that did not answer
    in time dropped it for a step."""
    from types import SimpleNamespace

    from meshrl.controller.replicas import WorkerPool

    def worker(ident, failed, requeued):
        async def metrics():
            if failed is None:
                raise TimeoutError("no answer")
            window = {"reward": 1.0, "success": 1.0, "failed": 0.0, "response_len": 2.0, "turns": 1.0, "tool_calls": 0.0, "env_tokens": 0.0, "env_s": 0.0}
            return {"episodes": [{**window, "truncated": 0.0}], "failed_total": failed, "requeued_total": requeued}

        return SimpleNamespace(ident=ident, actor=SimpleNamespace(metrics=SimpleNamespace(call_one=metrics)))

    pool = WorkerPool.__new__(WorkerPool)
    pool.replaced, pool._totals = 0, {}
    pool.workers = [worker(0, 3, 1), worker(1, 2, 0)]
    row = asyncio.run(pool.metrics())
    assert row["episode/failed_total"] == 5 and row["rollout/requeued_groups"] == 1
    pool.workers = [worker(100, 1, 0), worker(1, None, None)]  # worker 0 replaced; worker 1 silent this step
    row = asyncio.run(pool.metrics())
    assert row["episode/failed_total"] == 6 and row["rollout/requeued_groups"] == 1


# ---- metrics, rewards ----------------------------------------------------------------------------------
def test_metrics_jsonl_tensorboard_and_plot(tmp_path):
    w = MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        w.write(
            step,
            {
                "reward/mean": step / 10,
                "trainer/loss": 1 / step,
                "trainer/staleness_mean": 0.5,
                "trainer/idle_frac": 0.1,
                "generator/idle_frac": 0.2,
                "bad": float("nan"),
            },
        )
    w.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and "bad" not in rows[0]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    out = subprocess.run([sys.executable, "-m", "meshrl", "plot", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "meshrl", "plot", str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_a_resume_writes_again_the_checkpointed_rows_the_file_lost(tmp_path):
    """A run killed after step 3's checkpoint, before (or as) step 3's row was written: the
    resume writes the rows its checkpoint's history holds past the file's last step, and cuts
    rows past the restored step, so each step has its row once."""
    history = [{"step": s, "trainer/loss": s / 10} for s in (1, 2, 3)]
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for row in history[:2]:
        w.write(row["step"], {"trainer/loss": row["trainer/loss"]})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "trainer/lo')  # torn by the kill
    MetricsWriter(str(tmp_path), tensorboard=False, keep_until=3, restored=history).close()
    assert read_metrics(str(tmp_path)) == history
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "trainer/loss": 0.4}\n')  # a step past the checkpoint: trained again
    MetricsWriter(str(tmp_path), tensorboard=False, keep_until=3, restored=history + [{"step": 4, "trainer/loss": 0.4}]).close()
    assert read_metrics(str(tmp_path)) == history  # a history that a heal left past its checkpoint: cut too
    # step 4's evaluation written (it finished during the checkpoint) but not the step's own row
    evaluation = {"step": 4, "eval/greedy_accuracy": 0.5}
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps(evaluation) + "\n")
    MetricsWriter(str(tmp_path), tensorboard=False, keep_until=4, restored=history + [evaluation, {"step": 4, "trainer/loss": 0.4}]).close()
    assert read_metrics(str(tmp_path)) == history + [evaluation, {"step": 4, "trainer/loss": 0.4}]


def test_a_heal_that_went_back_cuts_the_lost_steps_rows_and_events(tmp_path):
    """A heal restored to step 2 from a snapshot older than the step in flight (snapshot_every
    > 1, or 0): steps 3 and 4 and step 4's evaluation were written, then trained again and
    written again, each step twice in metrics.jsonl, in TensorBoard and in plots. The lost
    steps' rows and events are cut, so the retrained ones are each step's only row."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(str(tmp_path))
    for step in (1, 2, 3, 4):
        w.write(step, {"trainer/loss": step})
    w.write(4, {"eval/greedy_accuracy": 0.5})
    w.rewind(2)
    for step in (3, 4, 5):
        w.write(step, {"trainer/loss": 10 * step})
    w.close()
    assert [(r["step"], r.get("trainer/loss")) for r in read_metrics(str(tmp_path))] == [(1, 1), (2, 2), (3, 30), (4, 40), (5, 50)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("trainer/loss")] == [(1, 1), (2, 2), (3, 30), (4, 40), (5, 50)]


def test_a_games_curves_and_progress_bar_show_each_trained_models_own_reward():
    from meshrl.api import progress_keys
    from meshrl.config import Config
    from meshrl.metrics import format_row, panels_of

    names = sorted(
        ["reward/mean", "trainer/reward_mean", "trainer/entropy", "proposer/reward/mean", "proposer/trainer/reward_mean", "proposer/trainer/entropy"]
    )
    panels = dict(panels_of(names))
    assert panels["reward"] == ["reward/mean", "proposer/reward/mean", "trainer/reward_mean", "proposer/trainer/reward_mean"]
    assert panels["stability"] == ["trainer/entropy", "proposer/trainer/entropy"]
    assert dict(panels_of(["trainer/entropy", "trainer/reward_mean"]))["stability"] == ["trainer/entropy"]  # one model: as before
    c = Config.from_dict({"data": {"source": "task:propose"}, "models": [{"name": "proposer"}, {"name": "user", "frozen": True, "model": {"path": "/x"}}]})
    keys = progress_keys(c)
    assert keys[-1] == "proposer/trainer/reward_mean" and not any(k.startswith("user/") for k in keys)
    assert format_row({"trainer/reward_mean": 0.5, "proposer/trainer/reward_mean": 0.25}, keys) == "reward_mean=0.5 proposer:reward_mean=0.25"


def test_reward_model_scores_through_the_same_interface(tmp_path, tokenizer_dir):
    """A local sequence-classification checkpoint as the reward, via scoring.reward_model,
    played by a rollout worker through a SingleTurnEnv."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    cfg = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(cfg).eval()
    path = tmp_path / "rm"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    config = Config.from_dict({"scoring": {"reward_model": str(path)}, "generator": {"group_size": 2}})
    assert isinstance(env_factory(config)(), SingleTurnEnv)
    worker = RolloutWorker(config, tokenizer_dir)
    tok = worker.tokenizer
    worker.set_generators([ScriptedGenerator(replies_in_order(tok, ["123", "xyz"]))])
    episodes = asyncio.run(worker.play_group(Claim(1, {"prompt": "a:", "answer": ""}, 0)))
    td = episode.pack(episodes)
    texts = texts_of(td, tok)
    assert sorted(texts) == ["123", "xyz"]
    with torch.no_grad():  # the prompt as the user's turn, the response as the assistant's, in the checkpoint's chat template
        want = [
            float(
                model(
                    torch.tensor(
                        [tok.apply_chat_template([{"role": "user", "content": "a:"}, {"role": "assistant", "content": t}], tokenize=True, return_dict=False)]
                    )
                ).logits[0, 0]
            )
            for t in texts
        ]
    assert td["reward"].tolist() == pytest.approx(want, abs=1e-5)
    assert td["finish_reason"].tolist() == [0, 0]
    # the same function, called directly
    fn = resolve_reward(config)
    assert fn("a:", "123", {}) == pytest.approx(want[texts.index("123")], abs=1e-5)
    # a chat record: the reward model reads all of its messages (it read only the last user turn)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a:"}]
    worker.set_generators([ScriptedGenerator(replies_in_order(tok, ["123", "123"]))])
    chat_td = episode.pack(asyncio.run(worker.play_group(Claim(2, {"prompt": chat, "answer": ""}, 0))))
    with torch.no_grad():
        ids = tok.apply_chat_template([*chat, {"role": "assistant", "content": "123"}], tokenize=True, return_dict=False)
        chat_want = float(model(torch.tensor([ids])).logits[0, 0])
    assert chat_td["reward"].tolist() == pytest.approx([chat_want, chat_want], abs=1e-5)
