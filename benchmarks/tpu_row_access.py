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
  physical row) compiles.

These are the facts behind README's "what stands between W1 and 3x essential".
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_tpu_embed import _tpu  # noqa: E402

SHARD_ROWS, ROWS, BLOCK = 250_000, 6_400, 64


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:300]


def _compile(fn, args, in_shardings=None, donate=()):
    """(bytes accessed, None) or (None, error line)."""
    try:
        c = jax.jit(fn, in_shardings=in_shardings, donate_argnums=donate).lower(*args).compile()
    except Exception as e:  # The compiler's errors are the result here.
        return None, _first_line(e)
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("bytes accessed", 0.0)), None


def _dma_rows(ids, table, *, lanes: int, interpret: bool = False):
    """out[j] = lanes [0, lanes) of table[ids[j]], one DMA per row, BLOCK rows per step."""
    width = table.shape[1]

    def kernel(ids_ref, table_hbm, out_ref, sem):
        base = pl.program_id(0) * BLOCK

        def copy(j, row):
            return pltpu.make_async_copy(table_hbm.at[pl.ds(row, 1), pl.ds(0, lanes)],
                                         out_ref.at[pl.ds(j, 1), pl.ds(0, lanes)], sem)

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
            num_scalar_prefetch=1, grid=(n // BLOCK,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((BLOCK, width), lambda i, ids: (i, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())]),
        out_shape=jax.ShapeDtypeStruct((n, width), table.dtype),
        # Bytes the DMAs read plus the output written: what the kernel moves.
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=n * (lanes + width) * 4),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(ids, table)


def measure(topology: str, dims=(32, 64, 128)) -> dict:
    topo = _tpu.topology(topology)
    mesh = Mesh(np.array(topo.devices[:1]), ("d",))
    one = NamedSharding(mesh, P())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
    ids, out = spec((ROWS,), jnp.int32), {"topology": topology, "rows": ROWS, "xla": []}
    for dim in dims:
        table, upd = spec((SHARD_ROWS, dim), jnp.float32), spec((ROWS, dim), jnp.float32)
        gather, _ = _compile(lambda t, i: t[i], (table, ids))
        scatter, _ = _compile(lambda t, i, u: t.at[i].set(u), (table, ids, upd), donate=(0,))
        tiled = Format(Layout((0, 1), ((1, 128),)), one)
        _, tiled_error = _compile(lambda t, i: t[i], (table, ids), in_shardings=(tiled, one))
        out["xla"].append({"dim": dim, "row_bytes": 4 * dim, "gather_per_row": gather / ROWS,
                           "scatter_per_row": scatter / ROWS,
                           "one_row_tiles": tiled_error or "compiles"})
    # Pallas: lowering needs the target chip, which the abstract mesh names.
    with jax.set_mesh(mesh):
        table = spec((SHARD_ROWS, 128), jnp.float32)
        full, full_error = _compile(functools.partial(_dma_rows, lanes=128), (ids, table))
        _, narrow_error = _compile(functools.partial(_dma_rows, lanes=32), (ids, table))
    rng = np.random.default_rng(0)
    small = jnp.asarray(rng.standard_normal((1_000, 128)), jnp.float32)
    some = jnp.asarray(rng.integers(0, 1_000, 4 * BLOCK), jnp.int32)
    got = jax.jit(functools.partial(_dma_rows, lanes=128, interpret=True))(some, small)
    out["pallas"] = {"row_dma_128_lanes": full_error or "compiles",
                     "declared_bytes_per_row": None if full is None else full / ROWS,
                     "interpret_matches_take": bool(jnp.array_equal(got, small[some])),
                     "row_dma_32_lanes": narrow_error or "compiles"}
    return out


def report(res: dict) -> str:
    lines = [f"{res['topology']}, one device: {res['rows']:,} random rows of a "
             f"({SHARD_ROWS:,}, D) f32 shard", "",
             f"{'D':>4s} {'row':>6s} {'XLA gather/row':>15s} {'XLA scatter/row':>16s}  "
             f"(1, 128) tiles"]
    for r in res["xla"]:
        lines.append(f"{r['dim']:>4d} {r['row_bytes']:>5d}B {r['gather_per_row']:>14,.0f}B "
                     f"{r['scatter_per_row']:>15,.0f}B  {r['one_row_tiles'][:72]}")
    p = res["pallas"]
    lines += ["", "Pallas row-DMA kernel (D = 128):",
              f"  compile for TPU: {p['row_dma_128_lanes']}; bytes per row as declared: "
              f"{p['declared_bytes_per_row']}",
              f"  interpret mode on CPU equals table[ids]: {p['interpret_matches_take']}",
              f"  DMA of a 32-lane slice (a packed D=32 row): {p['row_dma_32_lanes']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
