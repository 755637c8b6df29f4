"""One field error for the whole daemon (controlplane.errors.FieldError): the config, the
reports, the engine, live config changes and URL checks all raise it, each naming its field."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import create_engine

from controlplane.accounting.reports import cost_report
from controlplane.common import check_url, parse_group_by, parse_time
from controlplane.config import build_config
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.sampling_params import SamplingParams
from controlplane.errors import FieldError
from controlplane.runtime.live_config import ConfigAuditError, ConfigChangeError


def _raised(fn, *args, **kwargs) -> FieldError:
    with pytest.raises(FieldError) as err:
        fn(*args, **kwargs)
    assert str(err.value) == f"{err.value.field}: {err.value.message}"
    return err.value


def test_config_errors_name_the_key() -> None:
    e = _raised(build_config, {"engine": {"max_num_seqs": 0}}, env={})
    assert e.field == "engine.max_num_seqs"
    e = _raised(build_config, {"server": {"advertise_url": "ftp://x"}}, env={})
    assert e.field == "server.advertise_url" and "http" in e.message


def test_report_and_time_errors_name_the_parameter() -> None:
    assert _raised(parse_time, "since", "yesterday-ish").field == "since"
    assert _raised(parse_group_by, "model,colour", ("model", "api_key")).field == "group_by"
    naive = datetime(2026, 1, 1)
    e = _raised(
        cost_report, create_engine("sqlite://"), since=naive, until=datetime.now(UTC), group_by=""
    )
    assert e.field == "since"


def test_engine_and_live_config_errors_are_the_same_kind() -> None:
    # The engine's public name is the same class, not a cousin: except FieldError catches it.
    assert InvalidSettingError is FieldError
    assert _raised(SamplingParams, temperature=-1.0).field == "temperature"
    assert issubclass(ConfigChangeError, FieldError) and issubclass(ConfigAuditError, FieldError)
    assert _raised(check_url, "http://u:p@host", "fleet.url").field == "fleet.url"


def test_the_store_handle_reads_only_once_open(tmp_path) -> None:
    import asyncio

    from sqlalchemy import text

    from controlplane.runtime.store_handle import StoreHandle, StoreNotOpenError

    def one(db) -> int:
        with db.connect() as conn:
            return conn.execute(text("select 1")).scalar_one()

    store = StoreHandle()
    with pytest.raises(StoreNotOpenError):
        asyncio.run(store.read(one))
    store.db = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    assert store.is_open and asyncio.run(store.read(one)) == 1
