"""`FromOptax`: an optax GradientTransformation as a lazy, per-row table optimizer.

The transform is applied to ONE row at a time, like `CustomOptimizer`: `tx.init` on a (D,)
row defines the row's slots, one per leaf of the state (a (D,) leaf is a rank-2 slot, a
scalar leaf such as adam's `count` a rank-1 slot: one value per row, so a row's count counts
its own updates), and `tx.update(g, state, row)` is vmapped over the touched rows.

That is only the transform's own semantics when it is elementwise: when element i of the
update and of the new state depends on element i of the gradient, the parameters and the
state alone. Construction checks it by probing the transform on a small row (perturbing one
element at a time, at several gradient scales) and names the offending part of a chain
(e.g. `clip_by_global_norm`, which reads the whole parameter tree).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import _inputs, _optimizers

_PROBE_DIM = 4  # Probe rows: small, and two sizes to tell (D,) leaves from fixed shapes.
_PROBE_SCALES = (1e-3, 1.0, 1e3)


def _factory_name(fn) -> str | None:
    """The optax function that built an update function: 'scale_by_adam' from
    'scale_by_adam.<locals>.update_fn', looking through optax's wrappers."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        head = getattr(fn, "__qualname__", "").split(".<locals>")[0]
        if head and head != "with_extra_args_support":
            return head
        try:
            nonlocals = inspect.getclosurevars(fn).nonlocals.values()
        except (TypeError, ValueError):
            return None
        fn = next(
            (
                v.update if isinstance(v, optax.GradientTransformation) else v
                for v in nonlocals
                if callable(v) or isinstance(v, optax.GradientTransformation)
            ),
            None,
        )
    return None


def _chain_parts(tx) -> list | None:
    """The update functions of an optax.chain, or None for anything else."""
    if _factory_name(tx.update) != "chain":
        return None
    try:
        fns = inspect.getclosurevars(tx.update).nonlocals.get("update_fns")
    except (TypeError, ValueError):
        return None
    return list(fns) if fns else None


def _slot_name(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k).strip(".[]'\""))
    return "_".join(parts) or "state"


def _not_elementwise(update, init, d: int) -> bool:
    """Whether some element of update's output or new state depends on another element of
    its gradient, parameters or state (probed at random points)."""
    rng = np.random.default_rng(0)
    row = jnp.asarray(rng.normal(size=d), jnp.float32)
    state = init(row)
    for scale in _PROBE_SCALES:
        g = jnp.asarray(scale * rng.normal(size=d), jnp.float32)
        # One update first, so that the state is not the all-constant initial one.
        _, state1 = update(g, state, row)
        eye = np.eye(d, dtype=np.float32)

        def outputs(dg, dp, s=state1, g=g):
            upd, new = update(g + dg, s, row + dp)
            return [upd] + [x for x in jax.tree.leaves(new) if jnp.ndim(x) == 1]

        base = [np.asarray(x) for x in outputs(jnp.zeros(d), jnp.zeros(d))]
        for which in ("g", "p"):
            deltas = jnp.asarray(eye * (scale if which == "g" else 1.0))
            zeros = jnp.zeros((d, d), jnp.float32)
            probe = jax.vmap(outputs)(
                deltas if which == "g" else zeros, deltas if which == "p" else zeros
            )
            for b, p in zip(base, probe):
                changed = ~np.isclose(np.asarray(p), b[None], rtol=0, atol=0, equal_nan=True)
                if np.any(changed & (eye == 0)):
                    return True
    return False


