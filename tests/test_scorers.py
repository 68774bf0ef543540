"""Scorers (meshrl/scorers/): reward models, judges, remote servers and functions as scoring
signals, their batching, process rewards as per-token advantages, the checks before a run,
and runs on the real loop: one rewarded only by a reward model trained here, one with a
judge on its own vLLM engine, one whose scorer replica is killed mid-run.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import meshrl
from meshrl.config import Config, ConfigError, ScorerConfig
from meshrl.episode import Episode, Turn, assign_advantages, pack
from meshrl.scorers.backends import Failed, Remote, RewardModel, number_parser, parse_reply, with_opened_thinking, yes_no_parser
from meshrl.scorers.client import EpisodeScorers, ScorerUnavailable
from meshrl.scorers.process import assign_process_advantages, process_tensors, step_ends, step_texts
from meshrl.scorers.service import ScorerService
from tests.conftest import example_config, example_module


# ---- parsing ---------------------------------------------------------------------------------
def test_judge_replies_parse_exactly_and_unparsable_ones_follow_the_rule():
    assert number_parser("Score: 7/10") == 7.0
    assert number_parser(" -2.5 points") == -2.5
    assert number_parser("1e2") == 100.0
    assert number_parser("no digits here") is None
    # the verdict after the last `score`, not a number of the reasoning before it
    assert number_parser("1. Correctness: wrong. 2. Style: fine. Score: 2") == 2.0 and number_parser("so my final score is 8/10") == 8.0
    assert number_parser("Score: 7. The maximum score is 10.") == 7.0 and number_parser("score: 3, then 5; final score: 8") == 8.0
    # the default scale: the default template's 0-10 rating as 0-1 (a verifier's range); a yes/no judge's 0 or 1 as it is
    assert ScorerConfig(kind="judge").judge_scale() == 0.1 and ScorerConfig(kind="judge", parser="yes_no").judge_scale() == 1.0
    assert ScorerConfig(kind="judge", template="Rate it from 0 to 1: {response}").judge_scale() == 1.0  # a template of one's own: as before
    assert ScorerConfig(kind="judge", scale=0.5).judge_scale() == 0.5
    assert yes_no_parser(" Yes, it is") == 1.0 and yes_no_parser("no.") == 0.0 and yes_no_parser("maybe") is None
    assert yes_no_parser("Not sure") is None and yes_no_parser("Nope") is None and yes_no_parser("NO") == 0.0
    assert parse_reply(number_parser, "<think>1 or 2? step 3 says</think>\nScore: 9", 1.0, None) == 9.0  # a thinking judge's verdict
    assert parse_reply(yes_no_parser, "<think>\nno, wait</think> yes", 1.0, None) == 1.0
    assert isinstance(parse_reply(number_parser, "<think>the answer 4 is", 1.0, None), Failed)  # cut while thinking: no verdict
    assert parse_reply(number_parser, "step 1, then 2</think>\n\n8", 1.0, None) == 8.0  # <think> opened by the template
    # opened by the template and cut before its end: thoughts, no verdict (they read as a score of 2, or a yes_no's "No")
    opened = "<|im_start|>assistant\n<think>\n"
    assert isinstance(parse_reply(number_parser, with_opened_thinking(opened, "Okay, 2 + 2 is"), 1.0, None), Failed)
    assert parse_reply(number_parser, with_opened_thinking(opened, "so 4.</think>\n\n7"), 1.0, None) == 7.0
    assert with_opened_thinking("<think>x</think>\n", "8") == "8" and with_opened_thinking("user: rate it\n", "8") == "8"
    assert parse_reply(number_parser, "8", 0.1, 0.0) == pytest.approx(0.8)
    unreadable = parse_reply(number_parser, "great answer", 0.1, 0.0)
    assert isinstance(unreadable, Failed) and unreadable.unparsable and "great answer" in unreadable.reason
    assert isinstance(parse_reply(number_parser, "nan", 1.0, None), Failed)  # no number: "nan" is not one

    def raises(text):
        raise RuntimeError("bad parser")

    assert isinstance(parse_reply(raises, "7", 1.0, 0.0), Failed)  # a parser that raises: unparsable, not a crash
    assert isinstance(parse_reply(lambda t: float("inf"), "7", 1.0, 0.0), Failed)


# ---- batching --------------------------------------------------------------------------------
class Recording:
    """A backend that records its batches and scores each item by its `x`."""

    def __init__(self, fail_first: bool = False):
        self.batches: list[int] = []
        self.fail_first = fail_first

    async def score(self, items):
        self.batches.append(len(items))
        if self.fail_first and len(self.batches) == 1:
            raise RuntimeError("backend down")
        await asyncio.sleep(0.01)
        return [float(item["x"]) for item in items]


def test_requests_from_many_callers_are_batched_up_to_the_size_and_answered_in_order():
    async def main():
        backend = Recording()
        service = ScorerService(backend, ScorerConfig(batch_size=4, batch_wait_s=0.2))
        calls = [service.score([{"x": 10 * c + i} for i in range(3)]) for c in range(4)]  # 4 workers x 3 episodes
        results = await asyncio.gather(*calls)
        return backend, results

    backend, results = asyncio.run(main())
    assert [[r["score"] for r in res] for res in results] == [[10 * c + i for i in range(3)] for c in range(4)]
    assert sum(backend.batches) == 12 and max(backend.batches) == 4 and backend.batches[0] == 4  # full batches first
    assert all(r["queue_s"] >= 0 and r["score_s"] > 0 and 1 <= r["batch"] <= 4 for res in results for r in res)


def test_a_lone_request_is_scored_after_the_wait_and_a_failing_batch_fails_only_its_items():
    async def main():
        backend = Recording(fail_first=True)
        service = ScorerService(backend, ScorerConfig(batch_size=8, batch_wait_s=0.05))
        first = await service.score([{"x": 1}, {"x": 2}])  # never fills the batch: sent when the wait is up
        second = await service.score([{"x": 3}])
        return backend, first, second

    backend, first, second = asyncio.run(main())
    assert backend.batches == [2, 1]
    assert all(r["score"] is None and "backend down" in r["error"] for r in first)
    assert second[0]["score"] == 3.0 and second[0]["error"] is None


def test_a_hung_backend_wedges_its_replica_and_every_request_then_fails_at_once():
    """A backend that never answers (a hung engine) kept the replica's one batch running for
    ever: every later request timed out at its caller, and the replica was never replaced.
    Past WEDGED_AFTER x timeout_s its items fail, later requests fail at once, and its stats
    say it is wedged (what ScorerPool.check replaces it for)."""

    class Hung:
        calls = 0

        async def score(self, items):
            Hung.calls += 1
            await asyncio.sleep(3600)

    async def main():
        service = ScorerService(Hung(), ScorerConfig(batch_size=1, batch_wait_s=0.0, timeout_s=0.1))
        first, queued = await asyncio.wait_for(asyncio.gather(service.score([{"x": 1}]), service.score([{"x": 3}])), 30)
        later = await asyncio.wait_for(service.score([{"x": 2}]), 1)
        return service, first + queued, later

    service, first, later = asyncio.run(main())
    assert [r["score"] for r in first + later] == [None] * 3 and all("wedged" in r["error"] for r in (first[0], *later))
    assert "its caller gave up on it" in first[1]["error"]  # queued behind it past timeout_s
    assert service.stats()["wedged"] is True and Hung.calls == 1  # the batch queued behind it never reached it


def test_a_request_queued_past_its_callers_timeout_is_dropped_unscored():
    """A busy scorer scored every queued request, those whose callers had given up on them
    too (ahead of live ones; a PRM trained on them). One queued for the scorer's whole
    timeout_s is answered failed instead, and its backend never sees it."""

    class Slow:
        seen = []

        async def score(self, items):
            Slow.seen += [item["x"] for item in items]
            await asyncio.sleep(0.4)
            return [1.0] * len(items)

    async def main():
        service = ScorerService(Slow(), ScorerConfig(batch_size=1, batch_wait_s=0.0, timeout_s=0.2))
        first, late = await asyncio.wait_for(asyncio.gather(service.score([{"x": 1}]), service.score([{"x": 2}])), 10)
        return service, first, late

    service, first, late = asyncio.run(main())
    assert first[0]["score"] == 1.0 and late[0]["score"] is None and "its caller gave up on it" in late[0]["error"]
    assert Slow.seen == [1] and service.stats()["abandoned"] == 1

    # one still within timeout_s, but past it by the time a batch as long as the last two would
    # answer it, is dropped too (it was scored, and trained on by a PRM, for a caller already gone)
    class Slower(Slow):
        seen = []

        async def score(self, items):
            Slower.seen += [item["x"] for item in items]
            await asyncio.sleep(0.8)
            return [1.0] * len(items)

    async def later(service, x):
        await asyncio.sleep(1.0)
        return await service.score([{"x": x}])

    async def main2():
        service = ScorerService(Slower(), ScorerConfig(batch_size=1, batch_wait_s=0.0, timeout_s=2.0))
        return service, await asyncio.wait_for(asyncio.gather(*(service.score([{"x": x}]) for x in (1, 2, 3)), later(service, 4)), 20)

    service, answers = asyncio.run(main2())  # 3 is taken at 1.6 s with 0.8 s to come; 4 at 1.6 s, asked at 1.0 s
    assert Slower.seen == [1, 2, 4] and [a[0]["score"] for a in answers] == [1.0, 1.0, None, 1.0], answers
    assert re.search(r"where a batch takes [0-9.]+s and timeout_s=2s: its caller gives up on it first", answers[2][0]["error"]), answers[2]


def test_a_scorer_health_check_asks_each_replica_once_and_all_at_once():
    """ScorerPool.check asked a replica on another host for its stats twice (once for gone, once
    for wedged) and the replicas one after the other: hosts that had stopped answering held
    the step 60 s for each of them."""
    from meshrl.controller.members import Member
    from meshrl.controller.replicas import ScorerPool

    class Replica:
        gone_or_wedged = Member.gone_or_wedged

        in_flight = most = 0

        def __init__(self, here, alive, answer):
            self.here, self.live, self.answer, self.asked = here, alive, answer, 0
            self.actor = type("Actor", (), {"stats": type("Endpoint", (), {"call_one": self.stats})()})()

        def on_this_host(self):
            return self.here

        def alive(self):
            return self.live

        async def stats(self):
            self.asked += 1
            Replica.in_flight += 1
            Replica.most = max(Replica.most, Replica.in_flight)
            await asyncio.sleep(0.05)
            Replica.in_flight -= 1
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    replicas = {
        "wedged elsewhere": Replica(False, True, {"wedged": True}),
        "silent elsewhere": Replica(False, True, RuntimeError("unreachable")),
        "dead here": Replica(True, False, {}),
        "busy here": Replica(True, True, RuntimeError("slow")),
        "well here": Replica(True, True, {"wedged": False}),
    }
    health = {name: asyncio.run(r.gone_or_wedged()) for name, r in replicas.items()}
    assert health == {
        "wedged elsewhere": (False, True),
        "silent elsewhere": (True, False),
        "dead here": (True, False),
        "busy here": (False, False),
        "well here": (False, False),
    }
    assert [r.asked for r in replicas.values()] == [1, 1, 0, 1, 1]
    pool = object.__new__(ScorerPool)
    pool.members = {(0, i): Replica(False, True, {"wedged": False}) for i in range(3)}
    Replica.most = 0
    asyncio.run(pool.check())
    assert Replica.most == 3 and all(r.asked == 1 for r in pool.members.values())


# ---- the reward model ------------------------------------------------------------------------
def test_an_encoder_reward_model_scores_each_item_as_alone_and_keeps_its_cls(tmp_path):
    """A BERT-style reward model (its head reads the first token): rows right-padded, so an item
    scores the same beside a longer one (left-padded, its first position was a pad); a long
    input keeps its [CLS] (its last tokens alone lost it). Many rows go in batches of batch_size."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from meshrl.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    tok_dir = build_char_tokenizer(tmp_path / "rm")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    bert = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=1, max_position_embeddings=64
    )
    BertForSequenceClassification(bert).save_pretrained(tmp_path / "rm")
    rm = RewardModel(str(tmp_path / "rm"), max_len=24, device="cpu", batch_size=2)
    assert not rm.left_pad
    items = [{"prompt": "a:", "response": r} for r in ("1", "12345678", "9 9 9")]
    together = rm.score_sync(items)
    assert together == pytest.approx([rm.score_sync([item])[0] for item in items], abs=1e-5)
    long = rm.encode({"prompt": "q:"}, "x" * 100)
    assert len(long) == 24 and long[0] == rm.encode({"prompt": "q:"}, "x")[0]
    # RoBERTa's family numbers positions from its padding index + 1, and reads no more than its
    # positions: scored as the model scores a row alone (positions from 0 read its padding row),
    # and an input past them kept to them (it raised IndexError for the whole batch)
    from transformers import RobertaConfig, RobertaForSequenceClassification

    roberta = RobertaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=1,
        max_position_embeddings=20, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    RobertaForSequenceClassification(roberta).save_pretrained(tmp_path / "rm")
    rm = RewardModel(str(tmp_path / "rm"), max_len=1024, device="cpu")
    assert rm.max_len == 20 - tok.pad_token_id - 1
    row = rm.encode(items[1], items[1]["response"])
    with torch.no_grad():
        alone = rm.model(input_ids=torch.tensor([row])).logits[0, 0].item()
    assert rm.score_sync([items[1]])[0] == pytest.approx(alone, abs=1e-5)
    assert len(rm.encode({"prompt": "q:"}, "x" * 100)) == rm.max_len and isinstance(rm.score_sync([{"prompt": "q:", "response": "x" * 100}])[0], float)
    # DeBERTa-v3's positions are relative: it reads all of max_len, past max_position_embeddings
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    deberta = DebertaV2Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=1,
        max_position_embeddings=16, position_biased_input=False, relative_attention=True, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    DebertaV2ForSequenceClassification(deberta).save_pretrained(tmp_path / "rm")
    rm = RewardModel(str(tmp_path / "rm"), max_len=40, device="cpu")
    assert rm.max_len == 40 and isinstance(rm.score_sync([{"prompt": "q:", "response": "x" * 30}])[0], float)


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    """A small reward model trained on the default task's better and worse answers (ordered
    by its verifier), saved as a Hugging Face checkpoint with the character tokenizer: the
    reward-model example's first stage (examples/reward-model/train_rm.py --task digits)."""
    path = str(tmp_path_factory.mktemp("rm") / "rm")
    stats = example_module("reward-model/train_rm.py").train(path, task="digits", n=4000, steps=300, seed=0)
    return path, stats


