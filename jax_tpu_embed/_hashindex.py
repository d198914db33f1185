"""The index of a dynamic embedding table: unbounded 64-bit ids to the rows of a fixed table.

A dynamic table has no vocabulary: any int64 id may arrive, and the table holds the ids that
earned a row (admission) for as long as they keep it (eviction, TTL). This module is only the
index, ids to rows, inside jit with static shapes; the row arrays are the engine's.

Representation. An id is carried as two uint32 arrays (hi, lo), the halves of its two's
complement int64, because jax_enable_x64 stays off. The id -1 (both halves all ones) is
padding in inputs and the empty-slot marker in the index; it is never a key. Keys are stored
and compared whole, so no id ever reads another id's row, whatever the hashes do.

The index is NB buckets of b slots. An id's bucket g is a hash of (seed, hi, lo) mod NB; its
slot's global row is g·b + lane. Shard p of N owns buckets [p·NB/N, (p+1)·NB/N) ("div" over
buckets), so its local row is (g mod NB/N)·b + lane. g does not depend on N: the same ids are
resident, in the same rows, on every mesh size.

One training step (`update`) sees each shard's distinct ids of the step at once and decides,
for every bucket, which ids keep, take or lose a slot. The rules (docstring of `update`)
depend only on keys, steps and counts, never on the input order, so that the result is the
same however the caller batches or routes the ids; lanes only break ties between slots that
are interchangeable (empty ones).

Admission filter. With min_count k > 1 an id needs k sightings before it gets a slot. The
sightings are counted in a second, smaller bucketed table (NF buckets of bf entries). Filter
bucket f = g // (NB/NF) groups whole index buckets, so it lives on the shard that owns the
id's bucket on every mesh size (NB/N and NF/N are whole numbers).

Nothing fails silently: every outcome of every id is counted in the per-shard `stats`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _layout
from ._storage import mix32

EVICTIONS = ("lru", "lfu", "none")

# Per-shard counters, one column each of IndexState.stats. Every valid id of an update is
# exactly one of: hit, admitted, rejected, failed (misses = the last three).
STAT_NAMES = (
    "hits",  # found live: keeps its row
    "misses",  # not found live (absent or expired)
    "admitted",  # a miss that took a slot
    "rejected",  # a miss that admission turned away (count or probability)
    "failed",  # a miss admitted but without room in its bucket
    "evicted",  # a live occupant that lost its slot to an admitted id
    "expired",  # a TTL-expired slot reclaimed (reused, or freed by its own id's return)
    "filter_evicted",  # a filter entry replaced by a new sighting
    "filter_failed",  # a first sighting the full filter bucket could not record
)
_STAT = {name: i for i, name in enumerate(STAT_NAMES)}

PAD = 0xFFFFFFFF

# Salts of the keyed hashes derived from the table's seed: independent streams.
_SALT_BUCKET, _SALT_PRIORITY, _SALT_ADMIT = 1, 2, 3

# The scatters that combine a window with values (`_put_rows`), and max's identity.
_ADD, _MAX, _MUL = "add", "max", "mul"  # `_put_rows`' ops.
_SCATTERS = {_ADD: lax.scatter_add, _MAX: lax.scatter_max, _MUL: lax.scatter_mul}
_INT32_MIN = np.iinfo(np.int32).min
NEVER = _INT32_MIN  # `filter_last` of an entry no step has sighted.

# Local rows index int32 arrays inside jit.
_MAX_LOCAL_SLOTS = 1 << 31


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    """The shape and policy of one dynamic table's index.

    Attributes:
        buckets: NB, the index's buckets (global); a multiple of the number of shards.
        bucket_size: b, slots per bucket. Capacity is NB·b rows.
        eviction: Who an admitted id may displace when its bucket has no free slot: "lru"
            (least recently updated first), "lfu" (fewest updates first, then least recent),
            "none" (nobody: the id fails).
        ttl_steps: A slot not updated for this many steps is expired: not found, and free.
            None: slots never expire.
        min_count: k, sightings (steps with the id among a shard's misses) an id needs before
            it is admitted; 1 admits at the first.
        admit_probability: p, a miss that passed min_count is admitted iff a hash of
            (seed, step, id) falls below p; 1 admits all.
        filter_buckets: NF, buckets of the admission filter that counts sightings; 0 iff
            min_count == 1, else a divisor of `buckets` and a multiple of the shards.
        filter_bucket_size: bf, entries per filter bucket.
        seed: uint32, keys every hash of this table.
    """

    buckets: int
    bucket_size: int = 64
    eviction: str = "lru"
    ttl_steps: int | None = None
    min_count: int = 1
    admit_probability: float = 1.0
    filter_buckets: int = 0
    filter_bucket_size: int = 64
    seed: int = 0

    def __post_init__(self):
        def bad(field, allowed):
            value = getattr(self, field)
            raise ValueError(f"IndexConfig: {field} must be {allowed}, got {value!r}.")

        if not _is_int(self.buckets) or self.buckets < 1:
            bad("buckets", "an int >= 1")
        if not _is_int(self.bucket_size) or self.bucket_size < 1:
            bad("bucket_size", "an int >= 1")
        if self.buckets * self.bucket_size >= _MAX_LOCAL_SLOTS:
            bad(
                "buckets",
                f"such that buckets * bucket_size < 2**31 (bucket_size {self.bucket_size})",
            )
        if self.eviction not in EVICTIONS:
            bad("eviction", f"one of {EVICTIONS}")
        if self.ttl_steps is not None and (not _is_int(self.ttl_steps) or self.ttl_steps < 1):
            bad("ttl_steps", "None or an int >= 1")
        if not _is_int(self.min_count) or self.min_count < 1:
            bad("min_count", "an int >= 1")
        p = self.admit_probability
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            bad("admit_probability", "a float in (0, 1]")
        if not _is_int(self.filter_buckets) or self.filter_buckets < 0:
            bad("filter_buckets", "an int >= 0")
        if self.min_count == 1 and self.filter_buckets != 0:
            bad("filter_buckets", "0 when min_count == 1 (no filter)")
        if self.min_count > 1 and (
            self.filter_buckets < 1 or self.buckets % self.filter_buckets != 0
        ):
            bad("filter_buckets", f"a divisor of buckets ({self.buckets}) when min_count > 1")
        if not _is_int(self.filter_bucket_size) or self.filter_bucket_size < 1:
            bad("filter_bucket_size", "an int >= 1")
        if not _is_int(self.seed) or not 0 <= self.seed <= PAD:
            bad("seed", "an int in [0, 2**32)")

    @property
    def capacity(self) -> int:
        return self.buckets * self.bucket_size

    def check_shards(self, num_shards: int) -> None:
        """ValueError unless both bucket counts split evenly over `num_shards`."""
        if not _is_int(num_shards) or num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}.")
        for field in ("buckets", "filter_buckets"):
            if getattr(self, field) % num_shards:
                raise ValueError(
                    f"IndexConfig: {field} ({getattr(self, field)}) must be a multiple of "
                    f"the number of shards ({num_shards})."
                )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["keys", "last", "count", "filter_keys", "filter_count", "filter_last", "stats"],
    meta_fields=[],
)
@dataclasses.dataclass
class IndexState:
    """One dynamic table's index; every array sharded over the shard axis (first dim). The
    slot arrays are flat, bucket g's slots at [g·b, (g+1)·b) (see `_rows`); the keys are
    block-interleaved, bucket g's b hi words at [2g·b, (2g+1)·b) and then its b lo words,
    so that one window of 2b words holds a bucket's keys (`_key_rows`, `slot_words`).

    Attributes:
        keys: (NB·2b,) uint32, the key of each slot; PAD in both words for an empty slot.
        last: (NB·b,) int32, the step of the slot's last update (its admission included).
        count: (NB·b,) int32, steps in which the id was updated since its admission.
        filter_keys: (NF·2bf,) uint32, ids being counted by the admission filter, laid out
            as `keys`.
        filter_count: (NF·bf,) int32, their sightings so far.
        filter_last: (NF·bf,) int32, the step of each entry's last sighting where the
            filter's rules run in calls (`admission`, `record`: it keeps the entries
            sighted this step from the step's first sightings); NEVER before.
        stats: (N, len(STAT_NAMES)) int32, each shard's counters (STAT_NAMES).
    """

    keys: Any
    last: Any
    count: Any
    filter_keys: Any
    filter_count: Any
    filter_last: Any
    stats: Any


def empty_state(config: IndexConfig, num_shards: int, shard: int | None = None) -> IndexState:
    """A fresh index for `num_shards` shards, as NumPy arrays (place them row-sharded); with
    `shard` given, only that shard's part of each array (what its device holds)."""
    config.check_shards(num_shards)
    parts = num_shards if shard is None else 1
    nb, b = config.buckets * parts // num_shards, config.bucket_size
    nf, bf = config.filter_buckets * parts // num_shards, config.filter_bucket_size
    return IndexState(
        keys=np.full(nb * 2 * b, PAD, np.uint32),
        last=np.zeros(nb * b, np.int32),
        count=np.zeros(nb * b, np.int32),
        filter_keys=np.full(nf * 2 * bf, PAD, np.uint32),
        filter_count=np.zeros(nf * bf, np.int32),
        filter_last=np.full(nf * bf, NEVER, np.int32),
        stats=np.zeros((parts, len(STAT_NAMES)), np.int32),
    )


# ------------------------------------------------------------------------------- host ids


def split_ids(ids) -> tuple[np.ndarray, np.ndarray]:
    """int64 ids -> (hi, lo) uint32 arrays, the halves of their two's complement."""
    u = np.asarray(ids, np.int64).view(np.uint64)
    return (u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(PAD)).astype(np.uint32)


def join_ids(hi, lo) -> np.ndarray:
    """The inverse of split_ids: (hi, lo) uint32 -> int64 ids."""
    hi = np.asarray(hi).astype(np.uint64)
    lo = np.asarray(lo).astype(np.uint64)
    return ((hi << np.uint64(32)) | lo).view(np.int64)


def slot_words(keys, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo), flat uint32 in slot order, of block-interleaved keys (`IndexState.keys`
    with width b, `filter_keys` with bf); NumPy."""
    k = np.asarray(keys).reshape(-1, 2, width)
    return k[:, 0].reshape(-1), k[:, 1].reshape(-1)


def keys_at(keys, width: int, slots):
    """(hi, lo) uint32 of the slots `slots` (int32, slot order, in range) of
    block-interleaved keys, as `slot_words` orders them; jittable: one gather per word."""
    word = 2 * (slots // width) * width + slots % width
    return keys[word], keys[word + width]


def set_slot_words(keys: np.ndarray, width: int, slots, hi, lo) -> None:
    """Writes (hi, lo) into the slots `slots` (slot order, as `slot_words`) of a NumPy
    block-interleaved key array, in place."""
    k = keys.reshape(-1, 2, width)
    slots = np.asarray(slots, np.int64)
    k[slots // width, 0, slots % width] = hi
    k[slots // width, 1, slots % width] = lo


def slot_ids(config: IndexConfig, state: IndexState) -> np.ndarray:
    """Each slot's id, int64 in slot order (-1: empty); NumPy."""
    return join_ids(*slot_words(state.keys, config.bucket_size))


# ---------------------------------------------------------------------------------- hashes


def key_word(seed: int, salt: int) -> int:
    """The key of one of the table's keyed hashes (`_SALT_*`), as a Python int: `mix32`
    of the seed and the salt's `mix32`. Kernels and the C++ index take it as a constant."""

    def mix(x: int) -> int:  # `mix32` on a Python int.
        x ^= x >> 16
        x = (x * 0x7FEB352D) & PAD
        x ^= x >> 15
        x = (x * 0x846CA68B) & PAD
        return x ^ (x >> 16)

    return mix(int(seed) ^ mix(int(salt)))


def _key(seed: int, salt: int):
    return jnp.uint32(key_word(seed, salt))  # A constant, in kernels too.


def _hash(key, hi, lo):
    """A keyed 32-bit hash of the whole 64-bit id: every output bit depends on both halves."""
    return mix32(mix32(lo ^ key) ^ hi)


def _u32(x):
    return jnp.asarray(x).astype(jnp.uint32)


def _keyed(config: IndexConfig, salt: int, hi, lo):
    """`_hash` of the ids with the table's key for `salt`: NumPy for NumPy ids (host code,
    e.g. a restore's rebuild: eager jnp ops would compile anew for each size of ids),
    else jnp (traceable). The same bits either way."""
    if isinstance(hi, np.ndarray) and isinstance(lo, np.ndarray):
        key = np.uint32(key_word(config.seed, salt))
        return _hash(key, hi.astype(np.uint32), lo.astype(np.uint32))
    return _hash(_key(config.seed, salt), _u32(hi), _u32(lo))


def global_bucket(config: IndexConfig, hi, lo):
    """g, the id's global bucket, int32 (NumPy for NumPy ids: `_keyed`)."""
    h = _keyed(config, _SALT_BUCKET, hi, lo)
    if isinstance(h, (np.ndarray, np.generic)):
        return (np.asarray(h, np.uint32) % np.uint32(config.buckets)).astype(np.int32)
    return (h % jnp.uint32(config.buckets)).astype(jnp.int32)


def priority(config: IndexConfig, hi, lo):
    """The id's uint32 priority, independent of its bucket: orders the admitted ids of a
    bucket and breaks ties between slots (then (hi, lo), so no two distinct ids tie).
    NumPy for NumPy ids (`_keyed`)."""
    return _keyed(config, _SALT_PRIORITY, hi, lo)


def _admit_hash(config: IndexConfig, hi, lo, now):
    h = _hash(_key(config.seed, _SALT_ADMIT), _u32(hi), _u32(lo))
    return mix32(h ^ mix32(_u32(now)))


def _admit_threshold(p: float) -> int:
    return min(int(p * 2.0**32), PAD)


def _is_pad(hi, lo):
    return (hi == jnp.uint32(PAD)) & (lo == jnp.uint32(PAD))


def _expired(config: IndexConfig, last, now):
    if config.ttl_steps is None:
        return jnp.zeros(jnp.shape(last), bool)
    return now - last >= config.ttl_steps


# ------------------------------------------------------------------------ per-shard (jit)


def locate(config: IndexConfig, num_shards: int, hi, lo):
    """(owner shard, local bucket), int32, of ids of any shape. Padding gets some bucket;
    the caller masks it."""
    config.check_shards(num_shards)
    per = config.buckets // num_shards
    g = global_bucket(config, hi, lo)
    return g // per, g % per


def _rows(flat, first, width: int):
    """(U, width): the windows flat[first[i] : first[i] + width] of a 1-D array, `first` (U,)
    multiples of `width` clipped into range. Row gathers of the array's (words / 128, 128)
    view (`_layout.lane_windows`) where it has one; else one window of the flat array per
    index, which the TPU compiler writes as a loop of U iterations."""
    first = jnp.clip(first, 0, flat.shape[0] - width)
    if _layout.lane_view(flat.shape[0]):
        return _layout.lane_windows(flat, first, width)
    return jax.vmap(lambda s: lax.dynamic_slice(flat, (s,), (width,)))(first)


def _key_rows(keys, bucket, width: int):
    """(hi, lo), each (U, width): the keys of the buckets `bucket` (U,) of block-interleaved
    keys. One window of 2·width words per bucket, whose halves are lane slices: the TPU
    compiler charges two windows of width words, one per word array, four times the bytes
    of this one (benchmarks/hashindex_tpu_ops.py)."""
    window = _rows(keys, bucket * (2 * width), 2 * width)
    return window[:, :width], window[:, width:]


def _put_key_rows(keys, bucket, hi, lo, write, op: str):
    """`_put_rows` for block-interleaved keys: the buckets `bucket` (G,) combined by `op`
    with (hi, lo) ((G, width) each) where `write`."""
    width = hi.shape[1]
    return _put_rows(keys, bucket * (2 * width), jnp.concatenate([hi, lo], 1), write, op)


def _put_rows(flat, first, rows, write, op: str):
    """`flat` with the windows at `first` ((G,) multiples of the width, distinct where
    `write`) combined with `rows` ((G, width)) by `op` (`_ADD`, `_MAX`, `_MUL`); the others
    left as they are. Row scatters into the array's (words / 128, 128) view where it has
    one (`_layout.put_lane_windows`); else one windowed scatter, which the TPU compiler
    writes as a loop of G iterations."""
    g, width = rows.shape
    if _layout.aligned_windows(flat.shape[0], width):
        return _layout.put_lane_windows(flat, first, rows, write, op)
    # Each skipped window starts past the array at its own place: unique, and dropped.
    skip = flat.shape[0] + lax.iota(jnp.int32, g) * width
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )
    return _SCATTERS[op](
        flat,
        jnp.where(write, first, skip)[:, None],
        rows.astype(flat.dtype),
        dims,
        mode=lax.GatherScatterMode.FILL_OR_DROP,
        unique_indices=True,
    )


