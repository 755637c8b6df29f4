"""HTTP plumbing shared by the /v1 and /admin surfaces: `errors` (OpenAI-shaped error bodies),
`auth` (API keys, admin tokens, signed fleet requests), `body` (JSON body guards). Imports
neither API package."""
