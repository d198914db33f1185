"""One jitted train step: lookup → model → loss → dense (optax) and sparse (jte) updates.

The step never forms a (V, D) gradient: it differentiates the loss with respect to the dense
parameters and to the activations, and hands the activation gradients to
`Embedding.apply_gradients`, which touches only the rows of the batch.

    step = jte.make_train_step(emb, loss_fn, optax.adam(1e-3))
    state = step.init(jax.random.key(0), params)
    state, metrics = step(state, batch)          # jitted once; `state` is donated

Step N, plain:      lookup → model → loss → gradients → update the rows of batch N.
Step N, pipelined (`spec.pipeline_execution=True`): lookup → ... → update the rows of batch
N-1, while batch N's update waits in `state.pending` for step N+1 (or `flush`). The lookup of
step N+1 therefore reads the tables without step N's update (one step stale), as TensorFlow's
pipeline_execution_with_tensor_core; every update is still applied once, in order, with the
step counter it would have had. With no id shared by consecutive batches, both agree.

Non-finite values: when the loss, an activation gradient or a dense gradient of a step is NaN
or infinite, the whole step is skipped: no table, slot, parameter or optimizer state changes,
`state.step` does not advance, `metrics["skipped"]` is 1 and `state.skipped` counts it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _embedding, _inputs

Nested = Any
# discover(params, batch) -> {name: (Embedding, features)}: which embeddings a batch feeds.
Discover = Callable[[Any, Any], dict]
# loss(params, {name: activations}, batch) -> loss or (loss, aux).
Loss = Callable[[Any, dict, Any], Any]


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["features", "grads", "valid"], meta_fields=[]
)
@dataclasses.dataclass
class Pending:
    """The sparse update a pipelined step leaves for the next one.

    Attributes:
        features: {name: features} of the previous batch, as the batch gave them.
        grads: {name: activation gradients} of that batch, mirroring its activations.
        valid: bool scalar; False when there is nothing to apply (before the first step,
            after `flush`, after a skipped step).
    """

    features: dict
    grads: dict
    valid: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "opt_state", "embedding", "pending", "skipped"],
    meta_fields=[],
)
@dataclasses.dataclass
class TrainState:
    """Everything a train step reads and donates.

    Attributes:
        step: int32 scalar, steps taken (skipped steps excluded). The embedding optimizers'
            schedules see the same count (the embedding state's `step`), and so do optax's
            (its update count): all three advance together, once per applied step.
        params: The dense parameters, updated by the optax optimizer.
        opt_state: The optax state of `params`.
        embedding: A `jte.EmbeddingState` (`make_train_step`), or the flax "embedding"
            collection (`jte.flax.make_train_step`).
        pending: `Pending` with `spec.pipeline_execution=True`, else None.
        skipped: int32 scalar, steps skipped because of non-finite values.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    embedding: Any
    pending: Pending | None
    skipped: jax.Array


def _after_lookup(grads: jax.Array, acts: jax.Array) -> jax.Array:
    """`grads` unchanged, but computed from `acts`, so the update runs after the lookup.

    When the rows the update scatters into a table do not depend on what the lookup gathered
    from it (a loss linear in the activations, or the previous batch's gradients in a
    pipelined step), XLA may not order the in-place update after the read and copies the
    whole table to stay safe. `jax.lax.optimization_barrier` does not prevent this on
    XLA:CPU (the barrier is gone before copy insertion), a data dependency does.
    nan_to_num(0 * a) is exactly 0 for every a, inf and NaN included, and XLA does not fold
    it; it costs one (B, D) elementwise pass.
    """
    zero = jnp.nan_to_num(acts.astype(jnp.float32) * 0.0, nan=0.0, posinf=0.0, neginf=0.0)
    return grads + zero.astype(grads.dtype)


def _is_weighted(x) -> bool:
    return isinstance(x, _inputs.Weighted)


def _mask_features(features: Nested, keep: jax.Array) -> Nested:
    """Features whose ids all become -1 (never read or written) unless `keep`."""

    def mask(leaf):
        if _is_weighted(leaf):
            return _inputs.Weighted(jnp.where(keep, jnp.asarray(leaf.ids), -1), leaf.weights)
        return jnp.where(keep, jnp.asarray(leaf), -1)

    return jax.tree.map(mask, features, is_leaf=_is_weighted)


def _all_finite(*trees) -> jax.Array:
    ok = jnp.array(True)
    for leaf in jax.tree.leaves(trees):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


def _batch_size(features: dict) -> int:
    for leaf in jax.tree.leaves(features):
        if jnp.ndim(leaf) >= 1:
            return int(jnp.shape(leaf)[0])
    raise ValueError("The batch has no embedding features with a batch dimension.")


def _constrain(x, sharding: NamedSharding):
    mesh_types = getattr(sharding.mesh, "axis_types", None) or ()
    if any(t == jax.sharding.AxisType.Explicit for t in mesh_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _dense_sharding(x, replicated: NamedSharding) -> NamedSharding:
    """Dense parameters are replicated over the mesh unless the caller sharded them."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return replicated
    if isinstance(sharding.mesh, jax.sharding.AbstractMesh):  # From jax.eval_shape.
        return NamedSharding(replicated.mesh, sharding.spec)
    return sharding


def _unaliased(tree):
    """`tree` with every array appearing once: a donated buffer may not be passed twice."""
    seen = set()

    def once(x):
        if isinstance(x, jax.Array):
            if id(x) in seen:
                return jnp.copy(x)
            seen.add(id(x))
        return x

    return jax.tree.map(once, tree)


def _apply_masked(
    emb: _embedding.Embedding, state: _embedding.EmbeddingState, features, grads, keep: jax.Array
) -> _embedding.EmbeddingState:
    """`emb.apply_gradients`, or no change at all (step counter included) unless `keep`."""
    new = emb.apply_gradients(state, _mask_features(features, keep), grads)
    tables, slots = dict(new.tables), dict(new.slots)
    for name, plan in emb.table_plans.items():
        if plan.optimizer.dense_update:
            # Such tables update every row even without ids; keeping them costs a table copy.
            tables[name] = jnp.where(keep, tables[name], state.tables[name])
            slots[name] = jax.tree.map(
                lambda n, o: jnp.where(keep, n, o), slots[name], state.slots[name]
            )
    return _embedding.EmbeddingState(tables, slots, jnp.where(keep, new.step, state.step))


class TrainStep:
    """A jitted train step over dense parameters and one or more embeddings.

    Built by `jte.make_train_step` or `jte.flax.make_train_step`; call it as
    `state, metrics = step(state, batch)`. The state is donated: do not reuse the state you
    passed in.

    metrics: {"loss": float32 scalar, "skipped": int32 0 or 1 (non-finite step, see the
    module doc), "invalid_ids": int32 count of ids outside [0, V) other than -1 (treated as
    -1), "aux": what loss_fn returned besides the loss (only when it returned a pair)}.

    Attributes:
        trace_count: How many times the step was traced. One per input shape and structure;
            keep batch shapes fixed (drop the remainder) so it stays 1.
    """

    def __init__(
        self,
        *,
        discover: Discover,
        loss: Loss,
        tx: optax.GradientTransformation,
        unpack: Callable[[Any], dict],
        pack: Callable[[Any, dict], Any],
        donate: bool = True,
    ):
        self._discover, self._loss, self.tx = discover, loss, tx
        self._unpack, self._pack = unpack, pack
        self.embeddings: dict[str, _embedding.Embedding] = {}
        self.trace_count = 0
        donate_argnums = (0,) if donate else ()
        self._jit = jax.jit(self._step, donate_argnums=donate_argnums)
        self._flush_jit = jax.jit(self._flush, donate_argnums=donate_argnums)

    # ------------------------------------------------------------------ public

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """One step on `batch`; returns the new state and the metrics (device arrays)."""
        return self._jit(state, batch)

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """AOT: lower for a state and batch given as arrays or jax.ShapeDtypeStruct."""
        return self._jit.lower(state, batch)

    def flush(self, state: TrainState) -> TrainState:
        """Applies the update a pipelined step left pending; a no-op otherwise.

        Call it before evaluating, exporting or checkpointing a pipelined model.
        """
        if state.pending is None:
            return state
        return self._flush_jit(state)

    # --------------------------------------------------------------- building

    def _found(self, params, batch) -> tuple[dict, dict]:
        found = self._discover(params, batch)
        embs = {n: e for n, (e, _) in found.items()}
        self.embeddings.update(embs)
        return embs, {n: f for n, (_, f) in found.items()}

    def _pipelined(self, embs: dict) -> list[str]:
        return sorted(n for n, e in embs.items() if e.spec.pipeline_execution)

    def _pending_like(self, embs: dict, abstract_features: dict, abstract: bool):
        """Pending with nothing to apply, shaped like one batch; None if nothing pipelines."""
        names = self._pipelined(embs)
        if not names:
            return None
        features, grads = {}, {}
        for n in names:
            emb = embs[n]
            batch_sharding = NamedSharding(emb.mesh, P(emb.axis))
            acts = jax.eval_shape(emb.lookup, emb.abstract_state(), abstract_features[n])

            def make(s, fill, sharding=batch_sharding):
                if abstract:
                    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
                return jax.device_put(jnp.full(s.shape, fill, s.dtype), sharding)

            def empty(leaf):
                if _is_weighted(leaf):
                    return _inputs.Weighted(make(leaf.ids, -1), make(leaf.weights, 0))
                return make(leaf, -1)

            features[n] = jax.tree.map(empty, abstract_features[n], is_leaf=_is_weighted)
            grads[n] = jax.tree.map(lambda s: make(s, 0), acts)
        mesh = embs[names[0]].mesh
        # Any: an abstract Pending holds a ShapeDtypeStruct where the real one holds an array.
        valid: Any = (
            jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(mesh, P()))
            if abstract
            else jax.device_put(jnp.array(False), NamedSharding(mesh, P()))
        )
        return Pending(features, grads, valid)

    def _make_state(self, params, embedding, example_batch, abstract: bool) -> TrainState:
        states = self._unpack(embedding)
        embs, features = {}, {}

        def probe(p, b):
            e, f = self._found(p, b)
            embs.update(e)
            return f

        if example_batch is None:
            embs = dict(self.embeddings)
            if self._pipelined(embs) or not embs:
                raise ValueError(
                    "TrainStep: pass an example batch to create the state (a "
                    "pipelined step keeps one batch's update pending)."
                )
        else:
            features = jax.eval_shape(probe, params, example_batch)
        missing = sorted(set(embs) - set(states))
        if missing:
            raise ValueError(
                f"TrainStep: the embedding state has no entry for {missing}; "
                f"it has {sorted(states)}."
            )
        mesh = next(iter(embs.values())).mesh
        replicated = NamedSharding(mesh, P())
        first = states[sorted(embs)[0]]
        if abstract:

            def abstract_of(x):
                dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
                return jax.ShapeDtypeStruct(
                    jnp.shape(x), dtype, sharding=_dense_sharding(x, replicated)
                )

            # Any: an abstract TrainState holds ShapeDtypeStructs where the real one holds arrays.
            scalar: Any = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
            params = jax.tree.map(abstract_of, params)
            opt_state = jax.tree.map(abstract_of, jax.eval_shape(self.tx.init, params))
            return TrainState(
                scalar,
                params,
                opt_state,
                embedding,
                self._pending_like(embs, features, True),
                scalar,
            )

        # A copy, so that donating the state never deletes the caller's arrays (device_put
        # alone may alias the caller's buffer on one device, even with may_alias=False).
        params = jax.tree.map(
            lambda x: jax.device_put(
                jnp.copy(x) if isinstance(x, jax.Array) else x, _dense_sharding(x, replicated)
            ),
            params,
        )
        step = jax.device_put(jnp.array(first.step, jnp.int32, copy=True), replicated)
        skipped = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        # On the mesh like the step's outputs, so the second step does not retrace.
        opt_state = jax.tree.map(
            lambda x: jax.device_put(x, _dense_sharding(x, replicated)), self.tx.init(params)
        )
        state = TrainState(
            step, params, opt_state, embedding, self._pending_like(embs, features, False), skipped
        )
        return _unaliased(state)

    # ------------------------------------------------------------------- step

    def _step(self, state: TrainState, batch):
        embs, features = self._found(state.params, batch)
        states = self._unpack(state.embedding)
        if set(states) != set(embs):
            raise ValueError(
                f"TrainStep: the batch feeds embeddings {sorted(embs)} but the "
                f"state holds {sorted(states)}."
            )
        pipelined = self._pipelined(embs)
        if (state.pending is None) != (not pipelined) or (
            state.pending is not None and sorted(state.pending.features) != pipelined
        ):
            raise ValueError(
                f"TrainStep: the state's pending updates do not match the "
                f"pipelined embeddings {pipelined}; create the state with "
                f"this step's init."
            )
        first = embs[sorted(embs)[0]]
        batch = self._shard_batch(batch, first, _batch_size(features))

        acts = {n: embs[n].lookup(states[n], features[n]) for n in embs}

        def loss_of(params, acts):
            out = self._loss(params, acts, batch)
            loss: Any
            loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
            if (
                not hasattr(loss, "shape")
                or jnp.shape(loss) != ()
                or not jnp.issubdtype(jnp.result_type(loss), jnp.floating)
            ):
                raise ValueError(
                    f"loss_fn must return a float scalar loss, or (loss, aux); got "
                    f"{type(loss).__name__} with shape {jnp.shape(loss)} and dtype "
                    f"{jnp.result_type(loss)}. Reduce over the batch (e.g. jnp.mean)."
                )
            return loss.astype(jnp.float32), aux

        loss, vjp_fn, aux = jax.vjp(loss_of, state.params, acts, has_aux=True)
        dparams, dacts = vjp_fn(jnp.ones_like(loss))
        ok = _all_finite(loss, dacts, dparams)

        # Sparse updates: this batch's, or in a pipelined step the previous batch's.
        new_states = {}
        for n, emb in embs.items():
            if n in pipelined:
                assert state.pending is not None  # Checked above: pipelined steps have one.
                upd_features, upd_grads = state.pending.features[n], state.pending.grads[n]
                keep = state.pending.valid
            else:
                upd_features, upd_grads, keep = features[n], dacts[n], ok
            upd_grads = jax.tree.map(_after_lookup, upd_grads, acts[n])
            new_states[n] = _apply_masked(emb, states[n], upd_features, upd_grads, keep)
        pending = None
        if pipelined:
            sharding = {n: NamedSharding(embs[n].mesh, P(embs[n].axis)) for n in pipelined}
            pending = Pending(
                {
                    n: jax.tree.map(
                        lambda x, s=sharding[n]: _constrain(jnp.asarray(x), s), features[n]
                    )
                    for n in pipelined
                },
                {
                    n: jax.tree.map(lambda x, s=sharding[n]: _constrain(x, s), dacts[n])
                    for n in pipelined
                },
                ok,
            )

        updates, opt_state = self.tx.update(dparams, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        keep_new = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        params = jax.tree.map(keep_new, params, state.params)
        opt_state = jax.tree.map(keep_new, opt_state, state.opt_state)

        new_state = TrainState(
            step=state.step + ok.astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            embedding=self._pack(state.embedding, new_states),
            pending=pending,
            skipped=state.skipped + (~ok).astype(jnp.int32),
        )
        invalid = sum(
            jnp.sum(jnp.stack(list(embs[n].invalid_id_counts(features[n]).values()))) for n in embs
        )
        metrics = {
            "loss": loss,
            "skipped": (~ok).astype(jnp.int32),
            "invalid_ids": jnp.asarray(invalid, jnp.int32),
        }
        if aux is not None:
            metrics["aux"] = aux
        self.trace_count += 1  # Counted once the trace succeeded.
        return new_state, metrics

    def _shard_batch(self, batch, emb: _embedding.Embedding, batch_size: int):
        """Every array of the batch with leading dimension B is split over the mesh axis."""
        if batch_size < 1 or batch_size % emb.num_shards:
            # Said here: splitting the batch below would fail with a raw sharding error.
            raise ValueError(
                f"TrainStep: the batch has B={batch_size} examples, which mesh axis "
                f"{emb.axis!r} of size {emb.num_shards} does not divide; B must be a positive "
                f"multiple of {emb.num_shards} (drop or pad the remainder)."
            )
        sharding = NamedSharding(emb.mesh, P(emb.axis))

        def shard(x):
            if (
                hasattr(x, "shape")
                and len(x.shape) >= 1
                and x.shape[0] == batch_size
                and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            ):
                return _constrain(jnp.asarray(x), sharding)
            return x

        return jax.tree.map(shard, batch)

    def _flush(self, state: TrainState) -> TrainState:
        assert state.pending is not None  # flush() calls this only with an update pending.
        states = self._unpack(state.embedding)
        pipelined = sorted(state.pending.features)
        missing = [n for n in pipelined if n not in self.embeddings]
        if missing:
            raise ValueError(
                f"flush: embeddings {missing} are unknown to this step yet; "
                f"create the state with its init or run a step first."
            )
        new_states = dict(states)
        for n in pipelined:
            new_states[n] = _apply_masked(
                self.embeddings[n],
                states[n],
                state.pending.features[n],
                state.pending.grads[n],
                state.pending.valid,
            )
        pending = Pending(
            state.pending.features, state.pending.grads, jnp.zeros_like(state.pending.valid)
        )
        return dataclasses.replace(
            state, embedding=self._pack(state.embedding, new_states), pending=pending
        )


class EmbeddingTrainStep(TrainStep):
    """The step `make_train_step` returns: one `jte.Embedding` and a model written as
    `loss_fn(params, activations, batch)`."""

    _NAME = "embedding"

    def __init__(
        self,
        emb: _embedding.Embedding,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        features_fn: Callable | None = None,
        donate: bool = True,
    ):
        if not isinstance(emb, _embedding.Embedding):
            raise TypeError(
                f"make_train_step: emb must be a jte.Embedding, got {type(emb).__name__}."
            )
        if not callable(loss_fn):
            raise TypeError(
                f"make_train_step: loss_fn must be callable "
                f"fn(params, activations, batch), got {loss_fn!r}."
            )
        self.embedding = emb
        name = self._NAME

        def discover(params, batch):
            del params
            if features_fn is not None:
                return {name: (emb, features_fn(batch))}
            if not isinstance(batch, dict) or "features" not in batch:
                raise ValueError(
                    "make_train_step: the batch has no 'features' entry; pass "
                    "features_fn=lambda batch: ... to say where the embedding features are."
                )
            return {name: (emb, batch["features"])}

        super().__init__(
            discover=discover,
            loss=lambda params, acts, batch: loss_fn(params, acts[name], batch),
            tx=tx,
            unpack=lambda e: {name: e},
            pack=lambda e, states: states[name],
            donate=donate,
        )
        self.embeddings = {name: emb}

    def init(
        self,
        key: jax.Array | None,
        params: Any,
        example_batch: Any = None,
        *,
        embedding_state: _embedding.EmbeddingState | None = None,
    ) -> TrainState:
        """The initial TrainState.

        Args:
            key: Draws the tables with `emb.init(key)`; ignored with `embedding_state`.
            params: The dense parameters (a pytree of arrays); copied.
            example_batch: One batch (arrays or jax.ShapeDtypeStruct); required only with
                `spec.pipeline_execution=True`, to shape the pending update.
            embedding_state: Start from these tables (e.g. restored from a checkpoint) instead
                of drawing new ones; the state is consumed by the first step. `state.step`
                continues from its step.
        """
        if embedding_state is None:
            if key is None:
                raise ValueError("init: give a key to draw the tables, or embedding_state=.")
            embedding_state = self.embedding.init(key)
        return self._make_state(params, embedding_state, example_batch, abstract=False)

    def abstract_state(self, params: Any, example_batch: Any = None) -> TrainState:
        """The TrainState as jax.ShapeDtypeStruct leaves with shardings; allocates nothing.

        Use it to AOT-compile the step: `step.lower(step.abstract_state(p, b), b).compile()`.
        """
        return self._make_state(
            params, self.embedding.abstract_state(), example_batch, abstract=True
        )


def make_train_step(
    emb: _embedding.Embedding,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    features_fn: Callable | None = None,
    donate: bool = True,
) -> EmbeddingTrainStep:
    """Builds one jitted, state-donating train step.

    Args:
        emb: The `jte.Embedding`.
        loss_fn: fn(params, activations, batch) -> loss, or (loss, aux). `activations` mirrors
            the features: float32 (B, D) per feature ((B, L, D) for sequence features); the
            loss is a float scalar (reduce over the batch yourself).
        tx: The optax optimizer of `params`. The tables are never part of `params`: the
            spec's sparse optimizers update them.
        features_fn: fn(batch) -> the features (mirroring the spec). Default:
            `batch["features"]`.
        donate: Donate the state to the step (default), so tables are updated in place.

    Returns:
        `step(state, batch) -> (state, metrics)`, with `step.init(key, params, ...)` making the
        first state and `step.flush(state)` applying a pipelined step's pending update. Every
        array in the batch whose leading dimension is B is split over the mesh axis.
    """
    return EmbeddingTrainStep(emb, loss_fn, tx, features_fn=features_fn, donate=donate)
