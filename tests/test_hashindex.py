"""The dynamic table's index (`_hashindex`): the jitted update against a sequential reference.

The reference below shares no code with the module: it re-derives the hashes in NumPy and
keeps each bucket as a dict {id: [last, count]} that admitted ids enter one at a time, in
the order the rules state. The jitted update must equal it exactly after every step: which
ids sit in which bucket, with which last and count, the filter, every counter, and the rows
and fresh flags returned. Streams draw power-law ids over the whole int64 range, negative
ones and -1 padding included, so that buckets fill and every rule is exercised.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import count_primitive, make_mesh
from jax_tpu_embed import _hashindex as hx
from jax_tpu_embed import _layout, _storage

M32 = 0xFFFFFFFF
# Every program here (and test_hashindex_cpu's) is integer arithmetic on the index, which
# LLVM's optimizations only speed up (the same results): compiled without them, the fast
# tests take about a third less time. The index compiles at the default level in
# test_dynamic's steps.
QUICK = {"xla_backend_optimization_level": 0}
_jit = functools.partial(jax.jit, compiler_options=QUICK)

# ------------------------------------------------------------------------ the reference


def _mix(x):
    x = np.asarray(x, np.uint32).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def _halves(i: int) -> tuple[int, int]:
    u = i & 0xFFFFFFFFFFFFFFFF
    return u >> 32, u & M32


def _keyed(seed: int, salt: int, i: int) -> int:
    key = _mix(np.uint32(seed) ^ _mix(np.uint32(salt)))
    hi, lo = _halves(i)
    return int(_mix(_mix(np.uint32(lo) ^ key) ^ np.uint32(hi)))


class Reference:
    """The index as dicts, one admitted id at a time."""

    def __init__(self, config: hx.IndexConfig):
        self.c = config
        self.buckets: list[dict[int, list[int]]] = [{} for _ in range(config.buckets)]
        self.filter: list[dict[int, int]] = [{} for _ in range(config.filter_buckets)]
        self.stats: Counter = Counter()

    def bucket(self, i: int) -> int:
        return _keyed(self.c.seed, 1, i) % self.c.buckets

    def prio(self, i: int) -> tuple[int, int, int]:
        return (_keyed(self.c.seed, 2, i), *_halves(i))

    def admit_hash(self, i: int, now: int) -> int:
        return int(_mix(np.uint32(_keyed(self.c.seed, 3, i)) ^ _mix(np.uint32(now))))

    def expired(self, last: int, now: int) -> bool:
        return self.c.ttl_steps is not None and now - last >= self.c.ttl_steps

    def live(self, i: int, now: int) -> bool:
        entry = self.buckets[self.bucket(i)].get(i)
        return entry is not None and not self.expired(entry[0], now)

    def step(self, ids: list[int], now: int) -> dict[int, str]:
        """Outcome of each id: "hit", "placed", "rejected" or "failed"."""
        c, out = self.c, {}
        misses = []
        for i in ids:
            if self.live(i, now):
                entry = self.buckets[self.bucket(i)][i]
                entry[0], entry[1] = now, entry[1] + 1
                self.stats["hits"] += 1
                out[i] = "hit"
            else:
                misses.append(i)
        self.stats["misses"] += len(misses)
        sightings, admitted = {}, []
        for i in misses:
            ok = True
            if c.min_count > 1:
                f = self.filter[self.bucket(i) // (c.buckets // c.filter_buckets)]
                sightings[i] = min(f.get(i, 0) + 1, c.min_count)
                ok = sightings[i] >= c.min_count
            if c.admit_probability < 1:
                ok &= self.admit_hash(i, now) < min(int(c.admit_probability * 2**32), M32)
            if ok:
                admitted.append(i)
            else:
                self.stats["rejected"] += 1
                out[i] = "rejected"
        by_bucket: dict[int, list[int]] = {}
        for i in admitted:
            by_bucket.setdefault(self.bucket(i), []).append(i)
        for g, group in by_bucket.items():
            slots = self.buckets[g]
            group.sort(key=self.prio)
            for i in group:  # an admitted id's own expired slot is freed first
                if i in slots:
                    del slots[i]
                    self.stats["expired"] += 1
            for i in group:
                if len(slots) >= c.bucket_size:
                    gone = [k for k in slots if self.expired(slots[k][0], now)]
                    if gone:
                        victim = min(gone, key=lambda k: (slots[k][0], self.prio(k)))
                        self.stats["expired"] += 1
                    else:
                        idle = [k for k in slots if slots[k][0] < now]
                        if c.eviction == "none" or not idle:
                            self.stats["failed"] += 1
                            out[i] = "failed"
                            continue
                        if c.eviction == "lru":
                            victim = min(idle, key=lambda k: (slots[k][0], self.prio(k)))
                        else:
                            victim = min(
                                idle, key=lambda k: (slots[k][1], slots[k][0], self.prio(k))
                            )
                        self.stats["evicted"] += 1
                    del slots[victim]
                slots[i] = [now, 1]
                self.stats["admitted"] += 1
                out[i] = "placed"
        if c.min_count > 1:
            self._filter_step(misses, sightings, out)
        return out

    def _filter_step(self, misses, sightings, out):
        c = self.c
        by_bucket: dict[int, list[int]] = {}
        for i in misses:
            by_bucket.setdefault(self.bucket(i) // (c.buckets // c.filter_buckets), []).append(i)
        for fb, group in by_bucket.items():
            f = self.filter[fb]
            known = [i for i in group if i in f]
            firsts = sorted((i for i in group if i not in f), key=self.prio)
            sighted = set()
            for i in known:
                if out[i] == "placed":
                    del f[i]
                else:
                    f[i] = sightings[i]
                    sighted.add(i)
            for i in firsts:
                if len(f) >= c.filter_bucket_size:
                    idle = [k for k in f if k not in sighted]
                    if not idle:
                        self.stats["filter_failed"] += 1
                        continue
                    del f[min(idle, key=lambda k: (f[k], self.prio(k)))]
                    self.stats["filter_evicted"] += 1
                f[i] = 1
                sighted.add(i)


# ----------------------------------------------------------------------------- helpers


def _buckets_of(state, b: int) -> list[dict[int, tuple[int, int]]]:
    ids = hx.join_ids(*hx.slot_words(state.keys, b)).reshape(-1, b)
    last, count = np.asarray(state.last).reshape(-1, b), np.asarray(state.count).reshape(-1, b)
    return [
        {int(i): (int(t), int(n)) for i, t, n in zip(ids[g], last[g], count[g]) if i != -1}
        for g in range(ids.shape[0])
    ]


def _filter_of(state, bf: int) -> list[dict[int, int]]:
    ids = hx.join_ids(*hx.slot_words(state.filter_keys, bf)).reshape(-1, bf)
    count = np.asarray(state.filter_count).reshape(-1, bf)
    return [
        {int(i): int(n) for i, n in zip(ids[f], count[f]) if i != -1} for f in range(ids.shape[0])
    ]


def _stream(rng, steps: int, width: int, pool_size: int, zipf: float = 1.3):
    """`steps` arrays of `width` distinct int64 ids (power-law draws from a pool spread over
    int64, the extremes included), -1 padded, in random order."""
    pool = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, pool_size, np.int64)
    edge = [np.iinfo(np.int64).min, np.iinfo(np.int64).max, 0, 1, -2, M32, -(1 << 32), 1 << 32]
    pool[: len(edge)] = edge
    pool = pool[pool != -1]
    rng.shuffle(pool)
    out = []
    for _ in range(steps):
        draws = np.unique(pool[(rng.zipf(zipf, width) - 1) % pool.size])
        row = np.full(width, -1, np.int64)
        row[: draws.size] = draws
        out.append(rng.permutation(row))
    return out


@functools.cache
def _jitted_update(config):
    return _jit(functools.partial(hx.update, config))


def _update_one_shard(config, state, ids, now):
    hi, lo = hx.split_ids(ids)
    _, lb = hx.locate(config, 1, hi, lo)
    return _jitted_update(config)(state, hi, lo, lb, ids != -1, np.int32(now))


def _check_invariants(config, state, now):
    s = {k: int(v) for k, v in hx.stats(config, state, now).items()}
    assert s["occupancy"] <= s["held"] <= config.capacity
    assert s["admitted"] - s["evicted"] - s["expired"] == s["held"]
    if config.ttl_steps is None:
        assert s["held"] == s["occupancy"]
    assert s["misses"] == s["admitted"] + s["rejected"] + s["failed"]
    ids = hx.slot_ids(config, state)
    keys = ids[ids != -1]
    assert np.unique(keys).size == keys.size, "an id holds two slots"
    fids = hx.join_ids(*hx.slot_words(state.filter_keys, config.filter_bucket_size))
    fkeys = fids[fids != -1]
    assert np.unique(fkeys).size == fkeys.size, "an id holds two filter entries"


def _run_against_reference(config, steps, width, pool, seed=0):
    rng = np.random.default_rng(seed)
    ref = Reference(config)
    state = jax.tree.map(jnp.asarray, hx.empty_state(config, 1))
    outcomes = Counter()
    for t, ids in enumerate(_stream(rng, steps, width, pool), start=1):
        state, row, fresh = _update_one_shard(config, state, ids, t)
        row, fresh = np.asarray(row), np.asarray(fresh)
        want = ref.step([int(i) for i in ids if i != -1], t)
        outcomes.update(want.values())
        for i, r, f in zip(ids, row, fresh):
            what = want.get(int(i), "padding")
            assert (r >= 0) == (what in ("hit", "placed")), (t, int(i), what)
            assert bool(f) == (what == "placed"), (t, int(i), what)
        flat = hx.slot_ids(config, state)
        np.testing.assert_array_equal(flat[row[row >= 0]], ids[row >= 0])
        assert _buckets_of(state, config.bucket_size) == [
            {i: tuple(e) for i, e in b.items()} for b in ref.buckets
        ], f"step {t}"
        assert _filter_of(state, config.filter_bucket_size) == ref.filter, f"step {t}"
        got = dict(zip(hx.STAT_NAMES, np.asarray(state.stats)[0].tolist()))
        assert got == {k: ref.stats.get(k, 0) for k in hx.STAT_NAMES}, f"step {t}"
        _check_invariants(config, state, t)
    return state, ref, outcomes


# ------------------------------------------------------------------------------- tests

CASES = {
    "lru": (hx.IndexConfig(buckets=16, bucket_size=4, eviction="lru", seed=7), 24, 300),
    "lfu": (hx.IndexConfig(buckets=16, bucket_size=4, eviction="lfu", seed=8), 24, 300),
    "none": (hx.IndexConfig(buckets=16, bucket_size=4, eviction="none", seed=9), 24, 300),
    "ttl": (hx.IndexConfig(buckets=16, bucket_size=4, ttl_steps=6, seed=10), 24, 300),
    "min_count": (
        hx.IndexConfig(
            buckets=16, bucket_size=4, min_count=3, filter_buckets=4, filter_bucket_size=4
        ),
        24,
        120,
    ),
    "probability": (hx.IndexConfig(buckets=16, bucket_size=4, admit_probability=0.5), 24, 300),
    "tiny_all": (
        hx.IndexConfig(
            buckets=2,
            bucket_size=2,
            eviction="lfu",
            ttl_steps=4,
            min_count=2,
            admit_probability=0.7,
            filter_buckets=1,
            filter_bucket_size=3,
            seed=3,
        ),
        16,
        60,
    ),
    # Every option on, each shard's arrays whole rows of 128 words: the index reads and
    # writes its buckets as rows of their (words / 128, 128) views (`_layout`), where
    # tiny_all's take one window of the flat arrays each.
    "all_lanes": (
        hx.IndexConfig(
            buckets=32,
            bucket_size=4,
            eviction="lfu",
            ttl_steps=5,
            min_count=2,
            admit_probability=0.8,
            filter_buckets=16,
            filter_bucket_size=8,
            seed=5,
        ),
        40,
        400,
    ),
}


# The fast tier keeps the case with every option on; the slow tier runs each rule alone,
# and every option on arrays of whole 128-word rows (test_dynamic's tables have them).
@pytest.mark.parametrize(
    "case",
    [c if c == "tiny_all" else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def test_update_equals_reference(case):
    config, width, pool = CASES[case]
    _, ref, outcomes = _run_against_reference(config, 200, width, pool)
    # The stream exercised the rules this case is about.
    s = ref.stats
    assert outcomes["hit"] and outcomes["placed"]
    if config.eviction != "none" and config.ttl_steps is None and config.min_count == 1:
        assert s["evicted"] > 0
    if config.eviction == "none" or case == "tiny_all":
        assert s["failed"] > 0
    if config.ttl_steps is not None:
        assert s["expired"] > 0
    if config.min_count > 1:
        assert s["rejected"] > 0 and s["filter_evicted"] > 0
    if config.admit_probability < 1:
        assert s["rejected"] > 0
    if case == "tiny_all":
        assert s["filter_failed"] > 0
    lanes = [_layout.lane_view(x.shape[0]) for x in jax.tree.leaves(hx.empty_state(config, 1))]
    assert all(lanes[:-1]) if case == "all_lanes" else not all(lanes[:-1])  # Stats aside.


@pytest.mark.parametrize("width", [1, 16, 64, 256, 24])
def test_bucket_windows_equal_numpy(width):
    """`_rows` and `_put_rows` (`_layout`'s lane windows where the array has a view of
    128-word rows, else flat windows) against NumPy slices: every width, each op on both
    32-bit integer types (max's identity differs), the windows of one row written
    together, skipped windows left alone."""
    ops = {"add": np.add, "mul": np.multiply, "max": np.maximum}

    @_jit
    def windows(flat, starts, values, write):  # One compile for the read and every op.
        puts = [hx._put_rows(flat, starts, values, write, op) for op in ops]
        return hx._rows(flat, starts, width), puts

    rng = np.random.default_rng(width)
    for dtype in (np.int32, np.uint32):
        for size in (1536, 1568 + width):  # A lane view, and none.
            flat = rng.integers(-50 if dtype == np.int32 else 0, 100, size).astype(dtype)
            starts = rng.choice(size // width, min(40, size // width), replace=False) * width
            write = rng.random(len(starts)) < 0.7
            values = rng.integers(0, 5, (len(starts), width)).astype(dtype)
            got, puts = windows(flat, starts.astype(np.int32), values, write)
            np.testing.assert_array_equal(got, np.stack([flat[s : s + width] for s in starts]))
            for (op, f), put in zip(ops.items(), puts):
                want = flat.copy()
                for s, v in zip(starts[write], values[write]):
                    want[s : s + width] = f(want[s : s + width], v)
                np.testing.assert_array_equal(put, want, err_msg=f"{op} {dtype} {size}")


@functools.cache
def _jitted(f, config):
    """`f(config, ...)` jitted, once per function and config."""
    return _jit(functools.partial(f, config))


def _update_in_calls(config, state, ids, now, size: int):
    """`hx.update` of one step's distinct ids as the owners of a routed update run it, in
    calls of `size` ids: `sighted` for all, `admission` for the misses with a filter (in
    reverse order: any split does), `place` and `unfilter` for the admitted ones in
    (bucket, priority) order, `record` for the first sightings in (filter bucket,
    priority) order. Returns (state, row, placed) as `update`'s."""
    hi, lo = hx.split_ids(ids)
    _, lb = hx.locate(config, 1, hi, lo)
    lb = np.asarray(lb)
    jit = lambda f: _jitted(f, config)
    seen = jit(hx.sighted)(state, hi, lo, lb, ids != -1, now)
    state, u = seen.state, ids.size
    calls = lambda at: [np.asarray(at[i : i + size], int) for i in range(0, len(at), size)]

    def words(c):
        """A call's (hi, lo, local bucket), padded to `size` with the padding id, which
        every call skips: one compile per function."""
        pad = np.full(size - len(c), hx.PAD, np.uint32)
        fill = np.zeros(size - len(c), lb.dtype)
        return np.r_[hi[c], pad], np.r_[lo[c], pad], np.r_[lb[c], fill]

    admission, place, unfilter, record = map(jit, (hx.admission, hx.place, hx.unfilter, hx.record))
    admit, first = np.asarray(seen.admit).copy(), np.zeros(u, bool)
    if config.min_count > 1:  # `sighted` left the misses to `admission`.
        for c in calls(np.flatnonzero(np.asarray(seen.miss))[::-1]):
            state, a, f = admission(state, *words(c), True, now)
            admit[c], first[c] = np.asarray(a)[: len(c)], np.asarray(f)[: len(c)]
    prio = np.asarray(hx.priority(config, hi, lo))
    row, placed = np.asarray(seen.row).copy(), np.zeros(u, bool)
    for c in calls([i for i in np.lexsort((lo, hi, prio, lb)) if admit[i]]):
        state, r, ok = place(state, *words(c), True, now)
        state = unfilter(state, *words(c), ok)
        r, ok = np.asarray(r)[: len(c)], np.asarray(ok)[: len(c)]
        row[c], placed[c] = np.where(ok, r, row[c]), ok
    if config.min_count > 1:
        fb = lb // (config.buckets // config.filter_buckets)
        for c in calls([i for i in np.lexsort((lo, hi, prio, fb)) if first[i]]):
            state = record(state, *words(c), True, now)
    return state, row, placed


@pytest.mark.parametrize(
    "case, size",
    [
        pytest.param("tiny_all", 3, marks=pytest.mark.slow),
        pytest.param("min_count", 5, marks=pytest.mark.slow),
        pytest.param("ttl", 4, marks=pytest.mark.slow),
    ],
)
def test_rules_in_calls_equal_update(case, size):
    """The filter's rules split into calls (`admission`, `unfilter`, `record`: what a
    routed update runs in rounds, the work following the misses) leave the index, rows,
    placements and counters of one `update` call, step after step, with calls far smaller
    than a step's ids (a bucket's and a filter bucket's ids split between calls)."""
    config, width, pool = CASES[case]
    stream = _stream(np.random.default_rng(5), 60, width, pool)
    state = want_state = jax.tree.map(jnp.asarray, hx.empty_state(config, 1))
    update = _jitted(hx.update, config)
    for t, ids in enumerate(stream, start=1):
        hi, lo = hx.split_ids(ids)
        _, lb = hx.locate(config, 1, hi, lo)
        want_state, want_row, want_placed = update(want_state, hi, lo, lb, ids != -1, t)
        state, row, placed = _update_in_calls(config, state, ids, t, size)
        np.testing.assert_array_equal(row, np.asarray(want_row), err_msg=f"step {t}")
        np.testing.assert_array_equal(placed, np.asarray(want_placed), err_msg=f"step {t}")
        for f in dataclasses.fields(state):
            if f.name != "filter_last":  # The calls' own mark; `update` needs none.
                a, b = getattr(state, f.name), getattr(want_state, f.name)
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), f"{f.name}, {t}")
    totals = dict(zip(hx.STAT_NAMES, np.asarray(state.stats)[0].tolist()))
    assert totals["admitted"] and totals["hits"]
    if config.min_count > 1:
        assert totals["rejected"] and totals["filter_evicted"] and totals["filter_failed"], totals
    if config.ttl_steps is not None:
        assert totals["expired"], totals


