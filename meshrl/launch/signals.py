"""SIGTERM as SystemExit, so a scheduler's stop runs `finally` blocks and atexit hooks."""

from __future__ import annotations

import signal
import threading
import types
from typing import Any


def exit_on_sigterm() -> Any:
    """Make SIGTERM raise SystemExit in the main thread, so `finally` blocks and atexit run.

    Schedulers stop a job with SIGTERM, whose default action skips both and would leave the
    hosts running. Does nothing outside the main thread (signal handlers can only be set
    there: a controller whose loop runs in a worker thread calls this from the main thread)
    or where a handler is already installed. Returns the replaced handler, or None.
    """
    if in_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        return signal.signal(signal.SIGTERM, _raise_system_exit)
    return None


def _raise_system_exit(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
