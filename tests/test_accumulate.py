"""make_train_step(..., accumulate_steps=k): k micro-batches, one dense and one sparse update.

For a loss summed over examples, a step over k micro-batches equals one step over their
concatenation: the same tables and slots (one optimizer update per touched row, duplicates
across micro-batches merged first), dense params, optax state and loss.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_tpu_embed as jte
from conftest import make_mesh

K, MICRO, D = 3, 8, 4  # 3 micro-batches of 8 examples; the concatenated batch has 24.
V_SHARED, V_ONE = 23, 11  # Small: ids repeat within and across micro-batches.

OPTIMIZERS = {
    "adagrad": lambda: jte.Adagrad(learning_rate=0.3, initial_accumulator_value=0.1),
    "adam": lambda: jte.Adam(learning_rate=0.05),
    "sgd": lambda: jte.SGD(learning_rate=0.2),
}


def make_spec(optimizer="adagrad", strategy="div"):
    shared = jte.TableConfig(V_SHARED, D, combiner="mean", name="shared")
    one = jte.TableConfig(V_ONE, D, combiner="sum", name="one")
    return jte.EmbeddingSpec(
        {
            "a": jte.FeatureConfig(shared),
            "b": jte.FeatureConfig(one),
            "c": {"w": jte.FeatureConfig(shared)},
        },
        OPTIMIZERS[optimizer](),
        partition_strategy=strategy,
    )


def make_micro_batches(rng) -> dict:
    """Leaves (K, MICRO, ...): multi-hot "a" with -1 pads, one-hot "b", weighted "c/w"."""
    a = rng.integers(0, V_SHARED, (K, MICRO, 3))
    a[rng.random((K, MICRO, 3)) < 0.3] = -1
    c = rng.integers(0, V_SHARED, (K, MICRO, 2))
    c[rng.random((K, MICRO, 2)) < 0.2] = -1
    return {
        "features": {
            "a": a.astype(np.int32),
            "b": rng.integers(0, V_ONE, (K, MICRO)).astype(np.int32),
            "c": {
                "w": jte.Weighted(
                    c.astype(np.int32), rng.uniform(0.5, 2.0, (K, MICRO, 2)).astype(np.float32)
                )
            },
        },
        "y": rng.normal(size=(K, MICRO)).astype(np.float32),
    }


def concatenated(batch):
    return jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + np.shape(x)[2:]), batch)


def linear_loss(params, acts, batch):
    """Summed over examples: the sum over micro-batches is the concatenated batch's loss."""
    x = jnp.concatenate([acts["a"], acts["b"], acts["c"]["w"]], axis=-1)
    pred = jnp.tanh(x) @ params["w"] + params["bias"]
    return jnp.sum((pred - batch["y"]) ** 2)


def initial_params():
    return {
        "w": jnp.asarray(np.linspace(-0.5, 0.5, 3 * D), jnp.float32),
        "bias": jnp.zeros((), jnp.float32),
    }


def assert_same_embedding(emb, got, want, tol=1e-5):
    for name, table in emb.export(want).items():
        np.testing.assert_allclose(emb.export(got)[name], table, rtol=tol, atol=tol)
    for name, slots in emb.export_slots(want).items():
        for slot, value in slots.items():
            np.testing.assert_allclose(
                emb.export_slots(got)[name][slot], value, rtol=tol, atol=tol, err_msg=slot
            )


@pytest.mark.parametrize(
    "optimizer,strategy,num_shards,kind",
    [
        ("adagrad", "div", 4, "explicit"),
        pytest.param("adam", "mod", 4, "auto", marks=pytest.mark.slow),
        pytest.param("sgd", "mod", 2, "explicit", marks=pytest.mark.slow),
        pytest.param("adam", "div", 1, "explicit", marks=pytest.mark.slow),
    ],
)
def test_accumulated_step_equals_concatenated_step(optimizer, strategy, num_shards, kind):
    emb = jte.Embedding(make_spec(optimizer, strategy), make_mesh(num_shards, kind))
    tx = optax.adam(0.05)
    acc = jte.make_train_step(emb, linear_loss, tx, accumulate_steps=K)
    one = jte.make_train_step(emb, linear_loss, tx)
    s_acc = acc.init(jax.random.key(0), initial_params())
    s_one = one.init(jax.random.key(0), initial_params())
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = make_micro_batches(rng)
        s_acc, m_acc = acc(s_acc, batch)
        s_one, m_one = one(s_one, concatenated(batch))
        np.testing.assert_allclose(float(m_acc["loss"]), float(m_one["loss"]), rtol=1e-5)
        assert int(m_acc["skipped"]) == 0
    assert_same_embedding(emb, s_acc.embedding, s_one.embedding)
    assert int(s_acc.embedding.step) == int(s_one.embedding.step) == 3  # One update per step.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        (s_acc.params, s_acc.opt_state),
        (s_one.params, s_one.opt_state),
    )
    assert acc.trace_count == 1


