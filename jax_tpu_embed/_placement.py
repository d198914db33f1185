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

A table placed `HostCached` adds a device cache of each array's hot rows (`Lines`), and the
row work sees each of its arrays as a `Cached` (the host array, its cache, the step). Its
`gather` reads what the cache holds from HBM and fetches only the misses from the host, a
bounded number per host call (`max_misses`); its `scatter` writes every row through to
the host and keeps the cache's copies current, inserting the rows it missed (least
recently written out, within a set). The host array always holds the table, so the cache
is never flushed and its values are the same bits: everything above this module is
unaware of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.compute_on import compute_on

from . import _layout, _loops
from ._rowindex import NOT_MINE

HOST = "pinned_host"


def host_memory_supported(device) -> bool:
    """Whether `device` can address pinned host memory (TPU, GPU and CPU devices can)."""
    try:
        return HOST in {m.kind for m in device.addressable_memories()}
    except Exception:  # A platform without memory spaces.
        return False


def gather(on_host: bool, buffers, indices) -> list:
    """[buffers[i] rows at indices[i]], zeros where an index is out of range; on the host,
    one host computation for all of them (`Cached` buffers: per round of misses)."""
    if buffers and isinstance(buffers[0], Cached):
        return _cached_gather(buffers, indices)
    if buffers and isinstance(buffers[0], Staged):
        return _staged_gather(buffers, indices)
    if not on_host:
        return [b.at[i].get(mode="fill", fill_value=0) for b, i in zip(buffers, indices)]
    valid = [(i >= 0) & (i < b.shape[0]) for b, i in zip(buffers, indices)]
    rows = _fetch(list(buffers), indices)
    return [
        jnp.where(v.reshape(v.shape + (1,) * (r.ndim - v.ndim)), r, jnp.zeros((), r.dtype))
        for r, v in zip(rows, valid)
    ]


# The name of the host computations that read rows a device did not find in its memory
# (a cache's or the staged rows' misses), which run as the data needs, possibly never:
# `_aot.host_calls` tells them from the reads every step makes by it.
MISSES = "read_misses"


def _fetch(hosts, indices, misses: bool = False) -> list:
    """[hosts[i] rows at indices[i] clamped into range], read by one host computation and
    moved to the device; `misses`: named MISSES."""
    clamped = [
        jax.device_put(jnp.clip(i, 0, h.shape[0] - 1), jax.memory.Space.Host)
        for h, i in zip(hosts, indices)
    ]

    def read(hosts, indices):
        return [h.at[i].get(mode="promise_in_bounds") for h, i in zip(hosts, indices)]

    read.__name__ = MISSES if misses else "read"
    got = compute_on("device_host")(jax.jit(read))(hosts, clamped)
    return [jax.device_put(r, jax.memory.Space.Device) for r in got]


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
    if buffers and isinstance(buffers[0], Staged):
        hosts = write(True, store, [b.host for b in buffers], list(indices), values)
        return [
            dataclasses.replace(b, host=h, rows=_staged_write(b, i, v) if b.packed else b.rows)
            for b, h, i, v in zip(buffers, hosts, indices, values)
        ]
    if buffers and isinstance(buffers[0], Cached):
        hosts = write(True, store, [b.host for b in buffers], list(indices), values)
        return [
            dataclasses.replace(b, host=h, lines=_insert(b, i, v))
            for b, h, i, v in zip(buffers, hosts, indices, values)
        ]
    return write(on_host, store, list(buffers), list(indices), values)


def update_slice(on_host: bool, buffer, block, at) -> jax.Array:
    """`buffer` with `block` written at offsets `at` (a block of `init`)."""
    return write(
        on_host, lambda b, x, at: jax.lax.dynamic_update_slice(b, x, at), buffer, block, at
    )


# ------------------------------------------------------------------ rows staged for a step


