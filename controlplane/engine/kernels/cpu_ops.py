"""Our own CPU kernels (csrc/*.cpp): built for this machine with torch's cpp_extension,
loaded once per process.

One library, op namespace `controlplane_cpu`, whose schemas and fakes are all in ops.py:
attention (cpu_ops.cpp, used by attention/cpu.py), int4 and int8 linears (int4_linear.cpp,
int4_linear_bf16.cpp, int8_linear.cpp, int8_activations.cpp, used by model/quant/), packed
float and bf16 linears (packed_linear.cpp, bf16_linear.cpp, used by model/linear.py).

They are built for this machine's vector ISA, the one inductor picks (`pick_vec_isa`: its
`-m` flags and the `CPU_CAPABILITY_*` macro that selects ATen's `Vectorized<float>`), and
cached by torch under `TORCH_EXTENSIONS_DIR` (the daemon sets it under its data directory,
`server.compile_cache_dir`; torch's default is `~/.cache/torch_extensions`), one build per
source and flags (their hash is in the name). Building needs a C++ compiler (g++ 9 or newer,
as torch's cpp_extension asks; `$CXX`, else `c++`) and ninja (a dependency of the package):
`controlplane kernels build` builds them on purpose, with the compiler's output, and
`controlplane kernels status` says what loaded and why not (docs/operations.md). A first
build takes about a minute on 2 cores; a later process loads the cached library in well under
a second. Each build leaves a manifest (manifest.py) beside its library: where there is no
compiler or ninja (the Docker image's final stage), a build shipped in `TORCH_EXTENSIONS_DIR`
loads if it is of these sources, for this torch, and for instructions this CPU has. Otherwise
`available()` is False and the callers keep torch's kernels (`state()` says why).

torch's builder takes a `lock` file in the build directory and makes every other process wait
for it with no timeout, even when the process that took it is long dead. So a builder here also
holds an advisory `flock` on `lock.owner` beside it for the whole build, which the kernel drops
when that process dies (SIGKILL included): a `lock` with no live holder of `lock.owner` is
stale and removed at once (once no orphaned ninja works in the directory); a live holder is
waited for at most `configure(lock_wait_s=...)`
(server.kernel_build_wait_s), then this process keeps torch's kernels (`state()` says why). The
`stop` event of `configure` abandons a build in progress (the daemon sets it on SIGTERM or at
its start deadline): ninja gets SIGTERM, stops its compilers, and torch removes its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from controlplane.engine.kernels import manifest

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

# How long a process waits for another live process's build of the same kernels (two daemons
# starting at once on one host) before it keeps torch's kernels; the daemon sets it from
# server.kernel_build_wait_s. A cold build takes about a minute on 2 cores.
LOCK_WAIT_S = 300.0
LOCK_LOG_EVERY_S = 10.0  # the "waiting for the kernel build lock" line, repeated this often
OWNER_FILE = "lock.owner"  # beside torch's `lock`: flocked by the process that builds
POLL_S = 0.1  # how often a wait for the lock, or a build, looks at the stop event
# A directory of builds made elsewhere, each with its manifest, loaded first when one fits
# this machine (deploy/Dockerfile sets it to the builds its build stage made), whether or not
# a compiler is here: an image's first start needs no build.
SHIPPED_VAR = "CONTROLPLANE_KERNELS_DIR"

_lock = threading.Lock()  # held for the whole first `available()`: the build, or the wait
_state: dict[str, object] = {}  # "ok": bool, "error": str, "state": str once tried
_settings: dict[str, object] = {
    "lock_wait_s": LOCK_WAIT_S,
    "stop": threading.Event(),
    "verbose": False,  # the compiler's progress on stdout (`controlplane kernels build`)
}


class _Stopped(Exception):
    """The stop event was set: the build (or the wait for another one) was abandoned."""


class _LockHeld(Exception):
    """A live process held the build lock for longer than the wait allows."""


def configure(
    lock_wait_s: float | None = None,
    stop: threading.Event | None = None,
    verbose: bool | None = None,
) -> None:
    """Before the first `available()`: how long to wait for another live process's build
    (seconds), an event that, once set, abandons a build or a wait in progress (and any
    later one), leaving no lock behind, and whether the compiler's output is shown."""
    if lock_wait_s is not None:
        _settings["lock_wait_s"] = float(lock_wait_s)
    if stop is not None:
        _settings["stop"] = stop
    if verbose is not None:
        _settings["verbose"] = verbose


