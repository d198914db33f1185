"""Table stacking: owner-routed tables with one row form and optimizer share arrays
(`Embedding.stacks`).

Stacked and unstacked embeddings must be the same embedding: lookups and updates against the
float64 reference and against `stacking=False`, on 1 to 8 devices, "div" and "mod", on XLA
ops and the Pallas kernels; a skipped member leaves its rows alone while the others update;
export, checkpoints and `shard_rows` speak per-table rows whatever the stacking; a stack whose
exchanged rows overflow the kernels' VMEM stays one call with more rounds, and one whose
activations do runs in parts, with the same results.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
import reference
from conftest import make_mesh

B = 16
VOCAB = {"users": 37, "items": 50, "tags": 9}  # Stacked (dim 4), in this order.


def _spec(strategy="div", optimizer=None):
    users = jte.TableConfig(VOCAB["users"], 4, combiner="sum", name="users")
    items = jte.TableConfig(VOCAB["items"], 4, combiner="mean", name="items")
    tags = jte.TableConfig(VOCAB["tags"], 4, combiner="sqrtn", name="tags")
    wide = jte.TableConfig(23, 6, combiner="sum", name="wide")  # Another dim: alone.
    own = jte.TableConfig(13, 4, combiner="sum", name="own", optimizer=jte.SGD(0.2))
    return jte.EmbeddingSpec(
        {
            "user": jte.FeatureConfig(users),
            "history": jte.FeatureConfig(items, max_sequence_length=3),
            "item": jte.FeatureConfig(items),
            "tag": jte.FeatureConfig(tags),
            "wide": jte.FeatureConfig(wide),
            "own": jte.FeatureConfig(own),
        },
        optimizer or jte.Adagrad(0.3, initial_accumulator_value=0.2),
        partition_strategy=strategy,
    )


def _features(rng):
    def ids(vocab, shape, missing=0.2):
        x = rng.integers(0, max(2, vocab // 3), shape)  # Few distinct ids: duplicates.
        x[rng.random(shape) < missing] = -1
        return x.astype(np.int32)

    return {
        "user": ids(VOCAB["users"], (B, 4)),
        "history": ids(VOCAB["items"], (B, 3)),
        "item": ids(VOCAB["items"], (B,), 0.0),
        "tag": jte.Weighted(ids(VOCAB["tags"], (B, 2)), rng.uniform(0.5, 2, (B, 2)).astype("f4")),
        "wide": ids(23, (B, 2)),
        "own": ids(13, (B, 2)),
    }


# (feature, table, combiner, sequence length) for the reference.
_FEATURES = [
    ("user", "users", "sum", 0),
    ("history", "items", "mean", 3),
    ("item", "items", "mean", 0),
    ("tag", "tags", "sqrtn", 0),
    ("wide", "wide", "sum", 0),
    ("own", "own", "sum", 0),
]


def _split(leaf):
    if isinstance(leaf, jte.Weighted):
        return np.asarray(leaf.ids), np.asarray(leaf.weights)
    return np.asarray(leaf), None


def _grads(rng, acts):
    return {k: rng.normal(size=np.shape(v)).astype(np.float32) for k, v in acts.items()}


def _reference_step(tables, slots, features, grads):
    """(activations, tables, slots) of one float64 lookup and update."""
    acts, contributions = {}, {}
    for f, t, combiner, length in _FEATURES:
        ids, weights = _split(features[f])
        ids = ids if ids.ndim == 2 else ids[:, None]
        acts[f] = reference.lookup(tables[t], ids, weights, combiner, length)
        contributions.setdefault(t, []).append((ids, weights, combiner, length, grads[f]))
    new_tables, new_slots = dict(tables), dict(slots)
    for t, parts in contributions.items():
        rows = reference.row_gradients(tables[t].shape[0], parts)
        name, lr = ("sgd", 0.2) if t == "own" else ("adagrad", 0.3)
        new_tables[t], new_slots[t] = reference.apply(name, {}, tables[t], slots[t], rows, lr)
    return acts, new_tables, new_slots


def _close(got, want, what):
    for k in want:
        np.testing.assert_allclose(
            np.asarray(got[k]), want[k], rtol=2e-5, atol=2e-6, err_msg=f"{what} {k}"
        )


def _owner(strategy="div", num_shards=2, **kw):
    return jte.Embedding(_spec(strategy), make_mesh(num_shards), routing="owner", **kw)


def test_stacks_group_tables_of_one_row_form_and_optimizer():
    emb = _owner()
    assert {frozenset(v) for v in emb.stacks.values()} == {
        frozenset({"users", "items", "tags"}),
        frozenset({"wide"}),
        frozenset({"own"}),
    }
    assert all(key == "+".join(members) for key, members in emb.stacks.items())
    state = emb.init(jax.random.key(0))
    assert set(state.tables) == set(state.slots) == set(emb.stacks)
    assert set(emb.export(state)) == set(emb.backends) == set(emb.table_plans)
    for alone in (_owner(stacking=False), jte.Embedding(_spec(), make_mesh(2), routing="gather")):
        assert alone.stacks == {t: (t,) for t in alone.table_plans}
    # Per-table capacities: set for some members only, the tables keep apart.
    some = _owner(max_ids_per_shard={"users": 64})
    assert "users" in some.stacks and "items+tags" in some.stacks, some.stacks
    # Tables that round stochastically, or an optimizer touching every row, stay alone.
    bf16 = jte.TableConfig(30, 4, dtype=jnp.bfloat16, name="b")
    f32 = jte.TableConfig(30, 4, name="f")
    spec = jte.EmbeddingSpec(
        {"b": jte.FeatureConfig(bf16), "f": jte.FeatureConfig(f32), "g": jte.FeatureConfig(f32)},
        jte.Adagrad(0.1),
    )
    assert jte.Embedding(spec, make_mesh(2), routing="owner").stacks == {"b": ("b",), "f": ("f",)}
    # A table named like a stack would share its state key: a clear error.
    named = jte.TableConfig(30, 4, name="f+g", optimizer=jte.SGD(0.1))
    clash = jte.EmbeddingSpec(
        {
            "f": jte.FeatureConfig(f32),
            "g": jte.FeatureConfig(jte.TableConfig(30, 4, name="g")),
            "h": jte.FeatureConfig(named),
        },
        jte.Adagrad(0.1),
    )
    with pytest.raises(ValueError, match=r"\['f\+g'\] name both a table and a stack"):
        jte.Embedding(clash, make_mesh(2), routing="owner")
    dense = jte.EmbeddingSpec(
        {"a": jte.FeatureConfig(jte.TableConfig(30, 4, name="a")), "c": jte.FeatureConfig(f32)},
        jte.Adam(0.1, lazy_adam=False),
    )
    assert len(jte.Embedding(dense, make_mesh(2), routing="owner").stacks) == 2


@pytest.mark.parametrize(
    "strategy,num_shards,backend",
    [
        pytest.param("mod", 2, "xla", marks=pytest.mark.slow),
        pytest.param("mod", 4, "pallas_interpret", marks=pytest.mark.slow),
        pytest.param("div", 8, "xla", marks=pytest.mark.slow),
    ],
)
def test_stacked_tables_train_as_the_reference(strategy, num_shards, backend, rng):
    emb = _owner(strategy, num_shards, backend=backend)
    assert len(emb.stacks) == 3
    state = emb.init(jax.random.key(4))
    for _ in range(2):
        features = _features(rng)
        tables, slots = emb.export(state), emb.export_slots(state)
        acts = emb.lookup(state, features)
        grads = _grads(rng, acts)
        want_acts, want_tables, want_slots = _reference_step(tables, slots, features, grads)
        _close(acts, want_acts, "lookup")
        state = emb.apply_gradients(state, features, grads)
        got_tables, got_slots = emb.export(state), emb.export_slots(state)
        _close(got_tables, want_tables, "table")
        for t in want_slots:
            _close(got_slots[t], want_slots[t], f"slots of {t}")
        for t, table in tables.items():
            touched = np.any(want_tables[t] != table, axis=1)
            np.testing.assert_array_equal(got_tables[t][~touched], table[~touched], err_msg=t)


@pytest.mark.slow  # The fast tier: test_stacked_tables_train_as_the_reference.
def test_a_skipped_member_keeps_its_rows_while_the_others_update(rng):
    emb = _owner(num_shards=4)
    state = emb.init(jax.random.key(1))
    before = emb.export(state)
    features = _features(rng)
    grads = _grads(rng, emb.lookup(state, features))
    grads["tag"][3, 1] = np.nan  # Only table "tags" is skipped.
    state, skipped = emb.apply_gradients(state, features, grads, return_skipped=True)
    assert {t: int(v) for t, v in skipped.items()} == {
        "users": 0,
        "items": 0,
        "tags": 1,
        "wide": 0,
        "own": 0,
    }
    after = emb.export(state)
    np.testing.assert_array_equal(after["tags"], before["tags"])
    for t in ("users", "items"):
        assert not np.array_equal(after[t], before[t]), t
    assert int(state.step) == 1


@pytest.mark.slow  # Checkpoints of a stack: the fast tier trains stacks (test_stacked_*).
def test_export_checkpoint_and_shard_rows_speak_per_table_rows(tmp_path, rng):
    from jax_tpu_embed import checkpoint

    stacked = _owner("mod", 4)
    state = stacked.init(jax.random.key(2))
    features = _features(rng)
    state = stacked.apply_gradients(state, features, _grads(rng, stacked.lookup(state, features)))
    checkpoint.save(tmp_path, stacked, state)
    plain = jte.Embedding(_spec("div"), make_mesh(2))  # The all-gather path: no stacks.
    assert len(plain.stacks) == 5
    restored, _ = checkpoint.restore(tmp_path, plain)
    for a, b in [(stacked.export, plain.export), (stacked.export_slots, plain.export_slots)]:
        for x, y in zip(jax.tree.leaves(a(state)), jax.tree.leaves(b(restored))):
            np.testing.assert_array_equal(x, y)
    # Back again, through restore_tables, onto the stacked embedding.
    again = stacked.restore_tables(plain.export(restored), plain.export_slots(restored), step=1)
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for t in ("users", "items", "tags"):
        want = stacked.export(state)[t][np.arange(VOCAB[t]) % 4 == 1]
        np.testing.assert_array_equal(stacked.shard_rows(state, t, 1), want)


@dataclasses.dataclass(frozen=True)
class _OneTableAtATime(jte.backends.Pallas):
    """The Pallas kernels (interpreted), holding one table's call at most."""

    interpret: bool = True

    def holds(self, plan, rows):
        return len(plan.tables) == 1


