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
or infinite, the whole step is skipped: no table, slot, parameter, optimizer state, model state
(batch statistics) or rng changes, `state.step` does not advance, `metrics["skipped"]` is 1 and
`state.skipped` counts it.

Micro-batches (`accumulate_steps=k > 1`): every batch leaf has a leading axis of k
micro-batches. One lookup embeds all k (the activations of the whole batch are (B, D) per
feature, as small as their gradients, which the update needs anyway); the model's forward and
backward passes then run one micro-batch at a time in a `lax.scan`, so the model's own
intermediate activations are one micro-batch's. Dense gradients are summed over the
micro-batches; the k micro-batches' ids and activation gradients are concatenated into one
`apply_gradients` call, which sums the gradients of each row across all of them before the
optimizer runs once per touched row. For a loss that sums over examples this is one step on
the concatenated batch. The concatenation puts each device's rows of the k micro-batches next
to each other (example order b-major), so it moves no data between devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _config, _embedding, _guards, _inflight, _inputs, _sharding

Nested = Any
# discover(params, batch, model_state, rng) -> {name: (Embedding, features)}: which embeddings
# a batch feeds.
Discover = Callable[[Any, Any, Any, Any], dict]
# loss(params, {name: activations}, batch, model_state, rng) -> (loss or (loss, aux),
# new model_state).
Loss = Callable[[Any, dict, Any, Any, Any], tuple]


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
    data_fields=[
        "step",
        "params",
        "opt_state",
        "embedding",
        "pending",
        "skipped",
        "model_state",
        "rng",
    ],
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
        model_state: State the model updates without gradients (flax "batch_stats" and
            other mutable collections; with NNX, every variable but params and tables, rng
            counters included); None when there is none.
        rng: A PRNG key for the model's random streams (dropout); split every applied step,
            so each step draws new masks. None when the step uses no randomness.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    embedding: Any
    pending: Pending | None
    skipped: jax.Array
    model_state: Any = None
    rng: Any = None


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

    def ids(x):
        if isinstance(x, _inputs.SplitIds):  # A dynamic table's: -1 is both halves all ones.
            pad = jnp.uint32(_inputs.PAD)
            return _inputs.SplitIds(jnp.where(keep, x.hi, pad), jnp.where(keep, x.lo, pad))
        return jnp.where(keep, jnp.asarray(x), -1)

    def mask(leaf):
        if _is_weighted(leaf):
            return _inputs.Weighted(ids(leaf.ids), leaf.weights)
        return ids(leaf)

    return jax.tree.map(
        mask, features, is_leaf=lambda x: _is_weighted(x) or isinstance(x, _inputs.SplitIds)
    )


def _all_finite(*trees) -> jax.Array:
    ok = jnp.array(True)
    for leaf in jax.tree.leaves(trees):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


def examples_of(features: dict) -> int:
    """B: the leading dimension of the first feature array that has one."""
    for leaf in jax.tree.leaves(features):
        if jnp.ndim(leaf) >= 1:
            return int(jnp.shape(leaf)[0])
    raise ValueError("The batch has no embedding features with a batch dimension.")


def _dense_sharding(x, replicated: NamedSharding) -> NamedSharding:
    """Dense parameters are replicated over the mesh unless the caller sharded them."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return replicated
    if isinstance(sharding.mesh, jax.sharding.AbstractMesh):  # From jax.eval_shape.
        return NamedSharding(replicated.mesh, sharding.spec)
    return sharding


def _shape(x) -> tuple:
    """Shape of an array, a jax.ShapeDtypeStruct or a Python scalar."""
    return tuple(x.shape) if hasattr(x, "shape") else tuple(jnp.shape(x))


def first_micro_batch(batch, k: int):
    """Micro-batch 0 of a batch of k (arrays or jax.ShapeDtypeStruct leaves)."""
    _check_micro_batches(batch, k)

    def first(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        return x[0]

    return jax.tree.map(first, batch)


def _check_micro_batches(batch, k: int) -> None:
    """Every leaf of a batch of k micro-batches has a leading axis of k."""
    bad = [
        f"{jax.tree_util.keystr(path) or 'the batch'} has shape {_shape(x)}"
        for path, x in jax.tree_util.tree_leaves_with_path(batch)
        if len(_shape(x)) < 1 or _shape(x)[0] != k
    ]
    if bad:
        raise ValueError(
            f"accumulate_steps={k}: every batch leaf needs a leading axis of {k} "
            f"micro-batches, (k, b, ...); {'; '.join(bad[:5])}."
        )


def _check_batch_leading(emb: _embedding.Embedding) -> None:
    """Micro-batches are concatenated along the batch axis of each activation."""
    fixed = sorted(
        path
        for path, f in _config.flatten_features(emb.spec.features)
        if f.output_shape is not None
    )
    if fixed:
        raise ValueError(
            f"accumulate_steps > 1: features {fixed} have an output_shape, whose activation "
            f"has no batch axis to concatenate micro-batches along; drop output_shape and "
            f"reshape the activations in the model, or use accumulate_steps=1."
        )


def _reshape_on(x, shape, emb: _embedding.Embedding):
    """x.reshape(shape), split over emb's batch axis (Explicit meshes need to be told)."""
    sharding = NamedSharding(emb.mesh, P(emb.axis))
    if _sharding.is_explicit(emb.mesh):
        return jax.lax.reshape(x, shape, out_sharding=sharding)
    return jax.lax.with_sharding_constraint(x.reshape(shape), sharding)


