"""Flax NNX integration: the `Embed` module and a train step that updates a model in place.

    class Model(nnx.Module):
        def __init__(self, spec, rngs):
            self.embed = jte.nnx.Embed(spec, rngs=rngs)
            self.head = nnx.Linear(3 * D, 1, rngs=rngs)

        def __call__(self, features):
            acts = self.embed(features)                     # {feature: (B, D)}
            return self.head(jnp.concatenate(jax.tree.leaves(acts), axis=-1))[:, 0]

    model = Model(spec, nnx.Rngs(0))
    step = jte.nnx.make_train_step(model, loss_fn, optax.adam(1e-3))   # loss_fn(model, batch)
    metrics = step(batch)                                   # `model` is updated in place
    model.eval(); predictions = model(batch["features"])   # plain NNX inference

The tables, their optimizer slots and their step counter are one `EmbeddingTable` variable per
`Embed` (holding a `jte.EmbeddingState`), never an `nnx.Param`: `nnx.Optimizer(model, tx,
wrt=nnx.Param)` and `nnx.grad` over params never see a table, and no (V, D) gradient is formed.
The train step does what `jte.make_train_step` does (one lookup per `Embed`, the model's loss
differentiated with respect to the activations, one sparse update per touched row) on the
model's state split three ways: `nnx.Param` (optax), `EmbeddingTable` (the spec's sparse
optimizers) and everything else (batch statistics, rng counters), which the model updates as
it runs, so `nnx.Dropout` draws new masks every step and `nnx.BatchNorm` keeps its statistics.

Inside the step each `Embed` returns the activations the step computed; outside it, calling
an `Embed` looks its features up in its own tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import _config, _embedding, _guards, _train
from . import checkpoint as _checkpoint


class EmbeddingTable(nnx.Variable):
    """The state of one `Embed`: a `jte.EmbeddingState` (tables, slots, step).

    Not an `nnx.Param`, so optimizers and gradients over `nnx.Param` never touch it; the
    spec's sparse optimizers update it (`jte.nnx.make_train_step`).
    """


# Handlers of Embed calls inside a train step, innermost last: fn(layer, features) -> acts.
_HANDLERS = threading.local()


@contextlib.contextmanager
def _intercept(handler: Callable):
    stack = _HANDLERS.__dict__.setdefault("stack", [])
    stack.append(handler)
    try:
        yield
    finally:
        stack.pop()


def _handler() -> Callable | None:
    stack = getattr(_HANDLERS, "stack", None)
    return stack[-1] if stack else None


class Embed(nnx.Module):
    """Embeds the features of `spec`; its state is an `EmbeddingTable` variable.

    Calling it: `layer(features) -> activations`, features mirroring the spec (each leaf int
    (B,), int (B, L) padded with -1, or `jte.Weighted`), activations the same structure with
    float32 (B, D) per feature ((B, L, D) for sequence features).

    Args:
        spec: The EmbeddingSpec.
        mesh: As for `jte.Embedding` (default: every device on one axis "shard").
        axis: As for `jte.Embedding`.
        rngs: The tables are drawn by `Embedding.init(rngs.params())`: the same logical
            tables for every mesh size and strategy.

    Attributes:
        embedding: The `jte.Embedding` behind the layer: `engine` if given (built with
            any options; `from_embedding` passes it), else `jte.Embedding(spec, mesh, axis)`.
        state: The `EmbeddingTable` variable; `embedding_state` is its value.
    """

    def __init__(
        self,
        spec: _config.EmbeddingSpec,
        mesh: jax.sharding.Mesh | None = None,
        *,
        axis: str | None = None,
        rngs: nnx.Rngs,
        engine: _embedding.Embedding | None = None,
    ):
        if not isinstance(spec, _config.EmbeddingSpec):
            raise TypeError(
                f"jte.nnx.Embed: spec must be a jte.EmbeddingSpec, got {type(spec).__name__}."
            )
        if engine is None:
            engine = _embedding.Embedding(spec, mesh=mesh, axis=axis)
        elif not isinstance(engine, _embedding.Embedding) or engine.spec is not spec:
            raise ValueError(
                "jte.nnx.Embed: engine must be a jte.Embedding of the layer's spec; use "
                "Embed.from_embedding(engine, rngs=...)."
            )
        self.embedding = engine
        self.state = EmbeddingTable(self.embedding.init(rngs.params()))

    @classmethod
    def from_embedding(cls, emb: _embedding.Embedding, *, rngs: nnx.Rngs) -> Embed:
        """The layer of an existing `jte.Embedding`, built with any options (its
        `.embedding` is `emb`)."""
        return cls(emb.spec, emb.mesh, axis=emb.axis, rngs=rngs, engine=emb)

    @property
    def embedding_state(self) -> _embedding.EmbeddingState:
        """The layer's `jte.EmbeddingState` (e.g. for `jte.checkpoint.save`); replace it with
        `layer.state.set_value(new_state)`."""
        return self.state.get_value()

    def __call__(self, features: Any) -> Any:
        handler = _handler()
        if handler is not None:
            return handler(self, features)
        return self.embedding.lookup(self.embedding_state, features)


# ----------------------------------------------------------------------- helpers


def _path_name(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def embeds(model: nnx.Module) -> dict[str, Embed]:
    """{path "a/b": layer} of every `Embed` in `model` (a root-level one has the path "")."""
    return {
        _path_name(path): node for path, node in nnx.iter_graph(model) if isinstance(node, Embed)
    }


def _unpack(state: nnx.State) -> dict[str, _embedding.EmbeddingState]:
    """{layer path: EmbeddingState} from the EmbeddingTable part of a split model."""
    return {_path_name(path[:-1]): var.get_value() for path, var in nnx.to_flat_state(state)}


def _pack(state: nnx.State, states: dict[str, _embedding.EmbeddingState]) -> nnx.State:
    flat = [
        (path, var.replace(states.get(_path_name(path[:-1]), var.get_value())))
        for path, var in nnx.to_flat_state(state)
    ]
    return nnx.from_flat_state(flat)


def _split(model: nnx.Module):
    """(graphdef, params, embedding tables, everything else) of `model`."""
    return nnx.split(model, nnx.Param, EmbeddingTable, ...)


# --------------------------------------------------------------------- train step


class NnxTrainStep(_train.TrainStep):
    """The step `jte.nnx.make_train_step` returns: `metrics = step(batch)` updates the model.

    The model's `nnx.Param`s are trained by optax, its `Embed` tables by the spec's sparse
    optimizers, and its other variables (batch statistics, rng counters) are whatever the
    model leaves in them after the forward pass. The step state that is not the model's
    (optax state, step and skip counters, a pipelined update) lives here: `state`.
    Every `Embed` of the model must be called once per forward pass.

    Attributes:
        model: The model, updated in place by every call.
        state: The `jte.TrainState` of the last step without the model's own variables
            (params, embedding, model_state are None); None before the first step.
        trace_count: As for `jte.TrainStep`; a change of the model's structure or mode
            (e.g. `model.eval()` before a step) traces again.
    """

    def __init__(
        self,
        model: nnx.Module,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        *,
        donate: bool = True,
        accumulate_steps: int = 1,
    ):
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"jte.nnx.make_train_step: model must be a flax.nnx Module, "
                f"got {type(model).__name__}."
            )
        if not callable(loss_fn):
            raise TypeError(
                f"jte.nnx.make_train_step: loss_fn must be callable fn(model, batch), "
                f"got {loss_fn!r}."
            )
        if not embeds(model):
            raise ValueError("jte.nnx.make_train_step: the model has no jte.nnx.Embed.")
        self.model = model
        self.state: _train.TrainState | None = None
        # Set before each trace: the model's structure and its tables (which the merged model
        # holds but never reads inside the step: every Embed call is answered by a handler).
        self._graphdef: Any = None
        self._tables: Any = None

        def merged(params, model_state) -> nnx.Module:
            # Fresh Variables (tree.map rebuilds them), created in the current trace: NNX
            # refuses to update a Variable from a trace other than its own, and the model
            # state comes into vjp and scan bodies from the enclosing jit.
            fresh = jax.tree.map(lambda x: x, (params, self._tables, model_state))
            return nnx.merge(self._graphdef, *fresh)

        def discover(params, batch, model_state, rng):
            del rng  # NNX models carry their rng streams in model_state.
            model = merged(params, model_state)
            names = {id(layer): name for name, layer in embeds(model).items()}
            found = {}

            def handler(layer, features):
                name = names[id(layer)]
                if name in found:
                    raise ValueError(
                        f"Embed at {name or 'the root'!r} is called more than once in one "
                        f"forward pass. Call it once with all the features (features "
                        f"sharing a table belong in one spec)."
                    )
                emb = layer.embedding
                found[name] = (emb, features)
                shapes = jax.eval_shape(emb.lookup, emb.abstract_state(), features)
                return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            # The forward pass runs on a throwaway model: its rng draws and statistics
            # updates are dropped, and XLA drops all of it but the features.
            with _intercept(handler):
                loss_fn(model, batch)
            if not found:
                raise ValueError("jte.nnx.make_train_step: the loss calls no jte.nnx.Embed.")
            return found

        def loss(params, acts, batch, model_state, rng):
            del rng
            model = merged(params, model_state)
            names = {id(layer): name for name, layer in embeds(model).items()}
            with _intercept(lambda layer, features: acts[names[id(layer)]]):
                out = loss_fn(model, batch)
            return out, _split(model)[3]

        super().__init__(
            discover=discover,
            loss=loss,
            tx=tx,
            unpack=_unpack,
            pack=_pack,
            donate=donate,
            accumulate_steps=accumulate_steps,
        )
        donate_argnums = (0,) if donate else ()
        self._nnx_jit = jax.jit(self._traced, static_argnums=2, donate_argnums=donate_argnums)
        self._nnx_flush_jit = jax.jit(
            self._traced_flush, static_argnums=1, donate_argnums=donate_argnums
        )

    def _traced(self, state: _train.TrainState, batch, graphdef, next_batch=None):
        self._graphdef, self._tables = graphdef, state.embedding
        return self._step(state, batch, next_batch)

    def _traced_flush(self, state: _train.TrainState, graphdef):
        self._graphdef, self._tables = graphdef, state.embedding
        return self._flush(state)

    def _full_state(self, batch) -> tuple[Any, _train.TrainState]:
        """(graphdef, the TrainState of the model as it is now); the first call makes the
        optax state and counters."""
        graphdef, params, tables, rest = _split(self.model)
        _guards.check_not_consumed(
            {"params": params, "tables": tables, "rest": rest, "step_state": self.state},
            "jte.nnx train step",
            "model",
            "model",
            advice="A step donates the model's arrays and puts the new ones in the model: "
            "arrays taken from the model before a step (nnx.state, nnx.split) must not be "
            "put back after it; copy them when taking them (jax.tree.map(jnp.copy, ...)).",
        )
        self._graphdef, self._tables = graphdef, tables
        if self.state is None:
            # Copies of the params and variables, placed on the mesh as the step's outputs
            # will be; the model keeps its own until the step's results replace them.
            state = self._make_state(
                params, tables, batch, abstract=False, model_state=rest, rng=None
            )
        else:
            state = dataclasses.replace(
                self.state, params=params, embedding=tables, model_state=rest
            )
        return graphdef, _train.unaliased(state)

    def _write_back(self, new: _train.TrainState) -> None:
        nnx.update(self.model, new.params, new.embedding, new.model_state)
        self.state = dataclasses.replace(new, params=None, embedding=None, model_state=None)

    def __call__(self, batch: Any, next_batch: Any = None) -> dict:  # pyright: ignore[reportIncompatibleMethodOverride]
        """One step on `batch`; updates the model and returns the metrics (device arrays).
        `next_batch`: as for `jte.make_train_step`'s steps (HostCached tables prefetch its
        rows)."""
        graphdef, state = self._full_state(batch)
        new, metrics = self._nnx_jit(state, batch, graphdef, next_batch)
        self._write_back(new)
        self._in_flight.push(metrics["loss"])
        return metrics

    def lower(self, batch: Any) -> jax.stages.Lowered:  # pyright: ignore[reportIncompatibleMethodOverride]
        """AOT: the step lowered for the model as it is and `batch` (arrays or
        jax.ShapeDtypeStruct); nothing runs and the model does not change."""
        graphdef, state = self._full_state(batch)
        return self._nnx_jit.lower(state, batch, graphdef)

    def flush(self) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Applies the update a pipelined step left pending to the model; a no-op otherwise.

        Call it before evaluating, exporting or checkpointing a pipelined model.
        """
        if self.state is None or self.state.pending is None:
            return
        graphdef, state = self._full_state(None)
        self._write_back(self._nnx_flush_jit(state, graphdef))

    def init(self, *, params: Any = None, embedding_state: Any = None) -> None:
        """Starts training from given weights: writes them into the model (checked against
        it) and restarts the optax state and counters at the next step.

        Args:
            params: The model's `nnx.Param`s, e.g. dense weights from another framework: an
                `nnx.State` or its pure dict (`nnx.to_pure_dict(nnx.state(model,
                nnx.Param))`'s structure), with the model's shapes and dtypes; copied.
            embedding_state: A `jte.EmbeddingState` (e.g. from `emb.restore_tables` or
                `jte.checkpoint.restore`) for a model with one `Embed`, else {layer path:
                EmbeddingState} (paths as `jte.nnx.embeds(model)`); consumed by the first
                step, whose `state.step` continues from it.
        """
        layers = embeds(self.model)
        engines = {name: layer.embedding for name, layer in layers.items()}
        states = _guards.states_per_layer(embedding_state, engines, _embedding.EmbeddingState)
        if params is not None:
            current = nnx.state(self.model, nnx.Param)
            given = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
            _guards.check_like(given, nnx.to_pure_dict(current), "init: params")
            nnx.replace_by_pure_dict(current, jax.tree.map(lambda x: jnp.array(x), given))
            nnx.update(self.model, current)
        for name, state in states.items():
            layers[name].state.set_value(state)
        self.state = None

    @property
    def opt_state(self) -> Any:
        """The optax state of the model's params (None before the first step)."""
        return None if self.state is None else self.state.opt_state


