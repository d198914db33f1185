"""jte.nnx: the Embed module, its train step against the generic one, dropout and batch norm,
and checkpoints across meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _train

B, D = 16, 4
V_USER, V_ITEM = 61, 29


def make_spec(strategy="div", optimizer=None, pipeline=False):
    user = jte.TableConfig(V_USER, D, combiner="mean", name="user")
    item = jte.TableConfig(V_ITEM, D, combiner="sum", name="item")
    return jte.EmbeddingSpec(
        {
            "user": jte.FeatureConfig(user),
            "item": jte.FeatureConfig(item),
            "history": jte.FeatureConfig(item),
        },
        optimizer or jte.Adagrad(learning_rate=0.2),
        partition_strategy=strategy,
        pipeline_execution=pipeline,
    )


def make_batch(rng, n=B, hi_item=V_ITEM):
    history = rng.integers(0, hi_item, (n, 3))
    history[rng.random((n, 3)) < 0.3] = -1
    user = rng.integers(0, V_USER, (n, 2))
    return {
        "features": {
            "user": user.astype(np.int32),
            "item": rng.integers(0, hi_item, n).astype(np.int32),
            "history": history.astype(np.int32),
        },
        # A target the embeddings can learn: a fixed function of the user ids.
        "y": np.sin(user[:, 0]).astype(np.float32),
    }


class Model(nnx.Module):
    def __init__(self, spec, mesh, rngs, *, regularize=True):
        self.embed = jte.nnx.Embed(spec, mesh, rngs=rngs)
        self.regularize = regularize
        if regularize:
            self.bn = nnx.BatchNorm(3 * D, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(3 * D, 1, rngs=rngs)

    def __call__(self, features):
        acts = self.embed(features)
        x = jnp.concatenate([acts["history"], acts["item"], acts["user"]], axis=-1)
        if self.regularize:
            x = self.drop(self.bn(x))
        return self.head(jnp.tanh(x))[:, 0]


def mse(model, batch):
    return jnp.mean((model(batch["features"]) - batch["y"]) ** 2)


def touched(batches, table):
    ids = []
    for b in batches:
        f = b["features"]
        ids += [f["user"].ravel()] if table == "user" else [f["item"], f["history"].ravel()]
    ids = np.concatenate(ids)
    return np.unique(ids[ids >= 0])


def untouched_rows_identical(before, after, rows):
    mask = np.ones(len(before), bool)
    mask[rows] = False
    np.testing.assert_array_equal(after[mask], before[mask])
    assert not np.array_equal(after[rows], before[rows])


# ----------------------------------------------------------------------- the module


def test_tables_are_not_params_and_get_no_gradient():
    """nnx.Optimizer over nnx.Param never sees a table; a user's nnx.grad forms no (V, D)
    gradient and leaves the tables alone."""
    # An Auto mesh: eager NNX code mixes the mesh's activations with single-device params.
    model = Model(make_spec(), make_mesh(2, "auto"), nnx.Rngs(0), regularize=False)
    layer = model.embed
    assert isinstance(layer.state, jte.nnx.EmbeddingTable)
    assert not isinstance(layer.state, nnx.Param)
    params = nnx.state(model, nnx.Param)
    shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
    assert (V_USER, D) not in shapes and all(s[0] != V_ITEM for s in shapes if s)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = make_batch(np.random.default_rng(0))
    before = layer.embedding.export(layer.embedding_state)
    grads = nnx.grad(mse)(model, batch)  # wrt nnx.Param by default
    assert not jax.tree.leaves(nnx.state(grads, jte.nnx.EmbeddingTable))
    jaxpr = jax.make_jaxpr(lambda m, b: nnx.grad(mse)(m, b))(model, batch)
    table_shapes = {tuple(x.shape) for x in jax.tree.leaves(layer.embedding_state.tables)}
    outvar_shapes = {tuple(v.aval.shape) for v in jaxpr.jaxpr.outvars}
    assert not outvar_shapes & table_shapes
    opt.update(model, grads)
    after = layer.embedding.export(layer.embedding_state)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_embed_outside_the_step_is_a_lookup():
    mesh = make_mesh(4)
    spec = make_spec("mod")
    emb = jte.Embedding(spec, mesh)
    layer = jte.nnx.Embed.from_embedding(emb, rngs=nnx.Rngs(3))
    assert layer.embedding is emb
    # The tables are Embedding.init(rngs.params()): the same logical tables on any mesh.
    want = emb.export(emb.init(nnx.Rngs(3).params()))
    got = emb.export(layer.embedding_state)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    features = make_batch(np.random.default_rng(1))["features"]
    acts = layer(features)
    ref = emb.lookup(layer.embedding_state, features)
    jax.tree.map(np.testing.assert_array_equal, acts, ref)
    with pytest.raises(TypeError, match="spec must be a jte.EmbeddingSpec"):
        jte.nnx.Embed({"user": 1}, rngs=nnx.Rngs(0))  # pyright: ignore[reportArgumentType]


# ------------------------------------------------------------------- the train step


# Pipelined: test_two_embeds_one_nested_one_pipelined in the fast tier.
@pytest.mark.parametrize("pipeline", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_nnx_step_equals_generic_step(pipeline):
    """Same tables, same dense params: the NNX step and jte.make_train_step (checked against
    a float64 reference in test_train.py) agree after several steps, metrics included."""
    mesh = make_mesh(4)
    spec = make_spec("mod", pipeline=pipeline)
    emb = jte.Embedding(spec, mesh)
    model = Model(spec, mesh, nnx.Rngs(0), regularize=False)
    model.embed = jte.nnx.Embed.from_embedding(emb, rngs=nnx.Rngs(0))
    tx = optax.adam(0.02)
    step = jte.nnx.make_train_step(model, mse, tx)

    graphdef, params, _, rest = nnx.split(model, nnx.Param, jte.nnx.EmbeddingTable, ...)

    def loss_fn(p, acts, batch):
        m = nnx.merge(graphdef, p, nnx.state(model, jte.nnx.EmbeddingTable), rest)
        x = jnp.concatenate([acts["history"], acts["item"], acts["user"]], axis=-1)
        return jnp.mean((m.head(jnp.tanh(x))[:, 0] - batch["y"]) ** 2)

    generic = jte.make_train_step(emb, loss_fn, tx)
    rng = np.random.default_rng(2)
    batches = [make_batch(rng) for _ in range(4)]
    gstate = generic.init(None, params, batches[0], embedding_state=model.embed.embedding_state)
    gstate = jax.tree.map(jnp.copy, gstate)
    for batch in batches:
        m = step(batch)
        gstate, gm = generic(gstate, batch)
        np.testing.assert_allclose(float(m["loss"]), float(gm["loss"]), rtol=1e-5)
        assert int(m["skipped"]) == 0 and int(m["invalid_ids"]) == 0
    step.flush()
    gstate = generic.flush(gstate)
    got, want = emb.export(model.embed.embedding_state), emb.export(gstate.embedding)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        nnx.state(model, nnx.Param),
        gstate.params,
    )
    assert step.state is not None and int(step.state.step) == len(batches)
    assert step.trace_count == 1


@pytest.mark.slow  # The fast tier: test_nnx_step_equals_generic_step.
def test_dropout_and_batchnorm_train_and_touch_only_batch_rows():
    """Dropout draws new masks every step, batch statistics move, the loss falls, only the
    rows of the batches change (the others bit for bit), and eval-mode inference works."""
    mesh = make_mesh(2)
    model = Model(make_spec(), mesh, nnx.Rngs(0))
    rng = np.random.default_rng(3)
    batches = [make_batch(rng, hi_item=20) for _ in range(4)]
    layer = model.embed
    before = layer.embedding.export(layer.embedding_state)
    mean_before = np.asarray(model.bn.mean[...])
    step = jte.nnx.make_train_step(model, mse, optax.adam(0.02))
    losses = []
    for i in range(40):
        losses.append(float(step(batches[i % 4])["loss"]))
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])
    assert model.drop.rngs is not None
    assert int(model.drop.rngs.count[...]) == 40  # One draw per step, none by the step itself.
    assert not np.allclose(np.asarray(model.bn.mean[...]), mean_before)
    after = layer.embedding.export(layer.embedding_state)
    for name in before:
        untouched_rows_identical(before[name], after[name], touched(batches, name))
    assert step.trace_count == 1

    # Train mode: dropout makes two calls differ; eval mode: deterministic, running stats.
    features = batches[0]["features"]
    assert not np.allclose(model(features), model(features))
    model.eval()
    out = model(features)
    assert out.shape == (B,)
    np.testing.assert_array_equal(out, model(features))
    # Training after eval (the mode is part of the model's structure): back in train mode.
    model.train()
    step(batches[0])


def test_nonfinite_step_changes_nothing():
    model = Model(make_spec(), make_mesh(2), nnx.Rngs(0))
    step = jte.nnx.make_train_step(model, mse, optax.adam(0.02))
    batch = make_batch(np.random.default_rng(4))
    step(batch)
    raw = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: (
            np.asarray(jax.random.key_data(x))
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            else np.asarray(x)
        ),
        tree,
    )
    before = raw(nnx.state(model))
    opt_before = raw(step.opt_state)
    m = step(dict(batch, y=np.full(B, np.nan, np.float32)))
    assert int(m["skipped"]) == 1
    assert step.state is not None and int(step.state.skipped) == 1 and int(step.state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, raw(nnx.state(model)), before)
    jax.tree.map(np.testing.assert_array_equal, raw(step.opt_state), opt_before)
    assert int(step(batch)["skipped"]) == 0


def test_bad_models_raise():
    class NoEmbed(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match="no jte.nnx.Embed"):
        jte.nnx.make_train_step(NoEmbed(), mse, optax.sgd(0.1))
    with pytest.raises(TypeError, match="must be a flax.nnx Module"):
        jte.nnx.make_train_step(object(), mse, optax.sgd(0.1))  # pyright: ignore[reportArgumentType]

    model = Model(make_spec(), make_mesh(2), nnx.Rngs(0), regularize=False)

    def twice(model, batch):
        model.embed(batch["features"])
        return mse(model, batch)

    with pytest.raises(ValueError, match="called more than once"):
        jte.nnx.make_train_step(model, twice, optax.sgd(0.1))(make_batch(np.random.default_rng(0)))


# --------------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh_and_strategy(tmp_path):
    """Saved on 8 devices with "mod", restored on 2 devices with "div": the same tables,
    slots, dense params, batch statistics and optimizer state; training continues alike."""
    rng = np.random.default_rng(5)
    batches = [make_batch(rng) for _ in range(3)]
    model = Model(make_spec("mod"), make_mesh(8), nnx.Rngs(0))
    step = jte.nnx.make_train_step(model, mse, optax.adam(0.02))
    for b in batches:
        step(b)
    saved = jte.nnx.save_checkpoint(tmp_path, model, train_step=step)
    assert saved == 3

    other = Model(make_spec("div"), make_mesh(2), nnx.Rngs(1))
    other_step = jte.nnx.make_train_step(other, mse, optax.adam(0.02))
    other_step(batches[0])  # Creates its optimizer state, then overwritten.
    assert jte.nnx.restore_checkpoint(tmp_path, other, train_step=other_step) == 3
    src, dst = model.embed, other.embed
    assert dst.embedding.num_shards == 2 and dst.embedding.spec.partition_strategy == "div"
    for name, table in src.embedding.export(src.embedding_state).items():
        np.testing.assert_array_equal(dst.embedding.export(dst.embedding_state)[name], table)
    for name, slots in src.embedding.export_slots(src.embedding_state).items():
        for slot, value in slots.items():
            np.testing.assert_array_equal(
                dst.embedding.export_slots(dst.embedding_state)[name][slot], value
            )
    raw = lambda x: (  # noqa: E731
        jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    )
    rest = lambda m: jax.tree.map(raw, nnx.state(m, nnx.Not(jte.nnx.EmbeddingTable)))  # noqa: E731
    jax.tree.map(np.testing.assert_array_equal, rest(other), rest(model))
    assert other_step.state is not None and step.state is not None
    jax.tree.map(np.testing.assert_array_equal, other_step.opt_state, step.opt_state)
    assert int(other_step.state.step) == 3
    # The next step agrees (up to summation order across shards).
    m1, m2 = step(batches[1]), other_step(batches[1])
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    assert int(other_step.state.step) == 4


def test_step_forms_no_table_sized_value(monkeypatch):
    """A 1M-row table: the compiled NNX step's temporaries stay far below one table shard
    (a (V, D) gradient or a table copy would be one); the check does see a table copy when
    the step's ordering of update after lookup is taken away."""
    v, dim, shards = 1_000_000, 16, 2
    table = jte.TableConfig(v, dim, combiner="sum", name="big")
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table), "g": jte.FeatureConfig(table)}, jte.Adagrad(0.1)
    )

    class Big(nnx.Module):
        def __init__(self, rngs):
            self.embed = jte.nnx.Embed(spec, make_mesh(shards), rngs=rngs)
            self.head = nnx.Linear(dim, 1, rngs=rngs)

        def __call__(self, features):
            acts = self.embed(features)
            return self.head(jnp.tanh(acts["f"] + acts["g"]))[:, 0]

    model = Big(nnx.Rngs(0))
    batch = {
        "features": {
            "f": jax.ShapeDtypeStruct((256, 4), jnp.int32),
            "g": jax.ShapeDtypeStruct((256,), jnp.int32),
        }
    }

    def temp_bytes():
        # Linear in the activations: the gradients do not depend on what the lookup read.
        step = jte.nnx.make_train_step(
            model, lambda m, b: jnp.sum(m.head(m.embed(b["features"])["f"])), optax.sgd(0.1)
        )
        mem = step.lower(batch).compile().memory_analysis()
        assert mem is not None
        return mem.temp_size_in_bytes

    assert temp_bytes() < v * dim * 4 // shards / 50
    monkeypatch.setattr(_train, "_all_finite", lambda *trees: jnp.array(True))
    monkeypatch.setattr(_train, "_after_lookup", lambda grads, acts: grads)
    assert temp_bytes() >= v * dim * 4 // shards


