"""`jte.multihost.to_host`: an array's rows on this host, through the devices in pieces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _multihost


def _same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize(
    "kind, memory", [("auto", "device"), ("explicit", "device"), ("explicit", "pinned_host")]
)
@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((1000, 5), np.float32),
        ((1000,), np.uint32),
        ((1000, 3), np.int32),
        ((1000, 4), jnp.bfloat16),
    ],
)
def test_rows_in_pieces_equal_numpy(kind, memory, shape, dtype):
    """Rows taken on the devices in pieces of a few rows (as with several processes) equal
    NumPy's, in the order asked, duplicates included; so does the whole array."""
    rng = np.random.default_rng(0)
    host = (rng.normal(size=shape) * 1000).astype(dtype)
    if host.dtype.kind == "f":  # Bits kept: -0.0 and a NaN (an all-reduce of values adds 0.0).
        host[:2] = np.array([-0.0, np.nan], dtype).reshape((2,) + (1,) * (host.ndim - 1))
    x = jax.device_put(host, NamedSharding(make_mesh(8, kind), P("shard"), memory_kind=memory))
    rows = rng.integers(0, shape[0], 333)  # Duplicates; 333 is not a multiple of a piece.
    row_bytes = host.itemsize * int(np.prod(shape[1:]))
    _same_bits(jte.multihost.to_host(x, rows), host[rows])
    for per in (7, 100, 5000):
        got = jte.multihost.to_host(x, rows, chunk_bytes=per * row_bytes)
        _same_bits(got, host[rows])
    _same_bits(jte.multihost.to_host(x, np.arange(1000), chunk_bytes=64), host)
    _same_bits(jte.multihost.to_host(x), host)
    assert jte.multihost.to_host(x, np.zeros((0,), np.int64)).shape == (0,) + shape[1:]


@pytest.mark.parametrize("memory", ["device", "pinned_host"])
def test_each_part_read_alone_on_its_device(memory):
    """`parts` gives this process's part k of each array (an empty one too), and a part
    read `alone` in pieces on its device gives its own rows, as NumPy does."""
    rng = np.random.default_rng(1)
    host = rng.normal(size=(800, 3)).astype(np.float32)
    x = jax.device_put(host, NamedSharding(make_mesh(8), P("shard"), memory_kind=memory))
    parts = _multihost.parts(x, 8)
    assert sorted(parts) == list(range(8))
    rows = rng.integers(0, 100, 77)
    for k, part in parts.items():
        alone = _multihost.alone(part)
        assert alone.sharding.memory_kind == memory and alone.devices() == part.devices()
        want = host[100 * k : 100 * (k + 1)][rows]
        _same_bits(_multihost.to_host(alone, rows, chunk_bytes=5 * 12), want)
    empty = jax.device_put(np.zeros((0,), np.int32), NamedSharding(make_mesh(8), P("shard")))
    assert sorted(_multihost.parts(empty, 8)) == list(range(8))


def test_a_piece_costs_its_rows_on_a_device_not_the_table():
    """What one piece compiles to on 8 devices: temporaries of a few times its (4096, 64)
    float32 rows per device, whatever the table's rows, and no all-gather."""
    mesh = make_mesh(8, "auto")
    take = _multihost._take_rows(mesh, "shard", False)
    sizes = []
    for vocab in (1 << 16, 1 << 22):
        sharding = NamedSharding(mesh, P("shard"))
        table = jax.ShapeDtypeStruct((vocab, 64), jnp.float32, sharding=sharding)
        compiled = take.lower(table, jax.ShapeDtypeStruct((4096,), jnp.int32)).compile()
        memory, text = compiled.memory_analysis(), compiled.as_text()
        assert memory is not None and text is not None and "all-gather" not in text
        sizes.append((memory.temp_size_in_bytes, memory.output_size_in_bytes))
    assert sizes[0] == sizes[1]
    assert max(sizes[0]) <= 4 * 4096 * 64 * 4, sizes
