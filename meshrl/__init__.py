"""meshrl: asynchronous RL post-training of language models on Monarch actor meshes."""

import sys

from meshrl import collector, compat

if collector.in_a_monarch_proc():  # a proc Monarch started for meshrl's actors: before torch is imported
    collector.for_a_monarch_proc()
compat.monarch_prompt_supervision()  # in the controller, before Monarch loads; the procs it starts inherit it
if not any(isinstance(finder, compat.DeferredDynamoMarks) for finder in sys.meta_path):  # once, reloaded or not
    sys.meta_path.insert(0, compat.DeferredDynamoMarks())  # tensordict without torch._dynamo: seconds off each process that never compiles

from meshrl.config import Config, ConfigError  # noqa: E402

__all__ = ["Config", "ConfigError", "RunResult", "Session", "run"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `run` and `Session` pull in torch, Monarch and vLLM: import them only when asked,
    # so `meshrl config show` and config handling stay instant.
    if name in ("run", "Session", "RunResult"):
        from meshrl import api

        return getattr(api, name)
    raise AttributeError(f"module 'meshrl' has no attribute {name!r}")
