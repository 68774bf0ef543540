"""`files` transport (the named fallback): one safetensors file per version in a shared
directory, written straight from the staging snapshot by a background thread, made
visible atomically (temp file + rename). Readers load the whole file into one flat buffer
and view the tensors in place, as with the other transports."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import threading
from typing import BinaryIO, Callable

import torch

from meshrl.weightsync.buffers import ReceiveBuffers
from meshrl.weightsync.layout import ALIGN, Layout, TensorMeta, dtype_from_name
from meshrl.weightsync.staging import Lease, StagingPool

log = logging.getLogger(__name__)
KEEP = 2  # newest files kept; a reader holding an older one still has it open (POSIX), and
# one that listed a file just pruned lists again
_NAME = re.compile(r"^v(\d{10})\.safetensors$")
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_SAFETENSORS_DTYPE = {torch_name: st_name for st_name, torch_name in _DTYPES.items()}


def version_path(directory: str, version: int) -> str:
    return os.path.join(directory, f"v{version:010d}.safetensors")


def versions_in(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))


class FileWriter:
    """Writes each new staged version to `directory`, starting while `publish` still copies
    it (each tensor once its bytes are in); skips versions published while busy."""

    def __init__(self, pool: StagingPool, directory: str, poll_s: float = 0.2):
        os.makedirs(directory, exist_ok=True)
        self.pool, self.directory, self.poll_s = pool, directory, poll_s
        staged = pool.latest.version if pool.latest is not None else -1
        for newer in versions_in(directory):  # a healed trainer's, restored to an older step: the steps its
            if newer > staged:  # predecessor wrote past it were lost, and a reader would take the newest
                _remove(version_path(directory, newer))
        self.written = -1  # the version staged already is written again: the directory may lack it
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ws-files", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            lease = self.pool.wait_acquire(self.written + 1, self.poll_s, filling=True)
            if lease is None:
                continue
            try:
                self._write(lease)
            except Exception as e:  # noqa: BLE001 - surfaced through Publisher.check
                log.warning("writing weights version %d failed: %s", lease.version, e)
                self.error = e

    def _write(self, lease: Lease) -> None:
        """Write the leased version to a temp file and rename it into place, unless the
        slot changed under the write: its publish failed (and raised to its caller), or the
        lease expired."""
        final = version_path(self.directory, lease.version)
        tmp = f"{final}.tmp{os.getpid()}-{id(self)}"  # a writer replaced (a reconnect) may still finish its own file
        try:
            complete = write_version(tmp, lease.slot.flat, lease.slot.layout, lease.version, lambda end: self.pool.wait_packed(lease, end))
            if self.pool.release(lease) and complete:
                os.replace(tmp, final)  # atomic: readers see the whole file or none
                self.written = lease.version
                self._prune()
        finally:
            self.pool.release(lease)  # no-op if released above
            _remove(tmp)  # no-op if renamed

    def _prune(self) -> None:
        for old in versions_in(self.directory)[:-KEEP]:
            _remove(version_path(self.directory, old))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def write_version(path: str, flat: torch.Tensor, layout: Layout, version: int, wait_packed: Callable[[int], bool] | None = None) -> bool:
    """Write a staged version as a safetensors file, each tensor's bytes straight from the
    staging buffer (no serialised copy of the model). Larger elements come first, so with
    the data section starting ALIGN-aligned every tensor is aligned for its dtype in the
    file and in a reader's flat buffer (safetensors allows no gaps between tensors).
    `wait_packed(end)`, if given, waits until the buffer's bytes below `end` are final
    (False: they never will be, and writing stops). Returns whether the file is complete."""
    metas = sorted(layout.tensors, key=lambda m: -dtype_from_name(m.dtype).itemsize)
    header, offset = {"__metadata__": {"version": str(version)}}, 0
    for m in metas:
        header[m.name] = {"dtype": _SAFETENSORS_DTYPE[m.dtype], "shape": list(m.shape), "data_offsets": [offset, offset + m.nbytes]}
        offset += m.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)  # safetensors pads its header with spaces too
    data = memoryview(flat.numpy())
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for m in metas:
            if wait_packed is not None and not wait_packed(m.offset + m.nbytes):
                return False
            f.write(data[m.offset : m.offset + m.nbytes])  # big writes bypass the file buffer
    return True


def read_version(path: str, buffers: ReceiveBuffers) -> torch.Tensor:
    """Read a version file into a free buffer of `buffers`, whose layout is set from the
    file's header. The file is opened once: pruning it meanwhile does not matter (POSIX)."""
    with open(path, "rb", buffering=0) as f:
        layout, size = read_header(f)
        buffers.set_layout(layout)
        flat = buffers.take()
        try:
            f.seek(0)
            read_into(f, flat, size)
        except BaseException:
            buffers.give_back(flat)
            raise
    return flat


def read_header(f: BinaryIO) -> tuple[Layout, int]:
    """Layout of an open safetensors file (offsets into the whole file) and the file size."""
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    base = 8 + n
    metas = []
    for name, info in header.items():
        a, b = info["data_offsets"]
        metas.append(TensorMeta(name, tuple(info["shape"]), _DTYPES[info["dtype"]], base + a, b - a))
    metas.sort(key=lambda m: m.offset)
    size = os.fstat(f.fileno()).st_size
    total = (size + ALIGN - 1) // ALIGN * ALIGN
    return Layout(tuple(metas), ((0, total),), total, f"file:{n}:{hash(tuple(metas))}"), size


def read_into(f: BinaryIO, flat: torch.Tensor, size: int) -> None:
    """Read `size` bytes of an open, unbuffered file into the flat uint8 buffer (one syscall
    per chunk, no extra copy)."""
    view = memoryview(flat.numpy()).cast("B")
    done = 0
    while done < size:
        n = f.readinto(view[done:size])
        if not n:
            raise OSError(f"{f.name} ended after {done} of {size} bytes")
        done += n
