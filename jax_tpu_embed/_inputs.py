"""Feature inputs: the forms users give, checked on the host and brought to one form.

Every feature becomes `(ids, weights)`, both (B, L): int32 ids with -1 for "no id" and float32
weights that are 0 wherever the id is -1 or invalid. One-hot (B,) becomes (B, 1); sequence
features are truncated at the end or padded with -1 to max_sequence_length.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from . import _config


class Weighted(NamedTuple):
    """Ids with one float weight each: ids (B,) or (B, L) padded with -1, weights alike."""

    ids: Any
    weights: Any


def pad_ragged(values, *, row_lengths=None, row_splits=None, weights=None, max_length=None):
    """Ragged ids (flat values + row lengths or splits) to (B, L) padded with -1, on the host.

    Args:
        values: Flat ids of all rows, concatenated.
        row_lengths: (B,) ids per row. Exactly one of row_lengths / row_splits.
        row_splits: (B + 1,) offsets into values, starting at 0.
        weights: Optional flat weights aligned with values; then a `Weighted` is returned.
        max_length: L; longer rows are truncated at the end. Default: the longest row (>= 1).

    Returns:
        (B, L) ids padded with -1, int32 unless a value needs 64 bits (a dynamic table's id;
        for a static table it is then named as out of range, never wrapped into another id),
        then int64; or `Weighted(ids, weights)` with float32 weights.
    """
    values = np.asarray(values)
    if values.ndim != 1:
        raise ValueError(f"pad_ragged: values must be flat (1-D), got shape {values.shape}.")
    if (row_lengths is None) == (row_splits is None):
        raise ValueError("pad_ragged: give exactly one of row_lengths and row_splits.")
    if row_splits is not None:
        splits = np.asarray(row_splits, np.int64)
        if (
            splits.ndim != 1
            or splits.size == 0
            or splits[0] != 0
            or np.any(np.diff(splits) < 0)
            or splits[-1] != values.size
        ):
            raise ValueError(
                f"pad_ragged: row_splits must be non-decreasing, start at 0 and "
                f"end at len(values)={values.size}, got {splits.tolist()}."
            )
        lengths = np.diff(splits)
    else:
        lengths = np.asarray(row_lengths, np.int64)
        if lengths.ndim != 1 or np.any(lengths < 0) or lengths.sum() != values.size:
            raise ValueError(
                f"pad_ragged: row_lengths must be >= 0 and sum to "
                f"len(values)={values.size}, got {lengths.tolist()}."
            )
        splits = np.concatenate([[0], np.cumsum(lengths)])
    if max_length is not None and (not _config.is_int(max_length) or max_length < 1):
        raise ValueError(f"pad_ragged: max_length must be an int >= 1, got {max_length!r}.")
    width = int(max_length) if max_length is not None else max(1, int(lengths.max(initial=0)))
    batch = lengths.size
    rows = np.repeat(np.arange(batch), lengths)
    cols = np.arange(values.size) - splits[rows]
    keep = cols < width
    small = values.size == 0 or (
        np.issubdtype(values.dtype, np.integer)
        and np.iinfo(np.int32).min <= values.min() <= values.max() <= np.iinfo(np.int32).max
    )
    ids = np.full((batch, width), -1, np.int32 if small else np.int64)
    ids[rows[keep], cols[keep]] = values[keep]
    if weights is None:
        return ids
    weights = np.asarray(weights, np.float32)
    if weights.shape != values.shape:
        raise ValueError(
            f"pad_ragged: weights must match values' shape {values.shape}, got {weights.shape}."
        )
    w = np.zeros((batch, width), np.float32)
    w[rows[keep], cols[keep]] = weights[keep]
    return Weighted(ids, w)


PAD = 0xFFFFFFFF  # Both uint32 halves of the id -1.


class SplitIds(NamedTuple):
    """int64 ids as their two uint32 halves (two's complement): `hi` the upper 32 bits, `lo`
    the lower; -1 (padding) is hi = lo = 0xFFFFFFFF. Same shapes, (B,) or (B, L). The form
    dynamic tables take ids in under `jit` without `jax_enable_x64` (`split_ids`)."""

    hi: Any
    lo: Any


def split_ids(ids) -> SplitIds:
    """int64 ids (NumPy, a list, or any integer array) -> `SplitIds` of uint32 NumPy arrays.
    For input pipelines: split on the host, then feed the halves to a jitted step."""
    a = np.asarray(ids)
    if not np.issubdtype(a.dtype, np.integer) or a.dtype == np.uint64:
        raise ValueError(
            f"split_ids: ids must be a signed integer array (int64 or int32), got dtype {a.dtype}."
        )
    u = a.astype(np.int64).view(np.uint64)
    return SplitIds((u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(PAD)).astype(np.uint32))


def join_ids(ids: SplitIds) -> np.ndarray:
    """The inverse of `split_ids`: int64 NumPy ids."""
    hi = np.asarray(ids.hi).astype(np.uint64)
    lo = np.asarray(ids.lo).astype(np.uint64)
    return ((hi << np.uint64(32)) | lo).view(np.int64)


# ------------------------------------------------------------------ jax_enable_x64


def x32(*wide: str):
    """Decorator: the function runs with `jax_enable_x64` off, which the engine is written
    for (32-bit ids, rows and counters; 64-bit ids as `SplitIds`), so that it computes the
    same whether the caller has it on or not. With it off it is the function itself. With it
    on, the arguments named in `wide` are first narrowed where 64 bits still hold
    (`narrow`): a feature dict, given the first argument's spec (an `Embedding`, a
    `Server`) or the first argument as the spec, or any other tree (activation gradients).
    Outputs are 32-bit either way."""

    def decorate(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if not jax.enable_x64.value:
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            first = next(iter(bound.arguments.values()), None)  # self, or a spec.
            own = (
                first if isinstance(first, _config.EmbeddingSpec) else getattr(first, "spec", None)
            )
            for name in wide:
                if name in bound.arguments:
                    spec = own if name in _FEATURES else None
                    value = bound.arguments[name]
                    if signature.parameters[name].kind == inspect.Parameter.VAR_POSITIONAL:
                        bound.arguments[name] = tuple(narrow(v, spec) for v in value)
                    else:
                        bound.arguments[name] = narrow(value, spec)
            with jax.enable_x64(False):
                return fn(*bound.args, **bound.kwargs)

        return wrapped

    return decorate


_FEATURES = ("features", "more")  # The arguments of x32 that hold feature dicts.


def narrow(tree, spec: _config.EmbeddingSpec | None = None):
    """`tree` with its 64-bit arrays made 32-bit while `jax_enable_x64` is on: float64 to
    float32; int64 ids, in a feature dict of `spec`, to `SplitIds` for a dynamic table and to
    int32 for a static one; elsewhere int64 to int32. A jax array's value beyond int32
    becomes int32's minimum (an invalid id, never another row); NumPy ids beyond int32 of a
    static table stay as they are, for the host check to name them. NumPy arrays become
    new ones: jax may hand back a NumPy array it has seen under x64 as the 64-bit array it
    made then, whatever the setting now (jax 0.10.2)."""

    def narrowed(x):  # Other dtypes (complex, bool, strings) are left to the checks.
        if not isinstance(x, (np.ndarray, jax.Array)) or np.dtype(x.dtype).str[1:] not in _WIDE:
            return x
        if np.issubdtype(x.dtype, np.floating):
            return x.astype(np.float32)
        low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
        if isinstance(x, np.ndarray):
            return x if x.size and (x.min() < low or x.max() > high) else x.astype(np.int32)
        return jnp.where((x >= low) & (x <= high), x, low).astype(jnp.int32)

    if spec is None or not isinstance(tree, dict):
        return jax.tree.map(narrowed, tree)
    dynamic = {p for p, f in spec.flat_features if _is_dynamic(f)}
    out = {}
    for path, leaf in _flatten_leaves(tree):
        ids, weights = _split(leaf)
        if path in dynamic and isinstance(ids, (np.ndarray, jax.Array)) and ids.dtype == np.int64:
            ids = split_ids(ids) if isinstance(ids, np.ndarray) else _split_traced(ids)
        elif hasattr(ids, "dtype") and np.issubdtype(ids.dtype, np.integer):
            ids = narrowed(ids)  # Float ids are left for the checks to name.
        out[path] = Weighted(ids, narrowed(weights)) if isinstance(leaf, Weighted) else ids
    return _config.unflatten(out)


_WIDE = ("i8", "u8", "f8")  # The 64-bit dtypes `narrow` makes 32-bit.


def _is_dynamic(feature: _config.FeatureConfig) -> bool:
    return isinstance(feature.table, _config.TableConfig) and feature.table.dynamic is not None


def _split_traced(ids: jax.Array) -> SplitIds:
    """`split_ids` of an int64 jax array (traced or not), computed with jax_enable_x64 on."""
    u = ids.astype(jnp.uint64)
    return SplitIds((u >> 32).astype(jnp.uint32), (u & PAD).astype(jnp.uint32))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _split(leaf):
    if isinstance(leaf, Weighted):
        return leaf.ids, leaf.weights
    return leaf, None


def flatten_inputs(spec: _config.EmbeddingSpec, features) -> dict[str, Any]:
    """{path: leaf} following the spec's structure; raises on missing/extra features."""
    if not isinstance(features, dict):
        raise TypeError(
            f"features must be a dict mirroring the spec, got {type(features).__name__}."
        )
    given = dict(_flatten_leaves(features))
    want = [p for p, _ in spec.flat_features]
    missing = [p for p in want if p not in given]
    extra = sorted(p for p in given if p not in set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing features {missing}")
        if extra:
            parts.append(f"unknown features {extra}")
        raise ValueError(
            f"features do not match the spec: {'; '.join(parts)}. The spec's features are {want}."
        )
    return given


def _flatten_leaves(tree, prefix=""):
    for key in sorted(tree):
        path = f"{prefix}/{key}" if prefix else str(key)
        value = tree[key]
        if isinstance(value, dict):
            yield from _flatten_leaves(value, path)
        else:
            yield path, value


def validate(spec: _config.EmbeddingSpec, features, num_shards: int) -> None:
    """Checks concrete inputs on the host; raises one ValueError listing every problem."""
    flat = flatten_inputs(spec, features)
    configs = dict(spec.flat_features)
    problems: list[str] = []
    batch_sizes: dict[str, int] = {}
    for path, leaf in flat.items():
        f = configs[path]
        ids, weights = _split(leaf)
        if ids is None or not hasattr(ids, "shape") and not isinstance(ids, (list, tuple)):
            problems.append(
                f"Feature {path!r}: expected an int array (B,) or (B, L) or "
                f"jte.Weighted, got {type(leaf).__name__}."
            )
            continue
        dynamic = _is_dynamic(f)
        if isinstance(ids, SplitIds):
            if not dynamic:
                problems.append(
                    f"Feature {path!r}: jte.SplitIds are ids of a dynamic table; table "
                    f"{spec_table_name(spec, f)!r} has a vocabulary: give int ids."
                )
                continue
            halves = [_host_value(h) if _is_concrete(h) else h for h in ids]
            if any(h.dtype != np.uint32 for h in halves) or halves[0].shape != halves[1].shape:
                problems.append(
                    f"Feature {path!r}: SplitIds halves must be uint32 arrays of one shape, "
                    f"got {[(str(h.dtype), tuple(h.shape)) for h in halves]}."
                )
                continue
            ids = halves[0].astype(np.int32)  # Its shape is all that is checked below.
        if not _is_concrete(ids):
            continue
        ids = _host_value(ids)
        if not np.issubdtype(ids.dtype, np.signedinteger):
            problems.append(
                f"Feature {path!r}: ids have dtype {ids.dtype}; they must have {ID_DTYPES}."
            )
            continue
        if ids.ndim not in (1, 2):
            problems.append(f"Feature {path!r}: ids must be (B,) or (B, L), got shape {ids.shape}.")
            continue
        batch_sizes[path] = ids.shape[0]
        if weights is not None and _is_concrete(weights):
            weights = _host_value(weights)
            if not np.issubdtype(weights.dtype, np.floating):
                problems.append(f"Feature {path!r}: weights must be floats, got {weights.dtype}.")
            elif weights.shape != ids.shape:
                problems.append(
                    f"Feature {path!r}: weights shape {weights.shape} differs "
                    f"from ids shape {ids.shape}."
                )
            elif not np.all(np.isfinite(weights[ids != -1])):
                pos = np.argwhere(~np.isfinite(weights) & (ids != -1))[0].tolist()
                problems.append(f"Feature {path!r}: weight at position {pos} is not finite.")
        assert isinstance(f.table, _config.TableConfig)  # So in every EmbeddingSpec.
        if dynamic:  # Every int64 is an id; -1 pads.
            continue
        vocab = f.table.vocabulary_size
        bad = (ids != -1) & ((ids < 0) | (ids >= vocab))
        if bad.any():
            where = np.argwhere(bad)
            first = where[0].tolist()
            problems.append(
                f"Feature {path!r}: id {ids[tuple(first)]} at position {first} is outside "
                f"[0, {vocab}) of table {spec_table_name(spec, f)!r}"
                + (f" ({len(where)} invalid ids in all)" if len(where) > 1 else "")
                + ". Use -1 for padding."
            )
    if len(set(batch_sizes.values())) > 1:
        problems.append(f"all features must have the same batch size B, got {batch_sizes}.")
    elif batch_sizes:
        batch = next(iter(batch_sizes.values()))
        if batch % num_shards:
            problems.append(
                f"batch size B={batch} must be a multiple of the mesh size "
                f"{num_shards} along the sharding axis."
            )
    if problems:
        raise ValueError("Invalid features:\n  " + "\n  ".join(problems))


def _host_value(x):
    """x as NumPy. Of a jax.Array spanning several processes only this process's shards can be
    read; the rest is zeros (id 0 is always valid), so each process checks its own rows of
    the global batch and reports global positions."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        out = np.zeros(x.shape, x.dtype)
        for shard in x.addressable_shards:
            out[shard.index] = np.asarray(shard.data)
        return out
    return np.asarray(x)


def spec_table_name(spec, feature) -> str:
    return _config.table_names(spec)[id(feature.table)]


def normalize(feature: _config.FeatureConfig, leaf) -> tuple[jax.Array, jax.Array]:
    """(ids, weights): ids int32 (B, L) with -1 where nothing is looked up, weights
    float32 (B, L) (0 there).

    Works on NumPy and traced values alike; ids outside [0, V) other than -1 behave exactly
    like -1.
    """
    ids, weights = _split(leaf)
    ids = jnp.asarray(ids)
    if ids.ndim == 1:
        ids = ids[:, None]
        if weights is not None:
            weights = jnp.asarray(weights)[:, None]
    ids = ids.astype(jnp.int32)
    if feature.is_sequence:
        length = feature.max_sequence_length
        if ids.shape[1] > length:
            ids = ids[:, :length]
            weights = None if weights is None else jnp.asarray(weights)[:, :length]
        elif ids.shape[1] < length:
            pad = ((0, 0), (0, length - ids.shape[1]))
            ids = jnp.pad(ids, pad, constant_values=-1)
            weights = None if weights is None else jnp.pad(jnp.asarray(weights), pad)
    assert isinstance(feature.table, _config.TableConfig)  # So in every EmbeddingSpec.
    vocab = feature.table.vocabulary_size
    assert vocab is not None  # A dynamic table's ids are rows by now (_dynamic).
    valid = (ids >= 0) & (ids < vocab)
    ids = jnp.where(valid, ids, -1)
    if weights is None:
        weights = valid.astype(jnp.float32)
    else:
        weights = jnp.where(valid, jnp.asarray(weights, jnp.float32), 0.0)
    return ids, weights


def invalid_counts(spec: _config.EmbeddingSpec, features) -> dict[str, jax.Array]:
    """{feature path: int32 count of ids that are neither -1 nor in [0, V)}; jittable."""
    flat = flatten_inputs(spec, features)
    configs = dict(spec.flat_features)
    out = {}
    for path, leaf in flat.items():
        ids, _ = _split(leaf)
        ids = jnp.asarray(ids)
        table = configs[path].table
        assert isinstance(table, _config.TableConfig)  # So in every EmbeddingSpec.
        if table.dynamic is not None:  # Every id but -1 is valid.
            out[path] = jnp.zeros((), jnp.int32)
            continue
        vocab = int(table.vocabulary_size or 0)
        out[path] = jnp.sum((ids != -1) & ((ids < 0) | (ids >= vocab)), dtype=jnp.int32)
    return out


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


ID_DTYPES = "a signed integer dtype (int32 or int64; -1 pads)"


def check_batch(features_flat: dict[str, Any], num_shards: int, allow_empty: bool = False) -> int:
    """The common batch size B; static, so it is checked under jit too, with the ranks and
    dtypes (an id cast from a float, bool or unsigned dtype would silently be another id).
    B = 0 is an error unless `allow_empty` (serving answers an empty request)."""
    problems = []
    sizes = {}
    for path, leaf in features_flat.items():
        ids, weights = _split(leaf)
        if isinstance(ids, SplitIds):  # Halves checked where they are split (_dynamic).
            ids = ids.hi
            shape, dtype = np.shape(ids), np.dtype(np.int32)
        else:
            shape, dtype = np.shape(ids), _dtype(ids)
        if not jnp.issubdtype(dtype, jnp.signedinteger):
            problems.append(
                f"Feature {path!r}: ids have dtype {dtype}; they must have {ID_DTYPES}."
            )
        if len(shape) not in (1, 2):
            problems.append(f"Feature {path!r}: ids must be (B,) or (B, L), got shape {shape}.")
            continue
        sizes[path] = int(shape[0])
        if weights is not None:
            if np.shape(weights) != shape:
                problems.append(
                    f"Feature {path!r}: weights shape {np.shape(weights)} differs "
                    f"from ids shape {shape}."
                )
            if not jnp.issubdtype(_dtype(weights), jnp.floating):
                problems.append(
                    f"Feature {path!r}: weights have dtype {_dtype(weights)}; they must be "
                    f"real floats (e.g. float32)."
                )
    if len(set(sizes.values())) > 1:
        problems.append(f"all features must have the same batch size B, got {sizes}.")
    elif sizes:
        batch = next(iter(sizes.values()))
        if batch == 0 and not allow_empty:
            problems.append(
                f"the batch is empty (B=0); B must be a positive multiple of the mesh size "
                f"{num_shards} along the sharding axis."
            )
        elif batch % num_shards:
            problems.append(
                f"batch size B={batch} must be a multiple of the mesh size "
                f"{num_shards} along the sharding axis."
            )
    if problems:
        raise ValueError("Invalid features:\n  " + "\n  ".join(problems))
    return next(iter(sizes.values()))


def combiner_scale(weights: jax.Array, combiner: str, *, unit: bool = False) -> jax.Array:
    """Per-position factor (B, L) so that output = Σ_l scale·row; 0 where a divisor is 0.

    `unit`: every weight is 0 or 1, so the divisor comes from a count of the ids, summed as
    integers: the same value as the float sums. Around a dynamic table's serving lookup,
    XLA:CPU's fusion of the float sum made the whole lookup twice as slow (docs/design.md)."""
    if combiner == "sum":
        return weights
    if unit:
        count = jnp.sum(weights != 0, axis=1, keepdims=True, dtype=jnp.int32)
        count = count.astype(weights.dtype)
        denom = count if combiner == "mean" else jnp.sqrt(count)
    elif combiner == "mean":
        denom = jnp.sum(weights, axis=1, keepdims=True)
    else:  # sqrtn
        denom = jnp.sqrt(jnp.sum(weights * weights, axis=1, keepdims=True))
    safe = jnp.where(denom == 0, 1.0, denom)
    return jnp.where(denom == 0, 0.0, weights / safe)
