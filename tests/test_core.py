"""Lookups and sparse updates against the float64 NumPy reference, on 1-8 shards."""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpu_embed as jte
import reference
from conftest import count_primitive, make_mesh

B = 16


# `wide`: the same features over larger tables (ids spread by _WIDE's factors), in dims
# that pack 2, 32 and 1 rows to a 128-lane physical row: touched rows span many physical
# rows and some share one.
_WIDE = {"shared": (600, 40, 16), "mean": (300, 3, 27), "sqrtn": (400, 128, 20)}


def _features_and_spec(optimizer, *, table_optimizer=None, strategy="div", wide=False, **spec_kw):
    """A spec exercising every input form: shared table, combiners, weights, sequences."""
    size = lambda name, v, d: _WIDE[name][:2] if wide else (v, d)
    shared = jte.TableConfig(*size("shared", 37, 5), combiner="sum", name="shared")
    mean_t = jte.TableConfig(*size("mean", 11, 3), combiner="mean", optimizer=table_optimizer)
    sqrtn_t = jte.TableConfig(*size("sqrtn", 20, 4), combiner="sqrtn")
    spec = jte.EmbeddingSpec(
        {
            "multi": jte.FeatureConfig(shared),
            "one": jte.FeatureConfig(shared),
            "nested": {
                "mean": jte.FeatureConfig(mean_t),
                "seq": jte.FeatureConfig(mean_t, max_sequence_length=4),
            },
            "weighted": jte.FeatureConfig(sqrtn_t),
        },
        optimizer,
        partition_strategy=strategy,
        **spec_kw,
    )
    return spec


def _inputs(rng, wide=False):
    """Random ids with many duplicates and padding; `wide`: spread over _WIDE's tables."""
    out = _small_inputs(rng)
    if not wide:
        return out
    spread = lambda ids, name: np.where(ids >= 0, ids * _WIDE[name][2] + 1, ids).astype(np.int32)
    out["multi"], out["one"] = spread(out["multi"], "shared"), spread(out["one"], "shared")
    out["nested"] = {k: spread(v, "mean") for k, v in out["nested"].items()}
    w = out["weighted"]
    out["weighted"] = jte.Weighted(spread(w.ids, "sqrtn"), w.weights)
    return out


def _small_inputs(rng):
    multi = rng.integers(0, 12, (B, 6))  # Few distinct ids: many duplicates.
    multi[rng.random((B, 6)) < 0.3] = -1
    multi[3] = -1  # An example with no ids.
    seq = rng.integers(0, 11, (B, 6))  # Longer than max_sequence_length: truncated.
    seq[:, 3:][rng.random((B, 3)) < 0.5] = -1
    wid = rng.integers(0, 20, (B, 3))
    wid[0, 1] = -1
    wts = rng.uniform(0.1, 2.0, (B, 3)).astype(np.float32)
    return {
        "multi": multi.astype(np.int32),
        "one": rng.integers(0, 37, (B,)).astype(np.int32),
        "nested": {
            "mean": rng.integers(-1, 11, (B, 2)).astype(np.int32),
            "seq": seq.astype(np.int32),
        },
        "weighted": jte.Weighted(wid.astype(np.int32), wts),
    }


def _grads(rng, acts):
    return jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), acts)


# (path, table name, combiner, max_sequence_length) of the spec above.
_FEATURES = [
    ("multi", "shared", "sum", 0),
    ("one", "shared", "sum", 0),
    ("nested/mean", "nested/mean", "mean", 0),
    ("nested/seq", "nested/mean", "mean", 4),
    ("weighted", "weighted", "sqrtn", 0),
]


