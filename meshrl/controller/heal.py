"""Healing the trainer: a dead trainer proc is replaced while generation goes on (docs/healing.md).

When the trainer's call fails and the episode queue still answers, `TrainerHealer.heal`:
1. cancels the generators' pending weight update (it may be reading from the dead
   trainer's publisher; a replica that failed under it is kept, `GeneratorPool.source_lost`);
2. stops what is left of the trainer mesh and SIGKILLs its procs on this host that are
   still alive (a rank blocked in a collective with the dead one never returns);
3. spawns a new mesh on the same slots (the allocation's trainer hosts and device plan), or
   on the launcher's spare hosts when its own no longer answer (launcher.spare_hosts);
4. restores the newest complete trainer state: the per-step snapshot
   (meshrl/trainer/snapshot.py) or the last checkpoint, whichever is newer, else the
   seeded start of a run that began at version 0;
5. has the queue put back the batches taken since that version (`EpisodeQueue.retake`), so
   the step in flight is trained again from its own batch: no episode lost or trained twice;
6. publishes the restored weights and reconnects weight sync to the new publisher; a
   generator behind the restored version (its update cut off) is brought to it. With
   trainer.snapshot_every=1 no generator is ahead of it (a version is announced only once
   its snapshot is complete); with more, one ahead keeps its newer weights until the
   retrained trainer passes them (weight sync never hands out an older version).
Under placement=colocate the engines slept for the dead trainer's step: the loop has the
restored version loaded into them and wakes them (`RLLoop._woken_after_heal`), as after any
step, before the step is trained again. Under PPO the critic (its own proc) follows the policy: after a policy heal it is restored
to its own newest state at or below the restored version (RUN_DIR/critic/snapshots, else
its last checkpoint), so that no batch trains it twice. A critic proc that dies is healed
by `heal_critic`: a new proc, the same restore, the failed step's batch back to the queue.
Bounded by trainer.max_restarts (per mesh) and trainer.restart_timeout_s; past them the run
stops resumably, as a dead trainer did before. The generators and rollout workers are healed by
controller/replicas.py; this is the trainer's counterpart, called from the loop's step.
"""

from __future__ import annotations

import asyncio
import os
import time

from meshrl.controller import checkpoint as checkpoints
from meshrl.errors import TrainerFailed, first_line
from meshrl.futures import awaited, settled, stopped_on_failure
from meshrl.host import proc_alive, procs_dead, running_process, started as start_time
from meshrl.logs import console
from meshrl.trainer.actor import spawn_trainer
from meshrl.trainer.critic_actor import critic_root, spawn_critic
from meshrl.trainer.checkpoint import checkpoint_step
from meshrl.trainer.snapshot import drop_after, newest_complete, snapshot_root, snapshot_step


async def trainer_pids(trainer) -> list[tuple[int, float | None]]:
    """(pid, start time) of each trainer rank, by rank; the start time is None off this host."""
    return [local_proc(int(info["pid"]), info.get("host")) for info in await trainer.shard_info()]


def local_proc(pid: int, host: str | None) -> tuple[int, float | None]:
    """(pid, its start time) of a proc on `host` (None: this one); the start time is None off
    this host, or where the proc is gone."""
    import socket

    import psutil

    if host not in (None, socket.gethostname()):
        return pid, None
    try:
        return pid, start_time(psutil.Process(pid))
    except psutil.Error:
        return pid, None


def kill_running(pids: list[tuple[int, float | None]]) -> None:
    """SIGKILL each (pid, start time) on this host that still runs as that process."""
    import psutil

    for pid, started in pids:
        proc = running_process(pid, started) if started is not None else None
        if proc is not None:
            try:
                proc.kill()
            except psutil.Error:
                pass


def _reads_like_a_lost_proc(error: BaseException) -> bool:
    """A failure Monarch reports for a proc it lost (supervision), not one the trainer raised."""
    text = f"{type(error).__name__} {error}".lower()
    return any(word in text for word in ("supervision", "crashed", "proc exited", "stopped", "unreachable", "connection"))


def lost_a_proc(pids: list, error: BaseException) -> bool:
    """Whether `error` came from a proc of the trainer mesh `pids` (`trainer_pids`) that is
    gone: on this host it no longer runs; on another host, Monarch reports it lost (a trainer
    that raised, alive, is not healed: a new mesh would raise again)."""
    remote = any(started is None for _, started in pids)
    return procs_dead(pids) or (remote and _reads_like_a_lost_proc(error))


