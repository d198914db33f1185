"""Checks at the public entry points that are cheaper than what they prevent.

`check_not_consumed`: a state whose arrays were donated to an earlier call (eager
`apply_gradients`, a train step) holds deleted arrays. Handing one to a jitted program again
raises a bare `RuntimeError: Array has been deleted` at best; with donation on some jax builds
it crashes the process (openxla/xla issue 22604). Every entry point that takes a state calls
this first: one `is_deleted()` per leaf, no device work.

`check_restored`: tables and slots that come from outside the library's own updates
(`restore_tables`, checkpoints) must be finite, and each slot inside its optimizer's domain
(`SlotSpec.low`: Adagrad's accumulators > 0 where it divides by their square root, ...),
since the next update of a row outside it writes non-finite values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from . import _optimizers


def _is_deleted(leaf: Any) -> bool:
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
        return False
    return leaf.is_deleted()


def _deleted_leaf(tree: Any) -> str | None:
    """The path of the first deleted array of `tree` (tracers skipped), or None."""
    if not any(_is_deleted(leaf) for leaf in jax.tree.leaves(tree)):
        return None  # The common case, without building every leaf's path.
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if _is_deleted(leaf):
            return jax.tree_util.keystr(path)
    return None


def check_not_consumed(
    tree: Any, where: str, what: str = "state", name: str = "state", advice: str | None = None
) -> None:
    """ValueError if an array of `tree` was deleted (donated to an earlier call).

    Args:
        tree: The state (or any pytree of arrays) an entry point was given.
        where: The entry point, e.g. "Embedding.lookup", named first in the message.
        what: What `tree` is to the user ("state", "train state", "tables", "model").
        name: How the message spells `tree` in code, before the deleted leaf's path.
        advice: What to do instead, replacing "use the one that call returned".
    """
    path = _deleted_leaf(tree)
    if path is None:
        return
    if advice is None:
        advice = (
            f"Use the {what} that call returned; to keep the old one, copy it before that "
            f"call (jax.tree.map(jnp.copy, {name}))."
        )
    verb = "were" if what.endswith("s") else "was"
    raise ValueError(
        f"{where}: the {what} {verb} consumed by an earlier call that donated its arrays "
        f"({name}{path} is a deleted array). {advice}"
    )


# ------------------------------------------------------------ restored values


@dataclasses.dataclass(frozen=True)
class Restored:
    """One array handed to the state from outside (restore_tables, a checkpoint): the
    table's rows (`slot` None) or one of its slots', logical, its first `rows` rows real."""

    table: str
    slot: _optimizers.SlotSpec | None
    array: Any  # np.ndarray or jax.Array, (R, D) or (R,), R >= rows.
    rows: int
    optimizer: str = ""

    def rule(self) -> str:
        if self.slot is None or self.slot.low is None:
            return "finite"
        return f"finite and {'>' if self.slot.low_open else '>='} {self.slot.low:g}"

    def what(self) -> str:
        if self.slot is None:
            return f"table {self.table!r}"
        return f"slot {self.slot.name!r} of table {self.table!r}"


def _bounds(item: Restored) -> tuple:
    s = item.slot
    return (None, False) if s is None or s.low is None else (float(s.low), s.low_open)


def _ok(xp, x, low, low_open):
    ok = xp.isfinite(x)
    if low is not None:
        ok = ok & ((x > low) if low_open else (x >= low))
    return ok


def _in_host_memory(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host"


def _first_bad_in_host_shards(items: list[Restored]) -> list[tuple[Restored, int, float]]:
    """(item, flat index, value) of the first value outside its domain in each of `items`
    (jax.Arrays in host memory), read shard by shard in NumPy: never moved to a device.
    With several processes each reads its own shards, and one all-gather of the findings
    gives every process the same answer."""
    if not items:
        return []
    # Per item: (found, flat index, value), the earliest of this process's shards.
    mine = np.zeros((len(items), 3), np.float64)
    for k, it in enumerate(items):
        width = int(np.prod(it.array.shape[1:], dtype=np.int64))
        best = None
        for shard in it.array.addressable_shards:
            start = shard.index[0].start or 0
            if start >= it.rows:
                continue
            flat = np.asarray(shard.data)[: it.rows - start].astype(np.float32).reshape(-1)
            bad = ~_ok(np, flat, *_bounds(it))
            if bad.any():
                i = int(np.argmax(bad))
                at = start * width + i
                if best is None or at < best[0]:
                    best = (at, float(flat[i]))
        if best is not None:
            mine[k] = (1.0, best[0], best[1])
    every = mine[None]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(mine))
    found = []
    for k, it in enumerate(items):
        hits = [row for row in every[:, k] if row[0]]
        if hits:
            _, at, value = min(hits, key=lambda row: row[1])
            found.append((it, int(at), float(value)))
    return found


@functools.partial(jax.jit, static_argnums=1)
def _first_bad_on_devices(arrays: tuple, specs: tuple) -> tuple:
    """Per array: (any value outside its domain, the flat index of the first, its value)."""
    out = []
    for x, (rows, low, low_open) in zip(arrays, specs):
        flat = x[:rows].astype(jnp.float32).reshape(-1)
        ok = _ok(jnp, flat, low, low_open)
        i = jnp.argmin(ok.astype(jnp.int8))
        out.append((~ok[i], i, flat[i]))
    return tuple(out)


def check_restored(items: list[Restored], where: str) -> None:
    """ValueError naming each table or slot (row and value) outside its optimizer's
    domain: a non-finite value anywhere, or a slot value its update is not defined for
    (`SlotSpec.low`). NumPy arrays are checked on the host, jax.Arrays on their devices
    (one program for all of them, reading each array once), jax.Arrays in host memory
    shard by shard on the hosts that hold them (and the findings shared, so that every
    process raises or none)."""
    found: list[tuple[Restored, int, float]] = []
    in_host = [it for it in items if _in_host_memory(it.array)]
    on_devices = [
        it for it in items if isinstance(it.array, jax.Array) and not _in_host_memory(it.array)
    ]
    found += _first_bad_in_host_shards(in_host)
    for it in items:
        if isinstance(it.array, jax.Array):
            continue
        flat = np.asarray(it.array[: it.rows], np.float32).reshape(-1)
        bad = ~_ok(np, flat, *_bounds(it))
        if bad.any():
            i = int(np.argmax(bad))
            found.append((it, i, float(flat[i])))
    if on_devices:
        results = _first_bad_on_devices(
            tuple(it.array for it in on_devices),
            tuple((it.rows,) + _bounds(it) for it in on_devices),
        )
        for it, (bad, i, value) in zip(on_devices, jax.device_get(results)):
            if bool(bad):
                found.append((it, int(i), float(value)))
    if not found:
        return
    problems = []
    for it, i, value in found:
        width = int(np.prod(np.shape(it.array)[1:], dtype=np.int64))
        at = f"row {i // width}" + (f", column {i % width}" if np.ndim(it.array) == 2 else "")
        owner = f" ({it.optimizer})" if it.slot is not None and it.optimizer else ""
        shown = format(value, ".8g")  # The float32 value, not its float64 expansion.
        problems.append(f"{it.what()}{owner} has {shown} at {at}; it must be {it.rule()}")
    raise ValueError(
        f"{where}: " + "; ".join(problems) + ". Nothing was restored: a non-finite row, or "
        "a slot value the optimizer's update is not defined for, would make every update "
        "of that row non-finite."
    )


def on_every_process(fn: Callable[[], Any], where: str, errors: tuple = (ValueError,)) -> Any:
    """fn() on this process, which may fail (a ValueError) on its own part of the data
    alone: then every process raises, or none does, so that no process goes on alone into
    a collective the others never reach. A process whose fn succeeded raises the most
    specific of `errors` (ValueError subclasses, general first) that another's error is,
    naming the processes that failed."""
    try:
        return_value, problem = fn(), None
    except ValueError as e:
        return_value, problem = None, e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        kind = 0  # This process: 0 fine, else 1 + the most specific of `errors` it raised.
        if problem is not None:
            kind = 1 + max([i for i, e in enumerate(errors) if isinstance(problem, e)] or [0])
        kinds = np.asarray(multihost_utils.process_allgather(np.asarray([kind]))).reshape(-1)
        if problem is None and kinds.any():
            raise errors[max(int(kinds.max()) - 1, 0)](
                f"{where}: processes {np.flatnonzero(kinds).tolist()} failed (their errors "
                f"say why)."
            )
    if problem is not None:
        raise problem
    return return_value


def restored_items(
    table: str, optimizer: Any, value: Any, slots: dict, specs: tuple, rows: int | None = None
) -> list[Restored]:
    """The `Restored` items of one table: its rows and each of `slots` ({name: array}) that
    `specs` (its optimizer's slot specs) declares; `rows` the real rows (default all)."""
    rows = int(np.shape(value)[0]) if rows is None else rows
    name = type(optimizer).__name__
    items = [Restored(table, None, value, rows)]
    items += [Restored(table, s, slots[s.name], rows, name) for s in specs if s.name in slots]
    return items


# ------------------------------------------------------------------ options


def check_no_wide_ids(batch, where: str) -> None:
    """ValueError for a NumPy int64 array in a jitted step's batch with values beyond int32:
    without jax_enable_x64, jit would cut them to int32, other ids of a dynamic table.
    (With it, jit keeps them, and the embedding's calls split them: `_inputs.x32`.)"""
    if jax.enable_x64.value:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if isinstance(leaf, np.ndarray) and leaf.dtype == np.int64 and leaf.size:
            if leaf.min() < np.iinfo(np.int32).min or leaf.max() > np.iinfo(np.int32).max:
                raise ValueError(
                    f"{where}: batch{jax.tree_util.keystr(path)} holds int64 ids beyond "
                    f"int32, which jit cuts to int32 without jax_enable_x64. Give a dynamic "
                    f"table's ids as jte.split_ids(ids) (uint32 halves), or turn "
                    f"jax_enable_x64 on."
                )


def check_bool(value: Any, where: str, name: str, allow_none: bool = False) -> None:
    """TypeError unless `value` is a bool (NumPy's too; None if `allow_none`): a string
    such as "false" is truthy, and would silently mean True."""
    if isinstance(value, (bool, np.bool_)) or (allow_none and value is None):
        return
    kind = "a bool or None" if allow_none else "a bool"
    raise TypeError(f"{where}: {name} must be {kind} (True or False), got {value!r}.")


def check_like(given: Any, want: Any, what: str) -> None:
    """ValueError unless `given` has `want`'s tree structure, shapes and dtypes."""
    if jax.tree.structure(given) != jax.tree.structure(want):
        raise ValueError(
            f"{what} does not have the structure the model expects: got "
            f"{jax.tree.structure(given)}, expected {jax.tree.structure(want)}."
        )
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(given), jax.tree.leaves(want)):
        if jnp.shape(g) != jnp.shape(w) or jnp.result_type(g) != jnp.result_type(w):
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} is {jnp.result_type(g)}"
                f"{list(jnp.shape(g))}, expected {jnp.result_type(w)}{list(jnp.shape(w))}."
            )


