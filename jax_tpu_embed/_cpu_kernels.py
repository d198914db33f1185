"""CPU fast path: shard-local kernels in C++ called through XLA FFI.

XLA:CPU runs the gathers, scatters and sorts of the portable backend (_xla_backend) one element
at a time on one thread. On CPU meshes these replace them, shard by shard inside shard_map:

- `sum_duplicates`: `_xla_backend.sum_duplicates`, bit for bit (radix sort, then the gradients
  of each row summed in position order from +0.0, as XLA's scatter-add sums them).
- `update`: sum duplicates, gradient multiplier and clipping, then SGD, Adagrad or
  RowwiseAdagrad and their extras (weight decay, weight clipping), in place on the donated
  table and slot, touching only the rows in the batch. Same formulas and operation order as
  `_optimizers`. XLA:CPU's compiled form of them differs from it in the last bit of some
  float32 values: it fuses some multiply-adds (the kernels fuse Adagrad's a + g² as it does),
  approximates rsqrt, vectorises RowwiseAdagrad's mean(g²) and rewrites divisions.
  A bfloat16 table's row is widened to float32, updated, and rounded back as
  `_xla_backend.apply_rows` rounds it: stochastically with the same bits of (table, step,
  global row, lane), or to nearest even. A last-bit float32 difference changes the bfloat16
  result only when it straddles a rounding boundary (odds about 2**-16 per value), so bfloat16
  tables and Adagrad's slots come out bit-identical to backend="xla" in the tests; the
  RowwiseAdagrad accumulator may differ in its last bit.
- `pooled_lookup`: the gather and weighted sum of a non-sequence feature, without the
  (B, L, D) intermediate; bfloat16 rows are widened to float32 and summed in float32, in the
  XLA lookup's order (bit-identical to it in the tests).

The C++ source (csrc/cpu_kernels.cc) is compiled on first use with g++ into a cache directory
keyed by the source and flags ($JTE_CACHE_DIR, else ~/.cache/jax_tpu_embed). Without g++, or
if compilation fails, `available()` is False after one warning and the portable path runs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _backend, _optimizers, _plan, _storage, _streams, _xla_backend
from ._rowindex import NOT_MINE

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "cpu_kernels.cc"
_TARGETS = {
    "jte_sum_duplicates": "JteSumDuplicates",
    "jte_update_no_slot": "JteUpdateNoSlot",
    "jte_update_one_slot": "JteUpdateOneSlot",
    "jte_pooled_lookup": "JtePooledLookup",
}
_KINDS = {_optimizers.SGD: 0, _optimizers.Adagrad: 1, _optimizers.RowwiseAdagrad: 2}
# Must match `Flags` in the C++ source.
_MULTIPLIER, _CLIP_LIMIT, _CLIP_VALUE, _DECAY, _DECAY_BY_LR, _W_MIN, _W_MAX, _STOCHASTIC = (
    1,
    2,
    4,
    8,
    16,
    32,
    64,
    128,
)


def _cpu_flags() -> list[str]:
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    # AVX2 only when this machine has it. FMA too, as XLA:CPU uses it where the host has it;
    # the source fuses a multiply and an add only where XLA's result needs it (-ffp-contract=off).
    isa = ["-mavx2"] if " avx2" in flags else ["-march=x86-64-v2"] if " sse4_2" in flags else []
    return isa + (["-mfma"] if " fma" in flags else [])


def _build(source_path: pathlib.Path = _SOURCE) -> pathlib.Path:
    """The shared library of one C++ source (default: csrc/cpu_kernels.cc), compiled once
    into the cache and named after the source's stem."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    flags = [
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-ffp-contract=off",
        "-fno-math-errno",
        *_cpu_flags(),
        "-I",
        jax.ffi.include_dir(),
    ]
    source = source_path.read_bytes()
    key = hashlib.sha256(
        source + " ".join([cxx] + flags).encode() + jax.__version__.encode()
    ).hexdigest()[:16]
    cache = pathlib.Path(
        os.environ.get("JTE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "jax_tpu_embed"
    )
    lib = cache / f"{source_path.stem}-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        result = subprocess.run(
            [cxx, *flags, str(source_path), "-o", tmp], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"g++ failed:\n{result.stderr[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class Library:
    """One C++ source (`_build`), loaded and its FFI targets ({name: symbol}) registered
    once per process, on first use; `what` names it in the warning when that fails."""

    def __init__(self, source: pathlib.Path, targets: dict[str, str], what: str):
        self.source, self.targets, self.what = source, targets, what
        self._lock = threading.Lock()
        self._ok: bool | None = None

    def available(self) -> bool:
        """True when the kernels are compiled, loaded and registered (tried once)."""
        with self._lock:
            if self._ok is None:
                try:
                    lib = ctypes.cdll.LoadLibrary(str(_build(self.source)))
                    for name, symbol in self.targets.items():
                        jax.ffi.register_ffi_target(
                            name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu"
                        )
                    self._lib, self._ok = lib, True
                except Exception as e:  # noqa: BLE001 - any failure means: use the XLA path.
                    warnings.warn(
                        f"jax_tpu_embed: {self.what} unavailable ({e}); using the portable XLA "
                        f"path.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    self._ok = False
            return self._ok


_LIBRARY = Library(_SOURCE, _TARGETS, "CPU kernels")


def available() -> bool:
    """True when the kernels are compiled, loaded and registered (tried once per process)."""
    return _LIBRARY.available()


def supports_update(optimizer: _optimizers.Optimizer) -> bool:
    """Whether `update` implements this optimizer (its type exactly, not subclasses)."""
    return type(optimizer) in _KINDS


def sum_duplicates(keys: jax.Array, g: jax.Array):
    """`_xla_backend.sum_duplicates(keys, g)`: keys (M,) int32, g (M, D) float32."""
    m = keys.shape[0]
    return jax.ffi.ffi_call(
        "jte_sum_duplicates",
        (jax.ShapeDtypeStruct((m,), jnp.int32), jax.ShapeDtypeStruct(g.shape, jnp.float32)),
    )(keys.astype(jnp.int32), g.astype(jnp.float32))


def update(
    optimizer: _optimizers.SGD | _optimizers.Adagrad | _optimizers.RowwiseAdagrad,
    table: jax.Array,
    slots: tuple,
    keys: jax.Array,
    g: jax.Array,
    learning_rate: jax.Array,
    multiplier: jax.Array | None,
    clipping_limit: float | None,
    scale: jax.Array | None = None,
    rounding: jax.Array | None = None,
):
    """One sparse step, in place: (new table, new slots).

    Args:
        optimizer: SGD, Adagrad or RowwiseAdagrad (see `supports_update`).
        table: (S, D) float32 or bfloat16 shard; slots: () or one (S, D) / (S,) float32
            shard. A bfloat16 row is updated in float32 and rounded back to nearest even.
        keys: (M,) local row per position, >= 2**30 where this shard owns none.
        g: (M, D) float32 gradient per position; or, with `scale`, (M / L, D) gradients
            of which position p gets scale[p] * g[p // L] (a pooled feature's (B, D)
            gradient, never expanded to (B * L, D)).
        scale: (M,) float32 or None.
        learning_rate, multiplier: float32 scalars (multiplier None: 1).
        clipping_limit: The spec's clipping limit, or None.
        rounding: None, or (3,) int32 [step key's bits, first, stride] to round a bfloat16
            table's new rows stochastically with the bits of (step key, global row, lane),
            local row r being global row first + r * stride (see `stochastic_rounding`).
    """
    flags, clip_lo, clip_hi = 0, 0.0, 0.0
    if multiplier is not None:
        flags |= _MULTIPLIER
    if clipping_limit is not None:
        flags |= _CLIP_LIMIT
    c = optimizer.clipvalue
    if c is not None:
        flags |= _CLIP_VALUE
        clip_lo, clip_hi = c if isinstance(c, (tuple, list)) else (-c, c)
    if optimizer.weight_decay_factor:
        flags |= _DECAY
        if optimizer.multiply_weight_decay_factor_by_learning_rate:
            flags |= _DECAY_BY_LR
    if optimizer.clip_weight_min is not None:
        flags |= _W_MIN
    if optimizer.clip_weight_max is not None:
        flags |= _W_MAX
    if rounding is not None:
        flags |= _STOCHASTIC
    attrs = dict(
        kind=np.int32(_KINDS[type(optimizer)]),
        flags=np.int32(flags),
        eps=np.float32(getattr(optimizer, "epsilon", 0.0)),
        clip_limit=np.float32(clipping_limit or 0.0),
        clip_lo=np.float32(clip_lo),
        clip_hi=np.float32(clip_hi),
        decay=np.float32(optimizer.weight_decay_factor or 0.0),
        w_min=np.float32(optimizer.clip_weight_min or 0.0),
        w_max=np.float32(optimizer.clip_weight_max or 0.0),
    )
    scalars = jnp.stack(
        [
            jnp.asarray(learning_rate, jnp.float32),
            jnp.asarray(1.0 if multiplier is None else multiplier, jnp.float32),
        ]
    )
    if scale is None:
        scale = jnp.ones(keys.shape, jnp.float32)  # 1 * g is exactly g.
    if rounding is None:
        rounding = jnp.zeros((3,), jnp.int32)  # Unread: the flag is off.
    buffers = (table,) + tuple(slots)
    n = len(buffers)
    out = jax.ffi.ffi_call(
        "jte_update_no_slot" if n == 1 else "jte_update_one_slot",
        tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers),
        input_output_aliases={5 + i: i for i in range(n)},
    )(
        keys.astype(jnp.int32),
        scale.astype(jnp.float32),
        g.astype(jnp.float32),
        scalars,
        rounding.astype(jnp.int32),
        *buffers,
        **attrs,
    )
    return out[0], tuple(out[1:])


def stochastic_rounding(plan: _plan.TablePlan, step: _backend.RowStep, axis: str):
    """`update`'s `rounding` for this table and step: None unless it rounds stochastically.
    The key and global rows are `_xla_backend.stochastic_rows`' own, so both backends draw
    the same bits for a row."""
    if not plan.config.stochastic_rounding:
        return None
    assert step.step is not None
    key = _storage.step_key(_storage.table_seed(plan.name), step.step)
    first, second = plan.layout.global_ids(lax.axis_index(axis), jnp.arange(2, dtype=jnp.int32))
    return jnp.stack([lax.bitcast_convert_type(key, jnp.int32), first, second - first])


def pooled_lookup(table: jax.Array, keys: jax.Array, scale: jax.Array) -> jax.Array:
    """(B, D) = Σ_l scale[b, l] · table[keys[b, l]] over keys in [0, S); others skipped.
    A bfloat16 table's rows are widened to float32 (exactly) before the products."""
    b = keys.shape[0]
    return jax.ffi.ffi_call(
        "jte_pooled_lookup",
        jax.ShapeDtypeStruct((b, table.shape[1]), jnp.float32),
    )(keys.astype(jnp.int32), scale.astype(jnp.float32), table)


@dataclasses.dataclass(frozen=True)
class CpuBackend(_backend.Backend):
    """The kernels above for unpacked float32 and bfloat16 tables on CPU meshes, on the
    "gather" exchange. Every position of the global batch in one pass; optimizers other
    than SGD, Adagrad and RowwiseAdagrad sum their duplicates here and update their rows
    with the XLA form."""

    name = "cpu"
    one_pass = True

    def refuses(self, routing):
        if routing == "owner":
            return (
                "routing='owner' does its row work with the Pallas kernels or XLA "
                "ops; backend 'cpu' serves routing='gather' only"
            )
        return None

    def unusable(self, table, optimizer, storage, platform):
        if storage.on_host:  # Host rows are reached by XLA ops in host computations.
            return (
                "placement='host': its rows are in host memory, which the C++ kernels "
                "do not address (the 'xla' backend serves it)"
            )
        if platform != "cpu":
            return f"it needs a CPU mesh and this one is on {platform!r}"
        if storage.lanes:
            return "the C++ kernels take unpacked tables (lane_width=0)"
        if not available():
            return "its C++ kernels could not be built (see the warning above)"
        return None

    def lookup(self, call, table, inputs, axis):
        plan = call.plan
        out = {}
        for i in inputs:
            f = i.feature
            ids_all, w_all = _streams.gathered(i, axis)
            mine, local = _streams.owned(plan, f, ids_all, axis)
            scale = jnp.where(mine, _streams.feature_scale(f, w_all), 0.0)
            if f.config.is_sequence:
                partial = jnp.take(table, local, axis=0).astype(jnp.float32) * scale[..., None]
            else:
                partial = pooled_lookup(table, jnp.where(mine, local, NOT_MINE), scale)
            out[f.path] = lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)
        return out

    def update(self, call, table, slots, inputs, grads, step, axis):
        plan = call.plan
        keys, g, pooled = [], [], None
        for i in inputs:
            f = i.feature
            ids_all, w_all = _streams.gathered(i, axis)
            mine, local = _streams.owned(plan, f, ids_all, axis)
            scale = _streams.feature_scale(f, w_all)
            grad_all = lax.all_gather(grads[f.path], axis, tiled=True).astype(jnp.float32)
            if f.config.is_sequence:
                g_f = grad_all * scale[..., None]  # (B, L, D)
            else:
                g_f = scale[..., None] * grad_all[:, None, :]
                # The C++ update takes a lone pooled feature's (scale, grad_all) instead of g.
                pooled = (scale.reshape(-1), grad_all)
            keys.append(jnp.where(mine, local, NOT_MINE).reshape(-1))
            g.append(g_f.reshape(-1, g_f.shape[-1]))
        keys, g = jnp.concatenate(keys), jnp.concatenate(g)
        if not supports_update(plan.optimizer):
            rows, g_sum = sum_duplicates(keys, g)
            return _xla_backend.apply_rows(plan, table, slots, rows, g_sum, step, axis)
        if step.ok is not None:
            # The C++ update has no row function: a skipped table touches no row.
            keys = jnp.where(step.ok, keys, NOT_MINE)
        names = [s.name for s in plan.storage.slot_specs]
        scale = None
        if len(inputs) == 1 and pooled is not None:
            scale, g = pooled
        assert isinstance(
            plan.optimizer, (_optimizers.SGD, _optimizers.Adagrad, _optimizers.RowwiseAdagrad)
        )
        table, new = update(
            plan.optimizer,
            table,
            tuple(slots[n] for n in names),
            keys,
            g,
            step.learning_rate,
            step.multiplier,
            step.clipping_limit,
            scale,
            stochastic_rounding(plan, step, axis),
        )
        return table, dict(zip(names, new))
