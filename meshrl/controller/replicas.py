"""Generator replicas and rollout workers: started, watched, replaced and stopped here.

Each generator replica and each rollout worker has its own proc mesh, so a crashed one is
replaced alone while the run goes on. A killed replica proc leaves its vLLM engine
processes orphaned and their shared-memory queues named in /dev/shm; `kill_leftovers`
(controller/members.py) removes both whenever a started replica is stopped or replaced.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Awaitable, Callable

from meshrl.controller.members import Member, start_all, stop_engines, stop_members
from meshrl.config import Config
from meshrl.futures import awaited, by_rank, settled, settled_value, stopped_on_failure
from meshrl.generator.actor import GeneratorActor
from meshrl.generator.service import update_bound_s
from meshrl.agent.actor import RolloutWorkerActor
from meshrl.agent.summary import summarize
from meshrl.errors import first_line
from meshrl.weightsync.subscriber import subscriber_agent

log = logging.getLogger("meshrl")
WORKER_ID_STRIDE = 1 << 20
"""Worker ids in the queue are index + stride * incarnation."""


class GeneratorPool:
    """The generator replicas: spawn, weight updates, health checks, replacement, rescale."""

    def __init__(
        self,
        config: Config,
        alloc,
        checkpoint_dir: str,
        checkpoint_version: int,
        on_change: Callable[[], Awaitable[None]],
        teacher: bool = False,
        model: str = "policy",
        frozen: bool = False,
    ):
        # A replica starts from the Hugging Face export of `checkpoint_version`, then fetches the
        # current version over weight sync; a teacher's (meshrl/distill.py) and a frozen model's
        # never sync. `model`: whose replicas these are (a model beside the policy has its own slots).
        self.teacher, self.model = teacher, model
        self.frozen = teacher or frozen
        self.config, self.alloc = config, alloc
        self.checkpoint_dir, self.checkpoint_version = checkpoint_dir, checkpoint_version
        self.on_change = on_change  # re-wires weight sync and the workers after a change
        self.replicas: list[Member] = []
        self.asleep = False  # placement=colocate: between `sleep` and `wake`, a trainer steps on the devices
        self.paused = False  # Session.pause() until resume() (controller/control.py)
        self.replaced = 0
        self._lock = asyncio.Lock()  # a failed update and a health check may both see one death
        self._warm: dict[int, tuple] = {}  # replica index: (procs, actor) spawned by `warm`, not set up yet
        self.source_lost: Callable[[], bool] = lambda: False
        """Whether the trainer the weights come from is dead (the healer says): a failed update is then its failure, not the replica's."""

    @property
    def _role(self) -> str:
        """Its role in the device plan."""
        role = "teacher" if self.teacher else "generator"
        return role if self.model == "policy" else f"{self.model}/{role}"

    def handles(self) -> list:
        return [r.actor for r in self.replicas]

    def _spawn_actor(self, index: int) -> tuple:
        # One proc per replica (vLLM starts its tensor-parallel workers in it), with its GPUs from the plan; it imports vLLM as it starts.
        procs = self.alloc.host("generator", index).spawn_procs(per_host={"procs": 1}, bootstrap_command=self.alloc.bootstrap(self._role, [index]))
        return procs, procs.spawn(f"{'teacher' if self.teacher else 'generator'}{index}", GeneratorActor)

    def warm(self, n: int) -> None:
        """Spawn the first `n` replicas' procs now, before their checkpoint exists: each imports
        vLLM while the caller starts the trainer, instead of after it. `start` sets them up."""
        self._warm = {i: self._spawn_actor(i) for i in range(n)}

    async def spawn(self, index: int) -> Member:
        procs, actor = self._warm.pop(index, None) or self._spawn_actor(index)
        async with stopped_on_failure(procs):
            info = await asyncio.wait_for(
                actor.setup.call_one(self.config.to_dict(), self.checkpoint_dir, self.checkpoint_version, index, self.teacher),
                self.config.generator.startup_timeout_s,
            )
            member = Member(index, procs, actor, info["processes"]["host"], info["processes"]["pids"])
            try:
                if not self.frozen:  # its weight-sync sidecar, spawned from here (see subscriber_agent)
                    key = await asyncio.wait_for(awaited(actor.weight_sync_key.call_one()), self.config.generator.startup_timeout_s)
                    member.weight_sync = subscriber_agent(procs, key)
            except BaseException:  # its engine is up: its processes would outlive the proc's stop
                member.kill_leftovers()
                raise
        return member

    def subscribers(self) -> list:
        """The replicas' weight-sync subscribers, for WeightSync.connect."""
        return [r.weight_sync for r in self.replicas]

    async def start(self, n: int) -> None:
        """The first `n` replicas, started at once."""
        self.replicas = await start_all(self.spawn(i) for i in range(n))

    async def update(self, version: int, weights_id: str | None = None) -> None:
        """Every replica fetches and applies `version`, or is relabelled to it where it holds
        the weights the trainer names `weights_id` already; a replica that fails is replaced."""
        timeout = update_bound_s(self.config)

        async def one(r: Member) -> None:
            try:
                await asyncio.wait_for(awaited(r.actor.sync_weights.call_one(version, weights_id)), timeout)
            except Exception as e:  # noqa: BLE001 - a dead replica is replaced, the run goes on
                if self.source_lost() and (r.alive() or not r.on_this_host()):  # the publisher died under it: the heal updates it again
                    log.warning("generator replica %d missed version %d: the trainer it read from died", r.index, version)
                    return
                try:
                    await self.replace(r, e, version)
                except Exception as failed:  # noqa: BLE001 - the next health check tries again
                    # Out of the pool until then: a replica that missed a version must never
                    # generate again (asleep at level 2 it would wake on dropped weights under
                    # its old version).
                    await self._drop(r)
                    log.warning("generator replica %d could not be replaced yet (%s); the health check spawns another", r.index, str(failed)[:200])

        await asyncio.gather(*(one(r) for r in list(self.replicas)))

    async def sleep(self, keep_weights: bool = True) -> None:
        """placement=colocate: every replica gives the devices to the trainer, dropping its
        weights unless `keep_weights` (a replica that fails to is replaced at the next health
        check). A frozen model's keep theirs: nothing would load them again."""
        self.asleep = True
        await self._all("sleep", keep_weights or self.frozen)

    async def wake(self) -> None:
        self.asleep = False
        await self._all("wake")

    async def _all(self, endpoint: str, *args) -> None:
        async def one(r: Member) -> None:
            try:
                await asyncio.wait_for(awaited(getattr(r.actor, endpoint).call_one(*args)), self.config.weight_sync.timeout_s)
            except Exception as e:  # noqa: BLE001 - dead or stuck: the health check replaces it
                log.warning("generator replica %d did not %s: %s", r.index, endpoint, first_line(str(e), 200) or type(e).__name__)

        await asyncio.gather(*(one(r) for r in list(self.replicas)))

    async def replace(self, replica: Member, error: BaseException, version: int) -> None:
        """A new replica in `replica`'s place. Its processes on this host are killed before its stop:
        a live actor stopped with the workers' calls on their way returns them undeliverable, which
        ends the caller (Monarch). Off this host it is stopped alive (a worker so ended is replaced)."""
        async with self._lock:
            if replica not in self.replicas:
                return
            log.warning("%s replica %d failed (%s); replacing it", self._role, replica.index, first_line(str(error), 200) or type(error).__name__)
            replica.kill_leftovers()
            await replica.stop()
            fresh = await self.spawn(replica.index)
            self.replicas[self.replicas.index(replica)] = fresh
            try:
                await self.on_change()
            finally:  # its first version (or, failed, out of the pool), whatever the rewiring did
                if not self.frozen:
                    await self._first_load(fresh, version)
            self.replaced += 1
            log.warning("%s replica %d replaced", self._role, replica.index)

    async def _drop(self, replica: Member) -> None:
        async with self._lock:
            if replica in self.replicas:
                self.replicas.remove(replica)
                await replica.stop()
                await self.on_change()  # the workers stop sending it turns

    async def check(self, version: int) -> None:
        """Replace any replica whose proc is gone or that is wedged, and spawn those an earlier
        failure left missing. One on this host is checked by its pid, then asked briefly (no answer:
        applying an update, which its own bound judges); one elsewhere is asked (no answer in 30 s:
        gone). Wedged: `stalled_s` past generator.stall_timeout_s. Not while the pool sleeps."""
        if self.asleep:
            return
        want = 1 if self.teacher else self.config.generator.replicas
        missing = want - len(self.replicas)
        if missing > 0:
            await self.scale(want, version)
            self.replaced += missing
        dead = [r for r in self.replicas if r.on_this_host() and not r.alive()]
        for r in dead:
            await self.replace(r, RuntimeError(f"its proc {r.pids[0][0]} exited"), version)
        stall = self.config.generator.stall_timeout_s
        asked = [r for r in self.replicas if r not in dead and (stall or not r.on_this_host())]  # this host's: for a stall alone
        answers = await asyncio.gather(*(settled_value(r.actor.stats.call_one(), 2 if r.on_this_host() else 30) for r in asked))
        for r, answer in zip(asked, answers):
            if isinstance(answer, BaseException):
                if not r.on_this_host():
                    await self.replace(r, answer, version)
            elif stall and answer.get("stalled_s", 0.0) > stall:
                why = f"wedged: {answer['requests_in_flight']} requests in flight and no token for {answer['stalled_s']:.0f}s"
                await self.replace(r, RuntimeError(f"{why} (generator.stall_timeout_s={stall:g})"), version)

    async def scale(self, n: int, version: int) -> None:
        if n < 1:
            raise ValueError(f"need at least 1 generator replica, got {n}")
        plan = self.alloc.plan
        planned = sum(s.role == self._role for s in plan.slots)
        if plan.layout != "cpu" and n > planned:  # each replica's GPUs come from the plan the run started with
            raise ValueError(
                f"the device plan gives GPUs to {planned} generator replica(s): scale to at most {planned}, "
                f"or start the run with generator.replicas={n} on enough GPUs (meshrl config plan)"
            )
        async with self._lock:
            added, failed = [], []
            try:
                gone = [self.replicas.pop() for _ in range(len(self.replicas) - n)]
                if gone:  # the workers send them nothing more before they stop: a call to a stopped actor fails its sender
                    try:
                        await self.on_change()
                    except Exception as e:  # noqa: BLE001 - stopped below either way; the rewiring is tried again after
                        log.warning("the workers did not drop the scaled-down replicas first: %s", str(e)[:200])
                for r in gone:
                    try:
                        await asyncio.wait_for(awaited(r.actor.shutdown_engine.call_one()), 60)
                    except Exception as e:  # noqa: BLE001 - it is stopped below either way
                        log.warning("generator replica %d did not shut down cleanly: %s", r.index, str(e)[:200])
                    await r.stop()
                while len(self.replicas) < n:  # the lowest index free: its GPUs are the plan's (a dropped replica's too)
                    fresh = await self.spawn(min(set(range(n)) - {r.index for r in self.replicas}))
                    self.replicas = sorted(self.replicas + [fresh], key=lambda r: r.index)
                    added.append(fresh)
            finally:
                try:
                    await self.on_change()  # the workers never keep a stopped replica
                finally:  # each added one's first version, one by one (a collective sends to one at a time), whatever failed after it
                    failed = [e for r in (added if not self.frozen else []) if (e := await settled(self._first_load(r, version), None))]
            if failed:  # (a failed one left the pool: the health check starts another)
                raise failed[0]

    async def _first_load(self, fresh: Member, version: int) -> None:
        """A new replica's first version (the caller holds the lock), then paused if the pool is. One whose
        load fails stays paused (Generator.update_weights), so it leaves the pool: the health check starts another."""
        try:
            await asyncio.wait_for(awaited(fresh.actor.sync_weights.call_one(version)), update_bound_s(self.config))
            if self.paused:  # Session.pause(): one started meanwhile (a replacement, a rescale) generates nothing either
                await asyncio.wait_for(awaited(fresh.actor.pause_generation.call_one()), self.config.weight_sync.timeout_s)
                if not self.paused:  # resumed meanwhile (its resume may have reached this one first)
                    await asyncio.wait_for(awaited(fresh.actor.resume_generation.call_one()), self.config.weight_sync.timeout_s)
        except Exception:
            if fresh in self.replicas:
                self.replicas.remove(fresh)
            fresh.kill_leftovers()
            await fresh.stop()
            await self.on_change()
            raise

    async def read_stats(self) -> list[tuple[Member, float, dict | None]]:
        """(replica, controller clock, stats or None if it did not answer) for every replica."""
        import time

        async def read(r: Member):
            try:
                stats = await asyncio.wait_for(awaited(r.actor.stats.call_one()), 30)
            except Exception:  # noqa: BLE001 - a dead replica is replaced at the next check
                stats = None
            return r, time.monotonic(), stats

        return list(await asyncio.gather(*(read(r) for r in list(self.replicas))))

    async def stop_engines(self, stop_s: float = 60.0) -> None:
        await stop_engines(self.replicas, stop_s)

    async def shutdown(self, stop_s: float = 60.0, engines: bool = True) -> None:
        """Every replica at once (`stop_members`), and any warmed proc never set up."""
        await stop_members(self.replicas, stop_s, engines)
        await asyncio.gather(*(settled(procs.stop(), stop_s) for procs, _ in self._warm.values()))
        self.replicas, self._warm = [], {}


