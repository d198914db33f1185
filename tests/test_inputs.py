"""Input forms, validation messages, invalid ids under jit, global jax.Array inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
import reference
from conftest import make_mesh


def _spec(**kw):
    t = jte.TableConfig(10, 4, combiner="sum", name="t")
    s = jte.TableConfig(6, 2, combiner="mean", name="s")
    return jte.EmbeddingSpec(
        {"a": jte.FeatureConfig(t), "g": {"b": jte.FeatureConfig(s, max_sequence_length=3)}},
        jte.SGD(0.5),
        **kw,
    )


def test_pad_ragged_lengths_splits_weights_truncation():
    values = [5, 1, 2, 7, 7, 3]
    ids = jte.pad_ragged(values, row_lengths=[2, 0, 4])
    np.testing.assert_array_equal(ids, [[5, 1, -1, -1], [-1, -1, -1, -1], [2, 7, 7, 3]])
    same = jte.pad_ragged(values, row_splits=[0, 2, 2, 6])
    np.testing.assert_array_equal(ids, same)
    w = jte.pad_ragged(values, row_lengths=[2, 0, 4], weights=[1, 2, 3, 4, 5, 6], max_length=3)
    assert isinstance(w, jte.Weighted)
    np.testing.assert_array_equal(w.ids, [[5, 1, -1], [-1, -1, -1], [2, 7, 7]])
    np.testing.assert_array_equal(w.weights, [[1, 2, 0], [0, 0, 0], [3, 4, 5]])
    empty = jte.pad_ragged([], row_lengths=[0, 0])
    assert isinstance(empty, np.ndarray) and empty.shape == (2, 1)  # At least one column.


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(), "exactly one of row_lengths and row_splits"),
        (dict(row_lengths=[1, 1], row_splits=[0, 1, 2]), "exactly one"),
        (dict(row_lengths=[1, 2]), "sum to len\\(values\\)=2"),
        (dict(row_splits=[0, 3]), "row_splits must be non-decreasing"),
        (dict(row_lengths=[1, 1], max_length=0), "max_length must be an int >= 1"),
        (dict(row_lengths=[1, 1], weights=[1.0]), "weights must match"),
    ],
)
def test_pad_ragged_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        jte.pad_ragged([1, 2], **kw)


@pytest.mark.parametrize(
    "features,match",
    [
        (
            {"a": np.array([1, 10, 3, -1]), "g": {"b": np.zeros((4, 2), np.int32)}},
            r"Feature 'a': id 10 at position \[1\] is outside \[0, 10\) of table 't'",
        ),
        (
            {"a": np.array([1, 2, 3, 4]), "g": {"b": np.array([[0, 1], [2, -3], [0, 0], [1, 9]])}},
            r"Feature 'g/b': id -3 at position \[1, 1\] is outside \[0, 6\) of table 's' "
            r"\(2 invalid ids in all\)",
        ),
        (
            {"a": np.array([1.0, 2, 3, 4]), "g": {"b": np.zeros((4, 2), np.int32)}},
            "Feature 'a': ids have dtype float64; they must have a signed integer dtype",
        ),
        (
            {"a": np.zeros((4, 2, 2), np.int32), "g": {"b": np.zeros((4, 2), np.int32)}},
            r"Feature 'a': ids must be \(B,\) or \(B, L\)",
        ),
        (
            {"a": np.zeros(4, np.int32), "g": {"b": np.zeros((6, 2), np.int32)}},
            "all features must have the same batch size",
        ),
        (
            {"a": np.zeros(6, np.int32), "g": {"b": np.zeros((6, 2), np.int32)}},
            "batch size B=6 must be a multiple of the mesh size 4",
        ),
        ({"a": np.zeros(4, np.int32)}, r"missing features \['g/b'\]"),
        (
            {
                "a": np.zeros(4, np.int32),
                "g": {"b": np.zeros((4, 2), np.int32)},
                "c": np.zeros(4, np.int32),
            },
            r"unknown features \['c'\]",
        ),
        (
            {
                "a": jte.Weighted(np.zeros((4, 2), np.int32), np.ones((4, 3), np.float32)),
                "g": {"b": np.zeros((4, 2), np.int32)},
            },
            "weights shape \\(4, 3\\) differs",
        ),
        (
            {
                "a": jte.Weighted(np.zeros((4, 2), np.int32), np.ones((4, 2), np.int32)),
                "g": {"b": np.zeros((4, 2), np.int32)},
            },
            "weights must be floats",
        ),
    ],
)
def test_validation_messages(features, match):
    emb = jte.Embedding(_spec(), make_mesh(4))
    state = emb.init(jax.random.key(0))
    with pytest.raises(ValueError, match=match):
        emb.validate(features)
    with pytest.raises(ValueError, match=match):  # lookup validates NumPy inputs itself.
        emb.lookup(state, features)


def test_validation_reports_every_problem_at_once():
    emb = jte.Embedding(_spec(), make_mesh(1))
    with pytest.raises(ValueError) as e:
        emb.validate({"a": np.array([11, 0]), "g": {"b": np.array([[7, 0], [0, 0]])}})
    assert "Feature 'a'" in str(e.value) and "Feature 'g/b'" in str(e.value)


def test_ids_past_max_sequence_length_are_checked_too():
    emb = jte.Embedding(_spec(), make_mesh(1))
    with pytest.raises(ValueError, match=r"id 99 at position \[0, 4\]"):
        emb.validate({"a": np.array([1]), "g": {"b": np.array([[1, 2, 3, -1, 99]])}})


def test_invalid_ids_under_jit_behave_like_padding(rng):
    # "mod": an unmasked id >= V has an owner there (id % N) and a local row past the
    # shard's; with "div" its owner is past the last shard, which hides a missing mask.
    emb = jte.Embedding(_spec(partition_strategy="mod"), make_mesh(2))
    state = emb.init(jax.random.key(0))
    bad = {
        "a": np.array([[1, 10], [-5, 2]], np.int32),
        "g": {"b": np.array([[0, 6, 1], [-2, 3, 99]], np.int32)},
    }
    clean = {
        "a": np.array([[1, -1], [-1, 2]], np.int32),
        "g": {"b": np.array([[0, -1, 1], [-1, 3, -1]], np.int32)},
    }
    look = jax.jit(emb.lookup)
    np.testing.assert_array_equal(look(state, bad)["a"], look(state, clean)["a"])
    np.testing.assert_array_equal(look(state, bad)["g"]["b"], look(state, clean)["g"]["b"])
    counts = jax.jit(emb.invalid_id_counts)(bad)
    assert {k: int(v) for k, v in counts.items()} == {"a": 2, "g/b": 3}
    grads = {"a": np.ones((2, 4), np.float32), "g": {"b": np.ones((2, 3, 2), np.float32)}}
    upd = jax.jit(emb.apply_gradients)
    got, want = upd(state, bad, grads), upd(state, clean, grads)
    for name in ["t", "s"]:
        np.testing.assert_array_equal(emb.export(got)[name], emb.export(want)[name])
    before = emb.export(state)["t"]
    after = emb.export(got)["t"]
    np.testing.assert_array_equal(after[[0, 3, 4, 5, 6, 7, 8, 9]], before[[0, 3, 4, 5, 6, 7, 8, 9]])


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_global_jax_array_inputs_match_numpy(kind, rng):
    mesh = make_mesh(4, kind)
    emb = jte.Embedding(_spec(partition_strategy="mod"), mesh)
    state = emb.init(jax.random.key(0))
    a = rng.integers(-1, 10, (8, 3)).astype(np.int32)
    b = rng.integers(-1, 6, (8, 2)).astype(np.int32)
    wa = rng.uniform(0.5, 1.5, (8, 3)).astype(np.float32)
    batch = NamedSharding(mesh, P("shard"))
    arrays = {
        "a": jte.Weighted(
            jax.make_array_from_process_local_data(batch, a),
            jax.make_array_from_process_local_data(batch, wa),
        ),
        "g": {"b": jax.make_array_from_process_local_data(batch, b)},
    }
    numpy = {"a": jte.Weighted(a, wa), "g": {"b": b}}
    got, want = emb.lookup(state, arrays), emb.lookup(state, numpy)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    tables = emb.export(state)
    np.testing.assert_allclose(got["a"], reference.lookup(tables["t"], a, wa, "sum"), rtol=1e-5)
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), want)
    g_arrays = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(NamedSharding(mesh, P("shard")), x), grads
    )
    step = jax.jit(emb.apply_gradients)
    s1, s2 = step(state, arrays, g_arrays), emb.apply_gradients(state, numpy, grads)
    for name in ["t", "s"]:
        np.testing.assert_array_equal(emb.export(s1)[name], emb.export(s2)[name])


def test_output_shape_reshapes_activation_and_gradient(rng):
    t = jte.TableConfig(10, 4, combiner="sum")
    spec = jte.EmbeddingSpec(
        {
            "f": jte.FeatureConfig(t, output_shape=(4, 2)),
            "s": jte.FeatureConfig(t, max_sequence_length=2, output_shape=(16,)),
        },
        jte.SGD(1.0),
    )
    emb = jte.Embedding(spec, make_mesh(2, "auto"))
    state = emb.init(jax.random.key(0))
    ids = rng.integers(0, 10, (8, 2)).astype(np.int32)
    acts = emb.lookup(state, {"f": ids, "s": ids})
    assert acts["f"].shape == (4, 2, 4) and acts["s"].shape == (16, 4)
    table = emb.export(state)["f"]
    np.testing.assert_allclose(
        np.asarray(acts["f"]).reshape(8, 4), reference.lookup(table, ids, None, "sum"), rtol=1e-5
    )
    grads = {"f": np.ones((4, 2, 4), np.float32), "s": np.zeros((16, 4), np.float32)}
    state = emb.apply_gradients(state, {"f": ids, "s": ids}, grads)  # Consumes the old one.
    new = emb.export(state)["f"]
    counts = np.bincount(ids.ravel(), minlength=10)
    np.testing.assert_allclose(new, table - counts[:, None], rtol=1e-5, atol=1e-6)
    with pytest.raises(
        ValueError, match="output_shape \\(4, 2\\) has 8 outputs, but the batch gives 4"
    ):
        emb.lookup(state, {"f": ids[:4], "s": ids[:4]})
    with pytest.raises(ValueError, match=r"act_grads\['f'\] has shape \(8, 4\)"):
        emb.apply_gradients(
            state, {"f": ids, "s": ids}, {"f": np.ones((8, 4), np.float32), "s": grads["s"]}
        )


def test_lookup_and_update_trace_once(rng):
    emb = jte.Embedding(_spec(), make_mesh(4))
    state = emb.init(jax.random.key(0))
    traces = []

    def step(state, features):
        traces.append(1)
        acts = emb.lookup(state, features)
        grads = jax.tree.map(jnp.ones_like, acts)
        return emb.apply_gradients(state, features, grads)

    step = jax.jit(step, donate_argnums=0)
    for _ in range(3):
        features = {
            "a": rng.integers(0, 10, (8,)).astype(np.int32),
            "g": {"b": rng.integers(-1, 6, (8, 5)).astype(np.int32)},
        }
        state = step(state, features)
    assert len(traces) == 1
    assert int(state.step) == 3


# ----------------------------------------------- invalid ids on the jitted training path

_B = 16
# Ids that must act as -1: at and past V, far past it, negative ones other than -1.
_INVALID = {
    "t": [37, 38, 77, 37 * 8 + 5, 2**31 - 1, -5, -(2**31)],
    "s": [11, 12, 25, 11 * 8 + 3, 2**31 - 1, -5, -(2**31)],
}
_LR = {"t": 0.4, "s": 0.3}


def _invalid_ids_spec(strategy):
    """Mean and sqrtn combiners, weights, a sequence feature (ids past its length are
    dropped) and a one-hot feature; Adagrad's (D,) slot rides in the table's rows when lanes
    are packed, RowwiseAdagrad's scalar one is packed 128 rows to a physical row."""
    t = jte.TableConfig(37, 4, combiner="mean", name="t", optimizer=jte.Adagrad(_LR["t"]))
    s = jte.TableConfig(
        11, 3, combiner="sqrtn", name="s", optimizer=jte.RowwiseAdagrad(_LR["s"], epsilon=1e-3)
    )
    return jte.EmbeddingSpec(
        {
            "m": jte.FeatureConfig(t),
            "w": jte.FeatureConfig(t),
            "q": jte.FeatureConfig(s),
            "seq": jte.FeatureConfig(s, max_sequence_length=3),
            "o": jte.FeatureConfig(s),
        },
        jte.SGD(0.1),
        partition_strategy=strategy,
    )


