"""Checkpoints of an `Embedding`'s state, and optionally dense params, with orbax.

    jte.checkpoint.save(directory, emb, state, dense={"params": params, "opt": opt_state})
    state, dense = jte.checkpoint.restore(directory, emb2)        # latest step, any mesh

    jte.checkpoint.save(directory, emb, state, blocking=False)    # returns once on the host
    ...                                                           # training goes on
    jte.checkpoint.wait()                                         # the save is on disk

Checkpoints speak in logical rows, so one written on N shards with "mod" restores on M shards
with "div". Each save is one orbax step directory named after `state.step`; earlier ones are
kept. Orbax writes a step into a temporary directory and renames it only once every file is
written, so a save cut short (killed process, full disk) leaves the previous checkpoints
restorable and is never seen as a step.

`save(..., blocking=False)` returns once the arrays are copied to host memory (so the train
step may donate and overwrite them) and lets orbax write in a background thread; the same
temporary-directory-then-rename commit keeps a save killed part-way invisible. `wait()` joins
the saves in flight; `restore`, `all_steps` and the next `save` to the same directory join its
save first, and so does interpreter exit.

On disk, `directory/<step>/` holds these orbax items:

- `embedding`: {"tables": {name: (V, D)}, "slots": {name: {slot: (V, D) or (V,)}}}: exactly
  the logical rows in natural id order, so any orbax user reads them without knowing the
  mesh (`ocp.StandardCheckpointer().restore(f"{directory}/{step}/embedding")`). Checkpoints
  of earlier versions hold them padded with zero rows to a multiple of the saving mesh size;
  they restore as before (rows past V are dropped).
- `metadata`: JSON: the step, each table's vocabulary_size, dim, dtype and slots.
- `dense`: the `dense` pytree, when one was given.
- `dynamic`: each dynamic table's held ids, rows, slots and scores, one block per shard of
  the saving mesh (`_dynamic_logical`), in host memory.

No host gathers a whole table: tables are brought to logical row order on the devices,
split evenly over them (rows over the devices when N divides V, else rows over a divisor of
V and columns over a divisor of D), and every host writes only the slices its devices hold;
restore reads each device's slice of the logical rows and converts them back on the
devices. The conversion holds a transient second copy of the tables in device memory while
saving (none for "div" tables whose V is a multiple of N: their layout already is the
logical one), and while restoring the read copies are freed one table at a time as they are
converted. Tables in host memory (`placement="host"`, `HostCached`) may be larger than HBM,
so they never pass through the devices whole (`_conversion`): when each shard holds one
block of the logical rows ("div" with V a multiple of N), every host converts its own shards
in NumPy and orbax writes and reads the logical blocks in host memory, with any number of
processes. Other host tables are converted whole in NumPy with one process; with several,
their rows cross between the processes through the devices in pieces, each host keeping
the blocks it writes or the shards it holds. A dynamic table's blocks are each shard's own
entries: every host reads and writes those of its shards only. On restore it reads only
the blocks holding its shards' ids when the capacity is the same and one shard count
divides the other (`_by_shard`); otherwise each shard reads a share of the blocks and the
devices send every entry to the shard that owns it in the new index (`_routed`). Either
way each host rebuilds only its own shards of the index.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import logging
import math
import os
import re
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import (
    _dynamic,
    _embedding,
    _guards,
    _hashindex,
    _multihost,
    _optimizers,
    _placement,
    _storage,
)

_FORMAT = "jax_tpu_embed.checkpoint/1"
_ITEMS = ("embedding", "metadata", "dense", "dynamic")


def _orbax():
    """orbax.checkpoint, imported on first use: it takes about a second to import."""
    import orbax.checkpoint

    return orbax.checkpoint


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No checkpoint where one was asked for: a missing directory, no complete step, or a step
    that is not there. Both a FileNotFoundError and a ValueError."""


def save(
    directory: str | os.PathLike,
    emb: _embedding.Embedding,
    state: _embedding.EmbeddingState,
    *,
    dense: Any = None,
    blocking: bool = True,
    since_step: int | None = None,
) -> int:
    """Writes `state` (and `dense`) as the checkpoint of step `state.step` under `directory`.

    Args:
        directory: Root of the checkpoints; created if missing. Local path or any path orbax
            accepts (e.g. gs://...).
        emb: The Embedding that `state` belongs to.
        state: Its state; tables and slots are stored in logical rows.
        dense: Optional pytree of arrays (e.g. flax params and optax state) saved alongside.
        blocking: True: return once the checkpoint is complete on disk. False: return once
            the arrays are on the host, orbax writing them in the background; `wait()` joins.
        since_step: An incremental save on top of the checkpoint of that step in
            `directory` (itself full or incremental): each dynamic table stores the rows and
            slots of only the ids updated (or admitted) since then, with every live id and
            its scores; an id the table evicted since then is one the save does not list.
            Static tables and `dense` are saved whole. `restore` reads back through the
            chain; keep its steps.

    Returns:
        The step saved (complete on disk only when `blocking`).

    Raises:
        ValueError: `state` does not match `emb`'s tables, `directory` already holds a
            checkpoint for this step, or `since_step` is not an earlier step it holds.
        CheckpointWriteError (an OSError): writing failed (e.g. a full disk); the message
            names the directory, the step and the cause. The earlier steps are still
            restorable. With blocking=False such an error comes from `wait`.
    """
    _guards.check_bool(blocking, "checkpoint.save", "blocking")
    ocp = _orbax()
    path = _path(directory)
    wait(path)  # One save in flight per directory: orbax's manager keeps the steps in order.
    _guards.check_not_consumed(state, "checkpoint.save")
    _guards.check_not_consumed(dense, "checkpoint.save", "dense state", "dense")
    _check_state(emb, state)
    step = int(jax.device_get(state.step))
    _check_since(path, step, since_step)
    embedding = {"tables": {}, "slots": {}}
    physical, physical_slots = emb.table_arrays(state)  # Each table's arrays as stored alone.
    dynamic = {
        name: _dynamic_logical(
            emb, state, name, physical.pop(name), physical_slots.pop(name), since_step
        )
        for name in emb.dynamic
    }
    for name, plan in emb.table_plans.items():
        if name in emb.dynamic:
            continue
        storage = plan.storage
        own = physical_slots.pop(name)
        how = _conversion(emb, name)
        to_logical = {"shards": _blocks_to_logical, "pieces": _pieces_to_logical}.get(how)
        convert = functools.partial(to_logical or _to_logical, emb, storage)
        table, riders = convert(None, physical.pop(name))
        embedding["tables"][name] = table
        embedding["slots"][name] = {
            s.name: riders[s.name] if s.name in riders else convert(s, own[s.name])
            for s in storage.slot_specs
        }
    items = {
        "embedding": ocp.args.StandardSave(embedding),
        "metadata": ocp.args.JsonSave(_metadata(emb, step, dense is not None, dynamic, since_step)),
    }
    if dynamic:
        items["dynamic"] = ocp.args.StandardSave(
            {n: {k: v for k, v in d.items() if k != "counts"} for n, d in dynamic.items()}
        )
    if dense is not None:
        items["dense"] = ocp.args.StandardSave(dense)
    earlier = all_steps(path)
    with _writing(path, step, earlier, "save"):
        with _manager(path, read_only=False, asynchronous=not blocking) as manager:
            try:
                manager.save(step, args=ocp.args.Composite(**items), force=True)
            except ocp.checkpoint_manager.StepAlreadyExistsError as e:  # pyright: ignore[reportAttributeAccessIssue]
                raise ValueError(
                    f"checkpoint.save: {path} already holds a checkpoint for step "
                    f"{step}; delete it or save from a state with another step."
                ) from e
            if blocking:
                manager.wait_until_finished()
            else:
                _PENDING[path] = manager  # Kept open (not closed on exit) until `wait`.
                _PENDING_STEPS[path] = (step, earlier)
                _join_at_exit()
    return step


def _check_since(path: str, step: int, since_step) -> None:
    if since_step is None:
        return
    if isinstance(since_step, bool) or not isinstance(since_step, (int, np.integer)):
        raise ValueError(f"checkpoint.save: since_step must be an int or None, got {since_step!r}.")
    steps = all_steps(path) if _exists(path) else []
    if since_step >= step or int(since_step) not in steps:
        raise ValueError(
            f"checkpoint.save: since_step={since_step} must be an earlier step of {path} "
            f"(this save is step {step}); its steps are {steps}."
        )


class CheckpointWriteError(OSError):
    """A save that failed while writing (e.g. a full disk): names the directory, the step
    and the cause. The step was not committed; earlier steps are still restorable."""


