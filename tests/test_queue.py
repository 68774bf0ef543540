"""The episode queue: admission, versions, requeue, sampling policies, resume; property tests
of its invariants; threads; and the actor on real Monarch procs."""

import asyncio
import random
import threading
import time
from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrl import episode
from meshrl.episode import PAD_VERSION
from meshrl.config import Config
from meshrl.errors import BatchTimeout, PolicyWentBack, UserCodeError
from meshrl.queue import EpisodeQueue, QueueClosed, straggler_wait
from meshrl.queue.actor import EpisodeQueueActor
from tests.conftest import make_group


def make_queue(batch_groups: int = 1, seed: int = 0, **buffer) -> EpisodeQueue:
    """A queue; dynamic sampling is off unless asked for (size_of gives one-episode groups,
    which carry no signal and which it would drop)."""
    buffer.setdefault("dynamic_sampling", False)
    data = {"batch_groups": batch_groups, "seed": seed, "buffer": buffer}
    if buffer.get("depth") == 0:
        data["generator"] = {"update_mode": "block"}  # synchronous runs need it
    return EpisodeQueue(Config.from_dict(data))


def size_of(gid: int) -> int:
    return 1 + gid % 3


def claim_all(q: EpisodeQueue, worker: int = 0, timeout: float = 0.0) -> list:
    """Every claim admission allows now."""
    claims = []
    while (c := q.claim(worker, timeout)) is not None:
        claims.append(c)
    return claims


def deliver(q: EpisodeQueue, claim, versions: list[int] | None = None) -> bool:
    return q.put(claim.group_id, make_group(claim.group_id, size_of(claim.group_id), versions or [claim.version]), claim.token)


def check_batch(batch, sizes: dict[int, int], version: int, max_lag: int | None) -> None:
    gids = batch["group_id"].tolist()
    # groups whole and contiguous
    seen = []
    for g in gids:
        if not seen or seen[-1] != g:
            assert g not in seen, f"group {g} split in {gids}"
            seen.append(g)
    for g in seen:
        assert gids.count(g) == sizes[g]
    if max_lag is not None:
        lag = episode.staleness(batch, version)[batch["loss_mask"]]
        assert lag.numel() == 0 or int(lag.max()) <= max_lag


# ---- sampling -----------------------------------------------------------------------------------
def test_fifo_sampling_and_timeouts():
    q = make_queue(batch_groups=2, depth=1, max_lag=None, get_timeout_s=30)
    claims = claim_all(q)
    assert [c.group_id for c in claims] == [0, 1, 2, 3] and {c.version for c in claims} == {0}
    t0 = time.monotonic()
    assert q.claim(0, timeout=0.2) is None  # nothing more may start at version 0
    assert 0.15 < time.monotonic() - t0 < 2
    for i in (1, 0, 3):
        assert deliver(q, claims[i])
    batch = q.sample(2, current_version=0)
    assert batch["group_id"].tolist() == [1] * size_of(1) + [0] * size_of(0)  # the oldest finished first
    assert q.sample(1, 0, timeout=0.1)["group_id"].tolist() == [3] * size_of(3)
    assert len(q.ready) == 0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="get_timeout_s"):
        q.sample(1, current_version=0, timeout=0.1)  # group 2 is still running
    assert 0.05 < time.monotonic() - t0 < 2
    with pytest.raises(ValueError, match="at most 4"):
        q.sample(5, 0)
    assert q.consumed == [1, 0, 3]


def test_fifo_takes_the_oldest_claim_not_the_first_to_finish():
    """READY was kept in arrival order: a group claimed at version 0 that finished after one
    claimed at 1 (long replies) was overtaken, then dropped by the staleness bound; `fifo`
    trained long replies less often. READY is oldest first by its tokens' versions."""
    q = make_queue(batch_groups=1, depth=2, max_lag=2, lag_granularity="sequence")
    first = claim_all(q)
    assert [c.version for c in first] == [0, 0, 0]
    deliver(q, first[1])
    q.sample(1, current_version=1)
    (later,) = claim_all(q)
    assert later.version == 1
    deliver(q, later)  # claimed at 1, finished first
    deliver(q, first[2])  # claimed at 0, finished after it
    assert [int(g["group_id"][0]) for g in q.ready] == [first[2].group_id, later.group_id]
    assert q.sample(1, current_version=2)["group_id"].unique().tolist() == [first[2].group_id]
    assert q.sample(1, current_version=3)["group_id"].unique().tolist() == [later.group_id]
    assert q.metrics()["buffer/dropped_stale_groups"] == 0
    # a group with nothing to train (every episode failed: its loss mask cleared) is placed by its
    # tokens' versions all the same, not sent to the back for good; one with no model token first
    from meshrl.queue.sampling import insert_oldest_first, oldest_version

    failed = make_group(7, 2, [1, 2])
    failed["loss_mask"][:] = False
    assert oldest_version(failed) == 1
    empty = make_group(8, 1, [3])
    empty["versions"][:] = PAD_VERSION
    ready = deque([make_group(5, 1, [0]), make_group(6, 1, [2])])
    for g in (failed, empty):
        insert_oldest_first(ready, g)
    assert [int(g["group_id"][0]) for g in ready] == [8, 5, 7, 6]


def test_the_lag_metrics_are_the_last_batchs():
    """`buffer/lag_*` summed every batch since the run began (and a batch a heal retook counted
    twice): a lag that fell back to 0 still read as its old maximum. They are the last batch's."""
    q = make_queue(batch_groups=1, depth=1, max_lag=None, get_timeout_s=30)
    first = claim_all(q)
    deliver(q, first[0])
    q.sample(1, current_version=1)  # sampled by version 0, trained at 1
    m = q.metrics()
    assert m["buffer/lag_max"] == 1 and m["buffer/lag_mean"] == 1 and m["buffer/lag_hist/1"] == size_of(0)
    later = [c for c in claim_all(q) if c.version == 1]
    deliver(q, later[0])
    q.sample(1, current_version=1)
    m = q.metrics()
    assert m["buffer/lag_max"] == 0 and m["buffer/lag_mean"] == 0 and "buffer/lag_hist/1" not in m


def newest_first(groups, n, rng):
    return list(range(len(groups) - n, len(groups)))


def twice_the_first(groups, n, rng):
    return [0] * n


def test_straggler_wait_is_the_wait_after_half_the_batch_arrived():
    assert straggler_wait(10.0, []) == 0.0
    assert straggler_wait(10.0, [1.0, 2.0, 3.0]) == 0.0  # ready before the trainer asked
    assert straggler_wait(0.0, [1.0, 2.0, 3.0, 9.0]) == 7.0  # sync: the last group against the median one
    assert straggler_wait(2.5, [1.0, 2.0, 3.0, 9.0]) == 6.5  # asked after half had arrived
    # the queue reports the last batch's: a sync batch whose last group lags
    q = make_queue(batch_groups=4, depth=0, get_timeout_s=30)
    claims = claim_all(q)
    for c in claims[:3]:
        assert deliver(q, c)
    threading.Timer(0.3, deliver, (q, claims[3])).start()
    q.sample(4, 0)
    assert 0.25 <= q.metrics()["buffer/straggler_s"] < 5


