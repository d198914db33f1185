"""How the TPU compiler charges row-granular table access, and what a Pallas kernel can do.

    python benchmarks/tpu_row_access.py                 # v5p:2x2x1, prints a table
    python benchmarks/tpu_row_access.py --json out.json

No TPU needed (shared/TPU_AOT.md). For one (250,000, D) f32 shard and 6,400 random rows it
compiles, for one device of the topology:

- an XLA gather of the rows and a donated XLA scatter of them: "bytes accessed" per row,
  against the row's own 4·D bytes (the compiler charges whole (8, 128) tiles);
- the same with the table laid out in (1, 128) tiles (jax.experimental.layout), which would
  make one row one tile: does libtpu accept it;
- a Pallas TPU kernel that DMAs each row from HBM (scalar-prefetched ids): does Mosaic
  compile it for this topology, its result against `table[ids]` in Pallas' interpret mode on
  the CPU, and whether a DMA of a narrower lane slice (one packed 32-wide row of a 128-lane
  physical row) compiles;
- on chips with SparseCores (v5p, v6e; their DMA granule is 32 bytes, not 512): Pallas
  SparseCore kernels on the chip's vector subcores — an indirect-DMA gather of the rows from
  the shard stored flat, (S·D,), and from the usual (S, D) array; an Adagrad update of the
  rows of a flat table and accumulator in place (gather, math, scatter); whether `sqrt`
  lowers on a vector subcore (the update computes 1/sqrt by Newton steps from a bit-level
  first guess instead); whether Pallas' interpreter runs an indirect DMA on the CPU; and
  whether the gather takes a shard in host memory (`pinned_host`).
  For each: compiles, temporaries, table-sized ops in the optimized HLO (a relayout copy of
  the table), the compiler's bytes accessed against the bytes the kernel declares.
- writes into, and reads from, a donated `pinned_host` array by a Pallas kernel (`pl.HOST`
  refs): one DMA per (8, W) unit at rows read from SMEM, as many as a count read from SMEM
  (a size known only at run time), on every device of the topology under `shard_map`, for
  minor widths W of 128, 256 and 512 f32 lanes: does it compile, is the host array written
  in place (aliased, no host temporary, no table-sized copy).

These are the facts behind README's "what stands between W1 and 3x essential".
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.experimental.pallas import tpu_sc as plsc  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_tpu_embed import _aot  # noqa: E402

SHARD_ROWS, ROWS, BLOCK = 250_000, 6_400, 64


def _first_line(e: Exception) -> str:
    """The error's own message: its first line, or the innermost "...Error: ..." line of a
    traceback it carries (errors raised inside a callback arrive wrapped)."""
    lines = str(e).strip().splitlines()
    inner = [x for x in lines if re.match(r"^\w+(Error|Exception): ", x)]
    return (inner[-1] if inner else lines[0])[:300]


def _compiled(fn, args, in_shardings=None, donate=(), out_shardings=None):
    """(compiled, None) or (None, error line)."""
    try:
        jitted = jax.jit(
            fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate
        )
        return jitted.lower(*args).compile(), None
    except Exception as e:  # The compiler's errors are the result here.
        return None, _first_line(e)


def _bytes_accessed(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("bytes accessed", 0.0))


def _compile(fn, args, in_shardings=None, donate=()):
    """(bytes accessed, None) or (None, error line)."""
    compiled, error = _compiled(fn, args, in_shardings, donate)
    return (None, error) if compiled is None else (_bytes_accessed(compiled), None)


def _dma_rows(ids, table, *, lanes: int, interpret: bool = False):
    """out[j] = lanes [0, lanes) of table[ids[j]], one DMA per row, BLOCK rows per step."""
    width = table.shape[1]

    def kernel(ids_ref, table_hbm, out_ref, sem):
        base = pl.program_id(0) * BLOCK

        def copy(j, row):
            return pltpu.make_async_copy(
                table_hbm.at[pl.ds(row, 1), pl.ds(0, lanes)],
                out_ref.at[pl.ds(j, 1), pl.ds(0, lanes)],
                sem,
            )

        def start(j, carry):
            copy(j, ids_ref[base + j]).start()
            return carry

        def wait(j, carry):
            copy(j, 0).wait()
            return carry

        jax.lax.fori_loop(0, BLOCK, start, 0)
        jax.lax.fori_loop(0, BLOCK, wait, 0)

    n = ids.shape[0]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n // BLOCK,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((BLOCK, width), lambda i, ids: (i, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct((n, width), table.dtype),
        # Bytes the DMAs read plus the output written: what the kernel moves.
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=n * (lanes + width) * 4
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(ids, table)


# ------------------------------------------------------------------------------ SparseCore

WINDOW = 8  # Rows per indirect DMA (one index vector of the vector subcore's lanes).


def _sparse_core(chip: str):
    return pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip), 1).sparse_core


def _sc_mesh(sc):
    return plsc.VectorSubcoreMesh(
        core_axis_name="core",
        subcore_axis_name="subcore",
        num_cores=sc.num_cores,
        num_subcores=sc.num_subcores,
    )


def _worker_rows(sc, n: int):
    """(first row, rows) of this vector subcore's equal share of n rows."""
    per = n // (sc.num_cores * sc.num_subcores)
    worker = jax.lax.axis_index("core") * sc.num_subcores + jax.lax.axis_index("subcore")
    return worker * per, per


