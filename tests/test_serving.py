"""jte.serving: CPU lookups over exported tables give emb.lookup's numbers (and a float64
NumPy reference's) for every input form, strategy and mesh size; jax.export round trips."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import serving

B = 16


def _spec_a(strategy):
    """Every combiner, weights, sequences, a shared table and an output_shape."""
    shared = jte.TableConfig(37, 5, combiner="sum", name="shared")
    mean_t = jte.TableConfig(11, 3, combiner="mean")
    sqrtn_t = jte.TableConfig(20, 4, combiner="sqrtn")
    return jte.EmbeddingSpec(
        {
            "multi": jte.FeatureConfig(shared),
            "one": jte.FeatureConfig(shared),
            "nested": {
                "mean": jte.FeatureConfig(mean_t),
                "seq": jte.FeatureConfig(mean_t, max_sequence_length=4),
                "shaped": jte.FeatureConfig(mean_t, output_shape=(B // 2, 2)),
            },
            "weighted": jte.FeatureConfig(sqrtn_t),
            "wseq": jte.FeatureConfig(sqrtn_t, max_sequence_length=2),
        },
        jte.SGD(0.1),
        partition_strategy=strategy,
    )


def _spec_b(strategy):
    """A bfloat16 table; one-hot ids, weighted one-hot."""
    t = jte.TableConfig(9, 6, combiner="mean", name="bf", dtype=jnp.bfloat16)
    return jte.EmbeddingSpec(
        {"id": jte.FeatureConfig(t), "wid": jte.FeatureConfig(t)},
        jte.SGD(0.1),
        partition_strategy=strategy,
    )


def _inputs_a(rng):
    multi = rng.integers(0, 12, (B, 6))  # Few distinct ids: many duplicates.
    multi[rng.random((B, 6)) < 0.3] = -1
    multi[3] = -1  # An example with no ids.
    seq = rng.integers(0, 11, (B, 6))  # Longer than max_sequence_length: truncated.
    seq[:, 3:][rng.random((B, 3)) < 0.5] = -1
    wid = rng.integers(0, 20, (B, 3))
    wid[0, 1] = -1
    wts = rng.uniform(0.1, 2.0, (B, 3)).astype(np.float32)
    wts[5] = 0.0  # All-zero weights: the mean/sqrtn divisor is 0, the output 0.
    return {
        "multi": multi,
        "one": rng.integers(0, 37, (B,)),
        "nested": {
            "mean": rng.integers(-1, 11, (B, 2)),
            "seq": seq,
            "shaped": rng.integers(0, 4, (B, 3)),
        },
        "weighted": jte.Weighted(wid, wts),
        "wseq": jte.Weighted(wid[:, :1], wts[:, :1]),
    }  # Shorter: padded to 2.


def _inputs_b(rng):
    return {
        "id": rng.integers(0, 9, (B,)),
        "wid": jte.Weighted(
            rng.integers(0, 9, (B,)), rng.uniform(0.5, 1.5, (B,)).astype(np.float32)
        ),
    }


def _tables(spec, rng):
    return {
        name: rng.standard_normal((t.vocabulary_size, t.dim)).astype(t.dtype)
        for name, t in spec.tables().items()
    }


def _reference(spec, tables, features):
    """float64 NumPy: TF's combiners with weights as given; invalid ids and -1 ignored."""
    names = {id(t): n for n, t in spec.tables().items()}
    flat_inputs = dict(_flatten(features))
    out = {}
    for path, f in spec.flat_features:
        table = np.asarray(tables[names[id(f.table)]], np.float64)
        leaf = flat_inputs[path]
        ids, w = (leaf.ids, leaf.weights) if isinstance(leaf, jte.Weighted) else (leaf, None)
        ids = np.asarray(ids).reshape(len(ids), -1)
        w = np.ones(ids.shape) if w is None else np.asarray(w, np.float64).reshape(ids.shape)
        if f.max_sequence_length:
            n = f.max_sequence_length
            ids = np.pad(ids, ((0, 0), (0, max(0, n - ids.shape[1]))), constant_values=-1)[:, :n]
            w = np.pad(w, ((0, 0), (0, max(0, n - w.shape[1]))))[:, :n]
        valid = (ids >= 0) & (ids < table.shape[0])
        w = np.where(valid, w, 0.0)
        rows = table[np.where(valid, ids, 0)]
        if f.max_sequence_length:
            acts = rows * w[..., None]
        else:
            if f.table.combiner == "sum":
                scale = w
            else:
                d = (w.sum(1) if f.table.combiner == "mean" else np.sqrt((w * w).sum(1)))[:, None]
                scale = np.where(d == 0, 0.0, w / np.where(d == 0, 1.0, d))
            acts = np.einsum("bl,bld->bd", scale, rows)
        if f.output_shape:
            acts = acts.reshape(f.output_shape + (acts.shape[-1],))
        out[path] = acts
    return out


