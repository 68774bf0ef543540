"""Where output goes: meshrl's own lines to the console, everything else to RUN_DIR/logs/.

A run's procs hold libraries that print freely (vLLM's INFO lines, Monarch, triton, torch
warnings, a nanobind leak report at exit). Each proc sends its file descriptors 1 and 2
to `RUN_DIR/logs/ROLE.log` as it starts (`capture_process_output`), so whatever it and
its children (vLLM's engine core) print lands there, whichever library wrote it. The
`meshrl` command does the same for its own process (`quiet_console`) and keeps a copy of
the terminal for meshrl's lines: the start line, the progress bar, the warnings meshrl
chooses to surface (the `meshrl` logger at WARNING) and the summary. `logging.verbose`
(`meshrl run --verbose`) leaves every descriptor where it was.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

LOG_DIR = "logs"
_console: TextIO | None = None
_stdout_fd: int | None = None  # the process's stdout before `quiet_console` (`restore_terminal`)


def log_path(run_dir: str, role: str) -> str:
    return os.path.join(run_dir, LOG_DIR, f"{role}.log")


def role_log(config, role: str) -> str | None:
    """The file a role's output goes to (RUN_DIR/logs/ROLE.log); None when it stays on the
    terminal (`logging.verbose`)."""
    return None if verbose(config) else log_path(os.path.abspath(config.logging.run_dir), role)


def capture_process_output(run_dir: str, role: str) -> str:
    """Point this process's stdout and stderr (the descriptors, so C++ and child processes
    follow) at RUN_DIR/logs/ROLE.log, appended; returns the path."""
    path = log_path(run_dir, role)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    return path


def quiet_console(run_dir: str) -> TextIO:
    """For the `meshrl` command: keep the terminal for meshrl's lines and send the
    process's descriptors to RUN_DIR/logs/controller.log. Returns the console stream."""
    global _console, _stdout_fd
    if _console is None:
        _console, _stdout_fd = os.fdopen(os.dup(2), "w", buffering=1), os.dup(1)
        capture_process_output(run_dir, "controller")
        handler = logging.StreamHandler(_console)
        handler.setFormatter(logging.Formatter("meshrl: %(levelname)s: %(message)s"))
        handler.setLevel(logging.WARNING)
        logging.getLogger("meshrl").addHandler(handler)
    return _console


def restore_terminal() -> None:
    """Point stdout and stderr back where they went before `quiet_console` (for a process
    this one is replaced by: its own console is there again)."""
    if _console is not None:
        os.dup2(_stdout_fd, 1)
        os.dup2(_console.fileno(), 2)


def console() -> TextIO:
    """Where meshrl's own lines go: the terminal kept by `quiet_console`, else stderr."""
    return _console if _console is not None else sys.stderr


def verbose(config) -> bool:
    """Library output stays on the terminal: `logging.verbose`, or MESHRL_VERBOSE=1."""
    return config.logging.verbose or os.environ.get("MESHRL_VERBOSE") == "1"


def capture_role_output(config, role: str) -> None:
    """Called by each actor as it starts: its proc's output goes to RUN_DIR/logs/ROLE.log,
    unless `logging.verbose` (or MESHRL_VERBOSE=1 in the environment) keeps it on the
    terminal."""
    from meshrl.compat import monarch_unprefixed_logs  # an actor's proc: torch is loaded already

    monarch_unprefixed_logs()
    if verbose(config):
        return
    capture_process_output(os.path.abspath(config.logging.run_dir), role)


def progress_bar(total: int):
    """A progress bar of `total` steps on the console."""
    from tqdm import tqdm

    return tqdm(total=total, desc="meshrl", unit="step", file=console(), dynamic_ncols=True)
