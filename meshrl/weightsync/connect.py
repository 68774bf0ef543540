"""Controller side: wire one Publisher to its Subscribers, and re-wire after a restart.

`check_files_dir` is the `files` transport's check before a run (meshrl/preflight.py's
`preflight` calls it): weight_sync.files_dir can be written. Left null, `WeightSync` makes a
new directory with `tempfile.mkdtemp` (`meshrl-weights-*` under $TMPDIR, else /tmp)."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import socket
import tempfile
import uuid
import weakref
from datetime import timedelta

import torch.distributed as dist

from meshrl.compat import tcp_store_listening_on
from meshrl.config import Config, ConfigError, WeightSyncConfig
from meshrl.futures import awaited
from meshrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from meshrl.weightsync.spec import SyncSpec


def sidecars(procs, keys, spawn_agent) -> list:
    """Spawn, from this (the controller's) process, the sidecar agent of each publisher or
    subscriber that `keys` names: the ValueMesh of `weight_sync_key.call()` on an actor mesh
    over `procs`, one agent per proc whose key is not None, in rank order. `spawn_agent`:
    `publisher_agent` or `subscriber_agent`."""
    ranked = sorted(keys.items(), key=lambda point_key: point_key[0].rank)
    return [spawn_agent(procs.slice(**dict(point)), key) for point, key in ranked if key is not None]


FILES_PREFIX = "meshrl-weights-"


def sweep_dead_runs(parent: str) -> None:
    """Remove the `files` directories of this host's controllers that are gone (killed, or out of
    memory, before their exit removed them): each holds up to two whole versions of a model,
    under /tmp often in memory. Another host's, or a live process's, are left alone."""
    mine = f"{FILES_PREFIX}{socket.gethostname()}-"
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name.removeprefix(mine).partition("-")[0]
        if not name.startswith(mine) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except OSError:
            pass  # alive, another user's


def check_files_dir(c: Config) -> None:
    """weight_sync.files_dir, for the `files` transport, before any mesh starts: a directory
    the publisher can write its versions in, or can make (`FileWriter` makes it): its nearest
    existing parent takes a new folder. Tried by making and removing an empty folder there,
    since `os.access` says yes to root even in a tree no one can write (/proc)."""
    sync = c.weight_sync
    if sync.transport != "files" or sync.files_dir is None:
        return
    path = os.path.abspath(sync.files_dir)
    fix = f"choose a writable directory, or null for a new one under {tempfile.gettempdir()}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("weight_sync.files_dir", f"{path!r} is not a directory: {fix}")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".meshrl-write-check-", dir=parent))
    except OSError as e:
        why = e.strerror or type(e).__name__
        what = f"{path!r} is not writable" if parent == path else f"cannot make {path!r}: {parent!r}, the nearest of its folders that exists, is not writable"
        raise ConfigError("weight_sync.files_dir", f"{what} ({why}): {fix}") from None


class WeightSync:
    """Owns the connection between one publisher and its subscribers.

    For `collective` it also hosts the TCPStore in the controller process, which outlives
    any trainer or generator proc, so a group can be re-created after one of them died.
    """

    def __init__(self, cfg: WeightSyncConfig, store_host: str | None = None, on_gpu: bool = False):
        self.cfg = cfg
        self.on_gpu = on_gpu
        """The publisher and every subscriber hold a GPU: versions stay in GPU memory (SyncSpec.on_gpu)."""
        self.publisher = None
        self.subscribers: list = []
        self._store: dist.TCPStore | None = None
        self._store_host = store_host
        self._generation = itertools.count()
        self._tag = uuid.uuid4().hex[:8]
        # `files`: a directory of its own, under the one named (else the system's temporary one), so that
        # another model's versions, or an earlier run's left there, are never read as this one's
        self.files_dir = None
        if cfg.transport == "files":
            if cfg.files_dir is not None:
                os.makedirs(cfg.files_dir, exist_ok=True)
            sweep_dead_runs(cfg.files_dir or tempfile.gettempdir())
            self.files_dir = tempfile.mkdtemp(prefix=f"{FILES_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=cfg.files_dir)
            weakref.finalize(self, shutil.rmtree, self.files_dir, True)  # its versions go with it, when the controller exits at the latest
        if cfg.transport == "collective":
            # The store listens on this address only (it asks clients for no credentials).
            # Procs on this host reach loopback; with procs on other hosts, pass the
            # controller's own address as they reach it (e.g. socket.gethostname()).
            self._store_host = store_host or "127.0.0.1"
            self._store = tcp_store_listening_on(self._store_host, timedelta(seconds=cfg.timeout_s))

    def spec(self, ranks: int) -> SyncSpec:
        common = dict(
            transport=self.cfg.transport,
            timeout_s=self.cfg.timeout_s,
            files_dir=self.files_dir,
            on_gpu=self.on_gpu and self.cfg.transport in ("collective", "shm"),
        )
        if self.cfg.transport != "collective":
            return SyncSpec(**common)
        return SyncSpec(
            **common, store_host=self._store_host, store_port=self._store.port, world_size=1 + ranks, group_name=f"ws-{self._tag}-{next(self._generation)}/"
        )

    async def connect(self, publisher, subscribers: list) -> "WeightSync":
        """Connect the publisher's handle to every subscriber's handle (all at once, as a
        collective group needs every rank to join together). Bounded by timeout_s."""
        self.publisher, self.subscribers = publisher, list(subscribers)
        counts = [1] * len(self.subscribers)
        if self.cfg.transport == "collective":  # a subscriber whose engine's workers receive holds a rank per worker
            try:
                counts = await asyncio.wait_for(asyncio.gather(*[awaited(s.ranks.call_one(self.cfg.transport)) for s in self.subscribers]), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                raise WeightSyncTimeout(f"asking {len(self.subscribers)} weight-sync subscribers for their ranks took over {self.cfg.timeout_s:.0f}s") from None
        spec = self.spec(sum(counts))
        firsts = [1 + sum(counts[:i]) for i in range(len(counts))]
        calls = [publisher.configure.call_one(spec)]
        calls += [s.configure.call_one(spec, first, publisher) for first, s in zip(firsts, self.subscribers)]
        try:
            await asyncio.wait_for(asyncio.gather(*[awaited(c) for c in calls]), self.cfg.timeout_s + 10.0)
        except asyncio.TimeoutError:
            raise WeightSyncTimeout(f"connecting {len(calls)} weight-sync peers took over {self.cfg.timeout_s:.0f}s") from None
        except Exception as e:  # noqa: BLE001 - an ActorError from a peer's configure
            raise WeightSyncError(f"connecting weight-sync peers failed: {e}") from e
        return self

    async def reconnect(self, publisher=None, subscribers: list | None = None) -> "WeightSync":
        """After a trainer or generator restart: connect the new handles (the others are kept).
        A collective group is re-created under a new name; RDMA readers get the new owner."""
        return await self.connect(publisher or self.publisher, subscribers if subscribers is not None else self.subscribers)

    async def status(self) -> dict:
        """Versions and errors of every peer, e.g. to decide on a `reconnect`."""
        calls = [self.publisher.status.call_one()] + [s.status.call_one() for s in self.subscribers]
        got = await asyncio.wait_for(asyncio.gather(*[awaited(c) for c in calls], return_exceptions=True), self.cfg.timeout_s)
        return {"publisher": got[0], "subscribers": got[1:]}

    def close(self) -> None:
        """At the run's stop, once its procs are: the store stops listening (its server stops with
        the object), and a `files` transport's versions are removed, not left for the garbage
        collector (a notebook's runs one after another would keep every store and directory)."""
        self._store = None
        if self.files_dir is not None:
            shutil.rmtree(self.files_dir, ignore_errors=True)
