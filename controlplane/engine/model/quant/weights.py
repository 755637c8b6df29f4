"""The quantization itself, no kernel: float weights to int8 rows, int4 groups or FP8 rows and
back.

INT4 uses tinygemm's convention on every device: w = (q - 8) * scale + zero, q in [0, 15],
one (scale, zero) pair per `group_size` consecutive input features of an output row.
Asymmetric (min/max) groups: the zero point costs nothing in the kernel and halves the
rounding error of groups whose values are not centred on zero.

FP8 is e4m3 (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, largest finite value
448, no infinities) with one float32 scale per output channel, max |w| / 448, so each row's
largest weight lands on e4m3's largest value and the row uses the format's whole range. A
floating-point grid: every weight keeps 3 mantissa bits relative to its own magnitude (a
relative rounding error of at most 2^-4), where int8's uniform grid gives small weights of a
row with one large one few levels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TINY = 1e-12  # an all-zero row or group keeps a finite scale
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True, slots=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]: w ~= qweight * scales[:, None]

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None].float()


@dataclass(frozen=True, slots=True)
class Int4Weight:
    qvalues: torch.Tensor  # int32 [N, K], values in [0, 15]: one per weight, not yet packed
    scales_and_zeros: torch.Tensor  # float32 [K / group_size, N, 2] (tinygemm's layout)
    group_size: int

    def dequantize(self) -> torch.Tensor:
        k = self.qvalues.shape[1]
        scales = self.scales_and_zeros[..., 0].t().repeat_interleave(self.group_size, dim=1)
        zeros = self.scales_and_zeros[..., 1].t().repeat_interleave(self.group_size, dim=1)
        return (self.qvalues.float() - 8) * scales[:, :k] + zeros[:, :k]


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    qweight: torch.Tensor  # float8_e4m3fn [N, K]
    scales: torch.Tensor  # float32 [N]: w ~= qweight * scales[:, None]

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None].float()


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """e4m3 per output channel: each row divided by its max |w| / 448 and rounded to the
    nearest e4m3 value (torch's conversion: round to nearest even). The clamp saturates a
    quotient a float32 rounding above 448 explicitly, whatever a device's conversion does past
    the largest value (float8_e4m3fn has no infinity: its only code above 448 is NaN)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=TINY) / FP8_MAX
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scales)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per output channel, in [-127, 127] (so -128 is never used): each row rounded on
    the grid of its largest value (max |w| / 127), then twice: its scale refitted by least
    squares (<w, q> / <q, q>) and the row rounded again on it; the scale refitted at the end.

    Why: a row's scale from its maximum leaves the row's dequantized size off by a little, and
    a tied lm_head turns that straight into the logits' temperature. SmolLM2's int8 lm_head
    (and embedding) came out at +0.21% and +0.51% of the float head's perplexity in two runs
    whose int4 layers rounded differently (VDPBF16PS / AMX); refitted, +0.06% and +0.15%, for
    a few more passes over the weight at load (int8 linears: 39.308 -> 39.318, noise). Each
    step lowers the row's squared error."""
    w = weight.detach().float()
    q = torch.round(w / (w.abs().amax(dim=1, keepdim=True).clamp(min=TINY) / 127))
    for _ in range(2):
        scales = _least_squares_scale(w, q)
        q = torch.round(w / scales).clamp_(-127, 127)
    return Int8Weight(q.to(torch.int8), _least_squares_scale(w, q)[:, 0])


def _least_squares_scale(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The per-row scale s minimizing |w - s q|^2 ([rows, 1]; tiny for all-zero rows)."""
    return ((w * q).sum(1, keepdim=True) / (q * q).sum(1, keepdim=True).clamp(min=1)).clamp(
        min=TINY
    )


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool = False) -> Int4Weight:
    """Group-wise over input features. K must be a multiple of `group_size` (pad first)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    if symmetric:
        scales = w.abs().amax(dim=-1).clamp(min=TINY) / 7
        q = torch.round(w / scales[..., None]).clamp_(-8, 7) + 8
        zeros = torch.zeros_like(scales)
    else:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scales = (hi - lo).clamp(min=TINY) / 15
        q = torch.round((w - lo[..., None]) / scales[..., None]).clamp_(0, 15)
        zeros = lo + 8 * scales  # (q - 8) * scale + zero == q * scale + lo
    qvalues = q.to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
    return Int4Weight(qvalues, scales_and_zeros, group_size)
