"""A loop over a device's entries a window at a time, shared by the dynamic index's passes
(`_dynamic`) and the HostCached prefetch (`_placement`): each device does the work of the
entries it holds, `window` at a time, and one straight-line pass where a window holds all."""

from __future__ import annotations

from typing import Any

from jax import lax
from jax import numpy as jnp


def in_windows(count, window: int, inputs, body, outputs: Any = (), carry: Any = None):
    """Runs `values, carry = body(*window_of_each_input, valid, carry)` over the first
    `count` entries of `inputs` ((n + window,) arrays, or (n,) when one window holds all n),
    `window` at a time, and collects each of `values` ((window,) arrays) into the arrays
    `outputs` starts from (shaped as the inputs). Returns (outputs, carry)."""

    def run(start, outs, carry):
        take = lambda x: lax.dynamic_slice_in_dim(x, start, window)
        valid = lax.iota(jnp.int32, window) + start < count
        values, carry = body(*map(take, inputs), valid, carry)
        outs = tuple(lax.dynamic_update_slice_in_dim(o, v, start, 0) for o, v in zip(outs, values))
        return outs, carry

    if window >= inputs[0].shape[0]:
        return run(jnp.int32(0), outputs, carry)

    def step(state):
        start, outs, carry = state
        outs, carry = run(start, outs, carry)
        return start + window, outs, carry

    _, outs, carry = lax.while_loop(
        lambda state: state[0] < count, step, (jnp.int32(0), tuple(outputs), carry)
    )
    return outs, carry
