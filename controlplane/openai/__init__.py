"""The OpenAI-compatible `/v1` surface: `schema` (the request bodies as JSON Schema, and the
fields each endpoint reads), `protocol` (the hand parser: every field checked and named in its
400; typed CompletionRequest and ChatRequest), `tools` (tool calls: the request, the prompt,
forced calls, auto-parsed calls, streaming), `serving` (admission, validation, queueing, the
completion and chat flows), `flight` (the fan-out of prompts and choices into engine requests),
`render` (envelopes, SSE, tool calls in messages and chunks) and `app` (the /v1 routes; the
daemon's whole app is controlplane.asgi)."""
