"""Per-chip cost of the train step as the slice grows at a fixed per-chip batch (weak scaling).

    python benchmarks/tpu_scaling.py                         # v5p slices of 4, 64, 256, 512 chips
    python benchmarks/tpu_scaling.py --slices v5p:2x2x1 v5p:4x4x4 --routing owner gather
    python benchmarks/tpu_scaling.py --json out.json

No TPU needed: libtpu compiles the step from shapes (docs/design.md, "Compiling for TPUs").
Setup: 8 tables x 1,000,000 rows x D=64, sum combiner, L=20 ids per example, Adagrad,
1,024 examples per chip (global batch 1,024 x chips); the train step is lookup -> gradient ->
apply_gradients (`_aot.train_step_fn`). For each slice and routing ("gather": every chip
all-gathers the global batch's ids; "owner": ids travel to their rows' owners; "auto": what
`Embedding` picks) it prints, per chip, the compiler's bytes accessed, the largest sort
(elements), the largest collective and the temporaries, and each one's ratio to the
smallest slice of the same routing. The compiler charges a loop's body once, so for owner
routing the figures are one exchange round's; "rounds" is how many a step of W1's ids
(workloads.py's distribution) takes, from `Embedding.id_counts` (1: the figures are the step's).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

import jax_tpu_embed as jte  # noqa: E402
from jax_tpu_embed import _aot  # noqa: E402

TABLES, V, D, L, PER_CHIP = 8, 1_000_000, 64, 20, 1024
SLICES = ("v5p:2x2x1", "v5p:4x4x4", "v5p:4x8x8", "v5p:8x8x8")
_SORT_RE = re.compile(r"=\s*\(?\s*\w+\[([\d,]*)\][^=]*?\bsort\(")


def largest_sort(hlo: str) -> int:
    """Elements of the largest sort in an HLO module text (its first operand's size)."""
    best = 0
    for line in hlo.splitlines():
        m = _SORT_RE.search(line)
        if m:
            n = 1
            for x in m.group(1).split(","):
                if x:
                    n *= int(x)
            best = max(best, n)
    return best


def expected_unique(draws: int) -> float:
    """E[distinct rows] of one table among `draws` ids of W1's power law (tpu_bytes.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tpu_bytes import expected_unique_rows

    return expected_unique_rows(V, draws)


def embedding(topo: _aot.Topology, routing: str, sized: bool, stacking: bool) -> jte.Embedding:
    tables = [jte.TableConfig(V, D, combiner="sum", name=f"t{i}") for i in range(TABLES)]
    spec = jte.EmbeddingSpec(
        {f"t{i}": jte.FeatureConfig(t) for i, t in enumerate(tables)},
        jte.Adagrad(learning_rate=0.05),
    )
    kw = {}
    if sized:
        # As a user sizes them from `id_counts` on real batches: with W1's power law a
        # device's 20,480 ids per table hold E[U] distinct rows; owner routing sends up
        # to 1.5 E[U] / N per owner and round, the all-gather path's kernels plan E[U] / N
        # distinct rows per shard (their cost estimate only).
        n = len(topo.devices)
        u = expected_unique(PER_CHIP * (n // topo.chips) * L)
        if routing == "gather":
            kw["max_unique_ids_per_shard"] = int(np.ceil(expected_unique(PER_CHIP * n * L) / n))
        else:
            kw["max_ids_per_shard"] = int(np.ceil(1.5 * u))
            kw["max_unique_ids_per_shard"] = int(np.ceil(u))
    return jte.Embedding(spec, _aot.mesh(topo), routing=routing, stacking=stacking, **kw)


def w1_batch(batch: int) -> dict:
    """One global batch of W1's ids (workloads.py: power-law ranks, a fixed permutation per
    table), for `Embedding.id_counts`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import workloads

    cdf = workloads.power_law_cdf(V)
    out = {}
    for t in range(TABLES):
        perm = np.random.default_rng([0, 1, t]).permutation(V)
        ranks = workloads.sample_ranks(cdf, (batch, L), np.random.default_rng([0, 2, t]))
        out[f"t{t}"] = perm[ranks].astype(np.int32)
    return out


