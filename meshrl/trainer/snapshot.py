"""Per-step trainer snapshots: the state a healed trainer restores (docs/healing.md).

Every `trainer.snapshot_every` steps each rank saves its shards of the model, the optimizer,
the lr scheduler and its random generators into RUN_DIR/snapshots/step-N/. `start()` after the optimizer step
hands the write to a thread; `finish()` waits for it, and the trainer calls it just before
its next optimizer step, after the next batch arrived: the write runs while the new version
is published and the next batch is awaited, off the step's path. So the newest version a
trainer announced may be one step ahead of its newest complete snapshot, and a heal loses
at most that step, which it trains again from the batch the queue holds for it. Colocated
on CPU (`snapshot_inline`) the write is made, and completed, before the step returns.

A CPU trainer's state already is in host memory: each rank copies its shards into a flat
file of its own (`rank-R.bin`, mapped into memory, its layout beside it in `rank-R.layout`).
A snapshot directory is reused: the oldest of the kept ones is claimed (its marker removed
first, then renamed) and overwritten in place, so a write is one memory copy into pages the
file already holds. A new file of each write (torch.save) pays for the kernel allocating and
zeroing those pages again every step, about ten times the copy on a 300 MB state, and on a
host whose cores all compute that is taken from training and generation. DCP's planning and
metadata cost more than the write itself on small models, and a heal restores into a mesh of
the same shape, so DCP's resharding is not needed. A GPU trainer uses DCP's `async_save`,
whose staging takes the state off the device.
benchmarks/snapshot_cost.py measured the candidates (docs/healing.md). A snapshot is
completed the way a checkpoint is (meshrl/trainer/checkpoint.py: a marker written last into
the temp directory, the directory renamed, `latest` pointed at it), by the writing thread
itself on a single rank, else by rank 0 in `finish()` once every rank's file is written; a
crash during the write leaves the previous snapshot as the newest complete one.

A snapshot is for a trainer proc that dies, not for the machine: its files are not
fsynced (the page cache outlives the proc, and fsync was most of the write's cost); a run
that loses its controller's host resumes from a checkpoint, which is. The two newest
complete snapshots are kept.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshrl.trainer.checkpoint import COMPLETE_MARKER, LATEST, _stepped, _train_state, configured_lr, load_rng, rng_state, save_rng
from meshrl.weightsync.bytecopy import copy_pieces

_THREADS = ThreadPoolExecutor(1, thread_name_prefix="meshrl-snapshot")
KEEP = 2
"""Complete snapshots kept (the newest is restored; the one before it is the fallback while
the newest is replaced)."""
MAX_SPACING = 10
"""The most steps `trainer.snapshot_budget` spaces snapshots apart: a heal loses at most this
many steps, and the queue keeps this many steps' batches for it."""


def snapshot_budget(config) -> float:
    """`trainer.snapshot_budget` where a write takes cores from training or generation: a
    trainer that shares every core with the generators (`placement: colocate`, on CPU).
    With cores of its own (`split`) the write runs while the trainer waits for its next
    batch, and only what outlasts that wait is on the step's path (`snapshot_wait_s`):
    0 there, no spacing."""
    return config.trainer.snapshot_budget if config.placement == "colocate" else 0.0


def snapshot_inline(config) -> bool:
    """Whether a CPU trainer writes each snapshot in its own turn, before it returns: where it
    shares every core with the generators (`placement: colocate`) the roles take the cores in
    turn, and a write in the background would run in the engines' turn, on cores they spread
    every decode step over. In the trainer's turn the copy has the cores to itself, its cost
    is on the step's path where it is measured (`trainer/snapshot_stage_s`), and the snapshot
    is complete before the version is announced, so a heal loses no step (but the held steps
    of a trainer that accumulates over its pace, docs/healing.md)."""
    return config.placement == "colocate"


def snapshot_root(run_dir: str) -> str:
    return os.path.join(run_dir, "snapshots")


def newest_complete(root: str, at_most: int | None = None) -> str | None:
    """The newest snapshot directory holding its completion marker (of a step <= `at_most`,
    when given), or None. Looks past `latest` at every `step-*` directory, so a pointer lost
    with its host still finds one."""
    if not os.path.isdir(root):
        return None
    done = [n for n in os.listdir(root) if n.startswith("step-") and os.path.isfile(os.path.join(root, n, COMPLETE_MARKER))]
    if at_most is not None:
        done = [n for n in done if int(n[len("step-") :]) <= at_most]
    return os.path.join(root, max(done)) if done else None