def _flatten(tree, prefix=""):
    for key in sorted(tree):
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(tree[key], dict):
            yield from _flatten(tree[key], path)
        else:
            yield path, tree[key]


def _assert_close(got, want, rtol=1e-5, atol=1e-6):
    got, want = dict(_flatten(got)), dict(_flatten(want))
    assert got.keys() == want.keys()
    for path in want:
        assert np.shape(got[path]) == np.shape(want[path]), path
        np.testing.assert_allclose(
            np.asarray(got[path], np.float64), want[path], rtol=rtol, atol=atol, err_msg=path
        )


@functools.cache
def _case(which, strategy):
    spec = (_spec_a if which == "a" else _spec_b)(strategy)
    rng = np.random.default_rng(0)
    tables = _tables(spec, rng)
    features = (_inputs_a if which == "a" else _inputs_b)(rng)
    return spec, tables, features


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize(
    "num_shards,strategy,kind",
    [
        (1, "div", "explicit"),
        (2, "mod", "auto"),
        (4, "div", "explicit"),
        (8, "mod", "explicit"),
    ],
)
def test_serving_matches_training_lookup_and_reference(which, num_shards, strategy, kind):
    spec, tables, features = _case(which, strategy)
    emb = jte.Embedding(spec, make_mesh(num_shards, kind))
    state = emb.restore_tables(tables)
    trained = emb.lookup(state, features)
    server = serving.Server.from_embedding(emb, state)
    served = server(features)
    want = _reference(spec, tables, features)
    _assert_close(served, want)
    # Same numbers as the sharded lookup, up to float summation order across shards.
    _assert_close(
        served, jax.tree.map(lambda x: np.asarray(x, np.float64), trained), rtol=1e-6, atol=1e-6
    )
    assert all(x.devices() == {jax.devices("cpu")[0]} for x in jax.tree.leaves(served))


def test_serving_lookup_is_jittable_and_ignores_invalid_ids_under_jit():
    spec, tables, features = _case("a", "div")
    bad = dict(features)
    multi = features["multi"].copy()
    multi[1, 0], multi[2, 2] = 99, -7
    bad["multi"] = multi
    with pytest.raises(ValueError, match=r"id 99 at position \[1, 0\]"):
        serving.Server(spec, tables)(bad)
    got = jax.jit(functools.partial(serving.lookup, spec))(tables, bad)
    cleaned = dict(features, multi=np.where((multi < 0) | (multi >= 37), -1, multi))
    _assert_close(got, _reference(spec, tables, cleaned))
    # Global jax.Arrays skip host validation, like Embedding.lookup: invalid ids count as -1.
    on_device = jax.tree.map(jnp.asarray, bad)
    _assert_close(serving.Server(spec, tables)(on_device), _reference(spec, tables, cleaned))


def test_tables_that_do_not_fit_the_spec_are_listed():
    spec, tables, _ = _case("a", "div")
    broken = dict(tables)
    broken["shared"] = tables["shared"][:30]
    del broken["weighted"]
    broken["extra"] = np.zeros((2, 2), np.float32)
    with pytest.raises(
        ValueError,
        match=r"table 'weighted' is missing; table 'extra' is not "
        r"in the spec.*table 'shared' has shape \(30, 5\)",
    ):
        serving.Server(spec, broken)


def test_export_serialize_deserialize_call():
    spec, tables, features = _case("a", "mod")
    server = serving.Server(spec, tables)
    want = _reference(spec, tables, features)
    blob = server.export(features).serialize()
    assert isinstance(blob, (bytes, bytearray))
    restored = jax.export.deserialize(blob)
    _assert_close(restored.call(server.tables, features), want)
    # A self-contained artifact with the tables inside.
    inner = jax.export.deserialize(server.export(features, include_tables=True).serialize())
    _assert_close(inner.call(features), want)
    with pytest.raises(ValueError, match="polymorphic_batch=True is impossible"):
        server.export(features, polymorphic_batch=True)