@pytest.mark.slow
def test_a_stack_runs_in_parts_where_one_call_would_not_fit(rng):
    """A stack in one call, or in parts of whole members when the kernels cannot hold every
    feature at once: the same results."""
    (name,) = [k for k in _owner().stacks if "+" in k]
    members = [[t] for t in _owner().stacks[name]]
    shapes = {"user": (8, 4), "history": (8, 3), "item": (8, 1), "tag": (8, 2)}
    shapes |= {"wide": (8, 2), "own": (8, 1)}
    calls = _owner(backend="pallas_interpret").call_plans(shapes)
    assert [list(calls[name].tables)] == [sum(members, [])]
    # Kernels that hold one table's features at most: owner routing's parts are its members,
    # each run by the kernels, and id_counts and plan see the calls the engine makes.
    owner = _owner(backend=_OneTableAtATime())
    calls = owner.call_plans(shapes)
    assert [k for k in calls if k.startswith(name)] == [f"{name}#{i}" for i in range(3)]
    assert [list(calls[f"{name}#{i}"].tables) for i in range(3)] == members
    assert all(calls[f"{name}#{i}"].fallback is None for i in range(3))
    plain = _owner(backend=_OneTableAtATime(), stacking=False)
    states = [e.init(jax.random.key(3)) for e in (owner, plain)]
    for _ in range(2):
        features = _features(rng)
        grads = _grads(rng, owner.lookup(states[0], features))
        states = [e.apply_gradients(s, features, grads) for e, s in zip((owner, plain), states)]
    got, want = owner.export(states[0]), plain.export(states[1])
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # Owner routing under jit on an Auto mesh: test_routing's fast case.
def test_jit_step_on_batch_sharded_arrays_on_an_auto_mesh(rng):
    """The other tests run on Explicit meshes (jax.make_mesh); this one on Auto axes."""
    mesh = make_mesh(8, "auto")
    results = []
    for stacking in (True, False):
        emb = jte.Embedding(_spec("mod"), mesh, routing="owner", stacking=stacking)
        sharding = NamedSharding(mesh, P(emb.axis))
        put = lambda tree, s=sharding: jax.tree.map(
            lambda x: jax.device_put(np.asarray(x), s), tree
        )

        @jax.jit
        def step(state, features, grads, emb=emb):
            return emb.apply_gradients(state, features, grads), emb.lookup(state, features)

        step_rng = np.random.default_rng(7)
        state, acts = emb.init(jax.random.key(5)), None
        for _ in range(2):
            features = _features(step_rng)
            grads = _grads(step_rng, emb.lookup(state, features))
            state, acts = step(state, put(features), put(grads))
        results.append((emb.export(state), emb.export_slots(state), acts))
    for x, y in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_id_counts_report_the_rounds_of_the_stack(rng):
    """Owner routing exchanges a stack's rows together: the rounds are the stack's, and
    a capacity of a few rows per owner takes more of them than the whole batch's."""
    features = _features(rng)
    counts = {c: _owner(num_shards=4, max_ids_per_shard=c).id_counts(features) for c in (8, 4096)}
    assert counts[4096]["users"]["passes"] == 1
    small = counts[8]
    assert small["users"]["passes"] == small["items"]["passes"] == small["tags"]["passes"] > 1
    assert small["users"]["pairs"] == B * 4 and small["items"]["pairs"] == B * 4


