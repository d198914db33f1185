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
from test_optimizers import _B, _SEQ, _SPEC_EXTRAS, _V, OPTIMIZERS, _batch, _spec

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


@pytest.mark.slow  # The fast tier: the kernels' rounding against the XLA passes.
def test_bf16_results_do_not_depend_on_mesh_or_strategy(rng):
    table_of = {}
    batches = [_batch(rng) for _ in range(3)]
    grads = [
        {k: rng.normal(size=(16, 12) if k == "multi" else (16, 3, 12)) for k in ("multi", "seq")}
        for _ in range(3)
    ]
    meshes = [("div", 1), ("mod", 8), ("div", 8), ("mod", 2)]
    # Owner routing too: the rows' owners round them with the same bits.
    for strategy, n, routing in [(s, n, "gather") for s, n in meshes] + [("mod", 4, "owner")]:
        spec = _spec(jte.Adagrad(0.05), strategy, False)
        table = spec.features["multi"].table
        assert isinstance(table, jte.TableConfig)
        spec = _with_bf16(spec)
        emb = jte.Embedding(spec, make_mesh(n), backend="xla", routing=routing)
        state = emb.init(jax.random.key(4))
        for f, g in zip(batches, grads):
            state = emb.apply_gradients(state, f, jax.tree.map(np.float32, g))
        table_of[strategy, n, routing] = np.asarray(emb.export(state)["t"].astype(np.float32))
    first = table_of["div", 1, "gather"]
    for key, t in table_of.items():
        np.testing.assert_array_equal(t, first, err_msg=str(key))


# Optimizers of every slot form (no slot, one riding the table's rows, two, a rank-1 slot;
# the float32 battery has every optimizer on the kernels) at a packed dim that is not a power
# of two (rows padded to 64 lanes, two to a 128-lane row); Adagrad at dims 32-256, 200 among
# them (padded to 256 lanes). Meshes of 4 give shards of 75 rows: odd physical row counts,
# padded to row pairs. Owner routing once: the owners' kernels update the rows they receive.
# The fast tier keeps two: packed rows rounded stochastically with a riding slot and the
# extras, and unpacked rows rounded to nearest with two slots; the rest (routed among them:
# test_bf16_results_do_not_depend_on_mesh_or_strategy routes on the XLA ops in the fast
# tier) are marked slow.
_KERNEL_OPTIMIZERS = ("sgd+extras", "adagrad+extras", "adam+extras", "rowwise_adagrad")
_FAST_KERNEL_CASES = ("adagrad+extras-d48",)
_KERNEL_CASES = [(key, 48, "mod", 8, True, "gather", f"{key}-d48") for key in _KERNEL_OPTIMIZERS]
_KERNEL_CASES += [
    ("adagrad", 32, "div", 4, True, "gather", "adagrad-d32"),
    ("adagrad+extras", 64, "mod", 4, False, "gather", "adagrad+extras-d64-nearest"),
    ("adagrad", 128, "div", 4, True, "gather", "adagrad-d128"),
    ("rmsprop", 200, "mod", 4, False, "gather", "rmsprop-d200-nearest"),
    ("adam", 256, "div", 8, True, "gather", "adam-d256"),
    ("adagrad", 48, "div", 4, True, "owner", "adagrad-d48-owner"),
]
_KERNEL_CASES = [
    pytest.param(*c[:-1], id=c[-1], marks=[] if c[-1] in _FAST_KERNEL_CASES else pytest.mark.slow)
    for c in _KERNEL_CASES
]


