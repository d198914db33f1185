"""Multi-host input helpers: each process feeds its own part of the global batch.

On a multi-host slice (or any multi-controller JAX job) every process runs the same program,
but each one holds only its devices' part of the global batch. `Embedding.lookup` and
`apply_gradients` take global `jax.Array`s sharded over the embedding's axis; these helpers
say which rows of the global batch a process must load and turn its rows into those arrays
with `jax.make_array_from_process_local_data`.

    rows = multihost.process_batch_rows(emb, global_batch=B)      # this process's rows of B
    features = multihost.global_batch(emb, load(rows))           # leaves (b_local, ...)
    acts = emb.lookup(state, features)                           # global (B, D) arrays
    state = emb.apply_gradients(state, features, multihost.global_batch(emb, act_grads))

In one process both are trivial (every row; a device_put), so the same code runs everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Nested = Any


def batch_sharding(emb) -> NamedSharding:
    """The sharding of every batch input: dimension 0 split over `emb.axis`."""
    return NamedSharding(emb.mesh, P(emb.axis))


def process_batch_rows(emb, global_batch: int) -> np.ndarray:
    """The rows of the global batch this process supplies, in the order it supplies them.

    Args:
        emb: The `jte.Embedding`.
        global_batch: B, a multiple of the mesh size along `emb.axis`.

    Returns:
        int64 (b,) indices into [0, B), ascending: the rows of this process's devices along
        `emb.axis` (b = B * local shards / N). Processes that are replicas along other mesh
        axes get the same rows and must load the same data. In one process: arange(B).
    """
    n = emb.num_shards
    if global_batch <= 0 or global_batch % n:
        raise ValueError(
            f"process_batch_rows: global_batch={global_batch} must be a "
            f"positive multiple of the mesh size {n} along axis {emb.axis!r}."
        )
    per_shard = global_batch // n
    index_map = batch_sharding(emb).addressable_devices_indices_map((global_batch,))
    # jax types the values Index | None; a NamedSharding gives every device an index.
    starts = sorted(
        {
            index[0].start or 0  # pyright: ignore[reportOptionalSubscript]
            for index in index_map.values()
        }
    )
    return np.concatenate(
        [np.arange(s, s + per_shard, dtype=np.int64) for s in starts] + [np.zeros((0,), np.int64)]
    )  # Empty when no device is local.


def global_batch(emb, local: Nested) -> Nested:
    """Global jax.Arrays, sharded over `emb.axis`, from this process's rows.

    Args:
        emb: The `jte.Embedding`.
        local: A pytree (features, `jte.Weighted` leaves included, or activation gradients)
            whose array leaves hold this process's rows of the global batch, in the order of
            `process_batch_rows`: (b, ...) with b = B * local shards / N.

    Returns:
        The same structure with (B, ...) jax.Arrays sharded as `batch_sharding(emb)`. Every
        process calls it with the same structure and shapes: each gives its rows of the same
        global arrays (no communication happens here).
    """
    sharding = batch_sharding(emb)
    local = jax.tree.map(np.asarray, local)
    _check_local_rows(emb, local)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)


def shard_of_devices(emb) -> dict:
    """{device of this process: the shard along `emb.axis` it holds, 0..N-1}."""
    index_map = batch_sharding(emb).addressable_devices_indices_map((emb.num_shards,))
    return {d: index[0].start or 0 for d, index in index_map.items()}  # pyright: ignore[reportOptionalSubscript]


def _local_shards(emb) -> int:
    """How many of the N shards along `emb.axis` this process's devices hold."""
    return len(set(shard_of_devices(emb).values()))


def _check_local_rows(emb, local: Nested) -> None:
    """ValueError naming the leaf, the rows it has and the rows this process must load:
    every leaf the same b rows, a positive multiple of the shards this process holds (the
    b of `process_batch_rows`), instead of JAX's IndivisibleError."""
    k, n = _local_shards(emb), emb.num_shards
    rule = (
        f"this process holds {k} of the {n} shards along axis {emb.axis!r}, so it loads "
        f"B * {k} / {n} rows of a global batch B: len(process_batch_rows(emb, B))"
    )
    first = None
    for path, x in jax.tree_util.tree_leaves_with_path(local):
        name = jax.tree_util.keystr(path) or "the input"
        if x.ndim == 0:
            raise ValueError(
                f"global_batch: every leaf needs a batch dimension; {name} is a scalar {x!r}."
            )
        rows = x.shape[0]
        if first is None:
            first = (name, rows)
            if rows < 1 or rows % k:
                want = f"a positive multiple of {k}"
                raise ValueError(
                    f"global_batch: leaf {name} has {rows} rows; this process must load "
                    f"{want} ({rule})."
                )
        elif rows != first[1]:
            raise ValueError(
                f"global_batch: leaf {name} has {rows} rows, expected {first[1]} as "
                f"{first[0]} has: every leaf holds the same rows of the global batch ({rule})."
            )


