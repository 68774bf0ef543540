"""The whole-loop peer: Hugging Face TRL's GRPOTrainer vs meshrl (sync and async), same problem.

Same initial weights (meshrl's exported version-0 policy, RUN_DIR/hf/v0), same character
tokenizer, same task and reward (`--task`, default 'digits'), same group size, batch, learning rate,
completion length, clipping and loss aggregation. Measured in one invocation, one system
after the other (the machine has 2 cores). Reports samples/s and reward against samples
for TRL and for meshrl in both modes, and whether the issue's target holds: meshrl async
at least 2x TRL's samples/s at equal or better reward per sample. Every system runs at
each seed of `--seeds` (TRL from that seed's meshrl initial weights): speed is the mean
over the seeds, and the reward verdict takes async - TRL seed by seed, with the spread
between seeds as its noise.

    python benchmarks/trl_peer.py [--steps 24] [--trl-steps 24]
    python benchmarks/trl_peer.py --meshrl-json benchmarks/results/async_vs_sync.json  # reuse those runs

Needs `pip install -c constraints.txt trl==1.16.0` (the `bench` extra). TRL generates with
transformers `generate` (its default; its vLLM path is GPU-only), in this process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time

from common import RESULTS, machine

from async_vs_sync import MODE_CONFIGS, add_common_args, bench_config, bench_seeds, mean_gap, mode_means, reward_gap, run_seeds, time_to_reward  # noqa: E402

TARGET_SPEEDUP = 2.0


def task_dataset(task_name: str, n: int, seed: int, data=None):
    """The same records meshrl's task source makes for epoch 0 (record i is a pure function
    of seed, i): prompt, answer and the task's own fields."""
    from datasets import Dataset

    from meshrl.tasks import get_task

    task = get_task(task_name)
    return Dataset.from_list([task.sample(random.Random(f"{seed}/0/{i}"), data) for i in range(n)])