def _only_lane(mask):
    """(any, lane) of (U, l) masks with at most one lane set per row (an id holds at most
    one slot and one filter entry): one max over the lanes, where `any` and `argmax` are
    two passes over the (U, l) mask for the TPU compiler. The lane is 0 where none is set,
    as argmax gives it."""
    lanes = lax.broadcasted_iota(jnp.int32, mask.shape, 1)
    lane = jnp.max(jnp.where(mask, lanes, -1), 1)
    return lane >= 0, jnp.maximum(lane, 0)


def _at(rows, column):
    """rows[i, column[i]] of (U, l) rows: a select over the lanes, no gather."""
    lanes = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    return jnp.where(lanes == column[:, None], rows, 0).sum(1).astype(rows.dtype)


def _spread(num_groups: int, width: int, group, lane, values: dict, where):
    """Each candidate's value at (its group, lane), where `where`, in fresh (G, width)
    arrays: {name: values} and "set" (bool). Scatters into zeros (the TPU compiler charges
    them almost nothing), one writer per slot."""
    at = jnp.where(where, group * width + lane, num_groups * width)
    out = {"set": jnp.zeros(num_groups * width, bool).at[at].set(True, mode="drop")}
    for name, v in values.items():
        out[name] = jnp.zeros(num_groups * width, v.dtype).at[at].set(v, mode="drop")
    return {k: v.reshape(num_groups, width) for k, v in out.items()}


