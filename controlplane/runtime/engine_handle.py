"""The engine handle: the only way the layers above the engine reach it.

They ask it to tokenize, validate and queue a request, for statistics, the live request list,
the KV block map and the model's size; nothing above the engine touches `Engine` or its
tokenizer, block pool or model config directly (tests/test_architecture.py checks it).
`aengine` is None until the daemon has loaded the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from controlplane.errors import FieldError

if TYPE_CHECKING:
    from controlplane.engine import AsyncEngine, RequestStream, SamplingParams
    from controlplane.engine.structured import CompiledGrammar, StructuredOutput
    from controlplane.engine.types import StepStats


class EngineHandle:
    def __init__(self) -> None:
        self.aengine: AsyncEngine | None = None  # set by the daemon once loaded
        # Grammar compiles (structured outputs) run here: off the event loop and the step
        # thread. Two workers: one slow schema does not hold up every other compile.
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    @property
    def _engine(self) -> AsyncEngine:
        if self.aengine is None:
            raise RuntimeError("the engine is not loaded")
        return self.aengine

    @property
    def loaded(self) -> bool:
        return self.aengine is not None

    @property
    def running(self) -> bool:
        """The step loop runs (False before the model loads and once the loop has died)."""
        return self.aengine is not None and self.aengine.is_running

    @property
    def death(self) -> str | None:
        """Why the step loop died (/health says it), None while it runs or before it loads."""
        error = self.aengine.error if self.aengine is not None else None
        return None if error is None else f"{type(error).__name__}: {error}"

    @property
    def max_model_len(self) -> int | None:
        return self.aengine.engine.max_model_len if self.aengine else None

    # -- the /v1 surface: prompts, checks, queueing ---------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self._engine.engine.tokenizer.encode(text)

    @property
    def chat_template(self) -> str:
        """The model's chat template (Jinja text; empty when it has none)."""
        return self._engine.engine.tokenizer.chat_template or ""

    def tokenize_chat(
        self,
        messages: Any,
        add_generation_prompt: bool,
        escape: bool,
        continue_final_message: bool = False,
        **template_vars: Any,
    ) -> list[int]:
        """A chat's prompt tokens (its template); ValueError for messages it cannot render.
        Tools are rendered into the messages and `template_vars` by the /v1 surface
        (controlplane.openai.tools)."""
        tok = self._engine.engine.tokenizer
        return tok.encode_chat(
            messages,
            add_generation_prompt,
            escape=escape,
            continue_final_message=continue_final_message,
            **template_vars,
        )

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs)."""
        return self._engine.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (logprobs' `bytes`): part of a UTF-8 character for some."""
        return self._engine.engine.tokenizer.token_bytes(token_id)

    # -- POST /tokenize, /detokenize --------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Token ids are in [0, vocab_size) (the model's, as prompt token ids are checked)."""
        return self._engine.engine.model_config.vocab_size

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._engine.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens included (what vLLM's /detokenize gives)."""
        return self._engine.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    def tokenizer_info(self) -> dict[str, Any]:
        """What vLLM's GET /tokenizer_info tells a client tokenizing remotely
        (lm-evaluation-harness's `tokenizer_backend=remote`): the special tokens' text and the
        chat template; the ids come from /tokenize."""
        tok = self._engine.engine.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **tok.special_tokens,
            "chat_template": tok.chat_template,
            "model_max_length": self.max_model_len,
        }

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's string of each token (byte-level pieces as they are: `Ġcaf`)."""
        tok = self._engine.engine.tokenizer
        return [tok.id_to_token(t) or "" for t in token_ids]

    def warm_grammars(self) -> None:
        """Build the grammar engine's view of the vocabulary now, in the background (0.4 s for
        SmolLM2's 49k tokens), rather than in the first constrained request."""
        self._grammar_pool.submit(self._engine.engine.grammars.warm)

    async def compile_grammar(self, output: StructuredOutput, timeout_s: float) -> Any:
        """Compile (or find cached) a request's grammar in a worker thread, never on the
        step thread or the event loop. FieldError naming the field when it cannot be
        compiled or takes longer than `timeout_s` (the compile then finishes in the
        background and is cached)."""
        grammars = self._engine.engine.grammars
        hit = grammars.cached(output)
        if hit is not None:
            return hit
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._grammar_pool, grammars.compile, output)
        try:
            return await asyncio.wait_for(asyncio.shield(work), timeout_s)
        except TimeoutError:
            raise FieldError(
                output.field,
                f"compiling its grammar took longer than {timeout_s:g} s "
                "(server.grammar_compile_timeout_s); simplify the schema",
            ) from None

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's checks of one request (FieldError naming the field): run once,
        at the front, before anything is queued."""
        # The /v1 parser built `params` (SamplingParams checks itself as it is built), so only
        # the model-dependent checks run here: each check once per request.
        self._engine.engine.validate_request(prompt_ids, params, check_params=False)

    def add_validated(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        grammar: CompiledGrammar | None = None,
    ) -> RequestStream:
        """Queue a request `validate` has accepted: the engine does not check it again."""
        return self._engine.add_request(
            prompt_ids, params, request_id, validated=True, grammar=grammar
        )

    def abort(self, request_id: str) -> None:
        if self.aengine is not None:
            self.aengine.abort(request_id)

    def is_unfinished(self, request_id: str) -> bool:
        """The engine still holds it (a request that ended may not have its record yet)."""
        return self.aengine is not None and request_id in self.aengine.unfinished_ids()

    # -- visibility -----------------------------------------------------------------------------
    def stats(self) -> StepStats | None:
        """The engine's latest StepStats; None before it loads."""
        return self.aengine.stats() if self.aengine else None

    def recent_steps(self, since_step: int = -1) -> list[StepStats]:
        """The engine's recent StepStats after `since_step`, oldest first (the latest always
        included: AsyncEngine.recent_steps); none before it loads."""
        return self.aengine.recent_steps(since_step) if self.aengine else []

    @property
    def num_unfinished(self) -> int:
        return self.aengine.num_unfinished if self.aengine else 0

    def queue_length(self, max_num_seqs: int, incoming: int = 0) -> int:
        """Requests accepted but not running, `incoming` more included: those waiting at the
        engine's last step, plus those accepted since then (the step's statistics do not show
        them yet) that the free `max_num_seqs` slots cannot take."""
        if self.aengine is None:
            return 0
        s = self.aengine.stats()
        waiting = s.num_waiting + s.num_swapped
        new = max(0, self.aengine.num_unfinished - s.num_running - waiting) + incoming
        if waiting:  # something besides free slots holds requests back (KV blocks, budget)
            return waiting + new
        return max(0, new - max(0, max_num_seqs - s.num_running))

    async def live_requests(self) -> list[dict[str, Any]]:
        return await self.aengine.live_requests() if self.aengine else []

    def kv_block_map(self, buckets: int) -> tuple[list[float], list[float]]:
        """Fraction of KV blocks in use, and of blocks cached but unused (evictable), per range
        of block ids: a compact map of the cache."""
        if self.aengine is None:
            return [], []
        pool = self.aengine.engine.block_pool
        return pool.occupancy(buckets), pool.cached_occupancy(buckets)

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody holds, on the step thread; the blocks dropped."""
        return await self._engine.call(lambda engine: engine.reset_prefix_cache())

    def flops_per_token(self) -> float:
        return self._engine.engine.model_config.flops_per_token()

    def compile_state(self) -> str:
        """The compiled decode step: off | warming | ready | failed (Engine.compile_state)."""
        return self.aengine.engine.compile_state if self.aengine else "off"

    def compiled_max_rows(self) -> int | None:
        """The largest decode step that runs compiled (engine.compile_max_rows resolved at
        start); None without a compiled step."""
        compiled = self.aengine.engine.runner.compiled if self.aengine else None
        return None if compiled is None else compiled.max_rows

    def tensor_parallel(self) -> dict[str, Any] | None:
        """/admin/stats' `tensor_parallel`: the ranks' memory and recent steps; None at one
        rank (or before the model loads)."""
        ranks = self.aengine.engine.rank_stats() if self.aengine else None
        if ranks is None:
            return None
        return {"size": len(ranks), "ranks": [r.as_dict() for r in ranks]}

    def memory(self) -> dict[str, Any] | None:
        return dataclasses.asdict(self.aengine.engine.memory) if self.aengine else None

    def describe_model(self, name: str) -> str:
        """The start-up line's model part: `name`, architecture, dtype, device, KV cache size."""
        eng = self._engine.engine
        kv, bs = eng.block_pool.num_blocks, eng.settings.block_size
        return (
            f"model {name} ({eng.model_config.architecture}, {eng.dtype}, "
            f"{eng.device}), KV cache {kv} blocks x {bs} tokens = {kv * bs} tokens"
        )

    def update_settings(self, **changes: Any) -> None:
        if self.aengine is not None:
            self.aengine.update_settings(**changes)