@pytest.mark.slow
def test_find_is_read_only_and_agrees(rng):
    config, width, pool = CASES["ttl"]
    state, ref, _ = _run_against_reference(config, 40, width, pool, seed=1)
    now = 41
    resident = np.array([i for b in ref.buckets for i in b], np.int64)
    absent = rng.integers(-(2**62), 2**62, 20, np.int64)
    queries = np.concatenate([resident, absent, [-1, -1]])
    queries = np.resize(rng.permutation(queries), (4, -(-queries.size // 4)))  # 2-D
    hi, lo = hx.split_ids(queries)
    _, lb = hx.locate(config, 1, hi, lo)
    before = jax.tree.map(np.asarray, state)
    row, found = _jit(functools.partial(hx.find, config))(state, hi, lo, lb, now)
    row, found = np.asarray(row), np.asarray(found)
    assert row.shape == found.shape == queries.shape
    want = np.vectorize(lambda i: i != -1 and ref.live(int(i), now))(queries)
    np.testing.assert_array_equal(found, want)
    assert want.any() and (~want).any()
    flat = hx.slot_ids(config, before)
    np.testing.assert_array_equal(flat[row[found]], queries[found])
    assert (row[~found] == -1).all()
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.slow
def test_sighted_grouped_by_runs_equals_sighted_by_sort():
    """`sighted(grouped=True)` (ids of a bucket contiguous, as `_dynamic` resolves them:
    its writes grouped by runs, no sort) gives the state and results of the sorting path,
    with TTL (freed slots rewrite keys) and hits sharing buckets, padding at the end."""
    config, width, pool = CASES["ttl"]
    state, _, _ = _run_against_reference(config, 12, width, pool, seed=2)
    held = hx.slot_ids(config, state)
    rng = np.random.default_rng(5)
    ids = np.unique(np.concatenate([rng.choice(held[held != -1], 12), rng.integers(-99, 99, 8)]))
    hi, lo = hx.split_ids(ids)
    _, lb = hx.locate(config, 1, hi, lo)
    order = np.argsort(np.asarray(lb), kind="stable")
    pad = np.full(5, hx.PAD, np.uint32)
    hi, lo = np.concatenate([hi[order], pad]), np.concatenate([lo[order], pad])
    lb = np.concatenate([np.asarray(lb)[order], np.zeros(5, np.int32)])
    assert np.unique(lb[:-5]).size < ids.size, "no two ids share a bucket"
    valid = hi != hx.PAD
    out = {
        grouped: _jit(functools.partial(hx.sighted, config, grouped=grouped))(
            state, hi, lo, lb, valid, np.int32(13)
        )
        for grouped in (False, True)
    }
    step = np.asarray(out[False].state.stats - state.stats)[0]
    assert step[hx.STAT_NAMES.index("hits")] > 0, "no hit"
    assert step[hx.STAT_NAMES.index("expired")] > 0, "no freed slot"
    for a, b in zip(jax.tree.leaves(out[False]), jax.tree.leaves(out[True])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_update_has_no_loop_and_no_64_bit():
    config = CASES["tiny_all"][0]
    state = hx.empty_state(config, 1)
    u = 8
    args = (np.zeros(u, np.uint32), np.zeros(u, np.uint32), np.zeros(u, np.int32))
    jaxpr = jax.make_jaxpr(functools.partial(hx.update, config))(
        state, *args, np.ones(u, bool), np.int32(1)
    )
    for name in ("while", "scan", "cond"):
        assert count_primitive(jaxpr.jaxpr, name) == 0, name
    dtypes = {str(v.aval.dtype) for e in jaxpr.jaxpr.eqns for v in e.outvars}
    assert not dtypes & {"int64", "uint64", "float64"}, dtypes


def _sharded_update(config, mesh):
    n = mesh.shape["shard"]

    def local(state, hi, lo, valid, now):
        owner, lb = hx.locate(config, n, hi, lo)
        mine = valid & (owner == jax.lax.axis_index("shard"))
        state, row, fresh = hx.update(config, state, hi, lo, lb, mine, now)
        return state, row[None], fresh[None]

    shard, rep = P("shard"), P()
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(shard, rep, rep, rep, rep),
        out_specs=(shard, shard, shard),
        check_vma=False,
    )
    return _jit(fn)


def _put(state, mesh):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("shard"))), state)


