// bf16_linear: a bf16 weight, packed once at load into pair panels, times bf16 activations
// through AVX512-BF16 dot products (VDPBF16PS), for CPUs that have them but no AMX (Zen 4).
//
// Why not oneDNN's packed GEMV (model/linear.py's PackedLinear, the fallback): at one row it
// streamed a 1.1B Llama's weights at 20-25 GB/s on a 2-core Zen 4 whose memory reads at 33 GB/s,
// 68-71% of the bandwidth limit for a token. Here a block of 64 outputs is one sequential stream
// (all of K's pairs for those 64 outputs, 256 bytes a pair of K), a block after another (on 2 MB
// pages once model/arena.py has placed it). The 1.1B's shapes, weights cycled through 1-1.5 GB,
// against oneDNN (same run): one row 1.18-1.67x (27-37 GB/s against 18-25), 4 rows 1.01-1.10x,
// 16 rows 1.12-1.20x, 64 rows 1.08-1.09x, 512 rows 1.00-1.03x (both then bound by VDPBF16PS).
// Software prefetch ahead of the stream (as the int4 kernels ask, whose weights come in three
// streams) measured no gain: one stream the hardware prefetcher follows.
//
// Layout: packed[b][p][n] (uint32) = the bf16 pair (w[64 b + n][2 p], w[64 b + n][2 p + 1]),
// N padded with zero rows to whole blocks of 64 (K even). Each output is
//     acc = 0; for p in 0 .. K/2 - 1: acc = VDPBF16PS(acc, pair p of x, pair p of w)  (one lane)
//     out = bf16(acc + bias)
// whatever the row count, the row tile or the K chunk it falls in (a chunk's sums are stored
// to float32 and reloaded: exact): batch invariant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16_dot.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;  // outputs a block: four 16-lane vectors

#if defined(CPU_CAPABILITY_AVX512)

// Pairs of K a chunk once a step has more rows than one tile: every row tile after the first
// reads the block's chunk (kChunk x 256 bytes: 128 KB) from L2. Against oneDNN on the 1.1B's
// shapes (one run, 16 / 64 / 512 rows): chunks of 64 pairs (L1) 0.91-1.03x, 128 0.95-1.10x, 256
// 1.00-1.19x, 512 1.08-1.20x / 1.08-1.09x / 1.00-1.03x, 1024 about the same as 512.
constexpr int64_t kChunk = 512;

constexpr int kRowTile = 6;  // 6 rows x 4 vectors: 24 accumulators of the 32 registers

// ROWS rows of x (pairs, row stride K2) from m against pairs p0 .. p1 of one block: sums in
// registers, loaded from / stored to `total` (ROWS x 64 floats) unless the chunk is the first
// (from zero) or the only one.
template <int ROWS>
CP_BF16 void block_rows(const uint32_t* x, int64_t K2, const uint32_t* w, int64_t p0, int64_t p1, bool first,
                        float* total) {
  __m512 acc[ROWS][4];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(total + r * kBlock + 16 * j);
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t* wp = w + p * kBlock;
    __m512bh b[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) b[j] = reinterpret_cast<__m512bh>(_mm512_load_si512(wp + 16 * j));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * K2 + p])));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], b[j], a);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_store_ps(total + r * kBlock + 16 * j, acc[r][j]);
}

template <int... R>
void block_rows_n(int rows, std::integer_sequence<int, R...>, const uint32_t* x, int64_t K2, const uint32_t* w,
                  int64_t p0, int64_t p1, bool first, float* total) {
  ((rows == R + 1 ? block_rows<R + 1>(x, K2, w, p0, p1, first, total) : void()), ...);
}

#endif

// x [M, K] bf16 times the weight bf16_pack_weight packed, plus bias: [M, out_features] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_linear: x must be 2-D bfloat16, got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.size(2) == kBlock,
              "bf16_linear: packed must be [blocks, K / 2, 64] int32 (bf16_pack_weight's)");
  TORCH_CHECK(controlplane::bf16_dot_supported(), "bf16_linear: this CPU has no AVX512-BF16");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1), N = out_features;
  TORCH_CHECK(K == 2 * K2, "bf16_linear: x has ", K, " features, the weight ", 2 * K2);
  TORCH_CHECK(N <= packed.size(0) * kBlock, "bf16_linear: out_features=", N, " exceeds the packed weight");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(CPU_CAPABILITY_AVX512)
  const at::Tensor xc = x.contiguous();  // rows of K / 2 pairs
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.const_data_ptr<c10::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(packed.const_data_ptr<int32_t>());
  const float* bp = nullptr;
  at::Tensor bf;
  if (bias) bf = bias->to(at::kFloat).contiguous(), bp = bf.const_data_ptr<float>();
  c10::BFloat16* dst = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Few rows: all of K in one chunk, each block one stream. More: K in chunks, every row
  // tile over a chunk while it is in cache.
  const int64_t chunk = M <= kRowTile ? K2 : kChunk;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> total_buf(M * kBlock + 16);
    float* total = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(total_buf.data()) + 63) & ~uintptr_t{63});
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* w = wp + b * K2 * kBlock;
      for (int64_t p0 = 0; p0 < K2; p0 += chunk) {
        const int64_t p1 = std::min(K2, p0 + chunk);
        for (int64_t m = 0; m < M; m += kRowTile) {
          const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - m));
          block_rows_n(rows, std::make_integer_sequence<int, kRowTile>{}, xp + m * K2, K2, w, p0, p1, p0 == 0,
                       total + m * kBlock);
        }
      }
      const int64_t n0 = b * kBlock, nb = std::min(kBlock, N - n0);
      for (int64_t r = 0; r < M; ++r) {
        float* t = total + r * kBlock;
        if (bp)
          for (int64_t n = 0; n < nb; ++n) t[n] += bp[n0 + n];
        at::vec::convert(t, dst + r * N + n0, nb);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX512");
#endif
}

// A [N, K] bf16 weight (K even) as bf16_linear's panels: [ceil(N / 64), K / 2, 64] int32.
at::Tensor bf16_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "bf16_pack_weight: weight must be 2-D bfloat16, got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "bf16_pack_weight: in_features=", K, " is odd (the kernel reads pairs)");
  const int64_t blocks = (N + kBlock - 1) / kBlock, K2 = K / 2;
  const at::Tensor w = at::constant_pad_nd(weight, {0, 0, 0, blocks * kBlock - N});
  at::Tensor packed = at::empty({blocks, K2, kBlock}, weight.options().dtype(at::kInt));
  // [blocks, 64, K2, 2] -> [blocks, K2, 64, 2]: each pair's two halves stay adjacent.
  packed.view(at::kBFloat16).view({blocks, K2, kBlock, 2}).copy_(w.view({blocks, kBlock, K2, 2}).permute({0, 2, 1, 3}));
  return packed;
}

}  // namespace


TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("bf16_pack_weight", &bf16_pack_weight);
}
