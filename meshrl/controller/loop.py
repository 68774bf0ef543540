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
import time

from meshrl.compat import monarch_unprefixed_logs
from meshrl.config import Config
from meshrl.controller import checkpoint as checkpoints, colocate
from meshrl.controller.breaker import FailureBreaker, report_cliffs, report_divergence
from meshrl.controller.collect import StepMetrics
from meshrl.controller.evaluation import Evaluations
from meshrl.controller.heal import TrainerHealer
from meshrl.controller.members import MeshFailureLog, all_ended, in_order
from meshrl.controller.partners import TrainedModel, lost_partner, served_pools
from meshrl.controller.replicas import GeneratorPool, ScorerPool, WorkerPool
from meshrl.errors import BatchTimeout, TrainerFailed, UserCodeFailed, find, first_line, one_line
from meshrl.futures import bounded, settled, unless_lost
from meshrl.launch.allocation import LOST_HOST_STOP_S, allocate
from meshrl.launch.devices import weights_on_gpu
from meshrl.metrics import MetricsWriter
from meshrl.pinning import settle_layout
from meshrl.queue.actor import EpisodeQueueActor
from meshrl.rollout.env import RewardFn
from meshrl.scorers import ON_PROCS
from meshrl.stability import CliffWatch, DivergenceWatch, RewardDiverged
from meshrl.tokenizer import build_char_tokenizer
from meshrl.trainer.actor import spawn_trainer
from meshrl.trainer.critic_actor import spawn_critic
from meshrl.weightsync.connect import WeightSync

