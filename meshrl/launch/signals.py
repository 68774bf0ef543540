"""SIGTERM and SIGHUP as SystemExit, so a scheduler's stop or a closed terminal runs `finally`
blocks and atexit hooks."""

from __future__ import annotations

import signal
import threading
import types
from typing import Any


def exit_on_sigterm() -> Any:
    """Make SIGTERM (and SIGHUP) raise SystemExit in the main thread, so `finally` blocks and
    atexit run.

    Schedulers stop a job with SIGTERM, and a closed terminal or a dropped ssh session sends
    SIGHUP; the default action of both skips `finally` and atexit and would leave the hosts
    running. Does nothing outside the main thread (signal handlers can only be set there: a
    controller whose loop runs in a worker thread calls this from the main thread) or for a
    signal that already has a handler (`nohup` sets SIGHUP's to ignore). Returns the replaced
    SIGTERM handler, or None; SIGHUP's is left as set.
    """
    if not in_main_thread():
        return None
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _raise_system_exit)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        return signal.signal(signal.SIGTERM, _raise_system_exit)
    return None


def _raise_system_exit(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
