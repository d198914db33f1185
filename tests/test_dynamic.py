"""Dynamic tables: any int64 id, admission, eviction, export and restore, against a float64
dict reference (rows and Adagrad accumulators per id), on 1-8 devices, both exchanges."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import executables_made, make_mesh
from jax_tpu_embed import _dynamic, _dynamic_owner, _hashindex, _layout

DIM = 8
LR = 0.2


def spec_of(dynamic, combiner="mean", optimizer=None, dtype=jnp.float32, **users_kwargs):
    users = jte.TableConfig(
        dim=DIM, combiner=combiner, name="users", dynamic=dynamic, dtype=dtype, **users_kwargs
    )
    items = jte.TableConfig(vocabulary_size=64, dim=DIM, name="items")
    return jte.EmbeddingSpec(
        features={
            "user": jte.FeatureConfig(users),  # Multi-hot, weighted.
            "hist": jte.FeatureConfig(users, max_sequence_length=3),  # Same table, sequence.
            "item": jte.FeatureConfig(items),
        },
        optimizer=optimizer or jte.Adagrad(learning_rate=LR),
    )


def draw_ids(rng, shape, pool):
    """Ids from a power law over `pool` (int64 across the whole range, negatives too), with
    -1 padding."""
    rank = np.minimum(rng.zipf(1.3, size=shape), len(pool)) - 1
    ids = pool[rank]
    ids[rng.random(shape) < 0.2] = -1
    return ids


def batches(seed, steps, batch=8, pool_size=200):
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**63), 2**63 - 1, size=pool_size, dtype=np.int64)
    pool[:3] = [0, 5, -7]  # Small ids, a negative one.
    out = []
    for _ in range(steps):
        user = draw_ids(rng, (batch, 4), pool)
        weights = rng.uniform(0.5, 2.0, size=(batch, 4)).astype(np.float32)
        feats = {
            "user": jte.Weighted(user, weights),
            "hist": draw_ids(rng, (batch, 2), pool),  # Shorter than its length: padded.
            "item": rng.integers(0, 64, size=(batch,)).astype(np.int32),
        }
        grads = {
            "user": rng.normal(size=(batch, DIM)).astype(np.float32),
            "hist": rng.normal(size=(batch, 3, DIM)).astype(np.float32),
            "item": rng.normal(size=(batch, DIM)).astype(np.float32),
        }
        out.append((feats, grads))
    return out


def users(out) -> jte.DynamicRows:
    assert isinstance(out, jte.DynamicRows)
    return out


def initial_row(key_words, ids, draw=None):
    hi, lo = jte.split_ids(np.asarray(ids, np.int64))
    return np.asarray(_dynamic.initial_rows(key_words, hi, lo, DIM, draw), np.float64)


class Reference:
    """The dynamic table as a dict {id: [row, accumulator]} in float64 (Adagrad, TF's);
    `draw`: the table's row initializer (None: the default)."""

    def __init__(self, key_words, combiner, draw=None):
        self.key, self.combiner, self.rows, self.draw = key_words, combiner, {}, draw

    def row(self, i):
        return self.rows[i][0] if i in self.rows else initial_row(self.key, [i], self.draw)[0]

    def scales(self, ids, weights, sequence):
        valid = ids != -1
        w = np.where(valid, 1.0 if weights is None else np.asarray(weights, np.float64), 0.0)
        if sequence or self.combiner == "sum":
            return w
        d = (
            w.sum(1, keepdims=True)
            if self.combiner == "mean"
            else np.sqrt((w * w).sum(1, keepdims=True))
        )
        return np.divide(w, d, out=np.zeros_like(w), where=d != 0)

    def features(self, feats):
        user = feats["user"]
        hist = np.pad(feats["hist"], ((0, 0), (0, 1)), constant_values=-1)
        return [
            (user.ids, self.scales(user.ids, user.weights, False), False),
            (hist, self.scales(hist, None, True), True),
        ]

    def lookup(self, feats):
        out = []
        for ids, scale, sequence in self.features(feats):
            rows = np.zeros(ids.shape + (DIM,))
            for b, l in zip(*np.nonzero(ids != -1)):
                rows[b, l] = scale[b, l] * self.row(int(ids[b, l]))
            out.append(rows if sequence else rows.sum(1))
        return out

    def update(self, feats, grads, admitted=None):
        """Adds up each id's gradient, then steps the ids in `admitted` (default: all)."""
        g = {}
        for (ids, scale, sequence), grad in zip(
            self.features(feats), [grads["user"], grads["hist"]]
        ):
            for b, l in zip(*np.nonzero(ids != -1)):
                i = int(ids[b, l])
                g[i] = g.get(i, 0.0) + scale[b, l] * np.asarray(
                    grad[b, l] if sequence else grad[b], np.float64
                )
        for i, gi in g.items():
            if admitted is not None and i not in admitted:
                continue
            first = (initial_row(self.key, [i], self.draw)[0], np.full(DIM, 0.1))
            row, acc = self.rows.get(i, first)
            acc = acc + gi * gi
            self.rows[i] = (row - LR * gi / np.sqrt(acc), acc)


def key_words(state):
    return np.asarray(jax.device_get(state.index["users"].key))


def steps_against(emb, state, ref: Reference, stream):
    """`state` after the steps of `stream`, each lookup checked against the reference's
    (float32 rounding) before both update."""
    for feats, grads in stream:
        acts = emb.lookup(state, feats)
        want_user, want_hist = ref.lookup(feats)
        np.testing.assert_allclose(np.asarray(acts["user"]), want_user, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(acts["hist"]), want_hist, rtol=1e-5, atol=1e-6)
        state = emb.apply_gradients(state, feats, grads)
        ref.update(feats, grads)
    return state


@pytest.mark.parametrize(
    "n, routing, backend, combiner, kind",
    [
        (1, "gather", "xla", "mean", "explicit"),
        pytest.param(4, "gather", "cpu", "sqrtn", "auto", marks=pytest.mark.slow),
        pytest.param(8, "owner", "xla", "sum", "explicit", marks=pytest.mark.slow),
        # Lane-packed arrays with riders: the reset writes a row's lanes of a packed array.
        pytest.param(2, "gather", "pallas_interpret", "mean", "auto", marks=pytest.mark.slow),
        # Resolved at the owners, where lookups and updates find ids with the Pallas kernel.
        pytest.param(4, "owner", "pallas_interpret", "sum", "explicit", marks=pytest.mark.slow),
    ],
)
def test_matches_the_dict_reference(n, routing, backend, combiner, kind):
    """No eviction: exactly the ids seen in updates are resident, rows and accumulators to
    float32 rounding, lookups of unseen ids read their initial rows."""
    spec = spec_of(jte.DynamicTable(capacity=4096, bucket_size=64), combiner)
    emb = jte.Embedding(spec, make_mesh(n, kind), routing=routing, backend=backend)
    if backend == "pallas_interpret":  # Lookups and updates find ids with the kernel.
        assert emb.dynamic["users"].finder == backend
    state = emb.init(jax.random.key(3))
    ref = Reference(key_words(state), combiner)
    stream = batches(1, 5)
    state = steps_against(emb, state, ref, stream)
    seen = {
        int(i)
        for feats, _ in stream
        for i in np.concatenate([feats["user"].ids.ravel(), feats["hist"].ravel()])
        if i != -1
    }
    out = users(emb.export(state)["users"])
    assert isinstance(out, jte.DynamicRows)
    assert out.ids.dtype == np.int64 and list(out.ids) == sorted(seen)
    np.testing.assert_allclose(
        out.rows, np.stack([ref.rows[int(i)][0] for i in out.ids]), rtol=1e-5, atol=1e-6
    )
    acc = emb.export_slots(state)["users"]["accumulators"]
    np.testing.assert_array_equal(acc.ids, out.ids)
    np.testing.assert_allclose(
        acc.rows, np.stack([ref.rows[int(i)][1] for i in out.ids]), rtol=1e-5
    )
    stats = jax.tree.map(int, emb.dynamic_stats(state))["users"]
    assert stats["occupancy"] == len(seen) == stats["admitted"]
    assert stats["evicted"] == stats["failed"] == stats["rejected"] == 0


@pytest.mark.parametrize(
    "routing, backend, placement",
    [
        pytest.param("owner", "xla", "device", marks=pytest.mark.slow),  # The resets at the owners.
        pytest.param("gather", "cpu", "device", marks=pytest.mark.slow),  # The C++ index's.
        pytest.param("owner", "xla", "host", marks=pytest.mark.slow),  # `Fresh`.
        pytest.param("gather", "xla", "device", marks=pytest.mark.slow),  # The XLA index's.
    ],
)
def test_a_row_initializer_draws_new_ids_initial_rows(routing, backend, placement):
    """A dynamic table takes a `jte.initializers` row initializer: every path that draws an
    id's initial row draws it from (table, id) with that one (lookups of unknown ids, the
    resets of admitted ids' rows by the XLA index, at the owners and by the C++ index, a
    host table's update, serving), so the table equals the dict reference drawn so; and the
    values are the initializer's (uniform on [2, 3), far from the default's)."""
    draw = jte.initializers.uniform(2.0, 3.0)
    spec = spec_of(jte.DynamicTable(capacity=4096), "sum", initializer=draw, placement=placement)
    with pytest.raises(ValueError, match="takes the row initializers of jte.initializers"):
        spec_of(jte.DynamicTable(capacity=64), initializer=jax.nn.initializers.zeros)
    emb = jte.Embedding(spec, make_mesh(2), routing=routing, backend=backend)
    assert emb.dynamic["users"].draw == draw
    state = emb.init(jax.random.key(4))
    ref = Reference(key_words(state), "sum", draw)
    state = steps_against(emb, state, ref, batches(2, 3))
    out = users(emb.export(state)["users"])
    np.testing.assert_allclose(
        out.rows, np.stack([ref.rows[int(i)][0] for i in out.ids]), rtol=1e-5, atol=1e-6
    )
    unseen = np.array([[12345, -1], [-99, 7]], np.int64)  # Never in the stream.
    assert not np.isin(unseen, out.ids).any()
    rows = initial_row(key_words(state), unseen.ravel(), draw)
    assert (rows[[0, 2, 3]] >= 2.0).all() and (rows[[0, 2, 3]] < 3.0).all()
    server = jte.serving.Server.from_embedding(emb, state, unknown="init")
    got = server({"user": unseen, "hist": unseen, "item": np.zeros(2, np.int32)})
    want = rows.reshape(2, 2, DIM)
    want[0, 1] = 0.0
    np.testing.assert_allclose(np.asarray(got["user"]), want.sum(1), rtol=1e-6)


@pytest.mark.parametrize(
    "routing, backend",
    [("gather", "cpu"), pytest.param("gather", "xla", marks=pytest.mark.slow), ("owner", "xla")],
)
def test_a_skipped_step_leaves_the_table_and_its_index_alone(routing, backend):
    """A step whose gradients for the dynamic table are not finite skips it: its index (no
    admission, no eviction, no score), rows and slots stay bit for bit, on each resolution
    (the lookup's distinct ids are the update's, and a skipped table's are not sent)."""
    spec = spec_of(jte.DynamicTable(capacity=256, bucket_size=16), "mean")
    emb = jte.Embedding(spec, make_mesh(2), routing=routing, backend=backend)
    state = emb.init(jax.random.key(5))
    stream = batches(4, 3, pool_size=400)
    for feats, grads in stream[:2]:
        state = emb.apply_gradients(state, feats, grads)
    feats, grads = stream[2]  # New ids among them: they would be admitted.
    grads = {**grads, "user": np.where(np.arange(DIM) == 3, np.nan, grads["user"])}
    users_of = lambda s: jax.device_get(  # Its own rows: "owner" stacks it with "items".
        (*(x["users"] for x in emb.table_arrays(s)), s.index["users"])
    )
    before = users_of(state)
    state, skipped = emb.apply_gradients(state, feats, grads, return_skipped=True)
    assert int(skipped["users"]) == 1 and int(skipped["items"]) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(users_of(state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _Unweighted(Reference):
    """The reference of one unweighted multi-hot feature, "user"."""

    def features(self, feats):
        return [(feats["user"], self.scales(feats["user"], None, False), False)]


def _unweighted_run(n, combiner, backend, tpu_layout, dynamic, stream, placement="device"):
    users = jte.TableConfig(
        dim=DIM, combiner=combiner, name="users", dynamic=dynamic, placement=placement
    )
    spec = jte.EmbeddingSpec({"user": jte.FeatureConfig(users)}, jte.Adagrad(learning_rate=LR))
    emb = jte.Embedding(spec, make_mesh(n), backend=backend, tpu_layout=tpu_layout)
    state = emb.init(jax.random.key(7))
    lookups = []
    for ids, grad in stream:
        lookups.append(np.asarray(emb.lookup(state, {"user": ids})["user"]))
        state = emb.apply_gradients(state, {"user": ids}, {"user": grad})
    return emb, state, lookups


def _unweighted_stream():
    rng = np.random.default_rng(11)
    pool = rng.integers(-(2**63), 2**63 - 1, size=300, dtype=np.int64)
    return [
        (draw_ids(rng, (8, 4), pool), rng.normal(size=(8, DIM)).astype(np.float32))
        for _ in range(5)
    ]


@pytest.mark.parametrize("combiner", ["mean", pytest.param("sqrtn", marks=pytest.mark.slow)])
def test_unweighted_factors_computed_from_the_gathered_ids(combiner):
    """An unweighted feature under mean or sqrtn: every device computes its factors from the
    step's gathered ids (`_plan.Input.weights_all`) instead of gathering them. Against the
    float64 reference on 2 devices (C++ kernels, rows laid out row by row)."""
    stream = _unweighted_stream()
    emb, state, lookups = _unweighted_run(
        2, combiner, "cpu", False, jte.DynamicTable(capacity=4096, bucket_size=64), stream
    )
    ref = _Unweighted(key_words(state), combiner)
    for (ids, grad), got in zip(stream, lookups):
        want = ref.lookup({"user": ids})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        ref.update({"user": ids}, {"user": grad, "hist": None})  # One feature: no "hist".
    out = users(emb.export(state)["users"])
    np.testing.assert_allclose(
        out.rows, np.stack([ref.rows[int(i)][0] for i in out.ids]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_unweighted_factors_of_a_filtered_host_table_on_tpu_layouts(combiner):
    """As above, with an admission filter in host memory on TPU layouts (the updates resolve
    at the owners, which leave the host rows to the update's read: `_dynamic.Fresh`),
    against one device's plain run."""
    stream = _unweighted_stream()
    filtered = jte.DynamicTable(capacity=64, bucket_size=8, min_count=2, filter_capacity=32)
    base = _unweighted_run(1, combiner, "xla", False, filtered, stream)
    run = _unweighted_run(4, combiner, "xla", True, filtered, stream, placement="host")
    assert run[0].dynamic["users"].route == "owner"
    assert jax.tree.map(int, run[0].dynamic_stats(run[1])) == jax.tree.map(
        int, base[0].dynamic_stats(base[1])
    )
    a, b = users(run[0].export(run[1])["users"]), users(base[0].export(base[1])["users"])
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_allclose(a.rows, b.rows, rtol=1e-6, atol=1e-7)
    for x, y in zip(run[2], base[2]):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def run_stream(
    n,
    routing,
    dynamic,
    steps,
    seed=2,
    strategy="div",
    dtype=jnp.float32,
    batch=8,
    backend="xla",
    **options,
):
    spec = spec_of(dynamic, dtype=dtype)
    if strategy != "div":
        spec = jte.EmbeddingSpec(
            features=spec.features, optimizer=spec.optimizer, partition_strategy=strategy
        )
    emb = jte.Embedding(spec, make_mesh(n), routing=routing, backend=backend, **options)
    state = emb.init(jax.random.key(0))
    exports, lookups = [], []
    for feats, grads in batches(seed, steps, batch=batch, pool_size=400):
        lookups.append(np.asarray(emb.lookup(state, feats)["user"]))
        state = emb.apply_gradients(state, feats, grads)
        exports.append(users(emb.export(state)["users"]))
    return emb, state, exports, lookups


def assert_same_stream(base, run, rtol: float):
    """Two `run_stream`s of a stream that evicts or expires: the same counters and resident
    ids after every step, rows and lookups to `rtol` (atol a tenth of it)."""
    base_emb, base_state, base_exports, base_lookups = base
    emb, state, exports, lookups = run
    stats = jax.tree.map(int, base_emb.dynamic_stats(base_state))
    assert stats["users"]["evicted"] + stats["users"]["expired"] > 0
    assert jax.tree.map(int, emb.dynamic_stats(state)) == stats
    for a, b in zip(exports, base_exports):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.rows, b.rows, rtol=rtol, atol=rtol / 10)
    for a, b in zip(lookups, base_lookups):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol / 10)


@pytest.mark.slow
@pytest.mark.parametrize("eviction, ttl", [("lru", 2), ("lfu", None)])
def test_the_pallas_index_kernels_are_the_same(eviction, ttl):
    """Buckets of 64, where the Pallas kernels serve (Pallas' interpreter, the owner route
    on 2 devices: `find` of live and expired slots, the score writes, `place` evicting by
    lru or lfu): the counters and resident ids of XLA's index on one device after every
    step, rows and lookups to float32 rounding."""
    dynamic = jte.DynamicTable(capacity=256, bucket_size=64, eviction=eviction, ttl_steps=ttl)
    batch = 8 if ttl else 160  # Enough ids to fill the table, then evict.
    base = run_stream(1, "gather", dynamic, 6, batch=batch)
    run = run_stream(2, "owner", dynamic, 6, batch=batch, backend="pallas_interpret")
    plan = run[0].dynamic["users"]
    assert plan.finder == "pallas_interpret" and _dynamic.scorer(plan, 0) is not None
    stats = jax.tree.map(int, base[0].dynamic_stats(base[1]))["users"]
    assert stats["expired" if ttl else "evicted"] > 0, stats
    assert_same_stream(base, run, 2e-5)


@pytest.mark.slow
def test_the_same_on_every_mesh_and_exchange_with_eviction():
    """A table too small for the stream (LRU evicts every step): the same ids resident and
    the same counters on 1, 2 and 8 devices, both exchanges, div and mod; exported rows
    bit-identical on every mesh with the all-gather exchange, to float32 rounding with the
    owner exchange, and lookups to float32 rounding (their sums of several owners' rows run
    in another order on each mesh, as for static tables)."""
    dynamic = jte.DynamicTable(capacity=64, bucket_size=8)
    runs = [
        run_stream(1, "gather", dynamic, 12),
        run_stream(2, "owner", dynamic, 12, strategy="mod"),
        run_stream(8, "gather", dynamic, 12),
    ]
    base_emb, base_state, base_exports, base_lookups = runs[0]
    base_stats = jax.tree.map(int, base_emb.dynamic_stats(base_state))
    assert base_stats["users"]["evicted"] > 0
    for (emb, state, exports, lookups), exact in zip(runs[1:], [False, True]):
        rtol, atol = (0.0, 0.0) if exact else (1e-6, 1e-7)
        assert jax.tree.map(int, emb.dynamic_stats(state)) == base_stats
        for a, b in zip(exports, base_exports):
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_allclose(a.rows, b.rows, rtol=rtol, atol=atol)
        for a, b in zip(lookups, base_lookups):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "dynamic",
    [
        pytest.param(jte.DynamicTable(capacity=64, bucket_size=8), marks=pytest.mark.slow),
        pytest.param(
            jte.DynamicTable(
                capacity=16,  # 4 buckets: the same capacity on 1 and 4 devices
                bucket_size=4,
                eviction="lfu",
                ttl_steps=3,
                min_count=2,
                admit_probability=0.9,
                filter_capacity=8,
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["lru", "filter-ttl-lfu"],
)
def test_resolution_in_passes_is_the_same(dynamic):
    """On TPU layouts ids resolve at their owners (`_dynamic_owner`), `max_ids_per_shard`
    at a time, and an admission filter's rules in rounds of their own (filter buckets of
    two buckets here, so its first sightings go in another order): with windows far
    smaller than a step's ids (many rounds, buckets split between them) the resident ids
    and counters equal one device's single pass, rows and lookups to float32 rounding (the
    TPU layout's row passes sum gradients in another order). Slow: the fast tier keeps
    test_owner_rounds_send_every_id_when_a_device_holds_cd_of_them and the admission
    rules (test_admission_rules_and_ttl)."""
    base_emb, base_state, base_exports, base_lookups = run_stream(1, "gather", dynamic, 8)
    emb, state, exports, lookups = run_stream(
        4, "gather", dynamic, 8, tpu_layout=True, max_ids_per_shard=8
    )
    plan = emb.dynamic["users"]
    assert plan.compact and plan.window == 8 and plan.route == "owner"
    assert_same_stream(
        (base_emb, base_state, base_exports, base_lookups), (emb, state, exports, lookups), 1e-6
    )


@pytest.mark.parametrize(
    "n, batch, dynamic",
    [
        (2, 32, jte.DynamicTable(capacity=128, bucket_size=8)),
        (
            4,
            64,
            jte.DynamicTable(
                capacity=64, bucket_size=4, eviction="lfu", ttl_steps=2, admit_probability=0.8
            ),
        ),
        # The filter's rules in rounds of their own, one id a round per owner.
        (4, 64, jte.DynamicTable(capacity=64, bucket_size=4, min_count=2, ttl_steps=3)),
    ],
    ids=["lru", "ttl-lfu-probability", "filter"],
)
@pytest.mark.slow  # The fast tier keeps test_owner_rounds_send_every_id_when_a_device_holds_*.
def test_owner_resolution_in_rounds_is_the_same(n, batch, dynamic):
    """With routing="owner" each device sends its own distinct ids to their buckets' owners,
    at most Cd per owner and round (`_dynamic_owner`). With Cd far below a device's ids for
    one owner (many rounds, buckets split between rounds, one id sent by several devices),
    the resident ids and every counter equal one device's all-gather resolution exactly;
    rows and lookups to float32 rounding (the owner exchange sums gradients in another
    order, and these batches are larger than the other tests')."""
    steps = 4
    base_emb, base_state, base_exports, base_lookups = run_stream(
        1, "gather", dynamic, steps, batch=batch
    )
    emb, state, exports, lookups = run_stream(
        n, "owner", dynamic, steps, batch=batch, max_ids_per_shard=4 * n
    )
    plan = emb.dynamic["users"]
    assert plan.route == "owner"
    # Rounds happen: a device holds more distinct ids for one owner than Cd.
    feats = batches(2, 1, batch=batch, pool_size=400)[0][0]
    per_device = np.concatenate([feats["user"].ids, feats["hist"]], 1).reshape(n, -1)
    cd = _dynamic_owner.capacity(plan, per_device.shape[1], n)
    most = 0
    for ids in per_device:
        ids = np.unique(ids[ids != -1])
        owner, _ = _hashindex.locate(plan.index, n, *jte.split_ids(ids))
        most = max(most, np.bincount(np.asarray(owner), minlength=n).max())
    assert cd == 8 and most > 2 * cd, (cd, most)
    assert_same_stream(
        (base_emb, base_state, base_exports, base_lookups), (emb, state, exports, lookups), 2e-5
    )


def _owned_by_zero(config, n: int, count: int) -> np.ndarray:
    """`count` int64 ids whose buckets shard 0 owns (of n), in the order its rounds take
    them: (local bucket, priority, hi, lo)."""
    ids = np.random.default_rng(5).integers(1, 2**62, size=40 * count, dtype=np.int64)
    hi, lo = jte.split_ids(ids)
    owner, bucket = (np.asarray(x) for x in _hashindex.locate(config, n, hi, lo))
    priority = np.asarray(_hashindex.priority(config, jnp.asarray(hi), jnp.asarray(lo)))
    mine = np.nonzero(owner == 0)[0]
    order = mine[np.lexsort((lo[mine], hi[mine], priority[mine], bucket[mine]))]
    assert order.size >= count
    return ids[order[:count]]


@pytest.mark.parametrize(
    "case",  # The fast tier keeps the round a device fills.
    [pytest.param("one id a device", marks=pytest.mark.slow), "a device fills a round"],
)
def test_owner_rounds_send_every_id_when_a_device_holds_cd_of_them(case):
    """The owner resolution's rounds agree on a threshold per owner: the smallest Cd-th
    pending key of any device. When a device's ids for one owner fill a round (Cd equal to
    its m positions), that threshold is its last id, and a device with larger keys must wait
    for a second round. One round used to be all that ran whenever Cd >= m: such ids were
    neither admitted nor counted nor updated. Against the all-gather resolution: the same
    resident ids, rows and counters, and every id counted."""
    n = 4 if case == "one id a device" else 2

    def make(routing):
        table = jte.TableConfig(
            dim=4, name="t", dynamic=jte.DynamicTable(capacity=256, bucket_size=8)
        )
        spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.SGD(0.1))
        return jte.Embedding(spec, make_mesh(n), backend="xla", routing=routing)

    config = make("owner").dynamic["t"].index
    if case == "one id a device":  # Every device's one new id goes to shard 0.
        steps = [_owned_by_zero(config, n, n).reshape(n, 1)]
    else:  # Device 0's 8 ids fill owner 0's round; device 1's, already resident, come after.
        ids = _owned_by_zero(config, n, 16)
        steps = [np.concatenate([np.full(8, -1), ids[8:]]).reshape(8, 2), ids.reshape(8, 2)]
    out = {}
    for routing in ("gather", "owner"):
        emb = make(routing)
        state = emb.init(jax.random.key(0))
        for step in steps:
            grads = np.ones(step.shape[:1] + (4,), np.float32)
            state = emb.apply_gradients(state, {"f": step}, {"f": grads})
        stats = {k: int(v) for k, v in emb.dynamic_stats(state)["t"].items()}
        assert stats["misses"] == stats["admitted"] + stats["rejected"] + stats["failed"]
        out[routing] = emb.export(state)["t"], stats
    (want, want_stats), (got, got_stats) = out["gather"], out["owner"]
    assert got_stats == want_stats
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.rows, want.rows, rtol=1e-6)
    seen = sum(len(np.unique(s[s != -1])) for s in steps)
    assert want_stats["hits"] + want_stats["misses"] == seen


def routed_features(pages_dim: int, batch: int, pool) -> tuple[dict, dict]:
    """({path: FeatureConfig}, {path: draw(rng) of its ids from `pool`}) of two dynamic
    tables small enough to evict every step: "users" (lru; features "user" and the sequence
    "hist") and "pages" (lfu, with TTL, so its ids also expire; feature "page")."""
    users = jte.TableConfig(
        dim=DIM, name="users", dynamic=jte.DynamicTable(capacity=64, bucket_size=8)
    )
    pages = jte.TableConfig(
        dim=pages_dim,
        combiner="sum",
        name="pages",
        dynamic=jte.DynamicTable(capacity=32, bucket_size=4, eviction="lfu", ttl_steps=2),
    )
    features = {
        "user": jte.FeatureConfig(users),
        "hist": jte.FeatureConfig(users, max_sequence_length=3),
        "page": jte.FeatureConfig(pages),
    }
    draws = {
        "user": lambda rng: draw_ids(rng, (batch, 4), pool),
        "hist": lambda rng: draw_ids(rng, (batch, 2), pool),
        "page": lambda rng: draw_ids(rng, (batch, 8), pool[::-1]),
    }
    return features, draws


def feature_stream(rng, steps: int, draws: dict, grad_shapes: dict) -> list:
    """[(features, activation gradients)] of `steps` steps: each feature's ids drawn by
    draws[path](rng), its gradients normal of grad_shapes[path]."""
    out = []
    for _ in range(steps):
        feats = {p: draw(rng) for p, draw in draws.items()}
        grads = {p: rng.normal(size=grad_shapes[p]).astype(np.float32) for p in feats}
        out.append((feats, grads))
    return out


@pytest.mark.slow  # Four Embeddings of several steps each.
def test_tables_resolved_in_shared_rounds_are_each_as_alone():
    """A step's routed dynamic tables share one loop of rounds (`_dynamic_owner._rounds`):
    with Cd far below the ids (rounds) and two tables of different sizes (so one runs more
    rounds than the other, and its loop has empty rounds), and one table in host memory (its
    rows given to new ids reset by the update, not by the rounds), every table's lookups,
    exported rows, slots and counters are bit-identical to its own Embedding's."""
    n, batch, steps = 4, 32, 4
    rng = np.random.default_rng(5)
    pool = rng.integers(-(2**63), 2**63 - 1, size=300, dtype=np.int64)
    features, draws = routed_features(2 * DIM, batch, pool)
    hosted = jte.TableConfig(
        dim=DIM, name="hosted", dynamic=jte.DynamicTable(capacity=64), placement="host"
    )
    features["host"] = jte.FeatureConfig(hosted)
    draws["host"] = lambda rng: draw_ids(rng, (batch, 2), pool[100:])
    tables_of = {"users": ("user", "hist"), "pages": ("page",), "hosted": ("host",)}
    shapes = {"user": (batch, DIM), "hist": (batch, 3, DIM), "page": (batch, 2 * DIM)}
    stream = feature_stream(rng, steps, draws, {**shapes, "host": (batch, DIM)})

    def run(paths, keys=None):
        spec = jte.EmbeddingSpec({p: features[p] for p in paths}, jte.Adagrad(learning_rate=LR))
        emb = jte.Embedding(spec, make_mesh(n), routing="owner", max_ids_per_shard=4 * n)
        state = emb.init(jax.random.key(0))
        if keys:  # The initial rows of the full run's tables (init keys a table by position).
            index = {t: dataclasses.replace(x, key=keys[t]) for t, x in state.index.items()}
            state = dataclasses.replace(state, index=index)
        seen = []
        for feats, grads in stream:
            acts = emb.lookup(state, {p: feats[p] for p in paths})
            state = emb.apply_gradients(
                state, {p: feats[p] for p in paths}, {p: grads[p] for p in paths}
            )
            seen.append(jax.tree.map(np.asarray, acts))
        return emb, state, seen

    emb, state, acts = run(list(features))
    routed = [name for name, plan in emb.dynamic.items() if plan.route == "owner"]
    assert sorted(routed) == ["hosted", "pages", "users"]
    stats = jax.tree.map(int, emb.dynamic_stats(state))
    assert stats["pages"]["evicted"] + stats["pages"]["expired"] > 0, stats
    export, slots = emb.export(state), emb.export_slots(state)
    for name, paths in tables_of.items():
        alone, alone_state, alone_acts = run(list(paths), keys={name: state.index[name].key})
        assert jax.tree.map(int, alone.dynamic_stats(alone_state))[name] == stats[name]
        want = alone.export(alone_state)[name]
        np.testing.assert_array_equal(export[name].ids, want.ids)
        np.testing.assert_array_equal(export[name].rows, want.rows)
        want_acc = alone.export_slots(alone_state)[name]["accumulators"]
        np.testing.assert_array_equal(slots[name]["accumulators"].rows, want_acc.rows)
        for step, got in zip(alone_acts, acts):
            for p in paths:
                np.testing.assert_array_equal(got[p], step[p])


@pytest.mark.slow  # Three streams of four steps: about 30 s (xla).
@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_stacked_dynamic_tables_are_as_alone(tmp_path, backend):
    """Dynamic tables stack like static ones (owner routing, one dim and optimizer): one
    array for three dynamic tables (resolved at the owners, one with TTL and lfu, one with
    an admission filter) and a static table.
    Each table's resets land in its own block of the stack: lookups, exported rows, slots
    and counters are bit-identical to `stacking=False`, with evictions and expiry; either
    state's checkpoint restores into the other layout and steps on as the unstacked state;
    with XLA's row work and the Pallas kernels' (in their interpreter)."""
    n, batch, steps = 4, 16, 4
    rng = np.random.default_rng(6)
    pool = rng.integers(-(2**63), 2**63 - 1, size=300, dtype=np.int64)
    features, draws = routed_features(DIM, batch, pool)
    seen = jte.TableConfig(
        dim=DIM, name="seen", dynamic=jte.DynamicTable(capacity=32, bucket_size=4, min_count=2)
    )
    features["seen"] = jte.FeatureConfig(seen)
    features["word"] = jte.FeatureConfig(jte.TableConfig(vocabulary_size=50, dim=DIM, name="words"))
    draws["seen"] = lambda rng: draw_ids(rng, (batch, 3), pool[50:])
    draws["word"] = lambda rng: rng.integers(-1, 50, size=(batch, 3))
    shapes = {p: (batch, 3, DIM) if p == "hist" else (batch, DIM) for p in draws}
    stream = feature_stream(rng, steps, draws, shapes)

    def run(stacking, stream):
        spec = jte.EmbeddingSpec(features, jte.Adagrad(learning_rate=LR))
        emb = jte.Embedding(
            spec,
            make_mesh(n),
            routing="owner",
            max_ids_per_shard=4 * n,
            stacking=stacking,
            backend=backend,
        )
        state, acts = emb.init(jax.random.key(0)), []
        for feats, grads in stream:
            acts.append(jax.tree.map(np.asarray, emb.lookup(state, feats)))
            state = emb.apply_gradients(state, feats, grads)
        return emb, state, acts

    (emb, state, acts), (alone, alone_state, alone_acts) = (
        run(stacking, stream[:-1]) for stacking in (True, False)
    )
    assert list(emb.stacks.values()) == [("users", "pages", "seen", "words")]
    assert [emb.dynamic[t].route for t in ("users", "pages", "seen")] == ["owner"] * 3
    stats = jax.tree.map(int, emb.dynamic_stats(state))
    assert stats == jax.tree.map(int, alone.dynamic_stats(alone_state))
    assert stats["pages"]["evicted"] > 0 and stats["pages"]["expired"] > 0, stats
    assert stats["users"]["evicted"] > 0 and stats["seen"]["admitted"] > 0, stats
    for got, want in [
        (emb.export(state), alone.export(alone_state)),
        (emb.export_slots(state), alone.export_slots(alone_state)),
        *zip(acts, alone_acts),
    ]:
        jax.tree.map(np.testing.assert_array_equal, got, want)
    jte.checkpoint.save(tmp_path / "stacked", emb, state)
    jte.checkpoint.save(tmp_path / "alone", alone, alone_state)
    crossed = [  # Each checkpoint restored into the other layout.
        (alone, jte.checkpoint.restore(tmp_path / "stacked", alone)[0]),
        (emb, jte.checkpoint.restore(tmp_path / "alone", emb)[0]),
    ]
    feats, grads = stream[-1]
    want = alone.export(alone.apply_gradients(alone_state, feats, grads))
    for e, s in [*crossed, (emb, state)]:
        got = e.export(e.apply_gradients(s, feats, grads))
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_id_counts_of_dynamic_tables():
    """`id_counts` counts a dynamic table's ids at the shards that own their buckets (a
    NumPy reference), its distinct ids as the distinct rows they hold or would hold, capped
    at a shard's rows, and its stack's exchange rounds from them."""
    n, batch = 4, 16
    small = jte.TableConfig(
        dim=DIM, name="small", dynamic=jte.DynamicTable(capacity=32, bucket_size=8)
    )
    big = jte.TableConfig(dim=DIM, name="big", dynamic=jte.DynamicTable(capacity=4096))
    words = jte.TableConfig(vocabulary_size=50, dim=DIM, name="words")
    features = {
        "a": jte.FeatureConfig(small),
        "b": jte.FeatureConfig(big),
        "c": jte.FeatureConfig(big, max_sequence_length=3),
        "w": jte.FeatureConfig(words),
    }
    rng = np.random.default_rng(8)
    pool = rng.integers(-(2**63), 2**63 - 1, size=500, dtype=np.int64)
    feats = {
        "a": np.where(rng.random((batch, 4)) < 0.2, -1, rng.choice(pool, (batch, 4))),
        "b": draw_ids(rng, (batch, 6), pool),
        "c": draw_ids(rng, (batch, 3), pool[::-1]),
        "w": rng.integers(-1, 50, size=(batch, 2)),
    }
    spec = jte.EmbeddingSpec(features, jte.Adagrad(learning_rate=LR))
    for max_ids, rounds in ((None, 1), (n, 2)):
        emb = jte.Embedding(spec, make_mesh(n), routing="owner", max_ids_per_shard=max_ids)
        assert list(emb.stacks.values()) == [("small", "big", "words")]
        counts = emb.id_counts(feats)
        most = {}
        for name, paths in (("small", ["a"]), ("big", ["b", "c"])):
            ids = np.concatenate([feats[p].reshape(-1) for p in paths])
            hi, lo = _hashindex.split_ids(ids[ids != -1])
            owner = np.asarray(_hashindex.locate(emb.dynamic[name].index, n, hi, lo)[0])
            per_shard = emb.table_plans[name].storage.layout.rows_per_shard
            distinct = [len(np.unique(ids[ids != -1][owner == p])) for p in range(n)]
            assert counts[name]["pairs"] == ids.size
            assert counts[name]["owned_pairs"] == np.bincount(owner, minlength=n).max()
            assert counts[name]["unique_rows"] == min(max(distinct), per_shard), distinct
            most[name] = max(distinct)
        assert counts["small"]["unique_rows"] == 8 < most["small"]  # Capped: 32 rows / 4.
        assert counts["big"]["passes"] >= rounds, counts


@pytest.mark.slow  # Four streams of several steps each.
def test_bfloat16_dynamic_tables():
    """A bfloat16 dynamic table (stochastic rounding, the default) evicting every step: the
    same resident ids and counters as the float32 table, on 1 and 4 devices; its rows
    (exported in bfloat16, as a static table's) bit-identical on both meshes and within
    bfloat16's rounding of the float32 rows."""
    dynamic = jte.DynamicTable(capacity=64, bucket_size=8)
    f32 = run_stream(1, "gather", dynamic, 6)
    runs = [run_stream(n, "gather", dynamic, 6, dtype=jnp.bfloat16) for n in (1, 4)]
    stats = jax.tree.map(int, f32[0].dynamic_stats(f32[1]))
    assert stats["users"]["evicted"] > 0
    for emb, state, exports, _ in runs:
        assert emb.export(state)["users"].rows.dtype == jnp.bfloat16  # As static tables.
        assert jax.tree.map(int, emb.dynamic_stats(state)) == stats
        for a, b, c in zip(exports, f32[2], runs[0][2]):
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_array_equal(a.rows, c.rows)
            rows = np.asarray(a.rows, np.float32)
            np.testing.assert_allclose(rows, b.rows, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "eviction",
    [
        "lru",
        pytest.param("lfu", marks=pytest.mark.slow),
        pytest.param("none", marks=pytest.mark.slow),
    ],
)
def test_eviction_invariants(eviction):
    """Occupancy <= capacity; counters add up; each resident id's row is its initial row plus
    only its own updates since its last admission; rows of ids not in a step stay
    bit-identical."""
    capacity = 48
    spec = spec_of(jte.DynamicTable(capacity=capacity, bucket_size=8, eviction=eviction))
    emb = jte.Embedding(spec, make_mesh(4), backend="xla")
    state = emb.init(jax.random.key(1))
    ref = Reference(key_words(state), "mean")
    before = {}
    for feats, grads in batches(5, 10, pool_size=300):
        state = emb.apply_gradients(state, feats, grads)
        out = users(emb.export(state)["users"])
        now = {int(i): r for i, r in zip(out.ids, out.rows)}
        stats = jax.tree.map(int, emb.dynamic_stats(state))["users"]
        assert len(now) == stats["occupancy"] <= emb.dynamic["users"].rows
        assert stats["admitted"] - stats["evicted"] - stats["expired"] == stats["occupancy"]
        in_batch = {
            int(i)
            for i in np.concatenate([feats["user"].ids.ravel(), feats["hist"].ravel()])
            if i != -1
        }
        assert stats["hits"] + stats["misses"] > 0
        for i in set(ref.rows) - set(now):  # Evicted: forgotten.
            del ref.rows[i]
        ref.update(feats, grads, admitted=set(now))
        for i, row in now.items():
            np.testing.assert_allclose(row, ref.rows[i][0], rtol=1e-5, atol=1e-6)
            if i not in in_batch:
                np.testing.assert_array_equal(row, before[i])
        before = now
    if eviction == "none":
        assert stats["evicted"] == 0 and stats["failed"] > 0
    else:
        assert stats["evicted"] > 0


def test_admission_rules_and_ttl():
    """min_count=2 admits at the second update that sees an id; until then lookups read its
    initial row and its gradient is not applied (counted as rejected). ttl_steps expires a
    row: lookups read the initial row again."""
    spec = spec_of(jte.DynamicTable(capacity=1024, min_count=2, ttl_steps=2))
    emb = jte.Embedding(spec, make_mesh(2), backend="xla")
    state = emb.init(jax.random.key(4))
    ids = np.array([[11, -1, -1, -1], [2**40, -3, -1, -1]], np.int64)
    feats = {
        "user": jte.Weighted(ids, np.ones((2, 4), np.float32)),
        "hist": np.full((2, 1), -1, np.int64),
        "item": np.array([1, 2], np.int32),
    }
    grads = jax.tree.map(lambda x: np.ones(x.shape, np.float32), emb.lookup(state, feats))
    init = np.asarray(emb.lookup(state, feats)["user"])
    state = emb.apply_gradients(state, feats, grads)  # First sighting: not admitted.
    np.testing.assert_array_equal(np.asarray(emb.lookup(state, feats)["user"]), init)
    s = jax.tree.map(int, emb.dynamic_stats(state))["users"]
    assert (s["rejected"], s["admitted"], s["occupancy"]) == (3, 0, 0)
    state = emb.apply_gradients(state, feats, grads)  # Second: admitted and updated.
    s = jax.tree.map(int, emb.dynamic_stats(state))["users"]
    assert (s["admitted"], s["occupancy"]) == (3, 3)
    assert not np.allclose(np.asarray(emb.lookup(state, feats)["user"]), init)
    other = {
        **feats,
        "user": jte.Weighted(np.full((2, 4), -1, np.int64), np.ones((2, 4), np.float32)),
    }
    for _ in range(2):  # Two steps without the ids: expired.
        state = emb.apply_gradients(state, other, grads)
    assert int(emb.dynamic_stats(state)["users"]["occupancy"]) == 0
    np.testing.assert_array_equal(np.asarray(emb.lookup(state, feats)["user"]), init)


@pytest.mark.slow
def test_admit_probability_is_deterministic():
    """admit_probability=0.5 admits about half of 512 new ids, the same ones on every mesh,
    and counts the others as rejected."""
    spec = spec_of(jte.DynamicTable(capacity=4096, admit_probability=0.5))
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, size=(64, 8), dtype=np.int64)
    feats = {
        "user": jte.Weighted(ids.reshape(64, 8)[:, :4], np.ones((64, 4), np.float32)),
        "hist": ids.reshape(64, 8)[:, 4:6],
        "item": np.zeros((64,), np.int32),
    }
    exported = []
    for n in (1, 4):
        emb = jte.Embedding(spec, make_mesh(n), backend="xla")
        state = emb.init(jax.random.key(0))
        grads = jax.tree.map(lambda x: np.ones(x.shape, np.float32), emb.lookup(state, feats))
        state = emb.apply_gradients(state, feats, grads)
        exported.append(users(emb.export(state)["users"]))
        s = jax.tree.map(int, emb.dynamic_stats(state))["users"]
        assert s["admitted"] + s["rejected"] == 6 * 64
        assert 0.42 < s["admitted"] / (6 * 64) < 0.58
    np.testing.assert_array_equal(exported[0].ids, exported[1].ids)
    np.testing.assert_array_equal(exported[0].rows, exported[1].rows)


@pytest.mark.slow
def test_jitted_step_with_split_ids_and_int32_ids():
    """Under jit without x64: ids as jte.SplitIds (from jte.split_ids) give what NumPy int64
    gives eagerly; int32 ids are their int64 values (sign-extended)."""
    spec = spec_of(jte.DynamicTable(capacity=512))
    emb = jte.Embedding(spec, make_mesh(4), backend="xla")
    ((feats, grads),) = batches(3, 1)
    eager = emb.apply_gradients(emb.init(jax.random.key(0)), feats, grads)

    def as_split(f):
        return {
            "user": jte.Weighted(jte.split_ids(f["user"].ids), f["user"].weights),
            "hist": jte.split_ids(f["hist"]),
            "item": f["item"],
        }

    step = jax.jit(lambda s, f, g: emb.apply_gradients(s, f, g))
    jitted = step(emb.init(jax.random.key(0)), as_split(feats), grads)
    for a, b in [(users(emb.export(eager)["users"]), users(emb.export(jitted)["users"]))]:
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.rows, b.rows)
    small = {**feats, "hist": np.array([[-5, 3]] * 8, np.int32)}
    wide = {**feats, "hist": np.array([[-5, 3]] * 8, np.int64)}
    state = emb.init(jax.random.key(0))
    np.testing.assert_array_equal(
        np.asarray(emb.lookup(state, small)["hist"]), np.asarray(emb.lookup(state, wide)["hist"])
    )
    stats = jax.jit(emb.dynamic_stats)(jitted)
    assert int(stats["users"]["occupancy"]) == len(users(emb.export(jitted)["users"]).ids)


@pytest.mark.slow
def test_restore_onto_another_mesh_continues_the_same():
    """export on 8 devices -> restore_tables on 2 -> continue = continue on 8 (no eviction);
    a capacity too small for the rows is a clear error."""
    stream = batches(9, 6)
    dynamic = jte.DynamicTable(capacity=2048)
    big = jte.Embedding(spec_of(dynamic), make_mesh(8), backend="xla")
    state = big.init(jax.random.key(0))
    for feats, grads in stream[:3]:
        state = big.apply_gradients(state, feats, grads)
    tables, slots = big.export(state), big.export_slots(state)
    small = jte.Embedding(spec_of(dynamic), make_mesh(2), backend="xla")
    restored = small.restore_tables(tables, slots, step=3, key=jax.random.key(0))
    for feats, grads in stream[3:]:
        state = big.apply_gradients(state, feats, grads)
        restored = small.apply_gradients(restored, feats, grads)
    a, b = users(big.export(state)["users"]), users(small.export(restored)["users"])
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_allclose(a.rows, b.rows, rtol=1e-6, atol=1e-7)
    tiny = jte.Embedding(spec_of(jte.DynamicTable(capacity=8, bucket_size=8)), make_mesh(2))
    with pytest.raises(ValueError, match=r"table 'users'.*do not fit its capacity of 16"):
        tiny.restore_tables(tables, slots)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocabulary_size=10, dynamic=jte.DynamicTable(capacity=8)), "not both"),
        (
            dict(dynamic=jte.DynamicTable(capacity=8), initializer=jax.nn.initializers.zeros),
            "takes the row initializers of jte.initializers",
        ),
        (dict(), "vocabulary_size must be an int > 0, got None"),
    ],
)
def test_bad_table_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jte.TableConfig(dim=4, name="t", **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacity=0), "capacity must be an int > 0, got 0"),
        (
            dict(capacity=8, eviction="fifo"),
            r"eviction must be one of \['lru', 'lfu', 'none'\], got 'fifo'",
        ),
        (dict(capacity=8, min_count=0), "min_count must be an int >= 1, got 0"),
        (
            dict(capacity=8, admit_probability=0.0),
            r"admit_probability must be in \(0, 1\], got 0.0",
        ),
        (
            dict(capacity=8, admit_probability=1.5),
            r"admit_probability must be in \(0, 1\], got 1.5",
        ),
        (dict(capacity=8, ttl_steps=0), "ttl_steps must be an int >= 1 or None, got 0"),
    ],
)
def test_bad_dynamic_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jte.DynamicTable(**kwargs)


