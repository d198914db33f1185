"""jte.make_train_step: one jitted step against an independent float64 NumPy reference.

The model is linear in the activations, the loss a mean squared error; the reference computes
its gradients by hand, sums row gradients across examples and across the two features that
share a table, and applies Adagrad/SGD row by row, plainly or one step stale (pipelined).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _train

# The compiled steps of `setup` serve the whole module: it runs on one pytest-xdist worker
# (--dist loadgroup), so that they compile once.
pytestmark = pytest.mark.xdist_group("train")

B, D = 16, 4
V_SHARED, V_ONE = 97, 53
DENSE_LR = 0.05


def embedding_lr(step):
    """A schedule, so the test sees which step counter each update used."""
    return 0.3 / (1.0 + step)


def make_spec(optimizer: str, strategy="div", pipeline=False):
    shared = jte.TableConfig(V_SHARED, D, combiner="mean", name="shared")
    one = jte.TableConfig(V_ONE, D, combiner="sum", name="one")
    opt = (
        jte.Adagrad(learning_rate=embedding_lr, initial_accumulator_value=0.1)
        if optimizer == "adagrad"
        else jte.SGD(learning_rate=embedding_lr)
    )
    features = {
        "a": jte.FeatureConfig(shared),
        "b": jte.FeatureConfig(one),
        "c": {"w": jte.FeatureConfig(shared)},
    }
    return jte.EmbeddingSpec(
        features, opt, partition_strategy=strategy, pipeline_execution=pipeline
    )


def make_batch(rng, lo_shared=0, hi_shared=V_SHARED, lo_one=0, hi_one=V_ONE, label=None):
    """Multi-hot "a" (B, 3) with -1 pads, one-hot "b" (B,), weighted "c/w" (B, 2); ids in
    the given ranges, so duplicates within the batch are certain."""
    a = rng.integers(lo_shared, hi_shared, (B, 3))
    a[rng.random((B, 3)) < 0.3] = -1
    a[0] = -1  # An example with no ids.
    c_ids = rng.integers(lo_shared, hi_shared, (B, 2))
    c_ids[rng.random((B, 2)) < 0.2] = -1
    c_w = rng.uniform(0.5, 2.0, (B, 2)).astype(np.float32)
    y = rng.normal(size=B).astype(np.float32) if label is None else label
    return {
        "features": {
            "a": a.astype(np.int32),
            "b": rng.integers(lo_one, hi_one, B),
            "c": {"w": jte.Weighted(c_ids.astype(np.int32), c_w)},
        },
        "y": y,
    }


def loss_fn(params, acts, batch):
    x = jnp.concatenate([acts["a"], acts["b"], acts["c"]["w"]], axis=-1)  # (B, 3D)
    pred = x @ params["w"] + params["bias"]
    return jnp.mean((pred - batch["y"]) ** 2), {"pred_mean": jnp.mean(pred)}


def initial_params():
    return {"w": np.linspace(-0.5, 0.5, 3 * D).astype(np.float32), "bias": np.float32(0.1)}


# ------------------------------------------------------------------- float64 reference


def ref_parts(batch):
    """[(table, example, id, scale, slot of the activation)]: every (example, id) occurrence,
    with the combiner's factor; `slot` says which third of x the feature fills."""
    f = batch["features"]
    parts = []
    a = f["a"]
    for e in range(B):
        valid = a[e] >= 0
        for i in a[e][valid]:
            parts.append(("shared", e, int(i), 1.0 / valid.sum(), 0))
        parts.append(("one", e, int(f["b"][e]), 1.0, 1))
        ids, w = f["c"]["w"].ids[e], f["c"]["w"].weights[e].astype(np.float64)
        total = w[ids >= 0].sum()
        for i, wi in zip(ids, w):
            if i >= 0:
                parts.append(("shared", e, int(i), wi / total, 2))
    return parts


def ref_acts(tables, batch):
    x = np.zeros((B, 3, D))
    for table, e, i, s, slot in ref_parts(batch):
        x[e, slot] += s * tables[table][i]
    return x


def ref_step(state, batch, optimizer, pipeline):
    """One step of the documented semantics on float64 copies; returns the loss."""
    tables, params = state["tables"], state["params"]
    x = ref_acts(tables, batch)  # (B, 3, D)
    w = params["w"].reshape(3, D)
    pred = np.einsum("bsd,sd->b", x, w) + params["bias"]
    r = pred - batch["y"].astype(np.float64)
    loss = np.mean(r**2)
    dpred = 2 * r / B
    dx = dpred[:, None, None] * w[None]  # (B, 3, D)
    params["w"] = params["w"] - DENSE_LR * np.einsum("bsd,b->sd", x, dpred).reshape(-1)
    params["bias"] = params["bias"] - DENSE_LR * dpred.sum()
    update = (batch, dx)
    if pipeline:
        update, state["pending"] = state["pending"], update
    if update is not None:
        ref_sparse(state, update[0], update[1], optimizer)
    return loss


