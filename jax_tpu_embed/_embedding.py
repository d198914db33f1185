"""The embedding: sharded state, lookup, sparse update, export and restore."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import (
    _backend,
    _config,
    _counts,
    _dynamic,
    _dynamic_owner,
    _exchange,
    _guards,
    _inflight,
    _init,
    _inputs,
    _multihost,
    _placement,
    _plan,
    _planner,
    _sharding,
    _storage,
    _streams,
)
from ._rowindex import NOT_MINE

Nested = Any


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tables", "slots", "step", "index"],
    meta_fields=[],
)
@dataclasses.dataclass
class EmbeddingState:
    """All trainable embedding state.

    Attributes:
        tables: {state key (`Embedding.stacks`): its physical table array}, row-sharded;
            shard p holds rows [p * S, (p + 1) * S) in its local order (see
            `Embedding.shard_rows`). A dynamic table's array holds its slots' rows.
        slots: {state key: {slot name: physical array}}.
        step: int32 scalar, the number of updates applied so far.
        index: {dynamic table name: its index (which id holds which row, the scores that
            eviction reads, the admission filter, counters) and key}; empty without
            dynamic tables.
    """

    tables: dict
    slots: dict
    step: Any  # jax.Array; jax.ShapeDtypeStruct in abstract_state.
    index: dict = dataclasses.field(default_factory=dict)


class Embedding:
    """Row-sharded embedding tables over one axis of a mesh, with sparse optimizers.

    Args:
        spec: The EmbeddingSpec.
        mesh: A `jax.sharding.Mesh` (Auto or Explicit axes). Default: every device on one
            Auto axis named "shard".
        axis: The mesh axis the tables' rows and the batch are split over. Default: the
            mesh's only axis; required for a multi-axis mesh.
        backend: Who does each table's shard-local row work: "auto" (default), "xla",
            "pallas", "pallas_interpret" or "cpu", an instance of a `jte.backends` class
            for its options (e.g. `jte.backends.Pallas(interpret=True, block=256)`), or
            {table name: one of these} (tables left out are "auto"). "auto" takes the
            fused Pallas kernels on TPU meshes and the C++ kernels on CPU meshes where a
            table can use them, else the portable XLA passes. "pallas_interpret" runs the
            TPU kernels in Pallas' interpreter on any mesh (slow; for tests). A backend a
            table cannot use is a ValueError that names the table and the reason. Results
            agree to float32 rounding whatever the backend; `backends` says what was
            chosen, `call_plans` what runs (a call too big for the Pallas kernels' VMEM
            runs on XLA ops).
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
            where the kernels' memory allows; a dynamic table's slot table stacks too (its
            index stays its own). Tables on the all-gather path, in host memory, with
            stochastic rounding or with an optimizer that updates every row stay alone.
            Invisible but in `EmbeddingState`'s keys (`stacks`): export, checkpoints,
            serving and `shard_rows` speak per-table logical rows. False: one array per
            table.
        tpu_layout: Lay out, flatten and size as on TPU meshes: ids flattened column by
            column as the TPU stores them, max_ids_per_shard defaulting to 1.5 x the
            per-shard average, the XLA update in sorted passes. None (default): on TPU
            meshes only. True elsewhere runs those code paths on any mesh (for tests);
            results agree to float32 rounding.
        init_block_bytes: About how many bytes `init` draws per device and round (its
            transient memory; default 1 MiB; rows narrower than the lanes counted as
            padded to them). Values do not depend on it.
        stage_host_rows: Whether `stage` reads the rows of a step's batch from the tables
            placed "host" in one host read per table, for the lookup and the update to
            share (a train step calls it). None (default): on meshes whose devices' memory
            is not the host's (TPU, GPU); True: also on CPU meshes (for tests), where it
            only adds a copy. Values agree to float32 rounding with it or without.
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
        backend: str | _backend.Backend | Mapping[str, str | _backend.Backend] = "auto",
        lane_width: int | None = None,
        max_ids_per_shard: int | Mapping[str, int] | None = None,
        max_unique_ids_per_shard: int | Mapping[str, int] | None = None,
        routing: str | Mapping[str, str] = "auto",
        stacking: bool = True,
        tpu_layout: bool | None = None,
        init_block_bytes: int = _planner.INIT_BLOCK_BYTES,
        stage_host_rows: bool | None = None,
        cpu_kernels: bool | None = None,
        tpu_kernels: bool | str | None = None,
    ):
        if not isinstance(spec, _config.EmbeddingSpec):
            raise TypeError(
                f"Embedding: spec must be a jte.EmbeddingSpec, got {type(spec).__name__}."
            )
        _guards.check_bool(stacking, "Embedding", "stacking")
        _guards.check_bool(stage_host_rows, "Embedding", "stage_host_rows", allow_none=True)
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
        # Dynamic tables run as static tables of their capacity behind an index (_dynamic).
        engine_spec, self.dynamic = _dynamic.engine_spec(spec, int(mesh.shape[self.axis]))
        self._spec_tables = spec.tables()
        # The features of dynamic tables, whose ids are int64 (SplitIds under jit).
        self.dynamic_paths = frozenset(p for d in self.dynamic.values() for p in d.features)
        # Everything decided at construction, frozen: the step reads nothing else.
        self.plan = _planner.build(
            engine_spec,
            mesh,
            self.axis,
            backend=backend,
            lane_width=lane_width,
            max_ids_per_shard=max_ids_per_shard,
            max_unique_ids_per_shard=max_unique_ids_per_shard,
            routing=routing,
            stacking=stacking,
            tpu_layout=tpu_layout,
            init_block_bytes=init_block_bytes,
            cpu_kernels=cpu_kernels,
            tpu_kernels=tpu_kernels,
        )
        # A dynamic table's index runs in C++ where its slot table's row work does.
        self.dynamic = {
            name: _dynamic.with_kernel(plan, self.plan.tables[name])
            for name, plan in self.dynamic.items()
        }
        self.num_shards = self.plan.num_shards
        self.lane_width = self.plan.lane_width
        # Tables placed `HostCached` (never stacked: their state key is their name).
        self.cached = {
            name: plan.storage for name, plan in self.table_plans.items() if plan.storage.cache
        }
        # State keys whose rows a step reads from the host once (`stage`): tables placed
        # "host" (HostCached tables have their caches). On CPU meshes the host's memory
        # is the devices': staging would only copy.
        staging = stage_host_rows if stage_host_rows is not None else self.plan.platform != "cpu"
        self.stageable = frozenset(
            name
            for name, plan in self.plan.stacks.items()
            if staging and plan.storage.on_host and not plan.storage.cache
        )
        self._replicated = NamedSharding(mesh, P())
        # `init`'s programs (`_init`), built on first use.
        self.initializer = _init.Initializer(self.plan, mesh, self.state_arrays)
        self._stack_fns: dict = {}
        self._lookup_jit = jax.jit(self._lookup)
        # The state is donated: the update writes the touched rows in place instead of
        # copying every table and slot on each call (which made an eager call O(V)).
        self._apply_jit = jax.jit(self._apply, donate_argnums=0)
        self._prefetch_jit = jax.jit(self._prefetch, donate_argnums=0)
        self._stage_jit = jax.jit(self._stage)
        self._skipped: dict[str, jax.Array] | None = None
        self._add_counts = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        # Waits for call i - k on multi-device CPU meshes (XLA:CPU deadlock, _inflight.py).
        self._in_flight = _inflight.Window()

    @property
    def table_plans(self) -> Mapping[str, _plan.TablePlan]:
        """{table name: its plan as if stored alone} (read-only; `plan` holds them all)."""
        return self.plan.tables

    @property
    def feature_plans(self) -> tuple[_plan.FeaturePlan, ...]:
        return self.plan.features

    @property
    def stacks(self) -> dict[str, tuple[str, ...]]:
        """{state key: the tables stored in its arrays}: `EmbeddingState.tables` and
        `.slots` are keyed by these; a table stored alone is its own key."""
        return {name: plan.tables for name, plan in self.plan.stacks.items()}

    @property
    def backends(self) -> dict[str, str]:
        """{table name: the backend it was given}, fixed at construction. A call that
        backend cannot hold falls back to XLA ops: `call_plans` says which kernel runs."""
        return {name: plan.backend.name for name, plan in self.table_plans.items()}

    def call_plans(self, shapes: Mapping[str, tuple[int, int]]) -> dict[str, _plan.CallPlan]:
        """{key: CallPlan} of each call of the row work when each device holds ids of these
        (b, L) shapes ({feature path: shape}; every feature): which kernel really runs
        (`kernel`, with `fallback` saying why when it is not the table's backend), the
        exchange and the capacities. A table alone or a stack is under its state key; a
        stack that runs in parts, one entry per part, under "key#i"."""
        missing = sorted(f.path for f in self.feature_plans if f.path not in shapes)
        if missing:
            raise ValueError(f"call_plans: no shapes for the features {missing}.")
        return {k: call for k, (call, _) in _exchange.plan_calls(self.plan, shapes).items()}

    @property
    def routing(self) -> dict[str, str]:
        """{table name: "gather" | "owner"}, how its ids reach its rows' owners."""
        return {name: plan.routing for name, plan in self.table_plans.items()}

    def storage(self, table_name: str) -> _storage.TableStorage:
        """How a table and its slots are stored on the devices (see `_storage`)."""
        return self.table_plans[table_name].storage

    # ------------------------------------------------------------------ state

    def _rows(self, rank: int, memory_kind: str | None = None) -> NamedSharding:
        """Row sharding of a rank-`rank` array, spelled as jit's outputs spell it."""
        return NamedSharding(
            self.mesh, P(self.axis, *([None] * (rank - 1))), memory_kind=memory_kind
        )

    @_inputs.x32()
    def abstract_state(self) -> EmbeddingState:
        """The state as jax.ShapeDtypeStruct leaves with shardings; allocates nothing."""
        tables, slots = {}, {}
        for name, plan in self.plan.stacks.items():
            tables[name], slots[name] = self._abstract(plan.storage, plan.config.dtype)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
        index = {
            name: jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                self._index_shapes(name),
                self._index_shardings(name),
            )
            for name in self.dynamic
        }
        for name in self.cached:
            if name not in self.dynamic:  # A dynamic table's are in its DynamicState.
                index[name] = jax.tree.map(
                    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                    jax.eval_shape(self.cached[name].empty_cache),
                    self._cache_shardings(name),
                )
        return EmbeddingState(tables, slots, step, index)

    def _cache_shardings(self, name: str) -> _placement.CacheState:
        """A `HostCached` table's caches: every array split by rows over the axis."""
        shapes = jax.eval_shape(self.cached[name].empty_cache)
        return jax.tree.map(lambda x: self._rows(x.ndim), shapes)

    @_inputs.x32()
    def with_empty_caches(self, index: dict, traced: bool = False) -> dict:
        """`index` (a state's, without the caches of HostCached tables, or with) with every
        HostCached table's caches holding no row, placed as the state holds them: a
        dynamic table's in its `DynamicState`, any other's under its name."""
        caches = {}
        for name, storage in self.cached.items():
            caches[name] = jax.tree.map(
                lambda x, s: _sharding.constrain(x, s) if traced else jax.device_put(x, s),
                storage.empty_cache(),
                self._cache_shardings(name),
            )
        return self._set_caches(index, caches)

    def _set_caches(self, index: dict, caches: dict) -> dict:
        """`index` with these HostCached tables' caches ({name: CacheState})."""
        out = dict(index)
        for name, cache in caches.items():
            out[name] = (
                dataclasses.replace(out[name], cache=cache) if name in self.dynamic else cache
            )
        return out

    def _cache_of(self, index: dict, name: str) -> _placement.CacheState:
        """A HostCached table's caches in a state's index."""
        return index[name].cache if name in self.dynamic else index[name]

    def _index_shapes(self, name: str) -> _dynamic.DynamicState:
        words = jax.ShapeDtypeStruct((2,), jnp.uint32)
        shapes = jax.eval_shape(functools.partial(self._empty_index, name), words)
        if name in self.cached:
            shapes.cache = jax.eval_shape(self.cached[name].empty_cache)
        return shapes

    def _index_sharding(self, shape) -> NamedSharding:
        """An index array's sharding: split by buckets over the axis, or replicated when it
        is empty (a table without an admission filter has empty filter arrays, and a step
        gives an empty array back replicated: sharded here, each call would compile again)."""
        if math.prod(shape.shape) == 0:
            return NamedSharding(self.mesh, P(*([None] * len(shape.shape))))
        return self._rows(len(shape.shape))

    def _index_shardings(self, name: str) -> _dynamic.DynamicState:
        """The shardings of a dynamic table's `DynamicState`: the index's arrays split by
        buckets over the axis (empty ones replicated: `_index_sharding`), the key
        replicated."""
        shapes = self._index_shapes(name)
        # The key replicated as a step's output spells it, P(None): one compile, not two.
        return _dynamic.DynamicState(
            index=jax.tree.map(self._index_sharding, shapes.index),
            key=NamedSharding(self.mesh, P(None)),
            cache=self._cache_shardings(name) if name in self.cached else None,
        )

    def _empty_index(self, name: str, key_words) -> _dynamic.DynamicState:
        """A dynamic table's empty index and key words (its caches: `with_empty_caches`)."""
        return _dynamic.DynamicState(
            _dynamic.empty_index(self.dynamic[name], self.num_shards), key_words
        )

    def _new_index(self, key) -> dict:
        """{dynamic table name: its empty index, its key's words (and empty caches when
        HostCached); other HostCached table name: its empty caches}."""
        traced = isinstance(key, jax.core.Tracer)
        out = {}
        keys = self.initializer.table_keys(key) if self.dynamic else {}
        for name in self.dynamic:
            state = self._empty_index(name, _dynamic.key_words(keys[name]))
            out[name] = jax.tree.map(
                lambda x, s: _sharding.constrain(x, s) if traced else jax.device_put(x, s),
                state,
                dataclasses.replace(self._index_shardings(name), cache=None),
            )
        return self.with_empty_caches(out, traced)

    def _abstract(self, storage: _storage.TableStorage, dtype) -> tuple:
        table_shape, slot_shapes = storage.shapes()
        rows = lambda shape: self._rows(len(shape), storage.memory_kind)
        return jax.ShapeDtypeStruct(table_shape, dtype, sharding=rows(table_shape)), {
            n: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows(shape))
            for n, shape in slot_shapes.items()
        }

    @_inputs.x32()
    def init(self, key: jax.Array) -> EmbeddingState:
        """Initial tables and slots: the same logical values for every mesh and strategy.

        Tables with the default initializer and constant slot initializers (every built-in
        optimizer) are drawn in blocks of rows on their own shards, straight into the
        arrays of their stacks, all in one compiled program: the transient memory is a
        block per array (`init_block_bytes`), and there is one compile however many tables
        there are. Row r of such a table is a hash of (table key, r), so its value depends
        on neither the mesh, the strategy nor the block size. A table with its own
        initializer (or a slot with a random one) is called with the logical shape, as the
        API promises, in a program of its own; a stack holding one is joined from its
        members' arrays. Works traced inside another jit too.
        """
        return EmbeddingState(*self.initializer.init(key), self._new_index(key))

    @_inputs.x32()
    def init_programs(self) -> dict:
        """{table name: a jitted fn(table key) -> (table, slots) giving what `init` gives for
        it, as the table would be stored alone}; for compiling ahead of time (the planner
        checks initialisation fits HBM too)."""
        return self.initializer.programs()

    @_inputs.x32()
    def compile_init(self, key: jax.ShapeDtypeStruct) -> None:
        """Compiles `init`'s program of the blocked tables for keys like `key` before `init`
        is called (jax keeps it for the call), so that a caller can do it while it does
        something else. Thread-safe."""
        self.initializer.compile(key)

    @_inputs.x32()
    def restore_tables(
        self, tables: dict, slots: dict | None = None, step: int = 0, key: jax.Array | None = None
    ) -> EmbeddingState:
        """State from logical tables {name: (V, D)} and slots {name: {slot: (V, D) or (V,)}};
        a dynamic table's as `jte.DynamicRows` (what `export` / `export_slots` give).

        Slots missing from `slots` start at their initial values (random ones drawn from
        `key`, as `init(key)` would).
        """
        tables, given_slots, index = self._restore_dynamic(
            dict(tables), dict(slots or {}), step, key
        )
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
            given = dict(given_slots.get(name, {}))
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
                k = None if key is None else _init.slot_key(jax.random.fold_in(key, i), storage, s)
                if s in storage.riders:
                    logical[s.name] = np.asarray(self.initializer.initial(plan, s, k))
                else:  # Drawn on the devices, as `init` does.
                    drawn[s.name] = self.initializer.slot(plan, s, k)
            _guards.check_restored(
                _guards.restored_items(name, plan.optimizer, value, given, storage.slot_specs),
                "restore_tables",
            )
            table, stored = storage.to_physical(table, logical)
            kind = storage.memory_kind
            new_tables[name] = self._put(table, kind)
            new_slots[name] = {
                s.name: drawn[s.name] if s.name in drawn else self._put(stored[s.name], kind)
                for s in storage.stored
            }
        step_array = jax.device_put(jnp.asarray(step, jnp.int32), self._replicated)
        index = self.with_empty_caches(index)
        return EmbeddingState(*self.state_arrays(new_tables, new_slots), step_array, index)

    def _restore_dynamic(self, tables: dict, slots: dict, step: int, key) -> tuple:
        """`restore_tables`' dynamic tables: each `DynamicRows` made its slot table's logical
        rows (unused slots 0, their slots' initial values) and an index holding its ids
        (scores as if every id had been updated at `step`). Returns (tables, slots,
        {name: DynamicState on the devices}). The keys of the restored tables' initial rows
        come from `key` as `init(key)` draws them (default: jax.random.key(0))."""
        index = {}
        keys = self.initializer.table_keys(jax.random.key(0) if key is None else key)
        for name, plan in self.dynamic.items():
            if name not in tables:
                continue
            storage = self.table_plans[name].storage
            given = tables[name]
            if not isinstance(given, _dynamic.DynamicRows):
                raise ValueError(
                    f"restore_tables: table {name!r} is dynamic: give jte.DynamicRows(ids, "
                    f"rows) (what export gives), got {type(given).__name__}."
                )
            ids, rows = _dynamic.check_rows(f"restore_tables: table {name!r}", given, plan.dim)
            rows = rows.astype(np.float32)
            n = len(ids)
            entries = {"ids": ids, "last": np.full(n, step, np.int32), "count": np.ones(n)}
            try:
                built, global_rows = _dynamic.rebuild(plan, self.num_shards, entries)
            except ValueError as e:
                raise ValueError(f"restore_tables: table {name!r}: {e}") from None
            where = _dynamic.slot_rows(storage, global_rows)
            logical = np.zeros((plan.rows, plan.dim), np.float32)
            logical[where] = rows
            tables[name] = logical
            table_slots = {}
            for slot_name, value in dict(slots.get(name, {})).items():
                if isinstance(value, _dynamic.DynamicRows):
                    if not np.array_equal(np.asarray(value.ids, np.int64), ids):
                        raise ValueError(
                            f"restore_tables: slot {slot_name!r} of table {name!r} holds "
                            f"other ids than the table's DynamicRows."
                        )
                    value = value.rows
                value = np.asarray(value, np.float32)
                spec = next((s for s in storage.slot_specs if s.name == slot_name), None)
                if spec is None or value.shape[0] != len(ids):
                    table_slots[slot_name] = value  # Named in the checks below.
                    continue
                full = np.full((plan.rows,) + value.shape[1:], float(spec.initializer), np.float32)
                full[where] = value
                table_slots[slot_name] = full
            slots[name] = table_slots
            state = _dynamic.DynamicState(built, _dynamic.key_words(keys[name]))
            shardings = dataclasses.replace(self._index_shardings(name), cache=None)
            index[name] = jax.tree.map(
                lambda x, s: jax.device_put(np.asarray(x), s), state, shardings
            )
        return tables, slots, index

    # --------------------------------------------------- stacks <-> per-table arrays

    @_inputs.x32()
    def state_arrays(self, tables: dict, slots: dict) -> tuple[dict, dict]:
        """`EmbeddingState`'s (tables, slots), keyed by state key (`stacks`), from each
        table's physical arrays as it would be stored alone ({table: array}, {table: {slot:
        array}}, as `table_arrays` gives them); a table stored alone passes through, a
        stack is one concatenation per shard and array. For `jte.checkpoint`."""
        out_tables, out_slots = {}, {}
        for name, plan in self.plan.stacks.items():
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

    @_inputs.x32()
    def table_arrays(self, state: EmbeddingState) -> tuple[dict, dict]:
        """The inverse of `state_arrays`: each table's physical arrays as stored alone (a copy of
        its rows for a stacked table)."""
        _guards.check_not_consumed(state, "Embedding.table_arrays")
        tables, slots = {}, {}
        for name, plan in self.plan.stacks.items():
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
            plan = self.plan.stacks[stack]
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

    def _put(self, physical: np.ndarray, memory_kind: str | None = None) -> jax.Array:
        return jax.make_array_from_callback(
            physical.shape, self._rows(physical.ndim, memory_kind), lambda index: physical[index]
        )

    @_inputs.x32()
    def export(self, state: EmbeddingState) -> dict[str, Any]:
        """{table name: (V, D) np.ndarray} in natural row order, whatever strategy or mesh;
        a dynamic table's live rows as `jte.DynamicRows(ids, rows)`, ids ascending.

        With several processes this gathers the tables onto every process (a collective):
        call it on every process, then write from one.
        """
        _guards.check_not_consumed(state, "Embedding.export")
        tables = self.table_arrays(state)[0]
        out = {}
        for name, plan in self.table_plans.items():
            storage = plan.storage
            if name in self.dynamic:
                ids, where = self._live(state, name)
                rows = storage.take_stored(None, where, tables[name])
                out[name] = _dynamic.DynamicRows(ids, storage.split_row(rows)[0])
            else:
                out[name] = storage.to_logical(_multihost.to_host(tables[name]))[0]
        return out

    def _live(self, state: EmbeddingState, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids ascending, their stored positions) of a dynamic table's live ids (a
        collective with several processes)."""
        index = jax.tree.map(_multihost.to_host, state.index[name].index)
        now = int(np.asarray(jax.device_get(state.step)))
        return _dynamic.live(self.dynamic[name], index, now)

    @_inputs.x32()
    def dynamic_counters(self, state: EmbeddingState) -> dict[str, dict[str, jax.Array]]:
        """`dynamic_stats` without `occupancy`: the counters, and `held` (ids holding a row,
        TTL-expired ones included: admitted - evicted - expired), from O(shards) counters
        where `dynamic_stats` counts live rows over the whole index. Jittable; what the
        train step's metrics carry."""
        _guards.check_not_consumed(state, "Embedding.dynamic_counters")
        return {name: _dynamic.counters(state.index[name].index) for name in self.dynamic}

    @_inputs.x32()
    def dynamic_stats(self, state: EmbeddingState) -> dict[str, dict[str, jax.Array]]:
        """{dynamic table name: {counter: int32 scalar}}: `occupancy` (live rows), and since
        `init` (or the restore): `admitted`, `evicted` (by the eviction policy), `expired`
        (slots of rows past ttl_steps taken by new ids), `rejected` (misses not admitted:
        below min_count, or not drawn by admit_probability), `failed` (admitted but their
        bucket had no slot they could take: eviction "none", or every slot updated this
        step), `hits` and `misses` (ids of updates found or not), `filter_evicted`
        (min_count's filter forgot an id). Jittable. Nothing is dropped without a count:
        an id without a row reads its initial row, and its gradient is not applied."""
        _guards.check_not_consumed(state, "Embedding.dynamic_stats")
        return {
            name: _dynamic.stats(plan, state.index[name].index, state.step)
            for name, plan in self.dynamic.items()
        }

    @_inputs.x32()
    def export_slots(self, state: EmbeddingState) -> dict[str, dict[str, Any]]:
        """{table name: {slot name: (V, D) or (V,)}}; {} for a table without slots; a dynamic
        table's as `jte.DynamicRows` of its live ids.

        A collective with several processes, like `export`.
        """
        _guards.check_not_consumed(state, "Embedding.export_slots")
        out = {}
        tables, slots = self.table_arrays(state)
        for name, plan in self.table_plans.items():
            storage = plan.storage
            if name in self.dynamic:
                ids, where = self._live(state, name)
                riders = {}
                if storage.riders:
                    rows = storage.take_stored(None, where, tables[name])
                    riders = storage.split_row(rows)[1]
                out[name] = {
                    s.name: _dynamic.DynamicRows(
                        ids,
                        riders[s.name]
                        if s.name in riders
                        else storage.take_stored(s, where, slots[name][s.name]),
                    )
                    for s in storage.slot_specs
                }
                continue
            # The table's own array only when slots ride in it.
            table = _multihost.to_host(tables[name]) if storage.riders else None
            out[name] = storage.to_logical(
                table, {n: _multihost.to_host(x) for n, x in slots[name].items()}
            )[1]
        return out

    @_inputs.x32()
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
        stack = self.plan.stacks[self.plan.stack_of[table_name]]
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
            # Several processes: a collective, whichever holds the shard; one that read its
            # own copy instead would leave the others waiting in it.
            local = _multihost.to_host(array, np.arange(start, start + per_shard))
        for member in stack.members:
            if member.name == table_name:
                local = local[member.rows(stack.storage.packing)]
        return storage.shard_table_rows(local, shard)

    # ---------------------------------------------------------------- compute

    def validate(self, features: Nested) -> None:
        """Checks concrete inputs on the host; ValueError naming feature, id and position."""
        _inputs.validate(self.spec, features, self.num_shards)

    @_inputs.x32("features")
    def invalid_id_counts(self, features: Nested) -> dict[str, jax.Array]:
        """{feature path: int32 number of ids neither -1 nor in [0, V)}; jittable."""
        return _inputs.invalid_counts(self.spec, features)

    @_inputs.x32("features")
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
        than a round carries, max_ids_per_shard / N)}}. A dynamic table's ids count at the
        shards that own their buckets, each distinct id as the row it holds or would hold
        once admitted (at most a shard's rows). Host-side: features are NumPy arrays or
        fully addressable jax.Arrays.
        """
        flat = _inputs.flatten_inputs(self.spec, features)
        _inputs.check_batch(flat, self.num_shards)
        return _counts.id_counts(self.plan, {**flat, **self._counted_rows(flat)})

    def _counted_rows(self, flat) -> dict:
        """{path: (B, L) int64} of the dynamic features for `id_counts`: the rows their ids
        hold, or would hold once admitted, as far as the host can tell
        (`_dynamic.counted_rows`)."""
        out = {}
        for name, plan in self.dynamic.items():
            split = {p: _dynamic.split_leaf(p, f, flat[p])[:2] for p, f in plan.features.items()}
            hi, lo = _dynamic_owner.joined([tuple(map(np.asarray, x)) for x in split.values()])
            storage = self.table_plans[name].storage
            rows = _dynamic.counted_rows(plan, storage, np.asarray(hi), np.asarray(lo))
            out.update(zip(split, _dynamic_owner.split(rows, list(split.values()))))
        return out

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
        return {
            p: _dynamic.split_on_host(x) if p in self.dynamic_paths else x for p, x in flat.items()
        }

    @_inputs.x32("features")
    def lookup(
        self, state: EmbeddingState, features: Nested, *, staged: StagedRows | None = None
    ) -> Nested:
        """Embeds every feature.

        Args:
            state: From `init` or `apply_gradients`.
            features: Mirrors the spec. Each leaf is int (B,), int (B, L) padded with -1, or
                `Weighted(ids, weights)`; B a multiple of the mesh size.
            staged: From `stage(state, features)`: the rows of the tables in host memory
                are read from there instead of the host (see `stage`).

        Returns:
            Same structure: float32 (B, D) per feature, (B, L, D) for sequence features
            (or output_shape + (D,)). Examples with no ids give zeros.
        """
        _guards.check_not_consumed(state, "Embedding.lookup")
        flat = self._prepare(features)
        rows = _staged_rows(staged, state, "lookup")
        return _config.unflatten(
            self._lookup_jit(state.tables, state.index, state.step, flat, rows)
        )

    @_inputs.x32("features", "act_grads")
    def apply_gradients(
        self,
        state: EmbeddingState,
        features: Nested,
        act_grads: Nested,
        *,
        return_skipped: bool = False,
        staged: StagedRows | None = None,
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
            staged: From `stage(state, features)` before this state's lookup: the rows of
                the tables in host memory are read from there instead of the host.

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
        rows = _staged_rows(staged, state, "apply_gradients")
        new, skipped = self._apply_jit(state, flat, grads, rows)
        if not any(isinstance(x, jax.core.Tracer) for x in skipped.values()):
            if self._skipped is None:
                self._skipped = skipped
            else:
                self._skipped = self._add_counts(self._skipped, skipped)
            self._in_flight.push(skipped)
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
            if f.path not in flat:
                continue
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
        return _sharding.constrain(x, NamedSharding(self.mesh, P(self.axis)))

    def _out_shape(self, f: _plan.FeaturePlan, batch: int) -> tuple:
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
        if tuple(x.shape) == tuple(shape) or not _sharding.is_explicit(self.mesh):
            return x.reshape(shape)
        spec = P(self.axis) if shape[0] % self.num_shards == 0 else P()
        return jax.lax.reshape(x, shape, out_sharding=NamedSharding(self.mesh, spec))

    def _shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )

    def _lookup(self, tables, index, step, flat, staged):
        split = self._split_dynamic(flat)
        extra, gathered = {}, {}
        if split:
            rows, gathered = self._dynamic_rows(index, step, split)
            flat = {**flat, **self._dynamic_leaves(split, rows)}
            extra = self._initial_rows(index, split, rows)
        feats = self._normalized(flat)
        batch = next(iter(feats.values()))[0].shape[0]
        row = P(self.axis)
        tables, _ = self._with_caches(tables, {}, index, step)
        tables, _ = self._with_staged(tables, {}, staged)
        acts = self._shard_map(self._lookup_local, (row, row, P()), row)(tables, feats, gathered)
        for path, x in extra.items():
            acts[path] = acts[path] + x
        return {
            f.path: self._reshape(acts[f.path], self._out_shape(f, batch))
            for f in self.feature_plans
        }

    # Dynamic tables (_dynamic): their features' ids resolved to rows of their slot tables.

    def _split_dynamic(self, flat) -> dict:
        """{path: (hi, lo, weights or None)} of the dynamic tables' features."""
        return {
            path: _dynamic.split_leaf(path, f, flat[path])
            for plan in self.dynamic.values()
            for path, f in plan.features.items()
        }

    def _dynamic_specs(self):
        """The shard_map specs of the dynamic tables' `DynamicState`s: their shardings'."""
        specs = lambda name: jax.tree.map(lambda s: s.spec, self._index_shardings(name))
        return {name: specs(name) for name in self.dynamic}

    def _dynamic_index(self, index: dict) -> dict:
        """The dynamic tables' entries of a state's index (`_dynamic_specs`' tree): the index
        also holds the caches of HostCached static tables, under their names."""
        return {name: index[name] for name in self.dynamic}

    def _dynamic_rows(self, index, step, split) -> tuple[dict, dict]:
        """({path: (B, L) int32 slot-table rows of the ids, -1 where an id has none}, the
        global batch's rows and factors on every device for the features whose tables
        resolve by all-gather (`_dynamic_back`))."""
        row = P(self.axis)
        scaled = self._scaled_by_ids(split)

        def local(index, parts, step):
            plans = [p for p in self.dynamic.values() if p.route == "gather"]
            ids = _dynamic.gather_ids(
                [[parts[p] for p in plan.features] for plan in plans], self.axis
            )
            values = [
                _dynamic.lookup_rows(
                    plan,
                    self.table_plans[plan.name].storage,
                    index[plan.name].index,
                    hi,
                    lo,
                    step,
                    self.axis,
                )
                for plan, (hi, lo) in zip(plans, ids)
            ]
            out, gathered = self._dynamic_back(plans, parts, values, ids, scaled)
            routed = [p for p in self.dynamic.values() if p.route == "owner"]
            tables = [self._owned_table(plan, index, parts) for plan in routed]
            for plan, rows in zip(routed, _dynamic_owner.lookup_rows(tables, step, self.axis)):
                out.update(self._owned_rows(plan, parts, rows))
            return out, gathered

        parts = {
            p: (self._batch_sharded(h), self._batch_sharded(lo)) for p, (h, lo, _) in split.items()
        }
        specs = (self._dynamic_specs(), row, P())
        return self._shard_map(local, specs, (row, P()))(self._dynamic_index(index), parts, step)

    def _owned_table(self, plan, index, parts) -> _dynamic_owner.Table:
        """Inside shard_map: a table's part of a step resolved at the owners."""
        mine = [parts[p] for p in plan.features]
        storage = self.table_plans[plan.name].storage
        return _dynamic_owner.Table(
            plan, storage, index[plan.name].index, *_dynamic_owner.joined(mine)
        )

    @staticmethod
    def _owned_rows(plan, parts, rows) -> dict:
        """{path: (b, L) rows} of a table's features from its joined positions' `rows`."""
        mine = [parts[p] for p in plan.features]
        return dict(zip(plan.features, _dynamic_owner.split(rows, mine)))

    def _dynamic_back(self, plans, parts, values, ids, scaled) -> tuple[dict, dict]:
        """({path: (b, L) rows}, {path: (rows, factors or None) of the global batch}) of
        the dynamic features of `plans` from the tables' gathered rows (`values`,
        `_dynamic.scatter_rows`) and ids (`ids`, `_dynamic.gather_ids`'s). The second, the
        same on every device, holds the features whose slot table's exchange gathers ids
        ("gather"), which it takes as `_plan.Input.ids_all` and `weights_all` instead of
        gathering them again: their rows, and for the features in `scaled` their factors,
        computed here from the gathered ids. The other tables' rows come back by one
        reduce-scatter."""
        if not plans:
            return {}, {}
        shapes = [[parts[p][0].shape for p in plan.features] for plan in plans]
        stacks = self.plan.stacks
        everywhere = [stacks[self.plan.stack_of[p.name]].routing == "gather" for p in plans]
        rows = _dynamic.scatter_rows(values, shapes, everywhere, self.axis)
        local, gathered = {}, {}
        n = lax.axis_size(self.axis)
        for plan, table_rows, table_ids, table_shapes in zip(plans, rows, ids, shapes):
            combiner = self._spec_tables[plan.name].combiner
            for k, ((path, f), (mine, every)) in enumerate(zip(plan.features.items(), table_rows)):
                local[path] = mine
                if every is None:
                    continue
                scale = None
                if path in scaled:
                    hi, lo = (_dynamic.by_feature(x, table_shapes, n)[k] for x in table_ids)
                    scale = _dynamic.scaled_weights(f, combiner, hi, lo, None)
                gathered[path] = (every, scale)
        return local, gathered

    def _scaled_by_ids(self, split) -> set:
        """The dynamic features whose engine leaf is Weighted (`_dynamic_leaves`) with
        factors that depend on their ids alone (no weights given)."""
        return {
            path
            for plan in self.dynamic.values()
            for path, f in plan.features.items()
            if split[path][2] is None and self._weighted(plan, f, split[path][2])
        }

    def _weighted(self, plan, feature, weights) -> bool:
        """Whether a dynamic feature's engine leaf carries factors (`_dynamic_leaves`):
        unless they are all 1 (no weights, and a sum or a sequence)."""
        plain = self._spec_tables[plan.name].combiner == "sum"
        return not (weights is None and (plain or feature.is_sequence))

    def _scale(self, plan, path: str, split):
        """(B, L) float32: each position's factor under its table's own combiner, over all
        of the example's ids (found or not); 0 at padding."""
        hi, lo, w = split[path]
        combiner = self._spec_tables[plan.name].combiner
        return _dynamic.scaled_weights(plan.features[path], combiner, hi, lo, w)

    def _dynamic_leaves(self, split, rows) -> dict:
        """{path: the leaf the engine sees}: the rows themselves (-1: none, read as padding)
        when the factors are all 1 (no weights, and a sum or a sequence), else
        Weighted(rows, each position's factor, `_scale`)."""
        out = {}
        for plan in self.dynamic.values():
            for path, f in plan.features.items():
                if self._weighted(plan, f, split[path][2]):
                    out[path] = _inputs.Weighted(rows[path], self._scale(plan, path, split))
                else:
                    out[path] = rows[path]
        return out

    def _initial_rows(self, index, split, rows) -> dict:
        """{path: the natural-shaped activation part of the ids without a row}: their
        initial rows, combined as their table combines (`rows`: `_dynamic_rows`'s)."""
        out = {}
        for name, plan in self.dynamic.items():
            for path, f in plan.features.items():
                hi, lo, _ = split[path]
                rows_of, scale = rows[path], self._scale(plan, path, split)

                def local(key, hi, lo, rows, scale, f=f, plan=plan):
                    missing = (rows < 0) & (scale != 0)
                    how, draw = plan.compaction, plan.draw
                    if not f.is_sequence:
                        return _dynamic.missing_rows(
                            key, hi, lo, scale, missing, plan.dim, how, draw
                        )
                    init = _dynamic.initial_rows_where(key, hi, lo, missing, plan.dim, how, draw)
                    return scale[..., None] * init

                row = P(self.axis)
                parts = [self._batch_sharded(x) for x in (hi, lo, rows_of, scale)]
                out[path] = self._shard_map(local, (P(), row, row, row, row), row)(
                    index[name].key, *parts
                )
        return out

    def _admit(self, state, split, ok):
        """One step of the dynamic tables' indexes (admission, eviction, the reset of the
        rows they give to new ids) -> (index, tables, slots, {path: rows}, gathered):
        `tables` and `slots` the new arrays of the state keys that hold dynamic tables (a
        stack's too); `gathered` as `_dynamic_rows`'s. Tables in host memory are not reset
        here: the update does it (`_dynamic.Fresh`). Tables that route are resolved at
        their owners."""
        row = P(self.axis)
        names = list(self.dynamic)
        scaled = self._scaled_by_ids(split)
        routed = [name for name in names if self.dynamic[name].route == "owner"]
        # Where each table's rows are stored: its arrays' state key (a stack's members share
        # them) and the offset of its rows in every shard of them.
        stack_of = self.plan.stack_of
        keys = list(dict.fromkeys(stack_of[name] for name in names))
        offset = {t: o for k in keys for t, o in self.plan.stacks[k].offsets.items()}

        def local(index, tables, slots, parts, keep, step):
            new_index, values, out = {}, [], {}
            arrays = {k: (tables[k], slots[k]) for k in keys}
            owned = [self._owned_table(self.dynamic[name], index, parts) for name in routed]
            updates = [
                _dynamic_owner.Update(index[name].key, stack_of[name], offset[name], keep[name])
                for name in routed
            ]
            done, arrays = _dynamic_owner.update_rows(owned, updates, arrays, step, self.axis)
            for name, (idx, rows) in zip(routed, done):
                new_index[name] = dataclasses.replace(index[name], index=idx)
                out.update(self._owned_rows(self.dynamic[name], parts, rows))
            gathered = [name for name in names if name not in routed]
            plans = [self.dynamic[name] for name in gathered]
            ids = _dynamic.gather_ids(
                [[parts[p] for p in plan.features] for plan in plans], self.axis
            )
            for name, (hi, lo) in zip(gathered, ids):
                k = stack_of[name]
                table, table_slots = arrays[k]
                idx, table, table_slots, rows = _dynamic.update_rows(
                    self.dynamic[name],
                    self.table_plans[name].storage,
                    index[name].index,
                    index[name].key,
                    table,
                    table_slots,
                    hi,
                    lo,
                    keep[name],
                    step,
                    self.axis,
                    offset[name],
                )
                arrays[k] = (table, table_slots)
                new_index[name] = dataclasses.replace(index[name], index=idx)
                values.append(rows)
            back, gathered = self._dynamic_back(plans, parts, values, ids, scaled)
            out.update(back)
            new_tables = {k: table for k, (table, _) in arrays.items()}
            new_slots = {k: table_slots for k, (_, table_slots) in arrays.items()}
            return new_index, new_tables, new_slots, out, gathered

        parts = {
            p: (self._batch_sharded(h), self._batch_sharded(lo)) for p, (h, lo, _) in split.items()
        }
        specs = self._dynamic_specs()
        outs = (specs, row, row, row, P())
        return self._shard_map(local, (specs, row, row, row, P(), P()), outs)(
            self._dynamic_index(state.index),
            {k: state.tables[k] for k in keys},
            {k: state.slots[k] for k in keys},
            parts,
            {n: ok[n] for n in names},
            state.step,
        )

    def _apply(self, state, flat, grads, staged):
        split = self._split_dynamic(flat)
        batch = _inputs.check_batch(flat, self.num_shards)
        # Padding of static features is -1 or out of range; the dynamic ones' is -1 only.
        given = self._normalized({p: x for p, x in flat.items() if p not in split})
        given.update({p: (None, w) for p, (_, _, w) in split.items()})
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
        ok = self._steps_ok(given, local_grads, state.step)
        tables, slots, index = state.tables, state.slots, state.index
        keys = {name: state.index[name].key for name in self.dynamic}
        gathered = {}
        if split:
            index, new_tables, new_slots, rows, gathered = self._admit(state, split, ok)
            # Laid out as `init` lays it out, so that the next call's input matches the last
            # call's output and the step compiles once.
            index = {
                **state.index,
                **{
                    name: jax.tree.map(_sharding.constrain, x, self._index_shardings(name))
                    for name, x in index.items()
                },
            }
            tables, slots = {**tables, **new_tables}, {**slots, **new_slots}
            flat = {**flat, **self._dynamic_leaves(split, rows)}
        feats = self._normalized(flat)
        row, rep = P(self.axis), P()
        # The index after this step's resolution tells the update which rows of a host
        # table were given to new ids (`_dynamic.Fresh`).
        on_host = [n for n in self.dynamic if self.table_plans[n].storage.on_host] if split else []
        resolved = {
            n: (index[n].index.keys, index[n].index.last, index[n].index.count) for n in on_host
        }
        tables, slots = self._with_caches(tables, slots, index, state.step)
        tables, slots = self._with_staged(tables, slots, staged)
        tables, slots = self._shard_map(
            self._update_local, (row, row, row, rep, row, row, rep, rep, rep), (row, row)
        )(tables, slots, feats, gathered, local_grads, resolved, keys, state.step, ok)
        tables, slots, index = self._without_caches(tables, slots, index)
        for name in staged:  # Written through to the host: the host arrays are the state.
            tables[name] = tables[name].host
            slots[name] = {
                n: x.host if isinstance(x, _placement.Staged) else x for n, x in slots[name].items()
            }
        any_ok = functools.reduce(jnp.logical_or, ok.values())
        skipped = {name: (~keep).astype(jnp.int32) for name, keep in ok.items()}
        step = state.step + any_ok.astype(jnp.int32)
        return EmbeddingState(tables, slots, step, index), skipped

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

    # Tables in host memory (_placement.Staged): a step's rows read from the host once.

    @_inputs.x32("features", "more")
    def stage(self, state: EmbeddingState, features: Nested, *more: Nested) -> StagedRows | None:
        """Reads the rows `features` will touch in the tables placed "host" (and their
        slots) from host memory into device memory, in one host read per table, for the
        `lookup` and `apply_gradients` of these features (`staged=`), which then read
        those rows from device memory and not from the host: a train step reads each
        touched row once, not once per (id, position) pair for the lookup and again for
        the update. It does not change the state.

        `more` are other batches whose rows the same read brings: a pipelined step looks
        up one batch and updates the batch before (`pipeline_execution`), so it stages
        both, and its lookup and update each find their rows among them.

        Each device stages up to one pass's distinct rows (`call_plans`' `capacity`), or
        under owner routing the rows the devices send it in one round; rows past that, or
        rows of other features, are read from the host as without staging, so values
        never depend on it (beyond float32 rounding), only how many host reads a step
        makes. A dynamic table's ids are resolved as the lookup resolves them (its stage
        reads their rows, not the rows the update gives to new ids, which are read where
        needed). Tables in device memory and `HostCached` tables are not staged; nor is
        anything on CPU meshes unless `stage_host_rows=True`. A train step
        (`jte.make_train_step`) does this itself (a pipelined one with both batches).

        Args:
            state: From `init` or `apply_gradients`.
            features: As for `lookup`.
            *more: More batches (each as for `lookup`) to stage in the same read. A
                device still stages no more rows than the largest batch alone could
                touch, which assumes every id distinct: batches with fewer distinct rows
                between them fit, and the rows of the others are read where needed.

        Returns:
            The staged rows, for `staged=` (a pytree of jax Arrays); None where nothing is
            staged. Outside jit, `lookup` and `apply_gradients` refuse rows staged from a
            state of another step, which would be stale. The exchange's ids are sent once
            more for it (4 bytes an id: all-gathered, or under owner routing each
            device's distinct rows to their owners).
        """
        _guards.check_not_consumed(state, "Embedding.stage")
        if not self.stageable:
            return None
        batches = tuple(self._prepare(f) for f in (features, *more))
        rows = self._stage_jit(state.tables, state.slots, state.index, state.step, batches)
        return StagedRows(jnp.copy(state.step), rows)  # The state's is donated by updates.

    def _stage(self, tables, slots, index, step, batches):
        resolved = []
        for flat in batches:
            split = self._split_dynamic(flat)
            gathered = {}
            if self.stageable & set(self.dynamic):
                # Their ids resolved as the lookup resolves them (in a train step the
                # compiler may share the work); the rows the update gives to new ids are
                # read where they are needed.
                rows, gathered = self._dynamic_rows(index, step, split)
                flat = {**flat, **self._dynamic_leaves(split, rows)}
            else:
                flat = {p: x for p, x in flat.items() if p not in split}
            resolved.append((self._normalized(flat), gathered))

        def local(tables, slots, resolved):
            read, limits = {}, {}
            for feats, gathered in resolved:
                for name, inputs in self.plan.inputs(feats, gathered).items():
                    if name not in self.stageable:
                        continue
                    most = 0
                    for call, part in _exchange.calls(self.plan, name, inputs):
                        exchange = _exchange.EXCHANGES[call.exchange]
                        rows, bound = exchange.rows_read(call, part, self.axis)
                        read.setdefault(name, []).append(rows)
                        most += bound
                    # As many rows as the largest batch can touch, not their sum: that
                    # bound takes every id as distinct, which real batches are far from,
                    # so two of them fit and the host read stays one batch's size; rows
                    # past it are read where needed.
                    limits[name] = max(limits.get(name, 0), most)
            out = {}
            for name, limit in limits.items():
                keys = jnp.concatenate(read[name])
                storage = self.plan.stacks[name].storage
                hosts = [tables[name]] + [slots[name][s.name] for s in storage.stored]
                physical = [
                    jnp.where(keys < NOT_MINE, keys // p.per_row, NOT_MINE)
                    for p in storage.packings
                ]
                out[name] = _placement.stage(hosts, physical, limit)
            return out

        row = P(self.axis)
        return self._shard_map(local, (row, row, [(row, P())] * len(resolved)), row)(
            {n: tables[n] for n in self.stageable},
            {n: slots[n] for n in self.stageable},
            resolved,
        )

    def _with_staged(self, tables, slots, staged) -> tuple[dict, dict]:
        """(tables, slots) with the arrays of the staged state keys as `_placement.Staged`
        (slots only where given)."""
        tables, slots = dict(tables), dict(slots)
        for name, (ats, rows) in staged.items():
            storage = self.plan.stacks[name].storage
            arrays = [
                _placement.Staged(host, at, got, packing.packed)
                for host, at, got, packing in zip(
                    [tables[name]] + [slots.get(name, {}).get(s.name) for s in storage.stored],
                    ats,
                    rows,
                    storage.packings,
                )
            ]
            tables[name] = arrays[0]
            if name in slots:
                slots[name] = {
                    **slots[name],
                    **{s.name: x for s, x in zip(storage.stored, arrays[1:])},
                }
        return tables, slots

    # HostCached tables (_placement): the row work sees each array with its device cache.

    def _with_caches(self, tables, slots, index, step) -> tuple[dict, dict]:
        """(tables, slots) with every HostCached table's arrays as `_placement.Cached`
        (slots only where given)."""
        tables, slots = dict(tables), dict(slots)
        now = _sharding.constrain(jnp.full((self.num_shards,), step, jnp.int32), self._rows(1))
        for name, storage in self.cached.items():
            assert storage.cache is not None
            cache = self._cache_of(index, name)
            table, own = _placement.with_cache(
                storage.cache, tables[name], slots.get(name, {}), cache, now
            )
            tables[name] = table
            if name in slots:
                slots[name] = own
        return tables, slots

    def _without_caches(self, tables, slots, index) -> tuple[dict, dict, dict]:
        """The inverse of `_with_caches`: (tables, slots, index with the new caches)."""
        tables, slots, caches = dict(tables), dict(slots), {}
        for name in self.cached:
            tables[name], slots[name], cache = _placement.without_cache(tables[name], slots[name])
            caches[name] = jax.tree.map(_sharding.constrain, cache, self._cache_shardings(name))
        return tables, slots, self._set_caches(index, caches)

    @_inputs.x32("features")
    def prefetch(self, state: EmbeddingState, features: Nested) -> EmbeddingState:
        """Brings the rows `features` will touch into the caches of the HostCached tables
        (those with `prefetch=True`), ahead of the step that uses them.

        Call it with the next batch before the current batch's `apply_gradients` (a train
        step given `next_batch` does): its host reads then overlap the current step's
        work, and the rows it brings are kept until `state.step + 1`: the current
        update does not evict them, and they are not evicted for later prefetches before
        that step's update has used them. Values never depend on it (host memory always
        holds every row); only how many rows the next step finds in HBM does. A state
        without HostCached tables is returned as it is.

        Args:
            state: From `init` or `apply_gradients`; consumed as by `apply_gradients`.
            features: As for `lookup`: the batch of the next step.

        Returns:
            The new state (only the caches changed).
        """
        _guards.check_not_consumed(state, "Embedding.prefetch")
        if not any(s.cache and s.cache.prefetch for s in self.cached.values()):
            return state
        return self._prefetch_jit(state, self._prepare(features))

    def _prefetch(self, state: EmbeddingState, flat) -> EmbeddingState:
        names = [n for n, s in self.cached.items() if s.cache and s.cache.prefetch]
        # A dynamic table's ids as the rows they hold now (ids without one: none to fetch;
        # ids the current step admits are not resident yet, and miss in the next step).
        split = self._split_dynamic(flat)
        if split and any(n in self.dynamic for n in names):
            rows, _ = self._dynamic_rows(state.index, state.step, split)
            flat = {**flat, **self._dynamic_leaves(split, rows)}
        paths = {n: [f.path for f in self.feature_plans if f.table == n] for n in names}
        # Only the cached tables' features: another dynamic table's ids are still SplitIds.
        feats = self._normalized({p: flat[p] for n in names for p in paths[n] if p in flat})
        tables, slots = self._with_caches(state.tables, state.slots, state.index, state.step + 1)

        def local(tables, slots, feats):
            me = lax.axis_index(self.axis)
            for name in names:
                plan = self.table_plans[name]
                ids = jnp.concatenate(
                    [
                        lax.all_gather(feats[p][0], self.axis, tiled=True).reshape(-1)
                        for p in paths[name]
                    ]
                )
                owner, rows, found = plan.index.locate(name, ids)
                mine = found & (owner == me)
                stored = [s.name for s in plan.storage.stored]
                buffers = [tables[name]] + [slots[name][n] for n in stored]
                at = [  # Sorted: this device's rows among the first sum(mine).
                    _placement.distinct(jnp.where(mine, rows // p.per_row, NOT_MINE))
                    for p in plan.storage.packings
                ]
                window = _streams.capacity(plan, ids.shape[0], lax.axis_size(self.axis))
                tables[name], *new = _placement.prefetch(
                    buffers, at, jnp.sum(mine, dtype=jnp.int32), window
                )
                slots[name] = dict(zip(stored, new))
            return tables, slots

        row = P(self.axis)
        mine = lambda d: {n: d[n] for n in names}
        new_tables, new_slots = self._shard_map(local, (row, row, row), (row, row))(
            mine(tables), mine(slots), {p: feats[p] for n in names for p in paths[n]}
        )
        tables, slots = {**tables, **new_tables}, {**slots, **new_slots}
        _, _, index = self._without_caches(tables, slots, state.index)
        return EmbeddingState(state.tables, state.slots, state.step, index)

    @_inputs.x32()
    def cache_stats(self, state: EmbeddingState) -> dict[str, dict[str, jax.Array]]:
        """{HostCached table name: {counter: int32 scalar}}, summed over the devices since
        `init` or a restore: "hits" and "misses" (distinct rows the updates found in the
        cache, and not), "inserted" (rows updates and prefetches cached), "evicted" (cached
        rows they replaced), "prefetched" (rows prefetches fetched from host memory);
        "rows" (rows the cache can hold). Rows are counted as stored: a lane-packed
        physical row holds several. Lookups read the cache without changing it and are not
        counted. Jittable."""
        _guards.check_not_consumed(state, "Embedding.cache_stats")
        out = {}
        for name, storage in self.cached.items():
            lines = self._cache_of(state.index, name).table
            totals = jnp.asarray(lines.counts).sum(0, dtype=jnp.int32)
            out[name] = {c: totals[i] for i, c in enumerate(_placement.COUNTERS)}
            out[name]["rows"] = jnp.int32(lines.rows.shape[0] * storage.packing.per_row)
        return out

    # Inside shard_map: each stack's backend does its shard-local row work.

    def _lookup_local(self, tables, feats, gathered):
        out = {}
        for name, inputs in self.plan.inputs(feats, gathered).items():
            for call, part in _exchange.calls(self.plan, name, inputs):
                exchange = _exchange.EXCHANGES[call.exchange]
                out.update(exchange.lookup(call, tables[name], part, self.axis))
        return out

    def _update_local(self, tables, slots, feats, gathered, grads, resolved, keys, step, ok):
        tables, slots = dict(tables), dict(slots)
        fresh = {
            name: _dynamic.Fresh(
                self.table_plans[name].storage,
                keys[name],
                words,
                last,
                count,
                self.dynamic[name].index.bucket_size,
                step,
                self.dynamic[name].compaction,
                self.dynamic[name].draw,
            )
            for name, (words, last, count) in resolved.items()
        }
        for name, inputs in self.plan.inputs(feats, gathered).items():
            calls = _exchange.calls(self.plan, name, inputs)
            # A dynamic table is alone in one call, which updates each row once.
            assert name not in fresh or len(calls) == 1
            for call, part in calls:
                plan, members = call.plan, list(call.tables)
                if len(members) == 1:
                    row_step = _backend.row_step(plan, self.spec, step, ok[members[0]])
                    row_step = dataclasses.replace(row_step, fresh=fresh.get(members[0]))
                else:  # Several members in one call: a skipped one's rows are left alone.
                    members_ok = jnp.stack([ok[m] for m in members])
                    row_step = _backend.row_step(
                        plan, self.spec, step, jnp.any(members_ok), members_ok
                    )
                exchange = _exchange.EXCHANGES[call.exchange]
                tables[name], slots[name] = exchange.update(
                    call,
                    tables[name],
                    slots[name],
                    part,
                    {i.feature.path: grads[i.feature.path] for i in part},
                    row_step,
                    self.axis,
                )
        return tables, slots


class StagedRows(NamedTuple):
    """What `Embedding.stage` returns: the step of the state it read, and {state key:
    ([staged rows of each array], [their values])}."""

    step: Any
    rows: dict


def _staged_rows(staged: StagedRows | None, state: EmbeddingState, where: str) -> dict:
    """`staged.rows` ({} for None), after checking, where both steps are known, that they
    were staged from a state at `state`'s step: another step's rows would be stale."""
    if staged is None:
        return {}
    known = lambda x: not isinstance(x, jax.core.Tracer)  # noqa: E731
    if known(staged.step) and known(state.step) and int(staged.step) != int(state.step):
        raise ValueError(
            f"Embedding.{where}: staged= holds rows staged from a state at step "
            f"{int(staged.step)}, but this state is at step {int(state.step)}; stage the "
            f"state you look up and update."
        )
    return staged.rows
