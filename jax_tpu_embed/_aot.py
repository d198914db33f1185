"""Compiling an embedding train step for a real TPU topology on a machine without a TPU.

`libtpu` holds the real TPU compiler. Given only shapes and shardings (`emb.abstract_state()`
and abstract features), it compiles the per-device program of any topology here, on the CPU,
and reports what that program needs:

- `memory_analysis()`: per-device argument, output, alias (donated inputs reused as outputs)
  and temporary bytes;
- `cost_analysis()`: the compiler's estimate of "bytes accessed" and "flops" per step;
- the optimized HLO: collectives (op, shape, bytes) and which inputs alias outputs;
- the buffer assignment (written by the compiler when asked to dump): every temporary value
  with its size and the HLO op that makes it, e.g. a whole-table `copy`.

Set `JAX_PLATFORMS=cpu` before jax is imported (the project's tests do) so that libtpu does not
probe for hardware; `topology()` works whatever the local devices are.

    topo = _aot.topology("v5p:2x2x1")
    emb = jte.Embedding(spec, _aot.mesh(topo))
    report = _aot.compile_train_step(emb, batch=4096, ids_per_example=20)
    report.peak_bytes, report.largest_temps[0], report.collectives
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _config, _inputs, _placement, _platforms

GiB = 1 << 30

# HBM per chip, by the generation prefix of a topology name ("v5p:4x4x4" -> "v5p").
HBM_PER_CHIP = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}

# Ops whose shapes tell how much data crosses the interconnect. Their async forms
# ("all-gather-start" ... "-done") are counted once, at the start.
COLLECTIVE_OPS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)

_TOPOLOGY_RE = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+){1,2})$")


# --------------------------------------------------------------------------------- topology


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice known to libtpu, described without hardware.

    Attributes:
        name: As given, e.g. "v5p:4x4x4".
        generation: "v4", "v5e", "v5p" or "v6e".
        devices: The slice's JAX devices (one per TensorCore program: v4 has two per chip,
            the others one).
        chips: Number of chips.
        hbm_per_chip: Bytes of HBM per chip.
    """

    name: str
    generation: str
    devices: tuple
    chips: int
    hbm_per_chip: int

    @property
    def devices_per_chip(self) -> int:
        return len(self.devices) // self.chips

    @property
    def hbm_per_device(self) -> int:
        """Each device's share of its chip's HBM: what one device's program may use."""
        return self.hbm_per_chip // self.devices_per_chip


def topology(name: str) -> Topology:
    """The slice `name` ("v5e:2x2", "v5p:4x4x4", ...), from libtpu; ValueError if unknown."""
    match = _TOPOLOGY_RE.match(name or "")
    if not match:
        raise ValueError(
            f"topology {name!r} is not of the form GENERATION:AxB[xC], e.g. "
            f"'v5p:2x2x1' or 'v5e:2x2'; generations with a known HBM size: "
            f"{sorted(HBM_PER_CHIP)}."
        )
    generation = match.group(1)
    if generation not in HBM_PER_CHIP:
        raise ValueError(
            f"topology {name!r}: generation {generation!r} has no known HBM "
            f"size; known: {sorted(HBM_PER_CHIP)}."
        )
    devices = _topology_devices(name)
    chips = len({tuple(getattr(d, "coords", (d.id,))) for d in devices}) or len(devices)
    return Topology(
        name=name,
        generation=generation,
        devices=devices,
        chips=chips,
        hbm_per_chip=HBM_PER_CHIP[generation],
    )


_LOCK = threading.Lock()  # fd 2 is redirected while libtpu describes a topology.


@functools.cache
def _topology_devices(name: str) -> tuple:
    # Only shapes are compiled: several processes (pytest workers, a concurrent CLI) may
    # load libtpu at once without the single-user lock meant for real chips.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    with _LOCK:
        try:
            with _quiet_stderr():
                desc = topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception as e:  # libtpu raises JaxRuntimeError with its own explanation.
            text = str(e).strip()
            detail = text.splitlines()[0] if text else type(e).__name__
            raise ValueError(
                f"topology {name!r} is not known to libtpu: {detail}. Shapes must be "
                f"multiples of the per-host chip bounds (e.g. v5p:2x2x1, v5p:4x4x4, v5e:2x2, "
                f"v6e:4x4, v4:2x2x1)."
            ) from None
    return tuple(desc.devices)