@pytest.mark.slow
def test_a_stack_whose_exchanged_rows_overflow_vmem_stays_one_call(rng):
    """Kernels whose VMEM holds fewer exchanged rows than the stack's default capacity but
    all of its activations: the stack stays one call at the capacity that fits and runs
    more rounds (parts of whole tables would cost a call, a sort and a loop per part), and
    trains as the reference and as the unstacked tables."""
    vocab, length = 400, 6
    spec = jte.EmbeddingSpec(
        {n: jte.FeatureConfig(jte.TableConfig(vocab, 64, name=n)) for n in ("a", "b")},
        jte.Adagrad(0.5),
    )
    # 96 pairs per device on 4 devices: default Cd 48 (96 lane-dense rows of 2 per round);
    # a VMEM of 40 such rows (40 x 512 bytes in its half) holds Cd = 16, and the activations.
    kernels = jte.backends.Pallas(interpret=True, vmem=40 * 512 * 2)
    features = {}
    for n in ("a", "b"):  # Power-law ids: the hot low rows on shard 0 under "div".
        ids = (rng.pareto(0.8, (32, length)) * 3).astype(np.int64) % vocab
        ids[rng.random(ids.shape) < 0.1] = -1
        features[n] = ids.astype(np.int32)
    for stacking, want_calls in ((True, ["a+b"]), (False, ["a", "b"])):
        emb = jte.Embedding(spec, make_mesh(4), routing="owner", backend=kernels, stacking=stacking)
        calls = emb.call_plans({n: (8, length) for n in ("a", "b")})
        assert list(calls) == want_calls
        assert all(c.kernel == kernels and c.fallback is None for c in calls.values())
        assert {c.capacity for c in calls.values()} == {16}
        assert emb.id_counts(features)["a"]["passes"] > 1
        state = emb.init(jax.random.key(3))
        tables, slots = emb.export(state), emb.export_slots(state)
        acts = emb.lookup(state, features)
        grads = _grads(rng, acts)
        state = emb.apply_gradients(state, features, grads)
        got_t, got_s = emb.export(state), emb.export_slots(state)
        for n in ("a", "b"):
            want = reference.lookup(tables[n], features[n], None, "mean")
            np.testing.assert_allclose(acts[n], want, rtol=1e-5, atol=1e-6, err_msg=n)
            rows = reference.row_gradients(vocab, [(features[n], None, "mean", 0, grads[n])])
            want_t, want_s = reference.apply("adagrad", {}, tables[n], slots[n], rows, 0.5)
            np.testing.assert_allclose(got_t[n], want_t, rtol=2e-5, atol=2e-6, err_msg=n)
            np.testing.assert_allclose(
                got_s[n]["accumulators"], want_s["accumulators"], rtol=2e-5, atol=2e-6
            )


