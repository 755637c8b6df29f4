"""The one gate of the tests that need our C++ CPU kernels.

The kernels build on any CPU with a C++ compiler and ninja (they keep scalar code where the
CPU lacks an instruction set; the tests that need one skip on their own). So outside CI a
machine without the toolchain skips them, but under CI (`CI` set) a failed build fails the
run: CI's machine must build them, as the Docker image's build stage does."""

from __future__ import annotations

import os

import pytest

from controlplane.engine.kernels import cpu_ops


def require_kernels() -> None:
    """Skip the calling test (or module, at import) where the kernels did not build; under CI,
    fail it, naming the build error."""
    if cpu_ops.available():
        return
    if os.environ.get("CI"):
        pytest.fail(f"the CPU kernels did not build on CI: {cpu_ops.build_error()}", pytrace=False)
    pytest.skip(f"the CPU kernels did not build: {cpu_ops.build_error()}", allow_module_level=True)
