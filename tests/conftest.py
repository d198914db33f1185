"""Test setup: 8 simulated CPU devices, so sharding is tested on 1, 2, 4 and 8 devices.

The environment is set before jax is imported anywhere.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# libtpu (the TPU compiler for AOT compile tests) takes a machine-wide lock; pytest-xdist's
# workers each load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# 8 devices, unless the environment names a count: the multi-process tests' workers, which
# import the fuzzer (and so this file), take 4 each.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import atexit  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.extend  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

jax.config.update("jax_enable_x64", False)

# `--tier-coverage=DIR`: each test's lines of the package, to choose the fast tier's tests.
pytest_plugins = ["tier_coverage"]

# A persistent XLA compilation cache for one pytest run, shared by its pytest-xdist workers:
# many tests build the same program in a fresh Embedding (a fresh closure, so jit's own cache
# misses), and the persistent cache, keyed by the lowered program, compiles it once. The
# controller loads this file before it starts the workers, which inherit the variable; the
# process that made the directory removes it at exit, so every run starts empty (as a fresh
# clone in CI does) and no result depends on an earlier run. JTE_TEST_XLA_CACHE=off turns it
# off (to compare, or to rule it out); a directory given there is used and kept.
_CACHE_ENV = "JTE_TEST_XLA_CACHE"
_CACHE_ON = os.environ.get(_CACHE_ENV) != "off"
if _CACHE_ON:
    if not os.environ.get(_CACHE_ENV):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jte-xla-cache-")
        atexit.register(shutil.rmtree, os.environ[_CACHE_ENV], ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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


@contextlib.contextmanager
def executables_made():
    """A list that counts the executables made while the block runs: compiled, or read
    from the persistent compilation cache (the one above, which other tests may have
    filled)."""
    made = []
    names = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits")

    def timed(event: str, duration_secs: float, **kwargs):
        if event == names[0]:
            made.append(event)

    def event(event: str, **kwargs):
        if event == names[1]:
            made.append(event)

    jax.monitoring.register_event_duration_secs_listener(timed)
    jax.monitoring.register_event_listener(event)
    try:
        yield made
    finally:
        jax.monitoring.unregister_event_duration_listener(timed)
        jax.monitoring.unregister_event_listener(event)


@pytest.fixture(scope="module")
def no_persistent_cache():
    """The persistent compilation cache off for a module that compiles with libtpu for a TPU
    topology: such an executable is written to the cache but cannot be read back without a
    TPU client (a warning, then a compile anyway), so caching it only costs time."""
    if not _CACHE_ON:
        yield
        return
    # Whether the cache is used is decided once per process: reset_cache asks again.
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


@pytest.fixture
def rng():
    return np.random.default_rng(0)
