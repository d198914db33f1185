"""Bounds the steps a loop keeps in flight on multi-device CPU meshes (XLA:CPU deadlock).

XLA:CPU (jaxlib 0.10.2) runs a program over N local CPU devices on one thread pool of
max(cores, N) threads (`PJRT_NPROC` overrides the core count). A call dispatches one task per
device onto that pool; each task first takes a slot of its device's in-flight semaphore (32
executions per device) and then queues the execution, which runs on the same pool and, at a
collective, waits in a rendezvous until all N devices' executions of that call have arrived.
When a loop dispatches faster than the devices run (no wait per step), devices reach 32
executions in flight and dispatch tasks start blocking pool threads on the semaphore. With
fewer than 2N threads, the pool can fill with dispatch tasks waiting for a slot and
executions waiting in a rendezvous for a participant that has no thread left to run on: a
deadlock, which XLA aborts after 40 s ("waiting for all gather RendezvousKey ... Expected 4
threads"). Native stacks of a hung process show exactly that (docs/design.md).

The library's own loops (`TrainStep`, the flax and NNX steps, eager `apply_gradients`) keep
at most `max_steps_in_flight()` steps (4 by default) undone on such meshes: after dispatching
step i they wait for step i - k (a small output that is never donated). Dispatch then never
reaches the semaphore (for up to 6 executions per device per step), and the host stays
k steps ahead, so the devices do not wait for it. TPU, GPU and 1-device meshes never wait.

    jte.set_max_steps_in_flight(16)    # another bound
    jte.set_max_steps_in_flight(None)  # no bound (e.g. with PJRT_NPROC >= 2N set)

or `JTE_MAX_STEPS_IN_FLIGHT=0` in the environment (read at import).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import jax
import jax.core

DEFAULT = 4
_ENV = "JTE_MAX_STEPS_IN_FLIGHT"


def _from_env() -> int | None:
    raw = os.environ.get(_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT
    try:
        k = int(raw)
    except ValueError:
        raise ValueError(f"{_ENV} must be an integer (0: no bound), got {raw!r}.") from None
    return k if k > 0 else None


_limit: int | None = _from_env()


def set_max_steps_in_flight(k: int | None) -> None:
    """How many steps the library's loops leave undone on a multi-device CPU mesh.

    After dispatching step i, `TrainStep`, the flax and NNX steps and eager
    `Embedding.apply_gradients` wait for step i - k when they run on more than one CPU device,
    which keeps XLA:CPU from deadlocking in a collective (see the README). None or 0: never
    wait. Default 4, or `JTE_MAX_STEPS_IN_FLIGHT` from the environment.
    """
    global _limit
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"set_max_steps_in_flight: k must be an int >= 0 or None, got {k!r}.")
    _limit = k or None


def max_steps_in_flight() -> int | None:
    """The bound `set_max_steps_in_flight` set (None: no bound)."""
    return _limit


def _on_cpu_mesh(tree: Any) -> bool | None:
    """Whether `tree`'s first array lives on more than one CPU device; None when it cannot
    tell yet (no concrete array, e.g. inside a trace)."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.core.Tracer):
            return None
        if isinstance(x, jax.Array):
            devices = x.sharding.device_set
            return len(devices) > 1 and next(iter(devices)).platform == "cpu"
    return None


class Window:
    """The last steps of one loop; `push` each step's handle (a small output that is never
    donated), which waits for the step `max_steps_in_flight()` back on a CPU mesh."""

    __slots__ = ("_cpu", "_handles")

    def __init__(self):
        self._cpu: bool | None = None  # Decided by the first concrete handle.
        self._handles: collections.deque = collections.deque()

    def push(self, handle: Any) -> None:
        if self._cpu is False or isinstance(handle, jax.core.Tracer):
            return
        k = _limit
        if k is None:
            self._handles.clear()
            return
        if self._cpu is None:
            self._cpu = _on_cpu_mesh(handle)
            if not self._cpu:
                return
        self._handles.append(handle)
        while len(self._handles) > k:
            jax.block_until_ready(self._handles.popleft())
