"""Dynamic tables through jte.checkpoint, jte.flax and jte.serving: saved in logical form
(ids, rows, slots, scores, filter, key, counters) and restored onto any mesh and capacity
that holds them; a flax model trains one; a Server answers what Embedding.lookup does."""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _dynamic, _hashindex, checkpoint

DIM = 4


def spec_of(dynamic, optimizer=None, strategy="div"):
    users = jte.TableConfig(dim=DIM, combiner="mean", name="users", dynamic=dynamic)
    items = jte.TableConfig(vocabulary_size=16, dim=DIM, name="items")
    return jte.EmbeddingSpec(
        features={
            "user": jte.FeatureConfig(users),  # Multi-hot, weighted.
            "hist": jte.FeatureConfig(users, max_sequence_length=2),  # Same table, sequence.
            "item": jte.FeatureConfig(items),
        },
        optimizer=optimizer or jte.Adagrad(learning_rate=0.3),
        partition_strategy=strategy,
    )


def stream(seed, steps, batch=16, pool_size=120):
    """(features, activation gradients) per step: power-law ids over the whole int64 range
    (negatives too), with duplicates and -1 padding."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**63), 2**63 - 1, size=pool_size, dtype=np.int64)
    pool[:2] = [0, -7]
    out = []
    for _ in range(steps):
        rank = np.minimum(rng.zipf(1.2, size=(batch, 5)), pool_size) - 1
        ids = pool[rank]
        ids[rng.random(ids.shape) < 0.2] = -1
        feats = {
            "user": jte.Weighted(ids[:, :3], rng.uniform(0.5, 2, (batch, 3)).astype(np.float32)),
            "hist": ids[:, 3:],
            "item": rng.integers(0, 16, size=(batch,)).astype(np.int32),
        }
        grads = {
            "user": rng.normal(size=(batch, DIM)).astype(np.float32),
            "hist": rng.normal(size=(batch, 2, DIM)).astype(np.float32),
            "item": rng.normal(size=(batch, DIM)).astype(np.float32),
        }
        out.append((feats, grads))
    return out


def train(emb, state, steps):
    for feats, grads in steps:
        state = emb.apply_gradients(state, feats, grads)
    return state


def stats(emb, state):
    return jax.tree.map(int, emb.dynamic_stats(state))


# ------------------------------------------------------------------------- checkpoints


# Too small for the stream: LRU evicts, TTL expires, min_count rejects (a filter to save).
TTL = 5
DYNAMIC = jte.DynamicTable(capacity=32, bucket_size=4, eviction="lru", ttl_steps=TTL, min_count=2)


SAVED_AT = 7


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of 7 steps on 8 devices, and what the run it was cut from gives: the
    state's exports and counters then, and after 4 more steps."""
    path = tmp_path_factory.mktemp("dynamic")
    steps = stream(0, SAVED_AT + 4)
    emb = jte.Embedding(spec_of(DYNAMIC), make_mesh(8))
    state = train(emb, emb.init(jax.random.key(0)), steps[:SAVED_AT])
    s = stats(emb, state)["users"]
    assert s["evicted"] > 0 and s["rejected"] > 0 and s["expired"] > 0
    assert s["held"] > s["occupancy"]  # An expired id still holds its slot: saved too.
    checkpoint.save(path, emb, state)
    then = Snapshot(emb, state)
    state = train(emb, state, steps[SAVED_AT:])
    return path, steps, then, Snapshot(emb, state), (emb, state)


class Snapshot:
    """What a state shows: exports, slots, counters, step, and its index's held entries."""

    def __init__(self, emb, state):
        self.tables, self.slots = emb.export(state), emb.export_slots(state)
        self.stats, self.step = stats(emb, state), int(state.step)
        self.key = np.asarray(state.index["users"].key)

    def assert_equals(self, other, exact=False):
        rtol, atol = (0.0, 0.0) if exact else (1e-6, 1e-7)
        a, b = self.tables, other.tables
        np.testing.assert_array_equal(a["users"].ids, b["users"].ids)
        np.testing.assert_allclose(a["users"].rows, b["users"].rows, rtol=rtol, atol=atol)
        np.testing.assert_allclose(a["items"], b["items"], rtol=rtol, atol=atol)
        for name, x in self.slots["users"].items():
            y = other.slots["users"][name]
            np.testing.assert_array_equal(x.ids, y.ids)
            np.testing.assert_allclose(x.rows, y.rows, rtol=rtol, atol=atol)
        assert self.stats == other.stats
        assert self.step == other.step
        np.testing.assert_array_equal(self.key, other.key)


