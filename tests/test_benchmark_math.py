"""The arithmetic behind benchmarks/README.md's verdicts: reward at equal policy samples,
the seed-level noise, and the training time to a reward. Pure functions on made-up rows."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from async_vs_sync import mean_gap, policy_samples, reward_gap, time_to_reward  # noqa: E402

BATCH = 64


def rows(rewards, staleness=0.0, step_s=1.0):
    """Benchmark rows for steps 1..n as run_mode builds them."""
    return [{"step": k, "reward": r, "time/step_s": step_s, "policy_samples": policy_samples(k, staleness, BATCH)} for k, r in enumerate(rewards, start=1)]


def test_a_lagging_measurement_of_the_same_learning_is_no_gap():
    # The same policy curve (reward 0.1 per version) seen by an async run whose batches are
    # two versions old: at step k it trains on version k - 3, so its rewards trail by two
    # steps, and at equal policy samples the gap is zero.
    curve = [0.1 * v for v in range(12)]
    sync = rows(curve[:10])
    lagged = rows([curve[max(0, k - 3)] for k in range(1, 11)], staleness=2.0)
    g = reward_gap(lagged, sync)
    assert g["points"] > 0 and g["gap"] == pytest.approx(0.0, abs=1e-9)


def test_a_slower_learner_shows_a_negative_gap_and_fails_the_noise_rule():
    sync = rows([0.1 * k for k in range(10)])
    slower = rows([0.05 * k for k in range(10)])
    g = reward_gap(slower, sync)
    assert g["gap"] < -0.1
    assert not mean_gap([g, g, {**g, "gap": g["gap"] * 1.1}])["within_noise_or_better"]


def test_seed_noise_comes_from_the_spread_between_seeds():
    m = mean_gap([{"gap": 0.1, "stderr": 0.0}, {"gap": -0.1, "stderr": 0.0}, {"gap": 0.0, "stderr": 0.0}])
    assert m["gap"] == pytest.approx(0.0, abs=1e-12)
    assert m["stderr"] == pytest.approx(0.1 / math.sqrt(3))
    assert m["within_noise_or_better"] and m["seeds"] == 3
    assert not mean_gap([])["within_noise_or_better"]


def test_time_to_reward_counts_training_seconds_until_the_window_mean_reaches_the_level():
    r = rows([0.1, 0.5, 0.7, 0.8, 0.9, 0.95], step_s=2.0)
    # 3-step means: 0.433 (step 3), 0.667 (4), 0.8 (5): the level 0.7 is reached at step 5
    assert time_to_reward(r, 0.7) == pytest.approx(10.0)
    assert time_to_reward(r, 0.99) is None
    # the window must be full: one early lucky batch does not count
    assert time_to_reward(rows([0.9, 0.1, 0.1]), 0.5) is None


# ---- the engine simulation of benchmarks/scaling_model.py (long_tail.py's predictions) ----------------
def test_a_sync_batch_waits_for_its_longest_sequence():
    from scaling_model import batch_makespan

    assert batch_makespan([5, 3, 2, 7], capacity=4) == 7  # all at once: the longest sets it
    assert batch_makespan([5, 3, 2, 7], capacity=2) == 12  # 5 | 3 then 2 then 7 (starts at 5)
    assert batch_makespan([4] * 8, capacity=2) == 16


def test_a_full_engine_needs_total_tokens_over_slots_per_batch():
    from scaling_model import stream_steps_per_batch

    assert stream_steps_per_batch([1] * 100, capacity=10, batch=10, drain=False) == 1.0
    # one long sequence per batch: keep overtakes it, drain waits for it at every update
    lengths = ([20] + [1] * 9) * 20
    keep = stream_steps_per_batch(lengths, capacity=10, batch=10, drain=False)
    drain = stream_steps_per_batch(lengths, capacity=10, batch=10, drain=True)
    assert keep == pytest.approx(sum(lengths) / len(lengths) * 10 / 10, rel=0.25) and drain >= 19


def test_gpu_predictions_follow_the_tail():
    from scaling_model import length_predictions, lognormal_lengths

    lengths = sorted(lognormal_lengths(400, 1.4, 8192, 20000))
    assert lengths[len(lengths) * 95 // 100] / lengths[len(lengths) // 2] == pytest.approx(math.exp(1.645 * 1.4), rel=0.1)
    for row in length_predictions(1.4, 20, batches=6):
        s = row["step_s"]
        assert s["keep"] <= min(s["drain"], s["sync"])  # partial rollouts never lose to whole completions here
        assert row["keep_over_sync"] >= row["overlap_bound"] * 0.999  # and gain at least what overlap alone gives
        assert 0 <= row["trainer_idle"]["keep"] < row["trainer_idle"]["sync"] < 1


# ---- benchmarks/stability.py ----------------------------------------------------------------------
def test_stability_tenths_and_collapse_verdict():
    from stability import run_summary, tenths

    assert tenths([float(i) for i in range(20)]) == [0.5 + 2 * i for i in range(10)]
    assert tenths([1.0, 3.0]) == [1.0, 3.0]  # under ten steps: one value each
    # the issue-34 run: a 0.5 plateau, then 0 for the last 20 of 150 steps
    collapsed = run_summary([min(0.5, s / 90) for s in range(130)] + [0.0] * 20)
    assert collapsed["collapsed"] and collapsed["best_tenth"] == pytest.approx(0.5) and collapsed["last_tenth"] < 0.1
    assert 10 <= collapsed["steps_below_half_best"] <= 20
    # a climb that holds its plateau: no collapse, and the slow start does not count as "below"
    held = run_summary([min(0.6, s / 50) for s in range(150)])
    assert not held["collapsed"] and held["steps_below_half_best"] == 0 and held["first_tenth"] < 0.2
    # async against sync, paired by seed: one seed behind, one ahead, equal on average
    from stability import async_minus_sync

    def run(mode, seed, rewards):
        return {"mode": mode, "seed": seed, "rows": [{"step": i + 1, "reward": r} for i, r in enumerate(rewards)]}

    paired = async_minus_sync(
        [run("async", 0, [0.2] * 10), run("sync", 0, [0.3] * 10), run("async", 1, [0.4] * 10), run("sync", 1, [0.3] * 10), run("async", 2, [0.9] * 10)]
    )
    assert paired["seeds"] == 2 and paired["per_seed"] == pytest.approx([-0.1, 0.1]) and paired["gap"] == pytest.approx(0.0)
    assert paired["within_noise_or_better"]
    # a dip that recovers is counted but is no collapse
    dip = run_summary([0.6] * 60 + [0.1] * 30 + [0.6] * 60)
    assert not dip["collapsed"] and dip["steps_below_half_best"] > 0