def _merge(x, emb: _embedding.Embedding):
    """(k, b, ...) micro-batches -> (b·k, ...) one batch, example order b-major.

    b-major rather than k-major: each device's b/N rows of every micro-batch end up next to
    each other, so the result is split over the batch axis without moving data.
    """
    x = jnp.asarray(x)
    k, b = x.shape[:2]
    x = _sharding.constrain(x, NamedSharding(emb.mesh, P(None, emb.axis)))
    return _reshape_on(jnp.moveaxis(x, 0, 1), (b * k,) + x.shape[2:], emb)


def _split(x, k: int, emb: _embedding.Embedding):
    """The inverse of `_merge`: (b·k, ...) -> (k, b, ...)."""
    b = x.shape[0] // k
    x = _reshape_on(x, (b, k) + x.shape[1:], emb)
    return _sharding.constrain(jnp.moveaxis(x, 1, 0), NamedSharding(emb.mesh, P(None, emb.axis)))


def unaliased(tree):
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
    emb: _embedding.Embedding,
    state: _embedding.EmbeddingState,
    features,
    grads,
    keep: jax.Array,
    staged: _embedding.StagedRows | None,
) -> _embedding.EmbeddingState:
    """`emb.apply_gradients`, or no change at all (step counter included) unless `keep`."""
    new = emb.apply_gradients(state, _mask_features(features, keep), grads, staged=staged)
    tables, slots = dict(new.tables), dict(new.slots)
    for name, plan in emb.plan.stacks.items():  # Keyed as the state is.
        if plan.optimizer.dense_update:
            # Such tables update every row even without ids; keeping them costs a table copy.
            tables[name] = jnp.where(keep, tables[name], state.tables[name])
            slots[name] = jax.tree.map(
                lambda n, o: jnp.where(keep, n, o), slots[name], state.slots[name]
            )
    # A dynamic table's index saw no id unless `keep`: it is as it was.
    return _embedding.EmbeddingState(
        tables, slots, jnp.where(keep, new.step, state.step), new.index
    )


