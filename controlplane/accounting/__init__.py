"""Cost accounting, computed from the store: `utilization` (engine samples) and `gpu` (NVML
readings), `rollup` (the scheduled cost and utilization rollups, pruning), `reports` (cost,
request and utilization reports in SQL) and `cli` (`controlplane report`). Torch-free."""
