"""Clients of a running daemon: `admin` (the admin API over HTTP and SSE, the TUI's and the
fleet's only way in; `token`: where its token comes from) and `loadgen` (`controlplane
loadgen`, an OpenAI-API load generator). Torch-free."""