def ref_sparse(state, batch, dx, optimizer):
    """One sparse update; its learning rate sees the number of updates applied before."""
    tables, slots, step = state["tables"], state["slots"], state["applied"]
    state["applied"] += 1
    grads = {"shared": {}, "one": {}}
    for table, e, i, s, slot in ref_parts(batch):
        grads[table][i] = grads[table].get(i, 0.0) + s * dx[e, slot]
    lr = embedding_lr(step)
    for table, rows in grads.items():
        for i, g in rows.items():
            if optimizer == "adagrad":
                slots[table][i] += g * g
                tables[table][i] -= lr * g / np.sqrt(slots[table][i])
            else:
                tables[table][i] -= lr * g


def ref_flush(state, optimizer):
    if state["pending"] is not None:
        batch, dx = state["pending"]
        ref_sparse(state, batch, dx, optimizer)
        state["pending"] = None


def ref_state(tables, slots):
    return {
        "tables": {n: t.astype(np.float64) for n, t in tables.items()},
        "slots": {n: s["accumulators"].astype(np.float64) if s else None for n, s in slots.items()},
        "params": {k: np.asarray(v, np.float64) for k, v in initial_params().items()},
        "pending": None,
        "applied": 0,
    }


# ------------------------------------------------------------------------------- tests


@functools.cache
def setup(optimizer, strategy="div", pipeline=False, num_shards=2, kind="explicit"):
    """(emb, step, initial logical tables, initial slots), shared by the tests: every test
    that reuses a step also checks that it never traced again."""
    emb = jte.Embedding(make_spec(optimizer, strategy, pipeline), make_mesh(num_shards, kind))
    step = jte.make_train_step(emb, loss_fn, optax.sgd(DENSE_LR))
    state = emb.init(jax.random.key(0))
    return emb, step, emb.export(state), emb.export_slots(state)


def initial_state(emb, step, tables, slots, batch):
    return step.init(
        None, initial_params(), batch, embedding_state=emb.restore_tables(tables, slots)
    )


def run(optimizer, batches, **kwargs):
    emb, step, tables, slots = setup(optimizer, **kwargs)
    state = initial_state(emb, step, tables, slots, batches[0])
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    state = step.flush(state)
    assert step.trace_count == 1
    return emb, emb.export(state.embedding), state, losses


def _reference_cases():
    """Each mesh with and without pipelining; the fast tier takes each mesh once and
    pipelining on 8 devices (the other tests here pipeline on 2)."""
    meshes = [(1, "explicit", "div", "adagrad"), (8, "explicit", "mod", "adagrad")]
    meshes += [(4, "auto", "div", "sgd")]
    for pipeline in [False, True]:
        for case in meshes:
            fast = pipeline == (case[0] == 8)
            marks = [] if fast else [pytest.mark.slow]
            case_id = "-".join(map(str, case + (pipeline,)))
            yield pytest.param(*case, pipeline, id=case_id, marks=marks)


@pytest.mark.parametrize("num_shards,kind,strategy,optimizer,pipeline", list(_reference_cases()))
def test_step_matches_float64_reference(num_shards, kind, strategy, optimizer, pipeline):
    rng = np.random.default_rng(num_shards)
    batches = [make_batch(rng) for _ in range(4)]
    emb, got, state, losses = run(
        optimizer, batches, strategy=strategy, pipeline=pipeline, num_shards=num_shards, kind=kind
    )
    _, _, initial, initial_slots = setup(optimizer, strategy, pipeline, num_shards, kind)

    ref = ref_state(initial, initial_slots)
    ref_losses = [ref_step(ref, b, optimizer, pipeline) for b in batches]
    ref_flush(ref, optimizer)

    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for name in got:
        np.testing.assert_allclose(got[name], ref["tables"][name], rtol=2e-5, atol=2e-6)
        touched = np.any(ref["tables"][name] != initial[name].astype(np.float64), axis=1)
        assert 0 < touched.sum() < len(touched)
        np.testing.assert_array_equal(got[name][~touched], initial[name][~touched])
    for k in ("w", "bias"):
        np.testing.assert_allclose(state.params[k], ref["params"][k], rtol=2e-5, atol=2e-6)
    assert int(state.step) == int(state.embedding.step) == len(batches)


