"""Dynamic tables resolved at the owners: each device sends its own distinct ids to the
shards that own their buckets, in an `all_to_all`, and gets their rows back the same way.

The all-gather resolution (`_dynamic.lookup_rows`, `update_rows`) hands every device the
ids of the global batch: its all-gather, sorts and scatters grow with the number of devices
N at a fixed per-device batch. Here each device works on its m positions of the table
(XLA ops on TPU layouts and under owner routing: `_dynamic.with_kernel`):

1. Sort them by (owner, local bucket, priority, hi, lo) and keep the distinct ids (`_Ids`):
   owner p's run of them starts at `bounds[p]`.
2. Rounds (`_rounds`): send each owner the next ids of its run, at most Cd, in one
   `all_to_all` of (N, Cd) id words; the owner resolves the N·Cd ids it receives and sends
   one int32 per id back. A device with more than Cd ids for one owner runs more rounds:
   nothing is dropped.
3. The values come back to the distinct ids, and a running sum spreads each to the
   positions that hold the id (`_dynamic.to_positions`).

A lookup (`find`) reads nothing it writes, so its rounds may split the ids anyhow. An update
must see each id once and place a bucket's admitted ids in priority order across rounds
(`_hashindex.place`): in every round the devices agree, per owner p, on a threshold T_p
(the smallest Cd-th pending key of any device, keys compared as (owner·buckets + local
bucket, priority, hi, lo)), and each device sends its pending ids <= T_p. Every copy of an
id then reaches its owner in the same round, where duplicates from several devices are
merged, and the owner's rounds run in key order. `_routing` does the same for rows, with
one-word keys. An update is two such loops: every id's `sighted` (hits, admission, freed
slots) first, then the placement of the admitted ones, as one call would.

Per device and round the work is O(m + N·Cd), with Cd about 1.5·m/N: flat in N. A step's
routed tables share each loop (`_rounds`): one loop, and one set of agreements per round,
for all of them.
With an admission filter (`min_count > 1`) the first loop finds the hits only, and two
more loops run the filter's rules on the misses alone, in rounds of a 64th of Cd as the
placements: `_hashindex.admission` (sightings counted, each in its own entry, which
`filter_last` marks as sighted this step) before the placements, `_hashindex.record` (the
first sightings take entries, in filter-bucket order) after them (docs/design.md, "The
admission filter at the owners").

A table in host memory is not reset here: the update starts the rows given away from their
initial rows inside its one host read and write (`_dynamic.Fresh`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _dynamic, _hashindex, _routing

_MAX = np.uint32(0xFFFFFFFF)


def capacity(plan: _dynamic.DynamicPlan, m: int, num_shards: int) -> int:
    """Cd: distinct ids one device sends one owner per round. `max_ids_per_shard` / N when
    given, else 1.5·m / N (the all-gather resolution's window over N), a multiple of 8;
    at least m (one round always suffices) on one device."""
    if plan.window:
        cd = -(-plan.window // num_shards)
    else:
        cd = -(-3 * m // (2 * num_shards))
    cd = -(-max(cd, 8) // 8) * 8
    return min(cd, -(-m // 8) * 8) if num_shards > 1 else -(-m // 8) * 8


class _Ids(NamedTuple):
    """One device's distinct ids of one table in (owner, local bucket, priority, hi, lo)
    order, PAD past `count`; `words` are the four words of that order (uint32, the first
    `buckets` past the count); owner p's run starts at `bounds[p]`."""

    hi: Any
    lo: Any
    count: Any
    words: tuple
    bounds: Any

    @property
    def counts(self):
        return self.bounds[1:] - self.bounds[:-1]


def _ids(config: _hashindex.IndexConfig, n: int, hi, lo, count, per: int = 1) -> _Ids:
    """`_Ids` of ids (hi, lo) already in that order, the first `count` of them live. `per`:
    keyed by groups of `per` local buckets (the filter's buckets) in place of buckets."""
    nbl = config.buckets // n // per
    live = lax.iota(jnp.int32, hi.shape[0]) < count
    owner, bucket = _hashindex.locate(config, n, hi, lo)
    k0 = jnp.where(live, owner * nbl + bucket // per, config.buckets).astype(jnp.uint32)
    words = (k0, _hashindex.priority(config, hi, lo), hi, lo)
    limits = (lax.iota(jnp.int32, n + 1) * nbl).astype(jnp.uint32)
    bounds = jnp.sum(k0[None, :] < limits[:, None], axis=1, dtype=jnp.int32)
    return _Ids(hi, lo, count, words, bounds)


def _distinct(plan: _dynamic.DynamicPlan, hi, lo, valid, axis):
    """(`_Ids` of the distinct valid ids of this device's positions, the `_dynamic.Owned`
    that maps values of them back to the positions)."""
    n = lax.axis_size(axis)
    config = plan.index
    m = hi.shape[0]
    nbl = config.buckets // n
    owner, bucket = _hashindex.locate(config, n, hi, lo)
    k0 = jnp.where(valid, owner * nbl + bucket, config.buckets)
    k0, hi, lo, pos, first = _dynamic.sort_distinct(config, k0, config.buckets, hi, lo)
    live = k0 < config.buckets
    count = jnp.sum(first, dtype=jnp.int32)
    at, (d_hi, d_lo, d_bucket) = _dynamic.to_front(plan, n, first, count, m, hi, lo)
    owned = _dynamic.Owned(d_hi, d_lo, d_bucket, count, at, pos, live)
    return _ids(config, n, d_hi, d_lo, count), owned


def _compact(plan: _dynamic.DynamicPlan, n: int, ids: _Ids, mask) -> tuple[_Ids, Any]:
    """The ids of `mask` moved to the front in `ids`' order (`_dynamic.to_front`): (their
    `_Ids`, each one's index in `ids`, m past their count)."""
    count = jnp.sum(mask, dtype=jnp.int32)
    at, (hi, lo, _) = _dynamic.to_front(plan, n, mask, count, ids.hi.shape[0], ids.hi, ids.lo)
    return _ids(plan.index, n, hi, lo, count), at


def _by_filter_bucket(plan: _dynamic.DynamicPlan, n: int, ids: _Ids, mask) -> _Ids:
    """The ids of `mask` as `_Ids` in (owner, filter bucket, priority, hi, lo) order, the
    order in which `_hashindex.record` may take them in rounds: `ids`' own where a filter
    bucket is one bucket (the default), else sorted again."""
    config = plan.index
    per = config.buckets // config.filter_buckets
    count = jnp.sum(mask, dtype=jnp.int32)
    _, (hi, lo, _) = _dynamic.to_front(plan, n, mask, count, ids.hi.shape[0], ids.hi, ids.lo)
    if per > 1:
        words = _ids(config, n, hi, lo, count, per).words
        _, _, hi, lo = lax.sort(words, num_keys=4, is_stable=False)
    return _ids(config, n, hi, lo, count, per)


def _lex_le(a: tuple, t: tuple):
    """a <= t lexicographically over the words (uint32 arrays that broadcast)."""
    out = a[-1] <= t[-1]
    for x, y in zip(a[-2::-1], t[-2::-1]):
        out = (x < y) | ((x == y) & out)
    return out


def _lex_pmin(words: tuple, axis) -> tuple:
    """The lexicographic minimum over the devices of keys given as words ((N,) each):
    the first word's minimum, then the next's among the devices that tie, and so on."""
    out, tie = [], None
    for w in words:
        t = lax.pmin(w if tie is None else jnp.where(tie, w, _MAX), axis)
        tie = (w == t) if tie is None else tie & (w == t)
        out.append(t)
    return tuple(out)


def _add_windows(out, starts, rows):
    """`out` with rows[i] ((N, Cd)) added into out[starts[i] : starts[i] + Cd]: one windowed
    scatter (windows may overlap, where they add zeros)."""
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )
    return lax.scatter_add(out, starts[:, None], rows, dims, mode=lax.GatherScatterMode.CLIP)


def _rounds(tables: list[tuple[_Ids, int]], axis, ordered: bool, body, carry) -> tuple[list, Any]:
    """Runs `values, carry = body(received, carry)` at the owners on the ids each round
    brings them, until every device has sent every id of every table: `received[t]` is
    table t's (hi, lo) ((N·Cd_t,) each, device d's in block d, PAD in empty slots), for
    `tables[t]` = (its `_Ids`, Cd_t); `values[t]` (int32 (N·Cd_t,), 0 in empty slots) go
    back to the senders. Returns ([(m_t,) each id's value, in `ids`' order, 0 past the
    count], carry). `ordered`: rounds by threshold (module docstring), so every copy of an
    id comes in the same round and the owner's rounds run in key order.

    The tables share one loop: its rounds' agreements (one `pmin` per key word for every
    table's thresholds, one `pmax` for whether to go on) are one set of collectives, while
    each table keeps its own `all_to_all`s (one buffer for all of them cost the TPU compiler
    more bytes than the exchanges it saved: docs/design.md). A table has what its own loop
    would give it: the same ids in the same rounds, then rounds with nothing sent while the
    others finish."""
    if not tables:
        return [], carry
    n = lax.axis_size(axis)
    pad = jnp.uint32(_dynamic.PAD)
    cds = [cd for _, cd in tables]
    exchange = lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)

    def swap(parts: list) -> list:
        """Each table's (N, Cd_t) block sent, row d to device d; the (N, Cd_t) received."""
        return [exchange(x.reshape(-1)).reshape(n, -1) for x in parts]

    def one(sent, out, carry, cut: bool):
        pending = [ids.counts - s for (ids, _), s in zip(tables, sent)]
        first = [ids.bounds[:-1] + s for (ids, _), s in zip(tables, sent)]
        win = [  # (N, Cd_t) each word.
            tuple(_routing.windows(w, f, cd, _MAX) for w in ids.words)
            for (ids, cd), f in zip(tables, first)
        ]
        if cut:  # Every table's thresholds in one pmin per word.
            ends = [
                tuple(jnp.where(p >= cd, w[:, cd - 1], _MAX) for w in ws)
                for p, ws, cd in zip(pending, win, cds)
            ]
            t = _lex_pmin(tuple(jnp.concatenate(w) for w in zip(*ends)), axis)
            n_send = []
            for k, (p, ws) in enumerate(zip(pending, win)):
                mine = tuple(x[k * n : (k + 1) * n, None] for x in t)
                below = jnp.sum(_lex_le(ws, mine), axis=1, dtype=jnp.int32)
                n_send.append(jnp.minimum(p, below))
        else:
            n_send = [jnp.minimum(p, cd) for p, cd in zip(pending, cds)]
        valid = [lax.iota(jnp.int32, cd)[None, :] < k[:, None] for cd, k in zip(cds, n_send)]
        hi = swap([jnp.where(v, w[2], pad) for v, w in zip(valid, win)])
        lo = swap([jnp.where(v, w[3], pad) for v, w in zip(valid, win)])
        values, carry = body([(h.reshape(-1), l.reshape(-1)) for h, l in zip(hi, lo)], carry)
        back = swap([x.reshape(n, cd) for x, cd in zip(values, cds)])
        out = [
            _add_windows(o, f, jnp.where(v, b, 0)) for o, f, v, b in zip(out, first, valid, back)
        ]
        return [s + k for s, k in zip(sent, n_send)], out, carry

    sizes = [ids.hi.shape[0] for ids, _ in tables]
    sent = [jnp.zeros((n,), jnp.int32) for _ in tables]
    out = [jnp.zeros((m + cd,), jnp.int32) for m, cd in zip(sizes, cds)]  # + the last window.
    if all(cd >= m for cd, m in zip(cds, sizes)):  # Every device sends all in one round,
        # with no threshold: one at a device's Cd-th key (Cd == m, all for one owner) would
        # hold a larger key of another device back, for a round that never runs.
        _, out, carry = one(sent, out, carry, False)
        return [o[:m] for o, m in zip(out, sizes)], carry

    def more(sent):
        left = [jnp.any(s < ids.counts) for (ids, _), s in zip(tables, sent)]
        return lax.pmax(jnp.any(jnp.stack(left)).astype(jnp.int32), axis) > 0

    def step(state):
        sent, out, carry, _ = state
        sent, out, carry = one(sent, out, carry, ordered)
        return sent, out, carry, more(sent)

    _, out, carry, _ = lax.while_loop(lambda s: s[3], step, (sent, out, carry, more(sent)))
    return [o[:m] for o, m in zip(out, sizes)], carry


