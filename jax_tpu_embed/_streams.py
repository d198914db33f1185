"""The sorted (id, position) pairs of one table's features, shared by the backends.

Per step and device, for one table: N devices, global batch B, L ids per example, M = B·L
(id, position) pairs. Each device all-gathers the ids of the global batch ((N-1)/N · M·4
bytes received, plus the combiner's scales when a feature has weights or combines by
mean/sqrtn), keeps the pairs whose row it owns (`owned`) and, where a backend needs order,
sorts them by local row with each pair's output row and scale riding along (`Stream`).

The XLA passes (`_xla_backend`) read a stream C = `capacity` pairs at a time; the Pallas
kernels (`_pallas`) walk all owned pairs of a `fused` stream in one call. docs/design.md
derives the traffic of both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from . import _inputs, _layout
from ._plan import CallPlan, FeaturePlan, Input, TablePlan
from ._rowindex import NOT_MINE


def gathered(i: Input, axis):
    """Global-batch ids and weights of one feature's Input (weights derived from ids when
    the feature has none); each gathered here unless the Input holds it already."""
    ids_all = i.ids_all
    if ids_all is None:
        ids_all = lax.all_gather(i.ids, axis, tiled=True)
    if i.weights is None:
        return ids_all, (ids_all >= 0).astype(jnp.float32)
    if i.weights_all is not None:
        return ids_all, i.weights_all
    return ids_all, lax.all_gather(i.weights, axis, tiled=True)


def owned(plan: TablePlan, feature: FeaturePlan, ids_all, axis):
    """(mine, local): which positions of `feature`'s ids this shard owns and their local
    rows in the plan's array (0 elsewhere)."""
    owner, local, found = plan.index.locate(feature.table, ids_all)
    mine = found & (owner == lax.axis_index(axis))
    return mine, jnp.where(mine, local, 0)


def feature_scale(feature: FeaturePlan, weights_all):
    if feature.config.is_sequence:
        return weights_all
    return _inputs.combiner_scale(weights_all, feature.table_config.combiner)