def _sc_gather(table, ids, *, sc, dim: int, interpret: Any = False):
    """out[j] = table[ids[j]] on the SparseCores; `table` (S·D,) flat or (S, D)."""
    n = ids.shape[0]
    rows = table.reshape(-1, dim)

    @pl.kernel(
        out_type=jax.ShapeDtypeStruct((n, dim), table.dtype),
        mesh=_sc_mesh(sc),
        compiler_params=pltpu.CompilerParams(use_tc_tiling_on_sc=False),
        scratch_types=[pltpu.VMEM((WINDOW,), jnp.int32), pltpu.VMEM((WINDOW, dim), table.dtype)],
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=n * (2 * dim * 4 + 4)
        ),
        interpret=interpret,
    )
    def kernel(table_hbm, ids_hbm, out_hbm, idx, buf):
        first, per = _worker_rows(sc, n)

        @pl.loop(0, per, step=WINDOW)
        def _(j):
            pltpu.sync_copy(ids_hbm.at[pl.ds(first + j, WINDOW)], idx)
            pltpu.sync_copy(table_hbm.at[idx], buf)
            pltpu.sync_copy(buf, out_hbm.at[pl.ds(first + j, WINDOW)])

    return kernel(rows, ids)  # pyright: ignore[reportCallIssue]  (pl.kernel: untyped)


def _rsqrt(a, scratch):
    """1/sqrt(a) for a (lanes,) f32 vector > 0, on a vector subcore without sqrt: the
    bit-level first guess (0x5F375A86 - bits/2), then three Newton steps: relative error at
    most 1.8e-3, 4.7e-6, 1.5e-7 after each (the same steps in NumPy f32 over a in
    [1e-8, 1e8]). `scratch`: a (1, lanes) int32 VMEM ref for the bit casts."""
    scratch[0, :] = jnp.int32(0x5F375A86) - jax.lax.shift_right_logical(_bits(a, scratch), 1)
    y = scratch.bitcast(jnp.float32)[0, :]
    for _ in range(3):
        y = y * (1.5 - 0.5 * a * y * y)
    return y


def _bits(a, scratch):
    scratch.bitcast(jnp.float32)[0, :] = a
    return scratch[0, :]


def _sc_adagrad(table, acc, ids, grads, *, sc, dim: int, lr: float = 0.05):
    """Adagrad on rows ids (distinct) of flat (S·D,) `table` and `acc`, in place:
    acc += g², table -= lr·g/sqrt(acc), one indirect-DMA gather and scatter per window."""
    n, lanes = ids.shape[0], sc.num_lanes
    t_ref, a_ref = jax.new_ref(table.reshape(-1, dim)), jax.new_ref(acc.reshape(-1, dim))

    @pl.kernel(
        out_type=(),
        mesh=_sc_mesh(sc),
        compiler_params=pltpu.CompilerParams(use_tc_tiling_on_sc=False),
        scratch_types=[pltpu.VMEM((WINDOW,), jnp.int32)]
        + [pltpu.VMEM((WINDOW, dim), jnp.float32)] * 3
        + [pltpu.VMEM((1, lanes), jnp.int32)],
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=n * (5 * dim * 4 + 4)
        ),
    )
    def kernel(ids_hbm, g_hbm, idx, tb, ab, gb, scratch):
        first, per = _worker_rows(sc, n)

        @pl.loop(0, per, step=WINDOW)
        def _(j):
            pltpu.sync_copy(ids_hbm.at[pl.ds(first + j, WINDOW)], idx)
            pltpu.sync_copy(t_ref.at[idx], tb)
            pltpu.sync_copy(a_ref.at[idx], ab)
            pltpu.sync_copy(g_hbm.at[pl.ds(first + j, WINDOW)], gb)

            @pl.loop(0, WINDOW)
            def _(r):
                @pl.loop(0, dim, step=lanes)
                def _(k):
                    at = (r, pl.ds(k, lanes))
                    g = gb[at]
                    a = ab[at] + g * g
                    ab[at] = a
                    tb[at] = tb[at] - lr * g * _rsqrt(a, scratch)

            pltpu.sync_copy(tb, t_ref.at[idx])
            pltpu.sync_copy(ab, a_ref.at[idx])

    kernel(ids, grads)  # pyright: ignore[reportCallIssue]  (pl.kernel: untyped)
    return t_ref[...].reshape(-1), a_ref[...].reshape(-1)


