"""Owner routing: each device handles its own examples' ids and the rows it owns.

The all-gather path (`_streams`) hands every device the ids of the global batch: per device
and step its sort, pair lists and (B, D) partial activations grow with the number of
devices N at a fixed per-device batch b. Owner routing keeps them at the per-device batch.
Per device and table, with m = b·L local (id, position) pairs:

1. Sort the local pairs by key = owner·S + local row (S rows per shard), which groups them
   by owner and, within an owner, by row; number their distinct rows (at most m).
2. Send each owner the distinct rows it owns, at most Cd per owner and round, in one
   `all_to_all` of (N, Cd) row ids (plus, for the update, their (N, Cd, D) summed gradients).
3. Lookup: the owner reads the N·Cd received rows and sends them back the same way; each
   device combines the rows into its own activations. Update: the owner sums the gradients
   of rows received from several devices and applies the optimizer once per distinct row.

Skew: a device with more than Cd distinct rows for one owner runs more rounds; nothing is
dropped. Rounds keep each row's update whole: in every round, for every owner p, the
devices agree (`pmin`) on a threshold T_p, the smallest Cd-th pending row of any device
(or none when every device has fewer than Cd pending), and each device sends its pending
rows <= T_p: at most Cd, and every row <= T_p reaches its owner from every device in this
very round, so the owner updates it exactly once. When Cd >= m, one round always
suffices and runs as straight-line code.

Per device and round the work is O(m + N·Cd) with Cd = `capacity` ~ 2m/N: proportional to
the per-device batch, whatever N. docs/design.md compares the traffic of both paths.

This module is the exchange only: the row work (the owner's reads and updates, and how rows
travel) is the call's row kernel's (`_backend.RoutedRows`), and which kernel serves a call
at which Cd is decided once on the host (`plan_call`, read by the step and `id_counts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _plan, _rowindex, _streams
from ._rowindex import NONE, NOT_MINE


def capacity(
    plan: _plan.TablePlan, pairs: int, num_shards: int, k: int = 1, most: int | None = None
) -> int:
    """Cd: distinct rows one device sends one owner per round.

    `max_ids_per_shard` (C, the ids one shard handles per round) / N when set, else
    2·m / N: twice the mean when a device's m pairs are all distinct, room for uneven
    ownership. A multiple of 8·k: each owner's Cd/k lane-dense rows (`_Kernels`) fill whole
    (8, 128) tiles, so the (N·Cd/k, 128) buffers and their (N, Cd/k, 128) exchange share
    one layout and the reshapes between them are free (otherwise each is a copy of the
    buffer). When that is m or more, one round always suffices. An optimizer that updates
    every row (`Adam(lazy_adam=False)`) takes one round of all m.

    `most`: the row kernel holds the N·Cd/k exchanged rows resident, at most `most`
    lane-dense rows (`Backend.most_rows`): Cd is at most what fits, and a device with more
    distinct rows for one owner runs more rounds, rather than XLA ops, whose row gathers
    and scatters cost the TPU compiler a tile each.
    """
    multiple = 8 * k
    if plan.optimizer.dense_update or num_shards == 1:
        cd = _streams.round_up(pairs, multiple)
    else:
        c = -(-plan.max_ids // num_shards) if plan.max_ids else -(-2 * pairs // num_shards)
        cd = _streams.round_up(min(pairs, max(c, 8)), multiple)
    if most is not None:
        most = most * k // num_shards // multiple * multiple
        cd = min(cd, max(most, multiple))
    return cd


def supported(layout) -> str | None:
    """Why owner routing cannot serve a table of this layout, or None."""
    if not _rowindex.fits_owner_keys(layout.num_shards, layout.rows_per_shard):
        return (
            f"its {layout.num_shards} x {layout.rows_per_shard} padded rows do not fit "
            f"an int32 sort key"
        )
    return None


class _Local:
    """One device's pairs of one table, sorted by key, and their distinct rows."""

    def __init__(self, plan: _plan.TablePlan, inputs: list, axis: str, k: int = 1):
        s = plan.layout.rows_per_shard
        self.n = lax.axis_size(axis)
        self.s = s
        keys, outs, scales, parts, first = [], [], [], [], 0
        for f, ids, weights, *_ in inputs:  # Owner routing sends local ids only.
            b, l = ids.shape
            # Each feature's pairs as (L, b), joined along L and then flattened: the TPU
            # compiler lays narrow (b, L) ids out column-major, and joining the features'
            # flat pairs instead costs an in-place update of the whole joined array per
            # feature (docs/design.md, "Owner routing"). The sort below orders the pairs
            # whatever their order here.
            w = (ids >= 0).astype(jnp.float32) if weights is None else weights
            scale = _streams.feature_scale(f, w).T
            ids = ids.T
            keys.append(_keys(plan, f, ids))
            example = lax.broadcasted_iota(jnp.int32, (l, b), 1)
            if f.config.is_sequence:
                out, rows = example * l + lax.broadcasted_iota(jnp.int32, (l, b), 0), b * l
            else:
                out, rows = example, b
            outs.append(out + first)
            scales.append(jnp.where(ids >= 0, scale, 0.0))
            parts.append((f, first, rows))
            first += _streams.round_up(rows, k)  # Whole lane-dense rows per feature.
        self.rows, self.parts = first, parts
        # (key, output row, scale) order: each row's pairs in one canonical order.
        self.keys, self.out, self.scale = lax.sort(
            tuple(jnp.concatenate(x).reshape(-1) for x in (keys, outs, scales)),
            num_keys=3,
            is_stable=False,
        )
        self.pairs = self.keys.shape[0]
        # Pair i's distinct row: segment[i]; distinct row j's key: uniq[j] (NONE past them).
        starts, self.uniq, self.bounds = _distinct(self.keys, self.n, s)
        self.segment = jnp.cumsum(starts, dtype=jnp.int32) - 1
        self.counts = self.bounds[1:] - self.bounds[:-1]

    def per_owner(self, values):
        """values[owner of pair i] for every pair (NONE keys: the last owner's value)."""
        return _per_owner(self.keys, self.s, values)


