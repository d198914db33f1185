"""Tables in host memory (`placement="host"`): the same bits as device tables, every path.

A host table's arrays live in pinned host memory and the step reaches its rows through one
host gather and one host scatter per pass (`_placement`); everything between runs the
device path's arithmetic. So the properties are exact: lookups, exports and slots of host
tables equal those of device tables bit for bit, for every optimizer, on 1 to 8 devices,
"div" and "mod", both exchanges, with TPU layout (passes, packing) and without, through the
jitted train step, checkpoints and `restore_tables`; and the arrays stay in host memory.
Device tables are compared on the XLA backend, the one that serves host tables (the C++
kernels sum in another order).
"""

import dataclasses
import sys
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
import test_dynamic
from conftest import executables_made, make_mesh
from jax_tpu_embed import _placement
from test_optimizers import OPTIMIZERS

_B = 16
_HOST = "pinned_host"


# The fast tier's optimizers: a plain one with every extra, a slot riding in the table's
# rows, two slots and a rank-1 slot (the slow tier runs every optimizer).
# No slot, two slots, a rank-1 slot (Adagrad's accumulator is the cached and staged cases').
QUICK = ("sgd+extras", "adam+extras", "rowwise_adagrad")
# HostCached's: a slot riding in the table's rows (one cache) and a rank-1 slot (two).
QUICK_CACHED = ("adagrad", "rowwise_adagrad")


def _spec(placement, strategy: str, optimizers, shards: int = 1):
    """One table per optimizer, shared by a weighted pooled feature and a sequence
    feature, with widths that pack (4, 12) and one that does not (16); every fourth one
    bfloat16 (stochastic rounding). `placement`: a str, or fn(vocab, shards) -> HostCached."""
    features = {}
    for i, name in enumerate(optimizers):
        optimizer = OPTIMIZERS[name][0]
        vocab = 40 + 7 * i
        table = jte.TableConfig(
            vocabulary_size=vocab,
            dim=(4, 12, 16)[i % 3],
            combiner=("sum", "mean", "sqrtn")[i % 3],
            name=name.replace("+", "_"),
            optimizer=optimizer,
            placement=placement if isinstance(placement, str) else placement(vocab, shards),
            dtype=jnp.bfloat16 if i % 4 == 1 else jnp.float32,
        )
        features[name.replace("+", "_")] = {
            "pooled": jte.FeatureConfig(table),
            "seq": jte.FeatureConfig(table, max_sequence_length=3),
        }
    return jte.EmbeddingSpec(features, None, partition_strategy=strategy, clipping_limit=0.9)


def _batch(rng, spec):
    out = {}
    for name, feats in spec.features.items():
        vocab = feats["pooled"].table.vocabulary_size
        ids = rng.integers(0, vocab // 3, (_B, 4))  # Few distinct ids: duplicates.
        ids[rng.random((_B, 4)) < 0.25] = -1
        seq = rng.integers(0, vocab, (_B, 3))
        seq[:, 2][rng.random(_B) < 0.5] = -1
        weights = rng.uniform(0.2, 2.0, (_B, 4)).astype(np.float32)
        out[name] = {"pooled": jte.Weighted(ids, weights), "seq": seq}
    return out


def _memory_kinds(state) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves((state.tables, state.slots))}


_SLOW = pytest.mark.slow


def _small_cache(vocab: int, shards: int):
    """A cache smaller than one batch's distinct rows (rows stay uncached, misses take
    several host calls)."""
    return jte.HostCached(cache_rows=max(2 * shards, vocab // 5), ways=2, max_misses=2)


def _large_cache(vocab: int, shards: int):
    """A cache as large as a cache can be: one row fewer than the table."""
    return jte.HostCached(cache_rows=vocab - 1, ways=4)


def _equal_device_tables(
    placement,
    shards,
    strategy,
    routing,
    tpu_layout,
    optimizers,
    steps=3,
    staged=False,
    max_ids=None,
):
    """Lookups, exports and slots of tables placed `placement` (a fn(vocab, shards) for
    HostCached) equal those of device tables bit for bit over `steps` steps; `staged`: the
    host side's lookups and updates read the rows `stage` read (as a train step does off
    CPU), to float32 rounding; `max_ids`: both sides' `max_ids_per_shard`."""
    mesh = make_mesh(shards)
    spec_of = lambda p: _spec(p, strategy, optimizers, shards)
    embs = {
        p: jte.Embedding(
            spec_of(p),
            mesh,
            backend="xla",
            routing=routing,
            tpu_layout=tpu_layout,
            lane_width=128 if tpu_layout else 0,  # Packed rows, as on TPU.
            max_ids_per_shard=max_ids,
            stage_host_rows=staged or None,  # On CPU meshes only when asked.
        )
        for p in ("device", placement)
    }
    host = embs[placement]
    # XLA:CPU contracts multiply-adds (a * b + c, one rounding) where its fusions allow, and
    # fuses the row functions differently beside the cache's or the staged rows' ops:
    # such tables equal device tables to float32 rounding (the last bit of a few values;
    # most are exact).
    loose = set() if isinstance(placement, str) and not staged else set(host.table_plans)

    def equal(a: dict, b: dict):
        chex.assert_trees_all_equal(
            {k: v for k, v in a.items() if k not in loose},
            {k: v for k, v in b.items() if k not in loose},
        )
        chex.assert_trees_all_close(
            {k: a[k] for k in loose}, {k: b[k] for k in loose}, rtol=1e-6, atol=1e-7
        )

    states = {p: e.init(jax.random.key(3)) for p, e in embs.items()}
    assert _memory_kinds(states[placement]) == {_HOST}
    assert _memory_kinds(states["device"]) == {"device"}
    rng = np.random.default_rng(shards)
    for _ in range(steps):
        batch = _batch(rng, host.spec)
        rows = dict.fromkeys(embs)
        if staged:
            got = rows[placement] = host.stage(states[placement], batch)
            assert got is not None and set(got.rows) == set(host.table_plans)
            assert all(np.any(np.asarray(ats[0]) < 1 << 30) for ats, _ in got.rows.values())
            if max_ids is not None:  # A device stages a pass's or round's rows; some miss.
                assert strategy == "mod" and not tpu_layout  # Local row id // shards.
                short = []
                for name, (ats, _) in got.rows.items():
                    leaves = batch[name].values()
                    ids = np.concatenate([np.ravel(getattr(x, "ids", x)) for x in leaves])
                    ids = np.unique(ids[ids >= 0])
                    needed = np.bincount(ids % shards, minlength=shards)
                    staged_rows = np.sum(np.asarray(ats[0]).reshape(shards, -1) < 1 << 30, axis=1)
                    short.append(bool(np.any(needed > staged_rows)))
                assert any(short), short
        acts = {p: e.lookup(states[p], batch, staged=rows[p]) for p, e in embs.items()}
        equal(acts[placement], acts["device"])
        grads = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), acts["device"])
        states = {
            p: e.apply_gradients(states[p], batch, grads, staged=rows[p]) for p, e in embs.items()
        }
    assert _memory_kinds(states[placement]) == {_HOST}
    equal(host.export(states[placement]), embs["device"].export(states["device"]))
    equal(host.export_slots(states[placement]), embs["device"].export_slots(states["device"]))
    # The updates really happened: the tables moved away from their initial values.
    first = host.export(host.init(jax.random.key(3)))
    moved = host.export(states[placement])
    assert all(not np.array_equal(first[t], moved[t]) for t in first)
    return host, states[placement]


