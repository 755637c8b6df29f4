"""The operators' control surface: the /admin/* routes (token-protected) and /metrics."""