def test_reward_model_learns_the_preferences_and_scores_padded_batches_as_single_rows(trained_rm):
    path, stats = trained_rm
    # Measured: 0.99 held-out pairwise accuracy (400 pairs) after 300 steps.
    assert stats["accuracy"] >= 0.95, stats
    rm = RewardModel(path, device="cpu")
    items = [{"prompt": "a:", "response": r} for r in ("12345678", "1", "abc", "9 9 9 9 9 9", "")]
    together = rm.score_sync(items)
    alone = [rm.score_sync([item])[0] for item in items]
    assert together == pytest.approx(alone, abs=1e-4)
    assert together[0] > together[2]  # eight digits over three letters
    # process: one score per prefix
    steps = rm.score_sync([{"prompt": "a:", "response": "12ab", "steps": ["1", "12", "12a", "12ab"]}])[0]
    assert len(steps) == 4 and steps == pytest.approx(rm.score_sync([{"prompt": "a:", "response": s} for s in ["1", "12", "12a", "12ab"]]), abs=1e-4)


# ---- remote ----------------------------------------------------------------------------------
class RewardServer:
    """A reward server on loopback: fails its first `fail` requests with HTTP 500 (`cut`: by
    closing mid-body instead), then answers each item's response length (or, with steps, each step's)."""

    def __init__(self, fail: int = 0, answer=None, cut: bool = False):
        outer = self
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                outer.requests += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.requests <= fail and cut:  # a body cut short: http.client's IncompleteRead
                    self.send_response(200)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    self.wfile.write(b'{"scores": [')
                    return
                if outer.requests <= fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                scores = answer(body) if answer else [[len(s) for s in it["steps"]] if it.get("steps") else len(it["response"]) for it in body["items"]]
                data = json.dumps({"scores": scores}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_remote_scorer_retries_a_failing_server_and_fails_items_it_never_answers():
    items = [{"prompt": "a:", "response": "123", "steps": None}, {"prompt": "b:", "response": "1", "steps": ["1"]}]
    flaky = RewardServer(fail=2)
    try:
        got = asyncio.run(Remote(ScorerConfig(kind="remote", url=flaky.url, retries=2, timeout_s=20)).score(items))
        assert got == [3.0, [1.0]] and flaky.requests == 3
    finally:
        flaky.close()
    cut = RewardServer(fail=1, cut=True)  # an answer cut short is retried too, where it failed every worker's items in the batch
    try:
        got = asyncio.run(Remote(ScorerConfig(kind="remote", url=cut.url, retries=2, timeout_s=20)).score(items))
        assert got == [3.0, [1.0]] and cut.requests == 2
    finally:
        cut.close()
    down = RewardServer(fail=100)
    try:
        got = asyncio.run(Remote(ScorerConfig(kind="remote", url=down.url, retries=1, timeout_s=20)).score(items))
        assert all(isinstance(r, Failed) and "500" in r.reason for r in got) and down.requests == 2
    finally:
        down.close()
    wrong = RewardServer(answer=lambda body: ["high", 1.0])
    try:
        got = asyncio.run(Remote(ScorerConfig(kind="remote", url=wrong.url)).score(items))
        assert isinstance(got[0], Failed) and isinstance(got[1], Failed)  # a word, and a number where steps were asked
    finally:
        wrong.close()


# ---- process rewards -------------------------------------------------------------------------
def _model(ids, reward=0.0):
    return Turn("model", list(ids), [-1.0] * len(ids), [1] * len(ids), reward=reward)


def test_step_ends_fall_on_the_delimiters_and_turn_ends(char_tokenizer):
    tok = char_tokenizer
    ep = Episode(0, 0, [Turn("env", tok.encode("q:")), _model(tok.encode("ab\ncd\ne")), Turn("env", tok.encode("!")), _model(tok.encode("x\ny"))])
    p = len(tok.encode("q:"))
    assert step_ends(ep, tok, "turn", "\n") == [p + 6, p + 8 + 2]
    assert step_ends(ep, tok, "step", "\n") == [p + 2, p + 5, p + 6, p + 9, p + 10]
    assert step_texts(ep, tok, [p + 2, p + 6]) == ["ab\n", "ab\ncd\ne"]
    # a delimiter just before the end-of-turn token closes the last step, not a step of its own of the same text
    ep = Episode(0, 0, [Turn("env", tok.encode("q:")), _model(tok.encode("ab\ncd\n") + [tok.eos_token_id])])
    ends = step_ends(ep, tok, "step", "\n")
    assert ends == [p + 2, p + 6] and step_texts(ep, tok, ends) == ["ab\n", "ab\ncd\n"]


def test_step_ends_read_a_window_as_the_whole_prefix_would_in_linear_time():
    """Each token that could close the delimiter had its whole prefix decoded: quadratic in the
    answer's length, on the worker's loop. Through a byte-level BPE (merged newlines, characters
    cut in their bytes) the ends are those of decoding every prefix, and the tokens decoded
    grow linearly with the answer."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["step", "é", "中文", "x=1", "ки", " ", "\n", "\n\n", "so", "Ω"]
    corpus = ["".join(rng.choice(words) for _ in range(60)) for _ in range(200)]

    class Counting(PreTrainedTokenizerFast):
        decoded = 0

        def decode(self, ids, **kw):
            Counting.decoded += len(ids)
            return super().decode(ids, **kw)

    for vocab in (400, 256):  # merged characters and newlines; each byte a token (a character cut in its bytes)
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
        tok = Counting(tokenizer_object=bpe)
        for delimiter in ("\n\n", "ки", "\n"):
            for text in corpus[:20]:
                ids = tok.encode(text)
                ep = Episode(0, 0, [Turn("env", [1]), _model(ids)])
                whole = [1 + j for j in range(len(ids) - 1) if tok.decode(ids[: j + 1]).endswith(delimiter)] + [len(ids)]
                assert step_ends(ep, tok, "step", delimiter) == whole, (vocab, delimiter)
    ids = tok.encode("".join(rng.choice(words) for _ in range(2000)))
    Counting.decoded = 0
    step_ends(Episode(0, 0, [Turn("env", [1]), _model(ids)]), tok, "step", "\n")
    assert Counting.decoded < 40 * len(ids)  # (each prefix decoded whole: over 200 x len(ids) here)


@pytest.mark.parametrize("mode", ["return", "step"])
def test_process_advantages_change_exactly_after_the_scored_steps(mode):
    """Two episodes of one group; episode 0's steps end at tokens 3, 5 and 7, episode 1's at
    4 and 7 (no two adjacent steps with the same value, in either mode). The per-token advantage is constant within each step and changes right after
    each step's end, by the formula of meshrl/scorers/process.py."""
    eps = [
        Episode(0, 0, [Turn("env", [1, 2]), _model([3, 4, 5, 6, 7, 8], reward=1.0)]),
        Episode(0, 1, [Turn("env", [1, 2]), _model([3, 4, 5, 6, 7, 8], reward=0.0)]),
    ]
    eps[0].process = [(3, 0.5), (5, -1.0), (7, 2.5)]
    eps[1].process = [(4, 1.0), (7, 0.0)]
    td = assign_advantages(pack(eps), "grpo")
    scores, ends = process_tensors(eps, td["tokens"].shape[1])
    assign_process_advantages(td, scores, ends, 0.5, mode)
    adv = td["token_advantage"]
    baseline = (0.5 - 1.0 + 2.5 + 1.0 + 0.0) / 5
    for row, steps in enumerate([[(3, 0.5), (5, -1.0), (7, 2.5)], [(4, 1.0), (7, 0.0)]]):
        a = float(td["advantage"][row])
        start = 2
        for k, (end, s) in enumerate(steps):
            if mode == "return":
                want = a + 0.5 * sum(v - baseline for _, v in steps[k:])
            else:
                want = a + 0.5 * (s - baseline)
            assert adv[row, start : end + 1].tolist() == pytest.approx([want] * (end + 1 - start)), (row, k)
            start = end + 1
        changes = [t for t in range(3, 8) if not math.isclose(adv[row, t], adv[row, t - 1], abs_tol=1e-7)]
        assert changes == [e + 1 for e, _ in steps[:-1]], (row, changes)
        assert adv[row, :2].tolist() == [0.0, 0.0]  # the prompt never trains


def test_under_ppos_critic_step_scores_are_rewards_its_gae_adds_up():
    """trainer.loss.advantage=gae with a process scorer: the worker writes each step's weighted
    score at its last token (`process_reward`) and no per-token advantage (the critic's GAE
    writes it); with V = 0 and gamma = lambda = 1 each token's return is the sum of the
    rewards from it on, the turn's outcome and the step scores alike."""
    from types import SimpleNamespace

    from meshrl.agent.worker import RolloutWorker
    from meshrl.trainer.values import ppo_advantages

    config = Config.from_dict(
        {"trainer": {"loss": {"advantage": "gae"}}, "scoring": {"process_weight": 0.5, "scorers": [{"kind": "function", "path": "m:f", "process": "step"}]}}
    )
    eps = [Episode(0, i, [Turn("env", [1, 2]), _model([3, 4, 5, 6, 7, 8], reward=float(i))]) for i in range(2)]
    eps[0].process, eps[1].process = [(3, 0.5), (5, -1.0), (7, 2.5)], [(4, 1.0), (7, 0.0)]
    td = RolloutWorker._with_process(SimpleNamespace(config=config), assign_advantages(pack(eps), "gae"), eps)
    assert "token_advantage" not in td.keys()
    assert td["process_reward"][0].tolist() == [0, 0, 0, 0.25, 0, -0.5, 0, 1.25] and td["process_reward"][1, 4] == 0.5
    returns = ppo_advantages(td, torch.zeros(td["tokens"].shape), whiten=False)
    rewards = td["dense_reward"] + td["process_reward"]
    want = rewards.flip(1).cumsum(1).flip(1) * td["loss_mask"]
    assert torch.allclose(returns, want) and returns[0, 2] == pytest.approx(0.25 - 0.5 + 1.25 + 0.0)
    assert torch.equal(td["token_advantage"], returns)  # A = R - V with V = 0


def test_a_game_whose_models_train_by_gae_and_not_packs_every_group_with_the_same_keys():
    """The policy by gae beside a model by grpo whose threads a process scorer steps through:
    a group where only the policy spoke (the other's thread missing) and one where both did
    queue together (the keys come from the config, not from the group's rows)."""
    from types import SimpleNamespace

    from meshrl.agent.worker import RolloutWorker
    from meshrl.episode import concat

    config = Config.from_dict(
        {
            "trainer": {"loss": {"advantage": "gae"}},
            "models": [{"name": "a", "trainer": {"loss": {"advantage": "grpo"}}}],
            "data": {"source": "task:propose"},
            "scoring": {"scorers": [{"kind": "function", "path": "m:f", "process": "turn", "model": "a"}]},
        }
    )

    def episode(group, i, models):
        threads = [Episode(group, i, [Turn("env", [1]), _model([3, 4], reward=1.0)], model=m) for m in models]
        for t in threads:
            t.process = [(2, 0.5 * i)] if t.model == 1 else []
        return Episode(group, i, threads=threads)

    worker = SimpleNamespace(config=config)
    groups = []
    for group, models in ((0, [0]), (1, [0, 1])):
        eps = [episode(group, i, models) for i in range(2)]
        groups.append(RolloutWorker._with_process(worker, assign_advantages(pack(eps), "gae"), eps))
    assert {"token_advantage", "process_reward"} <= set(groups[0].keys()) == set(groups[1].keys())
    both = concat(groups)
    assert both["process_reward"].abs().sum() == 0  # the policy's threads had no step scores; the model's train by its advantage
    assert both["token_advantage"][-1, 1:].tolist() == [0.25, 0.25]  # the model's: its outcome's 0 and its step's 0.5 less their mean
    # a group queued before a run wrote process rewards (a resumed queue) joins with none
    old = groups[1].clone().exclude("process_reward")
    assert concat([groups[0], old])["process_reward"].abs().sum() == 0


# ---- the worker's side -----------------------------------------------------------------------
def times_two(prompt, response, sample):
    return 2.0 * len(response)


def per_step(prompt, response, sample):
    return [float(len(s)) for s in sample["steps"]]


def boom(prompt, response, sample):
    raise ValueError("no score today")


class StandIn:
    """A scorer replica stand-in for the worker's client: `score.call_one(items)`, answering,
    failing as a dead actor does, or never answering."""

    def __init__(self, mode: str = "ok", value: float = 0.25):
        outer = self
        self.calls = 0

        class Endpoint:
            def call_one(self, items):
                outer.calls += 1
                if mode == "dead":
                    raise RuntimeError("actor mesh is stopped")
                return outer._answer(items, mode, value)

        self.score = Endpoint()

    async def _answer(self, items, mode, value):
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "wedged":  # as ScorerService answers once a batch of its ran past its bound
            return [{"score": None, "error": "the replica is wedged", "unparsable": False, "wedged": True} for _ in items]
        if mode == "slow":
            await asyncio.sleep(0.05)
        return [{"score": value, "error": None, "unparsable": False, "queue_s": 0.01, "score_s": 0.02, "batch": 1} for _ in items]


def _episode(tok, text: str, env_reward: float = 1.0) -> Episode:
    return Episode(3, 12, [Turn("env", tok.encode("a:")), _model(tok.encode(text), reward=env_reward)])


def test_episode_reward_weighs_each_signal_and_logs_each_one(char_tokenizer):
    cfg = Config.from_dict(
        {
            "scoring": {
                "env_weight": 0.5,
                "scorers": [
                    {"kind": "function", "path": "tests.test_scorers:times_two", "weight": 0.1},
                    {"kind": "reward_model", "path": "/unused", "weight": 2.0, "name": "rm"},
                    {"kind": "function", "path": "tests.test_scorers:per_step", "weight": 1.0, "name": "steps", "process": "step", "step_delimiter": ","},
                ],
            }
        }
    )
    scorers = EpisodeScorers(cfg, char_tokenizer)
    scorers.set_replicas({1: [(0, StandIn(value=0.25))]})
    ep = _episode(char_tokenizer, "12,345")
    asyncio.run(scorers.score(ep, {"prompt": "a:", "answer": ""}))
    assert ep.finish_reason == "stop"
    assert ep.signals["env"] == 1.0 and ep.signals["function"] == 12.0 and ep.signals["rm"] == 0.25 and ep.signals["steps"] == 6.0
    assert ep.reward == pytest.approx(0.5 * 1.0 + 0.1 * 12.0 + 2.0 * 0.25 + 1.0 * 6.0)
    p = len(char_tokenizer.encode("a:"))
    assert ep.process == [(p + 2, 3.0), (p + 5, 6.0)]  # "12," and "12,345"
    assert ep.signals["rm/queue_s"] == 0.01 and ep.signals["rm/score_s"] == 0.02 and ep.signals["rm/wait_s"] >= 0
    # a second process scorer at weight 0, watched, with steps of its own: logged, and nothing of it trained on
    # (its step ends, at score 0, pulled the baseline and moved the per-token advantages)
    watched = {"kind": "function", "path": "tests.test_scorers:per_step", "weight": 0.0, "name": "watched", "process": "step", "step_delimiter": "4"}
    cfg = Config.from_dict({"scoring": {"scorers": [*cfg.to_dict()["scoring"]["scorers"], watched], "env_weight": 0.5}})
    scorers = EpisodeScorers(cfg, char_tokenizer)
    scorers.set_replicas({1: [(0, StandIn(value=0.25))]})
    ep = _episode(char_tokenizer, "12,345")
    asyncio.run(scorers.score(ep, {"prompt": "a:", "answer": ""}))
    assert ep.signals["watched"] == 6.0 and ep.process == [(p + 2, 3.0), (p + 5, 6.0)]


def test_a_wedged_replica_sends_its_episodes_to_another(char_tokenizer):
    """A wedged replica answered every request at once with no score: its episodes failed, and
    answering at once it looked least loaded and drew nearly every call until it was replaced."""
    cfg = Config.from_dict({"scoring": {"scorers": [{"kind": "reward_model", "path": "/unused", "name": "rm"}]}})
    scorers = EpisodeScorers(cfg, char_tokenizer)
    wedged, healthy = StandIn("wedged"), StandIn("slow", value=0.75)
    scorers.set_replicas({0: [(0, wedged), (1, healthy)]})

    async def main():
        eps = [_episode(char_tokenizer, "12") for _ in range(6)]
        await asyncio.gather(*(scorers.score(ep, {"prompt": "a:"}) for ep in eps))
        return eps

    eps = asyncio.run(main())
    assert all(ep.finish_reason == "stop" and ep.signals["rm"] == 0.75 for ep in eps)
    assert wedged.calls == 1  # asked once, then passed over while another is listed


def cut_short(prompt, response, sample):
    return float(sample["finish_reason"] == "length")


def test_a_function_scorer_reads_whether_the_reply_was_cut_short(char_tokenizer):
    """An env's reward reads the turn's finish_reason (math_answer scores a reply cut at its budget
    by its box alone); a function scorer's sample had none, so the same function scored it otherwise."""
    cfg = Config.from_dict({"scoring": {"scorers": [{"kind": "function", "path": "tests.test_scorers:cut_short", "name": "cut"}]}})
    ep = Episode(3, 12, [Turn("env", char_tokenizer.encode("a:")), Turn("model", char_tokenizer.encode("12"), [-1.0] * 2, [1] * 2, finish_reason="length")])
    asyncio.run(EpisodeScorers(cfg, char_tokenizer).score(ep, {"prompt": "a:", "answer": "1"}))
    assert ep.signals["cut"] == 1.0


def test_an_episode_without_a_model_turn_is_left_unscored(char_tokenizer):
    """A prompt that fills model.max_seq_len leaves no turn to score; scoring it raised, and the
    group was played and re-queued again without end."""
    cfg = Config.from_dict({"scoring": {"scorers": [{"kind": "function", "path": "tests.test_scorers:times_two"}]}})
    ep = Episode(3, 12, [Turn("env", char_tokenizer.encode("a long prompt"))])
    ep.finish_reason = "length"
    asyncio.run(EpisodeScorers(cfg, char_tokenizer).score(ep, {"prompt": "a long prompt", "answer": ""}))
    assert ep.finish_reason == "length" and ep.reward == 0.0 and not ep.signals


def test_a_failed_score_fails_its_episode_and_a_dead_replica_is_asked_again(char_tokenizer):
    cfg = Config.from_dict({"scoring": {"scorers": [{"kind": "function", "path": "tests.test_scorers:boom"}]}})
    ep = _episode(char_tokenizer, "123")
    asyncio.run(EpisodeScorers(cfg, char_tokenizer).score(ep, {"prompt": "a:"}))
    assert ep.finish_reason == "failed" and ep.reward == 0.0 and "no score today" in ep.failure and ep.signals["function/failed"] == 1.0

    cfg = Config.from_dict({"scoring": {"scorers": [{"kind": "remote", "url": "http://127.0.0.1:9/", "timeout_s": 0.5}]}})
    scorers = EpisodeScorers(cfg, char_tokenizer)
    dead, fresh = StandIn("dead"), StandIn(value=0.75)
    scorers.set_replicas({0: [(0, dead)]})

    async def replaced_meanwhile():
        ep = _episode(char_tokenizer, "123")
        task = asyncio.create_task(scorers.score(ep, {"prompt": "a:"}))
        await asyncio.sleep(0.3)
        scorers.set_replicas({0: [(1, fresh)]})  # as the controller does once the replacement is up
        await task
        return ep

    ep = asyncio.run(replaced_meanwhile())
    assert dead.calls >= 1 and fresh.calls == 1 and ep.signals["remote"] == 0.75 and ep.finish_reason == "stop"

    scorers.set_replicas({0: [(2, StandIn("hang"))]})  # alive but too slow: the episode fails, counted
    ep = _episode(char_tokenizer, "123")
    asyncio.run(scorers.score(ep, {"prompt": "a:"}))
    assert ep.finish_reason == "failed" and ep.signals["remote/failed"] == 1.0 and "timeout_s" in ep.failure

    scorers.replace_s = 0.2
    scorers.set_replicas({0: [(3, StandIn("dead"))]})  # never replaced: the group is played again
    with pytest.raises(ScorerUnavailable):
        asyncio.run(scorers.score(_episode(char_tokenizer, "1"), {"prompt": "a:"}))


def test_a_replica_that_dies_without_answering_is_dropped_when_it_leaves_the_list(char_tokenizer):
    """A replica that dies with a call in flight may never answer (a sharded PRM's rank 0
    whose peer died): once the controller's list drops it, the call goes to the replacement
    at once, not after timeout_s. A replica still listed is never asked twice."""
    cfg = Config.from_dict({"scoring": {"scorers": [{"kind": "remote", "url": "http://127.0.0.1:9/", "timeout_s": 30}]}})
    scorers = EpisodeScorers(cfg, char_tokenizer)
    silent, other, fresh = StandIn("hang"), StandIn("hang"), StandIn(value=0.5)

    async def main():
        scorers.set_replicas({0: [(0, silent)]})
        ep = _episode(char_tokenizer, "123")
        task = asyncio.create_task(scorers.score(ep, {"prompt": "a:"}))
        await asyncio.sleep(0.2)
        scorers.set_replicas({0: [(0, other)]})  # the same replica's handle, sent again: still listed
        await asyncio.sleep(0.2)
        assert silent.calls == 1 and other.calls == 0 and not task.done()
        scorers.set_replicas({})  # found dead: the controller drops it while its replacement starts
        await asyncio.sleep(0.2)
        assert not task.done()
        scorers.set_replicas({0: [(1, fresh)]})
        await asyncio.wait_for(task, 5)
        return ep

    start = time.monotonic()
    ep = asyncio.run(main())
    assert fresh.calls == 1 and ep.signals["remote"] == 0.5 and ep.finish_reason == "stop"
    assert time.monotonic() - start < 5


# ---- checks before the run -------------------------------------------------------------------
@pytest.mark.parametrize(
    "scoring, field",
    [
        ({"scorers": [{"kind": "reward_model"}]}, "scoring.scorers[0].path"),
        ({"scorers": [{"kind": "remote", "url": "ftp://x"}]}, "scoring.scorers[0].url"),
        ({"scorers": [{"kind": "judge", "path": "/j", "process": "step"}]}, "scoring.scorers[0].process"),
        ({"scorers": [{"kind": "remote", "url": "http://127.0.0.1:1/", "batch_size": 0}]}, "scoring.scorers[0].batch_size"),
        ({"scorers": [{"kind": "function", "path": "m:f", "name": "env"}]}, "scoring.scorers"),
        ({"env_weight": 0.0}, "scoring.env_weight"),
        ({"scorers": [{"kind": "oracle"}]}, "scoring.scorers[0].kind"),
    ],
)
def test_bad_scorer_configs_are_refused_with_the_field(scoring, field):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"scoring": scoring})
    assert e.value.field_path == field and "\n" not in str(e.value), str(e.value)