def check_same_on_every_process(tree: Nested, what: str = "NumPy inputs") -> None:
    """Raises ValueError unless every process passed equal NumPy leaves in `tree`.

    With several processes, jit takes a NumPy argument as one global value, replicated: every
    process must pass the whole global batch, the same everywhere. A process that passes only
    its own rows would silently train on a smaller, different batch per process. Compares one
    hash per process (a small all-gather, so every process must call it); jax.Arrays and
    tracers are skipped. Does nothing in one process or without NumPy leaves.
    """
    leaves = [x for x in jax.tree.leaves(tree) if not isinstance(x, (jax.Array, jax.core.Tracer))]
    if jax.process_count() == 1 or not leaves:
        return
    digest = hashlib.sha256()
    for x in leaves:
        x = np.ascontiguousarray(x)
        digest.update(f"{x.shape}{x.dtype.str};".encode())
        digest.update(x.tobytes())
    mine = np.frombuffer(digest.digest()[:8], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(
            f"{what} differ between processes (processes {differ} differ from process 0). "
            f"With several processes a NumPy input is the global batch and must be the same "
            f"on every process. To feed each process its own rows, make global jax.Arrays of "
            f"them: multihost.global_batch(emb, local_rows)."
        )


# At most this many bytes of an array pass through each device at once in `to_host`.
CHUNK_BYTES = 64 << 20


def to_host(x, rows=None, *, chunk_bytes: int = CHUNK_BYTES) -> np.ndarray:
    """`x[rows]` (all of `x` when rows is None) as a NumPy array on this process.

    The rows go through the devices in pieces of at most `chunk_bytes` per device: each
    device reads the piece's rows of its own block (from host memory for a table placed
    there) and one all-reduce of their bits joins them, exactly (-0.0 and NaNs kept).
    Neither the array nor all the rows taken are ever copied whole onto a device, as
    `process_allgather` of the array would do on every one, and only the rows asked for
    leave their memory. With several processes it is a collective: every process calls it
    with the same `rows`. An array this process holds whole is read shard by shard
    (`jax.device_get`) when all of it is asked for or it is no bigger than `chunk_bytes`.
    `rows`: int (m,), indices along dimension 0.
    """
    if isinstance(x, jax.Array):
        axis = _row_axis(x)
        # Held here and all of it wanted, or no bigger than a piece: read whole (no compile).
        held = x.is_fully_addressable and (rows is None or x.nbytes <= chunk_bytes)
        if axis is not None and not held and not x.is_fully_replicated:
            at = np.arange(x.shape[0]) if rows is None else np.asarray(rows)
            return _rows_in_pieces(x, axis, at, chunk_bytes)
        whole = _whole(x)
    else:
        whole = np.asarray(x)
    return whole if rows is None else whole[np.asarray(rows)]


def most_of(local: np.ndarray) -> np.ndarray:
    """The elementwise maximum of `local` over the processes (every process calls it with
    the same shape): e.g. counts that each process knows for its own shards, zeros elsewhere."""
    if jax.process_count() == 1:
        return np.asarray(local)
    return np.asarray(multihost_utils.process_allgather(np.asarray(local))).max(axis=0)


def parts(x: jax.Array, n: int) -> dict[int, jax.Array]:
    """{k: a single-device array of this process holding part k of `x`}: dimension 0 split
    into `n` equal parts (a table's or an index's shards); a part held by several local
    devices is given once."""
    at = x.sharding.addressable_devices_indices_map((n,) + x.shape[1:])  # Even if empty.
    return {at[s.device][0].start or 0: s.data for s in x.addressable_shards}  # pyright: ignore[reportOptionalSubscript]


def alone(x: jax.Array) -> jax.Array:
    """A single-device array as the one block of a one-device mesh (the same buffer), so
    that `to_host(alone(x), rows)` reads only `rows`, in pieces on that device (from host
    memory for an array there), with no other process taking part."""
    (device,) = x.devices()
    mesh = jax.sharding.Mesh(np.array([device]), ("alone",))
    spec = P("alone", *([None] * (x.ndim - 1)))
    sharding = NamedSharding(mesh, spec, memory_kind=x.sharding.memory_kind)
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [x])


