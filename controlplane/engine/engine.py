"""The engine: add_request / step / abort, live settings and a per-step stats snapshot.

Single-threaded by design: one thread calls `step()`. `update_settings` and `stats` are also
safe to call from other threads (they only swap immutable objects under a lock);
`AsyncEngine` routes add and abort through the step thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from controlplane.engine.compiled import CompiledDecode, compile_mode
from controlplane.engine.cuda_graphs import (
    CudaGraphDecode,
    Replayer,
    capture_sizes,
    cuda_replayers,
    eager_step,
    graphs_enabled,
)
from controlplane.engine.draft import DraftModel
from controlplane.engine.errors import GrammarFailedError, InvalidSettingError
from controlplane.engine.grammar_mask import MaskBatch, MaskJob
from controlplane.engine.model_runner import ModelRunner
from controlplane.engine.output import finish_text, make_output, merge, take_token
from controlplane.engine.overlap import Overlap, overlap_wanted
from controlplane.engine.parallel.rank import worker_main
from controlplane.engine.parallel.workers import TensorParallelError, Workers
from controlplane.engine.parts import build, make_backend
from controlplane.engine.prompt_logprobs import score as score_prompt
from controlplane.engine.sampler import Sampler
from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.scheduler import Scheduler, SchedulerOutput
from controlplane.engine.sequence import Sequence, SequenceStatus
from controlplane.engine.settings import (
    MAX_SPECULATIVE_TOKENS,
    EngineSettings,
    check,
    decode_row_ceilings,
    validate_changes,
)
from controlplane.engine.spec_decode import propose, verify
from controlplane.engine.structured import CompiledGrammar, Grammars, grammar_failed
from controlplane.engine.types import (
    RankStats,
    RequestMetrics,
    RequestOutput,
    StepStats,
    TokenLogprobs,
)

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILED_STEPS = 3


class Engine:
    def __init__(
        self,
        settings: EngineSettings | None = None,
        *,
        graph_replayers: Callable[[], Replayer] | None = None,
        long_running: bool = False,
        **overrides: Any,
    ) -> None:
        """`graph_replayers` (tests): capture decode steps with these replayers whatever
        `cuda_graphs` says, e.g. `CallAgain` on a CPU (see cuda_graphs.py). `long_running`:
        the engine serves for long (the daemon), so `compile = auto` compiles its decode
        step in the background on a CPU (compiled.compile_mode)."""
        unknown = set(overrides) - set(EngineSettings.field_names())
        if unknown:
            key = sorted(unknown)[0]
            raise InvalidSettingError(
                key, f"unknown setting; known settings: {', '.join(EngineSettings.field_names())}"
            )
        self._settings = check(dataclasses.replace(settings or EngineSettings(), **overrides))
        s = self._settings
        parts = build(s)
        self.model_config = cfg = parts.model_config
        self.device, self.dtype, self.max_model_len = parts.device, parts.dtype, parts.max_model_len
        self.tokenizer, self.model, self.memory = parts.tokenizer, parts.model, parts.memory
        self.kv_cache, self.block_pool, self.swap_pool = (
            parts.kv_cache,
            parts.block_pool,
            parts.swap_pool,
        )
        num_blocks = self.block_pool.num_blocks
        self.scheduler = Scheduler(s, self.block_pool, self.swap_pool, s.block_size)
        self.draft: DraftModel | None = parts.draft
        self.scheduler.draft = self.draft
        backend = make_backend(s.attention_backend, self.kv_cache, self.device, s.bf16_dot)
        log.info("attention: %s", type(backend).__name__)
        self.runner = ModelRunner(self.model, self.kv_cache, backend, self.device)
        if parts.workers is not None:
            assert self.model.tp is not None
            workers = Workers(parts.workers, self.device, worker_main, self.model.tp)
            workers.channel.board.post_memory(
                0, self.memory.weights_bytes, self.memory.kv_cache_bytes
            )
            self.runner.workers = workers
            log.info(
                "tensor parallel: %d ranks; %s",
                s.tensor_parallel_size,
                "; ".join(
                    f"rank {r.rank}: weights {r.weights_bytes / 2**20:.1f} MiB, "
                    f"KV cache {r.kv_cache_bytes / 2**20:.1f} MiB"
                    for r in workers.ranks()
                ),
            )
        # Tensor parallel steps run eagerly for now: a compiled step or a graph would have to
        # capture the layers' collectives (issue 56).
        mode = "off" if parts.workers else compile_mode(s.compile, self.device, long_running)
        compiled_rows, graph_rows = decode_row_ceilings(s)
        # The block the background warm-up writes its dummy K/V into, released by the step
        # thread (the pool's only user) once the warm-up is over.
        self._warm_up_block: list[int] = []
        if mode != "off":
            cpp_wrapper = self.device.type == "cpu" and (
                s.compile_cpp_wrapper == "on"
                or (s.compile_cpp_wrapper == "auto" and mode == "background")
            )
            self.runner.compiled = CompiledDecode(
                self.model, backend.graph_op(), compiled_rows, cpp_wrapper
            )
        graphs = parts.workers is None and (
            graph_replayers is not None
            or graphs_enabled(s.cuda_graphs, self.device, backend, mode == "start")
        )
        if mode == "start":
            # With graphs up to the compiled step's ceiling, steps come in their sizes only.
            only = capture_sizes(graph_rows) if graphs and graph_rows == compiled_rows else ()
            self.runner.compiled.warm_up(self.runner.backend, self.device, only=only)
        elif mode == "background":
            self._warm_up_block = self.block_pool.allocate(1)
            own_backend = make_backend(s.attention_backend, self.kv_cache, self.device, s.bf16_dot)
            self.runner.compiled.warm_up_in_background(
                own_backend, self.device, self._warm_up_block[0]
            )
        if graphs:
            compiled = self.runner.compiled if mode == "start" else None
            self.runner.graphs = CudaGraphDecode(
                compiled or eager_step(self.model),
                backend,  # Triton's: graphs_enabled checks it, tests forcing replayers use it
                graph_rows,
                -(-self.max_model_len // s.block_size),
                self.device,
                graph_replayers or cuda_replayers(),
            )
            self.runner.graphs.capture()
        self.sampler = Sampler(s.seed, self.device)
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, s.grammar_cache_size)
        self.masks = MaskBatch(cfg.vocab_size)
        # Structured outputs: live grammar states (one per constrained choice), and cumulative
        # mask work: seconds computing and applying masks, seconds the step waited for the
        # worker after the forward, steps that had constrained rows.
        self._grammar_states = 0
        self._mask_s = self._mask_wait_s = 0.0
        self._mask_steps = 0
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: EngineSettings | None = None
        self._step = 0
        self._num_finished = 0
        self._failed_steps = 0  # consecutive steps whose forward pass raised
        # Speculative decoding counters (see StepStats) and state: off | active | paused.
        self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
        self._spec_per_pos = [0] * MAX_SPECULATIVE_TOKENS
        self._speculation = "off"
        self._drafted: list[Sequence] = []  # sequences the draft model proposed for this step
        self._overlap = Overlap(self)  # asynchronous scheduling (engine.async_scheduling)
        # Before the first step: all zeros (step 0 is this snapshot, not a step).
        self._stats = StepStats(0, time.time(), 0, 0, 0, 0, num_blocks, 0, 0, 0, 0.0, 0, 0)

    @property
    def _async(self) -> bool:
        return overlap_wanted(self._settings.async_scheduling, self.device)

    def close(self) -> None:
        """Finish the step in flight and stop the device queue's thread (if one started), then
        the tensor-parallel workers (if any; a group that lost a rank has nothing to finish)."""
        try:
            with contextlib.suppress(TensorParallelError):
                self._overlap.drain()
        finally:
            self._overlap.close()
            if self.runner.workers is not None:
                self.runner.workers.close()

    def rank_stats(self) -> list[RankStats] | None:
        """Each tensor-parallel rank's memory and recent step times; None without TP."""
        workers = self.runner.workers
        return None if workers is None else workers.ranks()

    def check_ranks(self) -> None:
        """TensorParallelError naming a tensor-parallel worker that is gone; the step loop
        calls it between steps, so a worker lost while the engine is idle stops it too."""
        if self.runner.workers is not None:
            self.runner.workers.check()

    @property
    def compile_state(self) -> str:
        """The compiled decode step: off | warming (background: steps run eagerly) | ready |
        failed (the warm-up raised; eager for good)."""
        compiled = self.runner.compiled
        return "off" if compiled is None else compiled.state

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
        compiled = self.runner.compiled
        if (
            "max_num_seqs" in changes
            and compiled is not None
            and new.max_num_seqs > compiled.max_rows
        ):
            log.warning(
                "max_num_seqs %d is above the compiled decode step's %d rows "
                "(engine.compile_max_rows, restart-only): decode steps of more rows run eagerly",
                new.max_num_seqs,
                compiled.max_rows,
            )
        return new

    def _apply_pending(self) -> None:
        with self._lock:
            new, self._pending = self._pending, None
        if new is not None:
            self._settings = new
            self.scheduler.settings = new
            self.block_pool.enable_caching = new.enable_prefix_caching
            self.grammars.capacity = new.grammar_cache_size

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
        if params.n > self._settings.max_num_seqs:
            raise InvalidSettingError(
                "n",
                f"{params.n} choices need {params.n} batch slots; max_num_seqs is "
                f"{self._settings.max_num_seqs}",
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
        grammar: CompiledGrammar | None = None,
    ) -> str:
        """Queue a request; InvalidSettingError (naming the field) if it cannot run.

        `validated=True`: the caller ran `validate_request` on exactly these ids and params
        already (the HTTP front does, once, before queueing) and the check is skipped here.
        Python API users (`LLM`, `Engine`, `AsyncEngine`) leave it False and are checked.
        `grammar`: params.structured compiled already (the HTTP front compiles off the step
        thread); else it is compiled here, or found in the cache."""
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
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)
        metrics = RequestMetrics(arrival_time or time.time(), num_prompt_tokens=len(prompt_ids))
        group: list[Sequence] = []  # the request's choices; one unless params.n > 1
        for index in range(params.n):
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.choice_seed(index))
            group.append(
                Sequence(
                    request_id=request_id,
                    prompt_token_ids=prompt_ids,
                    params=params,
                    metrics=metrics,  # shared: output tokens are summed over the choices
                    detokenizer=self.tokenizer.detokenizer(params.skip_special_tokens),
                    generator=generator,
                    index=index,
                    status=SequenceStatus.PENDING,
                )
            )
        for seq in group:
            seq.group = group
            if grammar is not None:  # one grammar state per choice
                seq.matcher = grammar.new_state()
                self._grammar_states += 1
        self.requests[request_id] = group[0]
        self._overlap.num_special += Overlap.special(params)
        self.scheduler.add(group[0])
        return request_id

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish a request now with reason `abort` (one output per unfinished choice); its
        blocks are free when this returns. [] for an unknown or finished request."""
        seq = self.requests.get(request_id)
        if seq is None:
            return []
        now = time.time()
        out = [self._finish(c, "abort", now, [], []) for c in self._unfinished(seq)]
        # Publish the freed blocks and the removed request now: the next step may be long away
        # (an idle engine takes none). Same step number and per-step figures, new gauges only,
        # so nothing cumulative counts twice (see AsyncEngine._publish_stats).
        self._stats = dataclasses.replace(self._stats, **self._gauges())
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody holds; returns how many. Step thread only."""
        dropped = self.block_pool.reset()
        for seq in self.scheduler.running:
            seq.num_registered_blocks = 0  # their blocks forgot their hashes
        log.info("prefix cache reset: %d cached blocks dropped", dropped)
        self._stats = dataclasses.replace(self._stats, **self._gauges())
        return dropped

    @staticmethod
    def _unfinished(seq: Sequence) -> list[Sequence]:
        return [c for c in seq.group if c.status is not SequenceStatus.FINISHED]

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._warm_up_block and self.compile_state in ("ready", "failed"):
            self.block_pool.release(self._warm_up_block)
            self._warm_up_block = []
        self._apply_pending()
        why = self._overlap.blocked() if self._async else "off"
        if why is None:
            outputs, launched, sampled = self._overlap.step()
            self._step += 1
            work = (
                (
                    launched.num_prefill_tokens,
                    launched.num_decode_tokens,
                    launched.num_context_tokens,
                )
                if launched
                else (0, 0, 0)
            )
            self._stats = self._snapshot(*work, sampled, time.perf_counter() - t0)
            return outputs
        # Synchronous: the step in flight (asynchronous scheduling) ends first.
        if why != "off":
            self._overlap.synchronous[why] += 1
        outputs = self._overlap.drain()
        self._propose()
        now = time.time()
        sched = self.scheduler.schedule(now)
        sampled = 0
        prefill, decode, context = (
            sched.num_prefill_tokens,
            sched.num_decode_tokens,
            sched.num_context_tokens,
        )
        if not sched.is_empty:
            job = self._start_masks(sched)  # computed while the forward runs
            try:
                logits, seqs = self.runner.execute(sched)
            except Exception as exc:
                self.masks.finish(job)  # the worker must be done with the matchers
                outputs += self._fail_step(sched, exc)
                prefill, decode, context = 0, 0, 0  # nothing was computed
            else:
                try:
                    sampled = self._after_forward(sched, logits, seqs, job, outputs)
                    self._failed_steps = 0
                except Exception as exc:  # a defect, not one request's fault: fail the step
                    self.masks.finish(job)
                    outputs += self._fail_step(sched, exc, "processing its logits")
        if self.draft is not None:
            for seq in self._drafted:
                # Verified or not (the scheduler may drop drafts), the draft's KV is valid
                # only up to the tokens that were kept.
                if seq.status is not SequenceStatus.FINISHED:
                    self.draft.rollback(seq)
        self._drafted = []
        self._step += 1
        self._stats = self._snapshot(prefill, decode, context, sampled, time.perf_counter() - t0)
        return outputs

    def _after_forward(
        self,
        sched: SchedulerOutput,
        logits: torch.Tensor,
        seqs: list[Sequence],
        job: MaskJob,
        outputs: list[RequestOutput],
    ) -> int:
        """Mask, fork, sample and verify this step's rows; appends to `outputs` as it goes
        (so a failure part-way loses none). Returns the tokens sampled.

        The row layout is fixed once, here: (sequence, first row, drafts), from the drafts the
        forward pass was given. Nothing after this point recomputes it from the sequences,
        whose drafts and fork state change while the step is processed."""
        # The uncommon rows, looked for in one pass: a speculating sequence (1 + k rows), a
        # choice 0 about to fork its choices, a request that only scores (max_tokens 0).
        uncommon = any(
            s.draft_token_ids or s.params.max_tokens == 0 or (len(s.group) > 1 and s.awaits_fork)
            for s in seqs
        )
        rows = self._row_layout(seqs) if uncommon else []
        if (n := sum(1 + k for _, _, k in rows) if uncommon else len(seqs)) != len(logits):
            raise RuntimeError(f"{len(logits)} logits rows for {n} scheduled rows")
        for seq, lo, rows_logits in self.runner.prompt_logits:
            score_prompt(seq, lo, rows_logits)
        self.runner.prompt_logits = []
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if not item.seq.draft_token_ids:  # else once verified (see _verify)
                self.scheduler.cache_blocks(item.seq)
        if job.rows:
            outputs += self._apply_masks(logits, job)
        plain, plain_logits = seqs, logits  # the rows that sample one token each
        if uncommon:
            # After masking: forked choices copy choice 0's masked row (equal states).
            logits, rows = self._fork(logits, rows)
            at_rows = [(seq, at) for seq, at, k in rows if not k]
            if any(seq.params.max_tokens == 0 for seq, _ in at_rows):
                # Scoring only (max_tokens 0): the prompt is computed and scored, nothing sampled.
                now = time.time()
                for seq, _ in at_rows:
                    if seq.params.max_tokens == 0 and seq.status is not SequenceStatus.FINISHED:
                        outputs.append(self._finish(seq, "length", now, [], []))
                at_rows = [(seq, at) for seq, at in at_rows if seq.params.max_tokens != 0]
            plain = [seq for seq, _ in at_rows]
            plain_logits = (
                logits if len(at_rows) == len(logits) else logits[[at for _, at in at_rows]]
            )
        tokens, logprobs, errors = self._sample(plain_logits, plain) if plain else ([], [], {})
        sampled = len(plain) - len(errors)
        now = time.time()
        finished = SequenceStatus.FINISHED
        self._take(plain, tokens, logprobs, now, outputs, errors)
        for seq, at, k in rows:
            if k and seq.status is not finished:
                new = self._verify(seq, logits[at : at + k + 1], now)
                sampled += len(new[-1].new_token_ids) if new else 0
                outputs += new
        return sampled

    # -- structured outputs ---------------------------------------------------------------------
    def _start_masks(self, sched: SchedulerOutput) -> MaskJob:
        """Hand this step's constrained sampling rows to the mask worker."""
        if not self._grammar_states:  # no constrained request: nothing to look through
            return self.masks.start([], 0)
        rows: list[tuple[Sequence, int]] = []
        at = 0
        for seq in ModelRunner.sampling_sequences(sched):
            if seq.matcher is not None:
                rows.append((seq, at))
            at += 1 + len(seq.draft_token_ids)
        return self.masks.start(rows, at)

    def _apply_masks(self, logits: torch.Tensor, job: MaskJob) -> list[RequestOutput]:
        """Wait for the masks and apply them; a sequence whose grammar failed fails."""
        self._mask_wait_s += self.masks.finish(job)
        self._mask_s += job.compute_s
        self._mask_steps += 1
        rows: list[int] = []
        outputs: list[RequestOutput] = []
        now = time.time()
        for seq, at in job.rows:
            error = job.errors.get(id(seq))
            if isinstance(error, GrammarFailedError):
                outputs += self._fail(seq, error.message, now, param=error.field)
            elif error is not None:  # the mask worker failed
                outputs += self._fail(seq, str(error), now)
            else:
                rows += range(at, at + 1 + len(seq.draft_token_ids))
        t0 = time.perf_counter()
        self.masks.apply(logits, job, rows)
        self._mask_s += time.perf_counter() - t0
        return outputs

    def _fork(
        self, logits: torch.Tensor, rows: list[tuple[Sequence, int, int]]
    ) -> tuple[torch.Tensor, list[tuple[Sequence, int, int]]]:
        """Parallel sampling: a choice 0 about to sample its first token forks its pending
        choices, which sample from the same logits row (each with its own generator)."""
        if not any(seq.awaits_fork for seq, _, _ in rows):
            return logits, rows
        index: list[int] = []
        out: list[tuple[Sequence, int, int]] = []
        for seq, at, k in rows:
            group = [seq, *self.scheduler.fork(seq)] if seq.awaits_fork else [seq]
            for member in group:
                out.append((member, len(index), k))
                index += range(at, at + 1 + k)
        return logits[index], out

    @staticmethod
    def _row_layout(seqs: list[Sequence]) -> list[tuple[Sequence, int, int]]:
        """(sequence, first logits row, draft tokens) per sequence: a speculating one has
        1 + k rows."""
        rows, at = [], 0
        for seq in seqs:
            k = len(seq.draft_token_ids)
            rows.append((seq, at, k))
            at += 1 + k
        return rows

    # -- speculative decoding -----------------------------------------------------------------
    def _propose(self) -> None:
        self._speculation, drafted = propose(
            self.scheduler.running, self._settings, self.max_model_len, self.draft, self.sampler
        )
        if drafted:
            self._drafted = drafted

    def _verify(self, seq: Sequence, rows: torch.Tensor, now: float) -> list[RequestOutput]:
        """Accept or reject seq's draft tokens against the target's rows, emit the accepted
        ones and the target's next token, and roll the KV back past the rejected ones."""
        drafts = seq.draft_token_ids
        k = len(drafts)
        seq.num_computed_tokens -= k  # the drafts' K/V counts only once accepted
        try:
            tokens, lps = verify(rows, seq, drafts, seq.draft_probs, self.sampler.generator)
        except Exception as exc:
            log.exception("request %s failed in speculative verification", seq.request_id)
            return self._fail(seq, f"verification failed: {exc!r}", now)
        finally:
            seq.draft_token_ids, seq.draft_probs = [], None
        accepted = len(tokens) - 1  # the drafts accepted, then the target's own token
        self._spec_drafts += 1
        self._spec_draft_tokens += k
        self._spec_accepted += accepted
        for pos in range(accepted):
            self._spec_per_pos[pos] += 1
        seq.metrics.num_draft_tokens += k
        seq.metrics.num_accepted_tokens += accepted
        outs: list[RequestOutput] = []
        # A stop inside the accepted run ends the sequence there (_take skips the rest).
        self._take([seq] * len(tokens), tokens, lps, now, outs)
        if seq.status is not SequenceStatus.FINISHED:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.scheduler.trim(seq)
            self.scheduler.cache_blocks(seq)
        mine = [o for o in outs if o.index == seq.index]  # a failure also ends the siblings
        return [o for o in outs if o.index != seq.index] + ([merge(mine)] if mine else [])

    # -- failures: one request's fault ends that request, not the engine --------------------
    def _fail_step(
        self, sched: SchedulerOutput, exc: Exception, phase: str = "the forward pass"
    ) -> list[RequestOutput]:
        """The step raised in `phase` with no one request to blame, so every request whose KV
        this step touched fails (its blocks are freed; their contents are unknown) and the
        engine goes on. Call from inside the `except` block (the log takes the traceback).

        Tensor parallel: a failed step leaves the group's collectives out of step, so the
        engine cannot go on: the failure (naming the rank to blame) stops it."""
        if self.runner.workers is not None:
            raise self.runner.workers.failure(exc) from exc
        self._failed_steps += 1
        if self._failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise RuntimeError(
                f"{self._failed_steps} consecutive steps failed in {phase}; last: {exc!r}"
            ) from exc
        hosts = {host for _, host in sched.swap_out}  # swapped out by this step's copy
        failed = [item.seq for item in sched.scheduled]
        failed += [seq for seq in self.scheduler.swapped if hosts & set(seq.swap_table)]
        log.exception(
            "step %d: %s failed (%d in a row); failing its requests: %s",
            self._step + 1,
            phase,
            self._failed_steps,
            ", ".join(seq.request_id for seq in failed),
        )
        now = time.time()
        outputs: list[RequestOutput] = []
        for seq in failed:
            if seq.status is not SequenceStatus.FINISHED:
                outputs += self._fail(seq, f"{phase} failed: {exc!r}", now)
        return outputs

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

    def _take(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        lps: list[TokenLogprobs | None],
        now: float,
        outputs: list[RequestOutput],
        errors: dict[int, str] | None = None,
    ) -> None:
        """Take each row's sampled token (`errors`: rows whose sampling failed): append it,
        detokenize it, check the stop conditions, and put the row's output (or its request's
        failure) onto `outputs`. A row whose sequence has finished is skipped (a sibling's
        failure, or a stop earlier in a speculated run). The one loop of the synchronous
        step, speculation's verification and the overlapped step."""
        finished = SequenceStatus.FINISHED
        eos_token_ids, max_model_len = self.tokenizer.eos_token_ids, self.max_model_len
        for j, seq in enumerate(seqs):
            if seq.status is finished:
                continue
            if errors and j in errors:
                outputs += self._fail(seq, errors[j], now)
                continue
            token, lp = tokens[j], lps[j]
            try:
                # Before the token is taken: a token the grammar refuses is not output.
                matcher = seq.matcher
                if matcher is not None and not matcher.consume_token(token):
                    raise grammar_failed(seq.params.structured, matcher, len(seq.output_token_ids))
                reason, flush = take_token(seq, token, lp, now, eos_token_ids, max_model_len)
                if reason is None:
                    outputs.append(make_output(seq, [token], [lp], now, False))
                else:
                    outputs.append(self._finish(seq, reason, now, [token], [lp], flush))
            except GrammarFailedError as exc:  # the request's grammar, not the engine, failed
                log.warning("request %s: %s", seq.request_id, exc)
                outputs += self._fail(seq, exc.message, now, param=exc.field)
            except Exception as exc:
                log.exception(
                    "request %s failed after sampling (stop checks, detokenizer)",
                    seq.request_id,
                )
                outputs += self._fail(seq, f"post-processing failed: {exc!r}", now)

    def _fail(
        self, seq: Sequence, message: str, now: float, param: str | None = None
    ) -> list[RequestOutput]:
        """Finish seq's request (every unfinished choice) with reason `error`, whatever state
        its failure left it in; `param`: the request field at fault, if the request's own."""
        outputs = []
        for c in self._unfinished(seq) or [seq]:  # [seq]: it finished before it failed
            c.finish_reason = "error"
            c.metrics.finish_time = now
            if c.status is not SequenceStatus.FINISHED:
                self._end(c)
            out = make_output(c, [], [], now, finished=True)
            out.error, out.error_param = message, param
            outputs.append(out)
        return outputs

    def _end(self, seq: Sequence) -> None:
        """Take one choice out of the scheduler; the request ends with its last choice."""
        self.scheduler.remove(seq)
        if seq.matcher is not None:
            seq.matcher = None  # the grammar state goes with the sequence
            self._grammar_states -= 1
        if not self._unfinished(seq):
            del self.requests[seq.request_id]
            self._num_finished += 1
            self._overlap.num_special -= Overlap.special(seq.params)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        now: float,
        new: list[int],
        lps: list[TokenLogprobs | None],
        flush: bool = True,
    ) -> RequestOutput:
        finish_text(seq, flush)
        seq.finish_reason = reason
        seq.metrics.finish_time = now
        self._end(seq)
        return make_output(seq, new, lps, now, finished=True)

    # -- stats ----------------------------------------------------------------------------
    def _gauges(self) -> dict[str, Any]:
        """The point-in-time fields of StepStats (and the cumulative counts read, not summed)."""
        sch = self.scheduler
        return {
            "num_running": len(sch.running),
            "num_waiting": len(sch.waiting),
            "num_swapped": len(sch.swapped),
            "oldest_waiting_arrival": min(
                (q.metrics.arrival_time for q in (*sch.waiting, *sch.swapped)), default=None
            ),
            "kv_blocks_used": self.block_pool.num_used,
            "kv_blocks_total": self.block_pool.num_blocks,
            "num_preemptions": sch.num_preemptions,
            "num_finished": self._num_finished,
            "prefix_cache_queries_total": sch.num_cache_queries,
            "prefix_cache_hits_total": sch.num_cache_hits,
            "prefix_cache_evictions_total": self.block_pool.num_evictions,
            "kv_blocks_cached": self.block_pool.num_cached,
            "kv_blocks_evictable": self.block_pool.num_evictable,
            "spec_decode_num_drafts_total": self._spec_drafts,
            "spec_decode_num_draft_tokens_total": self._spec_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self._spec_accepted,
            "spec_decode_accepted_per_pos": tuple(
                self._spec_per_pos[: self._settings.speculative_num_tokens]
            ),
            "speculation": self._speculation,
            "grammar_states": self._grammar_states,
            "grammar_compiles_total": self.grammars.stats.compiles,
            "grammar_cache_hits_total": self.grammars.stats.cache_hits,
            "grammar_mask_s_total": self._mask_s,
            "grammar_mask_wait_s_total": self._mask_wait_s,
            "grammar_mask_steps_total": self._mask_steps,
            "async_steps_total": self._overlap.steps,
        }

    def _snapshot(
        self, prefill: int, decode: int, context: int, sampled: int, duration: float
    ) -> StepStats:
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
            num_context_tokens=context,
            num_sampled_tokens=sampled,
            step_duration=duration,
            **self._gauges(),
        )

    def stats(self) -> StepStats:
        return self._stats
