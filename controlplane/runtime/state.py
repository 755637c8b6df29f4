"""A daemon's state: one vocabulary for /health, /admin, the event stream and the fleet table."""

from __future__ import annotations

from enum import StrEnum


class DaemonState(StrEnum):
    LOADING = "loading"  # the model is loading: alive, not ready
    READY = "ready"  # admitting requests
    DRAINING = "draining"  # finishing what it has, admitting nothing new
    STOPPED = "stopped"  # shut down cleanly
    DEAD = "dead"  # the step loop died: alive no more (a liveness probe restarts it)

    @property
    def fleet_name(self) -> str:
        """How the fleet table (controlplane.fleet.registry) and its views name this state:
        a ready daemon is "serving" there (the name rows and fleet dashboards already carry);
        every other state keeps its name."""
        return "serving" if self is DaemonState.READY else self.value
