"""Benchmark CLI: run engines on a workload (or a sweep), print a table, write JSON and PNG.

Examples:
    python benchmarks/run.py --workload W0 --engines all --steps 20 --out bench_results/
    python benchmarks/run.py --workload W1 --engines baselines --steps 20
    python benchmarks/run.py --workload W1t1 --engines fbgemm_exact_adagrad,jte_adagrad
    python benchmarks/run.py --workload W0 --sweep vocab            # V = 1e5, 1e6, 1e7
    python benchmarks/run.py --workload W1t1 --sweep dim --values 16,64,256

Engines: all | baselines | jte | comma-separated names (see benchmarks/engines.py). Every
engine runs in its own subprocess; ratios are only computed against baselines of the same run.
A configuration whose tables + slots would not fit in the available memory is skipped with a
message (e.g. W0 at V=1e7: 8 tables × 1e7 × 32 floats × 2 = 20 GB).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engines as engines_mod  # noqa: E402
import harness  # noqa: E402
import workloads as workloads_mod  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="jax_tpu_embed benchmark harness",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--workload",
        default="W0",
        help="W0, W0v10, W1, W1t1, W1t1v10 (configs/bench_<name>.yaml) or a YAML path",
    )
    p.add_argument(
        "--engines",
        default="all",
        help=f"all | baselines | jte | comma list of {list(engines_mod.ENGINES)}",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per engine (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first step")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="time budget of the timed loop per engine; stops early but never "
        "before --min-steps (the result says how many steps were timed)",
    )
    p.add_argument("--min-steps", type=int, default=5)
    p.add_argument(
        "--sweep",
        choices=["vocab", "dim"],
        default=None,
        help="vocabulary sweep (default 1e5,1e6,1e7) or dim sweep (16..256)",
    )
    p.add_argument(
        "--values",
        default=None,
        help="comma-separated sweep values, e.g. 100000,1000000 or 16,64,256",
    )
    p.add_argument("--vocab", type=float, default=None, help="override V of the workload")
    p.add_argument("--dim", type=int, default=None, help="override D of the workload")
    p.add_argument("--lr", type=float, default=engines_mod.LEARNING_RATE)
    p.add_argument("--timeout", type=float, default=1800, help="per-engine subprocess timeout (s)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over all engines (interleaved); each engine keeps its best "
        "round (lowest median), all round medians are in the JSON",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        help="before each engine, wait up to this many seconds for other processes "
        "to go quiet (< 0.3 cores); the machine may be shared",
    )
    p.add_argument(
        "--omp-wait-policy",
        default="passive",
        choices=["passive", "active", "default"],
        help="OMP_WAIT_POLICY of every engine's process (torch/FBGEMM use OpenMP). "
        "passive (default): idle OpenMP threads sleep instead of spinning; on a "
        "2-core machine shared with other work, spinning threads made the "
        "torch/FBGEMM steps 10-25x slower. default: leave the environment's",
    )
    p.add_argument("--out", default="bench_results/", help="output directory for JSON and PNG")
    p.add_argument("--tag", default=None, help="file name stem (default: workload[_sweep])")
    a = p.parse_args(argv)

    names = engines_mod.resolve(a.engines)
    if a.sweep:
        values = [int(float(v)) for v in a.values.split(",")] if a.values else None
        cfgs = workloads_mod.sweep_configs(a.workload, a.sweep, values)
    else:
        cfgs = [
            workloads_mod.load_config(
                a.workload, vocabulary_size=int(a.vocab) if a.vocab else None, dim=a.dim
            )
        ]
    options = {
        "steps": a.steps,
        "warmup": a.warmup,
        "max_seconds": a.max_seconds,
        "min_steps": a.min_steps,
        "engine_kwargs": {"learning_rate": a.lr},
    }
    env_overrides = (
        {} if a.omp_wait_policy == "default" else {"OMP_WAIT_POLICY": a.omp_wait_policy.upper()}
    )
    print(f"engines: {', '.join(names)}")
    print(
        f"workloads: {', '.join(c.name for c in cfgs)}; {a.steps} timed steps, {a.warmup} warm-up"
    )
    results = harness.run_suite(
        cfgs,
        names,
        options=options,
        timeout=a.timeout,
        repeat=a.repeat,
        quiet_wait=a.quiet_wait,
        env_overrides=env_overrides,
    )

    print(harness.format_table(results))
    if a.sweep:
        print(harness.format_sweep(results, a.sweep))
    base = cfgs[0].name.split("@")[0]
    if a.tag:
        tag = a.tag
    elif a.sweep:
        tag = f"{base}_sweep_{a.sweep}"
    else:
        tag = cfgs[0].name.replace("@", "_").replace("=", "").replace(",", "_")
    json_path = os.path.join(a.out, f"{tag}.json")
    png_path = os.path.join(a.out, f"{tag}.png")
    harness.write_json(
        results,
        json_path,
        meta={
            "argv": sys.argv[1:] if argv is None else argv,
            "options": options,
            "sweep": a.sweep,
            "repeat": a.repeat,
            "env_overrides": env_overrides,
        },
    )
    title = (f"{base} {a.sweep} sweep" if a.sweep else cfgs[0].name) + " — ms/step, lower is better"
    png = harness.plot(results, png_path, title=title, sweep=a.sweep)
    print(f"\nwrote {json_path}" + (f" and {png}" if png else ""))
    return 0 if any(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
