"""The row-kernel seam: who does the shard-local row work of a table, and its per-row step.

Inside `shard_map`, each device embeds its examples and updates its rows. Two protocols
split that work:

- an exchange (`_exchange`: "gather" or "owner") brings each device the ids of the rows it
  owns and takes the results back;
- a row kernel (`Backend`, below) reads and updates one shard's rows: the XLA ops
  (`_xla_backend`), the fused Pallas TPU kernels (`_pallas`) or the C++ CPU kernels
  (`_cpu_kernels`). A kernel serves the "gather" exchange with `lookup` / `update` (it
  consumes the all-gathered batch through `_streams`) and the "owner" exchange with the
  row work `routed` gives (`RoutedRows`: it reads and updates the rows routed to it).

Everything about a table that is not a choice of kernels is shared (ownership: `_rowindex`;
storage: `_storage`; the pair streams: `_streams`; the optimizer's per-row step: `RowStep`).
No exchange imports a kernel: each call's kernel, capacities and fallback are decided once
(`_exchange.calls`) and handed to both in a `_plan.CallPlan`. `_backends` holds the
implementations and the choice among them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _config, _optimizers, _plan, _storage


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
    # fresh(values, rows) -> values: the rows read for the update ([table, *stored slots]
    # at the local rows `rows`), some replaced by the values they start this step from. A
    # dynamic table in host memory gives its new ids their initial rows this way, inside
    # the update's one read and write of those rows (`_dynamic.Fresh`; XLA backend only).
    fresh: Callable | None = None


class StepValues(NamedTuple):
    """A table's scalars at one step: its learning rate, then its hyperparameters and the
    spec's gradient multiplier (None when the spec has none)."""

    learning_rate: jax.Array
    hyperparameters: tuple
    multiplier: jax.Array | None

    @property
    def others(self) -> list:
        return [*self.hyperparameters, *([] if self.multiplier is None else [self.multiplier])]


def step_values(plan: _plan.TablePlan, spec: _config.EmbeddingSpec, step) -> StepValues:
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
    plan: _plan.TablePlan, spec: _config.EmbeddingSpec, step, ok=None, members_ok=None
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
    """A row kernel: the shard-local row work of a table (see the module docstring).

    Attributes:
        name: Its name in `Embedding(backend=...)` and `Embedding.backends`.
        lane_width: 128 when its kernels want narrow rows packed lane-dense (the default
            `lane_width` of an Embedding using it), else 0.
        one_pass: Its "gather" update takes every owned pair in one call, whatever the
            capacities say (kernels that walk the pairs); False: passes of C pairs.
    """

    name: str = ""
    lane_width: int = 0
    one_pass: bool = False

    def unusable(
        self,
        table: _config.TableConfig,
        optimizer: _optimizers.Optimizer,
        storage: _storage.TableStorage,
        platform: str,
    ) -> str | None:
        """Why this kernel cannot serve that table on a mesh of `platform` devices, or None
        if it can."""
        raise NotImplementedError

    def refuses(self, routing: str) -> str | None:
        """Why this kernel cannot serve the exchange `routing`, or None if it can."""
        del routing
        return None

    def vmem_bytes(self, device_kind: str) -> int:
        """On-chip memory per core its kernels size against, on devices of this kind."""
        del device_kind
        return 16 << 20

    def lane_rows(self, plan: _plan.TablePlan) -> int:
        """k, the logical rows per lane-dense row of its kernels' activations; 0 when its
        row work is XLA ops, which hold nothing resident."""
        del plan
        return 0

    def holds(self, plan: _plan.TablePlan, rows: int) -> bool:
        """Whether its kernels can hold a resident block of `rows` lane-dense rows (the
        activations or the exchanged rows of one call)."""
        del plan, rows
        return True

    def most_rows(self, plan: _plan.TablePlan) -> int:
        """The most lane-dense rows `holds` takes (lane_rows > 0 only)."""
        raise NotImplementedError

    def lookup(
        self, call: _plan.CallPlan, table: jax.Array, inputs: list[_plan.Input], axis: str
    ) -> dict[str, jax.Array]:
        """The "gather" exchange: {feature path: (b, D), or (b·L, D) for a sequence
        feature} for this device's b examples of every feature in `inputs` (all of them of
        the call's table)."""
        raise NotImplementedError

    def update(
        self,
        call: _plan.CallPlan,
        table: jax.Array,
        slots: dict,
        inputs: list[_plan.Input],
        grads: dict[str, jax.Array],
        step: RowStep,
        axis: str,
    ) -> tuple:
        """The "gather" exchange: (new table, new {stored slot: array}) after one sparse
        step from this device's activation gradients {path: (b, D) or (b, L, D)}."""
        raise NotImplementedError

    def routed(self, call: _plan.CallPlan, pairs: int, received: int) -> RoutedRows:
        """The "owner" exchange's row work for one call: `pairs` local pairs per device,
        at most `received` rows reaching an owner per round."""
        raise NotImplementedError

    def __repr__(self):
        return f"<backend {self.name}>"


class RoutedRows:
    """A row kernel's work inside owner routing (`_routing`), for one call.

    `local` is one device's sorted pairs (`_routing.Local`: `keys`, `out`, `scale`,
    `segment`, `pairs`, `rows`) and `r` one round (`_routing.Round`: `pair_slot`,
    `pair_in_round`, `valid`, `rows_of`). Rows travel as this kernel lays them out: (n, D)
    for XLA ops, k to a lane-dense row for the kernels.
    """

    k: int = 1  # Logical rows per lane-dense row of activations and exchanged rows.

    def owner_rows(self, table, rows):
        """The owner's rows `rows` (local rows, >= NOT_MINE: none), to send back."""
        raise NotImplementedError

    def combine(self, local, r, back, acc):
        """acc plus each pair's scaled row of `back` (the rows this round got back)."""
        raise NotImplementedError

    def zeros(self, rows: int):
        """The activations' accumulator for `rows` output rows."""
        raise NotImplementedError

    def unpack(self, acc, rows: int):
        """The accumulator as (rows, D) activations."""
        raise NotImplementedError

    def gradients(self, local, grad_rows):
        """What `send` reads: the activation gradients (rows, D) as this kernel needs them."""
        raise NotImplementedError

    def send(self, local, r, g):
        """The summed gradients of the distinct rows this round sends."""
        raise NotImplementedError

    def owner_update(self, table, slots, rows, grads, step: RowStep, axis: str):
        """(table, slots) after the owner applies the received gradients to `rows`."""
        raise NotImplementedError
