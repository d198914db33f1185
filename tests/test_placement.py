"""Tables in host memory (`placement="host"`): the same bits as device tables, every path.

A host table's arrays live in pinned host memory and the step reaches its rows through one
host gather and one host scatter per pass (`_placement`); everything between runs the
device path's arithmetic. So the properties are exact: lookups, exports and slots of host
tables equal those of device tables bit for bit, for every optimizer, on 1 to 8 devices,
"div" and "mod", both exchanges, with TPU layout (passes, packing) and without, through the
jitted train step, checkpoints and `restore_tables`; and the arrays stay in host memory.
Device tables are compared on the XLA backend, the one that serves host tables (the C++
kernels sum in another order).
"""

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
from conftest import make_mesh
from test_optimizers import OPTIMIZERS

_B = 16
_HOST = "pinned_host"


# The fast tier's optimizers: a plain one with every extra, a slot riding in the table's
# rows, two slots, a rank-1 slot, optax's and a user's row function.
QUICK = ("sgd+extras", "adagrad", "adam+extras", "ftrl", "rowwise_adagrad", "optax_adam", "custom")


def _spec(placement: str, strategy: str, optimizers):
    """One table per optimizer, shared by a weighted pooled feature and a sequence
    feature, with widths that pack (4, 12) and one that does not (16); every fourth one
    bfloat16 (stochastic rounding)."""
    features = {}
    for i, name in enumerate(optimizers):
        optimizer = OPTIMIZERS[name][0]
        table = jte.TableConfig(
            vocabulary_size=40 + 7 * i,
            dim=(4, 12, 16)[i % 3],
            combiner=("sum", "mean", "sqrtn")[i % 3],
            name=name.replace("+", "_"),
            optimizer=optimizer,
            placement=placement,
            dtype=jnp.bfloat16 if i % 4 == 1 else jnp.float32,
        )
        features[name.replace("+", "_")] = {
            "pooled": jte.FeatureConfig(table),
            "seq": jte.FeatureConfig(table, max_sequence_length=3),
        }
    return jte.EmbeddingSpec(features, None, partition_strategy=strategy, clipping_limit=0.9)


def _batch(rng, spec):
    out = {}
    for name, feats in spec.features.items():
        vocab = feats["pooled"].table.vocabulary_size
        ids = rng.integers(0, vocab // 3, (_B, 4))  # Few distinct ids: duplicates.
        ids[rng.random((_B, 4)) < 0.25] = -1
        seq = rng.integers(0, vocab, (_B, 3))
        seq[:, 2][rng.random(_B) < 0.5] = -1
        weights = rng.uniform(0.2, 2.0, (_B, 4)).astype(np.float32)
        out[name] = {"pooled": jte.Weighted(ids, weights), "seq": seq}
    return out


def _memory_kinds(state) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves((state.tables, state.slots))}


_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "shards, strategy, routing, tpu_layout, optimizers",
    [
        (2, "mod", "owner", True, QUICK),
        pytest.param(1, "div", "gather", False, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(2, "mod", "owner", True, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(4, "div", "owner", False, tuple(OPTIMIZERS), marks=_SLOW),
        pytest.param(8, "mod", "gather", True, tuple(OPTIMIZERS), marks=_SLOW),
    ],
)
def test_host_tables_equal_device_tables_bit_for_bit(
    shards, strategy, routing, tpu_layout, optimizers
):
    """Every optimizer in the slow tier, on 1 to 8 devices, both strategies and exchanges,
    with TPU layout (passes, lane-packed rows) and without; the fast tier takes `QUICK`."""
    mesh = make_mesh(shards)
    embs = {
        p: jte.Embedding(
            _spec(p, strategy, optimizers),
            mesh,
            backend="xla",
            routing=routing,
            tpu_layout=tpu_layout,
            lane_width=128 if tpu_layout else 0,  # Packed rows, as on TPU.
        )
        for p in ("device", "host")
    }
    states = {p: e.init(jax.random.key(3)) for p, e in embs.items()}
    assert _memory_kinds(states["host"]) == {_HOST}
    assert _memory_kinds(states["device"]) == {"device"}
    rng = np.random.default_rng(shards)
    for _ in range(3):
        batch = _batch(rng, embs["host"].spec)
        acts = {p: e.lookup(states[p], batch) for p, e in embs.items()}
        chex.assert_trees_all_equal(acts["host"], acts["device"])
        grads = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), acts["host"])
        states = {p: e.apply_gradients(states[p], batch, grads) for p, e in embs.items()}
    assert _memory_kinds(states["host"]) == {_HOST}
    chex.assert_trees_all_equal(
        embs["host"].export(states["host"]), embs["device"].export(states["device"])
    )
    chex.assert_trees_all_equal(
        embs["host"].export_slots(states["host"]), embs["device"].export_slots(states["device"])
    )
    # The updates really happened: the tables moved away from their initial values.
    first = embs["host"].export(embs["host"].init(jax.random.key(3)))
    moved = embs["host"].export(states["host"])
    assert all(not np.array_equal(first[t], moved[t]) for t in first)


