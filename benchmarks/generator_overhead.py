"""Generator overhead: the GeneratorActor on a Monarch mesh vs plain vLLM `LLM.generate`.

Same checkpoint, prompts and engine settings in one run (engines run one after the other:
the machine has 2 cores). Measures decode throughput of
  1. vLLM `LLM.generate` (n = group_size, one call for all prompts),
  2. the actor's one-shot `generate` endpoint (one vLLM request per sample),
  3. the actor's continuous loop (prompt source actor -> generator -> sink actor),
and how long generation is held by a weight update in each mode (keep, abort, drain,
block) while the continuous loop runs. Prints a table and writes JSON.

    python benchmarks/generator_overhead.py [--out benchmarks/results/generator_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUPS, GROUP_SIZE, NEW_TOKENS, PROMPT_LEN = 24, 4, 128, 16


def build_checkpoint(root: str) -> str:
    from tests.test_generator import save_checkpoint, tiny_qwen3

    return save_checkpoint(tiny_qwen3(0), os.path.join(root, "ckpt"))


def make_prompts(first_group: int = 0):
    from tests.test_generator import prompts

    return prompts(GROUPS, first_group=first_group, length=PROMPT_LEN)


def bench_plain_vllm(ckpt: str) -> dict:
    from meshrl.compat import vllm_cpu_defaults

    vllm_cpu_defaults()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_num_seqs=64,
              max_model_len=256, seed=0, logprobs_mode="processed_logprobs")
    startup = time.monotonic() - t0
    try:
        sp = SamplingParams(n=GROUP_SIZE, temperature=1.0, max_tokens=NEW_TOKENS, logprobs=0, stop_token_ids=[2])
        reqs = [TokensPrompt(prompt_token_ids=p.prompt_ids) for p in make_prompts(1000)]
        llm.generate(reqs[:2], sp, use_tqdm=False)  # warm-up
        t0 = time.monotonic()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        wall = time.monotonic() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {"startup_s": startup, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def bench_actor(ckpt: str) -> dict:
    from monarch.actor import this_host

    from meshrl.config import Config
    from meshrl.generator.actor import GeneratorActor
    from tests.test_generator import CompletionSink, PromptSource, tiny_qwen3

    config = Config.from_dict({
        "model": {"max_seq_len": 256, "dtype": "float32"},
        "generator": {"group_size": GROUP_SIZE, "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "max_num_seqs": 64},
    })
    weights = tiny_qwen3(0).state_dict()
    procs = this_host().spawn_procs(per_host={"procs": 1})
    helpers = this_host().spawn_procs(per_host={"procs": 1})
    gen = None
    out: dict = {}
    try:
        gen = procs.spawn("generator", GeneratorActor)
        out["startup_s"] = gen.setup.call_one(config.to_dict(), ckpt, 0).get(timeout=300)["startup_s"]
        gen.generate.call_one(make_prompts(2000)[:2]).get(timeout=120)  # warm-up
        t0 = time.monotonic()
        completions = gen.generate.call_one(make_prompts(1000)).get(timeout=300)
        wall = time.monotonic() - t0
        tokens = sum(len(c.response_ids) for c in completions)
        out["one_shot"] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}

        source = helpers.spawn("source", PromptSource)
        sink = helpers.spawn("sink", CompletionSink)
        # continuous loop, no updates
        source.load.call_one(make_prompts(1000)).get(timeout=60)
        t0 = time.monotonic()
        gen.start_generation.call_one(source, sink).get(timeout=60)
        got = []
        while len(got) < GROUPS:
            got += sink.take.call_one().get(timeout=60)
            time.sleep(0.01)
        wall = time.monotonic() - t0
        stats = gen.stop_generation.call_one(10.0).get(timeout=60)
        tokens = sum(len(c.response_ids) for g in got for c in g)
        # the actor's own stats, cumulative since setup (warm-up, one-shot and this loop);
        # busy = time with at least one vLLM request in flight
        out["continuous"] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                             "actor_stats": {k: stats[k] for k in ("tokens_generated", "busy_s", "idle_s", "tokens_per_s")}}

        # one update per mode while the loop runs (same weights: the cost, not the effect)
        pauses = {}
        for i, mode in enumerate(("keep", "abort", "drain", "block")):
            source.load.call_one(make_prompts(3000 + 100 * i)).get(timeout=60)
            before = gen.stats.call_one().get(timeout=60)["tokens_generated"]
            gen.start_generation.call_one(source, sink).get(timeout=60)
            # update once about a quarter of this round's tokens are out: mid-completion
            while gen.stats.call_one().get(timeout=60)["tokens_generated"] - before < GROUPS * GROUP_SIZE * NEW_TOKENS // 4:
                time.sleep(0.01)
            t0 = time.monotonic()
            held = gen.load_weights.call_one(i + 1, weights, mode).get(timeout=120)
            call = time.monotonic() - t0
            got = []
            while len(got) < GROUPS:
                got += sink.take.call_one().get(timeout=60)
                time.sleep(0.01)
            gen.stop_generation.call_one(10.0).get(timeout=60)
            spans = sum(len(set(c.versions)) > 1 for g in got for c in g)
            pauses[mode] = {"held_s": held, "call_s": call, "completions_spanning_versions": spans}
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
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        ckpt = build_checkpoint(root)
        plain = bench_plain_vllm(ckpt)
        actor = bench_actor(ckpt)
    result = {
        "setup": {"groups": GROUPS, "group_size": GROUP_SIZE, "new_tokens": NEW_TOKENS, "prompt_len": PROMPT_LEN,
                  "model": "random Qwen3, hidden 64, 2 layers, vocab 128, float32", "cpus": os.cpu_count()},
        "plain_vllm": plain,
        "actor": actor,
        "overhead_one_shot": 1 - actor["one_shot"]["tokens_per_s"] / plain["tokens_per_s"],
        "overhead_continuous": 1 - actor["continuous"]["tokens_per_s"] / plain["tokens_per_s"],
        "total_s": time.monotonic() - t_start,
    }
    rows = [("plain vLLM LLM.generate", plain["tokens_per_s"], plain["wall_s"]),
            ("GeneratorActor.generate (one-shot)", actor["one_shot"]["tokens_per_s"], actor["one_shot"]["wall_s"]),
            ("GeneratorActor continuous loop", actor["continuous"]["tokens_per_s"], actor["continuous"]["wall_s"])]
    print(f"\n{'path':<38}{'tok/s':>10}{'wall s':>10}")
    for name, tps, wall in rows:
        print(f"{name:<38}{tps:>10.0f}{wall:>10.2f}")
    print(f"\n{'update mode':<12}{'held s':>10}{'call s':>10}{'spanning':>10}")
    for mode, p in actor["update_pauses"].items():
        print(f"{mode:<12}{p['held_s']:>10.3f}{p['call_s']:>10.3f}{p['completions_spanning_versions']:>10}")
    print(f"\ntotal {result['total_s']:.0f}s; JSON -> {args.out}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