@pytest.mark.parametrize("opt_key,dim,strategy,num_shards,stochastic,routing", _KERNEL_CASES)
def test_bf16_pallas_kernels_round_like_the_xla_passes(
    opt_key, dim, strategy, num_shards, stochastic, routing, rng
):
    """The fused kernels (interpret mode, rows packed 128 lanes wide, bfloat16 rows moved in
    pairs of 32-bit words) round a new float32 row with the same bits as the XLA passes for
    the same (table, step, row): where the backends' float32 rows agree, so do the bfloat16
    tables, bit for bit.

    Their float32 rows can differ by an ulp (float32 tables too): off TPU the XLA passes add
    a row's gradients in position order and the kernels in (row, output row) order, and
    XLA:CPU fuses some a·b + c into one rounding in one program and not in the other. The
    combiner is "sum" and the gradients are multiples of 2^-6, so that every order gives the
    same sums; what is left moves a stochastically rounded value one bfloat16 step with
    probability about 2^-16 per ulp: at most a couple of such values are allowed.
    """
    optimizer, _, _, extras = OPTIMIZERS[opt_key]
    table = jte.TableConfig(
        _V,
        dim,
        combiner="sum",
        name="t",
        dtype=jnp.bfloat16,
        stochastic_rounding=stochastic,
    )
    spec = jte.EmbeddingSpec(
        {
            "multi": jte.FeatureConfig(table),
            "seq": jte.FeatureConfig(table, max_sequence_length=_SEQ),
        },
        optimizer,
        partition_strategy=strategy,
        **(_SPEC_EXTRAS if extras else {}),
    )
    batches = [_batch(rng) for _ in range(2)]
    grads = [
        {
            "multi": rng.integers(-64, 65, (_B, dim)).astype(np.float32) / 64,
            "seq": rng.integers(-64, 65, (_B, _SEQ, dim)).astype(np.float32) / 64,
        }
        for _ in range(2)
    ]
    out = []
    # Blocks of 8 pairs: rows carried across blocks.
    for backend in ("xla", jte.backends.Pallas(interpret=True, block=8)):
        emb, trained = _trained(
            spec, num_shards, batches, grads, backend=backend, lane_width=128, routing=routing
        )
        assert emb.backends == {"t": jte.backends.named(backend).name}
        assert emb.routing == {"t": routing}
        out.append(trained)
    (t_xla, s_xla, acts_xla), (t_pallas, s_pallas, acts_pallas) = out
    for k in acts_xla:  # The bfloat16 lookup kernel, too.
        np.testing.assert_allclose(acts_pallas[k], acts_xla[k], rtol=1e-5, atol=1e-6)
    assert t_pallas.dtype == jnp.bfloat16
    changed = t_xla.view(np.uint16) != _initial(spec, num_shards).view(np.uint16)
    assert changed.any(axis=1).sum() > 10  # Many rows updated, not only a few.
    bits_xla, bits_pallas = t_xla.view(np.int16), t_pallas.view(np.int16)
    apart = np.argwhere(bits_pallas != bits_xla)
    assert len(apart) <= 2, apart
    for i, j in apart:  # Neighbours: one bfloat16 step apart.
        assert abs(int(bits_pallas[i, j]) - int(bits_xla[i, j])) == 1, (i, j)
    assert s_pallas.keys() == s_xla.keys()
    for name in s_xla:
        np.testing.assert_allclose(s_pallas[name], s_xla[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _trained(spec, num_shards, batches, grads, **kw):
    """(emb, (table t, its slots, the lookup of batches[0])) after one update per batch,
    exported as logical rows."""
    emb = jte.Embedding(spec, make_mesh(num_shards), **kw)
    state = emb.init(jax.random.key(4))
    for f, g in zip(batches, grads):
        state = emb.apply_gradients(state, f, g)
    acts = jax.tree.map(np.asarray, emb.lookup(state, batches[0]))
    return emb, (emb.export(state)["t"], emb.export_slots(state)["t"], acts)


def _initial(spec, num_shards):
    emb = jte.Embedding(spec, make_mesh(num_shards), backend="xla")
    return emb.export(emb.init(jax.random.key(4)))["t"]


def _with_bf16(spec, stochastic=True):
    """The battery's spec with its table stored in bfloat16 (rounded stochastically, the
    default, or to nearest)."""
    old = spec.features["multi"].table
    table = jte.TableConfig(
        old.vocabulary_size,
        old.dim,
        combiner=old.combiner,
        name=old.name,
        dtype=jnp.bfloat16,
        stochastic_rounding=None if stochastic else False,
    )
    assert table.stochastic_rounding == stochastic
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


# The optimizers the C++ kernels update themselves (others sum duplicates there and update
# with the XLA form): SGD, Adagrad with every extra, RowwiseAdagrad.
_CPU_OPTIMIZERS = {
    "sgd": (jte.SGD(0.3), False),
    "adagrad+extras": (
        jte.Adagrad(
            0.2,
            initial_accumulator_value=0.5,
            clipvalue=(-0.5, 0.4),
            weight_decay_factor=0.05,
            multiply_weight_decay_factor_by_learning_rate=True,
            clip_weight_min=-0.3,
            clip_weight_max=0.25,
        ),
        True,
    ),
    "rowwise_adagrad": (jte.RowwiseAdagrad(0.2, initial_accumulator_value=0.1), False),
}


def _cpu_cases():
    """Every optimizer of _CPU_OPTIMIZERS on 1 and 8 devices, "div" and "mod", rounded
    stochastically, and to nearest on ("mod", 8). The rounding bits depend on the global row
    only (first + r * stride: on 8 devices first and stride differ between "div" and
    "mod"); the fast tier keeps 8 devices, each optimizer on one strategy in turn (and to
    nearest once), the slow tier the rest."""
    meshes = [("div", 1, True), ("mod", 1, True), ("div", 8, True), ("mod", 8, True)]
    meshes += [("mod", 8, False)]
    for strategy, n, stochastic in meshes:
        for i, key in enumerate(_CPU_OPTIMIZERS):
            # The fast tier: each optimizer on one strategy, in turn.
            mine = strategy == ("div", "mod")[i % 2]
            fast = n == 8 and mine and (stochastic or key == "adagrad+extras")
            yield pytest.param(
                key,
                strategy,
                n,
                stochastic,
                id=f"{key}-{strategy}-{n}-{stochastic}",
                marks=[] if fast else [pytest.mark.slow],
            )


@pytest.mark.parametrize("opt_key,strategy,num_shards,stochastic", list(_cpu_cases()))
def test_bf16_cpu_kernels_round_like_the_xla_passes(opt_key, strategy, num_shards, stochastic, rng):
    """The C++ kernels widen bfloat16 rows, update them in float32 and round them back with
    the same bits as the XLA passes: the same bfloat16 table, bit for bit, and the same
    lookups. Adagrad's accumulator is bit-identical too; RowwiseAdagrad's may differ in its
    last bit (XLA:CPU vectorises mean(g²))."""
    from jax_tpu_embed import _cpu_kernels

    if not _cpu_kernels.available():
        pytest.skip("the C++ CPU kernels do not compile here")
    optimizer, extras = _CPU_OPTIMIZERS[opt_key]
    spec = _with_bf16(_spec(optimizer, strategy, extras), stochastic)
    batches = [_batch(rng) for _ in range(3)]
    grads = [
        {
            "multi": rng.normal(size=(16, 12)).astype(np.float32),
            "seq": rng.normal(size=(16, 3, 12)).astype(np.float32),
        }
        for _ in range(3)
    ]
    out = []
    for backend in ("xla", "auto"):
        emb, trained = _trained(spec, num_shards, batches, grads, backend=backend)
        assert emb.backends == {"t": "xla" if backend == "xla" else "cpu"}
        out.append(trained)
    (t_xla, s_xla, acts_xla), (t_cpu, s_cpu, acts_cpu) = out
    assert t_cpu.dtype == jnp.bfloat16
    np.testing.assert_array_equal(t_cpu.view(np.uint16), t_xla.view(np.uint16))
    for k in acts_xla:
        np.testing.assert_array_equal(acts_cpu[k], acts_xla[k])
    for name in s_xla:
        if opt_key == "rowwise_adagrad":
            np.testing.assert_allclose(s_cpu[name], s_xla[name], rtol=1e-6)
        else:
            np.testing.assert_array_equal(s_cpu[name], s_xla[name])


@pytest.mark.parametrize("stochastic", [True, False])
def test_bf16_cpu_kernel_rounds_special_values_like_xla(stochastic, rng):
    """SGD with lr 1 on a zero row writes x = -g: the kernel's bfloat16 rows are
    `_storage.round_stochastically` of x with the bits of global row first + r * stride (or
    XLA's convert), for infinities, float32's largest value and values on and near rounding
    boundaries; NaN stays a quiet NaN. (XLA:CPU and the kernels run with subnormals flushed
    to zero, so x cannot be one.)"""
    from jax_tpu_embed import _cpu_kernels

    if not _cpu_kernels.available():
        pytest.skip("the C++ CPU kernels do not compile here")
    special = np.array(
        [0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF]
        + [0xBF808000, 0x3F7F8000, 0x00000000],
        np.uint32,
    ).view(np.float32)
    rows, d, first, stride = 40, 11, 5, 3
    x = (rng.normal(size=(rows, d)) * rng.choice([1e-3, 1.0, 1e4], (rows, 1))).astype(np.float32)
    x.reshape(-1)[: special.size] = special
    keys = rng.permutation(rows).astype(np.int32)  # Distinct rows, in any order.
    key = _storage.step_key(_storage.table_seed("t"), 7)
    rounding = None
    if stochastic:
        rounding = jnp.stack(
            [jax.lax.bitcast_convert_type(key, jnp.int32), jnp.int32(first), jnp.int32(stride)]
        )

    def run(g):
        table = jnp.zeros((rows, d), jnp.bfloat16)
        new, _ = _cpu_kernels.update(
            jte.SGD(1.0), table, (), keys, g, jnp.float32(1.0), None, None, None, rounding
        )
        return new

    got = np.asarray(jax.jit(run)(-x[keys]))
    if stochastic:
        bits = _storage.random_bits(key, first + stride * np.arange(rows), d)
        want = np.asarray(jax.jit(_storage.round_stochastically)(x, bits))
    else:
        want = np.asarray(jax.jit(lambda v: v.astype(jnp.bfloat16))(x))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # NaN: XLA's convert makes every NaN the quiet NaN of its sign, as the kernel does.
    nan = np.full((rows, d), np.nan, np.float32)
    got = np.asarray(jax.jit(run)(nan)).view(np.uint16)
    assert set(np.unique(got & 0x7FFF)) == {0x7FC0}