def mesh(topo: Topology, axis: str = "shard") -> Mesh:
    """A one-axis mesh over every device of the slice."""
    return Mesh(np.array(topo.devices), (axis,))


@contextlib.contextmanager
def _quiet_stderr():
    """Silences fd 2 (libtpu's C++ warnings about absent TPU hardware, which are noise here)."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# ------------------------------------------------------------------------------ train step


@_inputs.x32()
def abstract_features(emb, batch: int, ids_per_example: int | Mapping[str, int] = 1) -> dict:
    """int32 ids per feature path as jax.ShapeDtypeStruct, batch-sharded over `emb`'s axis.

    A combined feature gets (B, L) with L = `ids_per_example` (an int for every feature, or
    {feature path: L}, default 1); a sequence feature (B, max_sequence_length).
    """
    if batch % emb.num_shards:
        raise ValueError(
            f"batch {batch} is not a multiple of the mesh size "
            f"{emb.num_shards} (axis {emb.axis!r}); use a batch of "
            f"{_round_up(batch, emb.num_shards)}, for instance."
        )
    sharding = NamedSharding(emb.mesh, P(emb.axis))
    out = {}
    for f in emb.feature_plans:
        if f.config.is_sequence:
            length = f.config.max_sequence_length
        elif isinstance(ids_per_example, Mapping):
            length = int(ids_per_example.get(f.path, 1))
        else:
            length = int(ids_per_example)
        ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=sharding)
        if f.path in emb.dynamic_paths:  # A dynamic table's int64 ids, as two halves.
            half = jax.ShapeDtypeStruct((batch, length), jnp.uint32, sharding=sharding)
            ids = _inputs.SplitIds(half, half)
        out[f.path] = ids
    return _config.unflatten(out)  # Features mirror the spec's nesting.


@_inputs.x32()
def train_step_fn(emb, hidden: int = 16) -> tuple[Callable, dict]:
    """The train step of a model whose dense part is one tiny layer per feature.

    Returns (step, abstract_dense): `step(state, dense, features) -> (state, loss)` stages
    the host tables' rows (`emb.stage`, as `jte.make_train_step` does), does the lookup,
    loss = Σ_f Σ tanh(act_f @ W_f) with W_f (D, hidden), d(loss)/d(activations) by
    jax.vjp and `emb.apply_gradients`; `abstract_dense` is {feature path: W_f} as replicated
    ShapeDtypeStructs.

    With `emb.spec.pipeline_execution`, `features` is (batch, pending), as a pipelined
    train step has them: it stages both batches, looks up `batch` and updates `pending`.
    (The real step applies the gradients the step before computed for `pending`; this one
    applies `batch`'s, which have their shapes.)
    """
    replicated = NamedSharding(emb.mesh, P())
    dense = {
        f.path: jax.ShapeDtypeStruct((f.config.table.dim, hidden), jnp.float32, sharding=replicated)
        for f in emb.feature_plans
    }

    def step(state, dense, features):
        batches = features if emb.spec.pipeline_execution else (features,)
        features, updated = batches[0], batches[-1]
        staged = emb.stage(state, *batches)  # As `jte.make_train_step` does.
        acts = emb.lookup(state, features, staged=staged)

        def loss_fn(acts):
            flat = dict(_config.flatten_features(acts))
            return sum(jnp.sum(jnp.tanh(flat[p] @ w)) for p, w in sorted(dense.items()))

        loss, vjp = jax.vjp(loss_fn, acts)
        (act_grads,) = vjp(jnp.ones_like(loss))
        return emb.apply_gradients(state, updated, act_grads, staged=staged), loss

    return step, dense


# -------------------------------------------------------------------------------- reports


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the optimized HLO: `shape` lists the arrays it moves ("4 x
    f32[1024,128]" when the compiler combined several), `bytes` their total, per device."""

    op: str
    shape: str
    bytes: int
    name: str

    def __str__(self):
        return f"{self.op} {self.shape} ({self.bytes:,} B)"


@dataclasses.dataclass(frozen=True)
class Temp:
    """One temporary value of the buffer assignment, per device."""

    bytes: int
    shape: str
    name: str  # The HLO instruction defining it, e.g. "copy.24".
    op_name: str  # Its jax metadata (what produced it), "" if none.
    space: str = "hbm"  # "hbm", "vmem", "smem", ...

    def __str__(self):
        where = f" from {self.op_name}" if self.op_name else ""
        return f"{self.name} {self.shape} ({self.bytes:,} B, {self.space}){where}"


@dataclasses.dataclass(frozen=True)
class HostCall:
    """One computation the device runs on its host (`compute_on("device_host")`, an
    asynchronous `HostExecute`): what it does to host memory ("gather": reads host rows;
    "scatter": writes them), and the bytes crossing between host and device per call (its
    operands and results outside host memory: the rows and their indices). `on_miss`: a
    read of rows a device did not find in its memory (a `HostCached` table's cache or
    the rows `Embedding.stage` read), which runs in rounds as the data needs, possibly
    never; the other calls run every step."""

    kind: str
    crossing_bytes: int
    name: str
    on_miss: bool = False


@dataclasses.dataclass(frozen=True)
class Loop:
    """A `while` loop of the optimized HLO whose trip count is fixed when it compiles: how
    XLA writes a gather or scatter it cannot issue as one operation (a window of a 1-D
    array per index, for instance), one window or element an iteration. "Bytes accessed"
    charges such a loop its iterations' few bytes; its iterations run one after another,
    which the compiler's `estimated_cycles` count (`cycles`: the body's, times `trips`)."""

    trips: int
    cycles: int
    op_name: str
    name: str


@dataclasses.dataclass
class CompileReport:
    """What the TPU compiler says about one compiled step, per device.

    `peak_bytes` = arguments + outputs - aliases + temporaries, the formula of the HBM check.
    `largest_temps` is sorted by size, largest first (empty when no temporary exists).
    `table_bytes` / `slot_bytes`: {table name: bytes of this device's shard as stored}.
    `oom`: the compiler's out-of-memory message when compiled with `allow_oom`, else None.
    The device figures leave out host memory: `host_*_bytes` are the arguments, aliases and
    temporaries in the hosts' memory (tables with placement="host"), and `host_calls` the
    host computations that reach them.
    """

    topology: Topology
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    bytes_accessed: float
    flops: float
    collectives: list[Collective]
    largest_temps: list[Temp]
    aliased_state: list[str]
    unaliased_state: list[str]
    table_bytes: dict[str, int]
    slot_bytes: dict[str, int]
    compile_seconds: float
    oom: str | None = None
    hlo: str = dataclasses.field(repr=False, default="")
    host_argument_bytes: int = 0
    host_alias_bytes: int = 0
    host_temp_bytes: int = 0
    host_calls: list[HostCall] = dataclasses.field(default_factory=list)
    # The compiler's per-op estimates summed (loops' bodies times their fixed trip counts,
    # once where the count is data); Pallas calls carry none.
    estimated_cycles: int = 0
    loops: list[Loop] = dataclasses.field(default_factory=list)  # Most cycles first.

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def state_bytes(self) -> int:
        return sum(self.table_bytes.values()) + sum(self.slot_bytes.values())

    @property
    def hbm_bytes(self) -> int:
        return self.topology.hbm_per_device

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hbm_bytes

    def copies(self) -> list[str]:
        """The optimized HLO's `copy` instructions of at least 1 MiB (relayouts; a table-sized
        one is a whole-table copy), grouped by shape: ["3 x f32[81920,128] (41,943,040 B)"]."""
        counts: dict[tuple[str, int], int] = {}
        for _, shape, nbytes in _instructions(self.hlo, "copy"):
            if nbytes >= 1 << 20:
                counts[shape, nbytes] = counts.get((shape, nbytes), 0) + 1
        return [
            f"{k} x {shape} ({nbytes:,} B)"
            for (shape, nbytes), k in sorted(counts.items(), key=lambda kv: -kv[0][1] * kv[1])
        ]


@_inputs.x32()
def init_temp_bytes(emb) -> dict[str, int]:
    """{table name: per-device temporary bytes of initialising it (`emb.init_programs`)}.

    `init` fills the default-initialised tables together, a block of rows of each per round,
    and the others one after another, so its peak is about the whole state plus the largest
    of these.
    """
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    out = {}
    for name, fn in emb.init_programs().items():
        if emb.initializer.takes_buffers(name):  # A host table, drawn into host buffers.
            buffers = emb.initializer.host_buffers(emb.table_plans[name], abstract=True)
            lowered = fn.lower(key, buffers)
        else:
            lowered = fn.lower(key)
        try:
            compiled = lowered.compile()
        except Exception as e:  # A table too big for HBM: measure it anyway.
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            try:
                compiled = lowered.compile(compiler_options={"xla_tpu_no_crash_on_oom": True})
            except Exception as e2:  # One array alone exceeds HBM: temporaries unknown.
                if "RESOURCE_EXHAUSTED" not in str(e2):
                    raise
                out[name] = 0
                continue
        out[name] = int(compiled.memory_analysis().temp_size_in_bytes)
    return out


@_inputs.x32()
def compile_train_step(
    emb,
    batch: int,
    ids_per_example: int | Mapping[str, int] = 1,
    *,
    hidden: int = 16,
    topo: Topology | None = None,
    step: Callable | None = None,
    allow_oom: bool = False,
) -> CompileReport:
    """Compiles `step` (default: `train_step_fn(emb, hidden)`) with the state donated.

    Args:
        emb: A jte.Embedding whose mesh holds TPU topology devices (see `mesh`).
        batch: Global batch B, a multiple of the mesh size.
        ids_per_example: L, an int or {feature path: L} (see `abstract_features`).
        topo: The topology of `emb.mesh`, for the HBM figures; found from the devices if
            None.
        step: Optional fn(state, dense, features) -> (state, ...) replacing the default.
            A pipelined embedding's `features` are two batches (see `train_step_fn`).
        allow_oom: When the program does not fit HBM the compiler fails; with True it is
            compiled again with `xla_tpu_no_crash_on_oom` so that the report still gives
            every number (and `oom` the compiler's message).
    """
    if topo is None:
        topo = _topology_of(emb.mesh)
    default_step, dense = train_step_fn(emb, hidden)
    step = step or default_step
    state = emb.abstract_state()
    features = abstract_features(emb, batch, ids_per_example)
    if emb.spec.pipeline_execution:  # The batch and the pending one.
        features = (features, abstract_features(emb, batch, ids_per_example))
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=0).lower(state, dense, features)
    with tempfile.TemporaryDirectory(prefix="jte_tpu_") as dump:
        # The dump holds the buffer assignment: the only place that names each temporary.
        options = {"xla_dump_to": dump}
        oom = None
        try:
            compiled = lowered.compile(compiler_options=options)  # pyright: ignore[reportArgumentType]
        except Exception as e:  # JaxRuntimeError; its type moved between jax versions.
            if not allow_oom or "RESOURCE_EXHAUSTED" not in str(e):
                raise
            oom = str(e).strip().splitlines()[0]
            for path in glob.glob(os.path.join(dump, "*")):
                if os.path.isfile(path):
                    os.remove(path)
            try:
                compiled = lowered.compile(
                    compiler_options={  # pyright: ignore[reportArgumentType]
                        **options,
                        "xla_tpu_no_crash_on_oom": True,
                    }
                )
            except Exception as e2:
                # One array alone larger than HBM (a table's shard): the compiler cannot
                # place it at all, so only the state's own bytes are known.
                if "RESOURCE_EXHAUSTED" not in str(e2):
                    raise
                return _state_only_report(emb, topo, oom, time.perf_counter() - start)
        seconds = time.perf_counter() - start
        assignment = _read_buffer_assignment(dump)
    hlo = compiled.as_text()
    memory = compiled.memory_analysis()
    assert hlo is not None and memory is not None, "TPU compiles report both"
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    metadata = _op_names(hlo)
    if assignment is None:
        # No dump: the total bounds every temporary.
        temps = (
            [Temp(int(memory.temp_size_in_bytes), "?", "all temporaries", "")]
            if memory.temp_size_in_bytes
            else []
        )
    else:
        temps = [
            Temp(b, s, n, metadata.get(n.split("{")[0], ""), space) for b, s, n, space in assignment
        ]
    temps.sort(key=lambda t: -t.bytes)
    aliased, unaliased = _state_aliasing(hlo)
    tables, slots = _state_shard_bytes(emb)
    estimated, loops = cycles(hlo)
    return CompileReport(
        topology=topo,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        bytes_accessed=float(cost.get("bytes accessed", float("nan"))),
        flops=float(cost.get("flops", float("nan"))),
        collectives=collectives(hlo),
        largest_temps=temps,
        aliased_state=aliased,
        unaliased_state=unaliased,
        table_bytes=tables,
        slot_bytes=slots,
        compile_seconds=seconds,
        oom=oom,
        hlo=hlo,
        host_argument_bytes=int(getattr(memory, "host_argument_size_in_bytes", 0)),
        host_alias_bytes=int(getattr(memory, "host_alias_size_in_bytes", 0)),
        host_temp_bytes=int(getattr(memory, "host_temp_size_in_bytes", 0)),
        host_calls=host_calls(hlo),
        estimated_cycles=estimated,
        loops=loops,
    )


