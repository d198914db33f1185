"""The main demo, tiny (`--small`), and its pieces: AUC, the planted data, the DLRM."""

import itertools
import json
import pathlib
import tomllib

import numpy as np
import pytest
import yaml

from jax_tpu_embed import demo


def brute_force_auc(labels, scores):
    """P(score of a positive > score of a negative) + P(tie) / 2, over every pair."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(4))
def test_auc_matches_pairwise_definition(seed):
    rng = np.random.default_rng(seed)
    labels = rng.random(60) < 0.3
    scores = np.round(rng.normal(size=60), 1)  # Many ties.
    assert demo.auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_auc_edge_cases():
    assert demo.auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert demo.auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert demo.auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert np.isnan(demo.auc([1, 1], [0.1, 0.2]))


def test_planted_data_is_criteo_shaped_and_learnable():
    planted = {
        "row_effect_std": 0.25,
        "dense_effect_std": 0.25,
        "interaction_dim": 4,
        "interaction_features": [0, 1],
        "interaction_std": 0.35,
    }
    data = demo.PlantedCriteo([50, 300, 1000], 13, 1.05, 0.25, planted, np.random.default_rng(0))
    batch, logits = data.sample(20000, np.random.default_rng(1))
    assert batch["dense"].shape == (20000, 13) and batch["dense"].dtype == np.float32
    assert list(batch["sparse"]) == ["C1", "C2", "C3"]
    for ids, v in zip(batch["sparse"].values(), [50, 300, 1000]):
        assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < v
        counts = np.sort(np.bincount(ids, minlength=v))[::-1]
        assert counts[0] > 10 * max(counts[v // 2], 1)  # Power law: a few hot rows.
    assert abs(batch["label"].mean() - 0.25) < 0.02
    assert demo.auc(batch["label"], logits) > 0.7


def test_default_config_ships_inside_the_package():
    """An installed wheel has only the package: the demo's config must live in it, and match
    pyproject's package-data."""
    package = pathlib.Path(demo.__file__).parent
    path = pathlib.Path(str(demo.DEFAULT_CONFIG))
    assert path.is_file() and path.parent.parent == package
    data = tomllib.loads((package.parent / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["jax_tpu_embed"]
    assert any(path.relative_to(package).match(g) for g in globs), globs
    assert set(yaml.safe_load(path.read_text())) >= {"data", "model", "train", "small"}


@pytest.mark.slow
def test_small_demo_runs_and_learns(tmp_path, capsys):
    summary = demo.main(["--small", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert "Held-out: AUC" in out and "Trained 30 steps" in out
    assert summary["trace_count"] == 1 and summary["skipped_steps"] == 0
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["eval_auc"] > 0.6
    assert summary["planted_model_auc"] > summary["eval_auc"]
    assert (tmp_path / "training_curve.png").stat().st_size > 1000
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    if summary["checkpoint"] is not None:
        assert (tmp_path / "checkpoint" / str(summary["steps"])).is_dir()


@pytest.mark.slow
def test_demo_trains_on_criteo_files(tmp_path, capsys):
    """--data: a generated Criteo-format file (empty fields, a planted signal, one malformed
    line) trains the same DLRM to a held-out AUC well above chance."""
    from criteo_files import write_criteo

    path = tmp_path / "day_0.tsv"
    rows = write_criteo(path, 4000, seed=0)
    with open(path, "a") as f:
        f.write("\t".join(rows[0][:30]) + "\n")  # 30 fields: skipped and counted.
    args = ["--small", "--data", str(path), "--eval-every", "5", "--steps", "15"]
    summary = demo.main(args + ["--out", str(tmp_path / "out"), "--no-progress"])
    out = capsys.readouterr().out
    assert "Input pipeline alone:" in out and "Held-out: AUC" in out
    assert summary["data"] == [str(path)] and summary["skipped_lines"] >= 1
    assert summary["pipeline_examples_per_second"] > 0
    assert summary["trace_count"] == 1 and summary["planted_model_auc"] is None
    assert summary["eval_examples"] == 800
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["eval_auc"] > 0.6
    assert (tmp_path / "out" / "training_curve.png").stat().st_size > 1000


@pytest.mark.slow  # About 35 s on 2 cores: 26 dynamic tables compile in ~17 s alone.
def test_demo_dynamic_tables_on_criteo_files(tmp_path):
    """--id-mapping dynamic: the raw hex values as int64 ids in dynamic tables; a few steps,
    then the tables' dynamic_stats and the AUC. In a subprocess on one CPU device: on 8
    devices the 26 dynamic tables take 12-30 s to compile."""
    import os
    import subprocess
    import sys

    from criteo_files import write_criteo

    path = tmp_path / "day_0.tsv"
    rows = write_criteo(path, 1000, seed=0)
    out = tmp_path / "out"
    args = ["--small", "--data", str(path), "--eval-every", "5", "--steps", "4"]
    args += ["--batch-size", "128", "--id-mapping", "dynamic", "--capacity", "512"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(pathlib.Path(demo.__file__).parent.parent)]
        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "jax_tpu_embed.demo", *args, "--out", str(out), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # Takes about a minute on 2 cores under a parallel pytest worker.
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "26 dynamic tables (capacity 13,312 rows x 16)" in text
    assert "Held-out: AUC" in text and "Dynamic tables:" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["id_mapping"] == "dynamic" and summary["trace_count"] == 1
    assert 0.0 <= summary["eval_auc"] <= 1.0 and summary["eval_examples"] == 200
    stats, table_rows = summary["dynamic_stats"], summary["dynamic_rows"]
    assert list(stats) == [f"C{j + 1}" for j in range(26)]
    train = [r for i, r in enumerate(rows) if (i + 1) % 5 != 0]
    for j, (name, st) in enumerate(stats.items()):
        line = next(x for x in text.splitlines() if x.split()[:1] == [name])
        assert line.split()[1:3] == [f"{table_rows[name]:,}", f"{st['occupancy']:,}"]
        # Every distinct non-empty value of the 4 x 128 training lines got a row; an empty
        # field (-1, padding) none.
        seen = {r[14 + j] for r in train[: 4 * 128]} - {""}
        assert st["admitted"] == st["occupancy"] == len(seen), name
        assert st["evicted"] == st["failed"] == st["rejected"] == 0
        assert table_rows[name] >= 512


def test_demo_dynamic_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--id-mapping", "dynamic"])  # Synthetic data has no raw ids.
    assert "--id-mapping dynamic reads Criteo files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--data", "x.tsv", "--capacity", "100"])
    assert "--capacity sizes dynamic tables" in capsys.readouterr().err
    assert demo._capacities(None, [5, 7]) == [5, 7]
    assert demo._capacities([3], [5, 7]) == [3, 3]
    assert demo._capacities([3, 4], [5, 7]) == [3, 4]
    with pytest.raises(ValueError, match="--capacity: one positive number"):
        demo._capacities([3, 4, 5], [5, 7])
