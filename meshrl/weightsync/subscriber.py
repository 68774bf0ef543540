"""Generator side: `Subscriber.fetch` returns the newest version as views into one flat buffer.

Use it inside the generator actor (see meshrl/weightsync/__init__.py for the wiring). The
tensors of a fetch stay valid and unchanged until the next fetch returns; with
`shared_memory=True` the buffers are shared-memory files that another process (vLLM's
engine core) maps by name (`layout.shared_file_buffer`), so they are loaded without a copy.
With the `shm` transport they are the publisher's staging slot itself, leased until
`loaded()` (or the next fetch).

Given the `engine` it feeds (a VLLMEngine), a `collective` subscriber has the engine's
workers join the broadcast group themselves (one rank per worker), so every version lands in
the memory of the device that runs the model, a GPU on a GPU run; `fetch` then returns
`ReceivedInEngine` instead of tensors, which the engine loads where they are.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time

import torch
from monarch.actor import Actor, concurrent_endpoint

from meshrl.compat import spawn_owned_by_caller
from meshrl.config import WeightSyncConfig
from meshrl.weightsync import files
from meshrl.weightsync.buffers import ReceiveBuffers
from meshrl.weightsync.collective import CollectiveReceiver, wait_latest
from meshrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from meshrl.weightsync.rdma import RdmaReader
from meshrl.weightsync.shared import SharedReader
from meshrl.weightsync.spec import ReceivedInEngine, SyncSpec

_SUBSCRIBERS: dict[str, "Subscriber"] = {}
_ids = itertools.count()
FILE_POLL_S = 0.002  # one listdir per poll (microseconds): a new file is seen within ~2 ms
JOIN_GRACE_S = 8.0  # past the engine's own bound on its workers' join (RPC_MIN_S and a turn of its loop), within connect's


class Subscriber:
    def __init__(self, cfg: WeightSyncConfig, shared_memory: bool = False, engine=None):
        self.cfg = cfg
        self.engine = engine
        """A collective transport's receiving ranks live in this engine's workers (None: here)."""
        self._in_engine = False
        self.engine_error: BaseException | None = None
        """The last receive error the engine's workers reported (until the next connect)."""
        self.buffers = ReceiveBuffers(shared_memory)
        self.version = -1  # newest version handed out by fetch
        self.tensors: dict[str, torch.Tensor] | None = None
        self.spec: SyncSpec | None = None
        self._receiver: CollectiveReceiver | None = None
        self._reader: RdmaReader | None = None
        self._shared: SharedReader | None = None
        self.connections = 0
        """Connections begun so far (`configure`): a fetch that spans one may hold what the old one took."""
        self.connecting = False
        self.key = f"{os.getpid()}-{next(_ids)}"
        _SUBSCRIBERS[self.key] = self  # its sidecar (`subscriber_agent`) finds it here

    def configure(self, spec: SyncSpec, rank: int, publisher) -> None:
        """(Re)connect to a publisher; called by the controller through the sidecar."""
        self.connections += 1
        self.connecting = True
        try:
            self._configure(spec, rank, publisher)
        finally:
            self.connecting = False

    def _configure(self, spec: SyncSpec, rank: int, publisher) -> None:
        in_engine = spec.transport == "collective" and self.engine is not None
        before = self._shared  # its lease, if one is held, ends with the new reader's next release
        self.spec = None  # until this connection is made: a fetch after a failed one says so, not an AttributeError
        self.close_transport(stop_engine=not in_engine)  # the engine's workers replace their receivers as they join anew
        if in_engine:
            self.version, self.tensors = -1, None  # what the old receivers handed out went with them
            # the engine's loop serves its client; this runs in a worker thread (SubscriberAgent).
            # receive_weights is bounded by spec.timeout_s itself; the grace covers the loop's turn.
            joining = asyncio.run_coroutine_threadsafe(self.engine.receive_weights(spec, rank), self.engine.loop)
            try:
                joining.result(spec.timeout_s + JOIN_GRACE_S)
            except BaseException:
                joining.cancel()  # no more of its worker RPCs; workers that joined are replaced at the next connect
                raise
            self._in_engine = True
        elif spec.transport == "collective":
            self._receiver = CollectiveReceiver(spec, rank, self.buffers)  # blocks until all joined
        elif spec.transport == "rdma":
            self._reader = RdmaReader(publisher, self.buffers)
        elif spec.transport == "shm":
            self._shared = SharedReader(publisher, before)
        elif spec.transport != "files":
            raise WeightSyncError(f"unknown transport {spec.transport!r}")
        self.spec = spec

    def close_transport(self, stop_engine: bool = True) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._in_engine and stop_engine:  # the workers' receivers stop (not waited for: may run on the engine's loop)
            asyncio.run_coroutine_threadsafe(self.engine.stop_receiving(), self.engine.loop)
        self._receiver = self._reader = self._shared = None
        self._in_engine, self.engine_error = False, None

    def ranks(self, transport: str) -> int:
        """Ranks this subscriber holds in a `transport` group: its engine's workers, or one."""
        return self.engine.receive_ranks if transport == "collective" and self.engine is not None else 1

    def close(self) -> None:
        self.close_transport()
        _SUBSCRIBERS.pop(self.key, None)

    async def fetch(self, version: int | None = None, timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor] | ReceivedInEngine]:
        """The newest published version, at least `version` (None: whatever is newest, which
        may be the one already held; waits only if nothing was ever received). Raises
        WeightSyncTimeout after `timeout` (default weight_sync.timeout_s) and
        WeightSyncError when the transfer fails."""
        timeout = self.cfg.timeout_s if timeout is None else timeout
        if self.spec is None:
            raise WeightSyncError("this subscriber is not connected: call WeightSync.connect from the controller first")
        # Held: the tensors of the last fetch, still valid (shm: still leased; views whose
        # lease `loaded()` ended are never handed out again, the slot is leased anew).
        held = self.version >= 0 and (self._shared is None or self._shared.lease_id is not None)
        if held and version is not None and version <= self.version:
            return self.version, self.tensors  # no transfer
        if held and version is None:
            min_version, wait_s = self.version + 1, 0.0  # anything newer right now, else keep ours
        else:
            min_version, wait_s = (0 if version is None else version), timeout
        if self.spec.transport == "shm":  # views of the publisher's slot itself, leased
            got = await self._shared.fetch(min_version, wait_s, timeout)
        elif self._in_engine:  # received by the engine's workers: they load it in place
            try:
                got = await self.engine.take_received(min_version, wait_s)
            except Exception as e:  # noqa: BLE001 - a worker's receive error, through vLLM's RPC
                self.engine_error = e
                raise WeightSyncError(f"collective weight transfer failed in the engine: {e}") from e
            if got is not None:
                got = got, ReceivedInEngine(got)
        else:
            got = await self._receive(min_version, wait_s, timeout)
            if got is not None:
                got = got[0], self.buffers.hand_out(got[0], got[1])
        if got is None:
            if held and version is None:
                return self.version, self.tensors
            raise WeightSyncTimeout(f"no weights version >= {min_version} arrived within {timeout:.1f}s ({self.spec.transport})")
        self.version, self.tensors = got
        return got

    async def loaded(self) -> None:
        """The tensors of the last fetch were loaded and will not be read again: with `shm`
        this ends their lease on the publisher's slot (WeightSyncError if it had expired, so
        the load may have read a rewritten slot); other transports own their buffers."""
        if self._shared is not None:
            await self._shared.release(self.cfg.timeout_s)

    async def _receive(self, min_version: int, wait_s: float, timeout: float) -> tuple[int, torch.Tensor] | None:
        """(version, flat buffer) of a version >= min_version available within wait_s, or None."""
        transport = self.spec.transport
        if transport == "rdma":
            return await self._reader.fetch(min_version, wait_s, timeout)
        if transport == "collective":
            return await asyncio.to_thread(wait_latest, self.buffers, self._receiver, min_version, time.monotonic() + wait_s)
        return await self._receive_file(min_version, time.monotonic() + wait_s)

    async def _receive_file(self, min_version: int, deadline: float) -> tuple[int, torch.Tensor] | None:
        directory = self.spec.files_dir
        while True:
            have = files.versions_in(directory)
            if have and have[-1] >= min_version:
                try:
                    flat = await asyncio.to_thread(files.read_version, files.version_path(directory, have[-1]), self.buffers)
                    return have[-1], flat
                except FileNotFoundError:
                    continue  # pruned between listing and opening: list again
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(FILE_POLL_S)


def subscriber_agent(procs, key: str):
    """Spawn the sidecar of the Subscriber `key` on `procs` (its generator's one-proc mesh),
    from the controller, which then owns the agent's mesh (see `publisher_agent`)."""
    return spawn_owned_by_caller(procs, "weightsync_subscriber", SubscriberAgent, key)


class SubscriberAgent(Actor):
    """Sidecar of a Subscriber: lets the controller (re)connect it while the generator works."""

    def __init__(self, key: str):
        self.key = key

    @concurrent_endpoint
    async def configure(self, spec: SyncSpec, rank: int, publisher) -> int:
        await asyncio.to_thread(_SUBSCRIBERS[self.key].configure, spec, rank, publisher)
        return os.getpid()

    @concurrent_endpoint
    async def ranks(self, transport: str) -> int:
        return _SUBSCRIBERS[self.key].ranks(transport)

    @concurrent_endpoint
    async def status(self) -> dict:
        s = _SUBSCRIBERS[self.key]
        err = s._receiver.error if s._receiver is not None else s.engine_error
        return {"version": s.version, "error": repr(err) if err else None, "pid": os.getpid(), "in_engine": s._in_engine}
