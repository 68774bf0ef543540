"""The agent loop: rollout workers that play groups of episodes, model turns from the
generators and env turns from the envs of `meshrl/rollout/`, and put them on the queue.

- turns.py: model turns to generator replicas (replica choice, one message per burst).
- envs.py: which env plays an episode, in training and in evaluation.
- worker.py: `RolloutWorker`, plain asyncio: episodes, groups, evaluation, the claim loop
  and its retry policy, packing.
- actor.py: `RolloutWorkerActor`, the Monarch shell.
"""