@pytest.mark.parametrize(
    "shards, strategy, routing, tpu_layout, optimizers",
    [
        # Slow, like every case here: the fast tier reads host rows unstaged in the
        # staged test's owner case (the rows past a round) and in test_dynamic.py's
        # train step, and stages them in both staged cases.
        pytest.param(2, "mod", "owner", True, QUICK, marks=_SLOW),
        pytest.param(1, "div", "gather", False, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(2, "mod", "owner", True, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(4, "div", "owner", False, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(8, "mod", "gather", True, tuple(OPTIMIZERS), marks=_SLOW),
    ],
)
def test_host_tables_equal_device_tables_bit_for_bit(
    shards, strategy, routing, tpu_layout, optimizers
):
    """Every optimizer, on 1 to 8 devices, both strategies and exchanges, with TPU layout
    (passes, lane-packed rows) and without."""
    _equal_device_tables("host", shards, strategy, routing, tpu_layout, optimizers)


@pytest.mark.parametrize(
    "shards, strategy, routing, tpu_layout, optimizers, max_ids",
    [
        (4, "div", "gather", True, QUICK_CACHED, None),  # Packed rows, several passes.
        (2, "mod", "owner", False, QUICK_CACHED, 8),  # More rows than a round: some miss.
        pytest.param(1, "div", "gather", False, tuple(OPTIMIZERS), None, marks=_SLOW),
        pytest.param(2, "mod", "gather", False, tuple(OPTIMIZERS), 8, marks=_SLOW),
        pytest.param(4, "div", "owner", True, tuple(OPTIMIZERS), None, marks=_SLOW),
        pytest.param(8, "mod", "gather", True, tuple(OPTIMIZERS), None, marks=_SLOW),
        pytest.param(8, "mod", "owner", False, tuple(OPTIMIZERS), None, marks=_SLOW),
    ],
)
def test_staged_host_tables_equal_device_tables_bit_for_bit(
    shards, strategy, routing, tpu_layout, optimizers, max_ids
):
    """`stage` (one host read of a step's rows, which the lookup and the update then read
    from device memory) changes no value beyond float32 rounding (XLA:CPU fuses the row
    functions otherwise), with either exchange, also where a device owns more distinct
    rows than it stages (a pass's, or at the owners a round's)."""
    _equal_device_tables(
        "host", shards, strategy, routing, tpu_layout, optimizers, staged=True, max_ids=max_ids
    )


@pytest.mark.parametrize(
    "shards, routing, tpu_layout, tables",
    [
        # Packed: new ids' rows share staged physical rows. Slow: the fast tier stages a
        # dynamic host table in test_dynamic.py's train step.
        pytest.param(2, "gather", True, ("users",), marks=_SLOW),
        pytest.param(4, "owner", False, ("users", "pages", "seen"), marks=_SLOW),
        pytest.param(8, "gather", True, ("users", "pages", "seen"), marks=_SLOW),
    ],
)
def test_staged_dynamic_host_tables_equal_device_tables(shards, routing, tpu_layout, tables):
    """Dynamic tables in host memory, staged: `stage` resolves the batch's ids as the lookup
    does and reads their rows once; the rows the update gives to new ids are read where
    they are needed. With evictions (lru; in the slow tier lfu with TTL, and an admission
    filter), the lookups, exports, slots and counters equal those of the same tables in
    device memory (to float32 rounding), on either exchange, packed and not."""
    batch, steps = 16, 4
    rng = np.random.default_rng(shards)
    pool = rng.integers(-(2**63), 2**63 - 1, size=200, dtype=np.int64)
    features, draws = test_dynamic.routed_features(2 * test_dynamic.DIM, batch, pool)
    seen = jte.TableConfig(
        dim=test_dynamic.DIM,
        name="seen",
        dynamic=jte.DynamicTable(capacity=64, bucket_size=8, min_count=2),
    )
    features["seen"] = jte.FeatureConfig(seen)
    draws["seen"] = lambda rng: test_dynamic.draw_ids(rng, (batch, 3), pool[50:])
    features = {p: f for p, f in features.items() if f.table.name in tables}
    draws = {p: draws[p] for p in features}
    dim = {p: f.table.dim for p, f in features.items()}
    shapes = {p: (batch, 3, d) if p == "hist" else (batch, d) for p, d in dim.items()}
    stream = test_dynamic.feature_stream(rng, steps, draws, shapes)

    def embedding(placement):
        moved = {}
        for f in features.values():
            moved.setdefault(id(f.table), dataclasses.replace(f.table, placement=placement))
        spec = jte.EmbeddingSpec(
            {p: dataclasses.replace(f, table=moved[id(f.table)]) for p, f in features.items()},
            jte.Adagrad(learning_rate=test_dynamic.LR),
        )
        return jte.Embedding(
            spec,
            make_mesh(shards),
            backend="xla",
            routing=routing,
            tpu_layout=tpu_layout,
            lane_width=128 if tpu_layout else 0,
            stage_host_rows=placement == "host" or None,
        )

    embs = {p: embedding(p) for p in ("device", "host")}
    host = embs["host"]
    assert host.stageable == set(tables), host.stageable
    states = {p: e.init(jax.random.key(1)) for p, e in embs.items()}
    staged_rows = dict.fromkeys(host.stageable, 0)  # Over the steps: resident rows staged.
    for feats, grads in stream:
        staged = host.stage(states["host"], feats)
        assert staged is not None and set(staged.rows) == host.stageable
        for name, (ats, _) in staged.rows.items():
            staged_rows[name] += int(np.sum(np.asarray(ats[0]) < 1 << 30))
        acts = {
            "device": embs["device"].lookup(states["device"], feats),
            "host": host.lookup(states["host"], feats, staged=staged),
        }
        chex.assert_trees_all_close(acts["host"], acts["device"], rtol=1e-6, atol=1e-7)
        states = {
            "device": embs["device"].apply_gradients(states["device"], feats, grads),
            "host": host.apply_gradients(states["host"], feats, grads, staged=staged),
        }
    assert _memory_kinds(states["host"]) == {_HOST}
    assert all(staged_rows.values()), staged_rows
    stats = {p: jax.tree.map(int, e.dynamic_stats(states[p])) for p, e in embs.items()}
    assert stats["host"] == stats["device"]
    assert stats["host"]["users"]["evicted"] > 0, stats
    if "pages" in tables:
        assert stats["host"]["pages"]["evicted"] + stats["host"]["pages"]["expired"] > 0, stats
        assert stats["host"]["seen"]["admitted"] > 0, stats
    for read in ("export", "export_slots"):
        on_device, on_host = (getattr(e, read)(states[p]) for p, e in embs.items())
        chex.assert_trees_all_close(on_host, on_device, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "cache, shards, strategy, routing, tpu_layout, optimizers",
    [
        # Slow, like every case here: the fast tier trains a HostCached static table
        # with a small cache (rounds of misses) in
        # test_dynamic_tables_beside_a_cached_static_table and with prefetching in
        # test_train_step_prefetches_the_next_batch.
        pytest.param(_small_cache, 2, "mod", "owner", False, QUICK_CACHED, marks=_SLOW),
        pytest.param(_large_cache, 1, "div", "gather", True, QUICK, marks=_SLOW),
        pytest.param(_small_cache, 1, "div", "gather", False, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(_large_cache, 2, "mod", "owner", True, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(_small_cache, 4, "div", "owner", False, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(_small_cache, 8, "mod", "gather", True, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(_large_cache, 8, "div", "owner", True, tuple(OPTIMIZERS), marks=_SLOW),
    ],
)
def test_cached_tables_equal_device_tables(
    cache, shards, strategy, routing, tpu_layout, optimizers
):
    """HostCached tables over four steps (six in the slow tier), with caches from one row
    short of the table down to smaller than one batch's distinct rows (rows left uncached,
    several host calls per pass): the values of device tables, and the caches were used."""
    steps = 4 if optimizers == QUICK_CACHED else 6
    emb, state = _equal_device_tables(
        cache, shards, strategy, routing, tpu_layout, optimizers, steps=steps
    )
    stats = {t: {k: int(v) for k, v in c.items()} for t, c in emb.cache_stats(state).items()}
    assert set(stats) == set(emb.table_plans)
    for name, c in stats.items():
        assert c["hits"] > 0 and c["misses"] > 0 and c["inserted"] > 0, (name, c)
        assert c["inserted"] <= c["misses"] and c["evicted"] <= c["inserted"], (name, c)
    if cache is _small_cache and not tpu_layout:  # Full caches replaced rows (packed, a
        # physical row holds up to 128 logical rows: these tiny tables have few to evict).
        assert sum(c["evicted"] for c in stats.values()) > 0, stats


def test_init_eager_or_traced_lands_on_the_host():
    """`init` of host tables, with the default initializer (drawn into host buffers) and a
    user's (called with the logical shape), eager or inside another jit: the same values
    as device tables, in host memory."""
    out = {}
    for p in ("device", "host"):
        t = jte.TableConfig(101, 8, name="t", placement=p)
        u = jte.TableConfig(
            13, 4, name="u", placement=p, initializer=lambda k, s, d: jax.random.uniform(k, s, d)
        )
        spec = jte.EmbeddingSpec(
            {"a": jte.FeatureConfig(t), "b": jte.FeatureConfig(u)}, jte.Adagrad(0.1)
        )
        emb = jte.Embedding(spec, make_mesh(2), backend="xla", init_block_bytes=1024)
        for how, init in (("eager", emb.init), ("traced", jax.jit(emb.init))):
            state = init(jax.random.key(3))
            want = {"device": {"device"}, "host": {_HOST}}[p]
            assert _memory_kinds(state) == want, (p, how)
            out[p, how] = (emb.export(state), emb.export_slots(state))
    for how in ("eager", "traced"):
        chex.assert_trees_all_equal(out["host", how], out["device", "eager"])


def _train_spec(placement):
    big = jte.TableConfig(
        vocabulary_size=500, dim=8, combiner="sum", name="big", placement=placement
    )
    small = jte.TableConfig(vocabulary_size=30, dim=8, combiner="mean", name="small")
    return jte.EmbeddingSpec(
        {"big": jte.FeatureConfig(big), "small": jte.FeatureConfig(small)},
        jte.Adagrad(0.1),
    )


def _loss(params, acts, batch):
    x = jnp.concatenate([acts["big"], acts["small"]], axis=1)
    return jnp.mean((x @ params["w"] - batch["label"]) ** 2)


_CACHED = jte.HostCached(cache_rows=64, ways=4)


@pytest.mark.parametrize(
    "kind, placement, staged, pipelined",
    [
        # All slow: the fast tier feeds global arrays to jitted steps in test_inputs.py and
        # stages host rows in test_staged_host_tables_equal_device_tables_bit_for_bit.
        pytest.param("explicit", "host", True, False, marks=_SLOW),  # One host read of the rows.
        # A pipelined step stages its batch's rows and the pending one's in one read (as
        # test_stage_of_two_batches_* does).
        pytest.param("explicit", "host", True, True, marks=_SLOW),
        pytest.param("explicit", "host", False, False, marks=_SLOW),
        pytest.param("auto", "host", False, True, marks=_SLOW),  # An Auto mesh.
        pytest.param("explicit", _CACHED, False, False, marks=_SLOW),
    ],
)
def test_jitted_train_step_with_global_array_inputs(kind, placement, staged, pipelined):
    """The train step of a host (or host-cached) table fed global jax.Arrays sharded over
    the batch, against the same step of a device table fed NumPy: the same losses and
    tables (to float32 rounding where the step stages the host rows); pipelined or not."""
    mesh = make_mesh(4, kind)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 1)), jnp.float32)}
    steps = {}
    for p in ("device", "host"):
        spec = _train_spec(placement if p == "host" else p)
        emb = jte.Embedding(
            dataclasses.replace(spec, pipeline_execution=pipelined),
            mesh,
            backend="xla",
            stage_host_rows=staged or None,
        )
        assert (emb.stageable == {"big"}) == (p == "host" and staged), emb.stageable
        steps[p] = jte.make_train_step(emb, _loss, optax.sgd(0.05))
    batches = [
        {
            "features": {
                "big": rng.integers(-1, 500, (_B, 5)).astype(np.int32),
                "small": rng.integers(0, 30, (_B, 2)).astype(np.int32),
            },
            "label": rng.normal(size=(_B, 1)).astype(np.float32),
        }
        for _ in range(4)
    ]
    states = {p: s.init(jax.random.key(0), params, batches[0]) for p, s in steps.items()}
    batch_sharding = NamedSharding(mesh, P("shard"))
    for batch in batches:
        global_batch = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(batch_sharding, x), batch
        )
        states["device"], m_dev = steps["device"](states["device"], batch)
        states["host"], m_host = steps["host"](states["host"], global_batch)
        np.testing.assert_allclose(float(m_host["loss"]), float(m_dev["loss"]), rtol=1e-6 * staged)
    if pipelined:
        states = {p: steps[p].flush(s) for p, s in states.items()}
    emb_host, emb_dev = steps["host"].embedding, steps["device"].embedding
    host_state, dev_state = states["host"].embedding, states["device"].embedding
    assert host_state.tables["big"].sharding.memory_kind == _HOST
    assert host_state.tables["small"].sharding.memory_kind == "device"
    chex.assert_trees_all_close(
        emb_host.export(host_state), emb_dev.export(dev_state), rtol=1e-6 * staged, atol=0
    )
    if placement is _CACHED:
        stats = {k: int(v) for k, v in emb_host.cache_stats(host_state)["big"].items()}
        assert stats["hits"] > 0 and stats["inserted"] > 0, stats


@pytest.mark.slow  # The fast tier prefetches through the train step.
@pytest.mark.parametrize("shards, tpu_layout", [(2, False), (4, True)])
def test_prefetch_finds_every_row_and_changes_no_value(shards, tpu_layout):
    """`prefetch` of the next batch before each update, with a cache whose sets hold two
    batches' rows: every update finds all its rows in the cache, and values equal the
    device table's; a cache too small for one batch still gives those values. Without
    HostCached tables prefetch returns the state as it is."""
    rng = np.random.default_rng(7)
    batches = [rng.zipf(1.2, (_B, 6)) % 500 - 1 for _ in range(6)]  # -1: padding.
    grads = [rng.normal(size=(_B, 8)).astype(np.float32) for _ in batches]
    mesh = make_mesh(shards)

    def train(placement):
        table = jte.TableConfig(500, 8, combiner="sum", name="t", placement=placement)
        spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
        emb = jte.Embedding(
            spec, mesh, backend="xla", tpu_layout=tpu_layout, lane_width=128 * tpu_layout
        )
        state = emb.init(jax.random.key(0))
        state = emb.prefetch(state, {"f": batches[0]})
        misses = []
        for i, (batch, g) in enumerate(zip(batches, grads)):
            acts = emb.lookup(state, {"f": batch})
            if i + 1 < len(batches):
                state = emb.prefetch(state, {"f": batches[i + 1]})
            before = emb.cache_stats(state).get("t", {}).get("misses", 0)
            state = emb.apply_gradients(state, {"f": batch}, {"f": g + 0.01 * acts["f"]})
            misses.append(int(emb.cache_stats(state).get("t", {}).get("misses", 0) - before))
        return emb.export(state)["t"], misses, emb.cache_stats(state)

    device, _, none = train("device")
    assert none == {}
    roomy, misses, stats = train(jte.HostCached(cache_rows=400, ways=16))
    assert misses == [0] * len(batches), misses
    assert int(stats["t"]["prefetched"]) > 0 and int(stats["t"]["hits"]) > 0
    tiny, misses, _ = train(jte.HostCached(cache_rows=8 * shards, ways=2, max_misses=2))
    assert sum(misses) > 0
    for got in (roomy, tiny):
        np.testing.assert_allclose(got, device, rtol=1e-6, atol=1e-7)


def _set_of(row: int, sets: int) -> int:
    """The cache's set of a local row (murmur3's 32-bit finalizer), in plain Python."""
    x = row & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return (x ^ (x >> 16)) % sets


def _prefetched(lines: dict, host: np.ndarray, idx, ways: int, now: int) -> dict:
    """A prefetch of the distinct rows `idx` (out of range: none) in NumPy, one row at a
    time: the lines holding one are marked `now`; then each missing row, in index order,
    takes the oldest way of its set (ties: the lower way) if that way was last written
    before the current step (`now - 1`), and is counted as fetched either way."""
    tags, last, rows = (lines[k].copy() for k in ("tags", "last", "rows"))
    counts = lines["counts"].copy()
    sets = tags.size // ways
    valid = [int(r) for r in idx if 0 <= r < host.shape[0]]
    missing = []
    for r in valid:
        ws = _set_of(r, sets) * ways + np.arange(ways)
        held = ws[tags[ws] == r]
        if held.size:
            last[held] = max(int(last[held[0]]), now)
        else:
            missing.append(r)
    for r in missing:
        ws = _set_of(r, sets) * ways + np.arange(ways)
        oldest = ws[np.lexsort((np.arange(ways), last[ws]))[0]]
        counts[0, 4] += 1
        if last[oldest] < now - 1:
            counts[0, 2] += 1
            counts[0, 3] += int(tags[oldest] >= 0)
            tags[oldest], last[oldest], rows[oldest] = r, now, host[r]
    return {"tags": tags, "last": last, "rows": rows, "counts": counts}


@pytest.mark.parametrize(
    "max_misses, window, ways, sets",
    [(None, None, 4, 6), (1, None, 4, 6), pytest.param(3, 16, 6, 24, marks=_SLOW), (5, 7, 6, 24)],
)
def test_prefetch_inserts_each_missing_row_into_the_oldest_way(max_misses, window, ways, sets):
    """`_placement.prefetch` of two arrays (a table and a rank-1 slot, their own rows),
    against a row-at-a-time NumPy model: lines held by rows of the prefetch, lines marked by
    this or the current step, and full sets; in one call or in windows of the indices,
    which equal the model run window by window; with host rounds of 1 to 5 rows; with
    sets that share a row of 128 words (4 ways) and sets that straddle two (6 ways)."""
    from jax_tpu_embed import _placement

    rng = np.random.default_rng(max_misses or 0)
    vocab, now = 300, 9
    shape = _placement.CacheShape(rows=ways * sets, ways=ways, max_misses=max_misses)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=_HOST)
    words = _placement._padded(ways * sets, ways)  # Tags and ages, as `empty_lines` pads them.
    pad = lambda x: np.pad(x, (0, words - x.size), constant_values=-1)
    arrays, models, indices = [], [], []
    for width in (5, None):
        host = rng.normal(size=(vocab,) if width is None else (vocab, width)).astype(np.float32)
        lines = {
            "tags": np.full(ways * sets, -1, np.int32),
            "last": np.full(ways * sets, -1, np.int32),
            "rows": np.zeros((ways * sets,) + host.shape[1:], np.float32),
            "counts": np.zeros((1, 5), np.int32),
        }
        for r in rng.choice(vocab, 2 * ways * sets, replace=False):  # Most ways, some sets.
            ws = _set_of(int(r), sets) * ways + np.arange(ways)
            free = ws[lines["tags"][ws] < 0]
            if free.size:
                lines["tags"][free[0]] = r
                lines["last"][free[0]] = rng.integers(now - 4, now + 1)  # Some unevictable.
                lines["rows"][free[0]] = rng.normal(size=host.shape[1:])
        held = lines["tags"][lines["tags"] >= 0]
        hits = rng.choice(held, held.size // 2, replace=False)  # Rows the prefetch finds.
        assert np.any(lines["last"][np.isin(lines["tags"], hits)] < now)
        fresh = rng.choice(np.setdiff1d(np.arange(vocab), held), 24, replace=False)
        idx = rng.permutation(np.concatenate([hits, fresh, [-1, vocab + 3]]))
        models.append((lines, host, idx))
        stored = {**lines, "tags": pad(lines["tags"]), "last": pad(lines["last"])}
        array = _placement.Cached(
            jax.device_put(host, pinned),
            _placement.Lines(**{k: jnp.asarray(v) for k, v in stored.items()}),
            jnp.array([now], jnp.int32),
            shape,
        )
        arrays.append(array)
        indices.append(jnp.asarray(idx.astype(np.int32)))
    count = jnp.int32(len(indices[0]))
    got = jax.jit(lambda a, i: _placement.prefetch(a, i, count, window))(arrays, indices)
    for out, (lines, host, idx) in zip(got, models):
        step = window or len(idx)
        for start in range(0, len(idx), step):
            lines = _prefetched(lines, host, idx[start : start + step], ways, now)
        for key, want in lines.items():
            got = np.asarray(getattr(out.lines, key))
            np.testing.assert_array_equal(got[: len(want)], want, key)
            assert np.all(got[len(want) :] == -1), key  # The padding is never written.
        assert lines["counts"][0, 3] > 0 and lines["counts"][0, 2] < lines["counts"][0, 4]


def test_train_step_prefetches_the_next_batch():
    """A train step given `next_batch` finds every row of its HostCached table in the
    cache, and trains as the device table does (to float32 rounding). The last batch given
    as its own `next_batch` (the README's loop) runs the same program and fetches nothing."""
    mesh = make_mesh(2)
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(16, 1)), jnp.float32)}
    batches = [
        {
            "features": {
                "big": rng.integers(-1, 500, (_B, 5)).astype(np.int32),
                "small": rng.integers(0, 30, (_B, 2)).astype(np.int32),
            },
            "label": rng.normal(size=(_B, 1)).astype(np.float32),
        }
        for _ in range(5)
    ]
    out = {}
    for p in ("device", jte.HostCached(cache_rows=400, ways=16)):
        emb = jte.Embedding(_train_spec(p), mesh, backend="xla")
        step = jte.make_train_step(emb, _loss, optax.sgd(0.05))
        state = step.init(jax.random.key(0), params)
        losses = []
        for batch, upcoming in zip(batches[:-1], batches[1:]):
            state, metrics = step(state, batch, next_batch=upcoming)
            losses.append(float(metrics["loss"]))
        before = jax.tree.map(int, emb.cache_stats(state.embedding))
        with executables_made() as made:
            state, metrics = step(state, batches[-1], next_batch=batches[-1])
        assert made == []
        losses.append(float(metrics["loss"]))
        after = jax.tree.map(int, emb.cache_stats(state.embedding))
        for name, counts in after.items():  # Nothing more fetched, nothing missed.
            assert [counts[k] - before[name][k] for k in ("prefetched", "misses")] == [0, 0]
        out[p == "device"] = (losses, emb.export(state.embedding), emb, state)
    np.testing.assert_allclose(out[False][0], out[True][0], rtol=1e-6)
    chex.assert_trees_all_close(out[False][1], out[True][1], rtol=1e-6, atol=1e-7)
    emb, state = out[False][2], out[False][3]
    stats = {k: int(v) for k, v in emb.cache_stats(state.embedding)["big"].items()}
    # Only rows of the first step that no prefetch brought (those not in the second
    # batch, prefetched before the first update) were missing.
    rows = [set(b["features"]["big"].ravel().tolist()) - {-1} for b in batches[:2]]
    assert stats["misses"] == len(rows[0] - rows[1]) and stats["prefetched"] > 0, stats


