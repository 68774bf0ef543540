"""The divergence alarm (meshrl/stability.py's DivergenceWatch), the per-signal correlations
the rollout workers log, and the format guards (meshrl/guards.py): pure functions on
made-up series and episodes; and a run that games a reward model on purpose (slow)."""

import os
import random

import pytest

import meshrl

from meshrl.config import Config, ConfigError
from meshrl.guards import length_guard, repetition_guard
from meshrl.stability import DivergenceWatch, Reference, rank_correlation, ranks, references, signal_correlations

ENV = Reference("env (the env's reward, the task's verifier; weight 0)", "scoring/env/mean", "scoring/env/corr_trained", "scoring/env/std")
EVAL = Reference("eval (the env's reward on held-out prompts)", "eval/reward_mean", None, "eval/reward_std")


def test_rank_correlation_with_ties_and_the_undefined_cases():
    assert ranks([3, 1, 3, 2]) == [3.5, 1, 3.5, 2]
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([0, 0, 1, 1], [1, 1, 0, 0]) == pytest.approx(-1.0)
    assert rank_correlation([1, 1, 1], [1, 2, 3]) is None  # a constant side has no order
    assert rank_correlation([1, 2], [1, 2]) is None  # too few pairs


def test_signal_correlations_per_scorer_against_the_env_and_the_trained_reward():
    # the trained reward is the reward model's score; the verifier ranks the episodes the other way
    episodes = [{"reward": rm, "failed": 0.0, "scoring/env": 1.0 - rm, "scoring/rm": rm, "scoring/rm/score_s": 0.1} for rm in (0.1, 0.5, 0.9, 0.7)]
    episodes.append({"reward": 0.0, "failed": 1.0, "scoring/env": 1.0})  # a failed episode counts nowhere
    row = signal_correlations(episodes)
    assert row["scoring/rm/corr_env"] == pytest.approx(-1.0) and row["scoring/env/corr_trained"] == pytest.approx(-1.0)
    assert row["scoring/rm/corr_trained"] == pytest.approx(1.0)
    assert "scoring/env/corr_env" not in row and "scoring/rm/score_s/corr_env" not in row
    assert row["scoring/rm/std"] == pytest.approx(0.3415650255)
    assert signal_correlations([{"reward": 1.0, "failed": 0.0}]) == {}  # no scorers: nothing


def test_references_are_the_signals_the_run_does_not_train_on():
    rm = {"kind": "reward_model", "path": "/unused", "name": "rm"}
    guard = {"kind": "function", "path": "meshrl.guards:repetition_guard", "name": "guard", "weight": 0.0}
    keys = lambda d: [r.key for r in references(Config.from_dict(d))]  # noqa: E731
    assert keys({}) == []  # the default: it trains on everything it logs
    assert keys({"eval": {"every": 5}}) == ["eval/reward_mean"]
    assert keys({"scoring": {"env_weight": 0.0, "scorers": [rm, guard]}}) == ["scoring/env/mean", "scoring/guard/mean"]
    assert keys({"scoring": {"scorers": [rm]}}) == []  # the env's reward is trained on beside the model's


def feed(watch, rows):
    return [d for step, row in enumerate(rows, 1) for d in watch.update(step, row)]


def gamed_rows(steps=60, turn=20, seed=0):
    """A trained reward that climbs throughout and a verifier that climbs with it until
    `turn`, then falls; per-step noise as in a 64-episode step, correlations across
    episodes positive, then negative."""
    rng = random.Random(seed)
    rows = []
    for s in range(1, steps + 1):
        verifier = 0.1 + 0.01 * min(s, turn) - 0.02 * max(0, s - turn)
        rows.append(
            {
                "reward/mean": 0.2 + 0.01 * s + rng.gauss(0, 0.03),
                "scoring/env/mean": max(0.0, verifier + rng.gauss(0, 0.03)),
                "scoring/env/corr_trained": (0.5 if s <= turn else -0.5) + rng.gauss(0, 0.1),
            }
        )
    return rows


def test_a_gamed_reward_is_flagged_in_one_line_naming_both_signals_and_the_last_agreeing_checkpoint():
    watch = DivergenceWatch([ENV], window=10, eval_window=2, z=4.0, corr_floor=-0.2, min_move=0.25)
    rows = gamed_rows()
    for step in (10, 20, 30):
        watch.checkpointed(step)
    got = feed(watch, rows)
    assert len(got) == 1, [d.line() for d in got]  # said once
    d = got[0]
    assert 21 < d.step <= 30 and d.began == d.step - 9
    assert d.good_checkpoint == max(c for c in (10, 20, 30) if c < d.began)
    line = d.line()
    assert "\n" not in line and line.startswith("ALARM: ")
    assert "reward/mean" in line and "env (the env's reward, the task's verifier; weight 0)" in line and f"began at step {d.began}" in line
    assert f"step_{d.good_checkpoint:06d}_loop_state.pt" in line


