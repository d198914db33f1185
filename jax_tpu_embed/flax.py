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
"embedding" (`tables`, `slots`, `step` under the layer's path, and `index`, the dynamic
tables' indexes and keys, when the spec has dynamic tables), never in "params": an optax
optimizer over "params" never sees a table. `model.apply({"params": ..., "embedding": ...},
batch)` runs the model for evaluation.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.core
import jax.numpy as jnp
import optax

from . import _config, _embedding, _guards, _sharding, _train

COLLECTION = "embedding"
_STATE_KEYS = ("tables", "slots", "step")  # And "index", only with dynamic tables.


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
        engine: The `jte.Embedding` to run, built with any options (`from_embedding` sets
            it); None: `jte.Embedding(spec, mesh, axis)`, built once when the layer is.
    """

    spec: _config.EmbeddingSpec
    mesh: jax.sharding.Mesh | None = None
    axis: str | None = None
    engine: _embedding.Embedding | None = None

    def __post_init__(self):
        # The layer holds its engine: flax clones modules freely, and every clone carries
        # the same one (and its jit caches).
        if self.engine is None:
            engine = _embedding.Embedding(self.spec, mesh=self.mesh, axis=self.axis)
            object.__setattr__(self, "engine", engine)
        elif not isinstance(self.engine, _embedding.Embedding):
            raise TypeError(
                f"jte.flax.Embed: engine must be a jte.Embedding, got {type(self.engine).__name__}."
            )
        elif self.engine.spec is not self.spec or (
            self.mesh is not None and self.engine.mesh != self.mesh
        ):
            raise ValueError(
                "jte.flax.Embed: engine was built for another spec or mesh than the "
                "layer's; use Embed.from_embedding(engine)."
            )
        super().__post_init__()

    @property
    def embedding(self) -> _embedding.Embedding:
        """The `jte.Embedding` behind this layer (shared by every clone of it)."""
        assert self.engine is not None  # Set in __post_init__.
        return self.engine

    @classmethod
    def from_embedding(cls, emb: _embedding.Embedding, **kwargs) -> Embed:
        """The layer of an existing `jte.Embedding`, built with any options (its
        `.embedding` is `emb`)."""
        return cls(emb.spec, mesh=emb.mesh, axis=emb.axis, engine=emb, **kwargs)

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
        index = {}
        if emb.dynamic:  # Only then: a static layer's variables are as they always were.
            index = self.variable(COLLECTION, "index", lambda: created().index).value
        state = _embedding.EmbeddingState(tables.value, slots.value, step.value, index)
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
    return jax.tree.map(lambda x, a: _sharding.constrain(x, a.sharding), state, abstract)


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
                node["tables"], node["slots"], node["step"], node.get("index", {})
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
            out = {**node, "tables": s.tables, "slots": s.slots, "step": s.step}
            if s.index or "index" in node:
                out["index"] = s.index
            return out
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


def _zero_activations(emb: _embedding.Embedding, features) -> Any:
    """Zeros shaped as `emb.lookup`'s activations of `features`: what an Embed answers while
    the model only runs to be looked at."""
    shapes = jax.eval_shape(emb.lookup, emb.abstract_state(), features)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# XLA:CPU options for a program that runs once on small arrays (the dense layers' init):
# LLVM's heavier optimisations take much of its compile time and would save less than they
# cost. Level 1 keeps the values bit for bit what model.init gives; level 0 does not (it
# leaves multiply-adds unfused).
_RUN_ONCE: dict[str, Any] = {"xla_backend_optimization_level": 1}


def _on_cpu(layers: dict) -> bool:
    """Whether every layer's embedding lives on a CPU mesh ({path: (Embedding, key)})."""
    return all(emb.mesh.devices.flat[0].platform == "cpu" for emb, _ in layers.values())


def _nested(states: dict[tuple, _embedding.EmbeddingState]) -> dict:
    """The "embedding" collection holding `states` ({layer path: state}) as flax nests it."""
    collection: dict = {}
    for path, state in states.items():
        node = collection
        for part in path:
            node = node.setdefault(part, {})
        node.update(tables=state.tables, slots=state.slots, step=state.step)
        if state.index:
            node["index"] = state.index
    return collection


def _given_states(layers: dict, embedding_state: Any) -> dict:
    """{layer path (a tuple): EmbeddingState} from `init`'s embedding_state argument,
    each checked against its layer's Embedding."""
    names = {_path_name(path): path for path in layers}
    engines = {name: layers[path][0] for name, path in names.items()}
    given = _guards.states_per_layer(embedding_state, engines, _embedding.EmbeddingState)
    return {names[name]: state for name, state in given.items()}


class FlaxTrainStep(_train.TrainStep):
    """The step `jte.flax.make_train_step` returns.

    `state.params` is the model's "params" collection, `state.embedding` its "embedding"
    collection and `state.model_state` its other collections ("batch_stats", ...; None when
    there are none), which the model updates as it runs (they are mutable in the step).
    `state.rng` feeds the rng streams (default "dropout"): a new key every step. Every
    `Embed` of the model takes part; each must be called once per forward pass (give one
    layer all the features that share its tables).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        method: Callable | str | None = None,
        donate: bool = True,
        accumulate_steps: int = 1,
        rng_streams: Sequence[str] = ("dropout",),
        apply_kwargs: dict | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"jte.flax.make_train_step: model must be a flax.linen Module, "
                f"got {type(model).__name__}."
            )
        if isinstance(rng_streams, str) or not all(isinstance(r, str) for r in rng_streams):
            raise TypeError(
                f"jte.flax.make_train_step: rng_streams must be a sequence of stream names "
                f"such as ('dropout',), got {rng_streams!r}."
            )
        self.model, self.method = model, method
        self.rng_streams = tuple(rng_streams)
        kwargs = dict(apply_kwargs or {})
        self.apply_kwargs = kwargs

        def run(params, batch, model_state, rng, interceptor):
            """The model's outputs and its updated other collections."""
            mutable = sorted(model_state or {})
            with nn.intercept_methods(interceptor):
                out = model.apply(
                    {"params": params, **(model_state or {})},
                    batch,
                    method=method,
                    rngs=self._rngs(rng),
                    mutable=mutable or False,
                    **kwargs,
                )
            if not mutable:
                return out, model_state
            outputs, updated = out
            return outputs, {**model_state, **updated}

        def discover(params, batch, model_state, rng):
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
                return _zero_activations(emb, features)

            run(params, batch, model_state, rng, interceptor)
            if not found:
                raise ValueError("jte.flax.make_train_step: the model calls no jte.flax.Embed.")
            return found

        def loss(params, acts, batch, model_state, rng):
            def interceptor(next_fun, args, kwargs, context):
                if not _is_embed_call(context):
                    return next_fun(*args, **kwargs)
                return acts[_path_name(context.module.path)]

            outputs, model_state = run(params, batch, model_state, rng, interceptor)
            return loss_fn(outputs, batch), model_state

        super().__init__(
            discover=discover,
            loss=loss,
            tx=tx,
            unpack=embedding_states,
            pack=replace_embedding_states,
            donate=donate,
            accumulate_steps=accumulate_steps,
        )
        self._predict_jit = None

    def _rngs(self, rng) -> dict | None:
        if rng is None:
            return None
        return {s: jax.random.fold_in(rng, i) for i, s in enumerate(self.rng_streams)}

    def _split_variables(self, variables: dict) -> tuple[Any, dict, dict | None]:
        if COLLECTION not in variables:
            raise ValueError("jte.flax.make_train_step: the model has no jte.flax.Embed.")
        other = {k: v for k, v in variables.items() if k not in ("params", COLLECTION)}
        return variables.get("params", {}), variables[COLLECTION], other or None

    def _init_rngs(self, key) -> tuple[Any, Any]:
        """(rngs of model.init, the train state's rng) from the key given to `init`."""
        if isinstance(key, dict):
            if "params" not in key:
                raise ValueError(f"init: a dict of keys needs a 'params' key; got {sorted(key)}.")
            base = key["params"]
            init_rngs = dict(key)
        else:
            base = key
            init_rngs = {"params": key}
        if not self.rng_streams:
            return init_rngs, None
        for i, s in enumerate(self.rng_streams):
            init_rngs.setdefault(s, jax.random.fold_in(base, 2 + i))
        train_rng = jax.random.fold_in(base, 1)
        if isinstance(key, dict) and "train" in key:
            train_rng = init_rngs.pop("train")
        if jnp.issubdtype(jnp.result_type(train_rng), jax.dtypes.prng_key):
            # Raw key data in the state: NumPy and orbax handle it like any uint32 array.
            train_rng = jax.random.key_data(train_rng)
        return init_rngs, train_rng

    def _model_init(self, rngs, batch, layers: dict | None = None):
        """`model.init` with every Embed answering zeros: the variables but the tables.

        Each Embed's key is drawn as `Embed.__call__` draws it (same stream, path and
        count), and `layers` (if given) gets {layer path: (its Embedding, that key)}. The
        tables are drawn afterwards by `Embedding.init`, outside this program: traced in
        it, every table's initialisation and first lookup were compiled into the model's
        init, one copy per table.
        """
        found = {} if layers is None else layers

        def interceptor(next_fun, args, kwargs, context):
            if not _is_embed_call(context):
                return next_fun(*args, **kwargs)
            module = context.module
            if module.path not in found:  # A second call is the step's error, not init's.
                found[module.path] = (module.embedding, module.make_rng(COLLECTION))
            return _zero_activations(module.embedding, _features_arg(args, kwargs))

        with nn.intercept_methods(interceptor):
            variables = self.model.init(rngs, batch, method=self.method, **self.apply_kwargs)
        return variables, {path: key for path, (_, key) in found.items()}

    def init(
        self,
        key: Any,
        batch: Any,
        *,
        params: Any = None,
        embedding_state: Any = None,
    ) -> _train.TrainState:
        """The initial TrainState: `model.init(key, batch)`, then the optax state.

        Args:
            key: The rng of `model.init` (stream "params"; the tables draw from it unless a
                dict of keys gives an "embedding" stream). The train state's rng (dropout)
                is derived from it (or taken from a dict's "train" entry).
            batch: One batch (with accumulate_steps=k, k micro-batches); it fixes the
                shapes the step expects.
            params: Start from these dense parameters (the "params" collection, e.g.
                weights from another framework) instead of `model.init`'s; copied. Their
                structure, shapes and dtypes must be `model.init`'s.
            embedding_state: Start from these tables (e.g. `emb.restore_tables(...)` or
                `jte.checkpoint.restore`) instead of drawing new ones: a
                `jte.EmbeddingState` for a model with one `Embed`, else {layer path:
                EmbeddingState} (paths as in `step.embeddings`; layers left out are drawn).
                Consumed by the first step; `state.step` continues from its step.
        """
        init_rngs, rng = self._init_rngs(key)
        layers: dict = {}
        # One program for the dense variables; the tables come from one `Embedding.init`
        # program per layer, the same state `model.init` gives them. Both are compiled at
        # once: XLA's compiles run outside the GIL, and are most of init's time.
        micro = self._first_micro(batch)
        dense_init = jax.jit(functools.partial(self._model_init, layers=layers))
        traced_init = dense_init.trace(init_rngs, micro)
        key_info = traced_init.out_info[1]
        if not key_info:
            raise ValueError("jte.flax.make_train_step: the model has no jte.flax.Embed.")
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((key, batch)))
        given = _given_states(layers, embedding_state)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            compiling = [
                pool.submit(emb.compile_init, key_info[path])
                for path, (emb, _) in layers.items()
                if not traced and path not in given  # Nothing is compiled inside a trace.
            ]
            if traced:
                variables, keys = dense_init(init_rngs, micro)
            else:
                options = _RUN_ONCE if _on_cpu(layers) else None
                compiled = traced_init.lower().compile(compiler_options=options)
                variables, keys = compiled(init_rngs, micro)
            for done in compiling:
                done.result()
        states = {
            path: given[path] if path in given else layers[path][0].init(k)
            for path, k in keys.items()
        }
        own_params, collection, model_state = self._split_variables(
            {**variables, COLLECTION: _nested(states)}
        )
        if params is not None:
            _guards.check_like(params, own_params, "init: params")
        return self._make_state(
            own_params if params is None else params,
            collection,
            batch,
            False,
            model_state=model_state,
            rng=rng,
            owned=params is None,
        )

    def _first_micro(self, batch):
        if self.accumulate_steps == 1:
            return batch
        return _train.first_micro_batch(batch, self.accumulate_steps)

    def abstract_state(self, batch: Any) -> _train.TrainState:
        """The TrainState as jax.ShapeDtypeStruct leaves with shardings; allocates nothing."""
        rngs_and_rng = jax.eval_shape(lambda: self._init_rngs(jax.random.key(0)))
        layers: dict = {}
        variables, _ = jax.eval_shape(
            lambda b: self._model_init(self._init_rngs(jax.random.key(0))[0], b, layers),
            self._first_micro(batch),
        )
        if not layers:
            raise ValueError("jte.flax.make_train_step: the model has no jte.flax.Embed.")
        states = {path: emb.abstract_state() for path, (emb, _) in layers.items()}
        params, collection, model_state = self._split_variables(
            {**variables, COLLECTION: _nested(states)}
        )
        rng = rngs_and_rng[1]
        jax.eval_shape(
            lambda p, b, m, r: self._features(p, b, m, self._micro_keys(r))[1],
            params,
            batch,
            model_state,
            rng,
        )  # Finds the Embeds.
        collection = replace_embedding_states(
            collection,
            {n: self.embeddings[n].abstract_state() for n in embedding_states(collection)},
        )
        return self._make_state(
            params, collection, batch, abstract=True, model_state=model_state, rng=rng
        )

    def predict(self, state: _train.TrainState, batch: Any, **kwargs) -> Any:
        """The model's outputs on `batch` (jitted, batch split over the mesh as in the step).

        For evaluation; the state is not donated and nothing in it changes. `kwargs` go to
        `model.apply` (e.g. train=False), replacing the step's `apply_kwargs`. A pipelined
        state must be flushed first.
        """
        _guards.check_not_consumed(state, "FlaxTrainStep.predict", "train state", "state")
        if any(e.dynamic for e in self.embeddings.values()):
            _guards.check_no_wide_ids(batch, "FlaxTrainStep.predict")
        if state.pending is not None and bool(state.pending.valid):
            raise ValueError(
                "predict: the state has a pending update (pipeline_execution); "
                "call step.flush(state) first."
            )
        if self._predict_jit is None:

            def predict(state, batch, kwargs):
                embs, features = self._found(state.params, batch, state.model_state, state.rng)
                first = embs[sorted(embs)[0]]
                batch = self._shard_batch(batch, first, _train.examples_of(features))
                return self.model.apply(
                    self.variables(state), batch, method=self.method, **dict(kwargs)
                )

            self._predict_jit = jax.jit(predict, static_argnums=2)
        return self._predict_jit(state, batch, tuple(sorted(kwargs.items())))

    def variables(self, state: _train.TrainState) -> dict:
        """{"params", "embedding", other collections} for `model.apply` (flush a pipelined
        state first)."""
        return {"params": state.params, COLLECTION: state.embedding, **(state.model_state or {})}


