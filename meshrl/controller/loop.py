"""The RL loop: meshes, wiring, and one training step at a time.

    records --> EpisodeQueue --claim--> rollout workers <--turns--> generators (vLLM)
                     ^   |                  (env.reset, model turn, env.step, ...)
                     |   +<--finished groups--+
                     |   +--batch--> trainer --publish v--> weight sync --> generators
                     +------ version v (admission) ---+

The loops run inside the actors: workers claim groups and play them against the
generation service, the trainer pulls its batch from the queue and tells it the new
version. The controller (`RLLoop`) only starts things, says "step", moves weights to the
generators in the background, and reads metrics, so it is never on the data path.
Synchronous on-policy training, one-step overlap and fully asynchronous training differ
only in config (buffer.depth, buffer.max_lag, generator.update_mode), all applied by the
queue's admission and the generator's version gate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

import torch

from meshrl.compat import awaited
from meshrl.config import Config
from meshrl.controller.replicas import GeneratorPool, ScorerPool, WorkerPool
from meshrl.errors import one_line
from meshrl.launch.allocation import allocate
from meshrl.launch.devices import gpus_per_host, resolve_placement, resolve_transport, weights_on_gpu
from meshrl.launch.memory import plan_memory
from meshrl.logs import console
from meshrl.metrics import MetricsWriter
from meshrl.pinning import resolve_cpus
from meshrl.queue.actor import EpisodeQueueActor
from meshrl.rollout.env import RewardFn
from meshrl.scorers import ON_PROCS
from meshrl.stability import CliffWatch
from meshrl.tokenizer import build_char_tokenizer
from meshrl.trainer.actor import spawn_trainer
from meshrl.trainer.checkpoint import checkpoint_step, write_atomic
from meshrl.weightsync.connect import WeightSync

log = logging.getLogger("meshrl")
CHECKPOINT_FILE = "loop_state.pt"
HEALTH_CHECK_S = 5.0
"""How often a step waiting for its batch checks that generators and workers are alive."""
MAX_FAILURE_WARNINGS = 5
"""Distinct episode failures shown on the console in one run; later ones are in the metrics and logs."""


class RunFailed(RuntimeError):
    """The run stopped on a failure it can tell in one line (the message); `meshrl run` exits 1."""


class TrainerFailed(RunFailed):
    """A trainer proc died, or the host its batches come from: the run stops; resume it from its last checkpoint."""


class UserCodeFailed(RunFailed):
    """The user's code failed inside an actor (a data source, a sampling policy): the message
    is its one line, `role: ExceptionType: message (file:line; log: PATH)` (meshrl/errors.py)."""


class EpisodesFailed(RunFailed):
    """Every episode of `contracts.stop_after_failed_steps` consecutive steps failed: the run
    checkpointed and stopped, with the first failure's line."""


