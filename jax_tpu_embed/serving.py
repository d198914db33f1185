"""CPU serving of exported tables: the training lookup's numbers without a mesh.

    tables = emb.export(state)                       # {name: (V, D) np.ndarray}
    server = jte.serving.Server(spec, tables)        # tables on one CPU device
    acts = server(features)                          # == emb.lookup(state, features)

    exp = server.export(features)                    # jax.export.Exported
    blob = exp.serialize()                           # bytes; store it anywhere
    acts = jax.export.deserialize(blob).call(tables, features)

Inputs take every form `Embedding.lookup` takes (one-hot (B,), padded (B, L), `jte.Weighted`,
sequence features, ids outside [0, V) treated as -1) and are brought to (ids, weights) by the
same `_inputs.normalize`; combiners use the same `_inputs.combiner_scale`. Unlike TensorFlow,
tables trained with "mod" serve like any other: exports are always in natural row order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config, _embedding, _guards, _inputs

Nested = Any

try:
    # jax.export must know how to (de)serialize the Weighted input container.
    jax.export.register_namedtuple_serialization(
        _inputs.Weighted, serialized_name="jax_tpu_embed.Weighted"
    )
except ValueError:  # Already registered (module reloaded).
    pass


def lookup(spec: _config.EmbeddingSpec, tables: Mapping[str, Any], features: Nested) -> Nested:
    """Embeds every feature from logical tables; pure and jittable.

    Args:
        spec: The EmbeddingSpec the tables were trained with.
        tables: {table name: (V, D) array} in natural row order, as `Embedding.export` gives.
        features: Mirrors the spec; leaves as for `Embedding.lookup` (B need not be a
            multiple of anything).

    Returns:
        Same structure: float32 (B, D) per feature, (B, L, D) for sequence features (or
        output_shape + (D,)). Examples with no ids give zeros.
    """
    flat = _inputs.flatten_inputs(spec, features)
    names = _config.table_names(spec)
    out = {}
    for path, feature in spec.flat_features:
        table = jnp.asarray(tables[names[id(feature.table)]])
        out[path] = _embed(path, feature, table, flat[path])
    return _config.unflatten(out)


def _embed(path: str, feature: _config.FeatureConfig, table, leaf):
    ids, weights = _inputs.normalize(feature, leaf)  # (B, L); -1 and 0 where nothing.
    rows = jnp.take(table, jnp.maximum(ids, 0), axis=0).astype(jnp.float32)  # (B, L, D)
    if feature.is_sequence:
        acts = rows * weights[..., None]
    else:
        assert isinstance(feature.table, _config.TableConfig)  # So in every EmbeddingSpec.
        scale = _inputs.combiner_scale(weights, feature.table.combiner)
        acts = jnp.einsum("bl,bld->bd", scale, rows, precision=lax.Precision.HIGHEST)
    if feature.output_shape is None:
        return acts
    outputs = math.prod(acts.shape[:-1])
    if math.prod(feature.output_shape) != outputs:
        raise ValueError(
            f"Feature {path!r}: output_shape {feature.output_shape} has "
            f"{math.prod(feature.output_shape)} outputs, but the batch gives {outputs} "
            f"(shape {acts.shape[:-1]})."
        )
    return acts.reshape(tuple(feature.output_shape) + (acts.shape[-1],))


def _parts(leaf):
    return (leaf.ids, leaf.weights) if isinstance(leaf, _inputs.Weighted) else (leaf,)


def check_tables(spec: _config.EmbeddingSpec, tables: Mapping[str, Any]) -> None:
    """ValueError listing every table that is missing, unknown or of the wrong shape."""
    want = {name: (t.vocabulary_size, t.dim) for name, t in spec.tables().items()}
    problems = [f"table {n!r} is missing" for n in want if n not in tables]
    problems += [
        f"table {n!r} is not in the spec (its tables are {list(want)})"
        for n in tables
        if n not in want
    ]
    problems += [
        f"table {n!r} has shape {tuple(np.shape(tables[n]))}, the spec says "
        f"(vocabulary_size, dim) = {want[n]}"
        for n in want
        if n in tables and tuple(np.shape(tables[n])) != want[n]
    ]
    if problems:
        raise ValueError("serving: the tables do not fit the spec: " + "; ".join(problems) + ".")


class Server:
    """A jitted lookup over exported tables held on one device (the first CPU by default).

    Args:
        spec: The EmbeddingSpec the tables were trained with.
        tables: {table name: (V, D) np.ndarray}, e.g. `emb.export(state)`.
        device: Where to keep the tables and run; default `jax.devices("cpu")[0]`.
    """

    def __init__(
        self,
        spec: _config.EmbeddingSpec,
        tables: Mapping[str, Any],
        device: jax.Device | None = None,  # pyright: ignore[reportInvalidTypeForm]
    ):
        if not isinstance(spec, _config.EmbeddingSpec):
            raise TypeError(f"Server: spec must be a jte.EmbeddingSpec, got {type(spec).__name__}.")
        _guards.check_not_consumed(tables, "serving.Server", "tables", "tables")
        _guards.refuse_dynamic(spec, "serving.Server")
        check_tables(spec, tables)
        self.spec = spec
        self.device = device if device is not None else jax.devices("cpu")[0]
        self.tables = {n: jax.device_put(np.asarray(tables[n]), self.device) for n in spec.tables()}
        self._jit = jax.jit(lambda t, f: lookup(self.spec, t, f))

    @classmethod
    def from_embedding(
        cls,
        emb: _embedding.Embedding,
        state: _embedding.EmbeddingState,
        device: jax.Device | None = None,  # pyright: ignore[reportInvalidTypeForm]
    ) -> Server:
        """Serves `state`'s tables, exported in logical rows."""
        _guards.check_not_consumed(state, "serving.Server.from_embedding")
        return cls(emb.spec, emb.export(state), device)

    def __call__(self, features: Nested) -> Nested:
        """Activations of `features` (any batch size B); mirrors `Embedding.lookup`."""
        flat = _inputs.flatten_inputs(self.spec, features)
        leaves = [x for leaf in flat.values() for x in _parts(leaf)]
        if any(not isinstance(x, jax.Array) for x in leaves):  # As Embedding.lookup does.
            _inputs.validate(self.spec, features, 1)
        put = lambda x: jax.device_put(
            x if isinstance(x, jax.Array) else np.asarray(x), self.device
        )
        flat = {
            path: (
                _inputs.Weighted(put(leaf.ids), put(leaf.weights))
                if isinstance(leaf, _inputs.Weighted)
                else put(leaf)
            )
            for path, leaf in flat.items()
        }
        return self._jit(self.tables, _config.unflatten(flat))

    def export(
        self,
        features: Nested,
        *,
        include_tables: bool = False,
        platforms: Sequence[str] | None = ("cpu",),
        polymorphic_batch: bool = False,
    ) -> jax.export.Exported:
        """This lookup as a `jax.export.Exported` (StableHLO); see `export`."""
        return export(
            self.spec,
            self.tables,
            features,
            include_tables=include_tables,
            platforms=platforms,
            polymorphic_batch=polymorphic_batch,
        )