# (table, shape, weighted, combiner, max_sequence_length) of each feature.
_FEATURES = {
    "m": ("t", (_B, 3), False, "mean", 0),
    "w": ("t", (_B, 2), True, "mean", 0),
    "q": ("s", (_B, 4), False, "sqrtn", 0),
    "seq": ("s", (_B, 4), False, "", 3),
    "o": ("s", (_B,), False, "sqrtn", 0),
}


def _with_invalid_ids(rng):
    """(bad, clean, planted): features with invalid ids at random places, the same with -1
    there, and how many were planted per feature. Valid ids skip every third row, so that
    rows no valid id touches are there to be checked."""
    bad, clean, planted = {}, {}, {}
    for path, (table, shape, weighted, _, _) in _FEATURES.items():
        vocab = {"t": 37, "s": 11}[table]
        ids = rng.choice([-1] + [r for r in range(vocab) if r % 3], shape)
        where = rng.random(shape) < 0.3
        where.flat[0] = True  # At least one in every feature.
        ids = np.where(where, rng.choice(_INVALID[table], shape), ids).astype(np.int32)
        fixed = np.where(where, -1, ids).astype(np.int32)
        planted[path] = int(where.sum())
        if weighted:
            weights = rng.uniform(0.5, 2.0, shape).astype(np.float32)
            ids, fixed = jte.Weighted(ids, weights), jte.Weighted(fixed, weights)
        bad[path], clean[path] = ids, fixed
    return bad, clean, planted