def test_bad_ids_and_optimizers():
    emb = jte.Embedding(spec_of(jte.DynamicTable(capacity=64)), make_mesh(2))
    state = emb.init(jax.random.key(0))
    ((feats, _),) = batches(0, 1)
    with pytest.raises(ValueError, match=r"Feature 'hist': ids have dtype float32"):
        emb.lookup(state, {**feats, "hist": feats["hist"].astype(np.float32)})
    with pytest.raises(ValueError, match=r"Feature 'hist': ids have dtype uint64"):
        emb.lookup(state, {**feats, "hist": feats["hist"].astype(np.uint64)})
    with pytest.raises(ValueError, match=r"restore_tables: table 'users' is dynamic"):
        emb.restore_tables({"users": np.zeros((4, DIM)), "items": np.zeros((64, DIM))})
    custom = jte.CustomOptimizer(
        lambda g, row, slots, lr, hps: (row - lr * g, slots),
        slot_names=("v",),
        slot_initializers=(jax.nn.initializers.normal(),),
    )
    with pytest.raises(ValueError, match=r"slots \['v'\].*random initializers"):
        jte.Embedding(spec_of(jte.DynamicTable(capacity=64), optimizer=custom), make_mesh(2))


def test_config_files_take_dynamic_tables(tmp_path):
    """`dynamic: {...}` in a config file is a jte.DynamicTable; its errors name file and key."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "optimizer: {name: adagrad, learning_rate: 0.05}\n"
        "tables:\n"
        "  users: {dim: 16, dynamic: {capacity: 4096, eviction: lfu, min_count: 2}}\n"
        "  items: {vocabulary_size: 100, dim: 16}\n"
        "features: {user: users, item: items}\n"
    )
    users = jte.load_spec(str(path)).tables()["users"]
    assert users.vocabulary_size is None
    assert users.dynamic == jte.DynamicTable(capacity=4096, eviction="lfu", min_count=2)
    for table, match in [
        ("{dim: 16, dynamic: {capacity: 0}}", r"tables.u.dynamic: .*capacity must be an int > 0"),
        ("{dim: 16, dynamic: {capacity: 8, evict: lru}}", r"tables.u.dynamic.evict: unknown"),
        ("{vocabulary_size: 9, dim: 16, dynamic: {capacity: 8}}", r"not both \(got 9\)"),
    ]:
        path.write_text(f"optimizer: sgd\ntables:\n  u: {table}\nfeatures:\n  u: u\n")
        with pytest.raises(ValueError, match=match):
            jte.load_spec(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_plan_reports_a_dynamic_tables_index(tmp_path, placement):
    """`jte.plan` counts a dynamic table's rows (its capacity), slots and index bytes; in
    host memory, its rows and slots there and its index in HBM."""
    from jax_tpu_embed import plan

    path = tmp_path / "c.yaml"
    path.write_text(
        "optimizer: {name: adagrad, learning_rate: 0.05}\n"
        "tables:\n"
        f"  users: {{dim: 64, dynamic: {{capacity: 2000000}}, placement: {placement}}}\n"
        "features: {user: users}\n"
    )
    res = plan.plan(str(path), "v5p:2x2x1", batch=1024)
    (users,) = res["tables"]
    assert users["placement"] == placement
    rows_and_slots = users["table_bytes_per_chip"] + users["slot_bytes_per_chip"]
    # 31,250 buckets of 64 rounded up to an even number on each of 4 chips: 31,256.
    assert rows_and_slots >= 2_000_384 // 4 * 64 * 4 * 2
    assert res["per_chip"]["host_bytes"] == (rows_and_slots if placement == "host" else 0)
    assert res["per_chip"]["table_bytes"] == (
        0 if placement == "host" else users["table_bytes_per_chip"]
    )
    assert users["vocabulary_size"] is None and users["capacity"] == 2_000_384
    # Keys (8 B), last step and count (4 B each) per slot, a quarter of them per chip, and
    # the chip's row of int32 counters.
    from jax_tpu_embed import _hashindex

    counters = 4 * len(_hashindex.STAT_NAMES)
    assert users["index_bytes_per_chip"] == 2_000_384 // 4 * 16 + counters
    assert res["per_chip"]["index_bytes"] == users["index_bytes_per_chip"]
    assert res["fits"] and "dyn 2,000,384" in plan.format_table(res)


@pytest.mark.parametrize(
    "placement",
    [
        pytest.param("device", marks=pytest.mark.slow),
        "host",
        pytest.param(jte.HostCached(cache_rows=256, ways=4), marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_train_step_fed_by_split_ids(placement):
    """jte.make_train_step with a dynamic table (in HBM, in host memory with its rows staged
    as on TPU, or there with a cache of a quarter of its rows, the step given the next
    batch to prefetch): a pipeline gives jte.split_ids halves; the table learns (loss
    falls), the metrics carry the index's counters, and int64 NumPy ids beyond int32 are an
    error instead of being cut by jit."""
    import optax

    users = jte.TableConfig(
        dim=DIM, name="users", dynamic=jte.DynamicTable(capacity=1024), placement=placement
    )
    spec = jte.EmbeddingSpec(
        features={"user": jte.FeatureConfig(users)}, optimizer=jte.Adagrad(learning_rate=0.5)
    )
    emb = jte.Embedding(spec, make_mesh(2), stage_host_rows=placement == "host" or None)
    assert emb.stageable == ({"users"} if placement == "host" else set())

    def loss_fn(params, acts, batch):
        return jnp.mean((acts["user"] @ params["w"] - batch["y"]) ** 2)

    step = jte.make_train_step(emb, loss_fn, optax.sgd(0.1))
    state = step.init(jax.random.key(0), {"w": jnp.ones((DIM,))})
    rng = np.random.default_rng(0)
    pool = rng.integers(-(2**63), 2**63 - 1, size=32, dtype=np.int64)
    target = {int(i): float(v) for i, v in zip(pool, rng.normal(size=32))}
    losses, metrics, y = [], {}, None
    batches = []
    for _ in range(30):
        ids = rng.choice(pool, size=16)
        y = np.array([target[int(i)] for i in ids], np.float32)
        batches.append({"features": {"user": jte.split_ids(ids)}, "y": y})
    cached = isinstance(placement, jte.HostCached)
    for i, batch in enumerate(batches):
        upcoming = batches[i + 1] if cached and i + 1 < len(batches) else None
        state, metrics = step(state, batch, next_batch=upcoming)
        losses.append(float(metrics["loss"]))
    if cached:  # Its 32 ids stay cached once admitted: later updates find them in HBM.
        cache = jax.tree.map(int, emb.cache_stats(state.embedding))["users"]
        assert cache["hits"] > 0 and cache["misses"] <= 32, cache
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    kind = "device" if placement == "device" else "pinned_host"
    assert state.embedding.tables["users"].sharding.memory_kind == kind
    stats = jax.tree.map(int, emb.dynamic_stats(state.embedding))["users"]
    assert stats["occupancy"] == stats["admitted"] == 32
    counted = jax.tree.map(int, metrics["dynamic"]["users"])  # The last step's metrics.
    assert counted == {k: v for k, v in stats.items() if k != "occupancy"}
    with pytest.raises(ValueError, match=r"int64 ids beyond int32.*jte.split_ids"):
        step(state, {"features": {"user": pool[:16]}, "y": y})


@pytest.mark.parametrize(
    "front, mesh_kind, min_count",
    [
        ("core", "auto", 1),
        pytest.param("core", "auto", 2, marks=pytest.mark.slow),  # And restored.
        pytest.param("flax", None, 1, marks=pytest.mark.slow),  # The demo's: the default mesh.
        pytest.param("nnx", "explicit", 1, marks=pytest.mark.slow),
    ],
)
def test_train_step_compiles_once(tmp_path, front, mesh_kind, min_count):
    """The state a train step returns is laid out as the one it was given, so the second
    step reuses the first one's executable, on Auto and Explicit meshes and in every front
    end. A table without an admission filter holds empty filter arrays, which a step gives
    back replicated: laid out by rows at init, they made the second step compile the whole
    train step again (the demo's dynamic run compiled twice). The same after a restore (slow
    tier)."""
    import optax
    from flax import linen, nnx

    users = jte.TableConfig(
        dim=DIM, name="users", dynamic=jte.DynamicTable(capacity=256, min_count=min_count)
    )
    spec = jte.EmbeddingSpec({"user": jte.FeatureConfig(users)}, jte.Adagrad(learning_rate=0.5))
    mesh = None if mesh_kind is None else make_mesh(2, mesh_kind)
    rng = np.random.default_rng(0)
    pool = rng.integers(-(2**63), 2**63 - 1, size=64, dtype=np.int64)
    batches = [
        {"features": {"user": jte.split_ids(rng.choice(pool, (8, 3)))}, "y": np.ones(8, np.float32)}
        for _ in range(4)
    ]
    mse = lambda out, batch: jnp.mean((out - batch["y"]) ** 2)
    step: Any
    state: Any
    if front == "core":
        emb = jte.Embedding(spec, mesh)
        loss_fn = lambda params, acts, batch: mse(jnp.sum(acts["user"], -1) * params["w"], batch)
        step = jte.make_train_step(emb, loss_fn, optax.sgd(0.1))
        state = step.init(jax.random.key(0), {"w": jnp.ones(())})
        run = lambda state, batch: step(state, batch)[0]
    elif front == "flax":

        class Model(linen.Module):
            @linen.compact
            def __call__(self, batch):
                return jnp.sum(jte.flax.Embed(spec, mesh)(batch["features"])["user"], -1)

        step = jte.flax.make_train_step(Model(), mse, optax.sgd(0.1))
        state = step.init(jax.random.key(0), batches[0])
        run = lambda state, batch: step(state, batch)[0]
    else:

        class Tower(nnx.Module):
            def __init__(self):
                self.embed = jte.nnx.Embed(spec, mesh, rngs=nnx.Rngs(0))

            def __call__(self, batch):
                return jnp.sum(self.embed(batch["features"])["user"], -1)

        model = Tower()
        step = jte.nnx.make_train_step(model, lambda m, batch: mse(m(batch), batch), optax.sgd(0.1))
        state = None
        run = lambda state, batch: step(batch)
    state = run(state, batches[0])
    jax.block_until_ready(state)
    with executables_made() as made:
        for batch in batches[1:3]:
            state = run(state, batch)
        jax.block_until_ready(state)
    assert made == []
    if min_count > 1:  # Restored, the state is laid out as init lays it out.
        jte.checkpoint.save(tmp_path, emb, state.embedding, dense={"params": state.params})
        emb_state, dense = jte.checkpoint.restore(tmp_path, emb)
        state = step.init(None, dense["params"], embedding_state=emb_state)
        with executables_made() as made:
            jax.block_until_ready(run(state, batches[3]))
        assert made == []


@pytest.mark.slow
def test_pipelined_step_with_weighted_dynamic_features_equals_the_plain_one():
    """`pipeline_execution=True` on a dynamic table fed a weighted feature (a `Weighted`
    of SplitIds) and a plain one, on 2 devices: where consecutive batches share no id, each
    lookup sees what the plain step's sees (the ids' initial rows), so the losses match,
    and after `flush` so do the resident ids and rows. The step's init once failed making
    the empty pending update of a Weighted's SplitIds."""
    import optax

    rng = np.random.default_rng(11)

    def draw(k):  # Step k's ids: its own range of int64, with -1 padding and repeats.
        ids = rng.integers(0, 50, (8, 3)) + (k + 1) * 10**15
        ids[rng.random(ids.shape) < 0.2] = -1
        return ids

    feeds = []
    for k in range(4):
        weights = rng.uniform(0.5, 2.0, (8, 3)).astype(np.float32)
        weighted = jte.Weighted(jte.split_ids(draw(k)), weights)
        feeds.append({"features": {"w": weighted, "u": jte.split_ids(draw(k))}})

    def loss_fn(params, acts, batch):  # Its gradient depends on the activations.
        return params["s"] * jnp.sum(acts["w"] * acts["u"] + acts["w"] ** 2)

    out = {}
    for pipelined in (False, True):
        table = jte.TableConfig(
            dim=DIM, name="t", dynamic=jte.DynamicTable(capacity=256, bucket_size=8)
        )
        spec = jte.EmbeddingSpec(
            {"w": jte.FeatureConfig(table), "u": jte.FeatureConfig(table)},
            jte.Adagrad(0.1),
            pipeline_execution=pipelined,
        )
        emb = jte.Embedding(spec, make_mesh(2))
        step = jte.make_train_step(emb, loss_fn, optax.sgd(0.0))
        state = step.init(jax.random.key(0), {"s": jnp.float32(0.5)}, feeds[0])
        losses = []
        for feed in feeds:
            state, metrics = step(state, feed)
            losses.append(float(metrics["loss"]))
        state = step.flush(state)
        out[pipelined] = losses, emb.export(state.embedding)["t"]
    (plain_losses, plain), (piped_losses, piped) = out[False], out[True]
    np.testing.assert_allclose(piped_losses, plain_losses, rtol=1e-6)
    np.testing.assert_array_equal(piped.ids, plain.ids)
    assert len(plain.ids) > 40
    np.testing.assert_allclose(piped.rows, plain.rows, rtol=1e-6, atol=1e-7)