def find(config: IndexConfig, state: IndexState, hi, lo, local_bucket, now):
    """(local row int32, found bool) of ids of any shape in this shard's index; row -1 where
    not found. Read-only: a lookup (serving, evaluation) changes no slot and no counter.
    Padding and TTL-expired slots are never found."""
    b = config.bucket_size
    shape = jnp.shape(hi)
    hi, lo = _u32(hi).reshape(-1), _u32(lo).reshape(-1)
    nbl = state.last.shape[0] // b
    lb = jnp.clip(jnp.asarray(local_bucket, jnp.int32).reshape(-1), 0, nbl - 1)
    keys_hi, keys_lo = _key_rows(state.keys, lb, b)
    last = _rows(state.last, lb * b, b)
    match = (keys_hi == hi[:, None]) & (keys_lo == lo[:, None])
    match &= ~_expired(config, last, now) & ~_is_pad(hi, lo)[:, None]
    found, lane = _only_lane(match)
    return jnp.where(found, lb * b + lane, -1).reshape(shape), found.reshape(shape)


def _groups(key, prio, hi, lo, flag, num_groups: int):
    """Candidates grouped by `key` (their bucket), each group in priority order.

    Returns, per candidate in input order, its group (the groups numbered 0.. in key order)
    and its rank among the flagged candidates of its group; and each group's key
    (`num_groups` of them: at least the distinct keys; unused ones hold the largest key). One
    sort of U, the results put back in input order by scatters (no gather, no loop).

    The sort is unstable: only flagged candidates equal in all four keys (copies of one id)
    would get ranks that depend on their order, and no caller has them: `place` and
    `record` flag distinct ids, `sighted` and `_set_entries` use no ranks."""
    u = key.shape[0]
    iota = lax.iota(jnp.int32, u)
    skey, _, _, _, f, perm = lax.sort(
        (key, prio, hi, lo, flag.astype(jnp.int32), iota), num_keys=4, is_stable=False
    )
    start = jnp.ones(u, bool).at[1:].set(skey[1:] != skey[:-1])
    group_sorted = jnp.cumsum(start.astype(jnp.int32)) - 1
    before = jnp.cumsum(f) - f
    # Flagged candidates before the group's first: `before` never decreases, so a running
    # max of its values at group starts is the current group's.
    base = lax.cummax(jnp.where(start, before, 0))
    back = lambda x: jnp.zeros(u, x.dtype).at[perm].set(x, unique_indices=True)
    group_key = jnp.full(num_groups, skey[-1], skey.dtype).at[group_sorted].set(skey)
    return back(group_sorted), back(before - base), group_key


