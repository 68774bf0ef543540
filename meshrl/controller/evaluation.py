"""Evaluation on held-out prompts: greedy accuracy, pass@k and mean reward.

During training (`eval.every`) the controller hands the held-out records to a rollout
worker, which plays them on the generators beside the training groups: one greedy episode
and `eval.k` sampled ones per prompt, through the run's own env and reward. Training waits
for none of it; it only shares the generators. The last step is always evaluated, after
which the generators hold the final weights and nothing updates them, so
`meshrl eval RUN_DIR` on the final export reproduces that evaluation's greedy accuracy.
Each evaluation's metrics and every prompt's greedy answer go to RUN_DIR/eval/step_N.json
(`meshrl eval`'s to RUN_DIR/eval/eval-NAME.json, NAME the checkpoint's directory: final, v3), its metrics to the run's metrics as `eval/...`.

`Evaluations` is the controller's side of it during a run; `meshrl eval` starts what an
evaluation needs and nothing more: one generator replica on the checkpoint and one rollout
worker, on a local mesh (`evaluate_checkpoint`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

from typing import Callable

from meshrl.config import Config, ConfigError
from meshrl.errors import first_line
from meshrl.agent.summary import SOLVED
from meshrl.futures import awaited

log = logging.getLogger("meshrl")


def summarize_eval(results: list[dict], k: int) -> dict[str, float]:
    """`eval/...` metrics from `RolloutWorker.evaluate`'s per-record results."""
    n = len(results)
    samples = [r for res in results for r in res["samples"]]
    mean = sum(samples) / max(len(samples), 1)
    return {
        "eval/greedy_accuracy": sum(res["greedy"] >= SOLVED for res in results) / n,
        "eval/greedy_reward": sum(res["greedy"] for res in results) / n,
        f"eval/pass@{k}": sum(any(r >= SOLVED for r in res["samples"]) for res in results) / n,
        "eval/reward_mean": mean,
        "eval/reward_std": (sum((r - mean) ** 2 for r in samples) / max(len(samples), 1)) ** 0.5,  # (the divergence alarm's scale for it)
        "eval/prompts": float(n),
        "eval/failed": float(sum(res["failed"] for res in results)),
        "eval/version_min": float(min(res["version_min"] for res in results)),
        "eval/version_max": float(max(res["version_max"] for res in results)),
    }


async def evaluate_on(worker_actor, records: list[dict], version: int, k: int, timeout_s: float) -> tuple[dict[str, float], list[dict]]:
    """One evaluation on a rollout worker actor: its metrics and per-record results."""
    results = await asyncio.wait_for(awaited(worker_actor.evaluate.call_one(records, version, k)), timeout_s)
    return summarize_eval(results, k), results


def eval_timeout_s(config: Config, n_records: int) -> float:
    """Generous: every episode of the evaluation one after another, each at most its model turns."""
    return config.weight_sync.timeout_s + config.generator.startup_timeout_s + 10.0 * n_records * (config.eval.k + 1) * config.rollout.max_turns


class Evaluations:
    """Evaluations during a run, in the background on rollout worker 0, one at a time: every
    eval.every steps and at the last one (`start_if_due`), or on demand (`now`). Each
    evaluation's row goes to `record(step, row)`; a failed one is a warning, training goes on."""

    def __init__(self, config: Config, run_dir: str, workers, record: Callable[[int, dict], None]):
        self.config, self.run_dir, self.workers, self.record = config, run_dir, workers, record
        self.task: asyncio.Task | None = None
        self.records = None
        if config.eval.every:
            from meshrl.data import eval_records

            self.records = eval_records(config)

    def start_if_due(self, version: int) -> None:
        """Start the evaluation of `version` every eval.every steps and at the last one. A due
        one is skipped while the previous still runs, except the last step's, which waits for it."""
        every = self.config.eval.every
        last = version == self.config.steps  # (a Session stepping past `steps` evaluates every eval.every, as before it)
        if not every or not (version % every == 0 or last):
            return
        previous = self.task
        if previous is not None and not previous.done() and not last:
            log.warning("evaluation of step %d skipped: the previous one still runs", version)
            return
        self.task = asyncio.create_task(self._evaluate(version, previous))

    async def finish(self, version: int | None = None) -> dict[str, float] | None:
        """Wait for the evaluation in flight (the last step's, at the end of a run). `version`:
        the run's last, evaluated now when nothing is in flight and it has no results yet (a
        resume of a run stopped while its last evaluation ran: that step is not trained again)."""
        if self.task is None and version is not None and not os.path.isfile(os.path.join(self.run_dir, "eval", f"step_{version:06d}.json")):
            self.start_if_due(version)
        task, self.task = self.task, None
        return await task if task is not None else None

    async def now(self, version: int) -> dict[str, float] | None:
        """Evaluate `version` now (interactive sessions), after any in flight. A run with
        nothing held out (a file source, no eval.source) is refused: its training rows are no test."""
        if not self.records:
            from meshrl.config.checks import check_held_out
            from meshrl.data import eval_records

            check_held_out(self.config)

            self.records = eval_records(self.config)
        self.task = asyncio.create_task(self._evaluate(version, self.task))
        return await self.finish()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _evaluate(self, version: int, previous: asyncio.Task | None = None) -> dict[str, float] | None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        try:
            worker = self.workers.workers[0].actor
            row, results = await evaluate_on(worker, self.records, version, self.config.eval.k, eval_timeout_s(self.config, len(self.records)))
            os.makedirs(os.path.join(self.run_dir, "eval"), exist_ok=True)
            write_results(os.path.join(self.run_dir, "eval", f"step_{version:06d}.json"), row, results, self.records)
        except Exception as e:  # noqa: BLE001 - a failed evaluation is reported, training goes on
            log.warning("evaluation of step %d failed: %s", version, first_line(str(e), 200) or type(e).__name__)
            return None
        self.record(version, row)
        k = self.config.eval.k
        log.info(
            "eval at step %d: greedy accuracy %.3f, pass@%d %.3f, mean reward %.3f",
            version,
            row["eval/greedy_accuracy"],
            k,
            row[f"eval/pass@{k}"],
            row["eval/reward_mean"],
        )
        return row


