"""Clients of a running daemon: `admin` (the admin API over HTTP and SSE, the TUI's and the
fleet's only way in) and `loadgen` (`controlplane loadgen`, an OpenAI-API load generator).
Torch-free."""