def test_random_policy_and_custom_callable():
    q = make_queue(depth=8, max_lag=None, sampling="random", seed=1)
    for c in claim_all(q):
        deliver(q, c)
    assert q.next_group_id == 9
    picked = q.sample(3, 0)["group_id"].unique().tolist()
    assert len(picked) == 3 and picked != [0, 1, 2]
    newest = make_queue(depth=4, max_lag=None, sampling="tests.test_queue:newest_first")
    for c in claim_all(newest)[:3]:
        deliver(newest, c)
    assert newest.sample(1, 0)["group_id"].unique().tolist() == [2]
    bad = make_queue(depth=4, max_lag=None, sampling="tests.test_queue:twice_the_first")
    for c in claim_all(bad):
        deliver(bad, c)
    with pytest.raises(
        UserCodeError,
        match=r"^queue: ValueError: sampling policy 'tests.test_queue:twice_the_first' returned \[0, 0\]: "
        "expected 2 distinct indices",
    ):
        bad.sample(2, 0)  # the user's policy broke its contract: the queue closes on that one line
    with pytest.raises(UserCodeError, match="twice_the_first"):
        bad.claim(0, 0.1)


# ---- admission ----------------------------------------------------------------------------------
def test_depth_zero_admits_one_batch_per_version():
    q = make_queue(batch_groups=2, depth=0, max_lag=5)
    assert q.max_lag == 0 and q.ahead == 0  # synchronous: on-policy whatever max_lag says
    first = claim_all(q)
    assert [c.group_id for c in first] == [0, 1] and {c.version for c in first} == {0}
    for c in first:
        deliver(q, c)
    assert q.claim(0, 0.1) is None
    assert q.sample(2, 0)["group_id"].unique().tolist() == [0, 1]
    assert q.claim(0, 0.1) is None, "nothing is admitted until the trainer is at version 1"
    q.set_version(1)
    second = claim_all(q)
    assert [c.group_id for c in second] == [2, 3] and {c.version for c in second} == {1}
    q.set_max_lag(3)
    assert q.max_lag == 0 and q.claim(0, 0.0) is None  # depth 0 stays on-policy


@pytest.mark.parametrize("max_lag, lead", [(0, 0), (1, 1), (2, 1), (None, 1)])
def test_colocated_admits_a_batch_at_its_version_and_one_step_off_takes_the_weights_held(max_lag, lead):
    q = EpisodeQueue(Config.from_dict({"batch_groups": 2, "placement": "colocate", "buffer": {"depth": 3, "max_lag": max_lag, "dynamic_sampling": False}}))
    assert q.ahead == 0 and q.max_lag == lead  # depth has no effect: nothing is generated during a step
    first = claim_all(q)
    assert [c.group_id for c in first] == [0, 1] and {c.version for c in first} == {0}
    assert not q.wait_ready(2, 0.05)
    for c in first:
        deliver(q, c)
    assert q.wait_ready(2, 0.0) and q.claim(0, 0.05) is None
    q.sample(2, 0)
    assert q.claim(0, 0.05) is None, "admitted during the trainer's step"
    q.set_version(1)  # the step is done; its weights are still on their way to the generators
    second = claim_all(q)
    assert [c.group_id for c in second] == [2, 3] and {c.version for c in second} == {1 - lead}
    for c in second:
        deliver(q, c, [1 - lead])
    batch = q.sample(2, 1)
    assert int(batch["loss_mask"].sum()) > 0 and q.metrics()["buffer/masked_stale_tokens"] == 0
    q.set_max_lag(0)
    q.set_version(2)
    assert {c.version for c in claim_all(q)} == {2}


@pytest.mark.parametrize("depth, max_lag", [(1, None), (2, 2), (3, 1), (1, 3), (4, None), (2, 0)])
def test_admission_is_v_plus_one_plus_ahead_batches(depth, max_lag):
    bg = 2
    q = make_queue(batch_groups=bg, depth=depth, max_lag=max_lag)
    ahead = min(depth, depth if max_lag is None else max_lag)
    assert q.ahead == ahead
    admitted = 0
    for version in (0, 1, 3):
        q.set_version(version)
        claims = claim_all(q)
        admitted += len(claims)
        assert admitted == (version + 1 + ahead) * bg, (version, admitted)
        assert {c.version for c in claims} <= {version}