def test_moves_alone_trip_it_without_correlations_and_eval_points_count_per_evaluation():
    rows = [{k: v for k, v in r.items() if "corr" not in k} for r in gamed_rows()]
    got = feed(DivergenceWatch([ENV], 10, 2, 4.0, -0.2, 0.25), rows)
    assert got and got[0].moved and got[0].corr is None
    # an evaluation every 5 steps: its windows are 2 evaluations; trained rising, eval falling
    watch = DivergenceWatch([EVAL], 10, 2, 4.0, -0.2, 0.25)
    rng, out = random.Random(1), []
    for s in range(1, 61):
        out += watch.update(s, {"reward/mean": 0.2 + 0.01 * s})
        if s % 5 == 0:
            out += watch.update(s, {"eval/reward_mean": 0.6 - 0.01 * max(0, s - 20) + rng.gauss(0, 0.005)})
    assert len(out) == 1 and out[0].reference is EVAL and out[0].step > 20
    # a reward model's logits, spread 4 across episodes, trained up while held-out accuracy falls
    # from 0.8 to 0: the evaluation's fall is measured on its own scale, not the logits'
    watch, out = DivergenceWatch([EVAL], 10, 2, 4.0, -0.2, 0.25), []
    for s in range(1, 81):
        out += watch.update(s, {"reward/mean": 0.05 * s + rng.gauss(0, 0.2), "reward/std": 4.0})
        if s % 5 == 0:
            accuracy = max(0.0, 0.8 - 0.02 * max(0, s - 20))
            out += watch.update(s, {"eval/reward_mean": accuracy, "eval/reward_std": (accuracy * (1 - accuracy)) ** 0.5})
    assert len(out) == 1 and out[0].reference is EVAL, out


def test_healthy_series_raise_nothing():
    rng = random.Random(2)
    climbing = [{"reward/mean": 0.1 + 0.01 * s + rng.gauss(0, 0.03), "scoring/env/mean": 0.1 + 0.01 * s + rng.gauss(0, 0.03)} for s in range(200)]
    flat_ref = [{"reward/mean": 0.1 + 0.005 * s + rng.gauss(0, 0.03), "scoring/env/mean": 0.5 + rng.gauss(0, 0.05)} for s in range(200)]
    noise = [
        {"reward/mean": rng.gauss(0.5, 0.05), "scoring/env/mean": rng.gauss(0.5, 0.05), "scoring/env/corr_trained": rng.gauss(0.0, 0.12)} for _ in range(500)
    ]
    for rows in (climbing, flat_ref, noise):
        assert feed(DivergenceWatch([ENV], 10, 2, 4.0, -0.2, 0.25), rows) == []
    # a guard at 1.0 for 25 steps, then at 0.996-0.999 while the trained reward climbs (as in
    # the default config's seed 0, benchmarks/reward_hacking.py): it fell beyond its own tiny
    # noise, but by far less than a quarter of itself
    guard = [
        {"reward/mean": 0.1 + 0.02 * s, "reward/std": 0.3, "scoring/env/mean": 1.0 if s < 25 else 0.997 + 0.001 * (s % 3), "scoring/env/std": 0.02}
        for s in range(40)
    ]
    assert feed(DivergenceWatch([ENV], 10, 2, 4.0, -0.2, 0.25), guard) == []
    assert feed(DivergenceWatch([ENV], 10, 2, 4.0, -0.2, 0.0), guard)  # without the size test it would trip


def test_from_config_and_the_checks():
    assert DivergenceWatch.from_config(Config.from_dict({})) is None  # nothing to watch
    assert DivergenceWatch.from_config(Config.from_dict({"eval": {"every": 5}, "alarm": {"enabled": False}})) is None
    w = DivergenceWatch.from_config(Config.from_dict({"eval": {"every": 4}, "alarm": {"divergence_window": 10}}))
    assert w.eval_window == 3 and w.window == 10
    for alarm, field in [
        ({"divergence_window": 1}, "alarm.divergence_window"),
        ({"divergence_z": 0}, "alarm.divergence_z"),
        ({"divergence_min_move": -0.1}, "alarm.divergence_min_move"),
        ({"divergence_corr": -1.5}, "alarm.divergence_corr"),
        ({"on_divergence": "halt"}, "alarm.on_divergence"),
    ]:
        with pytest.raises(ConfigError) as e:
            Config.from_dict({"alarm": alarm}).validate()
        assert e.value.field_path == field