def test_init_eager_or_traced_lands_on_the_host():
    """`init` of host tables, with the default initializer (drawn into host buffers) and a
    user's (called with the logical shape), eager or inside another jit: the same values
    as device tables, in host memory."""
    out = {}
    for p in ("device", "host"):
        t = jte.TableConfig(101, 8, name="t", placement=p)
        u = jte.TableConfig(
            13, 4, name="u", placement=p, initializer=lambda k, s, d: jax.random.uniform(k, s, d)
        )
        spec = jte.EmbeddingSpec(
            {"a": jte.FeatureConfig(t), "b": jte.FeatureConfig(u)}, jte.Adagrad(0.1)
        )
        emb = jte.Embedding(spec, make_mesh(2), backend="xla", init_block_bytes=1024)
        for how, init in (("eager", emb.init), ("traced", jax.jit(emb.init))):
            state = init(jax.random.key(3))
            want = {"device": {"device"}, "host": {_HOST}}[p]
            assert _memory_kinds(state) == want, (p, how)
            out[p, how] = (emb.export(state), emb.export_slots(state))
    for how in ("eager", "traced"):
        chex.assert_trees_all_equal(out["host", how], out["device", "eager"])


def _train_spec(placement):
    big = jte.TableConfig(
        vocabulary_size=500, dim=8, combiner="sum", name="big", placement=placement
    )
    small = jte.TableConfig(vocabulary_size=30, dim=8, combiner="mean", name="small")
    return jte.EmbeddingSpec(
        {"big": jte.FeatureConfig(big), "small": jte.FeatureConfig(small)},
        jte.Adagrad(0.1),
    )


def _loss(params, acts, batch):
    x = jnp.concatenate([acts["big"], acts["small"]], axis=1)
    return jnp.mean((x @ params["w"] - batch["label"]) ** 2)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_jitted_train_step_with_global_array_inputs(kind):
    """The train step of a host table fed global jax.Arrays sharded over the batch, against
    the same step of a device table fed NumPy: the same losses and tables."""
    mesh = make_mesh(4, kind)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 1)), jnp.float32)}
    steps, states = {}, {}
    for p in ("device", "host"):
        emb = jte.Embedding(_train_spec(p), mesh, backend="xla")
        steps[p] = jte.make_train_step(emb, _loss, optax.sgd(0.05))
        states[p] = steps[p].init(jax.random.key(0), params)
    batch_sharding = NamedSharding(mesh, P("shard"))
    for _ in range(4):
        batch = {
            "features": {
                "big": rng.integers(-1, 500, (_B, 5)).astype(np.int32),
                "small": rng.integers(0, 30, (_B, 2)).astype(np.int32),
            },
            "label": rng.normal(size=(_B, 1)).astype(np.float32),
        }
        global_batch = jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(batch_sharding, x), batch
        )
        states["device"], m_dev = steps["device"](states["device"], batch)
        states["host"], m_host = steps["host"](states["host"], global_batch)
        assert float(m_dev["loss"]) == float(m_host["loss"])
    emb_host, emb_dev = steps["host"].embedding, steps["device"].embedding
    host_state, dev_state = states["host"].embedding, states["device"].embedding
    assert host_state.tables["big"].sharding.memory_kind == _HOST
    assert host_state.tables["small"].sharding.memory_kind == "device"
    chex.assert_trees_all_equal(emb_host.export(host_state), emb_dev.export(dev_state))


