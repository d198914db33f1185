"""The dynamic table's index on CPU: `_hashindex`'s per-shard work in C++ through XLA FFI.

XLA:CPU runs `_hashindex.update`'s multi-key sorts one element at a time. On CPU meshes
these run instead, shard by shard inside shard_map, with the same signatures and the same
outputs bit for bit:

- `find`: `_hashindex.find` (rows and found of any-shaped queries; read-only).
- `update`: `_hashindex.update`, every output: the whole new local IndexState, the local
  rows and the fresh flags, for every config (lru/lfu/none, TTL, min_count and its
  filter, admit_probability). One sequential pass over the step's ids (csrc/hashindex.cc
  says how it reproduces the XLA order). The index arrays are donated operands aliased to
  the results (`input_output_aliases`), so the kernel writes the slots it changes where
  they are: with the state donated to the jitted step a step costs O(ids), not O(capacity).
- `first_set`: the positions of a mask's first k set entries (`_dynamic._first`).
- `find_owned` and `resolve_update`: what `_dynamic.lookup_rows` and `update_rows` do on a
  shard with a table's gathered ids: locate them (`_hashindex.locate`) and keep the
  distinct ones the shard owns (by a hash table, in a call of its own that a step's lookup
  and update of the same ids share), then `find` or `update` them. The same index and rows
  as `locate`, a sort for the distinct ids and `update` in XLA ops; the update's resets
  come back compacted.

The source (csrc/hashindex.cc) is compiled on first use by `_cpu_kernels`' builder, into the
same cache. Without g++ `available()` is False after one warning, and callers keep the XLA
path.
"""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _cpu_kernels
from . import _hashindex as hx

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "hashindex.cc"
_TARGETS = {
    "jte_hashindex_find": "JteHashindexFind",
    "jte_hashindex_update": "JteHashindexUpdate",
    "jte_hashindex_owned_distinct": "JteHashindexOwnedDistinct",
    "jte_hashindex_find_distinct": "JteHashindexFindDistinct",
    "jte_hashindex_resolve_update": "JteHashindexResolveUpdate",
    "jte_hashindex_first_set": "JteHashindexFirstSet",
}
_EVICTION = {"lru": 0, "lfu": 1, "none": 2}  # Must match `Eviction` in the C++ source.
_FIELDS = ("keys", "last", "count", "filter_keys", "filter_count", "filter_last", "stats")
_DTYPES = (jnp.uint32, jnp.int32, jnp.int32, jnp.uint32, jnp.int32, jnp.int32, jnp.int32)

_LIBRARY = _cpu_kernels.Library(_SOURCE, _TARGETS, "C++ hash index")


def available() -> bool:
    """True when the kernels are compiled, loaded and registered (tried once per process)."""
    return _LIBRARY.available()


def _require() -> None:
    """The FFI targets must be registered before a call is traced (lowered)."""
    if not available():
        raise RuntimeError("jax_tpu_embed: the C++ hash index is unavailable (see the warning).")


def _ttl(config: hx.IndexConfig) -> np.int64:
    return np.int64(-1 if config.ttl_steps is None else config.ttl_steps)


def _now(now):
    return jnp.asarray(now, jnp.int32).reshape(1)


def find(config: hx.IndexConfig, state: hx.IndexState, hi, lo, local_bucket, now):
    """`_hashindex.find`: (local row int32, found bool) of ids of any shape; row -1 where
    not found. Read-only."""
    _require()
    shape = jnp.shape(hi)
    n = int(np.prod(shape))
    row, found = jax.ffi.ffi_call(
        "jte_hashindex_find",
        (jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.bool_)),
    )(
        jnp.asarray(hi).astype(jnp.uint32).reshape(n),
        jnp.asarray(lo).astype(jnp.uint32).reshape(n),
        jnp.asarray(local_bucket, jnp.int32).reshape(n),
        _now(now),
        *(jnp.asarray(getattr(state, f), d) for f, d in zip(_FIELDS[:2], _DTYPES)),
        ttl_steps=_ttl(config),
        bucket_size=np.int64(config.bucket_size),
    )
    return row.reshape(shape), found.reshape(shape)


def first_set(mask, k: int):
    """(k,) int32: the positions of the first k set entries of the 1-D bool `mask`, in
    order, its size past them (`jnp.nonzero(mask, size=k, fill_value=n)`, which XLA:CPU
    runs as a running sum over the whole mask)."""
    _require()
    return jax.ffi.ffi_call("jte_hashindex_first_set", jax.ShapeDtypeStruct((k,), jnp.int32))(
        jnp.asarray(mask, jnp.bool_)
    )


def _update_attrs(config: hx.IndexConfig) -> dict:
    """The update kernels' attributes: the index's rules and hash keys."""
    threshold = -1  # Admission by probability: a hash below it admits; -1 admits all.
    if config.admit_probability < 1.0:
        threshold = hx._admit_threshold(config.admit_probability)
    return {
        "ttl_steps": _ttl(config),
        "eviction": np.int32(_EVICTION[config.eviction]),
        "min_count": np.int32(config.min_count),
        "threshold": np.int64(threshold),
        "prio_key": np.int64(hx.key_word(config.seed, hx._SALT_PRIORITY)),
        "admit_key": np.int64(hx.key_word(config.seed, hx._SALT_ADMIT)),
        "bucket_size": np.int64(config.bucket_size),
        "filter_bucket_size": np.int64(config.filter_bucket_size),
    }


