"""jte.flax: the Embed layer's variables, and the flax train step against the generic one."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_tpu_embed as jte
import reference
from conftest import count_primitive, make_mesh

B, D = 16, 4


def make_spec(strategy="div", pipeline=False, v_user=61, v_item=29):
    user = jte.TableConfig(v_user, D, combiner="mean", name="user")
    item = jte.TableConfig(v_item, D, combiner="sum", name="item")
    return jte.EmbeddingSpec(
        {
            "user": jte.FeatureConfig(user),
            "item": jte.FeatureConfig(item),
            "history": jte.FeatureConfig(item),
        },
        jte.Adagrad(learning_rate=0.2),
        partition_strategy=strategy,
        pipeline_execution=pipeline,
    )


def make_batch(rng, v_user=61, v_item=29):
    history = rng.integers(0, v_item, (B, 3))
    history[rng.random((B, 3)) < 0.3] = -1
    return {
        "features": {
            "user": rng.integers(0, v_user, (B, 2)).astype(np.int32),
            "item": rng.integers(0, v_item, B).astype(np.int32),
            "history": history.astype(np.int32),
        },
        "y": rng.normal(size=B).astype(np.float32),
    }


class Model(nn.Module):
    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        acts = self.embed(batch["features"])
        x = jnp.concatenate([acts["history"], acts["item"], acts["user"]], axis=-1)
        return nn.Dense(1, name="head")(jnp.tanh(x))[:, 0]


def mse(outputs, batch):
    return jnp.mean((outputs - batch["y"]) ** 2)


# ----------------------------------------------------------------------- the layer


def test_variables_live_in_the_embedding_collection():
    spec = make_spec()
    emb = jte.Embedding(spec, make_mesh(2))
    model = Model(jte.flax.Embed.from_embedding(emb))
    assert model.embed.embedding is emb
    variables: Any = model.init(jax.random.key(0), make_batch(np.random.default_rng(0)))
    assert set(variables) == {"params", "embedding"}
    assert set(variables["params"]) == {"head"}  # No table among the params.
    state = variables["embedding"]["embed"]
    want = emb.abstract_state()
    for name, table in want.tables.items():
        assert state["tables"][name].shape == table.shape
        assert state["tables"][name].sharding.is_equivalent_to(table.sharding, table.ndim)
        assert state["slots"][name]["accumulators"].shape == table.shape
    assert int(state["step"]) == 0


def test_init_is_embedding_init(monkeypatch):
    """The layer draws its state with one `Embedding.init` call and stores it unchanged."""
    spec = make_spec()
    layer = jte.flax.Embed(spec, make_mesh(2))
    keys = []
    real_init = jte.Embedding.init

    def spy(self, key):
        keys.append(key)
        return real_init(self, key)

    monkeypatch.setattr(jte.Embedding, "init", spy)
    features = make_batch(np.random.default_rng(1))["features"]
    variables: Any = layer.init(jax.random.key(3), features)
    assert len(keys) == 1
    emb = layer.embedding
    got = jte.flax.embedding_states(variables["embedding"])[""]
    want = real_init(emb, keys[0])
    for name, table in emb.export(want).items():
        np.testing.assert_array_equal(emb.export(got)[name], table)
    acts: Any = layer.apply(variables, features)
    np.testing.assert_allclose(acts["user"], emb.lookup(want, features)["user"], rtol=1e-6)


@pytest.mark.parametrize(
    "num_shards,kind,strategy",
    [(8, "explicit", "mod"), pytest.param(4, "auto", "div", marks=pytest.mark.slow)],
)
def test_same_logical_tables_for_every_mesh(num_shards, kind, strategy):
    batch = make_batch(np.random.default_rng(2))
    tables = {}
    for n, k, s in [(1, "explicit", "div"), (num_shards, kind, strategy)]:
        layer = jte.flax.Embed(make_spec(s), make_mesh(n, k))
        variables: Any = layer.init(jax.random.key(7), batch["features"])
        tables[n] = layer.embedding.export(jte.flax.embedding_states(variables["embedding"])[""])
    for name, table in tables[1].items():
        np.testing.assert_array_equal(tables[num_shards][name], table)


def test_apply_without_embedding_variables_raises():
    model = Model(jte.flax.Embed(make_spec(), make_mesh(2)))
    batch = make_batch(np.random.default_rng(3))
    variables = model.init(jax.random.key(0), batch)
    with pytest.raises(ValueError, match="no 'embedding' variables"):
        model.apply({"params": variables["params"]}, batch)


def test_embedding_states_round_trip():
    model = Model(jte.flax.Embed(make_spec(), make_mesh(2)))
    variables: Any = model.init(jax.random.key(0), make_batch(np.random.default_rng(4)))
    states = jte.flax.embedding_states(variables["embedding"])
    assert list(states) == ["embed"]
    fresh = model.embed.embedding.init(jax.random.key(9))
    replaced = jte.flax.replace_embedding_states(variables["embedding"], {"embed": fresh})
    (key,) = [k for k, tables in model.embed.embedding.stacks.items() if "user" in tables]
    assert replaced["embed"]["tables"][key] is fresh.tables[key]
    assert variables["embedding"]["embed"]["tables"][key] is not fresh.tables[key]
    with pytest.raises(ValueError, match="no Embed at"):
        jte.flax.replace_embedding_states(variables["embedding"], {"other": fresh})


# ------------------------------------------------------------------------ the step


def test_flax_step_equals_generic_step():
    """The same model, written as a flax module and as loss_fn(params, acts, batch)."""
    rng = np.random.default_rng(5)
    batches = [make_batch(rng) for _ in range(3)]
    mesh = make_mesh(4, "auto")
    model = Model(jte.flax.Embed(make_spec(), mesh))
    flax_step = jte.flax.make_train_step(model, mse, optax.adam(0.05))
    f_state = flax_step.init(jax.random.key(0), batches[0])

    emb = model.embed.embedding
    head = nn.Dense(1)

    def loss_fn(params, acts, batch):
        x = jnp.concatenate([acts["history"], acts["item"], acts["user"]], axis=-1)
        out: Any = head.apply({"params": params["head"]}, jnp.tanh(x))
        return mse(out[:, 0], batch)

    generic = jte.make_train_step(emb, loss_fn, optax.adam(0.05))
    emb_state = jte.flax.embedding_states(f_state.embedding)["embed"]
    g_state = generic.init(
        None,
        f_state.params,
        embedding_state=emb.restore_tables(emb.export(emb_state), emb.export_slots(emb_state)),
    )

    for batch in batches:
        f_state, f_metrics = flax_step(f_state, batch)
        g_state, g_metrics = generic(g_state, batch)
        np.testing.assert_allclose(f_metrics["loss"], g_metrics["loss"], rtol=1e-6)
    assert flax_step.trace_count == generic.trace_count == 1
    got = emb.export(jte.flax.embedding_states(f_state.embedding)["embed"])
    for name, table in emb.export(g_state.embedding).items():
        np.testing.assert_allclose(got[name], table, rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        f_state.params,
        g_state.params,
    )
    out: Any = model.apply(flax_step.variables(f_state), batches[0])
    np.testing.assert_allclose(flax_step.predict(f_state, batches[0]), out, rtol=1e-6)


def test_optax_never_sees_a_table():
    seen = []

    def record():
        def init(params):
            seen.append(jax.tree.map(jnp.shape, params))
            return optax.EmptyState()

        def update(updates, state, params=None):
            seen.append(jax.tree.map(jnp.shape, updates))
            return jax.tree.map(lambda g: -0.1 * g, updates), state

        return optax.GradientTransformation(init, update)

    model = Model(jte.flax.Embed(make_spec(), make_mesh(2)))
    step = jte.flax.make_train_step(model, mse, record())
    rng = np.random.default_rng(6)
    state = step.init(jax.random.key(0), make_batch(rng))
    emb = model.embed.embedding
    before = emb.export(jte.flax.embedding_states(state.embedding)["embed"])
    batch = make_batch(rng, v_user=20, v_item=10)  # Rows >= 20 / >= 10 stay untouched.
    state, _ = step(state, batch)
    assert seen and all(set(s) == {"head"} for s in seen)
    after = emb.export(jte.flax.embedding_states(state.embedding)["embed"])
    np.testing.assert_array_equal(after["user"][20:], before["user"][20:])
    np.testing.assert_array_equal(after["item"][10:], before["item"][10:])
    assert np.any(after["user"][:20] != before["user"][:20])


class TwoTowers(nn.Module):
    """Two Embed layers: one plain, one pipelined."""

    users: jte.flax.Embed
    items: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        u = self.users(batch["u"])["user"]
        i = self.items(batch["i"])["item"]
        return jnp.sum(nn.Dense(D)(u) * i, axis=-1)


def test_two_layers_one_pipelined():
    mesh = make_mesh(2)
    user = jte.TableConfig(41, D, name="user")
    item = jte.TableConfig(43, D, name="item")
    users = jte.flax.Embed(jte.EmbeddingSpec({"user": jte.FeatureConfig(user)}, jte.SGD(0.5)), mesh)
    items = jte.flax.Embed(
        jte.EmbeddingSpec({"item": jte.FeatureConfig(item)}, jte.SGD(0.5), pipeline_execution=True),
        mesh,
    )
    model = TwoTowers(users, items)
    step = jte.flax.make_train_step(model, mse, optax.sgd(0.1))
    rng = np.random.default_rng(7)

    def batch():
        return {
            "u": {"user": rng.integers(0, 41, B)},
            "i": {"item": rng.integers(0, 43, B)},
            "y": rng.normal(size=B).astype(np.float32),
        }

    state = step.init(jax.random.key(0), batch())
    assert state.pending is not None and sorted(state.pending.features) == ["items"]
    for _ in range(3):
        state, m = step(state, batch())
    states = jte.flax.embedding_states(state.embedding)
    assert int(states["users"].step) == 3 and int(states["items"].step) == 2
    with pytest.raises(ValueError, match="flush"):
        step.predict(state, batch())
    state = step.flush(state)
    assert int(jte.flax.embedding_states(state.embedding)["items"].step) == 3
    assert step.trace_count == 1
    assert np.all(np.isfinite(step.predict(state, batch())))


class CallsTwice(nn.Module):
    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        a = self.embed(batch["features"])["item"]
        b = self.embed(batch["features"])["item"]
        return jnp.sum(a * b, axis=-1)


def test_layer_called_twice_raises():
    model = CallsTwice(jte.flax.Embed(make_spec(), make_mesh(2)))
    step = jte.flax.make_train_step(model, mse, optax.sgd(0.1))
    batch = make_batch(np.random.default_rng(8))
    with pytest.raises(ValueError, match="called more than once"):
        step.init(jax.random.key(0), batch)  # Found when init looks at the batch.


def test_model_without_embed_raises():
    step = jte.flax.make_train_step(nn.Dense(1), mse, optax.sgd(0.1))
    with pytest.raises(ValueError, match="no jte.flax.Embed"):
        step.init(jax.random.key(0), np.ones((B, 3), np.float32))


def test_abstract_state_matches_init():
    model = Model(jte.flax.Embed(make_spec(pipeline=True), make_mesh(2)))
    step = jte.flax.make_train_step(model, mse, optax.adam(1e-3))
    batch = make_batch(np.random.default_rng(9))
    real = step.init(jax.random.key(0), batch)
    abstract = step.abstract_state(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
    )
    real_leaves, real_def = jax.tree.flatten(real)
    abstract_leaves, abstract_def = jax.tree.flatten(abstract)
    assert real_def == abstract_def
    for x, a in zip(real_leaves, abstract_leaves):
        assert (x.shape, x.dtype) == (a.shape, a.dtype)
        assert x.sharding.is_equivalent_to(a.sharding, x.ndim)


def test_step_init_gives_model_init_variables():
    """step.init draws the tables outside model.init's program, with the keys the layer
    draws: the same params and tables, bit for bit, as model.init (one key, or a dict of
    keys with its own "embedding" stream)."""
    model = Model(jte.flax.Embed(make_spec(), make_mesh(4, "auto")))
    step = jte.flax.make_train_step(model, mse, optax.adam(1e-3))
    batch = make_batch(np.random.default_rng(12))
    for key in [jax.random.key(4), {"params": jax.random.key(5), "embedding": jax.random.key(6)}]:
        state = step.init(key, batch)
        want: Any = model.init(key if isinstance(key, dict) else {"params": key}, batch)
        jax.tree.map(np.testing.assert_array_equal, state.params, want["params"])
        jax.tree.map(np.testing.assert_array_equal, state.embedding, want["embedding"])


def test_step_init_traces_inside_another_transformation():
    """Under eval_shape (or jit) init compiles nothing itself and gives abstract state."""
    model = Model(jte.flax.Embed(make_spec(), make_mesh(2)))
    step = jte.flax.make_train_step(model, mse, optax.adam(1e-3))
    batch = make_batch(np.random.default_rng(13))
    got = jax.eval_shape(lambda k: step.init(k, batch), jax.random.key(0))
    want = step.abstract_state(batch)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for x, a in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert (x.shape, x.dtype) == (a.shape, a.dtype)


class SumOfActivations(nn.Module):
    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        x = sum(jax.tree.leaves(self.embed(batch["features"])))
        return nn.Dense(1)(x)[:, 0]


def _init_work(num_tables: int) -> tuple[int, int]:
    """(XLA compiles of step.init, draws (erf_inv) in its model.init program) for a model
    whose dense part is the same for any number of tables of distinct shapes."""
    rng = np.random.default_rng(num_tables)
    sizes = 40 + 8 * np.arange(num_tables)
    spec = jte.EmbeddingSpec(
        {
            f"f{i}": jte.FeatureConfig(jte.TableConfig(int(v), D, combiner="sum", name=f"t{i}"))
            for i, v in enumerate(sizes)
        },
        jte.Adagrad(learning_rate=0.1),
    )
    features = {f"f{i}": rng.integers(0, v, B).astype(np.int32) for i, v in enumerate(sizes)}
    model = SumOfActivations(jte.flax.Embed(spec, make_mesh(2)))
    step = jte.flax.make_train_step(model, mse, optax.sgd(0.1))
    events = []

    def listen(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(step.init(jax.random.key(0), {"features": features}))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    rngs = step._init_rngs(jax.random.key(0))[0]
    jaxpr = jax.make_jaxpr(step._model_init)(rngs, {"features": features}).jaxpr
    return len(events), count_primitive(jaxpr, "erf_inv")


@pytest.mark.slow
def test_init_compiles_the_same_programs_for_any_number_of_tables():
    """The demo's init took 15 s: one compile, or a copy of a table's initialisation in
    one program, per table. Counted rather than timed: step.init of a model with 26 tables
    compiles as many programs as with 3 (the dense variables', the tables' and the optax
    state's), and its
    model.init program draws no table (test_core counts the tables' program's draws)."""
    _init_work(2)  # Compiles what every init needs once (eager ops).
    compiles, draws = _init_work(26)
    assert (compiles, draws) == _init_work(3)
    assert compiles <= 3 and draws == 1  # The Dense kernel's truncated normal.


def test_default_mesh_works_eagerly(rng):
    """With the default mesh, plain eager code works: indexing an activation, model.apply
    and jax.grad of a model outside jit (Explicit axes made all three fail)."""
    spec = make_spec()
    batch = make_batch(rng)
    emb = jte.Embedding(spec)
    state = emb.init(jax.random.key(0))
    acts = emb.lookup(state, batch["features"])
    tables = emb.export(state)
    want = reference.lookup(tables["item"], batch["features"]["item"], None, "sum")
    np.testing.assert_allclose(acts["item"][0], want[0], rtol=1e-6)
    np.testing.assert_allclose(acts["item"][:, 1], want[:, 1], rtol=1e-6)

    model = Model(jte.flax.Embed(spec))
    variables = model.init(jax.random.key(1), batch)
    outputs: Any = model.apply(variables, batch)
    assert outputs.shape == (B,) and float(outputs[0]) == float(np.asarray(outputs)[0])

    def loss(params):
        return mse(model.apply({**variables, "params": params}, batch), batch)

    grads = jax.grad(loss)(variables["params"])
    eps = 1e-3
    w: Any = variables["params"]["head"]["bias"]
    bumped = {"head": {**variables["params"]["head"], "bias": w + eps}}
    numeric = (loss(bumped) - loss(variables["params"])) / eps
    np.testing.assert_allclose(grads["head"]["bias"][0], numeric, rtol=2e-2)


# ------------------------------------------------------- dropout and batch statistics


class Regularized(nn.Module):
    """BatchNorm and Dropout between the embeddings and the head, switched by `train`."""

    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch, train: bool = True):
        acts = self.embed(batch["features"])
        x = jnp.concatenate([acts["history"], acts["item"], acts["user"]], axis=-1)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.2, deterministic=not train)(x)
        return nn.Dense(1, name="head")(jnp.tanh(x))[:, 0]


def learnable_batch(rng, v_item=20):
    batch = make_batch(rng, v_item=v_item)
    batch["y"] = np.sin(batch["features"]["user"][:, 0]).astype(np.float32)
    return batch


@pytest.mark.slow  # The fast tier: test_flax_step_equals_generic_step.
def test_dropout_and_batch_stats_train_and_touch_only_batch_rows():
    """The dropout key advances every step, batch statistics are updated, the loss falls,
    rows outside the batches do not change (bit for bit), and predict(train=False) is
    deterministic with the running statistics."""
    rng = np.random.default_rng(12)
    batches = [learnable_batch(rng) for _ in range(4)]
    # Auto axes: linen's nn.Dropout draws its mask without a sharding, which Explicit axes
    # reject (flax.nnx.Dropout passes one).
    model = Regularized(jte.flax.Embed(make_spec(), make_mesh(2, "auto")))
    step = jte.flax.make_train_step(model, mse, optax.adam(0.02), apply_kwargs={"train": True})
    state = step.init(jax.random.key(0), batches[0])
    assert state.model_state is not None and set(state.model_state) == {"batch_stats"}
    assert set(state.params) == {"BatchNorm_0", "head"}
    emb = model.embed.embedding
    before = emb.export(jte.flax.embedding_states(state.embedding)["embed"])
    stats_before = jax.device_get(state.model_state)
    keys, losses = set(), []
    for i in range(40):
        keys.add(tuple(np.asarray(state.rng).ravel()))
        state, m = step(state, batches[i % 4])
        losses.append(float(m["loss"]))
    assert len(keys) == 40  # A new dropout key every step.
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])
    stats = jax.device_get(state.model_state)
    assert not np.allclose(
        stats["batch_stats"]["BatchNorm_0"]["mean"],
        stats_before["batch_stats"]["BatchNorm_0"]["mean"],
    )
    after = emb.export(jte.flax.embedding_states(state.embedding)["embed"])
    for name, rows in (
        ("user", np.unique(np.concatenate([b["features"]["user"].ravel() for b in batches]))),
        (
            "item",
            np.unique(
                np.concatenate(
                    [
                        np.r_[b["features"]["item"], b["features"]["history"].ravel()]
                        for b in batches
                    ]
                )
            ),
        ),
    ):
        rows = rows[rows >= 0]
        untouched = np.setdiff1d(np.arange(len(before[name])), rows)
        np.testing.assert_array_equal(after[name][untouched], before[name][untouched])
        assert not np.array_equal(after[name][rows], before[name][rows])
    assert step.trace_count == 1
    out = step.predict(state, batches[0], train=False)
    np.testing.assert_array_equal(out, step.predict(state, batches[0], train=False))
    want: Any = model.apply(step.variables(state), batches[0], train=False)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_dropout_needs_no_key_from_the_user_and_can_be_switched_off():
    """Without rng_streams the step has no key; a model with dropout then fails at init
    with flax's own error rather than silently using one key."""
    rng = np.random.default_rng(13)
    batch = learnable_batch(rng)
    model = Regularized(jte.flax.Embed(make_spec(), make_mesh(2)))
    plain = jte.flax.make_train_step(model, mse, optax.sgd(0.1), apply_kwargs={"train": False})
    state = plain.init(jax.random.key(0), batch)  # No dropout in eval mode: no key needed.
    assert state.rng is not None
    none = jte.flax.make_train_step(
        model, mse, optax.sgd(0.1), rng_streams=(), apply_kwargs={"train": False}
    )
    assert none.init(jax.random.key(0), batch).rng is None
    with pytest.raises(TypeError, match="rng_streams"):
        jte.flax.make_train_step(model, mse, optax.sgd(0.1), rng_streams="dropout")
