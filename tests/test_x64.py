"""The library under `jax_enable_x64`: the same numbers as without it, int64 ids taken as
they are (`_inputs.x32`: the engine's calls run with it off, their 64-bit inputs narrowed
first). Each test turns it on for itself (`jax.enable_x64(True)`), not for the process."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh

BATCH, STEPS = 16, 5


def _embedding(routing: str) -> jte.Embedding:
    """A dynamic table with TTL and a row initializer, a cached static table with a mean
    combiner, and a bfloat16 static table with Adam (its own stochastic rounding), on 4
    devices."""
    users = jte.TableConfig(
        dim=8,
        combiner="mean",
        name="users",
        dynamic=jte.DynamicTable(capacity=512, bucket_size=16, ttl_steps=3),
        initializer=jte.initializers.normal(0.3),
    )
    items = jte.TableConfig(
        vocabulary_size=1000,
        dim=8,
        combiner="mean",
        name="items",
        placement=jte.HostCached(cache_rows=256),
    )
    words = jte.TableConfig(
        vocabulary_size=500,
        dim=16,
        combiner="sqrtn",
        name="words",
        dtype=jnp.bfloat16,
        optimizer=jte.Adam(learning_rate=0.05),
    )
    features = {
        "user": jte.FeatureConfig(users),
        "item": jte.FeatureConfig(items),
        "words": jte.FeatureConfig(words),
    }
    spec = jte.EmbeddingSpec(features, jte.Adagrad(learning_rate=0.1))
    return jte.Embedding(spec, make_mesh(4), routing=routing)


def _batches(split: bool) -> list[dict]:
    """Int64 ids: the dynamic table's from all of int64 (as `SplitIds` where `split`), the
    static tables' small, and one beyond int32 (an invalid id, as -1 is padding)."""
    rng = np.random.default_rng(0)
    pool = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 60, dtype=np.int64)
    out = []
    for _ in range(STEPS):
        users = rng.choice(pool, (BATCH, 3))
        users[0, 2] = -1
        items = rng.integers(0, 1000, (BATCH, 2)).astype(np.int64)
        items[1, 1] = (1 << 32) + 5  # Beyond int32: invalid, never row 5.
        words = jte.Weighted(rng.integers(-1, 500, (BATCH, 4)), rng.random((BATCH, 4)))
        out.append(
            {"user": jte.split_ids(users) if split else users, "item": items, "words": words}
        )
    return out


def _gradients(acts: dict) -> dict:
    return jax.tree.map(lambda a: jnp.sin(3.0 * a) + 0.1, acts)


def _run(routing: str, x64: bool) -> dict:
    """Activations, invalid-id counts, exports, slots and counters of a jitted lookup and
    update over the batches, then of an eager lookup and a server."""
    emb = _embedding(routing)
    with jax.enable_x64(x64):
        state = emb.init(jax.random.key(1))

        @jax.jit
        def step(state, features):
            acts = emb.lookup(state, features)
            return emb.apply_gradients(state, features, _gradients(acts)), acts

        out: dict = {"acts": [], "invalid": []}
        # Without x64 the id beyond int32 is another invalid one (past the vocabulary).
        for features in _batches(split=not x64):
            items = features["item"]
            if x64:
                features = {**features, "item": jnp.asarray(items)}
            else:
                features = {**features, "item": np.minimum(items, 1005).astype(np.int32)}
            state, acts = step(state, features)
            out["acts"].append(acts)
            out["invalid"].append(emb.invalid_id_counts(features))
        out["export"] = emb.export(state)
        out["slots"] = emb.export_slots(state)
        out["stats"] = emb.dynamic_stats(state)
        eager = _batches(split=not x64)[0]
        eager["item"] = eager["item"] % 1000
        out["eager"] = emb.lookup(state, eager)
        server = jte.serving.Server.from_embedding(emb, state, unknown="init")
        out["served"] = server(eager)
        out["drawn"] = jte.initializers.normal(0.3, mean=0.1)(jax.random.key(5), (64, 8))
        return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("routing", ["gather", pytest.param("owner", marks=pytest.mark.slow)])
