"""Compiler-estimated HBM traffic of the W1 train step on a TPU slice, against essential bytes.

    python benchmarks/tpu_bytes.py                      # W1 on v5p:2x2x1 at D = 32, 64, 128
    python benchmarks/tpu_bytes.py --dims 64 --topology v5e:2x2 --json out.json
    python benchmarks/tpu_bytes.py --dims 32,64,128,256 --dtype bfloat16  # bf16 tables

No TPU needed: libtpu compiles the step from shapes (shared/TPU_AOT.md). For each dim it prints
the compiler's "bytes accessed" per step (cost_analysis of the per-device program, times the
device count) next to the essential bytes of WORKLOADS.md,

    essential = Σ_t U_t·D·(s + 4)·2 + T·B·L·4

(read and write each unique row, s bytes a value: 4, or 2 for --dtype bfloat16, and its
float32 Adagrad accumulator row; the int32 ids, counted per
table as benchmarks/workloads.py does, which reproduces WORKLOADS.md's totals), their ratio
(target <= 3x), per-device temporaries and every collective (op, shape, bytes per device).

U_t, the unique rows of one table per step, is the expectation under W1's id distribution:
P(rank r) ∝ (r+1)^-1.05 on [0, V), B·L draws, E[U] = Σ_r 1 - (1 - p_r)^(B·L); the permutation
of ranks to rows does not change it. (WORKLOADS.md measured ~207,000 over 8 tables.)

The total is split into the fused kernels' row DMAs (`row_dma_bytes`: physical rows, 512
bytes on TPU whatever D <= 128) and everything else (sort, collectives, activations, pair
lists); and, compiled apart, the lookup alone and `apply_gradients` alone. What single row
reads and writes cost (XLA, Pallas TensorCore and SparseCore kernels) is
benchmarks/tpu_row_access.py's subject.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from typing import Literal  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_tpu_embed as jte  # noqa: E402
from jax_tpu_embed import _aot  # noqa: E402

# W1 of shared/WORKLOADS.md.
TABLES, V, B, L, EXPONENT = 8, 1_000_000, 4096, 20, 1.05


def expected_unique_rows(
    vocabulary_size: int = V, draws: int = B * L, exponent: float = EXPONENT
) -> float:
    """E[distinct ranks] among `draws` i.i.d. draws with P(r) ∝ (r+1)^-exponent on [0, V)."""
    p = np.arange(1, vocabulary_size + 1, dtype=np.float64) ** -exponent
    p /= p.sum()
    return float(np.sum(-np.expm1(draws * np.log1p(-p))))


def essential_bytes(dim: int, unique_per_table: float, dtype: str = "float32") -> float:
    value = jnp.dtype(dtype).itemsize
    return TABLES * (unique_per_table * dim * (value + 4) * 2 + B * L * 4)


def _embedding(
    topo: _aot.Topology, dim: int, max_unique: int | None = None, dtype: str = "float32"
) -> jte.Embedding:
    tables = [
        jte.TableConfig(V, dim, combiner="sum", name=f"t{i}", dtype=dtype) for i in range(TABLES)
    ]
    spec = jte.EmbeddingSpec(
        {f"t{i}": jte.FeatureConfig(t) for i, t in enumerate(tables)},
        jte.Adagrad(learning_rate=0.05),
    )
    return jte.Embedding(spec, _aot.mesh(topo), max_unique_ids_per_shard=max_unique)


def auto_max_unique(num_shards: int) -> int:
    """The expected distinct rows one shard owns per table and step, E[U_t] / N: what a user
    sets max_unique_ids_per_shard to from their data (Embedding.id_counts). The fused TPU
    kernels walk every owned pair whatever it says; it sizes their cost estimates only, so
    the compiler's "bytes accessed" then holds their expected traffic."""
    return int(np.ceil(expected_unique_rows() / num_shards))


def row_dma_bytes(emb: jte.Embedding) -> float:
    """Per device and step: the bytes the fused kernels' row DMAs move, as their cost
    estimates declare them (the planned distinct rows of each table: one physical row of
    the table read by the lookup, one of the table and of each slot read and written by
    the update). The rest of "bytes accessed" is the sort, the collectives, the
    activations and the pair lists."""
    from jax_tpu_embed import _pallas, _streams

    total = 0.0
    for plan in emb.table_plans.values():
        if not plan.backend.name.startswith("pallas"):
            continue
        storage = plan.storage
        _, distinct = _streams.planned(plan, B * L, emb.num_shards)
        table = _pallas._row_bytes(storage.packing, plan.config.dtype)
        slots = sum(
            _pallas._row_bytes(storage.slot_packing(s), jnp.float32) for s in storage.stored
        )  # Riders travel in the table's row.
        total += distinct * (table + 2 * (table + slots))
    return total


def _cost(compiled) -> tuple[float, int]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["bytes accessed"]), int(compiled.memory_analysis().temp_size_in_bytes)


def _parts(emb: jte.Embedding) -> dict[str, tuple[float, int]]:
    """{part: (bytes accessed per device, temp bytes per device)}."""
    state = emb.abstract_state()
    features = _aot.abstract_features(emb, B, L)
    batch = NamedSharding(emb.mesh, P(emb.axis))
    grads = {}
    for f in emb.feature_plans:
        table = f.config.table
        assert isinstance(table, jte.TableConfig)  # So in every EmbeddingSpec.
        grads[f.path] = jax.ShapeDtypeStruct((B, table.dim), jnp.float32, sharding=batch)
    out = {}
    out["lookup only"] = _cost(jax.jit(emb.lookup).lower(state, features).compile())
    out["apply_gradients only"] = _cost(
        jax.jit(emb.apply_gradients, donate_argnums=0).lower(state, features, grads).compile()
    )

    return out


