"""Per-request sampling parameters, range-checked so that no request can upset the sampler.

Every numeric field must be finite and in range (see `validate`): a value the sampler cannot
handle (a top_k that overflows int64, a NaN temperature, a seed outside int64) is refused at
admission with an `InvalidSettingError` naming the field and the limit, never met in a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.structured import StructuredOutput

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
# Below this, dividing logits by the temperature overflows float32 to inf (1e-320 is a valid
# JSON number); a tiny temperature means "take the most likely token", so it is served greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # the sampler clamps k to the vocabulary size
# Large enough to forbid any repeat; bounded so that logits x penalty stay finite in float32.
MAX_REPETITION_PENALTY = 1e6
MAX_PENALTY = 2.0  # presence / frequency, OpenAI's range
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, OpenAI's type
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1  # engine-independent bound; validate_request checks the vocabulary
MAX_N = 1024  # engine-side sanity bound; the server's `server.max_n` is the configured limit
MAX_CACHE_SALT_CHARS = 4096  # the server's salt: JSON of a key hash and a cache_salt (256)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # vLLM's `priority`: an int; int32 here
LOWEST_PRIORITY_CLASS = 9  # classes 0 (first) .. 9 (last); a key over a deprioritizing budget


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below MIN_SAMPLING_TEMPERATURE) = greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None  # same seed, same output, whatever else shares the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per token; 0 = only the sampled token's
    # Scoring: the logprob of every prompt token given those before it (the first has none),
    # with top-N alternatives; 0 = only the prompt token's. None: not computed (no cost).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Parallel sampling: this many sequences (choices) from one prompt, sharing its KV blocks.
    # Choice i of a seeded request draws from a generator seeded from (seed, i).
    n: int = 1
    # Structured outputs: the grammar every choice's output must match (None: free text).
    structured: StructuredOutput | None = None
    # Prefix cache partition: requests share cached KV blocks only with requests of the same
    # salt (it enters the first block's hash). None: the shared partition. The server sets it
    # from the API key and the request's `cache_salt` (engine.prefix_cache_isolation).
    cache_salt: str | None = None
    # Scheduling (engine.scheduling_policy, engine/policy.py): vLLM's `priority` (lower runs
    # sooner), and what the server sets from the API key: the tenant (fair shares are per
    # tenant; None: the anonymous one) and its priority class (0 first .. 9 last).
    priority: int = 0
    tenant: str | None = None
    priority_class: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def torch_seed(self) -> int | None:
        """The seed as torch takes it: int64 negatives map onto [2^63, 2^64) (two's complement)."""
        return None if self.seed is None else self.seed % 2**64

    def choice_seed(self, index: int) -> int | None:
        """Choice `index`'s torch seed: choice 0 uses the request's seed (so n=1 and choice 0
        of n>1 draw the same tokens); the others a distinct value mixed from (seed, index)."""
        if self.seed is None:
            return None
        if index == 0:
            return self.torch_seed
        # splitmix64's finaliser: nearby (seed, index) pairs give unrelated seeds.
        z = (self.seed + index * 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    def validate(self) -> None:
        """Raise InvalidSettingError (field, limit) for any value out of range; changes nothing."""
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        # max_tokens 0: score the prompt without generating (only with prompt_logprobs).
        scoring = self.prompt_logprobs is not None
        _int(
            "max_tokens",
            self.max_tokens,
            0 if scoring else 1,
            None,
            what="an integer >= 0" if scoring else "an integer >= 1 (0 only with prompt_logprobs)",
        )
        _float(
            "temperature",
            self.temperature,
            0.0,
            MAX_TEMPERATURE,
            what=f"a finite number >= 0 and <= {MAX_TEMPERATURE:g} "
            f"(0, or below {MIN_SAMPLING_TEMPERATURE:g}: greedy)",
        )
        _int("top_k", self.top_k, -1, MAX_TOP_K, what="-1 or 0 (disabled), or in [1, 2^31-1]")
        _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _float("min_p", self.min_p, 0.0, 1.0)
        _float(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            MAX_REPETITION_PENALTY,
            low_open=True,
        )
        _float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if self.seed is not None:
            _int("seed", self.seed, SEED_MIN, SEED_MAX, what="an int64, in [-2^63, 2^63-1]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidSettingError("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP:
            raise InvalidSettingError(
                "stop", f"at most {MAX_STOP} stop strings, got {len(self.stop)}"
            )
        if not isinstance(self.stop_token_ids, list):
            raise InvalidSettingError("stop_token_ids", "must be a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidSettingError(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, 0, MAX_TOKEN_ID, what="token ids in [0, 2^31-1]")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSettingError(name, f"must be a boolean, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _int("n", self.n, 1, MAX_N)
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise InvalidSettingError(
                "cache_salt",
                f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            )
        _int(
            "priority",
            self.priority,
            PRIORITY_MIN,
            PRIORITY_MAX,
            what="an int32, in [-2^31, 2^31-1]",
        )
        _int("priority_class", self.priority_class, 0, LOWEST_PRIORITY_CLASS)
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise InvalidSettingError("tenant", f"must be a string, got {_show(self.tenant)}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidSettingError("structured", "must be a StructuredOutput")


def _int(name: str, value: object, lo: int, hi: int | None, what: str = "") -> None:
    """An int (not a bool) in [lo, hi]; `what` describes the range when the default won't do."""
    what = what or (f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]")
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or value < lo or (hi is not None and value > hi):
        raise InvalidSettingError(name, f"must be {what}, got {_show(value)}")


def _show(value: object) -> str:
    """repr, short for huge ints (str() refuses ints over 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        sign = "negative " if value < 0 else ""
        return f"a {sign}{abs(value).bit_length()}-bit integer"
    return repr(value)


def _float(
    name: str, value: object, lo: float, hi: float, low_open: bool = False, what: str = ""
) -> None:
    """A finite number in [lo, hi] ((lo, hi] with low_open); NaN and infinities never pass."""
    what = what or f"a finite number in {'(' if low_open else '['}{lo:g}, {hi:g}]"
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    v = float(value) if ok and (isinstance(value, float) or abs(value) < 2**1000) else math.inf
    if not ok or not math.isfinite(v) or v < lo or v > hi or (low_open and v == lo):
        raise InvalidSettingError(name, f"must be {what}, got {_show(value)}")
