"""GGUF checkpoints: llama.cpp's single-file format (metadata, tokenizer and tensors in one file).

- `known`: torch-free model aliases (`smollm2`) and served names; the CLI and config use it.
- `file`: open a `.gguf` once (`open_gguf`), its metadata as plain values and its tensors as
  raw blocks (`GGUFTensor`), with errors that name the file and the tensor.
- `weights`: map tensors onto `CausalLM` parameter names (undoing llama.cpp's Q/K RoPE
  permutation) and dequantize them (`dequantize`).
- `tokenizer`: a `tokenizers` BPE tokenizer and our `Tokenizer` from `tokenizer.ggml.*`.

Submodules are imported explicitly; this package itself imports nothing heavy.
"""