def available() -> bool:
    """Build (or load the cached build of) the kernels once per process; False if that fails."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = _build()
        # A stopped build is not this process's answer for good: an engine built later (a
        # daemon in a test process, with its own stop event) tries again.
        if ok or _state["state"] != "stopped":
            _state["ok"] = ok
        return ok


def wait_idle(timeout: float) -> bool:
    """Wait up to `timeout` seconds for a build (or a wait for one) in progress to end: after
    the stop event is set, the daemon waits here so that it exits with no lock left. True
    when none is in progress any more."""
    if not _lock.acquire(timeout=max(0.0, timeout)):
        return False
    _lock.release()
    return True


def state() -> dict[str, str]:
    """What this process's kernels are, for /admin/stats: `state` is `unused` (never asked
    for: not on a CPU, or not yet), `building` (or loading the cached build), `waiting` (for
    another process's build), `ready`, `failed` (no compiler or ninja, a build error),
    `lock_timeout` (another live process was building them for longer than the wait), or
    `stopped` (the start was stopped before or during the build); `reason` says why
    (build_error)."""
    return {"state": str(_state.get("state", "unused")), "reason": build_error()}


@functools.cache
def bf16_dot_available() -> bool:
    """Whether our bf16 dot-product kernels (`int8_linear_bf16`, `int4_linear_bf16`,
    `bf16_linear`) can run here: built for AVX512, on a CPU with AVX512-BF16."""
    return available() and bool(torch.ops.controlplane_cpu.bf16_dot_supported())


def describe() -> dict[str, object]:
    """What `controlplane kernels status` prints: `state()`, and where the build is, what
    it was built for (`isa`: the -m flags), how it came (built or loaded from torch's cache
    here, or a shipped build loaded without a compiler), and the toolchain found."""
    out: dict[str, object] = dict(state())
    out["extensions_dir"] = str(extensions_root())
    out["shipped_dir"] = str(_shipped_dir() or "") or None
    out["build_dir"] = _state.get("build_dir")
    out["library"] = _state.get("name")
    flags = _state.get("flags")
    out["isa"] = (
        " ".join(f for f in flags if f.startswith("-m")) if isinstance(flags, list) else None
    )
    out["loaded"] = _state.get("how")
    out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    out["toolchain_missing"] = toolchain_missing()
    out["bf16_dot"] = bf16_dot_available() if _state.get("ok") else False
    return out


def find_build() -> tuple[Path | None, str]:
    """The library `available()` would load without compiling (this machine's cached build,
    or a shipped one where there is no toolchain) and '', or None and why there is none:
    `controlplane kernels status` asks this before it loads anything, never building."""
    shipped = _shipped_dir()
    if shipped and (fitting := manifest.fitting(shipped, sources_digest())[0]):
        return fitting[0][0], ""
    missing = toolchain_missing()
    if missing:
        fitting, _ = manifest.fitting(extensions_root(), sources_digest())
        if fitting:
            return fitting[0][0], ""
        return None, f"no {' or '.join(missing)} on PATH, and no shipped build fits this machine"
    # A build with a manifest that fits needs no compiler probe (seconds on a busy host).
    fitting, _ = manifest.fitting(extensions_root(), sources_digest())
    if fitting:
        return fitting[0][0], ""
    name, _ = build_spec()
    library = extensions_root() / name / f"{name}.so"
    if library.is_file():
        return library, ""
    return None, f"not built for this machine yet ({library} is missing)"


def toolchain_missing() -> list[str]:
    """What building here lacks: the C++ compiler torch's cpp_extension runs (`$CXX`, else
    `c++`) and ninja; [] when both are on PATH."""
    compiler = os.environ.get("CXX", "c++")
    missing = [] if shutil.which(compiler) else [f"C++ compiler ({compiler})"]
    _put_ninja_on_path()
    from torch.utils.cpp_extension import is_ninja_available

    return missing if is_ninja_available() else [*missing, "ninja"]


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the package's own (the `ninja` wheel, a dependency) is in
    the environment's bin directory, which is not on PATH when the daemon is started by its
    full path or under systemd: put it there (last, so a system ninja wins)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the wheel's binary directory
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join(
        p for p in (os.environ.get("PATH", ""), ninja.BIN_DIR) if p
    )


def extensions_root() -> Path:
    """Where torch's cpp_extension keeps its builds: TORCH_EXTENSIONS_DIR, else its default
    (~/.cache/torch_extensions/py311_cpu, say)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("", False))


