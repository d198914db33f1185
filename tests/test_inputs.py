"""Input forms, validation messages, invalid ids under jit, global jax.Array inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
import reference
from conftest import make_mesh


def _spec(**kw):
    t = jte.TableConfig(10, 4, combiner="sum", name="t")
    s = jte.TableConfig(6, 2, combiner="mean", name="s")
    return jte.EmbeddingSpec({"a": jte.FeatureConfig(t),
                              "g": {"b": jte.FeatureConfig(s, max_sequence_length=3)}},
                             jte.SGD(0.5), **kw)


def test_pad_ragged_lengths_splits_weights_truncation():
    values = [5, 1, 2, 7, 7, 3]
    ids = jte.pad_ragged(values, row_lengths=[2, 0, 4])
    np.testing.assert_array_equal(ids, [[5, 1, -1, -1], [-1, -1, -1, -1], [2, 7, 7, 3]])
    same = jte.pad_ragged(values, row_splits=[0, 2, 2, 6])
    np.testing.assert_array_equal(ids, same)
    w = jte.pad_ragged(values, row_lengths=[2, 0, 4], weights=[1, 2, 3, 4, 5, 6],
                       max_length=3)
    assert isinstance(w, jte.Weighted)
    np.testing.assert_array_equal(w.ids, [[5, 1, -1], [-1, -1, -1], [2, 7, 7]])
    np.testing.assert_array_equal(w.weights, [[1, 2, 0], [0, 0, 0], [3, 4, 5]])
    empty = jte.pad_ragged([], row_lengths=[0, 0])
    assert isinstance(empty, np.ndarray) and empty.shape == (2, 1)  # At least one column.


@pytest.mark.parametrize("kw,match", [
    (dict(), "exactly one of row_lengths and row_splits"),
    (dict(row_lengths=[1, 1], row_splits=[0, 1, 2]), "exactly one"),
    (dict(row_lengths=[1, 2]), "sum to len\\(values\\)=2"),
    (dict(row_splits=[0, 3]), "row_splits must be non-decreasing"),
    (dict(row_lengths=[1, 1], max_length=0), "max_length must be an int >= 1"),
    (dict(row_lengths=[1, 1], weights=[1.0]), "weights must match"),
])
def test_pad_ragged_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        jte.pad_ragged([1, 2], **kw)


@pytest.mark.parametrize("features,match", [
    ({"a": np.array([1, 10, 3, -1]), "g": {"b": np.zeros((4, 2), np.int32)}},
     r"Feature 'a': id 10 at position \[1\] is outside \[0, 10\) of table 't'"),
    ({"a": np.array([1, 2, 3, 4]), "g": {"b": np.array([[0, 1], [2, -3], [0, 0], [1, 9]])}},
     r"Feature 'g/b': id -3 at position \[1, 1\] is outside \[0, 6\) of table 's' "
     r"\(2 invalid ids in all\)"),
    ({"a": np.array([1.0, 2, 3, 4]), "g": {"b": np.zeros((4, 2), np.int32)}},
     "Feature 'a': ids must have an integer dtype, got float64"),
    ({"a": np.zeros((4, 2, 2), np.int32), "g": {"b": np.zeros((4, 2), np.int32)}},
     r"Feature 'a': ids must be \(B,\) or \(B, L\)"),
    ({"a": np.zeros(4, np.int32), "g": {"b": np.zeros((6, 2), np.int32)}},
     "all features must have the same batch size"),
    ({"a": np.zeros(6, np.int32), "g": {"b": np.zeros((6, 2), np.int32)}},
     "batch size B=6 must be a multiple of the mesh size 4"),
    ({"a": np.zeros(4, np.int32)}, r"missing features \['g/b'\]"),
    ({"a": np.zeros(4, np.int32), "g": {"b": np.zeros((4, 2), np.int32)},
      "c": np.zeros(4, np.int32)}, r"unknown features \['c'\]"),
    ({"a": jte.Weighted(np.zeros((4, 2), np.int32), np.ones((4, 3), np.float32)),
      "g": {"b": np.zeros((4, 2), np.int32)}}, "weights shape \\(4, 3\\) differs"),
    ({"a": jte.Weighted(np.zeros((4, 2), np.int32), np.ones((4, 2), np.int32)),
      "g": {"b": np.zeros((4, 2), np.int32)}}, "weights must be floats"),
])
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
    emb = jte.Embedding(_spec(), make_mesh(2))
    state = emb.init(jax.random.key(0))
    bad = {"a": np.array([[1, 10], [-5, 2]], np.int32),
           "g": {"b": np.array([[0, 6, 1], [-2, 3, 99]], np.int32)}}
    clean = {"a": np.array([[1, -1], [-1, 2]], np.int32),
             "g": {"b": np.array([[0, -1, 1], [-1, 3, -1]], np.int32)}}
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
    np.testing.assert_array_equal(after[[0, 3, 4, 5, 6, 7, 8, 9]],
                                  before[[0, 3, 4, 5, 6, 7, 8, 9]])


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_global_jax_array_inputs_match_numpy(kind, rng):
    mesh = make_mesh(4, kind)
    emb = jte.Embedding(_spec(partition_strategy="mod"), mesh)
    state = emb.init(jax.random.key(0))
    a = rng.integers(-1, 10, (8, 3)).astype(np.int32)
    b = rng.integers(-1, 6, (8, 2)).astype(np.int32)
    wa = rng.uniform(0.5, 1.5, (8, 3)).astype(np.float32)
    batch = NamedSharding(mesh, P("shard"))
    arrays = {"a": jte.Weighted(jax.make_array_from_process_local_data(batch, a),
                                jax.make_array_from_process_local_data(batch, wa)),
              "g": {"b": jax.make_array_from_process_local_data(batch, b)}}
    numpy = {"a": jte.Weighted(a, wa), "g": {"b": b}}
    got, want = emb.lookup(state, arrays), emb.lookup(state, numpy)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    tables = emb.export(state)
    np.testing.assert_allclose(got["a"], reference.lookup(tables["t"], a, wa, "sum"),
                               rtol=1e-5)
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), want)
    g_arrays = jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("shard")), x), grads)
    step = jax.jit(emb.apply_gradients)
    s1, s2 = step(state, arrays, g_arrays), emb.apply_gradients(state, numpy, grads)
    for name in ["t", "s"]:
        np.testing.assert_array_equal(emb.export(s1)[name], emb.export(s2)[name])


def test_output_shape_reshapes_activation_and_gradient(rng):
    t = jte.TableConfig(10, 4, combiner="sum")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(t, output_shape=(4, 2)),
                              "s": jte.FeatureConfig(t, max_sequence_length=2,
                                                     output_shape=(16,))},
                             jte.SGD(1.0))
    emb = jte.Embedding(spec, make_mesh(2, "auto"))
    state = emb.init(jax.random.key(0))
    ids = rng.integers(0, 10, (8, 2)).astype(np.int32)
    acts = emb.lookup(state, {"f": ids, "s": ids})
    assert acts["f"].shape == (4, 2, 4) and acts["s"].shape == (16, 4)
    table = emb.export(state)["f"]
    np.testing.assert_allclose(np.asarray(acts["f"]).reshape(8, 4),
                               reference.lookup(table, ids, None, "sum"), rtol=1e-5)
    grads = {"f": np.ones((4, 2, 4), np.float32), "s": np.zeros((16, 4), np.float32)}
    new = emb.export(emb.apply_gradients(state, {"f": ids, "s": ids}, grads))["f"]
    counts = np.bincount(ids.ravel(), minlength=10)
    np.testing.assert_allclose(new, table - counts[:, None], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="output_shape \\(4, 2\\) has 8 outputs, but the "
                                         "batch gives 4"):
        emb.lookup(state, {"f": ids[:4], "s": ids[:4]})
    with pytest.raises(ValueError, match=r"act_grads\['f'\] has shape \(8, 4\)"):
        emb.apply_gradients(state, {"f": ids, "s": ids},
                            {"f": np.ones((8, 4), np.float32), "s": grads["s"]})


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
        features = {"a": rng.integers(0, 10, (8,)).astype(np.int32),
                    "g": {"b": rng.integers(-1, 6, (8, 5)).astype(np.int32)}}
        state = step(state, features)
    assert len(traces) == 1
    assert int(state.step) == 3
