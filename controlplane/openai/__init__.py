"""The OpenAI-compatible `/v1` surface: `protocol` (the hand parser: every field checked and
named in its 400, typed requests for completions and chat), `tools` (tool calls: the request,
the prompt, forced calls, auto-parsed calls, streaming) and `app` (the routes and serving:
admission, fan-out of prompts and choices, rendering of choices and chunks; it also assembles
the daemon's Litestar app for now)."""