def test_id_counts_and_plan_see_the_capacity_of_a_member_too_big_for_the_kernels(rng):
    """When a member's activations alone overflow the kernels' VMEM, XLA ops do its row
    work at the default capacity, not the one VMEM would cap: `id_counts` simulates its
    rounds and `plan` reports its rows per owner at the capacity the step takes."""
    from jax_tpu_embed import plan

    vocab, length = 400, 6
    spec = jte.EmbeddingSpec(
        {n: jte.FeatureConfig(jte.TableConfig(vocab, 64, name=n)) for n in ("a", "b")},
        jte.Adagrad(0.5),
    )
    # 48 pairs per device and member on 4 devices: XLA ops' default Cd 24. A VMEM of 16
    # lane-dense rows would cap the kernels' at 16 (the least, 8 of k = 2), whose 32
    # exchanged rows it cannot hold.
    kernels = jte.backends.Pallas(interpret=True, vmem=16 * 512 * 2)

    # Each device has 20 distinct rows on shard 0 ("div": 100 rows each) and 28 ids on the
    # others: at most 24 distinct rows for any owner (one round at the default capacity),
    # more than 16 for one (several at the capped one).
    def device_ids():
        x = np.concatenate([rng.choice(100, 20, replace=False), rng.integers(100, 400, 28)])
        return rng.permutation(x).reshape(8, length)

    features = {
        n: np.concatenate([device_ids() for _ in range(4)]).astype(np.int32) for n in ("a", "b")
    }
    emb = jte.Embedding(spec, make_mesh(4), routing="owner", backend=kernels)
    counts = emb.id_counts(features)
    routes = plan.routes(emb, 32, {"a": length, "b": length})
    assert [r["tables"] for r in routes] == [["a"], ["b"]]  # Parts: a member each.
    assert [r["rows_per_owner_and_round"] for r in routes] == [24, 24]
    assert [r["kernel"] for r in routes] == ["xla", "xla"] and all("fallback" in r for r in routes)
    for n in ("a", "b"):
        assert counts[n]["passes"] == 1
        ids = features[n].reshape(4, -1)  # Device d holds examples [8d, 8d + 8).
        distinct = [len(np.unique(ids[d][ids[d] // 100 == p])) for d in range(4) for p in range(4)]
        assert 16 < max(distinct) <= 24
    state = emb.init(jax.random.key(3))
    tables = emb.export(state)
    acts = emb.lookup(state, features)
    for n in ("a", "b"):
        want = reference.lookup(tables[n], features[n], None, "mean")
        np.testing.assert_allclose(acts[n], want, rtol=1e-5, atol=1e-6, err_msg=n)
