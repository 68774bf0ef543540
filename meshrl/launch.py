"""Host meshes for a run: where the trainer, generator and coordinator procs live.

The loop asks for one host mesh per role and spawns its proc meshes on it:

    async with allocate(config) as alloc:
        trainer_procs = alloc.spawn_procs("trainer", config.trainer.procs)
        ...

`config.launcher.kind` picks where the hosts come from:

- `local`: this machine (`this_host()`) for every role.
- `process`: `launcher.hosts` local worker processes, each standing in for one Slurm host
  (Monarch's `ProcessJob`). Same host plan and code path as `slurm`, runnable anywhere.
- `slurm`: one sbatch allocation of `launcher.hosts` nodes through Monarch's `SlurmJob`;
  this process is the controller (run it on a login node) and attaches to the workers.
- `torchx`: this process already runs inside a job launched from
  `meshrl/torchx_component.py:train`, which asks for one host; meshes use that host.
- `workers`: hosts already running `meshrl worker --address IP:PORT` (`run_worker`), listed
  in `launcher.workers`. This process attaches to them over Monarch's TCP transport, as
  Monarch attaches to a Slurm allocation's workers, and listens on `launcher.address` only.
  Each worker's procs bind what they serve to their host's address (`host_address()`).

Host plan (`plan_hosts`): one host holds every role. With more hosts, the trainer and the
generators get disjoint hosts (trainer hosts = ceil(trainer.procs / gpus_per_host) when
hosts have GPUs, else a share proportional to procs), and the coordinator (the episode
queue's proc and the rollout workers, which host the envs) shares the first generator
host rather than taking a whole node: the rollout workers ask the generators for every
model turn, and only finished groups travel on to the trainer.

Procs on attached hosts outlive a controller that exits or crashes, so `Allocation.stop()`
stops every proc mesh spawned through it, shuts the host meshes down and kills the job, on
every exit path of `async with`; an atexit hook and a SIGTERM handler back it up.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import types
from typing import Any
from unittest import mock

from monarch.actor import HostMesh, ProcMesh, this_host

from meshrl.compat import awaited, gloo_default_device_on_loopback
from meshrl.config import Config, ConfigError, ip_and_port

logger = logging.getLogger(__name__)

ROLES = ("trainer", "generator", "coord")
SHARED_MESH = "hosts"
"""The mesh name when one host holds every role."""
HOST_ADDRESS_ENV = "MESHRL_HOST_ADDRESS"
"""Set by `meshrl worker` to its host's address; the procs on that host inherit it."""
STOP_TIMEOUT_S = 30.0
"""Longest wait for one proc mesh or host mesh to stop before moving on to the next."""


