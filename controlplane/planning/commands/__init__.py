"""The planning commands (docs/planning.md): `controlplane replay`, `calibrate` and `plan`, one
module each over `common` (the window's flags and setup, the error wrapper, progress)."""

from controlplane.planning.commands.calibrate import add_calibrate_parser
from controlplane.planning.commands.plan import add_plan_parser
from controlplane.planning.commands.replay import add_replay_parser

__all__ = ["add_calibrate_parser", "add_plan_parser", "add_replay_parser"]
