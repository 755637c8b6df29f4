"""Offline batch generation on top of `Engine`."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from controlplane.engine.compiled import CompiledDecode, cache_warm, warm_key
from controlplane.engine.engine import Engine, RequestOutput
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.settings import EngineSettings, decode_row_ceilings

log = logging.getLogger(__name__)


class LLM:
    def __init__(
        self, model: str, settings: EngineSettings | None = None, **overrides: Any
    ) -> None:
        self.engine = Engine(settings, model=str(model), **overrides)
        self._compile_if_warm()

    def _compile_if_warm(self) -> None:
        """`compile = auto` on a CPU: a one-off engine runs eagerly, since a cold compile
        (minutes on a few cores) would seldom pay back in its work; but where inductor's cache
        already holds this model's decode step (a daemon, or an `LLM(compile="on")`, compiled it
        with this cache: TORCHINDUCTOR_CACHE_DIR), compiling takes seconds and each decode step
        is faster, so it does. The C++ wrapper's graphs are tried first (the daemon's)."""
        eng = self.engine
        s = eng.settings
        if s.compile != "auto" or eng.runner.compiled is not None or eng.device.type != "cpu":
            return
        op = eng.runner.backend.graph_op()
        wrappers = {"on": (True,), "off": (False,)}.get(s.compile_cpp_wrapper, (True, False))
        rows = decode_row_ceilings(s)[0]  # as the daemon's engine with these settings
        for cpp_wrapper in wrappers:
            if not cache_warm(warm_key(eng.model, op, cpp_wrapper, rows)):
                continue
            compiled = CompiledDecode(eng.model, op, rows, cpp_wrapper)
            try:
                compiled.warm_up(eng.runner.backend, eng.device)
            except Exception as exc:  # no C++ compiler for inductor, say: eager as before
                log.warning("the decode step's cache is warm but compiling it failed: %s", exc)
                return
            eng.runner.compiled = compiled
            return

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
