"""The initial state: programs that draw each table and slot on its own shards.

`Embedding.init` runs them; `Initializer` holds them for one plan on one mesh, compiled once.
Tables with the default initializer and constant slots are drawn in blocks of rows, straight
into the arrays of their stacks, by one program for all of them; a table with its own
initializer gets a program of its own (see `Initializer.init`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _optimizers, _placement, _plan, _sharding, _storage, initializers

# The largest table's blocks in `init` have at least this many rows.
_INIT_BLOCK_ROWS_MIN = 1024


def _drawn_as(plan: _plan.TablePlan) -> tuple:
    """(D, the table's row initializer): tables drawn alike share one computation in
    `init`'s rounds."""
    return plan.config.dim, initializers.of(plan.config.initializer)


def constant_rows(plan: _plan.TablePlan, slot: _optimizers.SlotSpec, valid):
    """Rows of a slot with a constant initial value: (n,) or (n, D) float32, zero where not
    `valid` ((n,) bool: padding rows)."""
    shape = valid.shape + ((plan.config.dim,) if slot.rank == 2 else ())
    value = jnp.where(valid, jnp.float32(float(slot.initializer)), 0.0)
    return jnp.broadcast_to(value.reshape(valid.shape + (1,) * (len(shape) - 1)), shape)


def slot_key(table_key, storage: _storage.TableStorage, slot):
    """The key a slot's initial value is drawn from: the same whether it rides in the
    table's array or has its own."""
    return jax.random.fold_in(table_key, storage.slot_specs.index(slot) + 1)


class Initializer:
    """`Embedding.init`'s programs for one plan on one mesh (built on first use, cached).

    `join`: ({table: array}, {table: {slot: array}}) of tables stored alone -> the state's
    (tables, slots) keyed by stack (`Embedding.state_arrays`).
    """

    def __init__(self, plan: _plan.EmbeddingPlan, mesh, join: Callable):
        self.plan, self.mesh, self._join = plan, mesh, join
        self.axis, self.num_shards = plan.axis, plan.num_shards
        self.table_plans = plan.tables
        self.stacks = {key: p.tables for key, p in plan.stacks.items()}
        self._replicated = NamedSharding(mesh, P())
        self._init_fns = None
        self._init_blocked = None

    def _rows(self, rank: int, memory_kind: str | None = None) -> NamedSharding:
        return NamedSharding(
            self.mesh, P(self.axis, *([None] * (rank - 1))), memory_kind=memory_kind
        )

    def _shardings(self, plan: _plan.TablePlan) -> tuple:
        table_shape, slot_shapes = plan.storage.shapes()
        kind = plan.storage.memory_kind
        return self._rows(len(table_shape), kind), {
            n: self._rows(len(shape), kind) for n, shape in slot_shapes.items()
        }

    def _shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def init(self, key: jax.Array) -> tuple[dict, dict, jax.Array]:
        """(tables, slots, step) of `Embedding.init`: the same logical values for every mesh
        and strategy.

        Tables with the default initializer and constant slot initializers (every built-in
        optimizer) are drawn in blocks of rows on their own shards, straight into the
        arrays of their stacks, all in one compiled program: the transient memory is a
        block per array, and there is one compile however many tables there are. Row r of
        such a table is a hash of (table key, r), so its value depends on neither the mesh,
        the strategy nor the block size. A table with its own initializer (or a slot with a
        random one) is called with the logical shape, as the API promises, in a program of
        its own; a stack holding one is joined from its members' arrays. Works traced
        inside another jit too.
        """
        keys = self.table_keys(key)
        tables, slots = {}, {}
        names = self._blocked_tables()
        if names:
            program, per_table = self.blocked_program()
            for name, (table, table_slots) in program(
                {n: keys[n] for n in names}, per_table
            ).items():
                tables[name], slots[name] = table, table_slots
        programs = self.programs()
        own = {}
        for name in self.plan.stacks:
            if name in tables:
                continue
            for t in self.stacks[name]:
                plan = self.table_plans[t]
                if not self.takes_buffers(t):
                    own[t] = programs[t](keys[t])
                elif isinstance(key, jax.core.Tracer):
                    # Inside another trace, host buffers would be constants of its program:
                    # drawn on the device, then moved to the host.
                    own[t] = jax.jit(
                        functools.partial(self._init_table_blocked, plan),
                        out_shardings=self._shardings(plan),
                    )(keys[t])
                else:
                    own[t] = programs[t](keys[t], self.host_buffers(plan))
        if own:
            joined = self._join(
                {t: x[0] for t, x in own.items()}, {t: x[1] for t, x in own.items()}
            )
            tables.update(joined[0])
            slots.update(joined[1])
        tables = {name: tables[name] for name in self.plan.stacks}
        slots = {name: slots[name] for name in self.plan.stacks}
        step = jnp.zeros((), jnp.int32)
        if not isinstance(key, jax.core.Tracer):
            step = jax.device_put(step, self._replicated)
        return tables, slots, step

    def programs(self) -> dict:
        """{table name: a jitted fn(table key) -> (table, slots) giving what `init` gives for
        it, as the table would be stored alone}; for compiling ahead of time (the planner
        checks initialisation fits HBM too). A host table drawn in blocks takes its host
        buffers too (`takes_buffers`)."""
        if self._init_fns is None:
            self._init_fns = {}
            for name, plan in self.table_plans.items():
                shardings = self._shardings(plan)
                if self.takes_buffers(name):
                    # Drawn block by block into the host buffers it is given (`host_buffers`,
                    # donated): a table in host memory may exceed HBM.
                    self._init_fns[name] = jax.jit(
                        functools.partial(self._init_host, plan),
                        out_shardings=shardings,
                        donate_argnums=1,
                    )
                    continue
                fn = self._init_table_blocked if self._blocked(name) else self._init_table
                self._init_fns[name] = jax.jit(functools.partial(fn, plan), out_shardings=shardings)
        return self._init_fns

    def takes_buffers(self, name: str) -> bool:
        """Whether table `name`'s program (`programs`) is fn(table key, `host_buffers`): a
        host table drawn in blocks. (A host table with its own initializer is called with
        its logical shape, on the device, and then moved to host memory.)"""
        return self.table_plans[name].storage.on_host and self._blocked(name)

    def host_buffers(self, plan: _plan.TablePlan, abstract: bool = False) -> tuple:
        """(table, {slot: array}): zero arrays in host memory for a host table's init
        program (ShapeDtypeStructs when `abstract`): allocated on the host, never on a
        device."""
        table_shape, slot_shapes = plan.storage.shapes()
        table_sharding, slot_shardings = self._shardings(plan)

        def zeros(shape, dtype, sharding):
            if abstract:
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            local = sharding.shard_shape(shape)  # Row-sharded evenly: every shard alike.
            return jax.make_array_from_callback(
                shape, sharding, lambda index: np.zeros(local, dtype)
            )

        return zeros(table_shape, plan.config.dtype, table_sharding), {
            n: zeros(shape, jnp.float32, slot_shardings[n]) for n, shape in slot_shapes.items()
        }

    def _init_host(self, plan: _plan.TablePlan, table_key, buffers):
        """`_init_table_blocked` of a host table, into its donated host `buffers`."""
        names = (plan.name,)
        per_table = self._per_table_rows(names)
        return self._draw_tables(names, None, {plan.name: table_key}, per_table, buffers)[plan.name]

    def _blocked(self, name: str) -> bool:
        """Whether `init` draws a table in row blocks: the default initializer or a row
        initializer (`jte.initializers`), and constant slots."""
        plan = self.table_plans[name]
        return initializers.of(plan.config.initializer) is not None and not any(
            callable(s.initializer) for s in plan.storage.slot_specs
        )

    def _blocked_tables(self) -> tuple:
        """The tables of the stacks whose every member `_blocked` (drawn by one program);
        not the tables in host memory, each drawn on its host by a program of its own."""
        return tuple(
            t
            for name in self.plan.stacks
            if all(self._blocked(t) for t in self.stacks[name])
            and not self.plan.stacks[name].storage.on_host
            for t in self.stacks[name]
        )

    def blocked_program(self) -> tuple:
        """(jitted fn({name: table key}, per_table) -> {stack: (table, slots)}, per_table):
        every blocked stack in one program (`per_table`: see `_per_table_rows`)."""
        if self._init_blocked is None:
            names = self._blocked_tables()
            targets = tuple(dict.fromkeys(self.plan.stack_of[n] for n in names))
            program = jax.jit(
                functools.partial(self._draw_tables, names, targets),
                out_shardings={t: self._shardings(self.plan.stacks[t]) for t in targets},
            )
            self._init_blocked = (program, self._per_table_rows(names))
        return self._init_blocked

    def table_keys(self, key) -> dict:
        return {name: jax.random.fold_in(key, i) for i, name in enumerate(self.table_plans)}

    def compile(self, key: jax.ShapeDtypeStruct) -> None:
        """Compiles `init`'s program of the blocked tables for keys like `key` before `init`
        is called (jax keeps it for the call), so that a caller can do it while it does
        something else. Thread-safe."""
        names = self._blocked_tables()
        if names:
            keys = jax.eval_shape(self.table_keys, key)
            program, per_table = self.blocked_program()
            program.lower({n: keys[n] for n in names}, per_table).compile()

    def _init_table_blocked(self, plan: _plan.TablePlan, table_key):
        """A table and its slots drawn block by block on their own shards (see `init`)."""
        names = (plan.name,)
        return self._draw_tables(names, None, {plan.name: table_key}, self._per_table_rows(names))[
            plan.name
        ]

    def blocks(self, names: tuple) -> tuple:
        """How `_init_local` splits the table arrays of `names` into rounds: (rounds,
        {(D, row initializer): the tables of width D drawn so}, and per table (T,)
        arrays: logical local rows (padding included), rows per physical row, rows per
        round, and the first row of its block in its group's draw)."""
        plans = [self.table_plans[n] for n in names]
        granule = np.array([p.storage.block_granule(None) for p in plans])
        logical = granule * [p.storage.shapes()[0][0] // self.num_shards for p in plans]
        # A row's bytes as the draw holds it: narrow rows pad to the lanes on TPU layouts.
        total = sum(int(n) * max(p.config.dim, p.storage.lanes) * 4 for n, p in zip(logical, plans))
        rounds = max(
            1,
            min(
                -(-total // self.plan.init_block_bytes),
                -(-logical.max() // _INIT_BLOCK_ROWS_MIN),
            ),
        )
        per_round = -(-logical // rounds)
        block = np.minimum(logical, -(-per_round // granule) * granule)
        groups: dict[tuple, list[int]] = {}  # In the tables' order: `drawn`'s.
        for j, p in enumerate(plans):
            groups.setdefault(_drawn_as(p), []).append(j)
        offset = np.zeros(len(plans), np.int64)
        for members in groups.values():
            offset[members] = np.cumsum(block[members]) - block[members]
        return rounds, groups, logical, granule, block, offset

    def _per_table_rows(self, names: tuple) -> tuple:
        """Per table of `names`: int32 (1 + N,), [the first row of its block in its draw,
        the rows each of the N shards holds]. Runtime inputs of `_init_local` rather than
        constants, so that tables of one shape have the same code (XLA compiles it once)."""
        offset = self.blocks(names)[-1]
        return tuple(
            np.concatenate([[o], self.table_plans[n].storage.layout.shard_sizes()]).astype(np.int32)
            for n, o in zip(names, offset)
        )

    def _targets(self, names: tuple, stacks: tuple | None) -> list:
        """The arrays `_init_local` writes: [(name, plan, [(index in names, first local
        row)])], one per stack of `stacks`, or one per table of `names` stored alone."""
        if stacks is None:
            return [(n, self.table_plans[n], [(j, 0)]) for j, n in enumerate(names)]
        out = []
        for stack in stacks:
            plan = self.plan.stacks[stack]
            out.append((stack, plan, [(names.index(t), o) for t, o in plan.offsets.items()]))
        return out

    def _draw_tables(
        self, names: tuple, stacks: tuple | None, keys: dict, per_table: tuple, buffers=None
    ):
        """{name: (table, slots)} of the blocked tables `names`, in the arrays of `stacks`
        (None: each table alone) (see `_init_local`); `buffers`: the host arrays of one
        host table (`host_buffers`), written in place."""
        words = jnp.stack([jax.random.key_data(keys[n]).reshape(-1) for n in names])
        words = words.astype(jnp.uint32)
        row = P(self.axis)
        targets = self._targets(names, stacks)
        out_specs = {
            name: (row, {s.name: row for s in plan.storage.stored}) for name, plan, _ in targets
        }
        buffer_specs = None if buffers is None else (row, {n: row for n in buffers[1]})
        local = self._shard_map(
            functools.partial(self._init_local, names, targets),
            (P(), P(), buffer_specs),
            out_specs,
        )(jnp.stack([words[:, 0], words[:, -1]]), per_table, buffers)
        kinds = {name: plan.storage.memory_kind for name, plan, _ in targets}
        return {
            n: (
                self._constrain(t, kinds[n]),
                {k: self._constrain(x, kinds[n]) for k, x in slots.items()},
            )
            for n, (t, slots) in local.items()
        }

    def _init_local(self, names: tuple, targets: list, words, per_table: tuple, buffers=None):
        """Inside shard_map: this shard's physical arrays of `targets` (`_targets`: the
        tables `names`, alone or in their stacks) and their stored slots.

        The tables are written in rounds: in each, a block of rows of every table (about
        1/rounds of it) is drawn by one computation for all of them (one per row width),
        then copied into place. Drawn per table, the program held one draw per table, and
        XLA took seconds to compile a demo's 26. `words`: (2, T) uint32, the first and last
        word of each table's key; `per_table`: see `_per_table_rows`.
        """
        shard = jax.lax.axis_index(self.axis)
        plans = [self.table_plans[n] for n in names]
        rounds, groups, logical, granule, block, offset = self.blocks(names)
        steps = [p.storage.layout.id_steps() for p in plans]
        first_id = jnp.asarray(np.stack([f for f, _ in steps]).astype(np.int32))[:, shard]
        stride = np.array([s for _, s in steps], np.int32)
        # Table j is written into array into[j][0] from its local row into[j][1] on.
        into = {j: (t, o) for t, (_, _, members) in enumerate(targets) for j, o in members}

        def first(r, j: Any = slice(None)):
            """The first local row of table j's block in round r (of every table's: (T,)).
            The last block ends where the array ends: the rows it writes twice get the same
            values twice."""
            r = jnp.clip(r, 0, rounds - 1)
            return jnp.minimum(r * block[j], logical[j] - block[j]).astype(jnp.int32)

        def draw(r):
            # Row i of a draw belongs to table `owner[i]`, its local row first + i - offset.
            start = first_id + stride * (first(r) - offset.astype(np.int32))
            out = []
            for (dim, how), members in groups.items():
                owner = np.repeat(np.array(members), block[members]).astype(np.int32)
                ids = start[owner] + stride[owner] * np.arange(len(owner), dtype=np.int32)
                out.append(initializers.rows_of(words[0][owner], words[1][owner], ids, dim, how))
            return out

        def write(arrays, drawn, r):
            arrays = list(arrays)
            for j, plan in enumerate(plans):
                storage = plan.storage
                start = first(r, j)
                local = start + jnp.arange(int(block[j]))
                valid = local < per_table[j][1 + shard]
                rows = jax.lax.dynamic_slice_in_dim(
                    drawn[list(groups).index(_drawn_as(plan))], per_table[j][0], int(block[j])
                )
                rows = jnp.where(valid[:, None], rows, 0.0).astype(plan.config.dtype)
                riders = {s.name: constant_rows(plan, s, valid) for s in storage.riders}
                physical = storage.block_to_physical(None, storage.join_row(rows, riders))
                t, o = into[j]
                at = ((o + start) // int(granule[j]),) + (0,) * (arrays[t].ndim - 1)
                arrays[t] = _placement.update_slice(
                    buffers is not None, arrays[t], physical.astype(arrays[t].dtype), at
                )
            return arrays

        def body(r, carry):
            # Round r - 1 is written while round r is drawn: a draw written in its own round
            # is fused into every table's write, and the program holds one draw per table.
            arrays, drawn = carry
            return write(arrays, drawn, r - 1), draw(r)

        arrays = [
            jnp.zeros(
                (p.storage.shapes()[0][0] // self.num_shards,) + p.storage.shapes()[0][1:],
                p.config.dtype,
            )
            if buffers is None
            else buffers[0]
            for _, p, _ in targets
        ]
        drawn = [jnp.zeros((int(block[m].sum()), g[0]), jnp.float32) for g, m in groups.items()]
        # One pass more than rounds: the first writes nothing, the last draws nothing new.
        arrays, _ = jax.lax.fori_loop(0, rounds + 1, body, (arrays, drawn))
        out = {}
        for (name, plan, members), table in zip(targets, arrays):
            slots = {}
            if buffers is not None:  # One host table: its slots written block by block too.
                size = per_table[members[0][0]][1 + shard]
                for s in plan.storage.stored:
                    slots[s.name] = self._host_slot(plan, s, buffers[1][s.name], size)
                out[name] = (table, slots)
                continue
            for s in plan.storage.stored:
                # Constants, computed where they are stored: no temporary, no blocks.
                rows = plan.storage.shapes()[1][s.name][0] // self.num_shards
                local = jnp.arange(rows * plan.storage.block_granule(s))
                valid = functools.reduce(
                    jnp.logical_or,
                    [(local >= o) & (local < o + per_table[j][1 + shard]) for j, o in members],
                )
                rows = constant_rows(plan, s, valid)
                slots[s.name] = plan.storage.block_to_physical(s, rows).astype(jnp.float32)
            out[name] = (table, slots)
        return out

    def _host_slot(self, plan: _plan.TablePlan, slot, buffer, size):
        """A host table's stored slot: its constant initial rows written into the host
        `buffer` (this shard's) a block at a time; `size`: the shard's real rows."""
        storage = plan.storage
        granule = storage.block_granule(slot)
        rows = buffer.shape[0]
        row_bytes = max(1, buffer.size // max(1, rows) * buffer.dtype.itemsize)
        block = max(1, min(rows, self.plan.init_block_bytes // row_bytes))
        rounds = -(-rows // block)

        def body(r, buffer):
            start = jnp.minimum(r * block, rows - block)
            local = start * granule + jnp.arange(block * granule)
            physical = storage.block_to_physical(slot, constant_rows(plan, slot, local < size))
            at = (start,) + (0,) * (buffer.ndim - 1)
            return _placement.update_slice(True, buffer, physical.astype(buffer.dtype), at)

        return jax.lax.fori_loop(0, rounds, body, buffer)

    def _init_table(self, plan: _plan.TablePlan, table_key):
        storage = plan.storage
        table = self.initial(plan, None, table_key)
        slots = {
            s.name: self.initial(plan, s, slot_key(table_key, storage, s))
            for s in storage.slot_specs
        }
        table, slots = storage.to_physical(table, slots)
        kind = storage.memory_kind
        return self._constrain(table, kind), {n: self._constrain(x, kind) for n, x in slots.items()}

    def initial(self, plan: _plan.TablePlan, slot: _optimizers.SlotSpec | None, key):
        """The logical initial value of a table (slot None) or one slot."""
        shape = plan.storage.logical_shape(slot)
        if slot is None:
            init = plan.config.initializer
            draw = initializers.of(init)
            if draw is not None:  # Drawn row by row.
                rows = jnp.arange(shape[0])
                return initializers.rows(key, rows, plan.config.dim, draw).astype(plan.config.dtype)
            assert init is not None  # `of` gives the default's row initializer for None.
            value = init(key, shape, jnp.float32)
            if tuple(jnp.shape(value)) != tuple(shape):
                # Shapes are static: a wrong one would be padded or cut into the layout.
                raise ValueError(
                    f"Table {plan.name!r}: its initializer returned shape "
                    f"{tuple(jnp.shape(value))}; expected (vocabulary_size, dim) = "
                    f"{tuple(shape)}, the shape it was called with."
                )
            return jnp.asarray(value).astype(plan.config.dtype)
        return _optimizers.slot_initial_value(slot, key, shape, table=plan.name)

    def _constrain(self, physical, memory_kind: str | None = None):
        # Said explicitly so that an init traced inside another jit keeps the row sharding
        # (and a host table its memory: a constraint does not move memory, device_put does).
        if memory_kind is not None:
            return jax.device_put(physical, self._rows(physical.ndim, memory_kind))
        return _sharding.constrain(physical, self._rows(physical.ndim))

    def slot(self, plan: _plan.TablePlan, slot: _optimizers.SlotSpec, key):
        """One stored slot's physical initial value, drawn on the devices."""
        storage = plan.storage
        sharding = self._rows(len(storage.shapes()[1][slot.name]), storage.memory_kind)
        fn = lambda k: self._constrain(storage.array_to_physical(slot, self.initial(plan, slot, k)))
        return jax.jit(fn, out_shardings=sharding)(key)