def test_one_update_per_row_not_one_per_micro_batch():
    """Adagrad, which is not additive over updates: the rows equal one update of each row's
    gradient summed over both micro-batches (float64 NumPy), a = a0 + g², w -= lr·g/√a."""
    table = jte.TableConfig(7, 2, combiner="sum", name="t")
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1, initial_accumulator_value=0.1)
    )
    emb = jte.Embedding(spec, make_mesh(2))
    r = np.array([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25], [2.0, 1.0]], np.float32)

    def loss(params, acts, batch):
        del params
        return jnp.sum(acts["f"] * batch["r"])

    step = jte.make_train_step(emb, loss, optax.sgd(0.0), accumulate_steps=2)
    state = step.init(jax.random.key(1), {})
    before = emb.export(state.embedding)["t"].astype(np.float64)
    ids = np.array([[3, 5, 3, 0], [5, 3, 6, 3]], np.int32)  # Row 3 in both micro-batches.
    rr = np.stack([r, -0.5 * r[::-1]])
    state, _ = step(state, {"features": {"f": ids}, "r": rr})
    grad = np.zeros((7, 2))
    for k in range(2):
        for i in range(4):
            grad[ids[k, i]] += rr[k, i]
    want = before.copy()
    for row in np.unique(ids):
        want[row] -= 0.1 * grad[row] / np.sqrt(0.1 + grad[row] ** 2)
    got = emb.export(state.embedding)["t"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[[1, 2, 4]], before[[1, 2, 4]].astype(np.float32))


@pytest.mark.slow
def test_micro_batches_with_pipelining_equal_the_concatenated_pipelined_step():
    spec = make_spec()
    spec = jte.EmbeddingSpec(spec.features, spec.optimizer, pipeline_execution=True)
    emb = jte.Embedding(spec, make_mesh(2))
    rng = np.random.default_rng(1)
    batches = [make_micro_batches(rng) for _ in range(3)]
    acc = jte.make_train_step(emb, linear_loss, optax.sgd(0.01), accumulate_steps=K)
    one = jte.make_train_step(emb, linear_loss, optax.sgd(0.01))
    s_acc = acc.init(jax.random.key(0), initial_params(), batches[0])
    s_one = one.init(jax.random.key(0), initial_params(), concatenated(batches[0]))
    for b in batches:
        s_acc, _ = acc(s_acc, b)
        s_one, _ = one(s_one, concatenated(b))
    assert_same_embedding(emb, acc.flush(s_acc).embedding, one.flush(s_one).embedding)


def test_accumulation_bad_input_raises():
    emb = jte.Embedding(make_spec(), make_mesh(2))
    step = jte.make_train_step(emb, linear_loss, optax.sgd(0.1), accumulate_steps=K)
    state = step.init(jax.random.key(0), initial_params())
    batch = make_micro_batches(np.random.default_rng(2))
    with pytest.raises(ValueError, match=r"leading axis of 3 micro-batches.*\['y'\] has shape"):
        step(state, dict(batch, y=np.zeros(MICRO, np.float32)))
    bads: list[Any] = [0, 1.5, True]
    for bad in bads:
        with pytest.raises(ValueError, match="accumulate_steps must be an int >= 1"):
            jte.make_train_step(emb, linear_loss, optax.sgd(0.1), accumulate_steps=bad)
    shaped = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(jte.TableConfig(5, D, name="t"), output_shape=(MICRO,))},
        jte.SGD(0.1),
    )
    step = jte.make_train_step(
        jte.Embedding(shaped, make_mesh(2)),
        lambda p, a, b: jnp.sum(a["f"]),
        optax.sgd(0.1),
        accumulate_steps=2,
    )
    with pytest.raises(ValueError, match=r"features \['f'\] have an output_shape"):
        step(step.init(jax.random.key(0), {}), {"features": {"f": np.zeros((2, MICRO), int)}})


