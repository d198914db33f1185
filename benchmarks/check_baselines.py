"""Checks every engine's training step against a float64 NumPy reference of sparse Adagrad.

A small workload (2 tables, V=1000, D=8, B=16, L=4; power-law ids, so rows repeat within a
batch) starts every engine from the same tables, runs 3 steps (batches 0, 1, 2) and compares the
updated tables and accumulators with a float64 reference:

    G_t[r]  = Σ_{(b,l): ids_t[b,l] = r} R_t[b]           (duplicates summed)
    Adagrad:           a += G²;        w -= lr·G/√a        (a0 = 0.1, no epsilon)
    row-wise Adagrad:  a += mean(G²);  w -= lr·G/(√a + ε)  (a0 = 0.1, ε = 1e-8)

Rows not in the batch have G = 0 and do not change in either form, so the dense reference is
also the sparse one; the check additionally asserts that untouched rows are bit-identical.
Each engine runs in its own subprocess (its own XLA_FLAGS), like the benchmark.

This is a script, not a pytest test:
    python benchmarks/check_baselines.py                    # all engines
    python benchmarks/check_baselines.py dense_jax torch_embeddingbag
Exit status 1 if an available engine disagrees with the reference.

It also reports, for information, how far optax.adagrad with optax's default eps=1e-7 (eps
inside the square root) lands from TF Adagrad: the benchmark configures eps=0 instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import engines as engines_mod  # noqa: E402
import harness  # noqa: E402
import workloads as workloads_mod  # noqa: E402

CHECK_CONFIG = workloads_mod.WorkloadConfig(
    name="check", tables=2, vocabulary_size=1000, dim=8, batch=16, ids_per_example=4
)
LR = 0.1
STEPS = 3
RTOL, ATOL = 2e-5, 2e-6


def initial_tables(cfg) -> list[np.ndarray]:
    rng = np.random.default_rng(123)
    return [
        (0.1 * rng.standard_normal((cfg.vocabulary_size, cfg.dim))).astype(np.float32)
        for _ in range(cfg.tables)
    ]


def reference(
    wl,
    tables0,
    optimizer: str,
    steps: int = STEPS,
    lr: float = LR,
    a0: float = engines_mod.INITIAL_ACCUMULATOR,
    eps: float = engines_mod.ROWWISE_EPS,
):
    c = wl.config
    W = [t.astype(np.float64) for t in tables0]
    A = [
        np.full(
            (c.vocabulary_size, c.dim) if optimizer == "adagrad" else (c.vocabulary_size,),
            a0,
            np.float64,
        )
        for _ in range(c.tables)
    ]
    touched = [np.zeros(c.vocabulary_size, bool) for _ in range(c.tables)]
    for k in range(steps):
        for t in range(c.tables):
            ids = wl.ids[k % wl.num_batches][t]
            R = wl.R[t].astype(np.float64)
            G = np.zeros((c.vocabulary_size, c.dim))
            np.add.at(G, ids.reshape(-1), np.repeat(R, c.ids_per_example, axis=0))
            touched[t][ids.reshape(-1)] = True
            if optimizer == "adagrad":
                A[t] += G * G
                W[t] -= lr * G / np.sqrt(A[t])
            else:
                A[t] += (G * G).mean(axis=1)
                W[t] -= lr * G / (np.sqrt(A[t])[:, None] + eps)
    return W, A, touched


def run_one(engine_name: str, engine_kwargs: dict) -> dict:
    """Runs in the child: setup from the common tables, STEPS steps, compare."""
    cfg = CHECK_CONFIG
    wl = workloads_mod.generate(cfg)
    eng = engines_mod.make(engine_name, learning_rate=LR, **engine_kwargs)
    msg = eng.check_available()
    if msg:
        return {"engine": engine_name, "status": "skipped", "message": msg}
    t0 = initial_tables(cfg)
    eng.setup(wl, init_tables=t0)
    for k in range(STEPS):
        eng.step(k % wl.num_batches)
    tables, slots = eng.export()
    W, A, touched = reference(wl, t0, eng.optimizer)
    out = {
        "engine": engine_name,
        "status": "ok",
        "optimizer": eng.optimizer,
        "kwargs": engine_kwargs,
        "note": eng.semantics_note,
        "tables": [],
    }
    ok = True
    for t in range(cfg.tables):
        w, a = np.asarray(tables[t], np.float64), np.asarray(slots[t], np.float64)
        a = a.reshape(A[t].shape)
        untouched_same = bool(
            np.array_equal(np.asarray(tables[t])[~touched[t]], t0[t][~touched[t]])
        )
        w_err = float(np.max(np.abs(w - W[t])))
        a_err = float(np.max(np.abs(a - A[t]) / np.maximum(np.abs(A[t]), 1.0)))
        moved = float(np.max(np.abs(W[t] - t0[t])))
        close = bool(
            np.allclose(w, W[t], rtol=RTOL, atol=ATOL)
            and np.allclose(a, A[t], rtol=RTOL, atol=ATOL)
        )
        ok &= close and untouched_same
        out["tables"].append(
            {
                "table": t,
                "touched_rows": int(touched[t].sum()),
                "max_abs_err_w": w_err,
                "max_rel_err_acc": a_err,
                "max_update": moved,
                "untouched_rows_unchanged": untouched_same,
                "allclose": close,
            }
        )
    out["match"] = ok
    return out


def run_subprocess(engine_name: str, engine_kwargs: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="jte_check_") as d:
        out = os.path.join(d, "out.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--one",
            engine_name,
            json.dumps(engine_kwargs or {}),
            out,
        ]
        p = subprocess.run(
            cmd, env=harness.engine_env(engine_name), capture_output=True, text=True, timeout=900
        )
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return {
            "engine": engine_name,
            "status": "error",
            "message": f"exit {p.returncode}: {(p.stdout + p.stderr)[-2500:]}",
        }


def main(argv) -> int:
    if len(argv) == 4 and argv[0] == "--one":
        try:
            res = run_one(argv[1], json.loads(argv[2]))
        except Exception as e:
            import traceback

            res = {
                "engine": argv[1],
                "status": "error",
                "message": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
        with open(argv[3], "w") as f:
            json.dump(res, f)
        return 0

    names = engines_mod.resolve(",".join(argv) if argv else "all")
    runs = [(n, {}) for n in names]
    if "dense_jax" in names:
        runs.append(("dense_jax", {"optax_eps": 1e-7}))  # informational: optax's default eps
    c = CHECK_CONFIG
    print(
        f"reference check: T={c.tables} V={c.vocabulary_size} D={c.dim} B={c.batch} "
        f"L={c.ids_per_example}, {STEPS} steps, lr={LR}, a0={engines_mod.INITIAL_ACCUMULATOR}, "
        f"row-wise eps={engines_mod.ROWWISE_EPS}; tolerance rtol={RTOL} atol={ATOL}"
    )
    wl = workloads_mod.generate(c)
    print(
        f"ids per table and batch: {c.batch * c.ids_per_example}, unique rows per table and "
        f"batch: {wl.unique_rows.min()}..{wl.unique_rows.max()} (duplicates are summed)"
    )
    failed = False
    for name, kw in runs:
        r = run_subprocess(name, kw)
        label = name + (f" {kw}" if kw else "")
        informational = bool(kw)
        if r["status"] != "ok":
            print(f"{label:40s} {r['status'].upper()}: {r['message']}")
            if r["status"] == "error" and not informational:
                failed = True
            continue
        w_err = max(t["max_abs_err_w"] for t in r["tables"])
        a_err = max(t["max_rel_err_acc"] for t in r["tables"])
        upd = max(t["max_update"] for t in r["tables"])
        same = all(t["untouched_rows_unchanged"] for t in r["tables"])
        verdict = (
            ("MATCH" if r["match"] else "MISMATCH")
            if not informational
            else ("info: within tol" if r["match"] else "info: differs")
        )
        print(
            f"{label:40s} {verdict:18s} max|Δw|={w_err:.2e} (updates up to {upd:.2e}), "
            f"max rel Δacc={a_err:.2e}, untouched rows unchanged: {same}"
        )
        if not r["match"] and not informational:
            failed = True
    print("\nsemantics notes:")
    for name in names:
        print(f"  {name}: {engines_mod.ENGINES[name]().semantics_note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
