"""Our own CPU kernels (csrc/cpu_ops.cpp), compiled on first use with torch's cpp_extension.

They are built for this machine's vector ISA, the one inductor picks (`pick_vec_isa`: its
`-m` flags and the `CPU_CAPABILITY_*` macro that selects ATen's `Vectorized<float>`), and
cached by torch under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`): the first
build takes ~15-20 s on 2 cores, a later process loads the cached library in well under a
second, and torch rebuilds it when the source or the flags change. Building needs a C++
compiler and ninja, which `engine.compile` needs too; without them `available()` is False
and the callers keep torch's kernels.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str once tried


def available() -> bool:
    """Build (or load the cached build of) the kernels once per process; False if that fails."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
        return bool(_state["ok"])


def build_error() -> str:
    """Why `available()` is False ('' when it is not, or before the first try)."""
    return str(_state.get("error", ""))


def _build() -> bool:
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    try:
        isa = pick_vec_isa()  # probes the compiler: raises without one
        # -fopenmp: ATen's parallel_for is OpenMP in torch's CPU wheels (as inductor builds).
        flags = [
            "-O3",
            "-fopenmp",
            *(f"-D{m}" for m in isa.build_macro()),
            *isa.build_arch_flags().split(),
        ]
        name = "controlplane_cpu_ops_" + ("_".join(str(isa).split()) or "scalar")
        load(
            name,
            [str(SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja, a build error: keep torch's kernels
        _state["error"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        log.warning("CPU kernels not built (%s); using torch's kernels", _state["error"][:300])
        return False
    if not hasattr(torch.ops.controlplane_cpu, "paged_decode_attention"):
        _state["error"] = "the library loaded without its ops"
        return False
    log.info(
        "CPU kernels (%s, %s) ready in %.1f s", name, " ".join(flags), time.perf_counter() - started
    )
    return True