MESH_CONFIG = hx.IndexConfig(
    buckets=16,
    bucket_size=4,
    eviction="lfu",
    ttl_steps=4,
    min_count=2,
    filter_buckets=8,
    filter_bucket_size=2,
    seed=11,
)


@pytest.mark.slow
def test_mesh_independence():
    config = MESH_CONFIG
    stream = _stream(np.random.default_rng(2), 25, 32, 300)
    exports, totals = [], []
    for n in (1, 2, 4, 8):
        mesh = make_mesh(n)
        step = _sharded_update(config, mesh)
        state = _put(hx.empty_state(config, n), mesh)
        for t, ids in enumerate(stream, start=1):
            hi, lo = hx.split_ids(ids)
            state, row, _ = step(state, hi, lo, ids != -1, np.int32(t))
        row = np.asarray(row)
        # Each id has a row on its owner only.
        assert ((row >= 0).sum(0) <= 1).all()
        exports.append(hx.export(config, jax.tree.map(np.asarray, state)))
        totals.append({k: int(v) for k, v in hx.stats(config, state, len(stream)).items()})
        _check_invariants(config, state, len(stream))
    for e in exports[1:]:
        for a, b in zip(exports[0], e):
            np.testing.assert_array_equal(a, b)
    assert all(t == totals[0] for t in totals)
    assert totals[0]["evicted"] and totals[0]["expired"] and totals[0]["filter_evicted"]