def newest_state(run_dir: str, checkpoint_dir: str | None = None, at_most: int | None = None) -> tuple[str | None, int]:
    """The newest complete trainer state of the run (of a step <= `at_most`, when given):
    (its directory, its step), from the per-step snapshots or the checkpoints
    (`checkpoint_dir`, default the run's trainer checkpoint); (None, 0) when neither holds one."""
    found: list[tuple[int, str]] = []
    snap = newest_complete(snapshot_root(run_dir), at_most)
    if snap is not None:
        found.append((snapshot_step(snap), snap))
    ckpt = checkpoint_dir or os.path.join(run_dir, "checkpoints", "trainer")
    try:
        step = checkpoint_step(ckpt)
        if at_most is None or step <= at_most:
            found.append((step, ckpt))
    except (FileNotFoundError, OSError, ValueError):
        pass
    if not found:
        return None, 0
    # at one step the checkpoint: a snapshot there may be an earlier start's, laid out for its ranks
    step, path = max(found, key=lambda f: (f[0], f[1] == ckpt))
    return path, step


async def replace_trainer(
    config, alloc, trainer, pids: list, run_dir: str, start_version: int, checkpoint_dir: str | None = None, at_most: int | None = None, role: str = "trainer"
):
    """Stop what is left of `trainer`, SIGKILL its procs on this host that still live (a rank
    waiting in a collective with the dead one never returns), spawn a new mesh on the same
    slots and restore the newest complete state under `run_dir` at or below `at_most` (the
    version the controller holds: a trainer that died after its snapshot was written but
    before its step returned is one ahead, and that step is trained again so that its row
    and groups are not lost), else the seeded start of a run that began at version 0.
    A trainer whose hosts no longer answer moves to the launcher's spare hosts, where it has
    them (launcher.spare_hosts). `role`: its slots in the device plan. Returns (the new mesh, its version). The policy's trainer and each trained model beside
    it (controller/partners.py) are replaced by this."""
    try:
        await asyncio.wait_for(trainer.stop(teardown=not procs_dead(pids)), 90)
    except Exception:  # noqa: BLE001 - dead procs do not answer; they are killed below
        pass
    kill_running(pids)
    if alloc.spares_left() and not await alloc.answers("trainer"):  # its host is gone: the spares take the new mesh
        alloc.move_to_spares("trainer")
    pace, t = config.trainer.pace, config.trainer
    if pace.accumulate and t.snapshot_every > 0 and at_most is not None:  # a held step's state lacks its gradients:
        at_most = max(pace.last_update(at_most), start_version)  # the last update's snapshot (or a resume's start)
    path, _ = newest_state(run_dir, checkpoint_dir, at_most)
    if path is None and start_version > 0:
        raise RuntimeError(f"no complete trainer state at or after the run's start (version {start_version})")
    new = await spawn_trainer(
        config, config.trainer.collective_timeout_s, host_mesh=alloc.host_mesh("trainer"), hosts=alloc.hosts("trainer"), plan=alloc.plan, role=role
    )
    async with stopped_on_failure(new):  # a restore that fails or outlasts the heal's bound leaves no procs behind
        version = await new.load_checkpoint(path) if path is not None else 0  # a snapshot or a checkpoint
    drop_after(snapshot_root(run_dir), version)  # a step written before its call failed is trained again
    return new, version


async def restore_critic(config, alloc, critic, checkpoint_dir: str, version: int, start_version: int, respawn: bool, role: str = "critic"):
    """PPO's `critic` (a CriticMesh of the model `config` trains) at its newest complete state
    at or below `version` (its snapshots under critic_root(config.logging.run_dir), else its
    checkpoint in `checkpoint_dir`), on new procs first when `respawn` (or when there is no
    such state, at a run's start: a fresh critic). `role`: its slots in the device plan.
    Returns (the critic, its version); the policy's critic and each trained model's are
    restored by this."""
    root = critic_root(config.logging.run_dir)
    path, _ = newest_state(root, checkpoint_dir, at_most=version)
    if path is None and start_version > 0:
        raise RuntimeError(f"no complete critic state at or after the run's start (version {start_version})")
    if respawn or path is None:
        await settled(critic.stop(), 90)  # a dead proc does not answer its teardown
        kill_running(critic.proc_ids)  # one wedged but alive would keep its GPU memory from the new one
        critic = await spawn_critic(config, alloc.host("trainer", 0), alloc.bootstrap(role, list(range(config.critic.procs))))
        async with stopped_on_failure(critic):
            restored = await critic.load_checkpoint(path) if path is not None else 0
    else:
        restored = await critic.load_checkpoint(path)
    drop_after(snapshot_root(root), restored)  # steps it trains again, on the batches the queue kept
    return critic, restored