def _state_only_report(emb, topo: Topology, oom: str, seconds: float) -> CompileReport:
    """The report of a step the compiler refused outright: the state (donated, so counted
    once) and nothing else; temporaries, traffic and collectives unknown."""
    tables, slots = _state_shard_bytes(emb)
    state = sum(tables.values()) + sum(slots.values())
    return CompileReport(
        topology=topo,
        argument_bytes=state,
        output_bytes=state,
        alias_bytes=state,
        temp_bytes=0,
        code_bytes=0,
        bytes_accessed=float("nan"),
        flops=float("nan"),
        collectives=[],
        largest_temps=[],
        aliased_state=[],
        unaliased_state=[],
        table_bytes=tables,
        slot_bytes=slots,
        compile_seconds=seconds,
        oom=f"{oom} (one array alone exceeds HBM, so the compiler placed nothing: the "
        "figures are the state's own)",
    )


def _topology_of(mesh_: Mesh) -> Topology:
    devices = tuple(mesh_.devices.flat)
    kind = devices[0].device_kind  # "TPU v5 lite", "TPU v5", "TPU v6 lite", "TPU v4"
    generation = _platforms.tpu_generation(kind)
    if generation is None:
        raise ValueError(
            f"mesh devices are {kind!r}, not TPU devices of a known generation "
            f"({sorted(HBM_PER_CHIP)}); build the mesh with _aot.mesh(topology)."
        )
    chips = len({tuple(getattr(d, "coords", (d.id,))) for d in devices})
    return Topology(
        name=f"{generation}:{len(devices)} devices",
        generation=generation,
        devices=devices,
        chips=chips,
        hbm_per_chip=HBM_PER_CHIP[generation],
    )