def _merged(config, n: int, hi, lo):
    """The ids an owner received in a round, sorted by (local bucket, priority, hi, lo),
    copies of one id adjacent: (hi, lo, local bucket, first copy (and not PAD), each sorted
    entry's slot). What `sighted(grouped=True)` and `place` take, and `_spread`'s input."""
    nbl = config.buckets // n
    _, bucket = _hashindex.locate(config, n, hi, lo)
    key = jnp.where(_dynamic.is_pad(hi, lo), nbl, bucket)
    key, hi, lo, slot, first = _dynamic.sort_distinct(config, key, nbl, hi, lo)
    return hi, lo, jnp.minimum(key, nbl - 1), first, slot


def _spread(first, values, slot):
    """Each received slot's value from its id's first copy (`values` at the firsts, in
    `_merged`'s order): a segmented scan carries a first's value over its copies, and one
    scatter into a fresh array puts them back in slot order (no gather: the TPU compiler
    charges a 1-D gather a tile per element)."""

    def last_first(a, b):
        return a[0] | b[0], jnp.where(b[0], b[1], a[1])

    _, run = lax.associative_scan(last_first, (first, jnp.where(first, values, 0)))
    return jnp.zeros_like(run).at[slot].set(run, unique_indices=True)


def _placements(cd: int) -> int:
    """Admitted ids one device sends one owner per placement round: a `_dynamic.ROUND`th
    of Cd, so that an owner places a 64th of a round's ids at once, as the all-gather
    resolution does (a trained table admits few ids a step; the TPU compiler charges a
    loop's body once, and `place` costs tens of KiB an id)."""
    return max(1, -(-cd // _dynamic.ROUND))


def joined(parts: list):
    """This device's positions of a table: its features' (hi, lo) ((b, L) each) flattened
    and joined, as `split` takes them apart."""
    flat = lambda xs: jnp.concatenate([x.reshape(-1) for x in xs])
    return flat([h for h, _ in parts]), flat([lo for _, lo in parts])


def split(rows, parts: list) -> list:
    """`rows` ((m,), `joined`'s order) as each feature's (b, L)."""
    out, start = [], 0
    for h, _ in parts:
        out.append(rows[start : start + h.size].reshape(h.shape))
        start += h.size
    return out


class Table(NamedTuple):
    """One dynamic table's part of a step at the owners: its plan, slot-table storage and
    index, and this device's m positions of it (`joined`: (m,) uint32 each)."""

    plan: _dynamic.DynamicPlan
    storage: Any
    index: Any
    hi: Any
    lo: Any


class Update(NamedTuple):
    """What `update_rows` also takes of a table: its key words, where its rows are stored
    (the state key of its arrays, and its rows' offset in their shard: a stack's members
    share arrays), and whether it steps (`keep` False: it is skipped, and sends none of
    its ids)."""

    key: Any
    stack: str
    offset: int
    keep: Any


def _filter_rounds(tables, filtered: list, sends: dict, cds: list, indexes: list, rule, axis):
    """Rounds (ordered, `_placements` ids an owner) of the `filtered` tables' ids `sends`
    ({table: `_Ids`}): each owner applies `rule(config, index, hi, lo, bucket, first)` ->
    (index, int32 code per id) to what it receives, sorted by bucket with copies of an id
    adjacent and `first` marking the first copy (`_merged`). Returns ([per filtered table,
    each id's code in its `_Ids`' order], indexes)."""
    n = lax.axis_size(axis)

    def body(received, indexes):
        out, indexes = [], list(indexes)
        for k, (r_hi, r_lo) in zip(filtered, received):
            config = tables[k].plan.index
            s_hi, s_lo, bucket, first, slot = _merged(config, n, r_hi, r_lo)
            indexes[k], code = rule(config, indexes[k], s_hi, s_lo, bucket, first)
            out.append(jnp.zeros_like(code).at[slot].set(code, unique_indices=True))
        return out, indexes

    rounds = [(sends[k], _placements(cds[k])) for k in filtered]
    return _rounds(rounds, axis, True, body, indexes)


def _admission(tables, filtered: list, ids: list, cds: list, codes: list, indexes: list, now, axis):
    """The filter's admission for the misses (code 1) of the `filtered` tables
    (`_hashindex.admission`: sightings counted, admitted ids' own expired slots freed).
    Returns (codes with 1 only for the admitted ids, {table: the first sightings' `_Ids`
    in filter order}, indexes)."""
    n = lax.axis_size(axis)

    def rule(config, index, hi, lo, bucket, first):
        miss = ~_dynamic.is_pad(hi, lo)
        index, admit, new = _hashindex.admission(
            config, index, hi, lo, bucket, miss, now, distinct=first
        )
        return index, jnp.where(admit, 1, jnp.where(new, 2, 0))

    misses = {k: _compact(tables[k].plan, n, ids[k], codes[k] == 1) for k in filtered}
    sends = {k: misses[k][0] for k in filtered}
    decisions, indexes = _filter_rounds(tables, filtered, sends, cds, indexes, rule, axis)
    codes, firsts = list(codes), {}
    for k, d in zip(filtered, decisions):
        m = codes[k].shape[0]
        d = jnp.zeros(m, jnp.int32).at[misses[k][1]].set(d, mode="drop", unique_indices=True)
        codes[k] = jnp.where(codes[k] == 1, (d == 1).astype(jnp.int32), codes[k])
        firsts[k] = _by_filter_bucket(tables[k].plan, n, ids[k], d == 2)
    return codes, firsts, indexes


def _record(tables, filtered: list, firsts: dict, cds: list, indexes: list, now, axis):
    """The first sightings of the `filtered` tables recorded (`_hashindex.record`), in
    filter order. Returns the indexes."""

    def rule(config, index, hi, lo, bucket, first):
        index = _hashindex.record(config, index, hi, lo, bucket, first, now)
        return index, jnp.zeros(hi.shape, jnp.int32)

    return _filter_rounds(tables, filtered, firsts, cds, indexes, rule, axis)[1]


def lookup_rows(tables: list[Table], now, axis) -> list:
    """Inside shard_map: for each of `tables`, the global slot-table rows ((m,) int32, -1
    where none) of this device's positions, found at their owners, the tables in shared
    rounds. Read-only."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    resolved = [_distinct(t.plan, t.hi, t.lo, ~_dynamic.is_pad(t.hi, t.lo), axis) for t in tables]

    def body(received, carry):  # Sorted by bucket per sender, not as a whole.
        values = []
        for t, (r_hi, r_lo) in zip(tables, received):
            _, bucket = _hashindex.locate(t.plan.index, n, r_hi, r_lo)
            row, found = _dynamic.find(t.plan, t.index, r_hi, r_lo, bucket, now)
            values.append(jnp.where(found, t.storage.layout.global_ids(me, row) + 1, 0))
        return values, carry

    sends = [(ids, capacity(t.plan, t.hi.shape[0], n)) for t, (ids, _) in zip(tables, resolved)]
    values, _ = _rounds(sends, axis, False, body, None)
    return [_dynamic.to_positions(owned, v - 1) - 1 for (_, owned), v in zip(resolved, values)]


def update_rows(
    tables: list[Table], updates: list[Update], arrays: dict, now, axis
) -> tuple[list[tuple], dict]:
    """Inside shard_map: `_dynamic.update_rows` resolved at the owners, the tables in shared
    rounds: one step's hits, admission and eviction for this device's positions of each
    table, and the reset of the rows given to new ids in `arrays` ({state key: (table,
    slots)}, the shard's; not of tables in host memory: `_dynamic.Fresh`). Returns ([per
    table (index, the positions' global slot-table rows ((m,) int32, -1 where none))], the
    new `arrays`)."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    # The lookup's distinct ids (one sort that a step's lookup and update share: XLA merges
    # the two equal computations); a skipped table sends none of them.
    resolved = [_distinct(t.plan, t.hi, t.lo, ~_dynamic.is_pad(t.hi, t.lo), axis) for t in tables]
    ids = [
        d._replace(bounds=jnp.where(u.keep, d.bounds, 0)) for (d, _), u in zip(resolved, updates)
    ]
    cds = [capacity(t.plan, t.hi.shape[0], n) for t in tables]

    # Every id's rules 1-3 first: 0 rejected (or none), 1 admitted, row + 2 a hit. The
    # copies of an id sent by several devices get its outcome from `sighted` too. With an
    # admission filter 1 is a miss, which the filter's rounds below decide.
    filtered = [k for k, t in enumerate(tables) if t.plan.index.min_count > 1]

    def seen(received, indexes):
        codes, out = [], []
        for t, (r_hi, r_lo), index in zip(tables, received, indexes):
            s_hi, s_lo, bucket, first, slot = _merged(t.plan.index, n, r_hi, r_lo)
            s = _hashindex.sighted(
                t.plan.index,
                index,
                s_hi,
                s_lo,
                bucket,
                True,
                now,
                grouped=True,
                find=_dynamic.finder(t.plan, now),
                distinct=first,
                scores=_dynamic.scorer(t.plan, now),
            )
            hit = t.storage.layout.global_ids(me, s.row) + 2
            code = jnp.where(s.hit, hit, s.admit.astype(jnp.int32))
            codes.append(jnp.zeros_like(code).at[slot].set(code, unique_indices=True))
            out.append(s.state)
        return codes, out

    codes, indexes = _rounds(list(zip(ids, cds)), axis, True, seen, [t.index for t in tables])
    firsts = {}
    if filtered:  # The filter's rules for the misses only (`_hashindex.admission`).
        codes, firsts, indexes = _admission(tables, filtered, ids, cds, codes, indexes, now, axis)

    # Then the admitted ones' placement, in key order, each round resetting the rows it gives.
    def placed(received, carry):
        indexes, arrays = carry
        codes, arrays, out = [], dict(arrays), []
        for t, u, (r_hi, r_lo), index in zip(tables, updates, received, indexes):
            s_hi, s_lo, bucket, first, slot = _merged(t.plan.index, n, r_hi, r_lo)
            index, row, ok = _dynamic.place(t.plan, index, s_hi, s_lo, bucket, first, now)
            index = _hashindex.unfilter(t.plan.index, index, s_hi, s_lo, bucket, ok)
            if not t.storage.on_host:
                init = _dynamic.initial_rows(u.key, s_hi, s_lo, t.plan.dim, t.plan.draw)
                table, slots = arrays[u.stack]
                reset = _dynamic.reset_rows(t.storage, table, slots, row + u.offset, ok, init)
                arrays[u.stack] = reset
            code = jnp.where(ok, t.storage.layout.global_ids(me, row) + 1, 0)
            codes.append(_spread(first, code, slot))
            out.append(index)
        return codes, (out, arrays)

    admitted = [_compact(t.plan, n, d, c == 1) for t, d, c in zip(tables, ids, codes)]
    sends = [(a, _placements(cd)) for (a, _), cd in zip(admitted, cds)]
    a_codes, (indexes, arrays) = _rounds(sends, axis, True, placed, (indexes, arrays))
    if filtered:  # Then the first sightings, once every sighting and placement is written.
        indexes = _record(tables, filtered, firsts, cds, indexes, now, axis)
    out = []
    for t, (_, owned), c, (_, at), a_c, index in zip(
        tables, resolved, codes, admitted, a_codes, indexes
    ):
        m = t.hi.shape[0]
        given = jnp.zeros(m, jnp.int32).at[at].set(a_c, mode="drop", unique_indices=True)
        rows = jnp.where(c >= 2, c - 2, given - 1)
        out.append((index, _dynamic.to_positions(owned, rows) - 1))
    return out, arrays