def _runs(key, num_groups: int, fill: int):
    """`_groups`' (group, group key) for candidates whose equal keys are contiguous (the
    caller sorted them): each run of equal keys is a group, numbered in input order; unused
    groups hold `fill`. A running count, no sort (at a pass of ids the TPU compiler charges
    `_groups`' sort more than the whole `find`)."""
    u = key.shape[0]
    start = jnp.ones(u, bool).at[1:].set(key[1:] != key[:-1])
    group = jnp.cumsum(start, dtype=jnp.int32) - 1
    group_key = jnp.full(num_groups, fill, key.dtype).at[group].set(key, mode="drop")
    return group, group_key


def _lane_order(keys):
    """(G, l) lane order: the lanes of each row sorted by `keys`, which leave no ties."""
    lanes = lax.broadcasted_iota(jnp.int32, keys[0].shape, 1)
    return lax.sort((*keys, lanes), dimension=1, num_keys=len(keys), is_stable=False)[-1]


def update(config: IndexConfig, state: IndexState, hi, lo, local_bucket, valid, now):
    """One training step of this shard's index, inside shard_map (local arrays).

    Args:
        state: This shard's IndexState (leading dims NB/N, NF/N and 1).
        hi, lo: The distinct ids this shard owns this step (U of them, any shape); the caller
            deduplicates. Duplicates of a valid id are not allowed.
        local_bucket: Their local buckets (`locate`).
        valid: False for padding and for ids of other shards.
        now: int32 step; steps increase from call to call.

    Returns:
        (new state, local row int32 (-1 where the id has no slot), fresh bool: the id took a
        slot this step, so its row holds another id's values and must be re-initialized).

    Every outcome depends on keys, steps and counts, not on input order or lanes:

    1. TTL: a slot with now - last >= ttl_steps is expired: not found, free for reuse.
    2. Hit (found live): last = max(last, now) (now, while steps increase), count += 1.
    3. Miss: admission. With min_count k > 1 the filter counts the id's sightings (steps in
       which it missed); the k-th admits it. With admit_probability p < 1 it is admitted iff
       a hash of (seed, now, id) < p. Both apply when both are set; a sighting at or past
       the k-th that the probability turns away stays at k, so the next may pass.
    4. Placement, per bucket. An admitted id's own expired slot, if any, is freed first
       (counted expired). Then the admitted ids, in priority order, take the bucket's slots
       in this order: free ones (empty, freed); expired ones by (last, priority); then,
       unless eviction is "none", occupied ones not updated this step (last < now), lru by
       last, lfu by (count, last), ties by priority. Those left over fail. A placed id gets
       last = now, count = 1, and leaves the filter; one that fails keeps its sightings.
    5. Filter (k > 1). A sighting of an id in the filter raises its count (up to k). A first
       sighting takes, in priority order, a free entry (empty, or freed by a placed id),
       else the entry not sighted this step of lowest (count, priority): filter_evicted;
       else none: filter_failed.
    """
    # Each call may be split into calls (_dynamic and _dynamic_owner do, in passes and
    # rounds): `sighted` and `admission` anyhow, `place` (and `unfilter`) in (bucket,
    # priority) order, `record` in (filter bucket, priority) order.
    seen = sighted(config, state, hi, lo, local_bucket, valid, now)
    state, admit = seen.state, seen.admit
    if config.min_count > 1:
        state, admit, first = admission(config, state, hi, lo, local_bucket, seen.miss, now)
    state, row, placed = place(config, state, hi, lo, local_bucket, admit, now)
    row = jnp.where(seen.hit, seen.row, row.reshape(-1)).reshape(jnp.shape(hi))
    if config.min_count > 1:
        state = unfilter(config, state, hi, lo, local_bucket, placed)
        state = record(config, state, hi, lo, local_bucket, first, now)
    return state, row, placed


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["state", "hit", "row", "miss", "admit"],
    meta_fields=[],
)
@dataclasses.dataclass
class Sighted:
    """`sighted`'s result: the state with the step's hits and freed slots written, and per
    id (flat, (U,)): hit, its row (-1 unless hit), miss, and admitted (to be placed; with
    an admission filter every miss, which `admission` decides)."""

    state: Any
    hit: Any
    row: Any
    miss: Any
    admit: Any


