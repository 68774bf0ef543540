"""The asynchronous RL loop: meshes, wiring, and one training step at a time.

    prompts (PromptSource) -> generators (vLLM) -> scorer -> ReplayBuffer -> trainer
         ^                                                                     |
         +----- generators pull version v over weight sync <-- publish v <-----+

The loops run inside the actors: generators pull prompts from the source and push groups
to the scorer, which puts them in the buffer; the trainer pulls its batch from the buffer
itself. The controller (`RLLoop`) only starts things, says "step", and reads metrics, so
it is never on the data path. Synchronous on-policy training, one-step overlap and fully
asynchronous training differ only in config (buffer depth, staleness bound, update mode).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from meshrl.buffer import ReplayBufferActor
from meshrl.config import Config
from meshrl.data import PromptSourceActor
from meshrl.generator.actor import GeneratorActor
from meshrl.launch import allocate
from meshrl.metrics import MetricsWriter
from meshrl.scoring import RewardFn, ScorerActor
from meshrl.tokenizer import build_char_tokenizer
from meshrl.trainer.actor import spawn_trainer
from meshrl.trainer.checkpoint import write_atomic
from meshrl.weightsync import WeightSync

log = logging.getLogger("meshrl")
CHECKPOINT_FILE = "loop_state.pt"


@dataclass
class GeneratorReplica:
    """One generator replica: its own proc mesh, so a crashed replica is replaced alone."""

    index: int
    procs: object
    actor: object
    processes: dict = field(default_factory=dict)
    """{"host", "pids": [(pid, start time)]}: the replica's proc and its vLLM engine processes."""
    last_stats: dict = field(default_factory=dict)
    last_stats_at: float | None = None
    """Controller clock when `last_stats` was read (the window of per-step generator metrics)."""

    def on_this_host(self) -> bool:
        import socket

        return self.processes.get("host") == socket.gethostname()

    @staticmethod
    def _running(pid: int, started: float):
        """The psutil handle of `pid` if it still runs and is the process that started at
        `started` (not a later one given the same pid); None otherwise."""
        import psutil

        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) < 1e-3 and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except psutil.Error:
            pass
        return None

    def proc_alive(self) -> bool:
        """Whether the replica's own proc (the first of `processes`) still runs on this host:
        a check with no round trip to the replica, which answers only between weight updates."""
        pids = self.processes.get("pids", [])
        return bool(pids) and self._running(*pids[0]) is not None

    def kill_leftovers(self) -> int:
        """SIGKILL what is still alive of this replica's processes (on this host): a killed
        replica proc leaves its vLLM engine processes orphaned. Returns how many."""
        import psutil

        if not self.on_this_host():
            return 0  # on another host: its host mesh's shutdown ends them
        killed, segments = 0, set()
        for pid, started in self.processes.get("pids", []):
            proc = self._running(pid, started)
            if proc is None:
                continue
            try:
                segments |= _shared_memory_segments(proc.pid)
                proc.kill()
                killed += 1
            except psutil.Error:
                pass
        # vLLM's shared-memory queues are unlinked by the process that made them, which was
        # killed: remove their names (memory is freed once the last mapping is gone, so a
        # process still using one is not affected).
        for path in segments:
            try:
                os.unlink(path)
            except OSError:
                pass
        return killed


