"""The replay buffer: property tests of its invariants, and the actor on real Monarch procs."""

import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrl import rollout
from meshrl.buffer import BufferClosed, ReplayBuffer
from meshrl.config import BufferConfig


def make_group(gid: int, n: int, versions: list[int], prompt_len: int = 3) -> "rollout.TensorDict":
    """A group of `n` completions whose tokens carry `versions` (one row pattern for all)."""
    return rollout.from_completions(
        [
            rollout.Completion(
                prompt_ids=list(range(1, prompt_len + 1)),
                response_ids=[7] * len(versions),
                logprobs=[-0.5] * len(versions),
                versions=list(versions),
                finish_reason="stop",
                group_id=gid,
                sample_id=gid * 100 + i,
                reward=float(i),
            )
            for i in range(n)
        ]
    )


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
        lag = rollout.staleness(batch, version)[batch["response_mask"]]
        assert lag.numel() == 0 or int(lag.max()) <= max_lag


def test_fifo_sampling_and_backpressure_timeout():
    buf = ReplayBuffer(BufferConfig(depth=1, max_lag=None, put_timeout_s=0.2), batch_groups=2)
    assert buf.capacity == 2
    buf.put(make_group(0, 2, [0, 0]))
    buf.put(make_group(1, 2, [0, 0]))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="put_timeout_s"):
        buf.put(make_group(2, 2, [0, 0]))
    assert 0.15 < time.monotonic() - t0 < 2
    batch = buf.sample(2, current_version=0)
    assert batch["group_id"].tolist() == [0, 0, 1, 1]
    assert len(buf) == 0
    with pytest.raises(TimeoutError, match="get_timeout_s"):
        buf.sample(1, current_version=0, timeout=0.1)


def test_put_waits_for_room_then_succeeds():
    buf = ReplayBuffer(BufferConfig(depth=1, max_lag=None), batch_groups=1)
    buf.put(make_group(0, 2, [0]))
    done = threading.Event()

    def producer():
        buf.put(make_group(1, 2, [0]), timeout=5)
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    time.sleep(0.2)
    assert not done.is_set(), "a put into a full buffer must wait"
    assert buf.sample(1, 0)["group_id"][0] == 0
    th.join(5)
    assert done.is_set()
    assert buf.metrics()["buffer/producer_wait_s"] >= 0.15


def test_evict_oldest_when_full():
    buf = ReplayBuffer(BufferConfig(depth=1, max_lag=None, when_full="evict_oldest"), batch_groups=2)
    for g in range(5):
        buf.put(make_group(g, 2, [0]))
    assert len(buf) == 2
    assert buf.sample(2, 0)["group_id"].unique().tolist() == [3, 4]
    assert buf.metrics()["buffer/evicted"] == 3


def test_version_rejection_sequence_and_token():
    seq = ReplayBuffer(BufferConfig(depth=4, max_lag=1, lag_granularity="sequence"), batch_groups=1)
    seq.set_version(3)
    assert not seq.put(make_group(0, 2, [1, 2, 3]))  # oldest token lags 2
    assert seq.put(make_group(1, 2, [2, 3, 3]))
    seq.set_version(4)  # now lags 2: dropped at sample time
    assert len(seq) == 0
    m = seq.metrics()
    assert m["buffer/rejected_at_put"] == 1 and m["buffer/dropped_stale_groups"] == 2

    tok = ReplayBuffer(BufferConfig(depth=4, max_lag=1, lag_granularity="token"), batch_groups=1)
    tok.set_version(3)
    assert tok.put(make_group(0, 2, [1, 2, 3]))
    batch = tok.sample(1, 3)
    assert batch["response_mask"].tolist() == [[False, True, True]] * 2
    assert tok.metrics()["buffer/masked_stale_tokens"] == 2
    assert not tok.put(make_group(1, 2, [0, 0]))  # nothing left: dropped whole


def test_depth_zero_is_on_policy():
    buf = ReplayBuffer(BufferConfig(depth=0, max_lag=5), batch_groups=2)
    assert buf.capacity == 2 and buf.max_lag == 0
    buf.set_version(2)
    assert not buf.put(make_group(0, 2, [1]))
    assert buf.put(make_group(1, 2, [2]))


def test_random_policy_and_custom_callable():
    buf = ReplayBuffer(BufferConfig(depth=8, max_lag=None, sampling="random"), batch_groups=1, seed=1)
    for g in range(8):
        buf.put(make_group(g, 2, [0]))
    picked = buf.sample(3, 0)["group_id"].unique().tolist()
    assert len(picked) == 3 and picked != [0, 1, 2]
    newest = ReplayBuffer(BufferConfig(depth=4, max_lag=None, sampling="tests.test_buffer:newest_first"), batch_groups=1)
    for g in range(3):
        newest.put(make_group(g, 2, [0]))
    assert newest.sample(1, 0)["group_id"].unique().tolist() == [2]


