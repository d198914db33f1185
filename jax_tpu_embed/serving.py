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

Dynamic tables serve their exported `jte.DynamicRows` (ids int64, rows): at load the ids are
split into uint32 halves and laid out by a hash of each id in buckets of about two, with
each bucket's start recorded, and the jitted lookup reads one window of keys from its id's
bucket (static shapes, so it exports; `served_rows`). An id that is not served reads zeros
(`unknown="zeros"`, the default) or its initial row (`unknown="init"`: what
`Embedding.lookup` gives it, drawn from the table's key words, `state.index[name].key`:
`Server.from_embedding` takes them from the state, else pass `keys=`). Their ids arrive as
int64 NumPy (split on the host) or `jte.SplitIds` (what a jitted or exported lookup takes).

    server = jte.serving.Server.from_embedding(emb, state, unknown="init")
    server = jte.serving.Server(spec, emb.export(state), unknown="init",
                                keys={"users": state.index["users"].key})
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _config, _dynamic, _embedding, _guards, _inputs, _layout, _storage

Nested = Any

UNKNOWN = ("zeros", "init")

for _type, _name in ((_inputs.Weighted, "Weighted"), (_inputs.SplitIds, "SplitIds")):
    try:
        # jax.export must know how to (de)serialize the input containers.
        jax.export.register_namedtuple_serialization(
            _type, serialized_name=f"jax_tpu_embed.{_name}"
        )
    except ValueError:  # Already registered (module reloaded).
        pass


def _dynamic_names(spec: _config.EmbeddingSpec) -> set[str]:
    return {n for n, t in spec.tables().items() if t.dynamic is not None}


_SALT = 0x5E2F1D07  # Keeps the buckets here apart from the index's and the initial rows'.
PER_BUCKET = 2  # Ids per bucket on average: the buckets are a power of two >= n / 2, and >= 2.


def _bucket_hash(hi, lo):
    """A 32-bit hash of the whole id (uint32 halves; jnp): every bit depends on both."""
    return _storage.mix32(jnp.asarray(hi, jnp.uint32) ^ _storage.mix32(lo ^ jnp.uint32(_SALT)))


def _buckets(h, num_buckets: int):
    """The bucket of hash `h`: its top log2(num_buckets) bits (num_buckets >= 2)."""
    return (h >> jnp.uint32(33 - num_buckets.bit_length())).astype(jnp.int32)


