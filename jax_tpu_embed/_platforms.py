"""Keeps JAX from probing for a TPU on a machine that has none.

With libtpu installed (the `tpu` extra, for planning TPU slices on any machine), JAX's backend
discovery loads libtpu whenever `JAX_PLATFORMS` is unset, even on a machine without TPU chips;
libtpu then prints start-up errors ("unexpected worker hostname", "could not determine TPU
accelerator type") before JAX falls back to the CPU. They read as failures but are not. So
when the package is imported before JAX has chosen its backends, nobody has chosen platforms
(`JAX_PLATFORMS`, `jax_platforms`, `JAX_FORCE_TPU_INIT`), no TPU chip is attached and no other
accelerator plugin is installed, the platforms are set to "cpu": the backend JAX would have
ended up with anyway, without the probe. Compiling for TPU topologies ahead of time
(`jax.experimental.topologies`, `python -m jax_tpu_embed.plan`) loads libtpu by itself and
works the same.
"""

from __future__ import annotations

import importlib.metadata
import os

import jax

# TPU generation by JAX device kind (real devices and libtpu's topology descriptions alike).
_TPU_GENERATIONS = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
}


def tpu_generation(device_kind: str) -> str | None:
    """ "v4", "v5e", "v5p" or "v6e" for a TPU device kind; None for anything else."""
    return _TPU_GENERATIONS.get(device_kind)


def _tpu_chips() -> int:
    try:
        from jax._src import hardware_utils

        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # An internal module that moved: assume a TPU may be there.
        return 1


def _other_plugins() -> bool:
    """Whether any PJRT plugin (GPU, ...) is installed besides the built-in CPU and TPU."""
    try:
        import jax_plugins  # noqa: F401  # pyright: ignore[reportMissingImports]

        return True
    except ImportError:
        pass
    return bool(importlib.metadata.entry_points(group="jax_plugins"))


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", {1: 1}))
    except Exception:
        return True


def skip_tpu_probe_without_chips() -> bool:
    """Sets JAX's platforms to "cpu" when the only accelerator JAX would try is a TPU and
    there is no TPU chip (see the module docstring). Returns whether it did."""
    if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    if getattr(jax.config, "jax_platforms", None) or _backends_initialized():
        return False
    if _tpu_chips() or _other_plugins():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
