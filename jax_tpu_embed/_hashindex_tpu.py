"""The dynamic index's Pallas TPU kernels: `find` by DMA of each id's bucket.

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
(`serves`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _hashindex

_LANES = 128
_BLOCK = 256  # Ids per grid step: their DMAs in flight together, 128 KiB of VMEM.


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
    words = _hashindex.PAD

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
            padding = (h == jnp.uint32(words)) & (l == jnp.uint32(words))
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
    inputs = [pad(hi, jnp.uint32(words)), pad(lo, jnp.uint32(words)), pad(bucket, 0)]
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
    `lane`, where `hit`) gets last = max(last, now) and count + 1, once however many ids
    hit it. The ids come sorted by bucket (`sighted(grouped=True)`), so a slot's hits are
    adjacent. With TTL, the slots freed (`freed_lane` of `local_bucket`, where `freed`)
    get last = count = 0 (their keys are `sighted`'s to clear).

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
    # A slot's hits are adjacent (an id and its copies): only the first counts, which also
    # keeps a run split between grid steps from counting one twice.
    slot = jnp.where(hit, local_bucket * b + lane, -1)
    again = slot == jnp.concatenate([jnp.full((1,), -1, slot.dtype), slot[:-1]])
    at = jnp.where(hit & ~again, (local_bucket % 2) * b + lane, -1)
    marks_in = [at]
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

        def each(fn):
            lax.fori_loop(0, block, lambda p, carry: (fn(p), carry)[1], 0)

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
