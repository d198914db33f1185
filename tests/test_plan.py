"""`python -m jax_tpu_embed.plan`: per-chip memory and cost of a config on a TPU slice, compiled
by libtpu without a TPU. Small configs on 4-chip slices, so every case compiles in seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import jax_tpu_embed as jte

if importlib.util.find_spec("libtpu") is None:
    pytest.skip(
        "libtpu is not installed (pip install 'jax[tpu]' to compile for TPU "
        "topologies without a TPU)",
        allow_module_level=True,
    )

from jax_tpu_embed import plan  # noqa: E402

# libtpu's executables cannot be read back from the persistent compilation cache (conftest).
pytestmark = pytest.mark.usefixtures("no_persistent_cache")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRITEO = os.path.join(REPO, "configs", "criteo_1tb_dcnv2.yaml")

SMALL = """\
optimizer: {name: adagrad, learning_rate: 0.05}
tables:
  users: {vocabulary_size: 1000000, dim: 128, combiner: sum}
  items: {vocabulary_size: 200000, dim: 64}
features:
  user: {table: users}
  history: {table: items}
  recent: {table: items, max_sequence_length: 8}
inputs:
  batch: 512
  ids_per_example: {history: 5}
"""

# 100M rows x 128 x 4 B x 2 (Adagrad) = 95.4 GiB: 23.8 GiB per v5e chip of 16 GiB.
HUGE = """\
optimizer: adagrad
tables:
  t: {vocabulary_size: 100000000, dim: 128, combiner: sum}
features:
  f: {table: t}
inputs: {batch: 256}
"""


@pytest.fixture
def config(tmp_path):
    def write(text: str, name: str = "c.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


def _run(capsys, *args) -> tuple[int, str, str]:
    code = plan.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_small_config_fits_with_per_chip_figures(config, capsys):
    code, out, err = _run(capsys, "--config", config(SMALL), "--topology", "v5e:2x2", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert (res["topology"], res["chips"], res["batch"], res["fits"]) == ("v5e:2x2", 4, 512, True)
    assert res["ids_per_example"] == {"history": 5, "recent": 8, "user": 1}
    c = res["per_chip"]
    tables = {t["name"]: t for t in res["tables"]}
    # users: 250,000 rows per chip x 128 x 4 B, and an accumulator of the same size.
    assert tables["users"]["rows_per_shard"] == 250_000
    assert tables["users"]["table_bytes_per_chip"] == 250_000 * 128 * 4
    assert tables["users"]["slot_bytes_per_chip"] == 250_000 * 128 * 4
    assert c["table_bytes"] >= 250_000 * 128 * 4 + 50_000 * 64 * 4
    assert c["hbm_bytes"] == 16 * 2**30
    assert c["table_bytes"] + c["slot_bytes"] <= c["total_bytes"] <= c["hbm_bytes"]
    assert c["bytes_accessed"] > 0 and c["flops"] > 0
    assert res["collectives"]["count"] > 0 and res["compiler_oom"] is None


@pytest.mark.slow  # libtpu compiles: the fast tier keeps test_small_config_fits_*.
def test_table_output_batch_override_and_capacities(config):
    res = plan.plan(config(SMALL), "v5p:2x2x1", 1024, max_unique_ids_per_shard=64)
    out = plan.format_table(res)
    assert "on v5p:2x2x1: 4 chips, 4 devices (1 per chip), global batch 1024" in out
    for needle in (
        "users",
        "items",
        "tables",
        "optimizer slots",
        "temporaries",
        "of 95.00 GiB HBM",
        ": fits",
        "bytes accessed/step",
        "flops/step",
    ):
        assert needle in out, needle
    # The capacities reach the Embedding.
    assert set(res["max_unique_ids_per_shard"].values()) == {64}
    assert set(res["max_ids_per_shard"].values()) == {None}


@pytest.mark.slow  # libtpu compiles: the fast tier keeps test_small_config_fits_*.
def test_v4_counts_two_devices_per_chip(config, capsys):
    code, out, err = _run(capsys, "--config", config(SMALL), "--topology", "v4:2x2x1", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert (res["chips"], res["devices"], res["devices_per_chip"]) == (4, 8, 2)
    users = {t["name"]: t for t in res["tables"]}["users"]
    assert users["rows_per_shard"] == 125_000
    assert users["table_bytes_per_chip"] == 2 * 125_000 * 128 * 4
    assert res["per_chip"]["hbm_bytes"] == 32 * 2**30


@pytest.mark.slow  # libtpu compiles: the fast tier keeps test_small_config_fits_*.
def test_config_that_does_not_fit_says_by_how_much_and_what_to_use(config, capsys):
    code, out, err = _run(capsys, "--config", config(HUGE), "--topology", "v5e:2x2")
    assert code == 1, err
    assert "DOES NOT FIT: over by" in out
    assert "try --topology v5e:2x4" in out
    code, out, _ = _run(capsys, "--config", config(HUGE), "--topology", "v5e:2x2", "--json")
    res = json.loads(out)
    assert res["fits"] is False
    c = res["per_chip"]
    assert res["over_by_bytes"] == max(c["total_bytes"], c["init_peak_bytes"]) - 16 * 2**30
    assert res["over_by_bytes"] > 7 * 2**30
    # Initialisation: all of the state plus one table's init temporaries.
    assert c["init_peak_bytes"] == c["table_bytes"] + c["slot_bytes"] + c["init_temp_bytes"]["t"]
    assert "RESOURCE_EXHAUSTED" in res["compiler_oom"]


# One 200M x 64 Adagrad table: a 25.6 GB array per v5e chip (16 GiB), which the compiler
# cannot place even with xla_tpu_no_crash_on_oom.
SHARD_OVER_HBM = """\
optimizer: adagrad
tables:
  t: {vocabulary_size: 200000000, dim: 64, combiner: sum}
