"""Failures of the user's code, told in one line.

An exception raised by the user's env, reward function, data source or sampling policy
inside an actor reaches the console as

    role: ExceptionType: message (file:line of the user's code; log: RUN_DIR/logs/ROLE.log)

`describe` makes that line where the exception is caught (the actor knows its role and its
log file); `UserCodeError` carries it across actor boundaries unchanged, and `one_line`
finds it again in whatever the controller receives (Monarch wraps a remote exception in
an `ActorError`, whose text is the whole remote traceback). The file:line is the innermost
frame of the user's code: not meshrl's, not the standard library's, not an installed
package's when a frame of the user's own is there. A contract break (an env's `step` that
returns the wrong thing: meshrl/rollout/env.py's `ContractError`) points at the method
that broke it.

Errors between actors are typed: a component raises its own exception class (the queue's
`BatchTimeout` and `QueueClosed`, `UserCodeError`) and a caller recognises it with `find`,
which looks through Monarch's `ActorError` wrapping (one per actor hop), never at the
message's text. `RunFailed` and its kinds are how the controller stops a run in one line.
`need` is how a check before the run (meshrl/preflight.py lists them) says what is wrong:
a `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
from typing import Iterator, TypeVar


_MESHRL_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})
_PACKAGE_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib")})


E = TypeVar("E", bound=BaseException)


class UserCodeError(RuntimeError):
    """A failure already told in one line (see `describe`): raised as is across actors."""


class QueueClosed(RuntimeError):
    """The episode queue was closed while a worker or the trainer waited on it."""


class BatchTimeout(TimeoutError):
    """The queue's `sample` waited its timeout (buffer.get_timeout_s) without a full batch:
    rollouts are not arriving. The controller recognises it by type (`find`) after the trip
    queue -> trainer -> controller."""


class PolicyWentBack(RuntimeError):
    """A trained model waited for the policy's batch of a version, and the policy's heal took it
    back before it took that batch: the model is ahead, and waits for the policy (controller/partners.py)."""


class ProcLost(RuntimeError):
    """A call's proc on this host was found gone while the call waited (`futures.unless_lost`): the call is abandoned
    and the proc healed at once, not after Monarch's delivery timeout for a message to a proc that just died."""


class RunFailed(RuntimeError):
    """The run stopped on a failure it can tell in one line (the message); `meshrl run` exits 1."""


class TrainerFailed(RunFailed):
    """A trainer proc died, or the host its batches come from: the run stops; resume it from its last checkpoint."""


class UserCodeFailed(RunFailed):
    """The user's code failed inside an actor (a data source, a sampling policy): the message
    is its one line, `role: ExceptionType: message (file:line; log: PATH)`."""


class EpisodesFailed(RunFailed):
    """Every episode of `contracts.stop_after_failed_steps` consecutive steps failed: the run
    checkpointed and stopped, with the first failure's line."""


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it, else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def source_location(obj) -> str | None:
    """`file:line` where a function, method or class is defined; None for builtins."""
    try:
        obj = inspect.unwrap(obj)
        return f"{shown_path(inspect.getsourcefile(obj))}:{inspect.getsourcelines(obj)[1]}"
    except (TypeError, OSError, ValueError):
        return None


def user_location(exc: BaseException) -> str | None:
    """`file:line` of the innermost frame of the user's code in `exc`'s traceback: outside
    meshrl and the standard library, preferring a file outside the installed packages.
    None when there is none (the call itself failed: a wrong signature)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    frames = [f for f in frames if not os.path.abspath(f.filename).startswith(_MESHRL_DIR)]
    outside_stdlib = [f for f in frames if not os.path.abspath(f.filename).startswith(_STDLIB_DIRS) or os.path.abspath(f.filename).startswith(_PACKAGE_DIRS)]
    own = [f for f in outside_stdlib if not os.path.abspath(f.filename).startswith(_PACKAGE_DIRS)]
    for candidates in (own, outside_stdlib):
        if candidates:
            return f"{shown_path(candidates[-1].filename)}:{candidates[-1].lineno}"
    return None


def first_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def describe(exc: BaseException, role: str, log: str | None = None) -> str:
    """`role: ExceptionType: message (file:line; log: PATH)`, one line."""
    if isinstance(exc, UserCodeError):
        return str(exc)
    where = getattr(exc, "where", None) or user_location(exc)
    tail = "; ".join(x for x in (where, f"log: {log}" if log else None) if x)
    message = first_line(str(exc)) or "(no message)"
    return f"{role}: {type(exc).__name__}: {message}" + (f" ({tail})" if tail else "")


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it wraps: an ActorError's remote exception (Monarch wraps it once per
    actor hop), its `__cause__` and `__context__`, each once."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [getattr(e, "exception", None), e.__cause__, e.__context__]


def find(exc: BaseException, kind: type[E]) -> E | None:
    """The `kind` exception inside `exc` (itself, or wrapped across actors); None when there is none."""
    return next((e for e in causes(exc) if isinstance(e, kind)), None)


def one_line(exc: BaseException) -> str | None:
    """The `UserCodeError` line inside `exc` (itself, its causes, or an ActorError's wrapped
    exception or remote traceback text); None when there is none."""
    marker = f"{UserCodeError.__module__}.{UserCodeError.__name__}: "
    for e in causes(exc):
        if isinstance(e, UserCodeError):
            return str(e)
        text = getattr(e, "exception_formatted", None) or ""
        for line in str(text).splitlines()[::-1]:
            if marker in line:
                return line.split(marker, 1)[1].strip()
    return None