@_SLOW  # The fast tier converts host checkpoints in test_host_checkpoints_convert_shard_by_shard.
@pytest.mark.parametrize("placement", ["host", _CACHED])
def test_checkpoint_and_restore_tables_keep_host_tables_on_host(tmp_path, placement):
    """Save on 4 devices, restore on 2 and continue = continue on 4 (to float32 rounding:
    the mesh changes the order of sums); `restore_tables` of the
    exported tables lands in host memory with the same values. A HostCached table is
    saved from its host arrays and restored with empty caches."""
    rng = np.random.default_rng(1)
    spec = _train_spec(placement)
    emb4 = jte.Embedding(spec, make_mesh(4), backend="xla")
    state = emb4.init(jax.random.key(1))
    batches = [
        {"big": rng.integers(-1, 500, (_B, 5)), "small": rng.integers(0, 30, (_B, 2))}
        for _ in range(3)
    ]

    def step(emb, state, batch):
        acts = emb.lookup(state, batch)
        grads = jax.tree.map(lambda a: jnp.cos(a) + 0.2, acts)
        return emb.apply_gradients(state, batch, grads)

    state = step(emb4, state, batches[0])
    jte.checkpoint.save(tmp_path / "ckpt", emb4, state)
    emb2 = jte.Embedding(spec, make_mesh(2), backend="xla")
    restored, _ = jte.checkpoint.restore(tmp_path / "ckpt", emb2)
    big = jax.tree.leaves((restored.tables["big"], restored.slots["big"]))
    assert {x.sharding.memory_kind for x in big} == {_HOST}
    assert restored.tables["small"].sharding.memory_kind == "device"
    chex.assert_trees_all_equal(emb2.export(restored), emb4.export(state))
    # The format does not depend on the placement: a device table restores the checkpoint
    # of a host table, and a host table the checkpoint of a device table.
    device = jte.Embedding(_train_spec("device"), make_mesh(2), backend="xla")
    on_device, _ = jte.checkpoint.restore(tmp_path / "ckpt", device)
    chex.assert_trees_all_equal(device.export(on_device), emb4.export(state))
    jte.checkpoint.save(tmp_path / "from_device", device, on_device)
    back, _ = jte.checkpoint.restore(tmp_path / "from_device", emb4)
    assert back.tables["big"].sharding.memory_kind == _HOST
    chex.assert_trees_all_equal(emb4.export(back), emb4.export(state))
    if placement is _CACHED:  # Saved from the host arrays; restored with empty caches.
        assert np.all(np.asarray(restored.index["big"].table.tags) == -1)
    for batch in batches[1:]:
        state, restored = step(emb4, state, batch), step(emb2, restored, batch)
    # Another mesh sums an example's ids in another order: equal to float32 rounding.
    chex.assert_trees_all_close(emb2.export(restored), emb4.export(state), rtol=1e-6, atol=1e-7)

    again = emb2.restore_tables(emb4.export(state), slots=emb4.export_slots(state))
    assert _memory_kinds(again) == {_HOST, "device"}
    assert again.tables["big"].sharding.memory_kind == _HOST
    chex.assert_trees_all_equal(emb2.export(again), emb4.export(state))
    if placement is _CACHED:
        assert np.all(np.asarray(again.index["big"].table.tags) == -1)  # Empty caches.
        assert int(emb4.cache_stats(state)["big"]["hits"]) > 0
        # Continuing from the empty caches gives the same tables as the device path would.
        device = jte.Embedding(_train_spec("device"), make_mesh(2), backend="xla")
        dev = device.restore_tables(emb4.export(state), slots=emb4.export_slots(state))
        for batch in batches:
            again, dev = step(emb2, again, batch), step(device, dev, batch)
        chex.assert_trees_all_close(emb2.export(again), device.export(dev), rtol=1e-6, atol=1e-7)


