"""Owner routing (`Embedding(routing="owner")`): ids travel to their rows' owners.

Every input form, "div" and "mod", 1, 2, 4 and 8 devices, NumPy and batch-sharded jax.Array
inputs on Explicit and Auto meshes, against the float64 reference; skewed batches that need
several exchange rounds; the choice and its errors. The optimizer battery
(tests/test_optimizers.py) runs every optimizer routed too; tests/test_multihost.py runs it
across two processes.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
import reference
from conftest import make_mesh
from jax_tpu_embed import _routing
from test_core import (
    _features_and_spec,
    _grads,
    _inputs,
    reference_lookup,
    reference_row_grads,
)


def _close(got, want):
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def _sharded(emb, tree):
    """Every leaf as a global jax.Array split over the batch."""
    sharding = NamedSharding(emb.mesh, P(emb.axis))
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), tree)


@pytest.mark.parametrize(
    "strategy,num_shards",
    [
        # One device (one round, _routing.capacity's num_shards == 1) is also
        # test_owner_lookups_match_numpy's. All slow: the fast tier routes ids in
        # test_skew_runs_more_rounds_and_drops_nothing, test_owner_lookups_match_numpy and
        # the owner cases of other files (`make test` runs every line that these do).
        pytest.param("div", 1, marks=pytest.mark.slow),
        pytest.param("mod", 2, marks=pytest.mark.slow),
        pytest.param("div", 4, marks=pytest.mark.slow),
        pytest.param("mod", 8, marks=pytest.mark.slow),
        pytest.param("div", 8, marks=pytest.mark.slow),
    ],
)
def test_every_input_form_matches_the_reference(strategy, num_shards, rng):
    spec = _features_and_spec(jte.Adagrad(0.3, initial_accumulator_value=0.2), strategy=strategy)
    emb = jte.Embedding(spec, make_mesh(num_shards), routing="owner")
    assert set(emb.routing.values()) == {"owner"}
    assert set(emb.backends.values()) == {"xla"}
    state = emb.init(jax.random.key(1))
    for _ in range(2):
        features = _inputs(rng)
        tables, slots = emb.export(state), emb.export_slots(state)
        acts = emb.lookup(state, features)
        _close(_flat(acts), reference_lookup(tables, features))
        grads = _grads(rng, acts)
        state = emb.apply_gradients(state, features, grads)
        row_grads = reference_row_grads(tables, features, grads)
        for name, rows in row_grads.items():
            want_t, want_s = reference.apply("adagrad", {}, tables[name], slots[name], rows, 0.3)
            np.testing.assert_allclose(emb.export(state)[name], want_t, rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(
                emb.export_slots(state)[name]["accumulators"],
                want_s["accumulators"],
                rtol=2e-5,
                atol=2e-6,
            )
            untouched = np.setdiff1d(np.arange(tables[name].shape[0]), list(rows))
            np.testing.assert_array_equal(
                emb.export(state)[name][untouched], tables[name][untouched]
            )


# The slow tier: the fast one runs owner routing against references on every input form
# (test_every_input_form_matches_the_reference) and jax.Array inputs on both kinds of mesh
# (test_inputs.py).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_jit_step_on_sharded_arrays_equals_the_gather_path(kind, rng):
    """A jitted lookup -> grad -> update on batch-sharded jax.Arrays: owner routing equals
    the all-gather path."""
    spec = _features_and_spec(jte.Adam(0.05), strategy="mod")
    mesh = make_mesh(8, kind)
    embs = {r: jte.Embedding(spec, mesh, routing=r, backend="xla") for r in ("owner", "gather")}
    results = {}
    for routing, emb in embs.items():
        step_rng = np.random.default_rng(5)

        @jax.jit
        def step(state, features, grads, emb=emb):
            return emb.apply_gradients(state, features, grads), emb.lookup(state, features)

        state = emb.init(jax.random.key(2))
        acts = None
        for _ in range(3):
            features = _inputs(step_rng)
            grads = _grads(step_rng, emb.lookup(state, features))
            state, acts = step(state, _sharded(emb, features), _sharded(emb, grads))
        results[routing] = (emb.export(state), emb.export_slots(state), acts)
    got, want = results["owner"], results["gather"]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


def _skewed(rng, batch, length, vocab):
    """Power-law ids: the hot low ids all on shard 0 under "div"."""
    ids = (rng.pareto(0.8, (batch, length)) * 3).astype(np.int64) % vocab
    ids[rng.random((batch, length)) < 0.1] = -1
    return ids.astype(np.int32)


@pytest.mark.parametrize(
    "strategy,num_shards",
    [
        pytest.param("div", 8, marks=pytest.mark.slow),
        ("div", 4),
        pytest.param("mod", 8, marks=pytest.mark.slow),
    ],
)
def test_skew_runs_more_rounds_and_drops_nothing(strategy, num_shards, rng):
    vocab, batch, length = 400, 32, 6
    table = jte.TableConfig(vocab, 4, combiner="mean", name="t")
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table)}, jte.Adagrad(0.5), partition_strategy=strategy
    )
    # 8 ids per owner and round: a device's distinct ids for shard 0 need several rounds.
    emb = jte.Embedding(spec, make_mesh(num_shards), routing="owner", max_ids_per_shard=8)
    state = emb.init(jax.random.key(3))
    features = {"f": _skewed(rng, batch, length, vocab)}
    counts = emb.id_counts(features)["t"]
    if strategy == "div":
        assert counts["passes"] > 1, counts
    _one_adagrad_step_matches_the_reference(emb, state, features, rng)


def _one_adagrad_step_matches_the_reference(emb, state, features, rng):
    """A lookup and an Adagrad(0.5) step of table "t" (feature "f") against the float64
    reference: a row updated twice (once per round) would differ from one update."""
    config = emb.table_plans["t"].config
    table0, slots0 = emb.export(state)["t"], emb.export_slots(state)["t"]
    acts = emb.lookup(state, features)
    want = reference.lookup(table0, features["f"], None, config.combiner)
    np.testing.assert_allclose(acts["f"], want, rtol=1e-5, atol=1e-6)
    grads = {"f": rng.normal(size=acts["f"].shape).astype(np.float32)}
    state = emb.apply_gradients(state, features, grads)
    contributions = [(features["f"], None, config.combiner, 0, grads["f"])]
    rows = reference.row_gradients(config.vocabulary_size, contributions)
    want_t, want_s = reference.apply("adagrad", {}, table0, slots0, rows, 0.5)
    np.testing.assert_allclose(emb.export(state)["t"], want_t, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(
        emb.export_slots(state)["t"]["accumulators"], want_s["accumulators"], rtol=2e-5, atol=2e-6
    )


def test_rounds_match_what_id_counts_predicts(rng):
    """id_counts' round count is what the engine runs: the same batch with one id more per
    owner in its capacity needs no more rounds, and a capacity of the whole batch one."""
    table = jte.TableConfig(200, 4, name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.SGD(0.1))
    features = {"f": _skewed(rng, 16, 8, 200)}
    rounds = [
        jte.Embedding(spec, make_mesh(4), routing="owner", max_ids_per_shard=c).id_counts(features)[
            "t"
        ]["passes"]
        for c in (32, 64, 512)
    ]
    assert rounds[0] >= rounds[1] >= rounds[2] == 1, rounds


@pytest.mark.parametrize("num_shards,pairs", [(1, 12), (4, 40), (8, 5), (32, 9)])
def test_owner_lookups_match_numpy(num_shards, pairs, rng):
    """`_per_owner` and `_count_below` over sorted keys with duplicates, owners holding no
    key (every odd one), NONE padding; N = 1 and N > m."""
    s = 6
    used = np.arange(0, num_shards, 2)
    pool = rng.choice(used, 4) * s + rng.integers(0, s, 4)
    real = rng.integers(1, pairs)
    keys = np.sort(np.concatenate([rng.choice(pool, real), np.full(pairs - real, _routing.NONE)]))
    assert len(np.unique(keys)) < len(keys)
    values = rng.integers(-50, 50, num_shards).astype(np.int32)
    got = _routing._per_owner(jax.numpy.asarray(keys, np.int32), s, jax.numpy.asarray(values))
    np.testing.assert_array_equal(got, values[np.minimum(keys // s, num_shards - 1)])
    near = np.concatenate([keys[:3], np.minimum(keys[:3] + 1, _routing.NONE)])
    limits = np.concatenate([np.arange(num_shards + 1) * s, near, [_routing.NONE - 1]])
    limits = limits.astype(np.int32)
    got = _routing._count_below(jax.numpy.asarray(keys, np.int32), jax.numpy.asarray(limits))
    np.testing.assert_array_equal(got, [(keys < x).sum() for x in limits])


def test_auto_routing_and_errors():
    spec = _features_and_spec(jte.SGD(0.1))
    emb = jte.Embedding(spec, make_mesh(8))
    assert set(emb.routing.values()) == {"gather"}  # CPU meshes: the all-gather path.
    emb = jte.Embedding(spec, make_mesh(8), routing={"shared": "owner"})
    assert emb.routing["shared"] == "owner" and emb.routing["weighted"] == "gather"
    assert emb.backends["shared"] == "xla"
    with pytest.raises(ValueError, match="routing must be one of"):
        jte.Embedding(spec, make_mesh(2), routing="scatter")
    with pytest.raises(ValueError, match="routing names \\['nope'\\]"):
        jte.Embedding(spec, make_mesh(2), routing={"nope": "owner"})
    with pytest.raises(ValueError, match="table 'shared' cannot use routing 'owner'.*'cpu'"):
        jte.Embedding(spec, make_mesh(2), routing="owner", backend="cpu")


def test_kernels_too_small_for_the_capacity_run_more_rounds(rng):
    """When the default capacity's exchanged rows would not fit VMEM, the Pallas kernels
    take the capacity that fits and more rounds (not XLA ops): results unchanged."""
    vocab, batch, length, dim = 400, 32, 6, 64
    table = jte.TableConfig(vocab, dim, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.5))
    # 48 pairs per device: default Cd 32 (4 devices x 32 / k=2: 64 lane-dense rows); a
    # VMEM that holds 40 such rows (40 x 512 bytes in its half) holds Cd = 16.
    kernels = jte.backends.Pallas(interpret=True, vmem=40 * 512 * 2)
    emb = jte.Embedding(spec, make_mesh(4), routing="owner", backend=kernels)
    (call,) = emb.call_plans({"f": (batch // 4, length)}).values()
    assert (call.kernel, call.fallback, call.capacity, call.k) == (kernels, None, 16, 2)
    features = {"f": _skewed(rng, batch, length, vocab)}
    assert emb.id_counts(features)["t"]["passes"] > 1
    _one_adagrad_step_matches_the_reference(emb, emb.init(jax.random.key(3)), features, rng)
