"""The SQL request store: schema, migrations, price history and the batched recorder.

Torch-free: the CLI and the admin API import it without the engine.
"""

from controlplane.store.db import make_engine, normalize_url
from controlplane.store.migrate import check, current, downgrade, head, upgrade
from controlplane.store.models import (
    FINAL_STATUSES,
    STATUSES,
    Base,
    PriceEntry,
    RequestRow,
    UTCDateTime,
    time_buckets,
)
from controlplane.store.prices import PriceBook, PriceRow, cost, sync_prices
from controlplane.store.recorder import Recorder, mark_interrupted
from controlplane.store.records import RequestRecord, hash_api_key

__all__ = [
    "FINAL_STATUSES",
    "STATUSES",
    "Base",
    "PriceBook",
    "PriceEntry",
    "PriceRow",
    "Recorder",
    "RequestRecord",
    "RequestRow",
    "UTCDateTime",
    "check",
    "cost",
    "current",
    "downgrade",
    "hash_api_key",
    "head",
    "make_engine",
    "mark_interrupted",
    "normalize_url",
    "sync_prices",
    "time_buckets",
    "upgrade",
]
