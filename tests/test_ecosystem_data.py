"""The field's data and checkers: math-verify and reasoning-gym rewards, reasoning-gym sources,
chat-message files and `datasets` directories, held-out eval prompts, and the one-line hint
when an optional extra is missing. Fast: no engines, everything built locally."""

import json
import os
import subprocess
import sys
import threading

import pytest

from meshrl.config import Config, ConfigError
from meshrl.preflight import check
from meshrl.data import eval_records, load_records
from meshrl.queue.prompts import PromptNode
from meshrl.rollout.chat import ChatRenderer
from meshrl.scoring import resolve_reward
from meshrl.verifiers import final_answer, math_answer, reasoning_gym_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RG = {"source": "reasoning_gym:basic_arithmetic", "num_prompts": 6, "task_args": {"max_digits": 2}}


# ---- math-verify ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gold, response, reward",
    [
        ("0.5", "so it is 1/2", 1.0),
        ("1/2", "0.5", 1.0),
        ("0.5", r"first \boxed{3}, then \boxed{\frac{1}{2}}", 1.0),  # the last box counts
        (r"\frac{1}{2}", "<answer>\\frac12</answer>", 1.0),
        ("72", "The answer: 72 apples.", 1.0),
        ("0.5", r"\boxed{\frac{1}{3}}", 0.0),
        ("3", "I think 4", 0.0),
        ("3", "no idea", 0.0),
        ("42", "The final answer is 42. It took 3 tries.", 1.0),  # the stated answer, not the last number
        ("-5", "The answer is \u22125.", 1.0),  # typeset text's minus sign
        (["3", "three"], "The answer is 3.", 1.0),  # a list holds the accepted forms
        (["3", "5"], "The answer is 4.", 0.0),
        ("42", "**Answer:** 42\n\nThis used step 3.", 1.0),
        ("3/4", r"So the result is $\frac{3}{4}$", 1.0),
    ],
)
def test_math_answer(gold, response, reward):
    assert math_answer("", response, {"answer": gold}) == reward


def test_final_answer_takes_the_last_box_tag_or_cue_then_the_last_number():
    assert final_answer(r"7 <answer>8</answer> \boxed{x^{2}}") == "x^{2}"
    # a draft boxed while thinking gives way to the tag (or cue) after it; a box inside a tag is the tag's answer
    assert final_answer("<think>maybe \\boxed{3}? no</think>\n<answer>5</answer>") == "5" and final_answer("<answer>\\boxed{5}</answer>") == "5"
    assert final_answer("<think>maybe \\boxed{3}? no</think> The answer is 5.") == "5"
    # Markdown's emphasis around the cue or its answer
    assert final_answer("**Answer:** 42\n\nThis used step 3.") == "42" and final_answer("The answer is **42**. Done in 3 steps") == "42"
    assert final_answer(r"**Final Answer:** $\frac{1}{2}$") == r"\frac{1}{2}"
    # no cue: the last number, or the LaTeX it is a piece of
    assert final_answer(r"So the result is $\frac{3}{4}$") == r"\frac{3}{4}" and final_answer(r"The answer is $-\frac{3}{4}$ (negative).") == r"-\frac{3}{4}"
    assert final_answer(r"Let $x=3$. Then x+1 = 4") == "4" and final_answer("so $x = 3$") == "3"
    assert final_answer("7 <answer> 8 </answer> 9") == "8"
    assert final_answer("7 then -1,000.5") == "-1,000.5"
    assert final_answer("answer: 7, after 2 steps") == "7" and final_answer("about 5e3 of them") == "5e3"
    assert final_answer("The answer is 2 times the radius, so 2*5 = 10") == "10"  # a cue whose number ends no sentence states none
    assert final_answer("The answer is 3.5 cm, from 7/2") == "7/2" and final_answer("answer is 1,234 apples; 5 left") == "5"  # never part of one
    assert final_answer("The answer is 42\nChecked: 6 x 7") == "42" and final_answer("So the answer is 3.5?") == "3.5"
    # the math a cue names, whole: its digits were taken for the last number (1/2 read as 2)
    assert final_answer(r"The answer is $\frac{1}{2}$.") == r"\frac{1}{2}" and final_answer(r"answer: \(\frac{3}{4}\)") == r"\frac{3}{4}"
    assert final_answer(r"The answer is $2$ times the radius, so 2*5 = 10") == "10"  # as a bare number: it ends no sentence
    # unfinished: a last box that never closes
    assert final_answer(r"\boxed{3} so the total is \boxed{4") is None