def capacity(plan: TablePlan, positions: int, num_shards: int) -> int:
    """C: how many of a table's M (id, position) pairs one shard handles per pass.

    `plan.max_ids` when set; else, on TPU meshes (`plan.on_tpu`), 1.5 times the per-shard
    average M / N (room for hot rows and uneven ownership), and otherwise M: XLA:CPU sorts
    and loops cost more than scanning all pairs. Rounded up to a multiple of 8, at most M.
    A shard owning more than C pairs in a step runs more passes: never drops an id. An
    optimizer that updates every row (`Adam(lazy_adam=False)`) always runs one pass of all M.
    """
    if plan.optimizer.dense_update:
        return positions
    c = plan.max_ids or (-(-3 * positions // (2 * num_shards)) if plan.on_tpu else positions)
    return max(1, min(positions, round_up(c, 8)))


def unique_capacity(plan: TablePlan, pairs: int) -> int:
    """Cu: distinct rows one pass of `pairs` (= C) pairs updates; a pass stops at Cu."""
    if plan.optimizer.dense_update or not plan.max_unique:
        return pairs
    return max(1, min(pairs, round_up(plan.max_unique, 8)))


def planned(plan: TablePlan, positions: int, num_shards: int) -> tuple[int, int]:
    """(pairs, distinct rows) per shard and step that the fused kernels' cost estimates
    assume: `max_ids_per_shard`, else the average M / N; `max_unique_ids_per_shard`, else
    as many as pairs. The kernels walk every owned pair whatever these say; set them to
    the data's expected values (`Embedding.id_counts`) for a true "bytes accessed"."""
    pairs = plan.max_ids or -(-positions // num_shards)
    return pairs, min(plan.max_unique or pairs, pairs)


def round_up(x: int, multiple: int) -> int:
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
class Stream:
    """The (id, position) pairs of one table's features, read C at a time from `start`.

    The positions of all features sharing the table are concatenated; `out` is each pair's
    output row: example b of a pooled feature, or (b, l) of a sequence feature, offset by the
    feature's first row in the concatenation (`parts`). Pairs this shard does not own have
    key NOT_MINE and scale 0. Built in position order; `sorted()` orders the owned pairs by
    row, first, with the payloads riding along in the sort so that each pass reads
    contiguous slices (the TPU compiler charges a 1-D gather a whole tile per element; a
    sort moves only its operands). `fused`: for the Pallas kernels, which walk all owned
    pairs in one call: no passes, no padding; activations and their gradients travel
    lane-dense (`pack`, see `build`).
    """

    keys: jax.Array  # (M [+ C + 1],) local row per pair; padded with NOT_MINE for passes
    out: jax.Array | None  # (M [+ C + 1],) output row per pair; padded with 0. None when
    #                   the keys hold it (`out_bits`).
    scale: jax.Array | None  # (M [+ C + 1],) combiner-scaled weight per pair; padded with
    #                   0. None (fused streams only): 1 for every owned pair.
    count: jax.Array  # () owned pairs
    capacity: int  # C
    pairs: int  # M
    rows: int  # Output rows of all the table's features together.
    parts: list  # [(FeaturePlan, first output row, output rows, rows per device)]
    fused: bool
    pack: int = 1  # Output rows per lane-dense row (fused: the table's k), see _streams.
    out_bits: int = 0  # > 0 (fused only): keys are row << out_bits | output row.

    def sorted(self) -> Stream:
        """Ordered by (key, output row, scale): each row's pairs in one canonical order,
        whatever path or sort reads them, so that the kernels and the passes sum a row's
        gradients alike. Unstable: a stable sort costs the TPU compiler an extra iota
        operand."""
        names = [n for n in ("keys", "out", "scale") if getattr(self, n) is not None]
        arrays = lax.sort(
            tuple(getattr(self, n) for n in names), num_keys=len(names), is_stable=False
        )
        return dataclasses.replace(self, **dict(zip(names, arrays)))

    def window(self, start):
        """(keys, out, scale), each (C,), of the pairs start ... start + C - 1."""
        assert self.out is not None and self.scale is not None, "a stream for passes"
        return tuple(
            lax.dynamic_slice_in_dim(a, start, self.capacity)
            for a in (self.keys, self.out, self.scale)
        )

    def key_at(self, i):
        """The key of pair i (sorted: NOT_MINE past the owned pairs)."""
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

        return lax.while_loop(lambda state: state[0] < self.count, step, (jnp.int32(0), carry))[1]


def _flat_pairs(i: Input, axis, columns: bool):
    """The global batch's (ids, scales), each (B·L,) in position order (`_position`).

    Flattened on the local shard before the all-gather: a (B, L) array with L < 128 is
    lane-padded on TPU, and every op after the gather would pay for it. With `columns`
    (TPU) flattened column by column: the TPU stores a (b, L) int32 array with L < 128
    column-major, so that order is a free reshape where row by row is a transposing copy;
    elsewhere row by row. The
    combiner's per-example sums use the local rows; a plain sum needs no weights at all:
    its scales are None, 1 for every id (padding is never owned). Where the Input holds
    the global (N·b, L) ids or weights (`Input.ids_all`, `weights_all`), they are laid out
    here as the gather would lay them out, and not gathered."""
    f, ids, weights = i.feature, i.ids, i.weights
    flat = (lambda x: x.T.reshape(-1)) if columns else (lambda x: x.reshape(-1))
    b, length = ids.shape
    # A global (N·b, L) array as the tiled all-gather of `flat` of each device's block.
    flat_all = (
        (lambda x: x.reshape(-1, b, length).transpose(0, 2, 1).reshape(-1))
        if columns
        else (lambda x: x.reshape(-1))
    )
    if i.ids_all is None:
        ids_all = lax.all_gather(flat(ids), axis, tiled=True)
    else:
        ids_all = flat_all(i.ids_all)
    if weights is None and (f.config.is_sequence or f.table_config.combiner == "sum"):
        return ids_all, None
    if weights is not None and i.weights_all is not None:
        return ids_all, flat_all(feature_scale(f, i.weights_all))
    w = (ids >= 0).astype(jnp.float32) if weights is None else weights
    return ids_all, lax.all_gather(flat(feature_scale(f, w)), axis, tiled=True)


def _position(pos, local_batch: int, length: int, columns: bool):
    """(example, l) of the flat positions `pos` of _flat_pairs: device blocks of
    local_batch·length positions, each column by column or row by row."""
    if not columns:
        return pos // length, pos % length
    block, within = pos // (local_batch * length), pos % (local_batch * length)
    return block * local_batch + within % local_batch, within // local_batch


def build(
    call: CallPlan, inputs: list, axis: str, *, fused: bool, pack_keys: bool = True
) -> Stream:
    """The Stream of one call's features (`_plan.Input`s), in position order, read
    `call.capacity` pairs at a time.

    `fused`: for the Pallas kernels, which walk all owned pairs in one call: no padding for
    passes, no scales when every one is 1, the output row packed into the key when both fit
    (and `pack_keys`), and output rows laid out lane-dense (`call.k` to a packed row, see
    below)."""
    plan = call.plan
    n = lax.axis_size(axis)
    items = []
    for i in inputs:
        f, ids = i.feature, i.ids
        ids_all, scale = _flat_pairs(i, axis, columns=plan.on_tpu)
        mine, local = owned(plan, f, ids_all, axis)
        b, l = ids.shape[0] * n, ids.shape[1]
        example, position = _position(
            lax.iota(jnp.int32, b * l), ids.shape[0], l, columns=plan.on_tpu
        )
        seq = f.config.is_sequence
        items.append(
            (
                f,
                jnp.where(mine, local, NOT_MINE),
                (mine, scale),
                example * l + position if seq else example,
                b * l if seq else b,
            )
        )
    keys = jnp.concatenate([k for _, k, *_ in items])
    c = call.capacity
    assert c == capacity(plan, keys.shape[0], n), "the call was planned for other shapes"
    k = call.k if fused else 1
    parts, outs, first = [], [], 0
    for f, _, _, out, rows in items:
        # Device d's rows of a feature are [d·r, d·r + local) with `local` rounded up to
        # r, a multiple of k: the feature's (N·r, D) activations, padded to the table's
        # lane width w, pack to (N·r / k, k·w), lane-dense, and each device's share is
        # whole packed rows. A narrow (B, D) array is lane-padded on TPU (D=32: 4x the
        # bytes) in the all-gather, the reduce-scatter and the kernels' VMEM blocks.
        local = rows // n
        r = round_up(local, k)
        parts.append((f, first, n * r, local))
        outs.append(out // local * r + out % local + first)
        first += n * r
    pad = (
        (lambda x, value=0: x)
        if fused
        else (lambda x, value=0: jnp.pad(x, (0, c + 1), constant_values=value))
    )
    # The kernels read scales only for owned pairs: all 1 needs no array at all (one
    # payload less in the sort). The passes read every pair: 0 where not owned.
    scales = [s for _, _, (_, s), *_ in items]
    scale = (
        None
        if fused and all(s is None for s in scales)
        else pad(
            jnp.concatenate(
                [jnp.where(mine, 1.0 if s is None else s, 0.0) for _, _, (mine, s), *_ in items]
            )
        )
    )
    out = jnp.concatenate(outs)
    # The kernels take (row, output row) packed into one key when both fit below
    # NOT_MINE: the sort then moves one array, not two, and so do the kernels.
    bits = max(first - 1, 1).bit_length()
    bits = bits if fused and pack_keys and plan.layout.rows_per_shard << bits <= NOT_MINE else 0
    if bits:
        keys, out = jnp.where(keys < NOT_MINE, keys << bits | out, NOT_MINE), None
    return Stream(
        keys=pad(keys, NOT_MINE),
        out=None if out is None else pad(out),
        scale=scale,
        # Counted on the final keys: one pass over them with the key computation.
        count=jnp.sum(keys < NOT_MINE, dtype=jnp.int32),
        capacity=c,
        pairs=keys.shape[0],
        rows=first,
        parts=parts,
        fused=fused,
        pack=k,
        out_bits=bits,
    )


def output_rows(inputs: list, k: int) -> int:
    """Rows of a table's activations per device, each feature's share rounded up to k:
    b per pooled feature, b·L per sequence feature (see `build`)."""
    return sum(
        round_up(ids.shape[0] * (ids.shape[1] if f.config.is_sequence else 1), k)
        for f, ids, *_ in inputs
    )


def packed(x, packing: _layout.Packing):
    """(r, D) rows, r a multiple of k -> (r / k, k·w) lane-dense (zero lanes past D)."""
    k, w = packing.per_row, packing.padded_width
    x = jnp.pad(x, [(0, 0), (0, w - x.shape[1])])
    return x.reshape(-1, k * w)


def unpacked(x, packing: _layout.Packing, rows: int):
    """The inverse of _packed, then the first `rows` rows."""
    return x.reshape(-1, packing.padded_width)[:rows, : packing.width]


def scatter_parts(acc, stream: Stream, axis: str, packing=None) -> dict:
    """Each feature's activations: its rows of its table's partial sums, reduce-scattered
    over the batch. `acc` is (rows, D), or with `packing` lane-dense (rows / k, k·w) with
    k = stream.pack (_streams), unpacked after the reduce-scatter."""
    out, k = {}, stream.pack
    for f, first, rows, local in stream.parts:
        partial = lax.psum_scatter(
            acc[first // k : (first + rows) // k], axis, scatter_dimension=0, tiled=True
        )
        if packing is not None:
            partial = unpacked(partial, packing, local)
        if f.config.is_sequence:
            partial = partial.reshape(-1, f.config.max_sequence_length, partial.shape[-1])
        out[f.path] = partial
    return out