def test_accumulated_step_has_no_table_sized_temporaries():
    """A 1M-row table: micro-batches add no table-sized buffer (the scan never carries or
    copies a table; the update runs once after it)."""
    v, dim, shards = 1_000_000, 16, 2
    table = jte.TableConfig(v, dim, combiner="sum", name="big")
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table), "g": jte.FeatureConfig(table)}, jte.Adagrad(0.1)
    )
    emb = jte.Embedding(spec, make_mesh(shards))
    r = np.linspace(-1, 1, 128 * dim, dtype=np.float32).reshape(128, dim)
    batch = {
        "features": {
            "f": jax.ShapeDtypeStruct((4, 128, 4), jnp.int32),
            "g": jax.ShapeDtypeStruct((4, 128), jnp.int32),
        }
    }
    step = jte.make_train_step(
        emb,
        lambda p, a, b: jnp.sum(jnp.tanh(a["f"] + a["g"]) * r) * p["s"],
        optax.sgd(0.1),
        accumulate_steps=4,
    )
    abstract = step.abstract_state({"s": jax.ShapeDtypeStruct((), jnp.float32)}, batch)
    mem = step.lower(abstract, batch).compile().memory_analysis()
    assert mem is not None
    assert mem.temp_size_in_bytes < v * dim * 4 // shards / 50


# ----------------------------------------------------------------- linen and NNX


class LinenModel(nn.Module):
    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        acts = self.embed(batch["features"])
        x = jnp.concatenate([acts["a"], acts["b"], acts["c"]["w"]], axis=-1)
        return nn.Dense(1, name="head")(jnp.tanh(x))[:, 0]


def sum_squares(outputs, batch):
    return jnp.sum((outputs - batch["y"]) ** 2)


@pytest.mark.slow
def test_linen_accumulated_step_equals_concatenated_step():
    model = LinenModel(jte.flax.Embed(make_spec("adam", "mod"), make_mesh(4)))
    rng = np.random.default_rng(3)
    batches = [make_micro_batches(rng) for _ in range(2)]
    acc = jte.flax.make_train_step(model, sum_squares, optax.adam(0.05), accumulate_steps=K)
    one = jte.flax.make_train_step(model, sum_squares, optax.adam(0.05))
    s_acc = acc.init(jax.random.key(0), batches[0])
    s_one = one.init(jax.random.key(0), concatenated(batches[0]))
    for b in batches:
        s_acc, m_acc = acc(s_acc, b)
        s_one, m_one = one(s_one, concatenated(b))
        np.testing.assert_allclose(float(m_acc["loss"]), float(m_one["loss"]), rtol=1e-5)
    emb = model.embed.embedding
    get = lambda s: jte.flax.embedding_states(s.embedding)["embed"]  # noqa: E731
    assert_same_embedding(emb, get(s_acc), get(s_one))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        s_acc.params,
        s_one.params,
    )
    assert acc.trace_count == 1


class NnxModel(nnx.Module):
    def __init__(self, spec, mesh, rngs):
        self.embed = jte.nnx.Embed(spec, mesh, rngs=rngs)
        self.head = nnx.Linear(3 * D, 1, rngs=rngs)

    def __call__(self, features):
        acts = self.embed(features)
        x = jnp.concatenate([acts["a"], acts["b"], acts["c"]["w"]], axis=-1)
        return self.head(jnp.tanh(x))[:, 0]


def nnx_loss(model, batch):
    return jnp.sum((model(batch["features"]) - batch["y"]) ** 2)