def make_train_step(
    model: nnx.Module,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    donate: bool = True,
    accumulate_steps: int = 1,
) -> NnxTrainStep:
    """One jitted, donating train step that updates an NNX model in place.

    Args:
        model: A flax.nnx Module with one or more `jte.nnx.Embed`s.
        loss_fn: fn(model, batch) -> float scalar loss, or (loss, aux). It runs in the
            model's current mode: call `model.train()` before training (NNX's default) and
            `model.eval()` for evaluation.
        tx: The optax optimizer of the model's `nnx.Param`s. The tables are never params:
            the spec's sparse optimizers update them.
        donate: Donate the model's arrays to the step (default), so tables are updated in
            place; the model holds the new arrays after each call.
        accumulate_steps: k > 1: every batch leaf has a leading axis of k micro-batches; see
            `jte.make_train_step`. The model runs on one micro-batch at a time, its other
            variables (batch statistics, rng counters) carried from one to the next.

    Returns:
        `step(batch) -> metrics` ({"loss", "skipped", "invalid_ids", "aux" if any}, as
        `jte.TrainStep`); `step.flush()` applies a pipelined step's pending update.
        Every array in the batch whose leading dimension is B is split over the mesh axis.
    """
    return NnxTrainStep(model, loss_fn, tx, donate=donate, accumulate_steps=accumulate_steps)


