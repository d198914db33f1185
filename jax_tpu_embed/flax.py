"""Flax (linen) integration: the `Embed` layer and a train step for models that use it.

    class Model(nn.Module):
        embed: jte.flax.Embed

        @nn.compact
        def __call__(self, batch):
            acts = self.embed(batch["features"])          # {feature: (B, D)}
            x = jnp.concatenate(jax.tree.leaves(acts), axis=-1)
            return nn.Dense(1)(x)[:, 0]

    model = Model(jte.flax.Embed(spec))
    step = jte.flax.make_train_step(model, loss_fn, optax.adam(1e-3))
    state = step.init(jax.random.key(0), batch)
    state, metrics = step(state, batch)

The tables, their optimizer slots and their step counter live in the variable collection
"embedding" (`tables`, `slots`, `step` under the layer's path), never in "params": an optax
optimizer over "params" never sees a table. `model.apply({"params": ..., "embedding": ...},
batch)` runs the model for evaluation.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.core
import jax.numpy as jnp
import optax

from . import _config, _embedding, _train

COLLECTION = "embedding"
_STATE_KEYS = ("tables", "slots", "step")

# One Embedding per (spec, mesh, axis): flax clones modules freely, and each clone must give
# the same engine (and the same jit caches).
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _engine(spec: _config.EmbeddingSpec, mesh, axis) -> _embedding.Embedding:
    per_spec = _ENGINES.setdefault(spec, {})
    key = (mesh, axis)
    if key not in per_spec:
        per_spec[key] = _embedding.Embedding(spec, mesh=mesh, axis=axis)
    return per_spec[key]


class Embed(nn.Module):
    """Embeds the features of `spec`; its state lives in the "embedding" collection.

    Calling it: `layer(features) -> activations`, features mirroring the spec (each leaf int
    (B,), int (B, L) padded with -1, or `jte.Weighted`), activations the same structure with
    float32 (B, D) per feature ((B, L, D) for sequence features).

    Initialisation draws the state with `Embedding.init`, from the "embedding" rng stream if
    given, else "params": the same logical tables for every mesh size and strategy.

    Attributes:
        spec: The EmbeddingSpec.
        mesh: As for `jte.Embedding` (default: every device on one axis "shard").
        axis: As for `jte.Embedding`.
    """

    spec: _config.EmbeddingSpec
    mesh: jax.sharding.Mesh | None = None
    axis: str | None = None

    @property
    def embedding(self) -> _embedding.Embedding:
        """The `jte.Embedding` behind this layer (shared by every clone of it)."""
        return _engine(self.spec, self.mesh, self.axis)

    @classmethod
    def from_embedding(cls, emb: _embedding.Embedding, **kwargs) -> Embed:
        """The layer of an existing `jte.Embedding` (its `.embedding` is `emb`)."""
        _ENGINES.setdefault(emb.spec, {})[(emb.mesh, emb.axis)] = emb
        return cls(emb.spec, mesh=emb.mesh, axis=emb.axis, **kwargs)

    @nn.compact
    def __call__(self, features: Any) -> Any:
        emb = self.embedding
        initial = None
        if not self.has_variable(COLLECTION, "tables"):
            if not self.is_mutable_collection(COLLECTION):
                raise ValueError(
                    f"Embed at {'/'.join(self.path) or 'the root'}: no {COLLECTION!r} "
                    f"variables. Pass them with the params: model.apply({{'params': ..., "
                    f"{COLLECTION!r}: ...}}, ...), as model.init returned them."
                )
            initial = _placed(emb, emb.init(self.make_rng(COLLECTION)))

        def created() -> _embedding.EmbeddingState:
            # Called only to create the variables: on the branch above that set `initial`.
            assert initial is not None
            return initial

        tables = self.variable(COLLECTION, "tables", lambda: created().tables)
        slots = self.variable(COLLECTION, "slots", lambda: created().slots)
        step = self.variable(COLLECTION, "step", lambda: created().step)
        state = _embedding.EmbeddingState(tables.value, slots.value, step.value)
        return emb.lookup(state, features)


def _placed(
    emb: _embedding.Embedding, state: _embedding.EmbeddingState
) -> _embedding.EmbeddingState:
    """`state` constrained to emb's shardings when traced (e.g. `jax.jit(model.init)`).

    Traced inside another jit, `Embedding.init`'s values lose their row sharding, and the
    lookup (a shard_map over row-sharded tables) would reject them.
    """
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
        return state
    abstract = emb.abstract_state()
    return jax.tree.map(lambda x, a: _train._constrain(x, a.sharding), state, abstract)


# ----------------------------------------------------------------- state helpers


def _path_name(path: tuple) -> str:
    return "/".join(path)


def embedding_states(collection: dict) -> dict[str, _embedding.EmbeddingState]:
    """{layer path "a/b": EmbeddingState} of every `Embed` in an "embedding" collection.

    Args:
        collection: `variables["embedding"]` or `TrainState.embedding`. A root-level `Embed`
            has the path "".
    """
    out = {}

    def walk(node, path):
        if isinstance(node, dict) and set(_STATE_KEYS) <= set(node):
            out[_path_name(path)] = _embedding.EmbeddingState(
                node["tables"], node["slots"], node["step"]
            )
            return
        if not isinstance(node, dict):
            raise ValueError(
                f"embedding_states: {_path_name(path)!r} is not an Embed's "
                f"state (tables, slots, step); got {type(node).__name__}."
            )
        for key in node:
            walk(node[key], path + (key,))

    walk(collection, ())
    return out


def replace_embedding_states(
    collection: dict, states: dict[str, _embedding.EmbeddingState]
) -> dict:
    """A copy of `collection` with the states of the layers named in `states` replaced."""
    unknown = sorted(set(states) - set(embedding_states(collection)))
    if unknown:
        raise ValueError(
            f"replace_embedding_states: no Embed at {unknown}; the collection "
            f"has {sorted(embedding_states(collection))}."
        )

    def walk(node, path):
        name = _path_name(path)
        if set(_STATE_KEYS) <= set(node):
            if name not in states:
                return node
            s = states[name]
            return {**node, "tables": s.tables, "slots": s.slots, "step": s.step}
        return {k: walk(v, path + (k,)) for k, v in node.items()}

    return walk(collection, ())


# ------------------------------------------------------------------- train step


def _is_embed_call(context) -> bool:
    return isinstance(context.module, Embed) and context.method_name == "__call__"


def _features_arg(args, kwargs):
    if args:
        return args[0]
    if "features" in kwargs:
        return kwargs["features"]
    raise TypeError("Embed.__call__ needs the features.")


class FlaxTrainStep(_train.TrainStep):
    """The step `jte.flax.make_train_step` returns.

    `state.params` is the model's "params" collection and `state.embedding` its "embedding"
    collection. Every `Embed` of the model takes part; each must be called once per forward
    pass (give one layer all the features that share its tables).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        method: Callable | str | None = None,
        donate: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"jte.flax.make_train_step: model must be a flax.linen Module, "
                f"got {type(model).__name__}."
            )
        self.model, self.method = model, method

        def discover(params, batch):
            """Runs the model once to see which features reach which Embed.

            The Embeds return zeros here, and nothing of this pass reaches the step's
            outputs: XLA drops all of it but the features.
            """
            found = {}

            def interceptor(next_fun, args, kwargs, context):
                if not _is_embed_call(context):
                    return next_fun(*args, **kwargs)
                name = _path_name(context.module.path)
                if name in found:
                    raise ValueError(
                        f"Embed at {name or 'the root'!r} is called more than once in one "
                        f"forward pass. Call it once with all the features (features "
                        f"sharing a table belong in one spec)."
                    )
                features = _features_arg(args, kwargs)
                emb = context.module.embedding
                found[name] = (emb, features)
                shapes = jax.eval_shape(emb.lookup, emb.abstract_state(), features)
                return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            with nn.intercept_methods(interceptor):
                model.apply({"params": params}, batch, method=method)
            if not found:
                raise ValueError("jte.flax.make_train_step: the model calls no jte.flax.Embed.")
            return found

        def loss(params, acts, batch):
            def interceptor(next_fun, args, kwargs, context):
                if not _is_embed_call(context):
                    return next_fun(*args, **kwargs)
                return acts[_path_name(context.module.path)]

            with nn.intercept_methods(interceptor):
                outputs = model.apply({"params": params}, batch, method=method)
            return loss_fn(outputs, batch)

        super().__init__(
            discover=discover,
            loss=loss,
            tx=tx,
            unpack=embedding_states,
            pack=replace_embedding_states,
            donate=donate,
        )
        self._predict_jit = None

    def _split_variables(self, variables: dict) -> tuple[Any, dict]:
        other = sorted(set(variables) - {"params", COLLECTION})
        if other:
            raise ValueError(
                f"jte.flax.make_train_step: the model has variable collections "
                f"{other}; only 'params' and {COLLECTION!r} are supported."
            )
        if COLLECTION not in variables:
            raise ValueError("jte.flax.make_train_step: the model has no jte.flax.Embed.")
        return variables.get("params", {}), variables[COLLECTION]

    def init(self, key: jax.Array, batch: Any) -> _train.TrainState:
        """The initial TrainState: `model.init(key, batch)`, then the optax state.

        Args:
            key: The rng of `model.init` (streams "params" and, if given as a dict,
                "embedding").
            batch: One batch; it fixes the shapes the step expects.
        """
        # One compiled program rather than one per table, slot and layer.
        init = jax.jit(functools.partial(self.model.init, method=self.method))
        params, collection = self._split_variables(init(key, batch))
        return self._make_state(params, collection, batch, abstract=False)

    def abstract_state(self, batch: Any) -> _train.TrainState:
        """The TrainState as jax.ShapeDtypeStruct leaves with shardings; allocates nothing."""
        variables = jax.eval_shape(
            lambda b: self.model.init(jax.random.key(0), b, method=self.method), batch
        )
        params, collection = self._split_variables(variables)
        jax.eval_shape(lambda p, b: self._found(p, b)[1], params, batch)  # Finds the Embeds.
        collection = replace_embedding_states(
            collection,
            {n: self.embeddings[n].abstract_state() for n in embedding_states(collection)},
        )
        return self._make_state(params, collection, batch, abstract=True)

    def predict(self, state: _train.TrainState, batch: Any) -> Any:
        """The model's outputs on `batch` (jitted, batch split over the mesh as in the step).

        For evaluation; the state is not donated. A pipelined state must be flushed first.
        """
        if state.pending is not None and bool(state.pending.valid):
            raise ValueError(
                "predict: the state has a pending update (pipeline_execution); "
                "call step.flush(state) first."
            )
        if self._predict_jit is None:

            def predict(state, batch):
                embs, features = self._found(state.params, batch)
                first = embs[sorted(embs)[0]]
                batch = self._shard_batch(batch, first, _train._batch_size(features))
                return self.model.apply(self.variables(state), batch, method=self.method)

            self._predict_jit = jax.jit(predict)
        return self._predict_jit(state, batch)

    def variables(self, state: _train.TrainState) -> dict:
        """{"params", "embedding"} for `model.apply` (flush a pipelined state first)."""
        return {"params": state.params, COLLECTION: state.embedding}


def make_train_step(
    model: nn.Module,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    method: Callable | str | None = None,
    donate: bool = True,
) -> FlaxTrainStep:
    """One jitted, state-donating train step for a flax model containing `Embed` layers.

    Args:
        model: A flax.linen Module; `model.apply(variables, batch, method=method)` gives the
            outputs. Its variables must be "params" and "embedding" only.
        loss_fn: fn(outputs, batch) -> float scalar loss, or (loss, aux).
        tx: The optax optimizer of "params".
        method: As for `model.apply`.
        donate: Donate the state to the step (default), so tables are updated in place.

    Returns:
        `step(state, batch) -> (state, metrics)` (see `jte.TrainStep`), with
        `step.init(key, batch)`, `step.flush(state)` and `step.variables(state)`.
    """
    return FlaxTrainStep(model, loss_fn, tx, method=method, donate=donate)
