"""The README is the user contract: its code must be the package's API.

Its signature blocks (blocks of bare `jte.X(...)` calls) are compared with the code's
signatures, every `jte.` name it mentions must exist, every keyword its examples pass must be
one the callee takes, and every Python block must parse. The self-contained examples run in
the slow tier (`test_readme_examples_run`)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jax_tpu_embed as jte

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def _blocks() -> list[tuple[int, str]]:
    """(line, code) of each Python block of the README, dedented as it is indented."""
    text = README.read_text()
    out = []
    for m in _BLOCK.finditer(text):
        indent = len(m.group(1))
        code = "\n".join(line[indent:] for line in m.group(2).splitlines())
        out.append((text[: m.start()].count("\n") + 1, code))
    return out


def _resolve(dotted: str) -> Any:
    """The object `jte.a.b` names (AttributeError if none)."""
    obj: Any = jte
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _signature_block(code: str) -> list[tuple[str, str]] | None:
    """[(dotted name, parameter list)] if every statement of `code` is a bare `jte.X(...)`
    written as a signature (comment lines aside), else None. The parameter list is read
    back as a `def`'s, so `*` and defaults keep their meaning."""
    statements = re.split(r"^(?=jte\.)", code, flags=re.M)
    out = []
    for s in statements:
        body = "\n".join(line for line in s.splitlines() if not line.lstrip().startswith("#"))
        if not body.strip():
            continue
        m = re.fullmatch(r"(jte(?:\.\w+)+)\((.*)\)\s*", body, re.S)
        if m is None:
            return None
        out.append((m.group(1), m.group(2)))
    return out or None


def _params(text: str) -> ast.arguments:
    return ast.parse(f"def _({text}): ...").body[0].args  # pyright: ignore[reportAttributeAccessIssue]


def _documented(args: ast.arguments) -> list[tuple[str, str, str | None]]:
    """[(name, kind, default source or None)] of a parsed parameter list."""
    out = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(positional, defaults):
        out.append((a.arg, "POSITIONAL_OR_KEYWORD", None if d is None else ast.unparse(d)))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)))
    return out


def _extras(code: str) -> list[tuple[str, str, str | None]] | None:
    """The parameters a `# extras: a=..., b=...` comment of a signature block names."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# extras:"):
            text = [line.split("extras:", 1)[1]]
            for more in lines[i + 1 :]:
                if not more.startswith("#  "):
                    break
                text.append(more[1:])
            text = [t.split("#", 1)[0] for t in text]  # A trailing comment's text.
            return _documented(_params("*, " + " ".join(text)))  # Keyword-only.
    return None


# Parameters a signature block leaves out on purpose, which the README's prose names as
# deprecated.
_DEPRECATED = {"jte.Embedding": ("cpu_kernels", "tpu_kernels")}
# Parameters the README shows as required that default to None in the code (a dataclass's
# fields after one with a default), where None is refused (`test_required_ones_refuse_none`).
_NONE_REFUSED = {"jte.TableConfig": ("vocabulary_size", "dim")}


def _signature_cases():
    for line, code in _blocks():
        calls = _signature_block(code)
        if calls:
            for name, params in calls:
                yield pytest.param(name, params, _extras(code), id=f"{name}@{line}")


def test_readme_has_signature_blocks():
    names = {p.values[0] for p in _signature_cases()}
    assert {"jte.TableConfig", "jte.Embedding", "jte.Adagrad", "jte.CustomOptimizer"} <= names


@pytest.mark.parametrize("name,params,extras", list(_signature_cases()))
def test_readme_signatures_are_the_code(name, params, extras):
    """Each signature the README writes out: the same parameters, in the same order, of the
    same kinds, with the same defaults; `**extras` stands for the comment's parameters."""
    real = inspect.signature(_resolve(name)).parameters
    documented = _documented(_params(params))
    variadic = _params(params).kwarg
    if variadic is not None:
        assert extras is not None, f"{name}: **{variadic.arg} without an `# extras:` comment"
        documented += extras
    names = [n for n, _, _ in documented]
    missing = [n for n in names if n not in real]
    assert not missing, f"{name}: the README names parameters it does not take: {missing}"
    left_out = _DEPRECATED.get(name, ())
    undocumented = [n for n in real if n not in names and n != "self" and n not in left_out]
    assert not undocumented, f"{name}: parameters the README does not show: {undocumented}"
    assert names == [n for n in real if n in names], f"{name}: order {names} vs {list(real)}"
    scope = {"jnp": jnp, "jte": jte}
    for n, kind, default in documented:
        p = real[n]
        if kind == "KEYWORD_ONLY" or p.kind == p.KEYWORD_ONLY:
            assert p.kind.name == kind, f"{name}: {n} is {p.kind.name}, the README says {kind}"
        if default is None:
            refused = p.default is None and n in _NONE_REFUSED.get(name, ())
            assert p.default is p.empty or refused, f"{name}: {n} has default {p.default!r}"
        else:
            assert p.default is not p.empty, f"{name}: {n} has no default (README: {default})"
            assert eval(default, scope) == p.default, (name, n, default, p.default)