def _dynamic_spec(placement, optimizer: str, dynamic, dtype, items: Any = "device"):
    users = jte.TableConfig(
        dim=test_dynamic.DIM,
        combiner="mean",
        name="users",
        dynamic=dynamic,
        placement=placement,
        dtype=dtype,
        optimizer=OPTIMIZERS[optimizer][0],
    )
    items = jte.TableConfig(vocabulary_size=64, dim=test_dynamic.DIM, name="items", placement=items)
    features = {
        "user": jte.FeatureConfig(users),  # Multi-hot, weighted.
        "hist": jte.FeatureConfig(users, max_sequence_length=3),  # Same table, sequence.
        "item": jte.FeatureConfig(items),
    }
    return jte.EmbeddingSpec(features, jte.Adagrad(learning_rate=0.2))


_LRU = jte.DynamicTable(capacity=64, bucket_size=8)
_LFU_TTL = jte.DynamicTable(
    capacity=16, bucket_size=4, eviction="lfu", ttl_steps=3, min_count=2, filter_capacity=8
)


# A cache of a third of the capacity, in sets of 4, 4 rows fetched per host call.
_DYNAMIC_CACHED = jte.HostCached(cache_rows=24, ways=4, max_misses=4)


def _side_by_side(embs: dict, states: dict, stream, steps: int, other: str) -> dict:
    """`steps` of `stream` through `embs["device"]` and `embs[other]` (which prefetches
    each next batch), their lookups equal to float32 rounding; the states after them."""
    for i, (feats, grads) in enumerate(stream[:steps]):
        acts = {p: e.lookup(states[p], feats) for p, e in embs.items()}
        chex.assert_trees_all_close(acts[other], acts["device"], rtol=1e-6, atol=1e-7)
        states[other] = embs[other].prefetch(states[other], stream[i + 1][0])
        states = {p: e.apply_gradients(states[p], feats, grads) for p, e in embs.items()}
    return states