class ScorerPool:
    """The scorer replicas of scoring.scorers (meshrl/scorers/): spawn, health checks,
    replacement. Each replica has a proc of its own (a sharded PRM `procs` of them, stopped
    and replaced together); a reward model or a judge holds the GPUs the device plan gives
    role `scorer` at its index (none on CPU). A scorer that trains
    (an implicit PRM) starts from its newest saved state when the run resumes (`resume`) and
    when it replaces a dead replica."""

    def __init__(self, config: Config, alloc, on_change: Callable[[], Awaitable[None]], resume: bool = False):
        from meshrl.scorers import ON_PROCS

        self.config, self.alloc, self.on_change, self.resume = config, alloc, on_change, resume
        self.names = config.scoring.scorer_names()
        # (scorer index, replica) of every replica, in the order of the device plan's `scorer` slots
        self.slots = [(i, r) for i, s in enumerate(config.scoring.scorers) if s.kind in ON_PROCS for r in range(s.replicas)]
        self.members: dict[tuple[int, int], Member] = {}
        self.down: set[tuple[int, int]] = set()  # members found dead and not replaced yet
        self.replaced = 0
        self._lock = asyncio.Lock()
        self._incarnations = itertools.count()

    def handles(self) -> dict[int, list]:
        """{scorer index: [(incarnation, actor)]} of the live replicas (meshrl/scorers/client.py)."""
        out: dict[int, list] = {}
        for key, m in sorted(self.members.items()):
            if key not in self.down:
                out.setdefault(key[0], []).append((m.ident, m.actor))
        return out

    async def spawn(self, slot: int, restore: bool = False) -> Member:
        from monarch.spmd import setup_torch_elastic_env_async

        from meshrl.launch.devices import scorer_slots
        from meshrl.scorers.actor import ScorerActor

        index, replica = self.slots[slot]
        n = self.config.scoring.scorers[index].procs  # a sharded PRM's ranks (scorers/prm.py); else 1
        if (index, replica) not in scorer_slots(self.config):  # a remote client holds no GPU, nor does a PRM beside a CPU trainer
            procs = self.alloc.host_mesh("coord").spawn_procs(per_host={"procs": n}, bootstrap_command=self.alloc.bootstrap("coord", list(range(n))))
        else:  # its GPUs are the device plan's scorer slots (none on CPU), on the first generator host
            first = scorer_slots(self.config).index((index, replica))
            bootstrap = self.alloc.bootstrap("scorer", list(range(first, first + n)))
            procs = self.alloc.host("generator", 0).spawn_procs(per_host={"procs": n}, bootstrap_command=bootstrap)
        async with stopped_on_failure(procs):
            if n > 1:  # torch.distributed's env for the PRM's FSDP ranks
                await asyncio.wait_for(setup_torch_elastic_env_async(procs), 60)
            actor = procs.spawn(f"scorer-{self.names[index]}-{replica}", ScorerActor)
            # rank 0 answers the rollout workers and leads the others through each batch (ScorerActor.follow)
            lead, others = (actor.slice(procs=slice(0, 1)), actor.slice(procs=slice(1, n))) if n > 1 else (actor, None)
            setup = awaited(actor.setup.call(self.config.to_dict(), index, replica, restore, others))
            infos = by_rank(await asyncio.wait_for(setup, self.config.generator.startup_timeout_s))
        if infos[0].get("restored") is not None:
            over = f", sharded over {infos[0]['world']} procs" if infos[0]["world"] > 1 else ""  # as its rank 0 found its group
            log.warning("scorer %s replica %d restored its saved state, version %d%s", self.names[index], replica, infos[0]["restored"], over)
        pids = [info["pids"][0] for info in infos] + [p for info in infos for p in info["pids"][1:]]
        return Member(slot, procs, lead, infos[0]["host"], pids, own=n, ident=next(self._incarnations))

    async def start(self) -> None:
        for slot in range(len(self.slots)):
            self.members[self.slots[slot]] = await self.spawn(slot, restore=self.resume)

    async def check(self) -> None:
        """Replace any replica whose proc is gone (by pid on this host, else asked), or that says
        it is wedged (a batch ran past scorers/service.py's WEDGED_AFTER x its timeout_s)."""
        members = list(self.members.items())
        health = await asyncio.gather(*(m.gone_or_wedged() for _, m in members))  # at once: each may wait its 30 s
        for (key, m), (gone, wedged) in zip(members, health):
            if not (gone or wedged):
                continue
            async with self._lock:
                name = f"scorer {self.names[key[0]]} replica {key[1]}"
                log.warning("%s %s; replacing it", name, "is wedged (a batch outran its timeout_s)" if wedged else "died")
                # the ranks still alive of a sharded PRM are killed first: a live actor stopped with
                # the workers' calls on its way returns them undeliverable, which ends the caller (Monarch)
                m.kill_leftovers()
                await m.stop()
                if key not in self.down:  # the workers drop its calls in flight and ask the others
                    self.down.add(key)
                    await self.on_change()
                try:
                    self.members[key] = await self.spawn(m.index, restore=True)
                except Exception as e:  # noqa: BLE001 - the next health check tries again; the workers ask the others meanwhile
                    log.warning("%s could not be replaced yet (%s); the next health check tries again", name, str(e)[:200])
                    continue
                self.down.discard(key)
                self.replaced += 1
                await self.on_change()
                log.warning("%s replaced", name)

    async def save_trained(self, timeout_s: float = 120.0) -> None:
        """Each trained scorer (an implicit PRM) saves its state, with the run's checkpoint; one
        that does not answer (dead: the health check replaces it) is logged, not waited for."""
        for (index, replica), m in self.members.items():
            if self.config.scoring.scorers[index].kind == "prm":
                failed = await settled(m.actor.save_state.call_one(), timeout_s)
                if failed is not None:
                    log.warning("scorer %s replica %d did not save its state (%s)", self.names[index], replica, first_line(str(failed), 200))

    async def export_trained(self, hf_dir: str, timeout_s: float = 300.0) -> list[dict]:
        """Each trained scorer (an implicit PRM, one replica) exported to `hf_dir`/final-NAME;
        what each export returned (ImplicitPRM.export_hf). One that fails or does not answer is
        logged and skipped: its saved state stays under checkpoints/."""
        done = []
        for (index, replica), m in sorted(self.members.items()):
            if self.config.scoring.scorers[index].kind != "prm":
                continue
            path = os.path.join(hf_dir, f"final-{self.names[index]}")
            try:
                done.append(await asyncio.wait_for(awaited(m.actor.export_hf.call_one(path)), timeout_s))
            except Exception as e:  # noqa: BLE001 - the policy's export goes on
                log.warning(
                    "scorer %s did not export (%s); its state is in checkpoints/prm-%s",
                    self.names[index],
                    first_line(str(e) or type(e).__name__, 200),
                    self.names[index],
                )
        return done

    async def stop_engines(self, stop_s: float = 60.0) -> None:
        await stop_engines(list(self.members.values()), stop_s)

    async def shutdown(self, stop_s: float = 60.0, engines: bool = True) -> None:
        await stop_members(list(self.members.values()), stop_s, engines)
        self.members = {}


