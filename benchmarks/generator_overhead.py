"""Generator overhead: the generation service (GeneratorActor on a Monarch mesh) vs plain vLLM `LLM.generate`.

Same checkpoint, prompts and engine settings in one run (engines run one after the other:
the machine has 2 cores). Measures decode throughput of
  1. vLLM `LLM.generate` (n = group_size, one call for all prompts),
  2. the service from this process: one concurrent `generate` call per sample, all at once
     (one vLLM request each, batched by vLLM),
  3. the service from a stand-in rollout worker on a proc of its own, which keeps
     max_num_seqs calls in flight and sends the next as soon as one returns (the
     continuous path: a worker's model turns to a replica),
and how long generation is held by a weight update in each mode (keep, abort, drain,
block) while requests flow. Prints a table and writes JSON.

    python benchmarks/generator_overhead.py [--out benchmarks/results/generator_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

from common import machine

GROUPS, GROUP_SIZE, NEW_TOKENS, PROMPT_LEN, MAX_NUM_SEQS = 24, 4, 128, 16, 64


def build_checkpoint(root: str) -> str:
    from tests.test_generator import save_checkpoint, tiny_qwen3

    return save_checkpoint(tiny_qwen3(0), os.path.join(root, "ckpt"))


def make_prompts(seed: int = 0) -> list[list[int]]:
    from tests.test_generator import prompts

    return prompts(GROUPS, seed=seed, length=PROMPT_LEN)


def make_requests(seed: int = 0) -> list[list[int]]:
    """One request per sample: each prompt GROUP_SIZE times (the service takes n = 1 calls)."""
    return [p for p in make_prompts(seed) for _ in range(GROUP_SIZE)]


def bench_plain_vllm(ckpt: str) -> dict:
    from meshrl.compat import vllm_cpu_defaults

    vllm_cpu_defaults()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=ckpt,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=256,
        seed=0,
        logprobs_mode="processed_logprobs",
    )
    startup = time.monotonic() - t0
    try:
        sp = SamplingParams(n=GROUP_SIZE, temperature=1.0, max_tokens=NEW_TOKENS, logprobs=0, stop_token_ids=[2])
        reqs = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(1000)]
        llm.generate(reqs[:2], sp, use_tqdm=False)  # warm-up
        t0 = time.monotonic()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        wall = time.monotonic() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {"startup_s": startup, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


async def _generate_all(gen, requests: list[list[int]]) -> list:
    from meshrl.futures import awaited

    return await asyncio.gather(*(awaited(gen.generate.call_one(ids)) for ids in requests))


async def _update_while_generating(gen, requests: list[list[int]], version: int, weights, mode: str) -> dict:
    """Send every request; once about a quarter of their tokens are out (mid-completion),
    apply `weights` as `version` in `mode`; wait for all of them."""
    from meshrl.futures import awaited

    before = (await gen.stats.call_one())["tokens_generated"]
    calls = [asyncio.ensure_future(awaited(gen.generate.call_one(ids))) for ids in requests]
    while (await gen.stats.call_one())["tokens_generated"] - before < len(requests) * NEW_TOKENS // 4:
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    held = await gen.load_weights.call_one(version, weights, mode)
    call = time.monotonic() - t0
    results = await asyncio.wait_for(asyncio.gather(*calls), 300)
    return {"held_s": held, "call_s": call, "completions_spanning_versions": sum(len(set(r.versions)) > 1 for r in results)}


def bench_actor(ckpt: str) -> dict:
    from monarch.actor import this_host

    from meshrl.config import Config
    from tests.conftest import GeneratorTestActor  # GeneratorActor + load_weights (tensors in the message)
    from tests.test_generator import RequestDriver, tiny_qwen3

    config = Config.from_dict(
        {
            "model": {"max_seq_len": 256, "dtype": "float32"},
            "generator": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "max_num_seqs": MAX_NUM_SEQS},
        }
    )
    weights = tiny_qwen3(0).state_dict()
    procs = this_host().spawn_procs(per_host={"procs": 1})
    helpers = this_host().spawn_procs(per_host={"procs": 1})
    gen = None
    out: dict = {}
    try:
        gen = procs.spawn("generator", GeneratorTestActor)
        out["startup_s"] = gen.setup.call_one(config.to_dict(), ckpt, 0).get(timeout=300)["startup_s"]
        asyncio.run(_generate_all(gen, make_requests(2000)[: 2 * GROUP_SIZE]))  # warm-up

        # 2. every sample's call at once, from this process
        requests = make_requests(1000)
        t0 = time.monotonic()
        results = asyncio.run(_generate_all(gen, requests))
        wall = time.monotonic() - t0
        tokens = sum(len(r.token_ids) for r in results)
        out["service"] = {"requests": len(requests), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}

        # 3. from a stand-in rollout worker's proc, max_num_seqs calls in flight
        driver = helpers.spawn("driver", RequestDriver)
        driver.start.call_one(gen, requests, MAX_NUM_SEQS).get(timeout=60)
        results, wall = driver.results.call_one(300).get(timeout=330)
        stats = gen.stats.call_one().get(timeout=60)
        tokens = sum(len(r.token_ids) for r in results)
        # the actor's own stats, cumulative since setup (warm-up and both runs above);
        # busy = time with at least one vLLM request in flight
        out["service_from_worker"] = {
            "requests": len(requests),
            "in_flight": MAX_NUM_SEQS,
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "actor_stats": {k: stats[k] for k in ("tokens_generated", "busy_s", "idle_s", "tokens_per_s")},
        }

        # one update per mode while requests flow (same weights: the cost, not the effect)
        pauses = {}
        for i, mode in enumerate(("keep", "abort", "drain", "block")):
            pauses[mode] = asyncio.run(_update_while_generating(gen, make_requests(3000 + 100 * i), i + 1, weights, mode))
        out["update_pauses"] = pauses
    finally:
        if gen is not None:
            gen.shutdown_engine.call_one().get(timeout=60)
        procs.stop().get(timeout=60)
        helpers.stop().get(timeout=60)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generator_overhead.json"))
    args = parser.parse_args()
    measured_on = machine()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        ckpt = build_checkpoint(root)
        plain = bench_plain_vllm(ckpt)
        actor = bench_actor(ckpt)
    result = {
        "setup": {
            "groups": GROUPS,
            "group_size": GROUP_SIZE,
            "new_tokens": NEW_TOKENS,
            "prompt_len": PROMPT_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
            "model": "random Qwen3, hidden 64, 2 layers, vocab 128, float32",
            "cpus": os.cpu_count(),
        },
        "machine": measured_on,
        "plain_vllm": plain,
        "actor": actor,
        "overhead_service": 1 - actor["service"]["tokens_per_s"] / plain["tokens_per_s"],
        "overhead_service_from_worker": 1 - actor["service_from_worker"]["tokens_per_s"] / plain["tokens_per_s"],
        "total_s": time.monotonic() - t_start,
    }
    rows = [
        ("plain vLLM LLM.generate", plain["tokens_per_s"], plain["wall_s"]),
        ("service, all calls at once", actor["service"]["tokens_per_s"], actor["service"]["wall_s"]),
        (f"service from a worker proc, {MAX_NUM_SEQS} in flight", actor["service_from_worker"]["tokens_per_s"], actor["service_from_worker"]["wall_s"]),
    ]
    print(f"\n{'path':<44}{'tok/s':>10}{'wall s':>10}")
    for name, tps, wall in rows:
        print(f"{name:<44}{tps:>10.0f}{wall:>10.2f}")
    print(f"\n{'update mode':<12}{'held s':>10}{'call s':>10}{'spanning':>10}")
    for mode, p in actor["update_pauses"].items():
        print(f"{mode:<12}{p['held_s']:>10.3f}{p['call_s']:>10.3f}{p['completions_spanning_versions']:>10}")
    print(f"\ntotal {result['total_s']:.0f}s; JSON -> {args.out}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
