"""Fused Pallas TPU kernels for the sorted (row, position) stream of one table shard.

The XLA forms in _sparse.py gather and scatter rows with XLA ops, which the TPU compiler
charges a whole (8, 128) tile per row touched, and gather each pair's activation gradient
the same way (tpu_row_access.py). These kernels walk the pairs of a `_Stream`, sorted by
row, one at a time instead, and move each touched physical row between HBM and VMEM with
one DMA each way:

- `pooled_lookup`: out[o] += scale · row for every owned pair (row, o, scale); a physical
  row is read once for all the consecutive pairs that share it.
- `fused_update`: the gradients of a row's pairs are summed in VMEM (the activation
  gradients are VMEM-resident), then the row's table and slot lanes are read, the
  optimizer's per-row function runs on them and they are written back: each touched
  physical row of each array is read once and written once. Rows outside the batch are
  never touched; the buffers are updated in place (aliased).

Packed arrays (`_layout.Packing`: k logical rows of width w per 128-lane physical row) keep
one physical row per array "open" in VMEM; a logical row's lanes are rotated to lane 0 to
be read and back to be written, and the open row is written back when the stream moves
past it, so logical rows sharing a physical row never overwrite each other.

The pairs come in blocks of `_BLOCK` through SMEM (a sequential grid); the kernel stops at
the owned count. Cost estimates declare the bytes the DMAs and blocks move for the
planned capacity (C pairs, Cu distinct rows), as XLA's cost analysis counts one pass of a
while loop: that is what `cost_analysis` then reports for them.

`interpret=True` runs the same kernels in Pallas' TPU interpreter (any backend): the tests
check them against the XLA forms and float64 references on the CPU.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _layout

_BLOCK = 1024  # Pairs per grid step (SMEM block of keys, output rows and scales).


# VMEM the resident (rows, lanes) f32 block (activations out, or activation gradients in) may
# take, double-buffered: 12 MiB of the 16 MiB default scoped VMEM of v4 and v5e. Larger
# global batches (rows = B, or B·L for sequence features) take the XLA form.
_VMEM_BUDGET = 12 << 20


def fits_vmem(rows: int, lanes: int) -> bool:
    """Whether a (rows, lanes) f32 block, lanes padded to 128, fits the kernels' budget."""
    return 2 * rows * (-(-lanes // 128) * 128) * 4 <= _VMEM_BUDGET


def _blocks(pairs: int) -> int:
    return -(-pairs // _BLOCK)


def _pair_specs():
    """SMEM block specs of the sorted keys, output rows and scales; blocks past the owned
    count repeat the last owned block, which the pipeline then does not fetch again."""
    def index(i, count_ref):
        return (jnp.minimum(i, jnp.maximum(count_ref[0] - 1, 0) // _BLOCK),)
    return [pl.BlockSpec((_BLOCK,), index, memory_space=pltpu.SMEM) for _ in range(3)]


class _Rows:
    """The distinct physical rows of one array that one block of pairs touches, in VMEM.

    `gather` lists them (consecutive keys map to non-decreasing physical rows, so a change
    of physical row is a new one) and reads them all with DMAs in flight together; `put`
    writes them all back the same way. Packed logical rows are read and written through
    their lane group (rotated to lane 0 and back). `n` and `at` live in SMEM.
    """

    def __init__(self, hbm, buf, tmp, phys, n, a: int, packing: _layout.Packing, sem):
        self.hbm, self.buf, self.tmp, self.phys, self.n, self.a = hbm, buf, tmp, phys, n, a
        self.k, self.w, self.width = packing.per_row, packing.padded_width, packing.width
        self.lanes, self.sem = buf.shape[1], sem

    def _copy(self, j, to_hbm: bool):
        hbm, vmem = self.hbm.at[pl.ds(self.phys[self.a, j], 1)], self.buf.at[pl.ds(j, 1)]
        return pltpu.make_async_copy(vmem, hbm, self.sem) if to_hbm else \
            pltpu.make_async_copy(hbm, vmem, self.sem)

    def gather(self, first, keys_ref, count: int | jax.Array):
        """Lists and reads the physical rows of `first` (if >= 0) and keys_ref[:count]."""
        self.n[self.a] = 0

        def add(key):
            ph, j = key // self.k, self.n[self.a]

            @pl.when((j == 0) | (ph != self.phys[self.a, jnp.maximum(j - 1, 0)]))
            def _():
                self.phys[self.a, j] = ph
                self._copy(j, False).start()
                self.n[self.a] = j + 1

        @pl.when(first >= 0)
        def _():
            add(first)

        def step(p, carry):
            add(keys_ref[p])
            return carry

        lax.fori_loop(0, count, step, 0)
        self._wait_all(False)

    def put(self):
        def step(j, carry):
            self._copy(j, True).start()
            return carry

        lax.fori_loop(0, self.n[self.a], step, 0)
        self._wait_all(True)

    def _wait_all(self, to_hbm: bool):
        def step(j, carry):
            self._copy(j, to_hbm).wait()
            return carry

        lax.fori_loop(0, self.n[self.a], step, 0)

    def slot_after(self, j, previous, key):
        """Buffer index of `key`'s physical row, given `previous` key's was j."""
        return jnp.where((previous >= 0) & (key // self.k != previous // self.k), j + 1, j)

    def read(self, j, row):
        """Logical row `row`'s lanes in buffer row j: (1, width) in the array's dtype."""
        x = self.buf[pl.ds(j, 1), :]
        if self.k > 1:
            x = pltpu.roll(x, (self.lanes - (row % self.k) * self.w) % self.lanes, 1)
        return x[:, :self.width]

    def write(self, j, row, value):
        value = value.astype(self.buf.dtype)
        if self.k == 1:
            self.buf[pl.ds(j, 1), :self.width] = value
            return
        self.tmp[:, :self.width] = value
        shift = (row % self.k) * self.w
        moved = pltpu.roll(self.tmp[...], shift, 1)
        lane = lax.broadcasted_iota(jnp.int32, (1, self.lanes), 1)
        mine = (lane >= shift) & (lane < shift + self.width)
        self.buf[pl.ds(j, 1), :] = jnp.where(mine, moved, self.buf[pl.ds(j, 1), :])


def _row_bytes(packing: _layout.Packing, dtype) -> int:
    return packing.per_row * packing.padded_width * jnp.dtype(dtype).itemsize


def pooled_lookup(table, packing: _layout.Packing, keys, out, scale, count, rows: int,
                  *, planned: tuple[int, int], interpret: bool = False):
    """out[o] += scale · row(key) over the owned pairs (key, o, scale), lane-dense.

    Returns (rows / k, k·w) f32: output row o in lanes [(o % k)·w, (o % k)·w + D) of row
    o // k, for the table's packing (k, w); zero lanes elsewhere. `keys` ascending with
    `count` owned pairs first. `planned` = (pairs, distinct rows) per shard sizes the cost
    estimate only.
    """
    k, w, width = packing.per_row, packing.padded_width, packing.width
    lanes = k * w

    def kernel(count_ref, keys_ref, out_ref, scale_ref, table_hbm, acc_ref, buf, phys, n,
               sem):
        i = pl.program_id(0)

        @pl.when(i == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        here = jnp.clip(count_ref[0] - i * _BLOCK, 0, _BLOCK)
        rows_ = _Rows(table_hbm, buf, None, phys, n, 0, packing, sem)

        @pl.when(here > 0)
        def _():
            rows_.gather(jnp.int32(-1), keys_ref, here)

            def pair(p, j):
                key = keys_ref[p]
                previous = jnp.where(p > 0, keys_ref[jnp.maximum(p - 1, 0)], -1)
                j = rows_.slot_after(j, previous, key)
                o = out_ref[p]
                row = buf[pl.ds(j, 1), :].astype(jnp.float32) * scale_ref[p]
                if k > 1:  # From key's lane group to o's.
                    row = pltpu.roll(row, (o % k - key % k) * w % lanes, 1)
                start = o % k * w
                lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
                row = jnp.where((lane >= start) & (lane < start + width), row, 0.0)
                acc_ref[pl.ds(o // k, 1), :] += row
                return j

            lax.fori_loop(0, here, pair, jnp.int32(0))

    itemsize = jnp.dtype(table.dtype).itemsize
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(_blocks(keys.shape[0]),),
            in_specs=_pair_specs() + [pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((rows // k, lanes), lambda i, c: (0, 0)),
            scratch_shapes=[pltpu.VMEM((_BLOCK, lanes), table.dtype),
                            pltpu.SMEM((1, _BLOCK), jnp.int32), pltpu.SMEM((1,), jnp.int32),
                            pltpu.SemaphoreType.DMA(())]),
        out_shape=jax.ShapeDtypeStruct((rows // k, lanes), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(
            flops=2 * planned[0] * width, transcendentals=0,
            bytes_accessed=(planned[1] * lanes * itemsize + 12 * planned[0] +
                            rows // k * lanes * 4)),
        interpret=interpret,
    )(jnp.reshape(count, (1,)).astype(jnp.int32), keys, out, scale, table)


def fused_update(arrays: list, packings: list, keys, out, scale, count, grads, scalars,
                 row_fn, *, planned: tuple[int, int], interpret: bool = False):
    """Sums each row's gradient and applies `row_fn` to it in place; returns new arrays.

    Args:
        arrays: The table's physical shard and its slots' (donated/aliased).
        packings: Their `_layout.Packing`s.
        keys, out, scale: The sorted pairs: (P,) local row, output row, combiner scale.
        count: () owned pairs (first in `keys`).
        grads: (R / k, k·w) f32 activation gradients, lane-dense as pooled_lookup's output
            (k, w of the table's packing, packings[0]).
        scalars: (n,) f32 values `row_fn` reads (learning rate, hyperparameters, ...).
        row_fn: fn(g (D,), [row (D,), *slots ((D,) or ())], scalars) -> new values, for one
            row (vmapped over a leading axis of one inside the kernel).
        planned: (pairs, distinct rows) per shard and step: sizes the cost estimate only.
    """
    n = len(arrays)
    gk, gw, dim = packings[0].per_row, packings[0].padded_width, packings[0].width
    glanes = gk * gw
    lanes = [p.per_row * p.padded_width for p in packings]

    def kernel(count_ref, keys_ref, out_ref, scale_ref, scalars_ref, grads_ref, *refs):
        hbm = refs[n:2 * n]  # The aliased outputs; refs[:n] are the same buffers.
        bufs, tmps = refs[2 * n:3 * n], refs[3 * n:4 * n]
        gacc, phys, counts, state, sem = refs[4 * n:]
        arrays_ = [_Rows(h, b, t, phys, counts, a, p, sem)
                   for a, (h, b, t, p) in enumerate(zip(hbm, bufs, tmps, packings))]
        i = pl.program_id(0)
        count = count_ref[0]
        here = jnp.clip(count - i * _BLOCK, 0, _BLOCK)

        @pl.when(i == 0)
        def _():
            state[0] = -1  # The row whose gradient gacc sums, carried across blocks.
            gacc[...] = jnp.zeros_like(gacc)

        def finish(row, slots):
            values = [r.read(j, row).astype(jnp.float32) for r, j in zip(arrays_, slots)]
            values = [v if p.rank == 2 else v.reshape(1) for v, p in zip(values, packings)]
            s = [scalars_ref[j] for j in range(scalars.shape[0])]
            new = jax.vmap(lambda g, vals: row_fn(g, vals, s))(gacc[...], values)
            for r, j, v, p in zip(arrays_, slots, new, packings):
                r.write(j, row, v if p.rank == 2 else v.reshape(1, 1))

        @pl.when(here > 0)
        def _():
            carried = state[0]
            for r in arrays_:
                r.gather(carried, keys_ref, here)

            def pair(p, carry):
                current, *slots = carry
                key = keys_ref[p]
                moved = key != current

                @pl.when(moved & (current >= 0))
                def _():
                    finish(current, slots)

                @pl.when(moved)
                def _():
                    gacc[...] = jnp.zeros_like(gacc)

                slots = [r.slot_after(j, current, key) for r, j in zip(arrays_, slots)]
                o = out_ref[p]
                g = grads_ref[pl.ds(o // gk, 1), :]
                if gk > 1:
                    g = pltpu.roll(g, (glanes - o % gk * gw) % glanes, 1)
                gacc[...] += scale_ref[p] * g[:, :dim]
                return (key, *slots)

            last, *slots = lax.fori_loop(0, here, pair, (carried,) + (jnp.int32(0),) * n)

            # The block with the last owned pair finishes its last row; otherwise the row
            # is carried (its pairs may go on), re-read by the next block after the write.
            ends = i * _BLOCK + here == count

            @pl.when(ends)
            def _():
                finish(last, slots)

            state[0] = jnp.where(ends, -1, last)

            for r in arrays_:
                r.put()

    row_bytes = sum(_row_bytes(p, a.dtype) for p, a in zip(packings, arrays))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(_blocks(keys.shape[0]),),
            in_specs=_pair_specs() + [
                pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(grads.shape, lambda i, c: (0, 0)),
            ] + [pl.BlockSpec(memory_space=pl.ANY)] * n,
            out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * n,
            scratch_shapes=(
                [pltpu.VMEM((_BLOCK + 1, l), a.dtype) for l, a in zip(lanes, arrays)] +
                [pltpu.VMEM((1, l), a.dtype) for l, a in zip(lanes, arrays)] +
                [pltpu.VMEM((1, dim), jnp.float32), pltpu.SMEM((n, _BLOCK + 1), jnp.int32),
                 pltpu.SMEM((n,), jnp.int32), pltpu.SMEM((1,), jnp.int32),
                 pltpu.SemaphoreType.DMA(())])),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        # Operand indices count the scalar-prefetch operand: arrays start at 6.
        input_output_aliases={6 + a: a for a in range(n)},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(
            flops=4 * planned[0] * dim, transcendentals=planned[1] * dim,
            bytes_accessed=(2 * planned[1] * row_bytes + 12 * planned[0] +
                            grads.size * 4)),
        interpret=interpret,
    )(jnp.reshape(count, (1,)).astype(jnp.int32), keys, out, scale, scalars, grads, *arrays)
