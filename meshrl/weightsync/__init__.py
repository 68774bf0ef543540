"""Weight sync: trainer -> generators, one version at a time, never a torn or live view.

How the pieces plug in (three small additions, no base class needed):

Trainer actor (the rank that holds the gathered, HF-named tensors)::

    from meshrl.weightsync import Publisher
    self.publisher = Publisher(cfg.weight_sync)          # in __init__ or setup, inside the actor
    @endpoint
    def weight_sync_handle(self):                        # async def if the actor's endpoints are async
        return self.publisher.handle if self.is_publishing_rank else None
    ...after optimizer step k:
    self.publisher.publish(k, hf_named_tensors)          # copies into staging, returns; cheap

Generator actor::

    from meshrl.weightsync import Subscriber
    self.subscriber = Subscriber(cfg.weight_sync, shared_memory=True)
    @endpoint
    async def weight_sync_handle(self):
        return self.subscriber.handle
    ...when it wants new weights:
    version, tensors = await self.subscriber.fetch()              # newest, no wait if none newer
    version, tensors = await self.subscriber.fetch(version=k)     # at least k, waits up to timeout_s

Controller::

    ws = await WeightSync(cfg.weight_sync).connect(publisher_handle, subscriber_handles)
    ...after a trainer (or generator) restart:
    await ws.reconnect(publisher=new_handle)

`fetch` returns views into one flat buffer, valid until the next fetch returns. Every
failure is a WeightSyncError (WeightSyncTimeout for timeouts) within weight_sync.timeout_s.
"""

from meshrl.weightsync.connect import WeightSync
from meshrl.weightsync.errors import WeightSyncError, WeightSyncTimeout
from meshrl.weightsync.layout import Layout, plan_layout
from meshrl.weightsync.publisher import Publisher, PublisherAgent
from meshrl.weightsync.subscriber import Subscriber, SubscriberAgent

__all__ = [
    "Layout", "Publisher", "PublisherAgent", "Subscriber", "SubscriberAgent",
    "WeightSync", "WeightSyncError", "WeightSyncTimeout", "plan_layout",
]