@pytest.mark.parametrize(
    "shards, routing, tpu_layout, optimizer, dynamic, dtype, placement",
    [
        pytest.param(1, "gather", False, "adagrad", _LRU, jnp.float32, "host", marks=_SLOW),
        # Slow, like every case here: the fast tier trains dynamic host and HostCached
        # tables in test_dynamic.py's train step.
        pytest.param(2, "owner", True, "rowwise_adagrad", _LRU, jnp.float32, "host", marks=_SLOW),
        pytest.param(4, "gather", True, "adam+extras", _LFU_TTL, jnp.float32, "host", marks=_SLOW),
        pytest.param(2, "gather", False, "sgd+extras", _LRU, jnp.bfloat16, "host", marks=_SLOW),
        pytest.param(
            1, "gather", False, "adagrad", _LRU, jnp.float32, _DYNAMIC_CACHED, marks=_SLOW
        ),
        pytest.param(
            2,
            "owner",
            False,
            "rowwise_adagrad",
            _LFU_TTL,
            jnp.float32,
            jte.HostCached(cache_rows=8, ways=2, max_misses=2),
            marks=_SLOW,
        ),
    ],
)
def test_dynamic_tables_in_host_memory(
    tmp_path, shards, routing, tpu_layout, optimizer, dynamic, dtype, placement
):
    """A dynamic table whose rows and slots live in host memory (its index on the device;
    HostCached: and a cache of its rows, which prefetches) against the same table in HBM,
    over a stream that evicts every step (and with "lfu" expires and filters): the same ids
    resident and the same counters; lookups, rows and slots equal to float32 rounding (a
    reused row starts from its initial row inside the update's read, which changes how
    XLA:CPU fuses the row function, as for HostCached); the arrays stay in host memory.
    Exported tables restored on another mesh land in host memory and continue as the
    device table does; a checkpoint restores into host memory on the first mesh."""
    mesh = make_mesh(shards)
    embs = {
        p: jte.Embedding(
            _dynamic_spec(placement if p == "host" else p, optimizer, dynamic, dtype),
            mesh,
            backend="xla",
            routing=routing,
            tpu_layout=tpu_layout,
            lane_width=128 if tpu_layout else 0,
        )
        for p in ("device", "host")
    }
    close = lambda a, b: chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)

    def same(states):
        exports = {p: e.export(states[p])["users"] for p, e in embs.items()}
        slots = {p: e.export_slots(states[p]).get("users", {}) for p, e in embs.items()}
        np.testing.assert_array_equal(exports["host"].ids, exports["device"].ids)
        close(exports["host"].rows.astype(np.float32), exports["device"].rows.astype(np.float32))
        close(
            {k: v.rows for k, v in slots["host"].items()},
            {k: v.rows for k, v in slots["device"].items()},
        )
        stats = {p: jax.tree.map(int, e.dynamic_stats(states[p])) for p, e in embs.items()}
        assert stats["host"] == stats["device"]
        assert _memory_kinds(states["host"]) == {_HOST, "device"}
        assert states["host"].tables["users"].sharding.memory_kind == _HOST
        return stats["host"]["users"]

    states = {p: e.init(jax.random.key(0)) for p, e in embs.items()}
    stream = test_dynamic.batches(2, 10, pool_size=400)
    states = _side_by_side(embs, states, stream, 7, "host")
    stats = same(states)
    assert stats["evicted"] + stats["expired"] > 0, stats
    if not isinstance(placement, str):
        cache = jax.tree.map(int, embs["host"].cache_stats(states["host"]))["users"]
        assert cache["hits"] > 0 and cache["prefetched"] > 0, cache

    # Both restored on another mesh (from the host table's export): the host one in host
    # memory, and both continue the same.
    other = make_mesh(2 if shards != 2 else 4)
    tables, slots = embs["host"].export(states["host"]), embs["host"].export_slots(states["host"])
    embs = {
        p: jte.Embedding(
            _dynamic_spec(placement if p == "host" else p, optimizer, dynamic, dtype),
            other,
            backend="xla",
        )
        for p in embs
    }
    states = {
        p: e.restore_tables(tables, slots, step=7, key=jax.random.key(0)) for p, e in embs.items()
    }
    for feats, grads in stream[7:]:
        states = {p: e.apply_gradients(states[p], feats, grads) for p, e in embs.items()}
    same(states)

    jte.checkpoint.save(tmp_path / "ckpt", embs["host"], states["host"])
    first = jte.Embedding(_dynamic_spec(placement, optimizer, dynamic, dtype), mesh, backend="xla")
    restored, _ = jte.checkpoint.restore(tmp_path / "ckpt", first)
    assert restored.tables["users"].sharding.memory_kind == _HOST
    chex.assert_trees_all_equal(first.export(restored), embs["host"].export(states["host"]))
    assert jax.tree.map(int, first.dynamic_stats(restored)) == jax.tree.map(
        int, embs["host"].dynamic_stats(states["host"])
    )


@pytest.mark.parametrize(
    "placement",  # The fast tier keeps the cached dynamic table's case.
    [pytest.param(p, marks=pytest.mark.slow) for p in ("device", "host")] + [_DYNAMIC_CACHED],
)
def test_dynamic_tables_beside_a_cached_static_table(tmp_path, placement):
    """A dynamic table (in HBM, in host memory, or HostCached) beside a HostCached static
    table, whose caches the state's index holds under its name next to the dynamic
    tables' indexes: lookups, prefetches and updates run (they once handed the whole index
    to the dynamic tables' shard_map, which refused the extra entry) and give what the
    same tables all in HBM give; a checkpoint restores it. On 4 devices: a prefetch
    once normalized the other dynamic table's SplitIds as ids, a (2, B, L) array that 4
    devices cannot split (on 2 it happened to divide)."""
    mesh = make_mesh(4)
    cached = jte.HostCached(cache_rows=32, ways=4, max_misses=8)
    embs = {
        "device": jte.Embedding(_dynamic_spec("device", "adagrad", _LRU, jnp.float32), mesh),
        "cached": jte.Embedding(
            _dynamic_spec(placement, "adagrad", _LRU, jnp.float32, items=cached), mesh
        ),
    }
    close = lambda a, b: chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-7)
    states = {p: e.init(jax.random.key(0)) for p, e in embs.items()}
    assert set(states["cached"].index) == {"users", "items"}
    states = _side_by_side(embs, states, test_dynamic.batches(2, 5, pool_size=400), 4, "cached")
    exports = {p: e.export(states[p]) for p, e in embs.items()}
    np.testing.assert_array_equal(exports["cached"]["users"].ids, exports["device"]["users"].ids)
    close(exports["cached"]["users"].rows, exports["device"]["users"].rows)
    close(exports["cached"]["items"], exports["device"]["items"])
    cache = jax.tree.map(int, embs["cached"].cache_stats(states["cached"]))["items"]
    assert cache["hits"] > 0 and cache["prefetched"] > 0, cache
    jte.checkpoint.save(tmp_path / "ckpt", embs["cached"], states["cached"])
    restored, _ = jte.checkpoint.restore(tmp_path / "ckpt", embs["cached"])
    chex.assert_trees_all_equal(embs["cached"].export(restored), exports["cached"])


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_checkpoints_convert_host_tables_in_numpy(strategy):
    """A host table may be larger than HBM, so a checkpoint never moves it through a
    device: its arrays become logical rows in NumPy on the host (lane-packed rows and "mod"
    order undone there), and logical rows become host arrays the same way."""
    from jax_tpu_embed import checkpoint

    emb = jte.Embedding(
        _spec("host", strategy, ("adagrad", "rowwise_adagrad")),
        make_mesh(4),
        backend="xla",
        tpu_layout=True,
        lane_width=128,
    )
    state = emb.init(jax.random.key(0))
    exported, slots = emb.export(state), emb.export_slots(state)
    for name, plan in emb.table_plans.items():
        storage = plan.storage
        assert storage.packing.packed  # Narrow rows, lane-packed as on TPU.
        table, riders = checkpoint._to_logical(emb, storage, None, state.tables[name])
        assert isinstance(table, np.ndarray)
        np.testing.assert_array_equal(table, exported[name])
        for s in storage.stored:
            logical = checkpoint._to_logical(emb, storage, s, state.slots[name][s.name])
            assert isinstance(logical, np.ndarray)
            np.testing.assert_array_equal(logical, slots[name][s.name])
            back = checkpoint._to_physical(emb, storage, s, logical)
            assert back.sharding.memory_kind == _HOST
            np.testing.assert_array_equal(np.asarray(back), np.asarray(state.slots[name][s.name]))
        back = checkpoint._to_physical(emb, storage, None, storage.join_row(table, riders))
        assert back.sharding.memory_kind == _HOST
        np.testing.assert_array_equal(np.asarray(back), np.asarray(state.tables[name]))


