"""Benchmarks: scripts that print figures, never pass/fail (benchmarks/README.md). Run them from
the repository root as modules: `python -m benchmarks.<name> --help`."""