def _state_shard_bytes(emb) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of one device's shard of each table and of its slots, as stored (padding and
    packing included; slots riding in the table's array count as slots)."""
    tables, slots = {}, {}
    for name, plan in emb.table_plans.items():
        tables[name], slots[name] = plan.storage.shard_bytes()
    return tables, slots


# ------------------------------------------------------------------------------ HLO text

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "token": 0,
}
# An array of an HLO shape text: dtype, dims and its layout if printed (in which memory
# space S(5) is host memory).
_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+[a-z]*)?)\[([\d,]*)\](\{[^}]*\})?")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")


def _arrays(shape_text: str) -> list[tuple[str, int, str]]:
    """[(array shape, logical bytes, layout or "")] of every array in an HLO shape text."""
    out = []
    for dtype, dims, layout in _ARRAY_RE.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(x) for x in dims.split(",") if x) if dims else 1
        out.append((f"{dtype}[{dims}]", n * _DTYPE_BYTES[dtype], layout))
    return out


def array_bytes(shape_text: str) -> list[tuple[str, int]]:
    """[(array shape, logical bytes)] of every array in an HLO shape text (tuples too)."""
    return [(shape, nbytes) for shape, nbytes, _ in _arrays(shape_text)]


def _parse(hlo: str):
    """(name, shape text, opcode, rest of line) of every instruction."""
    for line in hlo.splitlines():
        m = _INSTR_RE.match(line)
        if m:
            yield m.group(1), m.group(2), m.group(3), m.group(4)


