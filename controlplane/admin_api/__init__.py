"""The operators' control surface: /admin/* (token-protected) and /metrics."""
