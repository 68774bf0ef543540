"""vLLM generator replicas on a real Monarch proc mesh, with real vLLM engines.

One GeneratorActor (one engine) serves the whole module; a second one, started from a
checkpoint on disk, is the reference for tensor weight updates. The test model is a tiny
random Qwen3 whose EOS token can never be sampled (see `tiny_qwen3`), so long
completions run to their token budget and a weight update reliably lands inside them.
"""

from __future__ import annotations

import asyncio

import os
import time

import pytest
import torch
from monarch.actor import Actor, endpoint, this_host

from meshrl.config import Config
from meshrl.rollout import Completion, Prompt
from meshrl.tokenizer import build_char_tokenizer

FORCED = 77  # the token id the "forced" weights make overwhelmingly likely
EOS = 2
CALL_S = 120.0


def tiny_qwen3(seed: int):
    """A random Qwen3 (vocab 128, hidden 64, 2 layers, head_dim 32: the smallest head the
    vLLM CPU attention kernels accept). Hidden dim 0 of every embedding is a positive
    constant and lm_head row EOS is strongly negative on it, so EOS is never sampled;
    lm_head is scaled up so the distribution is peaked (greedy has clear winners)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, bos_token_id=1, eos_token_id=EOS,
        pad_token_id=0, tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.2
        model.lm_head.weight.mul_(10.0)
        model.lm_head.weight[EOS, 0] = -50.0
    return model


def forced_state_dict(model) -> dict[str, torch.Tensor]:
    """Weights under which FORCED is sampled with probability ~1 at every position: blocks
    write nothing to the residual stream (o_proj, down_proj = 0), so the normed hidden
    state's dim 0 is large and positive, and lm_head reads only dim 0 into FORCED."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            sd[k].zero_()
    sd["model.embed_tokens.weight"][:, 0] = 50.0
    sd["lm_head.weight"].zero_()
    sd["lm_head.weight"][FORCED, 0] = 100.0
    return sd


def save_checkpoint(model, path) -> str:
    model.save_pretrained(str(path), safe_serialization=True)
    build_char_tokenizer(path)
    return str(path)


def make_config(**generator) -> Config:
    gen = {"group_size": 2, "max_new_tokens": 200, "temperature": 0.7, "max_num_seqs": 16, "update_mode": "keep"}
    gen.update(generator)
    return Config.from_dict({"model": {"max_seq_len": 256, "dtype": "float32"}, "generator": gen, "seed": 0})


class PromptSource(Actor):
    """Hands out a fixed list of prompts, then None."""

    def __init__(self):
        self.prompts: list[Prompt] = []

    @endpoint
    async def load(self, prompts: list[Prompt]) -> None:
        self.prompts = list(prompts)

    @endpoint
    async def next_prompt(self, timeout: float = 1.0, consumer: int = 0) -> Prompt | None:
        if not self.prompts:
            await asyncio.sleep(min(timeout, 0.1))  # like meshrl.data's source: hold, then None
            return None
        return self.prompts.pop(0)


class CompletionSink(Actor):
    """Collects every group pushed by a generator."""

    def __init__(self):
        self.groups: list[list[Completion]] = []

    @endpoint
    async def put_completions(self, completions: list[Completion]) -> None:
        self.groups.append(completions)

    @endpoint
    async def take(self) -> list[list[Completion]]:
        groups, self.groups = self.groups, []
        return groups


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from meshrl.generator.actor import GeneratorActor

    root = tmp_path_factory.mktemp("generator")
    model = tiny_qwen3(0)
    ckpt = save_checkpoint(model, root / "ckpt")
    procs = this_host().spawn_procs(per_host={"procs": 1})
    helpers = this_host().spawn_procs(per_host={"procs": 1})
    gen = None
    try:
        gen = procs.spawn("generator", GeneratorActor)
        info = gen.setup.call_one(make_config().to_dict(), ckpt, 0).get(timeout=300)
        assert info["version"] == 0
        source = helpers.spawn("source", PromptSource)
        sink = helpers.spawn("sink", CompletionSink)
        yield {"root": root, "model": model, "ckpt": ckpt, "gen": gen, "source": source, "sink": sink, "helpers": helpers,
               "setup": info}
    finally:
        if gen is not None:
            try:
                gen.shutdown_engine.call_one().get(timeout=60)
            except Exception:
                pass
        procs.stop().get(timeout=60)
        helpers.stop().get(timeout=60)