def _keys(plan: _plan.TablePlan, f, ids):
    """The sort keys owner·S + local row of a feature's ids (NONE where no row)."""
    owner, local, found = plan.index.locate(f.table, ids)
    return jnp.where(found, owner * plan.layout.rows_per_shard + local, NONE)


def _distinct(keys, n: int, s: int):
    """(starts, uniq, bounds) of ascending keys: where each distinct key starts, the
    distinct keys ascending (NONE past them), and bounds[p] the place of owner p's first
    in `uniq` (bounds[N]: how many)."""
    starts = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
    uniq = lax.sort(jnp.where(starts, keys, NONE), is_stable=False)
    return starts, uniq, _count_below(uniq, jnp.arange(n + 1, dtype=jnp.int32) * s)


def rows_read(call: _plan.CallPlan, inputs: list, axis: str):
    """At each owner, the local rows (N·Cd,) that the devices' first Cd distinct rows for
    it are (NOT_MINE in empty slots), by one exchange of row ids: most of the rows the
    call's lookup and update will read there (all of them where every device has at most
    Cd distinct rows for each owner, which `capacity` makes the common case), for
    `Embedding.stage`. Only keys are sorted: no positions or scales ride along."""
    plan, cd = call.plan, call.capacity
    n, s = lax.axis_size(axis), plan.layout.rows_per_shard
    keys = jnp.concatenate([_keys(plan, f, ids).reshape(-1) for f, ids, *_ in inputs])
    keys = lax.sort(keys, is_stable=False)
    _, uniq, bounds = _distinct(keys, n, s)
    window = windows(uniq, bounds[:-1], cd, NONE)  # (N, Cd): each owner's first keys
    owner_start = (jnp.arange(n, dtype=jnp.int32) * s)[:, None]
    sent = lax.iota(jnp.int32, cd)[None, :] < (bounds[1:] - bounds[:-1])[:, None]
    return _exchange(jnp.where(sent, window - owner_start, NOT_MINE).reshape(-1), axis)


def _per_owner(sorted_keys, s: int, values):
    """values[min(key // s, N - 1)] for each of the (m,) sorted keys, from the (N,) values.

    A sum of steps over the keys: N compares per key. The TPU compiler charges far more
    bytes for every O(m + N) form measured (docs/design.md, "Owner routing"): a gather of
    the (N,) values per key, a scatter of the steps to the owners' first keys and a cumsum.
    """
    steps = jnp.concatenate([values[:1], values[1:] - values[:-1]])
    starts = lax.iota(jnp.int32, values.shape[0]) * s
    return jnp.sum(jnp.where(sorted_keys[:, None] >= starts[None, :], steps[None, :], 0), axis=1)


def _count_below(sorted_keys, limits):
    """For each limit, how many sorted keys are < it: a compare-and-count, no gathers.

    O(m) compares per limit, and still the fewest bytes for the TPU compiler: a binary
    search (`jnp.searchsorted`) gathers per limit and step, its sort method sorts and
    scatters, and a count per owner scatters per key (docs/design.md, "Owner routing").
    """
    return jnp.sum(sorted_keys[None, :] < limits[:, None], axis=1, dtype=jnp.int32)


