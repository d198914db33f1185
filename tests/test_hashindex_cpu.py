"""The C++ index kernels (`_hashindex_cpu`) against the XLA index (`_hashindex`, `_dynamic`).

Every step of every stream runs `_hashindex.update` and `_hashindex_cpu.update` from the same
state and asserts that all of their outputs are identical: the whole new IndexState (keys,
last, count, the filter, stats), the rows and the fresh flags. `find` and `distinct` the
same. tests/test_hashindex.py checks the XLA index against a sequential reference, so these
kernels are checked against it too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from jax_tpu_embed import _dynamic, _hashindex_cpu
from jax_tpu_embed import _hashindex as hx
from test_hashindex import CASES, MESH_CONFIG, QUICK, _stream

pytestmark = pytest.mark.skipif(
    not _hashindex_cpu.available(), reason="the C++ hash index does not compile here"
)

IMPLS = {"xla": hx, "cpp": _hashindex_cpu}

# Configs beyond test_hashindex's: every policy crossed with TTL, admission by count and
# probability together, a filter much smaller than the index.
EXTRA = {
    "none_ttl": (hx.IndexConfig(buckets=8, bucket_size=4, eviction="none", ttl_steps=5), 24, 200),
    "lfu_ttl": (
        hx.IndexConfig(buckets=8, bucket_size=4, eviction="lfu", ttl_steps=7, seed=21),
        24,
        200,
    ),
    "lru_all": (
        hx.IndexConfig(
            buckets=8,
            bucket_size=8,
            ttl_steps=9,
            min_count=3,
            admit_probability=0.6,
            filter_buckets=2,
            filter_bucket_size=8,
            seed=0xFFFFFFFF,
        ),
        40,
        400,
    ),
    "wide": (hx.IndexConfig(buckets=2, bucket_size=16, eviction="lfu", seed=4), 48, 300),
    "lfu_filter": (
        hx.IndexConfig(
            buckets=4,
            bucket_size=8,
            eviction="lfu",
            min_count=2,
            filter_buckets=4,
            filter_bucket_size=2,
            seed=5,
        ),
        32,
        300,
    ),
}
ALL = {**CASES, **EXTRA}
# The fast tier runs the case with every rule on; the slow tier every policy and rule alone
# ("wide": many placements per bucket and step). The programs here compile at
# test_hashindex's QUICK (no LLVM optimizations: half their compile time, no integer
# result changed), except "lru_all"'s stream, at the default level.
FAST = ("lru_all",)
STEPS = 300


@functools.cache
def _jitted(impl: str, fn: str, config):
    return jax.jit(functools.partial(getattr(IMPLS[impl], fn), config), compiler_options=QUICK)


def _assert_same(want, got, what):
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)
    ):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, path, a.dtype, b.dtype)
        if not np.array_equal(a, b):
            bad = np.argwhere(a != b)[:5].tolist()
            raise AssertionError(f"{what}: {jax.tree_util.keystr(path)} differs at {bad}")


def _inputs(config, rng, ids):
    """(hi, lo, local bucket, valid) of one step: the stream's ids, some of them not valid
    (another shard's)."""
    hi, lo = hx.split_ids(ids)
    _, lb = hx.locate(config, 1, hi, lo)
    valid = (ids != -1) & (rng.random(ids.shape) < 0.9)
    return hi, lo, np.asarray(lb), valid


@functools.cache
def _side_by_side(config, quick: bool):
    """A whole stream in one jitted scan: each step runs both updates from the same state
    and both finds on the new state, and says, per output array, whether they agree."""

    def step(state, xs):
        hi, lo, lb, valid, now, q_hi, q_lo, q_lb = xs
        want = hx.update(config, state, hi, lo, lb, valid, now)
        got = _hashindex_cpu.update(config, state, hi, lo, lb, valid, now)
        args = (want[0], q_hi, q_lo, q_lb, now + 1)
        want += hx.find(config, *args)
        got += _hashindex_cpu.find(config, *args)
        same = [jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got))]
        return want[0], jnp.stack(same)

    scan = lambda state, xs: jax.lax.scan(step, state, xs)
    return jax.jit(scan, compiler_options=QUICK if quick else None)