@contextlib.contextmanager
def _writing(path: str, step: int, earlier: list[int], call: str):
    """Turns a failure to write step `step` (tensorstore's or the OS's raw status text) into
    a CheckpointWriteError that says what failed and what is still there to restore."""
    try:
        yield
    except (ValueError, CheckpointWriteError) as e:
        if not _from_writer(e):
            raise  # Ours (a step that exists, a state that does not match), not the disk's.
        _raise_write_error(path, step, earlier, call, e)
    except Exception as e:
        _raise_write_error(path, step, earlier, call, e)


def _from_writer(e: BaseException) -> bool:
    """Whether a ValueError came from orbax or tensorstore rather than from this module."""
    return not str(e).startswith("checkpoint.") and not isinstance(e, CheckpointWriteError)


def _raise_write_error(path: str, step: int, earlier: list[int], call: str, e: BaseException):
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    fallback = (
        f"The previous step {earlier[-1]} is still restorable "
        f"(checkpoint.restore({path!r}) restores it; all steps: {earlier})."
        if earlier
        else f"There is no earlier step in {path}."
    )
    raise CheckpointWriteError(
        f"checkpoint.{call}: writing step {step} to {path} failed with "
        f"{type(root).__name__}: {_summary(root)}. Step {step} was not committed (a save cut "
        f"short is never seen as a step). {fallback}"
    ) from e


# Directory -> the CheckpointManager whose save is still being written (blocking=False),
# and (its step, the steps complete before it).
_PENDING: dict[str, Any] = {}
_PENDING_STEPS: dict[str, tuple[int, list[int]]] = {}


def wait(directory: str | os.PathLike | None = None) -> None:
    """Blocks until the saves started with `blocking=False` are complete on disk.

    Args:
        directory: Only the save under this directory; None: every save in flight.

    Raises:
        CheckpointWriteError (an OSError): the background write failed (e.g. a full disk);
            it names the directory, the step and the cause, and the earlier steps, which
            are still restorable.
    """
    paths = list(_PENDING) if directory is None else [_path(directory)]
    for path in paths:
        manager = _PENDING.pop(path, None)
        step, earlier = _PENDING_STEPS.pop(path, (-1, []))
        if manager is not None:
            with _writing(path, step, earlier, "wait"):
                try:
                    manager.wait_until_finished()
                finally:
                    manager.close()


@functools.cache
def _join_at_exit() -> None:
    """Makes interpreter exit join the saves in flight, so a script that ends right after an
    async save still writes it.

    Not `atexit`: by then Python has shut down the thread pools orbax writes with. threading's
    exit hooks run before that, newest first; this one is registered after orbax (and so
    concurrent.futures) was imported, so it runs before the pools' shutdown.
    """
    register = getattr(threading, "_register_atexit", atexit.register)
    register(wait)


def restore(
    directory: str | os.PathLike,
    emb: _embedding.Embedding,
    *,
    step: int | None = None,
    dense_target: Any = None,
) -> tuple[_embedding.EmbeddingState, Any]:
    """Reads a checkpoint onto `emb`'s mesh and partition strategy.

    Args:
        directory: Root the checkpoints were saved under.
        emb: Any Embedding whose tables have the checkpoint's names, vocabulary sizes, dims
            and optimizer slots; its mesh size and partition strategy may differ.
        step: The step to restore; default the latest complete one.
        dense_target: Optional pytree like the saved `dense` (arrays or
            jax.ShapeDtypeStruct): the dense state comes back with its exact pytree types
            (e.g. optax NamedTuples) and its leaves' shardings (replicated on `emb`'s mesh
            where a leaf has none). Without it, containers come back as orbax stores them
            (dicts and lists) and every leaf is replicated on `emb`'s mesh.

    Returns:
        (state, dense): the EmbeddingState with `step` restored, and the dense pytree, or None
        if none was saved.

    Raises:
        CheckpointNotFoundError (a FileNotFoundError and a ValueError): `directory` does not
            exist, holds no complete checkpoint, or has no checkpoint for `step`.
        CheckpointCorruptError (a ValueError): the step exists but a file of it is truncated,
            missing or garbage; the message names the step and the file or item, and lists
            the earlier steps that may be restored instead.
        ValueError: a table's vocabulary size, dim or slots differ from `emb`'s (the message
            names each such table), or tables are missing or extra.
    """
    ocp = _orbax()
    path = _path(directory)
    wait(path)
    if not _exists(path):
        raise CheckpointNotFoundError(
            f"checkpoint.restore: checkpoint directory {path} does not exist."
        )
    with _manager(path, read_only=True) as manager:
        steps = sorted(manager.all_steps())
        if not steps:
            raise CheckpointNotFoundError(
                f"checkpoint.restore: {path} holds no complete checkpoint (no finished step "
                f"directory; saves cut short are ignored)."
            )
        if step is None:
            step = int(steps[-1])
        if step not in steps:
            raise CheckpointNotFoundError(
                f"checkpoint.restore: {path} has no checkpoint for step {step}; its steps "
                f"are {steps}."
            )
        earlier = [s for s in steps if s < step]
        meta = _metadata_of(manager, path, step, earlier)
        _check_compatible(emb, meta, f"{path}/{step}")
        with _reading(path, step, "embedding", earlier):
            stored = manager.restore(
                step,
                args=ocp.args.Composite(
                    embedding=ocp.args.StandardRestore(_embedding_target(emb), strict=False)
                ),
            ).embedding
        dynamic, routed = _dynamic_entries(manager, path, step, meta, emb, earlier)
        dense = None
        if meta["has_dense"]:
            hint = "" if dense_target is None else "dense_target does not match it, or "
            with _reading(path, step, "dense", earlier, hint):
                if dense_target is None:
                    target = _dense_target_from_metadata(emb, manager.item_metadata(step)["dense"])
                else:
                    target = _dense_target(emb, dense_target)
                dense = manager.restore(
                    step, args=ocp.args.Composite(dense=ocp.args.StandardRestore(target))
                ).dense
        elif dense_target is not None:
            raise ValueError(
                f"checkpoint.restore: dense_target was given but the checkpoint "
                f"{path}/{step} holds no dense state."
            )
    where = f"checkpoint.restore: step {step} of {path}"
    _check_values(emb, stored, where)
    tables, slots, index = {}, {}, {}
    for name in emb.dynamic:
        tables[name], slots[name], index[name] = _dynamic_state(
            emb, name, dynamic[name], where, name in routed
        )
    for name, plan in emb.table_plans.items():
        if name in emb.dynamic:
            continue
        storage = plan.storage
        # pop: each read copy is freed as soon as it is converted.
        own = stored["slots"].pop(name)
        riders = {s.name: own.pop(s.name) for s in storage.riders}
        table = stored["tables"].pop(name)
        how = _conversion(emb, name)
        if how in ("shards", "pieces"):
            to_physical = _blocks_to_physical if how == "shards" else _pieces_to_physical
            convert = functools.partial(to_physical, emb, storage)
            tables[name] = convert(None, table, riders)
        else:
            convert = functools.partial(_to_physical, emb, storage)
            tables[name] = convert(None, storage.join_row(table, riders))
        slots[name] = {s.name: convert(s, own.pop(s.name)) for s in storage.stored}
    step_array = jax.device_put(jnp.asarray(meta["step"], jnp.int32), NamedSharding(emb.mesh, P()))
    # A HostCached table's host arrays hold all of it: its caches start empty.
    index = emb.with_empty_caches(index)
    state = _embedding.EmbeddingState(*emb.state_arrays(tables, slots), step_array, index)
    return state, dense


def _metadata_of(manager, path: str, step: int, earlier: list[int]) -> dict:
    """The metadata item of `step` (a corrupt one names `earlier`, the steps before it)."""
    ocp = _orbax()
    with _reading(path, step, "metadata/metadata", earlier):
        return manager.restore(
            step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())
        ).metadata


class CheckpointCorruptError(ValueError):
    """A checkpoint step that exists but cannot be read: a file of it is truncated, missing
    or not what orbax wrote. Earlier steps may still restore (the message lists them)."""


# What a process raises when another found a problem in its own part of a restore
# (`_guards.on_every_process`): the most specific kind any of them found.
_RESTORE_ERRORS = (ValueError, CheckpointCorruptError)


@contextlib.contextmanager
def _reading(path: str, step: int, item: str, earlier: list[int], hint: str = ""):
    """Turns any failure to read `item` of a step into a CheckpointCorruptError that names
    the step, the file or item, what went wrong, and the earlier steps to fall back on."""
    try:
        yield
    except (CheckpointNotFoundError, CheckpointCorruptError):
        raise
    except Exception as e:
        root = e  # Tensorstore's own words are at the end of the chain.
        while root.__cause__ is not None:
            root = root.__cause__
        where = f"{path}/{step}/{item}"
        files = re.findall(r'local file "([^"]+)"', str(e) + str(root))
        if files and files[-1].rstrip("/") != where:
            where += f" (file {files[-1]})"
        fallback = (
            f"Earlier steps that may be restored: {earlier} "
            f"(checkpoint.restore(..., step={earlier[-1]}))."
            if earlier
            else "There is no earlier step to fall back on."
        )
        raise CheckpointCorruptError(
            f"checkpoint.restore: step {step} is corrupt or incomplete ({hint}a file was "
            f"truncated, deleted or overwritten): reading {where} failed with "
            f"{type(root).__name__}: {_summary(root)}. {fallback}"
        ) from e


