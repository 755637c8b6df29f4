"""HTTP plumbing shared by the /v1 and /admin surfaces: `errors` (OpenAI-shaped error bodies),
`auth` (API keys, admin tokens), `signing` (signed fleet requests: no token on the wire),
`body` (JSON body guards), `request_id` (X-Request-Id). Imports neither API package."""