def states_per_layer(embedding_state: Any, engines: dict, state_type: type) -> dict:
    """{layer name: EmbeddingState} from a train step's `init(embedding_state=)`: one state
    (a model with one Embed) or {layer name: state}; each checked against its layer's
    engine (`engines`: {layer name: Embedding}): not consumed, and shaped like its state."""
    if embedding_state is None:
        return {}
    if isinstance(embedding_state, state_type):
        if len(engines) != 1:
            raise ValueError(
                f"init: the model has {len(engines)} Embed layers {sorted(engines)}; give "
                f"embedding_state as {{layer path: EmbeddingState}}."
            )
        embedding_state = {next(iter(engines)): embedding_state}
    if not isinstance(embedding_state, dict):
        raise TypeError(
            f"init: embedding_state must be a jte.EmbeddingState or {{layer path: "
            f"EmbeddingState}}, got {type(embedding_state).__name__}."
        )
    unknown = sorted(set(embedding_state) - set(engines))
    if unknown:
        raise ValueError(
            f"init: embedding_state has {unknown}, which are not Embed layers of the model; "
            f"its layers are {sorted(engines)}."
        )
    for name, state in embedding_state.items():
        where = f"init: embedding_state[{name!r}]"
        check_not_consumed(state, where, "embedding state", "embedding_state")
        check_like(state, engines[name].abstract_state(), where)
    return dict(embedding_state)