def newest_first(groups, n, rng):
    return list(range(len(groups) - n, len(groups)))


def test_close_wakes_waiters():
    buf = ReplayBuffer(BufferConfig(depth=1, max_lag=None), batch_groups=1)
    errors = []

    def consumer():
        try:
            buf.sample(1, 0, timeout=10)
        except BufferClosed as e:
            errors.append(e)

    th = threading.Thread(target=consumer)
    th.start()
    time.sleep(0.1)
    buf.close()
    th.join(5)
    assert len(errors) == 1


# ---- properties ---------------------------------------------------------------------------------
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(1, 4), st.integers(0, 3)),  # group size, version offset back
        st.tuples(st.just("sample"), st.integers(1, 3), st.integers(0, 2)),  # groups, version advance
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    depth=st.integers(0, 3),
    batch_groups=st.integers(1, 3),
    max_lag=st.one_of(st.none(), st.integers(0, 2)),
    granularity=st.sampled_from(["token", "sequence"]),
    sampling=st.sampled_from(["fifo", "random"]),
)
def test_invariants_single_thread(ops, depth, batch_groups, max_lag, granularity, sampling):
    cfg = BufferConfig(depth=depth, max_lag=max_lag, lag_granularity=granularity, sampling=sampling,
                       when_full="evict_oldest", put_timeout_s=0.01, get_timeout_s=0.01)
    buf = ReplayBuffer(cfg, batch_groups, seed=3)
    version, gid, sizes = 0, 0, {}
    for op, a, b in ops:
        if op == "put":
            sizes[gid] = a
            versions = [max(0, version - b)] * 2 + [version]
            buf.put(make_group(gid, a, versions))
            gid += 1
        else:
            version += b
            n = min(a, buf.capacity)
            try:
                batch = buf.sample(n, version)
            except TimeoutError:
                continue
            check_batch(batch, sizes, version, buf.max_lag)
        assert len(buf) <= buf.capacity


@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(st.tuples(st.integers(1, 4), st.lists(st.integers(0, 3), min_size=1, max_size=5)), max_size=6),
    version=st.integers(0, 4),
    sampling=st.sampled_from(["fifo", "random"]),
)
def test_state_round_trips_exactly(groups, version, sampling):
    cfg = BufferConfig(depth=8, max_lag=None, sampling=sampling)
    a = ReplayBuffer(cfg, batch_groups=1, seed=7)
    for gid, (n, versions) in enumerate(groups):
        a.put(make_group(gid, n, versions))
    a.set_version(version)
    state = a.state_dict()
    b = ReplayBuffer(cfg, batch_groups=1, seed=99)
    b.load_state_dict(state)
    assert b.metrics() == a.metrics()
    while len(a):
        x, y = a.sample(1, version), b.sample(1, version)
        assert set(x.keys()) == set(y.keys())
        for key in x.keys():
            assert torch.equal(x[key], y[key]), key
    assert len(b) == 0


def test_concurrent_producers_and_consumer_respect_bounds():
    cfg = BufferConfig(depth=2, max_lag=1, lag_granularity="sequence", put_timeout_s=10, get_timeout_s=10)
    buf = ReplayBuffer(cfg, batch_groups=2)
    sizes, version = {}, [0]
    lock = threading.Lock()
    occupancy = []
    stop = threading.Event()

    def producer(pid: int):
        rng = random.Random(pid)
        for i in range(40):
            gid = pid * 1000 + i
            n = rng.randint(1, 3)
            with lock:
                sizes[gid] = n
                v = version[0]
            buf.put(make_group(gid, n, [max(0, v - rng.randint(0, 2)), v]))

    def monitor():
        while not stop.is_set():
            occupancy.append(len(buf))
            time.sleep(0.0005)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(3)]
    mon = threading.Thread(target=monitor)
    for t in threads + [mon]:
        t.start()
    trained = 0
    while any(t.is_alive() for t in threads) or len(buf) >= 2:
        try:
            batch = buf.sample(2, version[0], timeout=0.5)
        except TimeoutError:
            continue
        with lock:
            check_batch(batch, sizes, version[0], max_lag=1)
            version[0] += 1
        trained += 1
    stop.set()
    for t in threads + [mon]:
        t.join(10)
    assert trained > 5
    assert max(occupancy) <= buf.capacity
