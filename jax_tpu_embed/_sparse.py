"""Shard-local lookup and sparse update; run inside `shard_map` over the mesh axis.

Per step and device, for one table: N devices, global batch B, L ids per example, D the
dim, M = B·L (id, position) pairs, P_p of them owned by device p, U_p the distinct rows it
owns, S slots. Packing (_layout.Packing): k logical rows of width w (D rounded up to a
power of two) per physical row of R = k·w·4 bytes (TPU: 512 B for D <= 128; R = D·4 when
not packed).

Both paths all-gather the ids of the global batch, (N-1)/N · M·4 bytes received (plus the
combiner weights when a feature has them or combines by mean/sqrtn), and sort the M pairs
by the local row this shard owns (others last), each pair's output row and combiner weight
riding along in the sort (3 · M·4 bytes of keys and payloads). For the fused kernels
the scales are dropped when every one is 1 (unweighted sums and sequences), and the
output row is packed into the key when row << bits(output rows) stays below 2**30 (W1:
250,000 rows per shard, 4,096 output rows): down to one array, M·4 bytes.

Fused kernels (TPU meshes, `TablePlan.fused`; _pallas.py), one call per table walking the
P_p owned pairs:
- lookup: reads 12·P_p bytes of sorted pairs (8·P_p without scales) and each touched
  physical row once, U'_p·R (U'_p <= U_p: logical rows sharing a physical row share the
  read); sums into the lane-dense (B/k, k·w) partial activations in VMEM, written once
  (B·w·4 bytes), then reduce-scattered: (N-1)/N · B·w·4 bytes (B·L·w·4 for a sequence
  feature).
- update: all-gathers the lane-dense activation gradients, (N-1)/N · B·w·4 bytes; the
  kernel reads them once into VMEM and the pairs (12·P_p or 8·P_p), sums each row's
  gradient in VMEM, then reads and writes each touched physical row of the table and of
  every slot array once: 2·U'_p·R·(1 + S') bytes, S' the slots with arrays of their own
  (`TablePlan.riders` ride in the table's rows). Nothing else touches a row.
At D = 128 that is the essential traffic; below, a 512-byte physical row is read for a
4·D-byte logical row (Mosaic DMAs move at least 512 contiguous bytes): the rows cost
128 / D times essential at most (4x at D=32).

XLA passes (elsewhere: CPU meshes, tpu_kernels=False, bf16 tables, dense Adam, batches
whose activations overflow VMEM), C = `capacity` owned pairs per pass (1.5·M/N on TPU, M
elsewhere), Cu = `unique_capacity` distinct rows:
- lookup: per pass gather C rows (C·D·4 B) and sum them into the (B, D) partial
  activations; reduce-scatter those, (N-1)/N · B·D·4 bytes.
- update: all-gather the activation gradients ((N-1)/N · B·D·4 bytes); per pass form the C
  pairs' gradients, sum them per row, gather the pass's distinct rows and their slots,
  apply the optimizer (vmapped), scatter them back in place: 2·U_p·D·4·(1 + S) bytes in
  all. A row whose pairs straddle two passes is held back and its partial sum carried, so
  every row gets exactly one update. A shard owning more than one pass holds runs more
  passes; nothing is dropped. Tables on the C++ CPU kernels (`TablePlan.cpu_rows`) make
  one pass over all M positions instead.

Rows not in the batch are never read or written: work and traffic are independent of the
vocabulary V. No table-sized value is ever formed (except for `Adam(lazy_adam=False)`,
whose contract updates every row).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config, _cpu_kernels, _layout, _optimizers, _pallas


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """Static facts of one table that the kernels need."""
    name: str
    config: _config.TableConfig
    optimizer: _optimizers.Optimizer
    layout: _layout.TableLayout
    slot_specs: tuple
    lanes: int = 0  # Physical row width to pack narrow rows into (128 on TPU); 0: none.
    cpu_kernels: bool = False  # Use the C++ kernels of _cpu_kernels (CPU meshes only).
    max_ids: int | None = None  # Pairs per shard and pass (see `capacity`); None: automatic.
    max_unique: int | None = None  # Distinct rows per shard and pass; None: = capacity.
    tpu: bool = False  # On a TPU mesh: passes of the per-shard share, pairs sorted with payloads.
    tpu_kernels: str = ""  # "pallas" / "interpret": the fused kernels of _pallas; "": XLA.
    vmem: int = 16 << 20  # VMEM per TensorCore of the mesh's TPUs (_pallas.vmem_bytes).

    @property
    def cpu_rows(self) -> bool:
        """Whether this table's rows go through the C++ lookup and update kernels."""
        return (self.cpu_kernels and self.lanes == 0 and
                jnp.dtype(self.config.dtype) == jnp.float32)

    @property
    def fused(self) -> bool:
        """Whether this table's rows go through the fused Pallas kernels (_pallas)."""
        return (bool(self.tpu_kernels) and not self.cpu_rows and
                not self.optimizer.dense_update and
                jnp.dtype(self.config.dtype) == jnp.float32)

    @property
    def riders(self) -> tuple:
        """The slots stored in the table's own array, right of its D lanes, in order.

        With packed rows (TPU) every row a step touches costs a whole physical row of the
        table and one of each slot array (512 bytes at least; Mosaic DMAs move no less).
        When the table's row and its same-width slots fit one 128-lane row together —
        f32, D·(1 + slots) <= 128, e.g. Adagrad at D <= 64 — they share it: [row | slot1
        | ...], and an update reads and writes one physical row, not 1 + S. Not when the
        shared row would pad to more lanes than the separate ones (Adam at D=32: 96 lanes
        pad to 128, 3 x 32 do not): HBM holds the tables. Rank-1 slots and wider groups
        keep their own arrays (`stored_slots`)."""
        if not self.lanes or jnp.dtype(self.config.dtype) != jnp.float32 or \
                self.optimizer.dense_update:
            return ()
        wide = tuple(s for s in self.slot_specs if s.rank == 2)
        width = lambda w: _layout.Packing(w, 2, self.lanes).padded_width
        d, n = self.config.dim, 1 + len(wide)
        fits = d * n <= self.lanes and width(d * n) <= n * width(d)
        return wide if wide and fits else ()

    @property
    def stored_slots(self) -> tuple:
        """The slots with arrays of their own (`state.slots`): all but the riders."""
        riders = self.riders
        return tuple(s for s in self.slot_specs if s not in riders)

    @property
    def packing(self) -> _layout.Packing:
        """The table array's: D lanes per logical row, and the riders' after them."""
        return _layout.Packing(self.config.dim * (1 + len(self.riders)), 2, self.lanes)

    @property
    def rows_packing(self) -> _layout.Packing:
        """D-wide rows packed as a table without riders: the lane-dense activations."""
        return _layout.Packing(self.config.dim, 2, self.lanes)

    def slot_packing(self, slot: _optimizers.SlotSpec) -> _layout.Packing:
        return _layout.Packing(self.config.dim if slot.rank == 2 else 1, slot.rank,
                               self.lanes)