features:
  f: {table: t}
inputs: {batch: 256}
"""


@pytest.mark.slow  # libtpu compiles: the fast tier keeps test_small_config_fits_*.
def test_table_shard_larger_than_hbm_does_not_fit(config, capsys):
    code, out, err = _run(capsys, "--config", config(SHARD_OVER_HBM), "--topology", "v5e:2x2")
    assert code == 1, err
    assert "Traceback" not in err
    assert "DOES NOT FIT: over by" in out
    assert "try --topology v5e:2x4" in out
    assert "total                     23.84 GiB" in out  # Table and accumulators per chip.
    assert "one array alone exceeds HBM" in out


def test_batch_contradicting_output_shape(config, capsys):
    text = SMALL.replace("user: {table: users}", "user: {table: users, output_shape: [64, 8]}")
    code, out, err = _run(
        capsys, "--config", config(text), "--topology", "v5e:2x2", "--batch", "256"
    )
    assert code == 2 and not out, err
    assert "feature 'user': output_shape (64, 8) has 512 outputs, but batch 256 gives 256" in err
    assert "needs batch 512" in err


def test_batch_not_a_multiple_of_the_devices(config, capsys):
    code, out, err = _run(
        capsys, "--config", config(SMALL), "--topology", "v5e:2x2", "--batch", "1001"
    )
    assert code == 2 and not out
    assert "batch 1001 is not a multiple of the 4 devices of v5e:2x2" in err
    assert "use 1000 or 1004" in err


@pytest.mark.parametrize(
    "topology, message",
    [
        ("v5p:1x1x1", "topology 'v5p:1x1x1' is not known to libtpu"),
        ("v9:2x2", "generation 'v9' has no known HBM size"),
        ("v5p-8", "'v5p-8' is not of the form GENERATION:AxB[xC]"),
    ],
)
def test_unknown_topology(config, capsys, topology, message):
    code, out, err = _run(capsys, "--config", config(SMALL), "--topology", topology)
    assert code == 2 and not out
    assert message in err


@pytest.mark.parametrize(
    "inputs, message",
    [
        (
            "inputs: {batch: 512, ids_per_example: {nope: 3}}",
            "inputs.ids_per_example.nope: no such feature",
        ),
        (
            "inputs: {batch: 512, ids_per_example: {history: 0}}",
            "inputs.ids_per_example.history: must be an int > 0, got 0",
        ),
        ("inputs: {batch: -4}", "inputs.batch: must be an int > 0, got -4"),
        ("inputs: {batch: 512, lengths: {}}", "inputs.lengths: unknown key"),
        ("inputs: {}", "no batch: pass --batch B or set inputs.batch"),
    ],
)
def test_bad_inputs_section(config, capsys, inputs, message):
    text = SMALL.split("inputs:")[0] + inputs + "\n"
    code, out, err = _run(capsys, "--config", config(text), "--topology", "v5e:2x2")
    assert code == 2 and not out
    assert message in err


def test_bad_config_file(config, capsys):
    code, _, err = _run(
        capsys, "--config", config(SMALL.replace("dim: 64", "dim: -64")), "--topology", "v5e:2x2"
    )
    assert code == 2 and "tables.items.dim" in err
    code, _, err = _run(capsys, "--config", "/nonexistent/x.yaml", "--topology", "v5e:2x2")
    assert code == 2 and "no such config file" in err


def test_criteo_config_is_mlperf_dcnv2():
    config = jte.load_config(CRITEO)
    tables = config.spec.tables()
    assert len(tables) == 26 and len(config.spec.flat_features) == 26
    assert max(t.vocabulary_size or 0 for t in tables.values()) == 40_000_000
    assert sum(t.vocabulary_size or 0 for t in tables.values()) == 204_184_588
    assert {t.dim for t in tables.values()} == {128}
    assert isinstance(config.spec.optimizer, jte.Adagrad)
    batch, lengths = plan.read_inputs(config)
    assert batch == 4096 and sum(lengths.values()) == 214 and lengths["cat_20"] == 100


def test_routing_reports_the_rows_each_device_sends_each_owner_per_round():
    """From 32 chips the Criteo config's 26 tables are one stack routed to owners; the plan
    says how many distinct rows a device sends each owner per round (VMEM's cap on the
    default 2m/N), without compiling anything."""
    from jax_tpu_embed import _aot

    config = jte.load_config(CRITEO)
    _, lengths = plan.read_inputs(config)
    small = jte.Embedding(config.spec, _aot.mesh(_aot.topology("v5p:2x2x1")))
    assert {r["routing"] for r in plan.routes(small, 4096, lengths)} == {"gather"}
    emb = jte.Embedding(config.spec, _aot.mesh(_aot.topology("v5p:4x4x4")))
    (route,) = plan.routes(emb, 65536, lengths)
    m = 65536 // 64 * 214
    assert (route["routing"], len(route["tables"]), route["ids_per_device"]) == ("owner", 26, m)
    assert route["uncapped_rows_per_owner_and_round"] == 2 * m // 64
    assert 8 <= route["rows_per_owner_and_round"] < 2 * m // 64
    (line,) = plan._route_lines({"routing": [route]})
    assert "26 stacked tables" in line and "without the VMEM cap" in line, line


@pytest.mark.slow  # A subprocess of its own.
def test_module_entry_point(config):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_tpu_embed.plan",
            "--config",
            config(SMALL),
            "--topology",
            "v5p:1x1x1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "python -m jax_tpu_embed.plan: error: topology 'v5p:1x1x1'" in proc.stderr


def test_a_capacity_that_cannot_work_is_an_error(config, capsys):
    code, _, err = _run(
        capsys, "--config", config(SMALL), "--topology", "v5p:2x2x1", "--max-ids-per-shard", "0"
    )
    assert code == 2
    assert "max_ids_per_shard for table" in err and "got 0" in err


@pytest.mark.slow  # libtpu compiles: the fast tier keeps test_small_config_fits_*.
@pytest.mark.parametrize("placement", ["host", "{host_cached: {cache_rows: 4000000}}"])
def test_a_table_in_host_memory_fits_where_it_did_not(config, capsys, placement):
    """HUGE (23.8 GiB a v5e chip: DOES NOT FIT) with `placement: host` or a HostCached
    placement: it fits, its bytes are counted in host memory, not HBM (but its cache), and
    the host calls and their traffic are reported."""
    text = HUGE.replace("combiner: sum}", f"combiner: sum, placement: {placement}}}")
    code, out, err = _run(capsys, "--config", config(text), "--topology", "v5e:2x2", "--json")
    assert code == 0, err
    res = json.loads(out)
    c = res["per_chip"]
    cached = placement != "host"
    assert res["fits"] and res["tables"][0]["placement"] == ("host_cached" if cached else "host")
    assert c["host_bytes"] == 2 * 25_000_000 * 128 * 4  # The table and its accumulator.
    assert c["table_bytes"] == c["slot_bytes"] == 0
    # A million cached rows a chip: the table's and the accumulator's, 2 * 512 B each.
    assert c["cache_bytes"] == (1_000_000 * 2 * 512 * 1.01 if cached else 0) or (
        cached and 1_000_000 * 2 * 512 < c["cache_bytes"] < 1_000_000 * 2 * 512 * 1.02
    )
    assert max(c["total_bytes"], c["init_peak_bytes"]) < c["cache_bytes"] + 0.05 * c["hbm_bytes"]
    # Every step: host, the read `stage` makes and the write; HostCached, the write. The
    # lookup's and the update's reads of rows not in HBM run as the data needs.
    assert c["host_calls"] == 1 + (not cached) and c["host_device_bytes_per_step"] > 0
    assert c["host_miss_calls"] == 2 and c["host_miss_bytes_per_round"] > 0
    text_report = plan.format_table(res)
    assert ("(host, cached)" if cached else "(host)") in text_report
    assert "in host memory" in text_report
    assert ("host tables' caches" in text_report) == cached