async def critic_healed(config, run_dir: str, what: str, restarts: int, restore, error: BaseException):
    """A dead critic healed by `restore()` (new procs at its newest state) within
    trainer.restart_timeout_s, while `restarts` (its heals so far) is under
    trainer.max_restarts; `what` (whose critic died, and when) opens the one line of the
    TrainerFailed (resumable) raised when it may not or cannot. Returns (what `restore()`
    returned, the heal's seconds). The policy's critic and each trained model's heal by this."""
    c = config
    if restarts >= c.trainer.max_restarts:
        raise TrainerFailed(
            f"{what}; not healed: trainer.max_restarts={c.trainer.max_restarts} restart(s) used; {checkpoints.how_to_resume(run_dir)}"
        ) from error
    t0 = time.monotonic()
    try:
        out = await asyncio.wait_for(restore(), c.trainer.restart_timeout_s)
    except Exception as e:  # noqa: BLE001 - the heal itself failed: stop, resumably
        raise TrainerFailed(
            f"{what} and could not be restarted within trainer.restart_timeout_s={c.trainer.restart_timeout_s:.0f}s "
            f"({type(e).__name__}: {first_line(str(e), 200)}); {checkpoints.how_to_resume(run_dir)}"
        ) from e
    return out, time.monotonic() - t0