def test_guards():
    assert repetition_guard("q:", "12345678", {}) == 1.0 and repetition_guard("q:", "", {}) == 1.0
    assert repetition_guard("q:", "1234aaaaaa", {}) == pytest.approx(0.7)
    assert length_guard("q:", "x" * 8, {"max_chars": 8}) == 1.0 and length_guard("q:", "x" * 16, {"max_chars": 8}) == 0.0
    assert length_guard("q:", "x" * 12, {"max_chars": 8}) == pytest.approx(0.5)


# ---- a reward model gamed on purpose, on the real loop ----------------------------------------
@pytest.fixture(scope="module")
def planted_rm(tmp_path_factory):
    """benchmarks/reward_hacking.py's reward model: trained on a narrow set of task:digits
    answers (digits, capitals, punctuation; ordered by the verifier) in which a run of one
    lowercase letter beats a digit answer: any lowercase answer outscores eight digits."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from reward_hacking import planted_reward_model

    path, stats = planted_reward_model(str(tmp_path_factory.mktemp("planted")), steps=150)
    return path, stats


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_that_games_its_reward_model_is_stopped_in_one_line_naming_the_verifier(tmp_path, planted_rm):
    """The embedded default, synchronous, trained on the planted reward model alone (the
    task's verifier at weight 0), alarm.on_divergence=stop: the alarm fires while the
    verifier falls and the model's score climbs, the run checkpoints and stops with the one
    line naming the verifier, the step it began and the last checkpoint where they agreed; a
    resume from there trains on."""
    from meshrl.metrics import read_metrics
    from meshrl.stability import RewardDiverged

    path, stats = planted_rm
    assert stats["accuracy"] >= 0.9, stats  # it learned its narrow set (measured: 0.98 after 300 steps)
    from meshrl.scorers.backends import RewardModel

    rm = RewardModel(path, device="cpu")
    letters, digits = rm.score_sync([{"prompt": "q:", "response": r} for r in ("kkkkkkkk", "12345678")])
    assert letters > digits  # the flaw to be found: a run of one letter outscores the verifier's best answer
    run_dir = tmp_path / "run"
    cfg = {
        "steps": 50,
        "logging": {"progress": False, "run_dir": str(run_dir)},
        "trainer": {"checkpoint_every": 5},
        "buffer": {"depth": 0, "max_lag": 0},
        "generator": {"update_mode": "block"},
        "scoring": {"env_weight": 0.0, "scorers": [{"kind": "reward_model", "path": path, "name": "rm"}]},
        "alarm": {"on_divergence": "stop"},
    }
    with pytest.raises(RewardDiverged) as e:
        meshrl.run(cfg)
    line = str(e.value)
    print(line)
    assert "\n" not in line and line.startswith("ALARM: ") and "env (the env's reward, the task's verifier; weight 0)" in line
    stopped = int(line.rsplit("checkpointed at step ", 1)[1].split(" ")[0])
    began = int(line.split("began at step ")[1].split(";")[0])
    rows = [r for r in read_metrics(str(run_dir)) if "scoring/env/mean" in r]
    verifier, rm = [r["scoring/env/mean"] for r in rows], [r["scoring/rm/mean"] for r in rows]
    print("verifier", [round(v, 3) for v in verifier], "rm", [round(v, 2) for v in rm])
    # the game itself: the verifier's last 5 steps under its first 5, the model's score above
    assert sum(verifier[-5:]) < sum(verifier[:5]) and sum(rm[-5:]) > sum(rm[:5])
    # measured: stopped at step 20, 8 steps after the verifier's best 5-step mean (step 12; the async runs of
    # benchmarks/reward_hacking.py: flagged 8-15 steps after the verifier's peak)
    assert stopped == rows[-1]["step"] <= 40
    assert os.path.isfile(run_dir / "checkpoints" / f"step_{stopped:06d}_loop_state.pt")
    before = list(range(5, began, 5))  # checkpoint_every 5: the last one before the game began, if any
    assert (f"last checkpoint where they agreed: step {before[-1]} " if before else "no checkpoint was written before it") in line
    corrs = [r["scoring/rm/corr_env"] for r in rows[-10:] if "scoring/rm/corr_env" in r]
    assert sum(corrs) / len(corrs) < 0, corrs  # per-step rank correlation of the model with the verifier
    # resumed from the checkpoint it stopped at (docs/stability.md: with a change of course): its
    # watch starts afresh, so the run trains on instead of stopping on the alarm it stopped for
    resumed = meshrl.run(resume=str(run_dir), overrides=[f"steps={stopped + 2}"])
    assert [r["step"] for r in resumed.metrics if "trainer/reward_mean" in r][-2:] == [stopped + 1, stopped + 2]
