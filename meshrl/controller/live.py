"""A Session's event-loop thread and the run started on it (`Live`), apart from the Session
so that a finalizer or an exit hook can stop them once the Session is gone: the run
directory's lock, the signal handlers, and a shutdown bounded whole."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time

from meshrl.launch.signals import exit_on_sigterm, restore_handlers
from meshrl.logs import console

log = logging.getLogger("meshrl")
SHUTDOWN_S = 300.0
"""The longest `Session.stop` waits for the run's procs to stop (each part has its own bound)."""
CANCEL_S = 60.0
"""How long a shutdown cancelled past SHUTDOWN_S has to run its cleanup."""


class Live:
    """A Session's event-loop thread and the run started on it, apart from the Session so
    that a finalizer or an exit hook can stop them once the Session is gone."""

    def __init__(self) -> None:
        self.run = None
        self.held: int | None = None  # the run directory's lock, while its run lives
        self.thread_loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.thread_loop.run_forever, name="meshrl-session", daemon=True)
        self.thread.start()
        self.signals = exit_on_sigterm()  # SIGTERM (scheduler preemption) runs the same cleanup as Ctrl-C, until stop puts the handlers back
        self._start_ended = threading.Event()
        self._start_ended.set()

    def release(self) -> None:
        """Let go of the run directory's lock (its run stopped, or its start failed)."""
        if self.held is not None:
            os.close(self.held)
            self.held = None

    def starting(self) -> bool:
        """A start is under way (or, cut short, still stopping what it had started)."""
        return not self._start_ended.is_set()

    async def enter(self, loop) -> None:
        self._start_ended.clear()
        try:
            await loop.__aenter__()
            self.run = loop
        finally:
            self._start_ended.set()

    def cancel_start(self, starting, loop) -> None:
        """Cancel a start a signal interrupted; its own failure path stops what it started (`RLLoop.__aenter__`), bounded;
        one that had just finished is stopped whole. A second signal ends the wait: it goes on stopping in the session's thread."""
        if starting is not None:
            starting.cancel()  # first: nothing after it (a line to a terminal that hung up) can keep the start going
        print("meshrl: interrupted while starting: stopping what has started (interrupt again not to wait)", file=console())
        try:
            self._start_ended.wait(SHUTDOWN_S)
        except (KeyboardInterrupt, SystemExit):
            return
        if self.run is loop:
            self.stop_run()

    def stop_run(self) -> bool:
        """Whether its run's shutdown ended. One past SHUTDOWN_S is cancelled and given CANCEL_S
        to run its cleanup (its `finally`s: the job killed, the metrics closed), the loop
        thread running on meanwhile: stopped at once, none of it ran."""
        if self.run is None:
            return True
        loop, self.run, ended = self.run, None, threading.Event()

        async def shutdown() -> None:
            try:
                await loop.shutdown()
            finally:
                ended.set()

        future = asyncio.run_coroutine_threadsafe(shutdown(), self.thread_loop)
        _wait_through_signals(future.result, SHUTDOWN_S)
        if not ended.is_set():
            future.cancel()
            _wait_through_signals(ended.wait, CANCEL_S)
        return ended.is_set()

    def stop(self, why: str | None = None) -> None:
        if why is not None and self.run is not None:
            print(f"meshrl: {why}: stopping its run ({self.run.run_dir})", file=console())
        if self.starting():  # a start a second interrupt stopped waiting for: its procs stop first
            _wait_through_signals(self._start_ended.wait, SHUTDOWN_S)
        if self.stop_run():
            self.release()
        else:  # its procs may live on: no other run takes the directory meanwhile
            print(f"meshrl: the run's shutdown did not end in {SHUTDOWN_S + CANCEL_S:.0f}s: its directory stays locked until this Python exits", file=console())
        if threading.current_thread() is threading.main_thread():  # (elsewhere they stay held: only the main thread sets handlers)
            restore_handlers(self.signals)
            self.signals = False
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread_loop.call_soon_threadsafe(self.thread_loop.stop)
            self.thread.join(10)

    def at_exit(self) -> None:
        self.stop("the interpreter exits with a Session not stopped")

    def dropped(self) -> None:
        """The finalizer of a Session collected without stop(). A collection can happen on any
        thread, the session's own among them, which cannot wait for its own loop: off the main
        thread the stop runs on a thread of its own."""
        atexit.unregister(self.at_exit)
        why = "a Session dropped without stop()"
        if threading.current_thread() is threading.main_thread():
            self.stop(why)
        else:
            threading.Thread(target=self.stop, args=(why,), name="meshrl-session-stop").start()


def _wait_through_signals(wait, timeout_s: float) -> None:
    """Wait for `wait(remaining)` to return, up to `timeout_s`: a Ctrl-C or SIGTERM meanwhile
    is logged and waited through (procs stop first); its own bound running out ends it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            wait(deadline - time.monotonic())
            return
        except (KeyboardInterrupt, SystemExit):
            log.warning("a signal came while the run's procs stop: they stop first")
        except Exception:  # noqa: BLE001 - its own bound ran out, or it failed: nothing more to wait for
            return