@pytest.mark.parametrize(
    "gold, response, sample, reward",
    [
        ("2", r"The answer is $\frac{1}{2}$.", {}, 0.0),
        ("1/2", r"The answer is $\frac{1}{2}$.", {}, 1.0),
        ("18", r"\boxed{\$18}", {}, 1.0),  # an escaped dollar is money, not a math delimiter
        (r"\$18", r"\boxed{18}", {}, 1.0),
        ("42", "6*7 = 42", {"finish_reason": "length"}, 1.0),  # a short answer that filled its budget
        ("4", r"\boxed{3} so the total is \boxed{4", {}, 0.0),
    ],
)
def test_math_answer_reads_what_the_reply_finished_saying(gold, response, sample, reward):
    assert math_answer("", response, {"answer": gold, **sample}) == reward


def test_math_answer_off_the_main_thread():
    """Rewards run in worker threads, where math-verify's SIGALRM timeouts would raise."""
    got = []
    t = threading.Thread(target=lambda: got.append(math_answer("", r"\boxed{\frac{2}{4}}", {"answer": "0.5"})))
    t.start()
    t.join()
    assert got == [1.0]


def test_a_warm_checker_outlives_the_thread_that_asked_first():
    """A reward call runs on a thread that ends with it (rollout/env.py); a checker child started
    from that thread died with it (PDEATHSIG follows the starting thread), so every check paid
    a fresh process and math-verify's import."""
    import time

    from meshrl import verifiers

    asked = threading.Thread(target=lambda: math_answer("", "1", {"answer": "1"}))
    asked.start()
    asked.join()
    time.sleep(0.5)
    assert verifiers._idle and all(c.proc.poll() is None for c in verifiers._idle)


def test_an_idle_checker_exits_and_the_next_check_starts_another(monkeypatch):
    """A warm child stayed for the life of its process: a run's preflight left one behind in
    the controller, a process the run had not stopped."""
    from meshrl import verifiers

    verifiers._stop_checkers()
    monkeypatch.setattr(verifiers, "IDLE_EXIT_S", 1.0)
    try:
        assert math_answer("", "1", {"answer": "1"}) == 1.0
        assert verifiers._idle[-1].proc.wait(timeout=30) == 0  # gone by itself
        assert math_answer("", r"\boxed{2}", {"answer": "2"}) == 1.0  # a fresh one checks the next
    finally:
        verifiers._stop_checkers()


def test_math_answer_that_never_ends_is_killed_and_the_loop_keeps_running(monkeypatch):
    """`3^{3^{16}}` keeps sympy in one big-integer power holding the GIL for many seconds (a taller
    tower, forever): the check runs in a child that is killed at VERIFY_TIMEOUT_S, the answer
    scores 0.0 as on math-verify's own timeout, the rollout worker's event loop keeps turning
    throughout, and the next answer is checked by a fresh child."""
    import asyncio

    from meshrl import verifiers
    from meshrl.rollout.env import call_reward

    monkeypatch.setattr(verifiers, "VERIFY_TIMEOUT_S", 2.0)
    math_answer("", "1", {"answer": "1"})  # a warm child, so start-up is not in what is measured

    async def main():
        gaps, last = [], loop.time()

        async def ticker():
            nonlocal last
            while True:
                await asyncio.sleep(0.05)
                gaps.append(loop.time() - last)
                last = loop.time()

        tick = asyncio.create_task(ticker())
        reward = await call_reward(math_answer, "", r"\boxed{3^{3^{16}}}", {"answer": "1"}, timeout_s=60)
        tick.cancel()
        return reward, max(gaps)

    loop = asyncio.new_event_loop()
    try:
        reward, longest_stall = loop.run_until_complete(main())
    finally:
        loop.close()
    assert reward == 0.0
    assert longest_stall < 5, f"the event loop stalled {longest_stall:.1f}s while the answer was checked"
    assert math_answer("", r"\boxed{\frac{2}{4}}", {"answer": "0.5"}) == 1.0