def sighted(
    config: IndexConfig,
    state: IndexState,
    hi,
    lo,
    local_bucket,
    valid,
    now,
    *,
    grouped=False,
    find=None,
    distinct=None,
    scores=None,
):
    """Rules 1-3 of `update` (with an admission filter, rule 2 only: see below) and the
    writes they make: hits get last = max(last, now),
    count += 1; an admitted id's own expired slot is freed (cleared). Placement (`place`)
    reads the result: a slot hit this step then has last >= now (never evictable) and a
    freed one is empty. Ids are independent here, so any split of a step's ids into calls
    gives the same state.

    `grouped`: the caller promises that ids of one local bucket are contiguous (sorted by
    bucket, as `_dynamic` resolves them), so the writes are grouped by runs, without a
    sort. Ids of one bucket apart would make two groups write one bucket, which the
    writes (unique windows) do not allow.

    `find`: a function of (state, hi, lo, local bucket) giving each id's (row of its slot,
    -1 where none; it holds one; that slot has expired): the Pallas kernel
    (`_hashindex_tpu.find_stale`), which then finds the hits and the expired slots
    to free, so the key windows are not read.

    `distinct`: the valid ids may come with copies, and these are the ids the counters
    count (one of each; default: every valid one). A copy gets the outcome of its id (the
    same find, the same admission hash) and writes what it writes again, which changes
    nothing (a hit's lane is set, not added).

    `scores`: with `grouped`, a function of (state, local bucket, lane, hit, freed, freed
    lane) that writes the hits (last = max(last, now), count + 1; `hit` holds the distinct
    ids' hits only) and the freed slots' last and count (0), and returns (last, count):
    the Pallas kernel (`_hashindex_tpu.scores`), in place of the windowed scatters.

    With min_count > 1 every miss is returned as admitted and nothing is freed or counted
    as rejected: `admission` decides for the misses, in calls of their own, so that the
    filter's work follows the misses, not every id (`update`)."""
    b = config.bucket_size
    hi, lo = _u32(hi).reshape(-1), _u32(lo).reshape(-1)
    valid = jnp.asarray(valid, bool).reshape(-1) & ~_is_pad(hi, lo)
    distinct = valid if distinct is None else jnp.asarray(distinct, bool).reshape(-1) & valid
    admission = config.min_count == 1  # Else `admission`'s, for the misses.
    now = jnp.asarray(now, jnp.int32)
    nbl = state.last.shape[0] // b
    lb = jnp.clip(jnp.asarray(local_bucket, jnp.int32).reshape(-1), 0, nbl - 1)

    if find is not None:
        found_row, found, expired = find(state, hi, lo, lb)
        lane = found_row - lb * b
        hit, stale = found & ~expired & valid, found & expired & valid
        hit_lane, stale_lane = jnp.where(hit, lane, 0), jnp.where(stale, lane, 0)
    else:
        keys_hi, keys_lo = _key_rows(state.keys, lb, b)
        last = _rows(state.last, lb * b, b)
        occupied = ~_is_pad(keys_hi, keys_lo)
        expired = occupied & _expired(config, last, now)
        same = (keys_hi == hi[:, None]) & (keys_lo == lo[:, None]) & valid[:, None]
        hit_lanes, stale_lanes = same & ~expired, same & expired
        hit, hit_lane = _only_lane(hit_lanes)
        stale, stale_lane = _only_lane(stale_lanes)
    miss = valid & ~hit

    admit = miss
    if admission and config.admit_probability < 1.0:
        threshold = jnp.uint32(_admit_threshold(config.admit_probability))
        admit &= _admit_hash(config, hi, lo, now) < threshold
    frees = config.ttl_steps is not None and admission  # Else no slot is freed here.
    freed = stale & admit & frees
    row = jnp.where(hit, lb * b + hit_lane, -1)

    # The writes: each bucket with a hit or a freed slot rewritten whole, once.
    u = hi.shape[0]
    groups = min(u, nbl + 1)
    edit = hit | freed
    if grouped:  # At most the valid ids' nbl buckets and one run of padding.
        group, group_bucket = _runs(lb, groups, nbl)
    else:
        z = jnp.zeros_like(hi)
        group, _, group_bucket = _groups(jnp.where(edit, lb, nbl), z, hi, lo, edit, groups)
    bucket = jnp.minimum(group_bucket, nbl - 1)
    first = bucket * b
    # The writes combine each window with the step's values (a hit's last: max with now;
    # its count: + 1; a freed slot's last and count: times 0, its key words: max with
    # PAD), so they never read the windows they write: the TPU compiler charges a scatter
    # whose values were gathered from its own operand several times one whose values were
    # not (docs/design.md).
    if scores is not None:  # The freed slots' last and count too.
        assert grouped, "the kernel takes ids sorted by bucket"
        one = hit & distinct  # A slot's hit once, not again for each copy of its id.
        last, count = scores(state, lb, hit_lane, one, freed if frees else None, stale_lane)
    else:
        hits_at = _spread(groups, b, group, hit_lane, {}, hit)["set"]
        hit_groups = hits_at.any(1) & (group_bucket < nbl)
        last = _put_rows(state.last, first, jnp.where(hits_at, now, _INT32_MIN), hit_groups, _MAX)
        count = _put_rows(state.count, first, hits_at.astype(jnp.int32), hit_groups, _ADD)
    count_of = lambda x: (x & distinct).sum()
    tally = {"hits": count_of(hit), "misses": count_of(miss), "rejected": count_of(miss & ~admit)}
    tally["expired"] = count_of(freed)
    keys = {}
    if frees:
        freed_at = _spread(groups, b, group, stale_lane, {}, freed)["set"]
        freed_groups = freed_at.any(1) & (group_bucket < nbl)
        if scores is None:
            kept = (~freed_at).astype(jnp.int32)
            last = _put_rows(last, first, kept, freed_groups, _MUL)
            count = _put_rows(count, first, kept, freed_groups, _MUL)
        pads = jnp.where(freed_at, jnp.uint32(PAD), jnp.uint32(0))
        keys["keys"] = _put_key_rows(state.keys, bucket, pads, pads, freed_groups, _MAX)
    new = dataclasses.replace(
        state, **keys, last=last, count=count, stats=state.stats + _tally(tally)[None, :]
    )
    return Sighted(new, hit, row, miss, admit)


def _tally(counts: dict):
    return jnp.stack([jnp.asarray(counts.get(name, 0), jnp.int32) for name in STAT_NAMES])


