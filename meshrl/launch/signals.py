"""SIGTERM and SIGHUP as SystemExit, so a scheduler's stop or a closed terminal runs `finally`
blocks and atexit hooks."""

from __future__ import annotations

import os
import select
import signal
import threading
import types


_HELD = {"count": 0, "replaced": {}}
"""Who holds the handlers (a Session, an allocation), and what they replaced: put back when the
last lets go, so one that stops first leaves the other's run its cleanup."""


def exit_on_sigterm() -> bool:
    """Make SIGTERM (and SIGHUP) raise SystemExit in the main thread, so `finally` blocks and
    atexit run, until every holder has called `restore_handlers`.

    Schedulers stop a job with SIGTERM, and a closed terminal or a dropped ssh session sends
    SIGHUP; the default action of both skips `finally` and atexit and would leave the hosts
    running. Does nothing outside the main thread (signal handlers can only be set there: a
    controller whose loop runs in a worker thread calls this from the main thread) or for a
    signal that already has a handler (`nohup` sets SIGHUP's to ignore). Returns whether the
    caller now holds them, for `restore_handlers`.
    """
    if not in_main_thread():
        return False
    for signum, handler in ((signal.SIGTERM, _raise_system_exit), (signal.SIGHUP, _hung_up)):
        if signal.getsignal(signum) is signal.SIG_DFL:  # (again, where another put the default back meanwhile)
            _HELD["replaced"].setdefault(signum, signal.signal(signum, handler))
    _HELD["count"] += 1
    return True


def restore_handlers(held: bool) -> None:
    """Let go of what `exit_on_sigterm` returned; the last holder puts back the handlers it
    replaced (main thread only: elsewhere they stay, as a notebook's kernel would keep them)."""
    if not held or not in_main_thread():
        return
    _HELD["count"] = max(0, _HELD["count"] - 1)
    if _HELD["count"] == 0:
        replaced, _HELD["replaced"] = _HELD["replaced"], {}
        for signum, handler in replaced.items():
            if signal.getsignal(signum) in (_raise_system_exit, _hung_up):  # not one the user set since
                signal.signal(signum, handler)


def _raise_system_exit(signum: int, frame: types.FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _hung_up(signum: int, frame: types.FrameType | None) -> None:
    """SIGHUP: the terminal is gone, and a write to it would raise (EIO) in the cleanup the exit
    runs; what would go to a descriptor whose reader is gone goes to /dev/null (a log file, a
    live pipe or socket stay as they are), then as SIGTERM."""
    from meshrl.logs import console

    null = os.open(os.devnull, os.O_WRONLY)
    try:
        fds = {1, 2}
        try:
            fds.add(console().fileno())
        except (OSError, ValueError, AttributeError):  # a stream without a descriptor (replaced stderr)
            pass
        for fd in fds:
            try:
                ready = select.poll()
                ready.register(fd, select.POLLOUT)
                if any(events & (select.POLLHUP | select.POLLERR) for _, events in ready.poll(0)):
                    os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)
    raise SystemExit(128 + signum)


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
