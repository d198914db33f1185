"""Row kernels: who does a table's shard-local row work (`Embedding(backend=...)`).

`backend=` takes a name ("auto", "xla", "pallas", "pallas_interpret", "cpu"), an instance of
one of the classes below (for their options), or {table name: either}:

    Xla()                     XLA ops: any mesh, any table, either routing
    Pallas(interpret=False,   fused Pallas TPU kernels (TPU meshes; interpret=True runs them
           block=1024,        in Pallas' interpreter anywhere); block: pairs per grid step;
           vmem=None,         vmem: VMEM bytes to size against (None: the chips');
           pack_keys=True)    pack_keys: (row, output row) in one sort key where both fit
    Cpu()                     C++ kernels through XLA FFI (CPU meshes, routing="gather")

A call that a kernel cannot hold (its activations overflow the Pallas kernels' VMEM) runs
on XLA ops instead, and `Embedding.call_plans` says so.
"""

from ._backend import Backend as Backend
from ._cpu_kernels import CpuBackend as Cpu
from ._pallas import PallasBackend as Pallas
from ._xla_backend import XlaBackend as Xla

NAMES = ("auto", "xla", "pallas", "pallas_interpret", "cpu")


def named(backend: str | Backend) -> Backend:
    """The kernel of a name in NAMES but "auto" (an instance is its own)."""
    if isinstance(backend, Backend):
        return backend
    return {
        "xla": Xla,
        "pallas": Pallas,
        "pallas_interpret": lambda: Pallas(interpret=True),
        "cpu": Cpu,
    }[backend]()
