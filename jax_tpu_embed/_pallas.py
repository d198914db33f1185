"""Fused Pallas TPU kernels for the sorted (row, position) pairs of one table shard.

The XLA forms in _xla_backend.py gather and scatter rows with XLA ops, which the TPU compiler
charges a whole (8, 128) tile per row touched (benchmarks/tpu_row_access.py measures it),
and gather each pair's activation gradient the same way. These kernels walk the owned pairs of a
`_streams.Stream`, sorted by row, in blocks of `block` pairs that arrive through SMEM on a
sequential grid, and stop at the owned count:

- `pooled_lookup`: per block, the distinct physical rows it touches are read with their
  DMAs in flight together, then each pair adds scale · row into the partial activations,
  a VMEM scratch written to HBM once at the end.
- `fused_update`: the activation gradients are copied into VMEM once. Per block, the
  distinct physical rows of each array (the table, with the slots that ride in its rows,
  and every other slot) are read (DMAs in flight together); each row's pair gradients are
  summed in VMEM; when the stream moves past a row, the optimizer's per-row function runs
  on the row's lanes; then the block's rows
  are written back in place (the arrays are aliased to the outputs). The row still open
  at the end of a block (its pairs may go on) is carried: its gradient sum stays in VMEM
  and the next block re-reads its physical row after this block's write. Logical rows that
  share a physical row (packed, `_layout.Packing`) share its one VMEM copy, so their
  writes never overwrite each other.

Activations and their gradients are lane-dense: (R/k, k·w) with the packing of D-wide
rows (k rows of width w per 128 lanes; `rows_packing`), not (R, D), which the TPU pads to
128 lanes. A logical row is moved between its lane group and lane 0 (or its output's lane
group) by a lane rotation.

Cost estimates declare the bytes the DMAs and SMEM blocks move for the planned pairs and
distinct rows per shard (`_streams.planned`): that is what `cost_analysis` reports for the
kernels. `interpret=True` runs them in Pallas' interpreter on any backend; the tests check
them against float64 references on CPU meshes that way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _backend, _layout, _plan, _platforms, _storage, _streams
from ._rowindex import NOT_MINE

BLOCK = 1024  # Default pairs per grid step (SMEM block of keys, output rows and scales).
_SMALLEST_VMEM = 16 << 20  # v4's, per TensorCore: the default when the chip is unknown.


def vmem_bytes(device_kind: str) -> int:
    """VMEM per TensorCore of a TPU by its device kind (pltpu.get_tpu_info_for_chip): 16 MiB
    on v4, 64 MiB on v5p, 128 MiB on v5e and v6e; 16 MiB if unknown."""
    chip = _platforms.tpu_generation(device_kind)
    if chip is None:
        return _SMALLEST_VMEM
    return int(pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip), 1).vmem_capacity_bytes)


def _block_bytes(rows: int, lanes: int) -> int:
    return rows * (-(-lanes // 128) * 128) * 4


def fits_vmem(rows: int, lanes: int, vmem: int) -> bool:
    """Whether the kernels' resident (rows, lanes) f32 block (the lane-dense activations
    or their gradients: B/k rows per feature, B·L/k for a sequence feature) takes at most
    half of a VMEM of `vmem` bytes; the rest is for the per-block row buffers. Larger
    batches take the XLA passes."""
    return _block_bytes(rows, lanes) <= vmem // 2


def vmem_rows(lanes: int, vmem: int) -> int:
    """The most rows of a (rows, lanes) f32 block that `fits_vmem`."""
    return vmem // 2 // _block_bytes(1, lanes)


def _params(vmem: int):
    return pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem * 7 // 8)


# Tables, slots and the activation blocks stay in HBM, moved only by the kernels' own DMAs.
_HBM = pl.BlockSpec(memory_space=pltpu.HBM)


def _in_hbm(x):
    """x, pinned to HBM as a pallas_call operand: otherwise the compiler may prefetch a
    whole small table shard into VMEM for the lookup, traffic in proportion to the
    vocabulary."""
    return pltpu.with_memory_space_constraint(x, pltpu.HBM)


def _blocks(pairs: int, block: int) -> int:
    return -(-pairs // block)


def _pair_specs(n: int, block: int):
    """SMEM block specs of the n pair arrays (sorted keys, output rows [, scales]); blocks
    past the owned count repeat the last owned block, which the pipeline then does not
    fetch again."""

    def index(i, count_ref):
        return (jnp.minimum(i, jnp.maximum(count_ref[0] - 1, 0) // block),)

    return [pl.BlockSpec((block,), index, memory_space=pltpu.SMEM) for _ in range(n)]


class _Pairs:
    """The sorted pairs a kernel walks: `keys` with, unless None, `out` (output rows) and
    `scale` (None: 1 for every pair, as for an unweighted sum). With `out_bits` > 0 there
    is no `out` array: each key holds row << out_bits | output row (_streams.build packs
    them when they fit, so that the sort and the kernels move one array, not two)."""

    def __init__(self, keys, out, scale, out_bits: int):
        self.arrays = [a for a in (keys, out, scale) if a is not None]
        self.has_out, self.has_scale, self.bits = out is not None, scale is not None, out_bits
        self.bytes = 4 * len(self.arrays)  # Per pair, read by the kernel.

    def bind(self, refs):
        """Takes this kernel's pair refs off the front of `refs`; returns the rest."""
        n = len(self.arrays)
        self.refs = dict(
            zip(["keys"] + ["out"] * self.has_out + ["scale"] * self.has_scale, refs[:n])
        )
        return refs[n:]

    def key(self, p):
        k = self.refs["keys"][p]
        return lax.shift_right_logical(k, self.bits) if self.bits else k

    def out(self, p):
        if self.bits:
            return self.refs["keys"][p] & ((1 << self.bits) - 1)
        return self.refs["out"][p]

    def scale(self, p):
        return self.refs["scale"][p] if self.has_scale else 1.0