@pytest.mark.slow
def test_pipeline_equals_plain_when_consecutive_batches_share_no_ids():
    rng = np.random.default_rng(1)
    batches = [make_batch(rng, 20 * k, 20 * k + 20, 10 * k, 10 * k + 10) for k in range(4)]
    _, plain, _, l_plain = run("adagrad", batches)
    _, piped, _, l_piped = run("adagrad", batches, pipeline=True)
    np.testing.assert_allclose(l_piped, l_plain, rtol=1e-6)
    for name, table in plain.items():
        np.testing.assert_allclose(piped[name], table, rtol=1e-6, atol=1e-7)


def test_pipeline_differs_when_batches_share_ids():
    """One step stale: batch 2's lookup misses batch 1's update of the rows they share."""
    rng = np.random.default_rng(2)
    batches = [make_batch(rng) for _ in range(3)]
    _, plain, _, l_plain = run("adagrad", batches)
    _, piped, _, l_piped = run("adagrad", batches, pipeline=True)
    assert l_piped[0] == pytest.approx(l_plain[0], rel=1e-6)  # Same tables at step 0.
    assert abs(l_piped[1] - l_plain[1]) > 1e-4
    assert np.abs(piped["shared"] - plain["shared"]).max() > 1e-4


@pytest.mark.parametrize("pipeline", [False, True])
def test_nonfinite_step_is_skipped_and_counted(pipeline):
    rng = np.random.default_rng(3)
    good, later = make_batch(rng), make_batch(rng)
    bad = make_batch(rng, label=np.full(B, np.nan, np.float32))
    emb, step, tables, slots = setup("adagrad", pipeline=pipeline)
    state = initial_state(emb, step, tables, slots, good)
    state, m = step(state, good)
    assert int(m["skipped"]) == 0
    before_tables = emb.export(state.embedding)
    before_params = jax.device_get(state.params)
    state, m = step(state, bad)
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
    assert int(state.step) == 1 and int(state.skipped) == 1
    for k, v in before_params.items():
        np.testing.assert_array_equal(state.params[k], v)
    after = emb.export(state.embedding)
    if pipeline:
        # The good batch's update, pending until now, is applied; the bad one is not queued.
        assert state.pending is not None and not bool(state.pending.valid)
        for name, want in run("adagrad", [good])[1].items():
            np.testing.assert_allclose(after[name], want, rtol=1e-6, atol=1e-7)
    else:
        for name in after:
            np.testing.assert_array_equal(after[name], before_tables[name])
    assert int(state.embedding.step) == 1
    state, m = step(state, later)
    assert int(m["skipped"]) == 0 and int(state.step) == 2
    assert step.trace_count == 1


@jax.custom_vjp
def poisoned(x, bad):
    """The identity, whose backward adds `bad` (0, NaN or inf) to one element of the
    cotangent: a finite loss whose activation gradients are not finite, as a numerically
    unstable backward gives them, while the dense gradients stay finite."""
    return x


def _poisoned_fwd(x, bad):
    return x, bad


def _poisoned_bwd(bad, g):
    one = (jnp.arange(g.shape[0])[:, None] == 1) & (jnp.arange(g.shape[1]) == 0)
    return g + jnp.where(one, bad, 0.0).astype(g.dtype), jnp.zeros_like(bad)


poisoned.defvjp(_poisoned_fwd, _poisoned_bwd)


def poisoned_loss(params, acts, batch):
    return loss_fn(params, dict(acts, b=poisoned(acts["b"], batch["bad"])), batch)


class PoisonedModel(nn.Module):
    """The model of `loss_fn` as a flax module, its "b" activations through `poisoned`."""

    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        acts = self.embed(batch["features"])
        x = jnp.concatenate([acts["a"], poisoned(acts["b"], batch["bad"]), acts["c"]["w"]], axis=-1)
        return nn.Dense(1)(x)[:, 0]


def _poisoned_step(kind, batch):
    """(step, state) with Adagrad tables and optax.adam: every part of the state moves."""
    if kind == "generic":
        emb, _, tables, slots = setup("adagrad")
        step = jte.make_train_step(emb, poisoned_loss, optax.adam(0.01))
        return step, initial_state(emb, step, tables, slots, batch)
    model = PoisonedModel(jte.flax.Embed(make_spec("adagrad"), make_mesh(2)))
    step = jte.flax.make_train_step(
        model, lambda out, b: jnp.mean((out - b["y"]) ** 2), optax.adam(0.01)
    )
    return step, step.init(jax.random.key(0), batch)