def test_left_out_parameters_are_deprecated_in_the_prose():
    text = " ".join(README.read_text().split())
    for params in _DEPRECATED.values():
        for n in params:
            m = re.search(rf"`{n}=`[^.]*deprecated", text)
            assert m, f"the README does not call {n}= deprecated"


def test_required_ones_refuse_none():
    """What `_NONE_REFUSED` relies on: a TableConfig without its vocabulary (and not
    dynamic) or without its dim is a ValueError naming the field."""
    with pytest.raises(ValueError, match="vocabulary_size"):
        jte.TableConfig(dim=4)
    with pytest.raises(ValueError, match="dim"):
        jte.TableConfig(vocabulary_size=10)


def test_readme_python_blocks_parse():
    bad = []
    for line, code in _blocks():
        if _signature_block(code):
            continue
        try:
            ast.parse(code)
        except SyntaxError as e:
            bad.append(f"line {line}: {e}")
    assert not bad, bad


def test_readme_names_exist():
    """Every `jte.a.b` the README mentions (prose and code) and every `emb.x` (an
    `Embedding`'s) is there."""
    text = README.read_text()
    missing = []
    for dotted in sorted(set(re.findall(r"\bjte(?:\.[A-Za-z_]\w*)+", text))):
        try:
            _resolve(dotted)
        except AttributeError:
            missing.append(dotted)
    for attr in sorted(set(re.findall(r"\bemb\.([A-Za-z_]\w*)", text))):
        if not hasattr(jte.Embedding, attr):
            missing.append(f"emb.{attr}")
    assert not missing, missing


def test_readme_calls_pass_keywords_the_callee_takes():
    """Every keyword a README example passes to a `jte.` callable or an `emb.` method."""
    wrong = []
    for line, code in _blocks():
        if _signature_block(code):
            continue
        for node in ast.walk(ast.parse(code)):
            if not isinstance(node, ast.Call) or not node.keywords:
                continue
            func = ast.unparse(node.func)
            if func.startswith("jte."):
                target = _resolve(func)
            elif func.startswith("emb.") and func.count(".") == 1:
                target = getattr(jte.Embedding, func.split(".")[1])
            else:
                continue
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind == p.VAR_KEYWORD for p in params.values()):
                continue
            for k in node.keywords:
                if k.arg is not None and k.arg not in params:
                    wrong.append(f"line {line}: {func}(..., {k.arg}=...)")
    assert not wrong, wrong


# ------------------------------------------------------------------ the examples, run

# Each Python block of the README runs in a namespace of its own: the imports its readers
# have, `_KIT`'s helpers, and what the block takes from the text around it (`_SETUP`, keyed
# by a piece of the block's code that no other block has). `_SIZES` shrinks a block's
# production sizes to the CPU; `_CHECK` asserts what a block's comments promise. A block
# with no entry runs as it is; `_NOT_RUN` names the ones that cannot run here, and why.
_PREAMBLE = """
import os
import jax, jax.numpy as jnp, numpy as np, optax
import jax_tpu_embed as jte
"""

