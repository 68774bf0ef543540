"""Code meshrl loads by name: user callables given as import paths, and optional packages.

A config names user code as `module:name` (scoring.reward_fn, rollout.env, ...), and some
features need a package only an extra installs (`pip install 'meshrl[reasoning]'`). Both
are looked up here, so that a missing one fails with a message saying what to do;
`check_import` is the check every component runs on the import paths its config names.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

from meshrl.config import ConfigError
from meshrl.errors import first_line

EXTRAS = {"reasoning_gym": "reasoning", "math_verify": "math", "openenv": "envs"}
"""Optional packages and the meshrl extra that installs each."""


def import_callable(path: str) -> Callable:
    """The object at import path `module:name`; ImportError saying what is missing."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot import {path!r}: {e}") from None


def missing_extra(module: str) -> str | None:
    """None when `module` imports; else the one line telling how to install its extra."""
    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken parent
        pass
    return f"needs the optional package {module!r}: pip install 'meshrl[{EXTRAS.get(module, module)}]'"


def check_import(field: str, value: str, what: str) -> object:
    """The object at `value`, an import path `module:name` naming `what` it should be; else a
    ConfigError on `field`."""
    module, sep, attr = value.partition(":")
    if not (sep and module and attr):
        raise ConfigError(field, f"{value!r} is not an import path 'module:name' of {what}")
    missing = object()
    try:
        found = getattr(importlib.import_module(module), attr, missing)
        problem = f"module {module!r} has no {attr!r}"
    except Exception as e:  # noqa: BLE001 - any import failure is the user's path to fix
        found, problem = missing, f"cannot import module {module!r} ({type(e).__name__}: {first_line(str(e))})"
    if found is missing:
        raise ConfigError(field, f"{value!r}: {problem}: give an importable 'module:name' of {what}")
    return found