def _ref_lookup(tables, clean):
    out = {}
    for path, (table, _, weighted, combiner, seq) in _FEATURES.items():
        ids, weights = clean[path] if weighted else (clean[path], None)
        out[path] = reference.lookup(
            tables[table],
            np.asarray(ids),
            None if weights is None else np.asarray(weights),
            combiner or "sum",
            seq,
        )
    return out


def _on_devices(mesh, tree):
    """Global jax.Arrays split over the batch: Embedding does not validate them on the
    host, so invalid ids reach the devices."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("shard"))), tree)


def _assert_lookup_matches(acts, want):
    for path, w in want.items():
        np.testing.assert_allclose(
            np.asarray(acts[path], np.float64), w, rtol=2e-6, atol=2e-6, err_msg=path
        )


def _ref_update(tables, slots, clean, grads):
    """The float64 reference of one sparse step: (tables, slots, rows touched)."""
    out_tables, out_slots, touched = {}, {}, {}
    for name, opt, hp in (("t", "adagrad", {}), ("s", "rowwise_adagrad", {"epsilon": 1e-3})):
        contributions = []
        for path, (table, _, weighted, combiner, seq) in _FEATURES.items():
            if table == name:
                ids, weights = clean[path] if weighted else (clean[path], None)
                contributions.append((ids, weights, combiner or "sum", seq, grads[path]))
        by_row = reference.row_gradients(tables[name].shape[0], contributions)
        out_tables[name], out_slots[name] = reference.apply(
            opt, hp, tables[name], slots[name], by_row, _LR[name]
        )
        touched[name] = np.isin(np.arange(tables[name].shape[0]), list(by_row))
    return out_tables, out_slots, touched


# Each mesh size, strategy and lane width twice, each pair of them once (the fast tier: every
# mesh size, strategy and lane width once).
@pytest.mark.parametrize(
    "num_shards,strategy,lanes",
    [
        (1, "div", 0),
        (8, "mod", 0),
        pytest.param(1, "mod", 128, marks=pytest.mark.slow),
        (8, "div", 128),
    ],
)
def test_invalid_ids_act_as_padding_in_the_jitted_train_step(num_shards, strategy, lanes):
    """Ids >= V and < -1 in global jax.Arrays (not validated on the host) through the
    jitted train step, so through emb.lookup, emb.invalid_id_counts and
    emb.apply_gradients under jit: lookups equal the float64 reference with those ids
    replaced by -1, and so does the update (rows no valid id touches stay bit-identical);
    the physical state, padding rows included, is bit for bit that of the batch with -1;
    the invalid ids are counted per feature and in the metrics."""
    rng = np.random.default_rng(100 * num_shards + lanes + (strategy == "mod"))
    mesh = make_mesh(num_shards)
    emb = jte.Embedding(_invalid_ids_spec(strategy), mesh, lane_width=lanes)
    state = emb.restore_tables(
        {"t": rng.standard_normal((37, 4)), "s": rng.standard_normal((11, 3))},
        {"s": {"accumulators": rng.uniform(0.0, 1.0, 11)}},
    )
    tables, slots = emb.export(state), emb.export_slots(state)
    bad, clean, planted = _with_invalid_ids(rng)
    grads = {
        path: rng.standard_normal(
            (_B, seq, emb.spec.tables()[table].dim) if seq else (_B, emb.spec.tables()[table].dim)
        ).astype(np.float32)
        for path, (table, _, _, _, seq) in _FEATURES.items()
    }

    def loss_fn(params, acts, batch):
        """d(loss)/d(acts) is batch["r"] exactly; the lookups and emb.invalid_id_counts
        (jitted with the step) come back as aux."""
        loss = params["s"] * sum(jnp.sum(acts[p] * batch["r"][p]) for p in sorted(acts))
        return loss, {"acts": acts, "counts": emb.invalid_id_counts(batch["features"])}

    step = jte.make_train_step(emb, loss_fn, optax.sgd(0.1), donate=False)

    def run(train, features):
        return step(train, {"features": _on_devices(mesh, features), "r": _on_devices(mesh, grads)})

    train = step.init(None, {"s": np.float32(1.0)}, embedding_state=state)
    got, metrics = run(train, bad)
    assert int(metrics["skipped"]) == 0
    _assert_lookup_matches(metrics["aux"]["acts"], _ref_lookup(tables, clean))
    assert {k: int(v) for k, v in metrics["aux"]["counts"].items()} == planted
    assert int(metrics["invalid_ids"]) == sum(planted.values())

    want_tables, want_slots, touched = _ref_update(tables, slots, clean, grads)
    got_tables, got_slots = emb.export(got.embedding), emb.export_slots(got.embedding)
    for name, want in want_tables.items():
        assert 0 < touched[name].sum() < len(touched[name])
        np.testing.assert_allclose(got_tables[name], want, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(
            got_slots[name]["accumulators"], want_slots[name]["accumulators"], rtol=2e-5, atol=2e-6
        )
        np.testing.assert_array_equal(
            got_tables[name][~touched[name]], tables[name][~touched[name]]
        )
        np.testing.assert_array_equal(
            got_slots[name]["accumulators"][~touched[name]],
            slots[name]["accumulators"][~touched[name]],
        )

    with_padding, clean_metrics = run(train, clean)
    assert int(clean_metrics["invalid_ids"]) == 0
    assert all(int(v) == 0 for v in clean_metrics["aux"]["counts"].values())

    def same(state, m):
        return jax.device_get((state, m["loss"], m["aux"]["acts"]))

    jax.tree.map(
        np.testing.assert_array_equal, same(got, metrics), same(with_padding, clean_metrics)
    )

    # Reading the updated tables: nothing was written where an invalid id would read.
    _, metrics = run(got, bad)
    _assert_lookup_matches(metrics["aux"]["acts"], _ref_lookup(got_tables, clean))
    assert step.trace_count == 1
