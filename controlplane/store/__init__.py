"""The SQL request store: schema, migrations, price history, the batched recorder, the
configuration audit log, the scheduled jobs' samples / cost rollups / pruning, the cost, request
and utilization reports, and the admin API's read queries.

Torch-free: the CLI and the admin API import it without the engine.
"""

from controlplane.store.audit import ConfigChange, history, write_changes
from controlplane.store.db import make_engine, normalize_url
from controlplane.store.migrate import check, current, downgrade, head, upgrade
from controlplane.store.models import (
    CONFIG_SOURCES,
    FINAL_STATUSES,
    IDLE_KEY,
    STATUSES,
    Base,
    ConfigChangeRow,
    CostRollupRow,
    GpuSampleRow,
    JobWatermarkRow,
    PriceEntry,
    RequestRow,
    UTCDateTime,
    UtilizationSampleRow,
    time_buckets,
)
from controlplane.store.prices import PriceBook, PriceRow, cost, sync_prices
from controlplane.store.queries import list_requests
from controlplane.store.recorder import Recorder, mark_interrupted
from controlplane.store.records import RequestRecord, hash_api_key
from controlplane.store.reports import Report, cost_report, requests_report, utilization_report
from controlplane.store.rollup import (
    GpuReading,
    RollupResult,
    UtilizationSample,
    prune,
    run_rollup,
    write_sample,
)

__all__ = [
    "CONFIG_SOURCES",
    "FINAL_STATUSES",
    "IDLE_KEY",
    "STATUSES",
    "Base",
    "ConfigChange",
    "ConfigChangeRow",
    "CostRollupRow",
    "GpuReading",
    "GpuSampleRow",
    "JobWatermarkRow",
    "PriceBook",
    "PriceEntry",
    "PriceRow",
    "Recorder",
    "Report",
    "RequestRecord",
    "RequestRow",
    "RollupResult",
    "UTCDateTime",
    "UtilizationSample",
    "UtilizationSampleRow",
    "check",
    "cost",
    "cost_report",
    "current",
    "downgrade",
    "hash_api_key",
    "head",
    "history",
    "list_requests",
    "make_engine",
    "mark_interrupted",
    "normalize_url",
    "prune",
    "requests_report",
    "run_rollup",
    "sync_prices",
    "time_buckets",
    "upgrade",
    "utilization_report",
    "write_changes",
    "write_sample",
]
