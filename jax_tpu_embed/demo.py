"""The main demo: a DLRM on synthetic Criteo-shaped data, trained with sparse embeddings.

    python -m jax_tpu_embed.demo            # `make demo`; about 1-2 minutes on 2 CPU cores
    python -m jax_tpu_embed.demo --small    # seconds; what tests/test_demo.py runs
    python -m jax_tpu_embed.demo --data day_0.gz [day_1.gz ...]   # real Criteo click logs
    python -m jax_tpu_embed.demo --data day_0.gz --id-mapping dynamic   # dynamic tables

The data: 13 dense features and 26 categorical ones with Criteo's (clipped) vocabulary sizes
and power-law id frequencies. Clicks come from a hidden planted model (per-row effects, dense
weights, pairwise interactions), so the loss can fall and the held-out AUC can rise well
above 0.5; the planted model's own AUC is the ceiling.

The model: bottom MLP over the dense features → 16-d vector; one `jte.flax.Embed` with 26
tables of dim 16 (Adagrad, row-sharded over every local device); dot interactions between the
27 vectors; top MLP → click logit. Dense parameters train with optax Adam.

With `--data`, the same model trains on Criteo click-log files (Kaggle's train.txt or the 1TB
day files, plain or gzip) read by `jte.data.criteo`: every `--eval-every`-th line (10th by
default) of each file is held out for the AUC, the rest is repeated for `--steps` steps. The
vocabulary sizes are the config's (categorical values mapped by `--id-mapping`, "mod" by
default); the input pipeline's examples/s alone is printed next to the train step's.
`--id-mapping dynamic` keeps each categorical value itself as an int64 id (`jte.data.criteo`'s
"raw" mapping: no mod, no collisions; an empty field is -1, no row) in dynamic tables
(`jte.DynamicTable`, LRU eviction) of `--capacity` rows each (default: the config's vocabulary
sizes); the ids reach the jitted step as `jte.split_ids` halves, and the tables'
`dynamic_stats` (occupancy, admitted, evicted, ...) are printed at the end.

Runs on every local device: on CPU, 8 simulated devices unless XLA_FLAGS already says how
many; on a TPU VM, its chips. Writes under out/demo/: training_curve.png, summary.json and a
checkpoint (when `jax_tpu_embed.checkpoint` is available).
"""

from __future__ import annotations

import os

# Before JAX starts a backend: split the host CPU into devices so that the tables shard.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import importlib.resources  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402
from numpy.typing import ArrayLike  # noqa: E402

import jax_tpu_embed as jte  # noqa: E402

# Inside the package, so that an installed wheel finds it too.
DEFAULT_CONFIG = importlib.resources.files("jax_tpu_embed") / "configs" / "dlrm_demo.yaml"


# ---------------------------------------------------------------------------------- data


