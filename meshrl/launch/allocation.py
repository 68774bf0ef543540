"""The `Allocation`: host meshes for each role, and every proc mesh spawned on them, stopped
on every exit path.

`launcher.kind` local and torchx use this host for every role; process (Monarch's
ProcessJob, local worker processes standing in for hosts), slurm (`slurm.py`) and workers
(`workers.py`) get host meshes from a job or from attached hosts, per the host plan
(`hosts.py`).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import socket
import time
from typing import Any, Callable

from monarch.actor import HostMesh, ProcMesh, this_host

from meshrl.config import Config, ConfigError
from meshrl.futures import awaited, settled
from meshrl.launch.devices import plan_devices
from meshrl.launch.hosts import ROLES, SPARE_MESH, job_meshes, role_meshes
from meshrl.launch.signals import exit_on_sigterm, restore_handlers
from meshrl.launch.slurm import SignalWatch, render_sbatch, slurm_dir, slurm_job
from meshrl.launch.workers import attach_workers, unreachable

logger = logging.getLogger("meshrl.launch")

STOP_TIMEOUT_S = 30.0
"""Longest wait for one proc mesh or host mesh to stop before moving on to the next."""
LOST_HOST_STOP_S = 10.0
"""With a host lost (the coordinator's, or `Allocation.host_lost`), the bound on each call and
stop of the procs that may be on it or wait on it (the controller's generators, scorers,
coordinator and trainer) and on each proc mesh's stop and host mesh's shutdown here: they
answer nothing, Monarch's own wait for a stop there is longer, and the job's kill that
follows ends whatever they left."""
HOST_PROBE_S = 20.0
"""How long a host has at most to start a bare proc (Monarch's bootstrap, no torch) before it
counts as lost (and no longer than launcher.host_timeout_s): a spawn on a host that is gone
waits forever, and a loaded live one answers within seconds."""


def host_timeout(seconds: float) -> Callable[[], None]:
    """Monarch's bound on a host's silence (`get_proc_state_max_idle`) set for this process,
    whose mesh controllers query the hosts; returns what puts the previous one back."""
    import monarch.config

    before = monarch.config.get_global_config().get("get_proc_state_max_idle")
    monarch.config.configure(get_proc_state_max_idle=f"{round(seconds * 1000)}ms")
    return lambda: monarch.config.configure(get_proc_state_max_idle=before) if before else None


def with_env(envs: list[dict[str, str]]):
    """A `bootstrap_command` for `spawn_procs`: the proc at rank i of the new mesh starts with
    `envs[i]` added to its environment, before Python runs in it, so before CUDA initialises
    (the device plan's `CUDA_VISIBLE_DEVICES`). None, Monarch's default command, when every
    env is empty."""
    if not any(envs):
        return None
    from monarch.actor import default_bootstrap_cmd

    base = default_bootstrap_cmd()
    return lambda point: base.with_env(envs[point.rank])


def allocate(config: Config) -> Allocation:
    """The hosts for a run, per `config.launcher`; use as `async with allocate(config) as alloc`.

    A dry run submits nothing: print `describe_job(config)` instead.
    """
    if config.launcher.dry_run:
        raise ConfigError("launcher.dry_run", "a dry run starts no hosts: print meshrl.launch.describe_job(config) instead")
    if config.launcher.kind in ("process", "slurm", "workers"):
        job_meshes(config)  # fail on an impossible plan before anything starts
    return Allocation(config)


def describe_job(config: Config) -> str:
    """What `allocate(config)` would start, as text: the host plan, plus the sbatch script for slurm."""
    kind = config.launcher.kind
    if kind in ("local", "torchx"):
        where = "this host" if kind == "local" else "this host (inside a TorchX job)"
        return f"launcher.kind={kind}: trainer, generator and coord on {where}\n"
    plan = ", ".join(f"{name}={n}" for name, n in job_meshes(config).items())
    text = f"launcher.kind={kind}: host meshes {plan}; coord on the first generator host\n"
    if kind == "slurm":
        text += render_sbatch(config)
    return text


# ---- the allocation ----------------------------------------------------------------------
_LIVE: set["Allocation"] = set()
"""Allocations not yet stopped, for the atexit safety net."""


@atexit.register
def _kill_live_jobs() -> None:
    # The controller is exiting without having stopped: kill the jobs (synchronous, no event loop
    # needed) so no worker outlives it. Proc meshes on this host die with their parent.
    for alloc in list(_LIVE):
        alloc._kill_job()


class Allocation:
    """Host meshes for each role; an async context manager that stops what it started.

    Create with `allocate(config)`. Inside `async with`, `host_mesh(role)` gives the role's
    HostMesh and `spawn_procs(role, procs)` spreads `procs` processes evenly over its hosts
    (use it rather than `host_mesh(role).spawn_procs`, whose `per_host` counts are per host
    and are not stopped by `stop()`).
    """

    def __init__(self, config: Config):
        self.config = config
        self.kind = config.launcher.kind
        self.plan = plan_devices(config)
        """The device plan, decided once for the run: every role's procs start from it (`env`)."""
        self._job: Any = None  # the Monarch job (process/slurm), None for local/torchx
        self._owned: dict[str, HostMesh] = {}  # host meshes from the job, shut down on stop
        self._roles: dict[str, HostMesh] = {}
        self._spares_used = 0  # hosts of the spare mesh the trainer has moved to
        self.host_lost = False
        """Set by the controller when one of the job's hosts is gone: `stop` bounds each wait by LOST_HOST_STOP_S."""
        self._lost: list[HostMesh] = []  # meshes left for spares or never connected: their shutdown would wait out its timeout
        self._procs: list[ProcMesh] = []
        self._holds_signals = False  # it holds exit_on_sigterm's handlers, let go on stop
        self._watch: SignalWatch | None = None  # slurm: relays Slurm's SIGTERM to this process
        self._started = False
        self._stopped = False
        self._restore_host_timeout: Callable[[], None] | None = None
        self._probe_stops: set = set()  # stops of probes a lost host never answered: not waited for

    def bootstrap(self, role: str, indices: list[int] | None = None):
        """The `bootstrap_command` for procs of `role` (one per index; `coord` and the rollout
        workers: one proc, no GPU): each starts with its devices from the plan."""
        return with_env(self.plan.envs(role, indices or [0]))

    # -- lifecycle --
    async def start(self) -> "Allocation":
        """Start (process/slurm: submit and connect to) the hosts; idempotent."""
        if self._started:
            return self
        self._started = True
        self._restore_host_timeout = host_timeout(self.config.launcher.host_timeout_s)
        if self.kind in ("local", "torchx"):
            host = this_host()
            self._roles = {role: host for role in ROLES}
            return self
        _LIVE.add(self)
        self._install_sigterm()
        try:
            if self.kind == "workers":
                self._owned = attach_workers(self.config)
            else:
                if self.kind == "process":
                    from monarch.job import ProcessJob

                    self._job = ProcessJob(job_meshes(self.config))
                else:
                    self._job = slurm_job(self.config)
                # cached_path=None: always a fresh allocation, never a stale one from an earlier run.
                # For slurm this blocks while the job queues (bounded by launcher.start_timeout_s):
                # in a thread, so that Ctrl-C or SIGTERM meanwhile cancels the start (and scancels the job:
                # submitted first, here, so that the job has its id by then).
                if self.kind == "slurm":
                    submitted = time.time()  # a signal note older than this is an earlier job's (SignalWatch)
                    self._job.apply()
                    state = await asyncio.to_thread(self._job.state, cached_path=None)
                else:
                    state = self._job.state(cached_path=None)
                self._owned = dict(state._hosts)
                if self.kind == "slurm":
                    self._watch = SignalWatch(slurm_dir(self.config), self._job._slurm_job_id, since=submitted)
            for name, mesh in self._owned.items():
                try:
                    await asyncio.wait_for(awaited(mesh.initialized), self.config.launcher.start_timeout_s)
                except asyncio.TimeoutError:
                    self._lost.append(mesh)  # never up: its shutdown would wait out STOP_TIMEOUT_S for nothing
                    raise TimeoutError(await asyncio.to_thread(self._not_connected, name)) from None
                logger.info("launcher: host mesh %r connected, %d hosts", name, mesh.sizes["hosts"])
            self._roles = role_meshes(self._owned)
        except BaseException:
            await self.stop()
            raise
        return self

    def _not_connected(self, name: str) -> str:
        """What to say when host mesh `name` did not connect in time; for `meshrl worker` hosts,
        which of their addresses nothing listens at (a typo'd port, a worker not started)."""
        la = self.config.launcher
        line = f"host mesh {name!r} did not connect within launcher.start_timeout_s={la.start_timeout_s:g}s"
        gone = unreachable(la.workers) if self.kind == "workers" else []
        if gone:
            line += f"; nothing listens at {', '.join(gone)}: start `meshrl worker --address IP:PORT` there, or fix launcher.workers"
        return line

    async def stop(self) -> None:
        """Stop every proc mesh spawned here, shut down the host meshes, kill the job. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._watch is not None:  # first: cancelling the job signals its workers, who would note it
            self._watch.stop()
        bound = LOST_HOST_STOP_S if self.host_lost else STOP_TIMEOUT_S
        try:
            for procs in reversed(self._procs):
                await _quietly(procs.stop(), "proc mesh stop", bound)
            # together: a mesh whose hosts are gone waits out its timeout, the others need not wait behind it
            live = {name: mesh for name, mesh in self._owned.items() if not any(mesh is lost for lost in self._lost)}
            await asyncio.gather(*(_quietly(mesh.shutdown(), f"host mesh {name!r} shutdown", bound) for name, mesh in live.items()))
        finally:
            self._procs.clear()
            self._kill_job()
            self._restore_sigterm()
            if self._restore_host_timeout is not None:
                self._restore_host_timeout()
                self._restore_host_timeout = None

    async def __aenter__(self) -> "Allocation":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- meshes --
    def host_mesh(self, role: str) -> HostMesh:
        """The HostMesh the `role` ("trainer", "generator" or "coord") spawns its procs on."""
        if role not in ROLES:
            raise KeyError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        if not self._started or self._stopped:
            raise RuntimeError("the allocation is not running: use `async with allocate(config) as alloc`")
        return self._roles[role]

    def controller_address(self) -> str:
        """Where procs reach this controller, for what it serves them (the weight-sync store):
        loopback when every host is this machine (local, torchx, process), the address the
        launcher names (workers), else this host's name, as Slurm names hosts (and Monarch
        reaches them by it). Never a wildcard."""
        if self.kind == "workers":
            return self.config.launcher.address
        return "127.0.0.1" if self.kind in ("local", "torchx", "process") else socket.gethostname()

    def hosts(self, role: str) -> int:
        """How many hosts the role's mesh spans."""
        return self.host_mesh(role).sizes.get("hosts", 1)  # this_host() has no "hosts" dimension

    def host(self, role: str, index: int) -> HostMesh:
        """One host of the role's mesh, round-robin by `index`: where item `index` of the role
        (a generator replica, say) spawns procs that must share a host (its `tp` procs)."""
        mesh = self.host_mesh(role)
        if "hosts" not in mesh.sizes:
            return mesh
        h = index % mesh.sizes["hosts"]
        return mesh.slice(hosts=slice(h, h + 1))

    async def answers(self, role: str, timeout: float | None = None) -> bool:
        """Whether every host of `role` still starts a proc within `timeout` (default
        HOST_PROBE_S, or launcher.host_timeout_s if shorter): a bare one is spawned on each
        (no actor, no torch) and stopped. A host that is gone never answers the spawn."""
        timeout = min(HOST_PROBE_S, self.config.launcher.host_timeout_s) if timeout is None else timeout
        probe = self.host_mesh(role).spawn_procs(per_host={"procs": 1}, name="host_probe")
        try:
            await asyncio.wait_for(awaited(probe.initialized), timeout)
        except Exception:  # noqa: BLE001 - timed out, or refused: a host is gone
            # its stop never ends there (the job's stop takes the proc): not waited for
            stop = asyncio.ensure_future(settled(probe.stop(), 5))
            self._probe_stops.add(stop)
            stop.add_done_callback(self._probe_stops.discard)
            return False
        await settled(probe.stop(), 5)
        return True

    def spares_left(self) -> int:
        mesh = self._owned.get(SPARE_MESH)
        return mesh.sizes["hosts"] - self._spares_used if mesh is not None else 0

    def move_to_spares(self, role: str = "trainer") -> None:
        """`role` (the trainer) leaves its hosts for as many unused spare hosts
        (launcher.spare_hosts); its next spawn lands there."""
        n, first = self.hosts(role), self._spares_used
        if self.spares_left() < n:
            raise RuntimeError(
                f"its host is lost and {self.spares_left()} of launcher.spare_hosts={self.config.launcher.spare_hosts} spare hosts are left, {n} needed"
            )
        self._lost.append(self._roles[role])
        self._roles[role] = self._owned[SPARE_MESH].slice(hosts=slice(first, first + n))
        self._spares_used += n

    def spawn_procs(self, role: str, procs: int, **kwargs: Any) -> ProcMesh:
        """Spawn `procs` processes for `role`, split evenly over its hosts; stopped by `stop()`.

        Keyword arguments go to `HostMesh.spawn_procs` (bootstrap, name, bootstrap_command...).
        """
        hosts = self.hosts(role)
        if procs < 1 or procs % hosts:
            raise ValueError(f"{procs} {role} procs do not split evenly over its {hosts} hosts")
        mesh = self.host_mesh(role).spawn_procs(per_host={"procs": procs // hosts}, **kwargs)
        self._procs.append(mesh)
        return mesh

    # -- safety nets --
    def _kill_job(self) -> None:
        _LIVE.discard(self)
        job, self._job = self._job, None
        if job is not None:
            try:
                job.kill()
            except Exception:
                logger.exception("launcher: killing the %s job failed; check for leftover workers", self.kind)

    def _install_sigterm(self) -> None:
        self._holds_signals = exit_on_sigterm()

    def _restore_sigterm(self) -> None:
        restore_handlers(self._holds_signals)
        self._holds_signals = False


async def _quietly(future: Any, what: str, timeout: float = STOP_TIMEOUT_S) -> None:
    """Await a Monarch stop/shutdown future with a timeout; log, don't raise: teardown goes on."""
    e = await settled(future, timeout)
    if e is not None:  # an already-dead proc or host fails here: nothing left to stop
        logger.warning("launcher: %s failed: %s: %s", what, type(e).__name__, e)
