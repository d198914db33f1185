"""The C++ sources compile wherever a compiler is on PATH.

Where they do not build, the library warns once and runs the portable XLA path, and the
tests of the C++ kernels skip (`test_cpu_kernels`, `test_hashindex_cpu`). That is right on
a machine without g++; with one, a skip would hide a broken source behind a passing run.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest

from jax_tpu_embed import _cpu_kernels, _hashindex_cpu


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler on PATH"
)
@pytest.mark.parametrize("available", [_cpu_kernels.available, _hashindex_cpu.available])
def test_kernels_build_where_a_compiler_is_found(available):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # The build's failure warning, raised with its stderr.
        assert available()