def test_preflight_names_a_missing_checkpoint_a_wrong_head_a_bad_template_and_a_parser_that_fails_its_probe(tmp_path, trained_rm):
    from meshrl.preflight import preflight
    from tests.conftest import build_digit_teacher

    rm, _ = trained_rm
    judge = build_digit_teacher(tmp_path / "judge")
    from meshrl.tokenizer import build_char_tokenizer

    build_char_tokenizer(judge)  # the judge's own tokenizer, beside its weights
    two_labels = shutil.copytree(rm, tmp_path / "two_labels")
    with open(two_labels / "config.json") as f:
        hf = json.load(f)
    with open(two_labels / "config.json", "w") as f:
        json.dump({**hf, "id2label": {"0": "bad", "1": "good"}, "label2id": {"bad": 0, "good": 1}}, f)
    base = {"logging": {"run_dir": str(tmp_path / "run")}}
    cases = [
        ({"kind": "reward_model", "path": str(tmp_path / "nowhere")}, "scoring.scorers[0].path", "no config.json"),
        ({"kind": "reward_model", "path": judge}, "scoring.scorers[0].path", "is Qwen3ForCausalLM"),
        ({"kind": "reward_model", "path": str(two_labels)}, "scoring.scorers[0].path", "2 labels"),
        ({"kind": "judge", "path": rm}, "scoring.scorers[0].path", "causal LM"),
        ({"kind": "judge", "path": judge, "template": "Rate {answr}"}, "scoring.scorers[0].template", "answr"),
        ({"kind": "judge", "path": judge, "parser": "yes_no"}, "scoring.scorers[0].parser", "probe_reply"),
        ({"kind": "function", "path": "tests.test_scorers:no_such"}, "scoring.scorers[0].path", "no_such"),
        ({"kind": "remote", "url": "http://127.0.0.1:9/score", "timeout_s": 2, "retries": 0}, "scoring.scorers[0].url", "127.0.0.1:9"),
    ]
    for spec, field, words in cases:
        with pytest.raises(ConfigError) as e:
            preflight(Config.from_dict({**base, "scoring": {"scorers": [spec]}}))
        assert e.value.field_path == field and words in str(e.value), (spec, str(e.value))
        assert "\n" not in str(e.value)
    # the good ones pass
    preflight(
        Config.from_dict(
            {**base, "scoring": {"scorers": [{"kind": "reward_model", "path": rm}, {"kind": "judge", "path": judge, "parser": "yes_no", "probe_reply": "yes"}]}}
        )
    )