def _leaf_names(config):
    state = hx.empty_state(config, 1)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    return names + ["row", "fresh", "find row", "found"]


@pytest.mark.parametrize(
    "case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in ALL]
)
def test_update_and_find_identical(case):
    _identical_over_a_stream(case, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lru_all", "lfu_filter", "none_ttl"])
def test_ten_thousand_steps_identical(case):
    """10^4 steps of power-law int64 ids (duplicates removed per step, padding, a full
    table, TTL expiry, admission thresholds): both kernels agree on every array after every
    step, and the counters add up."""
    state = _identical_over_a_stream(case, 10_000)
    s = dict(zip(hx.STAT_NAMES, np.asarray(state.stats)[0].tolist()))
    held = int(np.sum(hx.slot_ids(ALL[case][0], state) != -1))
    assert s["admitted"] - s["evicted"] - s["expired"] == held
    assert s["misses"] == s["admitted"] + s["rejected"] + s["failed"]


def _identical_over_a_stream(case, steps):
    config, width, pool = ALL[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    ids = np.stack(_stream(rng, steps, width, pool))
    # Queries: each step's ids, other ids of the pool, padding.
    queries = np.concatenate([ids, np.stack(_stream(rng, steps, width, pool))], axis=1)
    xs = (*_inputs(config, rng, ids), np.arange(1, steps + 1, dtype=np.int32))
    q_hi, q_lo = hx.split_ids(queries)
    xs += (q_hi, q_lo, np.asarray(hx.locate(config, 1, q_hi, q_lo)[1]))
    state = jax.tree.map(jnp.asarray, hx.empty_state(config, 1))
    state, same = _side_by_side(config, quick=case != "lru_all")(state, xs)
    same = np.asarray(same)
    if not same.all():
        t, leaf = np.argwhere(~same)[0]
        raise AssertionError(f"{case}: {_leaf_names(config)[leaf]} differs at step {t + 1}")
    s = dict(zip(hx.STAT_NAMES, np.asarray(state.stats)[0].tolist()))
    # The stream exercised the rules of this case.
    assert s["hits"] and s["admitted"]
    if config.eviction != "none" and config.ttl_steps is None and config.min_count == 1:
        assert s["evicted"]
    if config.eviction == "none":
        assert s["failed"]
    if config.ttl_steps is not None:
        assert s["expired"]
    if config.min_count > 1:
        assert s["filter_evicted"]
    if config.min_count > 1 or config.admit_probability < 1:
        assert s["rejected"]
    return state


def test_update_on_odd_states():
    """States the stream does not reach: local buckets out of range (clipped), steps that go
    back (last > now), counts at the int32 edge; ids of any shape (2-D)."""
    config = dataclasses.replace(EXTRA["lfu_ttl"][0], ttl_steps=3)
    rng = np.random.default_rng(7)
    state = jax.tree.map(jnp.asarray, hx.empty_state(config, 1))
    for t, ids in enumerate(_stream(rng, 40, 24, 200), start=1):
        hi, lo, lb, valid = _inputs(config, rng, ids)
        if t == 20:
            state = dataclasses.replace(
                state, count=jnp.where(state.count > 0, np.int32(2**31 - 1), state.count)
            )
        lb = np.where(rng.random(lb.shape) < 0.1, rng.integers(-3, 12, lb.shape), lb)
        now = np.int32(t if t < 30 else 60 - t)
        hi, lo, lb, valid = (x.reshape(2, -1) for x in (hi, lo, lb, valid))
        want = _jitted("xla", "update", config)(state, hi, lo, lb, valid, now)
        got = _jitted("cpp", "update", config)(state, hi, lo, lb, valid, now)
        _assert_same(want, got, f"step {t}")
        q_lb = np.where(rng.random(lb.shape) < 0.2, rng.integers(-3, 12, lb.shape), lb)
        args = (want[0], hi, lo, q_lb, now)
        _assert_same(
            _jitted("xla", "find", config)(*args), _jitted("cpp", "find", config)(*args), "find"
        )
        state = want[0]


def _distinct(hi, lo, valid):
    """The distinct valid entries in XLA ops: sorted distinct (hi, lo) (the rest padding,
    after them), a mask of the distinct ones, and each entry's position in the distinct
    list."""
    n = hi.shape[0]
    pad = jnp.uint32(hx.PAD)
    hi, lo = jnp.where(valid, hi, pad), jnp.where(valid, lo, pad)
    s_hi, s_lo, perm = jax.lax.sort((hi, lo, jnp.arange(n, dtype=jnp.int32)), num_keys=2)
    first = jnp.concatenate(
        [jnp.ones((1,), bool), (s_hi[1:] != s_hi[:-1]) | (s_lo[1:] != s_lo[:-1])]
    )
    segment = jnp.cumsum(first.astype(jnp.int32)) - 1
    u_hi = jnp.full((n,), pad, jnp.uint32).at[segment].set(s_hi)
    u_lo = jnp.full((n,), pad, jnp.uint32).at[segment].set(s_lo)
    where = jnp.zeros((n,), jnp.int32).at[perm].set(segment)
    return u_hi, u_lo, ~_dynamic.is_pad(u_hi, u_lo), where


# Every rule happens in a short stream on 4 shards.
MESH = dataclasses.replace(MESH_CONFIG, ttl_steps=8, filter_bucket_size=4)


def _by_row(rows, hi, lo, fresh):
    """(rows, hi, lo) of the fresh entries, ascending by row, padded with -1: the resets,
    in an order that does not depend on the order of the ids."""
    key = jnp.where(fresh, rows, jnp.iinfo(jnp.int32).max)
    key, hi, lo = jax.lax.sort((key, hi, lo), num_keys=1)
    keep = key < jnp.iinfo(jnp.int32).max
    return jnp.where(keep, key, -1), jnp.where(keep, hi, 0), jnp.where(keep, lo, 0)


def _both_sharded(config, mesh, keep: bool = True):
    """Inside shard_map, the C++ `resolve_update` and `find_owned` (as `_dynamic` runs them)
    against XLA ops from the same state: the gathered ids located, the owned ones
    deduplicated and updated, and found. Returns the XLA state and, per output array,
    whether the two agree."""
    n = mesh.shape["shard"]

    def xla(state, hi, lo, now):
        me = jax.lax.axis_index("shard")
        owner, lb = hx.locate(config, n, hi, lo)
        mine = (owner == me) & ~_dynamic.is_pad(hi, lo) & keep
        u_hi, u_lo, u_valid, where = _distinct(hi, lo, mine)
        _, u_lb = hx.locate(config, n, u_hi, u_lo)
        state, row, fresh = hx.update(config, state, u_hi, u_lo, u_lb, u_valid, now)
        rows = jnp.where(mine, row[where], -1)
        resets = _by_row(row, u_hi, u_lo, fresh & u_valid & (row >= 0))
        found_row, found = hx.find(config, state, hi, lo, lb, now)
        found_row = jnp.where(found & (owner == me), found_row, -1)
        return state, (rows, *resets, found_row)

    def cpp(state, hi, lo, now):
        me = jax.lax.axis_index("shard")
        state, r = _hashindex_cpu.resolve_update(config, state, hi, lo, keep, me, n, now)
        fresh = jax.lax.iota(jnp.int32, hi.shape[0]) < r.fresh_count
        resets = _by_row(r.fresh_rows, r.fresh_hi, r.fresh_lo, fresh)
        found_row = _hashindex_cpu.find_owned(config, state, hi, lo, me, n, now)
        return state, (r.rows, *resets, found_row)

    def local(state, hi, lo, now):
        want, got = xla(state, hi, lo, now), cpp(state, hi, lo, now)
        same = [jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got))]
        return want[0], jnp.stack(same)[None]

    shard, rep = P("shard"), P()
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(shard, rep, rep, rep), out_specs=(shard, shard), check_vma=False
    )
    return jax.jit(fn, compiler_options=QUICK)


