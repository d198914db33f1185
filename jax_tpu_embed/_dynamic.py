"""Dynamic tables: any int64 id, mapped to the rows of a fixed-capacity table by an index.

A dynamic table (`TableConfig(dynamic=jte.DynamicTable(...))`) is stored as a static table
of `capacity` rows, its *slot table*, plus an index (`_hashindex`) from ids to those rows.
The engine behind `Embedding` only ever sees slot tables: before the row work, each
dynamic feature's ids are resolved to rows of its slot table, and the feature goes on as a
weighted feature of a static table with the "sum" combiner, its weights already scaled by
the table's own combiner over every id it holds (found or not). So every exchange, row
kernel, optimizer, stacking rule and checkpoint path serves dynamic tables unchanged, and
the row kernels never learn that a row belongs to an id.

Resolution runs under `shard_map`, on the shard that owns each id's bucket (the index is
row-sharded by buckets, "div" over buckets, so which ids are resident does not depend on
the mesh): each device all-gathers the table's ids of the global batch, the owner finds
the ids it owns (lookup) or finds, admits and evicts the distinct ones (update), and one
reduce-scatter brings each device its examples' rows. On TPU layouts and under owner
routing each device sends its own ids to their owners instead (`_dynamic_owner`,
`with_kernel`). An id with no row (never admitted, refused, evicted, expired) reads its
*initial row*: the default initializer's truncated normal, drawn from a hash of (table
key, id), so it is the same on every mesh and capacity; a row the update gives to a new
id is reset to it, and its slots to their initial values, before the optimizer step.

Ids travel as two uint32 halves (`SplitIds`), so nothing needs `jax_enable_x64`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import (
    _config,
    _hashindex,
    _hashindex_cpu,
    _hashindex_tpu,
    _inputs,
    _loops,
    _storage,
    initializers,
)

PAD = _inputs.PAD  # Both halves of the id -1: padding, and an empty slot in the index.
SplitIds = _inputs.SplitIds
split_ids = _inputs.split_ids
join_ids = _inputs.join_ids


class DynamicRows(NamedTuple):
    """A dynamic table's live rows: `ids` int64 (n,) ascending, `rows` (n, D) in the table's
    dtype as `export` gives a static table's (or a slot's (n, D) / (n,)), row i belonging
    to ids[i]. What `export` gives and `restore_tables` takes for a dynamic table."""

    ids: np.ndarray
    rows: np.ndarray

    def to_dict(self) -> dict[int, np.ndarray]:
        return {int(i): r for i, r in zip(self.ids, self.rows)}


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["index", "key", "cache"], meta_fields=[]
)
@dataclasses.dataclass
class DynamicState:
    """One dynamic table's state beside its slot table: the index, the table's key
    (uint32 (2,), replicated) that its initial rows are drawn from, and for a `HostCached`
    table its caches (`_placement.CacheState`; None otherwise)."""

    index: Any  # _hashindex.IndexState
    key: Any
    cache: Any = None


@dataclasses.dataclass(frozen=True)
class DynamicPlan:
    """A dynamic table as the engine stores it: its index's configuration and the features
    that look it up ({path: FeatureConfig as the user gave it})."""

    name: str
    index: _hashindex.IndexConfig
    dim: int
    features: Mapping[str, _config.FeatureConfig]
    kernel: str = "xla"  # Who runs the index: "xla" (_hashindex) or "cpu" (_hashindex_cpu).
    compact: bool = False  # Resolve each shard's ids in passes of `capacity` (TPU layouts).
    window: int | None = None  # Distinct ids per pass when given (max_ids_per_shard).
    # How a device's ids reach their buckets' owners: "gather" (every device all-gathers
    # the global batch's ids, below) or "owner" (`_dynamic_owner`: each device sends its
    # own to their owners); `with_kernel` decides.
    route: str = "gather"
    # Who finds ids in the index (lookups, and the updates' hits) where `kernel` is "xla":
    # "xla", or the Pallas kernel (`_hashindex_tpu`, "pallas" or "pallas_interpret")
    # beside the Pallas row kernels.
    finder: str = "xla"
    # The table's row initializer (`jte.initializers.of`; None: the default): what an id's
    # initial row is drawn with, from a hash of (table, id).
    draw: initializers.RowInitializer | None = None

    @property
    def interpret(self) -> bool:
        """Whether the Pallas kernels run in Pallas' interpreter (tests on CPU)."""
        return self.finder == "pallas_interpret"

    @property
    def compaction(self) -> str:
        """How a few entries of a mask are moved to the front (`_first`): "sort" on TPU
        layouts, "cpu" (a C++ kernel) beside the C++ index, else "nonzero"."""
        return "sort" if self.compact else "cpu" if self.kernel == "cpu" else "nonzero"

    @property
    def rows(self) -> int:
        """Rows of the slot table (the capacity rounded up to whole buckets per shard)."""
        return self.index.buckets * self.index.bucket_size


