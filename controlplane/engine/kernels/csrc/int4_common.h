// What both int4 kernels share (int4_linear.cpp: torch's bits; int4_linear_bf16.cpp: bf16 dot
// products): torch's packed layout's argument checks, the scales' prefetch, the K chunking and
// the column dispatch (rows: tiles.h).
#pragma once

#include <ATen/ATen.h>

#include "prefetch.h"
#include "tiles.h"

#include <cstdint>
#include <type_traits>

namespace controlplane::int4 {

using controlplane::over_row_tiles;

// f(c0, vecs) over a block's nb columns, in steps of FULL vectors of `lanes` columns, then the
// last 1 to 3 vectors of a partial block; `vecs` a compile-time count.
template <int FULL, typename F>
inline void over_column_vectors(int64_t nb, int64_t lanes, const F& f) {
  TORCH_CHECK(nb % lanes == 0, "int4_linear: a block of ", nb, " rows");
  int64_t c0 = 0;
  for (; c0 + FULL * lanes <= nb; c0 += FULL * lanes) f(c0, std::integral_constant<int, FULL>{});
  switch ((nb - c0) / lanes) {
    case 0: break;
    case 1: f(c0, std::integral_constant<int, 1>{}); break;
    case 2: f(c0, std::integral_constant<int, 2>{}); break;
    case 3: f(c0, std::integral_constant<int, 3>{}); break;
    default: TORCH_CHECK(false, "int4_linear: a block of ", nb, " rows");
  }
}

// The next block's scales and zeros, asked for while this block computes. They lie a group's
// row of N pairs apart (torch's layout, [K / group, N, 2]): a stride that crosses pages, which
// the hardware prefetcher does not follow, so at one row each group's first load waited on
// memory.
template <typename ST>
inline void prefetch_scales(const ST* sz, int64_t n0, int64_t nb, int64_t N, int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) controlplane::prefetch(sz + g * N * 2 + n0 * 2, nb * 2, sz + groups * N * 2);
}

struct Int4Shape {
  int64_t M, N, K;
};

// The arguments both int4 ops take, checked; `group_multiple`: what group_size must divide by.
inline Int4Shape checked_int4_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                                   int64_t group_size, int64_t block_n, int64_t group_multiple) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed: contiguous uint8 [N, K / 2]");
  const int64_t N = packed.size(0);
  const int64_t K = packed.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "x: bf16 [rows, ", K, "] (the weight's in_features)");
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.is_contiguous() && scales_and_zeros.size(1) == N &&
                  scales_and_zeros.size(2) == 2,
              "scales_and_zeros: contiguous [K / group_size, N, 2]");
  TORCH_CHECK(group_size > 0 && group_size % group_multiple == 0 && K % group_size == 0 &&
                  scales_and_zeros.size(0) == K / group_size,
              "group_size ", group_size, " does not divide K = ", K, " into ", scales_and_zeros.size(0),
              " groups (of a multiple of ", group_multiple, ")");
  TORCH_CHECK((block_n == 32 || block_n == 64) && N % 16 == 0, "block_n: 32 or 64; N: a multiple of 16");
  return {x.size(0), N, K};
}

// K rows of a panel dequantized at a time: 128 x 64 floats (32 KB) stay in L1 while every row
// block reads them. Whole panels (147 KB at K = 576) spilled to L2 and the dequantization's
// stores stalled: a 576 x 3072 weight at 1 row took 280 us.
constexpr int64_t kChunkK = 128;

}  // namespace controlplane::int4