# ---- reasoning-gym ------------------------------------------------------------------------------
def test_reasoning_gym_source_is_deterministic_and_resumes():
    config = Config.from_dict({"data": RG})
    a = PromptNode(config.data, seed=5)
    a.reset()
    first = [next(a) for _ in range(8)]  # crosses an epoch boundary
    state = a.state_dict()
    rest = [next(a) for _ in range(5)]
    b = PromptNode(config.data, seed=5)
    b.reset(state)
    assert [next(b) for _ in range(5)] == rest
    c = PromptNode(config.data, seed=5)
    c.reset()
    assert [next(c) for _ in range(8)] == first
    assert [r["question"] for r in first[:6]] != [r["question"] for r in first[6:] + rest[:4]]  # epochs differ
    record = first[0]
    system, user = record["prompt"]
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user == {"role": "user", "content": record["question"]}
    assert record["metadata"]["source_dataset"] == "basic_arithmetic"
    assert json.loads(json.dumps(record))["answer"] == record["answer"]  # records travel between actors


def test_reasoning_gym_scorer():
    config = Config.from_dict({"data": RG})
    node = PromptNode(config.data, seed=0)
    node.reset()
    record = next(node)
    for score in (resolve_reward(config), reasoning_gym_reward(config)):
        assert score("", f"Thinking... <answer>{record['answer']}</answer>", record) == 1.0
        assert score("", f"<answer>{record['answer']}1</answer>", record) < 1.0
        assert score("", record["answer"], record) == 0.0  # no tags: no answer


def test_reasoning_gym_bad_task_args_name_the_field():
    """Found by validation, before any mesh starts."""
    with pytest.raises(ConfigError, match="data.task_args: reasoning_gym:basic_arithmetic rejects"):
        check(Config.from_dict({"data": {**RG, "task_args": {"no_such_arg": 1}}}))


# ---- chat messages in files and datasets directories ----------------------------------------------
ROWS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": str(i + 1)}], "level": i}
    for i in range(4)
]


def _write(tmp_path, fmt: str, rows: list[dict]) -> str:
    if fmt == "jsonl":
        path = tmp_path / "chat.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "chat.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        from datasets import Dataset, DatasetDict

        path = tmp_path / "chat_ds"
        data = Dataset.from_list(rows)
        (DatasetDict({"test": data.select([0]), "train": data}) if fmt == "datasetdict" else data).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "dataset", "datasetdict"])
def test_chat_rows_load_and_render(tmp_path, fmt, qwen_style_tokenizer):
    config = Config.from_dict(
        {"data": {"source": _write(tmp_path, fmt, ROWS), "prompt_key": "messages"}, "scoring": {"reward_fn": "meshrl.verifiers:math_answer"}}
    )
    node = PromptNode(config.data, seed=0)
    node.reset()
    records = sorted((next(node) for _ in range(4)), key=lambda r: r["level"])
    renderer = ChatRenderer(qwen_style_tokenizer)
    for i, r in enumerate(records):
        assert r["answer"] == str(i + 1) and [m["role"] for m in r["prompt"]] == ["system", "user"]
        text = qwen_style_tokenizer.decode(renderer.initial_ids(r["prompt"]))
        assert text == f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{i}+1?<|im_end|>\n<|im_start|>assistant\n"


def test_chat_rows_keep_their_own_answer_and_reject_bad_messages(tmp_path):
    rows = [{"messages": ROWS[0]["messages"], "answer": "one"}, {"messages": [{"role": "user", "content": "hi"}]}]
    records = load_records(
        Config.from_dict(
            {"data": {"source": _write(tmp_path, "jsonl", rows), "prompt_key": "messages"}, "scoring": {"reward_fn": "meshrl.verifiers:math_answer"}}
        ).data
    )
    assert records[0]["answer"] == "one" and records[0]["prompt"][-1]["role"] == "user"  # the assistant turn still leaves
    assert records[1]["answer"] is None and records[1]["prompt"] == [{"role": "user", "content": "hi"}]
    bad = tmp_path / "bad"
    bad.mkdir()
    config = Config.from_dict(
        {
            "data": {"source": _write(bad, "jsonl", [ROWS[0], {"messages": [{"content": "no role"}]}]), "prompt_key": "messages"},
            "scoring": {"reward_fn": "meshrl.verifiers:math_answer"},
        }
    )
    with pytest.raises(ValueError, match=r"\.jsonl:2: 'messages' holds .*'role' and 'content'"):  # FILE:LINE
        load_records(config.data)