def test_set_max_lag_tightens_and_loosens_admission_at_once():
    q = make_queue(depth=3, max_lag=3)
    assert q.claim(0, 0).group_id == 0
    q.set_max_lag(0)
    assert q.ahead == 0 and q.claim(0, 0.05) is None  # 1 batch admitted = (0 + 1 + 0)
    # a worker waiting for admission starts as soon as the bound is loosened
    got = []
    waiter = threading.Thread(target=lambda: got.append((q.claim(1, 10.0), time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    q.set_max_lag(1)
    waiter.join(10)
    assert got[0][0].group_id == 1 and got[0][1] - t0 < 1.0
    assert q.claim(0, 0) is None
    q.set_max_lag(None)  # bounded by depth alone
    assert [c.group_id for c in claim_all(q)] == [2, 3]
    with pytest.raises(ValueError, match="at least 0"):
        q.set_max_lag(-1)


def test_set_max_lag_rechecks_ready_groups():
    q = make_queue(depth=3, max_lag=None)
    c = q.claim(0, 0)
    assert deliver(q, c, [0, 0])
    q.set_version(2)
    assert len(q.ready) == 1  # no bound: kept
    q.set_max_lag(1)
    assert len(q.ready) == 0 and q.dropped == 1  # lags 2 now: dropped, and replaced
    assert q.metrics()["buffer/dropped_stale_groups"] == 1


# ---- versions -----------------------------------------------------------------------------------
def test_version_rejection_sequence_drops_and_admission_replaces():
    q = make_queue(depth=4, max_lag=1, lag_granularity="sequence")
    c0, c1 = claim_all(q)
    q.set_version(3)
    assert not q.put(0, make_group(0, 2, [1, 2, 3]))  # oldest token lags 2: the whole group goes
    assert q.put(1, make_group(1, 2, [2, 3, 3]))
    q.set_version(4)  # now it lags 2: dropped before any sample
    assert len(q.ready) == 0
    m = q.metrics()
    assert m["buffer/dropped_stale_groups"] == 2 and m["buffer/dropped_stale_tokens"] == 12
    assert m["buffer/masked_stale_tokens"] == 0
    # (4 + 1 + 1) batches may be admitted at version 4, plus one replacement per dropped group;
    # 2 are admitted already
    assert q.dropped == 2 and len(claim_all(q)) == (4 + 1 + 1) + 2 - 2


def test_version_rejection_token_masks():
    q = make_queue(depth=4, max_lag=1, lag_granularity="token")
    claim_all(q)
    q.set_version(3)
    assert q.put(0, make_group(0, 2, [1, 2, 3]))
    batch = q.sample(1, 3)
    assert batch["loss_mask"][:, 3:].tolist() == [[False, True, True]] * 2  # the token lagging 2 is out
    assert not batch["loss_mask"][:, :3].any()  # the prompt never trains
    assert q.metrics()["buffer/masked_stale_tokens"] == 2
    assert not q.put(1, make_group(1, 2, [0, 0]))  # nothing left: dropped whole
    assert q.dropped == 1 and q.metrics()["buffer/dropped_stale_groups"] == 1


def test_a_model_held_by_its_pace_counts_its_lag_in_its_own_weight_updates():
    """A game's proposer updating on steps 1, 5, 9, ... (`pace.every` 4) samples versions 1-4 on
    the same weights: the bound masks the policy's tokens that lag, never the proposer's that
    its held weights made, and masks the proposer's once an update moved its weights twice."""
    q = EpisodeQueue(
        Config.from_dict(
            {
                "models": [{"name": "proposer", "trainer": {"pace": {"every": 4}}}],
                "buffer": {"depth": 4, "max_lag": 1, "lag_granularity": "token", "dynamic_sampling": False},
            }
        )
    )
    claim_all(q)
    group = make_group(0, 2, [1, 2, 3])
    group["model"] = torch.tensor([0, 1])  # row 0 the policy's, row 1 the proposer's
    q.set_version(4)
    assert q.put(0, group)
    assert q.ready[0]["loss_mask"][:, 3:].tolist() == [[False, False, True], [True, True, True]]
    assert q.metrics()["buffer/masked_stale_tokens"] == 2
    assert episode.staleness(group, 9, q.paces)[1, 3:].tolist() == [2, 2, 2]  # updated at 5 and 9
    assert episode.staleness(group, 9)[1, 3:].tolist() == [8, 7, 6]  # counted in versions
    q.set_version(5)  # the proposer's first update since: a lag of 1 is within the bound
    batch = q.sample(1, 5)
    assert batch["loss_mask"][:, 3:].tolist() == [[False, False, False], [True, True, True]]
    assert q.metrics()["buffer/lag_max"] == 1


# ---- dynamic sampling ---------------------------------------------------------------------------
def flat_group(gid: int, n: int, version: int, reward: float = 0.0, failed: int | None = None, token_advantage: bool = False):
    """A packed group of `n` episodes that all scored `reward`; episode `failed` (if given)
    failed with a different reward; `token_advantage`: a distillation group with per-token
    advantages on its model tokens."""
    from meshrl.episode import Episode, Turn, assign_advantages, pack

    episodes = [
        Episode(
            gid,
            gid * 100 + i,
            [Turn("env", [1, 2]), Turn("model", [7, 8], [-0.5, -0.5], [version, version], reward=reward)],
            finish_reason="failed" if i == failed else "stop",
        )
        for i in range(n)
    ]
    if failed is not None:
        episodes[failed].turns[-1].reward = reward + 1.0  # ignored: it failed
    group = assign_advantages(pack(episodes), "grpo")
    if token_advantage:
        group["token_advantage"] = torch.where(group["loss_mask"], 0.25, 0.0)
    return group


def test_without_signal_is_equal_rewards_of_trained_episodes():
    assert episode.without_signal(flat_group(0, 4, 0))
    assert episode.without_signal(flat_group(0, 4, 0, reward=0.7))
    assert episode.without_signal(flat_group(0, 1, 0))  # one episode: no baseline, no signal
    assert episode.without_signal(flat_group(0, 3, 0, failed=1))  # the failed one's reward does not count
    assert not episode.without_signal(make_group(0, 2, [0]))  # rewards 0 and 1
    assert not episode.without_signal(flat_group(0, 4, 0, token_advantage=True))  # distillation: signal per token


def test_dynamic_sampling_drops_flat_groups_and_admission_replaces_them():
    q = make_queue(batch_groups=2, depth=0, dynamic_sampling=True, get_timeout_s=30)
    c0, c1 = claim_all(q)
    assert q.put(c0.group_id, flat_group(0, 4, 0, reward=1.0), c0.token)  # delivered (True), not trained
    assert deliver(q, c1)
    assert len(q.ready) == 1 and q.dropped == 1
    [c2] = claim_all(q)  # one replacement admitted, no more
    assert c2.group_id == 2 and c2.version == 0
    assert deliver(q, c2)
    batch = q.sample(2, 0)
    assert batch["group_id"].unique_consecutive().tolist() == [1, 2]
    m = q.metrics()
    assert m["buffer/dropped_zero_variance_groups"] == 1 and m["buffer/kept_zero_variance_groups"] == 0
    # the sampled reward counts the dropped group: 4 x 1.0 + group 1 (0, 1) + group 2 (0, 1, 2)
    assert m["buffer/sampled_reward_mean"] == pytest.approx((4 * 1.0 + 1 + 3) / 9)
    assert m["buffer/dropped_stale_groups"] == 0
    assert q.consumed == [1, 2]


def test_the_sampled_reward_is_the_policys_rows_alone_in_a_game():
    """A game's batch holds other models' rows, a frozen model's too (which has no trainer
    reward of its own): `buffer/sampled_reward_mean`, which the cliff alarm and the summary
    read for the policy, counts the policy's rows alone."""
    frozen = {"name": "proposer", "frozen": True, "model": {"path": "ckpt/proposer"}}
    buffer = {"depth": 0, "dynamic_sampling": False, "get_timeout_s": 30}
    q = EpisodeQueue(Config.from_dict({"batch_groups": 1, "buffer": buffer, "generator": {"update_mode": "block"}, "models": [frozen]}))
    [c] = claim_all(q)
    group = make_group(c.group_id, 4, [c.version])  # rewards 0, 1, 2, 3
    group["model"] = torch.tensor([0, 0, 1, 1])  # the last two rows: a frozen proposer's
    assert q.put(c.group_id, group, c.token)
    q.sample(1, 0)
    assert q.metrics()["buffer/sampled_reward_mean"] == pytest.approx(0.5)


def test_dynamic_sampling_is_bounded_per_batch_then_trains_what_there_is():
    """Every episode scores 0: at most max_dropped_per_batch groups are dropped between two
    batches, then flat groups are kept, and the batch completes."""
    q = make_queue(batch_groups=2, depth=0, dynamic_sampling=True, max_dropped_per_batch=3, get_timeout_s=30)
    for version in range(3):
        played = 0
        while len(q.ready) < 2 and played < 20:
            claims = claim_all(q)
            assert claims, "admission stopped before the batch was full"
            for c in claims:
                assert q.put(c.group_id, flat_group(c.group_id, 4, version), c.token)
                played += 1
        assert played == 2 + 3  # the batch plus the cap, never more
        batch = q.sample(2, version)
        assert len(batch["group_id"].unique()) == 2 and all(episode.without_signal(batch[s]) for s in episode.group_slices(batch))
        assert q.metrics()["buffer/sampled_reward_mean"] == 0.0
        q.set_version(version + 1)
    m = q.metrics()
    assert m["buffer/dropped_zero_variance_groups"] == 9 and m["buffer/kept_zero_variance_groups"] == 6
    # a cap of 0 drops nothing; dynamic sampling off drops nothing
    for buffer in ({"dynamic_sampling": True, "max_dropped_per_batch": 0}, {"dynamic_sampling": False}):
        q = make_queue(batch_groups=1, depth=0, **buffer)
        [c] = claim_all(q)
        assert q.put(c.group_id, flat_group(c.group_id, 4, 0), c.token)
        assert q.dropped == 0 and len(q.ready) == 1


def test_dynamic_sampling_default_cap_is_one_batch_and_survives_a_resume():
    q = make_queue(batch_groups=2, depth=1, max_lag=1, dynamic_sampling=True)
    assert q.max_dropped_per_batch == 2
    claims = claim_all(q)
    assert q.put(claims[0].group_id, flat_group(claims[0].group_id, 2, 0), claims[0].token)
    state = q.state_dict()
    r = make_queue(batch_groups=2, depth=1, max_lag=1, dynamic_sampling=True)
    r.load_state_dict(state)
    assert r.dropped == 1 and r._flat_dropped == 1 and r.metrics() == {**q.metrics(), "buffer/running": 0.0, "buffer/pending": 3.0}
    r.requeue()
    for c in claim_all(r)[:2]:
        assert r.put(c.group_id, flat_group(c.group_id, 2, 0), c.token)
    assert r.dropped == 2 and len(r.ready) == 1  # the second drop reached the cap of 2; the third is kept


@pytest.mark.parametrize("after", [1, 2, 8])
def test_a_resume_that_changes_batch_groups_keeps_admitting_as_many_as_the_bound_allows(after):
    """A run at batch_groups 4 resumed with 1, 2 or 8: admission counts batches of the new size
    from the work in flight as saved. Counted in the saved size, a smaller batch left
    admission shut for many steps (the trainer starved, BatchTimeout), a larger one let dozens
    of groups start past the bound."""

    def step(q, version, n):  # the workers deliver all they may start; the trainer takes a batch
        for c in claim_all(q):
            assert deliver(q, c)
        return q.sample(n, version, timeout=1.0)

    before = make_queue(batch_groups=4, depth=1, max_lag=None)  # (no stale drops: these workers deliver only between steps)
    for v in range(1, 6):
        step(before, v, 4)
    claim_all(before)  # RUNNING when the run stopped: pending once resumed
    resumed = make_queue(batch_groups=after, depth=1, max_lag=None)
    resumed.load_state_dict(before.state_dict())
    for v in range(6, 16):
        step(resumed, v, after)  # never starved
        in_flight = len(resumed.ready) + len(resumed.pending) + len(resumed.running)
        assert in_flight <= max(2 * after, 8 - after * (v - 5)), (v, in_flight)  # the bound, once what was in flight is trained


def test_a_drop_or_a_new_version_wakes_waiting_workers():
    """Admission opened by a stale drop (at put) or by the trainer's sample at a new version
    starts a waiting worker at once, not at its next poll."""
    q = make_queue(depth=1, max_lag=1, lag_granularity="sequence")
    c0, c1 = claim_all(q)

    def wait_claim(out):
        out.append((q.claim(5, 10.0), time.monotonic()))

    got: list = []
    waiter = threading.Thread(target=wait_claim, args=(got,))
    waiter.start()
    time.sleep(0.2)
    q.set_version(2)  # the trainer moved on (two versions at once, as after a resume)
    # version 2 opens admission; the notify of set_version wakes the waiter
    waiter.join(10)
    assert got[0][0].group_id == 2
    more = claim_all(q)
    assert [c.group_id for c in more] == [3]
    got.clear()
    waiter = threading.Thread(target=wait_claim, args=(got,))
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert not q.put(0, make_group(0, 1, [0]))  # lags 2: dropped, one more admitted
    waiter.join(10)
    assert got[0][0].group_id == 4 and got[0][1] - t0 < 1.0
    got.clear()
    waiter = threading.Thread(target=wait_claim, args=(got,))
    waiter.start()
    time.sleep(0.2)
    assert deliver(q, more[0], [2])
    t0 = time.monotonic()
    q.sample(1, 3)  # the trainer samples at version 3: admission opens
    waiter.join(10)
    assert got[0][0].group_id == 5 and got[0][1] - t0 < 1.0


# ---- requeue, close -----------------------------------------------------------------------------
def test_requeue_hands_the_same_group_out_again_and_refuses_late_puts():
    q = make_queue(batch_groups=2, depth=2, max_lag=None)
    a0, a1 = q.claim(0, 0), q.claim(0, 0)
    b2 = q.claim(1, 0)
    assert q.requeue(worker=0) == 2  # worker 0 presumed dead
    assert not deliver(q, a0)  # ... but it was alive: its late put is refused
    again = q.claim(1, 0)
    assert (again.group_id, again.sample) == (a0.group_id, a0.sample)  # re-queued groups come first
    assert deliver(q, again)
    again1 = q.claim(1, 0)
    assert (again1.group_id, again1.sample) == (a1.group_id, a1.sample)
    assert not deliver(q, a1), "the earlier holder's put was taken for the new claim's"
    assert q.claim(1, 0).group_id == 3  # then the stream goes on
    assert q.requeue(group_ids=[b2.group_id]) == 1
    assert q.requeue(group_ids=[b2.group_id]) == 0  # already re-queued
    # a worker presumed dead that was alive gives its claim up late, under its token: the
    # group's new claim is not its to give up (it was, and counted as the group's failed play)
    taken = q.claim(2, 0)
    assert taken.group_id == b2.group_id and q.requeue(group_ids=[b2.group_id], failure="late", token=b2.token) == 0
    assert q.requeue(group_ids=[b2.group_id], token=taken.token) == 1
    assert not deliver(q, b2)
    again2 = q.claim(2, 0)
    assert (again2.group_id, again2.sample) == (b2.group_id, b2.sample)
    for c in (again1, again2):
        assert deliver(q, c)
    assert q.sample(3, 0)["group_id"].unique().tolist() == [0, 1, 2]
    m = q.metrics()
    assert m["buffer/requeued"] == 4 and m["buffer/late_puts"] == 3 and m["buffer/puts"] == 3
    assert q.consumed == [0, 1, 2]  # no group trained twice
    with pytest.raises(ValueError, match="one whole group"):
        q.put(3, make_group(4, 1, [0]))


def test_a_group_its_workers_keep_failing_on_is_dropped_and_replaced():
    """A record nothing can play (a bug, a prompt no env or scorer takes) was played and
    re-queued without end; the MAX_FAILED_PLAYS-th failure drops it, as a stale group is, and
    admission replaces it. A worker's proc dying while it played the group counts as one: a
    record that kills every worker given it (an env that crashes its process) was handed to
    one new worker after another without end."""
    from meshrl.queue.buffer import MAX_FAILED_PLAYS

    q = make_queue(batch_groups=1, depth=0, max_lag=0)
    claim = q.claim(0, 0)
    first = claim.group_id
    for w in range(MAX_FAILED_PLAYS):  # each replacement worker claims it and dies on it
        assert claim.group_id == first and q.requeue(worker=w) == 1
        claim = q.claim(w + 1, 0)
    assert claim.group_id != first and q.metrics()["buffer/dropped_failed_groups"] == 1
    q = make_queue(batch_groups=1, depth=0, max_lag=0)
    bad = q.claim(0, 0)
    assert q.requeue(worker=0) == 1  # presumed dead: counted
    for _ in range(MAX_FAILED_PLAYS - 2):
        again = q.claim(1, 0)
        assert again.group_id == bad.group_id
        q.requeue(group_ids=[again.group_id], failure="IndexError: list index out of range")
    last = q.claim(1, 0)
    assert last.group_id == bad.group_id
    q.requeue(group_ids=[last.group_id], failure="IndexError: list index out of range")
    fresh = q.claim(1, 0)  # its replacement, though the batch of version 0 was admitted already
    assert fresh is not None and fresh.group_id != bad.group_id
    assert deliver(q, fresh)
    assert q.sample(1, 0)["group_id"].unique().tolist() == [fresh.group_id]
    assert q.metrics()["buffer/dropped_failed_groups"] == 1 and q.dropped_ids == [bad.group_id]
    assert q.metrics()["buffer/requeued"] == MAX_FAILED_PLAYS - 1  # the presumed-dead worker's and two failed plays: not the drop
    # what a rollout worker counts against a group: not a lost generator, scorer or a slow call
    from meshrl.agent.turns import GenerationFailed
    from meshrl.agent.worker import _not_the_groups
    from meshrl.scorers.client import ScorerUnavailable

    assert all(_not_the_groups(e) for e in (GenerationFailed("replica 0 died"), ScorerUnavailable("rm"), asyncio.TimeoutError()))
    assert not _not_the_groups(IndexError("list index out of range"))


def test_a_dead_workers_waiting_claim_takes_nothing_once_its_groups_are_requeued():
    """A worker's claim waits in the queue when its proc dies; the controller re-queues its
    groups, which wakes that claim: it must not take them back (its answer is lost, and
    the group would be RUNNING under a dead worker for good)."""
    q = make_queue(batch_groups=2, depth=0, max_lag=0)
    held = [q.claim(7, 0), q.claim(7, 0)]
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(q.claim(7, 10)))
    waiter.start()
    time.sleep(0.2)  # the dead worker's claim is waiting
    assert q.requeue(worker=7) == 2
    waiter.join(10)
    assert got == [None]
    assert [q.claim(8, 0).group_id for _ in held] == [c.group_id for c in held]  # both for the live worker


def test_a_claim_its_worker_gave_up_on_is_handed_out_again_or_takes_nothing():
    """A worker waits CLAIM_POLL_S + CLAIM_GRACE_S for a claim's answer; one that came later
    (a busy queue) was lost with the group it took, RUNNING under a live worker for good, and
    the batch never filled. The worker now gives that claim up by name (`abandon`)."""
    q = make_queue(batch_groups=2, depth=0, max_lag=0)
    lost = q.claim(3, 0, request=0)  # answered, but after its worker stopped waiting
    q.abandon(3, 0)
    assert q.running == {} and q.metrics()["buffer/requeued"] == 1 and q._failed_plays[lost.group_id] == 0  # not a failed play
    again = q.claim(3, 0, request=1)
    assert again.group_id == lost.group_id and not deliver(q, lost) and deliver(q, again)
    q.abandon(3, 0)  # an old name again: nothing of the newer claim's is given up
    assert list(q.running) == [] and len(q.ready) == 1
    got: list = []
    waiting = threading.Thread(target=lambda: got.append(q.claim(4, 10, request=5)))
    q.claim(4, 0, request=4)  # the batch's second group: nothing more is admitted at version 0
    waiting.start()
    time.sleep(0.2)
    q.abandon(4, 5)  # given up while it still waits: it takes nothing when admission opens
    q.set_version(1)
    waiting.join(10)
    assert got == [None] and q.claim(4, 0, request=6) is not None


def test_a_worker_hands_back_a_claim_answered_after_it_stopped_waiting(monkeypatch, tokenizer_dir):
    """The rollout worker's claim loop against a queue whose first answer arrives after the
    worker's wait: the group that answer took is played all the same (by the next claim)."""
    import types

    from meshrl.agent import worker as worker_module

    monkeypatch.setattr(worker_module, "CLAIM_POLL_S", 0.1)
    monkeypatch.setattr(worker_module, "CLAIM_GRACE_S", 0.2)
    q = make_queue(batch_groups=2, depth=0, max_lag=0)
    played: list[int] = []
    late = [True]

    async def claim(w, timeout, request=None):
        async def answer():  # the queue's side goes on after the caller stopped waiting
            got = await asyncio.to_thread(q.claim, w, timeout, request)
            if late.pop() if late else False:
                await asyncio.sleep(1.0)
            return got

        return await asyncio.shield(asyncio.ensure_future(answer()))

    def endpoint(fn):
        return types.SimpleNamespace(call_one=fn)

    async def abandon(w, request):
        q.abandon(w, request)

    async def requeue(*args):
        return q.requeue(*args)

    queue = types.SimpleNamespace(claim=endpoint(claim), abandon=endpoint(abandon), requeue=endpoint(requeue))
    rw = worker_module.RolloutWorker(Config.from_dict({"rollout": {"groups_per_worker": 1}, "logging": {"run_dir": "/runs/x"}}), tokenizer_dir, worker=3)

    async def deliver_one(queue, c):
        played.append(c.group_id)
        deliver(q, c)

    rw._deliver = deliver_one

    async def run():
        rw.start(queue)
        for _ in range(200):
            if len(played) == 2:
                break
            await asyncio.sleep(0.05)
        await rw.stop(5)

    asyncio.run(run())
    assert sorted(played) == [0, 1] and q.running == {} and q.metrics()["buffer/requeued"] == 1


def test_close_wakes_waiters():
    q = make_queue(depth=0, max_lag=0)
    claim_all(q)
    results: list = []

    def claimer():
        try:
            q.claim(0, 10.0)
        except QueueClosed as e:
            results.append(("claim", e))

    def consumer():
        try:
            q.sample(1, 0, timeout=10)
        except QueueClosed as e:
            results.append(("sample", e))

    threads = [threading.Thread(target=claimer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    q.close()
    for t in threads:
        t.join(5)
    assert time.monotonic() - t0 < 2
    assert sorted(r[0] for r in results) == ["claim", "sample"]
    assert isinstance(dict(results)["claim"], QueueClosed)
    with pytest.raises(QueueClosed):
        q.claim(0, 0)


# ---- properties ---------------------------------------------------------------------------------
ops = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.integers(0, 2)),  # worker
        st.tuples(st.just("put"), st.integers(0, 7), st.integers(0, 3)),  # which running group, spread of its versions
        st.tuples(st.just("requeue"), st.integers(0, 2)),  # worker presumed dead
        st.tuples(st.just("train"), st.just(0)),
    ),
    min_size=1,
    max_size=50,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    depth=st.integers(0, 3),
    batch_groups=st.integers(1, 3),
    max_lag=st.one_of(st.none(), st.integers(0, 2)),
    granularity=st.sampled_from(["token", "sequence"]),
    sampling=st.sampled_from(["fifo", "random"]),
    max_dropped=st.one_of(st.none(), st.integers(0, 2)),  # None: dynamic sampling off
)
def test_invariants_single_thread(ops, depth, batch_groups, max_lag, granularity, sampling, max_dropped):
    # one group in three has a single episode (size_of): no signal, dropped under dynamic sampling
    dynamic = {} if max_dropped is None else {"dynamic_sampling": True, "max_dropped_per_batch": max_dropped}
    q = make_queue(batch_groups, seed=3, depth=depth, max_lag=max_lag, lag_granularity=granularity, sampling=sampling, **dynamic)
    bound = q.max_lag
    ahead = q.ahead
    version = 0
    held: dict[int, tuple[int, int]] = {}  # group id -> (worker, claim version), as the workers see it
    samples: dict[int, dict] = {}
    flat_since_train = 0  # groups dropped without signal since the last batch
    for op in ops:
        if op[0] == "claim":
            c = q.claim(op[1], 0)
            if c is not None:
                assert c.version == version
                assert samples.setdefault(c.group_id, c.sample) == c.sample  # a re-claim hands the same record
                held[c.group_id] = (op[1], c.version)
        elif op[0] == "put" and held:
            gid = sorted(held)[op[1] % len(held)]
            _, cv = held.pop(gid)
            # tokens come from the claim's version or newer, and never from the future
            versions = [cv, max(cv, version - op[2]), version]
            late = gid not in q.running
            dropped_before = q.dropped
            ok = q.put(gid, make_group(gid, size_of(gid), versions))
            lag = version - cv
            if late:
                assert not ok
            elif bound is None or lag <= bound:
                assert ok
            elif granularity == "sequence" or all(version - v > bound for v in versions):
                assert not ok
            else:
                assert ok  # its stale tokens are masked
            if ok:  # delivered: dropped if it has no signal, within the cap since the last batch
                flat = size_of(gid) == 1
                assert q.dropped - dropped_before == (flat and max_dropped is not None and flat_since_train < max_dropped)
                flat_since_train += q.dropped - dropped_before
        elif op[0] == "requeue":
            ids = sorted(g for g, (_, w, _, _) in q.running.items() if w == op[1])
            assert q.requeue(worker=op[1]) == len(ids)
        elif op[0] == "train":
            try:
                batch = q.sample(batch_groups, version, timeout=0)
            except TimeoutError:
                continue  # the trainer would wait for the workers
            check_batch(batch, {g: size_of(g) for g in range(q.next_group_id)}, version, bound)
            flat_since_train = 0
            version += 1
            q.set_version(version)
        # admission: never more than (v + 1 + ahead) batches, plus replacements of dropped groups
        assert q.next_group_id <= (version + 1 + ahead) * batch_groups + q.dropped
        # nothing lost, nothing duplicated: every admitted group is in exactly one state
        ready = [int(g["group_id"][0]) for g in q.ready]
        pending = [g for g, _ in q.pending]
        states = [q.consumed, ready, pending, list(q.running)]
        every = [g for s in states for g in s]
        assert len(every) == len(set(every)), states
        assert len(every) + q.dropped == q.next_group_id
        assert sorted(every + q.dropped_ids) == list(range(q.next_group_id))  # and the dropped ones are named
        # so work in flight or waiting is bounded like a queue of (1 + ahead) batches
        assert len(ready) + len(pending) + len(q.running) <= (1 + ahead) * batch_groups
        assert len(q.consumed) == version * batch_groups


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.tuples(st.sampled_from(["ready", "running", "pending"]), st.lists(st.integers(0, 3), min_size=1, max_size=5)), max_size=6),
    version=st.integers(0, 4),
    sampling=st.sampled_from(["fifo", "random"]),
)
def test_state_round_trips_exactly(groups, version, sampling):
    cfg = {"depth": 8, "max_lag": None, "sampling": sampling}
    a = make_queue(seed=7, **cfg)
    a.set_version(version)
    claims = [a.claim(i % 2, 0) for i in range(len(groups))]
    for c, (state, versions) in zip(claims, groups):
        if state == "ready":
            assert a.put(c.group_id, make_group(c.group_id, size_of(c.group_id), versions))
        elif state == "pending":
            assert a.requeue(group_ids=[c.group_id]) == 1
    state = a.state_dict()
    b = make_queue(seed=7, **cfg)
    b.load_state_dict(state)
    # READY groups kept; RUNNING ones are pending now; counters carried over
    want = {**a.metrics(), "buffer/running": 0.0, "buffer/pending": float(len(a.pending) + len(a.running))}
    assert b.metrics() == want
    assert not b.running and b.version == a.version
    while len(a.ready):
        x, y = a.sample(1, version), b.sample(1, version)
        assert set(x.keys()) == set(y.keys())
        for key in x.keys():
            assert torch.equal(x[key], y[key]) and x[key].dtype == y[key].dtype, key
    assert len(b.ready) == 0
    # every group in flight is handed out again (lowest id first), then the prompts go on
    # exactly where they stopped: nothing lost, nothing duplicated
    in_flight = {c.group_id: c.sample for c, (s, _) in zip(claims, groups) if s != "ready"}
    a.requeue()
    resumed = [b.claim(0, 0) for _ in range(len(in_flight) + 3)]
    assert {c.group_id: c.sample for c in resumed[: len(in_flight)]} == in_flight
    assert [c.group_id for c in resumed[: len(in_flight)]] == sorted(in_flight)
    original = [a.claim(0, 0) for _ in range(len(in_flight) + 3)]
    assert [(c.group_id, c.sample) for c in resumed[len(in_flight) :]] == [(c.group_id, c.sample) for c in original[len(in_flight) :]]
    assert [c.group_id for c in resumed[len(in_flight) :]] == [len(groups) + i for i in range(3)]


