"""Cost accounting, computed from the store: `utilization` (an engine sample from two step
snapshots) and `gpu` (NVML readings), `samples` (writing them), `rollup` (the scheduled hourly
cost rollup), `prune` (retention), `reports` (cost, request and utilization reports in SQL) and
`cli` (`controlplane report`). Torch-free."""
