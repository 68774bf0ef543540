"""The episode queue between rollout workers and the trainer (config section `buffer`).

buffer.py: `EpisodeQueue`, which owns admission, in-flight work and staleness (plain
Python, no Monarch); sampling.py: which READY groups a batch takes (and the waits it reports); actor.py:
`EpisodeQueueActor`, which serves it on the coordinator's proc mesh.
"""

from meshrl.queue.buffer import BatchTimeout, Claim, EpisodeQueue, QueueClosed
from meshrl.queue.sampling import fifo, resolve_policy, straggler_wait, uniform

__all__ = ["BatchTimeout", "Claim", "EpisodeQueue", "QueueClosed", "fifo", "resolve_policy", "straggler_wait", "uniform"]
