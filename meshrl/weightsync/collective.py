"""`collective` transport: a broadcast group from the publishing trainer rank (rank 0) to
every subscriber, created once per connection: gloo between host buffers, or NCCL between
GPU-resident buckets (`SyncSpec.on_gpu`: every peer on a GPU). The same code runs both; on
CPU machines the suite runs it with gloo.

Signalling goes through the controller's TCPStore, not through the group: before each
version the sender writes a small header (version, layout id, the layout itself only when
it changed) under `<group>/hdr/<seq>`; receivers wait on that key with a short poll, so an
idle trainer is never a timeout, count themselves in `read/<seq>` and join the bucket
broadcasts, which the sender starts once every receiver has read the header. The group is created
with `timeout_s`, so a dead peer in a broadcast is an error within the timeout (NCCL's
too: `compat.nccl_errors_raise`); after an error the sender/receiver stop, their thread frees the
group, and the controller re-creates it under a new name (`WeightSync.reconnect`).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from meshrl.compat import nccl_errors_raise
from meshrl.host import host_address, interface_of
from meshrl.weightsync.buffers import ReceiveBuffers
from meshrl.weightsync.errors import WeightSyncError
from meshrl.weightsync.layout import Layout
from meshrl.weightsync.spec import SyncSpec
from meshrl.weightsync.staging import StagingPool

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often idle threads look at their stop flag
HEADER_POLL_S = 0.002  # how often an idle receiver asks the store for the next header


def make_group(spec: SyncSpec, rank: int) -> tuple[dist.Store, dist.ProcessGroup]:
    """Join the store and create this rank's group (all ranks must call it together): NCCL
    on this thread's current GPU when spec.on_gpu, else gloo."""
    timeout = timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(spec.group_name, store)
    listen_on = spec.store_host if _is_loopback(spec.store_host) else host_address()
    if spec.on_gpu:
        # NCCL's bootstrap sockets listen on the interface of the same address gloo would
        # (loopback on one host), unless the user named one; its data goes GPU to GPU.
        if listen_on is not None:
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo" if _is_loopback(listen_on) else interface_of(socket.gethostbyname(listen_on)))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        with nccl_errors_raise():
            pg = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
        # NCCL connects lazily, at the first broadcast; connecting now makes "every rank
        # joined" true when this returns, so a bad group fails here, not in a version's broadcast.
        pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return prefixed, pg
    # Every peer on this host: listen on loopback. Peers on other hosts: on the address the
    # launcher gave this host (`meshrl worker`). Otherwise gloo's default device, which
    # listens on the address the hostname resolves to (or GLOO_SOCKET_IFNAME's interface).
    if listen_on is not None:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=listen_on)]
        pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, opts)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)
    return prefixed, pg


def close_group(pg: dist.ProcessGroup) -> None:
    """Free an NCCL group's communicators (and their GPU memory) once its thread gave it up:
    a reconnect creates a new group each time. Gloo groups close with their last reference."""
    if isinstance(pg, getattr(dist, "ProcessGroupNCCL", ())):
        try:
            pg.abort()
        except Exception as e:  # noqa: BLE001 - the group is gone either way
            log.debug("aborting the weight-sync NCCL group: %s", e)


def _is_loopback(host: str) -> bool:
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))


