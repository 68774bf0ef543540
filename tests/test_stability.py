"""The run-level alarm's detector (meshrl/stability.py): pure functions on made-up series."""

import pytest

from meshrl.config import Config, ConfigError
from meshrl.stability import CliffWatch, entropy_cliff, reward_cliff, window_means


def issue_34_rewards() -> list[float]:
    """Steps 1..150 of the collapse in issue 34: a climb to a 0.5 plateau by step 45, held,
    then every episode at 0 from step 131."""
    return [min(0.5, 0.5 * s / 45) if s <= 130 else 0.0 for s in range(1, 151)]


def test_window_means():
    assert window_means([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]
    assert window_means([1, 2], 3) == []
    assert window_means([2.0], 1) == [2.0]


def test_reward_cliff_on_the_issue_34_collapse_and_not_on_noise():
    rewards = issue_34_rewards()
    assert not reward_cliff(rewards[:130], 10, 0.5, 0.1)
    assert reward_cliff(rewards, 10, 0.5, 0.1)
    # a plateau that wobbles by +-0.2 is no cliff
    wobbly = [0.5 + (0.2 if s % 2 else -0.2) for s in range(100)]
    assert not reward_cliff(wobbly, 10, 0.5, 0.1)
    # a run that never learned (best window under min_best) cannot fall
    assert not reward_cliff([0.05] * 20 + [0.0] * 20, 10, 0.5, 0.1)
    # too few steps for one window: nothing to judge
    assert not reward_cliff([1.0, 0.0], 10, 0.5, 0.1)


def test_entropy_cliff_is_a_floor():
    assert entropy_cliff([4.8] * 5 + [0.01] * 10, 10, 0.02)
    assert not entropy_cliff([0.28] * 20, 10, 0.02)  # a sharp, trained policy is not a collapse
    assert not entropy_cliff([0.0] * 20, 10, 0.0)  # floor 0: off


def test_watch_raises_once_and_names_the_last_good_checkpoint():
    watch = CliffWatch(window=10, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.02)
    raised = []
    for step, reward in enumerate(issue_34_rewards(), start=1):
        if step % 5 == 0:
            watch.checkpointed(step)  # checkpoint_every 5: written before the step is judged
        raised += [(step, a) for a in watch.update(step, {"buffer/sampled_reward_mean": reward, "trainer/entropy": 1.0})]
    assert len(raised) == 1, raised  # one line, not one per step of the fall
    step, alarm = raised[0]
    assert alarm.kind == "reward" and 131 <= step <= 140
    assert alarm.reference == pytest.approx(0.5) and alarm.value < 0.25
    # the first window under half the best ends at step 136: 130 and 135 may hold the falling
    # policy (135 does), 125 precedes the window
    assert step == 136 and alarm.good_checkpoint == 125
    line = alarm.line(10, 0.5)
    assert line.startswith("ALARM: reward fell off a cliff at step 136") and "step 125" in line and "\n" not in line


def test_watch_recovers_then_can_raise_again_and_prefers_the_sampled_reward():
    watch = CliffWatch(window=2, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.0)
    series = [0.8, 0.8, 0.0, 0.0, 0.0, 0.8, 0.8, 0.0, 0.0]
    kinds = [[a.kind for a in watch.update(i, {"buffer/sampled_reward_mean": r, "trainer/reward_mean": 1.0})] for i, r in enumerate(series)]
    assert [i for i, k in enumerate(kinds) if k] == [3, 8]  # once per fall
    assert watch.raised[0].good_checkpoint is None
    assert "no checkpoint" in watch.raised[0].line(2, 0.5)
    # without the sampled reward, trainer/reward_mean is watched
    plain = CliffWatch(window=2, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.0)
    got = [plain.update(i, {"trainer/reward_mean": r}) for i, r in enumerate([0.8, 0.8, 0.0, 0.0])]
    assert [len(g) for g in got] == [0, 0, 0, 1]


def test_watch_entropy_alarm():
    watch = CliffWatch(window=3, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.05)
    watch.checkpointed(1)
    watch.checkpointed(3)  # inside the window that fell under the floor
    alarms = [watch.update(s, {"trainer/entropy": e, "trainer/reward_mean": 0.0}) for s, e in enumerate([3.0, 2.0, 1.0, 0.01, 0.01, 0.01, 0.01])]
    fired = [(s, a) for s, al in enumerate(alarms) for a in al]
    assert len(fired) == 1 and fired[0][1].kind == "entropy" and fired[0][0] == 5
    assert fired[0][1].good_checkpoint == 1
    assert "entropy collapsed" in fired[0][1].line(3, 0.5)


def test_a_nan_entropy_is_a_collapse_and_a_nan_reward_is_skipped():
    """A policy whose weights went NaN reports NaN entropy every step: the alarm fires, where a
    NaN mean compared with the floor had read as healthy; a NaN reward is not a cliff."""
    watch = CliffWatch(window=3, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.05)
    rows = [{"trainer/entropy": 1.0 if s < 4 else float("nan"), "trainer/reward_mean": 0.8 if s != 5 else float("nan")} for s in range(10)]
    fired = [(s, a.kind) for s, row in enumerate(rows) for a in watch.update(s, row)]
    assert fired == [(4, "entropy")], fired


def test_the_last_good_checkpoint_precedes_the_window_when_a_model_skips_steps():
    """A proposer with no rows of its own on steps 4 and 6 (skipped): its window of 2 at step 7
    holds steps 5 and 7, and the fall began at 5, so the checkpoint to go back to is 4, not 5."""
    watch = CliffWatch(window=2, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.0, models=["proposer"])
    for c in (2, 4, 5, 6):
        watch.checkpointed(c)
    points = {1: 0.8, 2: 0.8, 3: 0.8, 5: 0.1, 7: 0.1}
    fired = []
    for step in range(1, 8):
        row = {"trainer/reward_mean": 0.5, "proposer/trainer/tokens": 10.0 if step in points else 0.0}
        row |= {"proposer/trainer/reward_mean": points[step]} if step in points else {}
        fired += watch.update(step, row)
    assert [(a.step, a.model, a.good_checkpoint) for a in fired] == [(7, "proposer", 4)]


def test_alarm_config_checks():
    c = Config.from_dict({})
    assert c.alarm.enabled and c.alarm.window == 10 and c.alarm.reward_drop == 0.5
    with pytest.raises(ConfigError, match="alarm.reward_drop"):
        Config.from_dict({"alarm": {"reward_drop": 1.5}})
    with pytest.raises(ConfigError, match="alarm.window"):
        Config.from_dict({"alarm": {"window": 0}})
    with pytest.raises(ConfigError, match="buffer.max_dropped_per_batch"):
        Config.from_dict({"buffer": {"max_dropped_per_batch": -1}})


def test_in_a_game_each_trained_model_is_watched_on_its_own_rows():
    """A solver (the policy) falls while the proposer rises: each is watched on its own rows
    (the policy on the buffer's sampled reward, which counts its rows alone), and the alarm
    names the fall, and whose it is."""
    watch = CliffWatch(window=2, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.05, models=["proposer"])
    solver = [0.8, 0.8, 0.8, 0.1, 0.1, 0.1]
    proposer = [0.2, 0.2, 0.2, 0.9, 0.9, 0.9]
    fired = []
    for step, (s, p) in enumerate(zip(solver, proposer), start=1):
        row = {
            "buffer/sampled_reward_mean": s,
            "trainer/reward_mean": 1.0,
            "proposer/trainer/reward_mean": p,
        }  # (under dynamic sampling the trained batch's can stay high)
        row |= {"trainer/entropy": 1.0, "proposer/trainer/entropy": 0.01 if step > 3 else 1.0}
        fired += [(step, a) for a in watch.update(step, row)]
    assert [(step, a.model, a.kind, a.key) for step, a in fired] == [
        (5, "", "reward", "alarm/reward"),
        (5, "proposer", "entropy", "proposer/alarm/entropy"),
    ]
    assert fired[0][1].line(2, 0.5).startswith("ALARM: reward fell off a cliff at step 5")
    assert fired[1][1].line(2, 0.5).startswith("ALARM: proposer's entropy collapsed at step 5")
    # a step that trained none of a model's own rows (a masked stand-in row: entropy 0, another
    # model's reward) is no point of its series
    spared = CliffWatch(window=2, reward_drop=0.5, min_best_reward=0.1, entropy_floor=0.05, models=["proposer"])
    empty = {"proposer/trainer/tokens": 0.0, "proposer/trainer/entropy": 0.0, "proposer/trainer/reward_mean": 0.0}
    for step in range(1, 7):
        rows = {"trainer/tokens": 10.0, "trainer/entropy": 1.0, "trainer/reward_mean": 0.5, "proposer/trainer/tokens": 10.0}
        rows |= {"proposer/trainer/entropy": 1.0, "proposer/trainer/reward_mean": 0.8} if step < 3 else empty
        assert not spared.update(step, rows), step