def place(config: IndexConfig, state: IndexState, hi, lo, local_bucket, admit, now):
    """Rule 4 of `update` for the admitted ids (`admit`; distinct, sorted or not) on the
    state `sighted` left: per bucket, in priority order, they take free slots, then expired
    ones, then (unless eviction is "none") occupied ones with last < now. Returns (state,
    local row int32 (-1 where not placed), placed bool), both shaped as `hi`.

    A bucket's ids may come in several calls, in priority order: a slot placed by an
    earlier call has last == now, so it is unavailable to later ones, and the slots left
    keep their order; each call's ranks then pick the slots one call's would have."""
    b = config.bucket_size
    shape = jnp.shape(hi)
    hi, lo = _u32(hi).reshape(-1), _u32(lo).reshape(-1)
    admit = jnp.asarray(admit, bool).reshape(-1) & ~_is_pad(hi, lo)
    now = jnp.asarray(now, jnp.int32)
    nbl = state.last.shape[0] // b
    lb = jnp.clip(jnp.asarray(local_bucket, jnp.int32).reshape(-1), 0, nbl - 1)
    prio = priority(config, hi, lo)

    # The admitted ids grouped by bucket (at most one group per local bucket, plus the
    # others'), each ranked in its group by priority: the ranks pick distinct slots.
    u = hi.shape[0]
    groups = min(u, nbl + 1)
    group, rank, group_bucket = _groups(jnp.where(admit, lb, nbl), prio, hi, lo, admit, groups)
    # The slots of each id's bucket in their order. Where the ids are no more than the
    # groups (a round of a few ids), each orders its own bucket's (a group's ids see one
    # order): reading a group's order back per id cost the TPU compiler more than that.
    # Where they are more (a whole step's), each group's are ordered once and read back.
    per_id = u <= groups
    bucket = jnp.minimum(group_bucket, nbl - 1)
    at = lb if per_id else bucket
    k_hi, k_lo = _key_rows(state.keys, at, b)
    k_last, k_count = _rows(state.last, at * b, b), _rows(state.count, at * b, b)
    occupied = ~_is_pad(k_hi, k_lo)
    expired = occupied & _expired(config, k_last, now)
    evictable = occupied & ~expired & (k_last < now)
    if config.eviction == "none":
        evictable = jnp.zeros_like(evictable)
    cls = jnp.where(~occupied, 0, jnp.where(expired, 1, jnp.where(evictable, 2, 3)))
    keyed = (cls == 1) | (cls == 2)
    z = jnp.uint32(0)
    lanes = lax.broadcasted_iota(jnp.int32, k_hi.shape, 1).astype(jnp.uint32)
    # Free and unavailable slots are ordered by lane (interchangeable), the others by key.
    tail = (
        jnp.where(keyed, priority(config, k_hi, k_lo), lanes),
        jnp.where(keyed, k_hi, z),
        jnp.where(keyed, k_lo, z),
    )
    if config.eviction == "lfu":
        score = (
            jnp.where(cls == 2, k_count, jnp.where(keyed, k_last, 0)),
            jnp.where(cls == 2, k_last, 0),
        )
    else:
        score = (jnp.where(keyed, k_last, 0),)
    order = _lane_order((cls, *score, *tail))
    if not per_id:
        order, cls = (_rows(x.reshape(-1), group * b, b) for x in (order, cls))
    placed = admit & (rank < (cls < 3).sum(1))
    lane = _at(order, jnp.minimum(rank, b - 1))
    taken = _at(cls, lane)
    row = jnp.where(placed, lb * b + lane, -1)

    # Each placed slot's key, last = now and count = 1, written by bucket window.
    arrays = {"last": (state.last, now), "count": (state.count, jnp.int32(1))}
    new = _set_entries(
        b, nbl, lb, lane, placed, arrays, (state.keys, hi, lo), (group, group_bucket)
    )
    stats = state.stats + placed_tally(admit, placed, taken)[None, :]
    return dataclasses.replace(state, **new, stats=stats), row.reshape(shape), placed.reshape(shape)


def placed_tally(admit, placed, taken):
    """`place`'s counters ((len(STAT_NAMES),) int32) from its admitted ids, those placed and
    the class of the slot each took (`place`'s `cls`: 1 expired, 2 evicted)."""
    tally = {
        "admitted": placed.sum(),
        "failed": (admit & ~placed).sum(),
        "evicted": (placed & (taken == 2)).sum(),
        "expired": (placed & (taken == 1)).sum(),
    }
    return _tally(tally)


def _set_entries(
    width: int, num_buckets: int, bucket, lane, write, arrays: dict, keys=None, grouping=None
):
    """Each written id's own entry (bucket, lane), distinct where `write`, set in flat int32
    arrays of buckets of `width` ({name: (array, values)}) and, with `keys` = (array, hi, lo),
    in block-interleaved keys. Returns {name: array} ("keys" too). The ids are grouped by
    bucket (a sort of them) and each bucket's window is cleared (times 0), then combined
    with the values (added; the keys by max): two scatters of values that never read the
    windows they write, which the TPU compiler charges less than one scatter set from a
    read of them, and far less than an element scatter (a tile per element: about 4 MB
    for a round's 480 ids; docs/design.md). `grouping`: the ids' (group, group bucket)
    when the caller has them (`_groups` of a superset of `write`)."""
    u = bucket.shape[0]
    if grouping is None:
        z = jnp.zeros_like(bucket)
        key = jnp.where(write, bucket, num_buckets)
        grouping = _groups(key, z, z, z, write, min(u, num_buckets + 1))[::2]
    group, group_bucket = grouping
    groups = group_bucket.shape[0]
    # Per-id values are spread into their windows; a value shared by all (a scalar) is
    # taken where a lane is set, without a scatter of its own.
    values = {name: v for name, (_, v) in arrays.items() if jnp.ndim(v)}
    if keys is not None:
        values.update(hi=keys[1], lo=keys[2])
    values = {k: jnp.broadcast_to(v, (u,)) for k, v in values.items()}
    e = _spread(groups, width, group, lane, values, write)
    written = e["set"].any(1) & (group_bucket < num_buckets)
    at = jnp.minimum(group_bucket, num_buckets - 1)
    keep = (~e["set"]).astype(jnp.int32)
    out = {}
    for name, (array, v) in arrays.items():  # Cleared lanes plus the values: never read.
        v = e[name] if name in values else jnp.where(e["set"], v, 0).astype(array.dtype)
        array = _put_rows(array, at * width, keep, written, _MUL)
        out[name] = _put_rows(array, at * width, v, written, _ADD)
    if keys is not None:
        array = _put_key_rows(keys[0], at, keep, keep, written, _MUL)
        out["keys"] = _put_key_rows(array, at, e["hi"], e["lo"], written, _MAX)
    return out


