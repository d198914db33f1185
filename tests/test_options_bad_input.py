"""Options and config files that were silently misread, and a save that fails for lack of
disk space (issue 26, item 4)."""

from typing import Any

import jax
import numpy as np
import optax
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh

# Typed Any: these are the wrong types on purpose.
FALSE: Any = "false"
NO: Any = "no"
ONE: Any = 1
ZERO: Any = 0
NP_FALSE: Any = np.bool_(False)


def _spec(optimizer=None):
    t = jte.TableConfig(10, 4, combiner="sum", name="t")
    return jte.EmbeddingSpec({"a": jte.FeatureConfig(t)}, optimizer or jte.Adagrad(0.1))


# ------------------------------------------------------------------ YAML duplicate keys


@pytest.mark.parametrize(
    "text,key,line",
    [
        (
            "optimizer: {name: sgd, learning_rate: 0.1}\n"
            "tables: {users: {vocabulary_size: 10, dim: 4}, users: {vocabulary_size: 20, dim: 4}}\n"
            "features: {u: users}\n",
            "users",
            2,
        ),
        (
            "optimizer: {name: sgd, learning_rate: 0.1}\n"
            "tables:\n"
            "  users:\n"
            "    vocabulary_size: 10\n"
            "    dim: 4\n"
            "    dim: 8\n"
            "features: {u: users}\n",
            "dim",
            6,
        ),
        (
            "optimizer: {name: sgd, learning_rate: 0.1}\n"
            "tables: {users: {vocabulary_size: 10, dim: 4}}\n"
            "features: {u: users}\n"
            "optimizer: {name: adagrad, learning_rate: 0.1}\n",
            "optimizer",
            4,
        ),
    ],
    ids=["table", "field", "top-level"],
)
def test_yaml_key_given_twice(tmp_path, text, key, line):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{path}: line {line}: key '{key}' is given twice"):
        jte.load_spec(path)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "base: &b {vocabulary_size: 10, dim: 4}\n"
        "optimizer: {name: sgd, learning_rate: 0.1}\n"
        "tables: {users: {<<: *b, dim: 8}}\n"
        "features: {u: users}\n"
    )
    assert jte.load_config(path).spec.tables()["users"].dim == 8


# ------------------------------------------------------------------ bool options


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: jte.Embedding(_spec(), stacking=FALSE), "Embedding: stacking must be a bool"),
        (lambda: jte.Embedding(_spec(), stacking=ZERO), "stacking must be a bool"),
        (lambda: jte.Adam(lazy_adam=FALSE), "Adam: lazy_adam must be a bool"),
        (lambda: jte.Adam(sum_inside_sqrt=ONE), "Adam: sum_inside_sqrt must be a bool"),
        (lambda: jte.Momentum(use_nesterov=NO), "Momentum: use_nesterov must be a bool"),
        (lambda: jte.RMSProp(centered=FALSE), "RMSProp: centered must be a bool"),
        (
            lambda: jte.FTRL(allow_zero_accumulator=NO),
            "FTRL: allow_zero_accumulator must be a bool",
        ),
        (
            lambda: jte.SGD(multiply_weight_decay_factor_by_learning_rate=FALSE),
            "multiply_weight_decay_factor_by_learning_rate must be a bool",
        ),
        (
            lambda: jte.make_train_step(
                jte.Embedding(_spec()), lambda p, a, b: 0.0, optax.sgd(0.1), donate=FALSE
            ),
            "make_train_step: donate must be a bool",
        ),
    ],
)
def test_bool_options_refuse_other_values(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_bool_options_accept_numpy_bools():
    jte.Embedding(_spec(), stacking=NP_FALSE)


def test_checkpoint_save_blocking_must_be_a_bool(tmp_path):
    emb = jte.Embedding(_spec(), make_mesh(2))
    with pytest.raises(TypeError, match="checkpoint.save: blocking must be a bool"):
        jte.checkpoint.save(tmp_path, emb, emb.init(jax.random.key(0)), blocking=FALSE)


# ------------------------------------------------------------------ multihost.global_batch


def test_global_batch_with_the_wrong_local_rows():
    emb = jte.Embedding(_spec(), make_mesh(4))
    with pytest.raises(
        ValueError,
        match=r"global_batch: leaf \['a'\] has 6 rows; this process must load a positive "
        r"multiple of 4 .*process_batch_rows",
    ):
        jte.multihost.global_batch(emb, {"a": np.zeros((6,), np.int32)})
    with pytest.raises(ValueError, match=r"leaf \['g'\] has 4 rows, expected 8 as \['a'\] has"):
        jte.multihost.global_batch(
            emb, {"a": np.zeros((8,), np.int32), "g": np.zeros((4, 4), np.float32)}
        )
    out = jte.multihost.global_batch(emb, {"a": np.zeros((8,), np.int32)})
    assert out["a"].shape == (8,)


# ------------------------------------------------------------------ disk full on save

_ENOSPC = (
    'UNKNOWN: Error writing local file "{path}/1.orbax-checkpoint-tmp/embedding/d/4f1e": '
    "No space left on device [OS error: No space left on device] "
    '[source locations="tensorstore/kvstore/file/file_key_value_store.cc:372"]'
)


@pytest.mark.parametrize("blocking", [True, False])
def test_save_failing_for_lack_of_space_is_wrapped(tmp_path, monkeypatch, blocking):
    import orbax.checkpoint as ocp

    emb = jte.Embedding(_spec(), make_mesh(2))
    state = emb.init(jax.random.key(0))
    jte.checkpoint.save(tmp_path, emb, state)  # Step 0, complete.
    later = emb.apply_gradients(
        jax.tree.map(jax.numpy.copy, state),
        {"a": np.arange(4, dtype=np.int32)},
        {"a": np.ones((4, 4), np.float32)},
    )

    def full_disk(self, *args, **kwargs):
        raise ValueError(_ENOSPC.format(path=tmp_path))

    # The writer fails as tensorstore does on a full disk: on the call that writes
    # (blocking) or in the background, raised when the save is joined.
    if blocking:
        monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    else:
        joined = ocp.CheckpointManager.wait_until_finished

        def save_in_background(self, *args, **kwargs):
            self._failing = True  # Its background write will fail.
            return True

        def wait_until_finished(self):
            if getattr(self, "_failing", False):
                self._failing = False
                full_disk(self)
            joined(self)

        monkeypatch.setattr(ocp.CheckpointManager, "save", save_in_background)
        monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", wait_until_finished)
    call = "save" if blocking else "wait"
    match = (
        rf"checkpoint.{call}: writing step 1 to {tmp_path} failed with ValueError: "
        rf"UNKNOWN: Error writing local file .*No space left on device.*Step 1 was not "
        rf"committed.*The previous step 0 is still restorable"
    )
    with pytest.raises(jte.checkpoint.CheckpointWriteError, match=match) as e:
        jte.checkpoint.save(tmp_path, emb, later, blocking=blocking)
        jte.checkpoint.wait()
    assert isinstance(e.value, OSError)
    monkeypatch.undo()
    assert jte.checkpoint.all_steps(tmp_path) == [0]
    restored, _ = jte.checkpoint.restore(tmp_path, emb)
    np.testing.assert_array_equal(emb.export(restored)["t"], emb.export(state)["t"])