@dataclasses.dataclass(frozen=True, eq=False)
class FromOptax(_optimizers.Optimizer):
    """An optax GradientTransformation as a sparse table optimizer, applied per row.

    Each touched row runs `updates, state = tx.update(g, state, row); row += updates` with
    its own state: `tx.init` of one (D,) row gives the row's slots, a (D,) vector per row
    for each vector leaf of the state and one value per row for each scalar leaf (adam's
    `count` counts the row's own updates, so bias correction and schedules inside `tx`
    follow the row's update count, as lazy Adam does). Slots are stored as float32 (integer
    counts are exact up to 2**24 updates of a row) and named by their path in the state:
    `optax.adam` gives "0_count", "0_mu" and "0_nu" (`export_slots`, checkpoints).

    Only elementwise transforms (adam, adamw, lion, rmsprop, adagrad, sgd with momentum,
    clip, schedules, chains of them) keep their meaning row by row; others, such as
    clip_by_global_norm, raise a ValueError naming them. The spec's gradient multiplier and
    clipping_limit apply before `tx`; the extras of the built-ins do not exist here (chain
    optax transforms instead).

    Args:
        transform: The optax.GradientTransformation.
    """

    transform: Any
    # Unused (the transform holds its own); the engine evaluates it, so it must exist.
    learning_rate: float = dataclasses.field(default=1.0, init=False, repr=False)
    _specs: tuple = dataclasses.field(default=(), init=False, repr=False)
    _leaves: tuple = dataclasses.field(default=(), init=False, repr=False)
    _treedef: Any = dataclasses.field(default=None, init=False, repr=False)

    @_inputs.x32()  # The engine runs the transform with jax_enable_x64 off: so is it probed.
    def __post_init__(self):
        tx = self.transform
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(
                f"FromOptax: transform must be an optax.GradientTransformation (e.g. "
                f"optax.adam(1e-3)), got {type(tx).__name__} {tx!r}."
            )
        name = _factory_name(tx.update) or "the transform"
        shapes = {}
        for d in (_PROBE_DIM, _PROBE_DIM + 1):
            try:
                shapes[d] = jax.eval_shape(tx.init, jax.ShapeDtypeStruct((d,), jnp.float32))
            except Exception as e:  # noqa: BLE001 - reported with the transform's name.
                raise ValueError(f"FromOptax: {name}.init fails on one (D,) row: {e}") from e
        paths, treedef = jax.tree_util.tree_flatten_with_path(shapes[_PROBE_DIM])
        other = jax.tree.leaves(shapes[_PROBE_DIM + 1])
        values0 = jax.tree.leaves(tx.init(jnp.zeros((_PROBE_DIM,), jnp.float32)))
        values1 = jax.tree.leaves(tx.init(jnp.linspace(-1.0, 2.0, _PROBE_DIM)))
        specs, leaves = [], []
        for (path, leaf), leaf2, v0, v1 in zip(paths, other, values0, values1):
            slot = _slot_name(path)
            if leaf.shape == () and leaf2.shape == ():
                rank = 1
            elif leaf.shape == (_PROBE_DIM,) and leaf2.shape == (_PROBE_DIM + 1,):
                rank = 2
            else:
                raise ValueError(
                    f"FromOptax: {name} is not elementwise: its state leaf {slot!r} has shape "
                    f"{leaf.shape} for a row of {_PROBE_DIM} (allowed: (D,) or a scalar)."
                )
            v0, v1 = np.asarray(v0, np.float64), np.asarray(v1, np.float64)
            if not (np.array_equal(v0, v1) and np.all(v0 == v0.reshape(-1)[0])):
                raise ValueError(
                    f"FromOptax: {name}'s initial state leaf {slot!r} depends on the row's "
                    f"values; only states that start from constants are supported."
                )
            specs.append(_optimizers.SlotSpec(slot, rank, float(v0.reshape(-1)[0])))
            leaves.append((leaf.shape, leaf.dtype))
        if len({s.name for s in specs}) != len(specs):
            raise ValueError(
                f"FromOptax: {name}'s state paths give duplicate slot names "
                f"{[s.name for s in specs]}."
            )
        parts = _chain_parts(tx)
        if parts is None:
            bad = [name] if _not_elementwise(tx.update, tx.init, _PROBE_DIM) else []
        else:  # Elementwise parts make an elementwise chain; name the ones that are not.
            bad = [
                _factory_name(fn) or f"part {i} of the chain"
                for i, fn in enumerate(parts)
                if _part_not_elementwise(tx, i, _PROBE_DIM)
            ]
        if bad:
            raise ValueError(
                f"FromOptax: {', '.join(bad)} is not elementwise (an element of its update "
                f"depends on other elements of the gradient or parameters, e.g. a global "
                f"norm), so it has no per-row meaning for a sparse table; use elementwise "
                f"transforms, or the spec's clipping_limit for clipping."
            )
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("_specs", tuple(specs))
        set_("_leaves", tuple(leaves))
        set_("_treedef", treedef)

    def slot_specs(self):
        return self._specs

    def update_row(self, gradient, row, slots, learning_rate, hyperparameters):
        del learning_rate, hyperparameters  # The transform holds its own.
        state = jax.tree_util.tree_unflatten(
            self._treedef,
            [
                s.astype(dtype) if rank == 2 else jnp.reshape(s, ()).astype(dtype)
                for s, (_, dtype), rank in zip(
                    slots, self._leaves, (spec.rank for spec in self._specs)
                )
            ],
        )
        updates, state = self.transform.update(gradient, state, row)
        new_row = row + updates.astype(row.dtype)
        return (new_row, *(jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(state)))


def _part_not_elementwise(tx, index: int, d: int) -> bool:
    """Probes part `index` of a chain alone, with its own state from the chain's init."""
    fns = inspect.getclosurevars(tx.update).nonlocals["update_fns"]

    def init(row):
        return tx.init(row)[index]

    def update(g, s, p):
        return fns[index](g, s, p)

    return _not_elementwise(update, init, d)
