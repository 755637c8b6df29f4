"""Tenants (issue 55): API keys managed live (keys.py), per-key limits (limits.py)."""
