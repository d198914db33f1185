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
