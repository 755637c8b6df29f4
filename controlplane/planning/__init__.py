"""Capacity planning from our own records (issue 57): a window of request rows (window.py) as
a workload (workload.py), driven again through an engine built from a proposed config
(replay.py) and judged side by side with what was recorded (summary.py); `controlplane replay`
(cli.py). docs/planning.md says what a replay reproduces and what it cannot."""