def _whole(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    # Not row blocks over one mesh axis: the whole array, on every device.
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _row_axis(x: jax.Array) -> str | None:
    """The mesh axis whose devices each hold one block of `x`'s rows (dimension 0 split
    evenly over one axis, the others whole), or None when `x` is not sharded so."""
    sharding = x.sharding
    if x.ndim == 0 or not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * x.ndim
    first = spec[0][0] if isinstance(spec[0], tuple) and len(spec[0]) == 1 else spec[0]
    if not isinstance(first, str) or any(s is not None for s in spec[1 : x.ndim]):
        return None
    return first if x.shape[0] % sharding.mesh.shape[first] == 0 else None


def _rows_in_pieces(x: jax.Array, axis: str, rows: np.ndarray, chunk_bytes: int) -> np.ndarray:
    row_bytes = x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
    # Pieces of a power of two rows (up to the chunk): a few compiled programs serve every
    # count of rows, where one per count made each export of a dynamic table compile anew.
    per = max(1, min(chunk_bytes // max(row_bytes, 1), 1 << max(len(rows) - 1, 0).bit_length()))
    out = np.empty((len(rows),) + x.shape[1:], x.dtype)
    sharding = x.sharding
    assert isinstance(sharding, NamedSharding)  # _row_axis
    on_host = sharding.memory_kind not in (None, "device")
    take = _take_rows(sharding.mesh, axis, on_host)
    for start in range(0, len(rows), per):
        piece = rows[start : start + per]
        n = len(piece)
        # Every piece the same length (the last padded with row 0).
        piece = np.pad(piece, (0, per - n)).astype(np.int32 if x.shape[0] < 2**31 else np.int64)
        out[start : start + n] = np.asarray(take(x, piece).addressable_data(0))[:n]
    return out


@functools.cache
def _take_rows(mesh, axis: str, on_host: bool):
    """jit(block of rows per device, replicated row indices) -> the rows, replicated: each
    device reads those in its block (zeros elsewhere) and an all-reduce sums their bits
    as unsigned integers, which is exact where one device holds each row."""
    from . import _placement

    def local(block, rows):
        at = rows - lax.axis_index(axis) * block.shape[0]
        mine = (at >= 0) & (at < block.shape[0])
        got = _placement.gather(on_host, [block], [jnp.where(mine, at, 0)])[0]
        got = jnp.where(mine.reshape(mine.shape + (1,) * (got.ndim - 1)), got, jnp.zeros_like(got))
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[got.dtype.itemsize]
        words = lax.bitcast_convert_type(got, bits)
        wide = words.astype(jnp.uint32) if got.dtype.itemsize < 4 else words
        total = lax.psum(wide, axis).astype(bits)
        return lax.bitcast_convert_type(total, got.dtype)

    row = P(axis)
    return jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(row, P()), out_specs=P(), check_vma=False)
    )


# Padding of `exchange`'s rows: the (hi, lo) words of id -1, which never travels.
_NO_ROW = np.uint32(0xFFFFFFFF)


def exchange(
    emb,
    sent: dict,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    through_devices: bool | None = None,
) -> dict:
    """{shard k of this process: {field: the values sent to shard k}, in ascending order of
    the first field} from `sent` = {shard k of this process: ({field: values}, dest)}: the
    fields' values (n, ...) one per entry, the first int64 ids (distinct, never -1), the
    others of 32-bit dtypes, and dest (n,) the shard each entry goes to. With several
    processes (or `through_devices`) an all_to_all over `emb.axis` through the devices,
    each entry as one row of uint32 words, in rounds of at most `chunk_bytes` a device, so
    no process holds another's entries and no device more than a round of them; one
    process, which holds every shard, regroups them itself. The field dicts of `sent` are
    emptied as they are sent (the caller's last references, so their memory goes then). A
    collective: every process calls it, with fields of the same names, dtypes and shapes."""
    n = emb.num_shards
    mine = shard_of_devices(emb)
    own = sorted(set(mine.values()))
    lead = next(iter(sent[own[0]][0]))
    by_dest = {}
    for k in own:
        fields, dest = sent[k]
        dest = np.asarray(dest, np.int64).reshape(-1)
        order = np.argsort(dest, kind="stable")
        by_dest[k] = (fields, order, np.searchsorted(dest[order], np.arange(n + 1)))
    if not (jax.process_count() > 1 if through_devices is None else through_devices):
        out = {}
        for k in own:
            taken = [(v, o[s[k] : s[k + 1]]) for v, o, s in by_dest.values()]
            order = np.argsort(np.concatenate([v[lead][t] for v, t in taken]), kind="stable")
            out[k] = {f: np.concatenate([v[f][t] for v, t in taken])[order] for f in sent[k][0]}
        for fields, _ in sent.values():
            fields.clear()
        return out
    like = {f: (v.dtype, v.shape[1:]) for f, v in sent[own[0]][0].items()}
    words = {}
    for k, (fields, order, _) in by_dest.items():
        words[k] = _words(fields, order)  # In destination order.
        fields.clear()
    width = words[own[0]].shape[1]
    longest = max(int(np.diff(s).max(initial=0)) for _, _, s in by_dest.values())
    longest = int(most_of(np.array([longest]))[0])  # Entries of the busiest (source, dest).
    per = max(1, min(longest, chunk_bytes // (n * width * 4)))
    sharding = NamedSharding(emb.mesh, P(emb.axis))
    swap = _all_to_all(emb.mesh, emb.axis)
    got: dict[int, list] = {k: [] for k in own}
    for start in range(0, longest, per):
        blocks = {}
        for k, (_, _, starts) in by_dest.items():
            block = np.empty((1, n, per, width), np.uint32)
            for j in range(n):
                part = words[k][starts[j] + start : starts[j + 1]][:per]
                block[0, j, : len(part)] = part
                block[0, j, len(part) :] = _NO_ROW
            blocks[k] = block
        arrays = [jax.device_put(blocks[k], d) for d, k in mine.items()]
        del blocks
        x = jax.make_array_from_single_device_arrays((n, n, per, width), sharding, arrays)
        del arrays
        seen = set()
        for s in swap(x).addressable_shards:
            k = mine[s.device]
            if k in seen:
                continue
            seen.add(k)
            rows = np.asarray(s.data).reshape(-1, width)
            got[k].append(rows[~((rows[:, 0] == _NO_ROW) & (rows[:, 1] == _NO_ROW))])
        del x
    del words
    out = {}
    for k in own:
        parts = got.pop(k)
        if len(parts) == 1:
            rows = parts[0]
        else:
            rows = np.concatenate(parts or [np.zeros((0, width), np.uint32)])
        del parts
        out[k] = _fields(rows, like)
    return out


def _words(fields: dict, order: np.ndarray) -> np.ndarray:
    """(n, w) uint32: the entries `order` picks, each entry's fields as words (an int64 as
    (hi, lo)): one pass over each field."""
    widths = [2 if v.dtype == np.int64 else math.prod(v.shape[1:]) for v in fields.values()]
    out, at = np.empty((len(order), sum(widths)), np.uint32), 0
    for v, w in zip(fields.values(), widths):
        v = v[order]
        if v.dtype == np.int64:
            u = v.view(np.uint64)
            out[:, at], out[:, at + 1] = u >> np.uint64(32), u & np.uint64(0xFFFFFFFF)
        else:
            assert v.dtype.itemsize == 4, v.dtype
            out[:, at : at + w] = v.view(np.uint32).reshape(len(v), w)
        at += w
    return out


def _fields(words: np.ndarray, like: dict) -> dict:
    """The inverse of `_words`: {field: values} shaped as `like` ({field: (dtype, shape)}),
    in ascending order of the first field (int64 ids), one pass over each field."""
    hi, lo = (words[:, i].astype(np.uint64) for i in (0, 1))
    order = np.argsort(((hi << np.uint64(32)) | lo).view(np.int64), kind="stable")
    out, at = {}, 0
    for f, (dtype, shape) in like.items():
        if dtype == np.int64:
            hi, lo = (words[order, i].astype(np.uint64) for i in (at, at + 1))
            out[f], at = ((hi << np.uint64(32)) | lo).view(np.int64), at + 2
        else:
            w = math.prod(shape)
            v = words[order, at : at + w].view(dtype)
            out[f], at = v.reshape((-1,) + tuple(shape)), at + w
    return out


@functools.cache
def _all_to_all(mesh, axis: str):
    """jit((N, N, r, w) sharded over `axis` along dimension 0) -> the same shape, where
    [k, j] is what device j held at [j, k]."""

    def swap(block):
        return lax.all_to_all(block, axis, 1, 1, tiled=True)

    row = P(axis)
    return jax.jit(jax.shard_map(swap, mesh=mesh, in_specs=row, out_specs=row, check_vma=False))
