"""The backend seam: who does the shard-local row work of a table, chosen once per table.

Inside `shard_map`, each device embeds its examples and updates its rows. Everything about a
table that is not a choice of kernels is shared (ownership and storage: `_storage`; the
sorted (id, position) pair streams: `_streams`; the optimizer's per-row step: `RowStep`). A
`Backend` does the rest, for one table at a time:

- `lookup(plan, table, inputs, axis)`: this device's activations of the table's features;
- `update(plan, table, slots, inputs, grads, row_step, axis)`: one sparse step on this
  device's shard of the table and its stored slots.

Implementations, each in a module of its own:

    "xla"               _xla_backend.XlaBackend   portable XLA passes, any mesh and table
    "pallas"            _pallas.PallasBackend     fused Pallas TPU kernels (TPU meshes)
    "pallas_interpret"  _pallas.PallasBackend     the same kernels in Pallas' interpreter
    "cpu"               _cpu_kernels.CpuBackend   C++ kernels through XLA FFI (CPU meshes)

`Embedding(backend=...)` names one for every table or {table: name}; "auto" takes the
fastest one each table can use on its mesh (`choose`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _config, _optimizers, _storage

NAMES = ("auto", "xla", "pallas", "pallas_interpret", "cpu")


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """Static facts of one table that the backends need.

    Attributes:
        name: The table's name.
        config: Its TableConfig.
        optimizer: Its optimizer (the table's own or the spec's).
        storage: Its physical form.
        backend: Who does its row work.
        max_ids: Pairs per shard and pass of the XLA passes (`_streams.capacity`); None:
            automatic.
        max_unique: Distinct rows per shard and pass; None: = the pairs per pass.
        on_tpu: The mesh is made of TPUs: passes over each shard's share of the pairs, and ids
            flattened as the TPU stores them (`_streams`).
        vmem: VMEM bytes per TensorCore of the mesh's TPUs (sizes the Pallas kernels).
        routing: "gather" (every device sees the global batch's ids: `_streams`) or
            "owner" (ids travel to the rows' owners: `_routing`).
        members: For a stack of several tables in one array (`_storage.stack`), each
            member's name, own layout and first local row in the stack's shards; () for
            a table stored alone.
    """

    name: str
    config: _config.TableConfig
    optimizer: _optimizers.Optimizer
    storage: _storage.TableStorage
    backend: Backend
    max_ids: int | None = None
    max_unique: int | None = None
    on_tpu: bool = False
    vmem: int = 16 << 20
    routing: str = "gather"
    members: tuple = ()

    @property
    def layout(self):
        return self.storage.layout

    def owner_and_local(self, table: str, ids):
        """(owner shard, local row in this plan's array) of ids of table `table`: its own
        layout's, offset by its first row in the stack for a stacked table."""
        for member in self.members:
            if member.name == table:
                owner, local = member.layout.owner_and_local(ids)
                return owner, local + member.offset
        return self.layout.owner_and_local(ids)


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
    float32, or None when the feature has none (derived from the ids where needed)."""

    feature: FeaturePlan
    ids: jax.Array
    weights: jax.Array | None


@dataclasses.dataclass(frozen=True)
class RowStep:
    """One step's optimizer work on ONE row, for every backend.

    `row_fn(g (D,), [row, *slots], scalars) -> [new row, *new slots]` applies the gradient
    multiplier and clipping, the optimizer's update_row and its extras (weight decay, weight
    clipping); `scalars` (n,) float32 holds the step's learning rate, hyperparameters and
    multiplier, so a kernel can take them as one operand. The C++ kernels read the same
    facts as fields.
    """

    scalars: jax.Array
    row_fn: Callable
    learning_rate: jax.Array
    multiplier: jax.Array | None
    clipping_limit: float | None
    step: jax.Array | None = None  # The step's int32 number (keys stochastic rounding).
    # False: the table is skipped this step; the backend then reads and writes none of its
    # rows (its pair count or row indices say "none"), at no cost beyond the touched rows.
    ok: jax.Array | None = None
    # A stack's step done in one call (owner routing): (members,) bool, False for a skipped
    # member, whose rows the call then leaves alone; `ok` is then whether any is kept.
    members_ok: jax.Array | None = None


class StepValues(NamedTuple):
    """A table's scalars at one step: its learning rate, then its hyperparameters and the
    spec's gradient multiplier (None when the spec has none)."""

    learning_rate: jax.Array
    hyperparameters: tuple
    multiplier: jax.Array | None

    @property
    def others(self) -> list:
        return [*self.hyperparameters, *([] if self.multiplier is None else [self.multiplier])]


def step_values(plan: TablePlan, spec: _config.EmbeddingSpec, step) -> StepValues:
    """`plan`'s table's scalars at `step`. A function giving anything but a real scalar is a
    ValueError at trace time naming the table and the function."""
    opt = plan.optimizer
    where = f"Table {plan.name!r}: {type(opt).__name__}"
    lr = _optimizers.evaluate(opt.learning_rate, step, f"{where} learning_rate(step)")
    hps = tuple(
        _optimizers.evaluate(h, step, f"{where} hyperparameters[{i}](step)")
        for i, h in enumerate(opt.hyperparameter_values())
    )
    multiplier = None
    if spec.gradient_multiplier_fn is not None:
        multiplier = _optimizers.evaluate(
            spec.gradient_multiplier_fn, step, "EmbeddingSpec: gradient_multiplier_fn(step)"
        )
    return StepValues(lr, hps, multiplier)


def row_step(
    plan: TablePlan, spec: _config.EmbeddingSpec, step, ok=None, members_ok=None
) -> RowStep:
    """The RowStep of `plan`'s table at `step` (an int32 scalar). `ok` (bool scalar, or None
    for always): when False, each backend touches no row of the table (`RowStep.ok`);
    `members_ok`: see `RowStep`."""
    opt = plan.optimizer
    lr, hps, multiplier = step_values(plan, spec, step)
    scalars = [lr, *hps]
    if multiplier is not None:
        scalars.append(multiplier)
    limit = spec.clipping_limit

    def row_fn(g, values, s):
        lr, row = s[0], values[0].astype(jnp.float32)
        if multiplier is not None:
            g = g * s[-1]
        if limit is not None:
            g = jnp.clip(g, -limit, limit)
        g = opt.clip_gradient(g)
        out = opt.update_row(g, row, list(values[1:]), lr, tuple(s[1 : 1 + len(hps)]))
        return [opt.finish_row(out[0], row, lr)] + list(out[1:])

    return RowStep(
        jnp.stack(scalars),
        row_fn,
        lr,
        multiplier,
        limit,
        jnp.asarray(step, jnp.int32),
        ok,
        members_ok,
    )


class Backend:
    """The shard-local row work of one table; see the module docstring."""

    name: str = ""

    def unusable(
        self,
        table: _config.TableConfig,
        optimizer: _optimizers.Optimizer,
        storage: _storage.TableStorage,
        platform: str,
    ) -> str | None:
        """Why this backend cannot serve that table on a mesh of `platform` devices, or
        None if it can."""
        raise NotImplementedError

    def lookup(
        self, plan: TablePlan, table: jax.Array, inputs: list[Input], axis: str
    ) -> dict[str, jax.Array]:
        """{feature path: (b, D), or (b·L, D) for a sequence feature} for this device's b
        examples of every feature in `inputs` (all of them of this table)."""
        raise NotImplementedError

    def update(
        self,
        plan: TablePlan,
        table: jax.Array,
        slots: dict,
        inputs: list[Input],
        grads: dict[str, jax.Array],
        step: RowStep,
        axis: str,
    ) -> tuple:
        """(new table, new {stored slot: array}) after one sparse step from this device's
        activation gradients {path: (b, D) or (b, L, D)}."""
        raise NotImplementedError

    def single_pass(self, plan: TablePlan, out_rows: int) -> bool:
        """Whether every update of a batch with `out_rows` output rows takes one pass over
        the pairs, whatever `max_ids_per_shard` says (`Embedding.id_counts`)."""
        del plan, out_rows
        return False

    def __repr__(self):
        return f"<backend {self.name}>"


def _implementations() -> dict[str, Backend]:
    # Imported here: the implementations import this module for the interface.
    from . import _cpu_kernels, _pallas, _xla_backend

    return {
        "xla": _xla_backend.XlaBackend(),
        "pallas": _pallas.PallasBackend(),
        "pallas_interpret": _pallas.PallasBackend(interpret=True),
        "cpu": _cpu_kernels.CpuBackend(),
    }


def per_table_choice(what: str, requested, tables, allowed) -> dict[str, str]:
    """{table name: choice} from an Embedding argument `what`: one of `allowed` for every
    table, or {table name: one of them} ("auto" for tables left out)."""
    if isinstance(requested, Mapping):
        unknown = sorted(set(requested) - set(tables))
        if unknown:
            raise ValueError(
                f"Embedding: {what} names {unknown}, which are not tables; the "
                f"tables are {sorted(tables)}."
            )
        per_table = {name: str(requested.get(name, "auto")) for name in tables}
    else:
        per_table = {name: requested for name in tables}
    bad = sorted({b for b in per_table.values() if b not in allowed}, key=str)
    if bad:
        raise ValueError(
            f"Embedding: {what} must be one of {list(allowed)} (or a dict of them "
            f"per table), got {bad[0]!r}."
        )
    return per_table


def choose(
    spec: _config.EmbeddingSpec,
    requested: str | Mapping[str, str],
    storages: dict[str, _storage.TableStorage],
    platform: str,
    *,
    auto_order: tuple[str, ...] | None = None,
) -> dict[str, Backend]:
    """{table name: Backend} for `requested` ("auto", a name, or {table: name}).

    "auto" takes, per table, the first of `auto_order` it can use (default by platform:
    TPU "pallas", CPU "cpu", then "xla", which serves every table). A named backend that a
    table cannot use is an error naming the table and the reason.
    """
    tables = spec.tables()
    per_table = per_table_choice("backend", requested, tables, NAMES)
    if auto_order is None:
        auto_order = {"tpu": ("pallas",), "cpu": ("cpu",)}.get(platform, ())
    impls = _implementations()
    chosen, problems = {}, []
    for name, want in per_table.items():
        table, storage = tables[name], storages[name]
        opt = spec.optimizer_of(table)
        if want == "auto":
            chosen[name] = next(
                impls[b]
                for b in (*auto_order, "xla")
                if impls[b].unusable(table, opt, storage, platform) is None
            )
            continue
        why = impls[want].unusable(table, opt, storage, platform)
        if why is not None:
            problems.append(f"table {name!r} cannot use backend {want!r}: {why}")
        chosen[name] = impls[want]
    if problems:
        raise ValueError("Embedding: " + "; ".join(problems) + ".")
    return chosen


def legacy_auto_order(platform: str, cpu_kernels, tpu_kernels, backend):
    """The backends "auto" tries first, from the deprecated cpu_kernels / tpu_kernels
    arguments (None when neither is given: the platform's default)."""
    if cpu_kernels is None and tpu_kernels is None:
        return None
    if backend != "auto":
        raise ValueError(
            "Embedding: pass backend= or the deprecated cpu_kernels= / tpu_kernels=, not both."
        )
    warnings.warn(
        "Embedding: cpu_kernels= and tpu_kernels= are deprecated; use backend= "
        "('auto', 'xla', 'pallas', 'pallas_interpret' or 'cpu').",
        DeprecationWarning,
        stacklevel=3,
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
