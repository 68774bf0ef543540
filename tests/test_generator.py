"""vLLM generator replicas on a real Monarch proc mesh, with real vLLM engines.

One generator actor (one engine) serves the whole module; a second one, started from a
checkpoint on disk, is the reference for tensor weight updates. Tests drive the replica as
rollout workers do: many concurrent `generate` calls, one sample each, and apply weight
updates while tokens flow. The actor is `tests.conftest.GeneratorTestActor`: the production
`GeneratorActor` plus the test-only `load_weights` (tensors in the message) and
`weights_checksum` endpoints.

The test model is a tiny random Qwen3 whose EOS token can never be sampled (see
`tiny_qwen3`), so long completions run to their token budget and a weight update reliably
lands inside them.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from monarch.actor import Actor, endpoint, this_host

from meshrl.config import Config
from meshrl.futures import awaited
from meshrl.generator.engine import RequestResult
from meshrl.rollout.env import StepResult
from meshrl.tokenizer import build_char_tokenizer

FORCED = 77  # the token id the "forced" weights make overwhelmingly likely
EOS = 2
CALL_S = 120.0
FLOWING = 400
"""Tokens generated before a test applies its update: the update lands mid-completion."""


def tiny_qwen3(seed: int):
    """A random Qwen3 of the default model's shapes (tests/conftest.py). Hidden dim 0 of every embedding is a positive
    constant and lm_head row EOS is strongly negative on it, so EOS is never sampled;
    lm_head is scaled up so the distribution is peaked (greedy has clear winners)."""
    from transformers import Qwen3ForCausalLM

    from tests.conftest import tiny_qwen3_config

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(EOS)).eval()
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
    gen = {"max_new_tokens": 200, "temperature": 0.7, "max_num_seqs": 16, "update_mode": "keep"}
    gen.update(generator)
    return Config.from_dict({"model": {"max_seq_len": 256, "dtype": "float32"}, "generator": gen, "seed": 0})


def spawn_generator(procs, name: str, config: Config, ckpt: str, version: int = 0):
    """A set-up generator replica (with the test endpoints) on `procs`; (actor, setup info)."""
    from tests.conftest import GeneratorTestActor

    gen = procs.spawn(name, GeneratorTestActor)
    info = gen.setup.call_one(config.to_dict(), ckpt, version).get(timeout=300)
    return gen, info


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("generator")
    model = tiny_qwen3(0)
    ckpt = save_checkpoint(model, root / "ckpt")
    procs = this_host().spawn_procs(per_host={"procs": 1})
    helpers = this_host().spawn_procs(per_host={"procs": 1})
    gen = None
    try:
        gen, info = spawn_generator(procs, "generator", make_config(), ckpt)
        assert info["version"] == 0
        yield {"root": root, "model": model, "ckpt": ckpt, "gen": gen, "procs": procs, "helpers": helpers, "setup": info}
    finally:
        if gen is not None:
            try:
                gen.shutdown_engine.call_one().get(timeout=60)
            except Exception:
                pass
        procs.stop().get(timeout=60)
        helpers.stop().get(timeout=60)


def prompts(n: int, seed: int = 0, length: int = 5) -> list[list[int]]:
    """`n` prompts of `length` token ids (BOS, then random ids), a pure function of `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 99, (length - 1,), generator=g).tolist() for _ in range(n)]


def hf_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token given everything before it."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response_ids)[:, None])[:, 0]


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n, eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


def generate_all(
    gen, requests: list[list[int]], max_new_tokens: int | None = None, temperature: float | None = None, min_version: int = 0
) -> list[RequestResult]:
    """One concurrent `generate` call per request (vLLM batches them); results in order."""

    async def main():
        calls = [awaited(gen.generate.call_one(ids, max_new_tokens, temperature, min_version)) for ids in requests]
        return await asyncio.wait_for(asyncio.gather(*calls), CALL_S)

    return asyncio.run(main())


class RequestDriver(Actor):
    """A stand-in rollout worker on a proc of its own: sends `generate` calls to a replica,
    at most `window` in flight (a new one as soon as one returns), and collects the results."""

    def __init__(self):
        self.task: asyncio.Task | None = None
        self.finished = 0

    @endpoint
    async def start(self, gen, requests: list[list[int]], window: int, max_new_tokens: int | None = None, temperature: float | None = None) -> None:
        if self.task is not None and not self.task.done():
            raise RuntimeError("already driving requests")
        self.finished = 0
        self.task = asyncio.create_task(self._drive(gen, requests, window, max_new_tokens, temperature))

    async def _drive(self, gen, requests, window, max_new_tokens, temperature) -> tuple[list[RequestResult], float]:
        slots = asyncio.Semaphore(window)

        async def one(ids):
            async with slots:
                out = await gen.generate.call_one(ids, max_new_tokens, temperature, 0)
                self.finished += 1
                return out

        t0 = time.monotonic()
        results = await asyncio.gather(*(one(ids) for ids in requests))
        return results, time.monotonic() - t0

    @endpoint
    async def finished_count(self) -> int:
        return self.finished

    @endpoint
    async def results(self, timeout: float = CALL_S) -> tuple[list[RequestResult], float]:
        """Every request's result, in order, and the seconds from the first call to the last answer."""
        return await asyncio.wait_for(asyncio.shield(self.task), timeout)


async def wait_for_tokens(gen, before: int, n: int, pending=()) -> None:
    """Until the replica has generated `n` tokens since `before` (none of `pending` done yet)."""
    deadline = time.monotonic() + 60
    while (await gen.stats.call_one())["tokens_generated"] - before < n:
        assert time.monotonic() < deadline, "no tokens generated"
        assert not any(c.done() for c in pending), "a request finished before tokens flowed"
        await asyncio.sleep(0.02)


def run_with_update(gen, requests: list[list[int]], update, late: list[list[int]] = (), driver=None):
    """Generate `requests` concurrently (from this process, or from `driver`'s proc); once
    tokens flow (FLOWING of them), send `update()` (an endpoint call, returning its Monarch
    future), then the `late` requests right after it. Returns (the update's result, the
    results of `requests`, the results of `late`)."""

    async def main():
        before = (await gen.stats.call_one())["tokens_generated"]
        calls = []
        if driver is not None:
            await driver.start.call_one(gen, requests, len(requests))
        else:
            calls = [asyncio.ensure_future(awaited(gen.generate.call_one(ids))) for ids in requests]
        await wait_for_tokens(gen, before, FLOWING, calls)
        if driver is not None:
            assert await driver.finished_count.call_one() == 0, "a request finished before the update"
        # Calls from one client to a replica's concurrent endpoints start in the order they
        # were sent: the update closes admission before the late requests start.
        updating = asyncio.ensure_future(awaited(update()))
        late_calls = [asyncio.ensure_future(awaited(gen.generate.call_one(ids))) for ids in late]
        out = await asyncio.wait_for(updating, CALL_S)
        if driver is not None:
            results, _ = await driver.results.call_one()
        else:
            results = await asyncio.wait_for(asyncio.gather(*calls), CALL_S)
        late_results = await asyncio.wait_for(asyncio.gather(*late_calls), CALL_S)
        return out, results, late_results

    return asyncio.run(main())


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


def test_deepseeks_float32_router_bias_reaches_a_bfloat16_engine_in_float32():
    """The trainer publishes the router bias in float32, and vLLM holds it in float32; the engine
    cast it to its bfloat16 on the way, and a load-balancing update of 1e-3 on a bias of 0.5 vanished."""
    from meshrl.generator.weight_loading import _cast, pack_to_shared_memory, views_of_shared_memory

    bias = torch.tensor([0.501, 1.003, 0.1234567])
    tensors = {"model.layers.3.mlp.gate.e_score_correction_bias": bias, "model.layers.3.mlp.gate.weight": torch.randn(3, 4)}
    shared = pack_to_shared_memory(tensors, torch.bfloat16)
    try:
        views = views_of_shared_memory(shared.path, shared.nbytes, shared.manifest)
        for loaded in (views, _cast(tensors, "bfloat16")):
            assert torch.equal(loaded["model.layers.3.mlp.gate.e_score_correction_bias"], bias)
            assert loaded["model.layers.3.mlp.gate.weight"].dtype == torch.bfloat16
    finally:
        shared.unlink()


def test_weight_sync_buffers_go_to_the_engine_in_place():
    """Tensors fetched by weight sync (views of a shared receive buffer) are described to the
    engine where they are; only tensors that need a cast (or live elsewhere) are copied."""
    from meshrl.generator.weight_loading import to_shared_memory, views_of_shared_memory
    from tests.conftest import fetched_into_shared_buffer

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


# ---- the service's version gate, on a stand-in engine (no vLLM) ---------------------------------
class FakeEngine:
    """The VLLMEngine surface the service uses: every request yields its whole budget of
    token 5, stamped with the engine's version, one event-loop turn later."""

    def __init__(self, gen, checkpoint_dir, **_):
        self.version = 0
        self.tokens_generated = 0
        self.tokens_scored = 0
        self.adapter_config = None  # no LoRA adapter: updates load full weights

    async def start(self, version: int = 0) -> float:
        self.version = version
        return 0.0

    def shutdown(self) -> None:
        pass

    async def run_request(self, request_id, token_ids, max_tokens, temperature=None) -> RequestResult:
        await asyncio.sleep(0)
        self.tokens_generated += max_tokens
        return RequestResult([5] * max_tokens, [-1.0] * max_tokens, [self.version] * max_tokens, "length")

    running = True
    """False while paused or asleep: the scheduler runs nothing."""

    async def pause(self, mode: str) -> None:
        self.running = False

    async def resume(self) -> None:
        self.running = True

    weights = True
    """False while asleep without its weights (VLLMEngine.sleep(keep_weights=False))."""

    sleep_mode = True
    """As on a GPU: a sleep without `keep_weights` drops them (False: as on CPU, it pauses)."""

    async def sleep(self, keep_weights: bool = True) -> bool:
        self.running, self.weights = False, keep_weights or not self.sleep_mode
        return not self.weights

    async def wake_weights(self) -> None:
        self.weights = True

    async def wake_up(self, resume: bool = True) -> None:
        self.running, self.weights = resume, True

    async def load_tensors(self, tensors, timeout_s: float = 120.0) -> int:
        assert self.weights, "a load into weights the engine dropped"
        return len(tensors)

    async def set_version(self, version: int) -> None:
        self.version = version


def test_a_teachers_score_many_is_aborted_by_its_id_and_a_stopping_one_fails_whole(monkeypatch):
    """score_many, as generate_many: abort_many stops a call whose caller gave up on it (its
    sequences answer as aborted); a replica that is stopping fails the whole call, the
    teacher's failure, not each sequence's (that would count against the group)."""
    import meshrl.generator.service as service

    class Slow(FakeEngine):
        aborted = None

        async def score(self, request_id, token_ids):
            await Slow.aborted.wait()
            raise RuntimeError("no log-probs (aborted?)")

    monkeypatch.setattr(service, "VLLMEngine", Slow)

    async def main():
        Slow.aborted = asyncio.Event()
        gen = service.Generator(Config.from_dict({}), "unused", teacher=True)
        await gen.start(0)
        call = asyncio.ensure_future(gen.score_many([[1, 2], [3]], call_id="w.t0"))
        await asyncio.sleep(0.05)
        assert gen.abort_many("w.t0")
        aborted = await asyncio.wait_for(call, 5)
        assert not gen.abort_many("w.t0")  # ended: nothing to stop
        during = asyncio.ensure_future(gen.score_many([[1, 2]]))  # in flight when the replica stops
        await asyncio.sleep(0.05)
        gen._stopping = True
        Slow.aborted.set()  # (the stop's abort)
        for call in (during, gen.score_many([[1, 2]])):  # ... and one that arrives after
            with pytest.raises(service.ReplicaStopping):
                await asyncio.wait_for(call, 5)
        return aborted

    assert asyncio.run(main()) == ["aborted: its caller gave up on it"] * 2


def test_a_distillation_teacher_captures_no_routes(monkeypatch):
    """A teacher took the policy's generator.return_routed_experts: a dense teacher's engine
    refused to start (no MoE router to capture), a MoE one captured routes nobody replays."""
    import meshrl.generator.service as service

    seen = []
    monkeypatch.setattr(service, "VLLMEngine", lambda gen, checkpoint_dir, **_: seen.append(gen.return_routed_experts) or FakeEngine(gen, checkpoint_dir))
    config = Config.from_dict({"generator": {"return_routed_experts": True}})
    service.Generator(config, "unused")
    service.Generator(config, "unused", teacher=True)
    assert seen == [True, False]


def test_vllms_error_finish_fails_the_sample_and_its_repetition_cut_is_a_length_finish(monkeypatch):
    """vLLM 0.32 ends a request with `error` (a retryable request-level failure: a KV load) or
    `repetition` (its guard against a repeating reply) too. `error` came back as a turn of
    none or some tokens the env scored and `pack` then refused (KeyError 'error'), failing its
    group as the group's own fault; it fails the sample (its group is played again), and a
    repetition cut is a `length` finish: a reply the model did not end."""
    import meshrl.generator.service as service

    class Ending(FakeEngine):
        reason = "error"

        async def run_request(self, request_id, token_ids, max_tokens, temperature=None) -> RequestResult:
            await asyncio.sleep(0)
            return RequestResult([5], [-1.0], [self.version], Ending.reason)

    monkeypatch.setattr(service, "VLLMEngine", Ending)

    async def main():
        gen = service.Generator(Config.from_dict({"generator": {"max_new_tokens": 4}}), "unused")
        await gen.start(0)
        failed = (await gen.generate_many([([1, 7],)]))[0]
        Ending.reason = "repetition"
        return failed, await gen.generate([1, 7])

    failed, cut = asyncio.run(main())
    assert isinstance(failed, str) and "finish_reason 'error'" in failed and cut.finish_reason == "length"


def test_min_version_waits_for_the_version_and_times_out_naming_it(monkeypatch):
    import meshrl.generator.service as service

    monkeypatch.setattr(service, "VLLMEngine", FakeEngine)
    monkeypatch.setattr(service, "UPDATE_SLACK_S", 0.0)
    config = Config.from_dict({"generator": {"max_new_tokens": 4}, "weight_sync": {"timeout_s": 0.5}})

    async def main():
        gen = service.Generator(config, "unused", replica=3)
        await gen.start(2)
        # already there: no wait
        assert (await gen.generate([1, 7], min_version=2)).versions == [2] * 4
        # waits until an update brings the replica to the version, then runs on it
        waiting = asyncio.ensure_future(gen.generate([1, 7], min_version=3))
        await asyncio.sleep(0.2)
        assert not waiting.done() and gen.stats()["requests_in_flight"] == 0
        await gen.update_weights(3, {}, "keep")
        out = await asyncio.wait_for(waiting, 5)
        assert out.versions == [3] * 4 and out.finish_reason == "length"
        # never reached: a clean TimeoutError naming both versions, after an update's bound
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"replica 3 is at version 3, not 5"):
            await gen.generate([1, 7], min_version=5)
        assert service.update_bound_s(config) - 0.05 < time.monotonic() - t0 < 5
        # the replica is not wedged by the timed-out wait
        assert (await gen.generate([1, 7])).versions == [3] * 4
        # stopping releases a request waiting for a version: it ends as aborted, no tokens
        waiting = asyncio.ensure_future(gen.generate([1, 7], min_version=9))
        await asyncio.sleep(0.05)
        await gen.stop(5.0)
        out = await asyncio.wait_for(waiting, 5)
        assert out.finish_reason == "abort" and out.token_ids == []

    asyncio.run(main())


def test_a_replica_that_generates_nothing_with_requests_in_flight_counts_as_stalled(monkeypatch):
    """`stalled_s` (the health check's reading of a wedged engine): the time with requests in
    flight, generating, and no token; never while paused, and restarted by any progress."""
    import meshrl.generator.service as service

    class Wedged(FakeEngine):
        async def run_request(self, request_id, token_ids, max_tokens, temperature=None) -> RequestResult:
            await asyncio.Event().wait()  # alive, never answering: a hung engine core

    monkeypatch.setattr(service, "VLLMEngine", Wedged)

    async def main():
        gen = service.Generator(Config.from_dict({"weight_sync": {"timeout_s": 0.5}}), "unused")
        await gen.start(0)
        assert gen.stalled_s(time.monotonic() + 100) == 0.0  # nothing in flight: idle, not stalled
        t0 = time.monotonic()
        waiting = asyncio.ensure_future(gen.generate([1, 7]))
        await asyncio.sleep(0.05)
        now = time.monotonic()
        assert 100 <= gen.stalled_s(now + 100) <= now + 100 - t0 and gen.stats()["requests_in_flight"] == 1
        await gen.pause()  # held by the user (or an update): frozen, not wedged, and the clock stops
        assert gen.stalled_s(now + 500) == 0.0
        await asyncio.sleep(1.0)
        await gen.resume()
        resumed = time.monotonic()
        assert 10 <= gen.stalled_s(resumed + 10) < resumed + 10 - t0 - 0.9  # the second paused does not count
        gen.engine.tokens_generated += 1  # a token: the clock restarts from this reading
        assert gen.stalled_s(resumed + 200) == 0.0 and gen.stalled_s(resumed + 250) == pytest.approx(50.0)
        # an update that drains (update_mode block) waits on requests the engine still generates: the clock runs
        draining = asyncio.ensure_future(gen.update_weights(1, {}, "block"))
        await asyncio.sleep(0.05)
        assert gen.stalled_s(resumed + 600) == pytest.approx(400.0, abs=1)  # from the token read at resumed + 200
        await asyncio.wait_for(draining, 5)  # half of weight_sync.timeout_s on, the request is frozen and the update applied
        assert gen.stats()["drains_cut"] == 1 and gen.version == 1
        waiting.cancel()

    asyncio.run(main())


def test_the_health_check_replaces_a_wedged_replica_and_leaves_a_busy_one():
    """GeneratorPool.check on replicas that answer `stats`: one stalled past
    generator.stall_timeout_s is replaced as wedged (killed before its stop); one under it,
    one on this host too busy to answer (an update it applies), or any with the bound at 0,
    is left."""
    from tests.conftest import FakeReplica, fake_pool

    async def main(bound):
        config = Config.from_dict({"generator": {"stall_timeout_s": bound, "replicas": 3}})
        old = [FakeReplica(0, stalled_s=400.0), FakeReplica(1, stalled_s=10.0), FakeReplica(2, stalled_s=None)]
        pool = fake_pool(config, old)
        await pool.check(7)
        return old, pool

    (wedged, slow, busy), pool = asyncio.run(main(300.0))
    assert wedged.killed and wedged.stopped and pool.replicas[0] is not wedged and pool.replicas[0].synced == [7]
    assert pool.replicas[1:] == [slow, busy] and not (slow.killed or busy.killed) and pool.replaced == 1
    _, pool = asyncio.run(main(0.0))  # off
    assert pool.replaced == 0


def test_a_replica_update_is_waited_for_as_long_as_its_parts_may_take(monkeypatch):
    """GeneratorPool.update gives a replica the sum of its update's bounds (the fetch and the
    load at weight_sync.timeout_s each, the drain between them at half of it): one slower than
    timeout_s but within that sum is kept, where it had been replaced as dead while it still
    applied a version (and its replacement would fare no better); one past the sum is replaced."""
    import meshrl.generator.service as service
    from tests.conftest import FakeReplica, fake_pool

    monkeypatch.setattr(service, "UPDATE_SLACK_S", 0.0)
    config = Config.from_dict({"generator": {"replicas": 2}, "weight_sync": {"timeout_s": 0.4}})
    assert service.update_bound_s(config) == pytest.approx(1.0)

    async def main():
        old = [FakeReplica(0, sync_s=0.7), FakeReplica(1, sync_s=30.0)]
        pool = fake_pool(config, old)
        await pool.update(3)
        return old, pool

    (slow, wedged), pool = asyncio.run(main())
    assert pool.replicas[0] is slow and slow.synced == [3] and not slow.killed
    assert pool.replicas[1] is not wedged and wedged.killed and pool.replicas[1].synced == [3] and pool.replaced == 1


def test_a_replica_started_while_the_session_is_paused_is_paused_too():
    """Session.pause(), then a dead replica replaced by the health check and one added by a
    rescale: each is paused after its first load, where it generated for the workers while the
    pool (and `generate()`) stayed paused."""
    from types import SimpleNamespace

    from tests.conftest import FakeReplica, fake_pool

    config = Config.from_dict({"generator": {"replicas": 2}})

    async def main():
        dead = FakeReplica(0)
        dead.stopped = True
        pool = fake_pool(config, [dead])
        pool.paused = True
        await pool.check(4)
        await pool.scale(2, 4)
        # resumed while a replacement's first load ran (the resume reached it before its pause): resumed again
        fresh = FakeReplica(1)
        pause = fresh.actor.pause_generation.call_one

        async def paused_then_resumed():
            await pause()
            pool.paused = False

        fresh.actor.pause_generation = SimpleNamespace(call_one=paused_then_resumed)
        pool.spawn = lambda index: asyncio.sleep(0, fresh)
        pool.replicas[1].stopped = True
        await pool.check(4)
        return pool

    pool = asyncio.run(main())
    assert pool.replicas[0].calls == [("sync_weights", 4), ("pause_generation",)]
    assert pool.replicas[1].calls == [("sync_weights", 4), ("pause_generation",), ("resume_generation",)]


def test_a_new_replica_whose_first_load_fails_leaves_the_pool_for_the_next_check_to_replace():
    """A replacement whose first version fails to load stays paused (Generator.update_weights):
    it leaves the pool, stopped, and the next health check starts another, where it had stayed
    in the pool paused and answering, never judged wedged, and a one-replica run starved."""
    from tests.conftest import FakeReplica, fake_pool

    config = Config.from_dict({"generator": {"replicas": 1}})
    spawned = []

    async def main():
        dead = FakeReplica(0)
        dead.stopped = True  # its proc gone

        async def spawn(index):
            spawned.append(FakeReplica(index, broken=not spawned))  # the first replacement's load fails
            return spawned[-1]

        pool = fake_pool(config, [dead], spawn)
        with pytest.raises(RuntimeError, match="the transfer broke"):
            await pool.check(7)
        assert pool.replicas == [] and spawned[0].stopped and spawned[0].killed
        await pool.check(7)  # the next check: one missing, started and loaded
        return pool

    pool = asyncio.run(main())
    assert pool.replicas == [spawned[1]] and spawned[1].synced == [7]


def test_a_pause_outlasts_sleep_and_wake_until_resume(monkeypatch):
    """placement=colocate sleeps and wakes the engine around every training step: a user's
    `pause` made before or during a sleep holds until the user's `resume`, not the next wake."""
    import meshrl.generator.service as service

    monkeypatch.setattr(service, "VLLMEngine", FakeEngine)
    config = Config.from_dict({"generator": {"max_new_tokens": 2}})

    async def held(gen) -> asyncio.Future:
        waiting = asyncio.ensure_future(gen.generate([1, 7]))
        await asyncio.sleep(0.1)
        assert not waiting.done() and not gen.engine.running
        return waiting

    async def main():
        gen = service.Generator(config, "unused")
        await gen.start(0)
        for order in ("pause first", "sleep first"):
            if order == "pause first":
                await gen.pause()
                await gen.sleep()
            else:
                await gen.sleep()
                await gen.pause()
            await gen.wake()
            waiting = await held(gen)
            await gen.update_weights(1, {}, "keep")  # an update while paused keeps it paused
            assert not gen.engine.running and not waiting.done()
            await gen.resume()
            assert (await asyncio.wait_for(waiting, 5)).finish_reason == "length" and gen.engine.running
        # a resume while asleep leaves the engine asleep until the wake
        await gen.sleep()
        await gen.pause()
        await gen.resume()
        waiting = await held(gen)
        await gen.wake()
        assert (await asyncio.wait_for(waiting, 5)).finish_reason == "length"
        # synchronous colocation: a version loaded while asleep (weights dropped) leaves the
        # engine asleep, and the request waiting meanwhile runs on that version after the wake
        await gen.sleep(keep_weights=False)
        waiting = await held(gen)
        await gen.update_weights(2, {}, "keep")
        assert not gen.engine.running and not waiting.done()
        await gen.wake()
        assert (await asyncio.wait_for(waiting, 5)).versions == [2, 2]
        assert gen.stats()["sleeps"] == 4
        # weights dropped and no load before the wake (the update was cut off: its trainer died): the
        # engine stays paused and nothing generates from the freed memory until a version is loaded
        await gen.sleep(keep_weights=False)
        await gen.wake()
        waiting = await held(gen)
        await gen.pause()  # a user's pause and resume do not release it either
        await gen.resume()
        await asyncio.sleep(0.1)
        assert not waiting.done() and not gen.engine.running

        async def cut_off(tensors, timeout_s=120.0):
            raise TimeoutError("the trainer's slot is gone")

        gen.engine.load_tensors = cut_off  # nor does a load that fails
        with pytest.raises(TimeoutError):
            await gen.update_weights(3, {}, "keep")
        await asyncio.sleep(0.1)
        assert not waiting.done() and not gen.engine.running
        del gen.engine.load_tensors
        await gen.update_weights(3, {}, "keep")
        assert (await asyncio.wait_for(waiting, 5)).versions == [3, 3] and gen.engine.running

    asyncio.run(main())


def test_a_version_with_the_weights_held_is_relabelled_not_loaded(monkeypatch):
    """A trainer's step off its trainer.pace makes a version with the weights of the one before
    (TrainerActor.weights_id keeps their name): an engine that loaded them runs on under the new
    version, nothing loaded; one that holds other weights, dropped them asleep, or is past the
    version loads as before."""
    import meshrl.generator.service as service

    monkeypatch.setattr(service, "VLLMEngine", FakeEngine)
    config = Config.from_dict({"generator": {"max_new_tokens": 2}})

    async def main():
        gen = service.Generator(config, "unused")
        await gen.start(0)
        assert not await gen.relabel(1, "a")  # the start's weights have no name
        await gen.update_weights(1, {}, "keep", weights_id="a")
        assert await gen.relabel(2, "a") and gen.version == 2
        assert (await gen.generate([1, 7])).versions == [2, 2]
        assert not await gen.relabel(3, "b") and gen.version == 2  # other weights
        assert not await gen.relabel(1, "a")  # never back
        await gen.sleep(keep_weights=True)
        assert await gen.relabel(3, "a")  # asleep with its weights (CPU, or level 1)
        await gen.wake()
        await gen.sleep(keep_weights=False)
        assert not await gen.relabel(4, "a")  # dropped: the version must be loaded
        await gen.update_weights(4, {}, "keep", weights_id="a")
        await gen.wake()
        assert await gen.relabel(5, "a") and gen.version == 5
        await gen.update_weights(6, {}, "keep")  # a load whose weights are not named
        assert not await gen.relabel(7, "a")
        stats = gen.stats()
        assert stats["relabels"] == 3 and [u["version"] for u in stats["updates"]] == [1, 4, 6], stats
        gen.engine.sleep_mode = False  # on CPU a sleep pauses, whatever it is asked to keep
        await gen.update_weights(7, {}, "keep", weights_id="b")
        await gen.sleep(keep_weights=False)
        assert await gen.relabel(8, "b")

    asyncio.run(main())


def test_a_load_that_fails_leaves_nothing_generating_under_the_old_label_until_a_load_succeeds(monkeypatch):
    """A load that times out (the engine may go on loading) or fails part-way may have left some
    layers new: the replica generates nothing under the old version's label, where it had resumed
    on those weights, until a load succeeds."""
    import meshrl.generator.service as service

    class Failing(FakeEngine):
        fail = 1

        async def load_tensors(self, tensors, timeout_s: float = 120.0) -> int:
            if self.fail:
                self.fail -= 1
                raise TimeoutError("the engine's load took over 120s")
            return await super().load_tensors(tensors, timeout_s)

    monkeypatch.setattr(service, "VLLMEngine", Failing)
    config = Config.from_dict({"generator": {"max_new_tokens": 2}})

    async def main():
        gen = service.Generator(config, "unused")
        await gen.start(0)
        with pytest.raises(TimeoutError):
            await gen.update_weights(1, {}, "keep", weights_id="a")
        assert not gen.engine.running and gen.version == 0
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(gen.generate([1, 7]), 0.3)
        assert not await gen.relabel(1, "a")
        await gen.update_weights(1, {}, "keep", weights_id="a")
        assert gen.engine.running and (await gen.generate([1, 7])).versions == [1, 1]

    asyncio.run(main())


def test_stats_report_the_newest_updates_not_every_one(monkeypatch):
    """`stats`, asked for every few seconds by the health check, sent every update of the run:
    a list that grew by one entry per step for as long as the run went on."""
    import meshrl.generator.service as service

    monkeypatch.setattr(service, "VLLMEngine", FakeEngine)

    async def main():
        gen = service.Generator(Config.from_dict({"generator": {"max_new_tokens": 2}}), "unused")
        await gen.start(0)
        for v in range(1, service.UPDATES_KEPT + 11):
            await gen.update_weights(v, {}, "keep", weights_id=str(v))
        return gen.stats()

    stats = asyncio.run(main())
    assert [u["version"] for u in stats["updates"]] == list(range(11, service.UPDATES_KEPT + 11))


def test_a_drain_update_freezes_requests_longer_than_half_its_bound_instead_of_failing(monkeypatch):
    """update_mode drain with a request that outlasts it: after half of weight_sync.timeout_s the
    request is kept across the swap (its tokens carry each version), the update is applied and
    counted in `drains_cut`, where the drain had run past the controller's bound and the live
    replica was replaced as dead."""
    import meshrl.generator.service as service

    release = asyncio.Event()

    class Long(FakeEngine):
        async def run_request(self, request_id, token_ids, max_tokens, temperature=None) -> RequestResult:
            await release.wait()
            return await super().run_request(request_id, token_ids, max_tokens, temperature)

    monkeypatch.setattr(service, "VLLMEngine", Long)
    config = Config.from_dict({"generator": {"max_new_tokens": 2}, "weight_sync": {"timeout_s": 0.4}})

    async def main():
        gen = service.Generator(config, "unused")
        await gen.start(0)
        long = asyncio.ensure_future(gen.generate([1, 7]))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(gen.update_weights(1, {}, "drain"), 5)
        assert gen.version == 1 and gen.stats()["drains_cut"] == 1 and not long.done()
        release.set()
        assert (await long).versions == [1, 1]  # (the fake engine stamps its version as it ends)

    asyncio.run(main())


def test_a_call_its_caller_gave_up_on_is_aborted_on_the_replica_and_frees_its_requests(monkeypatch):
    """A rollout worker's generate_many whose episodes all failed (their group cancelled):
    TurnBatcher asks the replica to abort it by its id, and the replica's requests end (vLLM
    aborts a cancelled request), where they decoded to their budgets for nobody, holding slots
    and KV cache. A call of the same name that ended is not touched; the other calls go on."""
    from types import SimpleNamespace

    import meshrl.generator.service as service
    from meshrl.agent.turns import TurnBatcher

    ended = []

    class Long(FakeEngine):
        async def run_request(self, request_id, token_ids, max_tokens, temperature=None) -> RequestResult:
            try:
                if token_ids[0] == 9:
                    await asyncio.sleep(3600)
                return await super().run_request(request_id, token_ids, max_tokens, temperature)
            except asyncio.CancelledError:
                ended.append(request_id)
                raise

    monkeypatch.setattr(service, "VLLMEngine", Long)
    config = Config.from_dict({"generator": {"max_new_tokens": 2}})

    class Replica:  # the actor's two endpoints, on the service
        def __init__(self, gen):
            self.generate_many = SimpleNamespace(call_one=lambda requests, call_id=None: gen.generate_many(requests, call_id))

            async def abort(call_id):
                aborted.append(call_id)
                return gen.abort_many(call_id)

            self.abort_many = SimpleNamespace(call_one=abort)

    aborted = []

    async def main():
        gen = service.Generator(config, "unused")
        await gen.start(0)
        batcher = TurnBatcher(config)
        batcher.set_generators([Replica(gen)])
        quick = await batcher.generate(0, [1, 7], 2, 0)  # a call that ended: its id is gone from the replica
        turns = [asyncio.ensure_future(batcher.generate(0, [9, i], 2, 0)) for i in range(3)]
        await asyncio.sleep(0.1)
        assert gen.stats()["requests_in_flight"] == 3
        for t in turns:  # their group failed: every episode waiting on the call is cancelled
            t.cancel()
        for _ in range(100):
            if gen.stats()["requests_in_flight"] == 0:
                break
            await asyncio.sleep(0.02)
        assert gen.stats()["requests_in_flight"] == 0 and len(ended) == 3
        assert len(aborted) == 1 and not gen._calls and not gen.abort_many(aborted[0])
        # cancelled on its own (the replica stopping), the call is cancelled, not answered as aborted
        own = asyncio.ensure_future(gen.generate_many([([9, 1], 2, None, 0)], "own"))
        await asyncio.sleep(0.05)
        own.cancel()
        with pytest.raises(asyncio.CancelledError):
            await own
        return quick

    assert asyncio.run(main()).token_ids == [5, 5]


def test_a_loaded_version_takes_its_weights_name_only_when_surely_its_bytes(monkeypatch):
    """GeneratorActor._sync names the weights it loads only when they are the version asked
    for, just transferred: not a newer version, not the subscriber's held tensors (after a
    heal those can be a dead trainer's), not a file (a dead trainer's or an earlier run's may
    be left in the directory). Unnamed weights are loaded again at the next version."""
    from types import SimpleNamespace

    import meshrl.generator.service as service
    from meshrl.generator.actor import GeneratorActor

    monkeypatch.setattr(service, "VLLMEngine", FakeEngine)

    class Subscriber:  # Subscriber.fetch's contract: version or newer; held tensors without a transfer
        spec, version, newest = SimpleNamespace(transport="shm"), -1, 0

        async def fetch(self, version: int):
            self.version = self.version if version <= self.version else max(version, self.newest)
            return self.version, {}

        async def loaded(self) -> None:
            pass

    async def main():
        actor = object.__new__(GeneratorActor)
        actor.generator = service.Generator(Config.from_dict({"generator": {"max_new_tokens": 2}}), "unused")
        await actor.generator.start(0)
        actor.subscriber, named = Subscriber(), []
        for transport, newest, version in (("shm", 5, 4), ("shm", 5, 5), ("shm", 6, 6), ("files", 7, 7), ("collective", 8, 8)):
            actor.subscriber.spec.transport, actor.subscriber.newest = transport, newest
            await actor._sync(version, 0.0, f"w{version}")
            named.append((actor.generator.version, actor.generator.weights_id))
        # 4 asked, 5 came; 5 held already; 6 transferred; 7 from a file; 8 received in the engine
        assert named == [(5, None), (5, None), (6, "w6"), (7, None), (8, "w8")], named

    asyncio.run(main())


def test_a_replicas_weight_updates_fetch_load_and_release_one_at_a_time(monkeypatch):
    """A retry after a reconnect and the heal's own update could run on one replica at once: the
    second fetch released the first's shm lease (or handed its receive buffer back) while the
    first still loaded from it. Each fetch, load and release runs whole before the next."""
    from types import SimpleNamespace

    import meshrl.generator.service as service
    from meshrl.generator.actor import GeneratorActor

    monkeypatch.setattr(service, "VLLMEngine", FakeEngine)
    events = []

    class Subscriber:
        spec, version = SimpleNamespace(transport="shm"), -1

        async def fetch(self, version: int):
            events.append(("fetch", version))
            await asyncio.sleep(0.05)
            self.version = max(self.version, version)
            return self.version, {}

        async def loaded(self) -> None:
            await asyncio.sleep(0.05)
            events.append(("loaded", self.version))

    async def main():
        actor = object.__new__(GeneratorActor)
        actor.generator = service.Generator(Config.from_dict({"generator": {"max_new_tokens": 2}}), "unused")
        await actor.generator.start(0)
        actor.subscriber = Subscriber()
        await asyncio.gather(actor._sync(3, 0.0, None), actor._sync(3, 0.0, None))
        return actor.generator.version

    assert asyncio.run(main()) == 3
    assert [kind for kind, _ in events] == ["fetch", "loaded", "fetch", "loaded"], events


# ---- a real engine on a proc mesh -----------------------------------------------------------------
@pytest.mark.slow
def test_cpu_engine_runs_the_model_in_its_engine_core_process(world):
    """One CPU worker runs inside vLLM's engine-core process (compat.vllm_cpu_single_worker_executor):
    a separate worker process costs every decode step a hand-off on a shared core."""
    import psutil

    names = [psutil.Process(pid).name() for pid, _ in world["setup"]["processes"]["pids"] if psutil.pid_exists(pid)]
    assert any("EngineCor" in n for n in names), names  # the kernel's name keeps 15 characters
    assert not any("Worker" in n for n in names), names


@pytest.mark.slow
def test_cpu_sampler_counts_token_ranks_without_compiling(monkeypatch):
    """compat.vllm_cpu_eager_token_ranks: the sampler's log-prob gather (every request of a
    meshrl engine asks for log-probs) compiles nothing and counts the ranks vLLM's does."""
    import torch._dynamo.utils as dynamo_utils
    import vllm.v1.sample.sampler as sampler

    from meshrl.compat import vllm_cpu_eager_token_ranks

    monkeypatch.setattr(sampler, "batched_count_greater_than", sampler.batched_count_greater_than)  # put back after
    g = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(70, 97, generator=g), -1)  # rows in blocks of 32: three blocks
    token_ids = torch.randint(0, 97, (70,), generator=g)
    vllm_cpu_eager_token_ranks()
    frames = dynamo_utils.counters["frames"]["total"]
    got = sampler.Sampler.gather_logprobs(logprobs, 2, token_ids)
    assert dynamo_utils.counters["frames"]["total"] == frames  # no frame compiled
    chosen = logprobs.gather(-1, token_ids[:, None])
    assert got.selected_token_ranks.tolist() == (logprobs >= chosen).sum(-1).tolist()
    assert got.logprobs[:, 0].tolist() == chosen[:, 0].tolist()


@pytest.mark.slow
def test_greedy_matches_transformers(world):
    model, gen = world["model"], world["gen"]
    v = gen.version.call_one().get(timeout=CALL_S)
    ps = prompts(3, seed=10)
    requests = [p for p in ps for _ in range(2)]  # two samples of each prompt, as a group
    results = generate_all(gen, requests, 24, 0.0)
    assert len(results) == 3 * 2
    for ids, r in zip(requests, results):
        assert r.token_ids == hf_greedy(model, ids, 24)
        assert r.finish_reason == "length" and r.versions == [v] * 24
        assert len(r.logprobs) == 24


@pytest.mark.slow
def test_sampler_logprobs_match_recomputation(world):
    # processed_logprobs: the returned log-prob is under the temperature-scaled distribution.
    model, gen = world["model"], world["gen"]
    requests = [p for p in prompts(4, seed=20) for _ in range(2)]
    results = generate_all(gen, requests, 24)  # T = 0.7
    worst, worst_raw = 0.0, float("inf")
    for ids, r in zip(requests, results):
        ref = hf_logprobs(model, ids, r.token_ids, 0.7)
        raw = hf_logprobs(model, ids, r.token_ids, 1.0)
        got = torch.tensor(r.logprobs, dtype=torch.float64)
        worst = max(worst, (got - ref).abs().max().item())
        worst_raw = min(worst_raw, (got - raw).abs().max().item())
    assert worst < 2e-3, f"sampler log-probs differ from log_softmax(logits/T) by {worst}"  # float32 kernels
    assert worst_raw > 1e-2, "log-probs look like T=1 (raw) log-probs, not the sampling distribution"


def _check_switch(r: RequestResult, new_version: int) -> int:
    """Versions are old...old new...new, every new token is FORCED with log-prob ~0 and no
    old token looks forced. Returns the switch index."""
    switch = next((i for i, v in enumerate(r.versions) if v == new_version), len(r.versions))
    assert all(v < new_version for v in r.versions[:switch]) and all(v == new_version for v in r.versions[switch:])
    assert all(t == FORCED for t in r.token_ids[switch:]), (switch, r.token_ids)
    assert all(lp > -1e-3 for lp in r.logprobs[switch:])
    assert all(lp < -0.05 for lp in r.logprobs[:switch]), "an old-version token came from the new weights"
    return switch


@pytest.mark.slow
def test_keep_update_switches_version_at_the_right_token(world):
    gen = world["gen"]
    forced = forced_state_dict(world["model"])
    v0 = gen.version.call_one().get(timeout=CALL_S)
    requests = [p for p in prompts(6, seed=100) for _ in range(2)]
    driver = world["helpers"].spawn("keep_driver", RequestDriver)  # as a rollout worker would, from its own proc
    held, results, _ = run_with_update(gen, requests, lambda: gen.load_weights.call_one(v0 + 1, forced, "keep"), driver=driver)
    assert len(results) == len(requests), "every request answered exactly once"
    spanning = 0
    for r in results:
        assert len(r.token_ids) == 200 and r.finish_reason == "length"
        switch = _check_switch(r, v0 + 1)
        spanning += 0 < switch < 200
    assert spanning >= 1, "the update should land inside some completions"
    assert held < 5.0
    restore(world, v0 + 2)


@pytest.mark.slow
def test_abort_update_resumes_prefixes_without_loss_or_duplicates(world):
    model, gen = world["model"], world["gen"]
    forced = forced_state_dict(model)
    v0 = gen.version.call_one().get(timeout=CALL_S)
    resumed_before = gen.stats.call_one().get(timeout=CALL_S)["samples_resumed"]
    requests = [p for p in prompts(6, seed=200) for _ in range(2)]
    _, results, _ = run_with_update(gen, requests, lambda: gen.load_weights.call_one(v0 + 1, forced, "abort"))
    assert len(results) == len(requests), "every request answered exactly once"
    spanning = 0
    for ids, r in zip(requests, results):
        # no token lost: full budget, the old-version prefix kept with its own log-probs
        assert len(r.token_ids) == len(r.logprobs) == len(r.versions) == 200
        assert r.finish_reason == "length"
        switch = _check_switch(r, v0 + 1)
        spanning += 0 < switch < 200
        # ...and no token lost or repeated at the seam: each prefix token's log-prob is the
        # old model's given exactly the tokens before it
        if switch:
            ref = hf_logprobs(model, ids, r.token_ids[:switch], 0.7)
            assert (torch.tensor(r.logprobs[:switch], dtype=torch.float64) - ref).abs().max().item() < 2e-3
    assert spanning >= 1
    assert gen.stats.call_one().get(timeout=CALL_S)["samples_resumed"] - resumed_before >= spanning
    restore(world, v0 + 2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drain", "block"])
def test_drain_and_block_updates_keep_each_request_on_one_version(world, mode):
    # 20 requests > max_num_seqs 16: vLLM queues some behind the others. Every request sent
    # before the update finishes on the old version; those sent after it wait and run on the new.
    gen = world["gen"]
    forced = forced_state_dict(world["model"])
    v0 = gen.version.call_one().get(timeout=CALL_S)
    requests = [p for p in prompts(10, seed=400) for _ in range(2)]
    late = [p for p in prompts(3, seed=450) for _ in range(2)]
    _, results, late_results = run_with_update(gen, requests, lambda: gen.load_weights.call_one(v0 + 1, forced, mode), late)
    seen = set()
    for i, r in enumerate(results + late_results):
        versions = set(r.versions)
        assert len(versions) == 1, f"{mode}: request {i} mixes versions {versions}"
        (v,) = versions
        seen.add(v)
        assert len(r.token_ids) == 200
        assert all(t == FORCED for t in r.token_ids) == (v == v0 + 1)
    assert {v for r in results for v in r.versions} == {v0}, "in-flight requests drain on the old version"
    assert {v for r in late_results for v in r.versions} == {v0 + 1}
    assert seen == {v0, v0 + 1}
    restore(world, v0 + 2)


@pytest.mark.slow
def test_min_version_waits_for_the_update(world):
    """A request naming a version the replica has not reached waits for the update that
    brings it, and every token it returns comes from that version."""
    model, gen = world["model"], world["gen"]
    v0 = gen.version.call_one().get(timeout=CALL_S)
    ids = prompts(1, seed=800)[0]

    async def main():
        waiting = asyncio.ensure_future(awaited(gen.generate.call_one(ids, 16, 0.0, v0 + 1)))
        await asyncio.sleep(1.0)
        assert not waiting.done(), "a request for a newer version ran on the old one"
        assert (await gen.stats.call_one())["requests_in_flight"] == 0
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        await gen.load_weights.call_one(v0 + 1, sd, "keep")
        return await asyncio.wait_for(waiting, CALL_S)

    out = asyncio.run(main())
    assert out.versions == [v0 + 1] * 16 and out.token_ids == hf_greedy(model, ids, 16)


@pytest.mark.slow
def test_pause_holds_generation_until_resume(world):
    gen = world["gen"]
    driver = world["helpers"].spawn("pause_driver", RequestDriver)

    async def main():
        before = (await gen.stats.call_one())["tokens_generated"]
        await driver.start.call_one(gen, prompts(4, seed=500), 4)
        try:
            await wait_for_tokens(gen, before, 1)
            await gen.pause_generation.call_one()
            held = (await gen.stats.call_one())["tokens_generated"]
            await asyncio.sleep(0.5)
            assert (await gen.stats.call_one())["tokens_generated"] == held
            assert await driver.finished_count.call_one() == 0
        finally:
            await gen.resume_generation.call_one()
        results, _ = await driver.results.call_one()
        return results

    results = asyncio.run(main())
    assert len(results) == 4 and all(len(r.token_ids) == 200 and r.finish_reason == "length" for r in results)


@pytest.mark.slow
def test_a_call_aborted_by_its_id_ends_its_requests_in_the_engine(world):
    """abort_many on a real replica: the generate_many call it names answers at once as
    aborted, vLLM ends its requests long before their budgets, and the replica serves on."""
    gen = world["gen"]

    async def main():
        before = (await gen.stats.call_one())["tokens_generated"]
        call = asyncio.ensure_future(awaited(gen.generate_many.call_one([(p, 250, None, 0) for p in prompts(3, seed=700)], call_id="worker-x-1")))
        await wait_for_tokens(gen, before, 10)
        await gen.pause_generation.call_one()  # (held mid-completion: the abort cannot come after they end)
        try:
            assert await gen.abort_many.call_one("worker-x-1") and not await gen.abort_many.call_one("worker-y-1")
            results = await asyncio.wait_for(call, 30)
        finally:
            await gen.resume_generation.call_one()
        stats = await gen.stats.call_one()
        return results, stats["requests_in_flight"], stats["tokens_generated"] - before

    results, in_flight, generated = asyncio.run(main())
    assert results == ["aborted: its caller gave up on it"] * 3 and in_flight == 0 and generated < 3 * 250
    (out,) = generate_all(gen, prompts(1, seed=701), 8, 0.0)
    assert out.finish_reason == "length" and len(out.token_ids) == 8


@pytest.mark.slow
def test_a_caller_gone_mid_request_does_not_fail_the_replica(world):
    """A rollout worker's proc stops (it died, or was stopped first at shutdown) while its
    requests run: their answers cannot be delivered, and the replica serves on."""
    gen = world["gen"]
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        driver = procs.spawn("doomed_driver", RequestDriver)
        before = gen.stats.call_one().get(timeout=CALL_S)["tokens_generated"]
        # many short requests, a new one as each returns: answers are always on their way
        driver.start.call_one(gen, prompts(2000, seed=900), 16, 4).get(timeout=CALL_S)
        asyncio.run(wait_for_tokens(gen, before, FLOWING))
    finally:
        procs.stop().get(timeout=60)
    deadline = time.monotonic() + 60
    while gen.stats.call_one().get(timeout=CALL_S)["requests_in_flight"] > 0:
        assert time.monotonic() < deadline, "the orphaned requests never finished"
        time.sleep(0.05)
    time.sleep(0.5)  # the last undeliverable answers come back
    v = gen.version.call_one().get(timeout=CALL_S)
    (out,) = generate_all(gen, prompts(1, seed=901), 8, 0.0)
    assert out.finish_reason == "length" and out.versions == [v] * 8


@pytest.mark.slow
def test_tensor_update_equals_fresh_engine_from_checkpoint(world):
    gen = world["gen"]
    new_model = tiny_qwen3(1)
    new_ckpt = save_checkpoint(new_model, world["root"] / "ckpt_new")
    version = gen.version.call_one().get(timeout=CALL_S) + 1
    checksum_before = gen.weights_checksum.call_one().get(timeout=CALL_S)
    gen.load_weights.call_one(version, new_model.state_dict(), "block").get(timeout=CALL_S)
    assert gen.weights_checksum.call_one().get(timeout=CALL_S) != checksum_before
    requests = [p for p in prompts(3, seed=300) for _ in range(2)]
    updated = generate_all(gen, requests, 24, 0.0)
    assert all(r.versions == [version] * len(r.token_ids) for r in updated)

    procs = this_host().spawn_procs(per_host={"procs": 1})
    fresh = None
    try:
        fresh, _ = spawn_generator(procs, "fresh", make_config(), new_ckpt, version)
        reference = generate_all(fresh, requests, 24, 0.0)
        assert gen.weights_checksum.call_one().get(timeout=CALL_S) == pytest.approx(fresh.weights_checksum.call_one().get(timeout=CALL_S), rel=1e-6)
    finally:
        if fresh is not None:
            fresh.shutdown_engine.call_one().get(timeout=60)
        procs.stop().get(timeout=60)
    for a, b in zip(updated, reference):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # and the new weights really are the checkpoint's: HF agrees on the greedy tokens
    ref = new_model.generate(torch.tensor([requests[0]]), do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert updated[0].token_ids == ref[0, len(requests[0]) :].tolist()
    restore(world, version + 1)


@pytest.mark.slow
def test_compiled_engine_generates_the_loaded_weights(world):
    """generator.compile: vLLM's torch.compile'd model reads the weights a version loads in
    place (the compiled graph must not have captured the old parameters)."""
    new_model = tiny_qwen3(2)
    requests = prompts(2, seed=700)
    procs = this_host().spawn_procs(per_host={"procs": 1})
    gen = None
    try:
        gen, _ = spawn_generator(procs, "compiled", make_config(compile=True), world["ckpt"])
        before = generate_all(gen, requests, 16, 0.0)
        gen.load_weights.call_one(1, new_model.state_dict(), "block").get(timeout=CALL_S)
        after = generate_all(gen, requests, 16, 0.0)
    finally:
        if gen is not None:
            gen.shutdown_engine.call_one().get(timeout=60)
        procs.stop().get(timeout=60)
    for ids, old, new in zip(requests, before, after):
        assert old.token_ids == hf_greedy(world["model"], ids, 16)
        assert new.token_ids == hf_greedy(new_model, ids, 16)
    assert all(r.versions == [1] * 16 for r in after)


class WeightsPublisher(Actor):
    """A stand-in trainer rank publishing full HF-named tensors over weight sync."""

    def __init__(self, weight_sync: dict):
        from meshrl.config import WeightSyncConfig
        from meshrl.weightsync.publisher import Publisher

        self.publisher = Publisher(WeightSyncConfig(**weight_sync))

    @endpoint
    def weight_sync_key(self):
        return self.publisher.key

    @endpoint
    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.publisher.publish(version, list(tensors.items()))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["rdma", "collective"])
def test_weight_sync_update_equals_loading_the_tensors(world, transport):
    """sync_weights: the subscriber fetches into its shared buffer and vLLM loads from that
    buffer in place (rdma), or the engine's worker is the broadcast group's rank and loads
    from its own receive buffer (collective); the engine ends up exactly as when the same
    tensors are copied in."""
    from meshrl.config import WeightSyncConfig
    from meshrl.weightsync.connect import WeightSync
    from meshrl.weightsync.publisher import publisher_agent
    from meshrl.weightsync.subscriber import subscriber_agent

    gen = world["gen"]
    weight_sync = {"transport": transport, "timeout_s": 60.0}
    publisher = world["helpers"].spawn("weights_publisher", WeightsPublisher, weight_sync)
    handles = [
        publisher_agent(world["helpers"], publisher.weight_sync_key.call_one().get(timeout=CALL_S)),
        subscriber_agent(world["procs"], gen.weight_sync_key.call_one().get(timeout=CALL_S)),
    ]
    ws = asyncio.run(WeightSync(WeightSyncConfig(**weight_sync)).connect(handles[0], handles[1:]))
    new_model = tiny_qwen3(2)
    version = gen.version.call_one().get(timeout=CALL_S) + 1
    publisher.publish.call_one(version, new_model.state_dict()).get(timeout=CALL_S)
    out = gen.sync_weights.call_one(version).get(timeout=CALL_S)
    assert out["version"] == version
    status = asyncio.run(ws.status())["subscribers"][0]
    assert status["in_engine"] == (transport == "collective") and status["error"] is None
    synced = gen.weights_checksum.call_one().get(timeout=CALL_S)
    requests = prompts(2, seed=400)
    tokens = [r.token_ids for r in generate_all(gen, requests, 16, 0.0)]
    gen.load_weights.call_one(version + 1, new_model.state_dict(), "block").get(timeout=CALL_S)
    assert gen.weights_checksum.call_one().get(timeout=CALL_S) == synced
    assert [r.token_ids for r in generate_all(gen, requests, 16, 0.0)] == tokens
    ws.close()
    restore(world, version + 2)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


class ThreeTurns:
    """A user env of token ids: three model turns whatever they say, ENV_REPLY after each
    of the first two."""

    def reset(self, sample: dict) -> list[int]:
        return sample["prompt"]

    def step(self, turn) -> StepResult:
        if turn.index < 2:
            return StepResult(observation=list(ENV_REPLY), done=False)
        return StepResult(reward=1.0, done=True)


ENV_REPLY = (5, 6, 7)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_multi_turn_episodes_spanning_an_update_carry_the_right_version_on_every_token(world, mode):
    """Rollout workers' episodes (3 model turns, env turns between) against the replica while
    its weights change mid-episode: every model token's version is the version of the
    weights that produced it (the new weights sample FORCED with log-prob ~0), versions never
    go back within an episode, and env tokens carry none."""
    from meshrl.episode import PAD_VERSION, pack
    from meshrl.queue import Claim
    from meshrl.agent.worker import RolloutWorker

    gen = world["gen"]
    forced = forced_state_dict(world["model"])
    v0 = gen.version.call_one().get(timeout=CALL_S)
    config = Config.from_dict({**make_config(max_new_tokens=50, group_size=2).to_dict(), "rollout": {"env": "tests.test_generator:ThreeTurns", "max_turns": 4}})
    worker = RolloutWorker(config, world["ckpt"])
    worker.set_generators([gen])
    claims = [Claim(gid, {"prompt": ids}, v0) for gid, ids in enumerate(prompts(6, seed=700 + len(mode)))]

    async def main():
        before = (await gen.stats.call_one())["tokens_generated"]
        groups = [asyncio.ensure_future(worker.play_group(c)) for c in claims]
        await wait_for_tokens(gen, before, 2 * FLOWING, groups)
        await asyncio.wait_for(awaited(gen.load_weights.call_one(v0 + 1, forced, mode)), CALL_S)
        return await asyncio.wait_for(asyncio.gather(*groups), 2 * CALL_S)

    episodes = [ep for group in asyncio.run(main()) for ep in group]
    assert len(episodes) == 12 and all(ep.finish_reason == "length" and len(ep.model_turns) == 3 for ep in episodes)
    turns_on_both, spanning = 0, 0
    for ep in episodes:
        versions = [v for t in ep.model_turns for v in t.versions]
        assert versions == sorted(versions), "a version went back within an episode"
        for turn in ep.model_turns:
            assert len(turn.token_ids) == 50
            switch = _check_switch(RequestResult(turn.token_ids, turn.logprobs, turn.versions, "length"), v0 + 1)
            spanning += 0 < switch < 50
        turns_on_both += len({t.versions[0] for t in ep.model_turns}) > 1
        assert [tuple(t.token_ids) for t in ep.turns if t.role == "env"][1:] == [ENV_REPLY, ENV_REPLY]
    assert turns_on_both >= 1, "the update should land between some episodes' turns"
    assert spanning >= 1, "the update should land inside some turns"
    td = pack(episodes)
    env = ~td["loss_mask"] & (td["tokens"] != 0)
    assert (td["versions"][env] == PAD_VERSION).all()
    restore(world, v0 + 2)


def test_an_engine_whose_start_fails_after_vllm_started_is_shut_down():
    """A failure after vLLM's construction (an RPC to its workers, the version, a teacher's
    temperature) left its engine processes running, holding the replica's cores or GPU, with no
    pid for the controller to kill: the engine is shut down on that path (and when cancelled)."""
    import types

    from meshrl.generator.service import Generator

    for failure in (RuntimeError("collective_rpc failed"), asyncio.CancelledError()):
        stopped = []

        async def start(version, failure=failure):
            raise failure

        gen = Generator.__new__(Generator)
        gen.gen, gen.teacher = Config().generator, False
        gen.engine = types.SimpleNamespace(start=start, shutdown=lambda: stopped.append(True))
        with pytest.raises(type(failure)):
            asyncio.run(gen.start(3))
        assert stopped == [True]