def engine_spec(spec: _config.EmbeddingSpec, num_shards: int):
    """(the spec the engine runs, {table name: DynamicPlan}): each dynamic table replaced by
    its slot table (a static table of the same name, dim, optimizer and dtype, combiner
    "sum"), each of its features by one on the slot table. A spec without dynamic tables
    is returned as it is."""
    tables = spec.tables()
    dynamic = {n: t for n, t in tables.items() if t.dynamic is not None}
    if not dynamic:
        return spec, {}
    for name, t in dynamic.items():
        opt = spec.optimizer_of(t)
        random = [s.name for s in opt.slot_specs() if callable(s.initializer)]
        if opt.dense_update:
            raise ValueError(
                f"Table {name!r}: {type(opt).__name__} updates every row each step; a dynamic "
                f"table's rows belong to ids only while they are resident. Use a sparse "
                f"optimizer."
            )
        if random:
            raise ValueError(
                f"Table {name!r}: a dynamic table resets a new id's slots to their initial "
                f"values inside the update; slots {random} of {type(opt).__name__} have "
                f"random initializers. Give them constant initial values."
            )
    slot_tables = {}
    plans = {}
    for name, t in dynamic.items():
        d = t.dynamic
        assert d is not None
        b = d.bucket_size
        buckets = -(-d.capacity // b)
        whole = num_shards * _hashindex_tpu.shard_multiple(b)
        buckets = -(-buckets // whole) * whole
        filter_buckets = 0
        if d.min_count > 1:  # NF divides NB and splits over the shards (_hashindex).
            target = -(-(d.filter_capacity or d.capacity) // b)
            r = max(1, buckets // target)
            while buckets % r or (buckets // r) % num_shards:
                r -= 1
            filter_buckets = buckets // r
        index = _hashindex.IndexConfig(
            buckets=buckets,
            bucket_size=b,
            eviction=d.eviction,
            ttl_steps=d.ttl_steps,
            min_count=d.min_count,
            admit_probability=float(d.admit_probability),
            filter_buckets=filter_buckets,
            seed=_storage.table_seed(name),
        )
        slot_tables[id(t)] = dataclasses.replace(
            t, vocabulary_size=buckets * b, dynamic=None, combiner="sum", name=name
        )
        feats = {p: f for p, f in spec.flat_features if f.table is t}
        draw = initializers.of(t.initializer)  # A row initializer: `TableConfig` checks.
        plans[name] = DynamicPlan(name, index, t.dim, feats, draw=draw)
    flat = {
        p: dataclasses.replace(f, table=slot_tables[id(f.table)])
        if id(f.table) in slot_tables
        else f
        for p, f in spec.flat_features
    }
    return dataclasses.replace(spec, features=_config.unflatten(flat)), plans


# ------------------------------------------------------------------------------ inputs


def is_pad(hi, lo):
    return (hi == jnp.uint32(PAD)) & (lo == jnp.uint32(PAD))


def split_leaf(path: str, feature: _config.FeatureConfig, leaf):
    """A dynamic feature's leaf (ids (B,) or (B, L): SplitIds, or signed integers, int32
    values sign-extended; or `Weighted` of these) -> (hi, lo, weights or None), uint32
    (B, L) halves laid out as the feature's ids are (sequence features padded or cut to
    their length). NumPy int64 is split on the host; everything else is traceable."""
    ids, weights = (leaf.ids, leaf.weights) if isinstance(leaf, _inputs.Weighted) else (leaf, None)
    if isinstance(ids, SplitIds):
        hi, lo = jnp.asarray(ids.hi), jnp.asarray(ids.lo)
        for half, x in (("hi", hi), ("lo", lo)):
            if x.dtype != jnp.uint32:
                raise ValueError(
                    f"Feature {path!r}: SplitIds.{half} has dtype {x.dtype}; both halves "
                    f"must be uint32 (jte.split_ids makes them)."
                )
        if hi.shape != lo.shape:
            raise ValueError(
                f"Feature {path!r}: SplitIds halves have shapes {hi.shape} and {lo.shape}."
            )
    else:
        if isinstance(ids, (np.ndarray, list, tuple, int, np.integer)):
            host = np.asarray(ids)
            if host.dtype.kind in "iu" and host.dtype.itemsize == 8:
                if host.dtype == np.uint64:
                    raise ValueError(
                        f"Feature {path!r}: ids have dtype uint64; a dynamic table takes "
                        f"int64 ids (view them as int64)."
                    )
                s = split_ids(host)
                hi, lo = jnp.asarray(s.hi), jnp.asarray(s.lo)
                return _shaped(feature, hi, lo, weights)
        x = jnp.asarray(ids)
        if not jnp.issubdtype(x.dtype, jnp.signedinteger):
            raise ValueError(
                f"Feature {path!r}: ids have dtype {x.dtype}; a dynamic table takes int64 "
                f"ids (NumPy), jte.SplitIds (under jit), or int32 (sign-extended)."
            )
        x = x.astype(jnp.int32)
        hi = jnp.where(x < 0, jnp.uint32(PAD), jnp.uint32(0))
        lo = lax.bitcast_convert_type(x, jnp.uint32)
    return _shaped(feature, hi, lo, weights)


def _shaped(feature, hi, lo, weights):
    if hi.ndim == 1:
        hi, lo = hi[:, None], lo[:, None]
        weights = None if weights is None else jnp.asarray(weights)[:, None]
    if feature.is_sequence:
        length = feature.max_sequence_length
        if hi.shape[1] > length:
            hi, lo = hi[:, :length], lo[:, :length]
            weights = None if weights is None else jnp.asarray(weights)[:, :length]
        elif hi.shape[1] < length:
            pad = ((0, 0), (0, length - hi.shape[1]))
            hi = jnp.pad(hi, pad, constant_values=jnp.uint32(PAD))
            lo = jnp.pad(lo, pad, constant_values=jnp.uint32(PAD))
            weights = None if weights is None else jnp.pad(jnp.asarray(weights), pad)
    return hi, lo, weights


def scaled_weights(feature: _config.FeatureConfig, combiner: str, hi, lo, weights):
    """(B, L) float32: each position's factor in the combined output, the table's combiner
    applied over every id the example holds (found or not); 0 at padding."""
    valid = ~is_pad(hi, lo)
    w = valid.astype(jnp.float32) if weights is None else jnp.where(valid, weights, 0.0)
    w = w.astype(jnp.float32)
    if feature.is_sequence:
        return w
    return _inputs.combiner_scale(w, combiner, unit=weights is None)


def id_words(hi, lo):
    """One uint32 per id for its initial row: a hash of both halves."""
    return _storage.mix32(hi ^ _storage.mix32(lo + jnp.uint32(0x9E3779B9)))


def initial_rows_where(key, hi, lo, mask, dim: int, how: str = "nonzero", draw=None):
    """`initial_rows` where `mask`, zeros elsewhere, drawing only the masked ones while they
    are at most an eighth of all (a trained table's lookups and updates mostly find their
    ids), every row otherwise: the same values either way."""
    shape, n = mask.shape, mask.size
    flat = mask.reshape(-1)

    def few(k):
        at, (p_hi, p_lo) = _first(flat, k, hi.reshape(-1), lo.reshape(-1), how=how)
        rows = initial_rows(key, p_hi, p_lo, dim, draw)
        out = jnp.zeros((n, dim), jnp.float32).at[at].set(rows, mode="drop")
        return out.reshape(shape + (dim,))

    def every():
        return jnp.where(mask[..., None], initial_rows(key, hi, lo, dim, draw), 0.0)

    return _by_count(jnp.sum(flat, dtype=jnp.int32), n, few, every, shape + (dim,), how)


def missing_rows(key, hi, lo, scale, missing, dim: int, how: str = "nonzero", draw=None):
    """Σ_l scale·(initial row) over the positions `missing` of (b, L) ids: (b, dim) float32,
    a combined feature's part from its ids without a row. Draws only those while they are
    at most `_few` of all, adding them into their examples; every row otherwise (on TPU
    layouts as soon as one is missing: `_by_count`)."""
    b, length = missing.shape
    n = missing.size

    def few(k):
        flat = lambda x: x.reshape(-1)
        at, (p_hi, p_lo, p_scale) = _first(
            flat(missing), k, flat(hi), flat(lo), flat(scale), how=how
        )
        rows = initial_rows(key, p_hi, p_lo, dim, draw)
        part = jnp.where((at < n)[:, None], p_scale[:, None] * rows, 0.0)
        return jnp.zeros((b, dim), jnp.float32).at[at // length].add(part, mode="drop")

    def term(k, out):
        rows = scale[:, k, None] * initial_rows(key, hi[:, k], lo[:, k], dim, draw)
        return out + jnp.where(missing[:, k, None], rows, 0.0)

    def every():
        # Added in position order, as `few` adds them: an example's sum has the same bits
        # whichever branch its device takes (a device's count depends on the mesh). On TPU
        # layouts unrolled, which XLA fuses into one pass (a reduction over the (b, L, dim)
        # rows, the TPU compiler writes them to HBM first: docs/design.md); else a loop.
        out = jnp.zeros((b, dim), jnp.float32)
        if how == "sort" and length <= UNROLLED:
            for k in range(length):
                out = term(k, out)
            return out
        return lax.fori_loop(0, length, term, out)

    count = jnp.sum(missing, dtype=jnp.int32)
    return _by_count(count, n, few, every, (b, dim), how)


def _by_count(count, n: int, few, every, shape, how: str):
    """Zeros of `shape` when `count` (of n ids) is 0, `few(k)` for the smallest of k = n/512,
    n/64 and n/8 that holds them, else `every()`: a trained table's steps need few initial
    rows or none, and then draw few or none. On TPU layouts (`how` "sort") `every()` as soon
    as one is needed: drawing a row is a few vector operations a value there, and moving
    the few to the front costs more bytes than drawing them all (docs/design.md). With a
    symbolic n (a serving lookup exported for any batch size) `every()` too."""
    few_ok = how != "sort" and isinstance(n, int)
    sizes = sorted({_few(n, FEW), _few(n, ROUND), _few(n)} - {n}) if few_ok else []
    branches = [lambda: jnp.zeros(shape, jnp.float32)]
    branches += [functools.partial(few, k) for k in sizes] + [every]
    index = (count > 0).astype(jnp.int32)
    for k in sizes:
        index += (count > k).astype(jnp.int32)
    return lax.switch(index, branches)


def initial_rows(key, hi, lo, dim: int, draw: initializers.RowInitializer | None = None):
    """(..., dim) float32: the initial rows of ids (hi, lo) of a table with key words `key`
    ((2,) uint32): its row initializer's (`DynamicPlan.draw`; None: the default's truncated
    normal), a hash of (key, id)."""
    return initializers.rows_of(key[0], key[1], id_words(hi, lo), dim, draw)


# --------------------------------------------------------------------- the shard's work


def gather_ids(tables: list, axis) -> list:
    """Inside shard_map: every dynamic table's ids of the global batch, in one all-gather
    (a collective costs its latency once, not twice per table). `tables`: per table, its
    features' (hi, lo) parts, (b, L) uint32 each. Returns per table (hi, lo), (P,) each:
    device by device, each device's features flattened and joined."""
    if not tables:
        return []
    flat = lambda parts: jnp.concatenate([x.reshape(-1) for x in parts])
    words = [flat([h for h, _ in parts] + [lo for _, lo in parts]) for parts in tables]
    every = lax.all_gather(jnp.concatenate(words), axis)  # (N, Σ 2·M)
    out, start = [], 0
    for w in words:
        m = w.shape[0] // 2
        out.append(
            (
                every[:, start : start + m].reshape(-1),
                every[:, start + m : start + 2 * m].reshape(-1),
            )
        )
        start += 2 * m
    return out


def by_feature(x, shapes: list, n: int) -> list:
    """A table's values at the positions of `n` devices ((P,) or (n, P / n): device by
    device, each device's features flattened and joined, as `gather_ids` lays them out)
    -> per feature, its (n·b, L) array from its (b, L) shape in `shapes`."""
    x = x.reshape(n, -1)
    out, start = [], 0
    for shape in shapes:
        m = int(np.prod(shape))
        out.append(x[:, start : start + m].reshape((n * shape[0],) + tuple(shape[1:])))
        start += m
    return out


def scatter_rows(tables: list, shapes: list, everywhere: list, axis) -> list:
    """Inside shard_map: every dynamic table's rows back to the examples' devices, and to
    every device for the tables whose slot-table exchange gathers the global batch's ids.
    `tables`: per table, (P,) int32, its row + 1 at the positions this shard owns and 0
    elsewhere (each position has one owner, so the sum over devices is its row + 1);
    `shapes`: per table, its features' (b, L); `everywhere`: per table, whether every
    device needs its rows. Returns per table the list of its features' (rows of this
    device's examples (b, L), rows of the global batch (N·b, L) or None), -1 where an id
    has none. The global rows are what the exchange would all-gather
    (`_plan.Input.ids_all`): one all-reduce for those tables replaces a reduce-scatter and
    then an all-gather per feature; the others share one reduce-scatter."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    out: list = [None] * len(tables)
    for wanted in (True, False):
        which = [t for t in range(len(tables)) if everywhere[t] == wanted]
        if not which:
            continue
        joined = jnp.concatenate([tables[t].reshape(n, -1) for t in which], axis=1)
        if wanted:  # (N, Σ): every device's positions.
            every = lax.psum(joined, axis) - 1
        else:  # (1, Σ): this device's positions (row `me` of `joined`).
            every = lax.psum_scatter(joined.reshape(-1), axis, scatter_dimension=0, tiled=True)
            every = every[None] - 1
        start = 0
        for t in which:
            width = tables[t].size // n
            rows = by_feature(every[:, start : start + width], shapes[t], every.shape[0])
            if wanted:
                mine = [
                    lax.dynamic_slice_in_dim(r, me * s[0], s[0]) for r, s in zip(rows, shapes[t])
                ]
                out[t] = list(zip(mine, rows))
            else:
                out[t] = [(r, None) for r in rows]
            start += width
    return out


def with_kernel(plan: DynamicPlan, table_plan) -> DynamicPlan:
    """The plan with its index run by the C++ kernel when its slot table's backend is the
    C++ one ("cpu") and the kernel builds here, else by XLA ops. XLA ops resolve ids at
    their owners (`_dynamic_owner`) under owner routing and wherever the slot table is laid
    out for TPU: the TPU compiler charges the all-gather resolution's sorts of the global
    batch more than the exchange, from 4 chips on (docs/design.md); elsewhere, and for
    what cannot route, by all-gather, in passes (`capacity`) on TPU layouts."""
    cpu = table_plan.backend.name == "cpu" and _hashindex_cpu.available()
    owner = not cpu and (table_plan.routing == "owner" or table_plan.on_tpu)
    pallas = table_plan.backend.name in ("pallas", "pallas_interpret")
    return dataclasses.replace(
        plan,
        kernel="cpu" if cpu else "xla",
        compact=table_plan.on_tpu,
        window=table_plan.max_ids,
        route="owner" if owner else "gather",
        finder=table_plan.backend.name if pallas and _hashindex_tpu.serves(plan.index) else "xla",
    )


def find(plan: DynamicPlan, index, hi, lo, bucket, now):
    """`_hashindex.find` of a lookup's (n,) ids on this shard's index, by the plan's
    `finder`. The Pallas kernel reads a bucket's keys once for a run of ids of that bucket,
    so the ids (in position order, or at their owner one sorted run per sender) are sorted
    by bucket for it first, and the results put back in order by one scatter."""
    if plan.finder == "xla":
        return _hashindex.find(plan.index, index, hi, lo, bucket, now)
    config, interpret = plan.index, plan.interpret
    at = lax.iota(jnp.int32, hi.shape[0])
    bucket, hi, lo, at = lax.sort((bucket, hi, lo, at), num_keys=1, is_stable=False)
    row, _ = _hashindex_tpu.find(config, index, hi, lo, bucket, now, interpret, True)
    row = jnp.zeros_like(row).at[at].set(row, unique_indices=True)
    return row, row >= 0


def finder(plan: DynamicPlan, now):
    """What `_hashindex.sighted(grouped=True)` takes as `find` for this plan: None (its own
    XLA ops), or the Pallas kernel as a function of (index, hi, lo, local bucket), told
    that the ids are sorted by bucket, finding expired slots too (`find_stale`)."""
    if plan.finder == "xla":
        return None
    config, interpret = plan.index, plan.interpret
    return lambda index, hi, lo, bucket: _hashindex_tpu.find_stale(
        config, index, hi, lo, bucket, now, interpret
    )


def scorer(plan: DynamicPlan, now):
    """What `_hashindex.sighted(grouped=True)` takes as `scores` for this plan: None (its
    own XLA scatters), or the Pallas kernel where the finder is one (buckets of 64, so an
    even number of them a shard: `engine_spec` rounds them so)."""
    if plan.finder == "xla":
        return None
    config, interpret = plan.index, plan.interpret
    return lambda index, bucket, lane, hit, freed, freed_lane: _hashindex_tpu.scores(
        config, index, bucket, lane, hit, now, interpret, freed, freed_lane
    )


def place(plan: DynamicPlan, index, hi, lo, bucket, admit, now):
    """`_hashindex.place` on this shard's index, of ids sorted by (local bucket, priority)
    (an update's admitted ids, as its resolution orders them), by the plan's `finder`:
    XLA's, or the Pallas kernel (buckets of 64, an even number of them a shard)."""
    if plan.finder == "xla":
        return _hashindex.place(plan.index, index, hi, lo, bucket, admit, now)
    return _hashindex_tpu.place(plan.index, index, hi, lo, bucket, admit, now, plan.interpret)


# ------------------------------------------------- resolution: sorted, owned, distinct ids


class Owned(NamedTuple):
    """The distinct ids one shard owns among a table's gathered ids, compacted to the front
    in (local bucket, priority, hi, lo) order, and what maps them back.

    `hi`, `lo`, `bucket` are (P + C,) (P gathered positions, C the window, 0 when one pass
    takes all; padding past the `count` distinct ones); `first` is each distinct id's first
    position in the sorted gathered ids; `pos` and `owned` are those sorted positions'
    original positions and whether they are owned."""

    hi: Any
    lo: Any
    bucket: Any
    count: Any
    first: Any
    pos: Any
    owned: Any


def capacity(plan: DynamicPlan, positions: int, num_shards: int) -> int:
    """C: ids one shard resolves per pass (an update's distinct ones, a lookup's owned
    positions: `_mine`). `max_ids_per_shard` when given; else on TPU layouts 1.5 times the
    average share of the P gathered positions (the TPU compiler charges each resolved id
    several tiles, so every device resolving all P would cost N times its share);
    elsewhere P, one pass: XLA:CPU's loops cost more than the work they save. A shard
    owning more ids in a step runs more passes: never drops one."""
    if plan.window:
        c = plan.window
    elif plan.compact:
        c = -(-3 * positions // (2 * num_shards))
    else:
        return positions
    return max(1, min(positions, -(-c // 8) * 8))


def _owned(plan: DynamicPlan, hi, lo, keep, axis, window: int) -> Owned:
    """Sorts the gathered ids (`gather_ids`) by (owned first, local bucket, priority, hi, lo)
    and moves the distinct owned ones to the front (`to_front`). No gather (the TPU
    compiler charges a 1-D gather a whole tile per element). What an update resolves; a
    lookup needs no distinct ids (`_mine`)."""
    n = lax.axis_size(axis)
    nbl = plan.index.buckets // n
    owner, bucket = _hashindex.locate(plan.index, n, hi, lo)
    mine = (owner == lax.axis_index(axis)) & ~is_pad(hi, lo) & keep
    k0, hi, lo, pos, first = sort_distinct(plan.index, jnp.where(mine, bucket, nbl), nbl, hi, lo)
    owned = k0 < nbl
    count = jnp.sum(first, dtype=jnp.int32)
    at, (d_hi, d_lo, d_bucket) = to_front(plan, n, first, count, window, hi, lo)
    return Owned(d_hi, d_lo, d_bucket, count, at, pos, owned)


def sort_distinct(config: _hashindex.IndexConfig, key, limit: int, hi, lo):
    """Ids sorted by (`key`, priority, hi, lo), so that the copies of an id are adjacent:
    (key, hi, lo, their positions before the sort, each one's first: the first copy of an
    id whose key is below `limit`). One sort of four keys that carries the positions.

    Unstable: the copies of an id come in any order, which no caller sees (each copy gets
    its id's value, and the index's rules give every copy its id's outcome). Stable, the
    positions were a fifth key, and each such sort of W1's 20,480 or 30,720 ids took libtpu
    a few seconds more to compile (docs/design.md, "Sorts")."""
    prio = _hashindex.priority(config, hi, lo)
    iota = lax.iota(jnp.int32, key.shape[0])
    key, _, hi, lo, pos = lax.sort((key, prio, hi, lo, iota), num_keys=4, is_stable=False)
    new = jnp.concatenate([jnp.ones((1,), bool), (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])])
    return key, hi, lo, pos, new & (key < limit)


def to_front(plan: DynamicPlan, num_shards: int, mask, count, window: int, hi, lo):
    """The entries of `mask` (count of them) moved to the front in their order, by one sort
    keyed by position that carries only the id words; the local buckets are computed again
    from them (a hash: the TPU compiler charges each operand of a sort, or of a scatter,
    far more than the hash). Returns (their positions (P,), P past the count; (hi, lo,
    local bucket), (P + C,) each, padding past the count)."""
    p = hi.shape[0]
    iota = lax.iota(jnp.int32, p)
    key, hi, lo = lax.sort((jnp.where(mask, iota, iota + p), hi, lo), num_keys=1, is_stable=False)
    live = iota < count
    extra = 0 if window >= p else window  # Room for the last pass's window.
    pad = lambda x, v: jnp.pad(jnp.where(live, x, v), (0, extra), constant_values=v)
    hi, lo = pad(hi, jnp.uint32(PAD)), pad(lo, jnp.uint32(PAD))
    bucket = _hashindex.locate(plan.index, num_shards, hi, lo)[1]
    return jnp.where(live, key, p), (hi, lo, bucket)


def _mine(plan: DynamicPlan, hi, lo, axis, window: int):
    """The gathered positions this shard owns, repeats included, moved to the front in
    position order (`to_front`): one sort of the P positions keyed by position, where
    `_owned` first sorts them by four keys. A read-only lookup needs no distinct ids: a
    repeat finds what its first finds.

    Returns ((hi, lo, bucket), (P + C,) each as `Owned`'s; their gathered positions (P,),
    P past the count; the count)."""
    n = lax.axis_size(axis)
    owner, _ = _hashindex.locate(plan.index, n, hi, lo)
    mine = (owner == lax.axis_index(axis)) & ~is_pad(hi, lo)
    count = jnp.sum(mine, dtype=jnp.int32)
    pos, ids = to_front(plan, n, mine, count, window, hi, lo)
    return ids, pos, count


def to_positions(owned: Owned, values):
    """Each gathered position's value + 1 (0 where not owned) from its distinct id's
    (`values`, int32, (P + C,) in distinct order, -1 for none), for `scatter_rows`. No
    gather: each distinct value's difference from the previous one goes to its id's first
    sorted position, and a running sum carries it over the id's repeats."""
    p = owned.pos.shape[0]
    v = values[:p] + 1
    delta = v - jnp.concatenate([jnp.zeros((1,), v.dtype), v[:-1]])
    sorted_values = jnp.cumsum(jnp.zeros((p,), v.dtype).at[owned.first].set(delta, mode="drop"))
    sorted_values = jnp.where(owned.owned, sorted_values, 0)
    return jnp.zeros((p,), v.dtype).at[owned.pos].set(sorted_values)


def lookup_rows(plan: DynamicPlan, storage, index, hi, lo, now, axis):
    """Inside shard_map: the global slot-table rows of the table's gathered ids (`hi`,
    `lo`: `gather_ids`'s), as `scatter_rows` takes them. Read-only."""
    me = lax.axis_index(axis)
    if plan.kernel == "cpu":  # One pass over the gathered ids, reading owned ones' buckets.
        row = _hashindex_cpu.find_owned(plan.index, index, hi, lo, me, lax.axis_size(axis), now)
        return jnp.where(row >= 0, storage.layout.global_ids(me, row) + 1, 0)
    p = hi.shape[0]
    window = capacity(plan, p, lax.axis_size(axis))
    ids, pos, count = _mine(plan, hi, lo, axis, window)

    def body(hi, lo, bucket, valid, carry):
        row, found = find(plan, index, hi, lo, bucket, now)
        return (jnp.where(found & valid, storage.layout.global_ids(me, row), -1),), carry

    empty = (jnp.full(ids[0].shape, -1, jnp.int32),)
    (rows,), _ = _loops.in_windows(count, window, ids, body, empty, None)
    # Row + 1 at each owned position (0: no row), 0 elsewhere, as `scatter_rows` takes it.
    return jnp.zeros(p, jnp.int32).at[pos].set(rows[:p] + 1, mode="drop", unique_indices=True)


def update_rows(
    plan: DynamicPlan, storage, index, key, table, slots, hi, lo, keep, now, axis, offset: int
):
    """Inside shard_map: one step's admission and eviction on this shard's buckets for the
    table's gathered ids (`gather_ids`'s), and the reset of the rows it gives to new ids
    (table row to the id's initial row, slots to their initial values) in `table` and
    `slots`, where the table's rows start at local row `offset` (a stack's arrays hold
    several tables). Returns (index, table, slots, the ids' global rows as `scatter_rows`
    takes them). `keep` False: the table is skipped this step (its index is left as it
    is).

    A table in device memory is reset here, written in place. A table in host memory is
    left as it is: the update starts the rows given away from their initial rows (`Fresh`),
    since every row given away this step is updated in the same step (a placed id is in
    the step's update), so its one host read and write serve the reset too. (Writing the
    resets to host memory here, the TPU compiler puts the written table in HBM:
    docs/design.md.)"""
    me = lax.axis_index(axis)
    in_place = not storage.on_host
    assert in_place or offset == 0, "tables in host memory are never stacked"
    if plan.kernel == "cpu":
        assert in_place, "host tables run the XLA index"
        n = lax.axis_size(axis)
        index, r = _hashindex_cpu.resolve_update(plan.index, index, hi, lo, keep, me, n, now)
        table, slots = _reset_fresh(storage, table, slots, r, key, plan, offset)
        rows = jnp.where(r.rows >= 0, storage.layout.global_ids(me, r.rows) + 1, 0)
        return index, table, slots, rows
    window = capacity(plan, hi.shape[0], lax.axis_size(axis))
    owned = _owned(plan, hi, lo, keep, axis, window)
    config, ids = plan.index, (owned.hi, owned.lo, owned.bucket)
    like = lambda dtype, value=0: jnp.full(owned.hi.shape, value, dtype)

    # Rules 1-3 (hits, admission, freed slots), then placement, each a pass at a time
    # (`_hashindex.place`: a bucket's ids may span passes). With an admission filter the
    # misses' admission and the first sightings run in passes of their own (`update`).
    def sighted(hi, lo, bucket, valid, index):
        s = _hashindex.sighted(
            config,
            index,
            hi,
            lo,
            bucket,
            valid,
            now,
            grouped=True,
            find=finder(plan, now),
            scores=scorer(plan, now),
        )
        return (s.hit, s.row, s.miss, s.admit), s.state

    outputs = (like(bool), like(jnp.int32, -1), like(bool), like(bool))
    seen, index = _loops.in_windows(owned.count, window, ids, sighted, outputs, index)
    seen = _hashindex.Sighted(None, *seen)

    # The passes after it see only the ids they decide, compacted in their (bucket,
    # priority) order and taken `_few` at a time (a trained table misses few ids and
    # admits fewer a step). Their results go back to the distinct order by one scatter.
    n = owned.hi.shape[0]
    k = _few(window, ROUND)
    iota = lax.iota(jnp.int32, n)

    def compacted(mask):
        """(count, [hi, lo, bucket, position] of the ids of `mask`, k past the last)."""
        _, picked = _first(mask, n, *ids, iota, how=plan.compaction)
        return jnp.sum(mask, dtype=jnp.int32), [jnp.pad(x, (0, k)) for x in picked]

    def back(count, picked, values):
        """Values of compacted ids at their distinct positions (zeros elsewhere)."""
        at = jnp.where(lax.iota(jnp.int32, n + k) < count, picked[3], n)
        return jnp.zeros(n, values.dtype).at[at].set(values, mode="drop")

    admit = seen.admit
    if config.min_count > 1:  # Each miss's sightings (`_hashindex.admission`).

        def decided(hi, lo, bucket, _, valid, index):
            index, admitted, first = _hashindex.admission(config, index, hi, lo, bucket, valid, now)
            return (admitted, first), index

        count, misses = compacted(seen.miss)
        none = jnp.zeros(n + k, bool)
        (admit, first), index = _loops.in_windows(count, k, misses, decided, (none, none), index)
        admit, first = back(count, misses, admit), back(count, misses, first)

    # Each placement round resets the rows it gives away (in device memory).
    admitted, picked = compacted(admit)

    def placed(hi, lo, bucket, _, valid, carry):
        index, table, slots = carry
        index, row, ok = place(plan, index, hi, lo, bucket, valid, now)
        index = _hashindex.unfilter(config, index, hi, lo, bucket, ok)
        if in_place:
            init = initial_rows(key, hi, lo, plan.dim, plan.draw)
            table, slots = reset_rows(storage, table, slots, row + offset, ok, init)
        return (row,), (index, table, slots)

    none = (jnp.full(n + k, -1, jnp.int32),)
    (a_row,), (index, table, slots) = _loops.in_windows(
        admitted, k, picked, placed, none, (index, table, slots)
    )
    at = jnp.where(lax.iota(jnp.int32, n + k) < admitted, picked[3], n)
    row = jnp.full(n, -1, jnp.int32).at[at].set(a_row, mode="drop")
    if config.min_count > 1:  # Then the first sightings, in filter order (`record`).
        count, firsts = compacted(first)
        per = config.buckets // config.filter_buckets
        if per > 1:  # A filter bucket is several buckets: sorted again.
            f_hi, f_lo, f_bucket, at = firsts
            live = lax.iota(jnp.int32, n + k) < count
            fb = jnp.where(live, f_bucket // per, config.filter_buckets)
            prio = _hashindex.priority(config, f_hi, f_lo)
            firsts = list(lax.sort((fb, prio, f_hi, f_lo, f_bucket, at), num_keys=4)[2:])

        def recorded(hi, lo, bucket, _, valid, index):
            return (), _hashindex.record(config, index, hi, lo, bucket, valid, now)

        _, index = _loops.in_windows(count, k, firsts, recorded, (), index)
    u_row = jnp.where(seen.hit, seen.row, row)
    rows = jnp.where(u_row >= 0, storage.layout.global_ids(me, u_row), -1)
    return index, table, slots, to_positions(owned, rows)


def _first(mask, k: int, *payloads, how: str):
    """(positions, [payloads at them]) of the first k entries of the 1-D `mask` (position
    n where fewer), as `DynamicPlan.compaction` says: "sort" (TPU layouts) by one sort,
    which moves the payloads along (the TPU compiler charges a 1-D gather, or `nonzero`, a
    whole tile per element); else the positions by `nonzero` ("nonzero") or the C++ kernel
    ("cpu") and the payloads by gathers, several times faster on XLA:CPU."""
    n = mask.shape[0]
    if how == "sort":
        iota = lax.iota(jnp.int32, n)
        key, *moved = lax.sort(
            (jnp.where(mask, iota, iota + n), *payloads), num_keys=1, is_stable=False
        )
        return jnp.where(key[:k] < n, key[:k], n), [x[:k] for x in moved]
    if how == "cpu":
        at = _hashindex_cpu.first_set(mask, k)
    else:
        at = jnp.nonzero(mask, size=k, fill_value=n)[0]
    picked = jnp.minimum(at, n - 1)
    return at, [x[picked] for x in payloads]


def _few(n: int, share: int = 8) -> int:
    """How many of n ids a compact path serves at once (`initial_rows_where`,
    `missing_rows`: a 512th, a 64th, an eighth, then all; the rounds of placements and
    resets: a 64th a round, after rounds of a 512th for the C++ index's first resets): a
    trained table's steps find most of their ids and give few rows away, so few need an
    initial row."""
    return min(n, max(8, n // share))


UNROLLED = 32  # `missing_rows` on TPU layouts sums up to this many ids an example one by one.
ROUND = 64  # Rounds of placements and resets take n / ROUND ids each (`_few`).
FEW = 8 * ROUND  # The smallest draws of initial rows, and first resets, take n / FEW.


def _reset_fresh(storage, table, slots: dict, resolved, key, plan: DynamicPlan, offset: int):
    """`reset_rows` of the rows the C++ index gave to new ids (`resolved`: its compacted fresh
    rows and ids; the table's rows start at `offset` in the arrays), in rounds: none when
    the step gave none away (a trained table's usual step), rounds of `_few(n, FEW)` up to
    `_few(n, ROUND)` rows (a trained table's steps give a few away), then rounds of that;
    the arrays are updated in place by the loops. (The XLA index resets its placements in
    its own rounds, `update_rows`.)"""
    rows, hi, lo = resolved.fresh_rows + offset, resolved.fresh_hi, resolved.fresh_lo
    count, n = resolved.fresh_count, rows.shape[0]
    draw = lambda hi, lo: initial_rows(key, hi, lo, plan.dim, plan.draw)
    k = _few(n, ROUND)
    if k == n:
        fresh = lax.iota(jnp.int32, n) < count
        return reset_rows(storage, table, slots, rows, fresh, draw(hi, lo))

    def rounds(k, stop, state):
        def body(state):
            start, table, slots = state
            # The last round starts earlier where it would run past the end: it resets some
            # rows again, to the same values.
            at = jnp.minimum(start, n - k)
            take = lambda x: lax.dynamic_slice_in_dim(x, at, k)
            fresh = at + lax.iota(jnp.int32, k) < count
            init = draw(take(hi), take(lo))
            table, slots = reset_rows(storage, table, slots, take(rows), fresh, init)
            return start + k, table, slots

        return lax.while_loop(lambda state: state[0] < stop, body, state)

    state = rounds(_few(n, FEW), jnp.minimum(count, k), (jnp.int32(0), table, slots))
    _, table, slots = rounds(k, count, state)
    return table, slots


def _initial_values(storage: _storage.TableStorage, init_rows) -> list:
    """[table rows, each stored slot's rows] of new ids whose initial rows are `init_rows`:
    the table's rows joined with its riders' initial values, the slots' initial values."""
    n = init_rows.shape[0]
    riders = {s.name: _constant(s, n, storage.dim) for s in storage.riders}
    value = storage.join_row(init_rows.astype(jnp.float32), riders)
    return [value.astype(storage.dtype)] + [_constant(s, n, storage.dim) for s in storage.stored]


def reset_rows(storage: _storage.TableStorage, table, slots: dict, rows, fresh, init_rows):
    """This shard's arrays with local rows `rows` where `fresh` set to a new id's initial
    row and its slots to their initial values; other rows untouched (writes to a row past
    the shard, where not fresh, are dropped)."""
    target = jnp.where(fresh, rows, jnp.int32(1 << 30))  # Past every shard: dropped.
    value, *slot_values = _initial_values(storage, init_rows)
    table = _write_rows(storage.packing, table, target, value)
    out = dict(slots)
    for s, value in zip(storage.stored, slot_values):
        out[s.name] = _write_rows(storage.slot_packing(s), slots[s.name], target, value)
    return table, out


@dataclasses.dataclass(frozen=True)
class Fresh:
    """`RowStep.fresh` of a dynamic table in host memory: inside the update, the rows given
    to new ids this step start from the ids' initial rows and the slots' initial values
    instead of what the host holds there (an evicted id's row).

    The index tells them apart, after this step's resolution: a slot given away this step
    holds last = now and count = 1 (`_hashindex.place`), and a hit's count was at least 1
    before the step added its own. So the update needs no list of the rows given away,
    which the owners' resolution has no static bound for, and it reads the index only at
    the rows it updates (its keys there are the new ids'), never a table-sized copy."""

    storage: _storage.TableStorage
    key: Any  # The table's key words (`key_words`).
    # The shard's index after this step's resolution: `IndexState`'s keys, last and count.
    keys: Any
    last: Any
    count: Any
    bucket_size: int
    now: Any  # The step that resolved it.
    how: str  # `DynamicPlan.compaction`.
    draw: initializers.RowInitializer | None = None  # `DynamicPlan.draw`.

    def __call__(self, values: list, rows) -> list:
        """`values` (the logical rows `rows` of the table and its stored slots, as read;
        rows outside the shard are padding) with the rows given away replaced; the initial
        rows are drawn for those only."""
        inside = (rows >= 0) & (rows < self.last.shape[0])
        r = jnp.where(inside, rows, 0)
        given = inside & (self.last[r] == self.now) & (self.count[r] == 1)
        hi, lo = _hashindex.keys_at(self.keys, self.bucket_size, r)
        s = self.storage
        init = initial_rows_where(self.key, hi, lo, given, s.dim, self.how, self.draw)
        out = []
        for v, new in zip(values, _initial_values(s, init)):
            mask = given.reshape(given.shape + (1,) * (v.ndim - 1))
            out.append(jnp.where(mask, new.astype(v.dtype), v))
        return out


def _constant(slot, n: int, dim: int):
    shape = (n, dim) if slot.rank == 2 else (n,)
    return jnp.full(shape, float(slot.initializer), jnp.float32)


def _write_rows(packing, array, rows, values):
    """Logical rows `rows` (distinct; out of range: dropped) of one shard's physical array
    set to `values` ((n, width) or (n,)). A packed array holds k rows a physical row, in
    lane groups of `padded_width`: the rows are sorted, the groups of the rows that share a
    physical row merged into it (a segmented scan), and each physical row written once, as
    read with the new groups over it. Seen as (k·rows, w) instead, the array was relaid out
    around the write by the TPU compiler wherever w < 128 (a table-sized temporary each
    round); a window of a lane group per row compiles into a loop of one row an iteration
    (docs/design.md, "Narrow slot tables", "Windows that compile to loops")."""
    if not packing.packed:
        return array.at[rows].set(values, mode="drop")
    k, w = packing.per_row, packing.padded_width
    n, lanes = rows.shape[0], array.shape[1]
    values = values.reshape(n, -1)
    values = jnp.pad(values, ((0, 0), (0, w - values.shape[1]))).astype(array.dtype)
    rows, order = lax.sort((rows, lax.iota(jnp.int32, n)), num_keys=2, is_stable=False)
    physical = rows // k
    group = lax.iota(jnp.int32, k)[None, :, None] == (rows % k)[:, None, None]
    mask = jnp.broadcast_to(group, (n, k, w)).reshape(n, lanes)
    placed = jnp.where(group, values[order][:, None, :], 0).reshape(n, lanes)

    def merge(a, b):  # a before b: b's groups over a's where both are of one row.
        same = (a[0] == b[0])[..., None]
        return b[0], b[1] | (same & a[1]), jnp.where(b[1] | ~same, b[2], a[2])

    _, mask, placed = lax.associative_scan(merge, (physical, mask, placed))
    last = jnp.concatenate([physical[1:] != physical[:-1], jnp.ones((1,), bool)])
    merged = jnp.where(mask, placed, array.at[physical].get(mode="clip"))
    # Each row left alone goes past the array at a place of its own: unique, and dropped.
    past = array.shape[0] + lax.iota(jnp.int32, n)
    target = jnp.where(last & (physical < array.shape[0]), physical, past)
    return array.at[target].set(merged, mode="drop", unique_indices=True)


def key_words(table_key):
    """The (2,) uint32 words a table's initial rows are drawn from: its key's first and last
    (as `initializers.rows` takes them)."""
    words = jax.random.key_data(table_key).reshape(-1).astype(jnp.uint32)
    return jnp.stack([words[0], words[-1]])


def empty_index(plan: DynamicPlan, num_shards: int):
    """The index of a table that holds no id yet (jnp arrays, traceable)."""
    return jax.tree.map(jnp.asarray, _hashindex.empty_state(plan.index, num_shards))


def split_on_host(leaf):
    """A dynamic feature's leaf with NumPy int64 ids (which `jit` would cut to int32 without
    `jax_enable_x64`) split into `SplitIds` on the host; any other leaf as it is."""
    ids, weights = (leaf.ids, leaf.weights) if isinstance(leaf, _inputs.Weighted) else (leaf, None)
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64:
        ids = split_ids(ids)
        return ids if weights is None else _inputs.Weighted(ids, weights)
    return leaf


def stats(plan: DynamicPlan, index, now) -> dict:
    """{counter: int32 scalar} of one table's index (see `Embedding.dynamic_stats`)."""
    return _hashindex.stats(plan.index, index, now)


def counted_rows(plan: DynamicPlan, storage, hi, lo) -> np.ndarray:
    """Stand-in slot-table rows of ids (hi, lo) ((m,) uint32 each, NumPy) for
    `Embedding.id_counts`: each id a row of the shard that owns its bucket (where its row
    is, or would be once admitted), the distinct ids of a shard distinct rows up to the
    rows it has; -1 at padding. The row exchange then carries what it carries when every
    id holds a row."""
    n = storage.layout.num_shards
    owner = np.asarray(_hashindex.locate(plan.index, n, hi, lo)[0], np.int64)
    keys = np.stack([owner, hi.astype(np.int64), lo.astype(np.int64)], 1)
    distinct, which = np.unique(keys, axis=0, return_inverse=True)  # By owner first.
    rank = np.arange(len(distinct)) - np.searchsorted(distinct[:, 0], distinct[:, 0])
    local = np.minimum(rank, storage.layout.rows_per_shard - 1)
    rows = np.asarray(storage.layout.global_ids(distinct[:, 0], local), np.int64)
    return np.where(np.asarray(is_pad(hi, lo)), -1, rows[which.reshape(-1)])


def slot_rows(storage, global_rows):
    """The slot table's logical rows (its ids under the spec's partition strategy) of the
    index's global rows (bucket * bucket_size + lane, "div" over buckets). NumPy."""
    s = storage.layout.rows_per_shard
    shard, local = np.divmod(np.asarray(global_rows, np.int64), s)
    if storage.layout.strategy == "mod":
        return local * storage.layout.num_shards + shard
    return shard * s + local


def live(plan: DynamicPlan, index, now: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids ascending, global rows) of the live ids of a table's index (NumPy arrays): a
    global row is the id's stored position, shard * S + local (`TableStorage.take_stored`)."""
    ids, global_rows, _, _ = _hashindex.export(plan.index, index, now)
    return np.asarray(ids, np.int64), np.asarray(global_rows, np.int64)


def check_rows(where: str, given: DynamicRows, dim: int | None = None):
    """(ids int64 ascending, their rows) of a `DynamicRows`, checked: a 1-D signed integer
    ids array of distinct ids other than -1, one row each ((n, dim), or (n, D) for any D when
    `dim` is None). Errors start with `where` (e.g. "restore_tables: table 'users'")."""
    ids = np.asarray(given.ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.signedinteger):
        raise ValueError(
            f"{where}: DynamicRows.ids must be a 1-D signed integer array, got "
            f"{ids.dtype} {ids.shape}."
        )
    ids = ids.astype(np.int64)
    rows = np.asarray(given.rows)
    if rows.ndim != 2 or rows.shape[0] != len(ids) or dim not in (None, rows.shape[1]):
        raise ValueError(
            f"{where}: DynamicRows.rows has shape {rows.shape}, expected "
            f"({len(ids)}, {dim or 'D'}) (one row per id)."
        )
    if np.any(ids == -1):
        raise ValueError(f"{where}: -1 is padding, never an id.")
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    if len(ids) > 1 and np.any(ids[1:] == ids[:-1]):
        dup = ids[1:][ids[1:] == ids[:-1]][0]
        raise ValueError(f"{where}: id {dup} is given twice.")
    return ids, rows


# ------------------------------------------- the index's logical form (checkpoints, IO)


def held(plan: DynamicPlan, index) -> dict[str, np.ndarray]:
    """A table's index in logical form, independent of the mesh and the capacity (NumPy;
    `index` an IndexState of host arrays): "ids" int64 ascending, every id holding a slot
    (TTL-expired ones too: they restore expired), "rows" their global rows in this index
    (int64), "lanes" their lanes in their buckets (int32: the rows modulo the bucket size,
    which `rebuild` can keep), "last" and "count" their scores (int32); "filter_ids" (int64
    ascending) and "filter_count" (int32), the admission filter's entries; "counters"
    (int64, one per `_hashindex.STAT_NAMES`), summed over the shards. Given one shard's part
    of an index (`_hashindex.empty_state`), the same of that shard alone, rows local to it."""
    ids, rows, last, count = _hashindex.export(plan.index, index, now=None)
    f_hi, f_lo = _hashindex.slot_words(index.filter_keys, plan.index.filter_bucket_size)
    f_count = np.asarray(index.filter_count).reshape(-1)
    keep = ~((f_hi == PAD) & (f_lo == PAD))
    f_ids = _hashindex.join_ids(f_hi[keep], f_lo[keep])
    order = np.argsort(f_ids, kind="stable")
    return {
        "ids": np.asarray(ids, np.int64),
        "rows": np.asarray(rows, np.int64),
        "lanes": (np.asarray(rows, np.int64) % plan.index.bucket_size).astype(np.int32),
        "last": np.asarray(last, np.int32),
        "count": np.asarray(count, np.int32),
        "filter_ids": f_ids[order].astype(np.int64),
        "filter_count": f_count[keep][order].astype(np.int32),
        "counters": np.asarray(index.stats, np.int64).sum(0),
    }


def rebuild(
    plan: DynamicPlan, num_shards: int, entries: Mapping[str, Any], shard: int | None = None
):
    """The inverse of `held` onto `plan`'s index for `num_shards` shards: (IndexState of
    NumPy arrays, each id's global row (int64, in the order of entries["ids"])). The ids
    keep their `last` and `count` (so eviction and TTL go on as before), and their lanes
    where entries has "lanes" (`_hashindex.build`: only from an index with these buckets);
    the filter's entries go to their filter buckets (one with fewer entries than given
    keeps the highest (count, priority), the ones its own eviction would keep), and none
    when min_count is 1; the counters ({name: total} or an array in STAT_NAMES order) go
    on shard 0. ValueError (not naming the table) when the capacity or a bucket cannot
    hold the ids.

    With `shard` given, `entries` are that shard's own (`held` of its part of an index of
    the same configuration and shards): the result is its part (`_hashindex.empty_state`),
    rows local to it, and the counters its own; a ValueError then says what is wrong with
    them (an id of another shard, a repeat)."""
    config = plan.index
    ids = np.asarray(entries["ids"], np.int64).reshape(-1)
    if len(ids) > config.capacity:
        raise ValueError(
            f"{len(ids)} ids do not fit its capacity of {config.capacity} rows "
            f"({config.buckets} buckets of {config.bucket_size})."
        )
    try:
        state, rows = _hashindex.build(
            config, num_shards, ids, entries["last"], entries["count"], shard, entries.get("lanes")
        )
    except ValueError as e:
        why = str(e).removeprefix("build: ")
        if shard is None:  # A shard's own entries fitted the same index when saved.
            why = f"its {len(ids)} ids do not fit its capacity of {config.capacity} rows: {why}"
        raise ValueError(why) from None
    f_ids = np.asarray(entries.get("filter_ids", np.zeros(0, np.int64)), np.int64).reshape(-1)
    f_count = np.asarray(entries.get("filter_count", np.zeros(0, np.int32)), np.int32)
    if config.filter_buckets and f_ids.size:
        hi, lo = _hashindex.split_ids(f_ids)
        g = np.asarray(_hashindex.global_bucket(config, hi, lo)).astype(np.int64)
        f = g // (config.buckets // config.filter_buckets)
        if shard is not None:
            f -= shard * (config.filter_buckets // num_shards)
        prio = np.asarray(_hashindex.priority(config, hi, lo)).astype(np.int64)
        # Per filter bucket, highest (count, priority, hi, lo) first.
        order = np.lexsort((-lo.astype(np.int64), -hi.astype(np.int64), -prio, -f_count, f))
        sorted_f = f[order]
        lane = np.arange(f.size) - np.searchsorted(sorted_f, sorted_f, side="left")
        bf = config.filter_bucket_size
        kept = lane < bf
        at = sorted_f[kept] * bf + lane[kept]
        src = order[kept]
        _hashindex.set_slot_words(state.filter_keys, bf, at, hi[src], lo[src])
        state.filter_count.reshape(-1)[at] = f_count.reshape(-1)[src]
    counters = entries.get("counters")
    if counters is not None:
        if isinstance(counters, Mapping):
            counters = [counters.get(n, 0) for n in _hashindex.STAT_NAMES]
        state.stats[0] = np.asarray(counters, np.int64).astype(np.int32)
    return state, rows


def counters(index) -> dict:
    """{counter: int32 scalar} summed over the shards, and "held" (admitted - evicted -
    expired): O(shards), no scan of the index."""
    totals = jnp.asarray(index.stats).sum(0, dtype=jnp.int32)
    out = {name: totals[i] for i, name in enumerate(_hashindex.STAT_NAMES)}
    out["held"] = out["admitted"] - out["evicted"] - out["expired"]
    return out
