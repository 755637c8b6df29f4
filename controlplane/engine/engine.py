"""The engine: add_request / step / abort, live settings and a per-step stats snapshot.

Single-threaded by design: one thread calls `step()`. `update_settings` and `stats` are also
safe to call from other threads (they only swap immutable objects under a lock);
`AsyncEngine` routes add and abort through the step thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Any

import torch

from controlplane.engine.attention import TorchPagedAttention
from controlplane.engine.block_pool import BlockPool
from controlplane.engine.errors import InvalidSettingError
from controlplane.engine.gguf.known import resolve_model_path
from controlplane.engine.kv_cache import KVCache, KVCacheSpec, plan_num_blocks
from controlplane.engine.loader import load_model, load_tokenizer
from controlplane.engine.model.config import load_model_config
from controlplane.engine.model.linear import auto_dtype
from controlplane.engine.model.quant import QuantConfig, memory_use
from controlplane.engine.runner import ModelRunner
from controlplane.engine.sampler import Sampler
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.scheduler import Scheduler, SchedulerOutput
from controlplane.engine.sequence import Sequence
from controlplane.engine.settings import EngineSettings, check, validate_changes
from controlplane.engine.types import RequestMetrics, RequestOutput, StepStats, TokenLogprobs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A failed forward pass fails the requests of that step and the engine goes on; this many
# failed forwards in a row mean the device (not a request) is broken: step() raises, and
# AsyncEngine declares the engine dead.
MAX_CONSECUTIVE_FAILED_STEPS = 3


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidSettingError("device", "cuda requested but torch sees no CUDA device")
    return torch.device(name)


class Engine:
    def __init__(self, settings: EngineSettings | None = None, **overrides: Any) -> None:
        unknown = set(overrides) - set(EngineSettings.field_names())
        if unknown:
            key = sorted(unknown)[0]
            raise InvalidSettingError(
                key, f"unknown setting; known settings: {', '.join(EngineSettings.field_names())}"
            )
        self._settings = check(dataclasses.replace(settings or EngineSettings(), **overrides))
        s = self._settings
        if not s.model:
            raise InvalidSettingError("model", "a model directory is required")
        model_dir = resolve_model_path(s.model)  # a directory, a .gguf file, or an alias
        self.model_config = cfg = load_model_config(model_dir)
        self.device = resolve_device(s.device)
        # Explicit values were validated against DTYPES; "auto" is what this device runs fast.
        if s.dtype == "auto":
            self.dtype, why = auto_dtype(cfg.torch_dtype, self.device)
            log.info("dtype auto: %s (%s)", str(self.dtype).removeprefix("torch."), why)
        else:
            self.dtype = _DTYPES[s.dtype]
        limit = cfg.max_position_embeddings
        if cfg.sliding_window is not None and cfg.sliding_window < limit:
            # Full attention equals sliding-window attention while sequences fit the window.
            log.info("capping max_model_len at the model's sliding window (%d)", cfg.sliding_window)
            limit = cfg.sliding_window
        self.max_model_len = min(s.max_model_len or limit, limit)

        t0 = time.perf_counter()
        self.tokenizer = load_tokenizer(model_dir)
        kind = s.quantization
        if kind == "auto":
            kind = cfg.stored_quantization
            log.info("quantization auto: %s (how the checkpoint stores its linear weights)", kind)
        quant = QuantConfig(kind, s.quantization_group_size, s.quantize_lm_head)
        self.model = load_model(
            model_dir, cfg, self.dtype, self.device, self.max_model_len, s.cpu_weight_packing, quant
        )
        log.info(
            "loaded %s (%s, %.1fM params, %s on %s) in %.2fs",
            model_dir,
            cfg.architecture,
            cfg.num_params / 1e6,
            self.dtype,
            self.device,
            time.perf_counter() - t0,
        )
        spec = KVCacheSpec.for_model(cfg, s.block_size, self.dtype)
        num_blocks, why = plan_num_blocks(
            spec,
            self.device,
            cpu_bytes=s.kv_cache_memory_bytes,
            gpu_fraction=s.gpu_memory_utilization,
            explicit=s.num_kv_blocks,
        )
        if num_blocks < 1:
            raise InvalidSettingError("kv_cache_memory_bytes", f"budget holds no KV block ({why})")
        num_swap = s.swap_space_bytes // spec.bytes_per_block
        log.info("KV cache: %s; swap space: %d blocks", why, num_swap)
        self.kv_cache = KVCache(spec, num_blocks, num_swap, self.device)
        self.memory = memory_use(self.model, spec, num_blocks, kind, self.dtype)
        log.info("memory: %s", self.memory.describe())
        self.block_pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap)
        self.scheduler = Scheduler(s, self.block_pool, self.swap_pool, s.block_size)
        self.runner = ModelRunner(
            self.model, self.kv_cache, TorchPagedAttention(self.kv_cache), self.device
        )
        self.sampler = Sampler(s.seed, self.device)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: EngineSettings | None = None
        self._step = 0
        self._num_finished = 0
        self._failed_steps = 0  # consecutive steps whose forward pass raised
        # Before the first step: all zeros (step 0 is this snapshot, not a step).
        self._stats = StepStats(0, time.time(), 0, 0, 0, 0, num_blocks, 0, 0, 0, 0.0, 0, 0)

    # -- settings -------------------------------------------------------------------------
    @property
    def settings(self) -> EngineSettings:
        """The settings in force (pending changes not yet applied are excluded)."""
        return self._settings

    def update_settings(self, **changes: Any) -> EngineSettings:
        """Validate now, apply at the next step boundary. Raises InvalidSettingError, changing nothing."""
        with self._lock:
            base = self._pending or self._settings
            new = validate_changes(base, changes)
            self._pending = new
        log.info("settings change staged: %s", changes)
        return new

    def _apply_pending(self) -> None:
        with self._lock:
            new, self._pending = self._pending, None
        if new is not None:
            self._settings = new
            self.scheduler.settings = new

    # -- requests -------------------------------------------------------------------------
    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, *, check_params: bool = True
    ) -> None:
        """Raise InvalidSettingError naming the field and the limit; touches no engine state.

        `check_params=False`: `params` was checked when it was built (SamplingParams validates
        in __post_init__) and not mutated since; only the model-dependent checks run."""
        if check_params:  # a Python API user may have changed fields after construction
            params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidSettingError("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidSettingError("prompt", f"token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidSettingError(
                "stop_token_ids", f"token ids must be in [0, {vocab}) (the model's vocabulary)"
            )
        if n >= self.max_model_len:
            raise InvalidSettingError(
                "prompt",
                f"has {n} tokens; the limit is {self.max_model_len - 1} (max_model_len {self.max_model_len} "
                "minus one generated token)",
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidSettingError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len}); at most {self.max_model_len - n} for this prompt",
            )
        blocks = -(-(n + params.max_tokens) // self._settings.block_size)
        if blocks > self.block_pool.num_blocks:
            raise InvalidSettingError(
                "max_tokens",
                f"prompt + max_tokens needs {blocks} KV blocks, the cache has {self.block_pool.num_blocks}",
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        *,
        validated: bool = False,
    ) -> str:
        """Queue a request; InvalidSettingError (naming the field) if it cannot run.

        `validated=True`: the caller ran `validate_request` on exactly these ids and params
        already (the HTTP front does, once, before queueing) and the check is skipped here.
        Python API users (`LLM`, `Engine`, `AsyncEngine`) leave it False and are checked."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidSettingError("prompt", "must not be empty")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        if not validated:
            self.validate_request(prompt_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidSettingError("request_id", f"{request_id!r} is already in flight")
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.torch_seed)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            metrics=RequestMetrics(arrival_time or time.time(), num_prompt_tokens=len(prompt_ids)),
            detokenizer=self.tokenizer.detokenizer(params.skip_special_tokens),
            generator=generator,
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now with reason `abort`; its blocks are free when this returns."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        out = self._finish(seq, "abort", time.time(), [], [])
        # Publish the freed blocks and the removed request now: the next step may be long away
        # (an idle engine takes none). Same step number and per-step figures, new gauges only,
        # so nothing cumulative counts twice (see AsyncEngine._publish_stats).
        self._stats = dataclasses.replace(self._stats, **self._gauges())
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._apply_pending()
        now = time.time()
        sched = self.scheduler.schedule(now)
        outputs: list[RequestOutput] = []
        sampled = 0
        prefill, decode = sched.num_prefill_tokens, sched.num_decode_tokens
        if not sched.is_empty:
            try:
                logits, seqs = self.runner.execute(sched)
            except Exception as exc:
                outputs = self._fail_step(sched, exc)
                seqs, prefill, decode = [], 0, 0  # nothing was computed
            else:
                self._failed_steps = 0
                for item in sched.scheduled:
                    item.seq.num_computed_tokens += item.num_new_tokens
            if seqs:
                tokens, logprobs, errors = self._sample(logits, seqs)
                sampled = len(seqs) - len(errors)
                now = time.time()
                for i, (seq, token, lp) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
                    if i in errors:
                        outputs.append(self._fail(seq, errors[i], now))
                    else:
                        outputs.append(self._append_or_fail(seq, token, lp, now))
        self._step += 1
        self._stats = self._snapshot(prefill, decode, sampled, time.perf_counter() - t0)
        return outputs

    # -- failures: one request's fault ends that request, not the engine --------------------
    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The forward pass raised: no one request is to blame, so every request whose KV this
        step touched fails (its blocks are freed; their contents are unknown) and the engine
        goes on. Call from inside the `except` block (the log takes the traceback from it)."""
        self._failed_steps += 1
        if self._failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise RuntimeError(
                f"{self._failed_steps} consecutive steps failed in the forward pass; last: {exc!r}"
            ) from exc
        hosts = {host for _, host in sched.swap_out}  # swapped out by this step's copy
        failed = [item.seq for item in sched.scheduled]
        failed += [seq for seq in self.scheduler.swapped if hosts & set(seq.swap_table)]
        log.exception(
            "step %d: forward pass failed (%d in a row); failing its requests: %s",
            self._step + 1,
            self._failed_steps,
            ", ".join(seq.request_id for seq in failed),
        )
        now = time.time()
        return [self._fail(seq, f"forward pass failed: {exc!r}", now) for seq in failed]

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[int, str]]:
        """Sample the batch; should that raise, sample row by row so that only the rows that
        fail on their own fail. Returns tokens, logprobs and {row: error message}.

        Failures come from per-row arithmetic (penalties, filters) before any random draw, so
        the retry draws what the batch would have for seeded requests."""
        try:
            tokens, lps = self.sampler(logits, seqs)
            return tokens, lps, {}
        except Exception as exc:
            log.warning("batched sampling failed (%r); sampling row by row", exc)
        tokens: list[int] = [0] * len(seqs)
        lps: list[TokenLogprobs | None] = [None] * len(seqs)
        errors: dict[int, str] = {}
        for i, seq in enumerate(seqs):
            try:
                (tokens[i],), (lps[i],) = self.sampler(logits[i : i + 1], [seq])
            except Exception as exc:
                log.exception("request %s failed in sampling", seq.request_id)
                errors[i] = f"sampling failed: {exc!r}"
        return tokens, lps, errors

    def _append_or_fail(
        self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float
    ) -> RequestOutput:
        try:
            return self._append(seq, token, lp, now)
        except Exception as exc:
            log.exception(
                "request %s failed after sampling (stop checks, detokenizer)", seq.request_id
            )
            return self._fail(seq, f"post-processing failed: {exc!r}", now)

    def _fail(self, seq: Sequence, message: str, now: float) -> RequestOutput:
        """Finish one request with reason `error`, whatever state its failure left it in."""
        seq.finish_reason = "error"
        seq.metrics.finish_time = now
        if self.requests.get(seq.request_id) is seq:  # else it finished before it failed
            self.scheduler.remove(seq)
            del self.requests[seq.request_id]
            self._num_finished += 1
        out = self._output(seq, [], [], now, finished=True)
        out.error = message
        return out

    def _append(
        self, seq: Sequence, token: int, lp: TokenLogprobs | None, now: float
    ) -> RequestOutput:
        p = seq.params
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        seq.append_token(token)
        m.num_output_tokens += 1
        reason = None
        stop_string = False
        if token in p.stop_token_ids or (
            not p.ignore_eos and token in self.tokenizer.eos_token_ids
        ):
            reason = "stop"  # the stop token's text is not part of the output
        else:
            piece = seq.detokenizer.add(token)
            seq.output_text += piece
            if p.stop and self._truncate_at_stop(seq, len(piece)):
                reason, stop_string = "stop", True
        if reason is None and (
            len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            return self._finish(seq, reason, now, [token], [lp], flush=not stop_string)
        return self._output(seq, [token], [lp], now, finished=False)

    @staticmethod
    def _truncate_at_stop(seq: Sequence, new_chars: int) -> bool:
        """Cut the text before the first stop string; only a match touching the new text is new."""
        text = seq.output_text
        start = max(0, len(text) - new_chars - max(len(s) for s in seq.params.stop) + 1)
        hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i != -1]
        if hits:
            seq.output_text = text[: min(hits)]
        return bool(hits)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        now: float,
        new: list[int],
        lps: list[TokenLogprobs | None],
        flush: bool = True,
    ) -> RequestOutput:
        if flush:
            seq.output_text += seq.detokenizer.flush()  # bytes held back for an unfinished char
        seq.finish_reason = reason
        seq.metrics.finish_time = now
        self.scheduler.remove(seq)
        del self.requests[seq.request_id]
        self._num_finished += 1
        return self._output(seq, new, lps, now, finished=True)

    def _output(
        self,
        seq: Sequence,
        new: list[int],
        lps: list[TokenLogprobs | None],
        now: float,
        finished: bool,
    ) -> RequestOutput:
        # Hold back text that could still turn out to be the start of a stop string.
        release = len(seq.output_text)
        if not finished and seq.params.stop:
            release = max(seq.num_emitted_chars, release - max(len(s) for s in seq.params.stop) + 1)
        delta = seq.output_text[seq.num_emitted_chars : release]
        seq.num_emitted_chars = release
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            new_token_ids=new,
            text=seq.output_text[:release],
            delta_text=delta,
            finished=finished,
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            logprobs=lps if seq.params.logprobs is not None else [],
            time=now,
        )

    # -- stats ----------------------------------------------------------------------------
    def _gauges(self) -> dict[str, int]:
        """The point-in-time fields of StepStats (and the cumulative counts read, not summed)."""
        sch = self.scheduler
        return {
            "num_running": len(sch.running),
            "num_waiting": len(sch.waiting),
            "num_swapped": len(sch.swapped),
            "kv_blocks_used": self.block_pool.num_used,
            "kv_blocks_total": self.block_pool.num_blocks,
            "num_preemptions": sch.num_preemptions,
            "num_finished": self._num_finished,
        }

    def _snapshot(self, prefill: int, decode: int, sampled: int, duration: float) -> StepStats:
        last = self._stats
        running = len(self.scheduler.running)
        return StepStats(
            busy_s_total=last.busy_s_total + duration,
            prefill_tokens_total=last.prefill_tokens_total + prefill,
            decode_tokens_total=last.decode_tokens_total + decode,
            running_total=last.running_total + running,
            batched_tokens_total=last.batched_tokens_total + prefill + decode,
            step=self._step,
            time=time.time(),
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            num_sampled_tokens=sampled,
            step_duration=duration,
            **self._gauges(),
        )

    def stats(self) -> StepStats:
        return self._stats
