"""A step's episode metrics, from the rollout workers' per-episode windows (worker.py's
`metrics`, game.py's `thread_windows`): the policy's under their own names, each model's
beside it as NAME/..., a game's own numbers as game/KEY, and each scorer's signal."""

from __future__ import annotations

from meshrl.stability import signal_correlations


MODEL_METRICS = ("reward/mean", "reward/std", "reward/success_rate", "response/length_mean", "episode/count", "episode/failed", "episode/truncated")
"""The episode metrics a game reports for each model beside the policy, as `NAME/...`."""


SOLVED = 1.0 - 1e-9
"""A verifier's reward at least this high solves its episode (reward/success_rate; an
evaluation's accuracy and pass@k): 1, less float rounding: an episode's reward sums its
turns', and six rounds of 1/6 sum to 0.9999999999999999."""


def succeeded(row, failed: bool) -> float:
    """1.0 where an episode (or a game's thread) did not fail and its env's reward, the verifier's,
    reached 1: with scorers its trained reward adds their scores (a wrong answer a reward model
    rated 1.2 read as a success, a right one it rated -0.5 did not)."""
    return float(not failed and row.signals.get("env", row.reward) >= SOLVED)


def summarize(windows: list[dict[str, float]], failed_total: float = 0.0, first_failure: str | None = None) -> dict:
    """Per-step episode metrics from the workers' per-episode windows; with `first_failure`
    (the first failed episode's reason, one line) as `episode/first_failure`, a string
    kept in the history and not in metrics.jsonl."""
    by_model: dict[str, list[dict]] = {}  # a game's rows carry their model's name; an env's are the policy's
    for w in windows:
        by_model.setdefault(w.get("model", "policy"), []).append(w)
    policy = by_model.pop("policy", [])
    # (a game that failed before the policy spoke has only other models' rows: its failure is still the run's)
    run_level = {"episode/failed_total": failed_total, **({"episode/first_failure": first_failure} if first_failure else {})} if windows else {}
    row = _summary(policy, failed_total, first_failure) if policy else run_level
    if windows:  # a game's env time rides on its first row, whichever model spoke first: the run's, all of it
        row["episode/env_s"] = sum(w["env_s"] for w in windows)
    for name, rows in by_model.items():
        theirs = _summary(rows)
        row.update({f"{name}/{k}": v for k, v in theirs.items() if k in MODEL_METRICS or k.startswith("scoring/")})
    games: dict[str, list[float]] = {}  # a game's Outcome.info, each number's mean over the games that gave it
    for w in windows:
        for key, value in w.items():
            if key.startswith("game/"):
                games.setdefault(key, []).append(value)
    row.update({key: sum(vs) / len(vs) for key, vs in games.items()})
    return row


def _summary(windows: list[dict[str, float]], failed_total: float = 0.0, first_failure: str | None = None) -> dict:
    """`summarize` of one model's episodes (at least one)."""
    n = len(windows)

    def mean(key: str) -> float:
        return sum(w[key] for w in windows) / n

    rewards = [w["reward"] for w in windows]
    mu = sum(rewards) / n
    lengths = sorted(w["response_len"] for w in windows)
    return {
        "response_lengths": lengths,  # every episode's, for length distributions: in the history, not in metrics.jsonl
        "reward/mean": mu,
        "reward/std": (sum((r - mu) ** 2 for r in rewards) / (n - 1)) ** 0.5 if n > 1 else 0.0,
        "reward/success_rate": mean("success"),
        "response/length_mean": mean("response_len"),
        "response/length_p50": lengths[n // 2],
        "response/length_p95": lengths[min(n - 1, int(0.95 * n))],
        "response/length_max": lengths[-1],
        "episode/count": float(n),
        "episode/turns_mean": mean("turns"),
        "episode/tool_calls_mean": mean("tool_calls"),
        "episode/env_tokens_mean": mean("env_tokens"),
        "episode/failed": sum(w["failed"] for w in windows),
        "episode/truncated": sum(w["truncated"] for w in windows),  # cut at max_new_tokens, max_turns or max_seq_len
        "episode/failed_total": failed_total,
        "episode/env_s": sum(w["env_s"] for w in windows),
        **scoring_metrics(windows),
        **({"episode/first_failure": first_failure} if first_failure else {}),
    }


def scoring_metrics(windows: list[dict[str, float]]) -> dict[str, float]:
    """`scoring/NAME/mean` of each signal over the episodes it scored, the mean seconds its
    requests queued, were scored and waited in all (`queue_s`, `score_s`, `wait_s`), and the
    episodes it failed or could not parse (`failed`, `unparsable`, counts)."""
    values: dict[str, list[float]] = {}
    for w in windows:
        for key, value in w.items():
            if key.startswith("scoring/"):
                values.setdefault(key, []).append(value)
    row = {}
    for key, vs in values.items():
        name, _, what = key.removeprefix("scoring/").partition("/")
        if what in ("failed", "unparsable"):
            row[key] = float(sum(vs))
        else:
            row[f"scoring/{name}/{what or 'mean'}"] = sum(vs) / len(vs)
    row.update(signal_correlations(windows))  # what the divergence alarm watches (meshrl/stability.py)
    return row