def prompts(n: int, first_group: int = 0, length: int = 5) -> list[Prompt]:
    g = torch.Generator().manual_seed(first_group)
    return [Prompt(prompt_ids=[1] + torch.randint(3, 99, (length - 1,), generator=g).tolist(), group_id=first_group + i) for i in range(n)]


def hf_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token given everything before it."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response_ids)[:, None])[:, 0]


def run_continuous(world, groups: list[Prompt], update) -> list[list[Completion]]:
    """Generate `groups` with the background loop; call `update()` once tokens flow."""
    gen = world["gen"]
    world["source"].load.call_one(groups).get(timeout=CALL_S)
    before = gen.stats.call_one().get(timeout=CALL_S)["tokens_generated"]
    gen.start_generation.call_one(world["source"], world["sink"]).get(timeout=CALL_S)
    deadline = time.monotonic() + 60
    while gen.stats.call_one().get(timeout=CALL_S)["tokens_generated"] - before < 400:
        assert time.monotonic() < deadline, "no tokens generated"
        time.sleep(0.02)
    update()
    out: list[list[Completion]] = []
    while len(out) < len(groups):
        assert time.monotonic() < deadline + 60, f"only {len(out)} of {len(groups)} groups arrived"
        out += world["sink"].take.call_one().get(timeout=CALL_S)
        time.sleep(0.05)
    stats = gen.stop_generation.call_one(10.0).get(timeout=CALL_S)
    assert stats["loop_error"] is None
    return out


def restore(world, version: int) -> None:
    sd = {k: v.clone() for k, v in world["model"].state_dict().items()}
    world["gen"].load_weights.call_one(version, sd, "block").get(timeout=CALL_S)


def test_shared_memory_weights_round_trip():
    from meshrl.generator.weight_loading import pack_to_shared_memory, views_of_shared_memory

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2).to(torch.bfloat16)}
    for dtype in (None, torch.bfloat16):
        shared = pack_to_shared_memory(tensors, dtype)
        try:
            views = views_of_shared_memory(shared.path, shared.nbytes, shared.manifest)
            assert set(views) == set(tensors)
            for k, t in tensors.items():
                want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
                assert views[k].dtype == want.dtype and torch.equal(views[k], want)
        finally:
            shared.unlink()
        assert not os.path.exists(shared.path)


def test_weight_sync_buffers_go_to_the_engine_in_place():
    """Tensors fetched by weight sync (views of a shared receive buffer) are described to the
    engine where they are; only tensors that need a cast (or live elsewhere) are copied."""
    from meshrl.generator.weight_loading import to_shared_memory, views_of_shared_memory
    from tests.test_weightsync import fetched_into_shared_buffer

    named = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(2, 2).to(torch.bfloat16))]
    bufs, flat, fetched = fetched_into_shared_buffer(named)
    before = set(os.listdir("/dev/shm"))
    for dtype, copied in ((None, set()), (torch.float32, {"c"}), (torch.bfloat16, {"a"})):
        segments = to_shared_memory(fetched, dtype)
        try:
            in_place = [s for s in segments if not s.owned]
            assert len(in_place) == 1 and in_place[0].path == flat.untyped_storage().filename
            assert {m[0] for s in segments if s.owned for m in s.manifest} == copied
            views = {}
            for s in segments:
                views.update(views_of_shared_memory(s.path, s.nbytes, s.manifest))
            for name, t in named:
                want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
                assert views[name].dtype == want.dtype and torch.equal(views[name], want)
        finally:
            for s in segments:
                s.unlink()
    assert set(os.listdir("/dev/shm")) == before, "copied segments are unlinked, in-place ones were never in /dev/shm"


def test_versions_from_spans():
    from types import SimpleNamespace as NS

    from meshrl.generator.engine import _versions_from_spans

    spans = [NS(version="default", start=0, end=2), NS(version="3", start=2, end=4), NS(version="4", start=4, end=6)]
    assert _versions_from_spans(spans, 6, 3) == [3, 3, 3, 3, 4, 4]
    assert _versions_from_spans(None, 2, 5) == [5, 5]


