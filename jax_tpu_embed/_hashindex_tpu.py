"""The dynamic index's Pallas TPU kernels: `find`, and an update's writes (`scores` of its
hits, `place` of its admitted ids), by DMA of the rows of each id's bucket.

XLA gathers each id's 128-word key window (`_hashindex._key_rows`) into an HBM temporary
and compares it in a second pass: the TPU compiler charges `find` about 1.1 KB an id and a
temporary of the windows (33 MB and 15.8 MB for the 30,720 ids a W1 owner resolves per
round on v5p, docs/design.md). With b = 64 slots a bucket's block-interleaved keys (64 hi
words, then 64 lo words) are exactly one 128-lane row of the keys seen as (buckets, 128),
so here each id's row is one DMA into VMEM, and the compare runs there: 512 bytes an id
read, nothing written but the answers, no temporary.

Per grid step of `block` ids (their words and buckets in SMEM): the block's DMAs are all
started, then waited for, then each id's row is compared in registers (the lo words
brought under the hi words by a lane rotation of 64) and the first matching lane taken.
An id of the same bucket as the one before it in the step reads that one's row: no DMA.
Callers that group ids by bucket (sort them by it) say so, and the cost declared is then
one row per bucket, not per id (`grouped`).
With TTL each id's `last` words come the same way (the row holding its bucket's and its
neighbour's) and expired slots are not found. The result is `_hashindex.find`'s, bit for
bit (the tests compare them in Pallas' interpreter); other bucket sizes keep the XLA form
(`serves`). `scores` and `place` read and write the rows of runs of ids the same way, and
equal `_hashindex`'s writes bit for bit too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _hashindex

_LANES = 128
_BLOCK = 256  # Ids per grid step: their DMAs in flight together, 128 KiB of VMEM.


def _each(block: int, fn) -> None:
    """Inside a kernel: fn(p) for each id p of the grid step's `block`."""
    lax.fori_loop(0, block, lambda p, carry: (fn(p), carry)[1], 0)


def serves(config: _hashindex.IndexConfig) -> bool:
    """Whether `find` takes this index: a bucket's keys fill one 128-lane row (b = 64)."""
    return 2 * config.bucket_size == _LANES


def shard_multiple(bucket_size: int) -> int:
    """What a shard's number of buckets is a multiple of, so that the kernels here take it:
    2 where they serve (two buckets' `last` and `count` to a 128-lane row), else 1."""
    return 2 if 2 * bucket_size == _LANES else 1