class TrainStep:
    """A jitted train step over dense parameters and one or more embeddings.

    Built by `jte.make_train_step` or `jte.flax.make_train_step`; call it as
    `state, metrics = step(state, batch)`. The state is donated: do not reuse the state you
    passed in.

    metrics: {"loss": float32 scalar, "skipped": int32 0 or 1 (non-finite step, see the
    module doc), "invalid_ids": int32 count of ids outside [0, V) other than -1 (treated as
    -1), "aux": what loss_fn returned besides the loss (only when it returned a pair),
    "dynamic": {dynamic table: `Embedding.dynamic_counters`} (only with dynamic tables; keyed
    "layer/table" when the model has several embeddings)}.

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
        accumulate_steps: int = 1,
    ):
        if (
            isinstance(accumulate_steps, bool)
            or not isinstance(accumulate_steps, int)
            or accumulate_steps < 1
        ):
            raise ValueError(
                f"make_train_step: accumulate_steps must be an int >= 1 (the number of "
                f"micro-batches along each batch leaf's leading axis), got {accumulate_steps!r}."
            )
        _guards.check_bool(donate, "make_train_step", "donate")
        self._discover, self._loss, self.tx = discover, loss, tx
        self._unpack, self._pack = unpack, pack
        self.accumulate_steps = accumulate_steps
        self.embeddings: dict[str, _embedding.Embedding] = {}
        self.trace_count = 0
        donate_argnums = (0,) if donate else ()
        self._jit = jax.jit(self._step, donate_argnums=donate_argnums)
        self._flush_jit = jax.jit(self._flush, donate_argnums=donate_argnums)
        # Waits for step i - k on multi-device CPU meshes (XLA:CPU deadlock, _inflight.py).
        self._in_flight = _inflight.Window()

    # ------------------------------------------------------------------ public

    def __call__(
        self, state: TrainState, batch: Any, next_batch: Any = None
    ) -> tuple[TrainState, dict]:
        """One step on `batch`; returns the new state and the metrics (device arrays).

        `next_batch` (optional, shaped as `batch`): the batch of the following step, whose
        rows of HostCached tables are brought into their caches while this step runs
        (`Embedding.prefetch`); it changes no value, only where the next step finds rows."""
        _guards.check_not_consumed(state, "TrainStep", "train state", "state")
        if any(e.dynamic for e in self.embeddings.values()):
            _guards.check_no_wide_ids(batch, "TrainStep")
        state, metrics = self._jit(state, batch, next_batch)
        self._in_flight.push(metrics["loss"])
        return state, metrics

    def lower(self, state: TrainState, batch: Any, next_batch: Any = None) -> jax.stages.Lowered:
        """AOT: lower for a state and batch given as arrays or jax.ShapeDtypeStruct."""
        return self._jit.lower(state, batch, next_batch)

    def flush(self, state: TrainState) -> TrainState:
        """Applies the update a pipelined step left pending; a no-op otherwise.

        Call it before evaluating, exporting or checkpointing a pipelined model.
        """
        _guards.check_not_consumed(state, "TrainStep.flush", "train state", "state")
        if state.pending is None:
            return state
        return self._flush_jit(state)

    # --------------------------------------------------------------- building

    def _found(self, params, batch, model_state=None, rng=None) -> tuple[dict, dict]:
        found = self._discover(params, batch, model_state, rng)
        embs = {n: e for n, (e, _) in found.items()}
        self.embeddings.update(embs)
        return embs, {n: f for n, (_, f) in found.items()}

    def _features(self, params, batch, model_state, rng) -> tuple[dict, dict]:
        """({name: Embedding}, {name: features}) of a batch; with micro-batches, the features
        of all k micro-batches concatenated into one batch of k·b examples (`_merge`)."""
        k = self.accumulate_steps
        if k == 1:
            return self._found(params, batch, model_state, rng)
        _check_micro_batches(batch, k)
        embs = {}

        def one(micro, key):
            e, f = self._found(params, micro, model_state, key)
            embs.update(e)
            return f

        # `rng` holds one key per micro-batch here.
        stacked = jax.vmap(one)(batch, rng)
        for emb in embs.values():
            _check_batch_leading(emb)
        return embs, {
            n: jax.tree.map(lambda x, e=embs[n]: _merge(x, e), stacked[n]) for n in stacked
        }

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
                if _is_weighted(leaf):  # Its ids may be a dynamic table's SplitIds halves.
                    ids = jax.tree.map(lambda s: make(s, -1), leaf.ids)
                    return _inputs.Weighted(ids, make(leaf.weights, 0))
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

    def _make_state(
        self,
        params,
        embedding,
        example_batch,
        abstract: bool,
        model_state: Any = None,
        rng: Any = None,
        owned: bool = False,
    ) -> TrainState:
        """The TrainState of these values; `owned`: params and model_state were made by the
        step's own init, nobody else holds them, and they need no copy."""
        where = "TrainStep.init"
        _guards.check_not_consumed(embedding, where, "embedding state", "embedding_state")
        _guards.check_not_consumed((params, model_state), where, "params", "(params, model_state)")
        states = self._unpack(embedding)
        embs, features = {}, {}

        def probe(p, b, m, r):
            e, f = self._features(p, b, m, self._micro_keys(r))
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
            features = jax.eval_shape(probe, params, example_batch, model_state, rng)
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
                jax.tree.map(abstract_of, model_state),
                jax.tree.map(abstract_of, rng),
            )

        # A copy, so that donating the state never deletes the caller's arrays (device_put
        # alone may alias the caller's buffer on one device, even with may_alias=False).
        def placed(tree, copy=True):
            return jax.tree.map(
                lambda x: jax.device_put(
                    jnp.copy(x) if copy and isinstance(x, jax.Array) else x,
                    _dense_sharding(x, replicated),
                ),
                tree,
            )

        params = placed(params, copy=not owned)
        step = jax.device_put(jnp.array(first.step, jnp.int32, copy=True), replicated)
        skipped = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        # On the mesh like the step's outputs, so the second step does not retrace. One
        # program, not one per distinct leaf shape that optax's init makes eagerly (the
        # mesh in context: params on Explicit axes carry it in their types).
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
            opt_state = self.tx.init(params)  # Traced in the caller's program.
        else:
            with jax.set_mesh(mesh):
                opt_state = jax.jit(self.tx.init)(params)
        opt_state = jax.tree.map(
            lambda x: jax.device_put(x, _dense_sharding(x, replicated)), opt_state
        )
        state = TrainState(
            step,
            params,
            opt_state,
            embedding,
            self._pending_like(embs, features, False),
            skipped,
            placed(model_state, copy=not owned),
            placed(rng),
        )
        return unaliased(state)

    def _micro_keys(self, key):
        """The key of each micro-batch (k keys), or the step's key when k == 1."""
        if key is None or self.accumulate_steps == 1:
            return key
        return jax.random.split(key, self.accumulate_steps)

    # ------------------------------------------------------------------- step

    def _grads(self, params, acts, batch, model_state, key):
        """Loss, d(loss)/d(params), d(loss)/d(acts), aux and the new model state of one
        (micro-)batch."""

        def loss_of(params, acts):
            out, new_model_state = self._loss(params, acts, batch, model_state, key)
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
            return loss.astype(jnp.float32), (aux, new_model_state)

        loss, vjp_fn, (aux, new_model_state) = jax.vjp(loss_of, params, acts, has_aux=True)
        dparams, dacts = vjp_fn(jnp.ones_like(loss))
        return loss, dparams, dacts, aux, new_model_state

    def _accumulated_grads(self, params, acts, batch, model_state, keys, embs, first):
        """`_grads` summed over k micro-batches, one at a time (lax.scan); the activation
        gradients come back concatenated like the features (`_merge`)."""
        k = self.accumulate_steps
        micro_acts = {n: jax.tree.map(lambda a, e=embs[n]: _split(a, k, e), acts[n]) for n in acts}

        def body(carry, xs):
            dparams_sum, loss_sum, model_state = carry
            micro, macts, key = xs
            loss, dparams, dacts, aux, model_state = self._grads(
                params, macts, micro, model_state, key
            )
            dparams_sum = jax.tree.map(jnp.add, dparams_sum, dparams)
            return (dparams_sum, loss_sum + loss, model_state), (dacts, aux)

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros((), jnp.float32), model_state)
        (dparams, loss, model_state), (dacts, aux) = jax.lax.scan(
            body, init, (batch, micro_acts, keys)
        )
        dacts = {n: jax.tree.map(lambda g, e=embs[n]: _merge(g, e), dacts[n]) for n in dacts}
        return loss, dparams, dacts, aux, model_state

    def _step(self, state: TrainState, batch, next_batch=None):
        k = self.accumulate_steps
        if state.rng is None:
            step_key = next_rng = None
        else:
            next_rng, step_key = jax.random.split(state.rng)
        keys = self._micro_keys(step_key)
        embs, features = self._features(state.params, batch, state.model_state, keys)
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
        # With micro-batches the merged features hold k·b examples; the batch is (k, b, ...).
        batch = self._shard_batch(batch, first, examples_of(features) // k, lead=int(k > 1))

        if next_batch is not None and any(e.cached for e in embs.values()):
            # Issued before the lookups: the host reads overlap this step's work.
            _, upcoming = self._features(state.params, next_batch, state.model_state, keys)
            states = {n: embs[n].prefetch(states[n], upcoming[n]) for n in embs}
        # One host read of each host table's rows for the lookup and the update (in a
        # pipelined step, of this batch's rows and the pending batch's).
        before = {n: [state.pending.features[n]] for n in pipelined if state.pending is not None}
        staged = {n: embs[n].stage(states[n], features[n], *before.get(n, [])) for n in embs}
        acts = {n: embs[n].lookup(states[n], features[n], staged=staged.get(n)) for n in embs}
        if k == 1:
            loss, dparams, dacts, aux, model_state = self._grads(
                state.params, acts, batch, state.model_state, step_key
            )
        else:
            loss, dparams, dacts, aux, model_state = self._accumulated_grads(
                state.params, acts, batch, state.model_state, keys, embs, first
            )
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
            new_states[n] = _apply_masked(
                emb, states[n], upd_features, upd_grads, keep, staged.get(n)
            )
        pending = None
        if pipelined:
            sharding = {n: NamedSharding(embs[n].mesh, P(embs[n].axis)) for n in pipelined}
            pending = Pending(
                {
                    n: jax.tree.map(
                        lambda x, s=sharding[n]: _sharding.constrain(jnp.asarray(x), s), features[n]
                    )
                    for n in pipelined
                },
                {
                    n: jax.tree.map(lambda x, s=sharding[n]: _sharding.constrain(x, s), dacts[n])
                    for n in pipelined
                },
                ok,
            )

        updates, opt_state = self.tx.update(dparams, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        keep_new = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        params = jax.tree.map(keep_new, params, state.params)
        opt_state = jax.tree.map(keep_new, opt_state, state.opt_state)
        model_state = jax.tree.map(keep_new, model_state, state.model_state)
        rng = None if state.rng is None else keep_new(next_rng, state.rng)

        new_state = TrainState(
            step=state.step + ok.astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            embedding=self._pack(state.embedding, new_states),
            pending=pending,
            skipped=state.skipped + (~ok).astype(jnp.int32),
            model_state=model_state,
            rng=rng,
        )
        invalid = sum(
            jnp.sum(jnp.stack(list(embs[n].invalid_id_counts(features[n]).values()))) for n in embs
        )
        metrics = {
            "loss": loss,
            "skipped": (~ok).astype(jnp.int32),
            "invalid_ids": jnp.asarray(invalid, jnp.int32),
        }
        dynamic = {}
        for n in embs:  # The indexes' counters: O(shards) each, never a scan of an index.
            for table, counts in embs[n].dynamic_counters(new_states[n]).items():
                dynamic[table if len(embs) == 1 else f"{n}/{table}"] = counts
        if dynamic:
            metrics["dynamic"] = dynamic
        if aux is not None:
            metrics["aux"] = aux
        self.trace_count += 1  # Counted once the trace succeeded.
        return new_state, metrics

    def _shard_batch(self, batch, emb: _embedding.Embedding, batch_size: int, lead: int = 0):
        """Every array of the batch with dimension B after `lead` leading axes (the
        micro-batch axis) is split over the mesh axis along that dimension."""
        if batch_size < 1 or batch_size % emb.num_shards:
            # Said here: splitting the batch below would fail with a raw sharding error.
            raise ValueError(
                f"TrainStep: the batch has B={batch_size} examples, which mesh axis "
                f"{emb.axis!r} of size {emb.num_shards} does not divide; B must be a positive "
                f"multiple of {emb.num_shards} (drop or pad the remainder)."
            )
        sharding = NamedSharding(emb.mesh, P(*([None] * lead), emb.axis))

        def shard(x):
            if (
                hasattr(x, "shape")
                and len(x.shape) >= 1 + lead
                and x.shape[lead] == batch_size
                and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            ):
                return _sharding.constrain(jnp.asarray(x), sharding)
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
                None,
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
        accumulate_steps: int = 1,
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

        def discover(params, batch, model_state, rng):
            del params, model_state, rng
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
            loss=lambda params, acts, batch, model_state, rng: (
                loss_fn(params, acts[name], batch),
                model_state,
            ),
            tx=tx,
            unpack=lambda e: {name: e},
            pack=lambda e, states: states[name],
            donate=donate,
            accumulate_steps=accumulate_steps,
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
    accumulate_steps: int = 1,
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
        accumulate_steps: k > 1: every batch leaf has a leading axis of k micro-batches,
            (k, b, ...); the model runs one micro-batch at a time, dense and row gradients
            are summed over all k, and one dense and one sparse update (one per touched row)
            follow: for a loss summed over examples, one step on the concatenated batch.
            `loss_fn` sees one micro-batch; metrics["loss"] is the sum of the k losses and
            metrics["aux"] has a leading axis of k.

    Returns:
        `step(state, batch) -> (state, metrics)`, with `step.init(key, params, ...)` making the
        first state and `step.flush(state)` applying a pipelined step's pending update. Every
        array in the batch whose leading dimension is B is split over the mesh axis.
    """
    return EmbeddingTrainStep(
        emb,
        loss_fn,
        tx,
        features_fn=features_fn,
        donate=donate,
        accumulate_steps=accumulate_steps,
    )