# ---- on the real loop ------------------------------------------------------------------------
TINY = {"logging": {"progress": False}, "trainer": {"checkpoint_every": 0}}


def _cfg(run_dir, **sections) -> dict:
    cfg = json.loads(json.dumps(TINY))
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value) if isinstance(value, dict) else cfg.__setitem__(key, value)
    cfg["logging"]["run_dir"] = str(run_dir)
    return cfg


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_rewarded_only_by_the_trained_reward_model_learns_the_task_as_the_verifier_sees_it(tmp_path, trained_rm):
    """The embedded default (40 steps, async), its verifier weighted 0: the policy learns from
    the reward model alone, and the verifier's reward (logged as scoring/env/mean) rises to
    at least 0.8. Measured: see benchmarks/README.md (scorers); the verifier-rewarded default
    reaches the same level in about as many steps."""
    rm, _ = trained_rm
    cfg = example_config("reward-model", tmp_path / "run")  # examples/reward-model/small.yaml, its reward model here
    cfg["scoring"]["scorers"][0]["path"] = rm
    result = meshrl.run(cfg)
    rows = [r for r in result.metrics if "scoring/env/mean" in r]
    verifier = [r["scoring/env/mean"] for r in rows]
    print("verifier", [round(v, 2) for v in verifier])
    assert sum(verifier[:3]) / 3 < 0.4, verifier
    assert sum(verifier[-5:]) / 5 >= 0.8, verifier
    last = rows[-1]
    assert last["scoring/rm/mean"] > rows[0]["scoring/rm/mean"]
    assert last["scoring/rm/score_s"] > 0 and last["scoring/rm/queue_s"] >= 0 and "scoring/rm/failed" not in last
    # the divergence alarm watched the verifier (weight 0) against the model's reward, and it agreed: no alarm
    assert not any("alarm/divergence" in r for r in result.metrics)
    assert sum(r["scoring/rm/corr_env"] for r in rows[-10:] if "scoring/rm/corr_env" in r) > 0  # the model ranks episodes as the verifier does


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_scorer_replica_is_replaced_and_no_episode_is_lost(tmp_path, trained_rm):
    rm, _ = trained_rm
    cfg = _cfg(
        tmp_path / "run",
        steps=100,
        batch_groups=4,
        generator={"group_size": 4, "max_new_tokens": 8, "max_num_seqs": 16},
        scoring={"scorers": [{"kind": "reward_model", "path": rm, "weight": 0.1}]},
    )
    s = meshrl.Session(cfg).start()
    try:
        rows = s.step(3)
        pid = s.loop.scorers.members[(0, 0)].pids[0][0]
        os.kill(pid, signal.SIGKILL)
        rows += s.step(5)
        assert rows[-1]["scoring/replicas_replaced"] >= 1
        groups = [g for r in rows for g in r.get("trained_groups", [])]
        assert len(groups) == 8 * 4 and len(set(groups)) == len(groups)  # every step full, no group twice
        assert sum(r.get("episode/failed", 0) for r in rows) == 0  # no episode failed for the scorer's death
        assert sum(r.get("scoring/reward_model/failed", 0) for r in rows) == 0
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_judge_on_its_own_engine_scores_replies_parsed_exactly(tmp_path):
    """A tiny judge (a random Qwen3 leaning to digits, greedy) on a scorer proc: every
    result's score is exactly the parser's reading of the reply it carries; then a run with
    the judge logged beside the verifier."""
    from monarch.actor import this_host

    from meshrl.scorers.actor import ScorerActor
    from meshrl.tokenizer import build_char_tokenizer
    from tests.conftest import build_digit_teacher

    judge = build_digit_teacher(tmp_path / "judge")
    build_char_tokenizer(judge)
    spec = {"kind": "judge", "path": judge, "template": "{prompt}{response}", "max_new_tokens": 6, "scale": 0.5}
    cfg = Config.from_dict(_cfg(tmp_path / "direct", scoring={"scorers": [spec]}))

    async def direct():
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            actor = procs.spawn("judge", ScorerActor)
            await actor.setup.call_one(cfg.to_dict(), 0, 0)
            items = [{"prompt": p, "response": r, "answer": "", "messages": None, "sample": {}, "steps": None} for p in "abcdefgh" for r in ("", "1", "x")]
            return await actor.score.call_one(items)
        finally:
            await procs.stop()

    results = asyncio.run(direct())
    assert len(results) == 24 and all("reply" in r for r in results)
    for r in results:
        value = number_parser(r["reply"])
        if value is None:
            assert r["score"] is None and r["unparsable"], r
        else:
            assert r["score"] == value * 0.5 and not r["unparsable"], r
    assert any(r["score"] is not None for r in results)

    run = meshrl.run(_cfg(tmp_path / "run", steps=3, scoring={"scorers": [{**spec, "weight": 0.0}]}))
    rows = [r for r in run.metrics if "scoring/judge/mean" in r or "scoring/judge/unparsable" in r]
    assert rows and all("scoring/env/mean" in r for r in rows)
    assert all(r.get("episode/failed", 0) == 0 for r in rows)  # unparsable replies score 0, they fail nothing


