"""The embedding: sharded state, lookup, sparse update, export and restore."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import (
    _backend,
    _config,
    _guards,
    _inputs,
    _layout,
    _multihost,
    _optimizers,
    _pallas,
    _routing,
    _storage,
    _streams,
)

Nested = Any


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["tables", "slots", "step"], meta_fields=[]
)
@dataclasses.dataclass
class EmbeddingState:
    """All trainable embedding state.

    Attributes:
        tables: {table name: (N * S, D) array}, row-sharded; shard p holds rows
            [p * S, (p + 1) * S) in its local order (see `Embedding.shard_rows`).
        slots: {table name: {slot name: (N * S, D) or (N * S,) float32 array}}.
        step: int32 scalar, the number of updates applied so far.
    """

    tables: dict
    slots: dict
    step: Any  # jax.Array; jax.ShapeDtypeStruct in abstract_state.


# `init` draws about this many bytes per device per round, and the largest table's blocks
# have at least this many rows.
_INIT_BLOCK_BYTES = 4 << 20
_INIT_BLOCK_ROWS_MIN = 1024


def _default_rows(key, ids, dim: int):
    """The default initializer's rows `ids` ((n,) ints) of a table: (n, dim) float32 drawn
    from a truncated normal (mean 0, stddev 1/sqrt(dim), cut at 2 stddev, as TensorFlow's).

    Element (r, c) is a counter-based hash of (key, r, c) alone, so a row's value depends on
    neither the mesh, the strategy nor how rows are grouped into blocks. A hash rather than
    jax.random: threefry's 20 rounds per element made XLA take seconds to compile each
    table's initialisation, and a demo with 26 tables spent most of its start-up there.
    """
    words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    return _default_rows_of(words[0], words[-1], ids, dim)


def _default_rows_of(k0, k1, ids, dim: int):
    """`_default_rows` from the key's first and last words: scalars, or (n,) (row i drawn
    with key words k0[i], k1[i]), so that one computation draws rows of several tables."""
    row = _storage.mix32(_storage.mix32(ids.astype(jnp.uint32) ^ k0) + k1)
    col = jnp.arange(dim, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    bits = _storage.mix32(_storage.mix32(row[:, None] ^ col) + jnp.reshape(k0, (-1, 1)))
    u = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) + (0.5 / (1 << 24))  # (0, 1)
    lo = jax.lax.erf(jnp.float32(-2.0 / math.sqrt(2.0)))
    z = math.sqrt(2.0) * jax.lax.erf_inv(lo + u * (-2.0 * lo))  # Inverse CDF on [-2, 2].
    return jnp.clip(z, -2.0, 2.0) / math.sqrt(dim)


def _constant_rows(plan: _backend.TablePlan, slot: _optimizers.SlotSpec, valid):
    """Rows of a slot with a constant initial value: (n,) or (n, D) float32, zero where not
    `valid` ((n,) bool: padding rows)."""
    shape = valid.shape + ((plan.config.dim,) if slot.rank == 2 else ())
    value = jnp.where(valid, jnp.float32(float(slot.initializer)), 0.0)
    return jnp.broadcast_to(value.reshape(valid.shape + (1,) * (len(shape) - 1)), shape)


def _per_table(what: str, value, spec: _config.EmbeddingSpec) -> dict:
    """{table name: positive int} from an Embedding argument `what`: an int or a mapping."""
    tables = spec.tables()
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        value = {name: value for name in tables}
    unknown = sorted(set(value) - set(tables))
    if unknown:
        raise ValueError(
            f"Embedding: {what} names {unknown}, which are not tables; "
            f"the tables are {sorted(tables)}."
        )
    for name, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(
                f"Embedding: {what} for table {name!r} must be a positive int, got {v!r}."
            )
    return {name: int(v) for name, v in value.items()}


def _slot_key(table_key, storage: _storage.TableStorage, slot):
    """The key a slot's initial value is drawn from: the same whether it rides in the
    table's array or has its own."""
    return jax.random.fold_in(table_key, storage.slot_specs.index(slot) + 1)


def _is_explicit(mesh) -> bool:
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