def sources_digest() -> str:
    """The C++ sources' and headers' hash: a build is of these sources or of none."""
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    return h.hexdigest()


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
    # The sources' hash and their folder in the name: two versions of controlplane on one host
    # (a rolling upgrade, a test checkout beside a daemon) each keep their own build rather
    # than rebuilding over each other at every start; so do two copies of the same sources
    # (a clone and an installed wheel), since ninja's commands name the source files' paths
    # and a build from the other copy is stale to it.
    folder = str(SOURCES[0].parent.resolve())
    digest = hashlib.sha256((sources_digest() + folder + " ".join(flags)).encode()).hexdigest()
    isa_name = "_".join(str(isa).split()) or "scalar"
    return f"controlplane_cpu_ops_{isa_name}_{digest[:12]}", flags


def _build() -> bool:
    started = time.perf_counter()
    stop = _settings["stop"]
    assert isinstance(stop, threading.Event)
    if stop.is_set():  # said once already, or the start was stopped before any build
        _state["state"] = "stopped"
        _state.setdefault("error", "the start was stopped before the kernel build")
        return False
    _state["state"] = "building"
    # The schemas and fakes (ops.py), before the kernels: the library only implements them.
    from controlplane.engine.kernels import ops

    try:
        shipped = _shipped_dir()
        fitting = manifest.fitting(shipped, sources_digest())[0] if shipped else []
        missing = toolchain_missing()
        if fitting:  # the image's own build for this CPU: no build, no compiler needed
            name, flags = _load(fitting[0])
        elif missing:  # no toolchain: only a shipped build in the extensions directory
            name, flags = _load_shipped(missing)
        else:
            name, flags = _build_here(stop)
    except _LockHeld as exc:
        return _fail("lock_timeout", str(exc))
    except Exception as exc:  # no compiler or ninja, a build error: keep torch's kernels
        if stop.is_set():
            return _fail("stopped", "the start was stopped during the kernel build")
        return _fail("failed", f"{type(exc).__name__}: {exc}".strip()[:2000])
    absent = ops.missing_kernels()
    if absent:
        return _fail("failed", f"the library loaded without the kernels of {', '.join(absent)}")
    _state["state"] = "ready"
    _state["name"], _state["flags"] = name, flags
    _state.pop("error", None)  # an earlier, stopped try's
    log.info(
        "CPU kernels (%s, %s) ready in %.1f s", name, " ".join(flags), time.perf_counter() - started
    )
    return True