def find(
    config: _hashindex.IndexConfig,
    state,
    hi,
    lo,
    local_bucket,
    now,
    interpret=False,
    grouped: bool = False,
):
    """`_hashindex.find` (local row int32, -1 where not found; found bool) of ids of any
    shape in this shard's index, by one DMA of its bucket's keys per id whose bucket is not
    the previous id's, and with TTL one of its `last` words (two buckets' to a 128-lane row;
    a shard of an odd number of buckets takes XLA's `find`).

    `grouped`: the ids (flattened) are sorted by bucket, so they read each bucket's row
    once (and one per grid step). It sets the cost declared to the compiler, not what is
    read; False: every id's row."""
    if config.ttl_steps is not None and (state.keys.shape[0] // (2 * config.bucket_size)) % 2:
        return _hashindex.find(config, state, hi, lo, local_bucket, now)
    row = _find(config, state, hi, lo, local_bucket, now, interpret, grouped, False)
    return row, row >= 0


def find_stale(config: _hashindex.IndexConfig, state, hi, lo, local_bucket, now, interpret=False):
    """`find` that also finds the ids whose slot has expired (TTL), as `sighted` must to
    free them: (row of the id's slot, -1 where none; it holds one; that slot has expired).
    The ids come sorted by bucket (`grouped`); an even number of buckets."""
    row = _find(config, state, hi, lo, local_bucket, now, interpret, True, True)
    expired = row <= -2  # Expired slots come back as -2 - row.
    row = jnp.where(expired, -2 - row, row)
    return row, row >= 0, expired


def _find(config, state, hi, lo, local_bucket, now, interpret, grouped: bool, stale: bool):
    """`find`'s rows, shaped as `hi`; with `stale`, an expired slot's row r as -2 - r."""
    assert serves(config), config
    b = config.bucket_size
    nbl = state.keys.shape[0] // (2 * b)
    ttl = config.ttl_steps
    assert ttl is None or nbl % 2 == 0, "TTL's `last` rows need an even number of buckets"
    shape = jnp.shape(hi)
    hi = jnp.asarray(hi).astype(jnp.uint32).reshape(-1)
    lo = jnp.asarray(lo).astype(jnp.uint32).reshape(-1)
    n = hi.shape[0]
    bucket = jnp.clip(jnp.asarray(local_bucket, jnp.int32).reshape(-1), 0, nbl - 1)
    # SMEM blocks of a power of two >= 128 ids; the padding ids are PAD (never found).
    total = max(-(-n // _LANES) * _LANES, _LANES)
    block = _BLOCK if total % _BLOCK == 0 else _LANES
    pad = lambda x, value: jnp.concatenate([x, jnp.full((total - n,), value, x.dtype)])
    pad_word = _hashindex.PAD  # A Python int: a constant inside the kernels.

    def kernel(*refs):
        if ttl is None:
            hi_ref, lo_ref, bucket_ref, keys_hbm, out_ref, rows, sem = refs
        else:
            hi_ref, lo_ref, bucket_ref, now_ref, keys_hbm, last_hbm = refs[:6]
            out_ref, rows, lasts, sem = refs[6:]

        def copies(p, at):
            out = [pltpu.make_async_copy(keys_hbm.at[pl.ds(at, 1)], rows.at[pl.ds(p, 1)], sem)]
            if ttl is not None:
                half = last_hbm.at[pl.ds(at // 2, 1)]
                out.append(pltpu.make_async_copy(half, lasts.at[pl.ds(p, 1)], sem))
            return out

        def read(p):  # Whether id p reads its row: the step's first, or a new bucket.
            return (p == 0) | (bucket_ref[p] != bucket_ref[jnp.maximum(p - 1, 0)])

        def start(p, carry):
            @pl.when(read(p))
            def _():
                for c in copies(p, bucket_ref[p]):
                    c.start()

            return carry

        def wait(p, carry):
            @pl.when(read(p))
            def _():
                for c in copies(p, 0):  # Waits for one row's bytes: any row of the shape.
                    c.wait()

            return carry

        lax.fori_loop(0, block, start, 0)
        lax.fori_loop(0, block, wait, 0)
        lane = lax.broadcasted_iota(jnp.int32, (1, _LANES), 1)

        def one(p, at):
            at = jnp.where(read(p), p, at)  # The slot its bucket's row was read into.
            row = rows[pl.ds(at, 1), :]
            h, l, g = hi_ref[p], lo_ref[p], bucket_ref[p]
            # Lane j < b: slot j's hi word, and its lo word rotated down from lane b + j.
            same = (row == h) & (pltpu.roll(row, b, 1) == l) & (lane < b)
            old = None  # With `stale`: the lanes of expired matches.
            if ttl is not None:  # Slot j's last: lane j of an even bucket, b + j of an odd.
                last = lasts[pl.ds(at, 1), :]
                last = jnp.where(g % 2 == 1, pltpu.roll(last, b, 1), last)
                live = now_ref[0] - last < ttl
                if stale:  # An id holds at most one slot: its match, expired or not.
                    old = same & ~live
                else:
                    same &= live
            first = jnp.min(jnp.where(same, lane, _LANES))
            padding = (h == jnp.uint32(pad_word)) & (l == jnp.uint32(pad_word))
            out = jnp.where((first < b) & ~padding, g * b + first, -1)
            if old is not None:
                expired = jnp.min(jnp.where(old, lane, _LANES)) < b
                out = jnp.where(expired & (out >= 0), -2 - out, out)
            out_ref[p] = out
            return at

        lax.fori_loop(0, block, one, 0)

    smem = lambda: pl.BlockSpec((block,), lambda i: (i,), memory_space=pltpu.SMEM)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    arrays = [state.keys.reshape(nbl, 2 * b)]
    if ttl is not None:
        arrays.append(state.last.reshape(nbl // 2, 2 * b))
    if not interpret:  # Else the compiler may copy a small shard's arrays into VMEM whole.
        arrays = [pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in arrays]
    inputs = [pad(hi, jnp.uint32(pad_word)), pad(lo, jnp.uint32(pad_word)), pad(bucket, 0)]
    in_specs = [smem(), smem(), smem()]
    scratch = [pltpu.VMEM((block, _LANES), jnp.uint32)]
    if ttl is not None:
        inputs.append(jnp.asarray(now, jnp.int32).reshape(1))
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        scratch.append(pltpu.VMEM((block, _LANES), jnp.int32))
    # Rows read: one per id, or per run of a bucket (and grid step, and the padding's).
    reads = total
    if grouped:
        reads = min(total, nbl + 2 + total // block)
    row = pl.pallas_call(
        kernel,
        grid=(total // block,),
        in_specs=in_specs + [hbm] * len(arrays),
        out_specs=smem(),
        out_shape=jax.ShapeDtypeStruct((total,), jnp.int32),
        scratch_shapes=scratch + [pltpu.SemaphoreType.DMA(())],
        # Its buckets' rows (512 bytes each) by DMA; per id 3 words in, 1 out through SMEM.
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=reads * len(arrays) * _LANES * 4 + total * 16,
        ),
        interpret=interpret,
    )(*inputs, *arrays)[:n]
    return row.reshape(shape)


def serves_scores(config: _hashindex.IndexConfig, state) -> bool:
    """Whether `scores` takes this shard: `serves`, and an even number of buckets (two to a
    128-lane row of `last` and `count`)."""
    return serves(config) and (state.last.shape[0] // config.bucket_size) % 2 == 0


def scores(
    config: _hashindex.IndexConfig,
    state,
    local_bucket,
    lane,
    hit,
    now,
    interpret=False,
    freed=None,
    freed_lane=None,
):
    """`sighted`'s writes of its hits, (last, count): each hit slot (bucket `local_bucket`,
    `lane`, where `hit`) gets last = max(last, now) and count + 1. The ids come sorted by
    bucket (`sighted(grouped=True)`), and `hit` holds one hit of a slot: a caller with
    copies of an id passes the hit of one of them (`sighted`'s `distinct`). Two would
    count twice where a grid step's edge falls between them, each step reading and writing
    the row. With TTL, the slots freed (`freed_lane` of `local_bucket`, where `freed`) get
    last = count = 0 (their keys are `sighted`'s to clear).

    Per grid step of `block` ids: one DMA of each run's 128-lane rows of `last` and
    `count` (two buckets each), the run's hits marked in VMEM, and the rows with a mark
    written back. The windowed scatters XLA makes of these writes cost the TPU compiler
    about three times the rows they move (docs/design.md)."""
    b = config.bucket_size
    nbl = state.last.shape[0] // b
    assert serves_scores(config, state), (config, nbl)
    n = local_bucket.shape[0]
    total = max(-(-n // _LANES) * _LANES, _LANES)
    block = _BLOCK if total % _BLOCK == 0 else _LANES
    # The padding's row is the last one: after every id's, so the ids stay sorted.
    row = jnp.clip(jnp.asarray(local_bucket, jnp.int32), 0, nbl - 1) // 2
    marks_in = [jnp.where(hit, (local_bucket % 2) * b + lane, -1)]
    if freed is not None:  # Clearing a lane twice clears it: no first needed.
        marks_in.append(jnp.where(freed, (local_bucket % 2) * b + freed_lane, -1))
    pad = lambda x, value: jnp.concatenate([x, jnp.full((total - n,), value, x.dtype)])

    def kernel(row_ref, *refs):
        k = len(marks_in)
        at_ref, gone_ref = refs[0], refs[1] if freed is not None else None
        now_ref, _, _, last_out, count_out = refs[k : k + 5]  # The outputs alias the inputs.
        lasts, counts, marks, sem = refs[k + 5 :]

        def copies(p, r, out):  # Row r of last and count to slot p (back, `out`).
            pairs = [(last_out, lasts), (count_out, counts)]
            pairs = [(hbm.at[pl.ds(r, 1)], vmem.at[pl.ds(p, 1)]) for hbm, vmem in pairs]
            pairs = [(dst, src) if out else (src, dst) for src, dst in pairs]
            return [pltpu.make_async_copy(src, dst, sem) for src, dst in pairs]

        def first(p):  # The step's first id, or the first of a row.
            return (p == 0) | (row_ref[p] != row_ref[jnp.maximum(p - 1, 0)])

        each = functools.partial(_each, block)

        def start_read(p):
            @pl.when(first(p))
            def _():
                marks[pl.ds(p, 1), :] = jnp.zeros((1, _LANES), jnp.int32)
                for c in copies(p, row_ref[p], False):
                    c.start()

        def wait(out):
            def fn(p):
                @pl.when(first(p))
                def _():
                    for c in copies(p, 0, out):  # One row's bytes: any row of the shape.
                        c.wait()

            return fn

        each(start_read)
        each(wait(False))
        lanes = lax.broadcasted_iota(jnp.int32, (1, _LANES), 1)

        def mark(p, slot):
            slot = jnp.where(first(p), p, slot)
            mark = (lanes == at_ref[p]).astype(jnp.int32)
            if gone_ref is not None:
                mark |= 2 * (lanes == gone_ref[p]).astype(jnp.int32)
            marks[pl.ds(slot, 1), :] |= mark
            return slot

        lax.fori_loop(0, block, mark, 0)

        def written(p):
            return first(p) & (jnp.max(marks[pl.ds(p, 1), :]) > 0)

        def start_write(p):
            @pl.when(written(p))
            def _():
                m = marks[pl.ds(p, 1), :]
                hits, cleared = (m & 1) > 0, (m & 2) > 0
                last = lasts[pl.ds(p, 1), :]
                last = jnp.where(hits, jnp.maximum(last, now_ref[0]), last)
                lasts[pl.ds(p, 1), :] = jnp.where(cleared, 0, last)
                count = counts[pl.ds(p, 1), :] + hits.astype(jnp.int32)
                counts[pl.ds(p, 1), :] = jnp.where(cleared, 0, count)
                for c in copies(p, row_ref[p], True):
                    c.start()

        def wait_written(p):
            @pl.when(written(p))
            def _():
                for c in copies(p, 0, True):
                    c.wait()

        each(start_write)
        each(wait_written)

    smem = lambda: pl.BlockSpec((block,), lambda i: (i,), memory_space=pltpu.SMEM)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    rows = [state.last.reshape(nbl // 2, _LANES), state.count.reshape(nbl // 2, _LANES)]
    if not interpret:  # Else the compiler may copy a small shard's arrays into VMEM whole.
        rows = [pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in rows]
    # Rows read and written: one per run of a row (and grid step, and the padding's).
    moved = min(total, nbl // 2 + 1 + total // block)
    last, count = pl.pallas_call(
        kernel,
        grid=(total // block,),
        in_specs=[smem()] * (1 + len(marks_in)) + [pl.BlockSpec(memory_space=pltpu.SMEM), hbm, hbm],
        out_specs=[hbm, hbm],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in rows],
        scratch_shapes=[pltpu.VMEM((block, _LANES), jnp.int32)] * 3 + [pltpu.SemaphoreType.DMA(())],
        input_output_aliases={2 + len(marks_in): 0, 3 + len(marks_in): 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        # Two rows of 512 bytes read and written per run; per id its words through SMEM.
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=moved * 4 * _LANES * 4 + total * 4 * (1 + len(marks_in)),
        ),
        interpret=interpret,
    )(
        pad(row, row[-1] if n else 0),
        *[pad(x, -1) for x in marks_in],
        jnp.asarray(now, jnp.int32).reshape(1),
        *rows,
    )
    return last.reshape(-1), count.reshape(-1)


def place(config: _hashindex.IndexConfig, state, hi, lo, local_bucket, admit, now, interpret=False):
    """`_hashindex.place` ((state, local row int32 (-1 where not placed), placed), (n,) ids)
    of ids sorted by (local bucket, priority), as an update's round brings them to their
    owner (`_dynamic_owner._merged`); an even number of buckets (`serves_scores`).

    One id at a time, each admitted id takes the first slot of its bucket's order (free,
    then expired, then evictable, by score, then key) as its bucket stands after the ids
    before it; that slot then holds last == now, so it is unavailable to the next, and the
    others keep their order: the slots `place`'s ranks pick in one call. Per grid step of
    `block` ids: one DMA of each run's key row (one bucket) and of its `last` and `count`
    rows (two buckets each), the placements made in VMEM, and the rows changed written
    back. XLA's `place` reads, orders and rewrites (U, 64) windows: the TPU compiler
    charges it about 17 KiB an id (docs/design.md)."""
    b = config.bucket_size
    nbl = state.last.shape[0] // b
    assert serves_scores(config, state), (config, nbl)
    hi = jnp.asarray(hi).astype(jnp.uint32).reshape(-1)
    lo = jnp.asarray(lo).astype(jnp.uint32).reshape(-1)
    pad_word = _hashindex.PAD
    admit = jnp.asarray(admit, bool).reshape(-1) & ~(
        (hi == jnp.uint32(pad_word)) & (lo == jnp.uint32(pad_word))
    )
    n = hi.shape[0]
    total = max(-(-n // _LANES) * _LANES, _LANES)
    block = _BLOCK if total % _BLOCK == 0 else _LANES
    bucket = jnp.clip(jnp.asarray(local_bucket, jnp.int32).reshape(-1), 0, nbl - 1)
    ttl, eviction = config.ttl_steps, config.eviction

    def signed(x):  # uint32 -> int32 of the same order.
        return lax.bitcast_convert_type(x ^ jnp.uint32(0x80000000), jnp.int32)

    def kernel(hi_ref, lo_ref, bucket_ref, admit_ref, now_ref, *refs):
        _, _, _, keys_out, last_out, count_out, row_ref, taken_ref = refs[:8]  # Aliased.
        keys_v, last_v, count_v, dirty, sem = refs[8:]

        def copies(p, out):  # Its bucket's key row and its `last` and `count` rows.
            g = bucket_ref[p]
            pairs = [
                (keys_out, keys_v, g),
                (last_out, last_v, g // 2),
                (count_out, count_v, g // 2),
            ]
            pairs = [(hbm.at[pl.ds(r, 1)], vmem.at[pl.ds(p, 1)]) for hbm, vmem, r in pairs]
            pairs = [(dst, src) if out else (src, dst) for src, dst in pairs]
            return [pltpu.make_async_copy(src, dst, sem) for src, dst in pairs]

        def new_bucket(p):  # The step's first id, or the first of a bucket.
            return (p == 0) | (bucket_ref[p] != bucket_ref[jnp.maximum(p - 1, 0)])

        def new_row(p):  # The step's first id, or the first of a `last` row.
            return (p == 0) | (bucket_ref[p] // 2 != bucket_ref[jnp.maximum(p - 1, 0)] // 2)

        each = functools.partial(_each, block)

        def moves(op, out, keyed, rowed):  # `op` ("start", "wait") on id p's copies.
            def fn(p):
                c = copies(p, out)

                @pl.when(keyed(p))
                def _():
                    getattr(c[0], op)()

                @pl.when(rowed(p))
                def _():
                    getattr(c[1], op)()
                    getattr(c[2], op)()

            return fn

        # Each bucket's key row goes to VMEM row p of its first id, each `last` and `count`
        # row to that of its first id; a row's copies that are not its first are unused.
        def clean(p):
            dirty[p] = 0

        each(clean)
        each(moves("start", False, new_bucket, new_row))
        each(moves("wait", False, new_bucket, new_row))
        lanes = lax.broadcasted_iota(jnp.int32, (1, _LANES), 1)
        now = now_ref[0]

        def one(p, at):
            k_at = jnp.where(new_bucket(p), p, at[0])
            r_at = jnp.where(new_row(p), p, at[1])
            g = bucket_ref[p]
            row_ref[p] = -1
            taken_ref[p] = 0

            @pl.when(admit_ref[p] != 0)
            def _():
                keys = keys_v[pl.ds(k_at, 1), :]
                odd = g % 2 == 1
                # Lane j < b: slot j's words (the lo words rotated down from lane b + j).
                k_hi, k_lo = keys, pltpu.roll(keys, b, 1)
                last_row, count_row = last_v[pl.ds(r_at, 1), :], count_v[pl.ds(r_at, 1), :]
                last = jnp.where(odd, pltpu.roll(last_row, b, 1), last_row)
                count = jnp.where(odd, pltpu.roll(count_row, b, 1), count_row)
                occupied = (k_hi != jnp.uint32(pad_word)) | (k_lo != jnp.uint32(pad_word))
                expired = occupied & ((now - last >= ttl) if ttl is not None else False)
                evictable = occupied & ~expired & (last < now)
                if eviction == "none":
                    evictable = jnp.zeros_like(evictable)
                cls = jnp.where(~occupied, 0, jnp.where(expired, 1, jnp.where(evictable, 2, 3)))
                keyed = (cls == 1) | (cls == 2)
                prio = _hashindex.priority(config, k_hi, k_lo)
                if eviction == "lfu":
                    score = [
                        jnp.where(cls == 2, count, jnp.where(keyed, last, 0)),
                        jnp.where(cls == 2, last, 0),
                    ]
                else:
                    score = [jnp.where(keyed, last, 0)]
                tail = [
                    jnp.where(keyed, signed(prio), signed(lanes.astype(jnp.uint32))),
                    jnp.where(keyed, signed(k_hi), 0),
                    jnp.where(keyed, signed(k_lo), 0),
                ]
                # The first slot of the order (cls, *score, *tail), among the available.
                cand = (lanes < b) & (cls < 3)
                for word in [cls, *score, *tail]:
                    best = jnp.min(jnp.where(cand, word, jnp.int32(2**31 - 1)))
                    cand &= word == best
                lane = jnp.min(jnp.where(cand, lanes, _LANES))

                @pl.when(lane < b)
                def _():
                    taken = jnp.max(jnp.where(lanes == lane, cls, 0))
                    row_ref[p] = g * b + lane
                    taken_ref[p] = taken
                    keys_v[pl.ds(k_at, 1), :] = jnp.where(
                        lanes == lane, hi_ref[p], jnp.where(lanes == lane + b, lo_ref[p], keys)
                    )
                    at_row = lanes == lane + jnp.where(odd, b, 0)
                    last_v[pl.ds(r_at, 1), :] = jnp.where(at_row, now, last_row)
                    count_v[pl.ds(r_at, 1), :] = jnp.where(at_row, 1, count_row)
                    dirty[k_at] |= 1
                    dirty[r_at] |= 2

            return k_at, r_at

        lax.fori_loop(0, block, one, (0, 0))

        keyed, rowed = (lambda p: (dirty[p] & 1) > 0), (lambda p: (dirty[p] & 2) > 0)
        each(moves("start", True, keyed, rowed))
        each(moves("wait", True, keyed, rowed))

    smem = lambda: pl.BlockSpec((block,), lambda i: (i,), memory_space=pltpu.SMEM)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    arrays = [
        state.keys.reshape(nbl, _LANES),
        state.last.reshape(nbl // 2, _LANES),
        state.count.reshape(nbl // 2, _LANES),
    ]
    if not interpret:  # Else the compiler may copy a small shard's arrays into VMEM whole.
        arrays = [pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in arrays]
    pad = lambda x, value: jnp.concatenate([x, jnp.full((total - n,), value, x.dtype)])
    # Rows read and written: per run of a bucket (and grid step, and the padding's), three.
    moved = min(total, nbl + 1 + total // block)
    keys, last, count, row, taken = pl.pallas_call(
        kernel,
        grid=(total // block,),
        in_specs=[smem()] * 4 + [pl.BlockSpec(memory_space=pltpu.SMEM)] + [hbm] * 3,
        out_specs=[hbm, hbm, hbm, smem(), smem()],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]
        + [jax.ShapeDtypeStruct((total,), jnp.int32)] * 2,
        scratch_shapes=[
            pltpu.VMEM((block, _LANES), jnp.uint32),
            pltpu.VMEM((block, _LANES), jnp.int32),
            pltpu.VMEM((block, _LANES), jnp.int32),
            pltpu.SMEM((block,), jnp.int32),
            pltpu.SemaphoreType.DMA(()),
        ],
        input_output_aliases={5: 0, 6: 1, 7: 2},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        # Three rows of 512 bytes read and written per run; per id 4 words in, 2 out.
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=moved * 6 * _LANES * 4 + total * 4 * 6
        ),
        interpret=interpret,
    )(
        pad(hi, jnp.uint32(pad_word)),
        pad(lo, jnp.uint32(pad_word)),
        pad(bucket, bucket[-1] if n else 0),  # After every id's: the ids stay sorted.
        pad(admit.astype(jnp.int32), 0),
        jnp.asarray(now, jnp.int32).reshape(1),
        *arrays,
    )
    row, taken = row[:n], taken[:n]
    placed = row >= 0
    new = dataclasses.replace(
        state,
        keys=keys.reshape(-1),
        last=last.reshape(-1),
        count=count.reshape(-1),
        stats=state.stats + _hashindex.placed_tally(admit, placed, taken)[None, :],
    )
    return new, row, placed
