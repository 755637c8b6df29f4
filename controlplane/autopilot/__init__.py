"""The SLO autopilot: `policy` (the pure decision: window figures, knobs, bounds and targets
in; a change or a hold, with its reason, out) and `runner` (the daemon's job that measures the
window, asks the policy and applies its change through the audited live-config path)."""