class TrainerHealer:
    """The loop's trainer healer: counts restarts and heals within the bounds."""

    def __init__(self, loop):
        self.loop = loop
        self.restarts = 0
        self.pids: list[tuple[int, float | None]] = []
        self.critic_restarts = 0
        self.pending_metrics: dict[str, float] = {}
        self.start_version = 0  # the version the run (or its resume) started at

    def metrics(self) -> dict[str, float]:
        """For the step's row: the restarts so far, and after a heal its time and steps lost."""
        out = {"trainer/restarts": float(self.restarts)}
        if self.loop.critic is not None:
            out["critic/restarts"] = float(self.critic_restarts)
        out, self.pending_metrics = {**out, **self.pending_metrics}, {}
        return out

    async def watch(self) -> None:
        """Note the current trainer mesh's procs (after it started or was replaced)."""
        self.pids = await trainer_pids(self.loop.trainer)

    def kill_procs(self) -> None:
        """SIGKILL the current trainer mesh's procs on this host that still run (after its stop)."""
        kill_running(self.pids)

    def trainer_dead(self) -> bool:
        """Whether a proc of the current trainer mesh on this host is gone."""
        return procs_dead(self.pids)

    def critic_dead(self) -> bool:
        """Whether a proc of PPO's critic on this host is gone."""
        return self.loop.critic is not None and procs_dead(self.loop.critic.proc_ids)

    def stops(self) -> list:
        """The stops of the policy's trainer and critic meshes (a mesh with a proc known dead: no teardown call to it)."""
        loop = self.loop
        trainer = [loop.trainer.stop(teardown=not self.trainer_dead())] if getattr(loop, "trainer", None) is not None else []
        return trainer + ([loop.critic.stop()] if loop.critic is not None else [])

    def lost_a_proc(self, error: BaseException) -> bool:
        """Whether `error` came from a proc of the policy's trainer that is gone (`lost_a_proc`)."""
        return lost_a_proc(self.pids, error)

    def can_heal(self) -> str | None:
        """Why this run's trainer is not healed (None: it is)."""
        c = self.loop.config
        if self.restarts >= c.trainer.max_restarts:
            return f"trainer.max_restarts={c.trainer.max_restarts} restart(s) used"
        return None

    async def heal(self, error: BaseException, call: str = "step") -> None:
        """Replace the dead trainer mesh and restore it (see the module's docstring); raises
        TrainerFailed with one line when it may not or cannot. `call`: the trainer call that
        failed (its step, a checkpoint, an export), for the console's line."""
        loop, c = self.loop, self.loop.config
        first = first_line(str(error)) or type(error).__name__
        dead = [rank for rank, (pid, started) in enumerate(self.pids) if not proc_alive(pid, started)]
        who = ", ".join(f"rank {r} (pid {self.pids[r][0]})" for r in dead) or "a trainer proc"
        if not self.lost_a_proc(error):
            raise TrainerFailed(
                f"the trainer failed at version {loop.version} ({type(error).__name__}: {first}); {checkpoints.how_to_resume(loop.run_dir)}"
            ) from error
        why_not = self.can_heal()
        if why_not is not None:
            raise TrainerFailed(
                f"the trainer failed at version {loop.version} ({who}: {type(error).__name__}: {first}); "
                f"not healed: {why_not}; {checkpoints.how_to_resume(loop.run_dir)}"
            ) from error
        self.restarts += 1
        t0, spares = time.monotonic(), loop.alloc.spares_left()
        try:
            version, retaken = await asyncio.wait_for(self._replace(), c.trainer.restart_timeout_s)
        except Exception as e:  # noqa: BLE001 - the heal itself failed: stop, resumably
            raise TrainerFailed(
                f"the trainer failed at version {loop.version} ({who}: {first}) and could not be restarted "
                f"within trainer.restart_timeout_s={c.trainer.restart_timeout_s:.0f}s ({type(e).__name__}: {first_line(str(e), 200)}); "
                f"{checkpoints.how_to_resume(loop.run_dir)}"
            ) from e
        took = time.monotonic() - t0
        moved = spares - loop.alloc.spares_left()
        where = f" on {moved} spare host(s) (its own is lost)" if moved else ""
        lost = max(0, loop.version - version)
        loop.version = version
        if lost:  # the lost steps' rows (their evaluations' too) go: trained again, they write their own
            loop.history = [row for row in loop.history if row["step"] <= version]
            loop._divergence_seen = min(loop._divergence_seen, len(loop.history))
            loop.metrics.rewind(version)
        self.pending_metrics.update({"trainer/restarts": float(self.restarts), "trainer/restart_s": took, "trainer/steps_lost": float(lost)})
        print(
            f"meshrl: trainer {who} died at version {version + lost} in its {call} ({first_line(first, 160)}); healed in {took:.1f}s{where} "
            f"from version {version} ({lost} step(s) lost, {len(retaken)} group(s) to train again; restart {self.restarts} of {c.trainer.max_restarts})",
            file=console(),
        )

    async def _replace(self) -> tuple[int, list[int]]:
        loop, c = self.loop, self.loop.config
        if loop._update_task is not None:  # reading from the dead publisher, it would wait out weight_sync.timeout_s
            task, loop._update_task = loop._update_task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        loop.trainer, version = await replace_trainer(c, loop.alloc, loop.trainer, self.pids, loop.run_dir, self.start_version, at_most=loop.version)
        await self.watch()
        if loop.critic is not None:  # back to the restored version with the policy: no batch trains it twice
            restored = await self._restore_critic(version, respawn=not await loop.critic.answers())
            self.pending_metrics["critic/steps_lost"] = float(max(0, version - restored))  # steps behind the policy it came back
        retaken = await awaited(loop.queue.retake.call_one(version))
        # connected first: configuring a publisher for GPU staging drops what host memory held
        loop.weight_sync = await loop.weight_sync.reconnect(publisher=await loop.trainer.publisher_handle())
        await loop.trainer.publish_current()
        # in the background, as after every step: one behind (its update cut off) catches up; none ahead goes back
        loop._update_task = asyncio.create_task(loop._update_generators(version))
        return version, retaken

    # ---- PPO's critic --------------------------------------------------------------------------
    async def heal_critic(self, error: BaseException) -> None:
        """The critic's proc died (a call to it failed, and it does not answer): a new proc on
        the same host, restored to the critic's newest state at or below the policy's
        version; the batch a failed step took goes back to the queue, and the step is trained
        again. Raises TrainerFailed with one line when it may not or cannot."""
        loop, c = self.loop, self.loop.config
        first = first_line(str(error)) or type(error).__name__
        what = f"the critic (pid {loop.critic.pid}) stopped answering at version {loop.version} ({type(error).__name__}: {first})"

        async def restore() -> tuple[int, list]:
            restored = await self._restore_critic(loop.version, respawn=True)
            return restored, await awaited(loop.queue.retake.call_one(loop.version))

        (restored, retaken), took = await critic_healed(c, loop.run_dir, what, self.critic_restarts, restore, error)
        self.critic_restarts += 1
        lost = max(0, loop.version - restored)
        self.pending_metrics.update({"critic/restart_s": took, "critic/steps_lost": float(lost)})
        print(
            f"meshrl: {first_line(what, 200)}; healed in {took:.1f}s from critic version {restored} "
            f"({lost} critic step(s) lost, {len(retaken)} group(s) to train again; restart {self.critic_restarts} of {c.trainer.max_restarts})",
            file=console(),
        )

    async def _restore_critic(self, version: int, respawn: bool) -> int:
        """The critic at its newest complete state at or below the policy's `version`
        (`restore_critic`). Returns its version."""
        loop = self.loop
        checkpoint_dir = os.path.join(loop.run_dir, "checkpoints", "critic")
        loop.critic, restored = await restore_critic(loop.config, loop.alloc, loop.critic, checkpoint_dir, version, self.start_version, respawn)
        return restored
