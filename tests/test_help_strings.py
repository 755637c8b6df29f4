"""The configuration's help strings and declared limits.

Help strings (an engine setting's `doc`, a config field's comment, as the generated configuration
reference renders them) say what a setting does, what it trades and when to turn it off, and link
to docs/benchmarks.md for figures: a measured ratio or a machine's name in one of them is a
figure kept in two places, which is how the README and the reference drifted. Every range or
choice declared on a field (controlplane/limits.py) is enforced: a value just outside it is
refused by the config file's path and by the engine's own check, naming the field.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import math
import re
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from controlplane import config
from controlplane.engine.settings import EngineSettings, check
from controlplane.errors import FieldError
from controlplane.limits import choices_of, range_of

REPO = Path(__file__).resolve().parent.parent
HOOK = REPO / "docs" / "hooks" / "config_reference.py"
BENCHMARKS = REPO / "docs" / "benchmarks.md"

# "1.39-1.45x", "0.68x", "3x", "1.5×"; not "0x9E37" (hex), "x86" or "3 x heartbeat_s" (a rule).
RATIO = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?[x×]\b")
# A timing or a throughput measured on some machine: "8 us", "10.12 ms", "72.6 tok/s".
TIMING = re.compile(r"\b\d+(?:\.\d+)?\s*(?:us|µs|ms|tok/s)\b")
# Machine and CPU family names. AMX is matched in capitals only: `amx` is a setting's name.
MACHINE = re.compile(
    r"\b(?:EPYC|Xeon|Zen ?\d?|Ryzen|Threadripper|(?:Sapphire|Emerald|Granite) Rapids|"
    r"(?:Ice|Cascade|Cooper) Lake|Skylake|Genoa|Turin|Graviton|[AHL]\d{2,3}|B200|GH200)\b",
    re.IGNORECASE,
)
AMX = re.compile(r"\bAMX\b")
# The longest help string allowed: bf16_dot's 806 characters were a lab notebook entry.
MAX_HELP_CHARS = 500


def load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hook_config_reference", HOOK)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def offences(text: str) -> list[str]:
    return [m.group(0) for pattern in (RATIO, TIMING, MACHINE, AMX) for m in pattern.finditer(text)]


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    return load_hook()


@pytest.fixture(scope="module")
def help_strings(hook: ModuleType) -> dict[str, str]:
    """Every field's help as the reference renders it, by dotted key, and the engine's docs as
    written on the fields (the same strings, read without the hook)."""
    out = {f"{s.name}.{r.key}" if s.name else r.key: r.doc for s in hook.sections() for r in s.rows}
    for f in dataclasses.fields(EngineSettings):
        out[f"EngineSettings.{f.name}"] = f.metadata["doc"]
    return out


def test_the_patterns_catch_what_the_help_strings_used_to_carry():
    # A pattern that matched nothing would pass every help string.
    for bad in (
        "SmolLM2 batch-1 decode 1.35-1.6x faster",
        "one user 0.68x",
        "1.39-1.45x llama.cpp there",
        "3x faster",
        "16 rows of 200 tokens 1.6x",
        "on a 2-core Zen 4",
        "on an AVX2 EPYC",
        "a 2-core Emerald Rapids Xeon",
        "Sapphire Rapids",
        "on a CPU with AMX tiles",
        "on an H100",
        "8 us a call",
        "10.12 -> 9.35 ms",
        "72.6 vs 82.3 tok/s",
    ):
        assert offences(bad), bad
    for fine in (
        "int4 / int8 values",
        "x86 CPU (AVX2 or AVX512)",
        "the `amx` setting",
        "0x9E3779B97F4A7C15",
        "2 MB pages",
        "USD per GPU-hour x GPUs x wall-clock time",
        "0.8 x T",
        "milliseconds",
        "docs/benchmarks.md#compiled-decode-step",
    ):
        assert not offences(fine), fine


def test_help_strings_carry_no_ratio_timing_or_machine_name(help_strings):
    assert len(help_strings) > 150  # every section's fields, and the engine's twice
    bad = {key: offences(text) for key, text in help_strings.items() if offences(text)}
    assert bad == {}, "figures belong in docs/benchmarks.md; link to its section instead"


def test_the_rendered_reference_carries_no_ratio_timing_or_machine_name(hook):
    page = html.unescape(hook.render())
    # Section intros and every key's block, as the site shows them; the environment variables
    # spell the setting's name (CONTROLPLANE_ENGINE__AMX).
    assert "## [engine]" in page and "bf16_dot" in page
    assert offences(re.sub(r"\bCONTROLPLANE_\w+", "", page)) == []


def test_help_strings_are_short(help_strings):
    long = {k: len(t) for k, t in help_strings.items() if len(t) > MAX_HELP_CHARS}
    assert long == {}


def test_help_strings_link_to_benchmark_sections_that_exist(help_strings, hook):
    text = BENCHMARKS.read_text()
    anchors = set(re.findall(r"\{ #([a-z0-9-]+) \}", text))
    linked = {a for doc in help_strings.values() for a in hook.BENCHMARK_LINK.findall(doc)}
    # The performance settings point at their figures.
    assert {"bf16-dot", "compiled-decode-step", "prefix-caching"} <= linked
    assert linked - anchors == set(), "docs/benchmarks.md lacks these sections"
    page = hook.render()
    assert "](benchmarks.md#bf16-dot)" in page  # rendered as a link on the site


# -- declared limits ---------------------------------------------------------------------------


def sections() -> dict[str, type]:
    """The config file's tables by name (engine included), read from the model."""
    hints = typing.get_type_hints(config.Config)
    out = {}
    for f in dataclasses.fields(config.Config):
        cls = hints[f.name]
        if typing.get_origin(cls) is tuple:
            cls = typing.get_args(cls)[0]
        if dataclasses.is_dataclass(cls):
            out[f.name] = cls
    return out