def _instructions(hlo: str, opcode: str):
    for name, shape, op, _ in _parse(hlo):
        if op == opcode:
            arrays = array_bytes(shape)
            if arrays:
                biggest = max(arrays, key=lambda a: a[1])
                yield name, biggest[0], biggest[1]


def collectives(hlo: str) -> list[Collective]:
    """Every collective of an HLO module text, with the arrays it moves per device: the larger
    of its results and its operands, summed over the tuple of a combined collective."""
    instrs = {name: (shape, rest) for name, shape, _, rest in _parse(hlo)}

    def operands(rest: str) -> list[str]:
        return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])

    def arrays_of(names) -> list[tuple[str, int]]:
        return [a for n in names for a in array_bytes(instrs.get(n, ("", ""))[0])]

    out = []
    for name, shape, op, rest in _parse(hlo):
        if op.endswith("-done") and op[: -len("-done")] in COLLECTIVE_OPS:
            base = op[: -len("-done")]
            start = (operands(rest) or [""])[0]
            sources = arrays_of(operands(instrs.get(start, ("", ""))[1]))
        elif op in COLLECTIVE_OPS:
            base, sources = op, arrays_of(operands(rest))
        else:
            continue  # "-start" ops are counted at their "-done".
        results = array_bytes(shape)
        moved = max((results, sources), key=lambda arrays: sum(b for _, b in arrays))
        if not moved:
            continue
        counts: dict[str, int] = {}
        for array, _ in moved:
            counts[array] = counts.get(array, 0) + 1
        text = " + ".join(a if k == 1 else f"{k} x {a}" for a, k in counts.items())
        out.append(Collective(base, text, sum(b for _, b in moved), name))
    return out


