"""The plan's types: frozen facts about tables, features and calls that the step reads.

Nothing here decides anything: `_planner.build` makes an `EmbeddingPlan` from (spec, mesh,
options), and `_exchange.calls` makes a `CallPlan` for each call of the row work. Every
reader (the step, `id_counts`, `jte.plan`, the stack splitting) reads the same objects, and
none of them can be changed after they are built (frozen dataclasses, read-only mappings).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from . import _config, _optimizers, _rowindex, _storage


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """Static facts of one array's tables: a table stored alone, or a stack of several.

    Attributes:
        name: The table's name, or the stack's state key ("a+b").
        config: Its TableConfig (a stack's: its first member's).
        optimizer: Its optimizer (the table's own or the spec's).
        storage: Its physical form.
        backend: The row kernel the table asked for (`_backend.Backend`); the kernel that
            really does a call's row work is the call's (`CallPlan.kernel`).
        fallback: The row kernel that serves a call the backend cannot hold (XLA ops).
        index: Where its ids live (`_rowindex`).
        max_ids: Pairs per shard and pass (gather) or ids per shard and round (owner);
            None: automatic.
        max_unique: Distinct rows per shard and pass; None: = the pairs per pass.
        on_tpu: Lay out and size as on TPU meshes: passes over each shard's share of the
            pairs, and ids flattened as the TPU stores them (`_streams`).
        vmem: VMEM bytes per TensorCore that the backend's kernels size against.
        routing: "gather" (every device sees the global batch's ids: `_streams`) or
            "owner" (ids travel to the rows' owners: `_routing`).
        members: For a stack of several tables in one array (`_storage.stack`), each
            member's name, own layout and first local row in the stack's shards; () for
            a table stored alone.
        member_capacities: (max_ids, max_unique) of each member, for the plans of a
            stack's parts (`EmbeddingPlan.part`).
    """

    name: str
    config: _config.TableConfig
    optimizer: _optimizers.Optimizer
    storage: _storage.TableStorage
    backend: Any
    fallback: Any
    index: _rowindex.Arithmetic
    max_ids: int | None = None
    max_unique: int | None = None
    on_tpu: bool = False
    vmem: int = 16 << 20
    routing: str = "gather"
    members: tuple = ()
    member_capacities: tuple = ()

    @property
    def layout(self):
        return self.storage.layout

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables stored in this plan's arrays."""
        return tuple(m.name for m in self.members) or (self.name,)

    @property
    def offsets(self) -> dict[str, int]:
        """{table: the first local row of its block in every shard of these arrays}."""
        return {m.name: m.offset for m in self.members} or {self.name: 0}


@dataclasses.dataclass(frozen=True)
class FeaturePlan:
    """One feature: its path ("a/b" when nested), config and table name."""

    path: str
    config: _config.FeatureConfig
    table: str

    @property
    def table_config(self) -> _config.TableConfig:
        """The feature's table (a name only in compat's dict form, never in a spec)."""
        table = self.config.table
        assert isinstance(table, _config.TableConfig)
        return table


class Input(NamedTuple):
    """One feature's shard of the batch: ids (b, L) int32, -1 where none; weights (b, L)
    float32, or None when the feature has none (derived from the ids where needed).
    `ids_all`, `weights_all`: the global batch's ids and weights (N·b, L), device by
    device, when the caller has them already (a dynamic table's rows, which its resolution
    sums over the devices, and their factors, which every device computes from the
    gathered ids), so that an exchange gathers neither; None: the exchange gathers them."""

    feature: FeaturePlan
    ids: jax.Array
    weights: jax.Array | None
    ids_all: jax.Array | None = None
    weights_all: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One call of the row work: a table, a stack or a part of one, for inputs of given
    shapes. Made once on the host from shapes (`_exchange.calls`); the step, `id_counts`,
    `jte.plan` and the stack splitting all read it.

    Attributes:
        plan: The plan of the table, stack or part the call serves.
        exchange: "gather" or "owner": how the ids reach the rows' owners.
        kernel: The row kernel that really does the work: the table's backend, or its
            fallback when the backend cannot hold the call (`fallback`).
        fallback: Why the table's backend does not do it (None: it does).
        capacity: gather: C, the pairs one shard takes per pass; owner: Cd, the distinct
            rows one device sends one owner per round.
        unique: gather: Cu, the distinct rows one pass updates; owner: = capacity.
        k: Logical rows per lane-dense row of the kernel's activations (1: XLA rows).
        single: gather: one pass takes every pair whatever the data (the kernels walk
            them all); owner: one round always suffices (Cd >= pairs).
        pairs: One device's (id, position) pairs of the call.
    """

    plan: TablePlan
    exchange: str
    kernel: Any
    fallback: str | None
    capacity: int
    unique: int
    k: int
    single: bool
    pairs: int

    @property
    def tables(self) -> tuple[str, ...]:
        return self.plan.tables


def frozen(mapping: Mapping) -> types.MappingProxyType:
    """A read-only view of a copy of `mapping`: an attempted write raises TypeError."""
    return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
    """Everything `Embedding` decided at construction, read-only (`_planner.build`).

    Attributes:
        spec: The EmbeddingSpec.
        axis: The mesh axis of the rows and the batch; num_shards: its size N.
        platform: The mesh's devices' platform; on_tpu: laid out as on TPU meshes.
        lane_width: 128 (narrow rows packed into 128-lane rows) or 0.
        tables: {table name: its plan as if stored alone}.
        stacks: {state key: the plan of its array}; a table stored alone is its own key.
        stack_of: {table name: its state key}.
        features: Every feature's plan, in the spec's order.
        init_block_bytes: What `init` draws per device and round (its transient memory).
    """

    spec: _config.EmbeddingSpec
    axis: str
    num_shards: int
    platform: str
    on_tpu: bool
    lane_width: int
    tables: Mapping[str, TablePlan]
    stacks: Mapping[str, TablePlan]
    stack_of: Mapping[str, str]
    features: tuple[FeaturePlan, ...]
    init_block_bytes: int

    def part(self, plan: TablePlan, tables: list[str]) -> TablePlan:
        """A stack's plan for the members `tables` alone (one call of a stack run in parts):
        their capacities summed (None: default)."""
        if len(tables) == len(plan.members):
            return plan
        by_name = dict(zip(plan.tables, zip(plan.members, plan.member_capacities)))
        members, capacities = zip(*(by_name[t] for t in tables))
        return dataclasses.replace(
            plan,
            members=tuple(members),
            member_capacities=tuple(capacities),
            **capacity_sums(list(capacities)),
        )

    def inputs(
        self, feats: Mapping[str, tuple], gathered: Mapping[str, tuple] | None = None
    ) -> dict[str, list[Input]]:
        """{state key: the Inputs of its tables' features, in member order} from {feature
        path: (ids, weights)} and the global batch of those that have it ({feature path:
        (`Input.ids_all`, `Input.weights_all`)}); keys without features are left out."""
        gathered = gathered or {}
        by_table: dict[str, list[Input]] = {}
        for f in self.features:
            if f.path in feats:
                ids, weights = feats[f.path]
                ids_all, weights_all = gathered.get(f.path, (None, None))
                by_table.setdefault(f.table, []).append(
                    Input(f, ids, weights, ids_all, weights_all)
                )
        return {
            name: [i for t in plan.tables for i in by_table.get(t, [])]
            for name, plan in self.stacks.items()
            if any(t in by_table for t in plan.tables)
        }


def capacity_sums(capacities: list[tuple[int | None, int | None]]) -> dict:
    """max_ids and max_unique of tables together from each one's (max_ids, max_unique):
    their sums (None: the default, when the first table has none)."""
    out = {}
    for i, field in enumerate(("max_ids", "max_unique")):
        values = [c[i] for c in capacities]
        out[field] = None if values[0] is None else sum(v or 0 for v in values)
    return out
