"""Batch formation as a pure function: no event loop, no device."""

from __future__ import annotations

import gc
import itertools
import random
import weakref

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from opsched import SchedulerConfig
from opsched.core.batching import SMALL_FUSED_BYTES, RequestQueue, form_batches
from opsched.core.requests import Request, RequestState
from opsched.ops import GLU_BACKWARD, GROUP_NORM_GRAD

_ids = itertools.count()


def glu_request(rows=2, cols=8, dtype=np.float32, priority=0, deadline=None, at=0.0):
    x = np.zeros((rows, cols), dtype)
    tensors = {"grad_out": np.zeros((rows, cols // 2), dtype), "self": x, "out": np.empty_like(x)}
    scalars = GLU_BACKWARD.check(tensors, {"dim": -1}, allocate=False)
    key, units = GLU_BACKWARD.fusion(tensors, scalars)
    return Request(
        next(_ids),
        at,
        GLU_BACKWARD,
        tensors,
        scalars,
        key,
        units,
        GLU_BACKWARD.nbytes(tensors),
        priority,
        deadline,
    )


def gn_request(m=16, priority=0):
    x = np.zeros((2, 3, m), np.float32)
    stats = np.zeros((2, 3), np.float32)
    tensors = {"x": x, "dy": x, "gamma": x, "mean": stats, "rstd": stats, "dx": np.empty_like(x)}
    key, units = GROUP_NORM_GRAD.fusion(tensors, {})
    return Request(
        next(_ids),
        0.0,
        GROUP_NORM_GRAD,
        tensors,
        {},
        key,
        units,
        GROUP_NORM_GRAD.nbytes(tensors),
        priority,
        None,
    )


def queue_of(*requests):
    q = RequestQueue()
    for r in requests:
        q.push(r)
    return q


CFG = SchedulerConfig(streams=4)


def test_same_key_fuses_into_one_launch():
    reqs = [glu_request() for _ in range(5)]
    batches, expired, wake = form_batches(queue_of(*reqs), [0], CFG, now=1.0)
    assert len(batches) == 1 and batches[0].requests == reqs and batches[0].fused
    assert not expired and wake is None
    lone = glu_request()
    batches, _, _ = form_batches(queue_of(lone), [0], CFG, now=1.0)
    assert batches[0].requests == [lone] and not batches[0].fused


def test_keys_do_not_mix_and_highest_priority_key_goes_first():
    low = [glu_request() for _ in range(3)]
    high = gn_request(priority=5)
    other_dtype = glu_request(dtype=np.float16, priority=1)
    q = queue_of(*low, high, other_dtype)
    idle = [0, 1, 2]
    batches, _, _ = form_batches(q, idle, CFG, now=1.0)
    assert [b.requests for b in batches] == [[high], [other_dtype], low]
    assert [b.stream for b in batches] == [0, 1, 2] and idle == []


def test_fifo_within_priority_and_priority_order_within_a_batch():
    a, b, c = glu_request(priority=0), glu_request(priority=2), glu_request(priority=0)
    batches, _, _ = form_batches(queue_of(a, b, c), [0], CFG, now=1.0)
    assert batches[0].requests == [b, a, c]


def test_max_batch_requests_and_bytes():
    reqs = [glu_request() for _ in range(10)]
    cfg = SchedulerConfig(streams=1, max_batch_requests=4)
    q = queue_of(*reqs)
    batches, _, _ = form_batches(q, [0], cfg, now=1.0)
    assert batches[0].requests == reqs[:4] and len(q) == 6
    per = reqs[0].nbytes
    cfg = SchedulerConfig(streams=1, max_batch_bytes=3 * per)
    batches, _, _ = form_batches(queue_of(*reqs), [0], cfg, now=1.0)
    assert len(batches[0].requests) == 3


def test_small_requests_fuse_up_to_an_inline_launch_where_the_device_runs_them_inline():
    small = [glu_request() for _ in range(64)]
    per = small[0].nbytes
    cfg = SchedulerConfig(streams=1, inline_max_bytes=10 * per)
    inline, _, _ = form_batches(queue_of(*small), [0], cfg, now=1.0, inline=True)
    assert [len(b.requests) for b in inline] == [10]  # (the rest waits for the next round)
    elsewhere, _, _ = form_batches(queue_of(*small), [0], cfg, now=1.0, inline=False)
    assert [len(b.requests) for b in elsewhere] == [64]
    # requests over SMALL_FUSED_BYTES, or too large for two to fit inline: max_batch_bytes
    large = [glu_request(rows=32, cols=2048) for _ in range(8)]  # 640 KiB each
    assert large[0].nbytes > SMALL_FUSED_BYTES
    cfg = SchedulerConfig(streams=1, inline_max_bytes=4 * large[0].nbytes)
    batches, _, _ = form_batches(queue_of(*large), [0], cfg, now=1.0, inline=True)
    assert [len(b.requests) for b in batches] == [8]
    cfg = SchedulerConfig(streams=1, inline_max_bytes=per)
    batches, _, _ = form_batches(queue_of(*small), [0], cfg, now=1.0, inline=True)
    assert [len(b.requests) for b in batches] == [64]


def test_work_spreads_over_idle_streams_when_each_share_is_large():
    reqs = [glu_request(rows=32, cols=2048) for _ in range(64)]  # 640 KiB each
    batches, _, _ = form_batches(queue_of(*reqs), [0, 1], CFG, now=1.0)
    assert [len(b.requests) for b in batches] == [32, 32]
    small = [glu_request() for _ in range(64)]  # 64 x 160 B: one launch is cheaper
    batches, _, _ = form_batches(queue_of(*small), [0, 1], CFG, now=1.0)
    assert [len(b.requests) for b in batches] == [64]


def test_large_request_launches_alone_and_splits_across_idle_streams():
    cfg = SchedulerConfig(streams=4, fuse_max_bytes=1000, split_min_bytes=4000)
    big = glu_request(rows=64, cols=16)  # 8 KiB of operands, queued first
    small = glu_request()
    q = queue_of(big, small)
    batches, _, _ = form_batches(q, [0, 1, 2], cfg, now=1.0)
    assert [b.fused for b in batches] == [False, False, False]  # one part per idle stream
    assert all(b.requests == [big] for b in batches) and big.parts_left == 3
    parts = [b.part[0]["self"] for b in batches]
    assert [p.shape[0] for p in parts] == [21, 21, 22]
    assert all(np.shares_memory(p, big.tensors["self"]) for p in parts)  # views, no copies
    assert len(q) == 1  # small waits for a stream
    batches, _, _ = form_batches(q, [1], cfg, now=1.0)
    assert batches[0].requests == [small] and not batches[0].fused  # alone: no gather


def test_large_request_whose_outputs_come_at_launch_runs_whole():
    # A device may leave outputs to the launch (the host devices do for requests that may
    # fuse): there is nothing to cut into parts yet, so the request runs unsplit.
    cfg = SchedulerConfig(streams=4, fuse_max_bytes=1000, split_min_bytes=4000)
    big = glu_request(rows=64, cols=16)
    big.tensors["out"] = None
    batches, _, _ = form_batches(queue_of(big), [0, 1, 2], cfg, now=1.0)
    assert len(batches) == 1 and batches[0].part is None and big.parts_left == 1


def test_large_request_alone_when_one_stream_idle():
    cfg = SchedulerConfig(streams=4, fuse_max_bytes=1000, split_min_bytes=4000)
    big = glu_request(rows=64, cols=16)
    batches, _, _ = form_batches(queue_of(big), [3], cfg, now=1.0)
    assert len(batches) == 1 and batches[0].part is None and batches[0].stream == 3


def test_expired_requests_leave_without_launching():
    gone = glu_request(deadline=0.5)
    live = glu_request(deadline=2.0)
    q = queue_of(gone, live)
    batches, expired, _ = form_batches(q, [0], CFG, now=1.0)
    assert expired == [gone] and gone.state is RequestState.EXPIRED
    assert batches[0].requests == [live] and len(q) == 0


def test_queue_expires_due_deadlines_in_order_and_says_the_next():
    late, soon, never, gone = (glu_request(deadline=d) for d in (3.0, 1.0, None, 2.0))
    q = queue_of(late, soon, never, gone)
    q.discard(gone, RequestState.CANCELLED)  # left the queue: its deadline no longer counts
    assert q.next_deadline() == 1.0
    assert q.expire_due(now=0.5) == [] and len(q) == 3
    assert q.expire_due(now=2.5) == [soon] and soon.state is RequestState.EXPIRED
    assert q.next_deadline() == 3.0 and len(q) == 2
    assert q.expire_due(now=9.0) == [late] and q.next_deadline() is None
    assert never.state is RequestState.QUEUED and q.head(never.key) is never


def test_queue_deadlines_keep_no_request_alive():
    q = RequestQueue()
    refs = []
    for _ in range(500):  # queued with a deadline, launched, done and dropped
        request = glu_request(deadline=1e9)
        refs.append(weakref.ref(request))
        q.push(request)
        q.take(request.key, 1, 1 << 30, 1 << 30, now=0.0)
        del request
    gc.collect()
    assert all(ref() is None for ref in refs)
    kept = glu_request(deadline=5.0)
    q.push(kept)
    assert q.next_deadline() == 5.0 and q.expire_due(now=6.0) == [kept]


def test_max_delay_holds_a_young_key_and_says_when_to_wake():
    cfg = SchedulerConfig(streams=1, max_delay_us=1000)
    r = glu_request(at=10.0)
    q = queue_of(r)
    batches, _, wake = form_batches(q, [0], cfg, now=10.0002)
    assert batches == [] and wake == pytest.approx(10.001) and len(q) == 1
    batches, _, wake = form_batches(q, [0], cfg, now=10.0011)
    assert batches[0].requests == [r] and wake is None


def test_max_delay_never_holds_a_request_past_its_deadline():
    cfg = SchedulerConfig(streams=1, max_delay_us=500_000)
    patient = glu_request(at=10.0, deadline=11.0)  # after the hold ends (10.5): held
    q = queue_of(patient)
    batches, _, wake = form_batches(q, [0], cfg, now=10.0)
    assert batches == [] and wake == pytest.approx(10.5)
    hurried = glu_request(at=10.0, deadline=10.1)  # before it: the key launches now
    q.push(hurried)
    batches, expired, _ = form_batches(q, [0], cfg, now=10.0)
    assert expired == [] and batches[0].requests == [patient, hurried]
    # the key's bound goes with the key: a later request of it may be held again
    later = glu_request(at=12.0)
    q.push(later)
    batches, _, wake = form_batches(q, [0], cfg, now=12.0)
    assert batches == [] and wake == pytest.approx(12.5)


def test_max_delay_does_not_hold_a_full_batch():
    cfg = SchedulerConfig(streams=1, max_delay_us=1000, max_batch_requests=3)
    reqs = [glu_request(at=10.0) for _ in range(3)]
    batches, _, _ = form_batches(queue_of(*reqs), [0], cfg, now=10.0)
    assert batches[0].requests == reqs


def test_queue_discard_is_lazy_and_counts():
    a, b = glu_request(), glu_request()
    q = queue_of(a, b)
    q.discard(a, RequestState.CANCELLED)
    assert len(q) == 1
    batches, _, _ = form_batches(q, [0], CFG, now=1.0)
    assert batches[0].requests == [b]
    assert q.peak == 2


def test_no_idle_stream_no_batch():
    q = queue_of(glu_request())
    assert form_batches(q, [], CFG, now=1.0) == ([], [], None)
    assert len(q) == 1


@pytest.mark.parametrize("plain", [False, True], ids=["priorities-deadlines", "plain"])
@pytest.mark.parametrize("seed", range(6))
def test_queue_takes_in_priority_then_id_order_whatever_the_pushes(seed, plain):
    # The queue's lanes against a plain model: the live requests of a key sorted by
    # (-priority, id). Pushes come with mixed priorities (or, ``plain``, one priority and
    # no deadline, so that a take may find its lane whole), mixed sizes in one key, taken
    # requests are put back (older ids pushed after newer ones, as after a launch that
    # could not start), some are discarded or expire, and batches are cut by count, by
    # bytes, and by the largest request that fuses. Some new requests come several at once
    # (``push_all``, as a launch's graph consumers do).
    rng = random.Random(seed)
    q = RequestQueue()
    live: list[Request] = []
    peak = 0
    key, per = glu_request().key, glu_request().nbytes
    for _ in range(300):
        action = rng.random()
        if action < 0.5:
            new = [
                glu_request(
                    rows=rng.choice([2, 2, 4]),
                    cols=rng.choice([8, 8, 16]),
                    priority=0 if plain else rng.choice([0, 0, 0, 1, 5, -2]),
                    deadline=None if plain else rng.choice([None, None, None, 0.5, 2.0]),
                )
                for _ in range(rng.choice([1, 1, 1, 2, 5]))
            ]
            assert all(r.key == key for r in new)
            if len(new) == 1:
                q.push(new[0])
            else:
                q.push_all(new)
            live.extend(new)
        elif action < 0.6 and live:
            r = rng.choice(live)
            q.discard(r, RequestState.CANCELLED)
            live.remove(r)
        else:
            limit = rng.choice([0, rng.randint(1, 6), 1024])
            budget = rng.choice([per * rng.randint(1, 6), 1 << 30])
            fuse_max = rng.choice([per, 4 * per, 1 << 20])
            taken, expired = q.take(key, limit, fuse_max, budget, now=1.0)
            want, want_expired, nbytes = [], [], 0
            for r in sorted(live, key=lambda r: (-r.priority, r.id)):
                if (
                    len(want) == limit
                    or r.nbytes > fuse_max
                    or (want and nbytes + r.nbytes > budget)
                ):
                    break
                if r.deadline is not None and r.deadline <= 1.0:
                    want_expired.append(r)
                else:
                    want.append(r)
                    nbytes += r.nbytes
            assert (taken, expired) == (want, want_expired)
            for r in want + want_expired:
                live.remove(r)
            if taken and rng.random() < 0.5:  # the launch could not start: put them back
                for r in rng.sample(taken, len(taken)):
                    r.state = RequestState.QUEUED
                    q.push(r)
                    live.append(r)
        assert len(q) == len(live)
        peak = max(peak, len(live))
        assert q.peak == peak
        assert q.queued_bytes(key) == sum(r.nbytes for r in live)
        head = q.head(key)
        assert head is min(live, key=lambda r: (-r.priority, r.id), default=None)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["push", "push", "push", "push_all", "pop", "take", "cancel", "requeue"]
            ),
            st.integers(0, 8),
        ),
        min_size=4,
        max_size=120,
    )
)
def test_the_next_key_is_always_the_one_whose_head_comes_first(steps):
    # Against a scan of every queued request: the next key is the key of the queued
    # request with the highest priority, then the lowest id, whatever pushes, pops,
    # takes, lazy cancellations and put-back requests came before.
    q = RequestQueue()
    dtypes = [np.float32, np.float16, np.float64]  # three fusion keys
    queued: list[Request] = []
    taken: list[Request] = []
    for what, n in steps:
        if what == "push":
            request = glu_request(dtype=dtypes[n % 3], priority=n // 3)
            q.push(request)
            queued.append(request)
        elif what == "push_all":  # new requests at once: one key and priority, or mixed
            same = n % 2 == 0
            new = [
                glu_request(
                    dtype=dtypes[n % 3 if same else i % 3], priority=n // 3 if same else i % 2
                )
                for i in range(2 + n % 4)
            ]
            q.push_all(new)
            queued.extend(new)
        elif what == "requeue" and taken:
            request = taken.pop(n % len(taken))
            request.state = RequestState.QUEUED
            q.push(request)
            queued.append(request)
        elif what == "cancel" and queued:
            request = queued.pop(n % len(queued))
            q.discard(request, RequestState.CANCELLED)
        elif what in ("pop", "take") and queued:
            key = q.best_key()
            if what == "pop":
                assert q.head(key) is not None
                out = [q.pop(key)]
            else:
                out, _ = q.take(key, n + 1, 1 << 30, 1 << 30, now=0.0)
            for request in out:
                queued.remove(request)
                request.state = RequestState.RUNNING
                taken.append(request)
        assert len({r.key for r in queued}) <= 3
        first = min(queued, key=lambda r: (-r.priority, r.id), default=None)
        assert q.best_key() == (None if first is None else first.key)
        assert len(q) == len(queued)
