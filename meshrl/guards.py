"""Format guards: reward functions that score what a reward model cannot see is wrong.

A policy trained on a reward model finds the answers the model scores high that no one
would accept; a guard scores one such shape directly, and weighted beside the reward model
(or logged at weight 0 to watch it: docs/stability.md) it takes the gain away. Each follows
the reward-function signature `(prompt, response, sample) -> float`, in [0, 1]:

    scoring:
      scorers:
        - {kind: reward_model, path: /ckpt/rm, name: rm}
        - {kind: function, path: meshrl.guards:repetition_guard, weight: 1.0, name: guard}
"""

from __future__ import annotations

RUN = 3
"""Characters of one kind in a row that any answer may have; each one past it is penalised."""
MAX_CHARS = 2048
"""length_guard's default: the response length at which the score reaches 0."""


def repetition_guard(prompt: str, response: str, sample: dict) -> float:
    """1 minus the share of the response's characters that repeat the character before them
    more than RUN times in a row ('1234aaaaaa' scores 0.7, '12345678' 1.0, '' 1.0): a run of
    one character is the shape a gamed reward model most often pays for."""
    if not response:
        return 1.0
    excess, run = 0, 0
    for i, ch in enumerate(response):
        run = run + 1 if i and ch == response[i - 1] else 1
        excess += run > RUN
    return 1.0 - excess / len(response)


def length_guard(prompt: str, response: str, sample: dict) -> float:
    """1 for a response of at most the record's `max_chars` (MAX_CHARS without one), falling
    linearly to 0 at twice that: the length a reward model that prefers longer answers is
    gamed with."""
    limit = int(sample.get("max_chars") or MAX_CHARS)
    return max(0.0, min(1.0, 2.0 - len(response) / limit))