def _random_state(emb, seed: int, step: int = 0):
    """A state whose every row and slot value differs, the slots positive (in every
    optimizer's domain): what a checkpoint test needs, without a training step, whose
    compile would be most of the test's time."""
    rng = np.random.default_rng(seed)
    tables = {
        n: rng.normal(size=(p.layout.vocabulary_size, p.config.dim))
        for n, p in emb.table_plans.items()
    }
    shapes = emb.export_slots(emb.init(jax.random.key(seed)))
    slots = jax.tree.map(lambda x: rng.uniform(0.1, 1.0, np.shape(x)), shapes)
    return emb.restore_tables(tables, slots, step=step)


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_host_checkpoints_convert_in_pieces(strategy):
    """With several processes a host table whose shards are not blocks of its logical rows
    ("mod", or V not a multiple of N) must cross between the processes, through the
    devices, but never whole: its rows pass in pieces (here of 3 stored rows, so that
    pieces end inside shards and blocks). One process runs the same conversion as two
    (tests/test_multihost.py runs two): the saved arrays are its logical rows, in host
    memory, split as the checkpoint splits them, and the restored ones the stored arrays,
    bit for bit (lane-packed rows, riders, bfloat16)."""
    from jax_tpu_embed import checkpoint

    spec = _spec("host", strategy, ("adagrad", "rowwise_adagrad", "adam"))
    emb = jte.Embedding(spec, make_mesh(4), backend="xla", tpu_layout=True, lane_width=128)
    state = _random_state(emb, seed=3)
    exported, slots = emb.export(state), emb.export_slots(state)

    def logical(storage, slot, array, chunk):
        out = checkpoint._pieces_to_logical(emb, storage, slot, array, chunk_bytes=chunk)
        table = out if slot is not None else out[0]
        assert isinstance(table, jax.Array) and table.sharding.memory_kind == _HOST
        twin = checkpoint._auto_twin(emb)
        assert table.sharding == checkpoint._exact_sharding(twin, table.shape, _HOST)
        return out

    def physical(storage, slot, chunk, rows, riders=None):
        def padded(x):  # As restore reads it: the padded rows, row blocks in host memory.
            pad = [(0, storage.layout.padded_rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
            return jax.device_put(
                np.pad(np.asarray(x), pad), checkpoint._row_sharding(emb, True, x.ndim, _HOST)
            )

        riders = {r: padded(x) for r, x in (riders or {}).items()}
        out = checkpoint._pieces_to_physical(
            emb, storage, slot, padded(rows), riders, chunk_bytes=chunk
        )
        assert out.sharding.memory_kind == _HOST
        return out

    for name, plan in emb.table_plans.items():
        storage = plan.storage
        # "pieces" with several processes (but for the div table of V = 40, "shards").
        assert checkpoint._conversion(emb, name) in ("numpy", "shards")
        chunk = 5 * state.tables[name].nbytes // state.tables[name].shape[0]
        table, riders = logical(storage, None, state.tables[name], chunk)
        np.testing.assert_array_equal(np.asarray(table), exported[name])
        for s in storage.stored:
            rows = logical(storage, s, state.slots[name][s.name], chunk)
            np.testing.assert_array_equal(np.asarray(rows), slots[name][s.name])
            back = physical(storage, s, chunk, rows)
            np.testing.assert_array_equal(np.asarray(back), np.asarray(state.slots[name][s.name]))
        for rider, rows in riders.items():
            np.testing.assert_array_equal(np.asarray(rows), slots[name][rider])
        back = physical(storage, None, chunk, table, riders)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(state.tables[name]))


def test_host_checkpoints_convert_shard_by_shard(tmp_path):
    """Host tables whose every shard holds one block of the logical rows ("div", V a
    multiple of N) are saved and restored shard by shard on the hosts that hold them (with
    any number of processes; tests/test_multihost.py runs two): lane-packed rows, riders
    and bfloat16 come back bit for bit, the files are a device table's, and a non-finite
    value in a host shard is refused at restore, naming the table and the row."""
    from jax_tpu_embed import checkpoint

    def spec(placement):
        tables = [
            jte.TableConfig(40, 4, name="a", placement=placement),  # Adagrad: a rider
            jte.TableConfig(
                48, 12, name="b", placement=placement, dtype=jnp.bfloat16,
                optimizer=jte.RowwiseAdagrad(0.1),
            ),
            jte.TableConfig(32, 16, name="c", placement=placement, optimizer=jte.Adam(0.05)),
        ]  # fmt: skip
        features = {t.name: jte.FeatureConfig(t) for t in tables}
        return jte.EmbeddingSpec(features, jte.Adagrad(0.1), partition_strategy="div")

    emb = jte.Embedding(spec("host"), make_mesh(4), backend="xla", tpu_layout=True, lane_width=128)
    assert {checkpoint._conversion(emb, name) for name in emb.table_plans} == {"shards"}
    assert emb.table_plans["a"].storage.riders and emb.table_plans["a"].storage.packing.packed
    state = _random_state(emb, seed=2, step=2)
    checkpoint.save(tmp_path / "ckpt", emb, state)
    back, _ = checkpoint.restore(tmp_path / "ckpt", emb)
    assert _memory_kinds(back) == {_HOST}
    chex.assert_trees_all_equal((back.tables, back.slots), (state.tables, state.slots))
    device = jte.Embedding(spec("device"), make_mesh(2), backend="xla")
    on_device, _ = checkpoint.restore(tmp_path / "ckpt", device)
    chex.assert_trees_all_equal(device.export(on_device), emb.export(state))
    chex.assert_trees_all_equal(device.export_slots(on_device), emb.export_slots(state))

    # A NaN in shard 2's first physical row: logical row 16 of "c" (8 rows a shard).
    bad = np.asarray(state.tables["c"]).copy()
    bad[2 * bad.shape[0] // 4, 0] = np.nan
    tables = {**state.tables, "c": jax.device_put(bad, state.tables["c"].sharding)}
    broken = jte.EmbeddingState(tables, state.slots, state.step + 1, state.index)
    checkpoint.save(tmp_path / "ckpt", emb, broken)
    with pytest.raises(ValueError, match=r"table 'c' has nan at row 16, column 0"):
        checkpoint.restore(tmp_path / "ckpt", emb)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: jte.TableConfig(10, 4, placement="hbm"), r"placement must be one of"),
        (lambda: jte.TableConfig(10, 4, placement=3), r"placement must be one of"),  # type: ignore[arg-type]
        (
            lambda: jte.TableConfig(
                dim=4, name="d", dynamic=jte.DynamicTable(100), placement=jte.HostCached(100)
            ),
            r"TableConfig\(name='d'\): HostCached\(cache_rows=100\) is not smaller than the "
            r"table's 100 rows",
        ),
        (
            lambda: jte.TableConfig(50, 4, name="c", placement=jte.HostCached(50)),
            r"TableConfig\(name='c'\): HostCached\(cache_rows=50\) is not smaller than the "
            r"table's 50 rows",
        ),
        (lambda: jte.HostCached(0), r"cache_rows must be an int > 0, got 0"),
        (lambda: jte.HostCached(10, ways=0), r"ways must be an int in \[1, 256\], got 0"),
        (lambda: jte.HostCached(10, max_misses=-1), r"max_misses must be an int > 0 or None"),
    ],
)
def test_bad_placements(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_host_tables_refuse_what_cannot_serve_them():
    table = jte.TableConfig(50, 4, name="h", placement="host")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
    with pytest.raises(ValueError, match=r"table 'h' cannot use backend 'cpu': placement='host'"):
        jte.Embedding(spec, make_mesh(2), backend="cpu")
    dense = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adam(0.1, lazy_adam=False))
    with pytest.raises(ValueError, match=r"table 'h' has placement='host' but its optimizer"):
        jte.Embedding(dense, make_mesh(2))
    # "auto" gives a host table the XLA backend, the device tables their own.
    device = jte.TableConfig(50, 4, name="d")
    both = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table), "g": jte.FeatureConfig(device)}, jte.Adagrad(0.1)
    )
    assert jte.Embedding(both, make_mesh(2)).backends["h"] == "xla"