def _summary(e: BaseException) -> str:
    """The first line of an error, without tensorstore's spec dump."""
    text = str(e).split("See full TensorStore details")[0].strip()
    text = text.splitlines()[0] if text else repr(e)
    text = text.rstrip(".")
    return text if len(text) <= 300 else text[:300] + "..."


def all_steps(directory: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoints under `directory`, ascending ([] if none)."""
    path = _path(directory)
    wait(path)
    if not _exists(path):
        return []
    with _manager(path, read_only=True) as manager:
        return sorted(manager.all_steps())


# ------------------------------------------------------------------------------- helpers


def _path(directory) -> str:
    path = os.fspath(directory)
    return path if "://" in path else os.path.abspath(path)


def _exists(path: str) -> bool:
    """Whether the directory exists, as process 0 sees it (every process takes the same
    branch: one that saw the directory another process had just created would open a
    manager the others do not, and orbax's collective steps would no longer match)."""
    if "://" in path:
        from etils import epath

        here = epath.Path(path).is_dir()
    else:
        here = os.path.isdir(path)
    if jax.process_count() == 1:
        return here
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(here)))


class _QuietAbsl(logging.Filter):
    """Drops orbax's warnings about read-only managers, which restore uses on purpose."""

    def filter(self, record):
        text = record.getMessage()
        return "read only" not in text and "read_only" not in text


@contextlib.contextmanager
def _manager(path: str, read_only: bool, asynchronous: bool = False):
    """A CheckpointManager for `path`, closed on exit unless `asynchronous` (then `wait`
    closes it once its save is written)."""
    ocp = _orbax()
    quiet = _QuietAbsl()
    log = logging.getLogger("absl")
    log.addFilter(quiet)
    try:
        options = ocp.CheckpointManagerOptions(
            read_only=read_only,
            create=not read_only,
            enable_async_checkpointing=asynchronous,
            # A save killed mid-way leaves "<step>.orbax-checkpoint-tmp-*"; the next save
            # clears it.
            cleanup_tmp_directories=not read_only,
        )
        handlers = {
            "embedding": ocp.StandardCheckpointHandler(),
            "metadata": ocp.JsonCheckpointHandler(),
            "dense": ocp.StandardCheckpointHandler(),
            "dynamic": ocp.StandardCheckpointHandler(),
        }
        # Any, as the `with` statement typed it before: orbax's restore results are
        # attribute-style Composites that its Mapping annotation does not describe.
        manager: Any = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
        try:
            yield manager
        except BaseException:
            manager.close()
            raise
        if not asynchronous:
            manager.close()
    finally:
        log.removeFilter(quiet)


def _auto_twin(emb) -> jax.sharding.Mesh:
    """`emb.mesh` with Auto axes: the layout conversions reshape sharded dims, which Explicit
    axes reject; the devices and the partitioning are the same."""
    return jax.sharding.Mesh(emb.mesh.devices, emb.mesh.axis_names)


def _row_sharding(emb, auto: bool, ndim: int, memory_kind: str | None = None) -> NamedSharding:
    # Spelled P(axis, None, ...) as jit's outputs spell it, so a restored state hits the same
    # compiled train step as a fresh one.
    mesh = _auto_twin(emb) if auto else emb.mesh
    return NamedSharding(mesh, P(emb.axis, *([None] * (ndim - 1))), memory_kind=memory_kind)