def test_reward_models_and_judges_hold_a_gpu_of_their_own_in_the_device_plan(tmp_path, trained_rm):
    from meshrl.launch.devices import plan_devices
    from meshrl.launch.memory import plan_memory

    rm, _ = trained_rm
    scorers = [{"kind": "reward_model", "path": rm, "replicas": 2}, {"kind": "remote", "url": "http://127.0.0.1:9/"}]
    cfg = Config.from_dict({"launcher": {"gpus_per_host": 4, "gpu_memory_gib": 80}, "scoring": {"scorers": scorers}})
    plan = plan_devices(cfg)
    assert [(s.role, s.index, s.gpus) for s in plan.slots] == [("trainer", 0, (0,)), ("generator", 0, (1,)), ("scorer", 0, (2,)), ("scorer", 1, (3,))]
    assert plan.env("scorer", 1)["CUDA_VISIBLE_DEVICES"] == "3"
    held = {h.role for g in plan_memory(cfg, plan=plan).gpus for h in g.holdings}
    assert "scorer" in held
    # a reward model of a family the trainer does not build: held as its files, not refused
    other = shutil.copytree(rm, tmp_path / "other_family")
    with open(other / "config.json") as f:
        hf = json.load(f)
    with open(other / "config.json", "w") as f:
        json.dump({**hf, "model_type": "deberta-v2", "architectures": ["DebertaV2ForSequenceClassification"]}, f)
    cfg = Config.from_dict({"launcher": {"gpus_per_host": 3, "gpu_memory_gib": 80}, "scoring": {"scorers": [{"kind": "reward_model", "path": str(other)}]}})
    (scorer,) = [h for g in plan_memory(cfg).gpus for h in g.holdings if h.role == "scorer"]
    weights = dict(scorer.lines)["reward model weights"]
    assert weights == sum(p.stat().st_size for p in other.glob("*.safetensors")) > 0
    with pytest.raises(ConfigError) as e:  # one GPU too few: the line names the field to change
        plan_devices(Config.from_dict({"launcher": {"gpus_per_host": 3}, "scoring": {"scorers": scorers}}))
    assert "teacher and scorers 2" in str(e.value)
    shared = plan_devices(Config.from_dict({"placement": "colocate", "launcher": {"gpus_per_host": 1}, "scoring": {"scorers": scorers}}))
    assert [(s.role, s.gpus) for s in shared.slots] == [("trainer", (0,)), ("generator", (0,)), ("scorer", (0,)), ("scorer", (0,))]