def _sc_sqrt(x, *, sc):
    lanes = sc.num_lanes

    @pl.kernel(
        out_type=jax.ShapeDtypeStruct((lanes,), jnp.float32),
        mesh=_sc_mesh(sc),
        scratch_types=[pltpu.VMEM((lanes,), jnp.float32)],
    )
    def kernel(x_hbm, o_hbm, buf):
        pltpu.sync_copy(x_hbm, buf)
        buf[...] = jnp.sqrt(buf[...])
        pltpu.sync_copy(buf, o_hbm)

    return kernel(x)  # pyright: ignore[reportCallIssue]  (pl.kernel: untyped)


_NOT_DATA_OPS = (
    "parameter",
    "bitcast",
    "tuple",
    "get-tuple-element",
    "call-start",
    "call-done",
    "custom-call",
    "constant",
)


def _table_sized_ops(hlo: str, shard_bytes: int) -> list[str]:
    """Ops of the optimized HLO (besides parameters, bitcasts and the kernel call) whose
    result is at least a table shard: relayout copies of the whole table."""
    out = []
    for _, shape, op, _ in _aot._parse(hlo):
        if op not in _NOT_DATA_OPS and any(b >= shard_bytes for _, b in _aot.array_bytes(shape)):
            out.append(f"{op} {shape.split('{')[0]}")
    return out


def _sc_result(compiled, error, shard_bytes: int, declared: float) -> dict:
    if compiled is None:
        return {"compiles": error}
    return {
        "compiles": "compiles",
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "table_sized_ops": _table_sized_ops(compiled.as_text(), shard_bytes),
        "bytes_accessed": _bytes_accessed(compiled),
        "declared_bytes": declared,
    }


