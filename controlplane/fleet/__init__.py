"""Fleets of daemons sharing one database: `registry` (the instances table: register,
heartbeat, members, config drift), `heartbeat` (the daemon's job that keeps its row fresh),
`auth` (fleet requests signed for the instance a row names, never the admin token), `actions`
(two-phase changes, drain and resume across instances) and `cli` (`controlplane fleet`)."""