def split_riders(plan: TablePlan, group):
    """(rows (..., D), {rider name: (..., D)}) from the table array's logical rows."""
    d = plan.config.dim
    return group[..., :d], {s.name: group[..., d * (1 + i):d * (2 + i)]
                            for i, s in enumerate(plan.riders)}


def join_riders(plan: TablePlan, rows, riders: dict):
    """The inverse of split_riders: logical rows of the table array."""
    if not plan.riders:
        return rows
    xp = jnp if isinstance(rows, jax.Array) else np
    return xp.concatenate([rows] + [riders[s.name].astype(rows.dtype) for s in plan.riders],
                          axis=-1)


@dataclasses.dataclass(frozen=True)
class FeaturePlan:
    path: str
    config: _config.FeatureConfig
    table: str


def combiner_scale(weights: jax.Array, combiner: str) -> jax.Array:
    """Per-position factor (B, L) so that output = Σ_l scale·row; 0 where a divisor is 0."""
    if combiner == "sum":
        return weights
    if combiner == "mean":
        denom = jnp.sum(weights, axis=1, keepdims=True)
    else:  # sqrtn
        denom = jnp.sqrt(jnp.sum(weights * weights, axis=1, keepdims=True))
    safe = jnp.where(denom == 0, 1.0, denom)
    return jnp.where(denom == 0, 0.0, weights / safe)


def _gathered(ids, weights, axis):
    """Global-batch ids and weights (weights derived from ids when the feature has none)."""
    ids_all = lax.all_gather(ids, axis, tiled=True)
    if weights is None:
        return ids_all, (ids_all >= 0).astype(jnp.float32)
    return ids_all, lax.all_gather(weights, axis, tiled=True)


def _owned(layout: _layout.TableLayout, ids_all, axis):
    """(mine, local): which positions this shard owns and their local rows (0 elsewhere)."""
    owner, local = layout.owner_and_local(ids_all)
    mine = (ids_all >= 0) & (owner == lax.axis_index(axis))
    return mine, jnp.where(mine, local, 0)


def _scale(feature: FeaturePlan, weights_all):
    if feature.config.is_sequence:
        return weights_all
    return combiner_scale(weights_all, feature.config.table.combiner)