def drop_after(root: str, step: int) -> None:
    """Remove the snapshots under `root` of steps past `step`: a run resumed from an earlier
    checkpoint trains those steps again on other batches, and a heal must not restore the
    abandoned ones (nor one of them while its replacement is being written)."""
    if not os.path.isdir(root):
        return
    for n in os.listdir(root):
        if n.startswith("step-") and int(n[len("step-") :]) > step:
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def snapshot_step(path: str) -> int:
    with open(os.path.join(path, COMPLETE_MARKER)) as f:
        return int(json.load(f)["step"])


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def local_state(model, optimizer) -> dict:
    """This rank's shards of the weights and of the optimizer's state, as plain tensors."""
    optim = optimizer.state_dict()
    optim["state"] = {k: {n: _local(v) for n, v in st.items()} for k, st in optim["state"].items()}
    return {"model": {n: _local(t) for n, t in model.state_dict().items()}, "optim": optim}


class _Ref(int):
    """A tensor's place in a slot's layout (its index), standing in for it in the pickled structure."""


_ALIGN = 64
"""Byte alignment of each tensor in a slot's flat file (any dtype's view of it is aligned)."""


def _flatten(obj, tensors: list):
    """`obj` with each tensor appended to `tensors` and replaced by its `_Ref`."""
    if torch.is_tensor(obj):
        tensors.append(obj)
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj, tensors: list):
    if isinstance(obj, _Ref):
        return tensors[obj]
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unflatten(v, tensors) for v in obj)
    return obj


def _view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    count = math.prod(shape)
    return flat[offset : offset + count * dtype.itemsize].view(dtype).view(shape)