def host_calls(hlo: str) -> list[HostCall]:
    """Every host computation (`HostExecute`) of an HLO module text: a "scatter" when it
    returns host arrays (the rows written in place), else a "gather"."""
    out = []
    for name, shape, op, rest in _parse(hlo):
        if op != "custom-call-start" or 'custom_call_target="HostExecute"' not in rest:
            continue
        # The start's shape: ((operands...), (results...), context).
        depth, parts, start = 0, [], 0
        for i, ch in enumerate(shape):
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == "," and depth == 1:
                parts.append(shape[start:i])
                start = i + 1
        parts.append(shape[start:])
        arrays = [[("S(5)" in lay, b) for _, b, lay in _arrays(part)] for part in parts[:2]]
        operands, results = arrays + [[]] * (2 - len(arrays))
        writes_host = any(on_host for on_host, _ in results)
        # Indices and rows sent to the host; a gather's rows come back (to device memory
        # directly, or through a copy).
        crossing = sum(b for on_host, b in operands if not on_host)
        if not writes_host:
            crossing += sum(b for _, b in results)
        kind = "scatter" if writes_host else "gather"
        on_miss = f"jit({_placement.MISSES})" in rest
        out.append(HostCall(kind, crossing, name, on_miss))
    return out


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its instruction lines}, the entry computation's name)."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s", line)
            if m:
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
                continue
        if current is not None and line.startswith("  "):
            comps[current].append(line)
    return comps, entry