@pytest.mark.slow  # Other fast tests run its lines (tests/tier_coverage.py).
@pytest.mark.parametrize("shards", [1, 4])
def test_identical_under_shard_map(shards):
    config = MESH
    mesh = make_mesh(shards)
    step = _both_sharded(config, mesh)
    state = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("shard"))),
        hx.empty_state(config, shards),
    )
    stream = _stream(np.random.default_rng(shards), 40, 32, 300)
    for t, ids in enumerate(stream, start=1):
        ids = np.concatenate([ids, ids[: len(ids) // 4]])  # repeats, as a batch has them
        hi, lo = hx.split_ids(ids)
        state, same = step(state, hi, lo, np.int32(t))
        same = np.asarray(same)
        assert same.all(), (t, np.argwhere(~same).tolist())
    s = hx.stats(config, state, len(stream))
    assert int(s["evicted"]) and int(s["expired"]) and int(s["filter_evicted"])
    # A skipped table (keep False): nothing changes, and no id has a row.
    before = jax.tree.map(np.asarray, state)
    after, same = _both_sharded(config, mesh, keep=False)(state, hi, lo, np.int32(len(stream) + 1))
    assert np.asarray(same).all()
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("shards", [0, 2])
def test_update_is_in_place(shards):
    """A donated step writes into the index buffers: no copy of the (NB·b,) arrays, the
    same buffers before and after, and temporaries of O(ids), not O(capacity). Plain jit
    (shards 0, `update`) and inside shard_map on 2 devices (`resolve_update`, as `_dynamic`
    runs it)."""
    config = hx.IndexConfig(buckets=8192, bucket_size=64, ttl_steps=50, min_count=2,
                            filter_buckets=4096, filter_bucket_size=16)  # fmt: skip
    u, n = 512, max(shards, 1)

    def local(state, hi, lo, now):
        if shards:
            me = jax.lax.axis_index("shard")
            state, r = _hashindex_cpu.resolve_update(config, state, hi, lo, True, me, n, now)
            return state, r.rows[None], r.fresh_rows[None]
        _, lb = hx.locate(config, n, hi, lo)
        state, row, fresh = _hashindex_cpu.update(config, state, hi, lo, lb, True, now)
        return state, row[None], fresh[None]

    state = hx.empty_state(config, n)
    if shards:
        mesh = make_mesh(shards)
        shard, rep = P("shard"), P()
        local = jax.shard_map(
            local, mesh=mesh, in_specs=(shard, rep, rep, rep), out_specs=shard, check_vma=False
        )
        state = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, shard)), state)
    state = jax.tree.map(jnp.asarray, state)
    step = jax.jit(local, donate_argnums=0)
    rng = np.random.default_rng(0)
    batches = [hx.split_ids(rng.integers(0, 1 << 40, u, np.int64))] * 3  # seen, admitted, hit
    compiled = step.lower(state, *batches[0], np.int32(1)).compile()
    hlo = compiled.as_text()
    assert hlo is not None
    nb, nf = 8192 * 64 // n, 4096 * 16 // n  # local arrays
    for shape in (f"u32[{nb}]", f"s32[{nb}]", f"u32[{nf}]", f"s32[{nf}]"):
        copies = [line for line in hlo.splitlines() if " copy(" in line and shape in line]
        assert not copies, copies
    memory = compiled.memory_analysis()
    assert memory is not None and memory.temp_size_in_bytes < config.capacity * 4 // 20
    pointers = lambda s: [b.data.unsafe_buffer_pointer() for x in jax.tree.leaves(s)
                          for b in x.addressable_shards]  # fmt: skip
    # From the first step's outputs on (a device_put may leave an input's buffer shared
    # with its NumPy array, and then it cannot be donated).
    state, row, _ = compiled(state, *batches[0], np.int32(1))
    before = pointers(state)
    for t, (hi, lo) in enumerate(batches[1:], start=2):
        state, row, _ = compiled(state, hi, lo, np.int32(t))
    assert pointers(state) == before
    assert ((np.asarray(row) >= 0).sum(0) == 1).all()  # every id has a row, on its owner
    assert np.asarray(state.stats)[:, hx.STAT_NAMES.index("hits")].sum() == u


