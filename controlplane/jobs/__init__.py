"""The daemon's scheduled jobs (APScheduler): utilization sampling, cost rollups, pruning and
the autopilot's runs, wired in `scheduler`; what they compute lives in controlplane.accounting."""