def test_checkpoint_restores_onto_another_mesh_and_continues_the_same(saved):
    """8 devices, "div" -> 2 devices, "mod", lane-packed (Adagrad's accumulator riding in
    the table's rows): the restored state shows what the saved one did, and 4 more steps give
    what the uninterrupted run gave (the same ids resident, the same counters: scores, the
    admission filter, the key and the counters came back)."""
    path, steps, then, after, (saving, _) = saved
    emb = jte.Embedding(spec_of(DYNAMIC, strategy="mod"), make_mesh(2), lane_width=128)
    assert len(emb.storage("users").riders) == 1
    for onto in (emb, saving):  # Each shard reads 4 blocks, then its own.
        state, _ = checkpoint.restore(path, onto)
        Snapshot(onto, state).assert_equals(then, exact=True)
        state = train(onto, state, steps[SAVED_AT:])
        Snapshot(onto, state).assert_equals(after)


def test_checkpoint_item_is_the_logical_form(saved):
    """The dynamic item, read by plain orbax: block k of each array holds shard k's entries
    (the 8 saving shards): its held ids ascending ((hi, lo) uint32 words, -1 padding),
    their rows and slots, scores, filter and counters; the key; the metadata records the
    config and each block's counts. Together the blocks hold every held id once."""
    path, _, then, _, (emb, _) = saved
    item = ocp.StandardCheckpointer().restore(path / str(SAVED_AT) / "dynamic")["users"]
    item = jax.tree.map(np.asarray, item)
    meta = ocp.JsonCheckpointHandler().restore(path / str(SAVED_AT) / "metadata")
    info = meta["dynamic"]["users"]
    assert "users" not in meta["tables"] and "items" in meta["tables"]
    assert info["config"]["capacity"] == 32 and info["config"]["min_count"] == 2
    blocks = info["blocks"]
    assert info["ids"] == then.stats["users"]["held"] == sum(blocks["ids"])
    assert len(blocks["ids"]) == 8 == item["ids"].shape[0] and item["ids"].dtype == np.uint32

    def ids(words):
        return jte.join_ids(jte.SplitIds(words[..., 0], words[..., 1]))

    config = emb.dynamic["users"].index
    every = []
    for k, n in enumerate(blocks["ids"]):
        mine = ids(item["ids"][k])
        assert np.all(mine[n:] == -1) and np.all(np.diff(mine[:n]) > 0)
        bucket = np.asarray(_hashindex.global_bucket(config, *_hashindex.split_ids(mine[:n])))
        assert np.all(bucket // (config.buckets // 8) == k)  # Shard k's own ids.
        assert blocks["changed"][k] == n  # A full save: rows of every id.
        np.testing.assert_array_equal(ids(item["changed"][k])[:n], mine[:n])
        every.append((mine[:n], item["rows"][k][:n], item["slots"]["accumulators"][k][:n]))
        assert np.all(item["last"][k][:n] <= SAVED_AT) and np.all(item["count"][k][:n] >= 1)
        filtered = ids(item["filter_ids"][k])[: blocks["filter_ids"][k]]
        bucket = np.asarray(_hashindex.global_bucket(config, *_hashindex.split_ids(filtered)))
        assert np.all(bucket // (config.buckets // 8) == k)  # The filter's too.
    held, rows, acc = (np.concatenate(x) for x in zip(*every))
    order = np.argsort(held)
    held, rows, acc = held[order], rows[order], acc[order]
    live = then.tables["users"]
    where = np.searchsorted(held, live.ids)
    np.testing.assert_array_equal(held[where], live.ids)
    np.testing.assert_array_equal(rows[where], live.rows)
    np.testing.assert_array_equal(acc[where], then.slots["users"]["accumulators"].rows)
    last = np.concatenate([item["last"][k][:n] for k, n in enumerate(blocks["ids"])])[order]
    assert np.all(last[where] > SAVED_AT - TTL)  # Live: not expired.
    np.testing.assert_array_equal(item["key"], then.key)
    counters = dict(zip(info["counters"], item["counters"].sum(0).tolist()))
    assert all(counters[k] == v for k, v in then.stats["users"].items() if k in counters)
    filtered = [item["filter_count"][k][:n] for k, n in enumerate(blocks["filter_ids"])]
    assert info["filter_ids"] > 0 and np.all(np.concatenate(filtered) >= 1)


@pytest.mark.parametrize("n,capacity", [(6, 96), pytest.param(8, 96, marks=pytest.mark.slow)])
def test_checkpoint_restores_onto_another_capacity_each_shard_reading_a_share(saved, n, capacity):
    """Into another capacity (other buckets) each shard reads a share of the saved blocks
    and the devices send every entry to the shard that owns it now (`multihost.exchange`):
    on 6 devices two groups of 3 shards read 4 blocks each, a third each (6 neither divides
    8 nor is divided by it); on 8 each shard reads its own block (on 2, four: the larger
    capacity test). The same live ids, rows, slots, scores, filter and counters as saved."""
    path, _, then, _, _ = saved
    dynamic = dataclasses.replace(DYNAMIC, capacity=capacity)
    emb = jte.Embedding(spec_of(dynamic), make_mesh(n))
    info = ocp.JsonCheckpointHandler().restore(path / str(SAVED_AT) / "metadata")
    assert not checkpoint._by_shard(emb, "users", [info["dynamic"]["users"]])
    state, _ = checkpoint.restore(path, emb)
    Snapshot(emb, state).assert_equals(then, exact=True)


@pytest.mark.parametrize("through_devices", [True, False])
def test_routed_entries_reach_their_shards_in_rounds(through_devices):
    """`checkpoint._routed`, through the devices (what several processes do) in rounds of
    a few rows (an id with its scores is 4 words, a
    changed id with its row and two slots 2 + 3·DIM, so the kinds take different rounds):
    each of 4 shards receives exactly the entries of the ids in its buckets, each kind in
    ascending id order, every field beside its own id; shares' counters stay where they
    were. And in one process, regrouped on the host."""
    emb = jte.Embedding(spec_of(dataclasses.replace(DYNAMIC, capacity=96)), make_mesh(4))
    config = emb.dynamic["users"].index
    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, 90, dtype=np.int64))
    rng.shuffle(ids)
    n = len(ids)
    every: dict[str, Any] = {
        "ids": ids,
        "last": rng.integers(0, 9, n).astype(np.int32),
        "count": rng.integers(1, 9, n).astype(np.int32),
        "changed": ids[::-1].copy(),  # Another order than the ids'.
        "rows": rng.normal(size=(n, DIM)).astype(np.float32),
        "slots": {
            "b": rng.normal(size=(n, DIM)).astype(np.float32),
            "a": rng.normal(size=(n, DIM)).astype(np.float32),
        },
        "filter_ids": ids[: n // 3],
        "filter_count": rng.integers(1, 3, n // 3).astype(np.int32),
        "key": np.array([1, 2], np.uint32),
    }
    parts = {}
    for k in range(4):  # Shard k sent the k-th quarter of every kind.
        cut = lambda x, k=k: np.array_split(x, 4)[k]
        part = {f: cut(v) for f, v in every.items() if f not in ("slots", "key")}
        slots = {s: cut(v) for s, v in every["slots"].items()}
        parts[k] = {**part, "slots": slots, "key": every["key"], "counters": {"admitted": 10 + k}}
    words = 2 + 3 * DIM  # A changed id's; a round: 5 of them a pair, more ids or filter entries.
    chunk = 5 * 4 * 4 * words
    got = checkpoint._routed(
        emb, "users", parts, chunk_bytes=chunk, through_devices=through_devices
    )
    owner = np.asarray(_hashindex.global_bucket(config, *jte.split_ids(ids))) // (
        config.buckets // 4
    )
    of = {int(i): j for j, i in enumerate(ids)}
    for k in range(4):
        mine = np.sort(ids[owner == k])
        assert 0 < len(mine) < n
        at = [of[int(i)] for i in mine]
        g = got[k]
        np.testing.assert_array_equal(g["ids"], mine)
        np.testing.assert_array_equal(g["last"], every["last"][at])
        np.testing.assert_array_equal(g["count"], every["count"][at])
        np.testing.assert_array_equal(g["changed"], mine)
        back = {int(i): j for j, i in enumerate(every["changed"])}
        rows_at = [back[int(i)] for i in mine]
        np.testing.assert_array_equal(g["rows"], every["rows"][rows_at])
        for s in ("a", "b"):
            np.testing.assert_array_equal(g["slots"][s], every["slots"][s][rows_at])
        filtered = np.sort(every["filter_ids"][owner[: n // 3] == k])
        np.testing.assert_array_equal(g["filter_ids"], filtered)
        f_at = [of[int(i)] for i in filtered]
        np.testing.assert_array_equal(g["filter_count"], every["filter_count"][f_at])
        assert g["counters"] == {"admitted": 10 + k}
        np.testing.assert_array_equal(g["key"], every["key"])


def test_incremental_saves_restore_through_the_chain(tmp_path):
    """A full save at step 4, then saves since 4 (at 7) and since 7 (at 10), on 4 devices:
    each incremental save holds rows of fewer ids than it lists, and each step restores on
    2 devices to exactly what the run showed then (ids evicted or expired in between are
    gone, the others keep their rows). A broken chain, or a since_step that is not an
    earlier step, is a clear error."""
    import shutil

    steps = stream(3, 10)
    emb = jte.Embedding(spec_of(DYNAMIC), make_mesh(4))
    state = train(emb, emb.init(jax.random.key(0)), steps[:4])
    checkpoint.save(tmp_path, emb, state)
    snapshots = {}
    for since, until in ((4, 7), (7, 10)):
        state = train(emb, state, steps[since:until])
        checkpoint.save(tmp_path, emb, state, since_step=since)
        snapshots[until] = Snapshot(emb, state)
    s = stats(emb, state)["users"]
    assert s["evicted"] > 0 and s["expired"] > 0
    small = jte.Embedding(spec_of(DYNAMIC, strategy="mod"), make_mesh(2))
    larger = jte.DynamicTable(**{**vars(DYNAMIC), "capacity": 64})
    # Shards reading 2 blocks each, 1 block each, half a block each; onto another capacity,
    # 2 blocks each whose entries go to their new shards.
    ontos = [small, emb, jte.Embedding(spec_of(DYNAMIC), make_mesh(8))]
    ontos.append(jte.Embedding(spec_of(larger), make_mesh(2)))
    infos = []
    for step in (4, 7, 10):
        info = ocp.JsonCheckpointHandler().restore(tmp_path / str(step) / "metadata")
        infos.append(info["dynamic"]["users"])
        if step == 4:
            continue
        assert info["since_step"] == step - 3
        users = info["dynamic"]["users"]
        assert 0 < users["changed"] < users["ids"], users
        for onto in ontos:
            restored, _ = checkpoint.restore(tmp_path, onto, step=step)
            Snapshot(onto, restored).assert_equals(snapshots[step], exact=True)
    assert [checkpoint._by_shard(e, "users", infos) for e in ontos] == [True] * 3 + [False]

    state = train(emb, state, steps[:1])  # Step 11.
    with pytest.raises(ValueError, match=r"since_step=5 must be an earlier step of .*\[4, 7, 10\]"):
        checkpoint.save(tmp_path, emb, state, since_step=5)
    with pytest.raises(ValueError, match=r"since_step=11 must be an earlier step .*step 11"):
        checkpoint.save(tmp_path, emb, state, since_step=11)
    with pytest.raises(ValueError, match=r"since_step must be an int or None, got '7'"):
        checkpoint.save(tmp_path, emb, state, since_step="7")  # type: ignore[arg-type]
    shutil.rmtree(tmp_path / "7")
    with pytest.raises(
        checkpoint.CheckpointCorruptError, match=r"saved on top of step 7 \(since_step\)"
    ):
        checkpoint.restore(tmp_path, emb, step=10)


@pytest.mark.slow
def test_bfloat16_rows_continue_the_same_after_a_restore(tmp_path):
    """A bfloat16 table rounds its new rows stochastically, with bits keyed by the rows they
    are stored in. A restore puts every id back in the lane of its bucket it was saved in
    (the index comes back as it was), so a run continued from a restored state (a full save,
    then one on top of it) gives the uninterrupted run's bits, on the same mesh and on
    another with the same buckets. Into other buckets (twice the capacity) the lanes are
    left out and the same ids and rows come back."""
    rounded = jte.DynamicTable(capacity=32, bucket_size=4, eviction="lfu")
    users = jte.TableConfig(
        dim=DIM, combiner="mean", name="users", dynamic=rounded, dtype=jnp.bfloat16
    )

    def spec(capacity=32):
        table = dataclasses.replace(users, dynamic=dataclasses.replace(rounded, capacity=capacity))
        base = spec_of(rounded)
        features = {
            k: dataclasses.replace(f, table=table) if f.table.name == "users" else f
            for k, f in base.features.items()
        }
        return jte.EmbeddingSpec(features, base.optimizer)

    steps = stream(5, 9)
    emb = jte.Embedding(spec(), make_mesh(4))
    assert emb.table_plans["users"].config.stochastic_rounding
    state = train(emb, emb.init(jax.random.key(0)), steps[:3])
    checkpoint.save(tmp_path, emb, state)
    state = train(emb, state, steps[3:6])
    checkpoint.save(tmp_path, emb, state, since_step=3)
    then = Snapshot(emb, state)
    assert then.stats["users"]["evicted"] > 0
    keys = np.asarray(state.index["users"].index.keys)
    after = Snapshot(emb, train(emb, state, steps[6:]))
    for onto in (emb, jte.Embedding(spec(), make_mesh(2))):
        restored, _ = checkpoint.restore(tmp_path, onto)
        Snapshot(onto, restored).assert_equals(then, exact=True)
        if onto is emb:
            np.testing.assert_array_equal(np.asarray(restored.index["users"].index.keys), keys)
        Snapshot(onto, train(onto, restored, steps[6:])).assert_equals(after, exact=True)
    larger = jte.Embedding(spec(64), make_mesh(2))
    restored, _ = checkpoint.restore(tmp_path, larger)
    Snapshot(larger, restored).assert_equals(then, exact=True)


def test_checkpoint_saved_in_the_background_holds_the_state_it_was_given(tmp_path):
    """save(blocking=False) returns with the dynamic item in host memory: the state's
    arrays may be deleted (as a donating step does) before orbax writes, and the restore
    shows the state as it was."""
    emb = jte.Embedding(spec_of(DYNAMIC), make_mesh(4))
    state = train(emb, emb.init(jax.random.key(0)), stream(5, 6))
    then = Snapshot(emb, state)
    checkpoint.save(tmp_path, emb, state, blocking=False)
    for x in jax.tree.leaves(state):
        x.delete()
    checkpoint.wait()
    restored, _ = checkpoint.restore(tmp_path, emb)
    Snapshot(emb, restored).assert_equals(then, exact=True)


def _saved_on_two_shards(tmp_path):
    """(embedding on 2 shards, its trained state's Snapshot, the step's directory, its
    dynamic item "users" as NumPy, its metadata) of a checkpoint saved under tmp_path."""
    import json

    emb = jte.Embedding(spec_of(DYNAMIC), make_mesh(2))
    state = train(emb, emb.init(jax.random.key(0)), stream(1, 6))
    where = tmp_path / str(checkpoint.save(tmp_path, emb, state))
    item = ocp.StandardCheckpointer().restore(where / "dynamic")["users"]
    meta = json.loads((where / "metadata" / "metadata").read_text())
    return emb, Snapshot(emb, state), where, jax.tree.map(np.asarray, item), meta


def _rewrite(where, item: dict, meta: dict):
    """The step at `where` with its dynamic item "users" and its metadata replaced."""
    import json
    import shutil

    shutil.rmtree(where / "dynamic")
    with ocp.StandardCheckpointer() as writer:
        writer.save(where / "dynamic", {"users": item})
    (where / "metadata" / "metadata").write_text(json.dumps(meta))


def test_checkpoint_written_before_blocks_restores(tmp_path):
    """A dynamic item saved as saves wrote it before blocks (flat arrays: ids int64
    ascending, one entry per id, the counters summed; no "blocks" in the metadata)
    restores to the state it holds."""
    emb, then, where, item, meta = _saved_on_two_shards(tmp_path)
    info = meta["dynamic"]["users"]
    blocks = info.pop("blocks")
    del info["seed"], info["filter_bucket_size"], info["lanes"]

    def flat(value, counts):
        if value.dtype == np.uint32:  # (hi, lo) words.
            value = jte.join_ids(jte.SplitIds(value[..., 0], value[..., 1]))
        return np.concatenate([value[k][:c] for k, c in enumerate(counts)])

    by = {f: np.argsort(flat(item[f], blocks[f])) for f in ("ids", "changed", "filter_ids")}
    old: dict[str, Any] = {
        f: flat(item[f], blocks[of])[by[of]]
        for f, of in [("ids", "ids"), ("last", "ids"), ("count", "ids"), ("changed", "changed")]
        + [("rows", "changed"), ("filter_ids", "filter_ids"), ("filter_count", "filter_ids")]
    }
    old["slots"] = {s: flat(v, blocks["changed"])[by["changed"]] for s, v in item["slots"].items()}
    old.update(key=item["key"], counters=item["counters"].sum(0).astype(np.int64))
    assert old["filter_ids"].size and old["ids"].dtype == np.int64
    _rewrite(where, old, meta)
    restored, _ = checkpoint.restore(tmp_path, emb)
    Snapshot(emb, restored).assert_equals(then, exact=True)


def test_checkpoint_with_a_block_of_another_shard_is_refused(tmp_path):
    """Two blocks swapped (their counts too) hold each other's shards' ids: a restore where
    each shard reads its own block refuses it as corrupt, naming the table and the shard
    (on every process: `_guards.on_every_process`); one shard reading both restores it."""
    emb, then, where, item, meta = _saved_on_two_shards(tmp_path)
    key = item.pop("key")  # The table's: the only field without a block per shard.
    item = {**jax.tree.map(lambda x: x[::-1], item), "key": key}
    blocks = meta["dynamic"]["users"]["blocks"]
    meta["dynamic"]["users"]["blocks"] = {f: c[::-1] for f, c in blocks.items()}
    assert blocks["ids"][0] and blocks["ids"][1]
    _rewrite(where, item, meta)
    with pytest.raises(
        checkpoint.CheckpointCorruptError,
        match=r"table 'users', shard 0: id -?\d+ belongs to shard 1 of 2, not to shard 0",
    ):
        checkpoint.restore(tmp_path, emb)
    one = jte.Embedding(spec_of(DYNAMIC), make_mesh(1))
    restored, _ = checkpoint.restore(tmp_path, one)
    assert checkpoint._by_shard(one, "users", [meta["dynamic"]["users"]])
    Snapshot(one, restored).assert_equals(then, exact=True)


def test_checkpoint_with_a_nan_row_is_refused_on_every_mesh(saved, tmp_path):
    """A saved row that is NaN (written by other code) is refused whether each shard reads
    its own block (the saving mesh) or four (2 devices)."""
    _, steps, _, _, (emb, state) = saved
    table = state.tables["users"]
    state = dataclasses.replace(
        state, tables={**state.tables, "users": jnp.full_like(table, np.nan, device=table.sharding)}
    )
    checkpoint.save(tmp_path, emb, state)
    for onto in (emb, jte.Embedding(spec_of(DYNAMIC), make_mesh(2))):
        with pytest.raises(ValueError, match=r"checkpoint.restore: .*table 'users' has nan"):
            checkpoint.restore(tmp_path, onto)


@pytest.mark.slow
def test_checkpoint_restores_onto_a_larger_capacity_and_refuses_a_small_one(saved):
    """Capacity 64 on 2 devices: the same live rows, scores and counters (then steps of
    resident ids continue the same); a capacity below the held ids, or a bucket that cannot
    hold its ids, is a ValueError naming the table, the ids and the capacity."""
    path, steps, then, _, _ = saved
    larger = jte.DynamicTable(**{**vars(DYNAMIC), "capacity": 64})
    emb = jte.Embedding(spec_of(larger), make_mesh(2))
    state, _ = checkpoint.restore(path, emb)
    Snapshot(emb, state).assert_equals(then, exact=True)
    # Steps of resident ids only (all hits): the same as with the saved capacity.
    resident = then.tables["users"].ids
    ref_emb = jte.Embedding(spec_of(DYNAMIC), make_mesh(8))
    ref, _ = checkpoint.restore(path, ref_emb)
    rng = np.random.default_rng(1)
    for feats, grads in steps[SAVED_AT:]:
        feats = {
            **feats,
            "user": jte.Weighted(rng.choice(resident, (16, 3)), feats["user"].weights),
            "hist": rng.choice(resident, (16, 2)),
        }
        state = emb.apply_gradients(state, feats, grads)
        ref = ref_emb.apply_gradients(ref, feats, grads)
    Snapshot(emb, state).assert_equals(Snapshot(ref_emb, ref))
    n = then.stats["users"]["held"]
    tiny = jte.Embedding(spec_of(jte.DynamicTable(capacity=8, bucket_size=4)), make_mesh(2))
    with pytest.raises(ValueError, match=rf"table 'users': {n} ids do not fit its capacity of 8"):
        checkpoint.restore(path, tiny)
    narrow = jte.Embedding(spec_of(jte.DynamicTable(capacity=32, bucket_size=1)), make_mesh(2))
    shard = r"its \d+ ids of shard \d \(of 2, 16 rows each\) do not fit: bucket"
    with pytest.raises(ValueError, match=rf"table 'users': {shard}"):
        checkpoint.restore(path, narrow)


# ------------------------------------------------------------------------------- flax


class Model(nn.Module):
    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        acts = self.embed(batch["features"])
        x = jnp.concatenate([acts["user"], acts["hist"].reshape(-1, 2 * DIM), acts["item"]], -1)
        return nn.Dense(1, name="head")(jnp.tanh(x))[:, 0]


def mse(outputs, batch):
    return jnp.mean((outputs - batch["y"]) ** 2)


def flax_batches(seed, steps):
    """Batches of the jitted step: the dynamic table's ids as jte.SplitIds."""
    out = []
    for feats, grads in stream(seed, steps):
        feats = {
            **feats,
            "user": jte.Weighted(jte.split_ids(feats["user"].ids), feats["user"].weights),
            "hist": jte.split_ids(feats["hist"]),
        }
        out.append({"features": feats, "y": grads["item"][:, 0]})
    return out


def flax_setup(batches, routing="auto"):
    dynamic = jte.DynamicTable(capacity=512, bucket_size=8)
    emb = jte.Embedding(spec_of(dynamic), make_mesh(4), routing=routing)
    model = Model(jte.flax.Embed.from_embedding(emb))
    step = jte.flax.make_train_step(model, mse, optax.adam(0.05))
    return emb, model, step, step.init(jax.random.key(0), batches[0])


@pytest.mark.slow
def test_flax_model_trains_a_dynamic_table():
    """A flax model with a dynamic table: its index lives in the "embedding" collection
    beside tables, slots and step; the flax step admits every id it sees (capacity to
    spare: the counters count exactly the distinct ids, and they are the exported ids);
    model.apply reads the trained rows as predict does."""
    batches = flax_batches(2, 3)
    emb, model, step, state = flax_setup(batches)
    layer = state.embedding["embed"]
    assert set(layer) == {"tables", "slots", "step", "index"}
    assert set(layer["index"]) == {"users"}
    before = emb.lookup(jte.flax.embedding_states(state.embedding)["embed"], batches[0]["features"])
    before = np.asarray(before["user"])
    for batch in batches:
        state, _ = step(state, batch)
    assert step.trace_count == 1
    trained = jte.flax.embedding_states(state.embedding)["embed"]
    seen = set()
    for batch in batches:
        for ids in (batch["features"]["user"].ids, batch["features"]["hist"]):
            seen |= set(jte.join_ids(ids).ravel().tolist())
    seen.discard(-1)
    s = stats(emb, trained)["users"]
    assert s["admitted"] == s["occupancy"] == s["misses"] == len(seen)
    assert s["evicted"] == s["rejected"] == s["failed"] == 0 and int(trained.step) == 3
    np.testing.assert_array_equal(emb.export(trained)["users"].ids, np.sort(list(seen)))
    after = emb.lookup(trained, batches[0]["features"])["user"]
    assert not np.allclose(np.asarray(after), before)  # The rows trained.
    out: Any = model.apply(step.variables(state), batches[0])
    np.testing.assert_allclose(out, step.predict(state, batches[0]), rtol=1e-6, atol=1e-6)
    wide = jte.join_ids(batches[0]["features"]["hist"])  # NumPy int64 beyond int32.
    with pytest.raises(ValueError, match="int64 ids beyond int32"):
        step.predict(state, {**batches[0], "features": {**batches[0]["features"], "hist": wide}})


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["auto", "owner"])
def test_flax_step_with_a_dynamic_table_equals_the_generic_step(routing):
    """The flax step and jte.make_train_step, started from the same state: the same losses,
    ids and rows; with owner routing the dynamic table is stacked with the static one in the
    "embedding" collection."""
    batches = flax_batches(2, 3)
    emb, _, step, state = flax_setup(batches, routing)
    assert len(emb.stacks) == (1 if routing == "owner" else 2)
    head = nn.Dense(1)

    def loss_fn(params, acts, batch):
        x = jnp.concatenate([acts["user"], acts["hist"].reshape(-1, 2 * DIM), acts["item"]], -1)
        out: Any = head.apply({"params": params["head"]}, jnp.tanh(x))
        return mse(out[:, 0], batch)

    generic = jte.make_train_step(emb, loss_fn, optax.adam(0.05))
    start = jax.tree.map(jnp.copy, jte.flax.embedding_states(state.embedding)["embed"])
    g_state = generic.init(None, jax.tree.map(jnp.copy, state.params), embedding_state=start)
    for batch in batches:
        state, metrics = step(state, batch)
        g_state, g_metrics = generic(g_state, batch)
        np.testing.assert_allclose(metrics["loss"], g_metrics["loss"], rtol=1e-6)
    trained = jte.flax.embedding_states(state.embedding)["embed"]
    got, want = emb.export(trained)["users"], emb.export(g_state.embedding)["users"]
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.rows, want.rows, rtol=1e-5, atol=1e-6)
    assert stats(emb, trained) == stats(emb, g_state.embedding)


# ---------------------------------------------------------------------------- serving


def reference_lookup(tables, feats, rule):
    """float64 NumPy: each id's served row ({id: row}; an id not there reads `rule(id)`),
    combined as the spec says (user: weighted mean; hist: a sequence; item: static)."""
    served = tables["users"].to_dict()

    def rows(ids):
        out = np.zeros(ids.shape + (DIM,))
        for at in zip(*np.nonzero(ids != -1)):
            i = int(ids[at])
            out[at] = served[i] if i in served else rule(i)
        return out

    w = np.where(feats["user"].ids != -1, feats["user"].weights, 0.0).astype(np.float64)
    total = w.sum(1, keepdims=True)
    scale = np.divide(w, total, out=np.zeros_like(w), where=total != 0)
    hist = np.pad(feats["hist"], ((0, 0), (0, 2 - feats["hist"].shape[1])), constant_values=-1)
    return {
        "user": np.einsum("bl,bld->bd", scale, rows(feats["user"].ids)),
        "hist": rows(hist),
        "item": np.asarray(tables["items"], np.float64)[feats["item"]],
    }


def assert_close(got, want, rtol=1e-5, atol=1e-6):
    for path in want:
        np.testing.assert_allclose(np.asarray(got[path]), want[path], rtol=rtol, atol=atol)


def with_unknown(feats, seed):
    """`feats` with about a third of the dynamic ids replaced by ids never trained."""
    rng = np.random.default_rng(seed)

    def mixed(ids):
        fresh = rng.integers(-(2**63), 2**63 - 1, size=ids.shape, dtype=np.int64)
        return np.where((rng.random(ids.shape) < 0.35) & (ids != -1), fresh, ids)

    user = feats["user"]
    return {
        **feats,
        "user": jte.Weighted(mixed(user.ids), user.weights),
        "hist": mixed(feats["hist"]),
    }


def as_split(feats):
    user = feats["user"]
    return {
        **feats,
        "user": jte.Weighted(jte.split_ids(user.ids), user.weights),
        "hist": jte.split_ids(feats["hist"]),
    }


@pytest.fixture(scope="module")
def trained(saved):
    """The checkpoint test's run after its 11 steps, and a batch of ids it holds and ids it
    never saw or did not admit."""
    emb, state = saved[-1]
    feats = with_unknown(stream(4, 1)[0][0], 0)  # Other draws of the pool: known and not.
    return emb, state, feats


def test_serving_a_dynamic_table_matches_lookup(trained):
    """unknown="init" (keys from the state) gives Embedding.lookup's activations for known
    and unknown ids; "zeros" gives a float64 reference's, which reads zeros for ids not
    served; int64 and SplitIds ids agree; no key with "init" is an error."""
    emb, state, feats = trained
    tables = emb.export(state)
    known = set(tables["users"].ids.tolist())
    ids = np.concatenate([feats["user"].ids.ravel(), feats["hist"].ravel()])
    assert {i for i in ids.tolist() if i != -1} - known and known & set(ids.tolist())
    want = {p: np.asarray(x) for p, x in emb.lookup(state, feats).items()}
    server = jte.serving.Server.from_embedding(emb, state, unknown="init")
    assert_close(server(feats), want, rtol=1e-6, atol=1e-7)
    assert_close(server(as_split(feats)), want, rtol=1e-6, atol=1e-7)
    key = np.asarray(state.index["users"].key)

    def initial(i):
        hi, lo = jte.split_ids(np.array([i], np.int64))
        return np.asarray(_dynamic.initial_rows(key, hi, lo, DIM))[0]

    assert_close(server(feats), reference_lookup(tables, feats, initial))
    zeros = jte.serving.Server(emb.spec, tables)
    assert_close(zeros(feats), reference_lookup(tables, feats, lambda i: np.zeros(DIM)))
    with pytest.raises(ValueError, match=r"unknown='init'.*key words.*\['users'\]"):
        jte.serving.Server(emb.spec, tables, unknown="init")
    with pytest.raises(ValueError, match=r"table 'users' is dynamic: give jte.DynamicRows"):
        jte.serving.Server(emb.spec, {**tables, "users": np.zeros((3, DIM), np.float32)})


@pytest.mark.slow
def test_serving_export_of_a_dynamic_table(trained):
    """jax.export: the artifact takes the served tables and SplitIds, serializes, and answers
    what the Server does (tables outside or inside it, any batch size)."""
    emb, state, feats = trained
    server = jte.serving.Server.from_embedding(emb, state, unknown="init")
    want = {p: np.asarray(x) for p, x in server(feats).items()}
    blob = server.export(feats).serialize()
    call = jax.export.deserialize(blob).call
    assert_close(call(server.tables, as_split(feats)), want, rtol=0, atol=0)
    inner = jax.export.deserialize(server.export(feats, include_tables=True).serialize())
    assert_close(inner.call(as_split(feats)), want, rtol=0, atol=0)
    exp = jte.serving.export(
        emb.spec,
        emb.export(state),
        feats,
        polymorphic_batch=True,
        unknown="init",
        keys={"users": state.index["users"].key},
    )
    small = jax.tree.map(lambda x: x[:3], as_split(feats))
    got = jax.export.deserialize(exp.serialize()).call(server.tables, small)
    assert_close(got, {p: x[:3] for p, x in want.items()}, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "dim, dtype, strategy, optimizer",
    [
        (8, jnp.float32, "div", jte.Adagrad(0.1)),  # Packed 16 to a row; the slot rides.
        (48, jnp.bfloat16, "mod", jte.Adam(0.01)),  # Rows in pairs of words; two slots.
        (24, jnp.float32, "mod", jte.RowwiseAdagrad(0.1)),  # A rank-1 slot, packed.
        (200, jnp.float32, "div", jte.Adam(0.01)),  # Wider than a lane row: padded to 256.
    ],
)
def test_stored_rows_are_the_logical_rows_they_hold(dim, dtype, strategy, optimizer):
    """`take_stored` (what export and checkpoints read a dynamic table's live rows with,
    never a whole table) at stored positions, in any order and with repeats, equals the
    logical rows of the whole arrays at those positions' rows, on the TPU layout's packed
    arrays (riders, bf16 pairs, rank-1 slots) and plain ones."""
    table = jte.TableConfig(
        dim=dim,
        name="t",
        dtype=dtype,
        dynamic=jte.DynamicTable(capacity=4 * 96, bucket_size=8),
    )
    spec = jte.EmbeddingSpec(
        {"f": jte.FeatureConfig(table)}, optimizer, partition_strategy=strategy
    )
    rng = np.random.default_rng(0)
    for lanes in (128, 0):
        storage = jte.Embedding(spec, make_mesh(4), lane_width=lanes).table_plans["t"].storage
        table_shape, slot_shapes = storage.shapes()
        physical = rng.normal(size=table_shape).astype(dtype)
        slots = {n: rng.normal(size=shape).astype(np.float32) for n, shape in slot_shapes.items()}
        logical, logical_slots = storage.to_logical(physical, slots)
        positions = rng.integers(0, storage.layout.num_shards * storage.layout.rows_per_shard, 300)
        rows = _dynamic.slot_rows(storage, positions)
        got = storage.take_stored(None, positions, physical)
        got, riders = storage.split_row(got)
        np.testing.assert_array_equal(got, logical[rows])
        for s in storage.slot_specs:
            value = (
                riders[s.name]
                if s.name in riders
                else storage.take_stored(s, positions, slots[s.name])
            )
            np.testing.assert_array_equal(value, logical_slots[s.name][rows], err_msg=s.name)
        assert storage.packing.packed == bool(lanes)  # D = 200 pads to 256 lanes.