def measure_sparse_core(topology: str, dims) -> dict | None:
    """The SparseCore rows of the report, or None if the chip has no SparseCore."""
    chip = topology.split(":")[0]
    sc = _sparse_core(chip)
    if sc is None:
        return None
    topo = _aot.topology(topology)
    mesh = Mesh(np.array(topo.devices[:1]), ("d",))
    one = NamedSharding(mesh, P())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
    quantum = sc.num_cores * sc.num_subcores * WINDOW
    n = -(-ROWS // quantum) * quantum
    ids = spec((n,), jnp.int32)
    out = {
        "num_cores": sc.num_cores,
        "num_subcores": sc.num_subcores,
        "num_lanes": sc.num_lanes,
        "dma_granule_bytes": sc.dma_granule_size_bytes,
        "rows": n,
        "dims": [],
    }
    with jax.set_mesh(mesh):  # Lowering reads the chip from the mesh.
        for dim in dims:
            shard = SHARD_ROWS * dim * 4
            flat, tiled = (
                spec((SHARD_ROWS * dim,), jnp.float32),
                spec((SHARD_ROWS, dim), jnp.float32),
            )
            gather = functools.partial(_sc_gather, sc=sc, dim=dim)
            update = functools.partial(_sc_adagrad, sc=sc, dim=dim)
            row = {"dim": dim, "row_bytes": 4 * dim}
            row["gather_flat"] = _sc_result(
                *_compiled(gather, (flat, ids)), shard, n * (2 * dim * 4 + 4)
            )
            row["gather_2d"] = _sc_result(
                *_compiled(gather, (tiled, ids)), shard, n * (2 * dim * 4 + 4)
            )
            row["adagrad_flat"] = _sc_result(
                *_compiled(update, (flat, flat, ids, spec((n, dim), jnp.float32)), donate=(0, 1)),
                shard,
                n * (5 * dim * 4 + 4),
            )
            out["dims"].append(row)
        _, sqrt_error = _compiled(
            functools.partial(_sc_sqrt, sc=sc), (spec((sc.num_lanes,), jnp.float32),)
        )
        # The rows of a table in host memory (`placement="host"`), read by the SparseCores.
        on_host = NamedSharding(mesh, P(), memory_kind="pinned_host")
        host_flat = jax.ShapeDtypeStruct((SHARD_ROWS * 128,), jnp.float32, sharding=on_host)
        gather = functools.partial(_sc_gather, sc=sc, dim=128)
        _, host_error = _compiled(gather, (host_flat, ids))
    out["gather_from_host"] = host_error or "compiles"
    out["sqrt_on_vector_subcore"] = sqrt_error or "compiles"
    out["interpret_indirect_dma"] = _interpret_sc_gather(chip, sc)
    return out


def _interpret_sc_gather(chip: str, sc) -> str:
    """Whether Pallas' interpreter runs the indirect-DMA gather on the CPU (it needs the
    chip's SparseCore description, given here, as there is no TPU to ask)."""
    from jax._src.pallas.mosaic import sc_core

    real = sc_core.get_sparse_core_info
    sc_core.get_sparse_core_info = lambda: sc
    quiet = logging.getLogger("jax._src.callback")  # It logs the callback's traceback.
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        rng = np.random.default_rng(0)
        n = sc.num_cores * sc.num_subcores * WINDOW
        table = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, 64, n), jnp.int32)
        got = _sc_gather(table, ids, sc=sc, dim=16, interpret=pltpu.InterpretParams())
        return (
            "matches table[ids]" if bool(jnp.array_equal(got, table[ids])) else "runs, wrong result"
        )
    except Exception as e:
        return _first_line(e)
    finally:
        sc_core.get_sparse_core_info = real
        quiet.setLevel(level)


def measure(topology: str, dims=(32, 64, 128)) -> dict:
    topo = _aot.topology(topology)
    mesh = Mesh(np.array(topo.devices[:1]), ("d",))
    one = NamedSharding(mesh, P())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
    ids, out = spec((ROWS,), jnp.int32), {"topology": topology, "rows": ROWS, "xla": []}
    for dim in dims:
        table, upd = spec((SHARD_ROWS, dim), jnp.float32), spec((ROWS, dim), jnp.float32)
        gather, gather_error = _compile(lambda t, i: t[i], (table, ids))
        scatter, scatter_error = _compile(
            lambda t, i, u: t.at[i].set(u), (table, ids, upd), donate=(0,)
        )
        assert gather is not None and scatter is not None, (gather_error, scatter_error)
        tiled = Format(Layout((0, 1), ((1, 128),)), one)
        _, tiled_error = _compile(lambda t, i: t[i], (table, ids), in_shardings=(tiled, one))
        out["xla"].append(
            {
                "dim": dim,
                "row_bytes": 4 * dim,
                "gather_per_row": gather / ROWS,
                "scatter_per_row": scatter / ROWS,
                "one_row_tiles": tiled_error or "compiles",
            }
        )
    # Pallas: lowering needs the target chip, which the abstract mesh names.
    with jax.set_mesh(mesh):
        table = spec((SHARD_ROWS, 128), jnp.float32)
        full, full_error = _compile(functools.partial(_dma_rows, lanes=128), (ids, table))
        _, narrow_error = _compile(functools.partial(_dma_rows, lanes=32), (ids, table))
    rng = np.random.default_rng(0)
    small = jnp.asarray(rng.standard_normal((1_000, 128)), jnp.float32)
    some = jnp.asarray(rng.integers(0, 1_000, 4 * BLOCK), jnp.int32)
    got = jax.jit(functools.partial(_dma_rows, lanes=128, interpret=True))(some, small)
    out["pallas"] = {
        "row_dma_128_lanes": full_error or "compiles",
        "declared_bytes_per_row": None if full is None else full / ROWS,
        "interpret_matches_take": bool(jnp.array_equal(got, small[some])),
        "row_dma_32_lanes": narrow_error or "compiles",
    }
    out["sparse_core"] = measure_sparse_core(topology, dims)
    out["host_dma"] = measure_host_dma(topology)
    return out


# ---------------------------------------------------------------- host memory by DMA

HOST_UNITS, HOST_MOVED = 1 << 16, 4_096  # (8, W) units per device's host shard, units moved.