def broadcast_buckets(pg: dist.ProcessGroup, buckets, timeout_s: float) -> None:
    """Broadcast every bucket from rank 0: issue them all, then wait for each (bounded)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = timedelta(seconds=timeout_s)
    works = [pg.broadcast([b], opts) for b in buckets]
    for w in works:
        w.wait(timedelta(seconds=timeout_s))
    if buckets and buckets[0].is_cuda:
        # NCCL's wait only orders this thread's stream after the broadcast: the bytes are
        # complete (for the sender: free to overwrite) once that stream has run.
        torch.cuda.current_stream(buckets[0].device).synchronize()


class CollectiveSender:
    """Rank 0: broadcasts the newest staged version whenever there is one it has not sent."""

    def __init__(self, pool: StagingPool, spec: SyncSpec):
        self.pool, self.spec = pool, spec
        self.error: BaseException | None = None
        self.sent_version = -1
        self._stop = threading.Event()
        self.store, self.pg = make_group(spec, 0)
        self._thread = threading.Thread(target=self._run, name=f"ws-send-{spec.group_name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop sending now: a broadcast the thread waits in is aborted (NCCL; its receivers are
        gone, as on a reconnect), so its lease on a staging slot ends at once, not when the wait
        times out (the next publishes would wait for that slot)."""
        self._stop.set()
        close_group(self.pg)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            close_group(self.pg)

    def _serve(self) -> None:
        if self.pool.device is not None:
            torch.cuda.set_device(self.pool.device)  # the current device is per thread
        seq, layout_sent = 0, None
        while not self._stop.is_set():
            lease = self.pool.wait_acquire(self.sent_version + 1, POLL_S)
            if lease is None:
                continue
            try:
                layout = lease.slot.layout
                new_layout = layout.layout_id != layout_sent
                header = {"version": lease.version, "layout_id": layout.layout_id, "layout": layout.to_json() if new_layout else None}
                self.store.set(f"hdr/{seq}", json.dumps(header))  # JSON: the store takes any local client's writes
                self._wait_read(seq, lease.version)
                broadcast_buckets(self.pg, layout.bucket_views(lease.slot.flat), self.spec.timeout_s)
                self.store.delete_key(f"hdr/{seq}")
                self.store.delete_key(f"read/{seq}")
                layout_sent, self.sent_version, seq = layout.layout_id, lease.version, seq + 1
            except Exception as e:  # noqa: BLE001 - recorded, reported by `check`
                if not self._stop.is_set():  # (closed: the abort ended the wait, nothing failed)
                    log.warning("weight broadcast of version %d failed: %s", lease.version, e)
                    self.error = e
                return
            finally:
                self.pool.release(lease)

    def _wait_read(self, seq: int, version: int) -> None:
        """Until every receiver has read header `seq` (each counts itself in `read/<seq>`). The
        broadcast's end does not say so: gloo's is a tree, and the root's sends can finish
        before a receiver two hops down has joined, which then waited for a header deleted
        under it while the rank feeding it timed out."""
        deadline = time.monotonic() + self.spec.timeout_s
        while self.store.add(f"read/{seq}", 0) < self.spec.world_size - 1:
            if self._stop.is_set() or time.monotonic() > deadline:
                raise WeightSyncError(f"not every receiver read the header of version {version} within {self.spec.timeout_s:.0f}s")
            time.sleep(HEADER_POLL_S)


class CollectiveReceiver:
    """Rank >= 1: joins every broadcast in a thread, keeping the newest complete version."""

    def __init__(self, spec: SyncSpec, rank: int, buffers: ReceiveBuffers):
        self.spec, self.rank, self.buffers = spec, rank, buffers
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.store, self.pg = make_group(spec, rank)
        self._thread = threading.Thread(target=self._run, name=f"ws-recv-{spec.group_name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop receiving now: a broadcast the thread waits in is aborted (NCCL), so the buffer
        it holds goes back at once rather than when the wait times out (a reconnect's new
        receiver would otherwise find one buffer fewer)."""
        self._stop.set()
        close_group(self.pg)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            close_group(self.pg)

    def _serve(self) -> None:
        if self.buffers.device is not None and torch.device(self.buffers.device).type == "cuda":
            torch.cuda.set_device(self.buffers.device)  # the current device is per thread
        seq, layout = 0, None
        while not self._stop.is_set():
            key = f"hdr/{seq}"
            try:
                # Poll with check (store.wait with short timeouts floods the log with warnings).
                if not self.store.check([key]):
                    time.sleep(HEADER_POLL_S)
                    continue
            except Exception as e:  # noqa: BLE001 - the store lives in the controller
                self._fail(WeightSyncError(f"the weight-sync store (controller) is unreachable: {e}"))
                return
            flat = None
            try:
                header = json.loads(self.store.get(key))
                self.store.add(f"read/{seq}", 1)  # the sender deletes the header once every receiver has
                version, layout_id = int(header["version"]), str(header["layout_id"])
                if header["layout"] is not None:
                    layout = Layout.from_json(header["layout"])
                    self.buffers.set_layout(layout)
                if layout is None or layout.layout_id != layout_id:
                    raise WeightSyncError(f"header of version {version} names layout {layout_id} that was never sent")
                flat = self.buffers.take()
                broadcast_buckets(self.pg, layout.bucket_views(flat), self.spec.timeout_s)
                self.buffers.complete(version, flat)
                seq += 1
            except Exception as e:  # noqa: BLE001
                if flat is not None:
                    self.buffers.give_back(flat)
                if not self._stop.is_set():  # closed: the abort ended the wait, nothing failed
                    self._fail(e)
                return

    def _fail(self, e: BaseException) -> None:
        log.warning("weight receive on rank %d failed: %s", self.rank, e)
        with self.buffers.lock:
            self.error = e
            self.buffers.lock.notify_all()


def wait_latest(buffers: ReceiveBuffers, receiver: "CollectiveReceiver", min_version: int, deadline: float):
    """(version, flat) of the newest received version >= min_version, or raise."""
    with buffers.lock:
        while True:
            if receiver.error is not None:
                raise WeightSyncError(f"collective weight transfer failed: {receiver.error}") from receiver.error
            if buffers.latest is not None and buffers.latest[0] >= min_version:
                version, flat = buffers.latest
                buffers.latest = None
                return version, flat
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            buffers.lock.wait(min(remaining, POLL_S))
