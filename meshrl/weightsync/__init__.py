"""Weight sync: trainer -> generators, one version at a time, never a torn or live view.

How the pieces plug in (three small additions, no base class needed):

Trainer actor (the rank that holds the gathered, HF-named tensors)::

    from meshrl.weightsync.publisher import Publisher
    self.publisher = Publisher(cfg.weight_sync)          # in __init__ or setup, inside the actor
    @endpoint
    def weight_sync_key(self):                           # async def if the actor's endpoints are async
        return self.publisher.key if self.is_publishing_rank else None
    ...after optimizer step k:
    self.publisher.publish(k, hf_named_tensors)          # copies into staging, returns; cheap

Generator actor::

    from meshrl.weightsync.subscriber import Subscriber
    self.subscriber = Subscriber(cfg.weight_sync, shared_memory=True)
    @endpoint
    async def weight_sync_key(self):
        return self.subscriber.key
    ...when it wants new weights:
    version, tensors = await self.subscriber.fetch()              # newest, no wait if none newer
    version, tensors = await self.subscriber.fetch(version=k)     # at least k, waits up to timeout_s

Controller (it spawns each sidecar agent on the proc that holds its publisher or subscriber,
so that the agents' meshes are its own)::

    publisher = publisher_agent(trainer_rank0_procs, await trainer.weight_sync_key.call_one())
    subscribers = [subscriber_agent(p, await g.weight_sync_key.call_one()) for p, g in generators]
    ws = await WeightSync(cfg.weight_sync).connect(publisher, subscribers)
    ...after a trainer (or generator) restart:
    await ws.reconnect(publisher=new_publisher)

    from meshrl.weightsync.connect import WeightSync

`fetch` returns views into one flat buffer, valid until the next fetch returns. Every
failure is a WeightSyncError (WeightSyncTimeout for timeouts) within weight_sync.timeout_s.

The package itself exposes the pure pieces, which import torch and the standard library
only: the bucket layout and packing (layout.py, bytecopy.py), the staging snapshots
(staging.py), the receive buffers (buffers.py), the broadcast and file transports
(collective.py, files.py). The Monarch agents live in publisher.py, subscriber.py and
rdma.py; import them from there.
"""

from meshrl.weightsync.buffers import ReceiveBuffers
from meshrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from meshrl.weightsync.layout import Layout, allocate, pack, plan_layout, unpack
from meshrl.weightsync.spec import SyncSpec
from meshrl.weightsync.staging import StagingPool

__all__ = [
    "Layout",
    "ReceiveBuffers",
    "StagingPool",
    "SyncSpec",
    "WeightSyncError",
    "WeightSyncTimeout",
    "allocate",
    "pack",
    "plan_layout",
    "unpack",
]
