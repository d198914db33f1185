"""Config validation, row ownership (TF's div/mod), export/restore and compiled memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _layout, _storage

T = jte.TableConfig(10, 4)


@pytest.mark.parametrize(
    "make,err,match",
    [
        (lambda: jte.TableConfig(0, 4), ValueError, "vocabulary_size must be an int > 0, got 0"),
        (
            lambda: jte.TableConfig(10, -1, name="x"),
            ValueError,
            r"TableConfig\(name='x'\): dim must be an int > 0, got -1",
        ),
        (
            lambda: jte.TableConfig(10, 4, combiner="max"),
            ValueError,
            r"combiner must be one of \['sum', 'mean', 'sqrtn'\], got 'max'",
        ),
        (lambda: jte.TableConfig(10, 4, dtype=jnp.int32), ValueError, "float32 or bfloat16"),
        (
            lambda: jte.TableConfig(10, 4, optimizer="adagrad"),  # pyright: ignore[reportArgumentType]  (deliberately wrong)
            TypeError,
            "jte optimizer",
        ),
        (
            lambda: jte.TableConfig(10, 4, initializer=3),  # pyright: ignore[reportArgumentType]  (deliberately wrong)
            TypeError,
            "initializer must be",
        ),
        (
            lambda: jte.FeatureConfig(T, max_sequence_length=-1),
            ValueError,
            "max_sequence_length must be an int >= 0, got -1",
        ),
        (lambda: jte.FeatureConfig(T, output_shape=(2, 0)), ValueError, "output_shape"),
        (
            lambda: jte.FeatureConfig(42),  # pyright: ignore[reportArgumentType]  (deliberately wrong)
            TypeError,
            "table must be a TableConfig",
        ),
        (
            lambda: jte.EmbeddingSpec({"a": jte.FeatureConfig(T)}, jte.SGD(), "cols"),
            ValueError,
            r"partition_strategy must be one of \['div', 'mod'\], got 'cols'",
        ),
        (lambda: jte.EmbeddingSpec({}, jte.SGD()), ValueError, "features is empty"),
        (
            lambda: jte.EmbeddingSpec({"a": T}, jte.SGD()),
            TypeError,
            "feature 'a' must be a FeatureConfig",
        ),
        (
            lambda: jte.EmbeddingSpec({"a": jte.FeatureConfig("t")}, jte.SGD()),
            TypeError,
            "names its table by the string 't'",
        ),
        (
            lambda: jte.EmbeddingSpec({"a": jte.FeatureConfig(T)}, None),
            ValueError,
            "have no optimizer of their own",
        ),
        (
            lambda: jte.EmbeddingSpec({"a": jte.FeatureConfig(T)}, jte.SGD(), clipping_limit=-1.0),
            ValueError,
            "clipping_limit must be a float > 0",
        ),
        (
            lambda: jte.EmbeddingSpec(
                {
                    "a": jte.FeatureConfig(jte.TableConfig(3, 2, name="x")),
                    "b": jte.FeatureConfig(jte.TableConfig(3, 2, name="x")),
                },
                jte.SGD(),
            ),
            ValueError,
            "two different tables are named 'x'",
        ),
        (
            lambda: jte.EmbeddingSpec(
                {
                    "a": jte.FeatureConfig(jte.TableConfig(3, 2, name="b")),
                    "b": jte.FeatureConfig(jte.TableConfig(3, 2)),
                },
                jte.SGD(),
            ),
            ValueError,
            "derived from feature 'b'",
        ),
        (lambda: jte.Adagrad(learning_rate=-1.0), ValueError, "learning_rate must be > 0"),
        (
            lambda: jte.Adagrad(initial_accumulator_value=0.0),
            ValueError,
            "initial_accumulator_value must be > 0",
        ),
        (lambda: jte.Adam(beta_1=1.0), ValueError, "beta_1 must be < 1"),
        (lambda: jte.FTRL(learning_rate_power=0.5), ValueError, "learning_rate_power must be <= 0"),
        (
            lambda: jte.FTRL(initial_accumulator_value=0.0),
            ValueError,
            "initial_accumulator_value must be > 0",
        ),
        (lambda: jte.SGD(clipvalue=(1.0, -1.0)), ValueError, "clipvalue must be"),
        (
            lambda: jte.SGD(clip_weight_min=1.0, clip_weight_max=0.0),
            ValueError,
            "clip_weight_min \\(1.0\\) must be <= clip_weight_max",
        ),
        (
            lambda: jte.CustomOptimizer(lambda *a: a[1], slot_names=["m"]),
            ValueError,
            "slot_initializers must have one entry per slot",
        ),
        (
            lambda: jte.CustomOptimizer(
                lambda *a: a[1], slot_names=["m"], slot_initializers=[0.0], slot_dims=[3]
            ),
            ValueError,
            "slot_dims must list 1 or 2",
        ),
    ],
)
def test_config_errors(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_table_names_derived_and_shared():
    shared = jte.TableConfig(5, 2)
    spec = jte.EmbeddingSpec(
        {
            "z": jte.FeatureConfig(shared),
            "a": {"b": jte.FeatureConfig(shared)},
            "c": jte.FeatureConfig(jte.TableConfig(5, 2, name="mine")),
        },
        jte.SGD(),
    )
    assert list(spec.tables()) == ["a/b", "mine"]  # First user in sorted order names it.
    assert jte.FTRL(initial_accumulator_value=0.0, allow_zero_accumulator=True)


@pytest.mark.parametrize(
    "strategy,want",
    [
        ("div", [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]),
        ("mod", [[0, 5, 10], [1, 6, 11], [2, 7, 12], [3, 8], [4, 9]]),
    ],
)
def test_tf_row_ownership_example(strategy, want):
    layout = _layout.TableLayout(13, 5, strategy)
    for p, rows in enumerate(want):
        np.testing.assert_array_equal(layout.logical_ids(p), rows)
        owner, local = layout.owner_and_local(np.array(rows))
        np.testing.assert_array_equal(owner, p)
        np.testing.assert_array_equal(local, np.arange(len(rows)))


@pytest.mark.parametrize("v,n", [(13, 5), (3, 8), (16, 4), (1, 1), (17, 8)])
@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_layout_round_trip(v, n, strategy):
    layout = _layout.TableLayout(v, n, strategy)
    x = np.arange(v * 2).reshape(v, 2) + 1
    phys = layout.to_physical(x)
    assert phys.shape == (n * layout.rows_per_shard, 2)
    np.testing.assert_array_equal(layout.to_logical(phys), x)
    np.testing.assert_array_equal(np.asarray(layout.to_logical(jnp.asarray(phys))), x)
    for p in range(n):
        s = layout.rows_per_shard
        size = layout.shard_sizes()[p]
        np.testing.assert_array_equal(phys[p * s : p * s + size], x[layout.logical_ids(p)])
        assert np.all(phys[p * s + size : (p + 1) * s] == 0)  # Padding.
    assert layout.shard_sizes().sum() == v


@pytest.mark.parametrize("strategy", ["div", "mod"])
def test_shard_rows_export_restore(strategy, rng):
    table = jte.TableConfig(13, 3, name="t")
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table)}, jte.Adam(0.1), partition_strategy=strategy
    )
    emb = jte.Embedding(spec, make_mesh(5, "auto"))
    logical = rng.normal(size=(13, 3)).astype(np.float32)
    m = rng.normal(size=(13, 3)).astype(np.float32)
    state = emb.restore_tables({"t": logical}, slots={"t": {"momenta": m}}, step=7)
    assert int(state.step) == 7
    np.testing.assert_array_equal(emb.export(state)["t"], logical)
    np.testing.assert_array_equal(emb.export_slots(state)["t"]["momenta"], m)
    np.testing.assert_array_equal(emb.export_slots(state)["t"]["velocities"], 0)
    layout = _layout.TableLayout(13, 5, strategy)
    for p in range(5):
        np.testing.assert_array_equal(emb.shard_rows(state, "t", p), logical[layout.logical_ids(p)])
    with pytest.raises(ValueError, match=r"table 't' has shape \(13, 4\)"):
        emb.restore_tables({"t": np.zeros((13, 4), np.float32)})
    with pytest.raises(ValueError, match=r"table 'u' is not in the spec"):
        emb.restore_tables({"t": logical, "u": logical})
    with pytest.raises(ValueError, match=r"has no slots \['accumulators'\]"):
        emb.restore_tables({"t": logical}, slots={"t": {"accumulators": m}})


def _step(emb):
    def step(state, features):
        acts = emb.lookup(state, features)
        grads = jax.tree.map(lambda a: jnp.full_like(a, 0.5), acts)
        return emb.apply_gradients(state, features, grads)

    return step


def _compiled_update(vocab, dim=128, batch=256, ids=8, mesh=None, with_step=True):
    table = jte.TableConfig(vocab, dim, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
    mesh = mesh or make_mesh(4)
    emb = jte.Embedding(spec, mesh)
    batch_sharding = NamedSharding(mesh, P("shard"))
    feats = {"f": jax.ShapeDtypeStruct((batch, ids), jnp.int32, sharding=batch_sharding)}
    grads = {"f": jax.ShapeDtypeStruct((batch, dim), jnp.float32, sharding=batch_sharding)}
    upd = jax.jit(emb.apply_gradients, donate_argnums=0)
    compiled = upd.lower(emb.abstract_state(), feats, grads).compile()
    if not with_step:
        return emb, compiled, None
    full = jax.jit(_step(emb), donate_argnums=0).lower(emb.abstract_state(), feats).compile()
    return emb, compiled, full


def test_compiled_update_has_no_table_sized_temporaries():
    vocab, dim = 1_000_000, 128
    emb, compiled, full = _compiled_update(vocab, dim)
    assert full is not None
    shard_bytes = vocab // 4 * dim * 4
    for c in (compiled, full):
        mem = c.memory_analysis()
        assert mem is not None and mem.temp_size_in_bytes < 0.05 * shard_bytes, mem
        # Table and accumulator are donated: their buffers are reused for the outputs.
        assert mem.alias_size_in_bytes >= 2 * shard_bytes, mem
        hlo = c.as_text()
        assert hlo is not None and f"f32[{vocab // 4},{dim}]" in hlo
        copies = [l for l in hlo.splitlines() if " copy(" in l and f"[{vocab // 4},{dim}]" in l]
        assert not copies, copies


def test_update_cost_does_not_grow_with_vocabulary():
    """The TPU compiler's own estimate (XLA:CPU's cost model charges a scatter for its whole
    operand, so it cannot tell)."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    except Exception as e:  # libtpu missing or unusable.
        pytest.skip(f"TPU compiler unavailable: {e}")
    mesh = jax.sharding.Mesh(np.array(topo.devices), ("shard",))
    for dim in [32, 128]:  # 32: lane-packed on TPU; 128: one row per 128 lanes.
        costs = []
        for vocab in [100_000, 10_000_000]:
            _, compiled, _ = _compiled_update(
                vocab, dim=dim, batch=1024, ids=8, mesh=mesh, with_step=False
            )
            cost = compiled.cost_analysis()
            assert cost is not None
            costs.append(cost["bytes accessed"])
        assert costs[1] < 1.1 * costs[0], (dim, costs)