def test_cached_tables_refuse_caches_that_cannot_serve_them():
    """A cache that cannot hold one set, or one round of misses, per device; a backend
    that cannot address host memory: errors naming the table and the limit."""

    def build(placement, backend="auto", shards=4):
        table = jte.TableConfig(1000, 4, name="c", placement=placement)
        spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
        return jte.Embedding(spec, make_mesh(shards), backend=backend)

    with pytest.raises(ValueError, match=r"table 'c': HostCached gives each of the 4 devices 8 "):
        build(jte.HostCached(32, ways=16))
    with pytest.raises(ValueError, match=r"raise cache_rows to at least 64 or lower ways"):
        build(jte.HostCached(32, ways=16))
    with pytest.raises(ValueError, match=r"HostCached\(max_misses=64\) fetches more rows per"):
        build(jte.HostCached(128, ways=4, max_misses=64))
    with pytest.raises(ValueError, match=r"table 'c' cannot use backend 'pallas_interpret'"):
        build(jte.HostCached(128, ways=4), backend="pallas_interpret")
    emb = build(jte.HostCached(128, ways=4))
    assert emb.backends["c"] == "xla" and set(emb.cache_stats(emb.init(jax.random.key(0)))) == {"c"}


def _benchmark(name: str, tmp_path, *args: str) -> tuple:
    """Runs benchmarks/<name>.py --quick in this process: (the module, its JSON)."""
    import importlib.util
    import json
    import os

    here = os.path.dirname(__file__)
    benchmarks = os.path.join(here, os.pardir, "benchmarks")
    path = os.path.join(benchmarks, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, benchmarks)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(benchmarks)
    out = tmp_path / f"{name}.json"
    assert module.main(["--quick", "--out", str(out), *args]) == 0
    return module, json.loads(out.read_text())


@_SLOW  # A benchmark's smoke run.
def test_host_offload_benchmark_runs(tmp_path):
    """benchmarks/host_offload.py (the script to run on a TPU VM) works, in its quick form:
    with prefetch, every update finds its rows in the cache (its sets hold two batches'
    rows); without, some miss; both fetch rows from host memory. Pipelined steps run."""
    _, result = _benchmark("host_offload", tmp_path)
    assert result["transfers"][0]["host gather"]["GB/s"] > 0
    steps = result["train_step"]
    pipelined = {"device pipelined", "host pipelined", "host pipe. unstaged"}
    assert (
        set(steps) == {"device", "host", "host unstaged", "cached", "cached+prefetch"} | pipelined
    )
    assert all(r["ms"] > 0 for r in steps.values())
    assert steps["cached+prefetch"]["update_hit_rate"] == 1.0
    assert steps["cached"]["update_hit_rate"] < 1.0
    for r in (steps["cached"], steps["cached+prefetch"]):
        assert 0.0 < r["hit_rate"] < 1.0 and r["host_rows_per_step"] > 0


@pytest.mark.slow
def test_cache_model_is_exact_lru_where_everything_fits(tmp_path):
    """benchmarks/cache_model.py: a cache that holds every row misses each row once; jte's
    own HostCached cache misses exactly the rows the model's W-way policy misses."""
    args = ("--engine", "--ways", "16", "--fractions", "0.05,0.4")
    cache_model, result = _benchmark("cache_model", tmp_path, *args)
    assert all(0 < e["exact LRU"] < 1 for e in result["miss_rates"])
    for e in result["miss_rates"]:
        assert e["jte 16-way"] == e["16-way LRU"], e
    rng = np.random.default_rng(0)
    steps = [np.unique(rng.integers(0, 300, 100)) for _ in range(20)]
    first = len(np.unique(np.concatenate(steps)))
    assert sum(cache_model.exact_lru(steps, 300)) == first
    assert sum(cache_model.set_associative(steps, 4096, 16)) == first
    # One row per step over and over with room for it: one miss.
    same = [np.array([7])] * 5
    assert cache_model.set_associative(same, 16, 16) == [1, 0, 0, 0, 0]


