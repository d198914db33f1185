"""The portable backend: XLA passes over a table's sorted owned pairs, on any mesh.

Per device and table, with C = `_streams.capacity` owned pairs per pass and Cu =
`_streams.unique_capacity` distinct rows:

- lookup: per pass, gather C rows and sum them into the (B, D) partial activations, which
  are reduce-scattered over the batch.
- update: all-gather the activation gradients; per pass form the C pairs' gradients, sum
  them per row, read the pass's distinct rows and their slots, apply the optimizer's row
  function (vmapped) and write them back in place. A row whose pairs straddle two passes is
  held back and its partial sum carried, so every row gets exactly one update; a shard that
  owns more than one pass holds runs more passes and nothing is dropped.

Off TPU, when one pass takes every pair, the update sums duplicates with a key-only sort and
a binary search instead (`sum_duplicates`): XLA:CPU sorts with payloads several times slower.
Packed rows (`_layout.Packing`) are read and written through `_Rows`.

Under owner routing (`_routing`) the same row reads and `apply_rows` serve the rows routed
to each owner (`XlaRouted`): rows travel (n, D), and the owner sums the gradients of a row
received from several devices (`owner_sum`) before updating it once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from . import _backend, _layout, _placement, _plan, _storage, _streams
from ._rowindex import NONE, NOT_MINE


@dataclasses.dataclass(frozen=True)
class XlaBackend(_backend.Backend):
    """XLA ops: any table, any mesh, either exchange."""

    name = "xla"

    def unusable(self, table, optimizer, storage, platform):
        return None  # Any table, any mesh.

    def routed(self, call, pairs, received):
        return XlaRouted(call.plan)

    def lookup(self, call, table, inputs, axis):
        plan = call.plan
        stream = _streams.build(call, inputs, axis, fused=False)
        packing = plan.storage.packing
        k, w = packing.per_row, packing.padded_width
        rows = stream.rows
        # One pass needs no order; several take the owned pairs first.
        single = stream.capacity >= stream.pairs
        stream = stream if single else stream.sorted()

        def one_pass(start, acc):
            keys, out, scale = stream.window(start)
            (phys,) = _placement.gather(plan.storage.on_host, [table], [keys // k])
            contrib = phys.astype(jnp.float32) * scale[:, None]
            if k > 1:
                # where() after the product: a neighbour's inf or nan never leaks in.
                contrib = jnp.where(packing.own_lanes(keys), contrib, 0.0)
            return stream.capacity, acc.at[out].add(contrib)

        acc = stream.passes(one_pass, jnp.zeros((rows, k * w), jnp.float32), single=single)
        acc = packing.fold(acc)  # Each position filled only its own lane group.
        acc = acc[:, : plan.config.dim]  # The row's lanes, not its riders'.
        return _streams.scatter_parts(acc, stream, axis)

    def update(self, call, table, slots, inputs, grads, step, axis):
        plan = call.plan
        stream = _streams.build(call, inputs, axis, fused=False)
        c = stream.capacity
        grad_rows = jnp.concatenate(
            [
                lax.all_gather(grads[f.path], axis, tiled=True)
                .astype(jnp.float32)
                .reshape(rows, -1)
                for f, _, rows, _ in stream.parts
            ]
        )
        if not plan.on_tpu and c >= stream.pairs:
            # One pass, off TPU: a key-only sort and a binary search beat XLA:CPU's payload
            # sort; on TPU they would be 1-D gathers and scatters.
            keys, out, scale = stream.window(0)
            rows, g_sum = sum_duplicates(keys, scale[:, None] * grad_rows[out])
            return apply_rows(plan, table, slots, rows, g_sum, step, axis)
        stream = stream.sorted()
        cu = call.unique
        slot_iota = lax.iota(jnp.int32, cu)

        def one_pass(start, carry):
            table, table_slots, held = carry
            keys, out, scale = stream.window(start)
            starts = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
            segment = jnp.cumsum(starts, dtype=jnp.int32) - 1
            # This pass takes the owned pairs of its first Cu distinct rows.
            take = (keys < NOT_MINE) & (segment < cu)
            consumed = jnp.sum(take, dtype=jnp.int32)
            g = jnp.where(take[:, None], scale[:, None] * grad_rows[out], 0.0)
            g_sum = jax.ops.segment_sum(
                g, jnp.where(take, segment, cu), num_segments=cu, indices_are_sorted=True
            )
            g_sum = g_sum.at[0].add(held)  # The row the previous pass held, if any.
            # Segment s's row: the s-th distinct key (a sort, not a 1-D scatter).
            rows = lax.sort(jnp.where(starts & take, keys, NOT_MINE), is_stable=False)[:cu]
            # Only a pass cut by C can end inside a row: hold that row back and carry its sum.
            nxt = stream.key_at(start + c)
            runs_on = (consumed == c) & (nxt < NOT_MINE) & (nxt == keys[c - 1])
            last = jnp.minimum(segment[c - 1], cu - 1)
            held = jnp.where(runs_on, g_sum[last], 0.0)
            rows = jnp.where(runs_on & (slot_iota == last), NOT_MINE, rows)
            # Unused segments get distinct out-of-range rows that gathers fill and scatters
            # drop.
            rows = jnp.where(rows < NOT_MINE, rows, NOT_MINE + slot_iota)
            table, table_slots = apply_rows(plan, table, table_slots, rows, g_sum, step, axis)
            return consumed, (table, table_slots, held)

        held = jnp.zeros((grad_rows.shape[1],), jnp.float32)
        table, slots, _ = stream.passes(
            one_pass, (table, slots, held), single=c >= stream.pairs and cu >= c
        )
        return table, slots


def sum_duplicates(keys, g):
    """Sums the gradients of equal keys.

    Args:
        keys: (M,) local row per position, NOT_MINE for positions this shard does not own.
        g: (M, D) gradient per position.

    Returns:
        rows (M,) ascending distinct local rows, padded with distinct ascending indices
        >= NOT_MINE that gathers fill and scatters drop; and their summed gradients (M, D).
    """
    m = keys.shape[0]
    # A key-only sort plus a vectorised binary search for each position's first occurrence:
    # XLA:CPU sorts (key, position) pairs several times slower than keys alone.
    sorted_keys = lax.sort(keys, is_stable=False)
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_keys[1:] != sorted_keys[:-1]])
    segment = jnp.cumsum(starts, dtype=jnp.int32) - 1
    first = jnp.searchsorted(sorted_keys, keys, side="left", method="scan")
    g_sum = jax.ops.segment_sum(g, segment[first], num_segments=m)
    rows = jnp.full((m,), NOT_MINE, jnp.int32).at[segment].set(sorted_keys)
    # Unused segments and the "not mine" segment get distinct out-of-range rows.
    rows = jnp.where(rows < NOT_MINE, rows, NOT_MINE + lax.iota(jnp.int32, m))
    return rows, g_sum


class _Rows:
    """Read-modify-write access to the distinct sorted rows `rows` of one shard array.

    Unpacked, a row is gathered and scattered on its own. Packed, each logical row's
    physical row is gathered (a copy per logical row) and its lanes picked out with a mask;
    on write, the new lanes of all logical rows sharing a physical row, and that row's old
    lanes, are combined with sorted segment sums of the raw bits (a sum of one value and
    zeros, so bit-exact, -0.0 included) and each physical row is written back once:
    neighbours keep their bits and no two writes collide. Segment sums cost the TPU
    compiler their output's size; a row gather or scatter costs a whole (8, 128) tile.

    The caller gathers the array at `read_at` and scatters `block(...)` at `write_at`
    (`_placement`), so that all the arrays of a table are read and written together.
    """

    def __init__(self, packing: _layout.Packing, rows, dtype):
        self.packing, self.rows, self.dtype = packing, rows, dtype
        self.read_at = self.write_at = rows
        if not packing.packed:
            return
        k, w = packing.per_row, packing.padded_width
        phys = rows // k  # Non-decreasing, since rows are sorted.
        self.starts = jnp.concatenate([jnp.ones((1,), bool), phys[1:] != phys[:-1]])
        self.segment = jnp.cumsum(self.starts, dtype=jnp.int32) - 1
        # Segment s's physical row: the s-th distinct one (a sort, not a 1-D scatter).
        self.write_at = lax.sort(jnp.where(self.starts, phys, NOT_MINE), is_stable=False)
        self.read_at = phys
        lane = lax.iota(jnp.int32, k * w)
        self.mine = ((lane // w)[None, :] == (rows % k)[:, None]) & (
            (lane % w)[None, :] < packing.width
        )

    def read(self, got):
        """The logical rows, from the array gathered at `read_at`."""
        if not self.packing.packed:
            return got
        k, w = self.packing.per_row, self.packing.padded_width
        self.bits = _bits(got)
        picked = jnp.where(self.mine, self.bits, 0).reshape(-1, k, w)
        picked = picked.sum(axis=1, dtype=self.bits.dtype)  # One nonzero term: exact bits.
        out = lax.bitcast_convert_type(picked[:, : self.packing.width], self.dtype)
        return out if self.packing.rank == 2 else out[:, 0]

    def block(self, values):
        """What to write at `write_at` for the new logical rows `values` (after `read`)."""
        values = values.astype(self.dtype)
        if not self.packing.packed:
            return values
        k, w = self.packing.per_row, self.packing.padded_width
        if self.packing.rank == 1:
            values = values[:, None]
        lanes = jnp.pad(_bits(values), [(0, 0), (0, w - self.packing.width)])
        lanes = jnp.tile(lanes, (1, k))  # Every lane group; the mask keeps this row's.
        n = self.rows.shape[0]
        total = lambda x: jax.ops.segment_sum(
            x, self.segment, num_segments=n, indices_are_sorted=True
        )
        new = total(jnp.where(self.mine, lanes, 0))
        touched = total(self.mine.astype(jnp.int32)) > 0
        old = total(jnp.where(self.starts[:, None], self.bits, 0))
        return lax.bitcast_convert_type(jnp.where(touched, new, old), self.dtype)


def _bits(x):
    """The raw bits of x as signed integers of the same width."""
    return lax.bitcast_convert_type(x, {2: jnp.int16, 4: jnp.int32}[x.dtype.itemsize])


def apply_rows(
    plan: _plan.TablePlan, table, slots: dict, rows_idx, g, step: _backend.RowStep, axis
):
    """Reads the distinct rows `rows_idx` (sorted; >= NOT_MINE: none) of the table and its
    stored slots, applies the optimizer's row function to each with its summed gradient
    `g`, and writes them back in place: (table, slots)."""
    storage = plan.storage
    names = [s.name for s in storage.stored]
    buffers = [table] + [slots[n] for n in names]
    if plan.optimizer.dense_update:
        # Every row of the shard is updated; rows not in the batch see a zero gradient.
        num_rows = plan.layout.rows_per_shard
        g = jnp.zeros((num_rows, g.shape[1]), jnp.float32).at[rows_idx].set(g, mode="drop")
        size = jnp.asarray(plan.layout.shard_sizes(), jnp.int32)[lax.axis_index(axis)]
        local = lax.iota(jnp.int32, num_rows)
        rows_idx = jnp.where(local < size, local, NOT_MINE + local)  # Padding stays as is.
    if step.ok is not None:  # A skipped table: no row read or written.
        none = NOT_MINE + lax.iota(jnp.int32, rows_idx.shape[0])  # Sorted and distinct.
        rows_idx = jnp.where(step.ok, rows_idx, none)
    access = [_Rows(p, rows_idx, b.dtype) for b, p in zip(buffers, storage.packings)]
    got = _placement.gather(storage.on_host, buffers, [a.read_at for a in access])
    values = [a.read(g) for a, g in zip(access, got)]
    if step.fresh is not None:
        values = step.fresh(values, rows_idx)
    s = [step.scalars[j] for j in range(step.scalars.shape[0])]
    row_fn = storage.stored_row_fn(step.row_fn)
    new = jax.vmap(lambda g_r, v_r: row_fn(g_r, v_r, s))(g, values)
    if plan.config.stochastic_rounding:
        new[0] = stochastic_rows(plan, new[0], rows_idx, step, axis)
    # No unique_indices/indices_are_sorted hints: with them the TPU compiler turns the
    # scatters of table and slots into whole-buffer passes.
    blocks = [a.block(v) for a, v in zip(access, new)]
    at = [a.write_at for a in access]
    table, *new_slots = _placement.scatter(storage.on_host, buffers, at, blocks)
    return table, dict(zip(names, new_slots))


def stochastic_rows(plan: _plan.TablePlan, rows, local, step: _backend.RowStep, axis):
    """New float32 rows (U, D) of the local rows `local` -> bfloat16, stochastically rounded
    with the bits of (table, step, global row); bfloat16 tables hold no riders."""
    assert step.step is not None and not plan.storage.riders
    key = _storage.step_key(_storage.table_seed(plan.name), step.step)
    ids = plan.layout.global_ids(lax.axis_index(axis), local)
    return _storage.round_stochastically(rows, _storage.random_bits(key, ids, rows.shape[1]))


def read_rows(plan: _plan.TablePlan, table, rows):
    """(n, D) float32: the logical rows `rows` of this shard (>= NOT_MINE: zeros)."""
    packing = plan.storage.packing
    k = packing.per_row
    (phys,) = _placement.gather(plan.storage.on_host, [table], [rows // k])
    phys = phys.astype(jnp.float32)
    if k > 1:
        phys = packing.fold(jnp.where(packing.own_lanes(rows), phys, 0.0))
    return phys[:, : plan.config.dim]


class XlaRouted(_backend.RoutedRows):
    """The row work of owner routing in XLA ops: any mesh, any table; rows travel (n, D)."""

    k = 1

    def __init__(self, plan: _plan.TablePlan):
        self.plan = plan

    def owner_rows(self, table, rows):
        return read_rows(self.plan, table, rows)

    def combine(self, local, r, back, acc):
        got = back[r.pair_slot] * jnp.where(r.pair_in_round, local.scale, 0.0)[:, None]
        return acc.at[local.out].add(got)

    def zeros(self, rows: int):
        return jnp.zeros((rows, self.plan.config.dim), jnp.float32)

    def unpack(self, acc, rows: int):
        return acc

    def gradients(self, local, grad_rows):
        """Per distinct row of `local` (as `uniq`), its summed gradient (m, D)."""
        g = local.scale[:, None] * grad_rows[local.out]  # NONE pairs have scale 0.
        return jax.ops.segment_sum(
            g, local.segment, num_segments=local.pairs, indices_are_sorted=True
        )

    def send(self, local, r, g):
        return r.rows_of(g)

    def owner_update(self, table, slots, rows, grads, step, axis):
        rows, g_sum = owner_sum(rows, grads)
        return apply_rows(self.plan, table, slots, rows, g_sum, step, axis)


def owner_sum(rows, g):
    """Sums the gradients of equal rows received from several devices.

    Returns the distinct rows ascending, padded with distinct indices >= NOT_MINE that
    gathers fill and scatters drop, and their summed gradients: `apply_rows`' input.
    Sorted with the arrival slot riding along, so equal rows sum in a fixed order.
    """
    n = rows.shape[0]
    keys, order = lax.sort((rows, lax.iota(jnp.int32, n)), num_keys=2, is_stable=False)
    starts = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
    segment = jnp.cumsum(starts, dtype=jnp.int32) - 1
    g_sum = jax.ops.segment_sum(g[order], segment, num_segments=n, indices_are_sorted=True)
    distinct = lax.sort(jnp.where(starts, keys, NONE), is_stable=False)
    distinct = jnp.where(distinct < NOT_MINE, distinct, NOT_MINE + lax.iota(jnp.int32, n))
    return distinct, g_sum