@pytest.mark.slow  # The fast tier: the linen and generic forms.
def test_nnx_accumulated_step_equals_concatenated_step():
    spec, mesh = make_spec("adagrad", "div"), make_mesh(2)
    rng = np.random.default_rng(4)
    batches = [make_micro_batches(rng) for _ in range(2)]
    m_acc, m_one = NnxModel(spec, mesh, nnx.Rngs(0)), NnxModel(spec, mesh, nnx.Rngs(0))
    acc = jte.nnx.make_train_step(m_acc, nnx_loss, optax.adam(0.05), accumulate_steps=K)
    one = jte.nnx.make_train_step(m_one, nnx_loss, optax.adam(0.05))
    for b in batches:
        l_acc, l_one = acc(b)["loss"], one(concatenated(b))["loss"]
        np.testing.assert_allclose(float(l_acc), float(l_one), rtol=1e-5)
    emb = m_acc.embed.embedding
    assert_same_embedding(emb, m_acc.embed.embedding_state, m_one.embed.embedding_state)
    params: Any = (nnx.state(m_acc, nnx.Param), nnx.state(m_one, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *params)
    assert acc.trace_count == 1


class NnxRegularized(NnxModel):
    def __init__(self, spec, mesh, rngs):
        super().__init__(spec, mesh, rngs)
        self.bn = nnx.BatchNorm(3 * D, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, features):
        acts = self.embed(features)
        x = jnp.concatenate([acts["a"], acts["b"], acts["c"]["w"]], axis=-1)
        return self.head(self.drop(self.bn(jnp.tanh(x))))[:, 0]


@pytest.mark.slow  # The fast tier: the accumulated steps equal the concatenated ones.
def test_dropout_and_batch_norm_advance_once_per_micro_batch():
    """NNX: the dropout counter moves K times per step, the statistics are carried from one
    micro-batch to the next; linen: batch_stats move and the step traces once."""
    rng = np.random.default_rng(5)
    batches = [make_micro_batches(rng) for _ in range(2)]
    model = NnxRegularized(make_spec(), make_mesh(2), nnx.Rngs(0))
    mean_before = np.asarray(model.bn.mean[...])
    step = jte.nnx.make_train_step(model, nnx_loss, optax.adam(0.01), accumulate_steps=K)
    for b in batches:
        assert np.isfinite(float(step(b)["loss"]))
    assert model.drop.rngs is not None
    assert int(model.drop.rngs.count[...]) == K * len(batches)
    assert not np.allclose(np.asarray(model.bn.mean[...]), mean_before)
    assert step.trace_count == 1

    class Linen(nn.Module):
        embed: jte.flax.Embed

        @nn.compact
        def __call__(self, batch):
            acts = self.embed(batch["features"])
            x = jnp.concatenate([acts["a"], acts["b"], acts["c"]["w"]], axis=-1)
            x = nn.Dropout(0.2, deterministic=False)(nn.BatchNorm(False)(x))
            return nn.Dense(1)(x)[:, 0]

    linen = Linen(jte.flax.Embed(make_spec(), make_mesh(2, "auto")))
    lstep = jte.flax.make_train_step(linen, sum_squares, optax.adam(0.01), accumulate_steps=K)
    state = lstep.init(jax.random.key(0), batches[0])
    stats = jax.device_get(state.model_state)
    for b in batches:
        state, m = lstep(state, b)
        assert np.isfinite(float(m["loss"]))
    moved = jax.device_get(state.model_state)["batch_stats"]["BatchNorm_0"]["mean"]
    assert not np.allclose(moved, stats["batch_stats"]["BatchNorm_0"]["mean"])
    assert lstep.trace_count == 1


def test_micro_batches_shrink_the_models_activation_memory():
    """The dense model's intermediates are one micro-batch's: with an MLP whose hidden
    activations dominate, the compiled step's temporaries shrink with k."""
    table = jte.TableConfig(1000, 8, combiner="sum", name="t")
    emb = jte.Embedding(
        jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1)), make_mesh(2)
    )

    def mlp(p, acts, batch):
        h = jnp.tanh(jnp.tanh(acts["f"] @ p["w1"]) @ p["w2"])
        return jnp.sum(h)

    params = {
        "w1": jax.ShapeDtypeStruct((8, 256), jnp.float32),
        "w2": jax.ShapeDtypeStruct((256, 256), jnp.float32),
    }

    def temp_bytes(k):
        step = jte.make_train_step(emb, mlp, optax.sgd(0.1), accumulate_steps=k)
        shape = (4096, 2) if k == 1 else (k, 4096 // k, 2)
        batch = {"features": {"f": jax.ShapeDtypeStruct(shape, jnp.int32)}}
        lowered = step.lower(step.abstract_state(params, batch), batch)
        mem = lowered.compile().memory_analysis()
        assert mem is not None
        return mem.temp_size_in_bytes

    assert temp_bytes(8) < temp_bytes(1) / 3


def test_abstract_state_with_micro_batches_matches_init():
    model = LinenModel(jte.flax.Embed(make_spec(), make_mesh(2)))
    step = jte.flax.make_train_step(model, sum_squares, optax.sgd(0.1), accumulate_steps=K)
    batch = make_micro_batches(np.random.default_rng(6))
    real = step.init(jax.random.key(0), batch)
    abstract = step.abstract_state(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
    )
    real_leaves, real_def = jax.tree.flatten(real)
    abstract_leaves, abstract_def = jax.tree.flatten(abstract)
    assert real_def == abstract_def
    for x, a in zip(real_leaves, abstract_leaves):
        assert (x.shape, x.dtype) == (a.shape, a.dtype)
