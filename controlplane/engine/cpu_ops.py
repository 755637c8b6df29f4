"""Our own CPU kernels (csrc/*.cpp), compiled on first use with torch's cpp_extension.

One library, op namespace `controlplane_cpu`: `paged_decode_attention` and, for compiled
steps, `step_attention` with `set_decode_step` / `clear_decode_step` (cpu_ops.cpp, used by
cpu_attention.py), `int4_linear`, `int4_linear_bf16`, `int8_linear`, `int8_linear_bf16`,
`w4a8_linear` and `w8a8_linear` (int4_linear.cpp, int4_linear_bf16.cpp, int8_linear.cpp,
int8_activations.cpp, used by model/quant.py), `packed_linear` and `bf16_linear` with
`bf16_pack_weight` (packed_linear.cpp, bf16_linear.cpp, used by model/linear.py).

They are built for this machine's vector ISA, the one inductor picks (`pick_vec_isa`: its
`-m` flags and the `CPU_CAPABILITY_*` macro that selects ATen's `Vectorized<float>`), and
cached by torch under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`), one build
per source and flags (their hash is in the name): the first build takes 45-55 s on 2 cores, a
later process loads the cached library in well under a second. Building needs a C++
compiler and ninja, which `engine.compile` needs too; without them `available()` is False
and the callers keep torch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "cpu_ops.cpp",
        "int4_linear.cpp",
        "int4_linear_bf16.cpp",
        "int8_linear.cpp",
        "int8_activations.cpp",
        "packed_linear.cpp",
        "bf16_linear.cpp",
    )
)
HEADERS = tuple(
    Path(__file__).parent / "csrc" / name
    for name in ("prefetch.h", "tiles.h", "bf16_dot.h", "int4_common.h")
)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str once tried


def available() -> bool:
    """Build (or load the cached build of) the kernels once per process; False if that fails."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
        return bool(_state["ok"])


@functools.cache
def bf16_dot_available() -> bool:
    """Whether our bf16 dot-product kernels (`int8_linear_bf16`, `int4_linear_bf16`,
    `bf16_linear`) can run here: built for AVX512, on a CPU with AVX512-BF16."""
    return available() and bool(torch.ops.controlplane_cpu.bf16_dot_supported())


def build_error() -> str:
    """Why `available()` is False ('' when it is not, or before the first try)."""
    return str(_state.get("error", ""))


def build_spec() -> tuple[str, list[str]]:
    """The extension's name and compiler flags on this machine (raises without a compiler)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()  # probes the compiler
    # -fopenmp: ATen's parallel_for is OpenMP in torch's CPU wheels (as inductor builds).
    flags = [
        "-O3",
        "-fopenmp",
        *(f"-D{m}" for m in isa.build_macro()),
        *isa.build_arch_flags().split(),
    ]
    # Inductor's AVX512 flags leave out F16C, which every AVX512 CPU has: without it each
    # float16 scale of the int8-activation kernels converts in scalar code.
    if "-mavx512f" in flags and "-mf16c" not in flags:
        flags.append("-mf16c")
    # The source's hash in the name: two versions of controlplane on one host (a rolling
    # upgrade, a test checkout beside a daemon) each keep their own build rather than
    # rebuilding over each other at every start.
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(sources + " ".join(flags).encode()).hexdigest()
    isa_name = "_".join(str(isa).split()) or "scalar"
    return f"controlplane_cpu_ops_{isa_name}_{digest[:12]}", flags


def _build() -> bool:
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    try:
        name, flags = build_spec()
        _clear_stale_lock(name)
        load(
            name,
            [str(source) for source in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja, a build error: keep torch's kernels
        _state["error"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        log.warning("CPU kernels not built (%s); using torch's kernels", _state["error"][:300])
        return False
    ops = torch.ops.controlplane_cpu
    if not all(
        hasattr(ops, op)
        for op in (
            "paged_decode_attention",
            "step_attention",
            "set_decode_step",
            "clear_decode_step",
            "int4_linear",
            "int4_linear_bf16",
            "amx_supported",
            "int8_linear",
            "int8_linear_bf16",
            "w4a8_linear",
            "w8a8_linear",
            "packed_linear",
            "bf16_linear",
            "bf16_pack_weight",
        )
    ):
        _state["error"] = "the library loaded without its ops"
        return False
    _register_fakes()
    log.info(
        "CPU kernels (%s, %s) ready in %.1f s", name, " ".join(flags), time.perf_counter() - started
    )
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile's tracing (a compiled step calls paged_decode_attention
    through step_attention, or `controlplane::paged_attention` for 8-bit caches)."""

    @torch.library.register_fake("controlplane_cpu::step_attention")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake("controlplane_cpu::int4_linear")
    @torch.library.register_fake("controlplane_cpu::int4_linear_bf16")
    def _(
        x: torch.Tensor,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        block_n: int,
        split: bool,
        amx: bool = False,
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], packed.shape[0]))

    @torch.library.register_fake("controlplane_cpu::w4a8_linear")
    def _(
        x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("controlplane_cpu::w8a8_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("controlplane_cpu::packed_linear")
    @torch.library.register_fake("controlplane_cpu::bf16_linear")
    def _(
        x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("controlplane_cpu::int8_linear")
    @torch.library.register_fake("controlplane_cpu::int8_linear_bf16")
    def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


# A build takes under a minute; a lock this much older was left by a process killed mid-build.
STALE_LOCK_S = 600.0


def _clear_stale_lock(name: str) -> None:
    """torch's builder waits, forever, for the lock file of a build in progress: a daemon killed
    during its first build would leave every later start waiting. An old lock is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that never finished", lock, age)
        lock.unlink(missing_ok=True)