def test_concurrent_workers_and_trainer_respect_bounds():
    bg, batches = 2, 15
    q = make_queue(batch_groups=bg, depth=2, max_lag=1, lag_granularity="sequence", get_timeout_s=30)
    ahead = q.ahead
    version = [0]
    outstanding: list[float] = []
    stop = threading.Event()
    errors: list = []

    def worker(wid: int):
        rng = random.Random(wid)
        try:
            while (c := q.claim(wid, 0.5)) is not None or not stop.is_set():
                if c is None:
                    continue
                time.sleep(rng.random() * 0.01)  # some groups are overtaken by later ones
                v = version[0]
                q.put(c.group_id, make_group(c.group_id, size_of(c.group_id), [c.version, max(c.version, v - rng.randint(0, 2)), v]))
        except QueueClosed:
            pass  # the test is over
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def monitor():
        while not stop.is_set():
            m = q.metrics()
            outstanding.append(m["buffer/groups"] + m["buffer/running"] + m["buffer/pending"])
            time.sleep(0.0005)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)] + [threading.Thread(target=monitor)]
    for t in threads:
        t.start()
    try:
        for _ in range(batches):
            batch = q.sample(bg, version[0], timeout=30)
            check_batch(batch, {g: size_of(g) for g in range(q.next_group_id)}, version[0], max_lag=1)
            version[0] += 1
            q.set_version(version[0])
    finally:
        stop.set()
        q.close()
        for t in threads:
            t.join(10)
    assert not errors
    assert len(q.consumed) == len(set(q.consumed)) == batches * bg
    assert max(outstanding) <= (1 + ahead) * bg


