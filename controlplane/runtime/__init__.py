"""The daemon's runtime: the one narrow handle the APIs and jobs receive (`runtime.Runtime`),
a container of narrow parts: the engine handle (`engine_handle`), the request ledger (`ledger`),
live config with its audited change path (`live_config`; the config file's safe reload in
`config_file`), the event stream (`events`) and the daemon's state (`state`); plus logging and
memory figures. The composition root that builds it is controlplane.daemon."""