def test_datasetdict_without_train_needs_one_split(tmp_path):
    from datasets import Dataset, DatasetDict

    data = Dataset.from_list(ROWS)
    DatasetDict({"a": data, "b": data}).save_to_disk(str(tmp_path / "two"))
    DatasetDict({"only": data}).save_to_disk(str(tmp_path / "one"))
    cfg = lambda d: (
        Config.from_dict({"data": {"source": str(tmp_path / d), "prompt_key": "messages"}, "scoring": {"reward_fn": "meshrl.verifiers:math_answer"}}).data
    )
    assert len(load_records(cfg("one"))) == 4
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\] and none is 'train'"):
        load_records(cfg("two"))
    # before the run: one line (a traceback of datasets' loading, where it was a bare ValueError), the held-out one's own advice
    from meshrl.data import check_records

    with pytest.raises(ConfigError, match=r"splits \['a', 'b'\] and none is 'train'"):
        check_records(
            Config.from_dict({"data": {"source": str(tmp_path / "two"), "prompt_key": "messages"}, "scoring": {"reward_fn": "meshrl.verifiers:math_answer"}})
        )
    held_out = {"source": str(tmp_path / "two"), "every": 5}
    with pytest.raises(ConfigError, match=r"none is 'test', 'validation' or 'train': save the held-out split alone"):
        check_records(
            Config.from_dict(
                {
                    "data": {"source": str(tmp_path / "one"), "prompt_key": "messages"},
                    "eval": held_out,
                    "scoring": {"reward_fn": "meshrl.verifiers:math_answer"},
                }
            )
        )


def test_a_train_and_test_dataset_is_evaluated_on_its_test_split(tmp_path):
    """eval.source naming a train/test DatasetDict evaluated on its train rows, the ones trained on."""
    from datasets import Dataset, DatasetDict

    from meshrl.data import eval_records

    train, test = Dataset.from_list(ROWS[:3]), Dataset.from_list(ROWS[3:])
    for splits, want in (({"train": train, "test": test}, ROWS[3:]), ({"train": train, "validation": test}, ROWS[3:]), ({"train": train}, ROWS[:3])):
        path = tmp_path / "-".join(splits)
        DatasetDict(splits).save_to_disk(str(path))
        data = {"source": str(path), "prompt_key": "messages"}
        config = Config.from_dict({"data": data, "eval": {"source": str(path), "every": 5}, "scoring": {"reward_fn": "meshrl.verifiers:math_answer"}})
        assert [r["answer"] for r in load_records(config.data)] == ["1", "2", "3"]  # training reads `train`
        assert [r["answer"] for r in eval_records(config)] == [str(row["level"] + 1) for row in want]
    # the preflight's check reads the split evaluation reads: a bad test split is refused before the meshes start
    from meshrl.data import check_records

    good = Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])
    DatasetDict({"train": good, "test": Dataset.from_list([{"question": "no prompt here"}])}).save_to_disk(str(tmp_path / "bad-test"))
    config = Config.from_dict({"data": {"source": "task:digits"}, "eval": {"source": str(tmp_path / "bad-test"), "every": 5}})
    with pytest.raises(ConfigError, match="bad-test:1: no 'prompt' field"):
        check_records(config)


def test_an_eval_file_is_read_only_as_far_as_its_prompts(tmp_path):
    """eval_records read the whole eval file before keeping its first eval.num_prompts rows: a
    big one was read whole at every evaluation, and a bad row far past them failed them all."""
    from meshrl.data import eval_records

    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)) + "not json\n")
    config = Config.from_dict({"data": {"source": "task:digits"}, "eval": {"source": str(path), "num_prompts": 3, "every": 5}})
    assert [r["prompt"] for r in eval_records(config)] == ["q0", "q1", "q2"]


