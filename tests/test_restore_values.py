"""Restored tables and slots are checked like every other input (issue 26, item 2).

`restore_tables` and `checkpoint.restore` accepted a NaN row and Adagrad accumulators of -1
(the next update turns every touched row into NaN). Now: tables finite, each slot in its
optimizer's domain (`SlotSpec.low`), and the error names the table, slot, row and value.
"""

import dataclasses

import jax
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh

V, D = 10, 4


def _shown(value) -> str:
    """A value as the errors write it (its float32 value, 8 significant digits)."""
    return format(float(np.float32(value)), ".8g")


def _emb(optimizer, num_shards=4, **kwargs):
    t = jte.TableConfig(V, D, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"a": jte.FeatureConfig(t)}, optimizer)
    return jte.Embedding(spec, make_mesh(num_shards), **kwargs)


def _table():
    return np.random.default_rng(0).normal(size=(V, D)).astype(np.float32)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_table_row(value):
    emb = _emb(jte.SGD(0.1))
    table = _table()
    table[7, 2] = value
    with pytest.raises(
        ValueError, match=rf"restore_tables: table 't' has {_shown(value)} at row 7, "
    ):
        emb.restore_tables({"t": table})


@pytest.mark.parametrize(
    "optimizer,slot,value,rule",
    [
        (jte.Adagrad(0.1), "accumulators", -1.0, "> 0"),
        (jte.Adagrad(0.1), "accumulators", 0.0, "> 0"),  # Divides by √a.
        (jte.Adagrad(0.1, epsilon=1e-8), "accumulators", -1.0, ">= 0"),
        (jte.ProximalAdagrad(0.1), "accumulators", 0.0, "> 0"),
        (jte.FTRL(0.1), "accumulators", 0.0, "> 0"),
        (jte.Adam(0.1), "velocities", -0.5, ">= 0"),
        (jte.AdagradMomentum(0.1), "accumulators", -1e-3, ">= 0"),
        (jte.RMSProp(0.1), "ms", -2.0, ">= 0"),
        (jte.Momentum(0.1), "momenta", np.nan, "finite"),
        (jte.RowwiseAdagrad(0.1), "accumulators", -1.0, ">= 0"),
        (
            jte.RowwiseAdagrad(0.1, epsilon=0.0, initial_accumulator_value=0.1),
            "accumulators",
            0.0,
            "> 0",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_slot_outside_its_optimizers_domain(optimizer, slot, value, rule):
    emb = _emb(optimizer)
    rank = {s.name: s.rank for s in optimizer.slot_specs()}[slot]
    good = {
        s.name: np.full((V, D) if s.rank == 2 else (V,), 0.5, np.float32)
        for s in optimizer.slot_specs()
    }
    emb.restore_tables({"t": _table()}, {"t": good})  # In the domain: fine.
    bad = dict(good)
    bad[slot] = good[slot].copy()
    bad[slot][3] = value
    column = ", column 0" if rank == 2 else ""
    rule = rule if rule == "finite" else "finite and " + rule
    match = (
        rf"restore_tables: slot '{slot}' of table 't' \({type(optimizer).__name__}\) has "
        rf"{_shown(value)} at row 3{column}; it must be {rule}"
    )
    with pytest.raises(ValueError, match=match):
        emb.restore_tables({"t": _table()}, {"t": bad})


def test_zero_accumulators_are_fine_where_nothing_divides_by_them():
    for optimizer in [jte.Adagrad(0.1, epsilon=1e-8), jte.RowwiseAdagrad(0.1), jte.Adam(0.1)]:
        emb = _emb(optimizer)
        zeros = {
            s.name: np.zeros((V, D) if s.rank == 2 else (V,), np.float32)
            for s in optimizer.slot_specs()
        }
        emb.restore_tables({"t": _table()}, {"t": zeros})


def test_custom_optimizer_slots_need_only_be_finite():
    opt = jte.CustomOptimizer(lambda g, w, s, lr, hp: (w - lr * g, s[0]), 0.1, ["v"], [0.0])
    emb = _emb(opt)
    emb.restore_tables({"t": _table()}, {"t": {"v": np.full((V, D), -3.0)}})
    with pytest.raises(ValueError, match=r"slot 'v' of table 't' .*inf at row 0"):
        emb.restore_tables({"t": _table()}, {"t": {"v": np.full((V, D), np.inf)}})


def test_every_problem_is_one_error_only_on_the_first_bad_value():
    emb = _emb(jte.Adagrad(0.1))
    table = _table()
    table[2, 1] = table[5, 0] = np.nan
    acc = np.full((V, D), 0.1, np.float32)
    acc[4, 3] = -1.0
    with pytest.raises(ValueError) as e:
        emb.restore_tables({"t": table}, {"t": {"accumulators": acc}})
    text = str(e.value)
    assert "table 't' has nan at row 2, column 1" in text
    assert "slot 'accumulators' of table 't' (Adagrad) has -1 at row 4, column 3" in text


@pytest.mark.parametrize("routing", ["gather", "owner"])
def test_checkpoint_with_values_outside_the_domain(tmp_path, routing):
    """A checkpoint whose contents violate it (written by other code, or by an earlier
    version that did not check) is refused on restore, naming the step."""
    emb = _emb(jte.Adagrad(0.1), routing=routing)
    state = emb.init(jax.random.key(0))
    acc = emb.export_slots(state)["t"]["accumulators"]
    acc[6, 1] = -4.0
    bad_state = _unchecked(emb, state, emb.export(state)["t"], {"accumulators": acc})
    jte.checkpoint.save(tmp_path, emb, bad_state)
    with pytest.raises(
        ValueError,
        match=r"checkpoint.restore: step 0 of .*slot 'accumulators' of table 't' \(Adagrad\) "
        r"has -4 at row 6, column 1",
    ):
        jte.checkpoint.restore(tmp_path, _emb(jte.Adagrad(0.1), num_shards=2))


def _unchecked(emb, state, table, slots):
    """`state` with table "t" and its slots replaced, built past the checks (as a buggy
    writer, or an earlier version that did not check, might have saved it)."""
    physical, stored = emb.storage("t").to_physical(table, slots)
    tables, slots = emb.state_arrays(
        {"t": emb._put(physical)}, {"t": {n: emb._put(x) for n, x in stored.items()}}
    )
    return dataclasses.replace(state, tables=tables, slots=slots)


def test_nan_table_in_checkpoint(tmp_path):
    emb = _emb(jte.SGD(0.1))
    state = emb.init(jax.random.key(0))
    table = emb.export(state)["t"]
    table[8, 0] = np.nan
    jte.checkpoint.save(tmp_path, emb, _unchecked(emb, state, table, {}))
    with pytest.raises(ValueError, match=r"table 't' has nan at row 8, column 0"):
        jte.checkpoint.restore(tmp_path, emb)
