"""Test setup: 8 simulated CPU devices, so sharding is tested on 1, 2, 4 and 8 devices.

The environment is set before jax is imported anywhere.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# libtpu (the TPU compiler for AOT compile tests) takes a machine-wide lock; pytest-xdist's
# workers each load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.extend  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def make_mesh(num_shards: int, kind: str = "explicit", axis: str = "shard"):
    """A 1-axis mesh over the first `num_shards` devices: "explicit" (jax.make_mesh, Explicit
    axes) or "auto" (jax.sharding.Mesh, Auto axes)."""
    devices = jax.devices()[:num_shards]
    if kind == "explicit":
        return jax.make_mesh((num_shards,), (axis,), devices=devices)
    return jax.sharding.Mesh(np.array(devices), (axis,))


def count_primitive(jaxpr, name: str) -> int:
    """Occurrences of primitive `name` in a jaxpr and in every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    count += count_primitive(sub.jaxpr, name)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    count += count_primitive(sub, name)
    return count


@pytest.fixture
def rng():
    return np.random.default_rng(0)
