"""Alembic migrations of the request store, installed as `controlplane.migrations`.

This directory is mapped onto that package (pyproject.toml, `package-dir`), so the scripts have
one home in the repository and still ship in the wheel; `controlplane.store.migrate` finds
them through the package.
"""