def update(config: hx.IndexConfig, state: hx.IndexState, hi, lo, local_bucket, valid, now):
    """`_hashindex.update`, bit for bit: (new state, local row int32 (-1: no slot), fresh
    bool). The state's arrays are updated in place where the caller donates them."""
    _require()
    shape = jnp.shape(hi)
    u = int(np.prod(shape))
    arrays = [jnp.asarray(getattr(state, f), d) for f, d in zip(_FIELDS, _DTYPES)]
    out = jax.ffi.ffi_call(
        "jte_hashindex_update",
        tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
        + (jax.ShapeDtypeStruct((u,), jnp.int32), jax.ShapeDtypeStruct((u,), jnp.bool_)),
        input_output_aliases={5 + i: i for i in range(len(arrays))},
    )(
        jnp.asarray(hi).astype(jnp.uint32).reshape(u),
        jnp.asarray(lo).astype(jnp.uint32).reshape(u),
        jnp.asarray(local_bucket, jnp.int32).reshape(u),
        jnp.broadcast_to(jnp.asarray(valid, bool), shape).reshape(u),
        _now(now),
        *arrays,
        **_update_attrs(config),
    )
    new = hx.IndexState(*out[: len(arrays)])
    return new, out[-2].reshape(shape), out[-1].reshape(shape)


def _locator(config: hx.IndexConfig, num_shards: int) -> dict:
    """The attributes that locate ids (`_hashindex.locate`) in the C++ kernels."""
    config.check_shards(num_shards)
    return {
        "bucket_key": np.int64(hx.key_word(config.seed, hx._SALT_BUCKET)),
        "buckets": np.int64(config.buckets),
        "num_shards": np.int64(num_shards),
    }


def _owned_distinct(config: hx.IndexConfig, hi, lo, me, num_shards: int) -> tuple:
    """(where, hi, lo, local bucket, count (1,)): the distinct ids among the gathered ones
    ((n,) uint32 words) that shard `me` owns, in order of first appearance (the first
    `count` of the (n,) hi, lo and buckets), and each position's index among them (-1: not
    this shard's, or padding). A pure function of its operands: a step's lookup and update
    of the same ids share one (XLA merges the two equal calls)."""
    n = hi.shape[0]
    vec = lambda dtype: jax.ShapeDtypeStruct((n,), dtype)
    call = jax.ffi.ffi_call(
        "jte_hashindex_owned_distinct",
        (
            vec(jnp.int32),
            vec(jnp.uint32),
            vec(jnp.uint32),
            vec(jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
        ),
    )(
        jnp.asarray(hi, jnp.uint32),
        jnp.asarray(lo, jnp.uint32),
        jnp.asarray(me, jnp.int32).reshape(1),
        **_locator(config, num_shards),
    )
    return tuple(call)


def find_owned(config: hx.IndexConfig, state: hx.IndexState, hi, lo, me, num_shards: int, now):
    """Inside shard_map, on shard `me` of `num_shards`: the local rows (int32, -1: none) of
    the gathered ids ((n,) uint32 words) that this shard owns and holds; -1 for the others
    and for padding. `_hashindex.locate`, then `find` of the distinct owned ids (each
    bucket read once). Read-only."""
    _require()
    n = hi.shape[0]
    return jax.ffi.ffi_call("jte_hashindex_find_distinct", jax.ShapeDtypeStruct((n,), jnp.int32))(
        *_owned_distinct(config, hi, lo, me, num_shards),
        _now(now),
        *(jnp.asarray(getattr(state, f), d) for f, d in zip(_FIELDS[:2], _DTYPES)),
        ttl_steps=_ttl(config),
        bucket_size=np.int64(config.bucket_size),
    )


class Resolved(NamedTuple):
    """`resolve_update`'s results besides the new index: each gathered position's local row
    (-1: not this shard's, padding, or no row), and the rows given to new ids this step with
    those ids, compacted (the first `fresh_count` of `fresh_rows`, `fresh_hi`, `fresh_lo`; the
    rest -1 and padding)."""

    rows: Any
    fresh_count: Any
    fresh_rows: Any
    fresh_hi: Any
    fresh_lo: Any


def resolve_update(
    config: hx.IndexConfig, state: hx.IndexState, hi, lo, keep, me, num_shards: int, now
) -> tuple[hx.IndexState, Resolved]:
    """Inside shard_map, on shard `me`: one update step of the gathered ids ((n,) uint32
    words) that this shard owns (none when `keep` is False), as `_hashindex.locate`, a
    deduplication and `update` would make it, bit for bit in the index. The state's arrays
    are updated in place where the caller donates them. The deduplication is
    `_owned_distinct`, which the step's lookup of the same ids shares."""
    _require()
    n = hi.shape[0]
    arrays = [jnp.asarray(getattr(state, f), d) for f, d in zip(_FIELDS, _DTYPES)]
    vec = lambda dtype: jax.ShapeDtypeStruct((n,), dtype)
    out = jax.ffi.ffi_call(
        "jte_hashindex_resolve_update",
        tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
        + (
            vec(jnp.int32),
            jax.ShapeDtypeStruct((1,), jnp.int32),
            vec(jnp.int32),
            vec(jnp.uint32),
            vec(jnp.uint32),
        ),
        input_output_aliases={7 + i: i for i in range(len(arrays))},
    )(
        *_owned_distinct(config, hi, lo, me, num_shards),
        jnp.asarray(keep, bool).reshape(1),
        _now(now),
        *arrays,
        **_update_attrs(config),
    )
    k = len(arrays)
    rows, count, f_rows, f_hi, f_lo = out[k:]
    return hx.IndexState(*out[:k]), Resolved(rows, count[0], f_rows, f_hi, f_lo)
