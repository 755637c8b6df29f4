"""What the daemon says about itself, shared by both APIs and the jobs: `metrics` (the
Prometheus registry, vLLM's names; `scrape` builds what is read at each scrape) and `stats` (windowed figures over recent steps and
requests). Torch-free; imports neither API package."""
