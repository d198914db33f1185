"""Multi-host training on JAX's own multi-controller runtime, on CPU.

Two worker processes (`_multihost_worker.py`), 4 CPU devices each, join one JAX job through
`jax.distributed.initialize` on 127.0.0.1 with gloo collectives and train over a mesh of all 8
devices; each process feeds only its rows of every global batch. Process 0 writes the exported
tables, slots and activations of every case; they must equal the same training run here, in one
process with 8 devices (conftest). The reference is computed while the workers run.
"""

import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import _multihost_worker as worker  # tests/ is on sys.path (rootdir conftest).
import jax_tpu_embed as jte
from criteo_files import write_criteo
from jax_tpu_embed import _multihost as multihost
from test_data import reference

# strategy:mesh[:inputs[:start[:routing]]] (see worker.train). Each strategy runs on an
# Explicit and an Auto mesh; "interleaved" gives each process non-contiguous rows of the
# batch; "numpy" feeds every process the whole global batch as NumPy arrays instead of its
# rows as global jax.Arrays; "restore" starts from restore_tables instead of init (and saves
# compiles); "owner" routes ids to their rows' owners across the processes (all_to_all over
# gloo); "host" puts every table in the processes' host memory (placement="host"), drawn there
# by init; "cached" there too, with a HostCached cache smaller than a batch, prefetching.
# "criteo": jte.data.criteo over two files, one per process (worker.read_criteo).
CASES = (
    "div:explicit",
    "mod:auto",
    "div:interleaved:local:restore",
    "mod:explicit:numpy:restore",
    "div:explicit:local:restore:owner",
    "mod:explicit:local:init:owner:host",
    "div:auto:local:init:gather:cached",
)
# checkpoint:strategy:mesh:placement[:sizes] (worker.checkpoint_roundtrip): tables of V a
# multiple of 8 (or not: "uneven") saved by both processes and restored. "div" in host
# memory with V a multiple of 8 converts shard by shard on each process's host; other host
# tables cross between the processes in pieces; device tables convert on the devices.
CHECKPOINT_CASES = (
    "checkpoint:div:explicit:host",
    "checkpoint:mod:auto:host",
    "checkpoint:div:explicit:host:uneven",
    "checkpoint:div:auto:device",
)
# "agree" first: it is the fast tier's only case, and the workers are stopped once the
# module's tests are done, so the fast tier does not wait for (or pay for) the others.
JOB_CASES = ("agree",) + CASES + ("criteo",) + CHECKPOINT_CASES
NUM_PROCESSES = 2

# One job (the module fixture `job`) serves every case: the module runs on one pytest-xdist
# worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("multihost")
# The whole job: a bound that catches a hang, not a time to meet. Its cases take about 160 s
# of each worker on 2 cores shared with another pytest worker; 180 s once ran out there.
JOB_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # Loopback only.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parents[1])  # In case the package is not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    return env


class _Job:
    """The two worker processes; results are read per case as process 0 writes them."""

    def __init__(self, out: Path, cases=JOB_CASES):
        self.out, self.deadline = out, time.monotonic() + JOB_TIMEOUT_S
        port, env = _free_port(), _worker_env()
        script = Path(__file__).with_name("_multihost_worker.py")
        self.logs = [out / f"worker{i}.log" for i in range(NUM_PROCESSES)]
        self.procs = []
        for i, log in enumerate(self.logs):
            with open(log, "wb") as f:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(script),
                            "--port",
                            str(port),
                            "--process-id",
                            str(i),
                            "--num-processes",
                            str(NUM_PROCESSES),
                            "--out",
                            str(out),
                            "--cases",
                            ",".join(cases),
                        ],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                    )
                )

    def _fail(self, why: str):
        self.stop()
        tails = "\n".join(
            f"--- worker {i} (rc={p.returncode}) ---\n" + _tail(log)
            for i, (p, log) in enumerate(zip(self.procs, self.logs))
        )
        pytest.fail(f"{why}\n{tails}")

    def _check_alive(self, waiting_for: str):
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            self._fail(f"a worker failed while waiting for {waiting_for}")
        if time.monotonic() > self.deadline:
            self._fail(f"timed out after {JOB_TIMEOUT_S}s waiting for {waiting_for}")
        return codes

    def result(self, case: str) -> dict:
        path = self.out / (case.replace(":", "_") + ".npz")
        while not path.exists():
            if all(c == 0 for c in self._check_alive(f"case {case}")):
                self._fail(f"the workers exited without writing {path.name}")
            time.sleep(0.1)
        with np.load(path) as data:
            return dict(data)

    def wait_exit(self):
        while any(c is None for c in self._check_alive("the workers to exit")):
            time.sleep(0.1)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)


