"""The C++ CPU kernels (backend="cpu"): bit-identical duplicate sums, in-place updates and
when "auto" takes them. tests/test_optimizers.py checks their optimizer math against the
float64 reference with every other backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _cpu_kernels, _streams, _xla_backend
from test_core import _features_and_spec

pytestmark = pytest.mark.skipif(
    not _cpu_kernels.available(), reason="CPU kernels do not compile here"
)


@pytest.mark.parametrize(
    "m,d,vocab,mine",
    [(1, 3, 5, 1.0), (257, 5, 40, 0.5), (4096, 8, 1 << 20, 0.3), (3000, 2, 7, 0.0)],
)
def test_sum_duplicates_bit_identical(m, d, vocab, mine, rng):
    keys = rng.integers(0, vocab, m).astype(np.int32)
    keys[rng.random(m) >= mine] = _streams.NOT_MINE
    g = rng.normal(size=(m, d)).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3], (m, 1))
    g = g.astype(np.float32)
    want = jax.jit(_xla_backend.sum_duplicates)(keys, g)
    got = jax.jit(_cpu_kernels.sum_duplicates)(keys, g)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(
        np.asarray(got[1]).view(np.int32), np.asarray(want[1]).view(np.int32)
    )


OPTIMIZERS = {
    "sgd": jte.SGD(0.1),
    "adagrad": jte.Adagrad(0.1),
    "rowwise_adagrad": jte.RowwiseAdagrad(0.1, initial_accumulator_value=0.1),
}


@pytest.mark.parametrize("opt_key", ["adagrad", "rowwise_adagrad", "sgd"])
def test_update_is_in_place(opt_key):
    """A donated step writes into the table and slot buffers: no table-sized temporaries."""
    optimizer = OPTIMIZERS[opt_key]
    vocab, dim, batch = 200_000, 16, 64
    table = jte.TableConfig(vocab, dim, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, optimizer)
    emb = jte.Embedding(spec, make_mesh(2))
    assert emb.backends == {"t": "cpu"}
    state = emb.init(jax.random.key(0))
    ids = jax.device_put(
        np.random.default_rng(0).integers(0, vocab, (batch, 4)).astype(np.int32),
        jax.sharding.NamedSharding(emb.mesh, jax.sharding.PartitionSpec("shard")),
    )

    def train_step(state, ids):
        acts = emb.lookup(state, {"f": ids})
        return emb.apply_gradients(state, {"f": ids}, {"f": jnp.cos(acts["f"])})

    step = jax.jit(train_step, donate_argnums=0)
    compiled = step.lower(state, ids).compile()
    table_bytes = vocab * dim * 4
    memory = compiled.memory_analysis()
    assert memory is not None and memory.temp_size_in_bytes < table_bytes // 20
    pointers = lambda s: [
        b.data.unsafe_buffer_pointer()
        for x in jax.tree.leaves((s.tables, s.slots))
        for b in x.addressable_shards
    ]
    before = pointers(state)
    state = compiled(state, ids)
    state = compiled(state, ids)
    assert pointers(state) == before


def test_auto_takes_them_where_it_can():
    spec = _features_and_spec(jte.Adagrad(0.1))
    assert set(jte.Embedding(spec, make_mesh(2)).backends.values()) == {"cpu"}
    assert set(jte.Embedding(spec, make_mesh(2), backend="xla").backends.values()) == {"xla"}
    bf16 = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(jte.TableConfig(10, 4, dtype=jnp.bfloat16, name="t"))},
        jte.Adagrad(0.1),
    )
    assert jte.Embedding(bf16, make_mesh(2)).backends == {"t": "cpu"}  # bfloat16 too.
    packed = jte.Embedding(spec, make_mesh(2), lane_width=128)
    assert set(packed.backends.values()) == {"xla"}  # Unpacked rows only.
    with pytest.raises(
        ValueError,
        match="table 'shared' cannot use backend 'cpu': the C.. kernels take unpacked tables",
    ):
        jte.Embedding(spec, make_mesh(2), lane_width=128, backend="cpu")