@pytest.mark.parametrize("kind", ["generic", pytest.param("flax", marks=pytest.mark.slow)])
def test_finite_loss_with_nonfinite_activation_gradients_is_skipped(kind):
    """The loss and the dense gradients are finite, an activation gradient is NaN or inf:
    the step is skipped and counted, and nothing else in the state changes, bit for bit
    (tables, slots, embedding step, dense params, optax state, step counter)."""
    rng = np.random.default_rng(11)

    def batch(bad=0.0):
        return dict(make_batch(rng), bad=np.float32(bad))

    step, state = _poisoned_step(kind, batch())
    state, m = step(state, batch())
    assert int(m["skipped"]) == 0 and int(state.step) == 1
    for k, bad in enumerate([np.nan, np.inf, -np.inf]):
        before = jax.device_get(state)
        state, m = step(state, batch(bad))
        assert np.isfinite(float(m["loss"]))
        assert int(m["skipped"]) == 1 and int(state.skipped) == k + 1
        after = jax.device_get(state)
        assert int(after.step) == 1 and int(before.skipped) == k
        jax.tree.map(
            np.testing.assert_array_equal,
            dataclasses.replace(after, skipped=0),
            dataclasses.replace(before, skipped=0),
        )
    state, m = step(state, batch())  # A finite step afterwards is applied.
    assert int(m["skipped"]) == 0 and int(state.step) == 2 and int(state.skipped) == 3
    assert step.trace_count == 1


def test_step_counter_is_shared_with_the_schedules():
    rng = np.random.default_rng(4)
    emb = jte.Embedding(make_spec("sgd"), make_mesh(2))
    tx = optax.sgd(optax.linear_schedule(0.1, 0.0, 10))
    step = jte.make_train_step(emb, loss_fn, tx)
    state = step.init(jax.random.key(0), initial_params())
    batches = [
        make_batch(rng),
        make_batch(rng, label=np.full(B, np.inf, np.float32)),
        make_batch(rng),
        make_batch(rng),
    ]
    for batch in batches:
        state, _ = step(state, batch)
    count = optax.tree_utils.tree_get(state.opt_state, "count")
    assert int(state.step) == int(state.embedding.step) == int(count) == 3
    assert int(state.skipped) == 1


def test_metrics_and_invalid_ids():
    rng = np.random.default_rng(5)
    emb, step, tables, slots = setup("sgd")
    batch = make_batch(rng)
    state = initial_state(emb, step, tables, slots, batch)
    state, m = step(state, batch)
    assert set(m) == {"loss", "skipped", "invalid_ids", "aux"}
    assert int(m["invalid_ids"]) == 0 and "pred_mean" in m["aux"]
    batch = make_batch(rng)
    batch["features"]["b"] = jnp.asarray(batch["features"]["b"]).at[3].set(V_ONE + 5)
    state, m = step(state, batch)  # A jax.Array is not validated on the host.
    assert int(m["invalid_ids"]) == 1
    assert step.trace_count == 1


def test_features_fn_and_donation():
    rng = np.random.default_rng(6)
    emb = jte.Embedding(make_spec("sgd"), make_mesh(2))
    step = jte.make_train_step(
        emb,
        lambda p, a, b: loss_fn(p, a, {"y": b["label"]})[0],
        optax.adam(1e-2),
        features_fn=lambda b: b["sparse"],
    )
    params = jax.tree.map(jnp.asarray, initial_params())
    state = step.init(jax.random.key(0), params)
    old = state
    batch = make_batch(rng)
    state, m = step(state, {"sparse": batch["features"], "label": batch["y"]})
    assert "aux" not in m
    # Donated: updated in place.
    assert all(t.is_deleted() for t in old.embedding.tables.values())
    assert not params["w"].is_deleted()  # init copied the caller's params.


# ------------------------------------------------------------------------------ errors


@pytest.fixture
def small_step():
    emb, step, tables, slots = setup("sgd")
    return step, initial_state(emb, step, tables, slots, None)


def test_missing_and_extra_features_raise(small_step):
    step, state = small_step
    batch = make_batch(np.random.default_rng(7))
    del batch["features"]["b"]
    with pytest.raises(ValueError, match=r"missing features \['b'\]"):
        step(state, batch)
    batch = make_batch(np.random.default_rng(7))
    batch["features"]["zzz"] = np.zeros(B, np.int32)
    with pytest.raises(ValueError, match=r"unknown features \['zzz'\]"):
        step(state, batch)