def _filter_entry(config: IndexConfig, state: IndexState, hi, lo, local_bucket, mask):
    """(filter bucket, in the filter, lane there, its sightings so far) of ids (flat) where
    `mask`: the window of their filter bucket, compared whole."""
    b, bf = config.bucket_size, config.filter_bucket_size
    nbl, nfl = state.last.shape[0] // b, state.filter_count.shape[0] // bf
    fb = local_bucket // (nbl // nfl)
    f_hi, f_lo = _key_rows(state.filter_keys, fb, bf)
    same = (f_hi == hi[:, None]) & (f_lo == lo[:, None]) & mask[:, None]
    found, lane = _only_lane(same)
    count = jnp.where(same, _rows(state.filter_count, fb * bf, bf), 0).sum(1)
    return fb, found, lane, count


def _flat_ids(config: IndexConfig, state: IndexState, hi, lo, local_bucket, mask):
    """(hi, lo, local bucket, mask), flat, with padding out of the mask."""
    hi, lo = _u32(hi).reshape(-1), _u32(lo).reshape(-1)
    mask = jnp.asarray(mask, bool).reshape(-1) & ~_is_pad(hi, lo)
    nbl = state.last.shape[0] // config.bucket_size
    lb = jnp.clip(jnp.asarray(local_bucket, jnp.int32).reshape(-1), 0, nbl - 1)
    return hi, lo, lb, mask


def admission(
    config: IndexConfig, state: IndexState, hi, lo, local_bucket, miss, now, distinct=None
):
    """Rule 3 of `update`, and rule 4's freeing of an admitted id's own expired slot, for
    the misses (`miss`) that `sighted` left to it, in any split into calls (the
    caller's rounds): each miss writes only its own slot and filter entry. A miss in the
    filter gets its sightings (count) and `filter_last` = now, which keeps its entry from
    the step's first sightings (`record`, after placement; a placed id's entry is freed by
    `unfilter`). `distinct`: as `sighted`'s (copies of an id get its outcome and write
    nothing). Returns (state, admitted, first: a first sighting, to `record`)."""
    b = config.bucket_size
    hi, lo, lb, miss = _flat_ids(config, state, hi, lo, local_bucket, miss)
    distinct = miss if distinct is None else jnp.asarray(distinct, bool).reshape(-1) & miss
    now = jnp.asarray(now, jnp.int32)
    admit, in_filter = miss, jnp.zeros_like(miss)
    if config.admit_probability < 1.0:
        threshold = jnp.uint32(_admit_threshold(config.admit_probability))
        admit &= _admit_hash(config, hi, lo, now) < threshold
    new = {}
    if config.min_count > 1:
        bf = config.filter_bucket_size
        fb, in_filter, f_lane, count = _filter_entry(config, state, hi, lo, lb, miss)
        sightings = jnp.minimum(count + 1, config.min_count)
        admit &= sightings >= config.min_count
        nfl = state.filter_count.shape[0] // bf
        arrays = {"filter_count": (state.filter_count, sightings)}
        arrays["filter_last"] = (state.filter_last, now)
        new.update(_set_entries(bf, nfl, fb, f_lane, in_filter & distinct, arrays))
    freed = jnp.zeros_like(miss)
    if config.ttl_steps is not None:  # The id's own slot, expired (else it would have hit).
        k_hi, k_lo = _key_rows(state.keys, lb, b)
        stale, lane = _only_lane((k_hi == hi[:, None]) & (k_lo == lo[:, None]) & miss[:, None])
        freed = stale & admit & distinct
        pad, zero = jnp.uint32(PAD), jnp.int32(0)
        arrays = {"last": (state.last, zero), "count": (state.count, zero)}
        nbl = state.last.shape[0] // b
        new.update(_set_entries(b, nbl, lb, lane, freed, arrays, (state.keys, pad, pad)))
    tally = {"rejected": (distinct & ~admit).sum(), "expired": freed.sum()}
    new["stats"] = state.stats + _tally(tally)[None, :]
    return dataclasses.replace(state, **new), admit, miss & ~in_filter


def unfilter(config: IndexConfig, state: IndexState, hi, lo, local_bucket, placed):
    """Rule 4's last clause for ids `placed` (distinct) this step, in any split into calls:
    each leaves the filter (its entry is emptied, free for the step's first sightings)."""
    if config.min_count == 1:
        return state
    bf = config.filter_bucket_size
    hi, lo, lb, placed = _flat_ids(config, state, hi, lo, local_bucket, placed)
    fb, found, lane, _ = _filter_entry(config, state, hi, lo, lb, placed)
    pad, nfl = jnp.uint32(PAD), state.filter_count.shape[0] // bf
    arrays = {"filter_count": (state.filter_count, jnp.int32(0))}
    new = _set_entries(bf, nfl, fb, lane, found, arrays, (state.filter_keys, pad, pad))
    return dataclasses.replace(state, filter_keys=new.pop("keys"), **new)


def record(config: IndexConfig, state: IndexState, hi, lo, local_bucket, first, now):
    """Rule 5's first sightings (`first`, distinct), after `admission` and `unfilter` have
    run for all of the step's ids: per filter bucket in priority order each takes a free
    entry, else the entry not sighted this step (`filter_last` < now) of lowest (count,
    priority): filter_evicted; else none: filter_failed. The calls may split a filter
    bucket's ids if they come in (filter bucket, priority) order: an entry taken by an
    earlier call was sighted now, and the others keep their order (as `place`'s slots)."""
    bf = config.filter_bucket_size
    hi, lo, lb, first = _flat_ids(config, state, hi, lo, local_bucket, first)
    now = jnp.asarray(now, jnp.int32)
    nbl, nfl = state.last.shape[0] // config.bucket_size, state.filter_count.shape[0] // bf
    fb = lb // (nbl // nfl)
    u, z = hi.shape[0], jnp.uint32(0)
    groups = min(u, nfl + 1)
    prio = priority(config, hi, lo)
    group, rank, group_bucket = _groups(jnp.where(first, fb, nfl), prio, hi, lo, first, groups)
    # Each id orders its own filter bucket's entries where the ids are no more than the
    # groups (a round's), as `place` does; else each group's are ordered once and read back.
    per_id = u <= groups
    at = fb if per_id else jnp.minimum(group_bucket, nfl - 1)
    g_hi, g_lo = _key_rows(state.filter_keys, at, bf)
    g_count = _rows(state.filter_count, at * bf, bf)
    g_last = _rows(state.filter_last, at * bf, bf)
    cls = jnp.where(_is_pad(g_hi, g_lo), 0, jnp.where(g_last == now, 3, 1))
    keyed = cls == 1
    lanes = lax.broadcasted_iota(jnp.int32, g_hi.shape, 1).astype(jnp.uint32)
    order = _lane_order(
        (
            cls,
            jnp.where(keyed, g_count, 0),
            jnp.where(keyed, priority(config, g_hi, g_lo), lanes),
            jnp.where(keyed, g_hi, z),
            jnp.where(keyed, g_lo, z),
        )
    )
    if not per_id:
        order, cls = (_rows(x.reshape(-1), group * bf, bf) for x in (order, cls))
    recorded = first & (rank < (cls < 3).sum(1))
    lane = _at(order, jnp.minimum(rank, bf - 1))
    taken = _at(cls, lane)
    tally = {
        "filter_evicted": (recorded & (taken == 1)).sum(),
        "filter_failed": (first & ~recorded).sum(),
    }
    arrays = {"filter_count": (state.filter_count, jnp.int32(1))}
    arrays["filter_last"] = (state.filter_last, now)
    keys = (state.filter_keys, hi, lo)
    new = _set_entries(bf, nfl, fb, lane, recorded, arrays, keys, (group, group_bucket))
    return dataclasses.replace(
        state, filter_keys=new.pop("keys"), **new, stats=state.stats + _tally(tally)[None, :]
    )