# ---- the actor on real procs ----------------------------------------------------------------------
from monarch.actor import Actor, endpoint, this_host  # noqa: E402


class Worker(Actor):
    """Claims `count` groups from the queue actor and puts them; returns how long each claim waited."""

    @endpoint
    async def produce(self, queue, worker: int, count: int, n: int) -> list[float]:
        waits = []
        for _ in range(count):
            t0 = time.monotonic()
            claim = None
            while claim is None:
                claim = await queue.claim.call_one(worker, 1.0)
            waits.append(time.monotonic() - t0)
            assert await queue.put.call_one(claim.group_id, make_group(claim.group_id, n, [claim.version]))
        return waits


async def _wait(future):
    return await future


@pytest.mark.slow  # about 35 s on 2 cores: three fresh procs import torch
@pytest.mark.timeout(180)
def test_queue_actor_with_a_worker_mesh():
    async def main():
        queue_procs = this_host().spawn_procs(per_host={"procs": 1})
        worker_procs = this_host().spawn_procs(per_host={"procs": 2})
        try:
            cfg = Config.from_dict({"batch_groups": 2, "buffer": {"depth": 1, "max_lag": 1}}).to_dict()
            queue = queue_procs.spawn("queue", EpisodeQueueActor, cfg)
            workers = worker_procs.spawn("workers", Worker)
            # Each worker wants 3 groups of 2: 6 groups, but (0 + 1 + 1) * 2 = 4 are admitted at version 0.
            # Monarch futures start when awaited: run the workers as tasks.
            p0 = asyncio.create_task(_wait(workers.slice(procs=0).produce.call_one(queue, 0, 3, 2)))
            p1 = asyncio.create_task(_wait(workers.slice(procs=1).produce.call_one(queue, 1, 3, 2)))
            deadline = time.monotonic() + 90  # first calls into fresh procs import torch: slow on 2 cores
            while (await queue.metrics.call_one())["buffer/groups"] < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.5)
            m = await queue.metrics.call_one()
            assert m["buffer/admitted"] == 4 and m["buffer/groups"] == 4  # workers held back by admission
            sizes = {g: 2 for g in range(6)}
            seen = []
            for version in range(3):
                batch = await queue.sample.call_one(2, version, 30.0)
                check_batch(batch, sizes, version, 1)
                seen += batch["group_id"].unique().tolist()
                await queue.set_version.call_one(version + 1)
            assert sorted(seen) == list(range(6))
            waits = (await p0) + (await p1)
            assert max(waits) > 1.0, "some claim must have waited for admission"
            # state survives a round trip through the actor: READY kept, RUNNING handed out again
            ready = await queue.claim.call_one(9, 1.0)
            running = await queue.claim.call_one(9, 1.0)
            assert await queue.put.call_one(ready.group_id, make_group(ready.group_id, 3, [3]))
            state = await queue.state_dict.call_one()
            other = queue_procs.spawn("queue2", EpisodeQueueActor, cfg)
            await other.load_state_dict.call_one(state)
            again = await other.sample.call_one(1, 3, 5.0)
            assert again["group_id"].tolist() == [ready.group_id] * 3
            resumed = await other.claim.call_one(0, 1.0)
            assert (resumed.group_id, resumed.sample) == (running.group_id, running.sample)
            metrics = await queue.metrics.call_one()
            assert metrics["buffer/puts"] == 7 and metrics["buffer/samples"] == 3
            await queue.close.call_one()
            with pytest.raises(Exception, match="episode queue closed"):
                await queue.claim.call_one(0, 5.0)
        finally:
            await worker_procs.stop()
            await queue_procs.stop()

    asyncio.run(main())