def test_cache_model_reads_criteo_files(tmp_path):
    """benchmarks/cache_model.py --criteo: each large feature's stream is the distinct rows
    (x mod V, V from configs/criteo_1tb_dcnv2.yaml) of each batch of the file's lines, in
    order: the miss rates equal the model's on the stream built here from the TSV text."""
    from criteo_files import write_criteo

    path = tmp_path / "day.tsv"
    lines = write_criteo(path, 24 * 256 + 100, seed=4)
    args = ("--criteo", str(path), "--ways", "4", "--fractions", "0.25,1.0")
    cache_model, result = _benchmark("cache_model", tmp_path, *args)
    tables = jte.load_spec(cache_model.CRITEO_CONFIG).tables()
    features = result["features"]
    assert features and all(f["vocab"] >= 1_000_000 for f in features.values())
    for name, got in features.items():
        j = int(name[1:]) - 1
        vocab = int(tables[f"cat_{j}"].vocabulary_size or 0)
        values = np.array([int(line[14 + j] or "0", 16) % vocab for line in lines])
        steps = [np.unique(values[k * 256 : (k + 1) * 256]) for k in range(24)]
        seen = len(np.unique(np.concatenate(steps)))
        assert got["rows_touched"] == seen and got["batches"] == 24
        want = cache_model.miss_rates(steps, [max(1, seen // 4), seen], [4])
        for g, w in zip(got["miss_rates"], want):
            assert g["cache_rows"] == w["cache_rows"]
            assert g["exact LRU"] == w["exact LRU"] and g["4-way LRU"] == w["4-way LRU"]
        assert 0 < got["miss_rates"][0]["exact LRU"] < 1


def _train_linen_and_nnx(spec, mesh, batches, prefetch: bool):
    """A linen model and an NNX model (an Embed layer of `spec`, a dense head on the "big"
    and "small" activations) trained with SGD on `batches`, each step given the next batch
    when `prefetch`. Returns ([(linen loss, NNX loss)] per step, (linen Embedding, its
    state), (NNX Embedding, its state))."""
    import flax.linen as nn
    from flax import nnx

    class Linen(nn.Module):
        embed: jte.flax.Embed

        @nn.compact
        def __call__(self, batch):
            acts = self.embed(batch["features"])
            x = jnp.concatenate([acts["big"], acts["small"]], axis=-1)
            return nn.Dense(1, name="head")(x)[:, 0]

    class Nnx(nnx.Module):
        def __init__(self, emb, rngs):
            self.embed = jte.nnx.Embed.from_embedding(emb, rngs=rngs)
            self.head = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, features):
            acts = self.embed(features)
            return self.head(jnp.concatenate([acts["big"], acts["small"]], axis=-1))[:, 0]

    emb = jte.Embedding(spec, mesh, backend="xla")
    step = jte.flax.make_train_step(
        Linen(jte.flax.Embed.from_embedding(emb)),
        lambda out, batch: jnp.mean((out - batch["label"]) ** 2),
        optax.sgd(0.1),
    )
    state = step.init(jax.random.key(0), batches[0])
    model = Nnx(jte.Embedding(spec, mesh, backend="xla"), nnx.Rngs(0))
    nnx_step = jte.nnx.make_train_step(
        model,
        lambda m, batch: jnp.mean((m(batch["features"]) - batch["label"]) ** 2),
        optax.sgd(0.1),
    )
    losses = []
    for i, batch in enumerate(batches):
        upcoming = batches[i + 1] if prefetch and i + 1 < len(batches) else None
        state, metrics = step(state, batch, next_batch=upcoming)
        nnx_metrics = nnx_step(batch, next_batch=upcoming)
        losses.append((float(metrics["loss"]), float(nnx_metrics["loss"])))
    nnx_step.flush()
    linen_state = jte.flax.embedding_states(state.embedding)["embed"]
    return losses, (emb, linen_state), (model.embed.embedding, model.embed.embedding_state)


@pytest.mark.slow  # Four models compiled.
def test_flax_linen_and_nnx_layers_with_a_host_table():
    """A linen model and an NNX model whose layer holds a host table (or a HostCached one,
    each step prefetching the next batch) train as the same models with the table on the
    device: equal losses and tables (to float32 rounding when cached), the table on the
    host."""
    rng = np.random.default_rng(4)
    mesh = make_mesh(2)
    batches = [
        {
            "features": {
                "big": rng.integers(-1, 500, (_B, 5)).astype(np.int32),
                "small": rng.integers(0, 30, (_B, 2)).astype(np.int32),
            },
            "label": rng.normal(size=(_B,)).astype(np.float32),
        }
        for _ in range(3)
    ]
    losses, tables = {}, {}
    for p in ("device", "host", _CACHED):
        losses[p], *trained = _train_linen_and_nnx(_train_spec(p), mesh, batches, p is _CACHED)
        for emb, state in trained:
            if p != "device":
                assert state.tables["big"].sharding.memory_kind == _HOST
            if p is _CACHED:  # The steps prefetched the next batches' rows.
                assert int(emb.cache_stats(state)["big"]["prefetched"]) > 0
        tables[p] = tuple(emb.export(state) for emb, state in trained)
    assert losses["host"] == losses["device"]
    chex.assert_trees_all_equal(tables["host"], tables["device"])
    np.testing.assert_allclose(losses[_CACHED], losses["device"], rtol=1e-6)
    chex.assert_trees_all_close(tables[_CACHED], tables["device"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # Six models compiled.
def test_flax_linen_and_nnx_layers_with_a_dynamic_host_table():
    """Linen and NNX models whose layer holds a dynamic table (int64 ids as split halves)
    in host memory, or HostCached with each step prefetching the next batch, train with
    the losses of the same models with the table in HBM."""
    rng = np.random.default_rng(4)
    mesh = make_mesh(2)
    pool = rng.integers(-(2**62), 2**62, size=300, dtype=np.int64)
    batches = [
        {
            "features": {
                "big": jte.split_ids(pool[rng.integers(0, 300, (_B, 5))]),
                "small": rng.integers(0, 30, (_B, 2)).astype(np.int32),
            },
            "label": rng.normal(size=(_B,)).astype(np.float32),
        }
        for _ in range(4)
    ]

    def spec(placement):
        big = jte.TableConfig(
            dim=8,
            combiner="sum",
            name="big",
            placement=placement,
            dynamic=jte.DynamicTable(capacity=128, bucket_size=8),
        )
        small = jte.TableConfig(vocabulary_size=30, dim=8, name="small")
        return jte.EmbeddingSpec(
            {"big": jte.FeatureConfig(big), "small": jte.FeatureConfig(small)},
            jte.Adagrad(0.1),
        )

    cached = jte.HostCached(cache_rows=48, ways=4)
    losses = {}
    for p in ("device", "host", cached):
        losses[p is cached, p == "host"], (emb, linen_state), _ = _train_linen_and_nnx(
            spec(p), mesh, batches, p is cached
        )
        if p != "device":
            assert linen_state.tables["big"].sharding.memory_kind == _HOST
        if p is cached:
            assert int(emb.cache_stats(linen_state)["big"]["prefetched"]) > 0
    device = losses[False, False]
    np.testing.assert_allclose(losses[False, True], device, rtol=1e-6)
    np.testing.assert_allclose(losses[True, False], device, rtol=1e-6)


def test_a_platform_without_host_memory_is_named():
    """`check_placements` names the table and the platform when the devices have no pinned
    host memory (CPU, TPU and GPU devices have it; a device without memory spaces not)."""
    from jax_tpu_embed import _planner

    class NoHostMemory:
        platform = "abacus"

        def addressable_memories(self):
            raise NotImplementedError

    table = jte.TableConfig(50, 4, name="h", placement="host")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
    storages = {n: p.storage for n, p in jte.Embedding(spec, make_mesh(1)).table_plans.items()}
    with pytest.raises(ValueError, match=r"table 'h' has placement='host' but abacus devices"):
        _planner.check_placements(spec.tables(), storages, NoHostMemory())
    _planner.check_placements(spec.tables(), storages, jax.devices()[0])  # CPU: fine.


def test_stage_reads_host_tables_only_when_asked_and_refuses_stale_rows():
    """On CPU meshes `stage` stages nothing unless `stage_host_rows=True`; rows staged from
    one step's state are refused by the next step's lookup and update (they are stale)."""
    mesh = make_mesh(2)
    spec = _train_spec("host")
    plain = jte.Embedding(spec, mesh, backend="xla")
    batch = {"big": np.array([[1, 2], [3, -1]]), "small": np.array([[0], [4]])}
    assert (
        plain.stageable == frozenset() and plain.stage(plain.init(jax.random.key(0)), batch) is None
    )
    emb = jte.Embedding(spec, mesh, backend="xla", stage_host_rows=True)
    assert emb.stageable == {"big"}
    state = emb.init(jax.random.key(0))
    staged = emb.stage(state, batch)
    acts = emb.lookup(state, batch, staged=staged)
    grads = jax.tree.map(jnp.ones_like, acts)
    state = emb.apply_gradients(state, batch, grads, staged=staged)
    for call in (
        lambda: emb.lookup(state, batch, staged=staged),
        lambda: emb.apply_gradients(state, batch, grads, staged=staged),
    ):
        with pytest.raises(
            ValueError, match="staged from a state at step 0, but this state is at step 1"
        ):
            call()
    with pytest.raises(TypeError, match="stage_host_rows must be a bool or None"):
        jte.Embedding(spec, mesh, stage_host_rows="yes")  # pyright: ignore[reportArgumentType]


@pytest.mark.slow
def test_stage_of_two_batches_reads_the_rows_of_both_once():
    """`stage(state, a, b)` (a pipelined step's batch and the pending one) stages on each
    device the rows that staging a and b apart would, in one read of one batch's size;
    the lookup of a and the update of b with it give the unstaged values. Two batches of
    all-distinct ids do not fit: the staged rows are full, and the rest are read where
    needed, values unchanged."""
    emb = jte.Embedding(_train_spec("host"), make_mesh(2), backend="xla", stage_host_rows=True)
    rng = np.random.default_rng(5)

    def batch(ids):
        return {"big": ids, "small": rng.integers(0, 30, (ids.shape[0], 2))}

    def staged_rows(staged):  # Per device: the set of rows staged, and how many it holds.
        at = np.asarray(staged.rows["big"][0][0]).reshape(2, -1)
        return [set(a[a != _placement.NOT_MINE].tolist()) for a in at], at.shape[1]

    pool = rng.choice(500, 40, replace=False)  # Each batch 30 of them, 20 in both.
    repeats = [batch(rng.choice(np.append(p, -1), (2 * _B, 5))) for p in (pool[:30], pool[10:])]
    # Rows of device 0 only (div), all distinct within each batch: 250 between them.
    perm = rng.permutation(250)
    apart_rows = [perm[:160].reshape(2 * _B, 5), perm[90:].reshape(2 * _B, 5)]
    for a, b in [repeats, [batch(x) for x in apart_rows]]:
        state = emb.init(jax.random.key(0))
        staged = emb.stage(state, a, b)
        both, limit = staged_rows(staged)
        apart = [staged_rows(emb.stage(state, x))[0] for x in (a, b)]
        union = [x | y for x, y in zip(*apart)]
        assert any(union) and any(len(u) > limit for u in union) == (a is not repeats[0])
        for got, u in zip(both, union):  # Past one batch's size: `limit` of the union.
            assert got == u if len(u) <= limit else (len(got) == limit and got < u)
        acts = emb.lookup(state, a, staged=staged)
        chex.assert_trees_all_equal(acts, emb.lookup(state, a))
        grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), acts)
        new = emb.apply_gradients(state, b, grads, staged=staged)  # Shaped as a.
        want = emb.apply_gradients(emb.init(jax.random.key(0)), b, grads)
        chex.assert_trees_all_close(emb.export(new), emb.export(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "shards, routing",  # The fast tier keeps the owners' resolution.
    [pytest.param(1, "gather", marks=_SLOW), (2, "owner")],
)
def test_an_expired_id_back_in_its_own_slot_starts_afresh_in_host_memory(shards, routing):
    """An id that expires (`ttl_steps`) and returns takes back its own freed slot, so the
    index holds the same key there before and after the step: a dynamic host table's
    update must still start that row (and its accumulator) from the id's initial values
    (`_dynamic.Fresh`), not from the expired id's trained row; with either resolution.
    Against float64 Adagrad from the initial row, which the lookups read at steps 0 and 2."""
    ttl = jte.DynamicTable(capacity=16, bucket_size=8, ttl_steps=2)
    emb = jte.Embedding(
        _dynamic_spec("host", "adagrad", ttl, jnp.float32),
        make_mesh(shards),
        backend="xla",
        routing=routing,
    )
    state = emb.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = np.full((2, 1), -1, np.int64)
    looked, grads = [], []
    for step in range(3):  # The id at steps 0 and 2, expired by then.
        ids[:, 0] = 77 if step != 1 else -1
        feats = {"user": ids, "hist": np.full((2, 3), -1, np.int64), "item": np.zeros(2, int)}
        acts = emb.lookup(state, feats)
        looked.append(np.asarray(acts["user"], np.float64))
        grads.append(jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), acts))
        state = emb.apply_gradients(state, feats, grads[-1])
    stats = jax.tree.map(int, emb.dynamic_stats(state))["users"]
    assert stats["expired"] == 1 and stats["admitted"] == 2, stats
    # Both examples read the initial row at steps 0 and 2 (step 0's update is forgotten).
    initial = looked[0][0]
    np.testing.assert_array_equal(looked[2], looked[0])
    np.testing.assert_array_equal(looked[0][1], initial)
    g = np.asarray(grads[2]["user"], np.float64).sum(0)  # One id an example, mean of one.
    opt = OPTIMIZERS["adagrad"][0]
    acc = opt.initial_accumulator_value + g * g
    want = initial - opt.learning_rate * g / np.sqrt(acc)
    exported = emb.export(state)["users"]
    np.testing.assert_array_equal(exported.ids, [77])
    np.testing.assert_allclose(exported.rows[0], want, rtol=1e-6, atol=1e-7)
    slots = emb.export_slots(state)["users"]
    np.testing.assert_allclose(np.asarray(slots["accumulators"].rows[0]), acc, rtol=1e-6, atol=1e-7)