def declared() -> list[tuple[str, dataclasses.Field]]:
    return [
        (section, f)
        for section, cls in sections().items()
        for f in dataclasses.fields(cls)
        if range_of(f) is not None or choices_of(f) is not None
    ]


def outside(f: dataclasses.Field) -> list[Any]:
    """Values just outside the field's declaration: past each end of its range (the open end
    itself), or a value that is none of its choices."""
    r = range_of(f)
    if r is None:
        choices = choices_of(f)
        assert choices
        return [max(choices) + 1] if isinstance(choices[0], int) else ["not-a-choice"]
    integer = isinstance(f.default, int) or f.default is None
    values = [r.lo if r.lo_open else (r.lo - 1 if integer else math.nextafter(r.lo, -math.inf))]
    if r.hi is not None:
        values.append(
            r.hi if r.hi_open else (r.hi + 1 if integer else math.nextafter(r.hi, math.inf))
        )
    return values


def raw_with(section: str, name: str, value: Any) -> dict[str, Any]:
    if section == "prices":
        entry = {"model": "*", "effective_from": "2026-01-01T00:00:00Z", name: value}
        return {"prices": [entry]}
    return {section: {name: value}}


def test_the_declarations_cover_the_ranged_fields():
    keys = {f"{s}.{f.name}" for s, f in declared()}
    assert len(keys) > 90
    for key in (
        "server.port",
        "server.log_level",
        "store.flush_interval_s",
        "alerts.queue_fill_crit",
        "prices.prompt_per_mtok",
        "engine.max_num_seqs",
        "engine.gpu_memory_utilization",
        "engine.quantization_group_size",
        "engine.attention_backend",
    ):
        assert key in keys, key


def test_every_default_is_inside_its_declaration():
    for section, f in declared():
        value = f.default
        if value is None:
            continue
        r = range_of(f)
        assert value in r if r is not None else value in choices_of(f), f"{section}.{f.name}"


# Fields whose declared range a rule relating them to another field enforces, with a message
# naming both: the autopilot's bounds (min <= max), max_window_s (>= window_s),
# unreachable_after_s (> heartbeat_s).
CROSS_FIELD = {
    *(
        f"autopilot.{k}_{end}"
        for k in config.AutopilotSettings().bounds()
        for end in ("min", "max")
    ),
    "autopilot.max_window_s",
    "fleet.unreachable_after_s",
}


@pytest.mark.parametrize("section,f", declared(), ids=[f"{s}.{f.name}" for s, f in declared()])
def test_a_value_just_outside_a_declaration_is_refused_naming_the_field(section, f):
    r = range_of(f)
    key = f"{section}.{f.name}"
    for value in outside(f):
        with pytest.raises(FieldError) as exc:
            config.build_config(raw_with(section, f.name, value), env={})
        if key in CROSS_FIELD:
            assert f.name in str(exc.value), (value, str(exc.value))
            continue
        where = f"prices[0].{f.name}" if section == "prices" else key
        limit = r.describe() if r is not None else ", ".join(map(str, choices_of(f)))
        assert exc.value.field == where and limit in exc.value.message, (value, str(exc.value))
        if section == "engine":
            # The engine's own check (Engine.update_settings, the LLM() constructor) too.
            with pytest.raises(FieldError) as direct:
                check(EngineSettings(**{f.name: value}))
            assert direct.value.field == f.name and limit in direct.value.message


def test_the_engine_refuses_a_wrong_type_naming_the_field_and_limit():
    for name, value, said in (
        ("max_num_seqs", "8", "must be an integer in [1, 4096]"),
        ("max_num_seqs", True, "must be an integer in [1, 4096]"),
        ("gpu_memory_utilization", "0.5", "must be a number in (0, 1]"),
        ("bf16_dot", 1, "must be true or false"),
        ("quantization_group_size", True, "must be one of 32, 64, 128, 256"),
        ("dtype", "FLOAT32", "must be one of auto, float32, bfloat16, float16"),
    ):
        with pytest.raises(FieldError) as exc:
            check(EngineSettings(**{name: value}))
        assert exc.value.field == name and said in exc.value.message, str(exc.value)


def test_log_level_is_matched_in_any_case():
    assert config.build_config({"server": {"log_level": "DEBUG"}}, env={}).server.log_level
    with pytest.raises(FieldError, match=r"^server\.log_level: must be one of debug, info"):
        config.build_config({"server": {"log_level": "verbose"}}, env={})
