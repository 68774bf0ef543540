"""On-policy distillation: teacher log-probs in the rollout batch, per-token advantages, the
loss and the trainer on them, and a teacher scoring on a real vLLM engine.

The engine tests run one teacher replica (a `GeneratorActor` set up with `teacher=True`) on
the tiny Qwen3 of tests/test_generator.py, with a test-only endpoint to change its logit
temperature, so that one engine can both sample and score at one temperature.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch
from monarch.actor import concurrent_endpoint, this_host

from meshrl import episode
from meshrl.config import LossConfig
from meshrl.distill import assign_distill_advantages, attach_teacher_logprobs
from meshrl.episode import Episode, Turn, assign_advantages, pack
from meshrl.futures import awaited
from meshrl.generator.actor import GeneratorActor
from meshrl.trainer.losses import CORRECTIONS, policy_loss, reduce_metrics
from tests.test_generator import CALL_S, hf_logprobs, make_config, prompts, save_checkpoint, tiny_qwen3

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def model(ids, logprobs, teacher=None, reward=0.0):
    return Turn("model", list(ids), list(logprobs), [1] * len(ids), reward=reward, teacher_logprobs=teacher)


def env(ids):
    return Turn("env", list(ids))


def scored_episodes():
    """Two groups: a two-turn episode, a one-turn one, a one-turn one, a failed unscored one."""
    return [
        Episode(0, 0, [env([5, 6]), model([7, 8], [-0.5, -1.0], [-0.25, -2.0], reward=1.0), env([9]), model([10], [-0.1], [-0.4])]),
        Episode(0, 1, [env([5, 6]), model([11, 12, 13], [-0.2, -0.3, -0.4], [-0.2, -0.1, -1.4])]),
        Episode(1, 2, [env([1]), model([2], [-2.0], [-0.5], reward=3.0)]),
        Episode(1, 3, [env([1]), model([3, 4], [-0.7, -0.8]), env([30])], "failed"),
    ]


# ---- the batch --------------------------------------------------------------------------------
def test_pack_writes_teacher_logprobs_on_model_tokens():
    td = pack(scored_episodes())
    assert td["teacher_logprobs"].dtype == torch.float32 and td["teacher_logprobs"].shape == td["tokens"].shape
    assert td["teacher_logprobs"][0].tolist() == pytest.approx([0, 0, -0.25, -2.0, 0, -0.4])
    assert td["teacher_logprobs"][1].tolist() == pytest.approx([0, 0, -0.2, -0.1, -1.4, 0])
    assert td["teacher_logprobs"][3].tolist() == [0.0] * 6  # failed: may stay unscored
    assert (td["teacher_logprobs"][~td["loss_mask"]] == 0).all()
    # no teacher anywhere: the batch is exactly the RL one
    plain = pack([Episode(0, 0, [env([1]), model([2], [-1.0])])])
    assert "teacher_logprobs" not in plain.keys() and "token_advantage" not in plain.keys()


def test_pack_refuses_a_partly_scored_episode_that_trains():
    eps = scored_episodes()
    eps[1].turns[1].teacher_logprobs = None
    with pytest.raises(ValueError, match="without teacher log-probs"):
        pack(eps)
    with pytest.raises(ValueError, match="teacher log-probs"):
        model([1, 2], [-1.0, -1.0], [-1.0])


def test_an_episode_the_teacher_cannot_score_counts_against_its_group(tmp_path):
    """A sequence the teacher failed on was raised as a lost generator (GenerationFailed), which
    never counts against the group: a record the teacher can never score was played again
    without end. It now counts (the queue drops the group after buffer.MAX_FAILED_PLAYS); a
    replica that is stopping fails the whole call, which is the teacher's, not the group's."""
    from types import SimpleNamespace

    from meshrl.agent.worker import RolloutWorker, _not_the_groups
    from meshrl.config import Config
    from meshrl.tokenizer import build_char_tokenizer

    worker = RolloutWorker(Config.from_dict({"distill": {"teacher": "unused"}}), build_char_tokenizer(tmp_path))

    async def score(sequences, call_id):
        return ["ValueError: prompt too long"] + [[0.0] * len(s) for s in sequences[1:]]

    worker.teacher = SimpleNamespace(score_many=SimpleNamespace(call_one=score))
    with pytest.raises(RuntimeError, match="the teacher could not score episode 0: ValueError: prompt too long") as e:
        asyncio.run(worker._packed(scored_episodes()))
    assert not _not_the_groups(e.value)


def test_a_teacher_call_past_its_bound_is_aborted_on_the_teacher(tmp_path):
    """The worker gave up on a slow teacher call and played the group again, while the teacher
    went on scoring the abandoned sequences, ahead of every later group's. It now aborts them
    by the call's id (Generator.score_many, as generate_many's turns)."""
    from types import SimpleNamespace

    from meshrl.agent.worker import RolloutWorker
    from meshrl.config import Config
    from meshrl.tokenizer import build_char_tokenizer

    config = Config.from_dict({"distill": {"teacher": "unused"}, "weight_sync": {"timeout_s": 0.2}, "generator": {"startup_timeout_s": 0.1}})
    worker = RolloutWorker(config, build_char_tokenizer(tmp_path))
    asked, aborted = [], []

    async def score(sequences, call_id):
        asked.append(call_id)
        await asyncio.sleep(3600)

    async def abort(call_id):
        aborted.append(call_id)
        return True

    worker.teacher = SimpleNamespace(score_many=SimpleNamespace(call_one=score), abort_many=SimpleNamespace(call_one=abort))
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(worker._packed(scored_episodes()))
    assert len(asked) == 1 and aborted == asked


def test_attach_teacher_logprobs_slices_whole_sequence_scores():
    ep = Episode(0, 0, [env([5, 6]), Turn("model", [7, 8], [-0.5, -1.0], [0, 0]), env([9]), Turn("model", [10], [-0.1], [0])])
    attach_teacher_logprobs(ep, [0.0, -9.0, -1.0, -2.0, -9.0, -3.0])  # position i: log p(token i | tokens < i)
    assert [t.teacher_logprobs for t in ep.turns] == [None, [-1.0, -2.0], None, [-3.0]]
    with pytest.raises(ValueError, match="6 tokens but 5"):
        attach_teacher_logprobs(ep, [0.0] * 5)


@pytest.mark.parametrize("mode", ["grpo", "grpo_no_std", "rloo"])
def test_token_advantage_is_weighted_reverse_kl_plus_group_advantage(mode):
    kl_w, r_w = 0.5, 2.0
    td = assign_distill_advantages(pack(scored_episodes()), kl_w, r_w, mode)
    group_adv = assign_advantages(pack(scored_episodes()), mode)
    assert torch.equal(td["advantage"], group_adv["advantage"])  # the task's advantage, untouched
    assert torch.equal(td["loss_mask"], group_adv["loss_mask"])  # the failed episode left the loss
    assert td["token_advantage"].dtype == torch.float32
    for b, ep in enumerate(scored_episodes()):
        at = 0
        for turn in ep.turns:
            for j in range(len(turn.token_ids)):
                got = float(td["token_advantage"][b, at + j])
                if turn.role == "model" and ep.finish_reason != "failed":
                    want = kl_w * (turn.teacher_logprobs[j] - turn.logprobs[j]) + r_w * float(group_adv["advantage"][b])
                    assert got == pytest.approx(want, abs=1e-6)
                else:
                    assert got == 0.0
            at += len(turn.token_ids)
        assert (td["token_advantage"][b, at:] == 0).all()


def test_unscored_batch_is_accepted_only_when_every_episode_failed():
    failed = pack([Episode(3, 0, [env([1]), model([2], [-1.0])], "failed"), Episode(3, 1, [env([1]), model([2], [-1.0])], "failed")])
    td = assign_distill_advantages(failed, 1.0, 1.0, "grpo")
    assert (td["teacher_logprobs"] == 0).all() and (td["token_advantage"] == 0).all() and not td["loss_mask"].any()
    with pytest.raises(ValueError, match="needs teacher_logprobs"):
        assign_distill_advantages(pack([Episode(3, 0, [env([1]), model([2], [-1.0])])]), 1.0, 1.0, "grpo")


def game_episode(sample_id: int, solver_reward: float, teacher=True, proposer_reward: float = 0.5) -> Episode:
    """A game's episode (task:propose's shape): a thread of the proposer (model 1) and one of the
    policy (model 0); only the policy's turns carry the teacher's scores."""
    proposer = Episode(0, sample_id, [env([1]), model([2], [-1.5], reward=proposer_reward)], model=1)
    solver = Episode(0, sample_id, [env([3]), model([4, 5], [-0.5, -1.0], [-0.2, -3.0] if teacher else None, reward=solver_reward)])
    return Episode(0, sample_id, threads=[proposer, solver])


def test_in_a_game_the_teacher_distills_the_policys_rows_and_the_others_keep_their_group_advantage():
    kl_w, r_w = 0.5, 2.0
    games = [game_episode(0, 1.0), game_episode(1, 0.0, proposer_reward=1.0)]
    td = assign_distill_advantages(pack(games), kl_w, r_w, "grpo")
    plain = assign_advantages(pack(games), "grpo")
    assert td["model"].tolist() == [1, 0, 1, 0] and torch.equal(td["advantage"], plain["advantage"])
    for b in (1, 3):  # the policy's threads: reverse KL to the teacher plus the weighted group advantage
        want = [kl_w * (t - mu) + r_w * float(plain["advantage"][b]) for t, mu in ((-0.2, -0.5), (-3.0, -1.0))]
        assert td["token_advantage"][b, 1:3].tolist() == pytest.approx(want)
    for b in (0, 2):  # the proposer's: its group advantage alone, on its one token, whatever the weights
        assert td["token_advantage"][b].tolist() == pytest.approx([0.0, float(plain["advantage"][b]), 0.0])
    # each trainer's rows: the teacher's log-probs reach the policy's alone
    proposer, policy = episode.model_rows(td, 1), episode.model_rows(td, 0)
    assert "teacher_logprobs" not in proposer.keys() and proposer["token_advantage"][:, 1].tolist() == pytest.approx(plain["advantage"][[0, 2]].tolist())
    assert policy["teacher_logprobs"][:, 1:3].flatten().tolist() == pytest.approx([-0.2, -3.0] * 2)
    # a policy's thread left unscored while another is scored is refused; every policy row failed: zeros
    with pytest.raises(ValueError, match="without teacher log-probs"):
        pack([game_episode(0, 1.0), game_episode(1, 0.0, teacher=False)])
    unscored = [game_episode(0, 1.0, teacher=False)]
    for row in unscored[0].threads:
        row.finish_reason = "failed" if row.model == 0 else "stop"
    assert not bool(assign_distill_advantages(pack(unscored), kl_w, r_w, "grpo")["loss_mask"][1].any())
    with pytest.raises(ValueError, match="needs teacher_logprobs"):
        assign_distill_advantages(pack([game_episode(0, 1.0, teacher=False)]), kl_w, r_w, "grpo")


def test_a_teacher_that_cannot_read_the_policys_token_ids_is_refused(tmp_path):
    """The teacher scores the policy's sampled token ids: a smaller vocabulary would index past
    its embedding, another tokenizer would score other tokens, silently."""
    import json

    from meshrl.config import Config, ConfigError, ModelConfig
    from meshrl.trainer import checkpoint as ckpt
    from meshrl.trainer.checks import check_teacher
    from meshrl.trainer.model import build_model
    from tests.conftest import build_lora_base

    def taught(teacher) -> Config:
        return Config.from_dict({"distill": {"teacher": str(teacher)}})

    same = build_lora_base(tmp_path / "same")  # the default shapes and the character tokenizer: the policy's own
    check_teacher(taught(same))
    small, specs = build_model(ModelConfig(vocab_size=64))
    ckpt.export_hf(small, specs, str(tmp_path / "small"))
    other = build_lora_base(tmp_path / "other")
    spec = json.loads((tmp_path / "other" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(spec))
    more = build_lora_base(tmp_path / "more")  # a tokenizer that adds tokens past the policy's: no mismatch
    spec = json.loads((tmp_path / "more" / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<think>"] = len(spec["model"]["vocab"])
    (tmp_path / "more" / "tokenizer.json").write_text(json.dumps(spec))
    check_teacher(taught(more))
    for teacher, why in ((tmp_path / "small", r"its vocabulary \(64\) is smaller than the policy's \(128\)"), (other, "other ids than the policy's")):
        with pytest.raises(ConfigError, match=why) as e:
            check_teacher(taught(teacher))
        assert e.value.field_path == "distill.teacher"


def test_a_teacher_its_engine_cannot_start_is_refused_before_the_run(tmp_path):
    """The teacher's engine runs generator.tp workers on distill.cpus, at model.max_seq_len: a
    teacher with fewer positions, heads tp does not split, or no weights, or one core for two
    workers, passed the checks and failed once the meshes were up."""
    import json
    import shutil

    from meshrl.config import Config, ConfigError
    from meshrl.trainer.checks import check_teacher
    from tests.conftest import build_lora_base

    same = build_lora_base(tmp_path / "same")
    short, bare = tmp_path / "short", tmp_path / "bare"
    shutil.copytree(same, short)
    hf = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 64}))
    odd = tmp_path / "odd"  # (read for its config alone)
    shutil.copytree(same, odd)
    (odd / "config.json").write_text(json.dumps({**hf, "num_attention_heads": 3, "num_key_value_heads": 3}))
    bare.mkdir()
    for name in os.listdir(same):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(same, name), bare / name)
    cases = [
        ({}, short, r"max_position_embeddings=64 is under model.max_seq_len=256"),
        ({"generator": {"tp": 2}}, odd, r"generator.tp=2, which the teacher's engine runs on too, does not split its 3 attention heads"),
        ({}, bare, "no weight files"),
    ]
    for extra, teacher, why in cases:
        with pytest.raises(ConfigError, match=why) as e:
            check_teacher(Config.from_dict({**extra, "distill": {"teacher": str(teacher)}}))
        assert e.value.field_path == "distill.teacher"
    yarn = tmp_path / "yarn"  # fewer positions, stretched by YaRN (transformers' newer spelling): vLLM serves it
    shutil.copytree(short, yarn)
    (yarn / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 64, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    check_teacher(Config.from_dict({"distill": {"teacher": str(yarn)}}))
    with pytest.raises(ConfigError, match=r"distill.cpus.*at least 2 cores") as e:
        Config.from_dict({"generator": {"tp": 2}, "distill": {"teacher": str(same), "cpus": "0"}})


def test_concat_pad_and_trim_keep_the_distillation_keys():
    a = assign_distill_advantages(pack(scored_episodes()[:2]), 1.0, 1.0, "grpo")  # T = 6
    b = assign_distill_advantages(pack(scored_episodes()[2:]), 1.0, 1.0, "grpo")  # T = 4
    both = episode.concat([a, b])
    assert both["tokens"].shape == (4, 6)
    for key in ("teacher_logprobs", "token_advantage"):
        assert torch.equal(both[key][:2], a[key])
        assert torch.equal(both[key][2:, :4], b[key]) and (both[key][2:, 4:] == 0).all()
    short = episode.trim(both[2:])
    assert short["teacher_logprobs"].shape == (2, 3) and torch.equal(short["token_advantage"], b["token_advantage"][:, :3])
    with pytest.raises(ValueError, match="different keys"):
        episode.concat([a, assign_advantages(pack(scored_episodes()[2:3]), "grpo")])


# ---- the loss ----------------------------------------------------------------------------------
def loss_inputs(seed: int, B: int = 4, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    lp = (-3 * torch.rand(B, T, generator=g)).double()
    mu = lp + 0.3 * torch.randn(B, T, generator=g).double()
    prox = lp + 0.1 * torch.randn(B, T, generator=g).double()
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0, 0] = True
    adv = torch.randn(B, generator=g).double()
    return lp, mu, prox, mask, adv


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_per_token_advantages_constant_along_t_equal_the_sequence_ones(correction, aggregation):
    lp, mu, prox, mask, adv = loss_inputs(1)
    cfg = dataclasses.replace(LossConfig(), correction=correction, aggregation=aggregation, opsm_delta=0.05)
    # garbage off the mask: a per-token advantage is read on loss tokens only
    per_token = torch.where(mask, adv[:, None].expand_as(mask), torch.tensor(float("nan"), dtype=adv.dtype))
    outs = []
    for a in (adv, per_token):
        x = lp.clone().requires_grad_(True)
        loss, m = policy_loss(x, mu, a, mask, cfg, prox_logprobs=prox)
        loss.backward()
        outs.append((loss.detach(), x.grad, reduce_metrics([m])))
    (l1, g1, m1), (l2, g2, m2) = outs
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert m1 == m2


def test_per_token_advantages_weight_each_token():
    """correction none, token_mean, the clip measured against pi_prox = pi_theta (so it never
    acts): d loss / d logprob_t = -A_t / n on loss tokens."""
    lp, mu, _, mask, _ = loss_inputs(2)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(3)).double()
    cfg = dataclasses.replace(LossConfig(), correction="none", aggregation="token_mean", clip_against="proximal")
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, mu, adv, mask, cfg)
    loss.backward()
    n = mask.sum()  # the loss computes in float32
    assert float(loss.detach()) == pytest.approx(float(-(adv * mask).sum() / n), abs=1e-6)
    assert torch.allclose(x.grad, torch.where(mask, -adv / n, 0.0).double(), atol=1e-7)


def test_opsm_with_per_token_advantages_drops_only_negative_tokens_of_off_policy_sequences():
    mask = torch.ones(2, 4, dtype=torch.bool)
    lp = torch.zeros(2, 4, dtype=torch.float64)
    mu = torch.tensor([[1.0] * 4, [0.0] * 4], dtype=torch.float64)  # row 0: log(mu / pi_prox) = 1 > delta
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0]] * 2, dtype=torch.float64)
    cfg = dataclasses.replace(LossConfig(), correction="opsm", opsm_delta=0.5)
    _, m = policy_loss(lp.clone().requires_grad_(True), mu, adv, mask, cfg)
    assert float(m["masked_sum"]) == 2.0


def test_advantages_of_a_wrong_shape_are_refused():
    lp, mu, _, mask, _ = loss_inputs(4)
    with pytest.raises(ValueError, match=r"\[B\]=4 or \[B,T\]"):
        policy_loss(lp, mu, torch.zeros(4, 3), mask, LossConfig())


# ---- the trainer -------------------------------------------------------------------------------
def test_trainer_step_on_token_advantages():
    """A PolicyTrainer step on token_advantage = advantage on every loss token is the RL step;
    micro-batching a distillation batch (trim, pad) does not change its loss; the step reports
    distill_reverse_kl, the token mean of sampler - teacher log-probs."""
    from meshrl.trainer.policy import PolicyTrainer
    from tests.test_trainer import CPU, make_batch
    from tests.test_trainer import make_config as trainer_config

    batch = make_batch(version=1, turns=2)
    mask = batch["loss_mask"]
    g = torch.Generator().manual_seed(0)
    teacher = torch.where(mask, batch["sampler_logprobs"] + 0.5 * torch.randn(mask.shape, generator=g), 0.0)
    same = batch.clone()
    same["teacher_logprobs"] = teacher
    same["token_advantage"] = torch.where(mask, batch["advantage"][:, None].expand_as(mask), 0.0)
    rl = PolicyTrainer(trainer_config(), CPU).train_step(batch, current_version=1)
    distill = PolicyTrainer(trainer_config(), CPU).train_step(same, current_version=1)
    assert distill["loss"] == pytest.approx(rl["loss"], abs=1e-6) and distill["grad_norm"] == pytest.approx(rl["grad_norm"], rel=1e-5)
    assert "distill_reverse_kl" not in rl
    want = float(torch.where(mask, batch["sampler_logprobs"] - teacher, 0.0).sum() / mask.sum())
    assert distill["distill_reverse_kl"] == pytest.approx(want, abs=1e-5)

    mixed = same.clone()
    mixed["token_advantage"] = torch.where(mask, 0.7 * (teacher - batch["sampler_logprobs"]) + batch["advantage"][:, None], 0.0)
    small = PolicyTrainer(trainer_config(micro_batch_size=3), CPU).train_step(mixed, current_version=1)
    whole = PolicyTrainer(trainer_config(micro_batch_size=64), CPU).train_step(mixed, current_version=1)
    assert small["loss"] == pytest.approx(whole["loss"], abs=1e-6) and small["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert abs(small["loss"] - rl["loss"]) > 1e-4  # the per-token advantages did change the loss


# ---- a teacher on a real vLLM engine -----------------------------------------------------------
class TeacherTestActor(GeneratorActor):
    """`GeneratorActor` plus what only these tests use: change the logit temperature (so that
    one engine can sample and score at one temperature) and read the engine's settings."""

    @concurrent_endpoint
    async def set_logit_temperature(self, temperature: float) -> None:
        await self._gen().engine.set_logit_temperature(temperature)

    @concurrent_endpoint
    async def engine_info(self) -> dict:
        engine = self._gen().engine
        return {
            "logit_temperature": engine.logit_temperature,
            "prefix_caching": bool(engine.llm.vllm_config.cache_config.enable_prefix_caching),
            "block_size": int(engine.llm.vllm_config.cache_config.block_size),
        }


