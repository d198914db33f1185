"""Which shard owns which row, and how logical rows map to the sharded arrays.

With N shards and V rows, ownership is TensorFlow's (`tf.nn.embedding_lookup` with
partition_strategy):

- "div": contiguous blocks; the first V % N shards hold V // N + 1 rows, the others V // N.
- "mod": row r lives on shard r % N at local index r // N.

Every shard is padded to S = ceil(V / N) rows so that the table is one (N * S, ...) jax.Array
row-sharded over the mesh axis; shard p holds rows [p * S, (p + 1) * S). Padding rows are
never read or written. Lookup, update, init, export and checkpoints all go through this
module; none of them re-derives ownership.

Lane packing (`Packing`). TPU vector registers and HBM tiles are 128 lanes wide; a row scatter
into a (rows, 64) array makes the TPU compiler copy the whole array, and (rows, 16|32) arrays
cost whole-array passes. So on TPU each array of width w < 128 is stored
with its rows padded to W (the smallest power of two >= w) and k = 128 // W logical rows side
by side in one 128-lane physical row: shard-local row r lives in physical row r // k, lanes
[(r % k) * W, (r % k) * W + w). Rank-1 slots (w = 1) pack 128 rows per physical row. A
table's same-width slots may ride in its own rows (_storage.TableStorage.riders): its logical
row is then w = D·(1 + slots) wide, [row | slot 1 | ...]. On CPU and GPU k = 1 and nothing
changes. Users never see this: export, shard_rows and checkpoints speak in logical rows.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """Row ownership of one table of `vocabulary_size` rows over `num_shards` shards."""

    vocabulary_size: int
    num_shards: int
    strategy: str

    @property
    def rows_per_shard(self) -> int:
        """S: rows of every shard, padding included."""
        return -(-self.vocabulary_size // self.num_shards)

    @property
    def padded_rows(self) -> int:
        return self.rows_per_shard * self.num_shards

    def shard_sizes(self) -> np.ndarray:
        """(N,) rows each shard really holds."""
        v, n = self.vocabulary_size, self.num_shards
        q, r = divmod(v, n)
        p = np.arange(n)
        if self.strategy == "div":
            return np.where(p < r, q + 1, q)
        return (v - p + n - 1) // n  # ids p, p + n, ... below v.

    def owner_and_local(self, ids):
        """Shard owning each id, and the id's index inside that shard (jnp or np ids).

        One floor division per id and case, the remainders by multiplication (x - (x // d)
        * d is x % d, negative x included): XLA:CPU divides an int32 array by a constant
        with a division per element, the dearest arithmetic of a step's id mapping."""
        n = self.num_shards
        if self.strategy == "mod":
            local = ids // n
            return ids - local * n, local
        q, r = divmod(self.vocabulary_size, n)
        if r == 0:  # Equal shards (q >= 1).
            owner = ids // q
            return owner, ids - owner * q
        big = r * (q + 1)  # Rows held by the larger shards.
        rest = ids - big
        first, later = ids // (q + 1), rest // max(q, 1)
        owner = _where(ids, ids < big, first, r + later)
        local = _where(ids, ids < big, ids - first * (q + 1), rest - later * max(q, 1))
        return owner, local

    def id_steps(self) -> tuple[np.ndarray, int]:
        """((N,) first, stride): local row i of shard p holds global id first[p] + stride * i,
        as `global_ids` says; NumPy, for every shard at once."""
        p = np.arange(self.num_shards)
        if self.strategy == "mod":
            return p, self.num_shards
        return np.cumsum(self.shard_sizes()) - self.shard_sizes(), 1

    def logical_ids(self, shard: int) -> np.ndarray:
        """The global ids shard `shard` holds, in its local order."""
        size = int(self.shard_sizes()[shard])
        if self.strategy == "mod":
            return shard + self.num_shards * np.arange(size)
        start = int(self.shard_sizes()[:shard].sum())
        return start + np.arange(size)

    def global_ids(self, shard, local):
        """The global ids of local rows `local` of shard `shard` (traceable; the inverse of
        owner_and_local)."""
        if self.strategy == "mod":
            return local * self.num_shards + shard
        q, r = divmod(self.vocabulary_size, self.num_shards)
        start = jnp.where(shard < r, shard * (q + 1), r * (q + 1) + (shard - r) * q)
        return start + local

    def to_physical(self, x):
        """Logical (V, ...) -> padded (N * S, ...); padding rows are zero. np or jnp."""
        xp = _xp(x)
        n, s, v = self.num_shards, self.rows_per_shard, self.vocabulary_size
        tail = x.shape[1:]
        if self.strategy == "mod":
            x = xp.pad(x, [(0, n * s - v)] + [(0, 0)] * len(tail))
            x = xp.swapaxes(x.reshape((s, n) + tail), 0, 1)
            return x.reshape((n * s,) + tail)
        q, r = divmod(v, n)
        if r == 0:
            return x
        big = x[: r * s].reshape((r, s) + tail)
        small = x[r * s :].reshape((n - r, q) + tail)
        small = xp.pad(small, [(0, 0), (0, 1)] + [(0, 0)] * len(tail))
        return xp.concatenate([big, small]).reshape((n * s,) + tail)

    def to_logical(self, x):
        """Padded (N * S, ...) -> logical (V, ...); the inverse of to_physical."""
        xp = _xp(x)
        n, s, v = self.num_shards, self.rows_per_shard, self.vocabulary_size
        tail = x.shape[1:]
        x = x.reshape((n, s) + tail)
        if self.strategy == "mod":
            return xp.swapaxes(x, 0, 1).reshape((n * s,) + tail)[:v]
        q, r = divmod(v, n)
        if r == 0:
            return x.reshape((v,) + tail)
        return xp.concatenate(
            [x[:r].reshape((r * s,) + tail), x[r:, :q].reshape(((n - r) * q,) + tail)]
        )


@dataclasses.dataclass(frozen=True)
class Packing:
    """How one row-sharded array of logical row width `width` is stored.

    Attributes:
        width: Logical row width: D, or 1 for a rank-1 slot (stored without a minor axis when
            it is not packed).
        rank: 2 for (rows, D) arrays, 1 for (rows,) arrays.
        lanes: Physical row width to pack into (128 on TPU); 0 disables packing.
        row_multiple: Each shard's physical rows are padded to a multiple of it: 2 for a
            16-bit table on TPU, whose rows the TPU stores in pairs sharing 32-bit words
            (the Pallas kernels move such a pair as one row of words).
    """

    width: int
    rank: int
    lanes: int = 0
    row_multiple: int = 1

    @property
    def padded_width(self) -> int:
        """W: with lanes, a narrower width rounded up to a power of two (k rows share a
        physical row) and a wider one to a multiple of the lanes; without, unchanged. (The
        TPU compiler lays a (rows, D) array with D not a multiple of 128 out dim-major and
        copies the whole array to row-major around every row gather and scatter.)"""
        if not self.lanes:
            return self.width
        if self.width >= self.lanes:
            return -(-self.width // self.lanes) * self.lanes
        return 1 << (self.width - 1).bit_length()

    @property
    def per_row(self) -> int:
        """k: logical rows per physical row."""
        if not self.lanes or self.width >= self.lanes:
            return 1
        return self.lanes // self.padded_width

    @property
    def packed(self) -> bool:
        return self.per_row > 1 or self.padded_width != self.width

    def shard_rows(self, rows_per_shard: int) -> int:
        """Physical rows of one shard holding `rows_per_shard` logical rows."""
        rows = -(-rows_per_shard // self.per_row)
        return -(-rows // self.row_multiple) * self.row_multiple

    def is_identity(self, rows_per_shard: int) -> bool:
        """Whether the physical rows of a shard are its logical rows, unpadded."""
        return not self.packed and self.shard_rows(rows_per_shard) == rows_per_shard

    def physical_shape(self, layout: TableLayout) -> tuple:
        n = layout.num_shards * self.shard_rows(layout.rows_per_shard)
        if not self.packed:
            return (n, self.width) if self.rank == 2 else (n,)
        return (n, self.per_row * self.padded_width)

    def own_lanes(self, rows):
        """(..., k·w) bool: in the physical row of each logical row of `rows` (jnp), the
        lanes of its own group, the other k - 1 rows' lanes False."""
        group = jnp.arange(self.per_row * self.padded_width, dtype=jnp.int32) // self.padded_width
        return group == (rows % self.per_row)[..., None]

    def fold(self, x):
        """(..., k·w) physical rows whose lanes outside one group per row are zero (see
        `own_lanes`), or sums of such rows -> (..., w): the sum over the k lane groups."""
        k, w = self.per_row, self.padded_width
        return x.reshape(x.shape[:-1] + (k, w)).sum(axis=-2) if k > 1 else x

    def pack(self, x, num_shards: int):
        """(N * S, width) or (N * S,) shard-ordered rows -> the physical array. np or jnp."""
        s = x.shape[0] // num_shards
        if self.is_identity(s):
            return x
        xp = _xp(x)
        k, w = self.per_row, self.padded_width
        x = x.reshape((num_shards, s, self.width))
        x = xp.pad(x, [(0, 0), (0, self.shard_rows(s) * k - s), (0, w - self.width)])
        return x.reshape((-1, k * w) if self.packed or self.rank == 2 else (-1,))

    def unpack(self, x, num_shards: int, rows_per_shard: int):
        """The inverse of pack: physical -> (N * S, width) or (N * S,)."""
        if self.is_identity(rows_per_shard):
            return x
        x = x.reshape((num_shards, -1, self.padded_width))[:, :rows_per_shard, : self.width]
        return x.reshape((-1, self.width) if self.rank == 2 else (-1,))


def _xp(x):
    return jnp if isinstance(x, jnp.ndarray) and not isinstance(x, np.ndarray) else np


def _where(like, cond, a, b):
    xp = np if isinstance(like, (np.ndarray, np.generic, int)) else jnp
    return xp.where(cond, a, b)


# Windows of flat per-shard arrays (a dynamic table's index, a HostCached cache's tags) read
# and written as rows of a (words / 128, 128) view, a reshape that moves nothing. A window
# per index of the flat array (a vmapped `dynamic_slice`, a windowed scatter) compiles for
# TPU into a loop of one window an iteration (docs/design.md, "Windows that compile to
# loops"); a row gather or scatter of the view does not.

LANES = 128


def window_rows(width: int) -> int:
    """Rows of 128 words that a window of `width` words can span, when it starts at a
    multiple of gcd(width, 128) words."""
    return -(-(width + LANES - math.gcd(width, LANES)) // LANES)


def lane_view(size: int) -> bool:
    """Whether a flat array of `size` words has its (size / 128, 128) view."""
    return size % LANES == 0


def lane_windows(flat, start, width: int):
    """(n, width): flat[start[i] : start[i] + width] of a 1-D array whose size is a
    multiple of 128 (`lane_view`), each window inside it. The rows of 128 words a window
    lies in are gathered from the view, and its words taken out of them: one group of
    `width` lanes where `width` divides 128 and the window starts at a multiple of it,
    else by rotating each row's lanes by the window's offset."""
    view = flat.reshape(-1, LANES)
    first = start // LANES
    offset = start % LANES
    k = window_rows(width)
    rows = jnp.concatenate([view.at[first + j].get(mode="clip") for j in range(k)], axis=1)
    if LANES % width == 0:  # Aligned: one row, the window one of its 128 / width groups.
        groups = rows.reshape(-1, LANES // width, width)
        return jnp.sum(jnp.where(_group(start, width), groups, 0), axis=1, dtype=flat.dtype)
    for b in range(7):  # offset < 128: rotate left by each of its bits.
        moved = jnp.roll(rows, -(1 << b), axis=1)
        rows = jnp.where((((offset >> b) & 1) == 1)[:, None], moved, rows)
    return rows[:, :width]


def _group(start, width: int):
    """(n, 128 / width, 1): which group of `width` lanes of its row each window starting at
    `start` (a multiple of `width`, which divides 128) is."""
    groups = lax.iota(jnp.int32, LANES // width)[None, :, None]
    return groups == (start % LANES // width)[:, None, None]


def aligned_windows(size: int, width: int) -> bool:
    """Whether `put_lane_windows` takes windows of `width` of a flat array of `size` words
    (windows at multiples of `width`)."""
    return lane_view(size) and (LANES % width == 0 or width % LANES == 0)


def put_lane_windows(flat, start, values, write, op: str):
    """`flat` (integers) with the windows at `start` ((G,), multiples of their width w,
    distinct where `write`) combined with `values` ((G, w)) by `op` ("add", "mul" or
    "max"), the others left as they are (`aligned_windows`). Row scatters into the
    (words / 128, 128) view; windows narrower than a row fill the rest of it with the op's
    identity, so that windows sharing a row combine."""
    g, width = values.shape
    view = flat.reshape(-1, LANES)
    values = values.astype(flat.dtype)
    if width >= LANES:  # Whole rows: width / 128 of them each, all distinct.
        k = width // LANES
        rows = (start // LANES)[:, None] + lax.iota(jnp.int32, k)[None, :]
        # A skipped window's rows go past the array at places of their own: still unique.
        past = view.shape[0] + lax.iota(jnp.int32, g * k).reshape(g, k)
        rows = jnp.where(write[:, None], rows, past).reshape(-1)
        values, unique = values.reshape(-1, LANES), True
    else:
        identity = {"add": 0, "mul": 1, "max": jnp.iinfo(flat.dtype).min}[op]
        values = jnp.where(_group(start, width), values[:, None, :], identity)
        values, unique = values.reshape(g, LANES), False
        rows = jnp.where(write, start // LANES, view.shape[0])
    at = view.at[rows]
    combine = {"add": at.add, "mul": at.multiply, "max": at.max}[op]
    return combine(values, mode="drop", unique_indices=unique).reshape(-1)