def make_train_step(
    model: nn.Module,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    method: Callable | str | None = None,
    donate: bool = True,
    accumulate_steps: int = 1,
    rng_streams: Sequence[str] = ("dropout",),
    apply_kwargs: dict | None = None,
) -> FlaxTrainStep:
    """One jitted, state-donating train step for a flax model containing `Embed` layers.

    Args:
        model: A flax.linen Module; `model.apply(variables, batch, method=method)` gives the
            outputs. Collections other than "params" and "embedding" (e.g. "batch_stats")
            are mutable in the step and kept in `state.model_state`.
        loss_fn: fn(outputs, batch) -> float scalar loss, or (loss, aux).
        tx: The optax optimizer of "params".
        method: As for `model.apply`.
        donate: Donate the state to the step (default), so tables are updated in place.
        accumulate_steps: k > 1: batches of k micro-batches (see `jte.make_train_step`);
            the model runs on one micro-batch at a time, its collections (batch
            statistics) updated after each.
        rng_streams: The rng streams the model draws from in training (`nn.Dropout` uses
            "dropout"); each step (and micro-batch) gets new keys from `state.rng`.
        apply_kwargs: Keyword arguments of `model.apply` in init and in the step, e.g.
            {"train": True}; `predict(state, batch, train=False)` gives its own.

    Returns:
        `step(state, batch) -> (state, metrics)` (see `jte.TrainStep`), with
        `step.init(key, batch)`, `step.flush(state)`, `step.predict(state, batch)` and
        `step.variables(state)`.
    """
    return FlaxTrainStep(
        model,
        loss_fn,
        tx,
        method=method,
        donate=donate,
        accumulate_steps=accumulate_steps,
        rng_streams=rng_streams,
        apply_kwargs=apply_kwargs,
    )