# ---- the host plan -----------------------------------------------------------------------
def plan_hosts(config: Config) -> dict[str, int]:
    """Named host meshes and their host counts for `launcher.hosts` hosts.

    {"hosts": 1} for one host; else {"trainer": t, "generator": g} with t + g = hosts.
    Each role's procs must split evenly over its hosts (a generator replica's `tp` procs
    stay on one host), otherwise a ConfigError says what to change.
    """
    la = config.launcher
    hosts = len(la.workers) if la.kind == "workers" else la.hosts
    trainer_procs = config.trainer.procs
    generator_procs = config.generator.replicas * config.generator.tp
    if hosts == 1:
        return {SHARED_MESH: 1}
    if la.gpus_per_host > 0:
        trainer_hosts = math.ceil(trainer_procs / la.gpus_per_host)
    else:  # CPU hosts: share the hosts in proportion to the procs each role runs
        trainer_hosts = round(hosts * trainer_procs / (trainer_procs + generator_procs))
        trainer_hosts = min(max(trainer_hosts, 1), hosts - 1)
    generator_hosts = hosts - trainer_hosts
    if generator_hosts < 1:
        raise ConfigError("launcher.hosts", f"{hosts} hosts leave none for the generators after {trainer_hosts} trainer hosts ({trainer_procs} procs at {la.gpus_per_host} GPUs per host): raise launcher.hosts")
    if trainer_procs % trainer_hosts:
        raise ConfigError("trainer.procs", f"{trainer_procs} procs do not split evenly over {trainer_hosts} trainer hosts: use a multiple of {trainer_hosts}")
    if generator_procs % generator_hosts or (generator_procs // generator_hosts) % config.generator.tp:
        raise ConfigError("generator.replicas", f"{config.generator.replicas} replicas x tp {config.generator.tp} do not split evenly over {generator_hosts} generator hosts (whole replicas per host): change generator.replicas or launcher.hosts")
    if la.gpus_per_host > 0 and generator_procs // generator_hosts > la.gpus_per_host:
        raise ConfigError("launcher.hosts", f"{generator_procs} generator procs need more than the {generator_hosts} hosts x {la.gpus_per_host} GPUs left after the trainer: raise launcher.hosts")
    return {"trainer": trainer_hosts, "generator": generator_hosts}


def _role_meshes(meshes: dict[str, HostMesh]) -> dict[str, HostMesh]:
    """Map each role to its host mesh; the coordinator gets the first generator host."""
    if SHARED_MESH in meshes:
        return {role: meshes[SHARED_MESH] for role in ROLES}
    generator = meshes["generator"]
    return {"trainer": meshes["trainer"], "generator": generator, "coord": generator.slice(hosts=slice(0, 1))}


# ---- Monarch jobs ------------------------------------------------------------------------
def _slurm_job(config: Config) -> Any:
    from monarch.job import SlurmJob

    la = config.launcher
    return SlurmJob(
        meshes=plan_hosts(config),
        python_exe=sys.executable,  # the controller's interpreter: a venv on a shared filesystem
        job_name="meshrl",
        time_limit=la.time_limit,
        partition=la.partition,
        account=la.account,
        gpus_per_node=la.gpus_per_host or None,
        log_dir=os.path.abspath(os.path.join(config.logging.run_dir, "slurm")),
        job_start_timeout=int(la.start_timeout_s),
    )


def render_sbatch(config: Config) -> str:
    """The sbatch script `launcher.kind=slurm` would submit, built by Monarch's own SlurmJob.

    SlurmJob has no public dry run: its submit method builds the script and pipes it to
    `sbatch`. We call that method with the `subprocess` it sees replaced by a recorder, so
    the script is Monarch's, nothing is submitted and no sbatch binary is needed. (It still
    creates the log directory, RUN_DIR/slurm.)
    """
    import monarch.config
    from monarch._src.job import slurm as monarch_slurm

    scripts: list[str] = []

    def record(cmd: list[str], input: str | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        scripts.append(input or "")
        return subprocess.CompletedProcess(cmd, 0, stdout="Submitted batch job 0\n", stderr="")

    fake_subprocess = types.SimpleNamespace(run=record, CalledProcessError=subprocess.CalledProcessError)
    # SlurmJob() switches this process's default transport to TCP; `configured()` restores it,
    # so a dry run leaves local meshes as they were.
    with (
        monarch.config.configured(),
        mock.patch.object(monarch_slurm, "subprocess", fake_subprocess),
        mock.patch.object(monarch_slurm.logger, "disabled", True),  # it would log "Submitting SLURM job"
    ):
        job = _slurm_job(config)
        job._submit_slurm_job(sum(plan_hosts(config).values()))
    return scripts[0]


def describe_job(config: Config) -> str:
    """What `allocate(config)` would start, as text: the host plan, plus the sbatch script for slurm."""
    kind = config.launcher.kind
    if kind in ("local", "torchx"):
        where = "this host" if kind == "local" else "this host (inside a TorchX job)"
        return f"launcher.kind={kind}: trainer, generator and coord on {where}\n"
    plan = ", ".join(f"{name}={n}" for name, n in plan_hosts(config).items())
    text = f"launcher.kind={kind}: host meshes {plan}; coord on the first trainer host\n"
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
        self._job: Any = None  # the Monarch job (process/slurm), None for local/torchx
        self._owned: dict[str, HostMesh] = {}  # host meshes from the job, shut down on stop
        self._roles: dict[str, HostMesh] = {}
        self._procs: list[ProcMesh] = []
        self._old_sigterm: Any = None
        self._started = False
        self._stopped = False

    # -- lifecycle --
    async def start(self) -> "Allocation":
        """Start (process/slurm: submit and connect to) the hosts; idempotent."""
        if self._started:
            return self
        self._started = True
        if self.kind in ("local", "torchx"):
            host = this_host()
            self._roles = {role: host for role in ROLES}
            return self
        _LIVE.add(self)
        self._install_sigterm()
        try:
            if self.kind == "workers":
                self._owned = _attach_workers(self.config)
            else:
                if self.kind == "process":
                    from monarch.job import ProcessJob

                    self._job = ProcessJob(plan_hosts(self.config))
                else:
                    self._job = _slurm_job(self.config)
                # cached_path=None: always a fresh allocation, never a stale one from an earlier run.
                # For slurm this blocks while the job queues (bounded by launcher.start_timeout_s).
                self._owned = dict(self._job.state(cached_path=None)._hosts)
            for name, mesh in self._owned.items():
                await asyncio.wait_for(awaited(mesh.initialized), self.config.launcher.start_timeout_s)
                logger.info("launcher: host mesh %r connected, %d hosts", name, mesh.sizes["hosts"])
            self._roles = _role_meshes(self._owned)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Stop every proc mesh spawned here, shut down the host meshes, kill the job. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            for procs in reversed(self._procs):
                await _quietly(procs.stop(), "proc mesh stop")
            for name, mesh in self._owned.items():
                await _quietly(mesh.shutdown(), f"host mesh {name!r} shutdown")
        finally:
            self._procs.clear()
            self._kill_job()
            self._restore_sigterm()

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
        self._old_sigterm = exit_on_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and _in_main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _attach_workers(config: Config) -> dict[str, HostMesh]:
    """Host meshes over the running `meshrl worker`s, in plan order (trainer hosts first).
    The controller's own Monarch channel listens on `launcher.address` only."""
    from monarch.actor import attach_to_workers, enable_transport

    la = config.launcher
    enable_transport(f"tcp://{la.address}:0")
    meshes, first = {}, 0
    for name, count in plan_hosts(config).items():
        workers = [f"tcp://{w}" for w in la.workers[first:first + count]]
        meshes[name] = attach_to_workers(name=name, ca="trust_all_connections", workers=workers)
        first += count
    return meshes


def host_address() -> str | None:
    """The address this proc's host serves on (set by `meshrl worker`); None on a host
    that `meshrl worker` did not start (local runs, ProcessJob, Slurm)."""
    return os.environ.get(HOST_ADDRESS_ENV) or None


def gloo_on_this_host():
    """A context for gloo groups whose members all run on this host: they listen on
    loopback, or on a host `meshrl worker` serves, on its named address (the worker gave
    gloo that interface already)."""
    return gloo_default_device_on_loopback() if host_address() is None else contextlib.nullcontext()


def run_worker(address: str) -> None:
    """Serve this host to a controller (`launcher.kind=workers`) until it shuts the host down.

    Monarch's host agent listens on `address` (IP:PORT of this host, never a wildcard); the
    procs it spawns use Unix sockets and send to other hosts from this address; what they
    serve themselves (gloo, torch.distributed stores) they bind to it too (`host_address()`).
    """
    ip, port = ip_and_port(address)
    url = f"[{ip}]" if ":" in ip else ip
    os.environ[HOST_ADDRESS_ENV] = ip
    # what the procs of this host serve on Monarch's default transport, and gloo's default device
    os.environ["HYPERACTOR_MESH_DEFAULT_TRANSPORT"] = f"tcp://{url}:0"
    os.environ["GLOO_SOCKET_IFNAME"] = _interface_of(ip)
    from monarch.actor import run_worker_loop_forever

    exit_on_sigterm()
    run_worker_loop_forever(address=f"tcp://{url}:{port}", ca="trust_all_connections")


def _interface_of(ip: str) -> str:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    raise ValueError(f"{ip} is not an address of this host: give one of its own")


def allocate(config: Config) -> Allocation:
    """The hosts for a run, per `config.launcher`; use as `async with allocate(config) as alloc`.

    A dry run submits nothing: print `describe_job(config)` instead.
    """
    if config.launcher.dry_run:
        raise ConfigError("launcher.dry_run", "a dry run starts no hosts: print meshrl.launch.describe_job(config) instead")
    if config.launcher.kind in ("process", "slurm", "workers"):
        plan_hosts(config)  # fail on an impossible plan before anything starts
    return Allocation(config)


def exit_on_sigterm() -> Any:
    """Make SIGTERM raise SystemExit in the main thread, so `finally` blocks and atexit run.

    Schedulers stop a job with SIGTERM, whose default action skips both and would leave the
    hosts running. Does nothing outside the main thread (signal handlers can only be set
    there: a controller whose loop runs in a worker thread calls this from the main thread)
    or where a handler is already installed. Returns the replaced handler, or None.
    """
    if _in_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        return signal.signal(signal.SIGTERM, _raise_system_exit)
    return None


# ---- helpers -----------------------------------------------------------------------------
def _raise_system_exit(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


async def _quietly(future: Any, what: str) -> None:
    """Await a Monarch stop/shutdown future with a timeout; log, don't raise: teardown goes on."""
    try:
        await asyncio.wait_for(awaited(future), STOP_TIMEOUT_S)
    except Exception as e:  # an already-dead proc or host raises here: nothing left to stop
        logger.warning("launcher: %s failed: %s: %s", what, type(e).__name__, e)