def test_a_rollout_worker_turns_step_scores_into_advantages_that_change_at_the_delimiters(tmp_path):
    """Through a rollout worker: a group of two episodes played on a scripted generator, a
    process function scoring each step (`,` ends one), packed: the trained per-token
    advantage changes exactly after each step's last token."""
    from meshrl.agent.worker import RolloutWorker
    from meshrl.queue import Claim
    from meshrl.tokenizer import build_char_tokenizer
    from tests.conftest import ScriptedGenerator, replies_in_order

    cfg = Config.from_dict(
        {
            "generator": {"group_size": 2},
            "scoring": {
                "process_weight": 1.0,
                "process_advantage": "step",
                "scorers": [{"kind": "function", "path": "tests.test_scorers:per_step", "process": "step", "step_delimiter": ",", "name": "steps"}],
            },
        }
    )
    worker = RolloutWorker(cfg, build_char_tokenizer(tmp_path / "tok"))
    tok = worker.tokenizer
    worker.set_generators([ScriptedGenerator(replies_in_order(tok, ["12,34,5", "1,23"]))])
    episodes = asyncio.run(worker.play_group(Claim(0, {"prompt": "a:", "answer": ""}, 0)))
    td = asyncio.run(worker._packed(episodes))
    for row, ep in enumerate(episodes):
        text = tok.decode(ep.token_ids[ep.prompt_len :])
        ends = [ep.prompt_len + i for i, ch in enumerate(text) if ch == ","] + [len(ep) - 1]  # the last: the end-of-turn token
        adv = td["token_advantage"][row]
        changes = [t for t in range(ep.prompt_len + 1, len(ep)) if not math.isclose(adv[t], adv[t - 1], abs_tol=1e-7)]
        assert changes == [e + 1 for e in ends[:-1]], (text, changes, adv.tolist())
        assert [p for p, _ in ep.process] == ends and ep.signals["steps"] == float(len(text.replace(tok.eos_token, "")))