def test_shared_batches_are_kept_back_to_each_trained_models_restorable_version():
    """The batches the models beside the policy train on (`shared`): the last two, and every
    one since a model's newest restorable version, which its healed trainer trains again;
    one let go raises at once, in one line, instead of waiting out the timeout."""
    data = {"batch_groups": 1, "data": {"source": "task:propose"}, "models": [{"name": "proposer"}], "buffer": {"dynamic_sampling": False}}
    q = EpisodeQueue(Config.from_dict(data))
    taken = {}
    for version in range(3):
        for c in claim_all(q):
            deliver(q, c)
        taken[version] = q.sample(1, version)["group_id"]
        q.set_version(version + 1)
        q.set_partner_durable(1, 0)  # the model's snapshots stopped at version 0
    assert all(torch.equal(q.shared(v, 0)["group_id"], taken[v]) for v in (0, 1, 2))
    q.set_partner_durable(1, 2)  # restorable at 2 again: what it no longer needs is let go
    for c in claim_all(q):
        deliver(q, c)
    q.sample(1, 3)
    assert q.shared(2, 0) is not None and q.shared(3, 0) is not None
    start = time.monotonic()
    with pytest.raises(LookupError, match=r"no batch for version 0: let go"):
        q.shared(0, 30)
    assert time.monotonic() - start < 1
    # a model waiting for the batch of 4 while the policy's heal takes it back to 3 (or taken back before it
    # asked): told at once, by type, until the policy takes the batch of 4 again
    q.set_version(4)
    threading.Timer(0.2, q.retake, (3,)).start()
    with pytest.raises(PolicyWentBack, match="went back to version 3 before taking the batch of 4"):
        q.shared(4, 30)
    with pytest.raises(PolicyWentBack):
        q.shared(4, 30)
    assert time.monotonic() - start < 5
    q.sample(1, 3)  # the policy trains step 4 again, then takes the batch of 4
    q.set_version(4)  # back where it was: a model asking for the batch of 4 now waits for it, as before the heal
    with pytest.raises(BatchTimeout):
        q.shared(4, 0.1)
    for c in claim_all(q):
        deliver(q, c)
    assert torch.equal(q.sample(1, 4)["group_id"], q.shared(4, 0)["group_id"])


