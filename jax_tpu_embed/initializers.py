"""Row initializers: table initializers that `init` draws row by row, in blocks.

`TableConfig(initializer=fn)` takes any `fn(key, shape, dtype)`, and `init` calls it with
the table's logical shape (V, D): the whole table at once, on the devices, so a table's
shard must fit device memory while it is drawn. The initializers here are drawn as the
default one is: element (r, c) is a function of (table key, r, c) alone, a counter-based
hash turned into a uniform number in (0, 1) and then into the distribution. `init` draws
them in blocks of rows on the devices that own them (in host memory for tables placed
there, however large), and a row's value depends on neither the mesh, the strategy nor
the block. Called as `fn(key, shape, dtype)` they give the same values for the whole
table, so they work wherever an initializer is taken.

    users = jte.TableConfig(vocabulary_size=2_000_000_000, dim=64, placement="host",
                            initializer=jte.initializers.normal(stddev=0.01))
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from . import _storage

KINDS = ("truncated_normal", "normal", "uniform", "constant")


@dataclasses.dataclass(frozen=True)
class RowInitializer:
    """One of the distributions below, drawn row by row (see the module docstring).

    Attributes:
        kind: "truncated_normal" (cut at 2 stddev, as TensorFlow's TruncatedNormal: stddev
            is the untruncated normal's), "normal", "uniform" or "constant".
        mean: Its mean (truncated_normal, normal), or its value (constant).
        stddev: truncated_normal and normal: the standard deviation; None: 1/sqrt(dim),
            the default initializer's.
        minval, maxval: uniform: the interval, [minval, maxval).
    """

    kind: str
    mean: float = 0.0
    stddev: float | None = None
    minval: float = 0.0
    maxval: float = 1.0

    def __post_init__(self):
        where = f"jte.initializers.{self.kind}"
        if self.kind not in KINDS:
            raise ValueError(
                f"RowInitializer: kind must be one of {list(KINDS)}, got {self.kind!r}."
            )
        numbers = {"mean": self.mean, "minval": self.minval, "maxval": self.maxval}
        if self.stddev is not None:
            numbers["stddev"] = self.stddev
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{where}: {name} must be a number, got {value!r}.")
            if not math.isfinite(value):
                raise ValueError(f"{where}: {name} must be finite, got {value!r}.")
        if self.stddev is not None and self.stddev <= 0:
            raise ValueError(f"{where}: stddev must be > 0, got {self.stddev!r}.")
        if self.kind == "uniform" and not self.minval < self.maxval:
            raise ValueError(
                f"{where}: minval must be < maxval, got {self.minval!r} and {self.maxval!r}."
            )

    def values(self, u, dim: int):
        """The distribution's values from uniform numbers `u` in (0, 1) (float32, any shape)
        for a table of width `dim`."""
        # A product and a sum are kept apart by a barrier: XLA contracts them into one
        # rounding (a fused multiply-add) in some programs and not in others, and a table's
        # values must not depend on whether `init`'s blocks or one call drew them.
        apart = jax.lax.optimization_barrier
        if self.kind == "uniform":
            return apart(u * (self.maxval - self.minval)) + self.minval
        if self.kind == "constant":
            return jnp.full(jnp.shape(u), self.mean, jnp.float32)
        if self.kind == "truncated_normal":
            lo = jax.lax.erf(jnp.float32(-2.0 / math.sqrt(2.0)))
            z = math.sqrt(2.0) * jax.lax.erf_inv(lo + u * (-2.0 * lo))  # Inverse CDF on [-2, 2].
            z = jnp.clip(z, -2.0, 2.0)
        else:
            z = math.sqrt(2.0) * jax.lax.erf_inv(2.0 * u - 1.0)
        # The default's ops, in its order: a division by sqrt(dim), then no mean added.
        z = z / math.sqrt(dim) if self.stddev is None else z * self.stddev
        return apart(z) + self.mean if self.mean else z

    def __call__(self, key, shape, dtype=jnp.float32):
        """The values of rows 0 .. shape[0] - 1 (shape (V, D)), as `init` draws them."""
        if len(shape) != 2:
            raise ValueError(
                f"jte.initializers.{self.kind}: draws (rows, dim) tables, got shape {shape}."
            )
        ids = jnp.arange(shape[0], dtype=jnp.int32)
        return rows(key, ids, int(shape[1]), self).astype(dtype)


# What `TableConfig(initializer=None)` draws: a truncated normal, stddev 1/sqrt(dim).
DEFAULT = RowInitializer("truncated_normal")


def of(initializer) -> RowInitializer | None:
    """The row initializer a `TableConfig.initializer` draws with: DEFAULT for None, itself
    for a row initializer; None for any other initializer (called with the logical shape)."""
    if initializer is None:
        return DEFAULT
    return initializer if isinstance(initializer, RowInitializer) else None


def rows(key, ids, dim: int, draw: RowInitializer | None = None):
    """Rows `ids` ((n,) ints) of a table: (n, dim) float32 of `draw` (None: the default
    initializer, a truncated normal of mean 0 and stddev 1/sqrt(dim) cut at 2 stddev, as
    TensorFlow's).

    Element (r, c) is a counter-based hash of (key, r, c) alone, so a row's value depends on
    neither the mesh, the strategy nor how rows are grouped into blocks. A hash rather than
    jax.random: threefry's 20 rounds per element made XLA take seconds to compile each
    table's initialisation, and a demo with 26 tables spent most of its start-up there.
    """
    if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = jnp.asarray(key).reshape(-1).astype(jnp.uint32)  # Typed keys, or raw uint32 ones.
    return rows_of(words[0], words[-1], ids, dim, draw)


def rows_of(k0, k1, ids, dim: int, draw: RowInitializer | None = None):
    """`rows` from the key's first and last words: scalars, or (n,) (row i drawn with key
    words k0[i], k1[i]), so that one computation draws rows of several tables."""
    row = _storage.mix32(_storage.mix32(ids.astype(jnp.uint32) ^ k0) + k1)
    col = jnp.arange(dim, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    bits = _storage.mix32(_storage.mix32(row[..., None] ^ col) + jnp.reshape(k0, (-1, 1)))
    u = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) + (0.5 / (1 << 24))  # (0, 1)
    return (draw or DEFAULT).values(u, dim)


def truncated_normal(stddev: float | None = None, mean: float = 0.0) -> RowInitializer:
    """A normal cut at 2 standard deviations (TensorFlow's TruncatedNormal; `stddev` is the
    untruncated normal's; None: 1/sqrt(dim), the default initializer, bit for bit)."""
    return RowInitializer("truncated_normal", mean=mean, stddev=stddev)


def normal(stddev: float | None = None, mean: float = 0.0) -> RowInitializer:
    """A normal (None: stddev 1/sqrt(dim))."""
    return RowInitializer("normal", mean=mean, stddev=stddev)


def uniform(minval: float = -0.05, maxval: float = 0.05) -> RowInitializer:
    """Uniform on [minval, maxval)."""
    return RowInitializer("uniform", minval=minval, maxval=maxval)


def constant(value: float = 0.0) -> RowInitializer:
    """Every element `value`."""
    return RowInitializer("constant", mean=value)


def zeros() -> RowInitializer:
    return constant(0.0)


def ones() -> RowInitializer:
    return constant(1.0)