def _exact_sharding(
    mesh: jax.sharding.Mesh, shape: tuple, memory_kind: str | None = None
) -> NamedSharding:
    """A sharding of a logical (V, D) or (V,) array over `mesh`'s devices that splits it
    evenly: rows over g devices (g divides V) and columns over h (h divides D), g·h dividing
    N and as large as possible (row splits first); the other devices hold replicas.
    jax.Arrays cannot be split unevenly, and an exact (V, D) is what any orbax user reads
    without knowing the mesh; this keeps each device's part about 1/N of it whenever V or D
    allows (a V prime to N with a D that N does not divide is the bad case)."""
    devices = mesh.devices.reshape(-1)
    n = devices.size
    best = (1, 1)
    for g in range(n, 0, -1):
        if n % g or shape[0] % g:
            continue
        rest = n // g
        h = 1
        if len(shape) == 2:
            h = max(c for c in range(1, rest + 1) if rest % c == 0 and shape[1] % c == 0)
        if g * h > best[0] * best[1]:
            best = (g, h)
    g, h = best
    exact = jax.sharding.Mesh(devices.reshape(g, h, n // (g * h)), ("rows", "cols", "replicas"))
    spec = P("rows", "cols") if len(shape) == 2 else P("rows")
    return NamedSharding(exact, spec, memory_kind=memory_kind)


@functools.cache
def _logical_fn(storage: _storage.TableStorage, slot: _optimizers.SlotSpec | None, mesh):
    """Jitted: a stored array -> its logical rows, exactly (V, ...) with `_exact_sharding`;
    for the table's array (slot None) (table (V, D), {rider: (V, D)})."""
    v, d = storage.layout.vocabulary_size, storage.dim
    if slot is not None:
        shape = (v, d) if slot.rank == 2 else (v,)
        return jax.jit(
            functools.partial(storage.array_to_logical, slot),
            out_shardings=_exact_sharding(mesh, shape),
        )

    def fn(physical):
        return storage.split_row(storage.array_to_logical(None, physical))

    exact = _exact_sharding(mesh, (v, d))
    return jax.jit(fn, out_shardings=(exact, {s.name: exact for s in storage.riders}))


@functools.cache
def _physical_fn(
    storage: _storage.TableStorage, slot: _optimizers.SlotSpec | None, sharding: NamedSharding
):
    def fn(stored):
        return storage.array_to_physical(slot, stored[: storage.layout.vocabulary_size])

    return jax.jit(fn, out_shardings=sharding)


def _conversion(emb, name: str) -> str:
    """How `save` and `restore` convert a static table between its stored arrays and its
    logical rows:
    - "shards": a table in host memory (which may be larger than HBM: it must not pass
      through a device) whose every shard holds one block of the logical rows ("div", V a
      multiple of N), so that each device's block of the saved (V, ...) array is its own
      shard's. Each host converts its own shards in NumPy, and orbax writes and reads the
      blocks in host memory, with any number of processes.
    - "numpy": another table in host memory, with one process: converted whole in NumPy.
    - "pieces": another table in host memory, with several processes: its rows must cross
      between the processes, which only the devices can do, so they pass through them in
      pieces of at most `multihost.CHUNK_BYTES` per device; each host keeps its blocks.
    - "devices": a table in device memory: converted on the devices, whole.
    """
    storage = emb.table_plans[name].storage
    layout = storage.layout
    if not storage.on_host:
        return "devices"
    if layout.strategy == "div" and layout.padded_rows == layout.vocabulary_size:
        return "shards"
    return "numpy" if jax.process_count() == 1 else "pieces"


def _host_blocks(shape: tuple, sharding: NamedSharding, blocks: dict) -> jax.Array:
    """{device: NumPy block} -> the array `shape` with `sharding`, in its memory kind."""
    on = lambda d: jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind)
    arrays = [jax.device_put(block, on(d)) for d, block in blocks.items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _blocks_to_logical(emb, storage: _storage.TableStorage, slot, array: jax.Array):
    """`_to_logical` of a "shards" table (`_conversion`): each local shard of the stored
    host array unpacked to its block of logical rows in NumPy (riders split off); the
    logical arrays in host memory, row-sharded. A table that is stored as its logical rows
    is returned as it is."""
    if storage.is_identity(slot):
        return array if slot is not None else (array, {})
    packing = storage.packing if slot is None else storage.slot_packing(slot)
    blocks, rider_blocks = {}, {}
    for shard in array.addressable_shards:
        block = packing.unpack(np.asarray(shard.data), 1, storage.layout.rows_per_shard)
        if slot is None:
            block, riders = storage.split_row(block)
            for rider, value in riders.items():
                rider_blocks.setdefault(rider, {})[shard.device] = np.ascontiguousarray(value)
        blocks[shard.device] = np.ascontiguousarray(block)

    def logical(blocks):
        shape = (storage.layout.vocabulary_size,) + next(iter(blocks.values())).shape[1:]
        return _host_blocks(shape, _row_sharding(emb, True, len(shape), _placement.HOST), blocks)

    table = logical(blocks)
    return table if slot is not None else (table, {r: logical(b) for r, b in rider_blocks.items()})


def _blocks_to_physical(emb, storage: _storage.TableStorage, slot, logical, riders=None):
    """`_to_physical` of a "shards" table (`_conversion`) from the logical host arrays
    restore read (a slot's, or for slot None the table's with its `riders` {name: array}):
    each local block joined and packed in NumPy into its shard of the stored array in host
    memory."""
    rider_blocks = {
        name: {sh.device: sh.data for sh in x.addressable_shards}
        for name, x in (riders or {}).items()
    }
    blocks = {}
    for shard in logical.addressable_shards:
        block = np.asarray(shard.data)
        if rider_blocks:
            block = storage.join_row(
                block, {n: np.asarray(b[shard.device]) for n, b in rider_blocks.items()}
            )
        blocks[shard.device] = block
    return _packed_shards(emb, storage, slot, blocks)


def _packed_shards(emb, storage: _storage.TableStorage, slot, blocks: dict) -> jax.Array:
    """{device: the logical rows of its shard (S, ...), riders joined} -> the stored array
    (the table's for slot None), each device's shard packed in NumPy, in the table's
    memory."""
    packing = storage.packing if slot is None else storage.slot_packing(slot)
    physical_shape = storage.shapes()[0] if slot is None else storage.shapes()[1][slot.name]
    sharding = _row_sharding(emb, False, len(physical_shape), storage.memory_kind)
    packed = {device: packing.pack(block, 1) for device, block in blocks.items()}
    return _host_blocks(physical_shape, sharding, packed)


def _pieces_to_logical(
    emb, storage: _storage.TableStorage, slot, array: jax.Array, chunk_bytes: int | None = None
):
    """`_to_logical` of a "pieces" table (`_conversion`): its logical rows pass through the
    devices in pieces (`TableStorage.take_stored`, a collective: every process reads every
    piece), and each process keeps the rows and columns of its devices' blocks of the saved
    arrays, which it builds in host memory with `_exact_sharding`. No device holds more
    than one piece of the table; a host holds its blocks and one piece."""
    layout = storage.layout
    v = layout.vocabulary_size
    chunk = _multihost.CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    per = max(1, chunk // max(row_bytes, 1))
    mesh = _auto_twin(emb)
    saved: dict = {}  # part -> (shape, sharding, {block index: NumPy block})
    for start in range(0, v, per):
        rows = np.arange(start, min(start + per, v), dtype=np.int64)
        owner, local = layout.owner_and_local(rows)
        got = storage.take_stored(slot, owner * layout.rows_per_shard + local, array)
        table, riders = (got, {}) if slot is not None else storage.split_row(got)
        for part, value in {None: table, **riders}.items():
            if part not in saved:
                shape = (v,) + value.shape[1:]
                sharding = _exact_sharding(mesh, shape, _placement.HOST)
                indices = sharding.addressable_devices_indices_map(shape)
                boxes = {_box(i, shape) for i in indices.values()}
                blocks = {box: np.empty([b - a for a, b in box], value.dtype) for box in boxes}
                saved[part] = (shape, sharding, blocks)
            for box, block in saved[part][2].items():
                (r0, r1), *cols = box
                a, b = max(r0, start), min(r1, start + len(rows))
                if a < b:
                    block[a - r0 : b - r0] = value[a - start : b - start][
                        (slice(None),) + tuple(slice(c0, c1) for c0, c1 in cols)
                    ]

    def placed(part):
        shape, sharding, blocks = saved[part]
        indices = sharding.addressable_devices_indices_map(shape)
        return _host_blocks(
            shape, sharding, {d: blocks[_box(i, shape)] for d, i in indices.items()}
        )

    if slot is not None:
        return placed(None)
    return placed(None), {r: placed(r) for r in saved if r is not None}


def _box(index, shape: tuple) -> tuple:
    """A device's index into an array of `shape` (a tuple of slices) -> ((start, stop), ...)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _pieces_to_physical(
    emb,
    storage: _storage.TableStorage,
    slot,
    logical: jax.Array,
    riders: dict | None = None,
    chunk_bytes: int | None = None,
) -> jax.Array:
    """`_to_physical` of a "pieces" table (`_conversion`) from the logical host arrays
    restore read (row blocks of the padded rows; for slot None the table's with its
    `riders`): the stored positions pass in pieces, each process reading their logical rows
    through the devices (`multihost.to_host`, a collective) and keeping those of its own
    shards, which it packs in NumPy into its shards of the stored array in host memory."""
    layout = storage.layout
    s = layout.rows_per_shard
    first, stride = layout.id_steps()
    sizes = layout.shard_sizes()
    parts = [logical] + [(riders or {})[r.name] for r in storage.riders if slot is None]
    chunk = _multihost.CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    row_bytes = sum(x.dtype.itemsize * int(np.prod(x.shape[1:], dtype=np.int64)) for x in parts)
    per = max(1, chunk // max(row_bytes, 1))
    shards = _multihost.shard_of_devices(emb)
    blocks: dict = {}
    for start in range(0, layout.padded_rows, per):
        positions = np.arange(start, min(start + per, layout.padded_rows), dtype=np.int64)
        shard, local = np.divmod(positions, s)
        real = local < sizes[shard]
        rows = np.where(real, first[shard] + stride * local, 0)
        got = [_multihost.to_host(x, rows, chunk_bytes=chunk) for x in parts]
        if slot is None and storage.riders:
            got = [storage.join_row(got[0], dict(zip([r.name for r in storage.riders], got[1:])))]
        value = np.where(real.reshape((-1,) + (1,) * (got[0].ndim - 1)), got[0], 0)
        if not blocks:
            blocks = {k: np.empty((s,) + value.shape[1:], value.dtype) for k in shards.values()}
        for k, block in blocks.items():
            a, b = max(k * s, start), min((k + 1) * s, start + len(positions))
            if a < b:
                block[a - k * s : b - k * s] = value[a - start : b - start]
    return _packed_shards(emb, storage, slot, {d: blocks[k] for d, k in shards.items()})


def _to_logical(emb, storage: _storage.TableStorage, slot, array: jax.Array):
    """A stored array -> its logical rows, exactly (V, ...), evenly sharded over `emb`'s
    devices (see `_exact_sharding`), or a NumPy array for a "numpy" table (`_conversion`);
    for the table's array (slot None) (table, {rider: rows})."""
    if storage.on_host:  # "numpy"
        logical = storage.array_to_logical(slot, np.asarray(array))
        return logical if slot is not None else storage.split_row(logical)
    array = jax.device_put(array, _row_sharding(emb, True, array.ndim))
    if storage.is_identity(slot):  # Already logical, unpadded and row-sharded: no copy.
        return array if slot is not None else (array, {})
    return _logical_fn(storage, slot, _auto_twin(emb))(array)


def _to_physical(emb, storage: _storage.TableStorage, slot, stored) -> jax.Array:
    """Stored logical rows (R', ...) on `emb`'s mesh, or in NumPy ("numpy") -> the
    physical array, row-sharded."""
    table_shape, slot_shapes = storage.shapes()
    ndim = len(table_shape if slot is None else slot_shapes[slot.name])
    if isinstance(stored, np.ndarray):
        physical = storage.array_to_physical(slot, stored[: storage.layout.vocabulary_size])
    else:
        physical = _physical_fn(storage, slot, _row_sharding(emb, True, ndim))(stored)
    return jax.device_put(physical, _row_sharding(emb, False, ndim, storage.memory_kind))


def _slot_info(plan) -> dict:
    return {s.name: {"rank": s.rank} for s in plan.storage.slot_specs}


def _metadata(
    emb, step: int, has_dense: bool, dynamic: dict | None = None, since_step: int | None = None
) -> dict:
    meta = {
        "format": _FORMAT,
        "step": step,
        "since_step": None if since_step is None else int(since_step),
        "has_dense": has_dense,
        "partition_strategy": emb.spec.partition_strategy,  # Informational only.
        "num_shards": emb.num_shards,
        "tables": {
            name: {
                "vocabulary_size": plan.config.vocabulary_size,
                "dim": plan.config.dim,
                "dtype": jnp.dtype(plan.config.dtype).name,
                "stored_rows": plan.config.vocabulary_size,
                "slots": _slot_info(plan),
            }
            for name, plan in emb.table_plans.items()
            if name not in emb.dynamic
        },
    }
    if dynamic:
        meta["dynamic"] = {name: _dynamic_info(emb, name, dynamic[name]) for name in dynamic}
    return meta


def _dynamic_info(emb, name: str, saved: dict) -> dict:
    """A dynamic table's metadata: its config, what its index was on the saving mesh, and
    how many entries its item's arrays hold (each array has at least one: orbax stores no
    empty arrays, so an empty one holds one padding entry, id -1)."""
    plan = emb.dynamic[name]
    table = emb.table_plans[name]
    config = emb.spec.tables()[name].dynamic
    counts = np.asarray(saved["counts"], np.int64)
    ids, changed, filtered = (counts[:, j].tolist() for j in range(3))
    return {
        "dim": plan.dim,
        "dtype": jnp.dtype(table.config.dtype).name,
        "slots": _slot_info(table),
        # Totals, and per block of the item (the saving mesh's shards): real entries.
        "ids": int(counts[:, 0].sum()),
        "changed": int(counts[:, 1].sum()),  # Ids with rows in the item (all in a full save).
        "filter_ids": int(counts[:, 2].sum()),
        "blocks": {"ids": ids, "changed": changed, "filter_ids": filtered},
        "counters": list(_hashindex.STAT_NAMES),
        "config": {
            "capacity": config.capacity,
            "eviction": config.eviction,
            "ttl_steps": config.ttl_steps,
            "min_count": config.min_count,
            "admit_probability": float(config.admit_probability),
            "bucket_size": config.bucket_size,
            "filter_capacity": config.filter_capacity,
        },
        "buckets": plan.index.buckets,
        "filter_buckets": plan.index.filter_buckets,
        "filter_bucket_size": plan.index.filter_bucket_size,
        "seed": plan.index.seed,
        "lanes": True,  # Each id's lane in its bucket (saves before session 35 have none).
    }


# ------------------------------------------------------------------ dynamic tables


def _words(ids: np.ndarray) -> np.ndarray:
    """int64 ids -> (..., 2) uint32 (hi, lo) words (`jte.split_ids`' halves): what a
    jax.Array holds without jax_enable_x64."""
    return np.stack(_hashindex.split_ids(ids), axis=-1)


def _ids(x) -> np.ndarray:
    """The int64 ids of an item's id array: (..., 2) uint32 words, or int64 as saved before
    blocks."""
    x = np.asarray(x)
    return _hashindex.join_ids(x[..., 0], x[..., 1]) if x.dtype == np.uint32 else x


def _dynamic_logical(emb, state, name: str, physical, physical_slots, since=None) -> dict:
    """A dynamic table's checkpoint item, block k of each array (dimension 0) holding shard
    k's entries, padded to the most any shard has: "ids" int64 ascending within the block
    (every id holding a slot, TTL-expired ones too), "last", "count" int32 (the index's
    scores), "changed" int64 (the ids whose rows follow: all of them, or with `since` those
    updated at a step >= since), "rows" float32 (N, m, D), "slots" {slot: (N, m, D) or
    (N, m)}, "filter_ids" int64, "filter_count" int32 (the admission filter), "counters"
    int64 (N, one per _hashindex.STAT_NAMES); and "key" uint32 (2,) (the words its initial
    rows are drawn from). Padding entries have id -1; every array has at least one entry
    per block (orbax stores no empty arrays). Each process reads only the shards it holds,
    the rows saved in pieces on their own devices (`multihost.alone`), and the blocks are
    global arrays sharded as the index is, so every host writes only its own: no host
    holds the table's whole index or rows. "counts" (N, 3): each block's real ids, changed
    ids and filter entries, known to every process; it goes to the metadata."""
    plan = emb.dynamic[name]
    storage = emb.table_plans[name].storage
    n = emb.num_shards
    index = state.index[name].index
    fields = [f.name for f in dataclasses.fields(index)]
    # An empty array (the filter's, with min_count 1) is replicated: `_index_sharding`.
    index_parts = {
        f: _multihost.parts(x, n) if x.shape[0] else collections.defaultdict(lambda x=x: x)
        for f in fields
        for x in [getattr(index, f)]
    }
    tables = _multihost.parts(physical, n)
    alone = _multihost.alone  # Each shard's rows read on its own device.
    own_slots = {s: _multihost.parts(a, n) for s, a in physical_slots.items()}
    blocks, counts = {}, np.zeros((n, 3), np.int64)
    for k in sorted(tables):
        part = type(index)(**{f: np.asarray(index_parts[f][k]) for f in fields})
        entries = _dynamic.held(plan, part)
        changed = np.ones(len(entries["ids"]), bool) if since is None else entries["last"] >= since
        where = entries["rows"][changed]  # The shard's own stored positions.
        rows, riders = storage.split_row(storage.take_stored(None, where, alone(tables[k])))
        slots = {
            s.name: riders[s.name]
            if s.name in riders
            else storage.take_stored(s, where, alone(own_slots[s.name][k]))
            for s in storage.slot_specs
        }
        blocks[k] = {
            "ids": _words(entries["ids"]),
            "lanes": entries["lanes"],
            "last": entries["last"],
            "count": entries["count"],
            "changed": _words(entries["ids"][changed]),
            "rows": rows.astype(np.float32, copy=False),
            "slots": {s: v.astype(np.float32, copy=False) for s, v in slots.items()},
            "filter_ids": _words(entries["filter_ids"]),
            "filter_count": entries["filter_count"],
            "counters": entries["counters"].astype(np.int32),
        }
        counts[k] = len(entries["ids"]), int(changed.sum()), len(entries["filter_ids"])
    counts = _multihost.most_of(counts)
    ids, changed, filtered = (max(int(c), 1) for c in counts.max(axis=0))

    def global_blocks(local: dict, width: int, fill=0) -> jax.Array:
        """{shard k: its entries} -> the (N, width, ...) array in host memory whose block k
        holds shard k's entries, padded with `fill`."""
        one = next(iter(local.values()))
        shape = (n, width) + one.shape[1:]

        def block(at):
            value = local[at[0].start or 0]
            out = np.full((1,) + shape[1:], fill, one.dtype)
            out[0, : len(value)] = value
            return out

        sharding = _row_sharding(emb, False, len(shape), _placement.HOST)  # Never in HBM.
        return jax.make_array_from_callback(shape, sharding, block)

    widths = {"ids": ids, "lanes": ids, "last": ids, "count": ids}
    widths.update(changed=changed, rows=changed)
    widths.update(filter_ids=filtered, filter_count=filtered)
    widths["counters"] = len(_hashindex.STAT_NAMES)  # One row of counters per block.
    item: dict[str, Any] = {
        f: global_blocks(
            {k: b[f] for k, b in blocks.items()},
            width,
            _hashindex.PAD if f in ("ids", "changed", "filter_ids") else 0,
        )
        for f, width in widths.items()
    }
    item["slots"] = {
        s.name: global_blocks({k: b["slots"][s.name] for k, b in blocks.items()}, changed)
        for s in storage.slot_specs
    }
    item["key"] = np.asarray(_multihost.to_host(state.index[name].key), np.uint32).reshape(2)
    item["counts"] = counts
    return item


def _placed(value, abstract: jax.ShapeDtypeStruct) -> jax.Array:
    """A host array placed as `abstract` says (works with several processes)."""
    host = np.asarray(value, abstract.dtype)
    return jax.make_array_from_callback(abstract.shape, abstract.sharding, lambda i: host[i])


def _by_shard(emb, name: str, infos: list[dict]) -> bool:
    """Whether each process may read only the blocks of table `name`'s items that hold its
    own shards' ids: every save in the chain (`infos`, the table's metadata in each) was
    written in blocks, by S shards where S is a multiple or a divisor of emb's N, from an
    index that puts every id in the bucket `emb`'s does (same buckets, bucket sizes and
    seed). A shard's buckets are then a whole run of S/N blocks, or lie in one block (with
    the buckets of N/S - 1 other shards)."""
    index = emb.dynamic[name].index
    same = {"filter_buckets": index.filter_buckets, "filter_bucket_size": index.filter_bucket_size}

    def matches(info: dict) -> bool:
        blocks = info.get("blocks")
        n, saved = emb.num_shards, len(blocks["ids"]) if blocks is not None else 0
        return (
            blocks is not None
            and (saved % n == 0 or n % saved == 0)
            and _same_buckets(emb, name, info)
            and all(info.get(k) == v for k, v in same.items())
        )

    return all(matches(info) for info in infos)


def _same_buckets(emb, name: str, info: dict) -> bool:
    """Whether a save of table `name` (`info`, its metadata) put every id in the bucket
    `emb`'s index does: the same buckets, bucket size and seed."""
    index = emb.dynamic[name].index
    return (
        info["config"]["bucket_size"] == index.bucket_size
        and info.get("buckets") == index.buckets
        and info.get("seed") == index.seed
    )


def _block_sharding(emb, blocks: int, ndim: int) -> NamedSharding:
    """The sharding of a dynamic item's (blocks, ...) arrays in host memory that spreads the
    blocks over the devices: G = gcd(blocks, N) groups of N/G shards each read blocks/G
    blocks, group g those from g·blocks/G on. Where `_by_shard` holds, these are the blocks
    its shard's ids are in: with blocks = r·N, shard k's r blocks from k·r on; with N =
    r·blocks, block k // r (each block on r shards)."""
    mesh, n = emb.mesh, emb.num_shards
    at = mesh.axis_names.index(emb.axis)
    devices = np.moveaxis(mesh.devices, at, 0)  # Shard by shard.
    groups = math.gcd(blocks, n)
    devices = devices.reshape((groups, n // groups) + devices.shape[1:])
    others = tuple(a for a in mesh.axis_names if a != emb.axis)
    grouped = jax.sharding.Mesh(devices, ("blocks", "within") + others)
    spec = P("blocks", *([None] * (ndim - 1)))
    return NamedSharding(grouped, spec, memory_kind=_placement.HOST)


def _dynamic_target(emb, saved: dict) -> dict:
    """Targets of the dynamic item, shaped from the metadata: items in blocks as
    jax.ShapeDtypeStructs spread over the devices (`_block_sharding`: each process reads
    only its devices' blocks); items saved before blocks, which hold one block of every id,
    as NumPy (every process reads all)."""
    out = {}
    for name, info in saved.items():
        if name not in emb.dynamic:
            continue
        blocks = info.get("blocks")
        if blocks is None:  # One flat block of every id.
            lead, widths = (), (info["ids"], info.get("changed", info["ids"]), info["filter_ids"])
        else:
            lead = (len(blocks["ids"]),)
            widths = tuple(max(blocks[k]) for k in ("ids", "changed", "filter_ids"))
        n, m, nf = (max(w, 1) for w in widths)
        d = info["dim"]

        def target(shape, dtype, name=name, lead=lead):
            shape = lead + shape
            if not lead:
                return np.zeros(shape, dtype)
            sharding = _block_sharding(emb, shape[0], len(shape))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        # Ids as int64 before blocks, as (hi, lo) uint32 words (`_words`) in blocks.
        ids = (lambda w: ((w,), np.int64)) if blocks is None else (lambda w: ((w, 2), np.uint32))
        counters = np.int64 if blocks is None else np.int32
        out[name] = {
            "ids": target(*ids(n)),
            **({"lanes": target((n,), np.int32)} if info.get("lanes") else {}),
            "last": target((n,), np.int32),
            "count": target((n,), np.int32),
            "rows": target((m, d), np.float32),
            "slots": {
                s: target((m, d) if v["rank"] == 2 else (m,), np.float32)
                for s, v in info["slots"].items()
            },
            "filter_ids": target(*ids(nf)),
            "filter_count": target((nf,), np.int32),
            "key": np.zeros((2,), np.uint32),
            "counters": target((len(info["counters"]),), counters),
        }
        if "changed" in info:  # Saves before incremental ones had rows of every id.
            out[name]["changed"] = target(*ids(m))
    return out


def _entries(block: dict, counts: tuple, counters: list) -> dict:
    """One block of the dynamic item without its padding entries (NumPy; `counts` its real
    ids, changed ids and filter entries); counters by name; "changed": the ids "rows" and
    "slots" belong to."""
    n, m, nf = counts
    kept = ("lanes", "last", "count") if "lanes" in block else ("last", "count")
    out: dict[str, Any] = {k: np.asarray(block[k])[:n] for k in kept}
    out["ids"] = _ids(block["ids"])[:n]
    out["changed"] = _ids(block["changed"])[:m] if "changed" in block else out["ids"]
    out["rows"] = np.asarray(block["rows"])[:m]
    out["slots"] = {s: np.asarray(v)[:m] for s, v in block["slots"].items()}
    out["filter_ids"] = _ids(block["filter_ids"])[:nf]
    out["filter_count"] = np.asarray(block["filter_count"])[:nf]
    out["key"] = np.asarray(block["key"], np.uint32)
    out["counters"] = dict(zip(counters, np.asarray(block["counters"]).reshape(-1).tolist()))
    return out


def _joined(parts: list[dict]) -> dict:
    """The entries of several blocks as one (in block order), counters summed."""
    if len(parts) == 1:
        return parts[0]
    cat = lambda key: np.concatenate([p[key] for p in parts])
    kept = ("ids", "lanes", "last", "count", "changed", "rows")
    out: dict[str, Any] = {k: cat(k) for k in kept if k in parts[0]}
    out.update(filter_ids=cat("filter_ids"), filter_count=cat("filter_count"))
    out["slots"] = {s: np.concatenate([p["slots"][s] for p in parts]) for s in parts[0]["slots"]}
    out["key"] = parts[0]["key"]
    out["counters"] = {c: sum(p["counters"][c] for p in parts) for c in parts[0]["counters"]}
    return out


def _unpadded(emb, name: str, stored: dict, info: dict, by_shard: bool) -> dict:
    """{shard k of emb: entries} for each shard this process holds, from the blocks its
    device read (`_block_sharding`): `by_shard`, the entries of k's ids; else k's share of
    its blocks' entries (`_share`), for `_routed` to send to their shards. An item saved
    before blocks: {None: the entries of every id}."""
    blocks = info.get("blocks")
    if blocks is None:  # Saved before blocks: one block of every id.
        counts = (info["ids"], info.get("changed", info["ids"]), info["filter_ids"])
        return {None: _entries(stored, counts, info["counters"])}
    counts = list(zip(blocks["ids"], blocks["changed"], blocks["filter_ids"]))
    stored = dict(stored)
    key = stored.pop("key")
    arrays, treedef = jax.tree.flatten(stored)

    def entries(block: int, leaves: list) -> dict:
        tree = {**treedef.unflatten(leaves), "key": key}
        return _entries(tree, counts[block], info["counters"])

    n, saved = emb.num_shards, len(counts)
    sharing = n // math.gcd(saved, n)  # The shards that read each block.
    mine = _multihost.shard_of_devices(emb)
    out = {}
    for k in sorted(set(mine.values())):
        device = next(d for d, j in mine.items() if j == k)
        parts = []
        for a in arrays:  # Each device holds its shard's blocks (`_block_sharding`).
            (held,) = [s for s in a.addressable_shards if s.device == device]
            parts.append((held.index[0].start or 0, np.asarray(held.data)))
        first = parts[0][0]
        found = [
            entries(first + i, [part[i] for _, part in parts]) for i in range(len(parts[0][1]))
        ]
        if not by_shard:
            out[k] = _share(_joined(found), k % sharing, sharing)
        elif saved >= n:
            out[k] = _joined(found)
        else:
            out[k] = _of_shard(emb, name, found[0], k, sharing)
    return out


# What travels with each kind of id (`_routed`, `_picked`), after the id itself.
_ROUTED = {
    "ids": ("lanes", "last", "count"),
    "changed": ("rows", "slots"),
    "filter_ids": ("filter_count",),
}


def _picked(entries: dict, picks: dict, first: bool) -> dict:
    """The entries that `picks` ({kind of id in `_ROUTED`: an index into its ids}) keeps
    of each kind, with what travels with them; the key; the counters where `first`, else
    zeros (so the totals stay when several take parts of one block)."""
    out: dict[str, Any] = {"key": entries["key"]}
    for lead, at in picks.items():
        for f in (lead, *_ROUTED[lead]):
            if f == "slots":
                out["slots"] = {s: v[at] for s, v in entries["slots"].items()}
            elif f in entries:
                out[f] = entries[f][at]
    out["counters"] = {c: v if first else 0 for c, v in entries["counters"].items()}
    return out


def _share(entries: dict, i: int, r: int) -> dict:
    """Part i of r disjoint parts of `entries` (every r-th id, changed id and filter entry
    from the i-th on), the counters with part 0: the r shards that read the same blocks
    each take one part to `_routed`, so every entry travels once and the counters' totals
    stay."""
    if r == 1:
        return entries
    return _picked(entries, dict.fromkeys(_ROUTED, slice(i, None, r)), i == 0)


def _routed(emb, name: str, parts: dict, **exchange) -> dict:
    """{shard k of this process: the entries of the ids that emb's index puts in k's
    buckets} from `parts` ({k: the share that shard k read (`_unpadded`)}, or {None: every
    entry, read by every process}): each id with its scores (and lanes), each changed id
    with its rows and slots, each filter entry, sent to the shard of its bucket through the
    devices (`multihost.exchange`), so no host holds more than its shards' entries; each
    kind in ascending id order. Each share's counters stay on its shard: their totals are
    what was saved. `exchange`: `multihost.exchange`'s options."""
    n = emb.num_shards
    own = sorted(set(_multihost.shard_of_devices(emb).values()))
    if None in parts:  # Every process read every entry: shard k sends every n-th.
        parts = {k: _share(parts[None], k, n) for k in own}
    config = emb.dynamic[name].index
    per = config.buckets // n
    out = {k: {"key": parts[k]["key"], "counters": parts[k]["counters"], "slots": {}} for k in own}
    for lead in _ROUTED:
        sent = {}
        for k in own:
            fields = _taken(parts[k], lead)
            g = _hashindex.global_bucket(config, *_hashindex.split_ids(fields[lead]))
            sent[k] = fields, g.astype(np.int64) // per
        # Each kind arrives in ascending id order: rows then follow their ids.
        for k, fields in _multihost.exchange(emb, sent, **exchange).items():
            for f, v in fields.items():
                slot = f.removeprefix("slots/")
                (out[k]["slots"] if slot != f else out[k])[slot] = v
    return out


def _taken(entries: dict, lead: str) -> dict:
    """{field: values} of what travels with `lead`'s ids (`_ROUTED`), ids first, slot s as
    "slots/s"; taken out of `entries`, so that they go once they are sent."""
    out = {lead: entries.pop(lead)}
    for f in _ROUTED[lead]:
        if f == "slots":
            slots = entries.pop("slots")
            out.update({f"slots/{s}": v for s, v in sorted(slots.items())})
        elif f in entries:
            out[f] = entries.pop(f)
    return out


def _of_shard(emb, name: str, entries: dict, k: int, sharing: int) -> dict:
    """The entries of one block (saved by fewer shards than emb has: `sharing` of emb's
    shards' buckets in it) that belong to emb's shard k; the block's counters go to the
    first of those shards, so that the totals stay what they were."""
    config = emb.dynamic[name].index
    per = config.buckets // emb.num_shards

    def ours(ids):
        g = _hashindex.global_bucket(config, *_hashindex.split_ids(ids))
        return np.asarray(g) // per == k

    return _picked(entries, {f: ours(entries[f]) for f in _ROUTED}, k % sharing == 0)


def _dynamic_entries(
    manager, path: str, step: int, meta: dict, emb, earlier: list
) -> tuple[dict, set]:
    """({dynamic table name of `emb`: {shard k of this process: the entries of k's ids}} at
    `step`, with the rows and slots of every id; the tables whose entries were `_routed`).
    An incremental save's other rows come from the step it was saved on top of, read the
    same way (a chain down to a full save)."""
    ocp = _orbax()
    chain = [(step, meta, earlier)]  # From `step` down to its full save.
    while chain[-1][1].get("dynamic") and chain[-1][1].get("since_step") is not None:
        top, top_meta, top_earlier = chain[-1]
        base = top_meta["since_step"]
        if base not in top_earlier:
            raise CheckpointCorruptError(
                f"checkpoint.restore: step {top} of {path} was saved on top of step {base} "
                f"(since_step), which the directory no longer holds; its steps are "
                f"{sorted(top_earlier + [top])}."
            )
        older = [s for s in top_earlier if s < base]
        chain.append((base, _metadata_of(manager, path, base, older), older))
    saved = {name: info for name, info in meta.get("dynamic", {}).items() if name in emb.dynamic}
    for name, info in saved.items():  # Before reading: a capacity the live ids cannot fit.
        blocks, config = info.get("blocks"), emb.dynamic[name].index
        held = sum(blocks["ids"]) if blocks is not None else info["ids"]
        if held > config.capacity:
            raise ValueError(
                f"checkpoint.restore: {path}/{step}: table {name!r}: {held} ids do not fit "
                f"its capacity of {config.capacity} rows ({config.buckets} buckets of "
                f"{config.bucket_size})."
            )
    by_shard = {
        name
        for name in saved
        if _by_shard(emb, name, [m.get("dynamic", {}).get(name, {}) for _, m, _ in chain])
    }

    def read(at: int, at_saved: dict, at_earlier: list) -> dict:
        with _reading(path, at, "dynamic", at_earlier):
            item = manager.restore(
                at,
                args=ocp.args.Composite(
                    dynamic=ocp.args.StandardRestore(_dynamic_target(emb, at_saved))
                ),
            ).dynamic
        return {
            name: _unpadded(emb, name, item[name], at_saved[name], name in by_shard)
            for name in item
        }

    def merged(top: dict, below: dict, where: str) -> dict:
        return {
            name: {k: _on_top(e, below[name][k], where, name) for k, e in parts.items()}
            for name, parts in top.items()
        }

    out: dict[str, dict] = {}
    for at, at_meta, at_earlier in reversed(chain):
        at_saved = at_meta.get("dynamic", {})
        if not at_saved:
            return {}, set()
        # Each process reads and checks only its devices' blocks.
        where = f"checkpoint.restore: {path}/{at}"
        item = _guards.on_every_process(
            functools.partial(read, at, at_saved, at_earlier), where, _RESTORE_ERRORS
        )
        # The entries of another index's shards go to their shards in this one.
        item = {n: p if n in by_shard else _routed(emb, n, p) for n, p in item.items()}
        if out:
            item = _guards.on_every_process(
                functools.partial(merged, item, out, f"{path}/{at}"), where, _RESTORE_ERRORS
            )
        out = item
    for name, parts in out.items():  # Lanes only into the buckets they were lanes of.
        if not _same_buckets(emb, name, saved[name]):
            for entries in parts.values():
                entries.pop("lanes", None)
    return out, set(saved) - by_shard


def _positions(keys: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(where each of `wanted` is in `keys` (distinct ids, any order), whether it is)."""
    order = np.argsort(keys, kind="stable")
    at = np.minimum(np.searchsorted(keys, wanted, sorter=order), max(len(keys) - 1, 0))
    where = order[at] if len(keys) else at
    found = (keys[where] == wanted) if len(keys) else np.zeros(len(wanted), bool)
    return where, found


def _on_top(entries: dict, below: dict, where: str, name: str) -> dict:
    """An incremental save's entries with every id's rows and slots: its own for the ids it
    lists as changed, those of the save below for the others."""
    ids, changed = entries["ids"], entries["changed"]
    own, mine = _positions(changed, ids)
    at, found = _positions(below["ids"], ids[~mine])
    if not found.all():
        raise CheckpointCorruptError(
            f"checkpoint.restore: {where}, table {name!r}: {int((~found).sum())} ids not "
            f"updated since the step below it are not in that step (e.g. id "
            f"{int(ids[~mine][~found][0])}); the chain of incremental saves is broken."
        )
    own = own[mine]

    def merge(mine_values, below_values):
        out = np.empty((len(ids),) + mine_values.shape[1:], mine_values.dtype)
        out[mine] = mine_values[own]
        out[~mine] = below_values[at]
        return out

    return {
        **entries,
        "changed": ids,
        "rows": merge(entries["rows"], below["rows"]),
        "slots": {s: merge(v, below["slots"][s]) for s, v in entries["slots"].items()},
    }


def _dynamic_state(emb, name: str, parts: dict, where: str, routed: bool) -> tuple:
    """(physical table, {slot: physical array}, DynamicState) of a dynamic table from its
    logical form (`_dynamic_entries`' {shard: entries} of this process's shards): the index
    rebuilt for emb's mesh and capacity shard by shard (scores, filter, counters and key as
    saved), the rows written to the slots the ids get: each process builds and packs only
    its own shards, in NumPy, placed straight where they live (never a logical copy on the
    devices, nor a host table in HBM). `routed`: the entries were sent to these shards from
    another index's (`_routed`), so one that does not fit is this capacity's limit, not a
    corrupt block."""
    plan = emb.dynamic[name]
    table_plan = emb.table_plans[name]
    storage = table_plan.storage
    n = emb.num_shards
    items = [
        item
        for entries in parts.values()
        for item in _guards.restored_items(
            name, table_plan.optimizer, entries["rows"], entries["slots"], storage.slot_specs
        )
    ]

    def checked_and_rebuilt():  # Each process checks and rebuilds its own shards' parts.
        _guards.check_restored(items, where)
        return _rebuilt(emb, name, parts, where, routed)

    local_rows, built = _guards.on_every_process(checked_and_rebuilt, where, _RESTORE_ERRORS)
    layout = storage.layout
    s_rows = layout.rows_per_shard
    mine = _multihost.shard_of_devices(emb)
    padding = np.arange(s_rows)[None, :] >= layout.shard_sizes()[:, None]  # (N, S)
    blocks, slot_blocks = {}, {s.name: {} for s in storage.stored}
    for k, (local, rows, slot_rows) in local_rows.items():
        table = np.zeros((s_rows, plan.dim), table_plan.config.dtype)
        table[local] = rows.astype(table.dtype)
        values = {}
        for spec in storage.slot_specs:
            value = slot_rows[spec.name]
            block = np.full((s_rows,) + value.shape[1:], float(spec.initializer), np.float32)
            block[local] = value
            block[padding[k]] = 0.0
            values[spec.name] = block
        table = storage.join_row(table, {r.name: values[r.name] for r in storage.riders})
        blocks.update({d: table for d, j in mine.items() if j == k})
        for slot, block in slot_blocks.items():
            block.update({d: values[slot] for d, j in mine.items() if j == k})
    physical = _packed_shards(emb, storage, None, blocks)
    slots = {
        spec.name: _packed_shards(emb, storage, spec, slot_blocks[spec.name])
        for spec in storage.stored
    }
    key = next(iter(parts.values()))["key"]
    abstract = dataclasses.replace(emb.abstract_state().index[name], cache=None)
    index = _dynamic.DynamicState(
        jax.tree.map(
            lambda s, *local: _from_parts(s, dict(zip(built, local)), n),
            abstract.index,
            *built.values(),
        ),
        _placed(key, abstract.key),
    )  # Caches: `Embedding.with_empty_caches`.
    return physical, slots, index


def _rebuilt(emb, name: str, parts: dict, where: str, routed: bool) -> tuple[dict, dict]:
    """({shard k of this process: (its ids' local rows, their rows, {slot: their values})},
    {k: shard k's index}) of `_dynamic_state`'s `parts`, each shard's index rebuilt from
    its own entries."""
    plan, n = emb.dynamic[name], emb.num_shards
    local_rows, built = {}, {}
    for k, entries in parts.items():
        ids = entries["ids"]
        if not np.array_equal(entries["changed"], ids):  # Rows follow the ids.
            raise CheckpointCorruptError(
                f"{where}: table {name!r}, shard {k}: the rows of a full save are not those "
                f"of its ids."
            )
        try:
            built[k], rows = _dynamic.rebuild(plan, n, entries, shard=k)
        except ValueError as e:
            if not routed:  # A saved shard's entries fitted this same index.
                raise CheckpointCorruptError(f"{where}: table {name!r}, shard {k}: {e}") from None
            raise ValueError(
                f"{where}: table {name!r}: its {len(ids)} ids of shard {k} (of {n}, "
                f"{plan.index.capacity // n} rows each) do not fit: {e}"
            ) from None
        local_rows[k] = rows, entries["rows"], entries["slots"]
    return local_rows, built


def _from_parts(abstract: jax.ShapeDtypeStruct, parts: dict, n: int) -> jax.Array:
    """The array `abstract` (dimension 0 split into `n` parts, one per shard) from {shard:
    part (NumPy)} of the shards this process holds."""
    at = abstract.sharding.addressable_devices_indices_map((n,) + abstract.shape[1:])
    if abstract.sharding.is_fully_replicated:  # Empty (`Embedding._index_sharding`): any part.
        blocks = dict.fromkeys(at, next(iter(parts.values())))
    else:
        blocks = {d: parts[i[0].start or 0] for d, i in at.items()}  # pyright: ignore[reportOptionalSubscript]
    return _host_blocks(abstract.shape, abstract.sharding, blocks)


def _check_state(emb, state) -> None:
    if not isinstance(state, _embedding.EmbeddingState):
        raise TypeError(
            f"checkpoint.save: state must be a jte.EmbeddingState, got {type(state).__name__}."
        )
    want = emb.abstract_state()
    problems = []
    if set(state.tables) != set(want.tables):
        problems.append(
            f"state has tables {sorted(state.tables)}, the embedding {sorted(want.tables)}"
        )
    else:
        for name, w in want.tables.items():
            if tuple(state.tables[name].shape) != w.shape:
                problems.append(
                    f"table {name!r} has shape {tuple(state.tables[name].shape)}, "
                    f"expected {w.shape}"
                )
            got_slots = {s: tuple(a.shape) for s, a in state.slots.get(name, {}).items()}
            want_slots = {s: a.shape for s, a in want.slots[name].items()}
            if got_slots != want_slots:
                problems.append(f"table {name!r} has slots {got_slots}, expected {want_slots}")
    if problems:
        raise ValueError(
            "checkpoint.save: the state does not belong to this embedding (a "
            "state of another mesh size or spec?): " + "; ".join(problems) + "."
        )


def _check_values(emb, stored: dict, where: str) -> None:
    """The stored tables finite and their slots in their optimizers' domains (one pass
    over each array on the devices; rows past V, the padding of older checkpoints, are
    not looked at)."""
    items = []
    for name, plan in emb.table_plans.items():
        if name in emb.dynamic:
            continue
        v = plan.storage.layout.vocabulary_size
        items += _guards.restored_items(
            name,
            plan.optimizer,
            stored["tables"][name],
            stored["slots"][name],
            plan.storage.slot_specs,
            rows=v,
        )
    _guards.check_restored(items, where)


def _check_compatible(emb, meta: dict, where: str) -> None:
    if meta.get("format") != _FORMAT:
        raise ValueError(
            f"checkpoint.restore: {where} is not a jax_tpu_embed checkpoint "
            f"(format {meta.get('format')!r}, expected {_FORMAT!r})."
        )
    saved = meta["tables"]
    saved_dynamic = meta.get("dynamic", {})
    static = {n: p for n, p in emb.table_plans.items() if n not in emb.dynamic}
    problems = []
    for name in emb.dynamic:
        if name in saved:
            problems.append(
                f"table {name!r} is dynamic in the spec but has a vocabulary in the checkpoint"
            )
    for name in saved_dynamic:
        if name in static:
            problems.append(
                f"table {name!r} is dynamic in the checkpoint but has a vocabulary in the spec"
            )
    known = set(saved) | set(saved_dynamic)
    missing = sorted(n for n in emb.table_plans if n not in known)
    extra = sorted(n for n in known if n not in emb.table_plans)
    if missing:
        problems.append(f"tables {missing} are not in the checkpoint (it has {sorted(known)})")
    if extra:
        problems.append(f"the checkpoint's tables {extra} are not in the embedding's spec")
    for name, plan in emb.table_plans.items():
        s = saved.get(name) if name in static else saved_dynamic.get(name)
        if s is None:
            continue
        fields = [("dim", plan.config.dim)]
        if name in static:
            fields.insert(0, ("vocabulary_size", plan.config.vocabulary_size))
        for field, have in fields:
            if s[field] != have:
                problems.append(
                    f"table {name!r}: {field} is {s[field]} in the checkpoint "
                    f"but {have} in the spec"
                )
        want_slots = _slot_info(plan)
        if s["slots"] != want_slots:
            problems.append(
                f"table {name!r}: the checkpoint has optimizer slots "
                f"{_describe_slots(s['slots'])} but the spec's optimizer "
                f"({type(plan.optimizer).__name__}) has "
                f"{_describe_slots(want_slots)}"
            )
    if problems:
        raise ValueError(
            f"checkpoint.restore: {where} does not fit the embedding: " + "; ".join(problems) + "."
        )


def _describe_slots(slots: dict) -> str:
    return "{" + ", ".join(f"{n!r} (rank {v['rank']})" for n, v in slots.items()) + "}"


def _embedding_target(emb) -> dict:
    """Abstract logical arrays (padded to `emb`'s N * S rows) on `emb`'s mesh, in host
    memory for the tables converted by "shards" or in "pieces", NumPy ones for "numpy"
    tables (`_conversion`)."""
    tables, slots = {}, {}
    for name, plan in emb.table_plans.items():
        if name in emb.dynamic:
            continue
        rows, d = plan.layout.padded_rows, plan.config.dim

        def target(shape, dtype, name=name):
            how = _conversion(emb, name)
            if how in ("shards", "pieces"):
                sharding = _row_sharding(emb, True, len(shape), _placement.HOST)
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            if how == "numpy":
                return np.zeros(shape, dtype)
            return jax.ShapeDtypeStruct(shape, dtype, sharding=_row_sharding(emb, True, len(shape)))

        tables[name] = target((rows, d), plan.config.dtype)
        slots[name] = {
            s.name: target((rows, d) if s.rank == 2 else (rows,), jnp.float32)
            for s in plan.storage.slot_specs
        }
    return {"tables": tables, "slots": slots}


def _replicated(emb) -> NamedSharding:
    return NamedSharding(emb.mesh, P())


def _dense_target(emb, target):
    def leaf(x):
        if x is None:
            return None
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            sharding = _replicated(emb)
        return jax.ShapeDtypeStruct(
            np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype, sharding=sharding
        )

    return jax.tree.map(leaf, target)


def _dense_target_from_metadata(emb, stored):
    tree = getattr(stored, "tree", stored)

    def leaf(m):
        if hasattr(m, "shape") and hasattr(m, "dtype"):
            return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=_replicated(emb))
        return m

    return jax.tree.map(leaf, tree, is_leaf=lambda m: hasattr(m, "shape"))