def cycles(hlo: str) -> tuple[int, list[Loop]]:
    """(estimated cycles of a compiled TPU module, its loops with a fixed trip count of 2
    or more, most cycles first). The estimates are the compiler's own (`estimated_cycles`
    in each op's backend config); a `while` counts its body times its trip count, the
    largest constant its condition compares with, and once where there is none (a loop
    that runs until the data says so). Calls into other computations than loop bodies
    (fusions, Pallas kernels) count as their call's estimate, or nothing."""
    comps, entry = _computations(hlo)
    loops: list[Loop] = []

    def total(name: str, depth: int = 0) -> int:
        out = 0
        for line in comps.get(name, []):
            if re.search(r"\swhile\(", line) and depth < 16:
                body = re.search(r"body=%?([\w.\-]+)", line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                if body is None or cond is None:
                    continue
                consts = re.findall(r"constant\((\d+)\)", "\n".join(comps.get(cond.group(1), [])))
                trips = max((int(c) for c in consts), default=1)
                spent = total(body.group(1), depth + 1) * trips
                if trips > 1:
                    own = _INSTR_RE.match(line)
                    loops.append(Loop(trips, spent, _op_name(line), own.group(1) if own else ""))
                out += spent
            else:
                m = re.search(r'"estimated_cycles":"(\d+)"', line)
                out += int(m.group(1)) if m else 0
        return out

    return total(entry), sorted(loops, key=lambda loop: -loop.cycles)


def _op_name(text: str) -> str:
    """The jax op_name metadata of an instruction's text, or ""."""
    m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', text)
    return m.group(1).replace("\\'", "'") if m else ""


def _op_names(hlo: str) -> dict[str, str]:
    """{instruction name: jax op_name metadata}."""
    return {name: label for name, _, _, rest in _parse(hlo) if (label := _op_name(rest))}


def _state_aliasing(hlo: str) -> tuple[list[str], list[str]]:
    """(aliased, not aliased): entry parameters from `state.tables` / `state.slots` (by their
    jax metadata), by whether the module's input_output_alias reuses them for an output."""
    header = hlo.split("\n", 1)[0]
    m = re.search(
        r"input_output_alias=\{(.*?)\}\s*,\s*(?:entry_computation_layout|"
        r"allow_spmd|num_partitions|replica_count|frontend)",
        header,
    )
    aliased_params = {int(p) for p in re.findall(r":\s*\((\d+),", m.group(1))} if m else set()
    entry = hlo[hlo.find("\nENTRY") :]
    aliased, unaliased = [], []
    for _, _, op, rest in _parse(entry):
        if op != "parameter":
            continue
        number = int(rest.split(")", 1)[0])
        label = _op_name(rest)
        if label.startswith(("state.tables", "state.slots", "state.index")):
            (aliased if number in aliased_params else unaliased).append(label)
    return aliased, unaliased


def _read_buffer_assignment(dump: str) -> list[tuple[int, str, str, str]] | None:
    """[(bytes, shape, instruction, memory space)] of every temporary in the compiler's buffer
    assignment dump; None if the compiler wrote none. Memory spaces: "hbm" (color 0), "vmem"
    (color 1: on-chip vector memory, where the compiler may stage a whole narrow table),
    "smem" (color 2), else "color N"."""
    files = sorted(glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt")))
    if not files:
        return None
    out = []
    for path in files:
        with open(path) as f:
            text = f.read()
        for block in re.split(r"\n(?=allocation \d+:)", text):
            head = block.split("\n", 1)[0]
            if not head.startswith("allocation") or any(
                k in head
                for k in ("parameter", "thread-local", "constant", "output shape", "maybe-live-out")
            ):
                continue
            color = re.search(r"color (\d+)", head)
            color = int(color.group(1)) if color else 0
            space = {0: "hbm", 1: "vmem", 2: "smem"}.get(color, f"color {color}")
            for v in re.finditer(
                r"value: <\d+ ([^ >]+)(?: @[^>]*)?> \(size=(\d+),"
                r"offset=\d+\): (.*)",
                block,
            ):
                out.append((int(v.group(2)), v.group(3).strip(), v.group(1), space))
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