class _Round:
    """What one device sends in one round: per owner p, its pending distinct rows
    bounds[p] + sent[p] ... + n_send[p] - 1, in slots p·Cd ... of the (N·Cd,) buffers."""

    def __init__(self, local: _Local, sent, cd: int, axis: str, single: bool):
        n = local.n
        pending = local.counts - sent
        self.first = local.bounds[:-1] + sent
        self.cd = cd
        window = windows(local.uniq, self.first, cd, NONE)  # (N, Cd) pending keys
        if single:
            n_send = pending
        else:
            nth = window[:, cd - 1]
            threshold = lax.pmin(jnp.where(pending >= cd, nth, NONE), axis)
            # Pending rows <= T_p: all rows below T_p + 1 minus those already sent.
            below = _count_below(local.uniq, jnp.minimum(threshold, NONE - 1) + 1)
            n_send = jnp.where(threshold == NONE, pending, jnp.minimum(pending, below - self.first))
        slot = lax.iota(jnp.int32, cd)
        self.valid = (slot[None, :] < n_send[:, None]).reshape(-1)  # (N·Cd,)
        owner_start = (jnp.arange(n, dtype=jnp.int32) * local.s)[:, None]
        self.local_rows = jnp.where(self.valid, (window - owner_start).reshape(-1), NOT_MINE)
        self.sent = sent + n_send
        # Pair i's slot in this round, if its row is sent now: its distinct row's place
        # among owner p's pending rows, offset by p·Cd.
        rank = local.segment - local.per_owner(self.first)
        in_round = (local.keys < NONE) & (rank >= 0) & (rank < local.per_owner(n_send))
        self.pair_slot = jnp.where(
            in_round, local.per_owner(jnp.arange(n, dtype=jnp.int32) * cd) + rank, 0
        )
        self.pair_in_round = in_round

    def rows_of(self, x):
        """(N·Cd, ...) the rows of `x` (one per distinct row, as `uniq`) this round sends,
        zero where a slot is empty."""
        win = windows(x, self.first, self.cd, 0).reshape(-1, *x.shape[1:])
        return jnp.where(self.valid.reshape(-1, *[1] * (x.ndim - 1)), win, 0)


def windows(x, starts, size: int, fill):
    """(len(starts), size, ...): x[s : s + size] for each start s, `fill` past the end.

    One gather of contiguous windows: the TPU compiler charges a gather per index it
    reads, so N windows of Cd cost far less than N·Cd single elements."""
    x = jnp.concatenate([x, jnp.full((size, *x.shape[1:]), fill, x.dtype)])
    return jax.vmap(lambda s: lax.dynamic_slice_in_dim(x, s, size))(starts)


def _rounds(local: _Local, cd: int, axis: str, body, carry):
    """Runs `carry = body(round, carry)` until every device has sent every distinct row."""
    single = cd >= local.pairs
    sent = jnp.zeros((local.n,), jnp.int32)
    if single:
        return body(_Round(local, sent, cd, axis, single=True), carry)

    def step(state):
        sent, carry, _ = state
        r = _Round(local, sent, cd, axis, single=False)
        carry = body(r, carry)
        more = lax.pmax(jnp.any(r.sent < local.counts).astype(jnp.int32), axis)
        return r.sent, carry, more > 0

    return lax.while_loop(lambda state: state[2], step, (sent, carry, jnp.bool_(True)))[1]


def _exchange(x, axis):
    return lax.all_to_all(x, axis, 0, 0, tiled=True)


def _kept(plan: _plan.TablePlan, rows, members_ok):
    """`rows` received by an owner, NOT_MINE where the member of the stack they belong to
    is skipped this step (compares against each member's block, no gather)."""
    keep = jnp.zeros(rows.shape, bool)
    for j, m in enumerate(plan.members):
        end = m.offset + m.layout.rows_per_shard
        keep = keep | ((rows >= m.offset) & (rows < end) & members_ok[j])
    return jnp.where(keep, rows, NOT_MINE)


