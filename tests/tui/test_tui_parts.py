"""The dashboard's pure parts: severity levels, trend lines, the `:` commands, the requests
table's filter and grouping (no Textual, no daemon)."""

from __future__ import annotations

import pytest

from controlplane.tui.commands import CommandError, parse, window_seconds
from controlplane.tui.cost_panel import spend_by
from controlplane.tui.history import spark
from controlplane.tui.severity import CRIT, OK, WARN, header_slo, level, metric_level
from controlplane.tui.tables import group_rows, matches, short_id

LIMITS = {"warn": 1000.0, "crit": 3000.0}


@pytest.mark.parametrize(
    ("value", "want"),
    [(0, OK), (999.9, OK), (1000, WARN), (2999, WARN), (3000, CRIT), (1e9, CRIT)],
)
def test_level_against_warn_and_crit(value, want):
    assert level(value, LIMITS) == want


def test_level_unknown_is_none_not_ok():
    assert level(None, LIMITS) is None
    assert level(5, None) is None
    assert level(True, LIMITS) is None  # a flag is not a measurement


def test_metric_level_reads_the_snapshot_thresholds():
    stats = {"ttft_p99_ms": 2500.0, "thresholds": {"ttft_p99_ms": LIMITS}}
    assert metric_level(stats, "ttft_p99_ms") == WARN
    assert metric_level(stats, "ttft_p99_ms", 3500.0) == CRIT  # e.g. the 10 s figure
    assert metric_level(stats, "itl_p99_ms") is None  # no threshold sent


def test_header_slo_is_red_when_missed_and_silent_without_targets():
    assert header_slo({"slo": {"attainment": 0.62, "met": False}}) == ("62%", CRIT)
    assert header_slo({"slo": {"attainment": 1.0, "met": True}}) == ("100%", OK)
    assert header_slo({"slo": {"attainment": None, "met": None}}) == ("", None)
    assert header_slo({}) == ("", None)


def test_spark_keeps_a_spike_and_fits_the_width():
    values = [1.0] * 100
    values[57] = 50.0
    line = spark(values, 10)
    assert len(line) == 10
    assert line.count("█") == 1 and line[5] == "█"  # the spike's cell, never averaged away
    assert set(line) - {"█"} == {"▁"}
    assert spark([None, None, 3.0], 3) == "  █"  # unknown values draw nothing
    assert spark([], 10) == "" and spark([1.0], 0) == ""
    assert len(spark([1.0, 2.0], 40)) == 2  # fewer points than cells: one cell each


def test_commands_parse_and_name_what_is_wrong():
    assert parse("abort-key bad-tenant").arg == "bad-tenant"
    assert parse("  DRAIN ").name == "drain"
    assert parse("filter").arg == ""  # clears the filter
    assert parse("cost 10m").arg == "10m"
    with pytest.raises(CommandError, match="abort-key needs KEY"):
        parse("abort-key")
    with pytest.raises(CommandError, match="takes no argument"):
        parse("drain now")
    with pytest.raises(CommandError, match=r"unknown command 'dran'.*drain"):
        parse("dran")
    with pytest.raises(CommandError, match="key, user or none"):
        parse("group model")


@pytest.mark.parametrize(("text", "seconds"), [("5m", 300), ("90m", 5400), ("24h", 86400)])
def test_cost_window_in_range(text, seconds):
    assert window_seconds(text) == seconds


@pytest.mark.parametrize("text", ["4m", "25h", "10", "1d", "-5m", "1.5h"])
def test_cost_window_out_of_range_or_malformed(text):
    with pytest.raises(CommandError, match="cost window"):
        window_seconds(text)


ROWS = [
    {"id": "chatcmpl-aaaa1111", "state": "running", "api_key_name": "alice", "end_user": "u1",
     "prompt_tokens": 10, "output_tokens": 30},
    {"id": "chatcmpl-bbbb2222", "state": "waiting", "api_key_name": "bad-tenant",
     "end_user": "u2", "prompt_tokens": 500, "output_tokens": 0},
    {"id": "chatcmpl-cccc3333", "state": "running", "api_key_name": "bad-tenant",
     "end_user": None, "prompt_tokens": 400, "output_tokens": 60},
]  # fmt: skip


def test_filter_words_all_match():
    assert [r["id"] for r in ROWS if matches(r, "key:bad")] == [
        "chatcmpl-bbbb2222",
        "chatcmpl-cccc3333",
    ]
    assert [r["id"] for r in ROWS if matches(r, "key:bad state:running")] == ["chatcmpl-cccc3333"]
    assert [r["id"] for r in ROWS if matches(r, "U1")] == ["chatcmpl-aaaa1111"]  # any field
    assert [r for r in ROWS if matches(r, "user:nobody")] == []


def test_group_by_key_counts_tokens_share_and_spend():
    groups = {g["name"]: g for g in group_rows(ROWS, "api_key_name", {"bad-tenant": 0.25})}
    bad = groups["bad-tenant"]
    assert (bad["requests"], bad["running"], bad["waiting"]) == (2, 1, 1)
    assert bad["prompt_tokens"] == 900 and bad["output_tokens"] == 60
    assert bad["share"] == pytest.approx(960 / 1000)
    assert bad["spend"] == 0.25 and groups["alice"]["spend"] is None
    by_user = {g["name"] for g in group_rows(ROWS, "end_user")}
    assert by_user == {"u1", "u2", "–"}


def test_short_id_keeps_the_distinctive_tail():
    assert short_id("chatcmpl-0123456789abcdef") == "…89abcdef"
    assert short_id("cmpl-0001") == "cmpl-0001"


def test_spend_by_reads_the_spend_column():
    report = {
        "columns": ["api_key", "requests", "list_usd"],
        "rows": [{"api_key": "a", "requests": 3, "list_usd": 0.5},
                 {"api_key": None, "requests": 1, "list_usd": 0.25}],
    }  # fmt: skip
    assert spend_by(report, "api_key") == {"a": 0.5, "–": 0.25}
    assert spend_by({"empty": True, "columns": ["list_usd"]}, "api_key") == {}