def test_a_models_wait_for_the_shared_batch_starts_again_when_the_policys_trainer_is_healed():
    """A model waiting for the policy's batch (`shared`) while the policy's trainer is healed at
    the same version (`retake`, nothing lost) waits its whole timeout again from the heal: the
    new trainer takes the batch, and a heal that ran long does not end the model's wait first."""
    data = {"batch_groups": 1, "data": {"source": "task:propose"}, "models": [{"name": "proposer"}], "buffer": {"dynamic_sampling": False}}
    q = EpisodeQueue(Config.from_dict(data))
    for c in claim_all(q):
        deliver(q, c)
    entered, wait = threading.Event(), q._cond.wait

    def waits(timeout=None):  # the model's wait has begun
        entered.set()
        return wait(timeout)

    def policy():  # healed 1.2 s into the model's 2-s wait, its new trainer takes the batch at 2.4 s
        assert entered.wait(10)
        start = time.monotonic()
        time.sleep(1.2)
        q.retake(0)
        time.sleep(max(0.0, start + 2.4 - time.monotonic()))
        q.sample(1, 0)

    q._cond.wait = waits
    threading.Thread(target=policy).start()
    assert q.shared(0, 2.0)["group_id"].numel() > 0


def two_model_queue() -> EpisodeQueue:
    """A queue for a run with a trained model beside the policy (it waits in `shared`)."""
    data = {"batch_groups": 1, "data": {"source": "task:propose"}, "models": [{"name": "proposer"}], "buffer": {"dynamic_sampling": False}}
    return EpisodeQueue(Config.from_dict(data))