# --------------------------------------------------------------------- checkpoints


def _key_data(tree):
    """Typed PRNG keys (nnx.Rngs) as their raw uint32 data: orbax stores plain arrays."""

    def raw(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    return jax.tree.map(raw, tree)


def _dense(model: nnx.Module, train_step: NnxTrainStep | None) -> dict:
    dense: dict = {"model": _key_data(nnx.to_pure_dict(nnx.state(model, nnx.Not(EmbeddingTable))))}
    if train_step is not None:
        if train_step.state is None:
            raise ValueError(
                "jte.nnx: train_step has not run yet, so it has no optimizer state to save "
                "or restore into; run one step first or leave train_step out."
            )
        s = train_step.state
        dense["train"] = {"opt_state": s.opt_state, "step": s.step, "skipped": s.skipped}
    return dense


def _only_embed(model: nnx.Module, what: str) -> Embed:
    layers = embeds(model)
    if len(layers) != 1:
        raise ValueError(
            f"jte.nnx.{what}: the model has {len(layers)} Embed layers ({sorted(layers)}); "
            f"these helpers handle one. Save each layer with jte.checkpoint.save(directory, "
            f"layer.embedding, layer.embedding_state) in its own directory."
        )
    return next(iter(layers.values()))


def save_checkpoint(
    directory: str | os.PathLike, model: nnx.Module, *, train_step: NnxTrainStep | None = None
) -> int:
    """`jte.checkpoint.save` of an NNX model: its Embed's tables and slots (logical rows) and,
    as the dense state, every other variable (params, batch statistics, rng state) and, with
    `train_step`, its optax state and counters. Returns the step saved (the tables' step).

    A pipelined step must be flushed first (`train_step.flush()`).
    """
    if train_step is not None and train_step.state is not None:
        pending = train_step.state.pending
        if pending is not None and bool(pending.valid):
            raise ValueError(
                "jte.nnx.save_checkpoint: the step has a pending update "
                "(pipeline_execution); call train_step.flush() first."
            )
    layer = _only_embed(model, "save_checkpoint")
    return _checkpoint.save(
        directory, layer.embedding, layer.embedding_state, dense=_dense(model, train_step)
    )


def restore_checkpoint(
    directory: str | os.PathLike,
    model: nnx.Module,
    *,
    step: int | None = None,
    train_step: NnxTrainStep | None = None,
) -> int:
    """Loads a `save_checkpoint` checkpoint into `model` (and `train_step`), in place.

    The model may live on another mesh size or use another partition strategy than the one
    saved: tables come back in logical rows onto its Embed's mesh. The model's structure
    must match the saved one. With `train_step`, which must have run a step (so that its
    optax state exists), its optax state and counters are restored too.

    Returns:
        The step restored.
    """
    layer = _only_embed(model, "restore_checkpoint")
    target = _dense(model, train_step)
    emb_state, dense = _checkpoint.restore(
        directory, layer.embedding, step=step, dense_target=target
    )
    current = nnx.to_pure_dict(nnx.state(model, nnx.Not(EmbeddingTable)))

    def rekey(now, saved):
        if isinstance(now, jax.Array) and jnp.issubdtype(now.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(now))
        return saved

    restored = jax.tree.map(rekey, current, dense["model"])
    rest = nnx.state(model, nnx.Not(EmbeddingTable))
    nnx.replace_by_pure_dict(rest, restored)
    nnx.update(model, rest)
    layer.state.set_value(emb_state)
    if train_step is not None:
        assert train_step.state is not None  # _dense checked it.
        train = dense["train"]
        train_step.state = dataclasses.replace(
            train_step.state,
            opt_state=train["opt_state"],
            step=train["step"],
            skipped=train["skipped"],
        )
    return int(jax.device_get(emb_state.step))
