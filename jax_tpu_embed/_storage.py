"""How one table and its optimizer slots are stored on the devices.

A table's logical form is what users see: the table (V, D) and each slot (V, D) or (V,), in
natural row order. Its physical form is what the devices hold: row-sharded arrays whose
layout this module alone knows:

- Ownership and padding (`_layout.TableLayout`): shard p holds its rows in local order,
  padded to S = ceil(V / N) rows.
- Lane packing (`_layout.Packing`): with `lanes` = 128 (TPU), an array of width w < 128 is
  stored k = 128 // W logical rows to a 128-lane physical row (W: w rounded up to a power of
  two), because the TPU pads (rows, w) arrays to 128 lanes and charges row scatters into them
  whole-array passes.
- Riders: a float32 table's same-width slots may ride in the table's own rows, [row | slot 1
  | ...], when they fit one 128-lane row together and the shared row pads to no more lanes
  than separate arrays would (Adagrad at every D <= 64). A touched row then costs one
  physical row, not 1 + S. Rank-1 slots and the rest keep arrays of their own (`stored`).

Stacks (`stack`): tables with the same row form and optimizer may share one array per
stored array, each shard holding its members' local rows one block after another. Each
member keeps its own `TableStorage` (its layout, and the physical form it would have alone);
the stack's arrays hold those forms at fixed offsets (`Member.rows`), so converting between
them is a slice or a concatenation per shard.

Init, export, restore, checkpoints, serving, planning and the backends all go through a
`TableStorage`; none of them re-derives the physical form.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _layout, _multihost, _optimizers, _placement


@dataclasses.dataclass(frozen=True)
class TableStorage:
    """The physical form of one table and its slots.

    Attributes:
        layout: Row ownership and padding over the shards.
        dim: D.
        dtype: The table's storage dtype (slots are float32).
        slot_specs: The optimizer's slots, in order.
        lanes: Physical row width narrow rows are packed into (128 on TPU); 0: none.
        dense_update: The optimizer updates every row (then nothing rides: its update is not
            row-local in the same way, and it never runs the fused kernels).
        on_host: The arrays live in the hosts' memory (`placement="host"` or
            `HostCached`), not the devices': the row work reaches them through `_placement`.
        cache: `HostCached`'s device cache per shard (`_placement.CacheShape`), or None.
    """

    layout: _layout.TableLayout
    dim: int
    dtype: jnp.dtype
    slot_specs: tuple
    lanes: int = 0
    dense_update: bool = False
    on_host: bool = False
    cache: _placement.CacheShape | None = None

    @property
    def memory_kind(self) -> str | None:
        """The memory kind of the arrays' shardings (None: the devices' default)."""
        return _placement.HOST if self.on_host else None

    # ------------------------------------------------------------- what is stored where

    @property
    def riders(self) -> tuple:
        """The slots stored in the table's own array, right of its D lanes, in order."""
        if not self.lanes or jnp.dtype(self.dtype) != jnp.float32 or self.dense_update:
            return ()
        wide = tuple(s for s in self.slot_specs if s.rank == 2)
        n = 1 + len(wide)

        def width(w):
            return _layout.Packing(w, 2, self.lanes).padded_width

        fits = self.dim * n <= self.lanes and width(self.dim * n) <= n * width(self.dim)
        return wide if wide and fits else ()

    @property
    def stored(self) -> tuple:
        """The slots with arrays of their own (`EmbeddingState.slots`): all but the riders."""
        riders = self.riders
        return tuple(s for s in self.slot_specs if s not in riders)

    @property
    def packing(self) -> _layout.Packing:
        """The table array's: D lanes per logical row, then the riders'."""
        pairs = 2 if self.lanes and jnp.dtype(self.dtype).itemsize == 2 else 1
        return _layout.Packing(self.dim * (1 + len(self.riders)), 2, self.lanes, pairs)

    @property
    def rows_packing(self) -> _layout.Packing:
        """D-wide rows packed as a table without riders: lane-dense activations."""
        return _layout.Packing(self.dim, 2, self.lanes)

    def slot_packing(self, slot: _optimizers.SlotSpec) -> _layout.Packing:
        return _layout.Packing(self.dim if slot.rank == 2 else 1, slot.rank, self.lanes)

    def empty_cache(self) -> _placement.CacheState:
        """A `HostCached` table's caches holding no row (global arrays, row-sharded)."""
        cache = self.cache
        assert cache is not None
        table_shape, slot_shapes = self.shapes()

        def lines(shape, dtype, packing):
            sets = cache.sets(packing.per_row)
            return _placement.empty_lines(shape, dtype, sets, cache.ways, self.layout.num_shards)

        return _placement.CacheState(
            lines(table_shape, self.dtype, self.packing),
            {
                s.name: lines(slot_shapes[s.name], jnp.float32, self.slot_packing(s))
                for s in self.stored
            },
        )

    @property
    def packings(self) -> list[_layout.Packing]:
        """The packings of the stored arrays, [table, *stored slots]."""
        return [self.packing] + [self.slot_packing(s) for s in self.stored]

    def shapes(self) -> tuple[tuple, dict[str, tuple]]:
        """(table shape, {stored slot: shape}) of the physical, global arrays."""
        return (
            self.packing.physical_shape(self.layout),
            {s.name: self.slot_packing(s).physical_shape(self.layout) for s in self.stored},
        )

    def logical_shape(self, slot: _optimizers.SlotSpec | None = None) -> tuple:
        """(V, D) for the table (slot None) or a rank-2 slot, (V,) for a rank-1 slot."""
        v = self.layout.vocabulary_size
        return (v, self.dim) if slot is None or slot.rank == 2 else (v,)

    # -------------------------------------------------------------- logical <-> physical

    def to_physical(self, table, slots: dict) -> tuple:
        """Logical table (V, D) and slots {name: (V, D) or (V,)} -> (table array, {stored
        slot: array}), global physical arrays. `slots` must hold every rider; stored slots
        missing from it are left out. NumPy or jnp (traceable)."""
        table = self._join(table, {s.name: slots[s.name] for s in self.riders})
        return (
            self._array_to_physical(self.packing, table),
            {
                s.name: self._array_to_physical(self.slot_packing(s), slots[s.name])
                for s in self.stored
                if s.name in slots
            },
        )

    def to_logical(self, table, slots: dict | None = None) -> tuple:
        """The inverse of to_physical: (table (V, D), {slot: logical}) with every rider and
        the stored slots given in `slots`. `table` may be None when no slot rides in it
        (then so is the table returned)."""
        riders = {}
        if table is not None:
            table, riders = self._split(self._array_to_logical(self.packing, table))
        elif self.riders:
            raise ValueError("TableStorage.to_logical: slots ride in the table's array; pass it.")
        slots = slots or {}
        stored = {
            s.name: self._array_to_logical(self.slot_packing(s), slots[s.name])
            for s in self.stored
            if s.name in slots
        }
        return table, {
            s.name: riders[s.name] if s.name in riders else stored[s.name]
            for s in self.slot_specs
            if s.name in riders or s.name in stored
        }

    def shard_table_rows(self, local, shard: int) -> np.ndarray:
        """The logical rows (without riders) of shard `shard` from its physical rows."""
        rows = self.packing.unpack(local, 1, self.layout.rows_per_shard)
        return self._split(rows)[0][: int(self.layout.shard_sizes()[shard])]

    def shard_rows(self) -> int:
        """Physical rows of one shard of the table array."""
        return self.packing.shard_rows(self.layout.rows_per_shard)

    def array_to_logical(self, slot: _optimizers.SlotSpec | None, physical):
        """One stored array (the table with its riders for slot None) -> logical rows."""
        packing = self.packing if slot is None else self.slot_packing(slot)
        return self._array_to_logical(packing, physical)

    def array_to_physical(self, slot: _optimizers.SlotSpec | None, logical):
        """The inverse of array_to_logical."""
        packing = self.packing if slot is None else self.slot_packing(slot)
        return self._array_to_physical(packing, logical)

    def is_identity(self, slot: _optimizers.SlotSpec | None) -> bool:
        """Whether the stored array is already its logical rows, unpadded: "div" with V a
        multiple of N, no packing, and for the table's array (slot None) no riders (D = 64
        with one rider fills 128 lanes unpacked, but half of each row is the rider's)."""
        packing = self.packing if slot is None else self.slot_packing(slot)
        layout = self.layout
        return (
            layout.strategy == "div"
            and layout.padded_rows == layout.vocabulary_size
            and packing.is_identity(layout.rows_per_shard)
            and (slot is not None or not self.riders)
        )

    def block_to_physical(self, slot: _optimizers.SlotSpec | None, rows):
        """One shard's block of consecutive local logical rows (for slot None the table's,
        riders joined with `join_row`) -> the physical rows holding them. The block must
        start and end on a physical row: a multiple of `block_granule(slot)` rows."""
        packing = self.packing if slot is None else self.slot_packing(slot)
        # A block is not a shard: its physical rows are not padded to row_multiple.
        return dataclasses.replace(packing, row_multiple=1).pack(rows, 1)

    def block_granule(self, slot: _optimizers.SlotSpec | None) -> int:
        """Logical rows per physical row of the table array (slot None) or a stored slot."""
        return (self.packing if slot is None else self.slot_packing(slot)).per_row

    def _array_to_physical(self, packing: _layout.Packing, logical):
        return packing.pack(self.layout.to_physical(logical), self.layout.num_shards)

    def take_stored(self, slot: _optimizers.SlotSpec | None, positions, array) -> np.ndarray:
        """One stored array's logical rows (the table's with its riders for slot None) at
        stored positions, NumPy: positions shard * S + local (a dynamic index's global
        rows), in any order. Only the physical rows of `array` (a jax.Array or NumPy)
        holding them are read (`multihost.to_host`: a collective with several processes),
        never the whole array."""
        packing = self.packing if slot is None else self.slot_packing(slot)
        s = self.layout.rows_per_shard
        shard, local = np.divmod(np.asarray(positions, np.int64), s)
        k, w = packing.per_row, packing.padded_width
        got = _multihost.to_host(array, shard * packing.shard_rows(s) + local // k)
        if not packing.packed:
            return got
        lanes = (local % k)[:, None] * w + np.arange(packing.width)
        got = np.take_along_axis(got, lanes, axis=1)
        return got if packing.rank == 2 else got[:, 0]

    def _array_to_logical(self, packing: _layout.Packing, physical):
        rows = packing.unpack(physical, self.layout.num_shards, self.layout.rows_per_shard)
        return self.layout.to_logical(rows)

    # --------------------------------------------------------------------- one row

    def split_row(self, group):
        """(rows (..., D), {rider name: (..., D)}) from the table array's logical rows."""
        return self._split(group)

    def join_row(self, rows, riders: dict):
        """The inverse of split_row."""
        return self._join(rows, riders)

    def _split(self, group):
        d = self.dim
        return group[..., :d], {
            s.name: group[..., d * (1 + i) : d * (2 + i)] for i, s in enumerate(self.riders)
        }

    def _join(self, rows, riders: dict):
        if not self.riders:
            return rows
        xp = np if isinstance(rows, np.ndarray) else jnp
        return xp.concatenate(
            [rows] + [xp.asarray(riders[s.name]).astype(rows.dtype) for s in self.riders], axis=-1
        )

    def stored_row_fn(self, row_fn):
        """row_fn(g, [row, *slots], scalars) -> [row, *slots] of ONE row, as a function over
        the stored arrays' values of that row, [table array's row, *stored slots]: the
        riders are split off before and joined back after."""
        if not self.riders:
            return row_fn
        names = [s.name for s in self.slot_specs]
        stored = [s.name for s in self.stored]

        def fn(g, values, scalars):
            row, riders = self._split(values[0])
            given = {**riders, **dict(zip(stored, values[1:]))}
            new = row_fn(g, [row] + [given[n] for n in names], scalars)
            new_slots = dict(zip(names, new[1:]))
            return [self._join(new[0], {n: new_slots[n] for n in riders})] + [
                new_slots[n] for n in stored
            ]

        return fn

    # ---------------------------------------------------------------------- accounting

    def shard_bytes(self) -> tuple[int, int]:
        """(table, slots) bytes of one shard as stored, padding and packing included; the
        riders count as slots, by their share of the table array's lanes."""
        table_shape, slot_shapes = self.shapes()
        n = self.layout.num_shards

        def size(shape, dtype):
            return int(np.prod(shape)) // n * jnp.dtype(dtype).itemsize

        table = size(table_shape, self.dtype)
        riders = table * len(self.riders) // (1 + len(self.riders))
        return table - riders, riders + sum(size(s, jnp.float32) for s in slot_shapes.values())


# ------------------------------------------------------------------------------ stacks


@dataclasses.dataclass(frozen=True)
class StackLayout(_layout.TableLayout):
    """The rows of a stack's shards: S = the members' blocks one after another, all real.
    Ownership belongs to each member's own layout (`_backend.TablePlan.owner_and_local`),
    never to the stack: asking the stack is a bug, and says so."""

    def owner_and_local(self, ids):
        raise TypeError("a stack's rows are owned by its members' layouts")

    def global_ids(self, shard, local):
        raise TypeError("a stack's rows have no global ids of their own")


@dataclasses.dataclass(frozen=True)
class Member:
    """One table in a stack: its own storage, and its first local row in the stack's shards
    (a multiple of every stored array's logical rows per physical row)."""

    name: str
    storage: TableStorage
    offset: int

    @property
    def layout(self) -> _layout.TableLayout:
        return self.storage.layout

    def rows(self, packing: _layout.Packing) -> slice:
        """The physical rows of one stack shard (of the array stored with `packing`) that
        hold this member's shard of that array, as the member alone would store it."""
        start = self.offset // packing.per_row
        return slice(start, start + packing.shard_rows(self.layout.rows_per_shard))


def stack(members: list[tuple[str, TableStorage]]) -> tuple[TableStorage, tuple[Member, ...]]:
    """(the stack's storage, its members) for tables whose storages agree on everything but
    their layout. Each member's block of rows starts on a physical row of every stored
    array, so a member's part of a stack shard is its own physical shard, padded."""
    first = members[0][1]
    for name, storage in members:
        if dataclasses.replace(storage, layout=first.layout) != first:
            raise ValueError(f"table {name!r} is stored unlike {members[0][0]!r}; not stackable")
    granule = math.lcm(*(p.per_row * p.row_multiple for p in first.packings))
    out, offset = [], 0
    for name, storage in members:
        out.append(Member(name, storage, offset))
        offset += -(-storage.layout.rows_per_shard // granule) * granule
    n = first.layout.num_shards
    layout = StackLayout(n * offset, n, "div")
    return dataclasses.replace(first, layout=layout), tuple(out)


def join_local(stacked: TableStorage, members, slot, parts: list):
    """One shard of a stack's array (the table's for slot None, else the stored slot's)
    from its members' shards of theirs, in member order: each padded to the next block."""
    packing = stacked.packing if slot is None else stacked.slot_packing(slot)
    starts = [m.rows(packing).start for m in members]
    ends = starts[1:] + [packing.shard_rows(stacked.layout.rows_per_shard)]
    return jnp.concatenate(
        [
            jnp.pad(x, [(0, end - start - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
            for x, start, end in zip(parts, starts, ends)
        ]
    )


# ------------------------------------------------------------------ stochastic rounding


def mix32(x):
    """A 32-bit integer hash (lowbias32): every output bit depends on every input bit.
    Counter-based randomness (initial values, stochastic rounding) is built on it. NumPy
    uint32 in, NumPy out (host code: nothing to compile); else jnp."""
    if isinstance(x, (np.ndarray, np.generic)):
        with np.errstate(over="ignore"):  # uint32 products wrap, as XLA's do.
            return _lowbias32(x, np.uint32)
    return _lowbias32(x, jnp.uint32)


def _lowbias32(x, u32):
    x = x ^ (x >> 16)
    x = x * u32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * u32(0x846CA68B)
    return x ^ (x >> 16)


def table_seed(name: str) -> int:
    """The table's key in the rounding stream: its name, so it is the same on every mesh."""
    return zlib.crc32(name.encode()) & 0xFFFFFFFF


def step_key(seed: int, step):
    """uint32 key of (table, step), the part of the stream shared by a step's rows."""
    return mix32(jnp.uint32(seed) ^ mix32(jnp.asarray(step).astype(jnp.uint32)))


def random_bits(key, rows, width: int):
    """(R, width) uint32 random bits, a counter-based stream of (key, global row, lane):
    no state, the same bits for a row whatever shard or backend updates it."""
    rows = jnp.asarray(rows).astype(jnp.uint32)[:, None]
    lanes = lax.broadcasted_iota(jnp.int32, (1, width), 1).astype(jnp.uint32)
    return mix32(mix32(key ^ mix32(rows)) ^ (lanes + jnp.uint32(0x9E3779B9)))


def round_stochastically(x, bits):
    """float32 x -> bfloat16, rounded away from zero with probability (distance to the
    nearer-to-zero neighbour) / (spacing): the low 16 random bits are added to the low 16
    bits of x, the carry decides, and the low bits are dropped. NaN stays NaN."""
    u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    u = (u + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
    out = lax.bitcast_convert_type(u, jnp.float32)
    return jnp.where(jnp.isnan(x), x, out).astype(jnp.bfloat16)
