"""bfloat16 tables with stochastic rounding: updates smaller than half a bfloat16 step are
kept on average, and the rounding bits are keyed by (table, step, row), so results do not
depend on the mesh or the partition strategy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _storage
from test_optimizers import _batch, _spec

_D = 128


def _descend(dtype, stochastic, steps=1000, backend="xla"):
    """`steps` SGD updates of -1e-4 on a row of ones; returns that row (float32)."""
    table = jte.TableConfig(
        4,
        _D,
        initializer=lambda key, shape, dtype: jnp.ones(shape, dtype),
        combiner="sum",
        name="t",
        dtype=dtype,
        stochastic_rounding=stochastic,
    )
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.SGD(1.0))
    emb = jte.Embedding(spec, make_mesh(1), backend=backend)
    ids = jnp.zeros((2, 1), jnp.int32).at[1].set(-1)  # Row 0 once per step.
    grads = {"f": jnp.full((2, _D), 1e-4, jnp.float32)}

    @jax.jit
    def run(state):
        return jax.lax.fori_loop(
            0, steps, lambda _, s: emb.apply_gradients(s, {"f": ids}, grads), state
        )

    state = run(emb.init(jax.random.key(0)))
    assert int(state.step) == steps
    return np.asarray(emb.export(state)["t"][0], np.float32)


def test_small_updates_survive_in_bf16():
    want = _descend(jnp.float32, None).mean()
    assert abs(want - 0.9) < 1e-3
    got = _descend(jnp.bfloat16, None).mean()  # Stochastic rounding is bf16's default.
    assert abs(got - want) <= 0.01 * abs(want), (got, want)
    # Rounding to nearest loses every one of them: the row stays at exactly 1.
    nearest = _descend(jnp.bfloat16, False)
    np.testing.assert_array_equal(nearest, np.ones(_D, np.float32))


def test_bf16_results_do_not_depend_on_mesh_or_strategy(rng):
    table_of = {}
    batches = [_batch(rng) for _ in range(3)]
    grads = [
        {k: rng.normal(size=(16, 12) if k == "multi" else (16, 3, 12)) for k in ("multi", "seq")}
        for _ in range(3)
    ]
    for strategy, n in [("div", 1), ("mod", 8), ("div", 8), ("mod", 2)]:
        spec = _spec(jte.Adagrad(0.05), strategy, False)
        table = spec.features["multi"].table
        assert isinstance(table, jte.TableConfig)
        spec = _with_bf16(spec)
        emb = jte.Embedding(spec, make_mesh(n), backend="xla")
        state = emb.init(jax.random.key(4))
        for f, g in zip(batches, grads):
            state = emb.apply_gradients(state, f, jax.tree.map(np.float32, g))
        table_of[strategy, n] = np.asarray(emb.export(state)["t"].astype(np.float32))
    first = table_of["div", 1]
    for key, t in table_of.items():
        np.testing.assert_array_equal(t, first, err_msg=str(key))


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_bf16_pallas_kernels_round_like_the_xla_passes(strategy, rng, monkeypatch):
    """The fused kernels (interpret mode, rows packed 128 lanes wide) draw the same bits
    for the same (table, step, row) as the XLA passes: the same bfloat16 table."""
    from jax_tpu_embed import _pallas

    monkeypatch.setattr(_pallas, "_BLOCK", 8)  # Rows carried across blocks.
    spec = _with_bf16(_spec(jte.Adagrad(0.05), strategy, False))
    batches = [_batch(rng) for _ in range(2)]
    grads = [
        {
            "multi": rng.normal(size=(16, 12)).astype(np.float32),
            "seq": rng.normal(size=(16, 3, 12)).astype(np.float32),
        }
        for _ in range(2)
    ]
    out = []
    for backend in ("xla", "pallas_interpret"):
        emb = jte.Embedding(spec, make_mesh(8), backend=backend)
        assert emb.backends == {"t": backend}
        state = emb.init(jax.random.key(4))
        for f, g in zip(batches, grads):
            state = emb.apply_gradients(state, f, g)
        acts = jax.tree.map(np.asarray, emb.lookup(state, batches[0]))
        out.append((emb.export(state)["t"], emb.export_slots(state)["t"]["accumulators"], acts))
    (t_xla, a_xla, acts_xla), (t_pallas, a_pallas, acts_pallas) = out
    for k in acts_xla:  # The bfloat16 lookup kernel, too.
        np.testing.assert_allclose(acts_pallas[k], acts_xla[k], rtol=1e-5, atol=1e-6)
    assert t_pallas.dtype == jnp.bfloat16
    np.testing.assert_array_equal(t_pallas.view(np.uint16), t_xla.view(np.uint16))
    np.testing.assert_allclose(a_pallas, a_xla, rtol=1e-6)


def _with_bf16(spec):
    """The battery's spec with its table stored in bfloat16 (default rounding)."""
    old = spec.features["multi"].table
    table = jte.TableConfig(
        old.vocabulary_size, old.dim, combiner=old.combiner, name=old.name, dtype=jnp.bfloat16
    )
    assert table.stochastic_rounding
    features = {
        k: jte.FeatureConfig(table, max_sequence_length=f.max_sequence_length)
        for k, f in spec.features.items()
    }
    return jte.EmbeddingSpec(features, spec.optimizer, partition_strategy=spec.partition_strategy)


def test_round_stochastically_is_unbiased_and_exact_on_bf16_values():
    x = jnp.asarray([1.0 - 1e-4, -3.3e-3, 7.123e5, 1.5], jnp.float32)
    n = 20000
    bits = _storage.random_bits(_storage.step_key(123, 7), jnp.arange(n), 4)
    rounded = jax.vmap(_storage.round_stochastically)(jnp.broadcast_to(x, (n, 4)), bits)
    r = np.asarray(rounded.astype(jnp.float32), np.float64)
    xs = np.asarray(x, np.float64)
    for j in range(4):  # Only the two bfloat16 neighbours of x come out.
        assert len(np.unique(r[:, j])) <= 2
    spacing = np.abs(xs) * 2.0**-7
    assert np.all(np.abs(r.mean(0) - xs) < 0.03 * spacing), (r.mean(0), xs)
    np.testing.assert_array_equal(r[:, 3], 1.5)  # Exactly representable: never moved.


@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(stochastic_rounding=True), ValueError, "stochastic_rounding=True needs dtype"),
        (
            dict(dtype=jnp.bfloat16, stochastic_rounding="yes"),
            TypeError,
            "stochastic_rounding must be a bool",
        ),
    ],
)
def test_stochastic_rounding_config_errors(kw, error, match):
    with pytest.raises(error, match=r"TableConfig\(name='t'\): " + match):
        jte.TableConfig(10, 4, name="t", **kw)
    assert not jte.TableConfig(10, 4).stochastic_rounding
    assert jte.TableConfig(10, 4, dtype=jnp.bfloat16).stochastic_rounding