def test_a_judge_runs_on_the_one_gpu_its_replica_holds_whatever_generator_tp(tmp_path, monkeypatch):
    """The device plan gives a judge replica one GPU, and its engine was built with the policy's
    generator.tp: at tp=2 it could not start; the memory plan divided its weights by 2 too."""
    import meshrl.generator.engine as engine
    from meshrl.launch.devices import plan_devices
    from meshrl.launch.memory import plan_memory
    from meshrl.scorers.backends import Judge
    from tests.conftest import build_lora_base

    path = build_lora_base(tmp_path / "judge")
    built = []
    monkeypatch.setattr(engine, "VLLMEngine", lambda gen, *a, **k: built.append(gen))
    spec = {"kind": "judge", "path": str(path), "template": "Rate {response}"}
    cfg = Config.from_dict({"generator": {"tp": 2}, "launcher": {"gpus_per_host": 4, "gpu_memory_gib": 80}, "scoring": {"scorers": [spec]}})
    Judge(cfg.scoring.scorers[0], cfg.generator)
    assert [g.tp for g in built] == [1]
    plan = plan_devices(cfg)
    assert [s.gpus for s in plan.slots if s.role == "scorer"] == [(3,)]
    (judge,) = [h for g in plan_memory(cfg, plan=plan).gpus for h in g.holdings if h.role == "scorer"]
    assert "(1/1)" in judge.notes[0], judge.notes


def test_a_hybrid_thinking_judge_is_asked_to_answer_at_once(tmp_path):
    """Qwen3's template thinks unless told not to: the documented Qwen3-8B judge spent its 8
    reply tokens inside <think> and scored every episode unparsable (0)."""
    import types

    from meshrl.scorers.backends import Judge
    from meshrl.tokenizer import build_char_tokenizer, load_tokenizer

    tok = load_tokenizer(build_char_tokenizer(tmp_path / "tok"))
    tok.chat_template = "{% for m in messages %}U{{ m['content'] }}{% endfor %}A{% if enable_thinking is defined and not enable_thinking %}<T></T>{% endif %}"
    judge = Judge.__new__(Judge)
    judge.tokenizer, judge.prompt_len = tok, 1000
    judge.spec = types.SimpleNamespace(template="Rate {response}")
    assert tok.decode(judge.prompt_ids({"prompt": "q", "response": "r", "sample": {}})).endswith("A<T></T>")
