"""The C++ CPU kernels (cpu_kernels=True) against the portable XLA path (cpu_kernels=False)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from test_core import _features_and_spec, _grads, _inputs

import jax_tpu_embed as jte
from jax_tpu_embed import _cpu_kernels, _sparse

pytestmark = pytest.mark.skipif(not _cpu_kernels.available(),
                                reason="CPU kernels do not compile here")


@pytest.mark.parametrize("m,d,vocab,mine", [(1, 3, 5, 1.0), (257, 5, 40, 0.5),
                                            (4096, 8, 1 << 20, 0.3), (3000, 2, 7, 0.0)])
def test_sum_duplicates_bit_identical(m, d, vocab, mine, rng):
    keys = rng.integers(0, vocab, m).astype(np.int32)
    keys[rng.random(m) >= mine] = _sparse._NOT_MINE
    g = rng.normal(size=(m, d)).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3], (m, 1))
    g = g.astype(np.float32)
    want = jax.jit(_sparse._sum_duplicates)(keys, g)
    got = jax.jit(_cpu_kernels.sum_duplicates)(keys, g)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]).view(np.int32),
                                  np.asarray(want[1]).view(np.int32))


_EXTRAS = dict(weight_decay_factor=0.01, multiply_weight_decay_factor_by_learning_rate=True,
               clip_weight_min=-0.3, clip_weight_max=0.25, clipvalue=(-0.5, 0.4))
OPTIMIZERS = {
    "sgd": (jte.SGD(0.1), {}),
    "adagrad": (jte.Adagrad(0.1), {}),
    "rowwise_adagrad": (jte.RowwiseAdagrad(0.1, initial_accumulator_value=0.1), {}),
    "adagrad_extras": (jte.Adagrad(lambda step: 0.1 / (1.0 + step), **_EXTRAS),
                       dict(clipping_limit=0.7, gradient_multiplier_fn=lambda s: 1.5 + s)),
    "sgd_extras": (jte.SGD(0.1, weight_decay_factor=0.02, clipvalue=0.3), {}),
    "ftrl": (jte.FTRL(0.1), {}),  # Not a C++ update: fast sum_duplicates, portable update.
}


def _close(a, b):
    # Adagrad's rsqrt(a) is 1/sqrt(a) in C++ and RowwiseAdagrad's mean(g²) sums in another
    # order: last-bit differences.
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt_key,strategy,num_shards", [
    ("sgd", "mod", 1), ("adagrad", "div", 2), ("rowwise_adagrad", "mod", 8),
    ("adagrad_extras", "div", 8), ("sgd_extras", "mod", 2), ("ftrl", "div", 2)])
def test_fast_path_matches_portable(opt_key, strategy, num_shards, rng):
    optimizer, spec_kw = OPTIMIZERS[opt_key]
    spec = _features_and_spec(optimizer, strategy=strategy, **spec_kw)
    mesh = make_mesh(num_shards)
    fast = jte.Embedding(spec, mesh, cpu_kernels=True)
    slow = jte.Embedding(spec, mesh, cpu_kernels=False)
    assert fast.plans["shared"].cpu_rows and not slow.plans["shared"].cpu_kernels
    s_fast, s_slow = fast.init(jax.random.key(1)), slow.init(jax.random.key(1))
    for _ in range(2):
        features = _inputs(rng)
        a_fast, a_slow = fast.lookup(s_fast, features), slow.lookup(s_slow, features)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     a_fast, a_slow)
        grads = _grads(rng, a_slow)
        before = fast.export(s_fast)
        s_fast = fast.apply_gradients(s_fast, features, grads)
        s_slow = slow.apply_gradients(s_slow, features, grads)
        after_fast, after_slow = fast.export(s_fast), slow.export(s_slow)
        for name in fast.plans:
            _close(after_fast[name], after_slow[name])
            for k, v in fast.export_slots(s_fast)[name].items():
                _close(v, slow.export_slots(s_slow)[name][k])
            untouched = np.all(after_slow[name] == before[name], axis=1)
            np.testing.assert_array_equal(after_fast[name][untouched],
                                          before[name][untouched])
        assert int(s_fast.step) == int(s_slow.step)


@pytest.mark.parametrize("opt_key", ["adagrad", "rowwise_adagrad", "sgd"])
def test_update_is_in_place(opt_key):
    """A donated step writes into the table and slot buffers: no table-sized temporaries."""
    optimizer, _ = OPTIMIZERS[opt_key]
    vocab, dim, batch = 200_000, 16, 64
    table = jte.TableConfig(vocab, dim, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, optimizer)
    emb = jte.Embedding(spec, make_mesh(2))
    assert emb.cpu_kernels
    state = emb.init(jax.random.key(0))
    ids = jax.device_put(np.random.default_rng(0).integers(0, vocab, (batch, 4)).astype(
        np.int32), jax.sharding.NamedSharding(emb.mesh, jax.sharding.PartitionSpec("shard")))

    def train_step(state, ids):
        acts = emb.lookup(state, {"f": ids})
        return emb.apply_gradients(state, {"f": ids}, {"f": jnp.cos(acts["f"])})

    step = jax.jit(train_step, donate_argnums=0)
    compiled = step.lower(state, ids).compile()
    table_bytes = vocab * dim * 4
    assert compiled.memory_analysis().temp_size_in_bytes < table_bytes // 20
    pointers = lambda s: [b.data.unsafe_buffer_pointer()
                          for x in jax.tree.leaves((s.tables, s.slots))
                          for b in x.addressable_shards]
    before = pointers(state)
    state = compiled(state, ids)
    state = compiled(state, ids)
    assert pointers(state) == before


def test_off_switch_and_checks():
    spec = _features_and_spec(jte.Adagrad(0.1))
    assert not jte.Embedding(spec, make_mesh(2), cpu_kernels=False).cpu_kernels
    assert jte.Embedding(spec, make_mesh(2)).cpu_kernels  # Default on CPU meshes.
    bf16 = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(jte.TableConfig(10, 4, dtype=jnp.bfloat16, name="t"))},
        jte.Adagrad(0.1))
    assert not jte.Embedding(bf16, make_mesh(2)).plans["t"].cpu_rows  # float32 only.
    packed = jte.Embedding(spec, make_mesh(2), lane_width=128)
    assert not packed.plans["shared"].cpu_rows
