"""Starting the flax train step from given weights (issue 26, item 6): dense params from
another framework and tables from `restore_tables`, through `init(..., params=,
embedding_state=)` instead of replacing the state's fields by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
from conftest import make_mesh
from test_flax import Model, make_batch, make_spec, mse


def _setup():
    emb = jte.Embedding(make_spec(), make_mesh(2))
    model = Model(jte.flax.Embed.from_embedding(emb))
    step = jte.flax.make_train_step(model, mse, optax.sgd(0.1))
    return emb, step


def test_flax_init_from_given_params_and_tables():
    emb, step = _setup()
    batch = make_batch(np.random.default_rng(0))
    rng = np.random.default_rng(1)
    # "Weights from another framework": NumPy arrays shaped as the model's.
    theirs = jax.tree.map(
        lambda x: rng.normal(size=x.shape).astype(np.float32),
        step.init(jax.random.key(0), batch).params,
    )
    tables = {
        n: rng.normal(size=(t.vocabulary_size or 0, t.dim)).astype(np.float32)
        for n, t in emb.spec.tables().items()
    }
    slots = {n: {"accumulators": np.full(t.shape, 0.3, np.float32)} for n, t in tables.items()}
    restored = emb.restore_tables(tables, slots, step=7)
    state = step.init(jax.random.key(5), batch, params=theirs, embedding_state=restored)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), theirs)
    got = emb.export(jte.flax.embedding_states(state.embedding)["embed"])
    jax.tree.map(np.testing.assert_array_equal, got, tables)
    assert int(state.step) == 7
    # The same training as from a state whose fields were replaced by hand.
    by_hand = step.init(jax.random.key(5), batch)
    replicated = NamedSharding(emb.mesh, P())
    params = jax.device_put(theirs, replicated)
    by_hand = dataclasses.replace(
        by_hand,
        params=params,
        opt_state=jax.device_put(step.tx.init(params), replicated),
        embedding=jte.flax.replace_embedding_states(
            by_hand.embedding, {"embed": emb.restore_tables(tables, slots, step=7)}
        ),
        step=jax.device_put(jnp.asarray(7, jnp.int32), replicated),
    )
    new, metrics = step(state, batch)
    _, want = step(by_hand, batch)
    assert int(new.step) == 8
    np.testing.assert_allclose(float(metrics["loss"]), float(want["loss"]), rtol=1e-6)


def test_flax_init_refuses_mismatched_weights():
    emb, step = _setup()
    batch = make_batch(np.random.default_rng(0))
    params = jax.tree.map(np.asarray, step.init(jax.random.key(0), batch).params)
    bad = jax.tree.map(lambda x: np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype), params)
    with pytest.raises(ValueError, match=r"init: params\['head'\]\['(bias|kernel)'\] is float32"):
        step.init(jax.random.key(0), batch, params=bad)
    with pytest.raises(ValueError, match="init: params does not have the structure"):
        step.init(jax.random.key(0), batch, params={"other": params["head"]})
    other = jte.Embedding(make_spec(v_user=70), make_mesh(2))
    with pytest.raises(ValueError, match=r"init: embedding_state\['embed'\]"):
        step.init(jax.random.key(0), batch, embedding_state=other.init(jax.random.key(0)))
    with pytest.raises(ValueError, match=r"\['nope'\], which are not Embed layers"):
        step.init(jax.random.key(0), batch, embedding_state={"nope": emb.init(jax.random.key(0))})


def test_nnx_step_from_given_params_and_tables():
    from flax import nnx

    spec = make_spec()

    class NnxModel(nnx.Module):
        def __init__(self, rngs):
            self.embed = jte.nnx.Embed(spec, make_mesh(2), rngs=rngs)
            self.head = nnx.Linear(3 * 4, 1, rngs=rngs)

        def __call__(self, features):
            acts = self.embed(features)
            x = jnp.concatenate([acts["history"], acts["item"], acts["user"]], axis=-1)
            return self.head(x)[:, 0]

    def loss_fn(model, batch):
        return jnp.mean((model(batch["features"]) - batch["y"]) ** 2)

    model = NnxModel(nnx.Rngs(0))
    step = jte.nnx.make_train_step(model, loss_fn, optax.sgd(0.1))
    batch = make_batch(np.random.default_rng(0))
    step(batch)  # A step taken, then restarted from other weights.
    rng = np.random.default_rng(3)
    theirs = jax.tree.map(
        lambda x: rng.normal(size=x.shape).astype(np.float32),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    )
    emb = model.embed.embedding
    tables = {
        n: rng.normal(size=(t.vocabulary_size or 0, t.dim)).astype(np.float32)
        for n, t in spec.tables().items()
    }
    step.init(params=theirs, embedding_state=emb.restore_tables(tables, step=3, key=None))
    assert step.state is None
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got), theirs)
    jax.tree.map(np.testing.assert_array_equal, emb.export(model.embed.embedding_state), tables)
    metrics = step(batch)
    assert np.isfinite(float(metrics["loss"])) and int(model.embed.embedding_state.step) == 4
    bad = jax.tree.map(lambda x: np.zeros(x.shape + (1,), x.dtype), theirs)
    with pytest.raises(ValueError, match=r"init: params\['head'\]"):
        step.init(params=bad)
    with pytest.raises(ValueError, match=r"\['x'\], which are not Embed layers"):
        step.init(embedding_state={"x": emb.init(jax.random.key(0))})
