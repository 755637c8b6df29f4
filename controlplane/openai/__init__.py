"""The OpenAI-compatible `/v1` surface: `schema` (the request bodies as JSON Schema, and the
fields each endpoint reads), `bodies` (the same bodies as msgspec structs: one strict native
pass), `protocol` (the field-named 400s, the unions and the rules across fields; typed
CompletionRequest and ChatRequest), `tools` (tool calls: the request, the prompt, forced calls,
auto-parsed calls, streaming), `serving` (admission, validation, queueing, the completion and
chat flows), `flight` (the fan-out of prompts and choices into engine requests), `render`
(envelopes, SSE, tool calls in messages and chunks), `responses` (the Responses API) and
`routes` (the /v1 routes; the daemon's whole app is controlplane.asgi)."""