class PlantedCriteo:
    """Criteo-shaped examples whose labels come from a hidden logistic model.

    Categorical ids: rank r in [0, V) drawn with P(r) ∝ (r + 1)^-s, mapped to a row by a fixed
    random permutation per table. The hidden logit of an example is
        bias + Σ_t effect_t[id_t] + dense · beta + Σ_{t<u in I} <vec_t[id_t], vec_u[id_u]>
    and its label is Bernoulli(sigmoid(logit)).

    Args:
        vocabulary_sizes: V per categorical feature (26 for Criteo).
        num_dense: Number of dense features.
        rng: numpy Generator drawing the hidden model.
    """

    def __init__(
        self,
        vocabulary_sizes: Sequence[int],
        num_dense: int,
        zipf_exponent: float,
        click_rate: float,
        planted: dict,
        rng: np.random.Generator,
    ):
        self.vocabulary_sizes = [int(v) for v in vocabulary_sizes]
        self.num_dense = num_dense
        self.names = [f"C{i + 1}" for i in range(len(self.vocabulary_sizes))]
        self.perms, self.cdfs, self.effects = [], [], []
        for v in self.vocabulary_sizes:
            self.perms.append(rng.permutation(v).astype(np.int32))
            p = (np.arange(v) + 1.0) ** -zipf_exponent
            self.cdfs.append(np.cumsum(p) / p.sum())
            self.effects.append(rng.normal(0.0, planted["row_effect_std"], v).astype(np.float32))
        self.beta = rng.normal(0.0, planted["dense_effect_std"], num_dense).astype(np.float32)
        self.pairs_of = [int(t) for t in planted["interaction_features"]]
        k = planted["interaction_dim"]
        self.vectors = {
            t: rng.normal(0.0, planted["interaction_std"], (self.vocabulary_sizes[t], k)).astype(
                np.float32
            )
            for t in self.pairs_of
        }
        self.bias = 0.0
        # Calibrate the bias so the mean label is about click_rate.
        logits = self._logits(*self._draw(20000, np.random.default_rng(12345)))
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if np.mean(1 / (1 + np.exp(-(logits + mid)))) < click_rate:
                lo = mid
            else:
                hi = mid
        self.bias = (lo + hi) / 2

    def _draw(self, n: int, rng: np.random.Generator):
        dense = rng.normal(0.0, 1.0, (n, self.num_dense)).astype(np.float32)
        ids = []
        for perm, cdf in zip(self.perms, self.cdfs):
            rank = np.minimum(np.searchsorted(cdf, rng.random(n)), len(cdf) - 1)
            ids.append(perm[rank])
        return dense, ids

    def _logits(self, dense, ids) -> np.ndarray:
        logit = self.bias + dense @ self.beta
        for t, i in enumerate(ids):
            logit = logit + self.effects[t][i]
        for a, t in enumerate(self.pairs_of):
            for u in self.pairs_of[a + 1 :]:
                logit = logit + np.sum(self.vectors[t][ids[t]] * self.vectors[u][ids[u]], -1)
        return logit.astype(np.float32)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
        """A batch and the hidden logits.

        Returns:
            batch: {"dense": float32 (n, 13), "sparse": {"C1".."C26": int32 (n,)},
                "label": float32 (n,)}; logits: float32 (n,), the planted model's.
        """
        dense, ids = self._draw(n, rng)
        logits = self._logits(dense, ids)
        labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.float32)
        # Criteo's dense features are counts; the model sees them as log1p of a count-like
        # transform, a monotone function of the planted feature.
        counts = np.floor(np.exp(dense + 1.0)).astype(np.float32)
        batch = {"dense": np.log1p(counts), "sparse": dict(zip(self.names, ids)), "label": labels}
        return batch, logits


class CriteoFiles:
    """Criteo click-log files through `jte.data.criteo`: a training split that repeats, and
    the held-out lines (every `eval_every`-th line of each file).

    Malformed lines are skipped and counted (`skipped`), so one bad line in a day file does
    not stop a long run; `jte.data.criteo`'s default is to raise.
    """

    def __init__(self, paths: Sequence[str], vocab: Sequence[int] | None, eval_every: int, mapping):
        if eval_every < 2:
            raise ValueError(f"--eval-every must be at least 2, got {eval_every}.")
        self.paths = list(paths)
        self.vocab, self.eval_every, self.mapping = vocab, eval_every, mapping
        self._batches: list = []

    def _read(self, batch_size, held_out: bool, **kwargs):
        k = self.eval_every
        batches = jte.data.criteo(
            self.paths,
            batch_size,
            self.vocab,
            id_mapping=self.mapping,
            on_error="skip",
            select_lines=(lambda n: n % k == 0) if held_out else (lambda n: n % k != 0),
            **kwargs,
        )
        self._batches.append(batches)
        return batches

    @property
    def skipped(self) -> int:
        """Malformed lines skipped by the training and held-out readers (a training line
        once per pass over the files)."""
        return sum(b.skipped for b in self._batches[1:])  # [0]: the throughput probe.

    def train(self, batch_size: int, sharding) -> Any:
        return self._read(batch_size, False, sharding=sharding, num_epochs=None)

    def pipeline_rate(self, batch_size: int, sharding, batches: int) -> float:
        """Examples/s of the input pipeline alone (global arrays built), no training."""
        it = iter(self._read(batch_size, False, sharding=sharding, num_epochs=None))
        jax.block_until_ready(next(it))  # Threads started, first chunks parsed.
        start = time.perf_counter()
        for _ in range(batches):
            jax.block_until_ready(next(it))
        seconds = time.perf_counter() - start
        it.close()  # Stops its reader threads.
        return batches * batch_size / seconds

    def held_out(self, batch_size: int, max_examples: int):
        """(batch, rows): batches of exactly `batch_size` (the last padded by repeating its
        rows, so that predict compiles once), `rows` of them real; at most max_examples."""
        seen = 0
        for b in self._read(batch_size, True, drop_remainder=False, num_epochs=1):
            rows = min(b["labels"].shape[0], max_examples - seen)
            if rows <= 0:
                return
            pad = np.arange(batch_size) % b["labels"].shape[0]
            b = jax.tree.map(lambda x, pad=pad: x[pad], b)
            if self.mapping == "raw":  # NumPy int64 ids: jit would cut them to int32.
                b["sparse"] = {k: jte.split_ids(v) for k, v in b["sparse"].items()}
            yield _model_batch(b), rows
            seen += rows