def _tail(path: Path, chars: int = 6000) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if "[Gloo]" not in line)[-chars:] or "(empty)"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost")
    for i in range(NUM_PROCESSES):  # One Criteo file per process, for the "criteo" case.
        write_criteo(out / f"criteo_{i}.tsv", 40, seed=10 + i)
    j = _Job(out)
    yield j
    j.stop()


# "host": the dynamic table's rows and slots in the processes' host memory.
DYNAMIC_CASES = (
    "dynamic:explicit",
    "dynamic:auto:local:init:owner",
    "dynamic:explicit:local:init:gather:host",
)


@pytest.fixture(scope="module")
def dynamic_job(tmp_path_factory):
    """A second 2-process job for the dynamic-table cases (slow tier only: the fast tier
    never starts it)."""
    j = _Job(tmp_path_factory.mktemp("multihost_dynamic"), DYNAMIC_CASES)
    yield j
    j.stop()


@pytest.mark.slow
@pytest.mark.parametrize("case", DYNAMIC_CASES)
def test_dynamic_tables_two_processes_match_one(dynamic_job, case, tmp_path):
    """A dynamic table (int64 ids as split halves, global jax.Arrays fed per process, LRU
    evicting every step) and a second one (lfu), stacked in one array with owner routing,
    on 2 processes x 4 devices: the same resident ids, counters, rows and slots as one
    process with 8 devices, both exchanges; a checkpoint saved and restored there holds
    them bit for bit, onto the same capacity and onto twice it; rows read in pieces
    through the devices (`multihost.to_host`) are the same."""
    want = worker.train(*case.split(":"), directory=str(tmp_path / "one"))
    got = dynamic_job.result(case)
    # The 2-process save, written by each process for its own 4 shards, in one process: on
    # 8 devices each shard reads its block, on 2 its 4 blocks; with another capacity too,
    # and the entries then travel to their new shards.
    import orbax.checkpoint as ocp

    from conftest import make_mesh
    from jax_tpu_embed import checkpoint

    saved = dynamic_job.out / case.replace(":", "_")
    parts = case.split(":")
    routing, placement = (parts + ["local", "init", "auto", "device"][len(parts) - 2 :])[4:]
    (step,) = checkpoint.all_steps(saved)
    info = ocp.JsonCheckpointHandler().restore(saved / str(step) / "metadata")
    info = info["dynamic"]["users"]
    assert len(info["blocks"]["ids"]) == 8 and sum(info["blocks"]["ids"]) == len(got["ids"])
    for n, capacity in ((8, 64), (2, 64), (2, 128)):
        emb = worker.dynamic_embedding(make_mesh(n), routing, placement, capacity)
        assert checkpoint._by_shard(emb, "users", [info]) == (capacity == 64)
        restored, _ = checkpoint.restore(saved, emb)
        np.testing.assert_array_equal(emb.export(restored)["users"].ids, got["ids"])
        np.testing.assert_array_equal(emb.export(restored)["users"].rows, got["rows"])
        acc = emb.export_slots(restored)["users"]["accumulators"].rows
        np.testing.assert_array_equal(acc, got["acc"])
        np.testing.assert_array_equal(emb.export(restored)["items"].rows, got["items/rows"])
    assert sorted(got) == sorted(want)
    assert int(want["stats/evicted"]) > 0 and int(want["stats/items/evicted"]) > 0
    np.testing.assert_array_equal(got["ids"], want["ids"])
    for key in ("ids", "rows", "acc", "items/ids", "items/rows"):  # Restored: bit for bit.
        np.testing.assert_array_equal(got[f"restored/{key}"], got[key], err_msg=key)
    for key in ("ids", "rows", "acc"):  # Onto twice the capacity, on 2 processes.
        np.testing.assert_array_equal(got[f"larger/{key}"], got[key], err_msg=key)
    for key in sorted(want):
        if key.startswith("stats/") or key.endswith("ids"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_processes_match_one(job, case):
    want = worker.train(*case.split(":"))  # This process: 8 devices, one controller.
    got = job.result(case)
    assert sorted(got) == sorted(want)
    for key in sorted(want):
        if key.startswith("meta/"):  # Facts of the 2-process run, checked below.
            continue
        # Tables and slots come out bit-identical; activations of combined features may
        # differ in the last bit (cross-process reduction order of the partial sums).
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key)

    rows = got["meta/rows"]  # (processes, b): the rows each process fed.
    per_shard = worker.B // 8
    blocks = [r.reshape(-1, per_shard)[:, 0] // per_shard for r in rows]  # Mesh positions.
    if case.split(":")[1] == "interleaved":
        assert [b.tolist() for b in blocks] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    else:
        assert [b.tolist() for b in blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    np.testing.assert_array_equal(np.sort(rows.ravel()), np.arange(worker.B))
    if case.split(":")[2:3] == ["numpy"]:  # Only the global batch passes the NumPy check.
        assert got["meta/same_check"].tolist() == [False, True]


@pytest.mark.slow
@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_checkpoints_of_two_processes(job, case, tmp_path):
    """A checkpoint saved by 2 processes x 4 devices restores there bit for bit, holds what
    one process with 8 devices trains, and restores in one process, on 8 devices and on 2
    (in device memory). Host tables of "div" with V a multiple of N are converted on each
    process's host, shard by shard; other host tables pass between the processes in pieces;
    device tables are converted on the devices."""
    from jax_tpu_embed import checkpoint

    _, strategy, mesh_kind, placement, *sizes = case.split(":")
    got = job.result(case)
    saved = {k[len("saved/") :]: v for k, v in got.items() if k.startswith("saved/")}
    restored = {k: v for k, v in got.items() if k.startswith(("table/", "slot/"))}
    assert sorted(saved) == sorted(restored) and saved
    for key in saved:  # Restored on the 2 processes: bit for bit.
        np.testing.assert_array_equal(restored[key], saved[key], err_msg=key)
    how = "devices" if placement == "device" else "shards" if strategy == "div" else "pieces"
    how = "pieces" if sizes == ["uneven"] else how
    assert got["meta/how"].tolist() == [how] * 3
    want = worker.checkpoint_roundtrip(
        strategy, mesh_kind, placement, str(tmp_path / "one"), *sizes
    )
    for key in saved:  # Trained by one process: the same values.
        np.testing.assert_allclose(saved[key], want[f"saved/{key}"], rtol=1e-6, atol=1e-6)
    directory = job.out / case.replace(":", "_")
    for devices, where in ((8, placement), (2, "device")):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("shard",))
        spec = worker.make_spec_placed(
            strategy, where, worker.SIZES if sizes else worker.EVEN_SIZES
        )
        emb = jte.Embedding(spec, mesh)
        state, _ = checkpoint.restore(directory, emb)
        for name, table in emb.export(state).items():
            np.testing.assert_array_equal(table, saved[f"table/{name}"], err_msg=name)
        for name, slots in emb.export_slots(state).items():
            for slot, value in slots.items():
                np.testing.assert_array_equal(value, saved[f"slot/{name}/{slot}"])


@pytest.mark.slow
def test_each_process_reads_its_own_criteo_file(job):
    """Process p reads criteo_p.tsv and its rows land at its devices' positions of each
    global batch (rows [0, 8) from process 0, [8, 16) from process 1 on the explicit mesh)."""
    got = job.result("criteo")
    assert got["meta/files"].ravel().tolist() == [0, 1]
    half = worker.CRITEO_BATCH // 2
    want = [
        reference(
            write_criteo(job.out / f"check_{i}.tsv", 40, seed=10 + i), vocab=worker.CRITEO_VOCAB
        )
        for i in range(NUM_PROCESSES)
    ]
    assert sorted(k for k in got if k.startswith("labels/")) == [f"labels/{i}" for i in range(5)]
    for i in range(5):
        rows = slice(i * half, (i + 1) * half)
        for k, key in enumerate(("labels", "dense", "ids")):
            expected = np.concatenate([w[k][rows] for w in want])
            np.testing.assert_allclose(got[f"{key}/{i}"], expected, rtol=1e-6, err_msg=key)


def test_a_failure_on_one_process_raises_on_every_process(job):
    """A restore's check that fails on process 1's own blocks alone (`_guards.
    on_every_process`): process 0 raises the same kind of error, naming process 1, and
    both then reach the next collective."""
    got = job.result("agree")
    assert str(got["raised"]) == "CheckpointCorruptError"
    assert str(got["message"]) == "restore: processes [1] failed (their errors say why)."
    assert got["after"].ravel().tolist() == [7, 7]


@pytest.mark.slow
def test_workers_exit_cleanly(job):
    job.wait_exit()


# ----------------------------------------------------- the helpers in a single process


def _emb(num_shards: int, kind: str = "auto"):
    devices = jax.devices()[:num_shards]
    mesh = (
        jax.make_mesh((num_shards,), ("shard",), devices=devices)
        if kind == "explicit"
        else jax.sharding.Mesh(np.array(devices), ("shard",))
    )
    return jte.Embedding(worker.make_spec("div"), mesh)


def test_process_batch_rows_single_process_is_everything():
    np.testing.assert_array_equal(multihost.process_batch_rows(_emb(4), 12), np.arange(12))


@pytest.mark.parametrize("batch", [0, 6, -4])
def test_process_batch_rows_rejects_batches_the_mesh_cannot_split(batch):
    with pytest.raises(
        ValueError, match=f"global_batch={batch} must be a positive multiple of the mesh size 4"
    ):
        multihost.process_batch_rows(_emb(4), batch)


def test_global_batch_shards_every_leaf_over_the_axis():
    emb = _emb(8, "explicit")
    features, grads = worker.global_step_data(0)
    got = multihost.global_batch(emb, {"features": features, "grads": grads})
    assert isinstance(got["features"]["multi"], jte.Weighted)
    for leaf in [got["features"]["one"], got["features"]["multi"].weights, got["grads"]["seq"]]:
        assert leaf.sharding.spec == P("shard")
        assert len(leaf.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(got["grads"]["seq"]), grads["seq"])


def test_global_batch_rejects_scalars():
    with pytest.raises(ValueError, match="every leaf needs a batch dimension"):
        multihost.global_batch(_emb(2), {"step": np.float32(1.0)})


def test_same_on_every_process_check_is_a_no_op_in_one_process():
    multihost.check_same_on_every_process({"ids": np.arange(4), "w": [1.0, 2.0]})


@pytest.mark.parametrize("through_devices", [True, False])
@pytest.mark.parametrize("shards,replicas", [(1, 1), (2, 1), (4, 2), (8, 1)])
def test_exchange_brings_each_shard_the_entries_sent_to_it(shards, replicas, through_devices):
    """`multihost.exchange` (restore onto another capacity routes entries to their new
    owners through it): every shard receives exactly the entries sent to it, each once and
    whole (int64 ids, float32 rows, int32 values), from every source: through the devices
    (as several processes do), with rounds forced by a small chunk, replicas of a shard
    along another mesh axis receiving the same and the padding (-1's words) never arriving
    as an entry; or regrouped in this one process. Each shard's in ascending id order; the
    fields given are let go of (emptied)."""
    devices = np.array(jax.devices()[: shards * replicas]).reshape(shards, replicas)
    mesh = jax.sharding.Mesh(devices, ("shard", "data"))
    emb = types.SimpleNamespace(mesh=mesh, axis="shard", num_shards=shards)
    rng = np.random.default_rng(shards)
    sent = {}
    for k in range(shards):
        n = int(rng.integers(1, 40)) if k else 0  # Shard 0 sends nothing.
        ids = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
        ids[: n // 3] = (ids[: n // 3] & 0xFFFFFFFF) | -(2**32)  # Half of -1's words.
        fields = {
            "ids": ids,
            "rows": rng.normal(size=(n, 3)).astype(np.float32),
            "count": rng.integers(-5, 5, n).astype(np.int32),
        }
        sent[k] = fields, rng.integers(0, shards, n)
    given = {k: (dict(fields), dest) for k, (fields, dest) in sent.items()}
    chunk = 3 * shards * 6 * 4  # 3 entries of 6 words a pair and round.
    got = multihost.exchange(emb, sent, chunk_bytes=chunk, through_devices=through_devices)
    assert sorted(got) == list(range(shards))
    assert all(not fields for fields, _ in sent.values())
    for k in range(shards):
        assert got[k]["ids"].dtype == np.int64 and got[k]["rows"].shape[1:] == (3,)
        assert (np.diff(got[k]["ids"]) > 0).all()
        entries = lambda f: [(i, tuple(r), c) for i, r, c in zip(f["ids"], f["rows"], f["count"])]
        want = sorted(
            e for fields, dest in given.values() for e, d in zip(entries(fields), dest) if d == k
        )
        assert entries(got[k]) == want, k