def served_rows(rows: _dynamic.DynamicRows, key: Any = None) -> dict[str, np.ndarray]:
    """A dynamic table's `DynamicRows` as a served table (NumPy), laid out for `find`:

    - "keys": uint32 (2·(n + W),), the ids as (hi, lo) pairs, by bucket (a power of two of
      them, about `PER_BUCKET` ids each; an id's bucket is the top bits of a hash of it),
      then W padding ids (-1, never found): W, the most ids of a bucket rounded up to a
      multiple of 8, is how many ids a lookup reads, one window of 2·W words (flat, so
      that a TPU stores it without padding lanes);
    - "rows": (n, D), in the same order;
    - "start": int32 (buckets,), where each bucket's ids begin;
    - "key": uint32 (2,) when given, the table's key words (`state.index[name].key`) that
      unknown="init" draws initial rows from.

    No ids: one padding entry (id -1, never found)."""
    ids, values = _dynamic.check_rows("serving", rows)
    if not len(ids):
        ids, values = np.full((1,), -1, np.int64), np.zeros((1, values.shape[1]), values.dtype)
    split = _inputs.split_ids(ids)
    num_buckets = 1 << max(1, (-(-len(ids) // PER_BUCKET) - 1).bit_length())
    cpu = jax.devices("cpu")[0]  # The hash as the lookup computes it, bit for bit.
    with jax.default_device(cpu):
        bucket = np.asarray(_buckets(_bucket_hash(split.hi, split.lo), num_buckets))
    order = np.argsort(bucket, kind="stable")  # The ids come ascending: (bucket, id) order.
    sizes = np.bincount(bucket, minlength=num_buckets)
    start = (np.cumsum(sizes) - sizes).astype(np.int32)
    width = -(-max(int(sizes.max()), 1) // 8) * 8
    keys = np.full((len(ids) + width, 2), np.uint32(_dynamic.PAD))
    keys[: len(ids), 0], keys[: len(ids), 1] = split.hi[order], split.lo[order]
    out = {"keys": keys.reshape(-1), "rows": values[order], "start": start}
    if key is not None:
        words = np.asarray(key)
        if words.shape != (2,) or words.dtype != np.uint32:
            raise ValueError(
                f"serving: a dynamic table's key must be its two uint32 key words "
                f"(state.index[name].key), got {words.dtype} {words.shape}."
            )
        out["key"] = words
    return out


LANES = 128  # A TPU vector register's lanes: what rows are packed to for a TPU (`served_tables`).


def _packing(dim: int) -> _layout.Packing:
    """How rows of width `dim` are lane-packed, as training stores them on a TPU: k = 128 / w
    rows of w lanes (dim rounded up to a power of two) share a physical row of 128 lanes;
    wider ones are padded to a multiple of 128."""
    return _layout.Packing(dim, 2, LANES)


def _is_packed(rows, dim: int) -> bool:
    """Whether served rows (an array or a ShapeDtypeStruct) are lane-packed: a packed row's
    width is k·w, never D."""
    p = _packing(dim)
    return p.packed and np.shape(rows)[-1] == p.per_row * p.padded_width


def _pack(rows, dim: int, extra: int = 0):
    """(n, D) rows (NumPy, jax.Array or ShapeDtypeStruct), with `extra` zero rows after them,
    lane-packed: (ceil((n + extra) / k), k·w); rows packed already, or that need no packing,
    as they are."""
    p = _packing(dim)
    if not p.packed or _is_packed(rows, dim):
        return rows
    n = np.shape(rows)[0] + extra
    if isinstance(rows, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((p.shard_rows(n), p.per_row * p.padded_width), rows.dtype)
    host = np.asarray(rows)
    return p.pack(np.pad(host, [(0, extra), (0, 0)]), 1)


def _pack_served(table: Mapping[str, Any], dim: int) -> dict[str, Any]:
    """A dynamic table's served form with its rows lane-packed. Padding ids (never found)
    fill the ids up to a multiple of k, so that `find` still knows their count (rows · k)."""
    out = dict(table)
    rows = table["rows"]
    if not _packing(dim).packed or _is_packed(rows, dim):
        return out
    n, keys = np.shape(rows)[0], table["keys"]
    extra = -n % _packing(dim).per_row
    if isinstance(keys, jax.ShapeDtypeStruct):
        out["keys"] = jax.ShapeDtypeStruct((keys.shape[0] + 2 * extra,), keys.dtype)
    else:
        keys = np.asarray(keys)
        pad = np.full((2 * extra,), _dynamic.PAD, keys.dtype)
        out["keys"] = np.concatenate([keys[: 2 * n], pad, keys[2 * n :]])
    out["rows"] = _pack(rows, dim, extra)
    return out


def _served_count(rows, dim: int) -> int:
    """How many ids a dynamic table's served rows hold (padding ids included)."""
    return np.shape(rows)[0] * (_packing(dim).per_row if _is_packed(rows, dim) else 1)


def _rows_at(rows, positions, dim: int):
    """float32 served rows at `positions`: (..., D); lane-packed rows, each position's
    physical row with every other row's lanes zeroed, (..., k·w), which `_fold` makes
    (..., D). Combined first and folded after, they cost the TPU compiler half as much at
    D = 16 as folded first (docs/design.md), and XLA:CPU's contraction over k·w lanes can
    round differently from one over D (float32 rounding)."""
    rows = jnp.asarray(rows)
    # Gathered at flat indices: the TPU compiler pads a (B, L) index array's L to 128 lanes
    # and charges the gather accordingly.
    flat = lambda at: jnp.take(rows, at.reshape(-1), axis=0).astype(jnp.float32)
    if not _is_packed(rows, dim):
        return flat(positions).reshape(positions.shape + (dim,))
    p = _packing(dim)
    physical = flat(positions // p.per_row).reshape(positions.shape + (-1,))
    return jnp.where(p.own_lanes(positions), physical, 0.0)


def _fold(x, dim: int):
    """(..., k·w) lane-packed rows (`_rows_at`), or sums of them over positions -> (..., D):
    the sum over the k lane groups, each lane holding one position's value or 0."""
    return x if x.shape[-1] == dim else _packing(dim).fold(x)[..., :dim]


@_inputs.x32()
def served_tables(
    spec: _config.EmbeddingSpec,
    tables: Mapping[str, Any],
    keys: Mapping[str, Any] | None = None,
    *,
    lanes: int = 0,
) -> dict[str, Any]:
    """`tables` with each dynamic table's `DynamicRows` made its served form (`served_rows`,
    with its key from `keys` if there); everything else as it is.

    `lanes=128` also packs every table's rows (a dynamic table's "rows") narrower than 128
    lanes as training packs them on a TPU: k rows of D lanes (D rounded up to a power of
    two) share a row of 128, and wider widths are padded to a multiple of 128. A TPU pads a
    narrow array's rows to 128 lanes, and its compiler charges a gather from one a copy of
    the whole table. This is the form a `Server` on a TPU holds and that artifacts exported
    for a TPU take (`export(platforms=("tpu",))`); the lookup reads either form."""
    if lanes not in (0, LANES):
        raise ValueError(f"serving: lanes must be 0 (rows as they are) or {LANES}, got {lanes}.")
    keys = dict(keys or {})
    dynamic = _dynamic_names(spec)
    unknown = sorted(set(keys) - dynamic)
    if unknown:
        raise ValueError(
            f"serving: keys are given for {unknown}, which are not dynamic tables of the "
            f"spec (its dynamic tables: {sorted(dynamic)})."
        )
    out = dict(tables)
    for name in dynamic:
        if isinstance(out.get(name), _dynamic.DynamicRows):
            out[name] = served_rows(out[name], keys.get(name))
        elif name in keys and isinstance(out.get(name), Mapping):
            out[name] = {**out[name], "key": np.asarray(keys[name])}
    if lanes:
        for name, t in spec.tables().items():
            if name not in out:
                continue
            if name in dynamic and isinstance(out[name], Mapping):
                out[name] = _pack_served(out[name], t.dim)
            elif name not in dynamic:
                out[name] = _pack(out[name], t.dim)
    return out


@_inputs.x32("features")
def lookup(
    spec: _config.EmbeddingSpec,
    tables: Mapping[str, Any],
    features: Nested,
    unknown: str = "zeros",
) -> Nested:
    """Embeds every feature from logical tables; pure and jittable.

    Args:
        spec: The EmbeddingSpec the tables were trained with.
        tables: {table name: (V, D) array} in natural row order, as `Embedding.export` gives;
            a dynamic table's in its served form (`served_rows`; `jte.DynamicRows` outside
            jit). Lane-packed tables (`served_tables(lanes=128)`) are read as packed.
        features: Mirrors the spec; leaves as for `Embedding.lookup` (B need not be a
            multiple of anything). A dynamic table's ids as `jte.SplitIds` under jit.
        unknown: What a dynamic table's id that is not served reads: "zeros", or "init",
            its initial row (as `Embedding.lookup`; the served table needs its "key").

    Returns:
        Same structure: float32 (B, D) per feature, (B, L, D) for sequence features (or
        output_shape + (D,)). Examples with no ids give zeros.
    """
    _check_unknown(unknown, "serving.lookup")
    if any(isinstance(t, _dynamic.DynamicRows) for t in tables.values()):
        tables = served_tables(spec, tables)
    flat = _inputs.flatten_inputs(spec, features)
    names = _config.table_names(spec)
    dynamic = _dynamic_names(spec)
    out = {}
    for path, feature in spec.flat_features:
        name = names[id(feature.table)]
        if name in dynamic:
            out[path] = _embed_dynamic(path, feature, name, tables[name], flat[path], unknown)
        else:
            table = jnp.asarray(tables[name])
            out[path] = _embed(path, feature, table, flat[path])
    return _config.unflatten(out)


def _check_unknown(unknown: str, where: str) -> None:
    if unknown not in UNKNOWN:
        raise ValueError(f"{where}: unknown must be one of {list(UNKNOWN)}, got {unknown!r}.")


def _embed(path: str, feature: _config.FeatureConfig, table, leaf):
    assert isinstance(feature.table, _config.TableConfig)  # So in every EmbeddingSpec.
    dim = feature.table.dim
    ids, weights = _inputs.normalize(feature, leaf)  # (B, L); -1 and 0 where nothing.
    rows = _rows_at(table, jnp.maximum(ids, 0), dim)  # (B, L, D), or (B, L, k·w) packed.
    if feature.is_sequence:
        return _shaped(path, feature, _fold(rows, dim) * weights[..., None])
    scale = _inputs.combiner_scale(weights, feature.table.combiner)
    return _shaped(path, feature, _fold(_combined(scale, rows), dim))


def _combined(scale, rows):
    return jnp.einsum("bl,bld->bd", scale, rows, precision=lax.Precision.HIGHEST)


def _embed_dynamic(path: str, feature: _config.FeatureConfig, name: str, table, leaf, unknown):
    assert isinstance(feature.table, _config.TableConfig)  # So in every EmbeddingSpec.
    if unknown == "init" and "key" not in table:
        raise ValueError(
            f"serving: unknown='init' draws the initial rows of table {name!r} from its key "
            f"words; give them (keys={{{name!r}: state.index[{name!r}].key}}, or "
            f"Server.from_embedding)."
        )
    dim = feature.table.dim
    draw = feature.table.initializer  # A row initializer, or None: the default.
    hi, lo, weights = _dynamic.split_leaf(path, feature, leaf)  # (B, L) halves.
    scale = _dynamic.scaled_weights(feature, feature.table.combiner, hi, lo, weights)
    position, found = find(table, hi, lo, dim)
    rows = jnp.where(found[..., None], _rows_at(table["rows"], position, dim), 0.0)
    # Initial rows drawn for the ids not served only, as the training lookup does.
    key = jnp.asarray(table["key"]) if unknown == "init" else None
    missing = ~found & (scale != 0)
    if feature.is_sequence:
        rows = _fold(rows, dim)
        if unknown == "init":
            rows = rows + _dynamic.initial_rows_where(key, hi, lo, missing, dim, draw=draw)
        return _shaped(path, feature, rows * scale[..., None])
    out = _fold(_combined(scale, rows), dim)
    if unknown == "init":
        out = out + _dynamic.missing_rows(key, hi, lo, scale, missing, dim, draw=draw)
    return _shaped(path, feature, out)


def find(table: Mapping[str, Any], hi, lo, dim: int | None = None):
    """(position int32, found bool) of ids (hi, lo) (any shape) in a served table
    (`served_rows`): each id's bucket from its hash, one window of W ids from the bucket's
    start, compared whole. Padding (-1) is never found; an id not found reads position 0.
    `dim`: the table's D, needed when its rows are lane-packed (`served_tables`)."""
    keys, start = jnp.asarray(table["keys"]), jnp.asarray(table["start"])
    ids = table["rows"].shape[0] if dim is None else _served_count(table["rows"], dim)
    width = keys.shape[0] // 2 - ids  # The padding: no window runs out.
    shape = np.shape(hi)
    hi, lo = (jnp.asarray(x, jnp.uint32).reshape(-1) for x in (hi, lo))  # Flat: see `_rows_at`.
    first = _point(start, _buckets(_bucket_hash(hi, lo), start.shape[0]))
    # One contiguous window per id: XLA:CPU copies it whole, where 2·W point gathers of
    # separate hi and lo arrays took twice as long.
    window = jax.vmap(lambda at: lax.dynamic_slice(keys, (2 * at,), (2 * width,)))(first)
    # Compared as it lies, (hi, lo) word pairs, against the id's words alternating: a pair
    # matches where its hi lane and the next lane both do. (Split into hi and lo columns,
    # the window cost more on XLA:CPU and on the TPU compiler's count.)
    lanes = lax.iota(jnp.int32, 2 * width)
    same = window == jnp.where(lanes % 2 == 0, hi[:, None], lo[:, None])
    pair = same & jnp.roll(same, -1, axis=1) & (lanes % 2 == 0)
    # One reduction gives both the lane and whether there is one: with `any` and `argmax`,
    # XLA:CPU gathered the windows once for each.
    lane = jnp.min(jnp.where(pair, lanes // 2, width), axis=-1)
    found = (lane < width) & ~_dynamic.is_pad(hi, lo)
    return jnp.where(found, first + lane, 0).reshape(shape), found.reshape(shape)


def _point(x, at, size: int = 8):
    """x[at] of a 1-D x at flat indices `at`. On a TPU each is read as a window of `size`
    that holds it (clamped into x) and one lane of that: the TPU compiler charges a point
    gather from a large 1-D array several times as much (docs/design.md). Elsewhere a
    plain gather, which XLA:CPU runs faster."""

    def windows(x, at):
        n = min(size, x.shape[0])
        s = jnp.minimum(at, x.shape[0] - n)
        window = jax.vmap(lambda a: lax.dynamic_slice(x, (a,), (n,)))(s)
        lane = lax.iota(jnp.int32, n) == (at - s)[:, None]
        return jnp.sum(jnp.where(lane, window, 0), axis=-1, dtype=x.dtype)

    return lax.platform_dependent(x, at, tpu=windows, default=lambda x, at: x[at])


def _shaped(path: str, feature: _config.FeatureConfig, acts):
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
    """ValueError listing every table that is missing, unknown or of the wrong shape (a
    dynamic table's: `jte.DynamicRows` or its served form, of (n, D) rows); lane-packed
    tables (`served_tables(lanes=128)`) too."""
    dynamic = _dynamic_names(spec)
    want = {name: (t.vocabulary_size, t.dim) for name, t in spec.tables().items()}
    problems = [f"table {n!r} is missing" for n in want if n not in tables]
    problems += [
        f"table {n!r} is not in the spec (its tables are {list(want)})"
        for n in tables
        if n not in want
    ]
    for n in want:
        if n not in tables:
            continue
        t = tables[n]
        if n not in dynamic:
            packed = _pack(jax.ShapeDtypeStruct(want[n], np.float32), want[n][1]).shape
            if tuple(np.shape(t)) not in (want[n], tuple(packed)):
                problems.append(
                    f"table {n!r} has shape {tuple(np.shape(t))}, the spec says "
                    f"(vocabulary_size, dim) = {want[n]}"
                    + (f" (lane-packed: {tuple(packed)})" if tuple(packed) != want[n] else "")
                )
            continue
        rows = t.rows if isinstance(t, _dynamic.DynamicRows) else None
        if isinstance(t, Mapping) and {"hi", "lo", "rows"} <= set(t):  # Before session 28.
            problems.append(
                f"table {n!r} is in an older served form (sorted 'hi' and 'lo' for a "
                f"binary search): serve its jte.DynamicRows, or make the form with "
                f"jte.serving.served_rows"
            )
            continue
        if isinstance(t, Mapping) and {"keys", "rows", "start"} <= set(t):
            rows = t["rows"]
        if rows is None:
            problems.append(
                f"table {n!r} is dynamic: give jte.DynamicRows(ids, rows) (what "
                f"Embedding.export gives), got {type(t).__name__}"
            )
        elif len(np.shape(rows)) != 2 or (
            np.shape(rows)[1] != want[n][1] and not _is_packed(rows, want[n][1])
        ):
            problems.append(
                f"table {n!r} has rows of shape {tuple(np.shape(rows))}, the spec says "
                f"(ids, dim) = (n, {want[n][1]})"
            )
    if problems:
        raise ValueError("serving: the tables do not fit the spec: " + "; ".join(problems) + ".")


def _host_split(spec: _config.EmbeddingSpec, flat: dict) -> dict:
    """{path: leaf} with a dynamic table's NumPy int64 ids split into `jte.SplitIds` on the
    host (jit would cut them to int32 without jax_enable_x64)."""
    dynamic = _dynamic_names(spec)
    names = _config.table_names(spec)
    features = dict(spec.flat_features)
    return {
        p: _dynamic.split_on_host(x) if names[id(features[p].table)] in dynamic else x
        for p, x in flat.items()
    }


class Server:
    """A jitted lookup over exported tables held on one device (the first CPU by default).

    Args:
        spec: The EmbeddingSpec the tables were trained with.
        tables: {table name: (V, D) np.ndarray}, e.g. `emb.export(state)`; a dynamic
            table's as `jte.DynamicRows` (what export gives it) or its served form.
        device: Where to keep the tables and run; default `jax.devices("cpu")[0]`.
        unknown: What a dynamic table's id that is not served reads: "zeros" (default) or
            "init", its initial row, as `Embedding.lookup` gives it (needs `keys`).
        keys: {dynamic table name: its key words, `state.index[name].key` (uint32 (2,))};
            `from_embedding` takes them from the state.

    `tables` holds what serves: a dynamic table's as {"keys", "rows", "start"[, "key"]}
    (`served_rows`), the form `export`'s artifacts take; on a TPU device, every table's rows
    lane-packed (`served_tables(lanes=128)`), the form artifacts exported for a TPU take.
    """

    @_inputs.x32()
    def __init__(
        self,
        spec: _config.EmbeddingSpec,
        tables: Mapping[str, Any],
        device: jax.Device | None = None,  # pyright: ignore[reportInvalidTypeForm]
        *,
        unknown: str = "zeros",
        keys: Mapping[str, Any] | None = None,
    ):
        if not isinstance(spec, _config.EmbeddingSpec):
            raise TypeError(f"Server: spec must be a jte.EmbeddingSpec, got {type(spec).__name__}.")
        _guards.check_not_consumed(tables, "serving.Server", "tables", "tables")
        _check_unknown(unknown, "serving.Server")
        check_tables(spec, tables)
        self.spec, self.unknown = spec, unknown
        self.device = device if device is not None else jax.devices("cpu")[0]
        # On a TPU the rows are lane-packed: a narrow (V, D) array would take 128 lanes a row.
        lanes = LANES if self.device.platform == "tpu" else 0
        served = served_tables(spec, tables, keys, lanes=lanes)
        dynamic = _dynamic_names(spec)
        if unknown == "init":
            missing = sorted(n for n in dynamic if "key" not in served[n])
            if missing:
                raise ValueError(
                    f"serving.Server: unknown='init' draws initial rows from each dynamic "
                    f"table's key words; none given for {missing} (keys={{name: "
                    f"state.index[name].key}}, or Server.from_embedding)."
                )
        put = lambda x: jax.device_put(np.asarray(x), self.device)
        self.tables = {
            n: jax.tree.map(put, served[n]) if n in dynamic else put(served[n])
            for n in spec.tables()
        }
        self._jit = jax.jit(lambda t, f: lookup(self.spec, t, f, self.unknown))

    @classmethod
    def from_embedding(
        cls,
        emb: _embedding.Embedding,
        state: _embedding.EmbeddingState,
        device: jax.Device | None = None,  # pyright: ignore[reportInvalidTypeForm]
        *,
        unknown: str = "zeros",
    ) -> Server:
        """Serves `state`'s tables, exported in logical rows (a dynamic table's live ids,
        with its key words from the state)."""
        _guards.check_not_consumed(state, "serving.Server.from_embedding")
        keys = {n: np.asarray(jax.device_get(state.index[n].key)) for n in emb.dynamic}
        return cls(emb.spec, emb.export(state), device, unknown=unknown, keys=keys)

    @_inputs.x32("features")
    def __call__(self, features: Nested) -> Nested:
        """Activations of `features` (any batch size B); mirrors `Embedding.lookup`."""
        flat = _inputs.flatten_inputs(self.spec, features)
        leaves = [x for leaf in flat.values() for x in _parts(leaf)]
        if any(not isinstance(x, jax.Array) for x in leaves):  # As Embedding.lookup does.
            _inputs.validate(self.spec, features, 1)
        put = lambda x: jax.device_put(
            x if isinstance(x, jax.Array) else np.asarray(x), self.device
        )

        def placed(ids):
            if isinstance(ids, _inputs.SplitIds):
                return _inputs.SplitIds(put(ids.hi), put(ids.lo))
            return put(ids)

        flat = {
            path: (
                _inputs.Weighted(placed(leaf.ids), put(leaf.weights))
                if isinstance(leaf, _inputs.Weighted)
                else placed(leaf)
            )
            for path, leaf in _host_split(self.spec, flat).items()
        }
        return self._jit(self.tables, _config.unflatten(flat))

    @_inputs.x32()
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
            unknown=self.unknown,
        )


@_inputs.x32()
def export(
    spec: _config.EmbeddingSpec,
    tables: Mapping[str, Any],
    features: Nested,
    *,
    include_tables: bool = False,
    platforms: Sequence[str] | None = ("cpu",),
    polymorphic_batch: bool = False,
    unknown: str = "zeros",
    keys: Mapping[str, Any] | None = None,
) -> jax.export.Exported:
    """Exports the serving lookup with `jax.export`.

    Args:
        spec: The EmbeddingSpec.
        tables: {name: (V, D)} arrays (or jax.ShapeDtypeStruct when include_tables=False); a
            dynamic table's as `jte.DynamicRows` or its served form (`served_rows`, leaves
            arrays or jax.ShapeDtypeStruct). The artifact takes the served form (as
            `Server.tables` holds it), with the same number of ids.
        features: Example inputs (arrays or jax.ShapeDtypeStruct) fixing every feature's
            form, shape and dtype. A dynamic table's NumPy int64 ids are taken as
            `jte.SplitIds`, which is what the artifact takes.
        include_tables: False: the function is `call(tables, features)` and the tables stay
            outside the artifact. True: the tables are constants inside it and the function
            is `call(features)` (only for tables small enough to ship in the artifact).
        platforms: Lowering platforms, e.g. ("cpu", "tpu"); None: the default backend's. With
            "tpu" among them, the artifact takes its tables lane-packed (`served_tables(spec,
            tables, lanes=128)`; a `Server` on a TPU holds them so), which a TPU stores
            without padding and gathers from without copying the table.
        polymorphic_batch: Export B as a symbolic dimension, so one artifact serves any batch
            size. Not possible when a feature has output_shape (fixed by B).
        unknown, keys: As for `Server`.

    Returns:
        The `jax.export.Exported`; `.serialize()` gives bytes for `jax.export.deserialize`.
    """
    _guards.check_not_consumed(tables, "serving.export", "tables", "tables")
    _check_unknown(unknown, "serving.export")
    check_tables(spec, tables)
    platforms = None if platforms is None else tuple(platforms)
    on_tpu = "tpu" in (platforms if platforms is not None else (jax.default_backend(),))
    tables = served_tables(spec, tables, keys, lanes=LANES if on_tpu else 0)
    flat = _host_split(spec, _inputs.flatten_inputs(spec, features))
    features = _config.unflatten(flat)
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
    table_specs = jax.tree.map(lambda t: jax.ShapeDtypeStruct(tuple(np.shape(t)), t.dtype), tables)
    if include_tables:
        constants = jax.tree.map(np.asarray, tables)
        fn = jax.jit(lambda f: lookup(spec, constants, f, unknown))
        return jax.export.export(fn, platforms=platforms)(feature_specs)
    fn = jax.jit(lambda t, f: lookup(spec, t, f, unknown))
    return jax.export.export(fn, platforms=platforms)(table_specs, feature_specs)