@pytest.mark.slow
def test_cpu_engine_runs_the_model_in_its_engine_core_process(world):
    """One CPU worker runs inside vLLM's engine-core process (compat.vllm_cpu_single_worker_executor):
    a separate worker process costs every decode step a hand-off on a shared core."""
    import psutil

    names = [psutil.Process(pid).name() for pid, _ in world["setup"]["processes"]["pids"] if psutil.pid_exists(pid)]
    assert any("EngineCor" in n for n in names), names  # the kernel's name keeps 15 characters
    assert not any("Worker" in n for n in names), names


@pytest.mark.slow
def test_greedy_matches_transformers(world):
    model, gen = world["model"], world["gen"]
    ps = prompts(3, first_group=10)
    completions = gen.generate.call_one(ps, 0.0, 24).get(timeout=CALL_S)
    assert len(completions) == 3 * 2
    assert len({c.sample_id for c in completions}) == 6
    for c in completions:
        ref = model.generate(torch.tensor([c.prompt_ids]), do_sample=False, max_new_tokens=24, eos_token_id=EOS, pad_token_id=0)
        assert c.response_ids == ref[0, len(c.prompt_ids):].tolist()
        assert c.finish_reason == "length" and c.versions == [0] * 24
        assert c.group_id in {p.group_id for p in ps}


@pytest.mark.slow
def test_sampler_logprobs_match_recomputation(world):
    # processed_logprobs: the returned log-prob is under the temperature-scaled distribution.
    model, gen = world["model"], world["gen"]
    completions = gen.generate.call_one(prompts(4, first_group=20), None, 24).get(timeout=CALL_S)  # T = 0.7
    worst, worst_raw = 0.0, float("inf")
    for c in completions:
        ref = hf_logprobs(model, c.prompt_ids, c.response_ids, 0.7)
        raw = hf_logprobs(model, c.prompt_ids, c.response_ids, 1.0)
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        worst = max(worst, (got - ref).abs().max().item())
        worst_raw = min(worst_raw, (got - raw).abs().max().item())
    assert worst < 2e-3, f"sampler log-probs differ from log_softmax(logits/T) by {worst}"  # float32 kernels
    assert worst_raw > 1e-2, "log-probs look like T=1 (raw) log-probs, not the sampling distribution"


def _check_switch(c: Completion, new_version: int) -> int:
    """Versions are old...old new...new, every new token is FORCED with log-prob ~0 and no
    old token looks forced. Returns the switch index."""
    switch = next((i for i, v in enumerate(c.versions) if v == new_version), len(c.versions))
    assert all(v < new_version for v in c.versions[:switch]) and all(v == new_version for v in c.versions[switch:])
    assert all(t == FORCED for t in c.response_ids[switch:]), (switch, c.response_ids)
    assert all(lp > -1e-3 for lp in c.logprobs[switch:])
    assert all(lp < -0.05 for lp in c.logprobs[:switch]), "an old-version token came from the new weights"
    return switch


@pytest.mark.slow
def test_keep_update_switches_version_at_the_right_token(world):
    gen = world["gen"]
    forced = forced_state_dict(world["model"])
    v0 = gen.version.call_one().get(timeout=CALL_S)
    held = []
    groups = run_continuous(
        world, prompts(6, first_group=100), lambda: held.append(gen.load_weights.call_one(v0 + 1, forced, "keep").get(timeout=CALL_S))
    )
    completions = [c for g in groups for c in g]
    assert sorted(c.group_id for g in groups for c in g[:1]) == list(range(100, 106))
    spanning = 0
    for c in completions:
        assert len(c.response_ids) == 200 and c.finish_reason == "length"
        switch = _check_switch(c, v0 + 1)
        spanning += 0 < switch < 200
    assert spanning >= 1, "the update should land inside some completions"
    assert held[0] < 5.0
    restore(world, v0 + 2)