TEACHER_T = 0.7


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    model = tiny_qwen3(0)
    ckpt = save_checkpoint(model, root / "ckpt")
    procs = this_host().spawn_procs(per_host={"procs": 1})
    actor = None
    try:
        actor = procs.spawn("teacher", TeacherTestActor)
        actor.setup.call_one(make_config(temperature=TEACHER_T).to_dict(), ckpt, 0, None, teacher=True).get(timeout=300)
        yield {"model": model, "actor": actor}
    finally:
        if actor is not None:
            try:
                actor.shutdown_engine.call_one().get(timeout=60)
            except Exception:
                pass
        procs.stop().get(timeout=60)


def call(future, timeout: float = CALL_S):
    return future.get(timeout=timeout)


def generate_all(actor, requests, max_new_tokens, temperature):
    async def main():
        calls = [awaited(actor.generate.call_one(ids, max_new_tokens, temperature, 0)) for ids in requests]
        return await asyncio.wait_for(asyncio.gather(*calls), CALL_S)

    return asyncio.run(main())


def worst(a, b) -> float:
    return (torch.tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()


@pytest.mark.slow
def test_teacher_scores_every_token_at_the_generator_temperature(teacher):
    """Set up as a teacher at generator.temperature = 0.7, the replica scores each token as
    HF's log_softmax(logits / 0.7) given the tokens before it, position 0 gets 0.0, a
    sequence of the full max_seq_len scores, and a failing sequence fails alone."""
    model, actor = teacher["model"], teacher["actor"]
    info = call(actor.engine_info.call_one())
    assert info["logit_temperature"] == TEACHER_T  # set by setup(teacher=True)
    call(actor.set_logit_temperature.call_one(TEACHER_T))
    g = torch.Generator().manual_seed(5)
    seqs = [[1] + torch.randint(3, 120, (n - 1,), generator=g).tolist() for n in (2, 40, 256)]  # 256 = model.max_seq_len
    out = call(actor.score_many.call_one([*seqs, [1], [], seqs[1] * 7]))
    *scores, one, empty, too_long = out
    for ids, s in zip(seqs, scores):
        assert isinstance(s, list) and len(s) == len(ids) and s[0] == 0.0
        assert worst(s[1:], hf_logprobs(model, ids[:1], ids[1:], TEACHER_T)) < 1e-4
    assert one == [0.0] and empty == []
    assert isinstance(too_long, str) and "256" in too_long


@pytest.mark.slow
def test_teacher_score_of_a_sample_equals_its_sampler_logprobs(teacher):
    """The engine's score of prompt + response equals, on the response, the log-probs the same
    engine returned when it sampled those tokens: at temperature 1, and at 0.7 (sampled at
    0.7 with plain logits, scored with logits / 0.7). Position t's score is the log-prob of
    token t, not t + 1: an off-by-one fails this at once. Responses are longer than a KV
    block, and scoring one twice gives the same values: positions in the prefix cache are
    scored too (the cache lookup is skipped for scoring)."""
    model, actor = teacher["model"], teacher["actor"]
    info = call(actor.engine_info.call_one())
    assert info["prefix_caching"]
    length = info["block_size"] + 30
    requests = prompts(3, seed=11, length=8)
    try:
        call(actor.set_logit_temperature.call_one(1.0))
        for temperature in (1.0, TEACHER_T):
            call(actor.set_logit_temperature.call_one(1.0))
            results = generate_all(actor, requests, length, temperature)
            call(actor.set_logit_temperature.call_one(temperature))
            seqs = [p + r.token_ids for p, r in zip(requests, results)]
            first = call(actor.score_many.call_one(seqs))
            again = call(actor.score_many.call_one(seqs))
            for p, r, s, s2 in zip(requests, results, first, again):
                assert len(r.token_ids) == length and len(s) == len(p) + length
                assert worst(s[len(p) :], r.logprobs) < 1e-4, temperature
                assert worst(s[1:], hf_logprobs(model, p[:1], p[1:] + r.token_ids, temperature)) < 1e-4
                assert s2 == s
    finally:
        call(actor.set_logit_temperature.call_one(TEACHER_T))