def test_two_embeds_one_nested_one_pipelined():
    mesh = make_mesh(2)
    user = jte.TableConfig(41, D, name="user")
    item = jte.TableConfig(43, D, name="item")

    class Tower(nnx.Module):
        def __init__(self, rngs):
            spec = jte.EmbeddingSpec(
                {"item": jte.FeatureConfig(item)}, jte.SGD(0.5), pipeline_execution=True
            )
            self.embed = jte.nnx.Embed(spec, mesh, rngs=rngs)

    class TwoTowers(nnx.Module):
        def __init__(self, rngs):
            spec = jte.EmbeddingSpec({"user": jte.FeatureConfig(user)}, jte.SGD(0.5))
            self.users = jte.nnx.Embed(spec, mesh, rngs=rngs)
            self.tower = Tower(rngs)
            self.proj = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, batch):
            u = self.users(batch["u"])["user"]
            i = self.tower.embed(batch["i"])["item"]
            return jnp.sum(self.proj(u) * i, axis=-1)

    model = TwoTowers(nnx.Rngs(0))
    assert sorted(jte.nnx.embeds(model)) == ["tower/embed", "users"]
    rng = np.random.default_rng(7)

    def batch():
        return {
            "u": {"user": rng.integers(0, 41, B)},
            "i": {"item": rng.integers(0, 43, B)},
            "y": rng.normal(size=B).astype(np.float32),
        }

    step = jte.nnx.make_train_step(
        model, lambda m, b: jnp.mean((m(b) - b["y"]) ** 2), optax.sgd(0.1)
    )
    for _ in range(3):
        step(batch())
    assert int(model.users.embedding_state.step) == 3
    assert int(model.tower.embed.embedding_state.step) == 2  # One update pending.
    step.flush()
    assert int(model.tower.embed.embedding_state.step) == 3
    assert step.trace_count == 1
    with pytest.raises(ValueError, match="2 Embed layers"):
        jte.nnx.save_checkpoint("unused", model)