def _shared_memory_segments(pid: int) -> set[str]:
    """POSIX shared-memory files Python made (`psm_*`) that process `pid` has mapped."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if "/dev/shm/psm_" in line}
    except (OSError, IndexError):
        return set()


class TrainerFailed(RuntimeError):
    """A trainer proc died: the run stops; resume it from its last checkpoint."""


class RLLoop:
    """Owns every mesh of one run. Use `async with RLLoop(config) as loop: await loop.step()`."""

    def __init__(self, config: Config, run_dir: str | None = None, resume: bool = False, reward_fn: RewardFn | None = None):
        self.config = config
        self.run_dir = os.path.abspath(run_dir or config.logging.run_dir)
        self.resume = resume
        self.reward_fn = reward_fn
        self.version = 0
        self.history: list[dict[str, float]] = []
        self.replicas: list[GeneratorReplica] = []
        self._update_task: asyncio.Task | None = None
        self.replaced = 0
        """Generator replicas replaced after a failure, over the run."""
        self._replace_lock = asyncio.Lock()
        self._last_step_end = None
        self._snapshot_task: asyncio.Task | None = None

    # ---- start-up -----------------------------------------------------------------------
    async def __aenter__(self) -> "RLLoop":
        try:
            await self.start()
        except BaseException:
            await self.shutdown()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    def _install_fault_hook(self) -> None:
        """Monarch's default answer to a proc that dies is to interrupt the client. A run
        replaces dead generators and reports a dead trainer itself, so failures are only
        logged here and surface as errors of the calls that touch the dead procs."""
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
            f.write(c.to_yaml())
        self.tokenizer_dir = c.model.tokenizer or c.model.path or build_char_tokenizer(os.path.join(self.run_dir, "tokenizer"))
        self.metrics = MetricsWriter(self.run_dir, tensorboard=c.logging.tensorboard)
        self.alloc = await allocate(c).__aenter__()

        # The coordinator proc: prompt source, replay buffer and scorer actors.
        self.coord = self.alloc.host_mesh("coord").spawn_procs(per_host={"procs": 1})
        # Actors spawned together are built in parallel threads of one proc, and concurrent
        # first imports of torch/transformers there fail half-initialised: build one at a time.
        self.buffer = self.coord.spawn("buffer", ReplayBufferActor, c.buffer.__dict__, c.batch_groups, c.seed)
        await self.buffer.num_groups.call_one()
        self.source = self.coord.spawn("source", PromptSourceActor, c.to_dict(), self.tokenizer_dir)
        await self.source.consumed.call_one()
        self.scorer = self.coord.spawn("scorer", ScorerActor, c.to_dict(), self.tokenizer_dir, self.buffer, self.source, self.reward_fn)
        await self.scorer.metrics.call_one()

        self.trainer = await spawn_trainer(c, host_mesh=self.alloc.host_mesh("trainer"), hosts=self.alloc.hosts("trainer"))
        await self.trainer.publisher_handle()  # creates the publisher before its first step
        if self.resume:
            await self._restore()
        self.initial_hf_dir = await self.trainer.export_hf(os.path.join(self.run_dir, "hf", f"v{self.version}"))
        for i in range(c.generator.replicas):
            self.replicas.append(await self._spawn_replica(i))
        self.weight_sync = await WeightSync(c.weight_sync).connect(
            await self.trainer.publisher_handle(), [await r.actor.weight_sync_handle.call_one() for r in self.replicas]
        )
        for r in self.replicas:
            await r.actor.start_generation.call_one(self.source, self.scorer)
        self._last_step_end = time.monotonic()

    async def _spawn_replica(self, index: int) -> GeneratorReplica:
        c = self.config
        # One proc per replica (vLLM starts its own tensor-parallel workers inside it), each on
        # its own proc mesh so that a crashed replica can be replaced alone.
        procs = self.alloc.host("generator", index).spawn_procs(per_host={"procs": 1})
        actor = procs.spawn(f"generator{index}", GeneratorActor)
        info = await asyncio.wait_for(
            actor.setup.call_one(c.to_dict(), self.initial_hf_dir, self.version, index), c.generator.startup_timeout_s
        )
        return GeneratorReplica(index, procs, actor, info["processes"])

    # ---- one step ---------------------------------------------------------------------------
    async def step(self) -> dict[str, float]:
        """Train on one batch from the buffer, publish the new version, and record metrics."""
        c = self.config
        try:
            out = await self.trainer.train_from_buffer(self.buffer, c.batch_groups, c.buffer.get_timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead trainer proc ends the run, resumably
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            has_ckpt = os.path.isfile(os.path.join(self.run_dir, "checkpoints", "latest"))
            how = f"resume from the last checkpoint with: meshrl run --resume {self.run_dir}" if has_ckpt else "no checkpoint was written yet"
            raise TrainerFailed(f"the trainer failed at version {self.version} ({type(e).__name__}: {first}); {how}") from e
        self.version = out["version"]
        # Generators move to the new version in the background while the trainer goes on;
        # 'block' (synchronous) waits for them before any prompt of the next batch is let out.
        if self._update_task is not None:  # in the background since the last step: usually done
            t0 = time.monotonic()
            out["sync/previous_update_s"] = await self._finish_update()
            out["sync/previous_update_wait_s"] = time.monotonic() - t0
        self._update_task = asyncio.create_task(self._update_generators(self.version))
        if c.generator.update_mode == "block":
            out["sync/update_s"] = await self._finish_update()
        # The bookkeeping between two training steps is on the trainer's critical path: its
        # round trips to the source, buffer, scorer and replicas go out together.
        row, _ = await asyncio.gather(self._collect_metrics(out), self.source.set_version.call_one(self.version))
        if c.trainer.checkpoint_every and self.version % c.trainer.checkpoint_every == 0:
            await self.checkpoint()
        return row

    async def _update_generators(self, version: int) -> float:
        t0 = time.monotonic()
        await asyncio.gather(*(self._update_replica(r, version) for r in self.replicas))
        return time.monotonic() - t0

    async def _update_replica(self, replica: GeneratorReplica, version: int) -> None:
        try:
            await asyncio.wait_for(replica.actor.sync_weights.call_one(version), self.config.weight_sync.timeout_s + 30)
        except Exception as e:  # noqa: BLE001 - a dead replica is replaced, the run goes on
            await self._replace_replica(replica, e)

    async def _finish_update(self) -> float:
        task, self._update_task = self._update_task, None
        return await task

    async def _replace_replica(self, replica: GeneratorReplica, error: Exception) -> None:
        """A generator replica died: re-queue its prompts, start a fresh one, re-wire weights."""
        async with self._replace_lock:  # a failed update and a health check may both see it
            if replica in self.replicas:
                await self._replace_replica_locked(replica, error)

    async def _replace_replica_locked(self, replica: GeneratorReplica, error: Exception) -> None:
        log.warning("generator replica %d failed (%s); replacing it", replica.index, str(error).splitlines()[0][:200])
        requeued = await self.source.requeue.call_one(replica.index)
        try:
            await asyncio.wait_for(replica.procs.stop(), 30)
        except Exception:  # noqa: BLE001 - it is already gone
            pass
        replica.kill_leftovers()
        fresh = await self._spawn_replica(replica.index)
        self.replicas[self.replicas.index(replica)] = fresh
        await self.weight_sync.reconnect(subscribers=[await r.actor.weight_sync_handle.call_one() for r in self.replicas])
        await fresh.actor.sync_weights.call_one(self.version)
        await fresh.actor.start_generation.call_one(self.source, self.scorer)
        self.replaced += 1
        log.warning("generator replica %d replaced; %d prompts re-queued", replica.index, requeued)

    async def check_generators(self) -> None:
        """Replace any replica whose proc is gone (called between steps). A replica on this
        host is checked by its pid: asking it would wait for the weight update it is
        applying (about 80 ms on a busy CPU core, every step). One on another host is asked."""
        for r in list(self.replicas):
            if r.on_this_host():
                if not r.proc_alive():
                    await self._replace_replica(r, RuntimeError(f"its proc {r.processes['pids'][0][0]} exited"))
                continue
            try:
                await asyncio.wait_for(r.actor.stats.call_one(), 30)
            except Exception as e:  # noqa: BLE001
                await self._replace_replica(r, e)

    async def _collect_metrics(self, out: dict) -> dict[str, float]:
        now = time.monotonic()
        wall = now - self._last_step_end
        self._last_step_end = now
        row = {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}
        row["trained_groups"] = out.get("trained_groups", [])  # kept in history, not in metrics.jsonl
        row["time/step_s"] = wall
        row["trainer/idle_frac"] = min(1.0, out.get("trainer/wait_s", 0.0) / max(wall, 1e-9))
        # Generator stats are read in the background, right after the previous step: a replica
        # answers only once the weight update just sent to it is done (75-87 ms measured on a
        # busy core, concurrent endpoint or not), and waiting for that here would put it on
        # the trainer's critical path every step.
        snapshot = self._snapshot_task or asyncio.create_task(self._read_generator_stats())
        self._snapshot_task = None
        buffer_metrics, scorer_metrics, stats_read = await asyncio.gather(
            self.buffer.metrics.call_one(), self.scorer.metrics.call_one(), snapshot
        )
        row.update(buffer_metrics)
        row.update(scorer_metrics)
        idle, tokens, seconds = [], 0.0, 0.0
        for r, at, stats in stats_read:
            if stats is None or r not in self.replicas:
                continue
            prev, r.last_stats = r.last_stats, stats
            window, r.last_stats_at = (at - r.last_stats_at if r.last_stats_at is not None else wall), at
            busy = stats.get("busy_s", 0.0) - prev.get("busy_s", 0.0)
            idle.append(1.0 - min(1.0, busy / max(window, 1e-9)))
            tokens += stats.get("tokens_generated", 0) - prev.get("tokens_generated", 0)
            seconds = max(seconds, window)
        if idle:
            row["generator/idle_frac"] = sum(idle) / len(idle)
        row["generator/tokens_per_s"] = tokens / max(seconds or wall, 1e-9)
        row["generator/replicas_replaced"] = float(self.replaced)
        self.history.append({"step": self.version, **row})
        self.metrics.write(self.version, row)
        self._snapshot_task = asyncio.create_task(self._read_generator_stats())  # for the next step
        return row

    async def _read_generator_stats(self) -> list[tuple[GeneratorReplica, float, dict | None]]:
        """(replica, controller clock, stats or None if it did not answer) for every replica."""

        async def read(r: GeneratorReplica):
            try:
                stats = await asyncio.wait_for(r.actor.stats.call_one(), 30)
            except Exception:  # noqa: BLE001 - a dead replica is replaced at the next check
                stats = None
            return r, time.monotonic(), stats

        return list(await asyncio.gather(*(read(r) for r in list(self.replicas))))

    # ---- interactive control (Session) ------------------------------------------------------
    async def generate_text(self, prompts: list[str], temperature: float | None = None) -> list[list[str]]:
        """One group of completions per prompt text, from the current policy (replica 0)."""
        from meshrl.rollout import Prompt
        from meshrl.tokenizer import load_tokenizer

        tok = load_tokenizer(self.tokenizer_dir)
        batch = [Prompt(tok.encode(t, add_special_tokens=False), group_id=-1 - i, text=t) for i, t in enumerate(prompts)]
        completions = await self.replicas[0].actor.generate.call_one(batch, temperature)
        groups: dict[int, list[str]] = {}
        for c in completions:
            groups.setdefault(c.group_id, []).append(tok.decode(c.response_ids, skip_special_tokens=True))
        return [groups.get(-1 - i, []) for i in range(len(prompts))]

    async def wait_for_generators(self) -> None:
        """Until every replica runs the trainer's current version: each step starts the
        update to its new version, so waiting for the pending update is enough."""
        if self._update_task is not None:
            await self._finish_update()

    async def export_to(self, path: str) -> str:
        """The current policy as a Hugging Face checkpoint at `path`."""
        return await self.trainer.export_hf(path)

    async def pause_generation(self) -> None:
        await asyncio.gather(*(_awaited(r.actor.pause_generation.call_one()) for r in self.replicas))

    async def resume_generation(self) -> None:
        await asyncio.gather(*(_awaited(r.actor.resume_generation.call_one()) for r in self.replicas))

    async def set_knobs(self, lr: float | None = None, max_lag: int | None = None) -> None:
        """Change the learning rate or the staleness bound between steps."""
        if lr is not None:
            if not lr > 0:
                raise ValueError(f"lr must be positive, got {lr}")
            await self.trainer.set_lr(lr)
            self.config.trainer.lr = lr
        if max_lag is not None:
            if max_lag < 0:
                raise ValueError(f"max_lag must be at least 0, got {max_lag}")
            await self.buffer.set_max_lag.call_one(max_lag)
            self.config.buffer.max_lag = max_lag

    async def scale_generators(self, replicas: int) -> None:
        """Add or remove generator replicas; removed replicas' prompts are re-queued."""
        if replicas < 1:
            raise ValueError(f"need at least 1 generator replica, got {replicas}")
        while len(self.replicas) > replicas:
            gone = self.replicas.pop()
            try:
                await asyncio.wait_for(gone.actor.shutdown_engine.call_one(), 60)
            finally:
                await self.source.requeue.call_one(gone.index)
                await asyncio.wait_for(gone.procs.stop(), 60)
                gone.kill_leftovers()
        added = []
        while len(self.replicas) < replicas:
            fresh = await self._spawn_replica(max((r.index for r in self.replicas), default=-1) + 1)
            self.replicas.append(fresh)
            added.append(fresh)
        await self.weight_sync.reconnect(subscribers=[await r.actor.weight_sync_handle.call_one() for r in self.replicas])
        for r in added:
            await r.actor.sync_weights.call_one(self.version)
            await r.actor.start_generation.call_one(self.source, self.scorer)
        self.config.generator.replicas = replicas

    # ---- checkpoint and resume ----------------------------------------------------------------
    async def checkpoint(self) -> str:
        """Trainer state (DCP), buffer contents, data iterator state and counters, atomically."""
        root = os.path.join(self.run_dir, "checkpoints")
        trainer_dir = await self.trainer.save_checkpoint(os.path.join(root, "trainer"))
        state = {
            "version": self.version,
            "trainer_dir": trainer_dir,
            "buffer": await self.buffer.state_dict.call_one(),
            "source": await self.source.state_dict.call_one(),
            "history": self.history,
        }
        path = os.path.join(root, f"step_{self.version:06d}_{CHECKPOINT_FILE}")
        tmp = path + ".tmp"
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        write_atomic(os.path.join(root, "latest"), os.path.basename(path))
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
        await self.buffer.load_state_dict.call_one(state["buffer"])
        in_buffer = sorted({int(g) for grp in state["buffer"]["groups"] for g in grp["group_id"].tolist()})
        await self.source.load_state_dict.call_one(state["source"], in_buffer)
        await self.source.set_version.call_one(self.version)
        self.history = state["history"]

    # ---- the end -------------------------------------------------------------------------------
    async def export(self) -> str:
        return await self.trainer.export_hf(os.path.join(self.run_dir, "hf", "final"))

    async def shutdown(self) -> None:
        """Stop everything this loop started, on every exit path; never raises."""
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
        steps = []
        if getattr(self, "source", None) is not None:
            steps.append(self.source.close.call_one())
        if getattr(self, "buffer", None) is not None:
            steps.append(self.buffer.close.call_one())
        for r in self.replicas:
            steps.append(r.actor.shutdown_engine.call_one())
        for s in steps:
            try:
                await asyncio.wait_for(_awaited(s), 30)
            except Exception:  # noqa: BLE001 - best effort; procs are stopped below
                pass
        meshes = [r.procs for r in self.replicas] + [getattr(self, "coord", None)]
        if getattr(self, "trainer", None) is not None:
            try:
                await self.trainer.stop()
            except Exception:  # noqa: BLE001
                pass
        for procs in meshes:
            if procs is not None:
                try:
                    await asyncio.wait_for(procs.stop(), 60)
                except Exception:  # noqa: BLE001
                    pass
        for r in self.replicas:
            r.kill_leftovers()
        if getattr(self, "alloc", None) is not None:
            await self.alloc.__aexit__(None, None, None)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        self.replicas = []
        self._restore_fault_hook()


async def _awaited(future):
    return await future
