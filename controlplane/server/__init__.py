"""The daemon: OpenAI-compatible HTTP API around the engine, with a SQL record of every request."""
