"""Placing values on a mesh the same way for Auto and Explicit axes."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding


def is_explicit(mesh) -> bool:
    """Whether any axis of `mesh` is Explicit (jax.make_mesh's default)."""
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def constrain(x, sharding: NamedSharding):
    """x placed as `sharding` says: a reshard on Explicit meshes (where the sharding is part
    of the type), a sharding constraint on Auto ones."""
    if is_explicit(sharding.mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