def _model_batch(batch: dict) -> dict:
    """jte.data.criteo's batch in the demo model's keys."""
    return {"dense": batch["dense"], "sparse": batch["sparse"], "label": batch["labels"]}


# --------------------------------------------------------------------------------- model


class DLRM(nn.Module):
    """DLRM: bottom MLP, embeddings, pairwise dot interactions, top MLP → click logit (B,).

    Attributes:
        embed: The `jte.flax.Embed` of the categorical features ((B, D) each).
        bottom_mlp: Widths over the dense features; the last must equal D.
        top_mlp: Hidden widths over [bottom output, interactions]; then Dense(1).
    """

    embed: jte.flax.Embed
    bottom_mlp: Sequence[int]
    top_mlp: Sequence[int]

    @nn.compact
    def __call__(self, batch: dict) -> jax.Array:
        x = batch["dense"]  # (B, 13)
        for width in self.bottom_mlp:
            x = nn.relu(nn.Dense(width)(x))  # (B, D) at the end
        acts = self.embed(batch["sparse"])  # {name: (B, D)}
        vectors = jnp.stack([x] + [acts[k] for k in sorted(acts)], axis=1)  # (B, F, D)
        dots = jnp.einsum("bfd,bgd->bfg", vectors, vectors)  # (B, F, F)
        f = vectors.shape[1]
        # Strict upper triangle, by static slices (no gather on a batch-sharded array).
        upper = [dots[:, i, i + 1 :] for i in range(f - 1)]
        z = jnp.concatenate([x] + upper, axis=-1)  # (B, D + F(F-1)/2)
        for width in self.top_mlp:
            z = nn.relu(nn.Dense(width)(z))
        return nn.Dense(1)(z)[:, 0]


def bce_loss(logits: jax.Array, batch: dict):
    """Mean sigmoid cross-entropy; aux: mean predicted click rate."""
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch["label"]))
    return loss, {"mean_prediction": jnp.mean(jax.nn.sigmoid(logits))}


# ------------------------------------------------------------------------------- metrics


def auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties 1/2.

    Mann-Whitney U from average ranks; O(n log n). NaN if one class is absent.
    """
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, np.float64)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, np.float64)
    # Average rank (1-based) over each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    run_rank = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(run_rank, ends - starts)
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


# ---------------------------------------------------------------------------------- run


def _optimizer(cfg: dict) -> jte.Optimizer:
    cfg = dict(cfg)
    name = cfg.pop("name")
    return getattr(jte, name)(**cfg)


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m jax_tpu_embed.demo", description=(__doc__ or "").split("\n\n")[0]
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML config (default: jax_tpu_embed/configs/dlrm_demo.yaml).",
    )
    p.add_argument("--steps", type=int, default=None, help="Training steps.")
    p.add_argument("--batch-size", type=int, default=None, help="Global batch size B.")
    p.add_argument("--small", action="store_true", help="Tiny tables and few steps (for tests).")
    p.add_argument("--out", default="out/demo", help="Output directory.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    p.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        default=None,
        help="Criteo TSV files (plain or .gz) to train on instead of synthetic data.",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="With --data: every N-th line of each file is held out for evaluation.",
    )
    p.add_argument(
        "--id-mapping",
        choices=("mod", "hash", "dynamic"),
        default="mod",
        help='With --data: categorical value -> row, "mod" (MLPerf) or "hash" into tables of '
        'the config\'s vocabulary sizes, or "dynamic": the value itself as an int64 id of a '
        "dynamic table (no collisions).",
    )
    p.add_argument(
        "--capacity",
        type=int,
        nargs="+",
        metavar="ROWS",
        default=None,
        help="With --id-mapping dynamic: rows of each dynamic table, one number for all or "
        "one per table (C1..C26); default: the vocabulary sizes the other mappings use.",
    )
    args = p.parse_args(argv)
    if args.id_mapping == "dynamic" and not args.data:
        p.error("--id-mapping dynamic reads Criteo files: give them with --data.")
    if args.capacity is not None and args.id_mapping != "dynamic":
        p.error("--capacity sizes dynamic tables: it needs --id-mapping dynamic.")
    return args


def _capacities(capacity: list[int] | None, vocab: list[int]) -> list[int]:
    """Rows of each dynamic table: --capacity (one for all, or one per table) or `vocab`."""
    if capacity is None:
        return list(vocab)
    if len(capacity) not in (1, len(vocab)) or min(capacity) < 1:
        raise ValueError(
            f"--capacity: one positive number for every table or {len(vocab)} (one per "
            f"table), got {capacity}."
        )
    return list(capacity) * len(vocab) if len(capacity) == 1 else list(capacity)


def _print_dynamic_stats(stats: dict[str, dict[str, int]], rows: dict[str, int]) -> None:
    """One line per dynamic table: its counters since init (Embedding.dynamic_stats)."""
    cols = ("occupancy", "admitted", "evicted", "rejected", "failed", "hits", "misses")
    width = max(len(c) for c in cols) + 1
    print("Dynamic tables: rows (capacity) and counters since init (Embedding.dynamic_stats):")
    print(f"{'table':<6}{'rows':>9}" + "".join(f"{c:>{width}}" for c in cols))
    for name, st in stats.items():
        print(f"{name:<6}{rows[name]:>9,}" + "".join(f"{st[c]:>{width},}" for c in cols))
    total = {c: sum(st[c] for st in stats.values()) for c in cols}
    print(f"{'all':<6}{sum(rows.values()):>9,}" + "".join(f"{total[c]:>{width},}" for c in cols))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the demo; returns the summary it prints (and writes to summary.json)."""
    args = _parse(argv)
    config = DEFAULT_CONFIG if args.config is None else pathlib.Path(args.config)
    cfg = yaml.safe_load(config.read_text())
    data_cfg, model_cfg, train_cfg, eval_cfg = (
        cfg["data"],
        cfg["model"],
        cfg["train"],
        cfg["eval"],
    )
    vocab = list(data_cfg["vocabulary_sizes"])
    steps, batch_size = train_cfg["steps"], train_cfg["batch_size"]
    eval_examples, eval_batch = eval_cfg["examples"], eval_cfg["batch_size"]
    if args.small:
        small = cfg["small"]
        vocab = [min(v, small["vocabulary_cap"]) for v in vocab]
        steps, batch_size = small["steps"], small["batch_size"]
        eval_examples = eval_batch = small["eval_examples"]
    steps = args.steps if args.steps is not None else steps
    batch_size = args.batch_size if args.batch_size is not None else batch_size
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    devices = jax.devices()
    n = len(devices)
    if batch_size % n or eval_batch % n:
        raise ValueError(
            f"batch sizes ({batch_size}, eval {eval_batch}) must be multiples of the {n} devices."
        )
    dynamic = args.id_mapping == "dynamic"
    capacity = _capacities(args.capacity, vocab) if dynamic else None
    table_text = (
        f"{len(vocab)} dynamic tables (capacity {sum(capacity):,} rows"
        if capacity is not None
        else f"{len(vocab)} tables ({sum(vocab):,} rows"
    )
    print(
        f"jax_tpu_embed demo: DLRM, {table_text} x {model_cfg['embedding_dim']}), batch "
        f"{batch_size}, {steps} steps, {n} {devices[0].platform} devices."
    )

    rng = np.random.default_rng(cfg["seed"])
    data = (
        None
        if args.data
        else PlantedCriteo(
            vocab,
            data_cfg["num_dense"],
            data_cfg["zipf_exponent"],
            data_cfg["click_rate"],
            data_cfg["planted"],
            rng,
        )
    )

    dim = model_cfg["embedding_dim"]
    names = [f"C{i + 1}" for i in range(len(vocab))]
    if capacity is None:
        tables = [
            jte.TableConfig(v, dim, combiner="sum", name=name) for name, v in zip(names, vocab)
        ]
    else:  # Any int64 id; a new id evicts its bucket's least recently updated row when full.
        tables = [
            jte.TableConfig(
                dim=dim, combiner="sum", name=name, dynamic=jte.DynamicTable(capacity=c)
            )
            for name, c in zip(names, capacity)
        ]
    features = {t.name: jte.FeatureConfig(t) for t in tables}
    spec = jte.EmbeddingSpec(features, _optimizer(train_cfg["embedding_optimizer"]))
    model = DLRM(jte.flax.Embed(spec), tuple(model_cfg["bottom_mlp"]), tuple(model_cfg["top_mlp"]))
    step = jte.flax.make_train_step(model, bce_loss, optax.adam(train_cfg["dense_learning_rate"]))

    train_rng = np.random.default_rng(cfg["seed"] + 1)
    pipeline_rate, train_batches = None, None
    if data is not None:
        next_batch = lambda: data.sample(batch_size, train_rng)[0]
    else:
        assert args.data is not None
        # "raw": int64 ids, split into jte.SplitIds halves on the host (in the reader's
        # prefetch thread, since the batches are global arrays) before the jitted step.
        files = (
            CriteoFiles(args.data, None, args.eval_every, "raw")
            if dynamic
            else CriteoFiles(args.data, vocab, args.eval_every, args.id_mapping)
        )
        sharding = jte.multihost.batch_sharding(model.embed.embedding)
        pipeline_rate = files.pipeline_rate(batch_size, sharding, batches=min(steps, 50))
        train_batches = iter(files.train(batch_size, sharding))
        next_batch = lambda: _model_batch(next(train_batches))
    first_batch = next_batch()
    t_init = time.perf_counter()
    state = step.init(jax.random.key(cfg["seed"]), first_batch)
    jax.block_until_ready(state)
    init_seconds = time.perf_counter() - t_init

    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the "demo" extra; without it, plain lines.
        tqdm = None
    bar = (
        tqdm(total=steps, unit="step", dynamic_ncols=True, disable=args.no_progress)
        if tqdm is not None
        else None
    )
    losses: list[float] = []
    pending: list[jax.Array] = []
    log_every = max(1, int(train_cfg.get("log_every", 10)))
    t_start = time.perf_counter()
    t_after_first = t_start  # Set again once the first step is done.
    batch = first_batch
    for i in range(steps):
        state, metrics = step(state, batch)
        pending.append(metrics["loss"])
        if i + 1 < steps:
            batch = next_batch()  # Overlaps the device step.
        if i == 0:
            jax.block_until_ready(metrics["loss"])
            t_after_first = time.perf_counter()  # Compile time excluded from throughput.
        if (i + 1) % log_every == 0 or i + 1 == steps:
            losses.extend(float(x) for x in jax.device_get(pending))
            pending.clear()
            elapsed = time.perf_counter() - t_after_first
            rate = i * batch_size / elapsed if i and elapsed > 0 else float("nan")
            recent = float(np.mean(losses[-log_every:]))
            if bar is not None:
                bar.set_postfix(loss=f"{recent:.4f}", ex_s=f"{rate:,.0f}")
                bar.update(i + 1 - bar.n)
            else:
                print(f"step {i + 1}/{steps} loss {recent:.4f} examples/s {rate:,.0f}")
    jax.block_until_ready(state.params)
    t_end = time.perf_counter()
    if train_batches is not None:
        train_batches.close()  # Stops its reader threads (it repeats the files forever).
    if bar is not None:
        bar.close()
    train_seconds = t_end - t_start
    timed_steps = steps - 1
    examples_per_s = (
        timed_steps * batch_size / (t_end - t_after_first) if timed_steps > 0 else float("nan")
    )

    # Held-out evaluation.
    state = step.flush(state)
    eval_rng = np.random.default_rng(cfg["seed"] + 2)
    scores, labels, planted = [], [], []
    if data is not None:
        for _ in range(max(1, eval_examples // eval_batch)):
            b, logits = data.sample(eval_batch, eval_rng)
            scores.append(np.asarray(step.predict(state, b)))
            labels.append(b["label"])
            planted.append(logits)
        scores, labels, planted = map(np.concatenate, (scores, labels, planted))
        eval_auc, planted_auc = auc(labels, scores), auc(labels, planted)
    else:
        for b, rows in files.held_out(eval_batch, eval_examples):
            scores.append(np.asarray(step.predict(state, b))[:rows])
            labels.append(b["label"][:rows])
        if not scores:
            raise ValueError(
                f"--data: no held-out lines (every {args.eval_every}th line of {files.paths}); "
                f"give more lines or a smaller --eval-every."
            )
        scores, labels = np.concatenate(scores), np.concatenate(labels)
        eval_auc, planted_auc = auc(labels, scores), None
    eval_loss = float(np.mean(optax.sigmoid_binary_cross_entropy(scores, labels)))

    title = (
        f"DLRM on planted Criteo-like data: held-out AUC {eval_auc:.3f} (planted {planted_auc:.3f})"
        if planted_auc is not None
        else f"DLRM on {len(files.paths)} Criteo file(s): held-out AUC {eval_auc:.3f}"
    )
    plot_path = _plot(out / "training_curve.png", losses, title)
    dynamic_stats, dynamic_rows = None, {}
    if dynamic:
        ((name, emb),) = step.embeddings.items()
        stats = emb.dynamic_stats(jte.flax.embedding_states(state.embedding)[name])
        dynamic_stats = {t: {k: int(v) for k, v in stats[t].items()} for t in names}
        dynamic_rows = {t: emb.dynamic[t].rows for t in names}
    checkpoint_dir, checkpoint_note = _checkpoint(out / "checkpoint", step, state)

    head = float(np.mean(losses[:log_every]))
    tail = float(np.mean(losses[-log_every:]))
    summary = {
        "steps": steps,
        "batch_size": batch_size,
        "devices": n,
        "platform": devices[0].platform,
        "init_seconds": round(init_seconds, 2),
        "compile_and_first_step_seconds": round(t_after_first - t_start, 2),
        "train_seconds": round(train_seconds, 2),
        "examples_per_second": round(examples_per_s, 1),
        "first_loss": round(head, 5),
        "final_loss": round(tail, 5),
        "skipped_steps": int(state.skipped),
        "eval_examples": int(labels.size),
        "eval_loss": round(eval_loss, 5),
        "eval_auc": round(eval_auc, 4),
        "planted_model_auc": round(planted_auc, 4) if planted_auc is not None else None,
        "plot": str(plot_path) if plot_path else None,
        "checkpoint": str(checkpoint_dir) if checkpoint_dir else None,
        "trace_count": step.trace_count,
    }
    if data is None:
        summary["data"] = files.paths
        summary["pipeline_examples_per_second"] = round(pipeline_rate or 0.0, 1)
        summary["skipped_lines"] = files.skipped
        summary["id_mapping"] = args.id_mapping
    if dynamic_stats is not None:
        summary["dynamic_rows"] = dynamic_rows
        summary["dynamic_stats"] = dynamic_stats
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"\nTrained {steps} steps of {batch_size} examples in {train_seconds:.1f} s "
        f"({examples_per_s:,.0f} examples/s after compilation) on {n} "
        f"{devices[0].platform} devices; init {init_seconds:.1f} s, compile and first "
        f"step {t_after_first - t_start:.1f} s."
    )
    print(
        f"Loss {head:.4f} -> {tail:.4f} (mean of the first and last {log_every} steps); "
        f"skipped steps: {summary['skipped_steps']}."
    )
    if planted_auc is not None:
        print(
            f"Held-out: AUC {eval_auc:.4f}, log loss {eval_loss:.4f} on {labels.size:,} "
            f"examples (the planted model itself: AUC {planted_auc:.4f})."
        )
    else:
        print(
            f"Input pipeline alone: {pipeline_rate:,.0f} examples/s (jte.data.criteo, "
            f"{len(files.paths)} file(s)); train step with it: {examples_per_s:,.0f} "
            f"examples/s. Malformed lines skipped: {files.skipped}."
        )
        print(
            f"Held-out: AUC {eval_auc:.4f}, log loss {eval_loss:.4f} on {labels.size:,} "
            f"examples (every {args.eval_every}th line of the files)."
        )
    if dynamic_stats is not None:
        _print_dynamic_stats(dynamic_stats, dynamic_rows)
    print(f"Plot: {plot_path or 'not written (' + 'matplotlib unavailable)'}")
    print(f"Checkpoint: {checkpoint_dir or checkpoint_note}")
    print(f"Summary: {out / 'summary.json'}")
    return summary


def _plot(path: pathlib.Path, losses: list[float], title: str) -> pathlib.Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    curve = np.asarray(losses)
    window = max(1, len(curve) // 30)
    smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(curve) + 1), curve, alpha=0.3, label="loss per step")
    ax.plot(np.arange(window, len(curve) + 1), smooth, label=f"mean of {window} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("train log loss")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _checkpoint(directory: pathlib.Path, step, state) -> tuple[pathlib.Path, str]:
    """Saves tables and dense params with jte.checkpoint; a rerun replaces the last run's."""
    shutil.rmtree(directory, ignore_errors=True)
    ((name, emb),) = step.embeddings.items()
    emb_state = jte.flax.embedding_states(state.embedding)[name]
    jte.checkpoint.save(
        str(directory.resolve()),
        emb,
        emb_state,
        dense={"params": state.params, "opt_state": state.opt_state},
    )
    return directory, "saved"


if __name__ == "__main__":
    main()