_KIT = '''
def user_spec(dim=64, dynamic=False, **table):
    """A one-feature spec: feature "user" of a table "users" (sum, Adagrad)."""
    size = None if dynamic else 1_000
    dyn = jte.DynamicTable(capacity=4_096) if dynamic else None
    users = jte.TableConfig(size, dim, combiner="sum", name="users", dynamic=dyn, **table)
    return jte.EmbeddingSpec({"user": jte.FeatureConfig(users)}, jte.Adagrad(0.05))

def user_batches(n, b=16, dynamic=False, seed=0):
    """n batches {"features": {"user": (b, 4) ids with repeats and -1}, "labels": (b,)}."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if dynamic:
            pool = rng.integers(-(2**63), 2**63 - 1, 40, dtype=np.int64)
            ids = pool[rng.integers(0, 40, (b, 4))]
        else:
            ids = rng.integers(0, 1_000, (b, 4))
        ids[:, -1] = -1
        labels = rng.integers(0, 2, b).astype(np.float32)
        out.append({"features": {"user": ids}, "labels": labels})
    return out

def loss_fn(params, acts, batch):
    logits = jnp.concatenate(jax.tree.leaves(acts), axis=-1) @ params["w"]
    return optax.sigmoid_binary_cross_entropy(logits, batch["labels"]).mean()

def train_state(emb, tx=None, **options):
    step = jte.make_train_step(emb, loss_fn, tx or optax.adam(1e-3), **options)
    return step.init(jax.random.key(0), {"w": jnp.zeros((64,))})

def flax_loss(logits, batch):
    return optax.sigmoid_binary_cross_entropy(logits, batch["labels"]).mean()
'''

_SETUP = {
    "items = jte.TableConfig(vocabulary_size=50_000": """
users = jte.TableConfig(vocabulary_size=1_000, dim=64, combiner="sum")
""",
    'batch["features"]["user"] = jte.split_ids': """
emb = jte.Embedding(user_spec(dynamic=True))
state = train_state(emb)
pipeline = user_batches(2, dynamic=True)
""",
    "placement=jte.HostCached(cache_rows=50_000_000)": """
emb = jte.Embedding(user_spec(placement=jte.HostCached(cache_rows=256)))
state = train_state(emb)
batches = user_batches(3)
""",
    'state = step.init(jax.random.key(0), {"w": jnp.zeros((64,))})\nfor': """
emb = jte.Embedding(user_spec())
batches = user_batches(2)
""",
    "acts = self.embed(batch[": """
spec = user_spec()
batch = user_batches(1)[0]
""",
    "nn.BatchNorm(use_running_average=not train)": """
import flax.linen as nn
spec = user_spec()
batch = user_batches(1)[0]
loss = flax_loss
""",
    "accumulate_steps=4)": """
emb = jte.Embedding(user_spec())
state = train_state(emb, accumulate_steps=4)
big_batch = user_batches(1, b=64)[0]
""",
    "PJRT_NPROC": """
emb = jte.Embedding(user_spec())
step = jte.make_train_step(emb, loss_fn, optax.adam(1e-3))
state = step.init(jax.random.key(0), {"w": jnp.zeros((64,))})
train_step = lambda state, batch: step(state, batch)[0]
batches = user_batches(17)
n_devices = len(jax.devices())
""",
    'jax.config.update("jax_enable_x64", True)': """
items = jte.TableConfig(1_000, 32, combiner="sum", name="items")
spec = user_spec(dim=32, dynamic=True)
spec = jte.EmbeddingSpec(dict(spec.features, item=jte.FeatureConfig(items)), jte.Adagrad(0.05))
emb = jte.Embedding(spec)
def loss_fn(params, acts, batch):
    logits = jnp.concatenate(jax.tree.leaves(acts), axis=-1) @ params["w"]
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()
state = jte.make_train_step(emb, loss_fn, optax.sgd(0.1)).init(
    jax.random.key(0), {"w": jnp.zeros((64,))})
ids_int64 = user_batches(1, dynamic=True)[0]["features"]["user"]
item_ids = user_batches(1, seed=1)[0]["features"]["user"]
y = np.ones(16, np.float32)
""",
    "from flax import nnx": """
spec = user_spec()
batches = user_batches(2)
""",
    'jte.checkpoint.save("ckpt/", emb, state.embedding': """
emb = jte.Embedding(user_spec())
step = jte.make_train_step(emb, loss_fn, optax.adam(1e-3))
state = step.init(jax.random.key(0), {"w": jnp.zeros((64,))})
state, _ = step(state, user_batches(1)[0])
""",
    "blocking=False)": """
emb = jte.Embedding(user_spec())
step = jte.make_train_step(emb, loss_fn, optax.adam(1e-3))
state = step.init(jax.random.key(0), {"w": jnp.zeros((64,))})
batch = user_batches(1)[0]
emb_state, dense = jax.tree.map(jnp.copy, state.embedding), {"params": state.params}
""",
    "server = jte.serving.Server(spec, emb.export(emb_state))": """
spec = user_spec()
emb = jte.Embedding(spec)
emb_state = emb.init(jax.random.key(0))
features = user_batches(1)[0]["features"]
""",
    "exp = jte.serving.export(": """
spec = user_spec()
emb = jte.Embedding(spec)
tables = emb.export(emb.init(jax.random.key(0)))
features = user_batches(1)[0]["features"]
""",
    'unknown="init")   # keys from the state': """
spec = user_spec(dynamic=True)
emb = jte.Embedding(spec)
ids = user_batches(1, dynamic=True)[0]["features"]["user"]
emb_state = emb.apply_gradients(
    emb.init(jax.random.key(0)), {"user": ids}, {"user": np.ones((16, 64), np.float32)})
blob = jte.serving.Server.from_embedding(emb, emb_state, unknown="init").export(
    {"user": jte.split_ids(ids)}).serialize()
""",
    "jte.multihost.process_batch_rows(emb, global_batch=B)": """
emb = jte.Embedding(user_spec())
state = emb.init(jax.random.key(0))
B = 16
data = user_batches(1, b=B)[0]["features"]["user"]
load_examples = lambda rows: {"user": data[rows]}
act_grads = {"user": np.ones((B, 64), np.float32)}
""",
}

