"""Prompt sources (tasks, JSONL, Parquet; resumable), rewards, the scorer, metrics and plots."""

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from meshrl.config import Config
from meshrl.data import PromptNode, PromptSource
from meshrl.metrics import MetricsWriter, plot_run, read_metrics
from meshrl.rollout import Completion
from meshrl.scoring import Scorer
from meshrl.tasks import TASKS
from meshrl.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_reward_their_own_answer_fully(name):
    import random

    task = TASKS[name]
    for i in range(20):
        prompt, answer = task.make(random.Random(i))
        if name == "digits":
            answer = "01234567"  # any digits are right
        assert task.reward(prompt, answer, {"answer": answer}) == 1.0
        assert task.reward(prompt, "", {"answer": answer}) == 0.0
        assert 0.0 <= task.reward(prompt, "zz9", {"answer": answer}) < 1.0


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
    rows = [{"question": f"q{i}?", "solution": str(i), "level": i % 3} for i in range(5)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = Config.from_dict({
        "data": {"source": str(path), "prompt_key": "question", "answer_key": "solution"},
        "scoring": {"reward_fn": "tests.test_data_scoring:exact"},
    })
    node = PromptNode(cfg.data, seed=0)
    got = [next(node) for _ in range(5)]
    assert sorted(r["prompt"] for r in got) == [f"q{i}?" for i in range(5)]
    assert all(r["answer"] == r["prompt"][1:-1] and "level" in r for r in got)


def exact(prompt, response, sample):
    return float(response == sample["answer"])


def test_source_gates_by_version_requeues_and_resumes(tokenizer_dir):
    cfg = Config.from_dict({"batch_groups": 2, "buffer": {"depth": 0}, "generator": {"update_mode": "block"}})
    src = PromptSource(cfg, tokenizer_dir)
    p = [src.next_prompt(0.1) for _ in range(2)]
    assert [x.group_id for x in p] == [0, 1]
    assert src.next_prompt(0.1) is None, "synchronous: one batch per version"
    src.set_version(1)
    p2 = src.next_prompt(0.1)
    assert p2.group_id == 2
    src.acknowledge([0])
    src.received([2])
    assert src.requeue(consumer=0) == 1  # group 2 is with the scorer: not the generator's to lose
    assert src.requeue(group_ids=[1]) == 0  # already re-queued
    assert src.next_prompt(0.1).group_id == 1  # re-queued prompts come first
    state = src.state_dict()
    assert sorted(x["group_id"] for x in state["pending"]) == [1, 2]
    other = PromptSource(cfg, tokenizer_dir)
    other.load_state_dict(state)
    other.set_version(1)
    resumed = [other.next_prompt(0.1).group_id for _ in range(3)]
    assert resumed == [1, 2, 3]  # in-flight prompts handed out again, then the stream continues


def test_scorer_marks_raising_and_slow_rewards_failed(tokenizer_dir):
    cfg = Config.from_dict({"scoring": {"timeout_s": 0.2}})

    def flaky(prompt, response, sample):
        if response == "boom":
            raise RuntimeError("bad reward")
        if response == "slow":
            time.sleep(1.0)
        return float(len(response))

    from meshrl.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    scorer = Scorer(cfg, tokenizer_dir, reward_fn=flaky)
    comps = [
        Completion([4], tok.encode(text, add_special_tokens=False), [-1.0] * len(text), [0] * len(text), "stop", 5, i)
        for i, text in enumerate(["ab", "boom", "slow", "abcd"])
    ]
    td = asyncio.run(scorer.score_group(comps))
    assert td["reward"].tolist() == [2.0, 0.0, 0.0, 4.0]
    assert td["finish_reason"].tolist() == [0, 3, 3, 0]
    assert abs(float(td["advantage"].sum())) < 1e-5
    m = scorer.metrics()
    assert m["scoring/failed"] == 2 and m["reward/mean"] == 1.5


def test_metrics_jsonl_tensorboard_and_plot(tmp_path):
    w = MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        w.write(step, {"reward/mean": step / 10, "trainer/loss": 1 / step, "trainer/staleness_mean": 0.5,
                       "trainer/idle_frac": 0.1, "generator/idle_frac": 0.2, "bad": float("nan")})
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


def test_reward_model_scores_through_the_same_interface(tmp_path, tokenizer_dir):
    """A local sequence-classification checkpoint as the reward, via scoring.reward_model."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=32, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(cfg).eval()
    path = tmp_path / "rm"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    config = Config.from_dict({"scoring": {"reward_model": str(path)}})
    scorer = Scorer(config, tokenizer_dir)
    from meshrl.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    comps = [Completion(tok.encode("a:", add_special_tokens=False), tok.encode(t, add_special_tokens=False), [-1.0] * len(t),
                        [0] * len(t), "stop", 1, i) for i, t in enumerate(["123", "xyz"])]
    td = asyncio.run(scorer.score_group(comps))
    with torch.no_grad():
        want = [float(model(**tok("a:" + t, return_tensors="pt")).logits[0, 0]) for t in ["123", "xyz"]]
    assert td["reward"].tolist() == pytest.approx(want, abs=1e-5)
    assert td["finish_reason"].tolist() == [0, 0]
