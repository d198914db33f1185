"""Reads and writes of table rows where the rows live: device memory, or host memory.

A table with `placement="host"` keeps its arrays (table and slots, row-sharded as always)
in the pinned memory of the host each device is attached to. JAX refuses a gather whose
operands live in different memory spaces, and XLA compiles host-memory gathers and scatters
only inside `compute_on("device_host")`. So the row work reaches a host table through the
two functions here: `gather` runs one host computation that reads the touched rows of every
array of a table and moves them to the device; `scatter` moves the new rows to the host and
writes them in place (the arrays are donated with the state, so the host table is aliased,
never copied). Everything between the two runs on the device, unchanged: the arithmetic is
the device path's, so a host table's values are bit-identical to a device table's.

Out-of-range indices are the engine's "no row" (gathers fill zeros, scatters drop); on the
host the gather reads a clamped index and the zeros are put back on the device, because
the bounds checks of a filling gather would mix device constants into host code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

HOST = "pinned_host"


def host_memory_supported(device) -> bool:
    """Whether `device` can address pinned host memory (TPU, GPU and CPU devices can)."""
    try:
        return HOST in {m.kind for m in device.addressable_memories()}
    except Exception:  # A platform without memory spaces.
        return False


def gather(on_host: bool, buffers, indices) -> list:
    """[buffers[i] rows at indices[i]], zeros where an index is out of range; on the host,
    one host computation for all of them."""
    if not on_host:
        return [b.at[i].get(mode="fill", fill_value=0) for b, i in zip(buffers, indices)]
    valid = [(i >= 0) & (i < b.shape[0]) for b, i in zip(buffers, indices)]
    clamped = [
        jax.device_put(jnp.clip(i, 0, b.shape[0] - 1), jax.memory.Space.Host)
        for b, i in zip(buffers, indices)
    ]

    @compute_on("device_host")
    @jax.jit
    def fetch(buffers, indices):
        return [b.at[i].get(mode="promise_in_bounds") for b, i in zip(buffers, indices)]

    rows = [jax.device_put(r, jax.memory.Space.Device) for r in fetch(list(buffers), clamped)]
    return [
        jnp.where(v.reshape(v.shape + (1,) * (r.ndim - v.ndim)), r, jnp.zeros((), r.dtype))
        for r, v in zip(rows, valid)
    ]


def write(on_host: bool, fn, buffers, *args):
    """fn(buffers, *args): new buffers from old ones (a write: scatters, slices); on the
    host, one host computation with `args` moved there, in place when the buffers are
    donated."""
    if not on_host:
        return fn(buffers, *args)
    args = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), args)
    return compute_on("device_host")(jax.jit(fn))(buffers, *args)


def scatter(on_host: bool, buffers, indices, values) -> list:
    """[buffers[i] with rows indices[i] set to values[i]]; out-of-range indices write
    nothing. On the host, one host computation for all of them."""

    def store(buffers, indices, values):
        return [b.at[i].set(v, mode="drop") for b, i, v in zip(buffers, indices, values)]

    values = [v.astype(b.dtype) for b, v in zip(buffers, values)]
    return write(on_host, store, list(buffers), list(indices), values)


def update_slice(on_host: bool, buffer, block, at) -> jax.Array:
    """`buffer` with `block` written at offsets `at` (a block of `init`)."""
    return write(
        on_host, lambda b, x, at: jax.lax.dynamic_update_slice(b, x, at), buffer, block, at
    )
