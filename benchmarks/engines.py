"""Benchmark engines: the peer baselines and jax_tpu_embed, all running the same step.

The step of WORKLOADS.md, for every engine:
    pooled_t = Σ_l table_t[ids_t[:, l]]              (B × D, sum combiner)
    loss     = Σ_t Σ pooled_t ⊙ R_t                   (R_t fixed, B × D)
    backward to the rows, duplicates summed, one Adagrad update per unique row:
        Adagrad:          a += g²;        w -= lr·g/√a            (a0 = 0.1, no epsilon)
        row-wise Adagrad: a += mean(g²);  w -= lr·g/(√a + eps)    (a0 = 0.1, eps = 1e-8)
The loss is computed and returned by every engine, as a training loop logs it. It is linear
in the pooled activations, so its gradient does not need them: a jitted JAX step that
returned only the new state would let XLA drop the forward lookups, and time half a step
against the eager peers' whole one.

Each engine class is cheap to import: its framework (jax, torch, fbgemm_gpu, jax_tpu_embed) is
imported only inside ``check_available``/``setup``, so a missing package skips that engine with a
message instead of breaking the harness. The harness runs each engine in its own subprocess
(peak RSS per engine, per-engine XLA_FLAGS).

Engine protocol (see ``Engine``):
    check_available() -> None | str      # a skip message if the package is missing
    setup(workload, init_tables=None)    # build tables/slots and device-resident batches
    compile()                            # optional ahead-of-time compile (timed separately)
    step(k)                              # one full training step on batch k, synchronous
    export() -> (tables, slots)          # lists of np arrays, per table (for the checks)
    state_bytes() -> int                 # bytes of tables + optimizer slots held
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

import numpy as np
import workloads  # A sibling module: the harness puts benchmarks/ on sys.path.

LEARNING_RATE = 0.05
INITIAL_ACCUMULATOR = 0.1
ROWWISE_EPS = 1e-8


class Engine:
    name: str = "?"
    kind: str = "baseline"  # "baseline" or "jte"
    optimizer: str = "adagrad"  # "adagrad" or "rowwise"
    xla_device_count: int | None = None  # --xla_force_host_platform_device_count, JAX engines
    threads: int = 2  # torch/OpenMP threads
    # Rough peak memory of the engine as a multiple of tables+slots bytes (memory guard).
    memory_factor: float = 1.3
    description: str = ""
    semantics_note: str = ""

    def __init__(
        self,
        learning_rate: float = LEARNING_RATE,
        initial_accumulator: float = INITIAL_ACCUMULATOR,
        rowwise_eps: float = ROWWISE_EPS,
    ):
        self.lr = float(learning_rate)
        self.a0 = float(initial_accumulator)
        self.eps = float(rowwise_eps)

    # -- protocol ---------------------------------------------------------------------------
    def check_available(self) -> str | None:
        return None

    def setup(self, workload, init_tables: list[np.ndarray] | None = None) -> None:
        raise NotImplementedError

    def compile(self) -> None:
        pass

    def step(self, k: int) -> None:
        raise NotImplementedError

    def export(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        raise NotImplementedError

    def state_bytes(self) -> int:
        raise NotImplementedError

    def versions(self) -> dict:
        return {}

    def info(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "optimizer": self.optimizer,
            "description": self.description,
            "semantics_note": self.semantics_note,
            "learning_rate": self.lr,
            "initial_accumulator": self.a0,
            "rowwise_eps": self.eps if self.optimizer == "rowwise" else None,
        }


def _missing(modules: list[str]) -> str | None:
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # ImportError, or a broken install (OSError from a .so)
            return f"cannot import {m!r} ({type(e).__name__}: {e})"
    return None


# ==========================================================================================
# JAX: what a user writes today (flax nn.Embed + optax.adagrad, dense)
# ==========================================================================================


class DenseJax(Engine):
    name = "dense_jax"
    xla_device_count = 1
    memory_factor = 2.3  # params + accumulators + a dense gradient of every table
    description = (
        "flax nn.Embed + optax.adagrad over whole tables, jitted, state donated (1 device)"
    )
    semantics_note = (
        "optax.adagrad(initial_accumulator_value=0.1, eps=0.0): optax computes "
        "g·rsqrt(a + eps) with eps inside the square root and the default "
        "eps=1e-7; with eps=0 it is exactly TF Adagrad (a stays >= 0.1 > 0). The "
        "update is dense: every row and accumulator is rewritten each step "
        "(untouched rows get g = 0, so values match the sparse update)."
    )

    def __init__(self, *args, optax_eps: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.optax_eps = float(optax_eps)  # 0: exact TF Adagrad; optax's default is 1e-7

    def check_available(self):
        return _missing(["jax", "flax", "optax"])

    def setup(self, wl, init_tables=None):
        import flax.linen as nn
        import jax
        import jax.numpy as jnp
        import optax

        c = wl.config
        names = wl.table_names

        class Model(nn.Module):
            @nn.compact
            def __call__(self, ids):
                return [
                    nn.Embed(c.vocabulary_size, c.dim, name=n)(ids[i]).sum(axis=1)
                    for i, n in enumerate(names)
                ]

        model = Model()
        opt = optax.adagrad(self.lr, initial_accumulator_value=self.a0, eps=self.optax_eps)
        self._batches = [jax.device_put(wl.ids[k]) for k in range(wl.num_batches)]
        self._R = jax.device_put(wl.R)
        if init_tables is None:
            params = jax.jit(model.init)(jax.random.key(0), self._batches[0])
        else:
            params = {
                "params": {
                    n: {"embedding": jnp.asarray(init_tables[i], jnp.float32)}
                    for i, n in enumerate(names)
                }
            }
        opt_state = jax.jit(opt.init)(params)

        def train_step(params, opt_state, ids, R):
            def loss_fn(p):
                pooled = model.apply(p, ids)
                return sum(jnp.sum(pooled[i] * R[i]) for i in range(len(names)))

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._jit = jax.jit(train_step, donate_argnums=(0, 1))
        self._fn = self._jit
        self._state = (params, opt_state)
        self._names = names
        jax.block_until_ready(self._state)

    def compile(self):
        p, o = self._state
        self._fn = self._jit.lower(p, o, self._batches[0], self._R).compile()

    def step(self, k):
        import jax

        p, o = self._state
        p, o, loss = self._fn(p, o, self._batches[k], self._R)
        self._state = (p, o)
        jax.block_until_ready((self._state, loss))

    def export(self):
        p, o = self._state
        tables = [np.asarray(p["params"][n]["embedding"]) for n in self._names]
        # opt_state = (ScaleByRssState(sum_of_squares=params-shaped), EmptyState)
        acc = o[0].sum_of_squares["params"]
        slots = [np.asarray(acc[n]["embedding"]) for n in self._names]
        return tables, slots

    def state_bytes(self):
        import jax

        return int(sum(x.nbytes for x in jax.tree.leaves(self._state)))

    def versions(self):
        import flax
        import jax
        import optax

        return {
            "jax": jax.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
            "devices": len(jax.devices()),
        }


# ==========================================================================================
# PyTorch: nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad
# ==========================================================================================


class TorchEmbeddingBag(Engine):
    name = "torch_embeddingbag"
    memory_factor = 1.4
    description = "torch nn.EmbeddingBag(mode='sum', sparse=True) per table + torch.optim.Adagrad"
    semantics_note = (
        "torch.optim.Adagrad(initial_accumulator_value=0.1, eps=0.0): torch "
        "computes g/(sqrt(a) + eps); eps=0 is allowed, so it is exactly TF "
        "Adagrad. Sparse gradients are coalesced (duplicates summed) and only "
        "touched rows are updated."
    )

    def check_available(self):
        return _missing(["torch"])

    def setup(self, wl, init_tables=None):
        import torch  # pyright: ignore[reportMissingImports]  (bench extra)

        torch.set_num_threads(self.threads)
        c = wl.config
        self._torch = torch
        if init_tables is None:
            self._bags = [
                torch.nn.EmbeddingBag(c.vocabulary_size, c.dim, mode="sum", sparse=True)
                for _ in range(c.tables)
            ]
        else:
            self._bags = [
                torch.nn.EmbeddingBag.from_pretrained(
                    torch.tensor(np.asarray(t, np.float32)), freeze=False, mode="sum", sparse=True
                )
                for t in init_tables
            ]
        params = [b.weight for b in self._bags]
        self._opt = torch.optim.Adagrad(
            params, lr=self.lr, initial_accumulator_value=self.a0, eps=0.0
        )
        self._batches = [
            [torch.from_numpy(wl.ids[k][t].astype(np.int64)) for t in range(c.tables)]
            for k in range(wl.num_batches)
        ]
        self._R = [torch.from_numpy(r) for r in wl.R]

    def step(self, k):
        ids = self._batches[k]
        self._opt.zero_grad(set_to_none=True)
        loss = sum((bag(ids[t]) * self._R[t]).sum() for t, bag in enumerate(self._bags))
        loss.backward()  # pyright: ignore[reportAttributeAccessIssue]  (sum() of tensors)
        self._opt.step()

    def export(self):
        tables = [b.weight.detach().numpy().copy() for b in self._bags]
        slots = [self._opt.state[b.weight]["sum"].numpy().copy() for b in self._bags]
        return tables, slots

    def state_bytes(self):
        n = 0
        for b in self._bags:
            n += b.weight.numel() * b.weight.element_size()
            st = self._opt.state.get(b.weight, {})
            if "sum" in st:
                n += st["sum"].numel() * st["sum"].element_size()
        return int(n)

    def versions(self):
        import torch  # pyright: ignore[reportMissingImports]  (bench extra)

        return {"torch": torch.__version__, "threads": torch.get_num_threads()}


# ==========================================================================================
# FBGEMM TBE on CPU: SplitTableBatchedEmbeddingBagsCodegen
# ==========================================================================================


class FbgemmTBE(Engine):
    memory_factor = 1.3
    optim_type = "EXACT_ADAGRAD"

    def check_available(self):
        msg = _missing(["torch", "fbgemm_gpu"])
        if msg:
            return msg + " -- install with: pip install -r benchmarks/requirements-bench.txt"
        return None

    def setup(self, wl, init_tables=None):
        import torch  # pyright: ignore[reportMissingImports]  (bench extra)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType  # pyright: ignore[reportMissingImports]  (bench extra)
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # pyright: ignore[reportMissingImports]  (bench extra)
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # pyright: ignore[reportMissingImports]  (bench extra)
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        torch.set_num_threads(self.threads)
        c = wl.config
        specs = [
            (c.vocabulary_size, c.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
            for _ in range(c.tables)
        ]
        rowwise = self.optimizer == "rowwise"
        self._tbe = SplitTableBatchedEmbeddingBagsCodegen(
            specs,
            optimizer=getattr(EmbOptimType, self.optim_type),
            learning_rate=self.lr,
            eps=self.eps if rowwise else 0.0,
            pooling_mode=PoolingMode.SUM,
        )
        with torch.no_grad():
            for st in self._tbe.split_optimizer_states():
                for s in st:
                    s.fill_(self.a0)
            if init_tables is not None:
                for w, t in zip(self._tbe.split_embedding_weights(), init_tables):
                    w.copy_(torch.from_numpy(np.asarray(t, np.float32)))
        B, L, T = c.batch, c.ids_per_example, c.tables
        # Table-major bags: bag (t, b) holds ids_t[b, :]; offsets of T·B bags of L ids.
        self._offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
        self._batches = [
            torch.from_numpy(
                np.concatenate([wl.ids[k][t].reshape(-1) for t in range(T)]).astype(np.int64)
            )
            for k in range(wl.num_batches)
        ]
        self._R = torch.from_numpy(np.concatenate(wl.R, axis=1))  # (B, T·D)

    def step(self, k):
        out = self._tbe(self._batches[k], self._offsets)  # (B, T·D)
        loss = (out * self._R).sum()
        loss.backward()  # TBE applies the optimizer inside its backward

    def export(self):
        tables = [w.detach().numpy().copy() for w in self._tbe.split_embedding_weights()]
        slots = [st[0].detach().numpy().copy() for st in self._tbe.split_optimizer_states()]
        return tables, slots

    def state_bytes(self):
        n = sum(w.numel() * w.element_size() for w in self._tbe.split_embedding_weights())
        n += sum(
            s.numel() * s.element_size() for st in self._tbe.split_optimizer_states() for s in st
        )
        return int(n)

    def versions(self):
        import torch  # pyright: ignore[reportMissingImports]  (bench extra)

        try:
            from importlib.metadata import version

            fb = version("fbgemm-gpu-cpu")
        except Exception:
            fb = "?"
        return {
            "torch": torch.__version__,
            "fbgemm_gpu_cpu": fb,
            "threads": torch.get_num_threads(),
        }


class FbgemmExactAdagrad(FbgemmTBE):
    name = "fbgemm_exact_adagrad"
    optim_type = "EXACT_ADAGRAD"
    description = "FBGEMM TBE (CPU, HOST) EXACT_ADAGRAD, sum pooling"
    semantics_note = (
        "FBGEMM computes w -= lr·g/(sqrt(a) + eps); created with eps=0 and its "
        "momentum1 state filled with 0.1 after construction (FBGEMM starts it at "
        "0), so it is exactly TF Adagrad."
    )


class FbgemmRowwiseAdagrad(FbgemmTBE):
    name = "fbgemm_rowwise_adagrad"
    optimizer = "rowwise"
    optim_type = "EXACT_ROWWISE_ADAGRAD"
    description = "FBGEMM TBE (CPU, HOST) EXACT_ROWWISE_ADAGRAD, sum pooling"
    semantics_note = (
        "Row-wise Adagrad: a += mean(g²); w -= lr·g/(sqrt(a) + eps), eps=1e-8; "
        "the per-row accumulator is filled with 0.1 after construction."
    )


# ==========================================================================================
# jax_tpu_embed (the library under test), via its public API only
# ==========================================================================================


def _import_jte():
    """Imports jax_tpu_embed: the installed one, else the checkout this file belongs to."""
    try:
        return importlib.import_module("jax_tpu_embed")
    except ModuleNotFoundError as e:
        if e.name != "jax_tpu_embed":
            raise
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if root not in sys.path:
            sys.path.append(root)
        return importlib.import_module("jax_tpu_embed")


class JteEngine(Engine):
    kind = "jte"
    xla_device_count = 2  # one XLA host device per core; the mesh is all local devices
    memory_factor = 1.6

    def check_available(self):
        msg = _missing(["jax"])
        if msg:
            return msg
        try:
            jte = _import_jte()
        except Exception as e:
            return (
                f"jax_tpu_embed does not import yet ({type(e).__name__}: {e}); "
                f"engine {self.name} skipped"
            )
        missing = [
            a
            for a in (
                "TableConfig",
                "FeatureConfig",
                "EmbeddingSpec",
                "Embedding",
                self._opt_name(),
            )
            if not hasattr(jte, a)
        ]
        if missing:
            return f"jax_tpu_embed lacks {missing}; engine {self.name} skipped"
        return None

    def _opt_name(self):
        return "RowwiseAdagrad" if self.optimizer == "rowwise" else "Adagrad"

    def _make_optimizer(self, jte):
        if self.optimizer == "rowwise":
            return jte.RowwiseAdagrad(
                learning_rate=self.lr, initial_accumulator_value=self.a0, epsilon=self.eps
            )
        return jte.Adagrad(learning_rate=self.lr, initial_accumulator_value=self.a0)

    def setup(self, wl, init_tables=None):
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        jte = _import_jte()

        c = wl.config
        self._names = wl.table_names
        self._feat = [f"f{i}" for i in range(c.tables)]
        mesh = Mesh(np.array(jax.devices()), ("shard",))
        tables = [
            jte.TableConfig(vocabulary_size=c.vocabulary_size, dim=c.dim, combiner="sum", name=n)
            for n in self._names
        ]
        features = {f: jte.FeatureConfig(table=t, name=f) for f, t in zip(self._feat, tables)}
        spec = jte.EmbeddingSpec(features=features, optimizer=self._make_optimizer(jte))
        emb = jte.Embedding(spec, mesh=mesh, axis="shard")
        self._emb = emb
        batch_sharding = NamedSharding(mesh, P("shard"))
        self._batches = [
            {f: jax.device_put(wl.ids[k][i], batch_sharding) for i, f in enumerate(self._feat)}
            for k in range(wl.num_batches)
        ]
        self._R = {f: jax.device_put(wl.R[i], batch_sharding) for i, f in enumerate(self._feat)}
        if init_tables is None:
            state = emb.init(jax.random.key(0))
        else:
            state = emb.restore_tables(
                {n: np.asarray(init_tables[i], np.float32) for i, n in enumerate(self._names)}
            )

        def train_step(state, features, R):
            acts = emb.lookup(state, features)
            loss, act_grads = workloads.jax_loss(acts, R)
            return emb.apply_gradients(state, features, act_grads), loss

        self._jit = jax.jit(train_step, donate_argnums=0)
        self._fn = self._jit
        self._state = state
        jax.block_until_ready(self._state)

    def compile(self):
        self._fn = self._jit.lower(self._state, self._batches[0], self._R).compile()

    def step(self, k):
        import jax

        self._state, loss = self._fn(self._state, self._batches[k], self._R)
        jax.block_until_ready((self._state, loss))

    def export(self):
        tables = self._emb.export(self._state)
        slots = self._emb.export_slots(self._state)
        return (
            [np.asarray(tables[n]) for n in self._names],
            [np.asarray(slots[n]["accumulators"]) for n in self._names],
        )

    def state_bytes(self):
        import jax

        return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(self._state)))

    def versions(self):
        import jax

        try:
            from importlib.metadata import version

            v = version("jax_tpu_embed")
        except Exception:
            v = "?"
        return {"jax": jax.__version__, "jax_tpu_embed": v, "devices": len(jax.devices())}


class JteAdagrad(JteEngine):
    name = "jte_adagrad"
    description = "jax_tpu_embed Adagrad, one jitted lookup→vjp→apply_gradients, 2 host devices"
    semantics_note = "jte.Adagrad(initial_accumulator_value=0.1): TF Adagrad, no epsilon."


class JteRowwiseAdagrad(JteEngine):
    name = "jte_rowwise_adagrad"
    optimizer = "rowwise"
    description = "jax_tpu_embed RowwiseAdagrad, one jitted step, 2 host devices"
    semantics_note = "jte.RowwiseAdagrad(initial_accumulator_value=0.1, epsilon=1e-8)."


# ==========================================================================================
# registry
# ==========================================================================================

ENGINES: dict[str, Callable[..., Engine]] = {
    cls.name: cls
    for cls in (
        DenseJax,
        TorchEmbeddingBag,
        FbgemmExactAdagrad,
        FbgemmRowwiseAdagrad,
        JteAdagrad,
        JteRowwiseAdagrad,
    )
}
BASELINES = [n for n, c in ENGINES.items() if c.kind == "baseline"]
JTE_ENGINES = [n for n, c in ENGINES.items() if c.kind == "jte"]


def resolve(spec: str) -> list[str]:
    """'all' | 'baselines' | 'jte' | comma-separated engine names."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if part == "all":
            out += list(ENGINES)
        elif part == "baselines":
            out += BASELINES
        elif part == "jte":
            out += JTE_ENGINES
        elif part in ENGINES:
            out.append(part)
        else:
            raise ValueError(
                f"unknown engine {part!r}; known: {list(ENGINES)} or all/baselines/jte"
            )
    return list(dict.fromkeys(out))


def make(name: str, **kwargs) -> Engine:
    return ENGINES[name](**kwargs)


def xla_flags_for(engine_cls, base: str | None = None) -> str:
    """XLA_FLAGS for an engine's subprocess: the user's flags with the device count replaced."""
    flags = [
        f
        for f in (base if base is not None else os.environ.get("XLA_FLAGS", "")).split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if engine_cls.xla_device_count:
        flags.append(f"--xla_force_host_platform_device_count={engine_cls.xla_device_count}")
    return " ".join(flags)