def _bytes(t: torch.Tensor):
    """A contiguous host tensor's bytes, as a numpy uint8 array over the same memory."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _layout(tensors: list) -> tuple[list, int]:
    """Each tensor's (offset, dtype, shape) in the flat file, and the file's size."""
    layout, offset = [], 0
    for t in tensors:
        layout.append((offset, t.dtype, tuple(t.shape)))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, max(offset, _ALIGN)


def _read_slot(path: str, rank: int) -> dict:
    """A rank's state from a slot: its tensors copied out of the file (the file is overwritten
    in place by a later snapshot, so nothing restored may keep pointing into it)."""
    with open(os.path.join(path, f"rank-{rank}.layout"), "rb") as f:
        saved = pickle.load(f)
    with open(os.path.join(path, f"rank-{rank}.bin"), "rb") as f:
        flat = torch.frombuffer(bytearray(f.read(saved["nbytes"])), dtype=torch.uint8)
    return _unflatten(saved["state"], [_view(flat, *entry).clone() for entry in saved["layout"]])


def is_snapshot(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER)) and os.path.basename(os.path.dirname(os.path.abspath(path))) == "snapshots"


def load_snapshot(path: str, model, optimizer, scheduler=None) -> int:
    """Restore this rank from a complete snapshot written by a mesh of the same shape (a
    heal's: the same procs and sharding); returns its step."""
    from meshrl.trainer.checkpoint import load_checkpoint

    with open(os.path.join(path, COMPLETE_MARKER)) as f:
        meta = json.load(f)
    kind = meta.get("extra", {}).get("snapshot")
    if kind not in ("slots", "local"):  # "local": torch.save'd shards, as written before the slots
        return int(load_checkpoint(path, model, optimizer, scheduler)["step"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    # to host memory first: read onto the GPU it would sit beside the live state, a second copy the memory plan does not count
    if kind == "slots":
        saved = _read_slot(path, rank)
    else:
        saved = torch.load(os.path.join(path, f"rank-{rank}.pt"), map_location="cpu", weights_only=False)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            _local(t).copy_(saved["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim = saved["optim"]
    for key, st in optim["state"].items():  # the shards back into DTensors shaped as their parameters
        p = params[key]
        if isinstance(p, DTensor):
            for n, v in st.items():
                if torch.is_tensor(v) and v.shape == p.to_local().shape and v.dim() > 0:
                    local = v.to(p.to_local().device)
                    st[n] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    with configured_lr(optimizer, scheduler):  # the rate the run configures now, as a checkpoint's load keeps it
        optimizer.load_state_dict(optim)
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(meta["scheduler"])
    load_rng(path)
    return int(meta["step"])


class Snapshots:
    """One rank's side of the per-step snapshots. `start(step, ...)` after the optimizer step,
    `finish()` before the next one; collective: every rank calls both in step.
    `process_group`: a gloo group of its own (the background write's collectives must not
    interleave with the training's), None for a single rank. `blocking`: each rank writes
    its own shards (into its slot's flat file, by a thread, no staging copy: the caller
    changes nothing before `finish()`), the CPU trainer's way; else DCP's async_save, the
    GPU trainer's. `keep`: complete snapshots kept. `complete`: the step of the newest
    snapshot `finish()` completed (0: none).

    `budget` (`trainer.snapshot_budget`): the share of a step the writes may cost. A write
    runs beside training, but on a host whose cores all compute it takes them from the
    step; when one write (`write_s`, timed in its thread) is more than `budget` of the
    step's period (from one `due` to the next), the next snapshots come `spacing` steps
    apart, the fewest that keep their average within it (at least `every`, at most
    `MAX_SPACING`). Every rank agrees on both figures (their maximum over the group).
    DCP's writes (GPU) are not timed, so they keep `every`.

    `inline` (`snapshot_inline`, with `blocking`): `start()` returns once the write is done,
    so the trainer pays it in its own turn rather than beside the engines."""

    def __init__(self, root: str, every: int, process_group=None, blocking: bool = False, keep: int = KEEP, budget: float = 0.0, inline: bool = False):
        self.root, self.every, self.pg, self.blocking, self.keep = os.path.abspath(root), every, process_group, blocking, keep
        self.inline = inline and blocking
        self.budget, self.spacing = budget, every
        self._pending: tuple[Any, str, str, dict, bool] | None = None  # (future, temp dir, name, metadata, completed by the thread)
        self.stage_s = self.wait_s = self.write_s = self.period_s = 0.0
        self.complete = self._started = 0
        self._last_due: float | None = None
        self._files: dict[tuple[int, int], torch.Tensor] = {}  # (device, inode) of a slot's flat file: its mapping, kept from write to write

    def due(self, step: int) -> bool:
        """Called once a step, after the optimizer step: whether this step's state is written.
        A step at or below the last one written means the state went back (restored in place,
        as a policy's heal restores its live critic), and `drop_after` removed what came after
        it: written again, then `spacing` apart from there."""
        now = time.perf_counter()
        if self._last_due is not None:
            self.period_s = now - self._last_due
        self._last_due = now
        return self.every > 0 and (step - self._started >= self.spacing or step <= self._started)

    def start(self, step: int, model, optimizer, scheduler=None) -> None:
        import torch.distributed.checkpoint as dcp

        if self._pending is not None:
            self.finish()
        self._started = step
        t0 = time.perf_counter()
        rank = dist.get_rank() if dist.is_initialized() else 0
        name = f"step-{step:08d}"
        tmp = os.path.join(self.root, f".{name}.tmp")
        meta = {
            "step": step,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra": {"snapshot": "slots" if self.blocking else "dcp"},
        }
        rng = rng_state()  # as the step left them: a restored trainer draws what this one would have
        if self.blocking and self.pg is None:  # one rank: the whole write, its completion included, by the thread
            self._pending = (_THREADS.submit(_timed, self._write, model, optimizer, tmp, name, meta, rng), tmp, name, meta, True)
            if self.inline:
                self._pending[0].result()
            self.stage_s = time.perf_counter() - t0
            return
        if rank == 0:
            _claim(self.root, tmp, self.keep)
        if self.pg is not None:
            dist.barrier(group=self.pg)
        save_rng(tmp, rng)
        if self.blocking:  # DCP's planning and metadata cost more than the write of a small model: plain shards
            future = _THREADS.submit(_timed, self._write_slot, local_state(model, optimizer), tmp, rank)
        else:
            writer = dcp.FileSystemWriter(tmp, sync_files=False)
            # an optimizer not stepped yet (its first steps off trainer.pace) saved without state, as a
            # version-0 checkpoint is: torch would make it one by a step of lr 0 (checkpoint._train_state)
            meta["optimizer_state"] = stepped = _stepped(optimizer)
            state = _train_state(model, optimizer, stepped)
            future = dcp.async_save(state, storage_writer=writer, process_group=self.pg, no_dist=self.pg is None)
        self._pending = (future, tmp, name, meta, False)
        if self.inline:
            future.result()
        self.stage_s = time.perf_counter() - t0

    def _write(self, model, optimizer, tmp: str, name: str, meta: dict, rng: dict) -> None:
        _claim(self.root, tmp, self.keep)
        save_rng(tmp, rng)
        self._write_slot(local_state(model, optimizer), tmp, 0)
        self._complete(tmp, name, meta)

    def _write_slot(self, state: dict, directory: str, rank: int) -> None:
        """This rank's `state` into the slot `directory`: its tensors copied into the flat file
        (mapped once, then reused), the structure and layout beside it."""
        tensors: list = []
        skeleton = _flatten(state, tensors)
        layout, nbytes = _layout(tensors)
        flat = self._file(os.path.join(directory, f"rank-{rank}.bin"), nbytes)
        # Host tensors are copied as bytes by numpy (weightsync/bytecopy.py), not by ATen: this
        # is the snapshot's thread, and an ATen parallel region entered from a second thread of
        # the proc starts an OpenMP team of its own beside the training's, which slowed every
        # later training step of the proc by about a quarter (benchmarks/README.md, section 19).
        pairs = []
        with torch.no_grad():
            for entry, t in zip(layout, tensors):
                dst = _view(flat, *entry)
                if t.device.type == "cpu" and t.is_contiguous() and t.numel():
                    pairs.append((_bytes(dst), _bytes(t)))
                elif t.numel():
                    dst.copy_(t)
        copy_pieces(pairs)
        with open(os.path.join(directory, f"rank-{rank}.layout"), "wb") as f:
            pickle.dump({"state": skeleton, "layout": layout, "nbytes": nbytes}, f)

    def _file(self, path: str, nbytes: int) -> torch.Tensor:
        """The flat file at `path`, `nbytes` long, mapped shared: the mapping this rank already
        holds for it (the same inode, renamed with its slot), else a new one."""
        with open(path, "ab") as f:
            if os.fstat(f.fileno()).st_size != nbytes:
                f.truncate(nbytes)
                os.posix_fallocate(f.fileno(), 0, nbytes)  # its blocks now: a full disk is an OSError here, not a SIGBUS in the copy
            st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino)  # unique while mapped: a mapping keeps even a removed file's inode alive
        flat = self._files.get(key)
        if flat is None or flat.numel() != nbytes:
            flat = self._files[key] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            while len(self._files) > self.keep + 1:  # slots removed since (drop_after): let their memory go
                self._files.pop(next(iter(self._files)))
        return flat

    def finish(self) -> str | None:
        """Wait for the pending write and complete it (rank 0); the snapshot's path, or None
        if none was pending."""
        if self._pending is None:
            return None
        t0 = time.perf_counter()
        future, tmp, name, meta, completed = self._pending
        self._pending = None
        written = future.result()  # DCP: every rank's shards and the metadata are written once the coordinator's is
        if self.blocking:
            self._space(written)  # with several ranks, a collective: every rank's file is written after it
        if not completed and (dist.get_rank() if dist.is_initialized() else 0) == 0:
            self._complete(tmp, name, meta)
        self.wait_s = time.perf_counter() - t0
        self.complete = int(meta["step"])
        return os.path.join(self.root, name)

    def _space(self, write_s: float) -> None:
        """The steps until the next snapshot, from this write's time against the step's period."""
        figures = torch.tensor([write_s, self.period_s], dtype=torch.float64)
        if self.pg is not None:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.pg)
        self.write_s, period = figures.tolist()
        if self.budget > 0 and period > 0:
            self.spacing = min(MAX_SPACING, max(self.every, math.ceil(self.write_s / (self.budget * period))))

    def _complete(self, tmp: str, name: str, meta: dict) -> None:
        final = os.path.join(self.root, name)
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:  # last: a directory without it is never restored
            json.dump(meta, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(self.root, LATEST + ".tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(self.root, LATEST + ".tmp"), os.path.join(self.root, LATEST))
        self._prune(name)

    def _prune(self, newest: str) -> None:
        names = sorted(n for n in os.listdir(self.root) if n.startswith("step-"))
        for n in names[: -self.keep]:
            shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)
        for n in os.listdir(self.root):  # temp dirs of writes a crash cut short
            if n.startswith(".step-") and n.endswith(".tmp") and n != f".{newest}.tmp":
                shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)


def _timed(fn, *args) -> float:
    """Call `fn(*args)` (a snapshot's write, in its thread); the seconds it took."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _claim(root: str, tmp: str, keep: int) -> None:
    """The temp directory `tmp` for the next snapshot: a slot the write may reuse, else a new
    one. A directory no heal would restore (a write cut short, a marker removed by a claim cut
    short) is reused first; else, with `keep` complete snapshots there (at least 2: one stays
    restorable meanwhile), the oldest is claimed: its marker goes first (from then on it is
    never restored), then it is renamed. The newest complete snapshot is never claimed."""
    os.makedirs(root, exist_ok=True)
    if os.path.isdir(tmp):
        return
    names = sorted(os.listdir(root))
    done = [n for n in names if n.startswith("step-") and os.path.isfile(os.path.join(root, n, COMPLETE_MARKER))]
    spare = [n for n in names if n.startswith(".step-") and n.endswith(".tmp") or n.startswith("step-") and n not in done]
    source = spare[0] if spare else (done[0] if len(done) >= max(keep, 2) else None)
    if source is None:
        os.makedirs(tmp)
        return
    marker = os.path.join(root, source, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    os.replace(os.path.join(root, source), tmp)