def _leaf(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def _ids_weights(features, path):
    leaf = _leaf(features, path)
    if isinstance(leaf, jte.Weighted):
        return np.asarray(leaf.ids), np.asarray(leaf.weights)
    return np.asarray(leaf), None


def reference_lookup(tables, features):
    out = {}
    for path, table, combiner, seq in _FEATURES:
        ids, w = _ids_weights(features, path)
        out[path] = reference.lookup(tables[table], ids, w, combiner, seq)
    return out


def reference_row_grads(tables, features, grads):
    contributions = {}
    for path, table, combiner, seq in _FEATURES:
        ids, w = _ids_weights(features, path)
        contributions.setdefault(table, []).append((ids, w, combiner, seq, _leaf(grads, path)))
    return {t: reference.row_gradients(tables[t].shape[0], c) for t, c in contributions.items()}


def _lookup_cases():
    """Both strategies on every mesh size; the fast tier keeps each strategy on each mesh kind
    and each mesh size once (4 of the 8)."""
    fast = {(1, "explicit", "div"), (2, "auto", "mod"), (4, "explicit", "mod"), (8, "auto", "div")}
    for n, kind in [(1, "explicit"), (2, "auto"), (4, "explicit"), (8, "auto")]:
        for strategy in ["div", "mod"]:
            marks = [] if (n, kind, strategy) in fast else [pytest.mark.slow]
            yield pytest.param(n, kind, strategy, id=f"{n}-{kind}-{strategy}", marks=marks)


@pytest.mark.parametrize("num_shards,kind,strategy", list(_lookup_cases()))
def test_lookup_matches_reference(kind, strategy, num_shards, rng):
    spec = _features_and_spec(jte.SGD(0.1), strategy=strategy)
    emb = jte.Embedding(spec, make_mesh(num_shards, kind))
    state = emb.init(jax.random.key(1))
    features = _inputs(rng)
    acts = emb.lookup(state, features)
    want = reference_lookup(emb.export(state), features)
    for path, *_ in _FEATURES:
        got = np.asarray(_leaf(acts, path))
        np.testing.assert_allclose(got, want[path], rtol=1e-5, atol=1e-6, err_msg=path)
    assert np.all(np.asarray(acts["multi"])[3] == 0)  # No ids: zero vector.


OPTIMIZERS = {
    "sgd": (jte.SGD(0.3), {}),
    "adagrad": (jte.Adagrad(0.2, initial_accumulator_value=0.5), {}),
    "adagrad_momentum": (
        jte.AdagradMomentum(
            0.1, momentum=0.9, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=1e-6
        ),
        dict(momentum=0.9, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=1e-6),
    ),
    "adagrad_momentum_plain": (
        jte.AdagradMomentum(0.1, momentum=0.5),
        dict(momentum=0.5, use_nesterov=False, exponent=2.0, beta2=1.0, epsilon=1e-10),
    ),
    "adam": (jte.Adam(0.05), dict(beta_1=0.9, beta_2=0.999, epsilon=1e-7, sum_inside_sqrt=True)),
    "adam_outside": (
        jte.Adam(0.05, beta_1=0.5, beta_2=0.7, epsilon=1e-3, sum_inside_sqrt=False),
        dict(beta_1=0.5, beta_2=0.7, epsilon=1e-3, sum_inside_sqrt=False),
    ),
    "ftrl": (
        jte.FTRL(
            0.2,
            l1_regularization_strength=0.01,
            l2_regularization_strength=0.1,
            beta=0.5,
            learning_rate_power=-0.5,
        ),
        dict(
            learning_rate_power=-0.5,
            l1=0.01,
            l2=0.1,
            beta=0.5,
            multiply_linear_by_learning_rate=False,
        ),
    ),
    "ftrl_linear_lr": (
        jte.FTRL(
            0.2,
            l1_regularization_strength=0.01,
            beta=0.1,
            learning_rate_power=-0.7,
            multiply_linear_by_learning_rate=True,
        ),
        dict(
            learning_rate_power=-0.7,
            l1=0.01,
            l2=0.0,
            beta=0.1,
            multiply_linear_by_learning_rate=True,
        ),
    ),
    "rowwise_adagrad": (jte.RowwiseAdagrad(0.2, initial_accumulator_value=0.1), dict(epsilon=1e-8)),
}


def _ref_name(key):
    return key.replace("_plain", "").replace("_outside", "").replace("_linear_lr", "")


def _run_reference(emb, spec, tables, slots, features, grads, steps_lr, extras=None):
    extras = extras or {}
    row_grads = reference_row_grads(tables, features, grads)
    out_t, out_s = {}, {}
    for name, table in tables.items():
        cfg = emb.table_plans[name]
        opt_key = next(k for k, (o, _) in OPTIMIZERS.items() if o is cfg.optimizer)
        _, hp = OPTIMIZERS[opt_key]
        out_t[name], out_s[name] = reference.apply(
            _ref_name(opt_key),
            hp,
            table,
            slots[name],
            row_grads.get(name, {}),
            cfg.optimizer.learning_rate,
            **extras,
        )
    return out_t, out_s


def _check_update(emb, spec, tables, slots, features, grads, state, extras=None):
    """The state after one update equals the float64 reference; untouched rows and slots
    keep their bits."""
    want_t, want_s = _run_reference(emb, spec, tables, slots, features, grads, None, extras)
    got_t, got_s = emb.export(state), emb.export_slots(state)
    row_grads = reference_row_grads(tables, features, grads)
    for name in tables:
        np.testing.assert_allclose(got_t[name], want_t[name], rtol=2e-5, atol=2e-6, err_msg=name)
        for s in want_s[name]:
            np.testing.assert_allclose(
                got_s[name][s], want_s[name][s], rtol=2e-5, atol=1e-6, err_msg=f"{name}/{s}"
            )
        untouched = np.setdiff1d(np.arange(tables[name].shape[0]), list(row_grads.get(name, {})))
        np.testing.assert_array_equal(got_t[name][untouched], tables[name][untouched])
        for s in got_s[name]:
            np.testing.assert_array_equal(got_s[name][s][untouched], slots[name][s][untouched])


def _two_steps_match_reference(emb, spec, rng, key, *, wide=False, extras=None):
    """Two steps of random inputs: lookups equal the reference, updates _check_update's."""
    state = emb.init(key)
    for _ in range(2):
        features = _inputs(rng, wide=wide)
        tables, slots = emb.export(state), emb.export_slots(state)
        acts = emb.lookup(state, features)
        want = reference_lookup(tables, features)
        for path, *_ in _FEATURES:
            np.testing.assert_allclose(
                np.asarray(_leaf(acts, path)), want[path], rtol=1e-5, atol=1e-6, err_msg=path
            )
        grads = _grads(rng, acts)
        state = emb.apply_gradients(state, features, grads)
        _check_update(emb, spec, tables, slots, features, grads, state, extras)


# tests/test_optimizers.py runs every optimizer on every backend, strategy and mesh size.


_EVERY_MESH = [
    (s, n, "auto" if n % 2 else "explicit") for s in ["div", "mod"] for n in [1, 2, 4, 8]
]


@pytest.mark.parametrize(
    "meshes",
    [
        # Both strategies, both mesh kinds, 1 and 8 devices; the slow tier runs all eight.
        pytest.param([("div", 1, "auto"), ("mod", 8, "explicit")], id="2"),
        pytest.param(_EVERY_MESH, id="all", marks=pytest.mark.slow),
    ],
)
def test_results_identical_for_every_strategy_and_mesh(meshes, rng):
    features = [_inputs(rng) for _ in range(2)]
    exports = []
    for strategy, n, kind in meshes:
        spec = _features_and_spec(
            jte.Adagrad(0.1), strategy=strategy, table_optimizer=jte.FTRL(0.1)
        )
        emb = jte.Embedding(spec, make_mesh(n, kind))
        state = emb.init(jax.random.key(3))
        g_rng = np.random.default_rng(5)
        for f in features:
            state = emb.apply_gradients(state, f, _grads(g_rng, emb.lookup(state, f)))
        exports.append((emb.export(state), emb.export_slots(state)))
    t0, s0 = exports[0]
    for t, s in exports[1:]:
        for name in t0:
            np.testing.assert_allclose(t[name], t0[name], rtol=1e-6, atol=1e-7)
            for k in s0[name]:
                np.testing.assert_allclose(s[name][k], s0[name][k], rtol=1e-6, atol=1e-7)


def test_extras_in_order_with_schedules(rng):
    """Multiplier -> clipping_limit -> clipvalue -> optimizer -> decay -> weight clipping."""
    sched = lambda step: 0.3 / (1.0 + step)
    opt = jte.Adagrad(
        sched,
        initial_accumulator_value=0.2,
        clipvalue=(-0.4, 0.3),
        weight_decay_factor=0.05,
        multiply_weight_decay_factor_by_learning_rate=True,
        clip_weight_min=-0.25,
        clip_weight_max=0.2,
    )
    spec = _features_and_spec(
        opt,
        table_optimizer=jte.SGD(0.2, weight_decay_factor=0.1),
        clipping_limit=0.5,
        gradient_multiplier_fn=lambda step: 2.0 + step,
    )
    emb = jte.Embedding(spec, make_mesh(4))
    state = emb.init(jax.random.key(4))
    step_fn = jax.jit(emb.apply_gradients)
    for step in range(3):
        features = _inputs(rng)
        tables, slots = emb.export(state), emb.export_slots(state)
        grads = _grads(rng, emb.lookup(state, features))
        grads = jax.tree.map(lambda g: 3 * g, grads)  # Large: clipping matters.
        state = step_fn(state, features, grads)
        row_grads = reference_row_grads(tables, features, grads)
        common: dict[str, Any] = dict(multiplier=2.0 + step, clipping_limit=0.5)
        want, want_s = reference.apply(
            "adagrad",
            {},
            tables["shared"],
            slots["shared"],
            row_grads["shared"],
            sched(step),
            clipvalue=(-0.4, 0.3),
            weight_decay=0.05,
            decay_by_lr=True,
            clip_min=-0.25,
            clip_max=0.2,
            **common,
        )
        np.testing.assert_allclose(emb.export(state)["shared"], want, rtol=1e-5, atol=1e-6)
        want_sgd, _ = reference.apply(
            "sgd",
            {},
            tables["nested/mean"],
            {},
            row_grads["nested/mean"],
            0.2,
            weight_decay=0.1,
            **common,
        )
        np.testing.assert_allclose(emb.export(state)["nested/mean"], want_sgd, rtol=1e-5, atol=1e-6)
    assert step_fn._cache_size() == 1  # pyright: ignore[reportAttributeAccessIssue]


def _momentum_sgd(gradient, row, slots, learning_rate, hyperparameters):
    (velocity, count) = slots
    (beta,) = hyperparameters
    velocity = beta * velocity + gradient
    return row - learning_rate * velocity, velocity, count + 1.0


# The fast tier: the XLA passes (the battery runs a custom optimizer on the kernels too).
@pytest.mark.parametrize(
    "strategy,tpu_kernels",
    [("div", False), pytest.param("mod", "interpret", marks=pytest.mark.slow)],
)
def test_custom_optimizer(strategy, tpu_kernels, rng):
    """A user's row function with a schedule, a hyperparameter and a rank-1 slot; also
    through the fused TPU kernels (in Pallas' interpreter, packed 128-lane rows)."""
    opt = jte.CustomOptimizer(
        _momentum_sgd,
        learning_rate=lambda s: 0.1 * (s + 1),
        slot_names=["velocity", "count"],
        slot_initializers=[jax.nn.initializers.constant(0.5), 0.0],
        hyperparameters=[lambda s: 0.9 - 0.1 * s],
        slot_dims=[2, 1],
    )
    spec = _features_and_spec(opt, strategy=strategy, wide=bool(tpu_kernels))
    backend = "pallas_interpret" if tpu_kernels else "auto"
    emb = jte.Embedding(spec, make_mesh(8), backend=backend)
    assert (emb.backends["shared"] == "pallas_interpret") == bool(tpu_kernels)
    state = emb.init(jax.random.key(0))
    np.testing.assert_array_equal(emb.export_slots(state)["shared"]["velocity"], 0.5)
    for step in range(2):
        features = _inputs(rng, wide=bool(tpu_kernels))
        tables, slots = emb.export(state), emb.export_slots(state)
        grads = _grads(rng, emb.lookup(state, features))
        state = emb.apply_gradients(state, features, grads)
        rg = reference_row_grads(tables, features, grads)["shared"]
        want_t, want_v, want_c = (
            tables["shared"].copy(),
            slots["shared"]["velocity"].copy(),
            slots["shared"]["count"].copy(),
        )
        beta, lr = 0.9 - 0.1 * step, 0.1 * (step + 1)
        for r, g in rg.items():
            want_v[r] = beta * want_v[r] + g
            want_t[r] = want_t[r] - lr * want_v[r]
            want_c[r] += 1
        got = emb.export_slots(state)["shared"]
        np.testing.assert_allclose(emb.export(state)["shared"], want_t, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["velocity"], want_v, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["count"], want_c)
        assert got["count"].shape == (600 if tpu_kernels else 37,)


def test_dense_adam_updates_every_row(rng):
    spec = _features_and_spec(jte.Adam(0.1, lazy_adam=False), strategy="mod")
    emb = jte.Embedding(spec, make_mesh(4))
    state = emb.init(jax.random.key(0))
    hp = dict(beta_1=0.9, beta_2=0.999, epsilon=1e-7, sum_inside_sqrt=True)
    for _ in range(2):
        features = _inputs(rng)
        tables, slots = emb.export(state), emb.export_slots(state)
        grads = _grads(rng, emb.lookup(state, features))
        state = emb.apply_gradients(state, features, grads)
        rg = reference_row_grads(tables, features, grads)
        for name in tables:
            want, want_s = reference.apply(
                "adam", hp, tables[name], slots[name], rg.get(name, {}), 0.1, dense=True
            )
            np.testing.assert_allclose(emb.export(state)[name], want, rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(
                emb.export_slots(state)[name]["momenta"], want_s["momenta"], rtol=2e-5, atol=1e-7
            )


def test_bfloat16_tables_compute_in_float32(rng):
    t = jte.TableConfig(50, 8, combiner="sum", dtype=jnp.bfloat16)
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(t)}, jte.Adagrad(0.1))
    emb = jte.Embedding(spec, make_mesh(2))
    state = emb.init(jax.random.key(0))
    assert state.tables["f"].dtype == jnp.bfloat16
    assert state.slots["f"]["accumulators"].dtype == jnp.float32
    ids = rng.integers(0, 50, (8, 3)).astype(np.int32)
    acts = emb.lookup(state, {"f": ids})
    assert acts["f"].dtype == jnp.float32
    want = reference.lookup(emb.export(state)["f"].astype(np.float64), ids, None, "sum")
    np.testing.assert_allclose(acts["f"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # The fast tier: test_init_is_the_same_for_every_block_size_*.
def test_same_logical_init_for_every_mesh_and_strategy():
    ref = None
    for strategy in ["div", "mod"]:
        for n in [1, 3, 8]:
            spec = _features_and_spec(jte.FTRL(0.1), strategy=strategy)
            emb = jte.Embedding(spec, make_mesh(n, "auto"))
            state = emb.init(jax.random.key(7))
            got = (emb.export(state), emb.export_slots(state))
            if ref is None:
                ref = got
            for name in ref[0]:
                np.testing.assert_array_equal(got[0][name], ref[0][name])
                np.testing.assert_array_equal(got[1][name]["accumulators"], np.float32(0.1))
    std = ref[0]["shared"].std()
    assert 0.5 / np.sqrt(5) < std < 1.2 / np.sqrt(5)  # TF default: stddev 1/sqrt(dim).


@pytest.mark.parametrize(
    "opt_key,strategy,num_shards",
    [
        # The fast tier compares packed rows with the reference instead
        # (test_update_in_passes_*, test_fused_tpu_kernels_*).
        pytest.param("adagrad", "div", 4, marks=pytest.mark.slow),
        # A rank-1 slot in a packed array of its own (test_checkpoint round-trips it fast).
        pytest.param("rowwise_adagrad", "mod", 2, marks=pytest.mark.slow),
        pytest.param("ftrl", "mod", 8, marks=pytest.mark.slow),  # Two riders.
    ],
)
def test_lane_packed_layout_gives_identical_results(opt_key, strategy, num_shards, rng):
    """TPU's layout (narrow rows packed into 128 lanes), forced on CPU: every export, slot and
    activation equal to the plain layout's (XLA may fuse the arithmetic differently: last-bit
    differences allowed)."""
    optimizer, _ = OPTIMIZERS[opt_key]
    spec = _features_and_spec(
        optimizer, strategy=strategy, table_optimizer=jte.Adam(0.1, lazy_adam=False)
    )
    plain = jte.Embedding(spec, make_mesh(num_shards), lane_width=0)
    packed = jte.Embedding(spec, make_mesh(num_shards), lane_width=128)
    s_plain, s_packed = plain.init(jax.random.key(0)), packed.init(jax.random.key(0))
    # 8 logical rows per physical row: D=5 and its slots' 5 lanes each (riders), padded to
    # a power of two.
    assert s_packed.tables["shared"].shape[1] == 128
    storage = packed.storage("shared")
    assert len(storage.riders) == {"adagrad": 1, "rowwise_adagrad": 0, "ftrl": 2}[opt_key]
    own = set() if storage.riders else {s.name for s in storage.slot_specs}  # Rank 1: own.
    assert set(s_packed.slots["shared"]) == own
    for _ in range(2):
        features = _inputs(rng)
        a_plain, a_packed = plain.lookup(s_plain, features), packed.lookup(s_packed, features)
        jax.tree.map(_close, a_plain, a_packed)
        grads = _grads(rng, a_plain)
        s_plain = plain.apply_gradients(s_plain, features, grads)
        before = packed.export(s_packed)["shared"]
        s_packed = packed.apply_gradients(s_packed, features, grads)
        touched = list(
            reference_row_grads(
                {"shared": before, "nested/mean": np.zeros((11, 3)), "weighted": np.zeros((20, 4))},
                features,
                grads,
            )["shared"]
        )
        untouched = np.setdiff1d(np.arange(37), touched)
        np.testing.assert_array_equal(
            packed.export(s_packed)["shared"][untouched], before[untouched]
        )  # Neighbours keep their bits.
        for name in plain.table_plans:
            _close(plain.export(s_plain)[name], packed.export(s_packed)[name])
            for k, v in plain.export_slots(s_plain)[name].items():
                _close(v, packed.export_slots(s_packed)[name][k])
            for p in range(num_shards):
                _close(plain.shard_rows(s_plain, name, p), packed.shard_rows(s_packed, name, p))
    # restore_tables takes logical rows back into the packed layout, riders included;
    # slots not given start at their initial values, as init draws them.
    back = packed.restore_tables(plain.export(s_plain), plain.export_slots(s_plain))
    fresh = packed.restore_tables(plain.export(s_plain), key=jax.random.key(0))
    initial = plain.export_slots(plain.init(jax.random.key(0)))
    for name in plain.table_plans:
        np.testing.assert_array_equal(packed.export(back)[name], plain.export(s_plain)[name])
        for k, v in plain.export_slots(s_plain)[name].items():
            np.testing.assert_array_equal(packed.export_slots(back)[name][k], v)
            np.testing.assert_array_equal(packed.export_slots(fresh)[name][k], initial[name][k])


def _close(a, b):
    # FTRL's powers amplify a last-bit difference over two steps to a few dozen ulps.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "backend,dim,optimizer,dtype",
    [
        pytest.param("pallas_interpret", 200, jte.Adam(0.05), jnp.float32, marks=pytest.mark.slow),
        pytest.param("xla", 136, jte.Adagrad(0.1), jnp.bfloat16, marks=pytest.mark.slow),
    ],
)
def test_rows_wider_than_the_lanes_are_stored_a_multiple_of_them_wide(
    backend, dim, optimizer, dtype
):
    """On TPU layouts a row wider than 128 lanes is stored padded to a multiple of 128
    (the TPU compiler copies a (rows, 200) array whole to another layout around every row
    gather): the padding lanes stay zero through updates, and lookups, rows and slots equal
    the unpadded layout's."""
    table = jte.TableConfig(37, dim, combiner="mean", name="t", optimizer=optimizer, dtype=dtype)
    features = {"f": jte.FeatureConfig(table)}
    spec = jte.EmbeddingSpec(features, None, partition_strategy="mod")
    plain = jte.Embedding(spec, make_mesh(4), backend=backend, lane_width=0)
    wide = jte.Embedding(spec, make_mesh(4), backend=backend, lane_width=128, tpu_layout=True)
    states = [e.init(jax.random.key(1)) for e in (plain, wide)]
    assert states[1].tables["t"].shape == (40, 256)
    assert all(x.shape == (40, 256) for x in jax.tree.leaves(states[1].slots["t"]))
    rng = np.random.default_rng(2)
    for _ in range(2):
        batch = {"f": rng.integers(-1, 37, (16, 4))}
        acts = [e.lookup(st, batch) for e, st in zip((plain, wide), states)]
        jax.tree.map(_close, *acts)
        grads = jax.tree.map(lambda a: jnp.sin(3 * a) + 0.1, acts[0])
        states = [e.apply_gradients(st, batch, grads) for e, st in zip((plain, wide), states)]
    for x in jax.tree.leaves((states[1].tables, states[1].slots)):
        np.testing.assert_array_equal(np.asarray(x, np.float32)[:, dim:], 0.0)
    jax.tree.map(
        lambda a, b: _close(np.asarray(a, np.float32), np.asarray(b, np.float32)),
        (plain.export(states[0]), plain.export_slots(states[0])),
        (wide.export(states[1]), wide.export_slots(states[1])),
    )


# Plain rows (lane_width 0) or packed as on a TPU mesh (128): each optimizer one of them,
# Adagrad both (test_lane_packed_layout_gives_identical_results compares the two layouts).
# The fast tier keeps plain rows in passes of ids (packed rows pass in other fast tests).
@pytest.mark.parametrize(
    "opt_key,strategy,num_shards,max_ids,max_unique,lane_width",
    [
        pytest.param("adagrad", "div", 4, 1, None, 0, marks=pytest.mark.slow),
        pytest.param("adagrad", "div", 4, 1, None, 128, marks=pytest.mark.slow),
        pytest.param("adam", "mod", 2, 3, 1, 128, marks=pytest.mark.slow),
        pytest.param("ftrl", "div", 8, 5, None, 0, marks=pytest.mark.slow),
        pytest.param("rowwise_adagrad", "mod", 4, None, 2, 128, marks=pytest.mark.slow),
        ("sgd", "div", 1, 2, None, 0),
        pytest.param("adagrad_momentum", "div", 1, None, 3, 128, marks=pytest.mark.slow),
    ],
)
def test_update_in_passes_matches_reference(
    opt_key, strategy, num_shards, max_ids, max_unique, lane_width, rng
):
    """The portable (TPU) path handles each shard's owned (id, position) pairs in passes of
    max_ids_per_shard pairs and max_unique_ids_per_shard distinct rows; with 1..5 a hot
    row's pairs span several passes and its gradient is carried over. Lookups and updates
    equal the reference; untouched rows and slots keep their bits."""
    optimizer, _ = OPTIMIZERS[opt_key]
    spec = _features_and_spec(optimizer, strategy=strategy)
    emb = jte.Embedding(
        spec,
        make_mesh(num_shards),
        backend="xla",
        lane_width=lane_width,
        max_ids_per_shard=max_ids,
        max_unique_ids_per_shard=max_unique,
        # As on a TPU mesh: packed rows, ids flattened column-major, sorted passes.
        tpu_layout=bool(lane_width),
    )
    assert emb.plan.on_tpu == bool(lane_width)
    _two_steps_match_reference(emb, spec, rng, jax.random.key(3))


@pytest.mark.parametrize(
    "opt_key,strategy,num_shards,keys",
    [
        pytest.param("adagrad", "div", 4, "packed", marks=pytest.mark.slow),
        pytest.param("ftrl", "mod", 2, "packed", marks=pytest.mark.slow),
        pytest.param("adagrad", "mod", 4, "separate", marks=pytest.mark.slow),
    ],
)
def test_fused_tpu_kernels_match_reference(opt_key, strategy, num_shards, keys, rng):
    """The fused Pallas lookup and update (_pallas, TPU meshes' default), run in Pallas'
    TPU interpreter on every input form at once, as on a TPU mesh (`tpu_layout`: ids
    flattened column-major): packed rows, shared tables, sequence features, weights, rank-1
    slots, gradient multiplier and clipping equal the float64 reference; untouched rows and
    slots keep their bits. Blocks of 8 pairs: rows carried from block to block, packed rows
    re-read after a write. Keys "packed" hold (row, output row) in one int32, as these
    small tables allow; "separate" gives the kernels an output-row array, as for tables too
    large to pack. (tests/test_optimizers.py runs every optimizer through them.)"""
    optimizer, _ = OPTIMIZERS[opt_key]
    spec = _features_and_spec(
        optimizer,
        strategy=strategy,
        wide=True,
        clipping_limit=0.9,
        gradient_multiplier_fn=lambda step: 1.5,
    )
    kernels = jte.backends.Pallas(interpret=True, block=8, pack_keys=keys == "packed")
    emb = jte.Embedding(spec, make_mesh(num_shards), backend=kernels, tpu_layout=True)
    assert set(emb.backends.values()) == {"pallas_interpret"}
    calls = emb.call_plans(_shapes(emb, _inputs(rng, wide=True)))
    assert {c.kernel for c in calls.values()} == {kernels}  # No call falls back.
    _two_steps_match_reference(
        emb,
        spec,
        rng,
        jax.random.key(5),
        wide=True,
        extras=dict(clipping_limit=0.9, multiplier=1.5),
    )


def _shapes(emb, features) -> dict:
    """{feature path: one device's (b, L)} of a global batch, as `call_plans` takes it."""
    out = {}
    for f in emb.feature_plans:
        leaf = _leaf(features, f.path)
        ids = np.asarray(leaf.ids if isinstance(leaf, jte.Weighted) else leaf)
        length = f.config.max_sequence_length or (ids.shape[1] if ids.ndim == 2 else 1)
        out[f.path] = (ids.shape[0] // emb.num_shards, length)
    return out


def test_pass_capacity():
    from jax_tpu_embed import _streams

    spec = _features_and_spec(jte.Adagrad(0.1))
    plan = jte.Embedding(spec, make_mesh(2), max_ids_per_shard={"shared": 100}).table_plans
    assert _streams.capacity(plan["shared"], 4096, 4) == 104  # Rounded up to 8.
    assert _streams.capacity(plan["shared"], 64, 4) == 64  # At most M.
    assert _streams.capacity(plan["weighted"], 4096, 4) == 4096  # CPU mesh: all M.
    # As on TPU meshes: 1.5 x M / N by default, the capacity the step's calls take.
    tpu_like = jte.Embedding(spec, make_mesh(4), backend="xla", tpu_layout=True)
    assert _streams.capacity(tpu_like.table_plans["weighted"], 4096, 4) == 1536
    assert _streams.capacity(tpu_like.table_plans["weighted"], 4096, 1) == 4096
    calls = tpu_like.call_plans({p: (256, 4) for p, _ in spec.flat_features})
    # 4 devices x 256 examples x 4 ids of "weighted": M = 4,096; "shared" has two features.
    assert calls["weighted"].capacity == 1536 and calls["shared"].capacity == 3072
    assert calls["weighted"].unique == 1536 and not calls["weighted"].single
    assert _streams.unique_capacity(plan["shared"], 104) == 104  # Default: C.
    plan = jte.Embedding(spec, make_mesh(2), max_unique_ids_per_shard=21).table_plans
    assert _streams.unique_capacity(plan["shared"], 104) == 24
    assert _streams.unique_capacity(plan["shared"], 16) == 16
    dense = jte.Embedding(
        _features_and_spec(jte.Adam(0.1, lazy_adam=False)),
        make_mesh(2),
        max_ids_per_shard=8,
        max_unique_ids_per_shard=8,
    ).table_plans
    assert _streams.capacity(dense["shared"], 4096, 4) == 4096  # Every row: one pass.
    assert _streams.unique_capacity(dense["shared"], 4096) == 4096


@pytest.mark.parametrize(
    "value,match",
    [
        (0, "max_ids_per_shard for table '.*' must be a positive int, got 0"),
        ({"nope": 8}, r"names \['nope'\], which are not tables"),
        ({"shared": 2.5}, "table 'shared' must be a positive int, got 2.5"),
        (True, "must be a positive int, got True"),
    ],
)
def test_bad_max_ids_per_shard(value, match):
    with pytest.raises(ValueError, match=match):
        jte.Embedding(_features_and_spec(jte.SGD(0.1)), make_mesh(2), max_ids_per_shard=value)
    with pytest.raises(ValueError, match=match.replace("max_ids", "max_unique_ids")):
        jte.Embedding(
            _features_and_spec(jte.SGD(0.1)), make_mesh(2), max_unique_ids_per_shard=value
        )


def test_id_counts_and_passes(rng):
    """id_counts against a per-shard count written out here ("mod": shard = id % N), and
    the pass count it predicts against a hand-worked case."""
    from jax_tpu_embed._streams import passes_needed

    spec = _features_and_spec(jte.Adagrad(0.1), strategy="mod")
    features = _inputs(rng)
    emb = jte.Embedding(
        spec, make_mesh(4), backend="xla", max_ids_per_shard=4, max_unique_ids_per_shard=2
    )
    got = emb.id_counts(features)
    shared = np.concatenate([features["multi"].ravel(), features["one"].ravel()])
    per_shard = [shared[(shared >= 0) & (shared % 4 == p)] for p in range(4)]
    assert got["shared"]["pairs"] == shared.size
    assert got["shared"]["owned_pairs"] == max(len(x) for x in per_shard)
    assert got["shared"]["unique_rows"] == max(len(np.unique(x)) for x in per_shard)
    # C = 8 (4 rounded up), Cu = 8: at least owned / 8 passes.
    assert got["shared"]["passes"] >= -(-got["shared"]["owned_pairs"] // 8)
    assert set(got) == {"shared", "nested/mean", "weighted"}
    # Rows a..d with 5, 1, 1, 3 pairs; C = 4, Cu = 2: [4 of a] [last of a, b] [c, all 3 of d].
    assert passes_needed(np.array([5, 1, 1, 3]), 4, 2) == 3
    assert passes_needed(np.array([5, 1, 1, 4]), 4, 2) == 4  # d's last pair spills over.
    assert passes_needed(np.array([5, 1, 1, 3]), 16, 16) == 1
    assert passes_needed(np.array([1] * 10), 16, 3) == 4


@pytest.mark.slow  # Several Pallas-interpret compiles; the kernels' own tests stay fast.
def test_pallas_choice_and_fallback(rng):
    """Which tables the Pallas kernels take: float32 and bfloat16 tables with a sparse
    update; a batch whose activations overflow half of the chip's VMEM runs the XLA passes,
    with the same results."""
    from jax_tpu_embed import _pallas

    assert _pallas.vmem_bytes("TPU v5") == 64 << 20  # v5p
    assert _pallas.vmem_bytes("TPU v5 lite") == 128 << 20  # v5e
    assert _pallas.vmem_bytes("TPU v4") == 16 << 20
    assert _pallas.vmem_bytes("cpu") == 16 << 20  # Unknown: the smallest.
    # 4,096 lane-dense rows of 128 f32 lanes: 2 MiB, half of 4 MiB.
    assert _pallas.fits_vmem(4096, 128, 4 << 20) and not _pallas.fits_vmem(4097, 128, 4 << 20)
    assert _pallas.fits_vmem(4096, 64, 4 << 20)  # Lanes pad to 128 in VMEM.

    spec = _features_and_spec(jte.Adagrad(0.2), wide=True)
    emb = jte.Embedding(spec, make_mesh(2), backend="pallas_interpret")
    assert emb.lane_width == 128  # The kernels' layout by default.
    with pytest.raises(
        ValueError,
        match=r"table 'shared' cannot use backend "
        r"'pallas_interpret': Adam\(lazy_adam=False\)",
    ):
        jte.Embedding(
            _features_and_spec(jte.Adam(0.1, lazy_adam=False)),
            make_mesh(2),
            backend="pallas_interpret",
        )
    # A chip with too little VMEM for the batch's activations: the XLA passes, said in the
    # call plans and run (no Pallas kernel in the step), with the same results.
    small = jte.Embedding(
        spec, make_mesh(2), backend=jte.backends.Pallas(interpret=True, vmem=2 << 10)
    )
    assert small.backends == emb.backends  # What was asked; the call plans say what runs.
    features = _inputs(rng, wide=True)
    shapes = _shapes(emb, features)
    for key, call in emb.call_plans(shapes).items():
        assert call.kernel.name == "pallas_interpret" and call.fallback is None, key
        assert call.single
    for key, call in small.call_plans(shapes).items():
        assert call.kernel.name == "xla" and not call.single, key
        assert "do not fit the pallas_interpret kernels' memory (2048 bytes)" in str(call.fallback)
    state = emb.init(jax.random.key(1))
    lookup = lambda e: jax.make_jaxpr(lambda s: e.lookup(s, features))(state)
    assert count_primitive(lookup(emb).jaxpr, "pallas_call") > 0
    assert count_primitive(lookup(small).jaxpr, "pallas_call") == 0
    acts, acts_small = emb.lookup(state, features), small.lookup(state, features)
    grads = _grads(rng, acts)
    for path, *_ in _FEATURES:
        np.testing.assert_allclose(_leaf(acts_small, path), _leaf(acts, path), rtol=1e-6, atol=1e-6)
    a = emb.export(emb.apply_gradients(jax.tree.map(jnp.copy, state), features, grads))
    b = small.export(small.apply_gradients(state, features, grads))
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-7)
    assert emb.id_counts(features)["shared"]["passes"] == 1


def test_backend_choice():
    """backend= picks each table's backend once, publicly; "auto" takes what a table can
    use; a backend a table cannot use is refused, naming the table and the reason; the
    deprecated cpu_kernels= / tpu_kernels= map onto the same choice."""
    from jax_tpu_embed import _cpu_kernels

    mixed = jte.EmbeddingSpec(
        {
            "a": jte.FeatureConfig(jte.TableConfig(10, 4, name="f32")),
            "b": jte.FeatureConfig(jte.TableConfig(10, 4, name="bf16", dtype=jnp.bfloat16)),
        },
        jte.Adagrad(0.1),
    )
    cpu = "cpu" if _cpu_kernels.available() else "xla"
    assert jte.Embedding(mixed, make_mesh(2)).backends == {"f32": cpu, "bf16": cpu}
    assert jte.Embedding(mixed, make_mesh(2), backend="xla").backends == {
        "f32": "xla",
        "bf16": "xla",
    }
    assert jte.Embedding(mixed, make_mesh(2), backend={"f32": "pallas_interpret"}).backends == {
        "f32": "pallas_interpret",
        "bf16": "xla",
    }
    # The kernels take bfloat16 tables too (tests/test_bf16.py, tests/test_tpu_compile.py).
    assert jte.Embedding(mixed, make_mesh(2), backend="pallas_interpret").backends == {
        "f32": "pallas_interpret",
        "bf16": "pallas_interpret",
    }
    with pytest.raises(
        ValueError,
        match="table 'f32' cannot use backend 'pallas': it needs a "
        "TPU mesh and this one is on 'cpu'",
    ):
        jte.Embedding(mixed, make_mesh(2), backend={"f32": "pallas"})
    with pytest.raises(
        ValueError, match="cannot use backend 'cpu': the C.. kernels take unpacked|'cpu': its C"
    ):
        jte.Embedding(mixed, make_mesh(2), backend={"bf16": "cpu"}, lane_width=128)
    with pytest.raises(
        ValueError,
        match=r"backend must be one of \['auto', 'xla', 'pallas', "
        r"'pallas_interpret', 'cpu'\].*got 'gpu'",
    ):
        jte.Embedding(mixed, make_mesh(2), backend="gpu")
    with pytest.raises(ValueError, match=r"backend names \['nope'\], which are not tables"):
        jte.Embedding(mixed, make_mesh(2), backend={"nope": "xla"})
    with pytest.warns(DeprecationWarning, match="use backend="):
        legacy = jte.Embedding(mixed, make_mesh(2), cpu_kernels=False)
    assert legacy.backends == {"f32": "xla", "bf16": "xla"}
    with pytest.warns(DeprecationWarning):
        legacy = jte.Embedding(mixed, make_mesh(2), tpu_kernels="interpret", lane_width=128)
    assert legacy.backends == {"f32": "pallas_interpret", "bf16": "pallas_interpret"}
    with (
        pytest.raises(
            ValueError, match="tpu_kernels must be None, True, False or 'interpret', got 'yes'"
        ),
        pytest.warns(DeprecationWarning),
    ):
        jte.Embedding(mixed, make_mesh(2), tpu_kernels="yes")
    with (
        pytest.raises(ValueError, match="tpu_kernels=True needs a TPU mesh; this one is on 'cpu'"),
        pytest.warns(DeprecationWarning),
    ):
        jte.Embedding(mixed, make_mesh(2), tpu_kernels=True)
    with pytest.raises(ValueError, match="pass backend= or the deprecated"):
        jte.Embedding(mixed, make_mesh(2), backend="xla", cpu_kernels=False)


@pytest.mark.parametrize(
    "opt_key",
    [pytest.param(k, marks=pytest.mark.slow) for k in ("adagrad", "rowwise_adagrad")] + ["adam"],
)
def test_packed_bfloat16_update_is_bit_identical_to_plain(opt_key, rng):
    """Packed rows are read and written through their raw bits: a bfloat16 table (with -0.0
    entries, which a float sum with zeros would turn into +0.0) and its slots come out of
    the packed layout bit for bit as out of the plain one."""
    table = jte.TableConfig(40, 5, combiner="sum", name="t", dtype=jnp.bfloat16)
    spec = jte.EmbeddingSpec({"a": jte.FeatureConfig(table)}, OPTIMIZERS[opt_key][0])
    start = rng.normal(size=(40, 5)).astype(np.float32)
    start[:, ::2] = -0.0
    ids = rng.integers(0, 12, (16, 3)).astype(np.int32)
    grads = {"a": rng.normal(size=(16, 5)).astype(np.float32)}
    out = []
    for lanes in (0, 128):
        emb = jte.Embedding(spec, make_mesh(4), lane_width=lanes, backend="xla")
        state = emb.restore_tables({"t": start.astype(jnp.bfloat16)})
        state = emb.apply_gradients(state, {"a": ids}, grads)
        out.append((emb.export(state)["t"], emb.export_slots(state)["t"]))
    assert out[0][0].dtype == jnp.bfloat16
    assert np.signbit(out[1][0][12:, ::2]).all()  # Untouched rows (ids < 12) keep -0.0.
    np.testing.assert_array_equal(out[0][0].view(np.uint16), out[1][0].view(np.uint16))
    for name, value in out[0][1].items():
        np.testing.assert_array_equal(value, out[1][1][name])


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_eager_update_donates_the_state(backend, rng):
    """An eager apply_gradients updates the given state's buffers in place (no O(V) copy of
    every table and slot per call), and the given state is consumed."""
    table = jte.TableConfig(4_000, 8, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
    emb = jte.Embedding(spec, make_mesh(2), backend=backend)
    state = emb.init(jax.random.key(0))
    before, slots = emb.export(state)["t"], emb.export_slots(state)["t"]

    def pointers(s):
        return [
            piece.data.unsafe_buffer_pointer()
            for x in jax.tree.leaves((s.tables, s.slots))
            for piece in x.addressable_shards
        ]

    old = pointers(state)
    ids = rng.integers(0, 40, (16, 3)).astype(np.int32)
    grads = {"f": rng.normal(size=(16, 8)).astype(np.float32)}
    new = emb.apply_gradients(state, {"f": ids}, grads)
    assert pointers(new) == old
    assert all(x.is_deleted() for x in jax.tree.leaves((state.tables, state.slots)))
    row_grads = reference.row_gradients(4_000, [(ids, None, "sum", 0, grads["f"])])
    want, _ = reference.apply("adagrad", {}, before, slots, row_grads, 0.1)
    np.testing.assert_allclose(emb.export(new)["t"], want, rtol=2e-5, atol=2e-6)


def test_init_is_the_same_for_every_block_size_mesh_strategy_and_layout():
    """`init` draws rows in blocks on their own shards: the logical values depend on none of
    the block size, the mesh, the strategy or the lane layout."""
    ref = None
    for block_bytes in (4 << 20, 1):  # One block per array; the smallest blocks (1,024 rows).
        for strategy, n, lanes in [("div", 1, 0), ("mod", 3, 0), ("div", 8, 128), ("mod", 2, 128)]:
            t = jte.TableConfig(5_003, 8, combiner="sum", name="t")
            r = jte.TableConfig(2_500, 4, combiner="sum", name="r", dtype=jnp.bfloat16)
            spec = jte.EmbeddingSpec(
                {"t": jte.FeatureConfig(t), "r": jte.FeatureConfig(r, max_sequence_length=2)},
                jte.FTRL(0.1, initial_accumulator_value=0.25),
                partition_strategy=strategy,
            )
            emb = jte.Embedding(spec, make_mesh(n), lane_width=lanes, init_block_bytes=block_bytes)
            state = emb.init(jax.random.key(3))
            got = (emb.export(state), emb.export_slots(state))
            for name, table in state.tables.items():  # Padding rows stay zero.
                storage = emb.storage(name)
                want = storage.to_physical(got[0][name], got[1][name])[0]
                np.testing.assert_array_equal(np.asarray(table), want)
            if ref is None:
                ref = got
                continue
            for name in ref[0]:
                np.testing.assert_array_equal(got[0][name], ref[0][name])
                np.testing.assert_array_equal(got[1][name]["accumulators"], np.float32(0.25))
                np.testing.assert_array_equal(got[1][name]["linears"], np.float32(0.0))
    table = ref[0]["t"].astype(np.float64)
    assert np.abs(table).max() <= 2 / np.sqrt(8) + 1e-6  # Cut at 2 stddev.
    assert 0.85 / np.sqrt(8) < table.std() < 0.9 / np.sqrt(8)  # 0.88 stddev after the cut.
    assert abs(table.mean()) < 0.01 and len(np.unique(table)) > 0.99 * table.size


@pytest.mark.parametrize("placement", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_row_initializers_are_drawn_in_blocks_as_called_whole(placement):
    """`jte.initializers` draw each element from (table key, row, column) alone, so `init`
    draws them in blocks on the shards that own the rows (in host memory for host tables,
    which may exceed the devices' memory) and gets what calling them with the logical
    shape gives (in a jitted call: run op by op, outside jit, XLA rounds some products and
    sums apart where a compiled program fuses them), on every mesh, strategy and lane
    layout and for any block size. Their distributions against float64 expectations;
    `truncated_normal()` is the default."""
    inits = {
        "n": jte.initializers.normal(stddev=0.5, mean=1.0),
        "u": jte.initializers.uniform(-3.0, -1.0),
        "t": jte.initializers.truncated_normal(stddev=0.2),
        "c": jte.initializers.constant(0.75),
        "d": jte.initializers.truncated_normal(),
        "plain": None,
    }
    tables = {
        k: jte.TableConfig(
            3_001, 8 if k != "n" else 16, combiner="sum", name=k, initializer=i, placement=placement
        )
        for k, i in inits.items()
    }
    spec = jte.EmbeddingSpec({k: jte.FeatureConfig(t) for k, t in tables.items()}, jte.Adagrad(0.1))
    key = jax.random.key(7)
    ref = None
    for strategy, n, lanes, block_bytes in [
        ("div", 1, 0, 1 << 20),
        ("mod", 4, 128, 1),
        ("div", 2, 0, 1),
    ]:
        emb = jte.Embedding(
            dataclasses.replace(spec, partition_strategy=strategy),
            make_mesh(n),
            lane_width=lanes,
            init_block_bytes=block_bytes,
            backend="xla",
        )
        assert all(emb.initializer._blocked(k) for k in inits)  # None is drawn in blocks too.
        got = emb.export(emb.init(key))
        if ref is None:
            keys = emb.initializer.table_keys(key)
            default = jte.initializers.truncated_normal()
            whole = {k: jax.jit(i or default, static_argnums=1) for k, i in inits.items()}
            ref = {k: np.asarray(f(keys[k], (3_001, tables[k].dim))) for k, f in whole.items()}
        for k in inits:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{k} {strategy} {n}")
    x = {k: v.astype(np.float64) for k, v in ref.items()}
    assert abs(x["n"].mean() - 1.0) < 0.02 and abs(x["n"].std() - 0.5) < 0.02
    assert x["u"].min() >= -3.0 and x["u"].max() < -1.0 and abs(x["u"].mean() + 2.0) < 0.02
    assert np.abs(x["t"]).max() <= 0.4 + 1e-6 and abs(x["t"].std() - 0.88 * 0.2) < 0.01
    assert (x["c"] == 0.75).all() and len(np.unique(x["n"])) > 0.99 * x["n"].size


def test_init_blocks_count_narrow_rows_as_padded_to_the_lanes():
    """A round of `init` draws about `init_block_bytes` (1 MiB by default) per device, a
    row counted as the draw holds it: on TPU layouts a row narrower than the lanes pads
    to them, so a D = 16 table's round is 2,048 rows there and 16,384 elsewhere. (The TPU
    compiler took 5 to 9 s to generate a round of 8,000 rows or more; docs/design.md.)"""
    table = jte.TableConfig(200_000, 16, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.SGD(0.1))
    for lanes, rows in ((0, 16_384), (128, 2_048)):
        emb = jte.Embedding(spec, make_mesh(2), lane_width=lanes)
        rounds, _, logical, _, block, _ = emb.initializer.blocks(("t",))
        assert logical[0] == 100_000 and rounds == -(-100_000 // rows), (lanes, rounds)
        assert block[0] <= rows and block[0] * rounds >= 100_000, (lanes, block)


@pytest.mark.slow
def test_init_draws_every_table_in_one_computation():
    """26 tables of two widths (the demo's count): `init`'s program draws them with one
    computation per width, in several rounds, and every table and slot is bit for bit what
    the table's own program gives."""
    rng = np.random.default_rng(11)
    tables = [
        jte.TableConfig(int(v), 8 if i % 3 else 4, combiner="sum", name=f"t{i}")
        for i, v in enumerate(rng.choice([64, 300, 1_000, 4_099], size=26))
    ]
    spec = jte.EmbeddingSpec(
        {t.name: jte.FeatureConfig(t) for t in tables},
        jte.FTRL(0.1, initial_accumulator_value=0.5),
        partition_strategy="mod",
    )
    # Routed to their owners, so that the tables are drawn into stacks.
    emb = jte.Embedding(spec, make_mesh(4), routing="owner", init_block_bytes=64 << 10)
    key = jax.random.key(5)
    keys = emb.initializer.table_keys(key)
    program, per_table = emb.initializer.blocked_program()
    jaxpr = jax.make_jaxpr(program)(keys, per_table).jaxpr
    assert count_primitive(jaxpr, "erf_inv") == 2
    assert emb.initializer.blocks(tuple(emb.table_plans))[0] > 1
    state = emb.init(key)
    assert len(state.tables) == 2  # The dim-8 tables in one stack, the dim-4 ones in another.
    tables, table_slots = emb.table_arrays(state)
    for name, fn in emb.init_programs().items():
        table, slots = fn(keys[name])
        np.testing.assert_array_equal(np.asarray(tables[name]), np.asarray(table))
        for slot, value in slots.items():
            np.testing.assert_array_equal(np.asarray(table_slots[name][slot]), np.asarray(value))
    assert len(np.unique(emb.export(state)["t0"])) > 0.99 * emb.export(state)["t0"].size


def test_layout_id_steps_match_global_ids():
    for strategy in ("div", "mod"):
        layout = (
            jte.Embedding(
                jte.EmbeddingSpec(
                    {"f": jte.FeatureConfig(jte.TableConfig(103, 2, name="t"))},
                    jte.SGD(0.1),
                    partition_strategy=strategy,
                ),
                make_mesh(4),
            )
            .storage("t")
            .layout
        )
        first, stride = layout.id_steps()
        local = np.arange(layout.rows_per_shard)
        for shard in range(4):
            want = np.asarray(layout.global_ids(shard, local))
            np.testing.assert_array_equal(first[shard] + stride * local, want)


_RSS_SCRIPT = """
import resource, sys
import jax, jax_tpu_embed as jte
t = jte.TableConfig(1_000_000, 64, combiner="sum", name="t")
emb = jte.Embedding(jte.EmbeddingSpec({"f": jte.FeatureConfig(t)}, jte.Adagrad(0.1)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
state = jax.block_until_ready(emb.init(jax.random.key(0)))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(peak - before, sum(x.nbytes for x in jax.tree.leaves((state.tables, state.slots))))
"""


@pytest.mark.slow  # A subprocess of its own.
def test_init_peak_memory_is_about_the_state():
    """A 1M x 64 Adagrad table (512 MB of state with its slot): init's peak RSS grows by at
    most 1.2 x the state + 256 MB (one logical copy and the physical one, or more, before)."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    grown, state = map(int, out.stdout.split())
    assert state == 2 * 1_000_000 * 64 * 4
    assert grown <= 1.2 * state + (256 << 20), (grown / 2**20, state / 2**20)