def plan_call(plan: _plan.TablePlan, inputs: list, n: int) -> _plan.CallPlan:
    """The call doing the row work of `inputs` (one device's; shapes suffice) on n devices.

    A kernel that holds rows resident (`Backend.lane_rows` > 0) does it when the rows it
    holds (the exchanged rows at the capacity it holds, or the activations) fit
    (`Backend.holds`): k logical rows per lane-dense row, Cd capped (`capacity`, more
    rounds). Else the table's fallback, XLA ops, which have no such limit, at the default
    Cd. On the host: the step, `id_counts` and `plan` all read the call this makes."""
    kernel = plan.backend
    k = kernel.lane_rows(plan)
    pairs = sum(i.ids.size for i in inputs)
    why = None
    if k:
        cd = capacity(plan, pairs, n, k, most=kernel.most_rows(plan))
        rows = max(n * cd, _streams.output_rows(inputs, k)) // k
        if kernel.holds(plan, rows):
            return _plan.CallPlan(plan, "owner", kernel, None, cd, cd, k, cd >= pairs, pairs)
        why = (
            f"its {rows} lane-dense rows of exchanged rows or activations do not fit "
            f"the {kernel.name} kernels' memory ({plan.vmem} bytes)"
        )
        kernel = plan.fallback
    cd = capacity(plan, pairs, n)
    return _plan.CallPlan(plan, "owner", kernel, why, cd, cd, 1, cd >= pairs, pairs)


def _row_work(call: _plan.CallPlan, inputs: list, axis: str):
    """(local pairs, Cd, the call's kernel's row work)."""
    n = lax.axis_size(axis)
    local = _Local(call.plan, inputs, axis, call.k)
    return local, call.capacity, call.kernel.routed(call, local.pairs, n * call.capacity)


def lookup(call: _plan.CallPlan, table, inputs: list, axis: str) -> dict:
    """{feature path: this device's activations} by owner routing."""
    local, cd, work = _row_work(call, inputs, axis)

    def body(r: _Round, acc):
        back = _exchange(work.owner_rows(table, _exchange(r.local_rows, axis)), axis)
        return work.combine(local, r, back, acc)

    acc = work.unpack(_rounds(local, cd, axis, body, work.zeros(local.rows)), local.rows)
    out = {}
    for f, first, rows in local.parts:
        part = acc[first : first + rows]
        if f.config.is_sequence:
            part = part.reshape(-1, f.config.max_sequence_length, part.shape[-1])
        out[f.path] = part
    return out


def update(call: _plan.CallPlan, table, slots: dict, inputs: list, grads: dict, step, axis: str):
    """(table, slots) after one sparse step by owner routing: every distinct row of the
    global batch is updated once, at its owner, with the sum of its gradients."""
    plan = call.plan
    local, cd, work = _row_work(call, inputs, axis)
    parts = []
    for f, _, rows in local.parts:
        g = grads[f.path].astype(jnp.float32).reshape(rows, -1)
        parts.append(jnp.pad(g, [(0, _streams.round_up(rows, work.k) - rows), (0, 0)]))
    g = work.gradients(local, jnp.concatenate(parts))

    def body(r: _Round, carry):
        table, slots = carry
        rows = _exchange(r.local_rows, axis)
        if step.members_ok is not None:
            rows = _kept(plan, rows, step.members_ok)
        sent = _exchange(work.send(local, r, g), axis)
        return work.owner_update(table, slots, rows, sent, step, axis)

    return _rounds(local, cd, axis, body, (table, slots))


def rounds_needed(cd: int, owner: np.ndarray, local: np.ndarray) -> int:
    """Rounds `update` runs for this global batch of one call (a table, a stack or a part
    of one) at Cd rows per owner and round (`plan_call`; NumPy, `id_counts`).

    `owner`, `local`: (N, m) each device's pairs' owners and local rows in the plan's
    array (owner -1: none)."""
    num_shards, m = owner.shape
    if cd >= m:
        return 1
    pending = []  # [device][owner] ascending distinct local keys not yet sent
    for d in range(num_shards):
        mine = owner[d] >= 0
        keys = np.unique(owner[d][mine].astype(np.int64) * (1 << 31) + local[d][mine])
        o, rows = keys >> 31, keys & ((1 << 31) - 1)
        pending.append([rows[o == p] for p in range(num_shards)])
    rounds = 1
    for p in range(num_shards):
        queues = [pending[d][p] for d in range(num_shards)]
        r = 0
        while any(len(q) for q in queues) or r == 0:
            r += 1
            nth = [q[cd - 1] for q in queues if len(q) >= cd]
            t = min(nth) if nth else None
            queues = [q[q > t] if t is not None else q[:0] for q in queues]
        rounds = max(rounds, r)
    return rounds


ROUTINGS = ("auto", "gather", "owner")
# "auto" routes to owners from this many shards on TPU meshes; below, the all-gather path.
# benchmarks/tpu_scaling.py measures both (docs/design.md).
AUTO_OWNER_SHARDS = 32
