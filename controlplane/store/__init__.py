"""The SQL request store, persistence only: schema, migrations, price history, the batched
recorder and its journal, the configuration audit log and the admin API's read queries. What is
computed from it (utilization samples, cost rollups, reports) lives in controlplane.accounting.

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
from controlplane.store.recorder import Recorder
from controlplane.store.records import RequestRecord, hash_api_key
from controlplane.store.recovery import mark_interrupted, replay_journal

__all__ = [
    "CONFIG_SOURCES",
    "FINAL_STATUSES",
    "IDLE_KEY",
    "STATUSES",
    "Base",
    "ConfigChange",
    "ConfigChangeRow",
    "CostRollupRow",
    "GpuSampleRow",
    "JobWatermarkRow",
    "PriceBook",
    "PriceEntry",
    "PriceRow",
    "Recorder",
    "RequestRecord",
    "RequestRow",
    "UTCDateTime",
    "UtilizationSampleRow",
    "check",
    "cost",
    "current",
    "downgrade",
    "hash_api_key",
    "head",
    "history",
    "list_requests",
    "make_engine",
    "mark_interrupted",
    "normalize_url",
    "replay_journal",
    "sync_prices",
    "time_buckets",
    "upgrade",
    "write_changes",
]