def test_export_with_polymorphic_batch_serves_any_batch_size():
    spec, tables, features = _case("b", "div")
    exp = serving.export(spec, tables, features, polymorphic_batch=True)
    call = jax.export.deserialize(exp.serialize()).call
    for size in (3, B):
        small = jax.tree.map(lambda x, size=size: x[:size], features)
        _assert_close(call(tables, small), _reference(spec, tables, small))
        _assert_close(call(tables, small), serving.Server(spec, tables)(small))


def test_dynamic_ids_are_found_in_their_hashed_buckets():
    """`served_rows` lays ids out by bucket and `find` reads one window of them: against a
    Python dict, every served id is found at its own row and no other id is found, for ids
    of every kind (small consecutive ones, negative ones, the int64 extremes, random ones
    with unsigned halves of all sizes); -1 (padding) never is; the window is the fullest
    bucket's ids rounded up to 8; no ids serve an empty table; the older served form (for
    a binary search) is a clear error."""
    rng = np.random.default_rng(3)
    ids = np.concatenate(
        [
            np.arange(1_000, dtype=np.int64),  # Consecutive: one unsigned-order run.
            -np.arange(2, 500, dtype=np.int64),
            np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, 2**32, 2**32 - 1]),
            rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 3_000, dtype=np.int64),
        ]
    )
    ids = np.unique(ids)
    rows = rng.standard_normal((len(ids), 3)).astype(np.float32)
    order = rng.permutation(len(ids))  # DynamicRows need not be sorted here.
    table = serving.served_rows(jte.DynamicRows(ids[order], rows[order]))
    n = len(ids)
    width = table["keys"].shape[0] // 2 - n
    start = table["start"]
    assert start.shape[0] & (start.shape[0] - 1) == 0 and start.shape[0] >= n / serving.PER_BUCKET
    fullest = int(np.max(np.diff(np.append(start, n))))
    assert width == -(-fullest // 8) * 8 and width < 32
    where = {int(i): k for k, i in enumerate(ids)}
    unknown = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 2_000, dtype=np.int64)
    unknown = unknown[~np.isin(unknown, ids)]
    query = np.concatenate([ids, unknown, [-1]]).reshape(1, -1)
    split = jte.split_ids(query)
    position, found = jax.jit(serving.find)(table, split.hi, split.lo)
    position, found = np.asarray(position)[0], np.asarray(found)[0]
    np.testing.assert_array_equal(found, np.arange(query.shape[1]) < n)
    served = table["rows"][position[:n]]
    want = np.stack([rows[where[int(i)]] for i in query[0, :n]])
    np.testing.assert_array_equal(served, want)
    # Lane-packed (32 rows of D = 3 to a 128-lane row; n is not a multiple of 32): padding
    # ids fill the last row, and every id is found where it was.
    packed = serving._pack_served(table, 3)
    assert n % 32 and packed["rows"].shape == (-(-n // 32), 128)
    got = jax.jit(serving.find, static_argnums=3)(packed, split.hi, split.lo, 3)
    np.testing.assert_array_equal(np.asarray(got[0])[0], position)
    np.testing.assert_array_equal(np.asarray(got[1])[0], found)

    empty = serving.served_rows(jte.DynamicRows(np.zeros(0, np.int64), np.zeros((0, 3))))
    hi, lo = jte.split_ids(np.array([[-1, 0, 7]]))
    assert not np.any(np.asarray(serving.find(empty, hi, lo)[1]))

    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(jte.TableConfig(dim=3, name="d", dynamic=jte.DynamicTable(64)))},
        jte.SGD(0.1),
    )
    old = {"hi": table["keys"][0::2], "lo": table["keys"][1::2], "rows": table["rows"]}
    with pytest.raises(ValueError, match=r"table 'd' is in an older served form.*served_rows"):
        jte.serving.Server(spec, {"d": old})


def _wide_spec():
    """Widths that pack 128 / w rows of w lanes to a row (1 -> 128 rows, 48 -> 2 rows of 64
    lanes), that pad one row (100 -> 128) or two (200 -> 256), and 128 (as it is); 37 rows,
    a multiple of none of them."""
    tables = {d: jte.TableConfig(37, d, combiner="mean", name=f"w{d}") for d in (1, 48, 100, 200)}
    tables[128] = jte.TableConfig(37, 128, combiner="sum", name="w128")
    features = {f"f{d}": jte.FeatureConfig(t) for d, t in tables.items()}
    features["seq"] = jte.FeatureConfig(tables[48], max_sequence_length=3)
    return jte.EmbeddingSpec(features, jte.Adagrad(0.1))


