"""`ScorerActor`: one scorer replica (a reward model, a judge, a remote client or an implicit PRM) on a proc.

scorer = procs.spawn("scorer-rm-0", ScorerActor)
await scorer.setup.call_one(config.to_dict(), index, replica)   # scoring.scorers[index]; restore=True: a PRM's saved state
results = await scorer.score.call_one(items)                     # see service.py
"""

from __future__ import annotations

import asyncio
import gc
import os

import torch

from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.compat import cuda_present, endpoint_for_callers_that_may_die
from meshrl.config import Config
from meshrl.logs import capture_role_output
from meshrl.scorers.backends import start_backend
from meshrl.scorers.service import PRMService, ScorerService


class ScorerActor(Actor):
    def __init__(self):
        self.service: ScorerService | None = None

    @endpoint
    async def setup(self, config_dict: dict, index: int, replica: int = 0, restore: bool = False) -> dict:
        import socket

        import psutil

        config = Config.from_dict(config_dict)
        spec = config.scoring.scorers[index]
        capture_role_output(config, f"scorer-{config.scoring.scorer_names()[index]}-{replica}")
        if not cuda_present():
            # On CPU the trainer and the generators hold the cores: a scorer takes one intra-op
            # thread, so no idle OpenMP thread spins on a core they need, and is not pinned: on the
            # trainer's cores (as the rollout workers are) its work lengthened the trainer's step,
            # while unpinned it runs on whichever core is idle at the moment.
            torch.set_num_threads(1)
        try:
            backend = await start_backend(spec, config, replica, restore)
        except Exception as e:  # noqa: BLE001 - some engine errors do not pickle, and one that cannot be sent aborts the caller
            raise RuntimeError(f"scorer {config.scoring.scorer_names()[index]} could not start: {type(e).__name__}: {str(e)[:500]}") from None
        if spec.kind == "prm":
            self.service = PRMService(backend, spec)  # whole groups per batch, one PRM version each
        else:
            self.service = ScorerService(backend, spec)
        gc.collect()
        gc.freeze()  # as a generator replica: the collector walks only what is made from here on
        me = psutil.Process()
        pids = [(p.pid, p.create_time()) for p in [me, *me.children(recursive=True)]]
        return {"host": socket.gethostname(), "pids": pids, "restored": getattr(backend, "restored", None)}

    @endpoint_for_callers_that_may_die
    async def score(self, items: list[dict]) -> list[dict]:
        """One result per item, once its batch is scored (ScorerService.score). Its caller, a
        rollout worker, may be gone by then: the answer is dropped."""
        if self.service is None:
            raise RuntimeError("ScorerActor.setup() has not been called")
        return await self.service.score(items)

    @concurrent_endpoint
    async def stats(self) -> dict:
        return {**(self.service.stats() if self.service else {}), "pid": os.getpid()}

    @concurrent_endpoint
    async def save_state(self) -> str | None:
        """A trained scorer's (an implicit PRM's) state saved now, beside the run's checkpoint:
        its path; None for a scorer that does not train."""
        save = getattr(self.service.backend if self.service else None, "save", None)
        return await asyncio.to_thread(save) if save is not None else None

    @concurrent_endpoint
    async def export_hf(self, path: str) -> dict | None:
        """A trained scorer (an implicit PRM) exported as a Hugging Face model at `path`
        (ImplicitPRM.export_hf); None for a scorer that does not train."""
        export = getattr(self.service.backend if self.service else None, "export_hf", None)
        return await asyncio.to_thread(export, path) if export is not None else None

    @concurrent_endpoint
    async def shutdown_engine(self) -> None:
        backend = self.service.backend if self.service else None
        release = getattr(backend, "release_sigterm", None)  # a judge's engine: vLLM's SIGTERM handler back first (compat.py)
        if release is not None:
            await release()
        shutdown = getattr(backend, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.service = None