def measure(slice_name: str, routing: str, sized: bool, stacking: bool = True) -> dict:
    topo = _aot.topology(slice_name)
    emb = embedding(topo, routing, sized, stacking)
    batch = PER_CHIP * topo.chips
    r = _aot.compile_train_step(emb, batch, L, topo=topo)
    # The compiler charges a loop's body once: the figures are one exchange round's. How
    # many rounds a step of W1's ids takes (1: the figures are the step's).
    rounds = 1
    if "owner" in emb.routing.values():
        rounds = max(c["passes"] for c in emb.id_counts(w1_batch(batch)).values())
    biggest = max(r.collectives, key=lambda c: c.bytes, default=None)
    return {
        "slice": slice_name,
        "chips": topo.chips,
        "devices": len(topo.devices),
        "global_batch": batch,
        "routing": routing,
        "stacks": len(emb.stacks),
        "sized": sized,
        "chosen": sorted(set(emb.routing.values())),
        "backends": sorted(set(emb.backends.values())),
        "bytes_accessed_per_device": r.bytes_accessed,
        "largest_sort": largest_sort(r.hlo),
        "largest_collective": str(biggest) if biggest else "",
        "largest_collective_bytes": biggest.bytes if biggest else 0,
        "collective_bytes": sum(c.bytes for c in r.collectives),
        "collectives": len(r.collectives),
        "temp_bytes_per_device": r.temp_bytes,
        "fits": r.fits,
        "compile_seconds": round(r.compile_seconds, 1),
        "rounds": rounds,
    }


def report(results: list[dict]) -> str:
    mb = lambda x: f"{x / 1e6:,.1f} MB"
    lines = [
        f"{TABLES} tables x {V:,} rows x D={D}, sum, L={L}, Adagrad, {PER_CHIP:,} examples "
        f"per chip; per chip, ratio to the smallest slice of the same routing",
        "",
        f"{'slice':<11s} {'chips':>5s} {'routing':>8s} {'stacks':>6s} {'bytes accessed':>15s} "
        f"{'x':>6s} {'largest sort':>13s} {'x':>6s} {'largest collective':>19s} "
        f"{'collectives':>11s} {'temps':>10s} {'compile':>8s} {'rounds':>6s}",
    ]
    first: dict[tuple, dict] = {}
    for r in results:
        base = first.setdefault((r["routing"], r["stacks"]), r)

        def ratio(k, r=r, base=base):
            return r[k] / base[k] if base[k] else float("nan")

        lines.append(
            f"{r['slice']:<11s} {r['chips']:>5d} {r['routing']:>8s} {r['stacks']:>6d} "
            f"{mb(r['bytes_accessed_per_device']):>15s} "
            f"{ratio('bytes_accessed_per_device'):>5.1f}x "
            f"{r['largest_sort']:>13,d} {ratio('largest_sort'):>5.1f}x "
            f"{mb(r['largest_collective_bytes']):>19s} {r['collectives']:>11d} "
            f"{mb(r['temp_bytes_per_device']):>10s} "
            f"{r['compile_seconds']:>7.1f}s {r['rounds']:>6d}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--slices", nargs="+", default=list(SLICES))
    parser.add_argument("--routing", nargs="+", default=["owner", "gather"])
    parser.add_argument(
        "--unsized",
        action="store_true",
        help="default capacities (2 m / N per owner and round) instead of sizing them "
        "from the expected distinct rows of W1's id distribution",
    )
    parser.add_argument(
        "--stacking",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="stack the 8 tables into one array (Embedding(stacking=True), the default) "
        "and/or keep one array per table",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = []
    for stacking in args.stacking:
        for routing in args.routing:
            for s in args.slices:
                results.append(measure(s, routing, not args.unsized, stacking == "on"))
                print(
                    f"  {s} {routing} stacking {stacking}: "
                    f"{results[-1]['bytes_accessed_per_device'] / 1e6:,.1f} MB",
                    file=sys.stderr,
                    flush=True,
                )
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
