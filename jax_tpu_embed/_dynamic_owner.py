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

Per device and round the work is O(m + N·Cd), with Cd about 1.5·m/N: flat in N.
The filter of `min_count > 1` needs all of a shard's ids of a step in one call, and tables
in host memory reset their rows inside the update's host write: both keep the all-gather
resolution for their updates (`routes_updates`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _dynamic, _hashindex, _routing

_MAX = np.uint32(0xFFFFFFFF)


def routes_updates(plan: _dynamic.DynamicPlan, storage) -> bool:
    """Whether a routed table's updates are resolved at the owners too (else by all-gather):
    not with an admission filter, nor for a table in host memory (module docstring)."""
    return plan.route == "owner" and plan.index.min_count == 1 and not storage.on_host


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


def _ids(config: _hashindex.IndexConfig, n: int, hi, lo, count) -> _Ids:
    """`_Ids` of ids (hi, lo) already in that order, the first `count` of them live."""
    nbl = config.buckets // n
    live = lax.iota(jnp.int32, hi.shape[0]) < count
    owner, bucket = _hashindex.locate(config, n, hi, lo)
    k0 = jnp.where(live, owner * nbl + bucket, config.buckets).astype(jnp.uint32)
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


def _rounds(ids: _Ids, cd: int, axis, ordered: bool, body, carry):
    """Runs `values, carry = body(hi, lo, carry)` at the owners on the ids each round brings
    them ((N·Cd,) each, device d's in block d, PAD in empty slots), until every device has
    sent every id; `values` (int32, 0 in empty slots) go back to the senders. Returns
    ((m,) each id's value, in `ids`' order, 0 past the count; carry). `ordered`: rounds by
    threshold (module docstring), so every copy of an id comes in the same round and the
    owner's rounds run in key order."""
    n = lax.axis_size(axis)
    m = ids.hi.shape[0]
    pad = jnp.uint32(_dynamic.PAD)
    exchange = lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True)

    def one(sent, out, carry):
        pending = ids.counts - sent
        first = ids.bounds[:-1] + sent
        win = tuple(_routing.windows(w, first, cd, _MAX) for w in ids.words)  # (N, Cd) each
        if ordered:
            full = pending >= cd
            t = _lex_pmin(tuple(jnp.where(full, w[:, cd - 1], _MAX) for w in win), axis)
            below = jnp.sum(_lex_le(win, tuple(x[:, None] for x in t)), axis=1, dtype=jnp.int32)
            n_send = jnp.minimum(pending, below)
        else:
            n_send = jnp.minimum(pending, cd)
        valid = lax.iota(jnp.int32, cd)[None, :] < n_send[:, None]
        hi = exchange(jnp.where(valid, win[2], pad).reshape(-1))
        lo = exchange(jnp.where(valid, win[3], pad).reshape(-1))
        values, carry = body(hi, lo, carry)
        back = exchange(values).reshape(n, cd)
        out = _add_windows(out, first, jnp.where(valid, back, 0))
        return sent + n_send, out, carry

    sent = jnp.zeros((n,), jnp.int32)
    out = jnp.zeros((m + cd,), jnp.int32)  # Room for the last window.
    if cd >= m:  # Every device sends all its ids in one round.
        _, out, carry = one(sent, out, carry)
        return out[:m], carry

    def more(sent):
        return lax.pmax(jnp.any(sent < ids.counts).astype(jnp.int32), axis) > 0

    def step(state):
        sent, out, carry, _ = state
        sent, out, carry = one(sent, out, carry)
        return sent, out, carry, more(sent)

    _, out, carry, _ = lax.while_loop(lambda s: s[3], step, (sent, out, carry, more(sent)))
    return out[:m], carry


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


def lookup_rows(plan: _dynamic.DynamicPlan, storage, index, hi, lo, now, axis):
    """Inside shard_map: the global slot-table rows ((m,) int32, -1 where none) of this
    device's m positions (`joined`), found at their owners. Read-only."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    config = plan.index
    ids, owned = _distinct(plan, hi, lo, ~_dynamic.is_pad(hi, lo), axis)

    def body(r_hi, r_lo, carry):  # Sorted by bucket per sender, not as a whole.
        _, bucket = _hashindex.locate(config, n, r_hi, r_lo)
        row, found = _dynamic.find(plan, index, r_hi, r_lo, bucket, now)
        return jnp.where(found, storage.layout.global_ids(me, row) + 1, 0), carry

    values, _ = _rounds(ids, capacity(plan, hi.shape[0], n), axis, False, body, None)
    return _dynamic.to_positions(owned, values - 1) - 1


def update_rows(
    plan: _dynamic.DynamicPlan, storage, index, key, table, slots, hi, lo, keep, now, axis
):
    """Inside shard_map: `_dynamic.update_rows` resolved at the owners (`routes_updates`):
    one step's hits, admission and eviction for this device's m positions (`joined`), and
    the reset of the rows given to new ids. Returns (index, table, slots, the positions'
    global slot-table rows ((m,) int32, -1 where none))."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    config = plan.index
    m = hi.shape[0]
    # The lookup's distinct ids (one sort that a step's lookup and update share: XLA merges
    # the two equal computations); a skipped table sends none of them.
    ids, owned = _distinct(plan, hi, lo, ~_dynamic.is_pad(hi, lo), axis)
    ids = ids._replace(bounds=jnp.where(keep, ids.bounds, 0))
    cd = capacity(plan, m, n)

    # Every id's rules 1-3 first: 0 rejected (or none), 1 admitted, row + 2 a hit. The
    # copies of an id sent by several devices get its outcome from `sighted` too.
    def seen(r_hi, r_lo, index):
        s_hi, s_lo, bucket, first, slot = _merged(config, n, r_hi, r_lo)
        s = _hashindex.sighted(
            config,
            index,
            s_hi,
            s_lo,
            bucket,
            True,
            now,
            grouped=True,
            find=_dynamic.finder(plan, now),
            distinct=first,
            scores=_dynamic.scorer(plan, now),
        )
        hit = storage.layout.global_ids(me, s.row) + 2
        code = jnp.where(s.hit, hit, s.admit.astype(jnp.int32))
        return jnp.zeros_like(code).at[slot].set(code, unique_indices=True), s.state

    codes, index = _rounds(ids, cd, axis, True, seen, index)

    # Then the admitted ones' placement, in key order, each round resetting the rows it gives.
    def placed(r_hi, r_lo, carry):
        index, table, slots = carry
        s_hi, s_lo, bucket, first, slot = _merged(config, n, r_hi, r_lo)
        index, row, ok = _dynamic.place(plan, index, s_hi, s_lo, bucket, first, now)
        init = _dynamic.initial_rows(key, s_hi, s_lo, plan.dim)
        table, slots = _dynamic.reset_rows(storage, table, slots, row, ok, init)
        code = jnp.where(ok, storage.layout.global_ids(me, row) + 1, 0)
        return _spread(first, code, slot), (index, table, slots)

    admitted, at = _compact(plan, n, ids, codes == 1)
    a_codes, (index, table, slots) = _rounds(
        admitted, _placements(cd), axis, True, placed, (index, table, slots)
    )
    given = jnp.zeros(m, jnp.int32).at[at].set(a_codes, mode="drop", unique_indices=True)
    rows = jnp.where(codes >= 2, codes - 2, given - 1)
    return index, table, slots, _dynamic.to_positions(owned, rows) - 1
