"""The exchanges, and the one decision per call of which kernel does its row work, and at what
size.

An exchange brings each device the ids of the rows it owns and takes the results back:

    "gather"   every device all-gathers the global batch's ids and keeps the pairs it owns;
               the call's row kernel reads them through `_streams` (`Backend.lookup` /
               `Backend.update`)
    "owner"    each device sends its own examples' distinct ids to their owners with
               all_to_all and gets rows back (`_routing`); the call's row kernel does the
               owners' reads and updates (`Backend.routed`)

A call is the row work of one table, one stack, or one part of a stack whose members do not
all fit one call of its kernel. `calls` makes each call's `_plan.CallPlan` from shapes alone,
once, and the step, `Embedding.id_counts`, `Embedding.call_plans` and `jte.plan` all read
it: which kernel really runs (the table's backend, or its fallback when the backend cannot
hold the call, which the plan says), and its capacities. Every exchange works with every
row kernel that does not refuse it (`Backend.refuses`), through the two protocols only.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from . import _plan, _routing, _streams
from ._rowindex import NOT_MINE


class Exchange:
    """How ids reach the rows' owners and results come back; see the module docstring."""

    name: str = ""

    def plan_call(self, plan: _plan.TablePlan, inputs: list, n: int) -> _plan.CallPlan:
        """The call doing the row work of `inputs` (one device's; shapes suffice), n devices."""
        raise NotImplementedError

    def lookup(self, call: _plan.CallPlan, table, inputs: list, axis: str) -> dict:
        """{feature path: this device's activations} of the call's features."""
        raise NotImplementedError

    def update(self, call: _plan.CallPlan, table, slots, inputs, grads, step, axis: str):
        """(table, slots) after one sparse step of the call's tables."""
        raise NotImplementedError

    def rows_read(self, call: _plan.CallPlan, inputs: list, axis: str) -> tuple:
        """(rows, limit): local rows of this device's shard (int32, NOT_MINE: none) that
        the call's lookup and update will read, and how many distinct ones to stage
        (`Embedding.stage`): what one pass or round reads. Rows left out are read where
        they are needed, so this bounds the staging's cost, never a value."""
        raise NotImplementedError


class Gather(Exchange):
    name = "gather"

    def plan_call(self, plan, inputs, n):
        kernel, why = plan.backend, None
        k = kernel.lane_rows(plan)
        if k:
            rows = n * _streams.output_rows(inputs, k) // k
            if not kernel.holds(plan, rows):
                why = (
                    f"the {rows} lane-dense rows of its activations do not fit the "
                    f"{kernel.name} kernels' memory ({plan.vmem} bytes)"
                )
                kernel, k = plan.fallback, 1
        pairs = sum(i.ids.size for i in inputs)
        c = _streams.capacity(plan, n * pairs, n)
        cu = _streams.unique_capacity(plan, c)
        single = kernel.one_pass
        return _plan.CallPlan(plan, "gather", kernel, why, c, cu, max(k, 1), single, pairs)

    def lookup(self, call, table, inputs, axis):
        return call.kernel.lookup(call, table, inputs, axis)

    def update(self, call, table, slots, inputs, grads, step, axis):
        return call.kernel.update(call, table, slots, inputs, grads, step, axis)

    def rows_read(self, call, inputs, axis):
        rows = []
        for i in inputs:
            ids_all, _ = _streams.gathered(i, axis)
            mine, local = _streams.owned(call.plan, i.feature, ids_all, axis)
            rows.append(jnp.where(mine, local, NOT_MINE).reshape(-1))
        return jnp.concatenate(rows), call.capacity


class Owner(Exchange):
    name = "owner"

    def plan_call(self, plan, inputs, n):
        return _routing.plan_call(plan, inputs, n)

    def lookup(self, call, table, inputs, axis):
        return _routing.lookup(call, table, inputs, axis)

    def update(self, call, table, slots, inputs, grads, step, axis):
        return _routing.update(call, table, slots, inputs, grads, step, axis)

    def rows_read(self, call, inputs, axis):
        rows = _routing.rows_read(call, inputs, axis)
        return rows, rows.shape[0]


EXCHANGES: dict[str, Exchange] = {"gather": Gather(), "owner": Owner()}


def calls(plan: _plan.EmbeddingPlan, key: str, inputs: list) -> list[tuple[_plan.CallPlan, list]]:
    """[(call plan, its inputs)] of the row work of state key `key` on `inputs` (shapes
    suffice): a stack's in one call (one sort, one exchange per round, one kernel) when its
    kernel holds it at the capacity that fits (more exchanged rows than it holds only
    means more rounds), else in parts of consecutive whole members that it holds; a member
    too big alone takes the fallback, as it would unstacked. Members' rows are disjoint: a
    split is the same update."""
    stack = plan.stacks[key]
    exchange, n = EXCHANGES[stack.routing], plan.num_shards
    if not stack.members:
        return [(exchange.plan_call(stack, inputs, n), inputs)]

    def call(part: list) -> _plan.CallPlan:
        tables = list(dict.fromkeys(i.feature.table for i in part))
        return exchange.plan_call(plan.part(stack, tables), part, n)

    groups: list[list] = []  # The inputs of each member, in member order.
    for i in inputs:
        if groups and groups[-1][-1].feature.table == i.feature.table:
            groups[-1].append(i)
        else:
            groups.append([i])
    parts: list[list] = []
    for group in groups:
        joined = parts[-1] + group if parts else None
        if joined and call(joined).fallback is None:
            parts[-1] = joined
        else:
            parts.append(group)
    return [(call(part), part) for part in parts]


def plan_calls(
    plan: _plan.EmbeddingPlan, shapes: Mapping
) -> dict[str, tuple[_plan.CallPlan, list]]:
    """{key: (call plan, its inputs as shapes)} of every call the row work makes when each
    device holds ids of these (b, L) shapes ({feature path: shape}): a table alone or a
    stack under its state key, a stack that runs in parts one entry per part, under
    "key#i". On the host, for `id_counts`, `call_plans` and `jte.plan`."""
    feats = {p: (jax.ShapeDtypeStruct(tuple(s), jnp.int32), None) for p, s in shapes.items()}
    out = {}
    for key, inputs in plan.inputs(feats).items():
        parts = calls(plan, key, inputs)
        for i, part in enumerate(parts):
            out[key if len(parts) == 1 else f"{key}#{i}"] = part
    return out
