"""controlplane: an operator-facing control plane for LLM inference."""

__version__ = "0.1.0"