def test_a_model_waiting_for_the_shared_batch_gets_it_as_soon_as_the_policy_takes_it():
    """`sample` storing the batch wakes the models waiting for it (`shared`) at once, not at the
    next put or version or at the end of their timeout."""
    q = two_model_queue()
    for c in claim_all(q):
        deliver(q, c)
    entered, done, got, wait = threading.Event(), threading.Event(), {}, q._cond.wait

    def waits(timeout=None):  # the model's wait has begun (the lock is released inside it)
        entered.set()
        return wait(timeout)

    def model():
        got["batch"] = q.shared(0, 30)
        got["at"] = time.monotonic()
        done.set()

    q._cond.wait = waits
    threading.Thread(target=model, daemon=True).start()
    try:
        assert entered.wait(10)
        q._cond.wait = wait
        taken, start = q.sample(1, 0), time.monotonic()
        assert done.wait(2), "the model waiting in shared was not woken by sample"
        assert got["at"] - start < 2 and torch.equal(got["batch"]["group_id"], taken["group_id"])
    finally:
        q.close()  # ends a wait left over on failure


def test_shared_hands_out_a_stored_batch_after_close_and_raises_only_without_one():
    """On a stop (`save_on_interrupt` closes the queue), a model behind the policy still gets the
    batch the policy took for its step, so the models reach the same version and are saved;
    a version with no batch stored raises QueueClosed, at once."""
    q = two_model_queue()
    for c in claim_all(q):
        deliver(q, c)
    taken = q.sample(1, 0)
    q.set_version(1)
    q.close()
    assert torch.equal(q.shared(0, 0)["group_id"], taken["group_id"])
    start = time.monotonic()
    with pytest.raises(QueueClosed):
        q.shared(1, 30)
    assert time.monotonic() - start < 2


def test_retake_puts_back_the_batches_taken_since_the_restored_version_once():
    """A healed trainer (controller/heal.py) restored to version v retakes every batch taken
    for v and later, in order and out of `consumed`; batches before the durable version are let go."""
    q = make_queue(batch_groups=2, depth=2, max_lag=2)
    for c in claim_all(q):
        deliver(q, c)
    first = q.sample(2, 0)["group_id"].unique().tolist()
    q.set_version(1, durable=1)  # version 1 is restorable: batch 0 is let go
    second = q.sample(2, 1)["group_id"].unique().tolist()
    q.set_version(2, durable=1)  # version 2 was not snapshotted: batch 1 is held
    for c in claim_all(q):
        deliver(q, c)
    third = q.sample(2, 2)["group_id"].unique().tolist()  # in flight when the trainer died
    assert q.retake(1) == second + third
    assert q.consumed == first and q.version == 1
    assert q.sample(2, 1)["group_id"].unique().tolist() == second  # trained again, in order
    assert q.sample(2, 1)["group_id"].unique().tolist() == third
    assert q.consumed == first + second + third and q.metrics()["buffer/retaken_groups"] == 4
    q.set_version(2)  # no durable version named: every batch taken is let go
    assert q.retake(2) == []
    # under random sampling too, each batch is taken again as it was (the models beside the policy trained it so)
    q = make_queue(batch_groups=2, depth=4, max_lag=None, sampling="random", seed=3)
    for c in claim_all(q):
        deliver(q, c)
    taken = [set(q.sample(2, 0)["group_id"].tolist()), set(q.sample(2, 0)["group_id"].tolist())]
    q.retake(0)
    assert set(q.sample(2, 0)["group_id"].tolist()) == taken[0]
    q.retake(0)  # healed again before it took the second: both, in order
    assert [set(q.sample(2, 0)["group_id"].tolist()) for _ in taken] == taken


def test_a_trainer_healed_from_a_checkpoint_gets_batches_for_the_steps_it_lost():
    """Without snapshots (trainer.snapshot_every 0) every batch is let go once the next version
    is set, and a heal restores the last checkpoint, steps back: the batches of the steps lost
    are not retaken, so admission replaces them with new groups. Before, the healed trainer
    trained what was in flight, then waited for batches no group was admitted for."""
    q = make_queue(batch_groups=2, depth=2, max_lag=2)
    for v in range(8):
        for c in claim_all(q):
            deliver(q, c)
        q.sample(2, v)
        q.set_version(v + 1)
    for c in claim_all(q):
        deliver(q, c)
    assert q.retake(0) == [] and q.version == 0
    for v in range(12):  # the healed trainer, steps 0 to 11 again
        for c in claim_all(q):
            deliver(q, c)
        assert q.sample(2, v, timeout=5)["group_id"].unique().numel() == 2, v
        q.set_version(v + 1)


def test_the_bound_of_the_moment_applies_to_groups_restored_and_retaken():
    """Groups READY in a checkpoint resumed with a tighter buffer.max_lag, and batches a healed
    trainer retakes after Session.set tightened it: each is held to the bound now (dropped,
    sequence granularity), where they went back to READY as they were and were trained past it."""
    saved = make_queue(batch_groups=1, depth=4, max_lag=4, lag_granularity="sequence")
    for c in claim_all(saved):
        assert deliver(saved, c)  # tokens of version 0
    saved.sample(1, 3)  # the trainer at version 3: the rest lag 3, within 4
    assert len(saved.ready) >= 1
    resumed = make_queue(batch_groups=1, depth=4, max_lag=1, lag_granularity="sequence")
    resumed.load_state_dict(saved.state_dict())
    assert len(resumed.ready) == 0 and resumed.metrics()["buffer/dropped_stale_groups"] == len(saved.ready)
    healed = make_queue(batch_groups=1, depth=2, max_lag=2, lag_granularity="sequence")
    for c in claim_all(healed):
        assert deliver(healed, c)
    taken = healed.sample(1, 1)["group_id"].unique().tolist()  # lag 1, within 2
    healed.set_version(2, durable=1)
    healed.set_max_lag(0)  # Session.set(max_lag=0), then the trainer dies
    assert healed.retake(1) == taken and int(taken[0]) not in {int(g["group_id"][0]) for g in healed.ready}
    assert int(taken[0]) in healed.dropped_ids


def test_a_sample_waiting_when_its_trainer_was_healed_takes_nothing():
    """A trainer killed while its rank 0 waits in `sample` (generation slower than training) is
    healed, and the queue's `retake` ends that wait: the dead trainer's call takes no batch
    (no group is lost) and does not move the version back up past the restored one."""
    import threading

    q = make_queue(batch_groups=2, depth=0, max_lag=0)
    for c in claim_all(q):
        deliver(q, c)
    q.sample(2, 0)
    q.set_version(1, durable=0)
    failed, entered, wait = [], threading.Event(), q._cond.wait

    def waits(timeout=None):  # the sample's wait for groups has begun
        entered.set()
        return wait(timeout)

    q._cond.wait = waits
    waiting = threading.Thread(target=lambda: failed.append(pytest.raises(RuntimeError, q.sample, 2, 1, 30.0)))
    waiting.start()
    assert entered.wait(10)
    back = q.retake(0)  # the heal: restored to version 0
    waiting.join(10)
    assert not waiting.is_alive() and "outlived its trainer" in str(failed[0].value)
    assert q.version == 0 and q.sample(2, 0)["group_id"].unique().tolist() == back  # trained again by the new trainer
