"""The daemon's runtime: the one narrow handle the APIs and jobs receive (`runtime`), live
config with its audited change path (`live_config`), the config file's safe reload
(`config_file`), logging and memory figures. The composition root is controlplane.daemon."""