class WorkerPool:
    """The rollout workers (and the envs they host): spawn, watch, replace, metrics."""

    def __init__(self, config: Config, alloc, tokenizer_dir: str, queue, reward_fn=None, teacher=None, scorers: dict | None = None):
        self.config, self.alloc, self.tokenizer_dir, self.queue, self.reward_fn = config, alloc, tokenizer_dir, queue, reward_fn
        self.teacher = teacher  # the distillation teacher's scoring replica, or None
        self.scorers = scorers or {}  # {scoring.scorers index: [replica actors]}
        self.workers: list[Member] = []
        self.partners: list[list] = []  # each trained model's generators beside the policy's (games)
        self.replaced = 0
        self._totals: dict = {}  # the run's totals: each worker's (failed, requeued) as it last answered, a replaced one's too
        self._warm: dict[int, tuple] = {}  # worker index: (procs, actor, ident) spawned by `warm`, not started yet
        self._incarnations = itertools.count()
        self._bootstrap = alloc.bootstrap("coord")  # no GPU for the workers' procs

    def _spawn_actor(self, index: int) -> tuple:
        # Every worker the run starts has its own id in the queue's ledger: a claim granted to
        # a dead worker after its groups were re-queued is never mistaken for its replacement's.
        ident = index + WORKER_ID_STRIDE * next(self._incarnations)
        procs = self.alloc.host_mesh("coord").spawn_procs(per_host={"procs": 1}, bootstrap_command=self._bootstrap)
        return procs, procs.spawn(f"rollout{index}", RolloutWorkerActor, self.config.to_dict(), self.tokenizer_dir, ident, self.reward_fn), ident

    def warm(self) -> None:
        """Spawn every worker's proc now: each loads its env, reward and tokenizer while the
        caller starts the trainer and the generators. `start` connects them."""
        self._warm = {i: self._spawn_actor(i) for i in range(self.config.rollout.workers)}

    async def spawn(self, index: int, generators: list) -> Member:
        procs, actor, ident = self._warm.pop(index, None) or self._spawn_actor(index)
        async with stopped_on_failure(procs):
            where = await asyncio.wait_for(awaited(actor.start.call_one(self.queue, generators, self.teacher, self.scorers, self.partners)), 300)
        member = Member(index, procs, actor, where["host"], where["pids"])
        member.ident = ident
        return member

    async def start(self, generators: list) -> None:
        """Every worker, started at once."""
        self.workers = await start_all(self.spawn(i, generators) for i in range(self.config.rollout.workers))

    async def set_generators(self, generators: list, model: int = 0) -> None:
        """The generators of trained model `model` (the policy's by default) to every worker."""
        if model:
            self.partners[model - 1] = generators
        await asyncio.gather(*(asyncio.wait_for(awaited(w.actor.set_generators.call_one(generators, model)), 60) for w in self.workers))

    async def set_teacher(self, teacher) -> None:
        self.teacher = teacher
        await asyncio.gather(*(asyncio.wait_for(awaited(w.actor.set_teacher.call_one(teacher)), 60) for w in self.workers))

    async def set_scorers(self, scorers: dict) -> None:
        self.scorers = scorers
        await asyncio.gather(*(asyncio.wait_for(awaited(w.actor.set_scorers.call_one(scorers)), 60) for w in self.workers))

    async def check(self, generators: list) -> None:
        """Replace a worker whose proc is gone (checked by pid on this host, asked elsewhere);
        the queue hands its groups out again."""
        for w in list(self.workers):
            if not await w.gone("health"):
                continue
            log.warning("rollout worker %d died; replacing it", w.index)
            await w.stop()
            requeued = await asyncio.wait_for(awaited(self.queue.requeue.call_one(w.ident)), 60)
            self.workers[self.workers.index(w)] = await self.spawn(w.index, generators)
            self.replaced += 1
            log.warning("rollout worker %d replaced; %d groups re-queued", w.index, requeued)

    async def metrics(self) -> dict[str, float]:
        windows, first = [], None
        for w in self.workers:
            try:
                m = await asyncio.wait_for(awaited(w.actor.metrics.call_one()), 30)
            except Exception:  # noqa: BLE001 - a dead worker is replaced at the next check
                continue
            windows += m["episodes"]
            self._totals[w.ident] = (m["failed_total"], m["requeued_total"])
            first = first or m.get("first_failure")
        row = summarize(windows, float(sum(f for f, _ in self._totals.values())), first)
        row["rollout/requeued_groups"] = float(sum(r for _, r in self._totals.values()))
        row["rollout/workers_replaced"] = float(self.replaced)
        return row

    async def shutdown(self, host_up: bool = True) -> None:
        """Every worker's rollouts, then its proc, all at once (as GeneratorPool.shutdown).
        Not `host_up` (the coordinator's host is gone): no call would be answered, and a
        proc mesh's stop would only wait out Monarch's bound, so the procs on this host are
        killed and the rest is left to the launcher's host shutdown."""
        if not host_up:
            for w in self.workers:
                w.kill_leftovers()
        else:
            await asyncio.gather(*(settled(w.actor.stop_rollouts.call_one(10.0), 30) for w in self.workers))
            await asyncio.gather(*(w.stop() for w in self.workers))
        await asyncio.gather(*(settled(warm[0].stop(), 60) for warm in self._warm.values()))
        self.workers, self._warm = [], {}