def resolve_target(path: str) -> tuple[str | None, str]:
    """(run directory or None, checkpoint directory) for `meshrl eval PATH`: a run directory
    (its final export, else its newest), or a Hugging Face checkpoint (inside a run's
    hf/ folder, that run's config applies)."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "config.yaml")):
        hf = os.path.join(path, "hf")
        exports = (
            sorted(
                (d for d in os.listdir(hf) if os.path.isfile(os.path.join(hf, d, "config.json"))),
                key=lambda d: (d == "final", int(d[1:]) if d[1:].isdigit() else -1),
            )
            if os.path.isdir(hf)
            else []
        )
        if not exports:
            raise ConfigError("RUN_DIR", f"{path!r} has no Hugging Face export under hf/: nothing to evaluate")
        return path, os.path.join(hf, exports[-1])
    if os.path.isfile(os.path.join(path, "config.json")):
        run_dir = os.path.dirname(os.path.dirname(path))
        return (run_dir if os.path.isfile(os.path.join(run_dir, "config.yaml")) else None), path
    raise ConfigError("RUN_DIR", f"{path!r} is neither a meshrl run directory (config.yaml) nor a Hugging Face checkpoint (config.json)")


async def evaluate_checkpoint(config: Config, checkpoint_dir: str, tokenizer_dir: str) -> tuple[dict[str, float], list[dict]]:
    """Evaluate `checkpoint_dir` on `config`'s held-out prompts: one generator replica and
    one rollout worker on a local mesh, stopped on every exit path."""
    from meshrl.controller.replicas import GeneratorPool
    from meshrl.data import eval_records
    from meshrl.launch import allocate
    from meshrl.agent.actor import RolloutWorkerActor

    records = eval_records(config)
    async with allocate(config) as alloc:

        async def no_rewiring() -> None:
            return None

        generators = GeneratorPool(config, alloc, checkpoint_dir, 0, no_rewiring)
        procs = None
        try:
            await generators.start(1)
            procs = alloc.host_mesh("coord").spawn_procs(per_host={"procs": 1})
            worker = procs.spawn("eval_worker", RolloutWorkerActor, config.to_dict(), tokenizer_dir, 0)
            await asyncio.wait_for(awaited(worker.set_generators.call_one(generators.handles())), 300)
            return await evaluate_on(worker, records, 0, config.eval.k, eval_timeout_s(config, len(records)))
        finally:
            if procs is not None:
                try:
                    await asyncio.wait_for(procs.stop(), 60)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            await generators.shutdown()


def write_results(path: str, metrics: dict[str, float], results: list[dict], records: list[dict], checkpoint: str | None = None) -> None:
    """The metrics and every prompt's greedy answer and rewards, as JSON (with the checkpoint
    evaluated, where `meshrl eval` named one)."""
    rows = [{"prompt": rec.get("prompt"), "answer": rec.get("answer"), **res} for rec, res in zip(records, results)]
    with open(path, "w") as f:
        json.dump({**({"checkpoint": checkpoint} if checkpoint else {}), "metrics": metrics, "prompts": rows}, f, indent=1, default=str)