_SIZES = {
    "capacity=50_000_000,  # rows over all shards": {"50_000_000": "65_536"},
}

_CHECK = {
    "items = jte.TableConfig(vocabulary_size=50_000": """
one = jte.Embedding(spec, jax.sharding.Mesh(jax.devices()[:1], ("shard",)))
acts = one.lookup(one.init(jax.random.key(0)), features)
assert {k: v.shape for k, v in acts.items()} == {
    "user": (2, 64), "item": (2, 32), "history": (2, 20, 32)}, acts
""",
    "capacity=50_000_000,  # rows over all shards": """
rows = emb.export(state)["users"]
assert isinstance(rows, jte.DynamicRows) and rows.rows.shape == (3, 64)
assert list(rows.ids) == sorted([8_311_446_120_557_721_403, -42, 17])
assert int(emb.dynamic_stats(state)["users"]["occupancy"]) == 3
""",
}

_NOT_RUN = {
    "since_step=1000": "two saves 100 steps apart (tests/test_dynamic_io.py saves chains)",
    "params=their_params": "another framework's weights (tests/test_start_from_weights.py)",
    "jte.data.criteo([": "Criteo files (tests/test_data.py reads generated ones)",
}


def _find(table: dict, code: str):
    hits = [v for k, v in table.items() if k in code]
    assert len(hits) <= 1, f"more than one entry matches the block {code[:60]!r}"
    return hits[0] if hits else None


def _example_cases():
    blocks = [(line, code) for line, code in _blocks() if not _signature_block(code)]
    for table in (_SETUP, _SIZES, _CHECK, _NOT_RUN):  # Each entry names exactly one block.
        for key in table:
            n = sum(key in code for _, code in blocks)
            assert n == 1, f"{key!r} matches {n} README blocks"
    for line, code in blocks:
        words = re.sub(r"\W+", "_", code.strip().splitlines()[0])[:32].strip("_")
        yield pytest.param(line, code, id=words)


@pytest.mark.slow  # Half a minute in all: each block compiles its own programs.
@pytest.mark.parametrize("line,code", list(_example_cases()))
def test_readme_examples_run(line, code, tmp_path, monkeypatch):
    reason = _find(_NOT_RUN, code)
    if reason:
        pytest.skip(f"not run here: {reason}")
    setup, check, run = _find(_SETUP, code) or "", _find(_CHECK, code) or "", code
    for old, new in (_find(_SIZES, code) or {}).items():
        run = run.replace(old, new)
    monkeypatch.chdir(tmp_path)  # Checkpoints go to ckpt/ here.
    monkeypatch.delenv("PJRT_NPROC", raising=False)  # Restored after: one block sets it.
    scope: dict = {"__name__": "readme_example"}
    try:
        for part in (_PREAMBLE, _KIT, setup, run, check):
            exec(compile(part, f"README.md, the block at line {line}", "exec"), scope)
        jax.block_until_ready([v for v in scope.values() if isinstance(v, jax.Array)])
        jte.checkpoint.wait()
    finally:
        jax.config.update("jax_enable_x64", False)  # One block turns it on.