def _compiled_step(tables: int, dynamic: bool, mesh, combiner: str):
    """The optimized HLO of a jitted lookup and update of `tables` one-feature tables,
    dynamic (C++ index) or static, on `mesh`."""
    import jax_tpu_embed as jte

    configs = {
        f"t{i}": jte.TableConfig(
            None if dynamic else 1000,
            8,
            combiner=combiner,
            name=f"t{i}",
            dynamic=jte.DynamicTable(capacity=1024) if dynamic else None,
        )
        for i in range(tables)
    }
    spec = jte.EmbeddingSpec(
        {n: jte.FeatureConfig(t) for n, t in configs.items()}, jte.Adagrad(learning_rate=0.1)
    )
    emb = jte.Embedding(spec, mesh)
    assert set(emb.backends.values()) == {"cpu"}
    ids = np.random.default_rng(0).integers(0, 1000, (16, 3))
    batch = {n: jte.split_ids(ids) if dynamic else ids for n in configs}

    def step(state, batch):
        acts = emb.lookup(state, batch)
        return emb.apply_gradients(state, batch, jax.tree.map(lambda a: 0.5 * a + 1, acts))

    return jax.jit(step).lower(emb.init(jax.random.key(0)), batch).compile().as_text()


@pytest.mark.parametrize("combiner", [pytest.param("sum", marks=pytest.mark.slow), "mean"])
def test_a_step_resolves_each_tables_ids_once(combiner):
    """In one jitted lookup and update of dynamic tables: one locate and deduplication of
    each table's ids (`owned_distinct`, shared by the find and the update), one all-gather
    of all tables' ids, and one all-reduce of their rows each way, which the slot tables'
    exchange takes as its gathered ids (and, for a mean, the factors every device computes
    from the gathered ids): per table, no collective beyond the static step's (which
    all-gathers each table's ids, once for both)."""
    import re

    mesh = make_mesh(2)
    count = lambda hlo, pattern: len(re.findall(pattern, hlo))
    collective = r"= \S+ (?:all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\("
    tables = 3
    dyn, static = (_compiled_step(tables, d, mesh, combiner) for d in (True, False))
    assert count(dyn, r'custom_call_target="jte_hashindex_owned_distinct"') == tables
    assert count(dyn, r'custom_call_target="jte_hashindex_find_distinct"') == tables
    # Static: each table's ids all-gathered, activations reduce-scattered, gradients
    # all-gathered. Dynamic: the same but the ids' all-gathers, plus 3 for all tables.
    assert count(static, collective) >= 3 * tables
    assert count(dyn, collective) == count(static, collective) - tables + 3