def test_checkpoint_and_restore_tables_keep_host_tables_on_host(tmp_path):
    """Save on 4 devices, restore on 2 and continue = continue on 4 (to float32 rounding:
    the mesh changes the order of sums); `restore_tables` of the
    exported tables lands in host memory with the same values."""
    rng = np.random.default_rng(1)
    spec = _train_spec("host")
    emb4 = jte.Embedding(spec, make_mesh(4), backend="xla")
    state = emb4.init(jax.random.key(1))
    batches = [
        {"big": rng.integers(-1, 500, (_B, 5)), "small": rng.integers(0, 30, (_B, 2))}
        for _ in range(3)
    ]

    def step(emb, state, batch):
        acts = emb.lookup(state, batch)
        grads = jax.tree.map(lambda a: jnp.cos(a) + 0.2, acts)
        return emb.apply_gradients(state, batch, grads)

    state = step(emb4, state, batches[0])
    jte.checkpoint.save(tmp_path / "ckpt", emb4, state)
    emb2 = jte.Embedding(spec, make_mesh(2), backend="xla")
    restored, _ = jte.checkpoint.restore(tmp_path / "ckpt", emb2)
    big = jax.tree.leaves((restored.tables["big"], restored.slots["big"]))
    assert {x.sharding.memory_kind for x in big} == {_HOST}
    assert restored.tables["small"].sharding.memory_kind == "device"
    chex.assert_trees_all_equal(emb2.export(restored), emb4.export(state))
    for batch in batches[1:]:
        state, restored = step(emb4, state, batch), step(emb2, restored, batch)
    # Another mesh sums an example's ids in another order: equal to float32 rounding.
    chex.assert_trees_all_close(emb2.export(restored), emb4.export(state), rtol=1e-6, atol=1e-7)

    again = emb2.restore_tables(emb4.export(state), slots=emb4.export_slots(state))
    assert _memory_kinds(again) == {_HOST, "device"}
    assert again.tables["big"].sharding.memory_kind == _HOST
    chex.assert_trees_all_equal(emb2.export(again), emb4.export(state))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: jte.TableConfig(10, 4, placement="hbm"), r"placement must be one of"),
        (lambda: jte.TableConfig(10, 4, placement=3), r"placement must be one of"),  # type: ignore[arg-type]
        (
            lambda: jte.TableConfig(
                dim=4, name="d", dynamic=jte.DynamicTable(100), placement="host"
            ),
            r"TableConfig\(name='d'\): a dynamic table cannot have placement='host' yet",
        ),
    ],
)
def test_bad_placements(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_host_tables_refuse_what_cannot_serve_them():
    table = jte.TableConfig(50, 4, name="h", placement="host")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
    with pytest.raises(ValueError, match=r"table 'h' cannot use backend 'cpu': placement='host'"):
        jte.Embedding(spec, make_mesh(2), backend="cpu")
    dense = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adam(0.1, lazy_adam=False))
    with pytest.raises(ValueError, match=r"table 'h' has placement='host' but its optimizer"):
        jte.Embedding(dense, make_mesh(2))
    # "auto" gives a host table the XLA backend, the device tables their own.
    device = jte.TableConfig(50, 4, name="d")
    both = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table), "g": jte.FeatureConfig(device)}, jte.Adagrad(0.1)
    )
    assert jte.Embedding(both, make_mesh(2)).backends["h"] == "xla"


def _benchmark(name: str, tmp_path) -> tuple:
    """Runs benchmarks/<name>.py --quick in this process: (the module, its JSON)."""
    import importlib.util
    import json
    import os

    here = os.path.dirname(__file__)
    benchmarks = os.path.join(here, os.pardir, "benchmarks")
    path = os.path.join(benchmarks, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, benchmarks)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(benchmarks)
    out = tmp_path / f"{name}.json"
    assert module.main(["--quick", "--out", str(out)]) == 0
    return module, json.loads(out.read_text())


def test_host_offload_benchmark_runs(tmp_path):
    """benchmarks/host_offload.py (the script to run on a TPU VM) works, in its quick form."""
    _, result = _benchmark("host_offload", tmp_path)
    assert result["transfers"][0]["host gather"]["GB/s"] > 0
    assert result["train_step"]["host"]["ms"] > 0