def cap_at_budgets(model, tokenizer, dataset) -> None:
    """Give TRL's generation meshrl's per-prompt token budgets (a record's `max_new_tokens`):
    `model.generate` stops each row once it has that many new tokens. TRL has no such knob.
    transformers pads a stopped row, and TRL counts a row up to its first end-of-sequence
    token, so the pad is the end-of-sequence token (GRPOConfig.generation_kwargs): a row cut
    at its budget then trains one token more than in meshrl, an end it did not sample."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    budget_of = dict(zip(dataset["prompt"], dataset["max_new_tokens"]))

    class Budgets(StoppingCriteria):
        def __init__(self, prompt_ids):
            self.start = prompt_ids.shape[1]
            texts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
            self.budgets = torch.tensor([budget_of[t] for t in texts], device=prompt_ids.device)

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[1] - self.start >= self.budgets

    generate = model.generate

    def generate_within_budgets(*args, **kwargs):
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(Budgets(kwargs["input_ids"]))
        return generate(*args, stopping_criteria=criteria, **kwargs)

    model.generate = generate_within_budgets


def reward_for_trl(task_name: str):
    """meshrl's own task reward, in TRL's reward-function signature."""
    from meshrl.tasks import get_task

    reward = get_task(task_name).reward

    def task_reward(prompts, completions, answer, **_) -> list[float]:
        return [reward(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]

    task_reward.__name__ = f"{task_name}_reward"
    return task_reward


def run_trl(model_dir: str, tokenizer_dir: str, cfg, steps: int, out_dir: str, setting: str = "float32") -> dict:
    """GRPOTrainer for `steps` optimizer steps, one generation batch per step, on CPU.
    `setting`: a dtype, bfloat16 being TRL's `bf16=True` (accelerate autocasts; master
    weights float32), with `+compile` for the Trainer's `torch_compile=True`."""
    dtype, _, extra = setting.partition("+")
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from meshrl.tokenizer import load_tokenizer

    g = cfg.generator
    batch = cfg.batch_groups * g.group_size
    lcfg = cfg.trainer.loss
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=cfg.seed,
        max_steps=steps,
        disable_tqdm=True,
        # one optimizer step on one freshly generated batch of batch_groups x group_size
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=g.group_size,
        num_iterations=1,
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=0,
        # meshrl's optimizer and loss: constant lr AdamW, grad clip, token-mean (DAPO) aggregation,
        # clip-higher, std-normalised group advantages, no KL
        learning_rate=cfg.trainer.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.grad_clip,
        loss_type="dapo",
        epsilon=lcfg.clip_low,
        epsilon_high=lcfg.clip_high,
        scale_rewards="group",
        beta=0.0,
        shuffle_dataset=False,
        bf16=dtype == "bfloat16",
        fp16=False,
        torch_compile=extra == "compile",
    )
    tokenizer = load_tokenizer(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    task = cfg.data.source.removeprefix("task:")
    dataset = task_dataset(task, steps * cfg.batch_groups + cfg.batch_groups, cfg.seed, cfg.data)
    if "max_new_tokens" in dataset.column_names:
        cap_at_budgets(model, tokenizer, dataset)
        args.generation_kwargs = {**(args.generation_kwargs or {}), "pad_token_id": tokenizer.eos_token_id}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.rows, self._t0 = [], [], None

        def on_step_begin(self, args, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rows.append({"step": state.global_step, "reward": float(logs["reward"])})

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_for_trl(task), args=args, processing_class=tokenizer, train_dataset=dataset, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    # on-policy: step i's batch comes from the policy trained on i - 1 batches
    rows = [{**r, "time/step_s": t, "samples": (i + 1) * batch, "policy_samples": i * batch} for i, (r, t) in enumerate(zip(timer.rows, timer.times))]
    steady = timer.times[1:] or timer.times  # the first step carries one-off costs
    step_s = statistics.mean(steady)
    return {
        "mode": "trl",
        "setting": setting,
        "steps": len(rows),
        "train_wall_s": wall,
        "step_s": step_s,
        "step_s_median": statistics.median(steady),
        "samples_per_s": batch / step_s,
        "rows": rows,
        "threads": torch.get_num_threads(),
    }


def engine_batch_s(ckpt: str, tokenizer_dir: str, cfg, repeats: int = 12) -> float:
    """Median seconds meshrl's vLLM engine alone (VLLMEngine: AsyncLLM in this process, the
    run's engine settings, no actors, workers or queue) takes to generate one batch of the
    task's first prompts, each group_size times: the generation floor of a colocated step."""
    import asyncio

    from meshrl.generator.engine import VLLMEngine
    from meshrl.rollout.chat import ChatRenderer
    from meshrl.tokenizer import load_tokenizer

    g = cfg.generator
    renderer = ChatRenderer(load_tokenizer(tokenizer_dir))
    records = task_dataset(cfg.data.source.removeprefix("task:"), cfg.batch_groups, cfg.seed, cfg.data)
    prompts = [renderer.initial_ids(r["prompt"]) for r in records for _ in range(g.group_size)]

    async def run() -> float:
        engine = VLLMEngine(g, ckpt, dtype=cfg.model.dtype, max_model_len=cfg.model.max_seq_len, seed=cfg.seed)
        await engine.start()
        try:
            times = []
            for k in range(repeats):
                t0 = time.monotonic()
                await asyncio.gather(*(engine.run_request(f"{k}-{i}", p, g.max_new_tokens) for i, p in enumerate(prompts)))
                times.append(time.monotonic() - t0)
        finally:
            engine.shutdown()
        return statistics.median(times[2:])  # the first batches warm the engine up

    return asyncio.run(run())


def export_initial_policy(args: argparse.Namespace, root: str) -> tuple[str, str]:
    """meshrl's version-0 policy and tokenizer, built in this process exactly as a run's
    single-proc trainer builds them (the initial weights are a pure function of the seed)."""
    import torch

    from meshrl.tokenizer import build_char_tokenizer
    from meshrl.trainer.policy import PolicyTrainer

    config = bench_config("sync", args, os.path.join(root, "export"))
    config.trainer.compile = False  # nothing runs here, and dynamo's settings stay TRL's defaults
    trainer = PolicyTrainer(config, torch.device("cpu"))
    return trainer.export_hf(os.path.join(root, "hf", "v0")), build_char_tokenizer(os.path.join(root, "tokenizer"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--trl-steps", type=int, default=None, help="TRL optimizer steps (default: --steps)")
    p.add_argument(
        "--trl-settings",
        default="float32,bfloat16,float32+compile",
        help="TRL settings to try at the first seed (a dtype, +compile for torch_compile=True); "
        "the fastest is the reference (TRL at its best setting on this machine) and runs at every seed",
    )
    p.add_argument(
        "--trl-probe-steps", type=int, default=6, help="steps of each setting's trial run (its first step, with the one-off costs, is left out of its speed)"
    )
    p.add_argument(
        "--meshrl-json", default=None, help="reuse the meshrl sync/async runs of this async_vs_sync.json (same problem size and seeds) instead of running them"
    )
    p.add_argument("--out", default=os.path.join(RESULTS, "trl_peer.json"))
    args = p.parse_args()
    if importlib.util.find_spec("trl") is None:  # before any run: without TRL the meshrl runs would be thrown away
        raise SystemExit("trl_peer.py needs TRL: pip install -c constraints.txt trl==1.16.0 (the `bench` extra)")
    t0 = time.monotonic()
    batch = args.batch_groups * args.group_size
    seeds = bench_seeds(args)
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-") as root:
        if args.meshrl_json:
            with open(args.meshrl_json) as f:
                reused = json.load(f)
            for key in (
                "steps",
                "batch_groups",
                "group_size",
                "max_new_tokens",
                "lr",
                "seed",
                "seeds",
                "task",
                "dtype",
                "compile",
                "async_batches_in_flight",
                "model",
            ):
                if reused["args"].get(key) != getattr(args, key):
                    raise SystemExit(f"{args.meshrl_json} was run with {key}={reused['args'].get(key)}, not {getattr(args, key)}")
            meshrl = reused["results"]
        else:
            meshrl = run_seeds(args, sorted({"sync", "async", *args.modes.split(",")}, key=list(MODE_CONFIGS).index), root)
        for r in meshrl:  # at this invocation's --reward-level, also for reused runs
            r["time_to_reward_s"] = time_to_reward(r["rows"], args.reward_level)
        modes = [m for m in MODE_CONFIGS if any(r["base_mode"] == m for r in meshrl)]
        means = {m: mode_means([r for r in meshrl if r["base_mode"] == m], batch) for m in modes}
        steps = args.trl_steps or args.steps
        trl_runs, others = [], []
        for i, seed in enumerate(seeds):
            seed_args = argparse.Namespace(**{**vars(args), "seed": seed})
            hf_v0, tokenizer_dir = export_initial_policy(seed_args, os.path.join(root, f"seed{seed}"))
            cfg = bench_config("sync", seed_args, os.path.join(root, "unused"))
            if i == 0 and "colocate" in modes:
                engine_s = engine_batch_s(hf_v0, tokenizer_dir, bench_config("colocate", seed_args, os.path.join(root, "unused")))
            if i == 0:  # TRL's fastest setting on this machine, from short runs of each
                probes = [run_trl(hf_v0, tokenizer_dir, cfg, args.trl_probe_steps, os.path.join(root, f"probe-{x}"), x) for x in args.trl_settings.split(",")]
                setting = min(probes, key=lambda t: t["step_s"])["setting"]
                others += [{**t, "mode": f"trl-{t['setting']}-probe", "seed": seed} for t in probes]
            run = run_trl(hf_v0, tokenizer_dir, cfg, steps, os.path.join(root, f"trl-{seed}"), setting)
            trl_runs.append({**run, "mode": "trl" if i == 0 else f"trl-seed{seed}", "seed": seed})
    for t in trl_runs + others:
        t.update(
            reward_last=statistics.mean(r["reward"] for r in t["rows"][-4:]),
            reward_mean=statistics.mean(r["reward"] for r in t["rows"]),
            time_to_reward_s=time_to_reward(t["rows"], args.reward_level),
        )
    trl = trl_runs[0]
    means["trl"] = mode_means(trl_runs, batch)
    trl_sps = means["trl"]["samples_per_s"]
    results = trl_runs + others + [{k: v for k, v in r.items() if k not in ("hf_v0", "tokenizer_dir")} for r in meshrl]
    trl_of_seed = {t["seed"]: t for t in trl_runs}
    for r in results:
        # reward against TRL's from the same initial weights, at equal samples the generating policy was trained on
        ref = trl_of_seed.get(r.get("seed"))
        r["reward_vs_trl"] = reward_gap(r["rows"], ref["rows"]) if ref is not None and r is not ref else None
    ratio = means["async"]["samples_per_s"] / trl_sps
    # per seed async - TRL; the noise is their spread between seeds
    summary = mean_gap([r["reward_vs_trl"] for r in results if r.get("base_mode") == "async" and r["reward_vs_trl"] and r["reward_vs_trl"]["points"]])
    gap, stderr, reward_ok = summary["gap"], summary["stderr"], summary["within_noise_or_better"]
    verdict = {
        "async_over_trl_samples_per_s": ratio,
        "sync_over_trl_samples_per_s": means["sync"]["samples_per_s"] / trl_sps,
        "trl_samples_per_s": trl_sps,
        "seeds": len(seeds),
        "reward_async_minus_trl": gap,
        "reward_async_minus_trl_stderr": stderr,
        "reward_async_minus_trl_per_seed": summary["per_seed"],
        "time_to_reward_s": {m: means[m]["time_to_reward_s"] for m in ("trl", "sync", "async")},
        "target_speed_met": ratio >= TARGET_SPEEDUP,
        "target_reward_met": reward_ok,
        "target_met": ratio >= TARGET_SPEEDUP and reward_ok,
    }
    if "colocate" in means:  # placement=colocate: the roles taking turns on every core, as TRL's one process does
        colocated = mean_gap([r["reward_vs_trl"] for r in results if r.get("base_mode") == "colocate" and r["reward_vs_trl"] and r["reward_vs_trl"]["points"]])
        verdict.update(
            colocate_over_trl_samples_per_s=means["colocate"]["samples_per_s"] / trl_sps,
            reward_colocate_minus_trl=colocated["gap"],
            reward_colocate_minus_trl_stderr=colocated["stderr"],
            time_to_reward_s={m: means[m]["time_to_reward_s"] for m in ("trl", *modes)},
        )
        # What colocation can reach with no framework cost at all: the engine alone generating
        # the batch, then the trainer's step and publish, one after the other.
        floor = engine_s + means["colocate"]["T_s"]
        verdict.update(colocate_engine_batch_s=engine_s, colocate_floor_s=floor, colocate_floor_over_trl_samples_per_s=(batch / trl_sps) / floor)
    # What overlap alone can give on this machine: one step takes at least the longer of
    # generating a batch (G) and training on it (T), each on its own share of the cores,
    # both measured in the sync runs. TRL's step over that is the ratio's ceiling, unless
    # async also generates more cheaply than sync (more sequences in flight per decode step).
    G, T = means["sync"].get("G_s", 0.0), means["sync"].get("T_s", 0.0)
    if G and T:
        verdict["async_step_floor_s"] = max(G, T)
        verdict["ceiling_over_trl_samples_per_s"] = (batch / trl_sps) / max(G, T)

    print(f"TRL reference: {trl['setting']} (fastest of {args.trl_settings} in {args.trl_probe_steps}-step trials), over {len(seeds)} seed(s)")
    print(f"\n{'system':<22}{'mean step s':>12}{'samples/s':>11}{'reward - TRL (equal policy samples)':>38}{'reward (last 4 steps)':>23}")
    for r in results:
        g = r["reward_vs_trl"]
        vs = f"{g['gap']:+.3f} +- {g['stderr']:.3f}" if g else "reference"
        print(f"{r['mode']:<22}{r['step_s']:>12.3f}{r['samples_per_s']:>11.1f}{vs:>38}{r['reward_last']:>23.4f}")
    print(f"\nmeans over {len(seeds)} seed(s): TRL {trl_sps:.1f} samples/s, meshrl " + ", ".join(f"{m} {means[m]['samples_per_s']:.1f}" for m in modes))
    if "colocate" in means:
        print(
            f"meshrl colocate / TRL samples/s = {verdict['colocate_over_trl_samples_per_s']:.2f}x; reward per sample, colocate - TRL "
            f"{verdict['reward_colocate_minus_trl']:+.3f} +- {verdict['reward_colocate_minus_trl_stderr']:.3f}"
        )
        print(
            f"colocate floor: the vLLM engine alone generates the batch in {verdict['colocate_engine_batch_s']:.3f} s, + the trainer's "
            f"step and publish {means['colocate']['T_s']:.3f} s = {verdict['colocate_floor_s']:.3f} s/step, "
            f"{verdict['colocate_floor_over_trl_samples_per_s']:.2f}x TRL's samples/s with no framework cost at all"
        )
    print(
        f"meshrl async / TRL samples/s = {ratio:.2f}x (target {TARGET_SPEEDUP:.0f}x: {'met' if verdict['target_speed_met'] else 'NOT met'}); "
        f"reward per sample, async - TRL per seed {', '.join(f'{g:+.3f}' for g in verdict['reward_async_minus_trl_per_seed'])}: "
        f"mean {gap:+.3f} +- {stderr:.3f}, {'equal, better or within noise' if reward_ok else 'WORSE'}; "
        f"overall target {'met' if verdict['target_met'] else 'NOT met'}"
    )
    reach = verdict["time_to_reward_s"]
    print(
        f"training time to a trained-batch reward of {args.reward_level} (mean over seeds): "
        + ", ".join(f"{m} {'never (some seed)' if t is None else f'{t:.1f} s'}" for m, t in reach.items())
    )
    if "ceiling_over_trl_samples_per_s" in verdict:
        print(
            f"overlap ceiling: max(G, T) = {verdict['async_step_floor_s']:.3f} s from the sync runs gives "
            f"{verdict['ceiling_over_trl_samples_per_s']:.2f}x TRL's samples/s; async beats it only by generating "
            f"more efficiently than sync (more sequences in flight)"
        )
    from async_vs_sync import plot

    payload = {
        "args": vars(args),
        "reused_meshrl_runs": args.meshrl_json,
        "machine": machine(),
        "reused_meshrl_machine": reused.get("machine_before") if args.meshrl_json else None,
        "results": results,
        "means": means,
        "verdict": verdict,
        "wall_s": time.monotonic() - t0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    png = plot(results, os.path.splitext(args.out)[0] + ".png", f"meshrl async vs TRL GRPOTrainer: {ratio:.2f}x samples/s")
    print(f"wrote {args.out} and {png} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