@pytest.mark.parametrize("k", [1, 8, 64, 300])
def test_first_set_equals_nonzero(k):
    """`first_set` (the C++ compaction `_dynamic._first` takes beside the C++ index): the
    positions of a mask's first k set entries, its size past them, as `jnp.nonzero`."""
    rng = np.random.default_rng(k)
    n = 257
    for count in (0, 1, 7, k - 1, k, k + 1, 100, n):
        mask = np.zeros(n, bool)
        mask[rng.choice(n, min(max(count, 0), n), replace=False)] = True
        got = np.asarray(jax.jit(_hashindex_cpu.first_set, static_argnums=1)(mask, k))
        want = np.asarray(jnp.nonzero(mask, size=k, fill_value=n)[0])
        np.testing.assert_array_equal(got, want, err_msg=f"{count} set")


def _missing_reference(key, hi, lo, scale, mask, dim):
    """float64 (b, dim): Σ_l scale·mask·(initial row), every position's row drawn."""
    init = np.asarray(_dynamic.initial_rows(key, hi, lo, dim), np.float64)
    w = np.where(mask, np.asarray(scale, np.float64), 0.0)
    return np.einsum("bl,bld->bd", w, init)


def test_a_few_initial_rows_drawn_alike_by_every_compaction():
    """`missing_rows` and `initial_rows_where` draw only the masked positions' rows while
    they are few (tiers of n/512, n/64 and n/8 rows, then all), compacted by `nonzero` or
    the C++ kernel; on TPU layouts ("sort") every row as soon as one is masked, summed
    position by position. Equal bit for bit either way, and equal to every row drawn
    (float64), for counts on both sides of each tier; an example's sum has the same bits in
    every tier."""
    b, length, dim = 256, 10, 8  # n = 2,560: tiers of 8 (n/512 rounds up to 8), 40, 320.
    n = b * length
    rng = np.random.default_rng(3)
    hi = jnp.asarray(rng.integers(0, 2**32, (b, length), dtype=np.uint32))
    lo = jnp.asarray(rng.integers(0, 2**32, (b, length), dtype=np.uint32))
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (b, length)), jnp.float32)
    key = jnp.asarray([7, 11], jnp.uint32)
    fns = {
        how: jax.jit(
            lambda m, how=how: (
                _dynamic.missing_rows(key, hi, lo, scale, m, dim, how),
                _dynamic.initial_rows_where(key, hi, lo, m, dim, how),
            )
        )
        for how in ("sort", "nonzero", "cpu")
    }
    for count in (0, 1, 8, 9, 40, 41, 320, 321, n):
        mask = np.zeros(n, bool)
        mask[rng.choice(n, count, replace=False)] = True
        mask = mask.reshape(b, length)
        got = {how: [np.asarray(x) for x in fn(jnp.asarray(mask))] for how, fn in fns.items()}
        for how in ("nonzero", "cpu"):
            for x, y in zip(got[how], got["sort"]):
                np.testing.assert_array_equal(x, y, err_msg=f"{how}, {count} masked")
        summed, rows = got["cpu"]
        want = _missing_reference(key, hi, lo, scale, mask, dim)
        np.testing.assert_allclose(summed, want, rtol=1e-5, atol=1e-6, err_msg=f"{count}")
        init = np.asarray(_dynamic.initial_rows(key, hi, lo, dim))
        np.testing.assert_allclose(rows, np.where(mask[..., None], init, 0.0), rtol=1e-6, atol=1e-7)
        assert count == 0 or np.abs(summed).sum() > 0
    # An example's sum has the same bits whichever tier its device's count falls in.
    few = np.zeros((b, length), bool)
    few[: b // 2] = rng.random((b // 2, length)) < 0.05
    many = few.copy()
    many[b // 2 :] = True
    for how, fn in fns.items():
        a, c = (np.asarray(fn(jnp.asarray(m))[0]) for m in (few, many))
        np.testing.assert_array_equal(a[: b // 2], c[: b // 2], err_msg=how)


def test_rows_given_to_new_ids_reset_in_rounds():
    """`_dynamic._reset_fresh`: the rows the C++ index gave to new ids are reset in rounds of
    a 512th up to a 64th of the ids, then a 64th: the same arrays, bit for bit, as one
    `reset_rows` of them all, for counts on both sides of each round size; every other row
    untouched."""
    import jax_tpu_embed as jte

    table = jte.TableConfig(dim=8, name="t", dynamic=jte.DynamicTable(capacity=8192))
    spec = jte.EmbeddingSpec({"t": jte.FeatureConfig(table)}, jte.Adagrad(learning_rate=0.1))
    emb = jte.Embedding(spec, make_mesh(1))
    storage = emb.table_plans["t"].storage
    state = emb.init(jax.random.key(0))
    rng = np.random.default_rng(5)
    arrays = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
        (state.tables["t"], state.slots["t"]),
    )
    n = 5120  # Rounds of 10, then of 80.
    rows = jnp.asarray(rng.permutation(8192)[:n], jnp.int32)
    hi = jnp.asarray(rng.integers(0, 2**32, n, dtype=np.uint32))
    lo = jnp.asarray(rng.integers(0, 2**32, n, dtype=np.uint32))
    key = jnp.asarray([3, 4], jnp.uint32)

    @jax.jit
    def both(arrays, count):
        resolved = _hashindex_cpu.Resolved(None, count, rows, hi, lo)
        table, slots = arrays
        rounds = _dynamic._reset_fresh(storage, table, slots, resolved, key, emb.dynamic["t"], 0)
        fresh = jnp.arange(n) < count
        init = _dynamic.initial_rows(key, hi, lo, 8)
        return rounds, _dynamic.reset_rows(storage, table, slots, rows, fresh, init)

    for count in (0, 1, 10, 11, 80, 81, 95, 700, n):
        rounds, once = both(arrays, jnp.int32(count))
        for x, y in zip(jax.tree.leaves(rounds), jax.tree.leaves(once)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{count}")
        changed = np.any(np.asarray(rounds[0]) != np.asarray(arrays[0]), axis=-1)
        assert changed.sum() == count