@pytest.mark.parametrize(
    "width,rank,k,w",
    [
        (5, 2, 16, 8),
        (64, 2, 2, 64),
        (128, 2, 1, 128),
        (1, 1, 128, 1),
        (200, 2, 1, 256),  # Wider than the lanes: a multiple of them.
        (3, 2, 32, 4),
    ],
)
def test_lane_packing_round_trip(width, rank, k, w):
    packing = _layout.Packing(width, rank, lanes=128)
    assert (packing.per_row, packing.padded_width) == (k, w)
    layout = _layout.TableLayout(37, 4, "mod")
    rows = layout.rows_per_shard * 4
    x = np.arange(rows * width).reshape((rows, width) if rank == 2 else (rows,)) + 1.0
    phys = packing.pack(x, 4)
    assert phys.shape == packing.physical_shape(layout)
    np.testing.assert_array_equal(packing.unpack(phys, 4, layout.rows_per_shard), x)
    assert _layout.Packing(width, rank, lanes=0).pack(x, 4) is x


@pytest.mark.parametrize("width,k,lanes", [(64, 2, 128), (128, 1, 128), (200, 1, 256)])
def test_row_pairs_pad_each_shard_to_an_even_number_of_physical_rows(width, k, lanes):
    """A 16-bit table on TPU (row_multiple=2): shards of 73 logical rows (37 or 73 physical
    rows) hold 38 or 74, the padding row zero and dropped on the way back."""
    packing = _layout.Packing(width, 2, lanes=128, row_multiple=2)
    layout = _layout.TableLayout(292, 4, "div")
    rows = {2: 38, 1: 74}[k]
    assert packing.shard_rows(73) == rows and packing.per_row == k
    assert not packing.is_identity(73)
    x = np.arange(292 * width, dtype=np.float32).reshape(292, width) + 1.0
    phys = packing.pack(x, 4)
    assert phys.shape == packing.physical_shape(layout) == (4 * rows, lanes)
    np.testing.assert_array_equal(phys.reshape(4, rows, -1)[:, -1], 0.0)
    np.testing.assert_array_equal(phys[:, k * width :], 0.0)  # Lanes past the rows: zero.
    np.testing.assert_array_equal(packing.unpack(phys, 4, 73), x)
    storage = _storage.TableStorage(layout, width, jnp.dtype(jnp.bfloat16), (), lanes=128)
    assert storage.packing == packing and not storage.is_identity(None)
    assert storage.block_to_physical(None, x[:8]).shape == (8 // k, lanes)


@pytest.mark.parametrize(
    "optimizer,dim,dtype,lanes,riders,width",
    [
        (jte.Adagrad(0.1), 32, jnp.float32, 128, ["accumulators"], 64),
        (jte.Adagrad(0.1), 64, jnp.float32, 128, ["accumulators"], 128),
        (jte.Adagrad(0.1), 65, jnp.float32, 128, [], 65),  # 130 lanes: no room.
        (jte.Adam(0.1), 40, jnp.float32, 128, ["momenta", "velocities"], 120),
        (jte.Adam(0.1), 32, jnp.float32, 128, [], 32),  # 96 lanes pad to 128 > 3 x 32.
        (jte.Adam(0.1, lazy_adam=False), 40, jnp.float32, 128, [], 40),  # Dense update.
        (jte.RowwiseAdagrad(0.1), 32, jnp.float32, 128, [], 32),  # Rank-1 slot.
        (jte.Adagrad(0.1), 32, jnp.bfloat16, 128, [], 32),  # f32 slots, bf16 table.
        (jte.Adagrad(0.1), 32, jnp.float32, 0, [], 32),  # Not packed (CPU).
    ],
)
def test_slots_ride_in_the_table_rows_only_when_free(optimizer, dim, dtype, lanes, riders, width):
    """Which slots share the table's array (TableStorage.riders): f32, same width, the group
    within 128 lanes and padding to no more lanes than separate arrays would; the others
    keep arrays of their own (abstract_state's slots)."""
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(jte.TableConfig(1000, dim, name="t", dtype=dtype))}, optimizer
    )
    emb = jte.Embedding(spec, make_mesh(2), lane_width=lanes)
    storage = emb.storage("t")
    assert [s.name for s in storage.riders] == riders
    assert storage.packing.width == width
    assert set(emb.abstract_state().slots["t"]) == (
        {s.name for s in storage.slot_specs} - set(riders)
    )
