"""Offline batch generation on top of `Engine`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from controlplane.engine.engine import Engine, RequestOutput
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.settings import EngineSettings


class LLM:
    def __init__(
        self, model: str, settings: EngineSettings | None = None, **overrides: Any
    ) -> None:
        self.engine = Engine(settings, model=str(model), **overrides)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Seq[str] | Seq[list[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order (one per choice
        for SamplingParams.n > 1)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts"
            )
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                ids.append(self.engine.add_request(prompt, params))
        except ValueError:
            for request_id in ids:  # a bad prompt fails the whole call, leaving nothing queued
                self.engine.abort(request_id)
            raise
        results: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id].append(out)
                        bar.update(not self.engine.requests.get(out.request_id))
        # A request with n > 1 contributes its n choices, in index order.
        return [o for i in ids for o in sorted(results[i], key=lambda o: o.index)]