# ---- held-out evaluation prompts ---------------------------------------------------------------
@pytest.mark.parametrize("data", [{"source": "task:copy", "num_prompts": 50}, {**RG, "task_args": {}, "num_prompts": 50}])
def test_eval_records_are_held_out_and_fixed(data):
    config = Config.from_dict({"data": data, "eval": {"num_prompts": 20}})
    held_out = eval_records(config)
    assert len(held_out) == 20 and held_out == eval_records(config)
    node = PromptNode(config.data, config.seed)
    node.reset()
    training = {json.dumps(next(node)["prompt"]) for _ in range(150)}  # three epochs
    assert not training & {json.dumps(r["prompt"]) for r in held_out}
    assert eval_records(Config.from_dict({"data": data, "eval": {"num_prompts": 20}, "seed": 1})) != held_out


def test_eval_records_from_a_file_in_stored_order(tmp_path):
    config = Config.from_dict({"data": {"source": "task:add", "prompt_key": "messages"}, "eval": {"source": _write(tmp_path, "jsonl", ROWS), "num_prompts": 3}})
    assert [r["answer"] for r in eval_records(config)] == ["1", "2", "3"]


# ---- a missing extra: one line naming the pip install ------------------------------------------
def test_base_install_works_without_the_extras():
    """With reasoning-gym, math-verify and openenv-core all missing, every meshrl module but
    the OpenEnv adapter imports and the default config validates; the adapter says which
    extra to install."""
    code = (
        "import sys, pkgutil, importlib, meshrl\n"
        "for m in ('reasoning_gym', 'math_verify', 'openenv'): sys.modules[m] = None\n"
        "names = [m.name for m in pkgutil.walk_packages(meshrl.__path__, 'meshrl.') if m.name not in ('meshrl.rollout.openenv', 'meshrl.__main__')]\n"
        "for name in names: importlib.import_module(name)\n"
        "from meshrl.cli import main\n"
        "assert main(['config', 'show']) == 0\n"
        "try:\n    import meshrl.rollout.openenv\nexcept ImportError as e:\n    print(e, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pip install 'meshrl[envs]'" in done.stderr


@pytest.mark.parametrize(
    "blocked, override, extra",
    [
        ("reasoning_gym", "data.source=reasoning_gym:basic_arithmetic", "reasoning"),
        ("math_verify", "scoring.reward_fn=meshrl.verifiers:math_answer", "math"),
    ],
)
def test_missing_extra_is_one_line(blocked, override, extra):
    code = f"import sys; sys.modules[{blocked!r}] = None; from meshrl.cli import main; sys.exit(main(['config', 'show', {override!r}]))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"pip install 'meshrl[{extra}]'" in lines[0]


def test_a_resume_over_data_in_another_order_starts_its_epoch_over(tmp_path):
    """The saved prompt position is (epoch, index) into an order the data, its size and the seed
    make: a row appended to the file, or another seed, put another order under that index, and
    the resumed epoch repeated some prompts and skipped others. Now the epoch starts over."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    data = Config.from_dict({"data": {"source": str(path)}}).data
    a = PromptNode(data, seed=5)
    a.reset()
    [next(a) for _ in range(4)]
    state = a.state_dict()
    same = PromptNode(data, seed=5)
    same.reset(state)
    assert same.changed is None and [next(same)["prompt"] for _ in range(6)] == [next(a)["prompt"] for _ in range(6)]
    elsewhere = PromptNode(Config.from_dict({"data": {"source": os.path.relpath(path)}}).data, seed=5)  # the file by another name
    elsewhere.reset(state)
    assert elsewhere.changed is None and elsewhere.index == 4
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    older = PromptNode(Config.from_dict({"data": {"source": str(link)}}).data, seed=5)  # a key saved as the config named it (before real paths)
    older.reset({**state, "order": f"{link}, 10 records, seed 5"})
    assert older.changed is None and older.index == 4
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "q10", "answer": "10"}) + "\n")
    for node in (PromptNode(data, seed=5), PromptNode(Config.from_dict({"data": {"source": str(path)}}).data, seed=6)):
        node.reset(state)
        assert "order changed since the checkpoint" in node.changed and "epoch 0 starts over" in node.changed
        assert sorted(next(node)["prompt"] for _ in range(11)) == sorted(f"q{i}" for i in range(11))  # none skipped
