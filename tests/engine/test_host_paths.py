"""The step's host-side fast paths (issue 54) give what the plain code gave: attention metadata
built from flat arrays, the detokenizer's one-token texts, outputs built by position."""

from __future__ import annotations

import dataclasses
import random
from array import array

import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from controlplane.engine.attention.backend import (
    SeqSpan,
    padded_block_table,
    padded_block_tables,
)
from controlplane.engine.detokenizer import IncrementalDetokenizer
from controlplane.engine.sequence import new_block_table
from controlplane.engine.types import OutputText, RequestOutput

CPU = torch.device("cpu")


def random_spans(rng: random.Random, n: int, block_size: int) -> list[SeqSpan]:
    spans = []
    for _ in range(n):
        ctx = rng.randint(1, 200)
        blocks = -(-ctx // block_size) + rng.randint(0, 2)  # tables may run past the context
        table = rng.sample(range(1000), blocks)
        spans.append(SeqSpan(1, ctx, table))
    return spans


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("held_as", [list, new_block_table])
@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_padded_block_table_is_the_lists_as_a_tensor(rows, held_as, dtype):
    spans = random_spans(random.Random(rows), rows, 16)
    expected = torch.tensor(padded_block_tables(spans, 16), dtype=dtype)
    for s in spans:
        s.block_table = held_as(s.block_table)
    assert torch.equal(padded_block_table(spans, 16, CPU, dtype=dtype), expected)
    wider = padded_block_table(spans, 16, CPU, expected.shape[1] + 3, dtype)
    assert torch.equal(wider[:, : expected.shape[1]], expected) and not wider[:, -3:].any()


def test_the_scheduler_keeps_every_block_table_an_array(tiny_model_dir):
    """A list would still be correct, only slow (a conversion a block id every step): through
    prefix hits, forks (n > 1), swapping and finishing, tables stay arrays."""
    engine = Engine(
        model=str(tiny_model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=4,
        preemption_mode="swap",
        seed=0,
    )
    shared = list(range(5, 17))  # three full blocks: later requests hit them
    for i in range(4):
        params = SamplingParams(max_tokens=12, temperature=0.8, n=2 if i == 1 else 1)
        engine.add_request([*shared, 30 + i], params)
    swapped = 0
    while engine.has_unfinished_requests():
        engine.step()
        sch = engine.scheduler
        swapped += len(sch.swapped)
        for seq in (*sch.running, *sch.waiting, *sch.swapped):
            assert type(seq.block_table) is array, seq.request_id
    assert swapped and sch.num_preemptions, "the cache was never short: nothing was swapped"
    assert engine.stats().prefix_cache_hits_total > 0


class FakeKV:
    class spec:  # stands in for KVSpec
        block_size = 16


def reference_prepare(spans, block_size, ratio):
    """The torch backend's metadata as its plain version built it (before issue 54)."""
    slots = []
    for s in spans:
        slots += [
            s.block_table[p // block_size] * block_size + p % block_size
            for p in range(s.context_len - s.num_new_tokens, s.context_len)
        ]
    decodes = [s for s in spans if s.num_new_tokens == 1]
    buckets, start = [], 0
    while start < len(decodes):
        end = start + 1
        while end < len(decodes) and decodes[end].context_len >= ratio * decodes[start].context_len:
            end += 1
        tables = padded_block_tables(decodes[start:end], block_size)
        lens = torch.tensor([s.context_len for s in decodes[start:end]], dtype=torch.long)
        mask = torch.arange(len(tables[0]) * block_size).unsqueeze(0) < lens.unsqueeze(1)
        buckets.append((start, end, torch.tensor(tables).flatten(), mask[:, None, None, :]))
        start = end
    return torch.tensor(slots, dtype=torch.long), buckets


def test_torch_backend_metadata_matches_the_plain_build():
    from controlplane.engine.attention.torch_paged import TorchPagedAttention

    rng = random.Random(0)
    decodes = sorted(random_spans(rng, 40, 16), key=lambda s: -s.context_len)
    prefills = [SeqSpan(5, 5, [3]), SeqSpan(12, 40, [7, 8, 9])]
    spans = decodes + prefills
    backend = TorchPagedAttention.__new__(TorchPagedAttention)
    backend.kv, backend.block_size = FakeKV(), 16
    meta = backend.prepare(spans, CPU)
    slots, buckets = reference_prepare(spans, 16, backend.BUCKET_RATIO)
    assert torch.equal(meta.slot_mapping, slots)
    assert len(meta.decodes) == len(buckets) > 1
    for got, (start, end, blocks, mask) in zip(meta.decodes, buckets, strict=True):
        assert (got.start, got.end) == (start, end)
        assert torch.equal(got.blocks, blocks)
        assert torch.equal(got.mask, mask)
    assert [(p.start, p.end, p.context_len) for p in meta.prefills] == [(40, 45, 5), (45, 57, 40)]
    assert meta.prefills[0].context_blocks is None
    assert torch.equal(meta.prefills[1].context_blocks, torch.tensor([7, 8, 9]))


class CountingBackend:
    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_decodes_once_a_token_once_it_has_seen_the_tokens(tiny_model_dir):
    from controlplane.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    text = "the quick brown fox jumps over the lazy dog, " * 20
    ids = tok.encode(text, add_special_tokens=False)
    backend = CountingBackend(tok.backend)
    first = IncrementalDetokenizer(backend)
    for i in ids:
        first.add(i)
    assert first.text + first.flush() == tok.decode(ids)
    calls = backend.calls
    second = IncrementalDetokenizer(backend)  # the one-token texts are known by now
    for i in ids:
        second.add(i)
    assert second.text == first.text
    assert backend.calls - calls <= len(ids) + 1 < calls


def test_request_output_fields_keep_the_order_make_output_passes():
    from controlplane.engine import output

    names = tuple(f.name for f in dataclasses.fields(RequestOutput))
    assert names[: len(output._OUTPUT_FIELDS)] == output._OUTPUT_FIELDS


def test_output_text_reads_as_the_joined_string_did():
    """OutputText (pieces, never the whole text copied a token) against a plain string: every
    tail, every earlier prefix (across compactions and a cut), the cut."""
    rng = random.Random(5)
    text, plain, prefixes = OutputText(), "", []
    for _ in range(3 * OutputText.COMPACT_AT + 7):
        piece = "".join(rng.choice("ab é€\n") for _ in range(rng.randint(0, 4)))
        text.append(piece)
        plain += piece
        assert text.length == len(plain) and str(text) == plain
        for start in {0, len(plain) // 2, max(0, len(plain) - 5), len(plain)}:
            assert text.tail(start) == plain[start:]
        end = rng.randint(0, len(plain))
        prefixes.append((text.prefix(end), plain[:end]))
    text.cut(len(plain) // 3)
    assert str(text) == plain[: len(plain) // 3] and text.length == len(plain) // 3
    text.append("z")
    for prefix, want in prefixes:  # read after later appends, compactions and the cut
        out = RequestOutput("r", [], [], [], prefix, "", False, None, None, [])
        assert out.text == want and out.text_so_far == want  # joined once, then kept