log = logging.getLogger("meshrl")
HEALTH_CHECK_S = 5.0
"""How often a step waiting for its batch checks that the queue, generators and workers are alive."""
QUEUE_SILENT_CHECKS = 2
"""Health checks in a row the episode queue must leave unanswered (each bounded by
`_queue_answers`' timeout) before the run stops as lost: its host is down, and without this
the trainer would notice only when `buffer.get_timeout_s` ran out. Two, so that one slow
answer on a loaded host never ends a run."""


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
        self.critic = None  # PPO's critic (trainer.loss.advantage=gae): a CriticMesh
        self.partners: list[TrainedModel] = []  # config.models: trained models beside the policy (controller/partners.py)
        self.served: dict[str, GeneratorPool] = {}  # and the frozen ones: generators alone
        self.collect: StepMetrics | None = None
        self.evaluations: Evaluations | None = None
        self._update_task: asyncio.Task | None = None
        self.mesh_failures = MeshFailureLog()  # logged, not Monarch's interrupt (controller/members.py)
        self.breaker = FailureBreaker(config)
        self.healer = TrainerHealer(self)  # replaces a dead trainer mesh (controller/heal.py)
        self.watch = CliffWatch.from_config(config) if config.alarm.enabled else None
        self.divergence = DivergenceWatch.from_config(config)  # None without a signal the run does not train on
        self._divergence_seen = 0  # history rows the divergence watch has read (evaluations' included)
        self._queue_silent = 0  # health checks in a row the queue left unanswered

    # ---- start-up -----------------------------------------------------------------------
    async def __aenter__(self) -> "RLLoop":
        try:
            await self.start()
        except BaseException as e:
            await self.shutdown()
            if (line := one_line(e) if isinstance(e, Exception) else None) is not None:  # the user's data or code failed in an actor as it started
                raise UserCodeFailed(line) from e
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def start(self) -> None:
        c = self.config
        monarch_unprefixed_logs()  # meshrl's lines as written, once (compat.py)
        self.mesh_failures.install()
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
            f.write(c.to_yaml())  # as given: `auto` placement is resolved again on the host that resumes it
        settle_layout(c)  # placement, weight transport and cores decided for this host
        cpus = f"trainer cpus {c.trainer.cpus or 'any'!r}, generator cpus {c.generator.cpus or 'any'!r}"
        log.info("placement: %s, %s, weight transport %s", c.placement, cpus, c.weight_sync.transport)
        self.tokenizer_dir = c.model.tokenizer or c.model.path or build_char_tokenizer(os.path.join(self.run_dir, "tokenizer"))
        self.alloc = await allocate(c).__aenter__()
        self._offload_optimizer = colocate.offloads_optimizer(c, self.alloc.plan)
        # The coordinator proc holds the episode queue; each rollout worker has a proc of its own.
        self.coord = self.alloc.host_mesh("coord").spawn_procs(per_host={"procs": 1}, bootstrap_command=self.alloc.bootstrap("coord"))
        self.queue = self.coord.spawn("queue", EpisodeQueueActor, c.to_dict())
        # Generators and workers get their procs now (importing vLLM, loading envs while the trainer starts), set up once it exported its weights.
        self.generators = GeneratorPool(c, self.alloc, None, 0, self._rewire)
        self.generators.warm(c.generator.replicas)
        self.workers = WorkerPool(c, self.alloc, self.tokenizer_dir, self.queue, self.reward_fn)
        self.workers.warm()

        bound = c.trainer.collective_timeout_s  # the trainer's setup (checkpoint loading), export and DCP calls, the queue's start
        self.trainer = await spawn_trainer(c, bound, host_mesh=self.alloc.host_mesh("trainer"), hosts=self.alloc.hosts("trainer"), plan=self.alloc.plan)
        await self.trainer.publisher_handle()  # creates the publisher before its first step
        await bounded(self.queue.metrics.call_one(), bound, "the episode queue (its proc starting, its data loading)")
        await self.healer.watch()  # the trainer's procs, to tell a dead one (controller/heal.py)
        if c.trainer.loss.advantage == "gae":  # PPO's critic: critic.procs on the trainer's first host (its cores, or GPUs of their own)
            self.critic = await spawn_critic(c, self.alloc.host("trainer", 0), self.alloc.bootstrap("critic", list(range(c.critic.procs))))
        if self.resume:
            self.version, self.history = await checkpoints.restore(self.run_dir, self.trainer, self.queue, self.watch, self.critic, timeout_s=bound)
            self.healer.start_version = self.version
            self._divergence_seen = len(self.history)  # its divergence watch starts afresh: the alarm the last run stopped on is not raised again
            if self.divergence is not None:  # ...from the checkpoint it resumed, one to go back to
                self.divergence.checkpointed(self.version)
        # Rows past the restored step belong to steps about to be trained again: cut them.
        wandb = dict(project=c.logging.wandb_project, mode=c.logging.wandb_mode, config=c.to_dict()) if c.logging.wandb else None
        self.metrics = MetricsWriter(self.run_dir, tensorboard=c.logging.tensorboard, keep_until=self.version, wandb=wandb, restored=self.history)
        self._last_checkpoint = time.monotonic()
        initial = await self.trainer.export_hf(checkpoints.start_export(self.run_dir, self.version), checkpoints.lora_base_dir(self.run_dir))
        await colocate.release(self.alloc.plan, self.trainer, self._offload_optimizer)  # on a shared GPU, before the engines start
        self.generators.checkpoint_dir, self.generators.checkpoint_version = initial, self.version
        self.generators.source_lost = self.healer.trainer_dead  # an update cut off by a dead trainer keeps its replica

        async def generators() -> None:  # and weight sync to them
            await self.generators.start(c.generator.replicas)
            on_gpu, publisher = weights_on_gpu(self.alloc.plan, c.weight_sync.transport), await self.trainer.publisher_handle()
            self.weight_sync = await WeightSync(c.weight_sync, self.alloc.controller_address(), on_gpu).connect(publisher, self.generators.subscribers())

        if c.distill.teacher:  # on-policy distillation: a replica on the teacher's checkpoint scores every episode
            self.teacher = GeneratorPool(c, self.alloc, c.distill.teacher, 0, self._rewire_teacher, teacher=True)
        if any(s.kind in ON_PROCS for s in c.scoring.scorers):  # reward models, judges, remote clients: procs of their own
            self.scorers = ScorerPool(c, self.alloc, self._rewire_scorers, self.resume)
        saved = checkpoints.saved_models(self.run_dir) if self.resume else {}
        self.partners = [TrainedModel(c, spec.name, self.alloc, self._rewire_partner, self._offload_optimizer) for spec in c.models if not spec.frozen]
        self.served = served_pools(c, self.alloc, self._rewire_partner)
        # The policy's generators, the teacher, the scorers and each model start at once, each mostly waiting on its procs;
        # engines sharing GPUs (a colocated plan: every model's, a frozen one's, a judge's or a PRM's):
        # every trainer first, then each engine in turn (members.py `in_order`: why)
        shared = self.alloc.plan.layout == "colocated"
        if shared:
            await all_ended(*(p.start_trainer(self.version, *saved.get(p.name, (None, None))) for p in self.partners))
        starts = [generators(), *(p.start_generators() if shared else p.start(self.version, *saved.get(p.name, (None, None))) for p in self.partners)]
        starts += [pool.start(pool.config.generator.replicas) for pool in self.served.values()]
        starts += [self.teacher.start(1)] if self.teacher is not None else []
        starts += [self.scorers.start()] if self.scorers is not None else []
        await (in_order if shared else all_ended)(*starts)
        self.workers.teacher, self.workers.scorers = self.teacher and self.teacher.handles()[0], self.scorers.handles() if self.scorers else {}
        pools = {p.name: p.generators for p in self.partners} | self.served
        self.workers.partners = [pools[name].handles() for name in c.model_names()[1:]]
        await self.workers.start(self.generators.handles())
        # (an evaluation of a step a heal has since gone back past is not kept: that step is trained, and evaluated, again)
        self.evaluations = Evaluations(c, self.run_dir, self.workers, lambda step, row: step <= self.version and self._record(step, row))
        self.collect = StepMetrics(self.queue, self.generators, self.workers, self.scorers)

    async def _rewire(self) -> None:
        """After a replica was replaced or added: weight sync and the workers follow."""
        await self.weight_sync.reconnect(subscribers=self.generators.subscribers())
        if self.workers is not None:
            await self.workers.set_generators(self.generators.handles())

    async def _rewire_scorers(self) -> None:
        if self.workers is not None:
            await self.workers.set_scorers(self.scorers.handles())

    async def _rewire_partner(self, handles: list, model: int) -> None:
        if self.workers is not None:
            await self.workers.set_generators(handles, model)

    async def _rewire_teacher(self) -> None:
        if self.workers is not None:
            await self.workers.set_teacher(self.teacher.handles()[0])

    # ---- one step ---------------------------------------------------------------------------
    async def step(self) -> dict[str, float]:
        """Train on one batch from the queue, move the generators to the new version in the
        background, and record metrics."""
        c, self._stepping = self.config, asyncio.current_task()  # (a Session's step Ctrl-C left running: shutdown cancels it)
        handoff: dict = {}
        # the trained models on the policy's batch at once (colocated: in turn, after the policy's trainer)
        partners = asyncio.ensure_future(self._train_partners()) if self.partners and c.placement != "colocate" else None
        try:
            while True:  # once, or again after the trainer was healed (controller/heal.py)
                try:
                    out = await self._train_call(handoff)
                    break
                except Exception as e:  # noqa: BLE001 - a dead trainer proc is healed, or ends the run resumably
                    await self._trainer_failed(e)
                    handoff.update(await self._woken_after_heal())
            if partners is not None:
                handoff.update(await self._watching(partners))
            elif self.partners:
                turn = lambda p: self._watching(asyncio.ensure_future(self._train_partners([p])))  # noqa: E731
                handoff.update(await colocate.models_in_turn(self.alloc.plan, self.trainer, self.partners, turn, self._offload_optimizer))
        finally:
            if partners is not None and not partners.done():
                partners.cancel()
        call_start = out.pop("_call_start")
        weights_id = out.pop("weights_id", None)  # the policy's generators relabelled where they hold these weights
        self.version = out["version"]
        out["time/trainer_call_s"] = time.monotonic() - call_start
        out.update(handoff)
        out.update(self.healer.metrics())
        try:
            load_asleep = colocate.wakes_on_new_version(c, self.alloc.plan)  # each version loaded while the engines sleep
            out.update(await colocate.after_step(self, weights_id))
            if self._update_task is not None:  # in the background since the last step: usually done
                t0 = time.monotonic()
                out["sync/previous_update_s"] = await self._finish_update()
                out["sync/previous_update_wait_s"] = time.monotonic() - t0
            if not load_asleep:
                self._update_task = asyncio.create_task(self._update_generators(self.version, weights_id))
            for p in self.partners:  # each model's generators follow in the background, unless loaded above
                out.setdefault(f"{p.name}/sync/previous_update_s", await p.finish_update())
                if not load_asleep:
                    p.update(self.version)
            row = await self.collect.row(out)
            recorded = self._record(self.version, row, write=False)  # written once the alarms have marked it
            try:
                await self._watch_failures(row)
                self.evaluations.start_if_due(self.version)
                if checkpoints.due(c, self.version, self._last_checkpoint):
                    await self.checkpoint()
                if self.watch is not None:  # after this step's checkpoint, so that it counts as written before a cliff showed
                    report_cliffs(self.watch, recorded["step"], row, recorded, self.config.alarm)
                if self.divergence is not None:
                    await self._watch_divergence(row, recorded)
            finally:  # under its own step, unless a heal in the checkpoint went back past it (it is trained again)
                if recorded["step"] <= self.version:
                    self.metrics.write(recorded["step"], row)
        except Exception as e:  # noqa: BLE001 - the coordinator's host can go down between two calls too
            if not await self._queue_answers():
                raise self._queue_lost() from e
            raise
        self._stepping = None  # done: its task may go on to other work (a shutdown cancels only a step under way)
        return row

    async def _train_call(self, handoff: dict) -> dict:
        """The trainer's call for one step (its start time under `_call_start`)."""
        c = self.config
        call_start = time.monotonic()
        if c.placement == "colocate":
            handoff.update(await self._hand_devices_to_trainer())
            call_start = time.monotonic()
        call = self.trainer.train_from_queue(self.queue, c.batch_groups, c.buffer.get_timeout_s, self.critic and self.critic.actor)
        out = await self._watching(asyncio.ensure_future(unless_lost(call, self.healer.trainer_dead)))  # a killed proc healed at once
        return {**out, "_call_start": call_start}

    async def _train_partners(self, partners: list | None = None) -> dict:
        """Each trained model beside the policy (`partners`: these), its step on the policy's batch (controller/partners.py),
        from the policy's `version` before its step (a heal of the policy meanwhile may take it back: they are then ahead)."""
        c, outs, partners, version = self.config, {}, self.partners if partners is None else partners, self.version
        calls = [p.train(self.queue, c.batch_groups, c.buffer.get_timeout_s, version) for p in partners]
        for p, out in zip(partners, await asyncio.gather(*calls)):
            if out.pop("version") != version + 1:
                raise TrainerFailed(f"trained model {p.name} is not at the policy's version {version + 1}: {checkpoints.how_to_resume(self.run_dir)}")
            outs.update(out)
        return outs

    async def _trainer_failed(self, e: Exception, call: str = "step") -> None:
        """The trainer's call failed: the user's code or the queue's timeout in one line, a lost
        queue ends the run resumably, a dead critic or trainer proc is healed (or, past the
        heal's bounds, ends the run resumably)."""
        c = self.config
        if isinstance(e, TrainerFailed):  # the health check found the queue's host gone: already the run's end
            raise e
        line = one_line(e)
        if line is not None:  # the user's data or code failed in the queue: its one line, not the trainer's trace
            raise UserCodeFailed(line) from e
        if find(e, BatchTimeout) is not None:  # the queue's sample, through the trainer's call
            raise TimeoutError(
                f"no batch for version {self.version} within buffer.get_timeout_s={c.buffer.get_timeout_s:.0f}s: "
                "rollouts are not arriving; check the generators and envs"
            ) from e
        if not await self._queue_answers():  # the trainer's call failed because the batches' source did
            raise self._queue_lost() from e
        if self.critic is not None and not await self.critic.answers():  # its proc died: a new one, restored
            await self.healer.heal_critic(e)
            return
        await self.healer.heal(e, call)

    async def _healing(self, call: str, make_call):
        """A trainer call outside the step (`make_call()`, which reads every trainer mesh when called): a trainer or
        critic proc that dies in it is healed, and the call is made again on the new mesh. The policy's state may then
        be older (`self.version` says which); a trained model's is trained back up to it. Any other failure is the call's own."""
        while True:
            try:
                return await make_call()
            except Exception as e:  # noqa: BLE001 - only a lost trainer or critic proc is healed here
                partner = next((p for p in self.partners if p.dead()), None) or await lost_partner(self.partners, e)
                if partner is not None and not self.healer.trainer_dead():
                    heal = partner.heal_outside_step(e, self.queue, (c := self.config).batch_groups, c.buffer.get_timeout_s, self.version)
                    await (colocate.asleep_while(self, partner, heal) if c.placement == "colocate" else heal)
                    continue
                if not (self.healer.lost_a_proc(e) or self.healer.critic_dead()):
                    raise
                colocated = self.config.placement == "colocate"  # the policy's healed with the engines asleep too
                await (colocate.asleep_while(self, None, self._trainer_failed(e, call)) if colocated else self._trainer_failed(e, call))

    async def _woken_after_heal(self) -> dict[str, float]:
        """placement=colocate: the engines slept for the dead trainer's step; with the healed version loaded (asleep on
        GPU every model's engines dropped their weights: each back at its trainer's version) they wake, as between steps."""
        if self.config.placement != "colocate":
            return {}
        if self._update_task is not None:  # the heal's update to the restored version
            await self._finish_update()
        await colocate.load_models(self.partners if colocate.wakes_on_new_version(self.config, self.alloc.plan) else [])
        return await colocate.wake_for_generators(self.alloc.plan, self.trainer, self._pools(), self._offload_optimizer)

    def _pools(self) -> list:  # the generator pools that sleep while the trainers step
        return [self.generators, *(p.generators for p in self.partners), *self.served.values()]

    async def _hand_devices_to_trainer(self) -> dict[str, float]:
        """placement=colocate, before the trainer's call: the previous weight load done, then
        the generators asleep on a complete batch (controller/colocate.py)."""
        t0 = time.monotonic()
        out = await colocate.settle_updates(self)
        out.update(await colocate.sleep_for_trainer(self.config, self.alloc.plan, self.queue, self._pools(), self._watching, t0))
        return out

    async def _watch_failures(self, row: dict) -> None:
        """The failure breaker (controller/breaker.py) warns, or trips: the run checkpoints and stops with EpisodesFailed."""
        first = self.breaker.tripped(self.version, row)
        if first is not None:  # its line says how to go on: from the checkpoint (a heal may move the version), or the one before if deferred
            step, saved = self.version, await self.checkpoint()
            raise self.breaker.stopped(first, step, checkpoints.go_on(self.run_dir, self.version, saved))

    async def _watch_divergence(self, row: dict, recorded: dict) -> None:
        """breaker.report_divergence on the history's new rows, evaluations' included; under
        alarm.on_divergence=stop the run checkpoints and stops with the line."""
        rows, self._divergence_seen = self.history[self._divergence_seen :], len(self.history)
        lines = report_divergence(self.divergence, rows, row, recorded)
        if lines and self.config.alarm.on_divergence == "stop":
            saved = await self.checkpoint()
            how = f"checkpointed at step {self.version} and stopped" if saved else f"stopped; {checkpoints.go_on(self.run_dir, self.version, None)}"
            raise RewardDiverged(f"{lines[0]}; alarm.on_divergence=stop: {how}")

    def _queue_lost(self) -> TrainerFailed:
        why = "its host (the coordinator's, with the rollout workers) is down or unreachable"
        return TrainerFailed(f"the episode queue stopped answering at version {self.version}: {why}; {checkpoints.how_to_resume(self.run_dir)}")

    async def _queue_answers(self, timeout_s: float = 10.0) -> bool:
        return await settled(self.queue.metrics.call_one(), timeout_s) is None  # dead, unreachable or too slow: all the same

    async def _update_generators(self, version: int, weights_id: str | None = None) -> float:
        t0 = time.monotonic()
        await self.generators.update(version, weights_id)
        return time.monotonic() - t0

    async def _finish_update(self) -> float:
        task, self._update_task = self._update_task, None
        return await task

    async def check_health(self) -> None:
        """Stop the run if the episode queue's host is gone; replace dead generator replicas
        and rollout workers (between steps, and every HEALTH_CHECK_S during one)."""
        error = None
        if await self._queue_answers():  # nothing else is replaced while its host may be gone
            self._queue_silent = 0
            try:
                await self.generators.check(self.version)
                for p in self.partners:
                    await p.check(self.version)
                for pool in self.served.values():  # a frozen model's replicas: version 0 for good
                    await pool.check(0)
                if self.teacher is not None:
                    await self.teacher.check(0)
                if self.scorers is not None:
                    await self.scorers.check()
                return await self.workers.check(self.generators.handles())
            except Exception as e:  # noqa: BLE001 - a replacement that met the queue's host going down counts as its silence
                if await self._queue_answers():
                    raise
                error = e
        self._queue_silent += 1
        if self._queue_silent >= QUEUE_SILENT_CHECKS:
            raise self._queue_lost() from error

    async def _watching(self, call: asyncio.Future):
        """The trainer's call, with dead replicas and workers replaced while it waits: one that dies
        mid-step holds groups its batch needs, which would otherwise return only at the batch's timeout."""
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=HEALTH_CHECK_S)
                if done:
                    return call.result()
                try:
                    await self.check_health()
                except TrainerFailed:  # the queue's host is gone: the run stops resumably
                    raise
                except Exception as e:  # noqa: BLE001 - the next check tries again
                    log.warning("health check during a step failed: %s", first_line(str(e), 200) or type(e).__name__)
        except BaseException:  # cancelled, or the run stops: the call is abandoned, its failure with it
            call.cancel()
            call.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise

    def _record(self, step: int, row: dict, write: bool = True) -> dict:
        """A step's (or an evaluation's) row: into the history (the entry, returned) and, where `write`, the metrics files."""
        self.history.append(entry := {"step": step, **row})
        if write:
            self.metrics.write(step, row)
        return entry

    # ---- checkpoint and export (controller/checkpoint.py) ------------------------------------
    async def export_to(self, path: str) -> str:
        """The current policy as a Hugging Face checkpoint at `path`, with its tokenizer (a
        trainer that dies meanwhile is healed, and the export made from the restored state)."""
        return await self._healing("export", lambda: checkpoints.export_hf(self.trainer, path, self.run_dir, self.tokenizer_dir))

    async def checkpoint(self, heal: bool = True) -> str | None:
        """Trainer state (DCP), the episode queue and the metrics history, atomically. A trainer that dies meanwhile is
        healed (`heal`) and the restored state saved: it may be older, the run training those steps again (None, nothing
        saved, while trained models are ahead of it: checkpoints.save). After Ctrl-C or SIGTERM (`heal=False`), no heal."""
        t, alarms = self.config.trainer, (self.watch, self.divergence)  # (the checkpoints an alarm names are kept, too)
        names, bounds = self.config.model_names(), {"timeout_s": t.collective_timeout_s, "keep": t.keep_checkpoints, "alarms": alarms}
        save = lambda: checkpoints.save(self.run_dir, self.trainer, self.queue, self.version, self.history, self.critic, self.partners, names, **bounds)  # noqa: E731
        path, self.version = await (self._healing("checkpoint", save) if heal else save())
        if path is None:
            return None
        if self.scorers is not None:  # an implicit PRM's state beside it
            await self.scorers.save_trained()
        self._last_checkpoint = time.monotonic()
        for watch in filter(None, alarms):  # a checkpoint an alarm may name as the last good one
            watch.checkpointed(self.version)
        return path

    # ---- the end -------------------------------------------------------------------------------
    async def export(self) -> str:
        """The policy's final HF checkpoint (hf/final), each trained model's and implicit PRM's
        beside it (hf/final-NAME), PPO's critic as a token classifier (hf/final-critic)."""
        if self.scorers is not None:
            await checkpoints.export_scorers(self.scorers, self.run_dir, self.tokenizer_dir)
        if self.critic is not None:
            await self._healing("export", lambda: checkpoints.export_critic(self.critic, self.run_dir, self.tokenizer_dir))
        for p in self.partners:  # hf/final-NAME (its own LoRA base), and its critic's beside it
            await self._healing("export", lambda p=p: p.export(self.run_dir, self.tokenizer_dir))
        return await self.export_to(os.path.join(self.run_dir, "hf", "final"))

    async def shutdown(self) -> None:
        """Stop everything this loop started, on every exit path; never raises."""
        self.mesh_failures.quiet()  # what it stops reports as failing: into the log file, not onto the console
        stepping = getattr(self, "_stepping", None)  # a step left running (a Session's, after Ctrl-C): never one beside the shutdown
        for part in (self.collect, self.evaluations, stepping if stepping is not asyncio.current_task() else None):
            if part is not None:
                part.cancel()
        if stepping is not None and stepping is not asyncio.current_task():
            await asyncio.wait([stepping], timeout=60)
        if self._update_task is not None:
            self._update_task.cancel()
        for p in self.partners:  # before their engines stop: an update cut off there would replace a replica
            p.cancel_update()
        # The workers and the queue share the coordinator's host: when the queue is silent it is gone (asking them would wait out each bound).
        coordinator_up = getattr(self, "queue", None) is not None and self._queue_silent == 0 and await self._queue_answers(5.0)
        if self.workers is not None:
            await self.workers.shutdown(host_up=coordinator_up)
        if coordinator_up:
            await settled(self.queue.close.call_one(), 30)  # best effort; its proc is stopped below
        # Every engine before the trainers it reads weights from, then every proc at once (each stage's parts at once).
        pools = [pool for pool in (self.generators, self.teacher, self.scorers, *self.served.values()) if pool is not None]
        stop_s = 60.0 if coordinator_up else LOST_HOST_STOP_S
        await asyncio.gather(*(pool.stop_engines(stop_s) for pool in (*pools, *(p.generators for p in self.partners)) if pool is not None))
        lost = getattr(self, "queue", None) is not None and not coordinator_up  # its trainer blocked on a lost queue: killed here, or by the job's stop
        meshes = self.healer.stops()
        coord = [self.coord.stop()] if getattr(self, "coord", None) is not None else []
        stops = [*(settled(stop, stop_s if lost else 120) for stop in meshes), *(settled(stop, stop_s) for stop in coord)]
        await asyncio.gather(*(pool.shutdown(stop_s, engines=False) for pool in pools), *(p.shutdown(stop_s, engines=False) for p in self.partners), *stops)
        self.healer.kill_procs()
        if getattr(self, "weight_sync", None) is not None:
            self.weight_sync.close()  # its store stops listening; the `files` transport's versions go
        if getattr(self, "alloc", None) is not None:
            self.alloc.host_lost = self.alloc.host_lost or lost
            await self.alloc.__aexit__(None, None, None)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self.mesh_failures.restore()