@pytest.mark.parametrize("which", [pytest.param("a", marks=pytest.mark.slow), "b", "wide"])
def test_lane_packed_tables_serve_the_same_numbers(which):
    """`served_tables(lanes=128)` packs each table as training packs it on a TPU, the form
    a TPU server holds and TPU artifacts take. The lookup reads it: against the tables as
    they are and the float64 reference (to float32 rounding; a contraction over 128 lanes
    may round differently), through `Server`, `lookup` under jit and an artifact exported
    for CPU and TPU, whose tables must be packed. Shapes: the packing's, also for
    `check_tables`."""
    if which == "wide":
        spec = _wide_spec()
        rng = np.random.default_rng(5)
        tables = _tables(spec, rng)
        features = {p: rng.integers(-1, 37, (B, 4)) for p, _ in spec.flat_features}
    else:
        spec, tables, features = _case(which, "div")
    packed = serving.served_tables(spec, tables, lanes=128)
    for name, t in spec.tables().items():
        p, v = serving._packing(t.dim), t.vocabulary_size
        assert v is not None
        shape = (-(-v // p.per_row), p.per_row * p.padded_width)
        assert packed[name].shape == (shape if p.packed else (v, t.dim)), name
        assert packed[name].dtype == tables[name].dtype
    plain = serving.Server(spec, tables)(features)
    want = _reference(spec, tables, features)
    _assert_close(plain, want)
    for got in (
        serving.Server(spec, packed)(features),
        jax.jit(functools.partial(serving.lookup, spec))(packed, features),
    ):
        _assert_close(got, jax.tree.map(lambda x: np.asarray(x, np.float64), plain), 1e-6, 1e-6)
        _assert_close(got, want)
    exp = serving.export(spec, tables, features, platforms=("cpu", "tpu"))
    assert [a.shape for a in exp.in_avals[: len(packed)]] == [
        packed[n].shape for n in sorted(packed)
    ]
    _assert_close(jax.export.deserialize(exp.serialize()).call(packed, features), want)
    with pytest.raises(ValueError, match="lanes must be 0"):
        serving.served_tables(spec, tables, lanes=64)


def test_lane_packed_dynamic_tables_serve_the_same_numbers():
    """A dynamic table's served rows packed (16 rows of D = 5 to a row; 1,000 ids, not a
    multiple of 16): the lookup finds every id and gives what the unpacked form gives, for
    unknown ids as zeros or their initial rows, combined (mean) and as a sequence; an
    artifact for TPU takes the packed form."""
    rng = np.random.default_rng(4)
    ids = np.unique(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 1_000))
    rows = rng.standard_normal((len(ids), 5)).astype(np.float32)
    t = jte.TableConfig(dim=5, name="d", combiner="mean", dynamic=jte.DynamicTable(4096))
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(t), "s": jte.FeatureConfig(t, max_sequence_length=4)},
        jte.SGD(0.1),
    )
    query = ids[rng.integers(0, len(ids), (B, 4))]
    query[rng.random((B, 4)) < 0.2] = rng.integers(0, 2**40, 1)  # Unknown to the table.
    query[rng.random((B, 4)) < 0.2] = -1
    features = {"f": query, "s": query[:, ::-1].copy()}
    tables = {"d": jte.DynamicRows(ids, rows)}
    keys = {"d": np.array([3, 11], np.uint32)}
    packed = serving.served_tables(spec, tables, keys, lanes=128)
    assert packed["d"]["rows"].shape == (63, 128)  # 1,008 rows of 8 lanes.
    for unknown in ("zeros", "init"):
        want = serving.Server(spec, tables, unknown=unknown, keys=keys)(features)
        got = serving.Server(spec, packed, unknown=unknown)(features)
        _assert_close(got, jax.tree.map(lambda x: np.asarray(x, np.float64), want), 1e-6, 1e-6)
    exp = serving.export(
        spec, tables, features, platforms=("cpu", "tpu"), unknown="init", keys=keys
    )
    split = {p: jte.split_ids(x) for p, x in features.items()}
    got = jax.export.deserialize(exp.serialize()).call(packed, split)
    _assert_close(got, jax.tree.map(lambda x: np.asarray(x, np.float64), want), 1e-6, 1e-6)