def test_calls_under_x64_give_what_they_give_without(routing):
    """With `jax_enable_x64` on, int64 ids go into a jitted step as they are (NumPy, or a
    jax.Array), and every number equals the run without it that splits them
    (`jte.split_ids`): activations, exports, slots, counters, an eager lookup and a served
    one, and a row initializer called whole. A static table's id beyond int32 is invalid
    there, as an id past the vocabulary is, never cut to another row."""
    want, got = _run(routing, x64=False), _run(routing, x64=True)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert got["invalid"][0]["item"] == 1 and got["stats"]["users"]["expired"] > 0
    # 32 bits out, but the int64 ids of a dynamic table's export (`jte.DynamicRows`).
    leaves = jax.tree.leaves((got["acts"], got["export"], got["slots"], got["stats"]))
    assert all(x.dtype == np.int64 or x.dtype.itemsize <= 4 for x in leaves)
    assert got["export"]["users"].ids.dtype == np.int64


@pytest.mark.slow
def test_train_step_and_checkpoints_under_x64(tmp_path):
    """`jte.make_train_step` takes NumPy int64 ids under `jax_enable_x64` (without it they
    are an error, see test_dynamic), and trains, saves and restores as the step fed
    `SplitIds` does without it (SGD, whose dense update is the same in either mode)."""

    def loss_fn(params, acts, batch):
        x = jnp.concatenate([acts["user"], acts["item"], acts["words"]], -1) @ params["w"]
        return jnp.mean((x[:, 0] - batch["label"]) ** 2)

    results = {}
    for x64 in (False, True):
        emb = _embedding("owner")
        step = jte.make_train_step(emb, loss_fn, optax.sgd(0.1))
        with jax.enable_x64(x64):
            state = step.init(jax.random.key(2), {"w": jnp.full((32, 1), 0.1, jnp.float32)})
            rng = np.random.default_rng(3)
            losses = []
            for features in _batches(split=not x64):
                features["item"] = features["item"] % 1000
                batch = {"features": features, "label": rng.normal(size=BATCH).astype(np.float32)}
                state, metrics = step(state, batch)
                losses.append(metrics["loss"])
            path = tmp_path / str(x64)
            jte.checkpoint.save(path, emb, state.embedding)
            restored, _ = jte.checkpoint.restore(path, emb)
            results[x64] = jax.tree.map(
                np.asarray, (losses, emb.export(restored), emb.dynamic_stats(restored))
            )
    jax.tree.map(np.testing.assert_array_equal, results[True], results[False])


@pytest.mark.slow
def test_flax_and_nnx_steps_under_x64():
    """The flax.linen and NNX train steps take int64 ids under `jax_enable_x64` and give the
    losses their steps give without it, fed `SplitIds`."""
    from flax import linen as nn
    from flax import nnx

    users = jte.TableConfig(
        dim=8, combiner="mean", name="users", dynamic=jte.DynamicTable(capacity=512)
    )
    items = jte.TableConfig(vocabulary_size=100, dim=8, combiner="sum", name="items")
    spec = jte.EmbeddingSpec(
        {"u": jte.FeatureConfig(users), "i": jte.FeatureConfig(items)},
        jte.Adagrad(learning_rate=0.1),
    )
    squared = lambda pred, batch: jnp.mean((pred - batch["label"]) ** 2)

    class Linen(nn.Module):
        embed: jte.flax.Embed

        @nn.compact
        def __call__(self, batch):
            acts = self.embed(batch["features"])
            return nn.Dense(1)(jnp.concatenate(jax.tree.leaves(acts), -1))[:, 0]

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.embed = jte.nnx.Embed(spec, rngs=rngs)
            self.head = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, features):
            acts = self.embed(features)
            return self.head(jnp.concatenate(jax.tree.leaves(acts), -1))[:, 0]

    losses = {}
    for x64 in (False, True):
        rng = np.random.default_rng(0)
        pool = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 50, dtype=np.int64)
        batches = []
        for _ in range(3):
            ids = rng.choice(pool, (8, 3))
            features = {"u": ids if x64 else jte.split_ids(ids), "i": rng.integers(0, 100, (8, 2))}
            batches.append({"features": features, "label": rng.normal(size=8).astype(np.float32)})
        with jax.enable_x64(x64):
            step = jte.flax.make_train_step(Linen(jte.flax.Embed(spec)), squared, optax.sgd(0.1))
            state = step.init(jax.random.key(0), batches[0])
            model = Nnx(nnx.Rngs(0))
            nnx_step = jte.nnx.make_train_step(
                model, lambda m, b: squared(m(b["features"]), b), optax.sgd(0.1)
            )
            out = []
            for batch in batches:
                state, metrics = step(state, batch)
                out.append((metrics["loss"], nnx_step(batch)["loss"]))
            losses[x64] = np.asarray(out)
    np.testing.assert_array_equal(losses[True], losses[False])