def measure(
    topology: str,
    dims,
    parts: bool = True,
    max_unique: int | Literal["auto"] | None = "auto",
    dtype: str = "float32",
) -> list[dict]:
    """max_unique: max_unique_ids_per_shard; "auto" (auto_max_unique) or None or an int."""
    topo = _aot.topology(topology)
    n = len(topo.devices)
    unique = expected_unique_rows()
    if max_unique == "auto":
        max_unique = auto_max_unique(n)
    results = []
    for dim in dims:
        emb = _embedding(topo, dim, max_unique, dtype)
        r = _aot.compile_train_step(emb, B, L, topo=topo)
        essential = essential_bytes(dim, unique, dtype)
        res = {
            "topology": topology,
            "dtype": dtype,
            "devices": n,
            "dim": dim,
            "tables": TABLES,
            "vocabulary_size": V,
            "batch": B,
            "ids_per_example": L,
            "unique_rows_per_table": round(unique),
            "max_unique_ids_per_shard": max_unique,
            "essential_bytes": essential,
            "bytes_accessed_per_device": r.bytes_accessed,
            "bytes_accessed_total": r.bytes_accessed * n,
            "ratio": r.bytes_accessed * n / essential,
            "row_dma_bytes_total": row_dma_bytes(emb) * n,
            "temp_bytes_per_device": r.temp_bytes,
            "largest_temps": [str(t) for t in r.largest_temps[:3]],
            "copies": r.copies(),
            "collectives": [
                {"op": c.op, "shape": c.shape, "bytes": c.bytes} for c in r.collectives
            ],
            "compile_seconds": round(r.compile_seconds, 1),
        }
        if parts:
            # Per-device programs, times the device count.
            res["parts"] = {
                k: {"bytes_accessed_total": b * n, "temp_bytes_per_device": t}
                for k, (b, t) in _parts(emb).items()
            }
        results.append(res)
    return results


def report(results: list[dict]) -> str:
    mb = lambda x: f"{x / 1e6:,.1f} MB"
    first = results[0]
    lines = [
        f"W1 ({first['tables']} {first['dtype']} tables x {first['vocabulary_size']:,} rows, "
        f"B={B}, L={L}, Adagrad) on {first['topology']} ({first['devices']} devices); "
        f"expected unique rows per table and step U_t = {first['unique_rows_per_table']:,} "
        f"({first['tables'] * first['unique_rows_per_table']:,} in all); "
        f"max_unique_ids_per_shard={first['max_unique_ids_per_shard']}",
        "",
    ]
    lines.append(
        f"{'D':>4s} {'essential':>12s} {'bytes accessed':>15s} {'ratio':>7s} "
        f"{'target':>7s} {'temp/device':>13s}"
    )
    for r in results:
        lines.append(
            f"{r['dim']:>4d} {mb(r['essential_bytes']):>12s} "
            f"{mb(r['bytes_accessed_total']):>15s} {r['ratio']:>6.1f}x {'3.0x':>7s} "
            f"{mb(r['temp_bytes_per_device']):>13s}"
        )
    for r in results:
        rows, rest = r["row_dma_bytes_total"], r["bytes_accessed_total"] - r["row_dma_bytes_total"]
        lines += [
            "",
            f"D={r['dim']}: compiled in {r['compile_seconds']} s; the kernels' row "
            f"DMAs {mb(rows)} ({rows / r['essential_bytes']:.1f}x essential), everything "
            f"else {mb(rest)} ({rest / r['essential_bytes']:.1f}x)",
        ]
        for name, part in r.get("parts", {}).items():
            lines.append(
                f"  {name:24s} bytes accessed {mb(part['bytes_accessed_total']):>12s}"
                f" ({part['bytes_accessed_total'] / r['essential_bytes']:.1f}x "
                f"essential), temp/device {mb(part['temp_bytes_per_device'])}"
            )
        lines.append(f"  largest temporaries: {'; '.join(r['largest_temps']) or 'none'}")
        if r["copies"]:
            lines.append(f"  copies >= 1 MiB: {', '.join(r['copies'])}")
        counts: dict = {}
        for c in r["collectives"]:
            key = (c["op"], c["shape"], c["bytes"])
            counts[key] = counts.get(key, 0) + 1
        lines.append(
            f"  collectives per device ({len(r['collectives'])}, "
            f"{mb(sum(c['bytes'] for c in r['collectives']))} in all):"
        )
        for (op, shape, nbytes), k in sorted(counts.items(), key=lambda kv: -kv[0][2]):
            lines.append(f"    {k:3d} x {op:15s} {shape:18s} {nbytes:>12,} B")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--dims", default="32,64,128", help="comma-separated dims")
    p.add_argument("--no-parts", action="store_true", help="skip the lookup/update split")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--dtype", default="float32", help="the tables' dtype: float32 or bfloat16")
    p.add_argument(
        "--max-unique-ids-per-shard",
        default="auto",
        help='"auto" (the expected distinct rows per shard), "none" (the '
        "default of Embedding: max_ids_per_shard) or an int",
    )
    a = p.parse_args(argv)
    mu = a.max_unique_ids_per_shard
    mu = None if mu == "none" else mu if mu == "auto" else int(mu)
    dims = [int(d) for d in a.dims.split(",")]
    results = measure(a.topology, dims, not a.no_parts, mu, a.dtype)
    print(report(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