def test_wrong_shapes_raise(small_step):
    step, state = small_step
    batch = make_batch(np.random.default_rng(8))
    batch["features"]["a"] = np.zeros((B, 3, 2), np.int32)
    with pytest.raises(ValueError, match=r"must be \(B,\) or \(B, L\)"):
        step(state, batch)
    batch = make_batch(np.random.default_rng(8))
    batch["features"]["b"] = batch["features"]["b"][: B - 2]
    with pytest.raises(ValueError, match="same batch size"):
        step(state, batch)


def test_bad_loss_and_batch_raise(small_step):
    step, state = small_step
    emb = step.embedding
    vector_loss = jte.make_train_step(emb, lambda p, a, b: jnp.sum(a["b"], axis=1), optax.sgd(0.1))
    batch = make_batch(np.random.default_rng(9))
    with pytest.raises(ValueError, match="float scalar loss"):
        vector_loss(vector_loss.init(jax.random.key(0), {}), batch)
    with pytest.raises(ValueError, match="no 'features' entry"):
        step(state, {"sparse": batch["features"], "y": batch["y"]})
    with pytest.raises(TypeError, match="jte.Embedding"):
        jte.make_train_step("not an embedding", loss_fn, optax.sgd(0.1))  # pyright: ignore[reportArgumentType]  (deliberately wrong)


def test_pipelined_init_needs_an_example_batch():
    emb = jte.Embedding(make_spec("sgd", pipeline=True), make_mesh(2))
    step = jte.make_train_step(emb, loss_fn, optax.sgd(DENSE_LR))
    with pytest.raises(ValueError, match="example batch"):
        step.init(jax.random.key(0), initial_params())


# --------------------------------------------------------------- no table-sized copies


@pytest.mark.parametrize("pipeline", [False, True])
def test_step_has_no_table_sized_temporaries(pipeline, monkeypatch):
    """A 1M-row table: the compiled step's temporaries stay far below one table shard.

    The loss is linear in the activations, so the activation gradients do not depend on what
    the lookup read (nor, pipelined, do the previous batch's). Without a data dependency XLA
    copies the whole table; in the plain step the finiteness check (which reads the loss)
    gives one too, so it is disabled below to show that `_after_lookup` alone suffices and
    that this test sees the copy when both are gone.
    """
    v, dim, shards = 1_000_000, 16, 2
    table = jte.TableConfig(v, dim, combiner="sum", name="big")
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table), "g": jte.FeatureConfig(table)},
        jte.Adagrad(0.1),
        pipeline_execution=pipeline,
    )
    emb = jte.Embedding(spec, make_mesh(shards))
    r = np.linspace(-1, 1, 256 * dim, dtype=np.float32).reshape(256, dim)
    batch = {
        "features": {
            "f": jax.ShapeDtypeStruct((256, 4), jnp.int32),
            "g": jax.ShapeDtypeStruct((256,), jnp.int32),
        }
    }

    def compiled_temp_bytes():
        step = jte.make_train_step(
            emb, lambda p, a, b: jnp.sum((a["f"] + a["g"]) * r) * p["s"], optax.sgd(0.1)
        )
        abstract = step.abstract_state({"s": jax.ShapeDtypeStruct((), jnp.float32)}, batch)
        mem = step.lower(abstract, batch).compile().memory_analysis()
        assert mem is not None
        return mem.temp_size_in_bytes

    shard_bytes = v * dim * 4 // shards
    assert compiled_temp_bytes() < shard_bytes / 50
    monkeypatch.setattr(_train, "_all_finite", lambda *trees: jnp.array(True))
    assert compiled_temp_bytes() < shard_bytes / 50
    monkeypatch.setattr(_train, "_after_lookup", lambda grads, acts: grads)
    assert compiled_temp_bytes() >= shard_bytes


def test_abstract_state_matches_init():
    emb = jte.Embedding(make_spec("adagrad", pipeline=True), make_mesh(2))
    step = jte.make_train_step(emb, loss_fn, optax.adam(1e-3))
    batch = make_batch(np.random.default_rng(10))
    real = step.init(jax.random.key(0), initial_params(), batch)
    abstract = step.abstract_state(initial_params(), batch)
    real_leaves, real_def = jax.tree.flatten(real)
    abs_leaves, abs_def = jax.tree.flatten(abstract)
    assert real_def == abs_def
    for x, a in zip(real_leaves, abs_leaves):
        assert (x.shape, x.dtype) == (a.shape, a.dtype)
        assert x.sharding.is_equivalent_to(a.sharding, x.ndim)
    assert dataclasses.is_dataclass(real) and real.pending is not None
