"""`ScorerActor`: one scorer replica (a reward model, a judge, a remote client or an implicit PRM) on a proc.

scorer = procs.spawn("scorer-rm-0", ScorerActor)
await scorer.setup.call_one(config.to_dict(), index, replica)   # scoring.scorers[index]; restore=True: a PRM's saved state
results = await scorer.score.call_one(items)                     # see service.py

A PRM on `procs` > 1 procs: `setup` on every rank (with the mesh of ranks 1.. as `followers`),
then only rank 0 is called; it leads the others through each collective call (`follow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os

import torch

from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.compat import cuda_present, endpoint_for_callers_that_may_die
from meshrl.config import Config
from meshrl.host import gloo_on_this_host, host_address, started
from meshrl.logs import capture_role_output
from meshrl.scorers.backends import start_backend
from meshrl.scorers.service import PRMService, ScorerService


class ScorerActor(Actor):
    FOLLOWED = ("score_rows", "save", "export_hf", "shutdown")
    """What rank 0 of a sharded PRM leads the others through (ImplicitPRM's collective calls)."""

    def __init__(self):
        self.service: ScorerService | None = None
        self.backend = None  # a sharded PRM's rank > 0: its shards, driven by rank 0 through `follow`

    @endpoint
    async def setup(self, config_dict: dict, index: int, replica: int = 0, restore: bool = False, followers=None) -> dict:
        """Start scoring.scorers[`index`]'s backend. A PRM on several procs: torch.distributed
        from the elastic env first (rank 0's store on this host's address only); rank 0 keeps
        `followers` (ranks 1..) and serves, the others wait for `follow`."""
        import socket

        import psutil

        config = Config.from_dict(config_dict)
        spec = config.scoring.scorers[index]
        rank = int(os.environ["RANK"]) if spec.procs > 1 else 0
        capture_role_output(config, f"scorer-{config.scoring.scorer_names()[index]}-{replica}" + (f"-rank{rank}" if rank else ""))
        if not cuda_present():
            # On CPU the trainer and the generators hold the cores: a scorer takes one intra-op
            # thread, so no idle OpenMP thread spins on a core they need, and is not pinned: on the
            # trainer's cores (as the rollout workers are) its work lengthened the trainer's step,
            # while unpinned it runs on whichever core is idle at the moment.
            torch.set_num_threads(1)
        try:
            with gloo_on_this_host() if spec.procs > 1 else contextlib.nullcontext():  # the group and the meshes FSDP makes
                if spec.procs > 1:
                    await asyncio.to_thread(_join_group, config, rank, spec.procs)
                backend = await start_backend(spec, config, replica, restore)
        except Exception as e:  # noqa: BLE001 - some engine errors do not pickle, and one that cannot be sent aborts the caller
            raise RuntimeError(f"scorer {config.scoring.scorer_names()[index]} could not start: {type(e).__name__}: {str(e)[:500]}") from None
        if rank > 0:
            self.backend = backend
        elif spec.kind == "prm":
            self.service = PRMService(backend, spec, followers, config.trainer.collective_timeout_s)  # whole groups per batch, one PRM version each
        else:
            self.service = ScorerService(backend, spec)
        gc.collect()
        gc.freeze()  # as a generator replica: the collector walks only what is made from here on
        me = psutil.Process()
        pids = [(p.pid, started(p)) for p in [me, *me.children(recursive=True)]]
        return {"host": socket.gethostname(), "pids": pids, "restored": getattr(backend, "restored", None), "world": getattr(backend, "world", 1)}

    @endpoint_for_callers_that_may_die
    async def score(self, items: list[dict]) -> list[dict]:
        """One result per item, once its batch is scored (ScorerService.score). Its caller, a
        rollout worker, may be gone by then: the answer is dropped."""
        if self.service is None:
            raise RuntimeError("ScorerActor.setup() has not been called")
        return await self.service.score(items)

    @endpoint
    async def follow(self, op: str, *args):
        """A sharded PRM's rank > 0: rank 0's collective call `op` (FOLLOWED), on this rank's
        shards and rows, in the order rank 0 sent them (this endpoint runs one call at a time)."""
        if self.backend is None or op not in self.FOLLOWED:
            raise RuntimeError(f"follow({op!r}) on a scorer that is not a PRM's rank > 0, or of an unknown call")
        return await asyncio.to_thread(getattr(self.backend, op), *args)

    @concurrent_endpoint
    async def stats(self) -> dict:
        return {**(self.service.stats() if self.service else {}), "pid": os.getpid()}

    @concurrent_endpoint
    async def save_state(self) -> str | None:
        """A trained scorer's (an implicit PRM's) state saved now, beside the run's checkpoint:
        its path; None for a scorer that does not train."""
        if isinstance(self.service, PRMService):
            return (await self.service.lead("save"))[0]
        return None

    @concurrent_endpoint
    async def export_hf(self, path: str) -> dict | None:
        """A trained scorer (an implicit PRM) exported as a Hugging Face model at `path`
        (ImplicitPRM.export_hf); None for a scorer that does not train."""
        if isinstance(self.service, PRMService):
            return (await self.service.lead("export_hf", path))[0]
        return None

    @concurrent_endpoint
    async def shutdown_engine(self) -> None:
        if isinstance(self.service, PRMService):  # its last save, on every rank
            await self.service.lead("shutdown")
            self.service = None
            return
        backend = self.service.backend if self.service else None
        release = getattr(backend, "release_sigterm", None)  # a judge's engine: vLLM's SIGTERM handler back first (compat.py)
        if release is not None:
            await release()
        shutdown = getattr(backend, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.service = None


def _join_group(config: Config, rank: int, world: int) -> None:
    """This rank of a sharded PRM joins its ranks' torch.distributed group (NCCL where the device
    plan gave it a GPU, as ImplicitPRM trains there; else gloo, even on a host with GPUs), listening
    as the critic's does; its collectives are bounded by trainer.collective_timeout_s."""
    from meshrl.launch.devices import planned_gpu
    from meshrl.trainer.actor import init_process_group_listening_on

    if planned_gpu():
        torch.cuda.set_device(0)  # its own GPU, the one the plan started it seeing
    init_process_group_listening_on(host_address() or "127.0.0.1", rank, world, planned_gpu(), config.trainer.collective_timeout_s)