def _host_dma(table, units, rows, count, *, write: bool):
    """One device's part: `write` copies units[i] into table[rows[i]] for i < count[0] (the
    table aliased, returned), else reads table[rows[i]] into a fresh HBM array; one DMA per
    unit, all started, then all waited for. `count` is data: the size is known only when the
    kernel runs."""
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)

    def kernel(copy_of):
        """The kernel: `copy_of(refs, i, row, sem)` is the DMA of unit i at `row`; all of
        the first count[0] started, then all waited for."""

        def body(rows_ref, count_ref, *refs):
            *refs, sem = refs
            each = lambda fn: jax.lax.fori_loop(0, count_ref[0], lambda i, c: (fn(i), c)[1], 0)
            each(lambda i: copy_of(refs, i, rows_ref[i], sem).start())
            each(lambda i: copy_of(refs, 0, 0, sem).wait())

        return body

    if write:  # refs: the units, the table given (aliased), the table written.
        return pl.pallas_call(
            kernel(lambda r, i, row, sem: pltpu.make_async_copy(r[0].at[i], r[2].at[row], sem)),
            out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
            in_specs=[smem, smem, pl.BlockSpec(memory_space=pl.ANY)]
            + [pl.BlockSpec(memory_space=pl.HOST)],
            out_specs=pl.BlockSpec(memory_space=pl.HOST),
            scratch_shapes=[pltpu.SemaphoreType.DMA],
            input_output_aliases={3: 0},
        )(rows, count, units, table)
    return pl.pallas_call(  # refs: the table, the units read.
        kernel(lambda r, i, row, sem: pltpu.make_async_copy(r[0].at[row], r[1].at[i], sem)),
        out_shape=jax.ShapeDtypeStruct(units.shape, units.dtype),
        in_specs=[smem, smem, pl.BlockSpec(memory_space=pl.HOST)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA],
    )(rows, count, table)


def _host_read_then_dma_write(table, units, rows, count):
    """The update's pattern: the units read by a host computation (as `_placement.gather`
    reads host tables), changed on the device, written back by the kernel."""

    @compute_on("device_host")
    @jax.jit
    def read(table, at):
        return table.at[at].get(mode="promise_in_bounds")

    at = jax.device_put(jnp.clip(rows, 0, table.shape[0] - 1), jax.memory.Space.Host)
    read_units = jax.device_put(read(table, at), jax.memory.Space.Device)
    return _host_dma(table, read_units * 0.5 + units, rows, count, write=True)


def measure_host_dma(topology: str, widths=(128, 256, 512)) -> list[dict]:
    """Per width W and direction: whether the kernel compiles for every device of the
    topology, and for a write whether the host array stays in place (the donated parameter
    aliased to the output, the compiler's host alias bytes its shard's, no host temporary,
    no copy of the table's shape)."""
    topo = _aot.topology(topology)
    mesh = Mesh(np.array(topo.devices), ("d",))
    n = mesh.devices.size
    host = NamedSharding(mesh, P("d"), memory_kind="pinned_host")
    dev = NamedSharding(mesh, P("d"))
    out = []
    for width in widths:
        table = jax.ShapeDtypeStruct((n * HOST_UNITS, 8, width), jnp.float32, sharding=host)
        units = jax.ShapeDtypeStruct((n * HOST_MOVED, 8, width), jnp.float32, sharding=dev)
        rows = jax.ShapeDtypeStruct((n * HOST_MOVED,), jnp.int32, sharding=dev)
        count = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=dev)
        for write in (True, False, "after a host read"):
            local = (
                _host_read_then_dma_write
                if write == "after a host read"
                else functools.partial(_host_dma, write=write)
            )
            spec = P("d")
            fn = jax.shard_map(
                lambda t, u, r, c, local=local: local(t, u, r, c),
                mesh=mesh,
                in_specs=(spec,) * 4,
                out_specs=spec,
                check_vma=False,
            )
            compiled, error = _compiled(
                fn,
                (table, units, rows, count),
                donate=(0,) if write else (),
                out_shardings=host if write else dev,
            )
            r = {"width": width, "unit_bytes": 8 * width * 4, "write": write}
            r["compiles"] = error or "compiles"
            if compiled is not None:
                mem = compiled.memory_analysis()
                hlo = compiled.as_text() or ""
                shape = f"f32[{HOST_UNITS},8,{width}]"
                copies = [
                    x.strip()[:120]
                    for x in hlo.splitlines()
                    if shape in x and re.search(r"= \S+ copy(-start)?\(", x)
                ]
                r["host_temp_bytes"] = int(getattr(mem, "host_temp_size_in_bytes", 0) or 0)
                r["host_alias_bytes"] = int(getattr(mem, "host_alias_size_in_bytes", 0) or 0)
                r["host_shard_bytes"] = HOST_UNITS * 8 * width * 4
                r["table_copies"] = copies
                r["aliased"] = bool(re.search(r"input_output_alias=\{ \{\}: \(0,", hlo))
            out.append(r)
    return out