class _BlockRows:
    """The distinct physical rows of one array that one block of pairs touches, in VMEM.

    `gather` lists them (consecutive keys map to non-decreasing physical rows, so a change
    of physical row is a new one) and reads them all with DMAs in flight together; `put`
    writes them all back the same way. Packed logical rows are read and written through
    their lane group (rotated to lane 0 and back). The list (`phys[a]`) and its length
    (`n[a]`) live in SMEM; `a` is the array's index among the kernel's arrays.

    A bfloat16 array (`dtype`) is moved as 32-bit words: the TPU stores 16-bit arrays with
    each pair of rows (2i, 2i + 1) interleaved in one row of 32-bit words (row 2i in the
    low halves), so one of its rows alone is not a DMA that Mosaic can make. The array is
    viewed as uint32 rows (half as many, `_operand`); each DMA moves a row pair into a
    32-bit buffer, and `read` / `write` take or replace one row's halves in registers.
    """

    def __init__(self, hbm, buf, tmp, phys, n, a: int, packing: _layout.Packing, sem, dtype):
        self.sub = 4 // jnp.dtype(dtype).itemsize  # Rows per 32-bit word.
        if jnp.dtype(hbm.dtype).itemsize < 4:  # On TPU: the words of the buffer, in place.
            hbm = hbm.bitcast(jnp.uint32)
        self.hbm, self.buf, self.tmp, self.phys, self.n, self.a = hbm, buf, tmp, phys, n, a
        self.k, self.w, self.width = packing.per_row, packing.padded_width, packing.width
        self.lanes, self.sem = buf.shape[1], sem
        self.per = self.k * self.sub  # Logical rows per buffer row.

    def _copy(self, j, to_hbm: bool):
        hbm, vmem = self.hbm.at[pl.ds(self.phys[self.a, j], 1)], self.buf.at[pl.ds(j, 1)]
        return (
            pltpu.make_async_copy(vmem, hbm, self.sem)
            if to_hbm
            else pltpu.make_async_copy(hbm, vmem, self.sem)
        )

    def gather(self, first, key, count: int | jax.Array):
        """Lists and reads the physical rows of `first` (if >= 0) and of key(p) for the
        block's pairs p < count."""
        self.n[self.a] = 0

        def add(key):
            ph, j = key // self.per, self.n[self.a]

            @pl.when((j == 0) | (ph != self.phys[self.a, jnp.maximum(j - 1, 0)]))
            def _():
                self.phys[self.a, j] = ph
                self._copy(j, False).start()
                self.n[self.a] = j + 1

        @pl.when(first >= 0)
        def _():
            add(first)

        def step(p, carry):
            add(key(p))
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
        return jnp.where((previous >= 0) & (key // self.per != previous // self.per), j + 1, j)

    def lanes_of(self, j, row):
        """Buffer row j as (1, lanes) float32, logical row `row`'s lane group in place (and,
        of a 16-bit array, `row`'s halves of the words)."""
        x = self.buf[pl.ds(j, 1), :]
        if self.sub == 1:
            return x.astype(jnp.float32)
        high = (row // self.k) % 2 == 1
        x = jnp.where(high, x & jnp.uint32(0xFFFF0000), x << 16)
        return lax.bitcast_convert_type(x, jnp.float32)

    def read(self, j, row):
        """Logical row `row`'s lanes in buffer row j: (1, width) float32."""
        x = self.lanes_of(j, row)
        if self.k > 1:
            x = pltpu.roll(x, (self.lanes - (row % self.k) * self.w) % self.lanes, 1)
        return x[:, : self.width]

    def write(self, j, row, value):
        if self.sub == 1:
            value = value.astype(self.buf.dtype)
        else:  # The bfloat16 bits (rounded to nearest unless already bfloat16), low half.
            value = value.astype(jnp.bfloat16).astype(jnp.float32)
            value = lax.bitcast_convert_type(value, jnp.uint32) >> 16
        if self.k == 1:
            if self.sub > 1:
                value = self._merge(row, self.buf[pl.ds(j, 1), : self.width], value)
            self.buf[pl.ds(j, 1), : self.width] = value
            return
        self.tmp[:, : self.width] = value
        shift = (row % self.k) * self.w
        moved = pltpu.roll(self.tmp[...], shift, 1)
        lane = lax.broadcasted_iota(jnp.int32, (1, self.lanes), 1)
        mine = (lane >= shift) & (lane < shift + self.width)
        old = self.buf[pl.ds(j, 1), :]
        if self.sub > 1:
            moved = self._merge(row, old, moved)
        self.buf[pl.ds(j, 1), :] = jnp.where(mine, moved, old)

    def _merge(self, row, old, new):
        """The words `old` with `row`'s halves replaced by the low halves of `new`."""
        high = (row // self.k) % 2 == 1
        return jnp.where(
            high, (old & jnp.uint32(0xFFFF)) | (new << 16), (old & jnp.uint32(0xFFFF0000)) | new
        )


def _buffer_dtype(dtype):
    """VMEM row buffers are 32-bit: a 16-bit array's rows travel in pairs (_BlockRows)."""
    return jnp.uint32 if jnp.dtype(dtype).itemsize < 4 else dtype


def _operand(x, interpret: bool):
    """A table or slot array as a kernel operand, and the inverse for its aliased output.

    A 16-bit array is walked as rows of 32-bit words (_BlockRows). The TPU kernel views its
    HBM buffer so in place (`Ref.bitcast`, no copy; the same view as an XLA op would be a
    relayout copy of the whole array); Pallas' interpreter cannot write through a bitcast
    ref, so it is given the same view (`pltpu.bitcast`) as an array instead.
    """
    if not interpret or jnp.dtype(x.dtype).itemsize == 4:
        return x, lambda y: y
    return pltpu.bitcast(x, jnp.uint32), lambda y: pltpu.bitcast(y, x.dtype)


def _physical_reads(distinct: int, array, keys, block: int) -> int:
    """The physical rows a kernel reads for `distinct` planned rows: each block reads its
    distinct physical rows once, so no more than the array has (rows of 32-bit words: a
    16-bit array's pairs), plus one re-read per block (a row that spans two blocks). Packed
    or dense keys (the rows exchanged by owner routing) reach this bound long before
    `distinct`."""
    itemsize = jnp.dtype(array.dtype).itemsize
    rows = array.shape[0] * itemsize // jnp.dtype(_buffer_dtype(array.dtype)).itemsize
    return min(distinct, rows + _blocks(keys.shape[0], block))


def _row_bytes(packing: _layout.Packing, dtype) -> int:
    """Bytes one DMA moves: a physical row of 32-bit words (a pair of 16-bit rows)."""
    return packing.per_row * packing.padded_width * jnp.dtype(_buffer_dtype(dtype)).itemsize


def pooled_lookup(
    table,
    packing: _layout.Packing,
    keys,
    out,
    scale,
    count,
    rows: int,
    *,
    planned: tuple[int, int],
    vmem: int,
    out_bits: int = 0,
    rows_packing: _layout.Packing | None = None,
    interpret: bool = False,
    block: int = BLOCK,
):
    """out[o] += scale · row(key) over the owned pairs (key, o, scale), lane-dense.

    Returns (rows / k, k·w) f32 for `rows_packing` (k, w; D-wide rows, default `packing`):
    output row o in lanes [(o % k)·w, (o % k)·w + D) of row o // k, zero lanes elsewhere.
    The table's `packing` may hold more than D lanes per logical row (riders, see
    _storage.TableStorage): its first D are the row. `keys` ascending with `count` owned pairs
    first; `out` and `scale` as _Pairs takes them. `planned` = (pairs, distinct rows) per
    shard sizes the cost estimate only.
    """
    rows_packing = rows_packing or packing
    k, w, width = rows_packing.per_row, rows_packing.padded_width, rows_packing.width
    kt, wt = packing.per_row, packing.padded_width
    lanes = k * w
    assert kt * wt == lanes, (packing, rows_packing)
    pairs = _Pairs(keys, out, scale, out_bits)

    def kernel(count_ref, *refs):
        table_hbm, acc_hbm, acc_ref, buf, phys, n, sem = pairs.bind(refs)
        i = pl.program_id(0)

        @pl.when(i == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        here = jnp.clip(count_ref[0] - i * block, 0, block)
        rows_ = _BlockRows(table_hbm, buf, None, phys, n, 0, packing, sem, table.dtype)

        @pl.when(here > 0)
        def _():
            rows_.gather(jnp.int32(-1), pairs.key, here)

            def pair(p, j):
                key = pairs.key(p)
                previous = jnp.where(p > 0, pairs.key(jnp.maximum(p - 1, 0)), -1)
                j = rows_.slot_after(j, previous, key)
                o = pairs.out(p)
                row = rows_.lanes_of(j, key) * pairs.scale(p)
                if k > 1 or kt > 1:  # From key's lane group to o's.
                    row = pltpu.roll(row, (o % k * w - key % kt * wt) % lanes, 1)
                start = o % k * w
                lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
                row = jnp.where((lane >= start) & (lane < start + width), row, 0.0)
                acc_ref[pl.ds(o // k, 1), :] += row
                return j

            lax.fori_loop(0, here, pair, jnp.int32(0))

        @pl.when(i == pl.num_programs(0) - 1)
        def _():
            pltpu.sync_copy(acc_ref, acc_hbm)  # One VMEM copy, not a double-buffered block.

    operand = _operand(table, interpret)[0]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(_blocks(keys.shape[0], block),),
            in_specs=_pair_specs(len(pairs.arrays), block) + [_HBM],
            out_specs=_HBM,
            scratch_shapes=[
                pltpu.VMEM((rows // k, lanes), jnp.float32),
                pltpu.VMEM((block, lanes), _buffer_dtype(table.dtype)),
                pltpu.SMEM((1, block), jnp.int32),
                pltpu.SMEM((1,), jnp.int32),
                pltpu.SemaphoreType.DMA(()),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((rows // k, lanes), jnp.float32),
        compiler_params=_params(vmem),
        cost_estimate=pl.CostEstimate(
            flops=2 * planned[0] * width,
            transcendentals=0,
            bytes_accessed=(
                _physical_reads(planned[1], table, keys, block) * _row_bytes(packing, table.dtype)
                + pairs.bytes * planned[0]
                + rows // k * lanes * 4
            ),
        ),
        interpret=interpret,
    )(
        jnp.reshape(count, (1,)).astype(jnp.int32),
        *pairs.arrays,
        operand if interpret else _in_hbm(operand),
    )


def fused_update(
    arrays: list,
    packings: list,
    keys,
    out,
    scale,
    count,
    grads,
    scalars,
    row_fn,
    *,
    planned: tuple[int, int],
    vmem: int,
    out_bits: int = 0,
    rows_packing: _layout.Packing | None = None,
    rounding: tuple | None = None,
    interpret: bool = False,
    block: int = BLOCK,
):
    """Sums each row's gradient and applies `row_fn` to it in place; returns new arrays.

    Args:
        arrays: The table's physical shard and its slots' (donated/aliased).
        packings: Their `_layout.Packing`s.
        keys, out, scale: The sorted pairs: (P,) local row, output row, combiner scale
            (as _Pairs takes them, with `out_bits`).
        count: () owned pairs (first in `keys`).
        grads: (R / k, k·w) f32 activation gradients, lane-dense as pooled_lookup's output
            (k, w of `rows_packing`, by default packings[0]).
        scalars: (n,) f32 values `row_fn` reads (learning rate, hyperparameters, ...).
        row_fn: fn(g (D,), [one value per array: (width,) or ()], scalars) -> new values,
            for one row (vmapped over a leading axis of one inside the kernel).
        planned: (pairs, distinct rows) per shard and step: sizes the cost estimate only.
        block: Pairs per grid step.
        rounding: None, or (layout, (2,) int32 [step key, shard]): the table (arrays[0], a
            bfloat16 one without riders) is rounded stochastically with the bits of
            (step key, global row, lane), as `_xla_backend.stochastic_rows` does.
    """
    n = len(arrays)
    rows_packing = rows_packing or packings[0]
    gk, gw, dim = rows_packing.per_row, rows_packing.padded_width, rows_packing.width
    glanes = gk * gw
    lanes = [p.per_row * p.padded_width for p in packings]
    pairs = _Pairs(keys, out, scale, out_bits)

    def kernel(count_ref, *refs):
        scalars_ref, grads_hbm, *refs = pairs.bind(refs)
        round_ref = None
        if rounding is not None:
            round_ref, *refs = refs
        hbm = refs[n : 2 * n]  # The aliased outputs; refs[:n] are the same buffers.
        bufs, tmps = refs[2 * n : 3 * n], refs[3 * n : 4 * n]
        grads_ref, gacc, phys, counts, state, sem = refs[4 * n :]
        arrays_ = [
            _BlockRows(h, b, t, phys, counts, a, p, sem, x.dtype)
            for a, (h, b, t, p, x) in enumerate(zip(hbm, bufs, tmps, packings, arrays))
        ]
        i = pl.program_id(0)
        count = count_ref[0]
        here = jnp.clip(count - i * block, 0, block)

        @pl.when(i == 0)
        def _():
            state[0] = -1  # The row whose gradient gacc sums, carried across blocks.
            gacc[...] = jnp.zeros_like(gacc)
            pltpu.sync_copy(grads_hbm, grads_ref)  # One VMEM copy, not double-buffered.

        def finish(row, slots):
            values = [r.read(j, row) for r, j in zip(arrays_, slots)]
            values = [v if p.rank == 2 else v.reshape(1) for v, p in zip(values, packings)]
            s = [scalars_ref[j] for j in range(scalars.shape[0])]
            new = jax.vmap(lambda g, vals: row_fn(g, vals, s))(gacc[...], values)
            if round_ref is not None:
                assert rounding is not None
                key = lax.bitcast_convert_type(round_ref[0], jnp.uint32)
                ids = rounding[0].global_ids(round_ref[1], row)
                bits = _storage.random_bits(key, jnp.reshape(ids, (1,)), new[0].shape[1])
                new[0] = _storage.round_stochastically(new[0], bits)
            for r, j, v, p in zip(arrays_, slots, new, packings):
                r.write(j, row, v if p.rank == 2 else v.reshape(1, 1))

        @pl.when(here > 0)
        def _():
            carried = state[0]
            for r in arrays_:
                r.gather(carried, pairs.key, here)

            def pair(p, carry):
                current, *slots = carry
                key = pairs.key(p)
                moved = key != current

                @pl.when(moved & (current >= 0))
                def _():
                    finish(current, slots)

                @pl.when(moved)
                def _():
                    gacc[...] = jnp.zeros_like(gacc)

                slots = [r.slot_after(j, current, key) for r, j in zip(arrays_, slots)]
                o = pairs.out(p)
                g = grads_ref[pl.ds(o // gk, 1), :]
                if gk > 1:
                    g = pltpu.roll(g, (glanes - o % gk * gw) % glanes, 1)
                gacc[...] += pairs.scale(p) * g[:, :dim]
                return (key, *slots)

            last, *slots = lax.fori_loop(0, here, pair, (carried,) + (jnp.int32(0),) * n)

            # The block with the last owned pair finishes its last row; otherwise the row
            # is carried (its pairs may go on), re-read by the next block after the write.
            ends = i * block + here == count

            @pl.when(ends)
            def _():
                finish(last, slots)

            state[0] = jnp.where(ends, -1, last)

            for r in arrays_:
                r.put()

    row_bytes = sum(_row_bytes(p, a.dtype) for p, a in zip(packings, arrays))
    operands, restore = zip(*(_operand(a, interpret) for a in arrays))
    new = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(_blocks(keys.shape[0], block),),
            in_specs=_pair_specs(len(pairs.arrays), block)
            + [
                pl.BlockSpec(memory_space=pltpu.SMEM),
                _HBM,
            ]
            + [pl.BlockSpec(memory_space=pltpu.SMEM)] * (rounding is not None)
            + [_HBM] * n,
            out_specs=[_HBM] * n,
            scratch_shapes=(
                [pltpu.VMEM((block + 1, l), _buffer_dtype(a.dtype)) for l, a in zip(lanes, arrays)]
                + [pltpu.VMEM((1, l), _buffer_dtype(a.dtype)) for l, a in zip(lanes, arrays)]
                + [
                    pltpu.VMEM(grads.shape, jnp.float32),
                    pltpu.VMEM((1, dim), jnp.float32),
                    pltpu.SMEM((n, block + 1), jnp.int32),
                    pltpu.SMEM((n,), jnp.int32),
                    pltpu.SMEM((1,), jnp.int32),
                    pltpu.SemaphoreType.DMA(()),
                ]
            ),
        ),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands],
        # Operand indices count the scalar-prefetch operand, the pair arrays, the scalars
        # and the gradients: the arrays follow them.
        input_output_aliases={
            len(pairs.arrays) + 3 + (rounding is not None) + a: a for a in range(n)
        },
        compiler_params=_params(vmem),
        cost_estimate=pl.CostEstimate(
            flops=4 * planned[0] * dim,
            transcendentals=planned[1] * dim,
            bytes_accessed=(
                2 * _physical_reads(planned[1], arrays[0], keys, block) * row_bytes
                + pairs.bytes * planned[0]
                + grads.size * 4
            ),
        ),
        interpret=interpret,
    )(
        jnp.reshape(count, (1,)).astype(jnp.int32),
        *pairs.arrays,
        scalars,
        grads,
        *([] if rounding is None else [rounding[1]]),
        *operands,
    )
    return [r(x) for r, x in zip(restore, new)]


def rounding(plan: _plan.TablePlan, step: _backend.RowStep, axis: str):
    """fused_update's `rounding` for this table and step: None unless it rounds
    stochastically."""
    if not plan.config.stochastic_rounding:
        return None
    assert step.step is not None
    key = _storage.step_key(_storage.table_seed(plan.name), step.step)
    shard = lax.axis_index(axis).astype(jnp.int32)
    return (plan.layout, jnp.stack([lax.bitcast_convert_type(key, jnp.int32), shard]))


@dataclasses.dataclass(frozen=True)
class PallasBackend(_backend.Backend):
    """The fused kernels above for float32 and bfloat16 tables with a sparse optimizer.

    Attributes:
        interpret: Run them in Pallas' interpreter (any mesh; slow; for tests).
        block: Pairs per grid step.
        vmem: VMEM bytes per TensorCore to size against; None: the mesh's chips'.
        pack_keys: Pack (row, output row) into one sort key where both fit.

    A call whose resident block does not fit half of VMEM (`fits_vmem`) falls back to XLA
    ops (its `_plan.CallPlan` says so).
    """

    interpret: bool = False
    block: int = BLOCK
    vmem: int | None = None
    pack_keys: bool = True
    lane_width = 128
    one_pass = True

    def __post_init__(self):
        for field in ("interpret", "pack_keys"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"backends.Pallas: {field} must be a bool, got {getattr(self, field)!r}."
                )
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"backends.Pallas: block must be a positive int, got {self.block!r}.")
        if self.vmem is not None and (
            isinstance(self.vmem, bool) or not isinstance(self.vmem, int) or self.vmem < 1
        ):
            raise ValueError(
                f"backends.Pallas: vmem must be None or a positive int of bytes, got {self.vmem!r}."
            )

    @property
    def name(self) -> str:  # type: ignore[override]
        return "pallas_interpret" if self.interpret else "pallas"

    def unusable(self, table, optimizer, storage, platform):
        if storage.on_host:  # Host rows are reached by XLA ops in host computations.
            return (
                "placement='host': its rows are in host memory, which the Pallas kernels "
                "do not address (the 'xla' backend serves it)"
            )
        if optimizer.dense_update:
            return (
                f"{type(optimizer).__name__}(lazy_adam=False) updates every row; the "
                f"Pallas kernels update the rows in the batch"
            )
        if not self.interpret and platform != "tpu":
            return (
                f"it needs a TPU mesh and this one is on {platform!r} (backend="
                f"'pallas_interpret' runs the kernels in Pallas' interpreter anywhere)"
            )
        return None

    def vmem_bytes(self, device_kind):
        return self.vmem if self.vmem is not None else vmem_bytes(device_kind)

    def lane_rows(self, plan):
        return plan.storage.rows_packing.per_row

    def _lanes(self, plan) -> int:
        packing = plan.storage.rows_packing
        return packing.per_row * packing.padded_width

    def holds(self, plan, rows):
        return fits_vmem(rows, self._lanes(plan), plan.vmem)

    def most_rows(self, plan):
        return vmem_rows(self._lanes(plan), plan.vmem)

    def routed(self, call, pairs, received):
        return PallasRouted(call.plan, pairs, received, self)

    def lookup(self, call, table, inputs, axis):
        plan = call.plan
        storage = plan.storage
        stream = _streams.build(call, inputs, axis, fused=True, pack_keys=self.pack_keys)
        stream = stream.sorted()
        acc = pooled_lookup(
            table,
            storage.packing,
            stream.keys,
            stream.out,
            stream.scale,
            stream.count,
            stream.rows,
            planned=_streams.planned(plan, stream.pairs, lax.axis_size(axis)),
            vmem=plan.vmem,
            out_bits=stream.out_bits,
            rows_packing=storage.rows_packing,
            interpret=self.interpret,
            block=self.block,
        )
        return _streams.scatter_parts(acc, stream, axis, storage.rows_packing)

    def update(self, call, table, slots, inputs, grads, step, axis):
        plan = call.plan
        storage = plan.storage
        stream = _streams.build(call, inputs, axis, fused=True, pack_keys=self.pack_keys)
        n = lax.axis_size(axis)
        # Each device's activation gradients lane-dense (its rows padded to r, see
        # _streams.build), then all-gathered.
        grad_rows = jnp.concatenate(
            [
                lax.all_gather(
                    _streams.packed(
                        jnp.pad(grads[f.path].reshape(local, -1), [(0, rows // n - local), (0, 0)]),
                        storage.rows_packing,
                    ),
                    axis,
                    tiled=True,
                ).astype(jnp.float32)
                for f, _, rows, local in stream.parts
            ]
        )
        stream = stream.sorted()
        names = [s.name for s in storage.stored]
        new = fused_update(
            [table] + [slots[s] for s in names],
            storage.packings,
            stream.keys,
            stream.out,
            stream.scale,
            # A skipped table: the kernel walks no pair.
            stream.count if step.ok is None else jnp.where(step.ok, stream.count, 0),
            grad_rows,
            step.scalars,
            storage.stored_row_fn(step.row_fn),
            planned=_streams.planned(plan, stream.pairs, n),
            vmem=plan.vmem,
            out_bits=stream.out_bits,
            rows_packing=storage.rows_packing,
            rounding=rounding(plan, step, axis),
            interpret=self.interpret,
            block=self.block,
        )
        return new[0], dict(zip(names, new[1:]))


class PallasRouted(_backend.RoutedRows):
    """The row work of owner routing in the kernels above, rows lane-dense (k to a
    128-lane row): the owner's reads and updates walk the received rows sorted, and each
    device combines the rows it gets back (or spreads its gradients over the rows it
    sends) with the pooled lookup kernel, whose cost is its pairs, not a tile per row as
    XLA's gathers and scatters."""

    def __init__(self, plan: _plan.TablePlan, pairs: int, received: int, kernel: PallasBackend):
        self.plan, self.packing = plan, plan.storage.rows_packing
        self.k = self.packing.per_row
        # The kernels' cost estimates: a round brings at most N·Cd rows to an owner, on
        # average as many as each device sends; max_unique_ids_per_shard bounds the
        # distinct ones.
        planned = min(pairs, received)
        self.planned = (planned, min(planned, plan.max_unique or planned))
        self.interpret, self.block = kernel.interpret, kernel.block

    def _lookup(self, table, packing, keys, out, scale, count, rows: int):
        return pooled_lookup(
            table,
            packing,
            keys,
            out,
            scale,
            count,
            rows,
            planned=self.planned,
            vmem=self.plan.vmem,
            rows_packing=self.packing,
            interpret=self.interpret,
            block=self.block,
        )

    def owner_rows(self, table, rows):
        keys, slot, count = _arrivals(rows)
        storage = self.plan.storage
        return self._lookup(table, storage.packing, keys, slot, None, count, rows.shape[0])

    def combine(self, local, r, back, acc):
        keys, out, scale = lax.sort(
            (jnp.where(r.pair_in_round, r.pair_slot, NOT_MINE), local.out, local.scale),
            num_keys=3,
            is_stable=False,
        )
        count = jnp.sum(r.pair_in_round, dtype=jnp.int32)
        return acc + self._lookup(back, self.packing, keys, out, scale, count, local.rows)

    def zeros(self, rows: int):
        return jnp.zeros((rows // self.k, self.k * self.packing.padded_width), jnp.float32)

    def unpack(self, acc, rows: int):
        return _streams.unpacked(acc, self.packing, rows)

    def gradients(self, local, grad_rows):
        return _streams.packed(grad_rows, self.packing)

    def send(self, local, r, g):
        keys, slot, scale = lax.sort(
            (jnp.where(r.pair_in_round, local.out, NOT_MINE), r.pair_slot, local.scale),
            num_keys=3,
            is_stable=False,
        )
        count = jnp.sum(r.pair_in_round, dtype=jnp.int32)
        n = r.valid.shape[0]
        return self._lookup(g, self.packing, keys, slot, scale, count, n)

    def owner_update(self, table, slots, rows, grads, step, axis):
        keys, slot, count = _arrivals(rows)
        if step.ok is not None:  # A skipped table: the kernel walks no pair.
            count = jnp.where(step.ok, count, 0)
        storage = self.plan.storage
        names = [s.name for s in storage.stored]
        new = fused_update(
            [table] + [slots[s] for s in names],
            storage.packings,
            keys,
            slot,
            None,
            count,
            grads,
            step.scalars,
            storage.stored_row_fn(step.row_fn),
            planned=self.planned,
            vmem=self.plan.vmem,
            rows_packing=self.packing,
            interpret=self.interpret,
            rounding=rounding(self.plan, step, axis),
            block=self.block,
        )
        return new[0], dict(zip(names, new[1:]))


def _arrivals(rows):
    """The rows an owner received, sorted, each with its arrival slot, and how many are
    real (NOT_MINE: an empty slot): the kernels' pairs."""
    keys, slot = lax.sort((rows, lax.iota(jnp.int32, rows.shape[0])), num_keys=2, is_stable=False)
    return keys, slot, jnp.sum(keys < NOT_MINE, dtype=jnp.int32)
