"""`files` transport (the named fallback): one safetensors file per version in a shared
directory, written from the staging snapshot by a background thread, made visible
atomically (temp file + rename). Readers load the whole file into one flat buffer and view
the tensors in place, as with the other transports."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import threading

import torch
from safetensors.torch import save_file

from meshrl.weightsync.layout import ALIGN, Layout, TensorMeta, unpack
from meshrl.weightsync.staging import StagingPool

log = logging.getLogger(__name__)
KEEP = 3  # newest files kept; a reader holding an older one still has it open (POSIX)
_NAME = re.compile(r"^v(\d{10})\.safetensors$")
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def version_path(directory: str, version: int) -> str:
    return os.path.join(directory, f"v{version:010d}.safetensors")


def versions_in(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))


class FileWriter:
    """Writes each new staged version to `directory`; skips versions published while busy."""

    def __init__(self, pool: StagingPool, directory: str, poll_s: float = 0.2):
        os.makedirs(directory, exist_ok=True)
        self.pool, self.directory, self.poll_s = pool, directory, poll_s
        self.written = -1
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ws-files", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            lease = self.pool.wait_acquire(self.written + 1, self.poll_s)
            if lease is None:
                continue
            try:
                final = version_path(self.directory, lease.version)
                tmp = f"{final}.tmp{os.getpid()}"
                views = unpack(lease.slot.flat, lease.slot.layout)
                save_file(views, tmp, metadata={"version": str(lease.version)})
                os.replace(tmp, final)  # atomic: readers see the whole file or none
                self.written = lease.version
                for old in versions_in(self.directory)[:-KEEP]:
                    try:
                        os.remove(version_path(self.directory, old))
                    except FileNotFoundError:
                        pass
            except Exception as e:  # noqa: BLE001 - surfaced through Publisher.check
                log.warning("writing weights version %d failed: %s", lease.version, e)
                self.error = e
            finally:
                self.pool.release(lease)


def read_header(path: str) -> tuple[Layout, int]:
    """Layout of a safetensors file (offsets into the whole file) and the file size."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    base = 8 + n
    metas = []
    for name, info in header.items():
        a, b = info["data_offsets"]
        metas.append(TensorMeta(name, tuple(info["shape"]), _DTYPES[info["dtype"]], base + a, b - a))
    metas.sort(key=lambda m: m.offset)
    size = os.path.getsize(path)
    total = (size + ALIGN - 1) // ALIGN * ALIGN
    return Layout(tuple(metas), ((0, total),), total, f"file:{n}:{hash(tuple(metas))}"), size


def read_into(path: str, flat: torch.Tensor, size: int) -> None:
    """Read the whole file into the flat uint8 buffer (one syscall per chunk, no extra copy)."""
    view = memoryview(flat.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = f.readinto(view[done:size])
            if not n:
                raise OSError(f"{path} ended after {done} of {size} bytes")
            done += n