def _build_here(stop: threading.Event) -> tuple[str, list[str]]:
    """Build for this CPU with torch's cpp_extension (or load its cached build), and leave a
    manifest beside the library so that a copy of the directory loads without a compiler."""
    from torch.utils.cpp_extension import _get_build_directory, load

    name, flags = build_spec()
    build_dir = Path(_get_build_directory(name, False))
    _state["build_dir"] = str(build_dir)
    verbose = bool(_settings["verbose"])
    with _owner(build_dir, stop), _stoppable(stop):
        load(
            name,
            [str(source) for source in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=verbose,
        )
    _state["how"] = "built or cached"
    manifest.write(build_dir, name, flags, sources_digest())
    return name, flags


def _load_shipped(missing: list[str]) -> tuple[str, list[str]]:
    """Load a build made elsewhere (deploy/Dockerfile's build stage) from the extensions
    directory: the richest one that fits (_shipped_builds). Raises naming what is missing."""
    fitting, seen = manifest.fitting(extensions_root(), sources_digest())
    if not fitting:
        builds = (
            f"the builds there ({', '.join(seen)}) are for other sources, torch or CPUs"
            if seen
            else "none is there"
        )
        raise RuntimeError(
            f"cannot build the kernels here (no {' or '.join(missing)} on PATH) and no shipped "
            f"build in {extensions_root()} fits this machine: {builds}; install a C++ compiler "
            "and ninja and run `controlplane kernels build`"
        )
    return _load(fitting[0])


def _load(build: tuple[Path, dict]) -> tuple[str, list[str]]:
    """Load a library built elsewhere (its manifest checked by manifest.fitting)."""
    library, found = build
    _state["build_dir"], _state["how"] = str(library.parent), "shipped"
    torch.ops.load_library(str(library))
    return str(found["name"]), list(found["flags"])


def _shipped_dir() -> Path | None:
    """SHIPPED_VAR's directory of builds made elsewhere (the Docker image's), if set."""
    value = os.environ.get(SHIPPED_VAR, "")
    return Path(value) if value else None


def _fail(state: str, error: str) -> bool:
    _state["state"], _state["error"] = state, error
    # The one line a start says about it (the daemon's /admin/stats `kernels` says it too).
    log.warning(
        "CPU kernels not built (%s); using torch's kernels, slower on a CPU (see "
        "docs/benchmarks.md#cpu-kernels); `controlplane kernels status` says more",
        error[:300],
    )
    return False


@contextlib.contextmanager
def _owner(build_dir: Path, stop: threading.Event) -> Iterator[None]:
    """Hold `lock.owner`'s flock (waiting for a live holder at most lock_wait_s), and remove a
    torch `lock` that no live process owns: every builder holds that flock for its whole
    build, so once it is ours, a `lock` there was left by a process that died mid-build. Its
    ninja may outlive it (a SIGKILL reaches only the daemon): a process still working in the
    build directory is waited for too, so that two builds never write the same objects."""
    lock = build_dir / "lock"
    fd = os.open(build_dir / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        wait_s = float(_settings["lock_wait_s"])  # type: ignore[arg-type]
        started = time.monotonic()
        logged = -LOCK_LOG_EVERY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                who = f"pid {holder} is building"
            else:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # names the builder to waiters
                left = _processes_in(build_dir.resolve()) if lock.exists() else []
                if not left:
                    break
                who = f"pid {left[0]}, of a build whose process died, is still running"
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise _LockHeld(
                    f"the kernel build lock {lock} was held by a live build ({who}) for "
                    f"{waited:.0f} s, longer than the wait allows (server.kernel_build_wait_s = "
                    f"{wait_s:g} s)"
                )
            if waited - logged >= LOCK_LOG_EVERY_S:
                _state["state"] = "waiting"
                log.warning(
                    "waiting for the kernel build lock %s (%s; up to %.0f s more)",
                    lock,
                    who,
                    wait_s - waited,
                )
                logged = waited
            if stop.wait(POLL_S):
                raise _Stopped()
        if stop.is_set():
            raise _Stopped()
        _state["state"] = "building"
        if lock.exists():
            log.warning(
                "removing %s, left by a build that never finished (no live process owns it)", lock
            )
            lock.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # drops the flock


def _processes_in(directory: Path) -> list[int]:
    """Processes whose working directory is `directory` (ninja and its compilers run in the
    build directory), read from /proc (Linux; elsewhere none are found)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == directory:
                    found.append(int(entry.name))
            except OSError:  # gone, or another user's
                continue
    return sorted(found)


@contextlib.contextmanager
def _stoppable(stop: threading.Event) -> Iterator[None]:
    """While torch builds: once `stop` is set, SIGTERM this process's ninja (torch runs it as a
    child), which stops its compilers and exits; torch's load then raises and removes its
    lock on the way out (FileBaton.release in a finally)."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(POLL_S):
            if stop.is_set():
                _signal_children("ninja", signal.SIGTERM)

    watcher = threading.Thread(target=watch, name="kernel-build-stop", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _signal_children(command: str, sig: int) -> None:
    """Send `sig` to this process's children named `command` (read from /proc: Linux)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split at the last.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == me and comm == command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), sig)