@pytest.mark.slow
def test_abort_update_resumes_prefixes_without_loss_or_duplicates(world):
    gen = world["gen"]
    forced = forced_state_dict(world["model"])
    v0 = gen.version.call_one().get(timeout=CALL_S)
    resumed_before = gen.stats.call_one().get(timeout=CALL_S)["samples_resumed"]
    groups = run_continuous(
        world, prompts(6, first_group=200), lambda: gen.load_weights.call_one(v0 + 1, forced, "abort").get(timeout=CALL_S)
    )
    assert sorted(g[0].group_id for g in groups) == list(range(200, 206)), "each group exactly once"
    completions = [c for g in groups for c in g]
    assert all(len(g) == 2 and len({c.group_id for c in g}) == 1 for g in groups)
    assert len({c.sample_id for c in completions}) == len(completions)
    spanning = 0
    for c in completions:
        # no token lost: full budget, the old-version prefix kept with its own log-probs
        assert len(c.response_ids) == len(c.logprobs) == len(c.versions) == 200
        assert c.finish_reason == "length"
        switch = _check_switch(c, v0 + 1)
        spanning += 0 < switch < 200
    assert spanning >= 1
    assert gen.stats.call_one().get(timeout=CALL_S)["samples_resumed"] - resumed_before >= spanning
    restore(world, v0 + 2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drain", "block"])
def test_drain_and_block_updates_keep_each_completion_on_one_version(world, mode):
    # 10 groups of 2 > max_num_seqs 16: some groups run before the update, some after.
    gen = world["gen"]
    forced = forced_state_dict(world["model"])
    v0 = gen.version.call_one().get(timeout=CALL_S)
    groups = run_continuous(
        world, prompts(10, first_group=400), lambda: gen.load_weights.call_one(v0 + 1, forced, mode).get(timeout=CALL_S)
    )
    assert sorted(g[0].group_id for g in groups) == list(range(400, 410))
    seen = set()
    for g in groups:
        versions = {v for c in g for v in c.versions}
        assert len(versions) == 1, f"{mode}: group {g[0].group_id} mixes versions {versions}"
        (v,) = versions
        seen.add(v)
        for c in g:
            assert len(c.response_ids) == 200
            assert all(t == FORCED for t in c.response_ids) == (v == v0 + 1)
    assert seen == {v0, v0 + 1}
    restore(world, v0 + 2)


@pytest.mark.slow
def test_pause_holds_generation_until_resume(world):
    gen = world["gen"]
    world["source"].load.call_one(prompts(2, first_group=500)).get(timeout=CALL_S)
    before = gen.stats.call_one().get(timeout=CALL_S)["tokens_generated"]
    gen.start_generation.call_one(world["source"], world["sink"]).get(timeout=CALL_S)
    try:
        deadline = time.monotonic() + 60
        while gen.stats.call_one().get(timeout=CALL_S)["tokens_generated"] == before:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gen.pause_generation.call_one().get(timeout=CALL_S)
        held = gen.stats.call_one().get(timeout=CALL_S)["tokens_generated"]
        time.sleep(0.5)
        assert gen.stats.call_one().get(timeout=CALL_S)["tokens_generated"] == held
        assert world["sink"].take.call_one().get(timeout=CALL_S) == []
        gen.resume_generation.call_one().get(timeout=CALL_S)
        groups = []
        while len(groups) < 2:
            assert time.monotonic() < deadline
            groups += world["sink"].take.call_one().get(timeout=CALL_S)
            time.sleep(0.05)
        assert all(len(c.response_ids) == 200 for g in groups for c in g)
    finally:
        gen.stop_generation.call_one(10.0).get(timeout=CALL_S)


@pytest.mark.slow
def test_tensor_update_equals_fresh_engine_from_checkpoint(world):
    from meshrl.generator.actor import GeneratorActor

    gen = world["gen"]
    new_model = tiny_qwen3(1)
    new_ckpt = save_checkpoint(new_model, world["root"] / "ckpt_new")
    version = gen.version.call_one().get(timeout=CALL_S) + 1
    checksum_before = gen.weights_checksum.call_one().get(timeout=CALL_S)
    gen.load_weights.call_one(version, new_model.state_dict(), "block").get(timeout=CALL_S)
    assert gen.weights_checksum.call_one().get(timeout=CALL_S) != checksum_before
    ps = prompts(3, first_group=300)
    updated = gen.generate.call_one(ps, 0.0, 24).get(timeout=CALL_S)
    assert all(c.versions == [version] * len(c.response_ids) for c in updated)

    procs = this_host().spawn_procs(per_host={"procs": 1})
    fresh = None
    try:
        fresh = procs.spawn("fresh", GeneratorActor)
        fresh.setup.call_one(make_config().to_dict(), new_ckpt, version).get(timeout=300)
        reference = fresh.generate.call_one(ps, 0.0, 24).get(timeout=CALL_S)
        assert gen.weights_checksum.call_one().get(timeout=CALL_S) == pytest.approx(
            fresh.weights_checksum.call_one().get(timeout=CALL_S), rel=1e-6
        )
    finally:
        if fresh is not None:
            fresh.shutdown_engine.call_one().get(timeout=60)
        procs.stop().get(timeout=60)
    for a, b in zip(updated, reference):
        assert a.response_ids == b.response_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # and the new weights really are the checkpoint's: HF agrees on the greedy tokens
    ref = new_model.generate(torch.tensor([ps[0].prompt_ids]), do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert updated[0].response_ids == ref[0, len(ps[0].prompt_ids):].tolist()
    restore(world, version + 1)


@pytest.mark.slow
def test_compiled_engine_generates_the_loaded_weights(world):
    """generator.compile: vLLM's torch.compile'd model reads the weights a version loads in
    place (the compiled graph must not have captured the old parameters)."""
    from meshrl.generator.actor import GeneratorActor

    new_model = tiny_qwen3(2)
    ps = prompts(2, first_group=700)
    procs = this_host().spawn_procs(per_host={"procs": 1})
    gen = None
    try:
        gen = procs.spawn("compiled", GeneratorActor)
        gen.setup.call_one(make_config(compile=True).to_dict(), world["ckpt"], 0).get(timeout=300)
        before = gen.generate.call_one(ps, 0.0, 16).get(timeout=CALL_S)
        gen.load_weights.call_one(1, new_model.state_dict(), "block").get(timeout=CALL_S)
        after = gen.generate.call_one(ps, 0.0, 16).get(timeout=CALL_S)
    finally:
        if gen is not None:
            gen.shutdown_engine.call_one().get(timeout=60)
        procs.stop().get(timeout=60)
    for old, new in zip(before, after):
        for model, c in ((world["model"], old), (new_model, new)):
            ref = model.generate(torch.tensor([c.prompt_ids]), do_sample=False, max_new_tokens=16, eos_token_id=EOS, pad_token_id=0)
            assert c.response_ids == ref[0, len(c.prompt_ids):].tolist()
    assert all(c.versions == [1] * 16 for c in after)


class WeightsPublisher(Actor):
    """A stand-in trainer rank publishing full HF-named tensors over weight sync."""

    def __init__(self, weight_sync: dict):
        from meshrl.config import WeightSyncConfig
        from meshrl.weightsync import Publisher

        self.publisher = Publisher(WeightSyncConfig(**weight_sync))

    @endpoint
    def weight_sync_handle(self):
        return self.publisher.handle

    @endpoint
    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.publisher.publish(version, list(tensors.items()))


@pytest.mark.slow
def test_weight_sync_update_equals_loading_the_tensors(world):
    """sync_weights: the subscriber fetches into its shared buffer and vLLM loads from that
    buffer in place; the engine ends up exactly as when the same tensors are copied in."""
    from meshrl.weightsync import WeightSync
    from meshrl.config import WeightSyncConfig

    gen = world["gen"]
    weight_sync = {"transport": "rdma", "timeout_s": 60.0}
    publisher = world["helpers"].spawn("weights_publisher", WeightsPublisher, weight_sync)
    handles = [publisher.weight_sync_handle.call_one().get(timeout=CALL_S), gen.weight_sync_handle.call_one().get(timeout=CALL_S)]
    ws = asyncio.run(WeightSync(WeightSyncConfig(**weight_sync)).connect(handles[0], handles[1:]))
    new_model = tiny_qwen3(2)
    version = gen.version.call_one().get(timeout=CALL_S) + 1
    publisher.publish.call_one(version, new_model.state_dict()).get(timeout=CALL_S)
    out = gen.sync_weights.call_one(version).get(timeout=CALL_S)
    assert out["version"] == version
    synced = gen.weights_checksum.call_one().get(timeout=CALL_S)
    ps = prompts(2, first_group=400)
    tokens = [c.response_ids for c in gen.generate.call_one(ps, 0.0, 16).get(timeout=CALL_S)]
    gen.load_weights.call_one(version + 1, new_model.state_dict(), "block").get(timeout=CALL_S)
    assert gen.weights_checksum.call_one().get(timeout=CALL_S) == synced
    assert [c.response_ids for c in gen.generate.call_one(ps, 0.0, 16).get(timeout=CALL_S)] == tokens
    ws.close()
    restore(world, version + 2)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