def occupancy(config: IndexConfig, state: IndexState, now):
    """Live slots (holding a key, not expired) of an index, int32 (local or global arrays)."""
    return (_held(config, state) & ~_expired(config, state.last, now)).sum(dtype=jnp.int32)


def _held(config: IndexConfig, state: IndexState):
    """(NB·b,) bool, slot order: the slot holds a key. The reshape splits each shard's run
    of whole buckets, which a sharded (Explicit) dimension allows."""
    keys = jnp.asarray(state.keys).reshape(-1, 2, config.bucket_size)
    return ~_is_pad(keys[:, 0], keys[:, 1]).reshape(-1)


def stats(config: IndexConfig, state: IndexState, now) -> dict:
    """{name: int32 scalar}: STAT_NAMES summed over the shards, "occupancy" (live slots) and
    "held" (slots holding a key, expired ones included). admitted - evicted - expired ==
    held at all times; without TTL held == occupancy."""
    totals = jnp.asarray(state.stats).sum(0, dtype=jnp.int32)
    out = {name: totals[i] for i, name in enumerate(STAT_NAMES)}
    out["occupancy"] = occupancy(config, state, now)
    out["held"] = _held(config, state).sum(dtype=jnp.int32)
    return out


# -------------------------------------------------------------------- host: checkpoints


def export(config: IndexConfig, state: IndexState, now=None):
    """The entries of an index, NumPy: (ids int64 ascending, global rows int64, last int32,
    count int32).

    With `now` None every slot holding a key is exported, TTL-expired ones included: they
    keep their `last`, so `build` restores them expired, and a restored index behaves as the
    saved one would have. With `now` given, expired entries are left out."""
    hi, lo = slot_words(state.keys, config.bucket_size)
    last, count = np.asarray(state.last).reshape(-1), np.asarray(state.count).reshape(-1)
    keep = ~((hi == PAD) & (lo == PAD))
    if now is not None and config.ttl_steps is not None:
        keep &= ~(np.int64(now) - last >= config.ttl_steps)
    rows = np.nonzero(keep)[0]
    ids = join_ids(hi[rows], lo[rows])
    order = np.argsort(ids, kind="stable")
    rows = rows[order]
    return ids[order], rows.astype(np.int64), last[rows], count[rows]


def build(
    config: IndexConfig,
    num_shards: int,
    ids,
    last,
    count,
    shard: int | None = None,
    lanes=None,
):
    """A fresh index for `num_shards` shards holding the given entries (an `export`), and
    each id's global row (int64, in the order of `ids`). Filter and stats start empty.
    With `shard` given, that shard's part of the index (`empty_state`) and rows local to
    it; every id must belong to it.

    `lanes`: each id's lane in its bucket, as the exported index had it (its row modulo
    the bucket size; only where that index had this one's buckets): each id then gets the
    row it had, so that what is keyed by rows (the stochastic rounding of bfloat16 rows)
    goes on as it would have. Without them, lanes are assigned in ascending id order inside
    each bucket; the rules of `update` do not depend on lanes, so the index behaves as the
    exported one either way."""
    config.check_shards(num_shards)
    ids = np.asarray(ids, np.int64).reshape(-1)
    last = np.asarray(last, np.int32).reshape(-1)
    count = np.asarray(count, np.int32).reshape(-1)
    if not ids.shape == last.shape == count.shape:
        raise ValueError(
            f"build: ids, last and count must have one entry each per id, got shapes "
            f"{ids.shape}, {last.shape} and {count.shape}."
        )
    if (ids == -1).any():
        raise ValueError("build: -1 is padding, never a key; it may not be among the ids.")
    hi, lo = split_ids(ids)
    g = np.asarray(global_bucket(config, hi, lo)).astype(np.int64)
    if shard is not None:
        per = config.buckets // num_shards
        outside = (g // per) != shard
        if outside.any():
            raise ValueError(
                f"build: id {int(ids[outside][0])} belongs to shard "
                f"{int(g[outside][0] // per)} of {num_shards}, not to shard {shard}."
            )
        g = g - shard * per
    order = np.lexsort((ids, g))
    repeats = int(np.count_nonzero(ids[order][1:] == ids[order][:-1]))  # Equal ids: adjacent.
    if repeats:
        raise ValueError(f"build: the ids must be distinct ({repeats} repeat).")
    sorted_g = g[order]
    first = np.searchsorted(sorted_g, sorted_g, side="left")
    lane = np.arange(ids.size) - first
    b = config.bucket_size
    if ids.size and lane.max() >= b:
        worst = np.bincount(g).argmax()
        raise ValueError(
            f"build: bucket {worst} would hold {np.bincount(g).max()} ids, but its capacity "
            f"is bucket_size = {b}."
        )
    if lanes is not None:
        lane = np.asarray(lanes, np.int64).reshape(-1)[order]
        if lane.shape != order.shape or (ids.size and (lane.min() < 0 or lane.max() >= b)):
            raise ValueError(
                f"build: lanes must give one lane in [0, {b}) per id, got "
                f"{np.asarray(lanes).shape} lanes for {ids.size} ids."
            )
        taken = np.unique(sorted_g * b + lane).size
        if taken != ids.size:
            raise ValueError(f"build: {ids.size - taken} ids are given a lane already taken.")
    state = empty_state(config, num_shards, shard)
    rows = np.empty(ids.size, np.int64)
    rows[order] = sorted_g * b + lane
    set_slot_words(state.keys, b, rows, hi, lo)
    state.last[rows] = last
    state.count[rows] = count
    return state, rows
