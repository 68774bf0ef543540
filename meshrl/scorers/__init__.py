"""Scoring as a role: reward models, LLM judges, remote reward servers and functions.

The env's reward (a task's verifier, `scoring.reward_fn` / `reward_model`, a multi-turn
env's rewards) is computed as the episode plays. `scoring.scorers` adds signals scored as
each episode finishes, with no barrier between episodes:

    rollout worker: episode done -> item -> scorer replica (least loaded)
    scorer proc:    items from every worker -> batch (full, or its oldest waited batch_wait_s)
                    -> backend (reward model | judge | remote) -> one result per item
    rollout worker: reward = env_weight x env reward + sum(weight x score); group packed
                    once every episode of it is scored, then queued

- backends.py: the reward model, the judge, the remote client, the parsers;
- service.py: one replica's batching and its timings;
- actor.py: the replica on a Monarch proc (`ScorerPool` in meshrl/controller/replicas.py
  starts, watches and replaces them);
- client.py: the rollout worker's side: items, calls, weights, metrics;
- process.py: process rewards (per turn, step or token) as per-token advantages;
- prm.py: PRIME's implicit PRM, scoring every model token and trained online on outcomes;
- preference.py: train a reward model on preference pairs (Bradley-Terry), as the suite does.
docs/scoring.md has the three kinds with a worked config each.
"""

from __future__ import annotations

ON_PROCS = ("reward_model", "judge", "remote", "prm")
"""Kinds that run on scorer procs of their own (a `function` runs in the rollout workers)."""
