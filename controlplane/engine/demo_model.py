"""A deterministic, randomly initialised Llama checkpoint in Hugging Face format.

`write_demo_model(path, size)` writes config.json, generation_config.json, model.safetensors,
tokenizer.json and tokenizer_config.json (with a Llama-3-style chat template), so the engine has a
model to serve without any download. The weights are random, so the text it generates is
gibberish, but every shape, name and file format is that of a real `LlamaForCausalLM`, and
transformers loads it.

The tokenizer is a real byte-level BPE trained with the `tokenizers` library on a synthetic
English-like corpus generated from a fixed seed, so any text round-trips through it. Everything is
deterministic: writing the same size and seed twice gives byte-identical files.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

# Bump when anything written changes, so existing demo directories are rewritten.
FORMAT_VERSION = 1

# Written last: its presence (with matching size, seed, version and file sizes) marks a
# complete demo model, so the daemon can call write_demo_model at every start cheaply.
MARKER_FILE = "controlplane_demo.json"

SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1376,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    },
}

# Size of the synthetic training corpus per model size: (sentences, distinct invented words).
_CORPUS: dict[str, tuple[int, int]] = {
    "small": (60_000, 50_000),
    "tiny": (3_000, 3_000),
}
_CORPUS_SEED = 20240601

BOS_TOKEN = "<|begin_of_text|>"
EOT_TOKEN = "<|eot_id|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
)

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- elif message['content'] is defined %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + content | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def _split(words: str) -> tuple[str, ...]:
    return tuple(words.split())


_COMMON_WORDS = _split(
    "the of and to a in is it you that he was for on are with as I his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been now "
    "find any new work part take get place made live where after back little only round man "
    "year came show every good me give our under name very through just form sentence great "
    "think say help low line differ turn cause much mean before move right boy old too same "
    "tell does set three want air well also play small end put home read hand port large "
    "spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth "
    "father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought city tree cross "
    "farm hard start might story saw far sea draw left late run while press close night real "
    "life few north open seem together next white children begin got walk example ease paper "
    "group always music those both mark often letter until mile river car feet care second "
    "book carry took science eat room friend began idea fish mountain stop once base hear "
    "horse cut sure watch color face wood main enough plain girl usual young ready above ever "
    "red list though feel talk bird soon body dog family direct pose leave song measure door "
    "product black short numeral class wind question happen complete ship area half rock "
    "order fire south problem piece told knew pass since top whole king space heard best hour "
    "better true during hundred five remember step early hold west ground interest reach fast "
    "verb sing listen six table travel less morning ten simple several vowel toward war lay "
    "against pattern slow center love person money serve appear road map rain rule govern "
    "pull cold notice voice unit power town fine certain fly fall lead cry dark machine note "
    "wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green oh quick develop ocean warm free minute strong "
    "special mind behind clear tail produce fact street inch multiply nothing course stay "
    "wheel full force blue object decide surface deep moon island foot system busy test "
    "record boat common gold possible plane stead dry wonder laugh thousand ago ran check "
    "game shape equate miss brought heat snow tire bring yes distant fill east paint language "
    "among model engine token server request answer stream cache memory batch queue latency"
)

# Syllable parts for invented words; "" makes onsets and codas optional.
_ONSETS = (
    "",
    *_split(
        "b c d f g h j k l m n p qu r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl "
        "sm sn sp st str sw th tr wh"
    ),
)
_VOWELS = _split("a e i o u ai ea ee ie oa oo ou y")
_CODAS = ("", "", "", *_split("b ck d ft g l ll m n nd ng nt p r rd rn rt s ss st t th x"))


def num_parameters(size: str) -> int:
    """Parameter count of the demo model of `size`, computed from SIZES."""
    spec = SIZES[size]
    return sum(_numel(shape) for _, shape in _parameter_shapes(spec))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parameter_shapes(spec: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every LlamaForCausalLM parameter, in a fixed order."""
    h = spec["hidden_size"]
    heads = spec["num_attention_heads"]
    kv_heads = spec["num_key_value_heads"]
    head_dim = h // heads
    inter = spec["intermediate_size"]
    vocab = spec["vocab_size"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (heads * head_dim, h)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * head_dim, h)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * head_dim, h)),
            (f"{p}.self_attn.o_proj.weight", (h, heads * head_dim)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return shapes


def _corpus(n_sentences: int, n_words: int, seed: int) -> list[str]:
    """Synthetic English-like lines: common English words plus invented pronounceable ones,
    Zipf-distributed, with capitals, punctuation, numbers and the odd line break."""
    rng = random.Random(seed)
    invented: set[str] = set()
    common = set(_COMMON_WORDS)
    while len(invented) < n_words:
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        if word not in common:
            invented.add(word)
    # Common words first so they are the most frequent; the rest in a seeded order.
    rest = sorted(invented)
    rng.shuffle(rest)
    lexicon = list(dict.fromkeys(_COMMON_WORDS)) + rest
    cum_weights = list(itertools.accumulate(1.0 / (rank + 2) for rank in range(len(lexicon))))
    punct = (".", ".", ".", ".", ",", "?", "!", ";", ":")
    lines = []
    for _ in range(n_sentences):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(3, 18))
        words[0] = words[0].capitalize()
        r = rng.random()
        if r < 0.08:
            words.insert(rng.randrange(len(words)), str(rng.randrange(10_000)))
        elif r < 0.12:
            i = rng.randrange(len(words))
            words[i] = f'"{words[i]}"'
        elif r < 0.16:
            i = rng.randrange(len(words))
            words[i] = words[i].capitalize()
        line = " ".join(words) + rng.choice(punct)
        if rng.random() < 0.1:
            line += "\n"
        lines.append(line)
    return lines