def export(
    spec: _config.EmbeddingSpec,
    tables: Mapping[str, Any],
    features: Nested,
    *,
    include_tables: bool = False,
    platforms: Sequence[str] | None = ("cpu",),
    polymorphic_batch: bool = False,
) -> jax.export.Exported:
    """Exports the serving lookup with `jax.export`.

    Args:
        spec: The EmbeddingSpec.
        tables: {name: (V, D)} arrays (or jax.ShapeDtypeStruct when include_tables=False).
        features: Example inputs (arrays or jax.ShapeDtypeStruct) fixing every feature's
            form, shape and dtype.
        include_tables: False: the function is `call(tables, features)` and the tables stay
            outside the artifact. True: the tables are constants inside it and the function
            is `call(features)` (only for tables small enough to ship in the artifact).
        platforms: Lowering platforms, e.g. ("cpu", "tpu"); None: the default backend's.
        polymorphic_batch: Export B as a symbolic dimension, so one artifact serves any batch
            size. Not possible when a feature has output_shape (fixed by B).

    Returns:
        The `jax.export.Exported`; `.serialize()` gives bytes for `jax.export.deserialize`.
    """
    _guards.check_not_consumed(tables, "serving.export", "tables", "tables")
    check_tables(spec, tables)
    flat = _inputs.flatten_inputs(spec, features)
    _inputs.check_batch(flat, 1, allow_empty=True)
    if polymorphic_batch:
        shaped = [p for p, f in spec.flat_features if f.output_shape is not None]
        if shaped:
            raise ValueError(
                f"serving.export: polymorphic_batch=True is impossible with "
                f"output_shape (features {shaped}); it fixes the batch size."
            )
        (batch,) = jax.export.symbolic_shape("B")
    else:
        batch = None

    def spec_of(x):
        shape = tuple(np.shape(x))
        if batch is not None:
            shape = (batch,) + shape[1:]
        return jax.ShapeDtypeStruct(shape, x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)

    feature_specs = jax.tree.map(spec_of, features)
    table_specs = {n: jax.ShapeDtypeStruct(tuple(np.shape(t)), t.dtype) for n, t in tables.items()}
    platforms = None if platforms is None else tuple(platforms)
    if include_tables:
        constants = {n: np.asarray(t) for n, t in tables.items()}
        fn = jax.jit(lambda f: lookup(spec, constants, f))
        return jax.export.export(fn, platforms=platforms)(feature_specs)
    fn = jax.jit(lambda t, f: lookup(spec, t, f))
    return jax.export.export(fn, platforms=platforms)(table_specs, feature_specs)