@pytest.mark.slow
def test_mesh_matches_reference_on_8_shards():
    config = MESH_CONFIG
    stream = _stream(np.random.default_rng(3), 25, 32, 300)
    mesh = make_mesh(8)
    step = _sharded_update(config, mesh)
    state = _put(hx.empty_state(config, 8), mesh)
    ref = Reference(config)
    for t, ids in enumerate(stream, start=1):
        hi, lo = hx.split_ids(ids)
        state, _, fresh = step(state, hi, lo, ids != -1, np.int32(t))
        want = ref.step([int(i) for i in ids if i != -1], t)
        placed = np.asarray(fresh).any(0)
        np.testing.assert_array_equal(
            placed, [want.get(int(i)) == "placed" for i in ids], err_msg=f"step {t}"
        )
    host = jax.tree.map(np.asarray, state)
    assert _buckets_of(host, config.bucket_size) == [
        {i: tuple(e) for i, e in b.items()} for b in ref.buckets
    ]
    assert _filter_of(host, config.filter_bucket_size) == ref.filter
    got = dict(zip(hx.STAT_NAMES, host.stats.sum(0).tolist()))
    assert got == {k: ref.stats.get(k, 0) for k in hx.STAT_NAMES}


@pytest.mark.parametrize("onto", [1, 4])
def test_export_build_round_trip(onto):
    config = CASES["ttl"][0]
    config = dataclasses.replace(config, eviction="lfu")
    stream = _stream(np.random.default_rng(4), 60, 24, 300)
    state = jax.tree.map(jnp.asarray, hx.empty_state(config, 1))
    for t, ids in enumerate(stream[:40], start=1):
        state, _, _ = _update_one_shard(config, state, ids, t)
    ids, rows, last, count = hx.export(config, state)
    assert (np.diff(ids) > 0).all()
    flat = hx.slot_ids(config, state)
    np.testing.assert_array_equal(flat[rows], ids)
    live = hx.export(config, state, now=40)[0]
    assert 0 < live.size < ids.size  # some expired entries are left out with `now`

    built, built_rows = hx.build(config, onto, ids, last, count)
    again = hx.export(config, built)
    for a, b in zip((ids, last, count), (again[0], again[2], again[3])):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(built_rows // config.bucket_size, rows // config.bucket_size)
    np.testing.assert_array_equal(hx.slot_ids(config, built)[built_rows], ids)
    assert built.stats.shape == (onto, len(hx.STAT_NAMES))
    # Shard by shard, from each shard's own entries: its part of the whole build, its rows.
    shard_of = built_rows // (config.capacity // onto)
    for k in range(onto):
        mine = shard_of == k
        part, local = hx.build(config, onto, ids[mine], last[mine], count[mine], shard=k)
        for got, whole in zip(jax.tree.leaves(part), jax.tree.leaves(built)):
            np.testing.assert_array_equal(got, np.split(np.asarray(whole), onto)[k])
        np.testing.assert_array_equal(local, built_rows[mine] - k * (config.capacity // onto))
        if onto > 1:
            with pytest.raises(ValueError, match=rf"belongs to shard \d of {onto}, not to shard"):
                hx.build(config, onto, ids[~mine][:1], last[:1], count[:1], shard=k)

    # With the exported lanes, every id gets its row back: the same index, on any mesh.
    lanes = rows % config.bucket_size
    kept, kept_rows = hx.build(config, onto, ids, last, count, lanes=lanes)
    np.testing.assert_array_equal(kept_rows, rows)
    for got, want in zip(jax.tree.leaves(kept)[:3], jax.tree.leaves(state)[:3]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # keys, last, count
    with pytest.raises(ValueError, match=r"lanes must give one lane in \[0, 4\) per id"):
        hx.build(config, onto, ids, last, count, lanes=np.full(ids.shape, 4))
    with pytest.raises(ValueError, match=r"ids are given a lane already taken"):
        hx.build(config, onto, ids, last, count, lanes=np.zeros(ids.shape, np.int64))

    # The rebuilt index (other lanes, other mesh) goes on exactly as the original.
    rebuilt = Reference(config)
    for g, b in enumerate(_buckets_of(built, config.bucket_size)):
        rebuilt.buckets[g] = {i: list(e) for i, e in b.items()}
    built_state = jax.tree.map(jnp.asarray, hx.build(config, 1, ids, last, count)[0])
    for t, ids_t in enumerate(stream[40:], start=41):
        state, _, _ = _update_one_shard(config, state, ids_t, t)
        built_state, _, _ = _update_one_shard(config, built_state, ids_t, t)
        rebuilt.step([int(i) for i in ids_t if i != -1], t)
    assert _buckets_of(state, config.bucket_size) == _buckets_of(built_state, config.bucket_size)
    assert _buckets_of(built_state, config.bucket_size) == [
        {i: tuple(e) for i, e in b.items()} for b in rebuilt.buckets
    ]


def _fitting(config, ids):
    """The ids (distinct) that fit their buckets: the first bucket_size of each bucket."""
    g = np.asarray(hx.global_bucket(config, *hx.split_ids(ids)))
    order = np.argsort(g, kind="stable")
    lane = np.empty_like(g)
    lane[order] = np.arange(g.size) - np.searchsorted(g[order], g[order])
    return ids[lane < config.bucket_size]


@pytest.mark.parametrize(
    "n, ttl, buckets, grouped",
    [
        pytest.param(1, None, 16, False, marks=pytest.mark.slow),
        pytest.param(130, None, 16, False, marks=pytest.mark.slow),
        (600, None, 16, False),
        (600, 3, 16, False),
        (130, 3, 15, False),
        # (test_sighted_with_the_pallas_find_equals_sighted runs it grouped in the fast tier.)
        pytest.param(600, None, 16, True, marks=pytest.mark.slow),
        pytest.param(600, 3, 16, True, marks=pytest.mark.slow),
    ],
)
def test_pallas_find_equals_find(n, ttl, buckets, grouped):
    """`_hashindex_tpu.find` (Pallas' interpreter) gives `find`'s rows, bit for bit: held ids
    in any lane (full buckets too), ids not held, padding, in shapes of any size (blocks of
    128 and 256 ids, padded); with TTL, expired slots not found (in even and odd buckets; a
    shard of an odd number of buckets takes XLA's find). Ids grouped by bucket (runs of
    about 37, across grid steps) read each run's row once. Other bucket sizes are not
    served."""
    from jax_tpu_embed import _hashindex_tpu

    rng = np.random.default_rng(n)
    config = hx.IndexConfig(buckets=buckets, bucket_size=64, ttl_steps=ttl)
    # Many share one hi word (and others one lo word): both words must be compared.
    same_hi = (np.int64(7) << 32) + rng.integers(0, 2**31, 400)
    same_lo = (rng.integers(0, 2**31, 400) << 32) + 12345
    ids = np.unique(np.concatenate([rng.integers(-(2**63), 2**63 - 1, 800), same_hi, same_lo]))
    ids = _fitting(config, ids)  # Every bucket full or nearly.
    last = rng.integers(0, 10, ids.size)  # With TTL 3 at step 8: those <= 5 expired.
    state, _ = hx.build(config, 1, ids, last, np.ones(ids.size))
    state = jax.tree.map(jnp.asarray, state)
    others = np.concatenate([same_hi + 2**31, same_lo + (1 << 32)])[rng.integers(0, 800, n)]
    others[::3] = rng.integers(-(2**63), 2**63 - 1, others[::3].size)
    asked = np.where(rng.random(n) < 0.6, rng.choice(ids, n), others)
    asked[rng.random(n) < 0.1] = -1
    if grouped:
        asked = asked[np.argsort(hx.global_bucket(config, *hx.split_ids(asked)), kind="stable")]
    shape = (n,) if n % 2 else (2, n // 2)
    hi, lo = (x.reshape(shape) for x in hx.split_ids(asked))
    bucket = hx.global_bucket(config, hi, lo)
    args = (state, hi, lo, bucket)
    want = _jit(lambda s, h, l, b: hx.find(config, s, h, l, b, 8))(*args)
    got = _jit(lambda s, h, l, b: _hashindex_tpu.find(config, s, h, l, b, 8, True, grouped))(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert n < 100 or (np.asarray(want[1]).any() and not np.asarray(want[1]).all())
    assert not _hashindex_tpu.serves(dataclasses.replace(config, bucket_size=32))


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(), marks=pytest.mark.slow),  # The fast tier keeps TTL's.
        dict(ttl_steps=3),  # Slots of last 0 to 4 at step 7: some expired, some freed.
        pytest.param(dict(admit_probability=0.5, eviction="lfu"), marks=pytest.mark.slow),
        pytest.param(dict(min_count=2, filter_buckets=4), marks=pytest.mark.slow),
    ],
)
def test_sighted_with_the_pallas_find_equals_sighted(kwargs):
    """`sighted` finding its hits with the Pallas kernel (`find=`, Pallas' interpreter),
    and writing them with the other (`scores=`, ids grouped by bucket), writes the same
    state and gives the same hits, rows, misses and admissions as with its own key windows
    and scatters, ids grouped by bucket (with copies) or not, invalid ones among them."""
    from jax_tpu_embed import _hashindex_tpu

    rng = np.random.default_rng(3)
    config = hx.IndexConfig(buckets=16, bucket_size=64, **kwargs)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, 900, dtype=np.int64))
    held = ids[: ids.size // 2]
    held = _fitting(config, held)
    state, _ = hx.build(config, 1, held, rng.integers(2, 7, held.size), np.ones(held.size))
    state = jax.tree.map(jnp.asarray, state)
    asked = np.unique(np.concatenate([rng.choice(held, 200), rng.choice(ids, 200)]))
    hi, lo = hx.split_ids(asked)
    bucket = np.asarray(hx.global_bucket(config, hi, lo))
    valid = rng.random(asked.size) < 0.9

    def kernel(state, hi, lo, bucket):
        return _hashindex_tpu.find_stale(config, state, hi, lo, bucket, 7, interpret=True)

    def scores(state, bucket, lane, hit, freed, freed_lane):
        return _hashindex_tpu.scores(config, state, bucket, lane, hit, 7, True, freed, freed_lane)

    for grouped in (False, True):
        at = np.argsort(bucket, kind="stable") if grouped else np.arange(asked.size)
        distinct = None
        if grouped and config.min_count == 1:  # Copies beside their ids, as several
            # senders send them to their owner (the filter counts sightings: no copies).
            at = np.repeat(at, rng.integers(1, 4, at.size))
            total = -(-at.size // 128) * 128
            edge = 256 if total % 256 == 0 else 128  # The second grid step's first id.
            at = np.insert(at, edge, at[edge - 1])[:-1]  # A copy across that edge.
            distinct = np.concatenate([[True], at[1:] != at[:-1]])
            assert not distinct[edge] and valid[at[edge]], "no copy across a step's edge"
        args = (state, hi[at], lo[at], bucket[at], valid[at], 7)
        sighted = functools.partial(hx.sighted, config, grouped=grouped)
        want = _jit(functools.partial(sighted, distinct=distinct))(*args)
        writes = scores if grouped else None
        pallas = functools.partial(sighted, find=kernel, scores=writes, distinct=distinct)
        got = _jit(pallas)(*args)
        for a, b in zip(
            jax.tree.leaves(dataclasses.asdict(got)), jax.tree.leaves(dataclasses.asdict(want))
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(want.hit).any() and np.asarray(want.miss).any()
        freed = np.asarray(want.state.stats - state.stats)[0, hx.STAT_NAMES.index("expired")]
        assert (freed > 0) == ("ttl_steps" in kwargs), freed


def test_pallas_scores_write_each_hit_slot_once():
    """`_hashindex_tpu.scores` (Pallas' interpreter) gives each slot hit by the first copy
    of its id last = max(last, now) and count + 1, and leaves the other slots alone: ids
    sorted by bucket over 5 grid steps, so runs of one 128-lane row (two buckets) span
    steps, with copies (not hits) across a step's edge."""
    from jax_tpu_embed import _hashindex_tpu

    rng = np.random.default_rng(11)
    config = hx.IndexConfig(buckets=16, bucket_size=64)
    state = hx.empty_state(config, 1)
    state.last[:] = rng.integers(0, 12, state.last.size)  # Some after `now` = 7.
    state.count[:] = rng.integers(0, 5, state.count.size)
    slots = np.sort(rng.choice(state.last.size, 300, replace=False))
    slots = np.repeat(slots, rng.integers(1, 4, slots.size))  # An id's copies: adjacent.
    hit = (rng.random(slots.size) < 0.7)[np.searchsorted(slots, slots)]  # The id's outcome.
    first = np.concatenate([[True], slots[1:] != slots[:-1]])  # As `sighted`'s `distinct`.
    assert 5 * 128 - 128 < slots.size <= 5 * 128
    bucket, lane = (slots // 64).astype(np.int32), (slots % 64).astype(np.int32)
    last, count = _hashindex_tpu.scores(
        config, jax.tree.map(jnp.asarray, state), bucket, lane, hit & first, 7, interpret=True
    )
    want_last, want_count = state.last.copy(), state.count.copy()
    touched = np.unique(slots[hit])
    want_last[touched] = np.maximum(want_last[touched], 7)
    want_count[touched] += 1
    np.testing.assert_array_equal(np.asarray(last), want_last)
    np.testing.assert_array_equal(np.asarray(count), want_count)
    edges = np.arange(128, slots.size, 128)  # Each grid step's first id.
    assert (slots[edges] == slots[edges - 1]).any(), "no copies across a step's edge"
    odd = hx.IndexConfig(buckets=3, bucket_size=64)
    assert not _hashindex_tpu.serves_scores(odd, hx.empty_state(odd, 1))


@pytest.mark.parametrize(
    "eviction, ttl",
    [
        pytest.param("lru", None, marks=pytest.mark.slow),  # The fast tier keeps lfu's.
        ("lfu", 7),
        pytest.param("none", None, marks=pytest.mark.slow),
        pytest.param("lru", 7, marks=pytest.mark.slow),
    ],
)
def test_pallas_place_equals_place(eviction, ttl):
    """`_hashindex_tpu.place` (Pallas' interpreter) gives `place`'s state, counters, rows and
    placements bit for bit: admitted ids sorted by (bucket, priority) with copies and
    padding between them, over 11 grid steps, into buckets with free, expired, evictable
    and unavailable slots, some with more admitted ids than slots they may take."""
    from jax_tpu_embed import _hashindex_tpu

    rng = np.random.default_rng(3)
    config = hx.IndexConfig(buckets=16, bucket_size=64, eviction=eviction, ttl_steps=ttl)
    held = np.unique(rng.integers(-(2**63), 2**63 - 1, 900, dtype=np.int64))
    bucket = np.asarray(hx.global_bucket(config, *hx.split_ids(held)))
    held = held[np.concatenate([np.flatnonzero(bucket == g)[:64] for g in range(16)])]
    # At step 8: last 8 to 13 unavailable; with TTL 7, last 0 or 1 expired.
    state, _ = hx.build(
        config, 1, held, rng.integers(0, 14, held.size), rng.integers(1, 6, held.size)
    )
    state = jax.tree.map(jnp.asarray, state)
    new = np.setdiff1d(np.unique(rng.integers(-(2**63), 2**63 - 1, 900, dtype=np.int64)), held)
    new = np.repeat(new, rng.integers(1, 3, new.size))  # Copies, as several senders make.
    hi, lo = (np.asarray(x) for x in hx.split_ids(new))
    bucket = np.asarray(hx.global_bucket(config, hi, lo))
    order = np.lexsort((lo, hi, np.asarray(hx.priority(config, hi, lo)), bucket))
    hi, lo, bucket, new = hi[order], lo[order], bucket[order], new[order]
    first = np.concatenate([[True], new[1:] != new[:-1]])
    admit = first & (rng.random(new.size) < 0.8)
    pad = rng.random(new.size) < 0.05
    hi, lo = (np.where(pad, np.uint32(hx.PAD), x) for x in (hi, lo))
    args = (state, hi, lo, bucket, admit)
    want = _jit(lambda s, h, l, b, a: hx.place(config, s, h, l, b, a, 8))(*args)
    pallas = lambda s, h, l, b, a: _hashindex_tpu.place(config, s, h, l, b, a, 8, interpret=True)
    got = _jit(pallas)(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stats = dict(zip(hx.STAT_NAMES, np.asarray(want[0].stats - state.stats)[0]))
    assert stats["failed"] > 0 and stats["admitted"] > 0 and new.size > 2 * 256
    assert stats["evicted"] > 0 or eviction == "none"
    assert (stats["expired"] > 0) == (ttl is not None), stats


@pytest.mark.parametrize("ttl", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_sighted_with_copies_equals_sighted_of_distinct_ids(ttl):
    """`sighted(distinct=...)` on ids with copies beside them (several devices sent one id)
    writes the state `sighted` of the distinct ids writes, counters included, and gives
    each copy its id's hit, row and admission."""
    rng = np.random.default_rng(5)
    config = hx.IndexConfig(buckets=8, bucket_size=8, ttl_steps=ttl, admit_probability=0.5)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, 120, dtype=np.int64))
    held = ids[:40]
    held = _fitting(config, held)
    # At step 7 with TTL 2, those of last 5 have expired.
    state, _ = hx.build(config, 1, held, rng.integers(5, 7, held.size), np.ones(held.size))
    state = jax.tree.map(jnp.asarray, state)
    asked = np.unique(np.concatenate([rng.choice(held, 30), rng.choice(ids, 30)]))
    copies = np.repeat(asked, rng.integers(1, 4, asked.size))  # Each id 1 to 3 times.
    bucket = np.asarray(hx.global_bucket(config, *hx.split_ids(copies)))
    copies = copies[np.argsort(bucket, kind="stable")]  # Grouped, copies adjacent.
    first = np.concatenate([[True], copies[1:] != copies[:-1]])
    once = copies[first]

    @_jit
    def run(hi, lo, distinct):
        b = hx.global_bucket(config, hi, lo)
        return hx.sighted(config, state, hi, lo, b, True, 7, grouped=True, distinct=distinct)

    want, got = run(*hx.split_ids(once), None), run(*hx.split_ids(copies), first)
    for a, b in zip(jax.tree.leaves(want.state), jax.tree.leaves(got.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    of_id = np.cumsum(first) - 1  # Each entry's id among `once`.
    for field in ("hit", "row", "admit"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, field)), np.asarray(getattr(want, field))[of_id], field
        )
    assert np.asarray(want.hit).any() and np.asarray(want.admit).any() and (~first).any()


def test_build_errors():
    config = hx.IndexConfig(buckets=2, bucket_size=2)
    with pytest.raises(ValueError, match=r"would hold \d+ ids.*capacity is bucket_size = 2"):
        hx.build(config, 1, np.arange(10), np.zeros(10), np.ones(10))
    with pytest.raises(ValueError, match="-1 is padding"):
        hx.build(config, 1, [-1], [0], [1])
    with pytest.raises(ValueError, match="distinct"):
        hx.build(config, 1, [5, 5], [0, 0], [1, 1])
    with pytest.raises(ValueError, match=r"buckets \(2\) must be a multiple"):
        hx.build(config, 4, [5], [0], [1])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(buckets=0), "buckets"),
        (dict(buckets=4, bucket_size=0), "bucket_size"),
        (dict(buckets=4, eviction="fifo"), "eviction"),
        (dict(buckets=4, ttl_steps=0), "ttl_steps"),
        (dict(buckets=4, min_count=0), "min_count"),
        (dict(buckets=4, admit_probability=0.0), "admit_probability"),
        (dict(buckets=4, admit_probability=1.5), "admit_probability"),
        (dict(buckets=4, filter_buckets=2), "filter_buckets"),
        (dict(buckets=4, min_count=2), "filter_buckets"),
        (dict(buckets=4, min_count=2, filter_buckets=3), "filter_buckets"),
        (dict(buckets=4, seed=-1), "seed"),
        (dict(buckets=4, seed=1 << 32), "seed"),
        (dict(buckets=True), "buckets"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"IndexConfig: {field} must be"):
        hx.IndexConfig(**kwargs)


def test_split_join_and_locate(rng):
    ids = np.concatenate(
        [rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 1000, np.int64), [-1, 0]]
    )
    hi, lo = hx.split_ids(ids)
    assert hi.dtype == lo.dtype == np.uint32
    np.testing.assert_array_equal(hx.join_ids(hi, lo), ids)
    assert hi[-2] == lo[-2] == M32
    config = hx.IndexConfig(buckets=64, bucket_size=8, seed=5)
    ref = Reference(config)
    g = np.array([ref.bucket(int(i)) for i in ids])
    for n in (1, 2, 8):
        owner, local = map(np.asarray, hx.locate(config, n, hi, lo))
        np.testing.assert_array_equal(owner * (64 // n) + local, g)
        np.testing.assert_array_equal(owner, g // (64 // n))
    # Buckets spread: no bucket is far above the mean.
    assert np.bincount(g, minlength=64).max() < 3 * ids.size / 64


def test_host_hashes_equal_the_traced_ones_bit_for_bit():
    """`global_bucket` and `priority` of NumPy ids run in NumPy (a restore's host code then
    compiles nothing for each new size of ids) and give the bits of the jitted jnp form,
    for ids from all of int64, a 0-d id included; `mix32` likewise."""
    config = hx.IndexConfig(buckets=192, bucket_size=8, seed=11)
    rng = np.random.default_rng(4)
    ids = rng.integers(-(2**63), 2**63 - 1, 1000, dtype=np.int64)
    ids[:3] = [0, -2, 2**63 - 1]
    hi, lo = hx.split_ids(ids)
    for fn in (hx.global_bucket, hx.priority):
        host = fn(config, hi, lo)
        assert isinstance(host, np.ndarray)
        traced = np.asarray(_jit(functools.partial(fn, config))(hi, lo))
        assert host.dtype == traced.dtype
        np.testing.assert_array_equal(host, traced)
        np.testing.assert_array_equal(fn(config, hi[5:6].reshape(()), lo[5:6].reshape(())), host[5])
    words = rng.integers(0, 2**32, 500, dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(_storage.mix32(words), np.asarray(_jit(_storage.mix32)(words)))
