"""Cost, request and utilization reports from SQL: what `controlplane report ...` prints and the
admin API's /admin/costs and /admin/utilization return.

All read only the database (they work while the daemon is down) and aggregate across
instances (a cost report can also count one instance's requests: `instance_id`, scope
"instance"). The window is whole UTC hours: every hour that overlaps [since, until), i.e. from
the hour containing `since` up to the hour containing the last instant before `until`; the
`Report`'s since / until are that effective window. The exception is a cost report from the
request rows (`source` "requests", which `cost_window` picks for the API and the CLI when a
window of 1 minute to 24 hours is not whole hours, or is grouped by end_user): it counts the
final requests that arrived in exactly [since, until), with the rollup's arithmetic, so over
whole hours both sources give the same counts, tokens and list cost. From the rows there is
no GPU-amortized cost, utilization or MFU (those are kept per hour): they are None, and
nothing is provisional. Every cost report says its `source`, `scope` and exact window;
`requests` is succeeded + failed and `token_share` the group's share of the window's prompt +
completion tokens.

Cost reports read `cost_rollups` (see `controlplane.accounting.rollup` for each figure), and the
request rows the rollup has not counted yet (requests that ended since an instance's last rollup
run, or of an instance that never ran one): their (hour, instance) is recounted from the rows,
with the GPU figures of the last rollup, and every row and total it touches has
`provisional` = true until the next rollup. Per group:
counts, tokens and costs are sums; `list_usd_per_mtok_prompt` / `_completion` are the group's
prompt-side / completion-side list cost per million prompt / completion tokens;
`cached_share` is cached / prompt tokens and `cache_savings_usd` what the prefix cache saved at
list price (cached tokens x (prompt rate - cached rate), by each request's own price row);
`gpu_usd_per_mtok` is the group's GPU cost per million computed tokens (prompt - cached +
completion; the same rate for prompt and completion tokens). A group that includes "(idle)"
rows (grouping without api_key) therefore shows the all-in GPU rate, idle time included; the
"(idle)" group itself (grouping by api_key) has no tokens and no rate. `mean_utilization` and
`mfu` are means over the distinct (hour, instance) pairs the group's rows fall in, weighted by
their covered seconds.

Request reports read the request rows themselves (final rows only, by their arrival hour), so
they can group by what the hourly rollups do not keep: `user` (the requests' OpenAI `user`
field, `requests.end_user`), besides day|hour, model and api_key. Per group: requests
succeeded / failed, tokens, the cached share of prompt tokens, list cost (the sum of the rows'
`cost_usd`, priced at ingest) and mean TTFT and end-to-end latency (over the rows that have
one). No GPU cost: that is shared out per hour by the rollup, which is not kept per user (users
are chosen by clients, unbounded, and rollups are kept forever). Request rows are pruned after
`jobs.request_retention_days`, so a request report reaches back that far at most. Grouped by
api_key (alone or with day|hour) a request report also counts the requests refused in the
window's hours (`throttled`, `throttled_by_reason`), which have no request row, from the
`refusals` table (per UTC hour, instance, key and reason; store.recorder writes it); a group
whose every request was refused has a row of its own. By api_key alone each row also has the
table key's budget use in its current period (`budget_usd`, `budget_period`,
`budget_spend_usd`, `budget_use`; controlplane.tenants.budgets.budget_use, the spend query the
daemons' budgets read), null for a key without a budget.

Utilization reports read `utilization_samples` and `gpu_samples`. Means are time-weighted (by
the samples' interval_s) over the samples that carry the reading; GPU means are per GPU;
`gpu_energy_j` is the energy all GPUs used (the sum of `gpu_samples.interval_energy_j`) and
`max_gpu_temperature_c` the hottest reading.

Totals are computed from the same underlying sums as the rows (never by averaging rows).
Parameters are validated here; a bad one raises FieldError (a ValueError) with the
parameter's name in `field` and the reason in `message`, for the CLI and the API (422).
"""

from __future__ import annotations

from controlplane.accounting.reports.base import (
    BUDGET_METRICS,
    COST_GROUPS,
    COST_METRICS,
    REQUEST_GROUPS,
    REQUEST_METRICS,
    THROTTLED_METRICS,
    UTILIZATION_GROUPS,
    UTILIZATION_METRICS,
    Report,
    window,
)
from controlplane.accounting.reports.cost import (
    COST_SOURCES,
    HOURLY_ONLY,
    MAX_EXACT_WINDOW,
    MIN_WINDOW,
    cost_report,
    cost_window,
)
from controlplane.accounting.reports.requests import request_columns, requests_report
from controlplane.accounting.reports.utilization import utilization_report

__all__ = [
    "BUDGET_METRICS",
    "COST_GROUPS",
    "COST_METRICS",
    "COST_SOURCES",
    "HOURLY_ONLY",
    "MAX_EXACT_WINDOW",
    "MIN_WINDOW",
    "REQUEST_GROUPS",
    "REQUEST_METRICS",
    "THROTTLED_METRICS",
    "UTILIZATION_GROUPS",
    "UTILIZATION_METRICS",
    "Report",
    "cost_report",
    "cost_window",
    "request_columns",
    "requests_report",
    "utilization_report",
    "window",
]