def capacity(plan: TablePlan, positions: int, num_shards: int) -> int:
    """C: how many of a table's M (id, position) pairs one shard handles per pass.

    `plan.max_ids` when set; else, on TPU meshes (`plan.tpu`), 1.5 times the per-shard
    average M / N (room for hot rows and uneven ownership), and otherwise M: XLA:CPU sorts
    and loops cost more than scanning all pairs (W0 on 2 CPU devices, cpu_kernels=False:
    lookup 23 ms with 1.5 M / N, 6 ms with M). Rounded up to a multiple of 8 and at most M.
    A shard owning more than C pairs in a step runs more passes: never drops an id. An
    optimizer that updates every row (`Adam(lazy_adam=False)`) always runs one pass of all M.
    """
    if plan.optimizer.dense_update:
        return positions
    c = plan.max_ids or (-(-3 * positions // (2 * num_shards)) if plan.tpu else positions)
    return max(1, min(positions, _round_up(c, 8)))


def unique_capacity(plan: TablePlan, pairs: int) -> int:
    """Cu: distinct rows one pass of `pairs` (= C) pairs updates; a pass stops at Cu."""
    if plan.optimizer.dense_update or not plan.max_unique:
        return pairs
    return max(1, min(pairs, _round_up(plan.max_unique, 8)))


def planned(plan: TablePlan, positions: int, num_shards: int) -> tuple[int, int]:
    """(pairs, distinct rows) per shard and step that the fused kernels' cost estimates
    assume: `max_ids_per_shard`, else the average M / N; `max_unique_ids_per_shard`, else
    as many as pairs. The kernels walk every owned pair whatever these say; set them to
    the data's expected values (`Embedding.id_counts`) for a true "bytes accessed"."""
    pairs = plan.max_ids or -(-positions // num_shards)
    return pairs, min(plan.max_unique or pairs, pairs)


def runs_fused(plan: TablePlan, packed_rows: int) -> bool:
    """Whether a table runs the fused kernels: `plan.fused`, and its activations (B rows per
    feature, or B·L for a sequence feature, k to a lane-dense row of k·w lanes) fit the
    kernels' VMEM block (_pallas.fits_vmem); else the XLA passes."""
    return plan.fused and _pallas.fits_vmem(
        packed_rows, plan.rows_packing.per_row * plan.rows_packing.padded_width, plan.vmem)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def passes_needed(counts, c: int, cu: int) -> int:
    """Passes update_local runs over one shard's rows with these pair counts (NumPy, in
    ascending row order): each pass takes up to C pairs and stops at Cu distinct rows; a
    row may straddle passes. Embedding.id_counts reports it; kept here, by the engine."""
    passes, row, left = 0, 0, 0  # `left`: pairs of `row` not yet taken.
    while row < len(counts):
        passes += 1
        room, distinct = c, 0
        while row < len(counts) and room > 0 and distinct < cu:
            take = min(room, left or int(counts[row]))
            left = (left or int(counts[row])) - take
            room, distinct = room - take, distinct + 1
            if left == 0:
                row += 1
    return passes


@dataclasses.dataclass
class _Stream:
    """The (id, position) pairs of one table's features, read C at a time from `start`.

    The positions of all features sharing the table are concatenated; `out` is each pair's
    output row: example b of a pooled feature, or (b, l) of a sequence feature, offset by the
    feature's first row in the concatenation (`parts`). Pairs this shard does not own have
    key _NOT_MINE and scale 0. Built in position order; `sorted()` orders the owned pairs by
    row, first, with the payloads riding along in the sort so that each pass reads
    contiguous slices: the TPU compiler charges a 1-D gather a 4 KiB tile per element
    (30,720 int32 of 81,920: 128 MB), a 3-operand sort of the 81,920 about 2.6 MB per
    device, 0.66 MB an unstable one of packed keys alone (no scales, `out_bits`).
    `fused`: the table runs the fused kernels of _pallas, which walk all owned pairs in one
    call: no passes, no padding; its activations and their gradients travel lane-dense
    (`pack`, see _streams).
    """
    keys: jax.Array    # (M [+ C + 1],) local row per pair; padded with _NOT_MINE for passes
    out: jax.Array | None  # (M [+ C + 1],) output row per pair; padded with 0. None when
    #                   the keys hold it (`out_bits`).
    scale: jax.Array | None  # (M [+ C + 1],) combiner-scaled weight per pair; padded with
    #                   0. None (fused streams only): 1 for every owned pair.
    count: jax.Array   # () owned pairs
    capacity: int      # C
    pairs: int         # M
    rows: int          # Output rows of all the table's features together.
    parts: list        # [(FeaturePlan, first output row, output rows, rows per device)]
    fused: bool
    pack: int = 1      # Output rows per lane-dense row (fused: the table's k), see _streams.
    out_bits: int = 0  # > 0 (fused only): keys are row << out_bits | output row.

    def sorted(self) -> _Stream:
        """Ordered by (key, output row, scale): each row's pairs in one canonical order,
        whatever path or sort reads them, so that the kernels and the passes sum a row's
        gradients alike. Unstable: a stable sort costs the TPU compiler an extra iota
        operand (W1, one D=64 table: 21.90 -> 20.92 MB per device)."""
        names = [n for n in ("keys", "out", "scale") if getattr(self, n) is not None]
        arrays = lax.sort(tuple(getattr(self, n) for n in names), num_keys=len(names),
                          is_stable=False)
        return dataclasses.replace(self, **dict(zip(names, arrays)))

    def window(self, start):
        """(keys, out, scale), each (C,), of the pairs start ... start + C - 1."""
        return tuple(lax.dynamic_slice_in_dim(a, start, self.capacity)
                     for a in (self.keys, self.out, self.scale))

    def key_at(self, i):
        """The key of pair i (sorted: _NOT_MINE past the owned pairs)."""
        return lax.dynamic_slice_in_dim(self.keys, i, 1)[0]

    def passes(self, body, carry, *, single: bool):
        """Runs `consumed, carry = body(start, carry)` from start 0 until every owned pair
        is consumed; with `single`, one pass is known to take them all: straight-line code."""
        if single:
            return body(jnp.int32(0), carry)[1]

        def step(state):
            start, carry = state
            consumed, carry = body(start, carry)
            return start + consumed, carry

        return lax.while_loop(lambda state: state[0] < self.count, step,
                              (jnp.int32(0), carry))[1]


def _flat_pairs(f: FeaturePlan, ids, weights, axis, columns: bool):
    """The global batch's (ids, scales), each (B·L,) in position order (_position).

    Flattened on the local shard before the all-gather: a (B, L) array with L < 128 is
    lane-padded on TPU (20 ids: 6.4x the bytes), and every op after the gather would pay
    for it. With `columns` (TPU) flattened column by column: the TPU stores a (b, L) int32
    array with L < 128 column-major, so that order is a free reshape where row by row is a
    transposing copy (W1: 0.33 MB per table and device); elsewhere row by row. The
    combiner's per-example sums use the local rows; a plain sum needs no weights at all:
    its scales are None, 1 for every id (padding is never owned)."""
    flat = (lambda x: x.T.reshape(-1)) if columns else (lambda x: x.reshape(-1))
    ids_all = lax.all_gather(flat(ids), axis, tiled=True)
    if weights is None and (f.config.is_sequence or f.config.table.combiner == "sum"):
        return ids_all, None
    w = (ids >= 0).astype(jnp.float32) if weights is None else weights
    return ids_all, lax.all_gather(flat(_scale(f, w)), axis, tiled=True)


def _position(pos, local_batch: int, length: int, columns: bool):
    """(example, l) of the flat positions `pos` of _flat_pairs: device blocks of
    local_batch·length positions, each column by column or row by row."""
    if not columns:
        return pos // length, pos % length
    block, within = pos // (local_batch * length), pos % (local_batch * length)
    return block * local_batch + within % local_batch, within // local_batch


def _streams(feats: dict, features: list[FeaturePlan], plans: dict[str, TablePlan],
             axis: str) -> dict[str, _Stream]:
    """One _Stream per table that does not go through the C++ kernels, in position order."""
    by_table: dict[str, list] = {}
    for f in features:
        plan = plans[f.table]
        if plan.cpu_rows:
            continue
        ids, weights = feats[f.path]
        ids_all, scale = _flat_pairs(f, ids, weights, axis, columns=plan.tpu)
        mine, local = _owned(plan.layout, ids_all, axis)
        b, l = ids.shape[0] * lax.axis_size(axis), ids.shape[1]
        example, position = _position(lax.iota(jnp.int32, b * l), ids.shape[0], l,
                                      columns=plan.tpu)
        seq = f.config.is_sequence
        by_table.setdefault(f.table, []).append(
            (f, jnp.where(mine, local, _NOT_MINE), (mine, scale),
             example * l + position if seq else example, b * l if seq else b))
    streams = {}
    n = lax.axis_size(axis)
    for name, items in by_table.items():
        plan = plans[name]
        keys = jnp.concatenate([k for _, k, *_ in items])
        c = capacity(plan, keys.shape[0], n)
        k = plan.rows_packing.per_row
        fused = runs_fused(plan, _out_rows(items, n, k) // k)
        k = k if fused else 1
        parts, outs, first = [], [], 0
        for f, _, _, out, rows in items:
            # Device d's rows of a feature are [d·r, d·r + local) with `local` rounded up to
            # r, a multiple of k: the feature's (N·r, D) activations, padded to the table's
            # lane width w, pack to (N·r / k, k·w), lane-dense, and each device's share is
            # whole packed rows. A narrow (B, D) array is lane-padded on TPU (D=32: 4x the
            # bytes) in the all-gather, the reduce-scatter and the kernels' VMEM blocks.
            local = rows // n
            r = _round_up(local, k)
            parts.append((f, first, n * r, local))
            outs.append(out // local * r + out % local + first)
            first += n * r
        pad = (lambda x, value=0: x) if fused else (
            lambda x, value=0: jnp.pad(x, (0, c + 1), constant_values=value))
        # The kernels read scales only for owned pairs: all 1 needs no array at all (one
        # payload less in the sort). The passes read every pair: 0 where not owned.
        scales = [s for _, _, (_, s), *_ in items]
        scale = None if fused and all(s is None for s in scales) else pad(jnp.concatenate([
            jnp.where(mine, 1.0 if s is None else s, 0.0)
            for _, _, (mine, s), *_ in items]))
        out = jnp.concatenate(outs)
        # The kernels take (row, output row) packed into one key when both fit below
        # _NOT_MINE: the sort then moves one array, not two, and so do the kernels.
        bits = max(first - 1, 1).bit_length()
        bits = bits if fused and plan.layout.rows_per_shard << bits <= _PACKED_KEYS else 0
        if bits:
            keys, out = jnp.where(keys < _NOT_MINE, keys << bits | out, _NOT_MINE), None
        streams[name] = _Stream(
            keys=pad(keys, _NOT_MINE), out=None if out is None else pad(out), scale=scale,
            # Counted on the final keys: one pass over them with the key computation.
            count=jnp.sum(keys < _NOT_MINE, dtype=jnp.int32), capacity=c,
            pairs=keys.shape[0], rows=first, parts=parts, fused=fused, pack=k,
            out_bits=bits)
    return streams


def _out_rows(items, n: int, k: int) -> int:
    """Output rows of a table's features with each device's share rounded up to k."""
    return sum(n * _round_up(rows // n, k) for *_, rows in items)


def _packed(x, packing: _layout.Packing):
    """(r, D) rows, r a multiple of k -> (r / k, k·w) lane-dense (zero lanes past D)."""
    k, w = packing.per_row, packing.padded_width
    x = jnp.pad(x, [(0, 0), (0, w - x.shape[1])])
    return x.reshape(-1, k * w)


def _unpacked(x, packing: _layout.Packing, rows: int):
    """The inverse of _packed, then the first `rows` rows."""
    return x.reshape(-1, packing.padded_width)[:rows, :packing.width]


def lookup_local(tables: dict, feats: dict, features: list[FeaturePlan],
                 plans: dict[str, TablePlan], axis: str) -> dict:
    """Activations of this device's examples: (b, D) or (b, L, D) per feature path."""
    out = {}
    for f in features:
        plan = plans[f.table]
        if not plan.cpu_rows:
            continue
        ids, weights = feats[f.path]
        ids_all, w_all = _gathered(ids, weights, axis)
        mine, local = _owned(plan.layout, ids_all, axis)
        scale = jnp.where(mine, _scale(f, w_all), 0.0)
        if f.config.is_sequence:
            rows = jnp.take(tables[f.table], local, axis=0)
            partial = rows * scale[..., None]
        else:
            partial = _cpu_kernels.pooled_lookup(tables[f.table],
                                                 jnp.where(mine, local, _NOT_MINE), scale)
        out[f.path] = lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)
    for name, stream in _streams(feats, features, plans, axis).items():
        plan = plans[name]
        packing, table = plan.packing, tables[name]
        k, w = packing.per_row, packing.padded_width
        rows = stream.rows
        if stream.fused:
            stream = stream.sorted()
            acc = _pallas.pooled_lookup(
                table, packing, stream.keys, stream.out, stream.scale, stream.count, rows,
                planned=planned(plan, stream.pairs, lax.axis_size(axis)), vmem=plan.vmem,
                out_bits=stream.out_bits, rows_packing=plan.rows_packing,
                interpret=plan.tpu_kernels == "interpret")
            out.update(_scatter_parts(acc, stream, axis, plan.rows_packing))
            continue
        # One pass needs no order; several take the owned pairs first.
        single = stream.capacity >= stream.pairs
        stream = stream if single else stream.sorted()
        group = lax.iota(jnp.int32, k * w) // w

        def one_pass(start, acc, stream=stream, table=table, k=k, group=group):
            keys, out, scale = stream.window(start)
            phys = table.at[keys // k].get(mode="fill", fill_value=0).astype(jnp.float32)
            contrib = phys * scale[:, None]
            if k > 1:
                # where() after the product: a neighbour's inf or nan never leaks in.
                contrib = jnp.where(group == (keys % k)[:, None], contrib, 0.0)
            return stream.capacity, acc.at[out].add(contrib)

        acc = stream.passes(one_pass, jnp.zeros((rows, k * w), jnp.float32), single=single)
        if packing.packed:  # Fold the k lane groups: each position filled only its own.
            acc = acc.reshape(rows, k, w).sum(axis=1)
        acc = acc[:, :plan.config.dim]  # The row's lanes, not its riders'.
        out.update(_scatter_parts(acc, stream, axis))
    return out


def _scatter_parts(acc, stream: _Stream, axis: str, packing=None) -> dict:
    """Each feature's activations: its rows of its table's partial sums, reduce-scattered
    over the batch. `acc` is (rows, D), or with `packing` lane-dense (rows / k, k·w) with
    k = stream.pack (_streams), unpacked after the reduce-scatter."""
    out, k = {}, stream.pack
    for f, first, rows, local in stream.parts:
        partial = lax.psum_scatter(acc[first // k:(first + rows) // k], axis,
                                   scatter_dimension=0, tiled=True)
        if packing is not None:
            partial = _unpacked(partial, packing, local)
        if f.config.is_sequence:
            partial = partial.reshape(-1, f.config.max_sequence_length, partial.shape[-1])
        out[f.path] = partial
    return out


def update_local(tables: dict, slots: dict, feats: dict, grads: dict, step,
                 features: list[FeaturePlan], plans: dict[str, TablePlan], axis: str,
                 spec: _config.EmbeddingSpec):
    """One sparse optimizer step on this device's shard of every table."""
    tables, slots = dict(tables), dict(slots)
    gathered = lambda g: lax.all_gather(g, axis, tiled=True).astype(jnp.float32)
    multiplier = (None if spec.gradient_multiplier_fn is None else
                  jnp.asarray(spec.gradient_multiplier_fn(step), jnp.float32))

    def finish(plan, rows_idx, g_sum, table, table_slots):
        scalars, row_fn = _row_step(plan, spec, step)
        return _apply_rows(plan, table, table_slots, rows_idx, g_sum, scalars, row_fn, axis)

    # Tables on the C++ kernels: every position of the global batch, in one pass.
    by_table: dict[str, list] = {}
    for f in features:
        plan = plans[f.table]
        if not plan.cpu_rows:
            continue
        ids, weights = feats[f.path]
        ids_all, w_all = _gathered(ids, weights, axis)
        mine, local = _owned(plan.layout, ids_all, axis)
        scale = _scale(f, w_all)
        grad_all = gathered(grads[f.path])
        if f.config.is_sequence:
            g = grad_all * scale[..., None]  # (B, L, D)
        else:
            g = scale[..., None] * grad_all[:, None, :]
        key = jnp.where(mine, local, _NOT_MINE)
        # The C++ update takes a lone pooled feature's (scale, grad_all) instead of g.
        pooled = None if f.config.is_sequence else (scale.reshape(-1), grad_all)
        by_table.setdefault(f.table, []).append(
            (key.reshape(-1), g.reshape(-1, g.shape[-1]), pooled))
    for name, parts in by_table.items():
        plan = plans[name]
        keys = jnp.concatenate([k for k, _, _ in parts])
        g = jnp.concatenate([v for _, v, _ in parts])
        if not _cpu_kernels.supports_update(plan.optimizer):
            rows_idx, g_sum = _cpu_kernels.sum_duplicates(keys, g)
            tables[name], slots[name] = finish(plan, rows_idx, g_sum, tables[name],
                                               slots[name])
            continue
        lr = _optimizers.evaluate(plan.optimizer.learning_rate, step)
        names = [s.name for s in plan.slot_specs]
        scale = None
        if len(parts) == 1 and parts[0][2] is not None:
            scale, g = parts[0][2]
        tables[name], new = _cpu_kernels.update(
            plan.optimizer, tables[name], tuple(slots[name][n] for n in names), keys, g,
            lr, multiplier, spec.clipping_limit, scale)
        slots[name] = dict(zip(names, new))

    # Every other table: the owned pairs in passes of C, sorted by row. A row whose pairs
    # run past the end of a pass is held back, its partial sum carried into the next pass,
    # so that each row gets exactly one optimizer update with its whole gradient.
    for name, stream in _streams(feats, features, plans, axis).items():
        plan = plans[name]
        c = stream.capacity
        if stream.fused:
            # Each device's activation gradients lane-dense (its rows padded to r, see
            # _streams), then all-gathered.
            n = lax.axis_size(axis)
            grad_rows = jnp.concatenate([
                gathered(_packed(jnp.pad(grads[f.path].reshape(local, -1),
                                         [(0, rows // n - local), (0, 0)]),
                                 plan.rows_packing))
                for f, _, rows, local in stream.parts])
            stream = stream.sorted()
            names = [sl.name for sl in plan.stored_slots]
            scalars, row_fn = _row_step(plan, spec, step)
            new = _pallas.fused_update(
                [tables[name]] + [slots[name][s] for s in names],
                [plan.packing] + [plan.slot_packing(sl) for sl in plan.stored_slots],
                stream.keys, stream.out, stream.scale, stream.count, grad_rows, scalars,
                _stored_row_fn(plan, row_fn), planned=planned(plan, stream.pairs, n),
                vmem=plan.vmem, out_bits=stream.out_bits, rows_packing=plan.rows_packing,
                interpret=plan.tpu_kernels == "interpret")
            tables[name], slots[name] = new[0], dict(zip(names, new[1:]))
            continue
        grad_rows = jnp.concatenate([gathered(grads[f.path]).reshape(rows, -1)
                                     for f, _, rows, _ in stream.parts])
        if not plan.tpu and c >= stream.pairs:
            # One pass, off TPU: a key-only sort and a binary search (_sum_duplicates) beat
            # XLA:CPU's payload sort (W0, 2 CPU devices, cpu_kernels=False: apply_gradients
            # 18 ms vs 33 ms); on TPU they would be 1-D gathers and scatters.
            keys, out, scale = stream.window(0)
            rows, g_sum = _sum_duplicates(keys, scale[:, None] * grad_rows[out])
            tables[name], slots[name] = finish(plan, rows, g_sum, tables[name], slots[name])
            continue
        stream = stream.sorted()
        cu = unique_capacity(plan, c)
        slot_iota = lax.iota(jnp.int32, cu)

        def one_pass(start, carry, stream=stream, plan=plan, grad_rows=grad_rows, c=c,
                     cu=cu, slot_iota=slot_iota):
            table, table_slots, held = carry
            keys, out, scale = stream.window(start)
            starts = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
            segment = jnp.cumsum(starts, dtype=jnp.int32) - 1
            # This pass takes the owned pairs of its first Cu distinct rows.
            take = (keys < _NOT_MINE) & (segment < cu)
            consumed = jnp.sum(take, dtype=jnp.int32)
            g = jnp.where(take[:, None], scale[:, None] * grad_rows[out], 0.0)
            g_sum = jax.ops.segment_sum(g, jnp.where(take, segment, cu), num_segments=cu,
                                        indices_are_sorted=True)
            g_sum = g_sum.at[0].add(held)  # The row the previous pass held, if any.
            # Segment s's row: the s-th distinct key (a sort, not a 1-D scatter; see _Stream).
            rows = lax.sort(jnp.where(starts & take, keys, _NOT_MINE), is_stable=False)[:cu]
            # Only a pass cut by C can end inside a row: hold that row back and carry its sum.
            nxt = stream.key_at(start + c)
            runs_on = (consumed == c) & (nxt < _NOT_MINE) & (nxt == keys[c - 1])
            last = jnp.minimum(segment[c - 1], cu - 1)
            held = jnp.where(runs_on, g_sum[last], 0.0)
            rows = jnp.where(runs_on & (slot_iota == last), _NOT_MINE, rows)
            # Unused segments get distinct out-of-range rows that gathers fill and scatters
            # drop.
            rows = jnp.where(rows < _NOT_MINE, rows, _NOT_MINE + slot_iota)
            table, table_slots = finish(plan, rows, g_sum, table, table_slots)
            return consumed, (table, table_slots, held)

        held = jnp.zeros((grad_rows.shape[1],), jnp.float32)
        tables[name], slots[name], _ = stream.passes(
            one_pass, (tables[name], slots[name], held),
            single=c >= stream.pairs and cu >= c)
    return tables, slots


# Local rows are < 2**30 (checked by Embedding); keys at or above mark "no row".
_NOT_MINE = 1 << 30
# Bound on packed (row, output row) keys (_streams): below _NOT_MINE. Tests lower it to
# run the kernels on separate output-row arrays.
_PACKED_KEYS = _NOT_MINE


def _sum_duplicates(keys, g):
    """Sums the gradients of equal keys.

    Args:
        keys: (M,) local row per position, _NOT_MINE for positions this shard does not own.
        g: (M, D) gradient per position.

    Returns:
        rows (M,) ascending distinct local rows, padded with distinct ascending indices
        >= _NOT_MINE that gathers fill and scatters drop; and their summed gradients (M, D).
    """
    m = keys.shape[0]
    # A key-only sort plus a vectorised binary search for each position's first occurrence:
    # XLA:CPU sorts (key, position) pairs ~3x slower than keys alone (10,240 keys: 2.9 ms vs
    # 1.0 ms), and the pair sort dominated the update.
    sorted_keys = lax.sort(keys, is_stable=False)
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_keys[1:] != sorted_keys[:-1]])
    segment = jnp.cumsum(starts, dtype=jnp.int32) - 1
    first = jnp.searchsorted(sorted_keys, keys, side="left", method="scan")
    g_sum = jax.ops.segment_sum(g, segment[first], num_segments=m)
    rows = jnp.full((m,), _NOT_MINE, jnp.int32).at[segment].set(sorted_keys)
    # Unused segments and the "not mine" segment get distinct out-of-range rows.
    rows = jnp.where(rows < _NOT_MINE, rows, _NOT_MINE + lax.iota(jnp.int32, m))
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
    """

    def __init__(self, buf, packing: _layout.Packing, rows):
        self.buf, self.packing, self.rows = buf, packing, rows
        if not packing.packed:
            return
        k, w = packing.per_row, packing.padded_width
        phys = rows // k  # Non-decreasing, since rows are sorted.
        self.starts = jnp.concatenate([jnp.ones((1,), bool), phys[1:] != phys[:-1]])
        self.segment = jnp.cumsum(self.starts, dtype=jnp.int32) - 1
        # Segment s's physical row: the s-th distinct one (a sort, not a 1-D scatter).
        self.phys = lax.sort(jnp.where(self.starts, phys, _NOT_MINE), is_stable=False)
        lane = lax.iota(jnp.int32, k * w)
        self.mine = ((lane // w)[None, :] == (rows % k)[:, None]) & (
            (lane % w)[None, :] < packing.width)
        self.bits = _bits(buf.at[phys].get(mode="fill", fill_value=0))

    def read(self):
        if not self.packing.packed:
            return self.buf.at[self.rows].get(mode="fill", fill_value=0)
        k, w = self.packing.per_row, self.packing.padded_width
        picked = jnp.where(self.mine, self.bits, 0).reshape(-1, k, w)
        picked = picked.sum(axis=1, dtype=self.bits.dtype)  # One nonzero term: exact bits.
        out = lax.bitcast_convert_type(picked[:, :self.packing.width], self.buf.dtype)
        return out if self.packing.rank == 2 else out[:, 0]

    def write(self, values):
        values = values.astype(self.buf.dtype)
        # No unique_indices/indices_are_sorted hints: with them the TPU compiler turns the
        # scatters of table and slots into whole-buffer passes (measured: 3.9 GB vs 0.27 GB
        # "bytes accessed" for 8,192 rows into a 2.5M x 128 shard).
        if not self.packing.packed:
            return self.buf.at[self.rows].set(values, mode="drop")
        k, w = self.packing.per_row, self.packing.padded_width
        if self.packing.rank == 1:
            values = values[:, None]
        lanes = jnp.pad(_bits(values), [(0, 0), (0, w - self.packing.width)])
        lanes = jnp.tile(lanes, (1, k))  # Every lane group; the mask keeps this row's.
        n = self.rows.shape[0]
        total = lambda x: jax.ops.segment_sum(x, self.segment, num_segments=n,
                                              indices_are_sorted=True)
        new = total(jnp.where(self.mine, lanes, 0))
        touched = total(self.mine.astype(jnp.int32)) > 0
        old = total(jnp.where(self.starts[:, None], self.bits, 0))
        block = lax.bitcast_convert_type(jnp.where(touched, new, old), self.buf.dtype)
        return self.buf.at[self.phys].set(block, mode="drop")


def _bits(x):
    """The raw bits of x as signed integers of the same width."""
    return lax.bitcast_convert_type(x, {2: jnp.int16, 4: jnp.int32}[x.dtype.itemsize])


def _row_step(plan: TablePlan, spec: _config.EmbeddingSpec, step):
    """(scalars, row_fn): the step's scalars as a (n,) f32 array, and
    row_fn(g (D,), [row, *slots], scalars) -> [new row, *new slots] for ONE row: the
    gradient multiplier and clipping, the optimizer's update_row and finish_row. The XLA
    form vmaps it over the touched rows; the fused kernel calls it per row."""
    opt = plan.optimizer
    hps = tuple(opt.hyperparameters())
    scalars = [_optimizers.evaluate(opt.learning_rate, step)]
    scalars += [_optimizers.evaluate(h, step) for h in hps]
    multiplied = spec.gradient_multiplier_fn is not None
    if multiplied:
        scalars.append(jnp.asarray(spec.gradient_multiplier_fn(step), jnp.float32))

    def row_fn(g, values, s):
        lr, row = s[0], values[0].astype(jnp.float32)
        if multiplied:
            g = g * s[-1]
        if spec.clipping_limit is not None:
            g = jnp.clip(g, -spec.clipping_limit, spec.clipping_limit)
        g = opt.clip_gradient(g)
        out = opt.update_row(g, row, list(values[1:]), lr, tuple(s[1:1 + len(hps)]))
        return [opt.finish_row(out[0], row, lr)] + list(out[1:])

    return jnp.stack(scalars), row_fn


def _apply_rows(plan: TablePlan, table, slots: dict, rows_idx, g, scalars, row_fn, axis):
    """Gathers the touched rows and slots, runs the optimizer, scatters them back."""
    names = [s.name for s in plan.stored_slots]
    packings = [plan.packing] + [plan.slot_packing(s) for s in plan.stored_slots]
    buffers = [table] + [slots[n] for n in names]
    if plan.optimizer.dense_update:
        # Every row of the shard is updated; rows not in the batch see a zero gradient.
        num_rows = plan.layout.rows_per_shard
        g = jnp.zeros((num_rows, g.shape[1]), jnp.float32).at[rows_idx].set(g, mode="drop")
        size = jnp.asarray(plan.layout.shard_sizes(), jnp.int32)[lax.axis_index(axis)]
        local = lax.iota(jnp.int32, num_rows)
        rows_idx = jnp.where(local < size, local, _NOT_MINE + local)  # Padding stays as is.
    access = [_Rows(b, p, rows_idx) for b, p in zip(buffers, packings)]
    values = [a.read() for a in access]
    s = [scalars[j] for j in range(scalars.shape[0])]
    row_fn = _stored_row_fn(plan, row_fn)
    new = jax.vmap(lambda g_r, v_r: row_fn(g_r, v_r, s))(g, values)
    table, *new_slots = [a.write(v) for a, v in zip(access, new)]
    return table, dict(zip(names, new_slots))


def _stored_row_fn(plan: TablePlan, row_fn):
    """row_fn over the values of the stored arrays of one row, [table array's row, *stored
    slots], instead of [row, *slots]: the riders are split off the table array's row
    before and joined back after."""
    if not plan.riders:
        return row_fn
    names = [sl.name for sl in plan.slot_specs]
    stored = [sl.name for sl in plan.stored_slots]

    def fn(g, values, s):
        row, riders = split_riders(plan, values[0])
        given = {**riders, **dict(zip(stored, values[1:]))}
        new = row_fn(g, [row] + [given[n] for n in names], s)
        new_slots = dict(zip(names, new[1:]))
        return ([join_riders(plan, new[0], {n: new_slots[n] for n in riders})] +
                [new_slots[n] for n in stored])

    return fn