def _train_tokenizer(size: str) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of exactly SIZES[size]['vocab_size'] tokens
    (fewer only if the corpus runs out of merges), with the special tokens at the end of the
    vocabulary as in Llama 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    vocab_size = SIZES[size]["vocab_size"]
    n_sentences, n_words = _CORPUS[size]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # The trainer's result does not depend on its thread count (checked), but keep it serial
    # anyway: it is as fast here and rules out any scheduling effect.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tok.train_from_iterator(_corpus(n_sentences, n_words, _CORPUS_SEED), trainer)
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok


def _random_state_dict(spec: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, spec["torch_dtype"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _parameter_shapes(spec):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
        tensors[name] = t.to(dtype).contiguous()
    return tensors


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _is_complete(path: Path, size: str, seed: int) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict) or (
        marker.get("format_version"),
        marker.get("size"),
        marker.get("seed"),
    ) != (FORMAT_VERSION, size, seed):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, nbytes in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != nbytes:
            return False
    return True


def write_demo_model(path: str | Path, size: str = "small", seed: int = 0) -> Path:
    """Write the demo model of `size` ("small" or "tiny") with weights from `seed` into `path`
    (created if missing) and return `path`. Returns at once if `path` already holds a complete
    demo model of that size and seed; files of other names in `path` are left alone."""
    from safetensors.torch import save_file

    if size not in SIZES:
        raise ValueError(f"size: unknown demo model size {size!r}; choose from {sorted(SIZES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if _is_complete(path, size, seed):
        return path
    (path / MARKER_FILE).unlink(missing_ok=True)

    spec = SIZES[size]
    tok = _train_tokenizer(size)
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    if tok_vocab > spec["vocab_size"]:  # cannot happen: the trainer stops at its target
        raise AssertionError(f"tokenizer has {tok_vocab} tokens > vocab_size {spec['vocab_size']}")
    bos_id = tok.token_to_id(BOS_TOKEN)
    eot_id = tok.token_to_id(EOT_TOKEN)
    end_id = tok.token_to_id(END_OF_TEXT_TOKEN)

    head_dim = spec["hidden_size"] // spec["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": spec["vocab_size"],
        "max_position_embeddings": spec["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eot_id,
        "torch_dtype": spec["torch_dtype"],
    }
    generation_config = {"bos_token_id": bos_id, "eos_token_id": [end_id, eot_id]}
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": spec["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }

    _write_atomic(path / "config.json", _json_bytes(config))
    _write_atomic(path / "generation_config.json", _json_bytes(generation_config))
    _write_atomic(path / "tokenizer_config.json", _json_bytes(tokenizer_config))
    _write_atomic(path / "tokenizer.json", (tok.to_str(pretty=True) + "\n").encode("utf-8"))
    weights_tmp = path / "model.safetensors.tmp"
    save_file(_random_state_dict(spec, seed), str(weights_tmp), metadata={"format": "pt"})
    # safetensors creates the file owner-only; give it the same mode as the JSON files.
    os.chmod(weights_tmp, (path / "config.json").stat().st_mode & 0o777)
    os.replace(weights_tmp, path / "model.safetensors")

    files = {
        name: (path / name).stat().st_size
        for name in (
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        )
    }
    marker = {"format_version": FORMAT_VERSION, "size": size, "seed": seed, "files": files}
    _write_atomic(path / MARKER_FILE, _json_bytes(marker))
    return path
