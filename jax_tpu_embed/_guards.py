"""Checks at the public entry points that are cheaper than what they prevent.

`check_not_consumed`: a state whose arrays were donated to an earlier call (eager
`apply_gradients`, a train step) holds deleted arrays. Handing one to a jitted program again
raises a bare `RuntimeError: Array has been deleted` at best; with donation on some jax builds
it crashes the process (openxla/xla issue 22604). Every entry point that takes a state calls
this first: one `is_deleted()` per leaf, no device work.

"""

from __future__ import annotations

from typing import Any

import jax
import jax.core


def _deleted_leaf(tree: Any) -> str | None:
    """The path of the first deleted array of `tree` (tracers skipped), or None."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
            continue
        if leaf.is_deleted():
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
