"""What the daemon hands to the recorder: one plain record per request state change."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

# Longest values of the client-chosen text fields: the API refuses longer ones with a 400 naming
# the field (controlplane.openai.protocol), the schema sizes its columns by them.
MAX_END_USER_CHARS = 256
MAX_X_REQUEST_ID_CHARS = 128


@dataclass(slots=True)
class RequestRecord:
    """A request's state: submitted once when it starts (status "running"), once when it ends.

    The final record carries everything (not a delta): the store upserts by `id`, so a final
    record alone is a complete row.
    """

    id: str
    instance_id: str
    model: str
    endpoint: str  # "completions" | "chat.completions"
    status: str  # running | success | error | aborted | interrupted
    arrival_time: datetime  # aware UTC
    api_key_name: str | None = None
    api_key_hash: str | None = None  # hash_api_key(key), never the key
    finish_reason: str | None = None  # stop | length | abort | error | shutdown ...
    error: str | None = None
    first_token_time: datetime | None = None
    finish_time: datetime | None = None
    queue_time_s: float | None = None
    ttft_s: float | None = None
    mean_itl_s: float | None = None
    e2e_latency_s: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # speculative decoding: proposed for this request
    accepted_draft_tokens: int = 0  # and of those accepted
    end_user: str | None = None  # the request's OpenAI `user` field
    # The HTTP request's X-Request-Id: the client's (not unique: clients may reuse one) or the
    # generated one. Several rows share it when one request carried several prompts.
    x_request_id: str | None = None
    # Structured outputs: what constrained the output (json_schema, json_object, regex,
    # choice, grammar, tools; None: free text) and the grammar's compile time in ms (0.0 when
    # it came from the cache).
    structured: str | None = None
    grammar_compile_ms: float | None = None
    # What it asked for: choices sampled from its prompt, and its max_tokens (None: the model's
    # length). A replay (controlplane.planning) drives them again.
    n: int = 1
    max_tokens: int | None = None

    @property
    def is_final(self) -> bool:
        return self.status != "running"


def hash_api_key(key: str) -> str:
    """The sha256 hex digest of an API key: identifies a key in the store without revealing it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()