class RLLoop:
    """Owns every mesh of one run. Use `async with RLLoop(config) as loop: await loop.step()`."""

    def __init__(self, config: Config, run_dir: str | None = None, resume: bool = False, reward_fn: RewardFn | None = None):
        self.config = config
        self.run_dir = os.path.abspath(run_dir or config.logging.run_dir)
        config.logging.run_dir = self.run_dir  # every actor writes its log under it
        self.resume = resume
        self.reward_fn = reward_fn
        self.version = 0
        self.history: list[dict[str, float]] = []
        self.generators: GeneratorPool | None = None
        self.teacher: GeneratorPool | None = None
        self.scorers: ScorerPool | None = None
        self.workers: WorkerPool | None = None
        self._update_task: asyncio.Task | None = None
        self._snapshot_task: asyncio.Task | None = None
        self._eval_task: asyncio.Task | None = None
        self._last_step_end = None
        self._failed_steps = 0  # consecutive steps in which every episode failed
        self._warned: set[str] = set()  # failures already shown on the console
        self.watch = CliffWatch.from_config(config.alarm) if config.alarm.enabled else None

    # ---- start-up -----------------------------------------------------------------------
    async def __aenter__(self) -> "RLLoop":
        try:
            await self.start()
        except BaseException as e:
            await self.shutdown()
            line = one_line(e) if isinstance(e, Exception) else None
            if line is not None:  # the user's data or code failed in an actor as it started
                raise UserCodeFailed(line) from e
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def _install_fault_hook(self) -> None:
        """Monarch's default answer to a proc that dies is to interrupt the client. A run
        replaces dead generators and workers and reports a dead trainer itself, so failures
        are only logged here and surface as errors of the calls that touch the dead procs."""
        import monarch.actor

        self._previous_fault_hook = monarch.actor.unhandled_fault_hook

        def log_failure(failure) -> None:
            log.warning("mesh failure: %s", str(failure).strip().splitlines()[0][:300])

        monarch.actor.unhandled_fault_hook = log_failure

    def _restore_fault_hook(self) -> None:
        import monarch.actor

        if getattr(self, "_previous_fault_hook", None) is not None:
            monarch.actor.unhandled_fault_hook = self._previous_fault_hook
            self._previous_fault_hook = None

    async def start(self) -> None:
        c = self.config
        self._install_fault_hook()
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
            f.write(c.to_yaml())  # as given: `auto` placement is resolved again on the host that resumes it
        if c.launcher.kind in ("slurm", "workers") and c.launcher.gpus_per_host == 0 and c.trainer.device == "auto":
            print(f"meshrl: launcher.gpus_per_host=0: this {c.launcher.kind} run plans no GPUs (every role on CPU"
                  + (", and the Slurm job asks for none" if c.launcher.kind == "slurm" else "") + "); set it to the hosts' GPUs for a GPU run",
                  file=console())
        placement, why = resolve_placement(c)
        if c.placement == "auto" and gpus_per_host(c) == 0:  # the console says which CPU placement, and why
            print(f"meshrl: placement auto -> {placement} ({why})", file=console())
        c.placement, c.weight_sync.transport = placement, resolve_transport(c)
        c.trainer.cpus, c.generator.cpus = resolve_cpus(c)
        log.info("placement: %s, trainer cpus %r, generator cpus %r, weight transport %s", c.placement, c.trainer.cpus or "any",
                 c.generator.cpus or "any", c.weight_sync.transport)
        self.tokenizer_dir = c.model.tokenizer or c.model.path or build_char_tokenizer(os.path.join(self.run_dir, "tokenizer"))
        self.alloc = await allocate(c).__aenter__()
        # colocated on GPUs: the trainer frees memory (and AdamW's state where the memory plan says) before the engines wake
        memory = plan_memory(c, plan=self.alloc.plan) if self.alloc.plan.layout == "colocated" else None
        self._offload_optimizer = memory is not None and memory.offload_optimizer or c.trainer.offload_optimizer == "always"

        # The coordinator proc holds the episode queue; each rollout worker has a proc of its own.
        self.coord = self.alloc.host_mesh("coord").spawn_procs(per_host={"procs": 1}, bootstrap_command=self.alloc.bootstrap("coord"))
        self.queue = self.coord.spawn("queue", EpisodeQueueActor, c.to_dict())
        await self.queue.metrics.call_one()

        # setup (checkpoint loading), export and DCP calls are bounded like the trainer's collectives
        self.trainer = await spawn_trainer(c, c.trainer.collective_timeout_s, host_mesh=self.alloc.host_mesh("trainer"),
                                           hosts=self.alloc.hosts("trainer"), plan=self.alloc.plan)
        await self.trainer.publisher_handle()  # creates the publisher before its first step
        if self.resume:
            await self._restore()
        # Rows past the restored step belong to steps about to be trained again: cut them.
        wandb = dict(project=c.logging.wandb_project, mode=c.logging.wandb_mode, config=c.to_dict()) if c.logging.wandb else None
        self.metrics = MetricsWriter(self.run_dir, tensorboard=c.logging.tensorboard, keep_until=self.version, wandb=wandb)
        self._last_checkpoint = time.monotonic()
        initial = await self.trainer.export_hf(os.path.join(self.run_dir, "hf", f"v{self.version}"), self._lora_base_dir())
        self.generators = GeneratorPool(c, self.alloc, initial, self.version, self._rewire)
        await self.generators.start(c.generator.replicas)
        self.weight_sync = await WeightSync(c.weight_sync, self.alloc.controller_address(), weights_on_gpu(self.alloc.plan, c.weight_sync.transport)).connect(await self.trainer.publisher_handle(), await self._subscribers())
        teacher = None
        if c.distill.teacher:  # on-policy distillation: a replica on the teacher's checkpoint scores every episode
            self.teacher = GeneratorPool(c, self.alloc, c.distill.teacher, 0, self._rewire_teacher, teacher=True)
            await self.teacher.start(1)
            teacher = self.teacher.handles()[0]
        scorers = None
        if any(s.kind in ON_PROCS for s in c.scoring.scorers):  # reward models, judges, remote clients: procs of their own
            self.scorers = ScorerPool(c, self.alloc, self._rewire_scorers)
            await self.scorers.start()
            scorers = self.scorers.handles()
        self.workers = WorkerPool(c, self.alloc, self.tokenizer_dir, self.queue, self.reward_fn, teacher, scorers)
        await self.workers.start(self.generators.handles())
        if c.eval.every:
            from meshrl.data import eval_records

            self.eval_records = eval_records(c)
        self._last_step_end = time.monotonic()

    async def _subscribers(self) -> list:
        return [await awaited(r.actor.weight_sync_handle.call_one()) for r in self.generators.replicas]

    async def _rewire(self) -> None:
        """After a replica was replaced or added: weight sync and the workers follow."""
        await self.weight_sync.reconnect(subscribers=await self._subscribers())
        if self.workers is not None:
            await self.workers.set_generators(self.generators.handles())

    async def _rewire_scorers(self) -> None:
        if self.workers is not None:
            await self.workers.set_scorers(self.scorers.handles())

    async def _rewire_teacher(self) -> None:
        if self.workers is not None:
            await self.workers.set_teacher(self.teacher.handles()[0])

    # ---- one step ---------------------------------------------------------------------------
    async def step(self) -> dict[str, float]:
        """Train on one batch from the queue, move the generators to the new version in the
        background, and record metrics."""
        c = self.config
        handoff, call_start = {}, time.monotonic()
        try:
            if c.placement == "colocate":
                handoff = await self._hand_devices_to_trainer()
                call_start = time.monotonic()
            out = await self._watching(asyncio.ensure_future(self.trainer.train_from_queue(self.queue, c.batch_groups, c.buffer.get_timeout_s)))
        except Exception as e:  # noqa: BLE001 - a dead trainer proc ends the run, resumably
            line = one_line(e)
            if line is not None:  # the user's data or code failed in the queue: its one line, not the trainer's trace
                raise UserCodeFailed(line) from e
            if "rollouts are not arriving" in str(e):
                raise TimeoutError(f"no batch for version {self.version} within buffer.get_timeout_s={c.buffer.get_timeout_s:.0f}s: "
                                   "rollouts are not arriving; check the generators and envs") from e
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            if not await self._queue_answers():  # the trainer's call failed because the batches' source did
                raise self._queue_lost() from e
            raise TrainerFailed(f"the trainer failed at version {self.version} ({type(e).__name__}: {first}); {self._how_to_resume()}") from e
        self.version = out["version"]
        out["time/trainer_call_s"] = time.monotonic() - call_start
        out.update(handoff)
        try:
            if self._colocated_on_policy():  # the engines wake on the new version: loaded while they sleep
                out["colocate/load_s"] = await self._update_generators(self.version)
            if c.placement == "colocate":
                if self.alloc.plan.layout == "colocated":  # the GPU is the trainer's until the engines wake
                    out.update(await self.trainer.release_memory(self._offload_optimizer))
                t0 = time.monotonic()
                await self.generators.wake()
                out["colocate/wake_s"] = time.monotonic() - t0
            if self._update_task is not None:  # in the background since the last step: usually done
                t0 = time.monotonic()
                out["sync/previous_update_s"] = await self._finish_update()
                out["sync/previous_update_wait_s"] = time.monotonic() - t0
            if not self._colocated_on_policy():
                self._update_task = asyncio.create_task(self._update_generators(self.version))
            row = await self._collect_metrics(out)
            await self._watch_failures(row)
            self._evaluate_if_due()
            if self._checkpoint_due():
                await self.checkpoint()
            self._watch_cliffs(row)
        except Exception as e:  # noqa: BLE001 - the coordinator's host can go down between two calls too
            if not await self._queue_answers():
                raise self._queue_lost() from e
            raise
        return row

    def _checkpoint_due(self) -> bool:
        every, every_s = self.config.trainer.checkpoint_every, self.config.trainer.checkpoint_every_s
        return bool(every and self.version % every == 0 or every_s and time.monotonic() - self._last_checkpoint >= every_s)

    async def _hand_devices_to_trainer(self) -> dict[str, float]:
        """placement=colocate, before the trainer's call: the previous weight load done, the
        batch complete (nothing more is admitted until the trainer's next version), then the
        generators asleep, their devices the trainer's until `wake`."""
        c = self.config
        out = {}
        t0 = time.monotonic()
        if self._update_task is not None:
            out["sync/previous_update_s"] = await self._finish_update()
        ready = await self._watching(asyncio.ensure_future(awaited(self.queue.wait_ready.call_one(c.batch_groups, c.buffer.get_timeout_s))))
        if not ready:  # the trainer's own wait reports it, with the queue's counts
            return out
        out["colocate/generate_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        await self.generators.sleep(keep_weights=not self._colocated_on_policy())
        out["colocate/sleep_s"] = time.monotonic() - t0
        return out

    def _colocated_on_policy(self) -> bool:
        """placement=colocate: each version is loaded while the engines sleep, and they wake
        on it (on GPU they drop their weights when they sleep, instead of copying them to
        host memory and back). Always on GPUs: one step off would pay that round trip every
        step to gain nothing, since loading pauses the engine anyway. On CPU with max_lag >= 1
        (one step off) the engines wake on the weights they hold and the new version loads
        while they generate."""
        c = self.config
        return c.placement == "colocate" and (c.buffer.max_lag == 0 or self.alloc.plan.layout == "colocated")

    async def _watch_failures(self, row: dict) -> None:
        """The failure breaker: a warning line when more than contracts.warn_failed_frac of
        the step's episodes failed (once per distinct failure), and a checkpoint and
        EpisodesFailed when every episode of contracts.stop_after_failed_steps steps in a
        row failed. A step in which no episode finished counts neither way."""
        k = self.config.contracts
        count, failed = row.get("episode/count", 0.0), row.get("episode/failed", 0.0)
        if count <= 0:
            return
        first = row.get("episode/first_failure") or "(no reason reported)"
        if failed > k.warn_failed_frac * count:
            key = re.sub(r"\d+", "#", first.split(": ", 1)[-1])  # the same failure from another worker or record
            if key not in self._warned and len(self._warned) < MAX_FAILURE_WARNINGS:
                self._warned.add(key)
                log.warning("step %d: %d of %d episodes failed; the first: %s", self.version, failed, count, first)
        self._failed_steps = self._failed_steps + 1 if failed >= count else 0
        if k.stop_after_failed_steps and self._failed_steps >= k.stop_after_failed_steps:
            await self.checkpoint()
            raise EpisodesFailed(f"every episode of the last {self._failed_steps} steps failed; the first of step {self.version}: {first}; "
                                 f"fix it, then continue from the checkpoint at step {self.version} with: meshrl run --resume {self.run_dir}")

    def _watch_cliffs(self, row: dict) -> None:
        """The run-level alarm (meshrl/stability.py): one console line per cliff, after this
        step's checkpoint (if any) so that it counts as written before the cliff showed."""
        if self.watch is None:
            return
        for alarm in self.watch.update(self.version, row):
            row[f"alarm/{alarm.kind}"] = self.history[-1][f"alarm/{alarm.kind}"] = 1.0
            log.warning("%s", alarm.line(self.config.alarm.window, self.config.alarm.reward_drop))

    def _how_to_resume(self) -> str:
        if os.path.isfile(os.path.join(self.run_dir, "checkpoints", "latest")):
            return f"resume from the last checkpoint with: meshrl run --resume {self.run_dir}"
        return "no checkpoint was written yet"

    def _queue_lost(self) -> TrainerFailed:
        return TrainerFailed(f"the episode queue stopped answering at version {self.version}: its host "
                             f"(the coordinator's, with the rollout workers) is down or unreachable; {self._how_to_resume()}")

    # ---- evaluation beside training (controller/evaluation.py) ------------------------------
    def _evaluate_if_due(self) -> None:
        """Start the evaluation of this version in the background every eval.every steps and
        at the last one. One runs at a time: a due one is skipped while the previous still
        runs, except the last step's, which waits for it."""
        every = self.config.eval.every
        last = self.version >= self.config.steps
        if not every or not (self.version % every == 0 or last):
            return
        previous = self._eval_task
        if previous is not None and not previous.done() and not last:
            log.warning("evaluation of step %d skipped: the previous one still runs", self.version)
            return
        self._eval_task = asyncio.create_task(self._evaluate(self.version, previous))

    async def _evaluate(self, version: int, previous: asyncio.Task | None = None) -> dict[str, float] | None:
        from meshrl.controller.evaluation import eval_timeout_s, evaluate_on, write_results

        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        try:
            worker = self.workers.workers[0].actor
            row, results = await evaluate_on(worker, self.eval_records, version, self.config.eval.k,
                                             eval_timeout_s(self.config, len(self.eval_records)))
            os.makedirs(os.path.join(self.run_dir, "eval"), exist_ok=True)
            write_results(os.path.join(self.run_dir, "eval", f"step_{version:06d}.json"), row, results, self.eval_records)
        except Exception as e:  # noqa: BLE001 - a failed evaluation is reported, training goes on
            log.warning("evaluation of step %d failed: %s", version, (str(e).strip().splitlines() or [type(e).__name__])[0][:200])
            return None
        self.history.append({"step": version, **row})
        self.metrics.write(version, row)
        k = self.config.eval.k
        log.info("eval at step %d: greedy accuracy %.3f, pass@%d %.3f, mean reward %.3f",
                 version, row["eval/greedy_accuracy"], k, row[f"eval/pass@{k}"], row["eval/reward_mean"])
        return row

    async def finish_evaluation(self) -> dict[str, float] | None:
        """Wait for the evaluation in flight (the last step's, at the end of a run)."""
        task, self._eval_task = self._eval_task, None
        return await task if task is not None else None

    async def evaluate_now(self) -> dict[str, float] | None:
        """Evaluate the current version now (interactive sessions), after any in flight."""
        if not getattr(self, "eval_records", None):
            from meshrl.data import eval_records

            self.eval_records = eval_records(self.config)
        self._eval_task = asyncio.create_task(self._evaluate(self.version, self._eval_task))
        return await self.finish_evaluation()

    async def _queue_answers(self, timeout_s: float = 10.0) -> bool:
        try:
            await asyncio.wait_for(awaited(self.queue.metrics.call_one()), timeout_s)
            return True
        except Exception:  # noqa: BLE001 - dead, unreachable or too slow: all the same here
            return False

    async def _update_generators(self, version: int) -> float:
        t0 = time.monotonic()
        await self.generators.update(version)
        return time.monotonic() - t0

    async def _finish_update(self) -> float:
        task, self._update_task = self._update_task, None
        return await task

    async def check_health(self) -> None:
        """Replace dead generator replicas and rollout workers (between steps, and every
        HEALTH_CHECK_S during one)."""
        await self.generators.check(self.version)
        if self.teacher is not None:
            await self.teacher.check(0)
        if self.scorers is not None:
            await self.scorers.check()
        await self.workers.check(self.generators.handles())

    async def _watching(self, call: asyncio.Future):
        """The trainer's call, with dead replicas and workers replaced while it waits: one
        that dies mid-step holds groups its batch needs, which would otherwise come back
        only when the batch timed out."""
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=HEALTH_CHECK_S)
                if done:
                    return call.result()
                try:
                    await self.check_health()
                except Exception as e:  # noqa: BLE001 - the next check tries again
                    log.warning("health check during a step failed: %s", (str(e).splitlines() or [type(e).__name__])[0][:200])
        except asyncio.CancelledError:
            call.cancel()
            raise

    async def _collect_metrics(self, out: dict) -> dict[str, float]:
        now = time.monotonic()
        wall = now - self._last_step_end
        self._last_step_end = now
        row = {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}
        row["trained_groups"] = out.get("trained_groups", [])  # kept in history, not in metrics.jsonl
        row["time/step_s"] = wall
        row["time/controller_s"] = max(0.0, wall - out.get("time/trainer_call_s", wall))  # the step's time outside the trainer's call
        row["trainer/idle_frac"] = min(1.0, out.get("trainer/wait_s", 0.0) / max(wall, 1e-9))
        # Generator stats are read in the background, right after the previous step: a replica
        # is busy applying the weight update just sent to it, and waiting for its answer here
        # would put that on the trainer's critical path every step.
        snapshot = self._snapshot_task or asyncio.create_task(self.generators.read_stats())
        self._snapshot_task = None
        queue_metrics, worker_metrics, stats_read = await asyncio.gather(
            awaited(self.queue.metrics.call_one()), self.workers.metrics(), snapshot
        )
        row.update(queue_metrics)
        row.update(worker_metrics)
        idle, tokens, seconds, versions = [], 0.0, 0.0, []
        for r, at, stats in stats_read:
            if stats is None or r not in self.generators.replicas:
                continue
            versions.append(stats.get("version", 0))
            prev, r.last_stats = r.last_stats, stats
            window, r.last_stats_at = (at - r.last_stats_at if r.last_stats_at is not None else wall), at
            busy = stats.get("busy_s", 0.0) - prev.get("busy_s", 0.0)
            idle.append(1.0 - min(1.0, busy / max(window, 1e-9)))
            tokens += stats.get("tokens_generated", 0) - prev.get("tokens_generated", 0)
            seconds = max(seconds, window)
        if idle:
            row["generator/idle_frac"] = sum(idle) / len(idle)
            row["generator/version"] = float(min(versions))  # the oldest replica's weights, read after the previous step
        row["generator/tokens_per_s"] = tokens / max(seconds or wall, 1e-9)
        row["generator/replicas_replaced"] = float(self.generators.replaced)
        if self.scorers is not None:
            row["scoring/replicas_replaced"] = float(self.scorers.replaced)
        self.history.append({"step": self.version, **row})
        self.metrics.write(self.version, row)
        self._snapshot_task = asyncio.create_task(self.generators.read_stats())  # for the next step
        return row

    # ---- interactive control (Session) ------------------------------------------------------
    async def generate_text(self, prompts: list[str], temperature: float | None = None) -> list[list[str]]:
        """A group of completions (generator.group_size) per prompt text, from the current
        policy on replica 0."""
        from meshrl.tokenizer import load_tokenizer

        tok = load_tokenizer(self.tokenizer_dir)
        gen = self.generators.replicas[0].actor
        n = self.config.generator.group_size

        async def one(text: str) -> str:
            out = await awaited(gen.generate.call_one(tok.encode(text, add_special_tokens=False), None, temperature, 0))
            return tok.decode(out.token_ids, skip_special_tokens=True)

        return [list(await asyncio.gather(*(one(t) for _ in range(n)))) for t in prompts]

    async def wait_for_generators(self) -> None:
        """Until every replica runs the trainer's current version: each step starts the
        update to its new version, so waiting for the pending update is enough."""
        if self._update_task is not None:
            await self._finish_update()

    async def export_to(self, path: str) -> str:
        """The current policy as a Hugging Face checkpoint at `path`, with its tokenizer, so
        that transformers, vLLM and `meshrl eval` load it alone."""
        from meshrl.tokenizer import load_tokenizer

        path = await self.trainer.export_hf(path, self._lora_base_dir())
        load_tokenizer(self.tokenizer_dir).save_pretrained(path)
        return path

    def _lora_base_dir(self) -> str:
        """Where a from-scratch LoRA policy's frozen base weights are exported (its adapters'
        PEFT base): once per run, beside the versions."""
        return os.path.join(self.run_dir, "hf", "base")

    async def pause_generation(self) -> None:
        await asyncio.gather(*(awaited(r.actor.pause_generation.call_one()) for r in self.generators.replicas))

    async def resume_generation(self) -> None:
        await asyncio.gather(*(awaited(r.actor.resume_generation.call_one()) for r in self.generators.replicas))

    async def set_knobs(self, lr: float | None = None, max_lag: int | None = None) -> None:
        """Change the learning rate or the staleness bound (admission follows it) between steps."""
        if lr is not None:
            if not lr > 0:
                raise ValueError(f"lr must be positive, got {lr}")
            await self.trainer.set_lr(lr)
            self.config.trainer.lr = lr
        if max_lag is not None:
            if max_lag < 0:
                raise ValueError(f"max_lag must be at least 0, got {max_lag}")
            await awaited(self.queue.set_max_lag.call_one(max_lag))
            self.config.buffer.max_lag = max_lag

    async def scale_generators(self, replicas: int) -> None:
        """Add or remove generator replicas; groups on a removed replica are played again."""
        await self.generators.scale(replicas, self.version)
        self.config.generator.replicas = replicas

    # ---- checkpoint and resume ----------------------------------------------------------------
    async def checkpoint(self) -> str:
        """Trainer state (DCP), the episode queue and the metrics history, atomically."""
        root = os.path.join(self.run_dir, "checkpoints")
        trainer_dir = await self.trainer.save_checkpoint(os.path.join(root, "trainer"))
        # After an interrupted step the trainer may have finished a step the loop never saw
        # (its metrics row is lost, its weights are not).
        self.version = max(self.version, checkpoint_step(trainer_dir))
        state = {
            "version": self.version,
            "trainer_dir": trainer_dir,
            "queue": await awaited(self.queue.state_dict.call_one()),
            "history": self.history,
        }
        path = os.path.join(root, f"step_{self.version:06d}_{CHECKPOINT_FILE}")
        tmp = path + ".tmp"
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        write_atomic(os.path.join(root, "latest"), os.path.basename(path))
        self._last_checkpoint = time.monotonic()
        if self.watch is not None:
            self.watch.checkpointed(self.version)
        return path

    async def _restore(self) -> None:
        root = os.path.join(self.run_dir, "checkpoints")
        latest = os.path.join(root, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{self.run_dir} has no checkpoint to resume from ({latest} missing)")
        with open(latest) as f:
            state = torch.load(os.path.join(root, f.read().strip()), weights_only=False)
        self.version = await self.trainer.load_checkpoint(state["trainer_dir"])
        if self.version != state["version"]:
            raise RuntimeError(f"trainer checkpoint is at version {self.version}, loop state at {state['version']}")
        await awaited(self.queue.load_state_dict.call_one(state["queue"]))
        self.history = state["history"]
        if self.watch is not None:  # the alarm picks up where it was, checkpoints included, silently
            saved = {int(name[5:11]) for name in os.listdir(root) if name.startswith("step_") and name.endswith(CHECKPOINT_FILE)}
            for row in self.history:
                if row.get("step") in saved:
                    self.watch.checkpointed(int(row["step"]))
                self.watch.update(int(row.get("step", 0)), row)

    # ---- the end -------------------------------------------------------------------------------
    async def export(self) -> str:
        return await self.export_to(os.path.join(self.run_dir, "hf", "final"))

    async def shutdown(self) -> None:
        """Stop everything this loop started, on every exit path; never raises."""
        for task in (self._snapshot_task, self._update_task, self._eval_task):
            if task is not None:
                task.cancel()
        if self.workers is not None:
            await self.workers.shutdown()
        if getattr(self, "queue", None) is not None:
            try:
                await asyncio.wait_for(awaited(self.queue.close.call_one()), 30)
            except Exception:  # noqa: BLE001 - best effort; its proc is stopped below
                pass
        for pool in (self.generators, self.teacher, self.scorers):
            if pool is not None:
                await pool.shutdown()
        if getattr(self, "trainer", None) is not None:
            try:
                await self.trainer.stop()
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "coord", None) is not None:
            try:
                await asyncio.wait_for(self.coord.stop(), 60)
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "alloc", None) is not None:
            await self.alloc.__aexit__(None, None, None)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self._restore_fault_hook()
