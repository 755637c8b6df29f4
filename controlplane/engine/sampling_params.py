"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.engine.errors import InvalidSettingError

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
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
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        def num(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidSettingError(name, f"must be a number, got {value!r}")
            return float(value)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidSettingError(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        if self.max_tokens < 1:
            raise InvalidSettingError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if num("temperature", self.temperature) < 0:
            raise InvalidSettingError("temperature", f"must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidSettingError(
                "top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k!r}"
            )
        if not 0 < num("top_p", self.top_p) <= 1:
            raise InvalidSettingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= num("min_p", self.min_p) <= 1:
            raise InvalidSettingError("min_p", f"must be in [0, 1], got {self.min_p}")
        if num("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidSettingError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= num(name, getattr(self, name)) <= 2:
                raise InvalidSettingError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidSettingError("seed", f"must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidSettingError("stop", "must be non-empty strings")
        if len(self.stop) > 16:
            raise InvalidSettingError("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise InvalidSettingError("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidSettingError(
                "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
