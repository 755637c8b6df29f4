"""The demo checkpoint: layout, determinism, early return, and that transformers loads it."""

import hashlib
import json
import time

import pytest

from controlplane.engine.demo_model import SIZES, num_parameters, write_demo_model
from controlplane.engine.tokenizer import Tokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _hashes(path):
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file()
    }


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("tiny-demo") / "model", size="tiny")


def test_tiny_files_and_config(tiny_dir):
    for name in FILES:
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    spec = SIZES["tiny"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["rope_theta"] == 10000
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 2048
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert config[key] == spec[key]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)

    tok = Tokenizer.from_dir(tiny_dir)
    assert config["vocab_size"] >= tok.vocab_size
    assert config["bos_token_id"] == tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert config["eos_token_id"] == tok.token_to_id("<|eot_id|>")
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {
        tok.token_to_id("<|end_of_text|>"),
        tok.token_to_id("<|eot_id|>"),
    }
    tok_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is True
    assert tok_config["bos_token"] == "<|begin_of_text|>"
    assert tok_config["eos_token"] == "<|eot_id|>"


def test_tiny_is_fast(tmp_path):
    import torch  # noqa: F401  (import time is not part of writing the model)

    start = time.perf_counter()
    write_demo_model(tmp_path / "fast", size="tiny")
    # About 0.2 s here; the brief's budget is 2 s, doubled against slow CI machines.
    assert time.perf_counter() - start < 4


def test_tokenizer_is_trained_byte_level_bpe(tiny_dir):
    data = json.loads((tiny_dir / "tokenizer.json").read_text())
    assert data["model"]["type"] == "BPE"
    assert data["pre_tokenizer"]["type"] == "ByteLevel"
    assert data["decoder"]["type"] == "ByteLevel"
    assert len(data["model"]["merges"]) > 500
    special = {t["content"]: t["id"] for t in data["added_tokens"] if t["special"]}
    assert set(special) >= {
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    }
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.vocab_size == SIZES["tiny"]["vocab_size"]
    # Merges learnt from the English-ish corpus make common words a single token.
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    text = "Any text at all: Ünïcödé 🦙 日本語 \x00\x7f"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert prompt == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_weights_layout_and_init(tiny_dir):
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_dir / "model.safetensors"))
    spec = SIZES["tiny"]
    h, inter, vocab = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    kv = spec["num_key_value_heads"] * h // spec["num_attention_heads"]
    expected = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.self_attn.q_proj.weight": (h, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, h),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert sum(v.numel() for v in tensors.values()) == num_parameters("tiny")
    for name, t in tensors.items():
        assert t.dtype == torch.float32
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t))
        else:
            assert abs(t.mean().item()) < 0.005, name
            assert 0.015 < t.std().item() < 0.025, name
    assert not torch.equal(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"])


def test_small_parameter_count_and_dtype():
    assert 50e6 <= num_parameters("small") <= 60e6
    assert SIZES["small"]["torch_dtype"] == "bfloat16"
    assert SIZES["small"]["vocab_size"] == 32000


def test_deterministic(tiny_dir, tmp_path):
    again = write_demo_model(tmp_path / "again", size="tiny")
    first = _hashes(tiny_dir)
    assert set(first) >= set(FILES)
    assert _hashes(again) == first
    other_seed = write_demo_model(tmp_path / "seed1", size="tiny", seed=1)
    hashes = _hashes(other_seed)
    assert hashes["model.safetensors"] != first["model.safetensors"]
    assert hashes["tokenizer.json"] == first["tokenizer.json"]


def test_existing_complete_model_is_not_rewritten(tmp_path):
    path = write_demo_model(tmp_path / "m", size="tiny")
    mtimes = {f.name: f.stat().st_mtime_ns for f in path.iterdir()}
    time.sleep(0.01)
    assert write_demo_model(path, size="tiny") == path
    assert {f.name: f.stat().st_mtime_ns for f in path.iterdir()} == mtimes

    # A damaged weights file makes it incomplete: it is rewritten.
    weights = path / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    write_demo_model(path, size="tiny")
    assert weights.read_bytes() == good

    # A different seed is a different model: rewritten too.
    write_demo_model(path, size="tiny", seed=3)
    assert weights.read_bytes() != good
    assert not any(p.name.endswith(".tmp") for p in path.iterdir())


def test_unknown_size(tmp_path):
    with pytest.raises(ValueError, match="huge"):
        write_demo_model(tmp_path, size="huge")


def test_transformers_loads_tiny(tiny_dir):
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == 2
    assert sum(p.numel() for p in model.parameters()) == num_parameters("tiny")
    ours = load_file(str(tiny_dir / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(state[name], tensor), name

    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_dir / "tokenizer.json"))
    tok = Tokenizer.from_dir(tiny_dir)
    text = "The model engine 🦙 says héllo."
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text)
    assert hf_tok.decode(ids, skip_special_tokens=True) == text

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), SIZES["tiny"]["vocab_size"])
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_small_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    start = time.perf_counter()
    path = write_demo_model(tmp_path / "small", size="small")
    assert time.perf_counter() - start < 60
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == 32000
    config = transformers.AutoConfig.from_pretrained(str(path))
    assert config.vocab_size == 32000
    assert config.hidden_size == 512
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118 (safe_open is not iterable)
        assert f.get_slice("lm_head.weight").get_dtype() == "BF16"
    assert sum(_prod(shape) for shape in shapes) == num_parameters("small")
    assert 50e6 <= num_parameters("small") <= 60e6


def _prod(dims):
    n = 1
    for d in dims:
        n *= d
    return n


def test_demo_model_cli_writes_a_loadable_checkpoint(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli-tiny"
    r = subprocess.run(
        [sys.executable, "-m", "controlplane", "demo-model", str(out), "--size", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "wrote tiny demo model" in r.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