class Embedding:
    """Row-sharded embedding tables over one axis of a mesh, with sparse optimizers.

    Args:
        spec: The EmbeddingSpec.
        mesh: A `jax.sharding.Mesh` (Auto or Explicit axes). Default: every device on one
            Auto axis named "shard".
        axis: The mesh axis the tables' rows and the batch are split over. Default: the
            mesh's only axis; required for a multi-axis mesh.
        backend: Who does each table's shard-local row work: "auto" (default), "xla",
            "pallas", "pallas_interpret" or "cpu", or {table name: one of these} (tables
            left out are "auto"). "auto" takes the fused Pallas kernels on TPU meshes and
            the C++ kernels on CPU meshes where a table can use them, else the portable
            XLA passes. "pallas_interpret" runs the TPU kernels in Pallas' interpreter on
            any mesh (slow; for tests). A backend a table cannot use is a ValueError that
            names the table and the reason. Results agree to float32 rounding whatever the
            backend; `backends` says what was chosen.
        lane_width: Physical row width that narrow rows are packed into (see `_storage`);
            0 stores every array as (rows, D). Default: 128 on TPU meshes or when a table
            runs the Pallas kernels, 0 elsewhere. It changes only the physical layout.
        max_ids_per_shard: How many (id, position) pairs of a table one shard handles per
            pass of the XLA passes: an int for every table or {table name: int}. A shard
            that owns more in a step runs more passes; no id is ever dropped. Default on
            TPU meshes: 1.5 x the per-shard average B*L/N of each table; elsewhere all B*L,
            one pass (see _streams.capacity). The Pallas kernels walk every owned pair and
            use it only to size their cost estimates; the C++ kernels ignore it.
        max_unique_ids_per_shard: How many distinct rows of a table one shard updates per
            pass (int or {table name: int}); a pass stops early at that many. Default:
            max_ids_per_shard. `id_counts` measures both on real batches.
        routing: How a table's ids reach the devices that own its rows: "gather" (every
            device all-gathers the global batch's ids and keeps the pairs it owns; per
            device work grows with the number of devices), "owner" (each device sends
            its own examples' distinct ids to their owners with all_to_all and gets rows
            back; per-device work stays proportional to the per-device batch), "auto"
            (default: "owner" on TPU meshes of 32 or more devices, else "gather"), or
            {table name: one of these}. "owner" does its row work with the Pallas kernels
            ("pallas", "pallas_interpret") or XLA ops ("xla"; the default off TPU).
            Results agree to float32 rounding; `routing` (the attribute) says what was
            chosen. With "owner", max_ids_per_shard bounds the ids one shard receives per
            round; more rounds run when a skewed batch needs them (`id_counts`).
        stacking: True (default): tables routed to their owners (`routing`) that agree
            on dim, float32 dtype, optimizer (the same object) and backend share one array
            per stored array, each shard holding its members' rows one block after
            another, so that one sort, one exchange per round and one kernel serve them all
            where the kernels' memory allows. Tables on the all-gather path, with
            stochastic rounding or with an optimizer that updates every row stay alone.
            Invisible but in `EmbeddingState`'s keys (`stacks`): export, checkpoints,
            serving and `shard_rows` speak per-table logical rows. False: one array per
            table.
        cpu_kernels: Deprecated: backend="auto" uses the C++ kernels on CPU meshes;
            False means backend="xla" for them.
        tpu_kernels: Deprecated: True is backend="pallas", False leaves the Pallas kernels
            out of "auto", "interpret" prefers "pallas_interpret" where a table can use it.
    """

    def __init__(
        self,
        spec: _config.EmbeddingSpec,
        mesh: jax.sharding.Mesh | None = None,
        axis: str | None = None,
        *,
        backend: str | Mapping[str, str] = "auto",
        lane_width: int | None = None,
        max_ids_per_shard: int | Mapping[str, int] | None = None,
        max_unique_ids_per_shard: int | Mapping[str, int] | None = None,
        routing: str | Mapping[str, str] = "auto",
        stacking: bool = True,
        cpu_kernels: bool | None = None,
        tpu_kernels: bool | str | None = None,
    ):
        if not isinstance(spec, _config.EmbeddingSpec):
            raise TypeError(
                f"Embedding: spec must be a jte.EmbeddingSpec, got {type(spec).__name__}."
            )
        _guards.check_bool(stacking, "Embedding", "stacking")
        _guards.check_bool(cpu_kernels, "Embedding", "cpu_kernels", allow_none=True)
        if mesh is None:
            # Auto axes: with Explicit ones (jax.make_mesh's default) every array the user
            # gets back carries its sharding in its type, and plain eager code such as
            # `acts["f"][0]` or `jax.grad` of a model outside `jit` fails to type-check.
            mesh = jax.make_mesh(
                (jax.device_count(),), ("shard",), axis_types=(jax.sharding.AxisType.Auto,)
            )
        if axis is None:
            if len(mesh.axis_names) != 1:
                raise ValueError(
                    f"Embedding: the mesh has axes {mesh.axis_names}; pass axis= "
                    f"to say which one the tables and the batch are split over."
                )
            axis = mesh.axis_names[0]
        if axis not in mesh.axis_names:
            raise ValueError(
                f"Embedding: axis {axis!r} is not an axis of the mesh {mesh.axis_names}."
            )
        self.spec, self.mesh = spec, mesh
        self.axis = str(axis)
        self.num_shards = int(mesh.shape[axis])
        platform = mesh.devices.flat[0].platform
        auto_order = _backend.legacy_auto_order(platform, cpu_kernels, tpu_kernels, backend)
        if lane_width is None:
            wanted = set(backend.values()) if isinstance(backend, Mapping) else {backend}
            pallas = platform == "tpu" or bool(wanted & {"pallas", "pallas_interpret"})
            lane_width = 128 if pallas else 0
        if lane_width not in (0, 128):
            raise ValueError(f"Embedding: lane_width must be 0 or 128, got {lane_width!r}.")
        self.lane_width = lane_width
        max_ids = _per_table("max_ids_per_shard", max_ids_per_shard, spec)
        max_unique = _per_table("max_unique_ids_per_shard", max_unique_ids_per_shard, spec)
        storages = {}
        for name, table in spec.tables().items():
            opt = spec.optimizer_of(table)
            storages[name] = _storage.TableStorage(
                layout=_layout.TableLayout(
                    table.vocabulary_size, self.num_shards, spec.partition_strategy
                ),
                dim=table.dim,
                dtype=jnp.dtype(table.dtype),
                slot_specs=tuple(opt.slot_specs()),
                lanes=lane_width,
                dense_update=opt.dense_update,
            )
            if storages[name].layout.rows_per_shard >= _streams.NOT_MINE:
                raise ValueError(
                    f"Embedding: table {name!r} would hold "
                    f"{storages[name].layout.rows_per_shard} rows per shard; "
                    f"at most 2**30 are supported: use more shards."
                )
        tables = spec.tables()
        asked = {
            name: (backend.get(name, "auto") if isinstance(backend, Mapping) else backend)
            for name in tables
        }
        if isinstance(backend, Mapping):  # Names that are not tables: choose() says so.
            asked.update({k: v for k, v in backend.items() if k not in tables})
        routings = _routing.choose(
            tables,
            dict(routing) if isinstance(routing, Mapping) else routing,
            {name: str(b) for name, b in asked.items()},
            {name: st.layout for name, st in storages.items()},
            platform,
            self.num_shards,
        )
        # Owner-routed tables do their row work with the Pallas kernels or XLA ops.
        asked = {
            n: "xla" if routings.get(n) == "owner" and b == "auto" and platform != "tpu" else b
            for n, b in asked.items()
        }
        backends = _backend.choose(spec, asked, storages, platform, auto_order=auto_order)
        vmem = _pallas.vmem_bytes(mesh.devices.flat[0].device_kind)
        self.table_plans: dict[str, _backend.TablePlan] = {
            name: _backend.TablePlan(
                name=name,
                config=table,
                optimizer=spec.optimizer_of(table),
                storage=storages[name],
                backend=backends[name],
                max_ids=max_ids.get(name),
                max_unique=max_unique.get(name),
                on_tpu=platform == "tpu",
                vmem=vmem,
                routing=routings[name],
            )
            for name, table in spec.tables().items()
        }
        self._stack_plans = self._make_stacks(bool(stacking))
        self._stack_of = {t: name for name, tables in self.stacks.items() for t in tables}
        names = _config.table_names(spec)
        self.feature_plans = [
            _backend.FeaturePlan(p, f, names[id(f.table)]) for p, f in spec.flat_features
        ]
        self._replicated = NamedSharding(mesh, P())
        self._init_fns = None
        self._init_blocked = None
        self._stack_fns: dict = {}
        self._lookup_jit = jax.jit(self._lookup)
        # The state is donated: the update writes the touched rows in place instead of
        # copying every table and slot on each call (which made an eager call O(V)).
        self._apply_jit = jax.jit(self._apply, donate_argnums=0)
        self._skipped: dict[str, jax.Array] | None = None
        self._add_counts = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))

    def _make_stacks(self, stacking: bool) -> dict[str, _backend.TablePlan]:
        """{stack name: its plan}, in the order of each stack's first table: a table stored
        alone is a stack of its own, under its name; several tables sharing arrays are one
        under their names joined by "+"."""
        groups: dict[tuple, list[str]] = {}
        for name, plan in self.table_plans.items():
            alone = (
                not stacking
                or plan.routing != "owner"
                or jnp.dtype(plan.config.dtype) != jnp.float32
                or plan.config.stochastic_rounding
                or plan.optimizer.dense_update
            )
            key = (
                (name,)
                if alone
                else (
                    plan.config.dim,
                    id(plan.optimizer),
                    plan.backend.name,
                    plan.max_ids is None,
                    plan.max_unique is None,
                )
            )
            groups.setdefault(key, []).append(name)
        chunks: list[list[str]] = []
        for names in groups.values():
            # Greedily, in spec order, while the stack's local rows fit the sort keys (with
            # up to 128 rows of padding per member for the alignment of its block).
            chunks.append([])
            for name in names:
                rows = sum(self.table_plans[n].layout.rows_per_shard + 128 for n in chunks[-1])
                rows += self.table_plans[name].layout.rows_per_shard + 128
                if chunks[-1] and not self._stackable(rows):
                    chunks.append([])
                chunks[-1].append(name)
        order = list(self.table_plans)
        chunks.sort(key=lambda chunk: order.index(chunk[0]))
        stacks = [self._stack(chunk) for chunk in chunks]
        keys = [name for name, _ in stacks]
        clash = sorted({k for k in keys if keys.count(k) > 1})
        if clash:  # A table named like a stack ("a+b"): their state would share a key.
            raise ValueError(
                f"Embedding: the state keys {clash} name both a table and a stack of "
                f"tables; rename the table or pass stacking=False."
            )
        return dict(stacks)

    def _stackable(self, rows: int) -> bool:
        return rows < _streams.NOT_MINE and self.num_shards * rows < _routing.NONE

    def _capacities(self, names) -> dict:
        """max_ids and max_unique of tables `names` together: their sums (None: default)."""
        out = {}
        for field in ("max_ids", "max_unique"):
            values = [getattr(self.table_plans[n], field) for n in names]
            out[field] = None if values[0] is None else sum(values)
        return out

    def _stack(self, names: list[str]) -> tuple[str, _backend.TablePlan]:
        if len(names) == 1:
            return names[0], self.table_plans[names[0]]
        plans = [self.table_plans[n] for n in names]
        storage, members = _storage.stack([(n, p.storage) for n, p in zip(names, plans)])
        name = "+".join(names)
        return name, dataclasses.replace(
            plans[0], name=name, storage=storage, members=members, **self._capacities(names)
        )

    @property
    def stacks(self) -> dict[str, tuple[str, ...]]:
        """{state key: the tables stored in its arrays}: `EmbeddingState.tables` and
        `.slots` are keyed by these; a table stored alone is its own key."""
        return {
            name: tuple(m.name for m in plan.members) or (name,)
            for name, plan in self._stack_plans.items()
        }

    @property
    def backends(self) -> dict[str, str]:
        """{table name: the backend doing its row work}, fixed at construction."""
        return {name: plan.backend.name for name, plan in self.table_plans.items()}

    @property
    def routing(self) -> dict[str, str]:
        """{table name: "gather" | "owner"}, how its ids reach its rows' owners."""
        return {name: plan.routing for name, plan in self.table_plans.items()}

    def storage(self, table_name: str) -> _storage.TableStorage:
        """How a table and its slots are stored on the devices (see `_storage`)."""
        return self.table_plans[table_name].storage

    # ------------------------------------------------------------------ state

    def _rows(self, rank: int) -> NamedSharding:
        """Row sharding of a rank-`rank` array, spelled as jit's outputs spell it."""
        return NamedSharding(self.mesh, P(self.axis, *([None] * (rank - 1))))

    def abstract_state(self) -> EmbeddingState:
        """The state as jax.ShapeDtypeStruct leaves with shardings; allocates nothing."""
        tables, slots = {}, {}
        for name, plan in self._stack_plans.items():
            tables[name], slots[name] = self._abstract(plan.storage, plan.config.dtype)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
        return EmbeddingState(tables, slots, step)

    def _abstract(self, storage: _storage.TableStorage, dtype) -> tuple:
        table_shape, slot_shapes = storage.shapes()
        return jax.ShapeDtypeStruct(table_shape, dtype, sharding=self._rows(len(table_shape))), {
            n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=self._rows(len(shape)))
            for n, shape in slot_shapes.items()
        }

    def _shardings(self, plan: _backend.TablePlan) -> tuple:
        return jax.tree.map(lambda a: a.sharding, self._abstract(plan.storage, plan.config.dtype))

    def init(self, key: jax.Array) -> EmbeddingState:
        """Initial tables and slots: the same logical values for every mesh and strategy.

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
        keys = self._table_keys(key)
        tables, slots = {}, {}
        names = self._blocked_tables()
        if names:
            program, per_table = self._init_blocked_fn()
            for name, (table, table_slots) in program(
                {n: keys[n] for n in names}, per_table
            ).items():
                tables[name], slots[name] = table, table_slots
        programs = self.init_programs()
        own = {}
        for name in self._stack_plans:
            if name not in tables:
                own.update({t: programs[t](keys[t]) for t in self.stacks[name]})
        if own:
            joined = self._join(
                {t: x[0] for t, x in own.items()}, {t: x[1] for t, x in own.items()}
            )
            tables.update(joined[0])
            slots.update(joined[1])
        tables = {name: tables[name] for name in self._stack_plans}
        slots = {name: slots[name] for name in self._stack_plans}
        step = jnp.zeros((), jnp.int32)
        if not isinstance(key, jax.core.Tracer):
            step = jax.device_put(step, self._replicated)
        return EmbeddingState(tables, slots, step)

    def init_programs(self) -> dict:
        """{table name: a jitted fn(table key) -> (table, slots) giving what `init` gives for
        it, as the table would be stored alone}; for compiling ahead of time (the planner
        checks initialisation fits HBM too)."""
        if self._init_fns is None:
            self._init_fns = {
                name: jax.jit(
                    functools.partial(
                        self._init_table_blocked if self._blocked(name) else self._init_table,
                        plan,
                    ),
                    out_shardings=self._shardings(plan),
                )
                for name, plan in self.table_plans.items()
            }
        return self._init_fns

    def _blocked(self, name: str) -> bool:
        """Whether `init` draws a table in row blocks: default initializer, constant slots."""
        plan = self.table_plans[name]
        return plan.config.initializer is None and not any(
            callable(s.initializer) for s in plan.storage.slot_specs
        )

    def _blocked_tables(self) -> tuple:
        """The tables of the stacks whose every member `_blocked` (drawn by one program)."""
        return tuple(
            t
            for name in self._stack_plans
            if all(self._blocked(t) for t in self.stacks[name])
            for t in self.stacks[name]
        )

    def _init_blocked_fn(self) -> tuple:
        """(jitted fn({name: table key}, per_table) -> {stack: (table, slots)}, per_table):
        every blocked stack in one program (`per_table`: see `_per_table_rows`)."""
        if self._init_blocked is None:
            names = self._blocked_tables()
            targets = tuple(dict.fromkeys(self._stack_of[n] for n in names))
            program = jax.jit(
                functools.partial(self._draw_tables, names, targets),
                out_shardings={t: self._shardings(self._stack_plans[t]) for t in targets},
            )
            self._init_blocked = (program, self._per_table_rows(names))
        return self._init_blocked

    def _table_keys(self, key) -> dict:
        return {name: jax.random.fold_in(key, i) for i, name in enumerate(self.table_plans)}

    def _compile_init(self, key: jax.ShapeDtypeStruct) -> None:
        """Compiles `init`'s program of the blocked tables for keys like `key` before `init`
        is called (jax keeps it for the call), so that a caller can do it while it does
        something else. Thread-safe."""
        names = self._blocked_tables()
        if names:
            keys = jax.eval_shape(self._table_keys, key)
            program, per_table = self._init_blocked_fn()
            program.lower({n: keys[n] for n in names}, per_table).compile()

    def _init_table_blocked(self, plan: _backend.TablePlan, table_key):
        """A table and its slots drawn block by block on their own shards (see `init`)."""
        names = (plan.name,)
        return self._draw_tables(names, None, {plan.name: table_key}, self._per_table_rows(names))[
            plan.name
        ]

    def _init_blocks(self, names: tuple) -> tuple:
        """How `_init_local` splits the table arrays of `names` into rounds: (rounds,
        {D: the tables of row width D}, and per table (T,) arrays: logical local rows
        (padding included), rows per physical row, rows per round, and the first row of
        its block in its width's draw)."""
        plans = [self.table_plans[n] for n in names]
        granule = np.array([p.storage.block_granule(None) for p in plans])
        logical = granule * [p.storage.shapes()[0][0] // self.num_shards for p in plans]
        total = sum(int(n) * p.config.dim * 4 for n, p in zip(logical, plans))
        rounds = max(
            1, min(-(-total // _INIT_BLOCK_BYTES), -(-logical.max() // _INIT_BLOCK_ROWS_MIN))
        )
        per_round = -(-logical // rounds)
        block = np.minimum(logical, -(-per_round // granule) * granule)
        groups: dict[int, list[int]] = {}
        for j, p in enumerate(plans):
            groups.setdefault(p.config.dim, []).append(j)
        offset = np.zeros(len(plans), np.int64)
        for members in groups.values():
            offset[members] = np.cumsum(block[members]) - block[members]
        return rounds, groups, logical, granule, block, offset

    def _per_table_rows(self, names: tuple) -> tuple:
        """Per table of `names`: int32 (1 + N,), [the first row of its block in its draw,
        the rows each of the N shards holds]. Runtime inputs of `_init_local` rather than
        constants, so that tables of one shape have the same code (XLA compiles it once)."""
        offset = self._init_blocks(names)[-1]
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
            plan = self._stack_plans[stack]
            offsets = {m.name: m.offset for m in plan.members} or {stack: 0}
            out.append((stack, plan, [(names.index(t), o) for t, o in offsets.items()]))
        return out

    def _draw_tables(self, names: tuple, stacks: tuple | None, keys: dict, per_table: tuple):
        """{name: (table, slots)} of the blocked tables `names`, in the arrays of `stacks`
        (None: each table alone) (see `_init_local`)."""
        words = jnp.stack([jax.random.key_data(keys[n]).reshape(-1) for n in names])
        words = words.astype(jnp.uint32)
        row = P(self.axis)
        targets = self._targets(names, stacks)
        out_specs = {
            name: (row, {s.name: row for s in plan.storage.stored}) for name, plan, _ in targets
        }
        local = self._shard_map(
            functools.partial(self._init_local, names, targets), (P(), P()), out_specs
        )(jnp.stack([words[:, 0], words[:, -1]]), per_table)
        return {
            n: (self._constrain(t), {k: self._constrain(x) for k, x in slots.items()})
            for n, (t, slots) in local.items()
        }

    def _init_local(self, names: tuple, targets: list, words, per_table: tuple):
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
        rounds, groups, logical, granule, block, offset = self._init_blocks(names)
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
            out = {}
            for dim, members in groups.items():
                owner = np.repeat(np.array(members), block[members]).astype(np.int32)
                ids = start[owner] + stride[owner] * np.arange(len(owner), dtype=np.int32)
                out[dim] = _default_rows_of(words[0][owner], words[1][owner], ids, dim)
            return out

        def write(arrays, drawn, r):
            arrays = list(arrays)
            for j, plan in enumerate(plans):
                storage = plan.storage
                start = first(r, j)
                local = start + jnp.arange(int(block[j]))
                valid = local < per_table[j][1 + shard]
                rows = jax.lax.dynamic_slice_in_dim(
                    drawn[plan.config.dim], per_table[j][0], int(block[j])
                )
                rows = jnp.where(valid[:, None], rows, 0.0).astype(plan.config.dtype)
                riders = {s.name: _constant_rows(plan, s, valid) for s in storage.riders}
                physical = storage.block_to_physical(None, storage.join_row(rows, riders))
                t, o = into[j]
                at = ((o + start) // int(granule[j]),) + (0,) * (arrays[t].ndim - 1)
                arrays[t] = jax.lax.dynamic_update_slice(
                    arrays[t], physical.astype(arrays[t].dtype), at
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
            for _, p, _ in targets
        ]
        drawn = {d: jnp.zeros((int(block[m].sum()), d), jnp.float32) for d, m in groups.items()}
        # One pass more than rounds: the first writes nothing, the last draws nothing new.
        arrays, _ = jax.lax.fori_loop(0, rounds + 1, body, (arrays, drawn))
        out = {}
        for (name, plan, members), table in zip(targets, arrays):
            slots = {}
            for s in plan.storage.stored:
                # Constants, computed where they are stored: no temporary, no blocks.
                rows = plan.storage.shapes()[1][s.name][0] // self.num_shards
                local = jnp.arange(rows * plan.storage.block_granule(s))
                valid = functools.reduce(
                    jnp.logical_or,
                    [(local >= o) & (local < o + per_table[j][1 + shard]) for j, o in members],
                )
                rows = _constant_rows(plan, s, valid)
                slots[s.name] = plan.storage.block_to_physical(s, rows).astype(jnp.float32)
            out[name] = (table, slots)
        return out

    def _init_table(self, plan: _backend.TablePlan, table_key):
        storage = plan.storage
        table = self._initial(plan, None, table_key)
        slots = {
            s.name: self._initial(plan, s, _slot_key(table_key, storage, s))
            for s in storage.slot_specs
        }
        table, slots = storage.to_physical(table, slots)
        return self._constrain(table), {n: self._constrain(x) for n, x in slots.items()}

    def _initial(self, plan: _backend.TablePlan, slot: _optimizers.SlotSpec | None, key):
        """The logical initial value of a table (slot None) or one slot."""
        shape = plan.storage.logical_shape(slot)
        if slot is None:
            if plan.config.initializer is None:
                rows = jnp.arange(shape[0])
                return _default_rows(key, rows, plan.config.dim).astype(plan.config.dtype)
            value = plan.config.initializer(key, shape, jnp.float32)
            if tuple(jnp.shape(value)) != tuple(shape):
                # Shapes are static: a wrong one would be padded or cut into the layout.
                raise ValueError(
                    f"Table {plan.name!r}: its initializer returned shape "
                    f"{tuple(jnp.shape(value))}; expected (vocabulary_size, dim) = "
                    f"{tuple(shape)}, the shape it was called with."
                )
            return jnp.asarray(value).astype(plan.config.dtype)
        return _optimizers.slot_initial_value(slot, key, shape, table=plan.name)

    def _constrain(self, physical):
        # Said explicitly so that an init traced inside another jit keeps the row sharding.
        sharding = self._rows(physical.ndim)
        if _is_explicit(self.mesh):
            return jax.sharding.reshard(physical, sharding)
        return jax.lax.with_sharding_constraint(physical, sharding)

    def _init_slot(self, plan: _backend.TablePlan, slot: _optimizers.SlotSpec, key):
        """One stored slot's physical initial value, drawn on the devices."""
        storage = plan.storage
        sharding = self._rows(len(storage.shapes()[1][slot.name]))
        fn = lambda k: self._constrain(
            storage.array_to_physical(slot, self._initial(plan, slot, k))
        )
        return jax.jit(fn, out_shardings=sharding)(key)

    def restore_tables(
        self, tables: dict, slots: dict | None = None, step: int = 0, key: jax.Array | None = None
    ) -> EmbeddingState:
        """State from logical tables {name: (V, D)} and slots {name: {slot: (V, D) or (V,)}}.

        Slots missing from `slots` start at their initial values (random ones drawn from
        `key`, as `init(key)` would).
        """
        slots = slots or {}
        problems = [f"table {n!r} is missing" for n in self.table_plans if n not in tables]
        problems += [
            f"table {n!r} is not in the spec (its tables are {list(self.table_plans)})"
            for n in tables
            if n not in self.table_plans
        ]
        if problems:
            raise ValueError("restore_tables: " + "; ".join(problems) + ".")
        new_tables, new_slots = {}, {}
        for i, (name, plan) in enumerate(self.table_plans.items()):
            storage = plan.storage
            value = np.asarray(tables[name])
            if value.shape != storage.logical_shape():
                raise ValueError(
                    f"restore_tables: table {name!r} has shape {value.shape}; the "
                    f"spec says (vocabulary_size, dim) = "
                    f"{storage.logical_shape()}."
                )
            table = value.astype(plan.config.dtype)
            given = dict(slots.get(name, {}))
            unknown = sorted(set(given) - {s.name for s in storage.slot_specs})
            if unknown:
                raise ValueError(
                    f"restore_tables: table {name!r} has no slots {unknown}; its "
                    f"optimizer's slots are "
                    f"{[s.name for s in storage.slot_specs]}."
                )
            logical, drawn = {}, {}
            for s in storage.slot_specs:
                shape = storage.logical_shape(s)
                if s.name in given:
                    logical[s.name] = np.asarray(given[s.name], np.float32)
                    if logical[s.name].shape != shape:
                        raise ValueError(
                            f"restore_tables: slot {s.name!r} of table {name!r} "
                            f"has shape {logical[s.name].shape}, expected "
                            f"{shape}."
                        )
                    continue
                if callable(s.initializer) and key is None:
                    raise ValueError(
                        f"restore_tables: slot {s.name!r} of table {name!r} "
                        f"has a random initializer; pass key=."
                    )
                k = None if key is None else _slot_key(jax.random.fold_in(key, i), storage, s)
                if s in storage.riders:
                    logical[s.name] = np.asarray(self._initial(plan, s, k))
                else:  # Drawn on the devices, as `init` does.
                    drawn[s.name] = self._init_slot(plan, s, k)
            _guards.check_restored(
                _guards.restored_items(name, plan.optimizer, value, given, storage.slot_specs),
                "restore_tables",
            )
            table, stored = storage.to_physical(table, logical)
            new_tables[name] = self._put(table)
            new_slots[name] = {
                s.name: drawn[s.name] if s.name in drawn else self._put(stored[s.name])
                for s in storage.stored
            }
        step_array = jax.device_put(jnp.asarray(step, jnp.int32), self._replicated)
        return EmbeddingState(*self._join(new_tables, new_slots), step_array)

    # --------------------------------------------------- stacks <-> per-table arrays

    def _join(self, tables: dict, slots: dict) -> tuple[dict, dict]:
        """The state's (tables, slots), keyed by stack, from each table's physical arrays
        as it would be stored alone ({table: array}, {table: {slot: array}}); a table
        stored alone passes through, a stack is one concatenation per shard and array."""
        out_tables, out_slots = {}, {}
        for name, plan in self._stack_plans.items():
            if not plan.members:
                if name in tables:
                    out_tables[name], out_slots[name] = tables[name], slots[name]
                continue
            members = [m.name for m in plan.members]
            if not all(m in tables for m in members):
                continue
            out_tables[name], out_slots[name] = self._stack_fn(name, "join")(
                {m: tables[m] for m in members}, {m: slots[m] for m in members}
            )
        return out_tables, out_slots

    def _split(self, state: EmbeddingState) -> tuple[dict, dict]:
        """The inverse of `_join`: each table's physical arrays as stored alone (a copy of
        its rows for a stacked table)."""
        tables, slots = {}, {}
        for name, plan in self._stack_plans.items():
            if not plan.members:
                tables[name], slots[name] = state.tables[name], state.slots[name]
                continue
            t, s = self._stack_fn(name, "split")(state.tables[name], state.slots[name])
            tables.update(t)
            slots.update(s)
        return tables, slots

    def _stack_fn(self, stack: str, what: str):
        """The jitted per-shard join or split of a stack's arrays (cached)."""
        key = (stack, what)
        if key not in self._stack_fns:
            plan = self._stack_plans[stack]
            storage, members = plan.storage, plan.members
            row = P(self.axis)

            def join(tables, slots):
                parts = [tables[m.name] for m in members]
                return _storage.join_local(storage, members, None, parts), {
                    s.name: _storage.join_local(
                        storage, members, s, [slots[m.name][s.name] for m in members]
                    )
                    for s in storage.stored
                }

            def split(table, slots):
                return {m.name: table[m.rows(storage.packing)] for m in members}, {
                    m.name: {
                        s.name: slots[s.name][m.rows(storage.slot_packing(s))]
                        for s in storage.stored
                    }
                    for m in members
                }

            fn = join if what == "join" else split
            self._stack_fns[key] = jax.jit(self._shard_map(fn, (row, row), (row, row)))
        return self._stack_fns[key]

    def _put(self, physical: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(
            physical.shape, self._rows(physical.ndim), lambda index: physical[index]
        )

    def _fetch(self, x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def export(self, state: EmbeddingState) -> dict[str, np.ndarray]:
        """{table name: (V, D) np.ndarray} in natural row order, whatever strategy or mesh.

        With several processes this gathers the tables onto every process (a collective):
        call it on every process, then write from one.
        """
        _guards.check_not_consumed(state, "Embedding.export")
        tables = self._split(state)[0]
        return {
            name: plan.storage.to_logical(self._fetch(tables[name]))[0]
            for name, plan in self.table_plans.items()
        }

    def export_slots(self, state: EmbeddingState) -> dict[str, dict[str, np.ndarray]]:
        """{table name: {slot name: (V, D) or (V,)}}; {} for a table without slots.

        A collective with several processes, like `export`.
        """
        _guards.check_not_consumed(state, "Embedding.export_slots")
        out = {}
        tables, slots = self._split(state)
        for name, plan in self.table_plans.items():
            storage = plan.storage
            # The table's own array only when slots ride in it.
            table = self._fetch(tables[name]) if storage.riders else None
            out[name] = storage.to_logical(
                table, {n: self._fetch(x) for n, x in slots[name].items()}
            )[1]
        return out

    def shard_rows(self, state: EmbeddingState, table_name: str, shard: int) -> np.ndarray:
        """The rows shard `shard` holds, in its local order, padding excluded.

        With several processes this is a collective, like `export`: call it on every process.
        """
        _guards.check_not_consumed(state, "Embedding.shard_rows")
        if table_name not in self.table_plans:
            raise ValueError(
                f"shard_rows: no table {table_name!r}; tables are {list(self.table_plans)}."
            )
        storage = self.table_plans[table_name].storage
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard_rows: shard must be in [0, {self.num_shards}), got {shard}.")
        stack = self._stack_plans[self._stack_of[table_name]]
        array = state.tables[stack.name]
        per_shard = array.shape[0] // self.num_shards
        start = shard * per_shard
        if array.is_fully_addressable:
            local = next(
                np.asarray(piece.data)
                for piece in array.addressable_shards
                if (piece.index[0].start or 0) == start
            )
        else:
            # Several processes: all gather, whichever holds the shard; one that read its
            # own copy instead would leave the others waiting in the all-gather.
            local = self._fetch(array)[start : start + per_shard]
        for member in stack.members:
            if member.name == table_name:
                local = local[member.rows(stack.storage.packing)]
        return storage.shard_table_rows(local, shard)

    # ---------------------------------------------------------------- compute

    def validate(self, features: Nested) -> None:
        """Checks concrete inputs on the host; ValueError naming feature, id and position."""
        _inputs.validate(self.spec, features, self.num_shards)

    def invalid_id_counts(self, features: Nested) -> dict[str, jax.Array]:
        """{feature path: int32 number of ids neither -1 nor in [0, V)}; jittable."""
        return _inputs.invalid_counts(self.spec, features)

    def id_counts(self, features: Nested) -> dict[str, dict[str, int]]:
        """How a global batch loads the shards, per table: for choosing `max_ids_per_shard`
        and `max_unique_ids_per_shard` from real data (run it on a few batches and take the
        largest values with some headroom).

        Returns {table name: {"pairs": M, the (id, position) pairs of the table's features;
        "owned_pairs": the most pairs with a valid id any one shard owns; "unique_rows": the
        most distinct rows any one shard owns; "passes": the most update passes any shard
        runs with this Embedding's settings, over the table's whole stack (`stacks`), or the
        part of it that one call serves (1 unless they are below the other two; always 1 on
        the Pallas and C++ kernels, which walk every pair in one call; with routing="owner",
        the exchange rounds: more than 1 when a device holds more distinct ids for one owner
        than a round carries, max_ids_per_shard / N)}}. Host-side: features are NumPy arrays
        or fully addressable jax.Arrays.
        """
        flat = _inputs.flatten_inputs(self.spec, features)
        _inputs.check_batch(flat, self.num_shards)
        return _streams.id_counts(
            self.table_plans, self._call_plans, self.feature_plans, flat, self.num_shards
        )

    def _prepare(self, features, act_grads=None) -> dict:
        flat = _inputs.flatten_inputs(self.spec, features)
        # With several processes a NumPy input is the global batch: processes passing their
        # own rows instead would train on wrong data without an error. Checked first, so
        # that validation below fails on every process or on none.
        _multihost.check_same_on_every_process((flat, act_grads))
        if all(not isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(flat)):
            if any(not isinstance(x, jax.Array) for x in jax.tree.leaves(flat)):
                self.validate(features)
        _inputs.check_batch(flat, self.num_shards)
        return flat

    def lookup(self, state: EmbeddingState, features: Nested) -> Nested:
        """Embeds every feature.

        Args:
            state: From `init` or `apply_gradients`.
            features: Mirrors the spec. Each leaf is int (B,), int (B, L) padded with -1, or
                `Weighted(ids, weights)`; B a multiple of the mesh size.

        Returns:
            Same structure: float32 (B, D) per feature, (B, L, D) for sequence features
            (or output_shape + (D,)). Examples with no ids give zeros.
        """
        _guards.check_not_consumed(state, "Embedding.lookup")
        flat = self._prepare(features)
        return _config.unflatten(self._lookup_jit(state.tables, flat))

    def apply_gradients(
        self,
        state: EmbeddingState,
        features: Nested,
        act_grads: Nested,
        *,
        return_skipped: bool = False,
    ) -> Any:
        """One sparse optimizer step from d(loss)/d(activations) of the global batch.

        Each row in the batch gets exactly one update from the sum of its gradients (across
        examples and across features sharing its table); other rows and slots are untouched.

        A table is skipped (none of its rows or slots change) when a value of this step
        is not finite: an activation gradient or a weight of one of its features, its
        learning rate, a hyperparameter or the gradient multiplier; or when a learning-rate
        function gives a negative value (0 for FTRL, which divides by it). `state.step`
        advances unless every table was skipped. Skips are counted: in `skipped_updates`
        for calls outside jit, and in the second return value with `return_skipped=True`.

        The state given is consumed (its buffers are donated and updated in place, as in a
        jitted training loop): use the returned state from then on. Copy it first
        (`jax.tree.map(jnp.copy, state)`) to keep the old one. Inside `jit`, donation is
        the outer function's business.

        Args:
            state: From `init` or `apply_gradients`.
            features: As for `lookup`.
            act_grads: Mirrors the features: real (float or int) arrays shaped like the
                activations.
            return_skipped: Also return {table name: int32 1 if skipped, else 0} (jittable).

        Returns:
            The new state, or (new state, skipped) with `return_skipped`.
        """
        _guards.check_not_consumed(state, "Embedding.apply_gradients")
        flat = self._prepare(features, act_grads)
        grads = dict(_config.flatten_features(act_grads)) if isinstance(act_grads, dict) else None
        if grads is None or set(grads) != set(flat):
            raise ValueError(
                f"act_grads must mirror the features {sorted(flat)}, got "
                f"{sorted(grads) if grads is not None else type(act_grads)}."
            )
        for path, g in grads.items():
            dtype = g.dtype if hasattr(g, "dtype") else np.asarray(g).dtype
            if isinstance(g, _inputs.Weighted) or not (
                jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
            ):
                what = "a Weighted" if isinstance(g, _inputs.Weighted) else f"dtype {dtype}"
                raise ValueError(
                    f"act_grads[{path!r}] has {what}; gradients must be real numbers "
                    f"(a float dtype such as float32, or an int dtype)."
                )
        new, skipped = self._apply_jit(state, flat, grads)
        if not any(isinstance(x, jax.core.Tracer) for x in skipped.values()):
            if self._skipped is None:
                self._skipped = skipped
            else:
                self._skipped = self._add_counts(self._skipped, skipped)
        return (new, skipped) if return_skipped else new

    @property
    def skipped_updates(self) -> dict[str, int]:
        """{table name: how many calls of `apply_gradients` outside jit skipped it} (see
        `apply_gradients`); inside jit, use its `return_skipped=True`."""
        if self._skipped is None:
            return dict.fromkeys(self.table_plans, 0)
        return {n: int(np.asarray(x.addressable_data(0))) for n, x in self._skipped.items()}

    # Both below are traced once per input structure; they hold no Python state.

    def _normalized(self, flat):
        feats = {}
        for f in self.feature_plans:
            leaf = flat[f.path]
            ids, weights = _inputs.normalize(f.config, leaf)
            if not isinstance(leaf, _inputs.Weighted):
                weights = None  # Derived from the ids on each device: nothing to send.
            feats[f.path] = (
                self._batch_sharded(ids),
                None if weights is None else self._batch_sharded(weights),
            )
        return feats

    def _batch_sharded(self, x):
        sharding = NamedSharding(self.mesh, P(self.axis))
        if _is_explicit(self.mesh):
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    def _out_shape(self, f: _backend.FeaturePlan, batch: int) -> tuple:
        d = f.table_config.dim
        natural = (batch, f.config.max_sequence_length, d) if f.config.is_sequence else (batch, d)
        if f.config.output_shape is None:
            return natural
        if math.prod(f.config.output_shape) != math.prod(natural[:-1]):
            raise ValueError(
                f"Feature {f.path!r}: output_shape {f.config.output_shape} has "
                f"{math.prod(f.config.output_shape)} outputs, but the batch gives "
                f"{math.prod(natural[:-1])} (shape {natural[:-1]})."
            )
        return tuple(f.config.output_shape) + (d,)

    def _reshape(self, x, shape):
        """Reshape that tells Explicit meshes where the result lives: split over the batch
        axis when the leading dimension divides evenly, else replicated."""
        if tuple(x.shape) == tuple(shape) or not _is_explicit(self.mesh):
            return x.reshape(shape)
        spec = P(self.axis) if shape[0] % self.num_shards == 0 else P()
        return jax.lax.reshape(x, shape, out_sharding=NamedSharding(self.mesh, spec))

    def _shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def _lookup(self, tables, flat):
        feats = self._normalized(flat)
        batch = next(iter(feats.values()))[0].shape[0]
        row = P(self.axis)
        acts = self._shard_map(self._lookup_local, (row, row), row)(tables, feats)
        return {
            f.path: self._reshape(acts[f.path], self._out_shape(f, batch))
            for f in self.feature_plans
        }

    def _apply(self, state, flat, grads):
        feats = self._normalized(flat)
        batch = next(iter(feats.values()))[0].shape[0]
        local_grads = {}
        for f in self.feature_plans:
            want = self._out_shape(f, batch)
            g = jnp.asarray(grads[f.path])
            if g.shape != want:
                raise ValueError(
                    f"act_grads[{f.path!r}] has shape {g.shape}; the activation is {want}."
                )
            natural = (
                (batch, f.config.max_sequence_length, f.table_config.dim)
                if f.config.is_sequence
                else (batch, f.table_config.dim)
            )
            local_grads[f.path] = self._batch_sharded(self._reshape(g, natural))
        # Decided on the global arrays, so that every device skips the same tables; the row
        # functions then keep a skipped table's rows (see _backend.row_step).
        ok = self._steps_ok(feats, local_grads, state.step)
        row, rep = P(self.axis), P()
        tables, slots = self._shard_map(
            self._update_local, (row, row, row, row, rep, rep), (row, row)
        )(state.tables, state.slots, feats, local_grads, state.step, ok)
        any_ok = functools.reduce(jnp.logical_or, ok.values())
        skipped = {name: (~keep).astype(jnp.int32) for name, keep in ok.items()}
        return EmbeddingState(tables, slots, state.step + any_ok.astype(jnp.int32)), skipped

    def _steps_ok(self, feats, grads, step) -> dict[str, jax.Array]:
        """{table name: bool scalar}: whether this step's values for the table are usable
        (see `apply_gradients`). Reductions over the (B, D) gradients and (B, L) weights
        only, never over the table."""
        ok = {}
        for name, plan in self.table_plans.items():
            values = _backend.step_values(plan, self.spec, step)
            good = plan.optimizer.learning_rate_ok(values.learning_rate)
            for v in values.others:
                good = good & jnp.isfinite(v)
            ok[name] = good
        for f in self.feature_plans:
            good = jnp.all(jnp.isfinite(grads[f.path]))
            weights = feats[f.path][1]
            if weights is not None:  # 0 wherever the id is -1 or invalid (ignored there).
                good = good & jnp.all(jnp.isfinite(weights))
            ok[f.table] = ok[f.table] & good
        return ok

    # Inside shard_map: each stack's backend does its shard-local row work.

    def _inputs(self, feats) -> dict[str, list[_backend.Input]]:
        """{stack name: the Inputs of its tables' features}, in member order."""
        by_table: dict[str, list[_backend.Input]] = {}
        for f in self.feature_plans:
            by_table.setdefault(f.table, []).append(_backend.Input(f, *feats[f.path]))
        return {
            name: [i for t in self.stacks[name] for i in by_table.get(t, [])]
            for name in self._stack_plans
            if any(t in by_table for t in self.stacks[name])
        }

    def _parts(self, plan: _backend.TablePlan, inputs: list) -> list:
        """[(plan, inputs)]: a stack's row work in one call (one sort, one exchange per
        round, one kernel) when the kernels' resident blocks fit VMEM at the capacity that
        fits (`_routing.fits`: more exchanged rows than VMEM holds only means more
        rounds), else in parts of consecutive whole members whose activations fit; a
        member too big alone takes XLA ops, as it would unstacked. Members' rows are
        disjoint: a split is the same update."""
        if not plan.members:
            return [(plan, inputs)]
        by_member = {m.name: m for m in plan.members}
        groups: list[list] = []  # The inputs of each member, in member order.
        for i in inputs:
            if groups and groups[-1][-1].feature.table == i.feature.table:
                groups[-1].append(i)
            else:
                groups.append([i])
        parts: list[list] = []
        for group in groups:
            joined = parts[-1] + group if parts else None
            if joined and _routing.fits(
                self._part_plan(plan, joined, by_member), joined, self.num_shards
            ):
                parts[-1] = joined
            else:
                parts.append(group)
        return [(self._part_plan(plan, part, by_member), part) for part in parts]

    def _call_plans(self, shapes: dict[str, tuple[int, int]]) -> dict[str, tuple]:
        """{key: (plan, inputs)} of each call the row work makes when each device holds ids
        of these (b, L) shapes ({feature path: shape}): a table alone or a stack under its
        state key, a stack that runs in parts (`_parts`) one entry per part, under "key#i";
        `inputs` with shapes for arrays. On the host, for `id_counts` and `plan`."""
        feats = {p: (jax.ShapeDtypeStruct(shape, jnp.int32), None) for p, shape in shapes.items()}
        out = {}
        for name, inputs in self._inputs(feats).items():
            parts = self._parts(self._stack_plans[name], inputs)
            for i, part in enumerate(parts):
                out[name if len(parts) == 1 else f"{name}#{i}"] = part
        return out

    def _part_plan(self, plan: _backend.TablePlan, inputs: list, by_member: dict):
        """The stack's plan for the members that `inputs` feed: their capacities summed."""
        names = list(dict.fromkeys(i.feature.table for i in inputs))
        if len(names) == len(plan.members):
            return plan
        return dataclasses.replace(
            plan, members=tuple(by_member[n] for n in names), **self._capacities(names)
        )

    def _lookup_local(self, tables, feats):
        out = {}
        for name, inputs in self._inputs(feats).items():
            for plan, part in self._parts(self._stack_plans[name], inputs):
                if plan.routing == "owner":
                    out.update(_routing.lookup(plan, tables[name], part, self.axis))
                else:
                    out.update(plan.backend.lookup(plan, tables[name], part, self.axis))
        return out

    def _update_local(self, tables, slots, feats, grads, step, ok):
        tables, slots = dict(tables), dict(slots)
        for name, inputs in self._inputs(feats).items():
            for plan, part in self._parts(self._stack_plans[name], inputs):
                members = [m.name for m in plan.members] or [name]
                if len(members) == 1:
                    row_step = _backend.row_step(plan, self.spec, step, ok[members[0]])
                else:  # Several members in one call: a skipped one's rows are left alone.
                    members_ok = jnp.stack([ok[m] for m in members])
                    row_step = _backend.row_step(
                        plan, self.spec, step, jnp.any(members_ok), members_ok
                    )
                update = _routing.update if plan.routing == "owner" else plan.backend.update
                tables[name], slots[name] = update(
                    plan,
                    tables[name],
                    slots[name],
                    part,
                    {i.feature.path: grads[i.feature.path] for i in part},
                    row_step,
                    self.axis,
                )
        return tables, slots
