"""Drills: a real daemon put through what production does to it, ending with PASS/FAIL checks.
Run them from the repository root as modules: `python -m drills.<name> --help`; CI runs them
through tests/daemon/test_drills.py (`python -m pytest -m drill`)."""
