"""One pure function from (spec, mesh, options) to the frozen `_plan.EmbeddingPlan`.

Everything `Embedding` decides at construction is decided here, once: each table's storage,
row kernel (`backend`) and exchange (`routing`), its capacities, and which tables share
arrays (stacks). Nothing reads a module global: the platform facts that tests vary (lay out
as on TPU, a kernel's VMEM and block size) are options, or fields of the kernel instance
passed as `backend`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    _backend,
    _config,
    _guards,
    _layout,
    _placement,
    _plan,
    _routing,
    _rowindex,
    _storage,
    backends,
)

ROUTINGS = ("auto", "gather", "owner")
# `init` draws about this many bytes per device per round by default.
INIT_BLOCK_BYTES = 1 << 20


def build(
    spec: _config.EmbeddingSpec,
    mesh: jax.sharding.Mesh,
    axis: str,
    *,
    backend: Any = "auto",
    lane_width: int | None = None,
    max_ids_per_shard=None,
    max_unique_ids_per_shard=None,
    routing: Any = "auto",
    stacking: bool = True,
    tpu_layout: bool | None = None,
    init_block_bytes: int = INIT_BLOCK_BYTES,
    cpu_kernels: bool | None = None,
    tpu_kernels: bool | str | None = None,
) -> _plan.EmbeddingPlan:
    """The plan of an `Embedding(spec, mesh, axis, **options)`; see `Embedding` for the
    options. Raises ValueError naming the table and the reason for any option a table
    cannot take."""
    num_shards = int(mesh.shape[axis])
    device = mesh.devices.flat[0]
    platform = device.platform
    tables = spec.tables()
    _guards.check_bool(stacking, "Embedding", "stacking")
    _guards.check_bool(tpu_layout, "Embedding", "tpu_layout", allow_none=True)
    on_tpu = platform == "tpu" if tpu_layout is None else tpu_layout
    if (
        isinstance(init_block_bytes, bool)
        or not isinstance(init_block_bytes, (int, np.integer))
        or init_block_bytes < 1
    ):
        raise ValueError(
            f"Embedding: init_block_bytes must be a positive int, got {init_block_bytes!r}."
        )
    auto_order = legacy_auto_order(platform, cpu_kernels, tpu_kernels, backend)
    asked = per_table("backend", backend, tables, backends.NAMES, backends.Backend)
    asked = {n: b if b == "auto" else backends.named(b) for n, b in asked.items()}
    if lane_width is None:
        wanted = [b for b in asked.values() if isinstance(b, backends.Backend)]
        dense = platform == "tpu" or any(b.lane_width for b in wanted)
        lane_width = 128 if dense else 0
    if lane_width not in (0, 128):
        raise ValueError(f"Embedding: lane_width must be 0 or 128, got {lane_width!r}.")
    max_ids = positive_per_table("max_ids_per_shard", max_ids_per_shard, spec)
    max_unique = positive_per_table("max_unique_ids_per_shard", max_unique_ids_per_shard, spec)
    storages = {}
    for name, table in tables.items():
        opt = spec.optimizer_of(table)
        storages[name] = _storage.TableStorage(
            layout=_layout.TableLayout(
                # The engine's spec has slot tables in place of dynamic ones (_dynamic).
                int(table.vocabulary_size or 0),
                num_shards,
                spec.partition_strategy,
            ),
            dim=table.dim,
            dtype=jnp.dtype(table.dtype),
            slot_specs=tuple(opt.slot_specs()),
            lanes=lane_width,
            dense_update=opt.dense_update,
            on_host=table.on_host,
            cache=cache_shape(table, num_shards),
        )
        if storages[name].layout.rows_per_shard >= _rowindex.MAX_LOCAL_ROWS:
            raise ValueError(
                f"Embedding: table {name!r} would hold "
                f"{storages[name].layout.rows_per_shard} rows per shard; "
                f"at most 2**30 are supported: use more shards."
            )
    check_placements(tables, storages, device)
    routings = choose_routing(tables, routing, asked, storages, platform, num_shards)
    kernels = choose_kernels(spec, asked, storages, platform, routings, auto_order)
    fallback = backends.named("xla")
    table_plans = {
        name: _plan.TablePlan(
            name=name,
            config=table,
            optimizer=spec.optimizer_of(table),
            storage=storages[name],
            backend=kernels[name],
            fallback=fallback,
            index=_rowindex.Arithmetic(((name, storages[name].layout, 0),)),
            max_ids=max_ids.get(name),
            max_unique=max_unique.get(name),
            on_tpu=on_tpu,
            vmem=kernels[name].vmem_bytes(device.device_kind),
            routing=routings[name],
        )
        for name, table in tables.items()
    }
    on_host = frozenset(n for n, s in storages.items() if s.on_host)
    stacks = make_stacks(table_plans, num_shards, stacking, on_host)
    stack_of = {t: key for key, plan in stacks.items() for t in plan.tables}
    names = _config.table_names(spec)
    return _plan.EmbeddingPlan(
        spec=spec,
        axis=axis,
        num_shards=num_shards,
        platform=platform,
        on_tpu=on_tpu,
        lane_width=lane_width,
        tables=_plan.frozen(table_plans),
        stacks=_plan.frozen(stacks),
        stack_of=_plan.frozen(stack_of),
        features=tuple(_plan.FeaturePlan(p, f, names[id(f.table)]) for p, f in spec.flat_features),
        init_block_bytes=int(init_block_bytes),
    )


def per_table(what: str, requested, tables, allowed, instance=None) -> dict:
    """{table name: choice} from an Embedding argument `what`: one of `allowed` (or an
    instance of `instance`) for every table, or {table name: one of them} ("auto" for tables
    left out)."""
    if isinstance(requested, Mapping):
        _known_tables(what, requested, tables)
        per = {name: requested.get(name, "auto") for name in tables}
    else:
        per = {name: requested for name in tables}
    ok = lambda b: (
        (instance is not None and isinstance(b, instance)) or (isinstance(b, str) and b in allowed)
    )
    bad = [b for b in per.values() if not ok(b)]
    if bad:
        also = " or a jte.backends instance" if instance is not None else ""
        raise ValueError(
            f"Embedding: {what} must be one of {list(allowed)}{also} (or a dict of them "
            f"per table), got {bad[0]!r}."
        )
    keep = lambda b: instance is not None and isinstance(b, instance)
    return {n: b if keep(b) else str(b) for n, b in per.items()}


def _known_tables(what: str, given: Mapping, tables) -> None:
    """ValueError naming the keys of `given` (an Embedding argument `what`) that are not
    tables."""
    unknown = sorted(set(given) - set(tables))
    if unknown:
        raise ValueError(
            f"Embedding: {what} names {unknown}, which are not tables; the tables are "
            f"{sorted(tables)}."
        )


def positive_per_table(what: str, value, spec: _config.EmbeddingSpec) -> dict:
    """{table name: positive int} from an Embedding argument `what`: an int or a mapping."""
    tables = spec.tables()
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        value = {name: value for name in tables}
    _known_tables(what, value, tables)
    for name, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(
                f"Embedding: {what} for table {name!r} must be a positive int, got {v!r}."
            )
    return {name: int(v) for name, v in value.items()}


def cache_shape(table: _config.TableConfig, num_shards: int) -> _placement.CacheShape | None:
    """A `HostCached` table's cache on each device: its share of `cache_rows`."""
    cache = table.cache
    if cache is None:
        return None
    rows = -(-cache.cache_rows // num_shards)
    return _placement.CacheShape(rows, cache.ways, cache.max_misses, cache.prefetch)


def check_placements(tables: dict, storages: dict, device) -> None:
    """ValueError naming each host-placed table the mesh or its optimizer cannot serve."""
    problems = []
    for name, storage in storages.items():
        if not storage.on_host:
            continue
        if not _placement.host_memory_supported(device):
            problems.append(
                f"table {name!r} has placement='host' but {device.platform} devices have "
                f"no {_placement.HOST!r} memory"
            )
        cache = storage.cache
        if cache is not None and cache.rows < cache.ways:
            problems.append(
                f"table {name!r}: HostCached gives each of the {storage.layout.num_shards} "
                f"devices {cache.rows} cached rows, fewer than one set of ways={cache.ways}: "
                f"raise cache_rows to at least {cache.ways * storage.layout.num_shards} or "
                f"lower ways"
            )
        elif cache is not None and cache.max_misses and cache.max_misses > cache.rows:
            problems.append(
                f"table {name!r}: HostCached(max_misses={cache.max_misses}) fetches more "
                f"rows per host call than the {cache.rows} rows each device caches: lower "
                f"max_misses or raise cache_rows"
            )
        if storage.dense_update:
            problems.append(
                f"table {name!r} has placement='host' but its optimizer updates every row "
                f"each step (e.g. Adam(lazy_adam=False)), which would move the whole table "
                f"between host and device: use a lazy optimizer or placement='device'"
            )
    if problems:
        raise ValueError("Embedding: " + "; ".join(problems) + ".")


def choose_routing(
    tables: dict, requested, asked: dict, storages: dict, platform: str, num_shards: int
) -> dict[str, str]:
    """{table name: "gather" | "owner"} for `requested` ("auto", a name or {table: name}).

    `asked`: each table's requested kernel ("auto" or a Backend): a kernel that refuses an
    exchange (`Backend.refuses`) is never routed there; "auto" routes a table to owners on
    TPU meshes of `_routing.AUTO_OWNER_SHARDS` shards or more.
    """
    requested = dict(requested) if isinstance(requested, Mapping) else requested
    per = per_table("routing", requested, tables, ROUTINGS)
    out, problems = {}, []
    for name, want in per.items():
        why = _routing.supported(storages[name].layout)
        kernel = asked[name]
        refused = None if kernel == "auto" else kernel.refuses("owner")
        if want == "auto":
            owner = (
                platform == "tpu"
                and num_shards >= _routing.AUTO_OWNER_SHARDS
                and refused is None
                and why is None
            )
            out[name] = "owner" if owner else "gather"
            continue
        if want == "owner":
            why = why or refused
            if why is not None:
                problems.append(f"table {name!r} cannot use routing 'owner': {why}")
        out[name] = want
    if problems:
        raise ValueError("Embedding: " + "; ".join(problems) + ".")
    return out


def choose_kernels(
    spec: _config.EmbeddingSpec,
    asked: dict,
    storages: dict[str, _storage.TableStorage],
    platform: str,
    routings: dict[str, str],
    auto_order: tuple[str, ...] | None = None,
) -> dict[str, _backend.Backend]:
    """{table name: Backend} from `asked` ("auto" or a Backend per table).

    "auto" takes, per table, the first of `auto_order` it can use on its exchange (default
    by platform: TPU "pallas", CPU "cpu"), else "xla", which serves every table and both
    exchanges. An asked kernel that a table cannot use is an error naming the table and the
    reason.
    """
    if auto_order is None:
        auto_order = {"tpu": ("pallas",), "cpu": ("cpu",)}.get(platform, ())
    candidates = [backends.named(b) for b in (*auto_order, "xla")]
    tables = spec.tables()
    chosen, problems = {}, []
    for name, want in asked.items():
        table, storage = tables[name], storages[name]
        opt = spec.optimizer_of(table)
        if want == "auto":
            chosen[name] = next(
                b
                for b in candidates
                if b.unusable(table, opt, storage, platform) is None
                and b.refuses(routings[name]) is None
            )
            continue
        why = want.unusable(table, opt, storage, platform)
        if why is not None:
            problems.append(f"table {name!r} cannot use backend {want.name!r}: {why}")
        chosen[name] = want
    if problems:
        raise ValueError("Embedding: " + "; ".join(problems) + ".")
    return chosen


def legacy_auto_order(platform: str, cpu_kernels, tpu_kernels, backend):
    """The backends "auto" tries first, from the deprecated cpu_kernels / tpu_kernels
    arguments (None when neither is given: the platform's default)."""
    if cpu_kernels is None and tpu_kernels is None:
        return None
    if not isinstance(backend, str) or backend != "auto":
        raise ValueError(
            "Embedding: pass backend= or the deprecated cpu_kernels= / tpu_kernels=, not both."
        )
    warnings.warn(
        "Embedding: cpu_kernels= and tpu_kernels= are deprecated; use backend= "
        "('auto', 'xla', 'pallas', 'pallas_interpret' or 'cpu').",
        DeprecationWarning,
        stacklevel=4,
    )
    if tpu_kernels not in (None, True, False, "interpret"):
        raise ValueError(
            f"Embedding: tpu_kernels must be None, True, False or 'interpret', got {tpu_kernels!r}."
        )
    if tpu_kernels is True and platform != "tpu":
        raise ValueError(
            f"Embedding: tpu_kernels=True needs a TPU mesh; this one is on "
            f"{platform!r} (use 'interpret' to run the kernels in Pallas' "
            f"interpreter)."
        )
    if cpu_kernels and platform != "cpu":
        raise ValueError(
            f"Embedding: cpu_kernels=True needs a CPU mesh; this one is on {platform!r}."
        )
    order = []
    if tpu_kernels == "interpret":
        order.append("pallas_interpret")
    elif tpu_kernels is not False and platform == "tpu":
        order.append("pallas")
    if cpu_kernels is not False and platform == "cpu":
        order.append("cpu")
    return tuple(order)


def make_stacks(
    table_plans: dict[str, _plan.TablePlan],
    num_shards: int,
    stacking: bool,
    alone_tables: frozenset = frozenset(),
) -> dict[str, _plan.TablePlan]:
    """{state key: its plan}, in the order of each stack's first table: a table stored
    alone is a stack of its own, under its name; several tables sharing arrays are one
    under their names joined by "+". Only owner-routed float32 tables without stochastic
    rounding or a dense optimizer stack, with tables of the same dim, optimizer (object),
    kernel and capacity defaults."""
    groups: dict[tuple, list[str]] = {}
    for name, plan in table_plans.items():
        alone = (
            not stacking
            or name in alone_tables
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
                plan.backend,
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
            rows = sum(table_plans[n].layout.rows_per_shard + 128 for n in chunks[-1])
            rows += table_plans[name].layout.rows_per_shard + 128
            stackable = rows < _rowindex.MAX_LOCAL_ROWS and _rowindex.fits_owner_keys(
                num_shards, rows
            )
            if chunks[-1] and not stackable:
                chunks.append([])
            chunks[-1].append(name)
    order = list(table_plans)
    chunks.sort(key=lambda chunk: order.index(chunk[0]))
    stacks = [_stack([table_plans[n] for n in chunk]) for chunk in chunks]
    keys = [plan.name for plan in stacks]
    clash = sorted({k for k in keys if keys.count(k) > 1})
    if clash:  # A table named like a stack ("a+b"): their state would share a key.
        raise ValueError(
            f"Embedding: the state keys {clash} name both a table and a stack of "
            f"tables; rename the table or pass stacking=False."
        )
    return {plan.name: plan for plan in stacks}


def _stack(plans: list[_plan.TablePlan]) -> _plan.TablePlan:
    if len(plans) == 1:
        return plans[0]
    storage, members = _storage.stack([(p.name, p.storage) for p in plans])
    capacities = tuple((p.max_ids, p.max_unique) for p in plans)
    return dataclasses.replace(
        plans[0],
        name="+".join(p.name for p in plans),
        storage=storage,
        members=members,
        member_capacities=capacities,
        index=_rowindex.Arithmetic(
            tuple((m.name, m.layout, m.offset) for m in members), stacked=True
        ),
        **_plan.capacity_sums(list(capacities)),
    )