def test_nnx_layer_and_micro_batches():
    """A dynamic table in a jte.nnx.Embed trains under jte.nnx.make_train_step; with
    accumulate_steps=2 each micro-batch's ids are admitted."""
    import optax
    from flax import nnx

    table = jte.TableConfig(dim=DIM, name="users", dynamic=jte.DynamicTable(capacity=1024))
    spec = jte.EmbeddingSpec(
        features={"user": jte.FeatureConfig(table)}, optimizer=jte.Adagrad(learning_rate=0.5)
    )
    mesh = make_mesh(2)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = jte.nnx.Embed(spec, mesh, rngs=rngs)
            self.head = nnx.Linear(DIM, 1, rngs=rngs)

        def __call__(self, features):
            return self.head(self.embed(features)["user"])[:, 0]

    def loss_fn(model, batch):
        return jnp.mean((model(batch["features"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(1)
    pool = rng.integers(-(2**63), 2**63 - 1, size=24, dtype=np.int64)
    model = Model(nnx.Rngs(0))
    step = jte.nnx.make_train_step(model, loss_fn, optax.sgd(0.05))
    seen = set()
    for _ in range(5):
        ids = rng.choice(pool, size=8)
        seen |= set(ids.tolist())
        y = rng.normal(size=8).astype(np.float32)
        step({"features": {"user": jte.split_ids(ids)}, "y": y})
    emb, state = model.embed.embedding, model.embed.embedding_state
    assert set(users(emb.export(state)["users"]).ids.tolist()) == seen

    emb = jte.Embedding(spec, mesh)
    accum = jte.make_train_step(
        emb, lambda p, acts, b: jnp.mean(acts["user"] ** 2), optax.sgd(0.0), accumulate_steps=2
    )
    state = accum.init(jax.random.key(0), {})
    ids = rng.choice(pool, size=(2, 8))
    state, _ = accum(state, {"features": {"user": jte.split_ids(ids)}})
    exported = users(emb.export(state.embedding)["users"])
    assert set(exported.ids.tolist()) == set(ids.ravel().tolist())


def test_pad_ragged_keeps_64_bit_ids():
    """pad_ragged gives int64 ids when a value needs 64 bits (never wrapped into int32), int32
    otherwise."""
    big = np.array([2**40 + 3, -(2**50), 7, 2**62], np.int64)
    ids = np.asarray(jte.pad_ragged(big, row_lengths=[2, 0, 2]))
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, [[2**40 + 3, -(2**50)], [-1, -1], [7, 2**62]])
    small = np.asarray(jte.pad_ragged(np.array([1, 2], np.int64), row_lengths=[1, 1]))
    assert small.dtype == np.int32


@pytest.mark.parametrize(
    "width, rank, dtype",
    [
        (8, 2, np.float32),  # 16 rows to a 128-lane row.
        pytest.param(24, 2, np.float32, marks=pytest.mark.slow),  # Padded to 32 lanes: 4 a row.
        pytest.param(48, 2, jnp.bfloat16, marks=pytest.mark.slow),  # 2 to a row, 16-bit.
        pytest.param(1, 1, np.float32, marks=pytest.mark.slow),  # A rank-1 slot: 128 to a row.
        pytest.param(200, 2, np.float32, marks=pytest.mark.slow),  # Padded to 256 lanes.
        pytest.param(128, 2, np.float32, marks=pytest.mark.slow),  # As it is.
    ],
)
def test_reset_rows_write_their_own_lanes_of_packed_rows(width, rank, dtype):
    """`_dynamic._write_rows` (the reset of rows given to new ids) on a shard's physical
    array equals setting the rows of its logical view and packing it again, bit for bit:
    rows sharing a physical row (written in one call) keep each other's lanes, the padding
    lanes are zeros, rows out of range are dropped, and the rows around them, inf and nan
    included, are untouched. The slow tier adds the widths padded to more lanes."""
    packing = _layout.Packing(width, rank, 128)
    rows_per_shard = 1000
    rng = np.random.default_rng(width)
    shape = (rows_per_shard, width) if rank == 2 else (rows_per_shard,)
    logical = rng.standard_normal(shape).astype(dtype)
    logical[rng.integers(0, rows_per_shard, 50)] = np.inf
    logical[rng.integers(0, rows_per_shard, 50)] = np.nan
    physical = packing.pack(logical, 1)
    rows = rng.permutation(rows_per_shard)[:300].astype(np.int32)
    rows[::7] = 1 << 30  # Past the shard: dropped.
    values = rng.standard_normal((300,) + shape[1:]).astype(np.float32)
    got = jax.jit(_dynamic._write_rows, static_argnums=0)(packing, physical, rows, values)
    want = logical.copy()
    keep = rows < rows_per_shard
    want[rows[keep]] = values[keep].astype(dtype)
    want = packing.pack(want, 1)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