def test_cache_model_is_exact_lru_where_everything_fits(tmp_path):
    """benchmarks/cache_model.py: a cache that holds every row misses each row once."""
    cache_model, result = _benchmark("cache_model", tmp_path)
    assert all(0 < e["exact LRU"] < 1 for e in result["miss_rates"])
    rng = np.random.default_rng(0)
    steps = [np.unique(rng.integers(0, 300, 100)) for _ in range(20)]
    first = len(np.unique(np.concatenate(steps)))
    assert sum(cache_model.exact_lru(steps, 300)) == first
    assert sum(cache_model.set_associative(steps, 4096, 16)) == first
    # One row per step over and over with room for it: one miss.
    same = [np.array([7])] * 5
    assert cache_model.set_associative(same, 16, 16) == [1, 0, 0, 0, 0]


@pytest.mark.slow  # Four models compiled.
def test_flax_linen_and_nnx_layers_with_a_host_table():
    """A linen model and an NNX model whose layer holds a host table train as the same
    models with the table on the device: equal losses and tables, the table on the host."""
    import flax.linen as nn
    from flax import nnx

    rng = np.random.default_rng(4)
    mesh = make_mesh(2)
    batches = [
        {
            "features": {
                "big": rng.integers(-1, 500, (_B, 5)).astype(np.int32),
                "small": rng.integers(0, 30, (_B, 2)).astype(np.int32),
            },
            "label": rng.normal(size=(_B,)).astype(np.float32),
        }
        for _ in range(3)
    ]

    class Linen(nn.Module):
        embed: jte.flax.Embed

        @nn.compact
        def __call__(self, batch):
            acts = self.embed(batch["features"])
            x = jnp.concatenate([acts["big"], acts["small"]], axis=-1)
            return nn.Dense(1, name="head")(x)[:, 0]

    def linen_loss(outputs, batch):
        return jnp.mean((outputs - batch["label"]) ** 2)

    class Nnx(nnx.Module):
        def __init__(self, emb, rngs):
            self.embed = jte.nnx.Embed.from_embedding(emb, rngs=rngs)
            self.head = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, features):
            acts = self.embed(features)
            return self.head(jnp.concatenate([acts["big"], acts["small"]], axis=-1))[:, 0]

    def nnx_loss(model, batch):
        return jnp.mean((model(batch["features"]) - batch["label"]) ** 2)

    losses, tables = {}, {}
    for p in ("device", "host"):
        emb = jte.Embedding(_train_spec(p), mesh, backend="xla")
        model = Linen(jte.flax.Embed.from_embedding(emb))
        step = jte.flax.make_train_step(model, linen_loss, optax.sgd(0.1))
        state = step.init(jax.random.key(0), batches[0])
        nnx_model = Nnx(jte.Embedding(_train_spec(p), mesh, backend="xla"), nnx.Rngs(0))
        nnx_step = jte.nnx.make_train_step(nnx_model, nnx_loss, optax.sgd(0.1))
        losses[p] = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses[p].append((float(metrics["loss"]), float(nnx_step(batch)["loss"])))
        nnx_step.flush()
        linen_state = jte.flax.embedding_states(state.embedding)["embed"]
        nnx_state = nnx_model.embed.embedding_state
        if p == "host":
            assert linen_state.tables["big"].sharding.memory_kind == _HOST
            assert nnx_state.tables["big"].sharding.memory_kind == _HOST
        tables[p] = (emb.export(linen_state), nnx_model.embed.embedding.export(nnx_state))
    assert losses["host"] == losses["device"]
    chex.assert_trees_all_equal(tables["host"], tables["device"])


def test_a_platform_without_host_memory_is_named():
    """`check_placements` names the table and the platform when the devices have no pinned
    host memory (CPU, TPU and GPU devices have it; a device without memory spaces not)."""
    from jax_tpu_embed import _planner

    class NoHostMemory:
        platform = "abacus"

        def addressable_memories(self):
            raise NotImplementedError

    table = jte.TableConfig(50, 4, name="h", placement="host")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
    storages = {n: p.storage for n, p in jte.Embedding(spec, make_mesh(1)).table_plans.items()}
    with pytest.raises(ValueError, match=r"table 'h' has placement='host' but abacus devices"):
        _planner.check_placements(spec.tables(), storages, NoHostMemory())
    _planner.check_placements(spec.tables(), storages, jax.devices()[0])  # CPU: fine.
