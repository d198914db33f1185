"""Benchmark workloads of shared/WORKLOADS.md: definitions (configs/bench_*.yaml) and generator.

A workload is T tables of V rows and dim D, a batch of B examples with exactly L ids per example
and table, sum combiner. Ids per table: a rank r in [0, V) drawn with P(r) ∝ (r+1)^-1.05 (a
truncated power law, sampled by the inverse of its exact discrete CDF), then mapped to a row by a
fixed random permutation of [0, V) per table. Seed 0; 4 pre-generated batches that the benchmark
cycles through; a fixed random R_t (B × D) per table; loss = Σ_t Σ pooled_t ⊙ R_t.

Random streams: every (purpose, table[, batch]) has its own generator seeded by
``np.random.default_rng([seed, purpose, table, batch])``, so the ids do not depend on D (a dim
sweep keeps the same ids) and the permutation of table t does not depend on the number of tables.

Essential bytes per step = Σ_t (U_t·D·4·4 + B·L·4): read and write the row and its accumulator
row for each of the U_t unique rows of table t, plus the int32 ids of every table. (The ids term
is per table: that is what reproduces the totals of WORKLOADS.md, e.g. 15.7 MB for W0.)

CLI: ``python benchmarks/workloads.py --check [W0 W1 ...]`` prints measured unique rows and
essential bytes per step next to the values of WORKLOADS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO_ROOT, "configs")

ALL_WORKLOADS = ("W0", "W0v10", "W1", "W1t1", "W1t1v10")

# Purpose tags of the random streams.
_PERM, _IDS, _R = 1, 2, 3


@dataclass(frozen=True)
class WorkloadConfig:
    name: str
    tables: int
    vocabulary_size: int
    dim: int
    batch: int
    ids_per_example: int
    expected_unique_rows: float | None = None
    expected_essential_mb: float | None = None
    exponent: float = 1.05
    num_batches: int = 4
    seed: int = 0

    def __post_init__(self):
        for f in ("tables", "vocabulary_size", "dim", "batch", "ids_per_example", "num_batches"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"workload {self.name!r}: {f} must be a positive int, got {v!r}")

    # -- sizes -----------------------------------------------------------------------------
    def table_bytes(self) -> int:
        """float32 tables."""
        return self.tables * self.vocabulary_size * self.dim * 4

    def slot_bytes(self, optimizer: str = "adagrad") -> int:
        """float32 Adagrad accumulator: (V, D) per table, or (V,) for row-wise Adagrad."""
        per_row = self.dim if optimizer == "adagrad" else 1
        return self.tables * self.vocabulary_size * per_row * 4

    def state_bytes(self, optimizer: str = "adagrad") -> int:
        return self.table_bytes() + self.slot_bytes(optimizer)

    def table_names(self) -> list[str]:
        return [f"t{i}" for i in range(self.tables)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_path(name: str) -> str:
    return os.path.join(CONFIG_DIR, f"bench_{name.lower()}.yaml")


def load_config(
    name_or_path: str, *, vocabulary_size: int | None = None, dim: int | None = None, **overrides
) -> WorkloadConfig:
    """Loads a workload from ``configs/bench_<name>.yaml`` (or a YAML path) and applies overrides.

    ``vocabulary_size`` / ``dim`` override V and D (vocabulary and dim sweeps); the name gets a
    suffix (``W0@V=1000000``) and the expected values of the YAML (valid only for the original
    V and D) are dropped. Other keyword overrides (batch, tables, ...) are applied likewise.
    """
    import yaml  # pyyaml is a dependency of the project

    path = name_or_path if os.path.exists(name_or_path) else config_path(name_or_path)
    if not os.path.exists(path):
        known = sorted(
            f[6:-5]
            for f in os.listdir(CONFIG_DIR)
            if f.startswith("bench_") and f.endswith(".yaml")
        )
        raise FileNotFoundError(f"no workload {name_or_path!r} ({path}); known: {known}")
    with open(path) as f:
        raw = yaml.safe_load(f)
    fields = {f.name for f in dataclasses.fields(WorkloadConfig)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(f"{path}: unknown fields {sorted(unknown)}; allowed: {sorted(fields)}")
    cfg = WorkloadConfig(**raw)
    changes = dict(overrides)
    if vocabulary_size is not None:
        changes["vocabulary_size"] = int(vocabulary_size)
    if dim is not None:
        changes["dim"] = int(dim)
    changes = {k: v for k, v in changes.items() if getattr(cfg, k) != v}
    if changes:
        suffix = ",".join(f"{_short(k)}={v}" for k, v in sorted(changes.items()))
        drop = {}
        if {"vocabulary_size", "batch", "ids_per_example", "tables", "exponent", "seed"} & set(
            changes
        ):
            drop["expected_unique_rows"] = None
        drop["expected_essential_mb"] = None
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}@{suffix}", **changes, **drop)
    return cfg


def _short(key: str) -> str:
    return {
        "vocabulary_size": "V",
        "dim": "D",
        "batch": "B",
        "ids_per_example": "L",
        "tables": "T",
    }.get(key, key)


# -- generator -----------------------------------------------------------------------------


def jax_loss(acts, R):
    """(loss, d(loss)/d(acts)) of the workloads' loss Σ_f Σ acts_f ⊙ R_f, for jitted JAX steps.

    The gradient is R, tied to the loss by a factor 1 + 0·loss. A real model's gradients
    depend on its activations; this loss's would not, and then XLA has nothing that orders
    the lookups' reads of a table before the update's in-place writes to it, and copies
    every table each step (an `optimization_barrier` is removed before that decision). The
    step returns the loss too, or XLA drops the lookups, which the eager peers always run.
    """
    import jax.numpy as jnp

    loss = sum(jnp.sum(acts[f] * R[f]) for f in acts)
    tie = 1.0 + 0.0 * loss  # 1 for a finite loss.
    return loss, {f: R[f] * tie for f in acts}


def power_law_cdf(vocabulary_size: int, exponent: float = 1.05) -> np.ndarray:
    """Exact CDF (float64, length V) of P(r) ∝ (r+1)^-exponent on r in [0, V)."""
    w = np.arange(1, vocabulary_size + 1, dtype=np.float64) ** (-exponent)
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return cdf


def sample_ranks(cdf: np.ndarray, shape, rng: np.random.Generator) -> np.ndarray:
    """Inverse-CDF sampling: the smallest r with cdf[r] > u, u ~ U[0, 1)."""
    u = rng.random(shape)
    r = np.searchsorted(cdf, u, side="right")
    return np.minimum(r, cdf.shape[0] - 1)


@dataclass
class Workload:
    config: WorkloadConfig
    ids: list[list[np.ndarray]]  # [batch k][table t] -> (B, L) int32 row ids
    R: list[np.ndarray]  # [table t] -> (B, D) float32, fixed over steps
    unique_rows: np.ndarray  # (num_batches, tables) int64: U_t of each batch
    essential_bytes: np.ndarray  # (num_batches,) int64
    gen_seconds: float = 0.0
    table_names: list[str] = field(default_factory=list)

    @property
    def num_batches(self) -> int:
        return len(self.ids)

    def mean_unique_rows(self) -> float:
        """Mean over batches of Σ_t U_t."""
        return float(self.unique_rows.sum(axis=1).mean())

    def mean_essential_bytes(self) -> float:
        return float(self.essential_bytes.mean())


def generate(config: WorkloadConfig) -> Workload:
    c = config
    t0 = time.perf_counter()
    cdf = power_law_cdf(c.vocabulary_size, c.exponent)
    unset = np.empty((0, 0), np.int32)  # Every entry is replaced below.
    ids = [[unset] * c.tables for _ in range(c.num_batches)]
    for t in range(c.tables):
        perm = np.random.default_rng([c.seed, _PERM, t]).permutation(c.vocabulary_size)
        for k in range(c.num_batches):
            rng = np.random.default_rng([c.seed, _IDS, t, k])
            ranks = sample_ranks(cdf, (c.batch, c.ids_per_example), rng)
            ids[k][t] = perm[ranks].astype(np.int32)
        del perm
    del cdf
    R = [
        np.random.default_rng([c.seed, _R, t]).standard_normal((c.batch, c.dim), np.float32)
        for t in range(c.tables)
    ]
    unique = np.array(
        [[np.unique(ids[k][t]).size for t in range(c.tables)] for k in range(c.num_batches)],
        dtype=np.int64,
    )
    essential = unique.sum(axis=1) * c.dim * 4 * 4 + c.tables * c.batch * c.ids_per_example * 4
    return Workload(
        config=c,
        ids=ids,
        R=R,
        unique_rows=unique,
        essential_bytes=essential,
        gen_seconds=time.perf_counter() - t0,
        table_names=c.table_names(),
    )


def sweep_configs(base: str, sweep: str, values=None) -> list[WorkloadConfig]:
    """Configs of a vocabulary sweep (default V = 1e5, 1e6, 1e7) or dim sweep (16..256)."""
    if sweep == "vocab":
        values = values or [100_000, 1_000_000, 10_000_000]
        return [load_config(base, vocabulary_size=int(v)) for v in values]
    if sweep == "dim":
        values = values or [16, 32, 64, 128, 256]
        return [load_config(base, dim=int(v)) for v in values]
    raise ValueError(f"unknown sweep {sweep!r}; allowed: 'vocab', 'dim'")


def check(names=ALL_WORKLOADS, tolerance: float = 0.05) -> bool:
    """Prints measured vs expected unique rows / essential MB; True if all within tolerance."""
    ok = True
    print(
        f"{'workload':10s} {'U/step':>10s} {'expected':>10s} {'MB/step':>8s} {'expected':>9s} "
        f"{'gen s':>6s}  status"
    )
    for name in names:
        cfg = load_config(name)
        wl = generate(cfg)
        u, mb = wl.mean_unique_rows(), wl.mean_essential_bytes() / 1e6
        eu, emb = cfg.expected_unique_rows, cfg.expected_essential_mb
        good = True
        if eu:
            good &= abs(u / eu - 1) <= tolerance
        if emb:
            good &= abs(mb / emb - 1) <= tolerance
        ok &= good
        print(
            f"{cfg.name:10s} {u:10.0f} {eu or float('nan'):10.0f} {mb:8.2f} "
            f"{emb or float('nan'):9.1f} {wl.gen_seconds:6.2f}  "
            f"{'ok' if good else 'MISMATCH (> %.0f%%)' % (tolerance * 100)}"
        )
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("workloads", nargs="*", default=list(ALL_WORKLOADS))
    p.add_argument(
        "--check",
        action="store_true",
        help="compare unique rows and essential bytes with WORKLOADS.md",
    )
    p.add_argument("--tolerance", type=float, default=0.05)
    a = p.parse_args(argv)
    if a.check:
        return 0 if check(a.workloads, a.tolerance) else 1
    for name in a.workloads:
        print(load_config(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