class _HostArray:
    """One array's shard in host memory (`host`) with some of its rows in device memory, as
    the row work sees it (`Staged`, `Cached`): shaped and typed as the host array."""

    host: Any

    @property
    def shape(self):
        return self.host.shape

    @property
    def dtype(self):
        return self.host.dtype

    def misses_per_call(self, n: int) -> int:
        """Rows a host computation fetches of the `n` a gather misses at most (`_miss_rounds`):
        an eighth, at least 8."""
        return min(n, max(8, n // 8))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Staged(_HostArray):
    """Inside `shard_map`: one array of a `placement="host"` table in a step that read the
    batch's rows from the host once (`stage`): its shard in host memory, `at` ((U,) int32)
    the distinct local physical rows read, ascending (NOT_MINE past them), and `rows` their
    values in device memory. The lookup and the update then gather from `rows`; an index
    not staged (a device owning more than U distinct rows, or other features than the
    staged ones) is fetched from the host in rounds (`_miss_rounds`), so values never
    depend on what was staged. Scatters write through to the host, and into `rows` where
    the array is lane-packed (`packed`): a physical row then holds logical rows that a
    later pass of the update reads again; otherwise a step writes each row once, after
    its last read."""

    host: Any
    at: Any
    rows: Any
    packed: bool = dataclasses.field(metadata=dict(static=True))


def stage(hosts, rows, limit: int) -> tuple[list, list]:
    """([at], [values]) of each host array: the first `limit` distinct rows among
    `rows[i]` (local physical rows; out of range: none), ascending and padded with NOT_MINE,
    and their values, read from the host by one host computation for all the arrays."""
    ats = []
    for h, r in zip(hosts, rows):
        mine = distinct(jnp.where((r >= 0) & (r < h.shape[0]), r, NOT_MINE))
        ats.append(lax.sort(mine, is_stable=False)[:limit])  # The repeats (NOT_MINE) last.
    return ats, _fetch(list(hosts), ats)


def distinct(rows):
    """`rows` (int32, (n,)) sorted, each repeat of a value replaced by NOT_MINE (no row):
    distinct rows, as `prefetch` and `stage` take them."""
    rows = lax.sort(rows, is_stable=False)
    repeat = jnp.concatenate([jnp.zeros((1,), bool), rows[1:] == rows[:-1]])
    return jnp.where(repeat, NOT_MINE, rows)


def _positions(at, idx):
    """(pos, hit): where each of `idx` is in the ascending `at`, and whether it is there, by
    two sorts of both together: the TPU compiler charges a 1-D gather or scatter (as
    `searchsorted` makes) a whole tile per element."""
    u, n = at.shape[0], idx.shape[0]
    values = jnp.concatenate([at, idx])
    tag = jnp.concatenate([jnp.zeros((u,), jnp.int32), jnp.ones((n,), jnp.int32)])
    query = jnp.concatenate([jnp.full((u,), n, jnp.int32), lax.iota(jnp.int32, n)])
    # By value, each of `at` before the queries of its value.
    values, tag, query = lax.sort((values, tag, query), num_keys=2, is_stable=False)
    i = lax.iota(jnp.int32, u + n)
    starts = jnp.concatenate([jnp.ones((1,), bool), values[1:] != values[:-1]])
    # A query hits when the run of its value starts with an entry of `at`; that entry is
    # the last of `at` before it.
    first_tag = lax.cummax(jnp.where(starts, 2 * i + tag, -1)) % 2
    hit = (tag == 1) & (first_tag == 0)
    pos = jnp.cumsum(tag == 0, dtype=jnp.int32) - 1
    # Back to the queries' order (the entries of `at` last).
    _, pos, hit = lax.sort((query, pos, hit), num_keys=1, is_stable=False)
    return pos[:n], hit[:n]


def _staged_lines(b: Staged, idx):
    """(line, miss): each index's row of `b.rows` (past them where it has none) and whether
    it is a row of the shard that was not staged."""
    valid = (idx >= 0) & (idx < b.host.shape[0])
    pos, hit = _positions(b.at, idx)
    return jnp.where(valid & hit, pos, b.at.shape[0]), valid & ~hit


def _staged_write(b: Staged, idx, values):
    """`b.rows` with the staged ones of rows `idx` set to `values`."""
    line, _ = _staged_lines(b, idx)
    return b.rows.at[line].set(values, mode="drop")


def _staged_gather(buffers, indices) -> list:
    """`gather` of `Staged` arrays: staged rows from device memory, the others (if any)
    from the host in rounds."""
    outs, misses = [], []
    for b, idx in zip(buffers, indices):
        line, miss = _staged_lines(b, idx)
        outs.append(b.rows.at[line].get(mode="fill", fill_value=0))
        misses.append(miss)
    return _miss_rounds(buffers, indices, misses, _filled, outs)


def _filled(at, rows, got, outs):
    """`_miss_rounds`' `fetched` for gathers: the fetched rows `got` set at positions `at`
    of the outputs."""
    return [o.at[a].set(g, mode="drop") for o, a, g in zip(outs, at, got)]


# ------------------------------------------------------------------ the device cache


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """A `HostCached` table's cache on each device: `rows` logical rows of its shard, in sets
    of `ways` (LRU within a set), and `max_misses` (None: an eighth of a pass's rows, at
    least 8) host rows fetched per host call; `prefetch`: whether prefetches fill it."""

    rows: int
    ways: int
    max_misses: int | None = None
    prefetch: bool = True

    def sets(self, per_row: int) -> int:
        """Sets of an array that packs `per_row` logical rows into one physical row."""
        lines = -(-self.rows // per_row)
        return max(1, -(-lines // self.ways))

    def misses_per_call(self, n: int) -> int:
        return min(n, self.max_misses or max(8, n // 8))


COUNTERS = ("hits", "misses", "inserted", "evicted", "prefetched")
EMPTY = -1  # The tag of a line holding no row.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Lines:
    """One array's device cache, row-sharded: each device caches rows of its own shard.

    Attributes:
        rows: (N * sets * ways, ...) the cached physical rows, in the array's dtype.
        tags: (N * `_padded(sets * ways, ways)`,) int32, the local physical row each line
            holds (EMPTY: none); a set's ways one after another, then padding, which no set
            reads. Flat and padded to whole 128-lane rows: `_sets` reads a set's ways from
            the rows of 128 words they lie in.
        last: As `tags`: the step each line was last written (LRU).
        counts: (N, len(COUNTERS)) int32: distinct rows the updates found (hits) and did
            not find (misses), rows inserted and rows they evicted (by updates and
            prefetches), and rows prefetches fetched from the host.
    """

    rows: Any
    tags: Any
    last: Any
    counts: Any


def empty_lines(shape, dtype, sets: int, ways: int, num_shards: int) -> Lines:
    """A cache holding no row, for an array whose physical rows have shape shape[1:]."""
    lines = num_shards * sets * ways
    words = num_shards * _padded(sets * ways, ways)
    return Lines(
        rows=jnp.zeros((lines, *shape[1:]), dtype),
        tags=jnp.full((words,), EMPTY, jnp.int32),
        last=jnp.full((words,), -1, jnp.int32),
        counts=jnp.zeros((num_shards, len(COUNTERS)), jnp.int32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cached(_HostArray):
    """Inside `shard_map`: one array of a `HostCached` table as the row work sees it, its
    shard in host memory with its device cache; `now` (1,) int32 is the step (the update's
    step, or the next one for a prefetch)."""

    host: Any
    lines: Lines
    now: Any
    cache: CacheShape = dataclasses.field(metadata=dict(static=True))

    def misses_per_call(self, n: int) -> int:
        return self.cache.misses_per_call(n)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CacheState:
    """A `HostCached` table's caches (in `EmbeddingState.index`): its array's and each
    stored slot's ({slot name: Lines})."""

    table: Lines
    slots: dict


def with_cache(shape: CacheShape, table, slots: dict, cache: CacheState, now):
    """(table, slots) of a `HostCached` table as `Cached` arrays for the row work."""
    wrap = lambda host, lines: Cached(host, lines, now, shape)
    return wrap(table, cache.table), {n: wrap(x, cache.slots[n]) for n, x in slots.items()}


def without_cache(table: Cached, slots: dict) -> tuple:
    """The inverse of `with_cache`: (host table, {slot: host array}, CacheState)."""
    cache = CacheState(table.lines, {n: x.lines for n, x in slots.items()})
    return table.host, {n: x.host for n, x in slots.items()}, cache


def _set_of(idx, sets: int):
    """The set of local physical row `idx`: murmur3's finalizer, every bit of the row
    mixed into the low bits the modulo keeps, so that the small ids a power law favours,
    runs of rows and strided rows spread over the sets."""
    x = idx.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return ((x ^ (x >> 16)) % jnp.uint32(sets)).astype(jnp.int32)


def _padded(lines: int, ways: int) -> int:
    """Words of a shard's tags and ages: its lines in whole rows of 128, and the rows a
    set's window may reach past them."""
    return (-(-lines // 128) + _layout.window_rows(ways)) * 128


def _sets(flat, s, ways: int):
    """(n, ways): the sets `s` of a shard's tags or ages (`_padded`), as row gathers of
    their (words / 128, 128) view (`_layout.lane_windows`)."""
    return _layout.lane_windows(flat, s * ways, ways)


def _probe(c: Cached, idx):
    """(valid, set, hit, way) of each index: whether it is a row of the shard, its set,
    whether the cache holds it and in which way."""
    ways = c.cache.ways
    valid = (idx >= 0) & (idx < c.host.shape[0])
    s = _set_of(jnp.where(valid, idx, 0), c.lines.rows.shape[0] // ways)
    eq = (_sets(c.lines.tags, s, ways) == idx[:, None]) & valid[:, None]
    return valid, s, jnp.any(eq, axis=1), jnp.argmax(eq, axis=1).astype(jnp.int32)


def _cached_gather(buffers, indices) -> list:
    """`gather` of `Cached` arrays: hits from the caches; the misses of every array fetched
    from the host together, `max_misses` per array and host computation, in as many rounds
    as the array with most misses needs (none when everything hits)."""
    outs, misses = [], []
    for c, idx in zip(buffers, indices):
        valid, s, hit, way = _probe(c, idx)
        line = jnp.where(hit, s * c.cache.ways + way, c.lines.rows.shape[0])
        outs.append(c.lines.rows.at[line].get(mode="fill", fill_value=0))
        misses.append(valid & ~hit)
    return _miss_rounds(buffers, indices, misses, _filled, outs)


def _miss_rounds(buffers, indices, misses, fetched, carry):
    """Fetches the rows of `indices` where `misses` from the host, `max_misses` per array
    and host computation, every array in the same calls: `carry = fetched(at, rows, got,
    carry)` after each, with per array the positions `at` ((m,), n past the misses), the
    rows there (`rows`, -1 past them) and their values `got`. Rounds run while an array has
    misses left (none when everything hits)."""
    n = indices[0].shape[0]
    m = buffers[0].misses_per_call(n)
    iota = lax.iota(jnp.int32, n)
    # Each array's miss positions first, ascending, then n (a sort, not `nonzero`: the TPU
    # compiler charges a 1-D gather a tile per element).
    order = [
        jnp.pad(
            lax.sort(jnp.where(miss, iota, n + iota), is_stable=False),
            (0, m),
            constant_values=2 * n,
        )
        for miss in misses
    ]
    total = jnp.max(jnp.stack([jnp.sum(miss, dtype=jnp.int32) for miss in misses]))

    def round_(state):
        start, carry = state
        at = [lax.dynamic_slice_in_dim(o, start, m) for o in order]
        at = [jnp.where(a < n, a, n) for a in at]  # n: no miss, dropped by `fetched`.
        rows = [jnp.where(a < n, idx[jnp.minimum(a, n - 1)], -1) for idx, a in zip(indices, at)]
        got = _fetch([c.host for c in buffers], rows, misses=True)
        return start + m, fetched(at, rows, got, carry)

    _, carry = lax.while_loop(lambda state: state[0] < total, round_, (jnp.int32(0), carry))
    return carry


def prefetch(buffers, indices, count=None, window: int | None = None) -> list:
    """The `Cached` arrays with the distinct rows `indices` (out of range: none) in their
    caches, ready for step `now`: missing rows fetched from the host and inserted, and
    every one of them kept until step `now` has used it: the update of the step before
    (`now - 1`) evicts no line marked `now`, and this insertion evicts only lines older
    than it. Only missing rows move: the lines a prefetch hits are marked, not read.

    `window`: at most that many indices of each array per call, in a loop over the first
    `count` (those past it are out of range), so that a device does its own rows' work
    and not the global batch's. A set's missing rows take its oldest ways in index order
    across calls and host rounds as in one (each insertion is marked `now`); a line that
    a later call would hit may be evicted by an earlier one, and is then fetched again:
    only where the device owns more than a window."""

    def once(buffers, indices):
        marked, misses = [], []
        for c, idx in zip(buffers, indices):
            valid, s, hit, way = _probe(c, idx)
            line = jnp.where(hit, s * c.cache.ways + way, c.lines.tags.shape[0])
            # First, so that no insertion below evicts a line this prefetch needs.
            last = c.lines.last.at[line].max(c.now[0], mode="drop")
            marked.append(dataclasses.replace(c.lines, last=last))
            misses.append(valid & ~hit)

        def fetched(at, rows, got, lines):
            return [
                _insert(dataclasses.replace(c, lines=x), r, g, prefetching=True)
                for c, x, r, g in zip(buffers, lines, rows, got)
            ]

        lines = _miss_rounds(buffers, indices, misses, fetched, marked)
        return [dataclasses.replace(c, lines=x) for c, x in zip(buffers, lines)]

    n = indices[0].shape[0]
    if window is None or window >= n:
        return once(buffers, indices)

    def call(*at_and_lines):
        *at, _, lines = at_and_lines
        part = [dataclasses.replace(c, lines=x) for c, x in zip(buffers, lines)]
        return (), [c.lines for c in once(part, at)]

    # Past `count` the indices are out of range: the padding's too.
    padded = [jnp.pad(i, (0, window), constant_values=-1) for i in indices]
    _, lines = _loops.in_windows(count, window, padded, call, (), [c.lines for c in buffers])
    return [dataclasses.replace(c, lines=x) for c, x in zip(buffers, lines)]


def _insert(c: Cached, idx, values, prefetching: bool = False) -> Lines:
    """The cache after the distinct rows `idx` (out of range: none) were written `values`
    at step `now`: the lines holding them get the new values, and the rows it missed take,
    in each set, the least recently written ways that neither this step nor a prefetch for
    the next has marked (the i-th missing row of a set the i-th such way; a row finding
    none stays uncached). A prefetch marks its rows `now` (the next step) and leaves the
    current step's alone."""
    lines = c.lines
    ways = c.cache.ways
    off = lines.tags.shape[0]  # Past the last line and the padding: dropped.
    sets = lines.rows.shape[0] // ways
    n = idx.shape[0]
    now = c.now[0]
    valid, s, hit, way = _probe(c, idx)
    hit_line = jnp.where(hit, s * ways + way, off)
    last = lines.last.at[hit_line].max(now, mode="drop")  # A prefetched mark stays.
    oldest = now - 1 if prefetching else now  # Lines marked this late are kept.
    miss = valid & ~hit
    # Each missing row's rank among the missing rows of its set, in index order.
    iota = lax.iota(jnp.int32, n)
    key, order = lax.sort((jnp.where(miss, s, sets), iota), num_keys=2, is_stable=False)
    starts = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
    rank_sorted = iota - lax.cummax(jnp.where(starts, iota, 0))
    rank = jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted)
    ages = _sets(last, s, ways)  # (n, ways)
    # Each way's place in its set from the oldest (ties: the lower way first), by comparing
    # every pair of ways: XLA:CPU sorts many short rows slowly (docs/design.md).
    lane = lax.iota(jnp.int32, ways)
    before = (ages[:, None, :] < ages[:, :, None]) | (
        (ages[:, None, :] == ages[:, :, None]) & (lane[None, :] < lane[:, None])
    )
    place = jnp.sum(before, axis=2, dtype=jnp.int32)  # (n, ways): ways ahead of each.
    pick = place == jnp.minimum(rank, ways - 1)[:, None]  # One way per row.
    victim = jnp.sum(jnp.where(pick, lane, 0), axis=1, dtype=jnp.int32)
    victim_last = jnp.sum(jnp.where(pick, ages, 0), axis=1, dtype=ages.dtype)
    insert = miss & (rank < ways) & (victim_last < oldest)
    new_line = jnp.where(insert, s * ways + victim, off)
    evicted = insert & (lines.tags.at[new_line].get(mode="fill", fill_value=EMPTY) >= 0)
    count = lambda x: jnp.sum(x, dtype=jnp.int32)
    found, missed = (jnp.int32(0), jnp.int32(0)) if prefetching else (count(hit), count(miss))
    fetched = count(miss) if prefetching else jnp.int32(0)
    return Lines(
        rows=lines.rows.at[jnp.where(hit, hit_line, new_line)].set(values, mode="drop"),
        tags=lines.tags.at[new_line].set(idx, mode="drop"),
        last=last.at[new_line].set(now, mode="drop"),
        counts=lines.counts
        + jnp.stack([found, missed, count(insert), count(evicted), fetched])[None, :],
    )
