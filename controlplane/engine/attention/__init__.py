"""Paged attention over a ragged batch: the backend protocol and its implementations (torch,
which runs anywhere; our CPU kernel; Triton for GPUs)."""