def report(res: dict) -> str:
    lines = [
        f"{res['topology']}, one device: {res['rows']:,} random rows of a "
        f"({SHARD_ROWS:,}, D) f32 shard",
        "",
        f"{'D':>4s} {'row':>6s} {'XLA gather/row':>15s} {'XLA scatter/row':>16s}  (1, 128) tiles",
    ]
    for r in res["xla"]:
        lines.append(
            f"{r['dim']:>4d} {r['row_bytes']:>5d}B {r['gather_per_row']:>14,.0f}B "
            f"{r['scatter_per_row']:>15,.0f}B  {r['one_row_tiles'][:72]}"
        )
    p = res["pallas"]
    lines += [
        "",
        "Pallas row-DMA kernel (D = 128):",
        f"  compile for TPU: {p['row_dma_128_lanes']}; bytes per row as declared: "
        f"{p['declared_bytes_per_row']}",
        f"  interpret mode on CPU equals table[ids]: {p['interpret_matches_take']}",
        f"  DMA of a 32-lane slice (a packed D=32 row): {p['row_dma_32_lanes']}",
    ]
    lines += ["", _host_report(res["host_dma"])]
    sc = res.get("sparse_core")
    if sc is None:
        return "\n".join(lines + ["", "No SparseCore on this chip."])
    mb = lambda x: f"{x / 1e6:,.1f} MB"
    lines += [
        "",
        f"SparseCore: {sc['num_cores']} cores x {sc['num_subcores']} vector subcores "
        f"of {sc['num_lanes']} lanes, DMA granule {sc['dma_granule_bytes']} B; "
        f"{sc['rows']:,} rows",
    ]
    for r in sc["dims"]:
        lines.append(f"  D={r['dim']} ({r['row_bytes']} B rows):")
        for key, label in (
            ("gather_flat", "gather, flat (S*D,) shard"),
            ("gather_2d", "gather, (S, D) shard"),
            ("adagrad_flat", "Adagrad in place, flat"),
        ):
            x = r[key]
            if x["compiles"] != "compiles":
                lines.append(f"    {label:28s} {x['compiles'][:110]}")
                continue
            ops = ", ".join(x["table_sized_ops"]) or "none"
            lines.append(
                f"    {label:28s} compiles; temp {mb(x['temp_bytes'])}; "
                f"table-sized ops: {ops}; bytes accessed {mb(x['bytes_accessed'])}"
                f" (kernel declares {mb(x['declared_bytes'])})"
            )
    lines += [
        f"  sqrt on a vector subcore: {sc['sqrt_on_vector_subcore'][:110]}",
        f"  gather from a pinned_host shard (D=128): {sc['gather_from_host'][:110]}",
        f"  interpret mode, indirect DMA on CPU: {sc['interpret_indirect_dma'][:110]}",
    ]
    return "\n".join(lines)


def _host_report(rows: list[dict]) -> str:
    lines = [
        f"Pallas DMAs to and from a pinned_host array ({HOST_UNITS:,} (8, W) f32 units a "
        f"device, {HOST_MOVED:,} moved, the count read at run time):",
    ]
    for r in rows:
        what = {True: "write", False: "read"}.get(r["write"], "write after a host read")
        head = f"  W={r['width']:<4d} ({r['unit_bytes']:>6,d} B units) {what:23s}"
        if r["compiles"] != "compiles":
            lines.append(f"{head} {r['compiles'][:100]}")
            continue
        place = ""
        if r["write"]:
            in_place = (
                r["aliased"]
                and r["host_alias_bytes"] == r["host_shard_bytes"]
                and not r["table_copies"]
                and not r["host_temp_bytes"]
            )
            place = "; in place" if in_place else f"; NOT in place: {r}"
        lines.append(f"{head} compiles{place}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = p.parse_args(argv)
    res = measure(a.topology)
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
