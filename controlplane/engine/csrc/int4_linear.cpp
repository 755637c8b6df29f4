// int4_linear: y = x @ w.T for torch's CPU int4 weight (as `_convert_weight_to_int4pack_for_cpu`
// packs it), bit for bit what `_weight_int4pack_mm_for_cpu` returns, 1.1-1.7x faster from 16
// rows on (benchmarks/int4_linear.py; slower below, where torch's kernel keeps the rows).
//
// Why: torch's kernel dequantizes a 64-column panel of the weight again for every 4 rows of
// activations, so a 512-token prompt chunk pays for 128 dequantizations of each weight. Here
// each panel is dequantized once per call, 128 input features at a time, to float32 in a
// per-thread buffer that stays in L1, and every row block reuses it. No resident copy of the
// weight (int4_dense_copy keeps one, 4x the int4 bytes), no transient one either.
//
// Bit for bit: each output is the same float32 FMA chain over k = 0 .. K-1, from zero, on the
// same dequantized values, rounded to bf16 once, as in torch's kernel; a row's result never
// depends on how many rows share the call (batch invariance: a prompt's logits do not depend
// on how it was chunked or cached). torch's AVX512 kernel dequantizes as (q - 8) * s + z with
// one FMA, its AVX2 kernel as q * s + (z - 8 s), two; we do what the build's ISA does, and
// the Python side checks the result against torch's kernel once per process (any other torch
// or layout turns this path off).
//
// torch's packed layout (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack):
// rows in blocks of `block_n` (64 under AVX512, 32 otherwise), each block [K, nb / 2] bytes.
// A full block under AVX512 / AVX2 is "split": for each k, the low nibbles of its nb / 2
// bytes are rows 0 .. nb/2 - 1 in order and the high nibbles rows nb/2 .. nb - 1. Partial
// blocks, and every block of the scalar build, pair neighbours: byte j holds row 2j low,
// row 2j + 1 high.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "prefetch.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kMaxBlock = 64;

// Rows k0 .. k1 - 1 of the block's weights as float32, [k1 - k0, nb] row-major, dequantized as
// torch's kernel does. k0 and k1 are multiples of the group size.
template <typename ST>
void dequantize_panel(const uint8_t* src, const ST* sz, int64_t n0, int64_t nb, bool split, int64_t N,
                      int64_t k0, int64_t k1, int64_t group, float* panel) {
  alignas(64) float scale[kMaxBlock];
  alignas(64) float zero[kMaxBlock];
  alignas(64) float q[kMaxBlock];
  const int64_t half = nb / 2;
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const ST* g = sz + (g0 / group) * N * 2 + n0 * 2;
    for (int64_t n = 0; n < nb; ++n) {
      scale[n] = static_cast<float>(g[2 * n]);
#if defined(CPU_CAPABILITY_AVX512) || !defined(CPU_CAPABILITY_AVX2)
      zero[n] = static_cast<float>(g[2 * n + 1]);
#else
      zero[n] = std::fma(scale[n], -8.0f, static_cast<float>(g[2 * n + 1]));  // AVX2: the -8 in the zero
#endif
    }
    for (int64_t k = g0; k < g0 + group; ++k) {
      const uint8_t* b = src + k * half;
      for (int64_t j = 0; j < half; ++j) {
        q[split ? j : 2 * j] = static_cast<float>(b[j] & 15);
        q[split ? j + half : 2 * j + 1] = static_cast<float>(b[j] >> 4);
      }
      float* w = panel + (k - k0) * nb;
#if defined(CPU_CAPABILITY_AVX512) || !defined(CPU_CAPABILITY_AVX2)
      for (int64_t n = 0; n < nb; ++n) w[n] = std::fma(q[n] - 8.0f, scale[n], zero[n]);
#else
      for (int64_t n = 0; n < nb; ++n) w[n] = std::fma(q[n], scale[n], zero[n]);
#endif
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// A full split block of 64 rows in intrinsics: the portable loop above compiles to half-width
// conversions through stack arrays, 2.5x slower.
template <typename ST>
void dequantize_panel64(const uint8_t* src, const ST* sz, int64_t n0, int64_t N, int64_t k0, int64_t k1,
                        int64_t group, float* panel) {
  alignas(64) float scale[64];
  alignas(64) float zero[64];
  const __m256i low = _mm256_set1_epi8(15);
  const __m512i eight = _mm512_set1_epi32(8);
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const ST* g = sz + (g0 / group) * N * 2 + n0 * 2;
    for (int n = 0; n < 64; ++n) {
      scale[n] = static_cast<float>(g[2 * n]);
      zero[n] = static_cast<float>(g[2 * n + 1]);
    }
    __m512 vs[4], vz[4];
    for (int j = 0; j < 4; ++j) vs[j] = _mm512_load_ps(scale + 16 * j), vz[j] = _mm512_load_ps(zero + 16 * j);
    for (int64_t k = g0; k < g0 + group; ++k) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k * 32));
      const __m256i lo = _mm256_and_si256(bytes, low);                         // rows 0 .. 31
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);  // rows 32 .. 63
      const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                               _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
      float* w = panel + (k - k0) * 64;
      for (int j = 0; j < 4; ++j) {  // (q - 8) * s + z, one FMA, as torch's AVX512 kernel
        const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(part[j]), eight));
        _mm512_storeu_ps(w + 16 * j, _mm512_fmadd_ps(q, vs[j], vz[j]));
      }
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
// A group's scales and zeros for the 32 rows of a full block under AVX2, as float32 vectors,
// the zero with the -8 folded in (z - 8 s, as torch's AVX2 kernel). sz: 32 (scale, zero) pairs.
inline void group_scales32(const c10::BFloat16* sz, __m256 (&vs)[4], __m256 (&vz)[4]) {
  // A (scale, zero) pair of bf16 is one 32-bit lane: the scale its low half, the zero its high.
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 minus8 = _mm256_set1_ps(-8.0f);
  for (int j = 0; j < 4; ++j) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 16 * j));
    vs[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    vz[j] = _mm256_fmadd_ps(vs[j], minus8, _mm256_castsi256_ps(_mm256_and_si256(pairs, high)));
  }
}

inline void group_scales32(const float* sz, __m256 (&vs)[4], __m256 (&vz)[4]) {
  alignas(32) float scale[32];
  alignas(32) float zero[32];
  for (int n = 0; n < 32; ++n) {
    scale[n] = sz[2 * n];
    zero[n] = std::fma(scale[n], -8.0f, sz[2 * n + 1]);
  }
  for (int j = 0; j < 4; ++j) vs[j] = _mm256_load_ps(scale + 8 * j), vz[j] = _mm256_load_ps(zero + 8 * j);
}

// Row k of a full split block (16 bytes: rows 0 .. 15 in the low nibbles, 16 .. 31 in the
// high) as 4 vectors of dequantized weights, q * s + (z - 8 s).
inline void dequantize_row32(const uint8_t* bytes16, const __m256 (&vs)[4], const __m256 (&vz)[4], __m256 (&w)[4]) {
  const __m128i low = _mm_set1_epi8(15);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16));
  const __m128i lo = _mm_and_si128(bytes, low);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
  const __m128i part[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
  for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[j])), vs[j], vz[j]);
}

// A full split block of 32 rows into the panel. The portable loop above made our kernel
// slower than torch's up to 64 rows on an AVX2 EPYC (576 -> 3072 at 16 rows: 575 us against
// 346; 432 with this).
template <typename ST>
void dequantize_panel32(const uint8_t* src, const ST* sz, int64_t n0, int64_t N, int64_t k0, int64_t k1,
                        int64_t group, float* panel) {
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    __m256 vs[4], vz[4], w[4];
    group_scales32(sz + (g0 / group) * N * 2 + n0 * 2, vs, vz);
    for (int64_t k = g0; k < g0 + group; ++k) {
      dequantize_row32(src + k * 16, vs, vz, w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(panel + (k - k0) * 32 + 8 * j, w[j]);
    }
  }
}

// Rows this few skip the panel under AVX2: each weight row is dequantized in registers and
// used at once (a decode step of one or two sequences).
constexpr int64_t kFusedRows = 2;

// ROWS rows of x against a full split block of 32 rows, all of K: the same FMA chains as the
// panel path, without its stores and loads of the panel (576 -> 3072 at 1 row: 206 -> 111 us
// on an AVX2 EPYC; torch's kernel 139).
template <int ROWS, typename ST>
void fused_block32(const float* x, int64_t K, const uint8_t* src, const ST* sz, int64_t n0, int64_t N,
                   int64_t group, c10::BFloat16* out, int64_t ldo) {
  __m256 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    __m256 vs[4], vz[4], w[4];
    group_scales32(sz + (g0 / group) * N * 2 + n0 * 2, vs, vz);
    for (int64_t k = g0; k < g0 + group; ++k) {
      dequantize_row32(src + k * 16, vs, vz, w);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * K + k);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(a, w[j], acc[r][j]);
      }
    }
  }
  alignas(32) float row[32];
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_store_ps(row + 8 * j, acc[r][j]);
    at::vec::convert(row, out + r * ldo, 32);
  }
}

#endif

// ROWS rows of x (float32, row stride K) times kn rows of VECS vectors of a panel's columns
// (row stride nb), continuing each output's FMA chain from `acc` (k0 > 0) or from zero; after
// the last chunk the sums are rounded to bf16 into `out`, else kept in `acc` (row stride nb)
// for the next chunk. Spilling a running sum to memory and reloading it leaves the chain's
// result unchanged, and so does the shape of the tile an output is computed in.
template <int ROWS, int VECS>
void micro_kernel(const float* x, int64_t K, int64_t kn, const float* panel, int64_t nb, float* acc_buf,
                  bool first, bool last, c10::BFloat16* out, int64_t ldo) {
  constexpr int64_t cols = VECS * kLanes;
  Vec acc[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = first ? Vec(0.0f) : Vec::loadu(acc_buf + r * nb + v * kLanes);
  for (int64_t k = 0; k < kn; ++k) {
    Vec w[VECS];
    for (int v = 0; v < VECS; ++v) w[v] = Vec::loadu(panel + k * nb + v * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const Vec a(x[r * K + k]);
      for (int v = 0; v < VECS; ++v) acc[r][v] = at::vec::fmadd(a, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float* row = acc_buf + r * nb;
    for (int v = 0; v < VECS; ++v) acc[r][v].store(row + v * kLanes);
    if (last) at::vec::convert(row, out + r * ldo, cols);
  }
}

// f(m, rows) for tiles of TILE rows from m = 0, then the last rows (fewer than TILE, at most 5),
// `rows` a compile-time count (std::integral_constant) so each tile shape is its own kernel.
template <int TILE, typename F>
void over_row_tiles(int64_t M, const F& f) {
  static_assert(TILE <= 6, "the remainder switch covers up to 5 rows");
  int64_t m = 0;
  for (; m + TILE <= M; m += TILE) f(m, std::integral_constant<int, TILE>{});
  switch (M - m) {
    case 0: break;
    case 1: f(m, std::integral_constant<int, 1>{}); break;
    case 2: f(m, std::integral_constant<int, 2>{}); break;
    case 3: f(m, std::integral_constant<int, 3>{}); break;
    case 4: f(m, std::integral_constant<int, 4>{}); break;
    case 5: f(m, std::integral_constant<int, 5>{}); break;
    default: TORCH_CHECK(false, "int4_linear: internal row split");
  }
}

// f(c0, vecs) over a block's nb columns, in steps of FULL vectors of `lanes` columns, then the
// last 1 to 3 vectors of a partial block; `vecs` a compile-time count.
template <int FULL, typename F>
void over_column_vectors(int64_t nb, int64_t lanes, const F& f) {
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

struct Chunk {  // one K chunk of one panel, applied to every row of x
  const float* x;
  int64_t M, K, k0, kn;
  const float* panel;
  int64_t nb;  // the panel's columns
  float* acc;  // [M, nb] running sums
  c10::BFloat16* out;
  int64_t ldo;
};

// Tiles of kRows rows by VECS vectors: 6 x 4 in zmm (24 accumulators of 32 registers); 6 x 2
// in ymm (12 of 16). Zen 3's FMAs take 4 cycles, two a cycle: fewer than 8 independent
// accumulators leave them idle, and the 2 x 4 tile this kernel had on AVX2 ran at ~40% of
// peak (576 -> 3072 at 512 rows: 22.9 ms).
constexpr int kRows = 6;
constexpr int kVecs = kLanes == 16 ? 4 : 2;

template <int ROWS, int VECS>
inline void rows_of(const Chunk& c, int64_t m, int64_t c0) {
  micro_kernel<ROWS, VECS>(c.x + m * c.K + c.k0, c.K, c.kn, c.panel + c0, c.nb, c.acc + m * c.nb + c0, c.k0 == 0,
                           c.k0 + c.kn == c.K, c.out + m * c.ldo + c0, c.ldo);
}

// Every row of the chunk against every column of its panel.
void panel_times_rows(const Chunk& c) {
  over_column_vectors<kVecs>(c.nb, kLanes, [&](int64_t c0, auto vecs) {
    over_row_tiles<kRows>(c.M, [&](int64_t m, auto rows) { rows_of<decltype(rows)::value, decltype(vecs)::value>(c, m, c0); });
  });
}

// The next block's scales and zeros, asked for while this block computes. They lie a group's
// row of N pairs apart (torch's layout, [K / group, N, 2]): a stride that crosses pages, which
// the hardware prefetcher does not follow, so at one row each group's first load waited on
// memory.
template <typename ST>
void prefetch_scales(const ST* sz, int64_t n0, int64_t nb, int64_t N, int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) controlplane::prefetch(sz + g * N * 2 + n0 * 2, nb * 2, sz + groups * N * 2);
}

struct Int4Shape {
  int64_t M, N, K;
};

// The arguments both int4 ops take, checked; `group_multiple`: what group_size must divide by.
Int4Shape checked_int4_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
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

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                       int64_t group_size, int64_t block_n, bool split) {
  const Int4Shape shape = checked_int4_args(x, packed, scales_and_zeros, group_size, block_n, 1);
  const int64_t M = shape.M, N = shape.N, K = shape.K;  // (a structured binding cannot be captured in C++17)
  // x as float32 in a plain buffer: at::Tensor::to cost ~3 us a call, as much as a 576 x 576
  // weight's arithmetic at one row.
  const at::Tensor xc = x.contiguous();
  std::vector<float> xf(M * K);
  at::vec::convert(xc.const_data_ptr<c10::BFloat16>(), xf.data(), M * K);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = xf.data();
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  const int64_t blocks = (N + block_n - 1) / block_n;
  const int64_t kc = std::max(kChunkK / group_size, int64_t{1}) * group_size;
  auto run = [&](auto* sz) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> panel(kc * block_n);
      std::vector<float> acc(M * block_n);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n0 = i * block_n;
        const int64_t nb = std::min(block_n, N - n0);
        if (i == begin) prefetch_scales(sz, n0, nb, N, K / group_size);
        if (i + 1 < end) prefetch_scales(sz, n0 + block_n, std::min(block_n, N - n0 - block_n), N, K / group_size);
        const uint8_t* block = src + n0 * K / 2;
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
        if (split && nb == 32 && M <= kFusedRows) {
          if (M == 1)
            fused_block32<1>(xp, K, block, sz, n0, N, group_size, dst + n0, N);
          else
            fused_block32<2>(xp, K, block, sz, n0, N, group_size, dst + n0, N);
          continue;
        }
#endif
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          const int64_t k1 = std::min(K, k0 + kc);
#if defined(CPU_CAPABILITY_AVX512)
          if (split && nb == 64)
            dequantize_panel64(block, sz, n0, N, k0, k1, group_size, panel.data());
          else
#elif defined(CPU_CAPABILITY_AVX2)
          if (split && nb == 32)
            dequantize_panel32(block, sz, n0, N, k0, k1, group_size, panel.data());
          else
#endif
            dequantize_panel(block, sz, n0, nb, split && nb == block_n, N, k0, k1, group_size, panel.data());
          panel_times_rows(Chunk{xp, M, K, k0, k1 - k0, panel.data(), nb, acc.data(), dst + n0, N});
        }
      }
    });
  };
  switch (scales_and_zeros.scalar_type()) {
    case at::kBFloat16: run(scales_and_zeros.const_data_ptr<c10::BFloat16>()); break;
    case at::kFloat: run(scales_and_zeros.const_data_ptr<float>()); break;
    default: TORCH_CHECK(false, "int4_linear: unsupported scales dtype ", scales_and_zeros.scalar_type());
  }
  return out;
}


// ---- int4_linear_bf16: the same int4 weights through AVX512-BF16 dot products ---------------
//
// Where the CPU has AVX512-BF16 (Zen 4, Sapphire Rapids), VDPBF16PS multiplies 32 bf16 pairs
// into 16 float32 sums in one instruction. A weight is (q - 8) * s + z with s and z shared by a
// group of input features, so a group's share of an output factors (as llama.cpp's blocks do):
//
//     sum_k w[k] x[k] = s * sum_k (q[k] - 8) x[k] + z * sum_k x[k]
//
// q - 8 is a small integer, exact in bf16, and so are the bf16 activations: the partial sums are
// VDPBF16PS chains over the group's pairs (q[k] - 8, q[k + 1] - 8) with no dequantization (a
// table lookup turns nibbles into bf16), every product exact, and each group adds two FMAs.
//
// Not torch's results bit for bit, but batch invariant as the float path is: each output is
//     total = 0; for each group g: partial = the VDPBF16PS chain over its pairs, from 0;
//                                  total = fma(partial, s, total); total = fma(xsum[g], z, total)
// (xsum[g]: the group's x summed in float32, the same way for every row), whatever the row
// count, the tile or the path (panel or one-row) that computes it. The Python side uses it for
// every row count or for none (Int4Linear.bf16_dot).

#if defined(CPU_CAPABILITY_AVX512)
#define CP_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

template <typename T>
T* aligned64(std::vector<T>& buf) {  // buf's first 64-byte aligned element (buf has 64 bytes spare)
  const auto at = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((at + 63) & ~uintptr_t{63});
}

// bf16 bit patterns of q - 8 for q = 0 .. 15, twice: VPERMW reads an index's low 5 bits, so a
// word holding a whole byte indexes its low nibble without masking.
CP_BF16 inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = c10::BFloat16(static_cast<float>((i & 15) - 8)).x;
  return _mm512_load_si512(t);
}

// Rows k and k + 1 of a full split block (32 bytes each: rows 0 .. 31 in the low nibbles, 32 ..
// 63 in the high) as bf16 pairs (q[k][n] - 8, q[k + 1][n] - 8), rows 16 j .. 16 j + 15 in
// pairs[j]: 14 instructions for 128 weights (dequantizing them to float took 36).
CP_BF16 inline void q_pairs64(const uint8_t* row, const __m512i table, __m512i (&pairs)[4]) {
  for (int j = 0; j < 2; ++j) {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 + 16 * j)));
    const __m512i both = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));  // a word a byte: row k low, k + 1 high
    pairs[j] = _mm512_permutexvar_epi16(both, table);                               // low nibbles
    pairs[j + 2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(both, 4), table);  // high nibbles
  }
}

// A group's scales and zeros for the 64 rows of a full block, as float32 vectors. A (scale,
// zero) pair of bf16 is one 32-bit lane, the scale its low half: two integer ops make both.
CP_BF16 inline void group_scales64(const c10::BFloat16* sz, __m512 (&vs)[4], __m512 (&vz)[4]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < 4; ++j) {
    const __m512i pairs = _mm512_loadu_si512(sz + 32 * j);
    vs[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    vz[j] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
  }
}

CP_BF16 inline void group_scales64(const float* sz, __m512 (&vs)[4], __m512 (&vz)[4]) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_loadu_ps(sz + 32 * j), b = _mm512_loadu_ps(sz + 32 * j + 16);
    vs[j] = _mm512_permutex2var_ps(a, even, b);
    vz[j] = _mm512_permutex2var_ps(a, odd, b);
  }
}

// xsum: each row's groups of x summed in float32, [M, K / group]; the same sums for a row
// whatever the rows beside it.
CP_BF16 void group_sums(const c10::BFloat16* x, int64_t M, int64_t K, int64_t group, float* xsum) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g0 = 0; g0 < K; g0 += group) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g0; k < g0 + group; k += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * K + k));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
      xsum[r * (K / group) + g0 / group] = _mm512_reduce_add_ps(sum);
    }
}

// Steps this few rows skip the panel: each pair of weight rows becomes bf16 pairs in registers
// and is used at once, two rows a pass (making the pairs costs little: reading the weights twice
// from L2 is cheaper than a panel for so few rows). 4 rows of a 1.1B Llama's 2048 -> 11264 ran
// at 0.73x torch's kernel's speed through the panel, 1.16x in two passes.
constexpr int64_t kFusedPairRows = 4;

// ROWS rows of x (bf16 pairs, row stride K / 2) against a full split block of 64 rows, all of
// K: the same chains as the panel path.
template <int ROWS, typename ST>
CP_BF16 void fused_block64_bf16(const uint32_t* x, const float* xsum, int64_t K, const uint8_t* src, const ST* sz,
                                int64_t n0, int64_t N, int64_t group, c10::BFloat16* out, int64_t ldo) {
  const __m512i table = nibble_table();
  const int64_t groups = K / group;
  __m512 total[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) total[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
      __m512i pairs[4];
      q_pairs64(src + k * 32, table, pairs);
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * (K / 2) + k / 2])));
        for (int j = 0; j < 4; ++j) part[r][j] = _mm512_dpbf16_ps(part[r][j], reinterpret_cast<__m512bh>(pairs[j]), a);
      }
    }
    __m512 vs[4], vz[4];
    group_scales64(sz + g * N * 2 + n0 * 2, vs, vz);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xs = _mm512_set1_ps(xsum[r * groups + g]);
      for (int j = 0; j < 4; ++j) {
        total[r][j] = _mm512_fmadd_ps(part[r][j], vs[j], total[r][j]);
        total[r][j] = _mm512_fmadd_ps(xs, vz[j], total[r][j]);
      }
    }
  }
  alignas(64) float row[64];
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_store_ps(row + 16 * j, total[r][j]);
    at::vec::convert(row, out + r * ldo, 64);
  }
}

// Rows k0 .. k1 - 1 of a block as bf16 pairs, [(k1 - k0) / 2, nb] lanes, and its groups'
// scales and zeros as float32, [(k1 - k0) / group, nb] each.
template <typename ST>
CP_BF16 void pair_panel(const uint8_t* src, const ST* sz, int64_t n0, int64_t nb, bool split, int64_t N, int64_t k0,
                        int64_t k1, int64_t group, uint32_t* panel, float* sp, float* zp) {
  const int64_t half = nb / 2;
  for (int64_t g0 = k0; g0 < k1; g0 += group) {
    const ST* g = sz + (g0 / group) * N * 2 + n0 * 2;
    float* s = sp + (g0 - k0) / group * nb;
    float* z = zp + (g0 - k0) / group * nb;
    if (split && nb == 64) {
      __m512 vs[4], vz[4];
      group_scales64(g, vs, vz);
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(s + 16 * j, vs[j]), _mm512_storeu_ps(z + 16 * j, vz[j]);
    } else {
      for (int64_t n = 0; n < nb; ++n) s[n] = static_cast<float>(g[2 * n]), z[n] = static_cast<float>(g[2 * n + 1]);
    }
  }
  if (split && nb == 64) {
    const __m512i table = nibble_table();
    for (int64_t k = k0; k < k1; k += 2) {
      __m512i pairs[4];
      q_pairs64(src + k * 32, table, pairs);
      for (int j = 0; j < 4; ++j) _mm512_storeu_si512(panel + (k - k0) / 2 * 64 + 16 * j, pairs[j]);
    }
    return;
  }
  auto q = [&](int64_t k, int64_t n) -> float {  // row n's int4 value at k, less 8
    const uint8_t* b = src + k * half;
    const int v = split ? (n < half ? b[n] & 15 : b[n - half] >> 4) : (n % 2 ? b[n / 2] >> 4 : b[n / 2] & 15);
    return static_cast<float>(v - 8);
  };
  for (int64_t k = k0; k < k1; k += 2)
    for (int64_t n = 0; n < nb; ++n)
      panel[(k - k0) / 2 * nb + n] = static_cast<uint32_t>(c10::BFloat16(q(k, n)).x) |
                                     (static_cast<uint32_t>(c10::BFloat16(q(k + 1, n)).x) << 16);
}

struct PairChunk {  // one K chunk of one pair panel, applied to every row of x
  const uint32_t* x;  // [M, K / 2] bf16 pairs
  const float* xsum;  // [M, groups]
  int64_t M, K2, groups;
  int64_t p0, pn, gp;  // the chunk's first pair, its pairs, pairs a group
  const uint32_t* panel;
  const float* sp;
  const float* zp;
  int64_t nb;
  float* total;  // [M, nb] running sums
  c10::BFloat16* out;
  int64_t ldo;
};

// ROWS rows from m against VECS vectors of the chunk's columns from c0: per group, the partial
// sums in registers (6 x 4 tiles: 24 accumulators; 3 x 4 tiles that kept the totals in
// registers too ran 1.3x slower: VDPBF16PS wants many independent chains), then folded into
// the running totals, which stay in L1 between groups.
template <int ROWS, int VECS>
CP_BF16 void micro_kernel_bf16(const PairChunk& c, int64_t m, int64_t c0) {
  const bool first = c.p0 == 0, last = c.p0 + c.pn == c.K2;
  const int64_t chunk_groups = c.pn / c.gp;
  const uint32_t* x = c.x + m * c.K2 + c.p0;
  const int64_t K2 = c.K2, nb = c.nb, gp = c.gp;
  const uint32_t* panel = c.panel + c0;
  float* total = c.total + m * nb + c0;
  const int64_t groups = c.groups;
  const float* xsum = c.xsum + m * groups + c.p0 / gp;
  const float* sp = c.sp + c0;
  const float* zp = c.zp + c0;
  for (int64_t gi = 0; gi < chunk_groups; ++gi) {
    __m512 part[ROWS][VECS];
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < VECS; ++v) part[r][v] = _mm512_setzero_ps();
    for (int64_t p = gi * gp; p < (gi + 1) * gp; ++p) {
      __m512bh w[VECS];
      for (int v = 0; v < VECS; ++v) w[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * nb + v * 16));
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * K2 + p])));
        for (int v = 0; v < VECS; ++v) part[r][v] = _mm512_dpbf16_ps(part[r][v], w[v], a);
      }
    }
    // Unrolled by hand-held pragmas: as a loop, GCC spilled all 24 partial sums to the stack.
    const bool zero = first && gi == 0;
    __m512 sv[VECS], zv[VECS];
#pragma GCC unroll 4
    for (int v = 0; v < VECS; ++v) sv[v] = _mm512_loadu_ps(sp + gi * nb + v * 16), zv[v] = _mm512_loadu_ps(zp + gi * nb + v * 16);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xs = _mm512_set1_ps(xsum[r * groups + gi]);
#pragma GCC unroll 4
      for (int v = 0; v < VECS; ++v) {
        float* t = total + r * nb + v * 16;
        __m512 acc = zero ? _mm512_setzero_ps() : _mm512_load_ps(t);
        acc = _mm512_fmadd_ps(part[r][v], sv[v], acc);
        _mm512_store_ps(t, _mm512_fmadd_ps(xs, zv[v], acc));
      }
    }
  }
  if (last)
    for (int r = 0; r < ROWS; ++r) at::vec::convert(total + r * nb, c.out + (m + r) * c.ldo + c0, VECS * 16);
}

constexpr int kPairRows = 6;

void pair_panel_times_rows(const PairChunk& c) {
  over_column_vectors<4>(c.nb, 16, [&](int64_t c0, auto vecs) {
    over_row_tiles<kPairRows>(c.M, [&](int64_t m, auto rows) {
      micro_kernel_bf16<decltype(rows)::value, decltype(vecs)::value>(c, m, c0);
    });
  });
}
#endif

bool bf16_dot_supported() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

at::Tensor int4_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                            int64_t group_size, int64_t block_n, bool split) {
  TORCH_CHECK(bf16_dot_supported(), "int4_linear_bf16: this CPU (or this build) has no AVX512-BF16");
#if defined(CPU_CAPABILITY_AVX512)
  const Int4Shape shape = checked_int4_args(x, packed, scales_and_zeros, group_size, block_n, 16);
  const int64_t M = shape.M, N = shape.N, K = shape.K;  // (a structured binding cannot be captured in C++17)
  const int64_t groups = K / group_size;
  const at::Tensor xc = x.contiguous();
  std::vector<float> xsum(M * groups);
  group_sums(xc.const_data_ptr<c10::BFloat16>(), M, K, group_size, xsum.data());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.const_data_ptr<c10::BFloat16>());
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  const int64_t blocks = (N + block_n - 1) / block_n;
  // 256 K rows a chunk: a pair panel of 128 x 64 lanes is 32 KB, as the float path's.
  const int64_t kc = std::max(2 * kChunkK / group_size, int64_t{1}) * group_size;
  auto run = [&](auto* sz) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      // 64-byte aligned: a vector load or store that straddles two cache lines costs two, and
      // a total stored so and reloaded one group later missed store forwarding.
      std::vector<uint32_t> panel_buf(kc / 2 * block_n + 16);
      std::vector<float> scales_buf(2 * kc / group_size * block_n + 16), total_buf(M * block_n + 16);
      uint32_t* panel = aligned64(panel_buf);
      float* sp = aligned64(scales_buf);
      float* zp = sp + kc / group_size * block_n;
      float* total = aligned64(total_buf);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n0 = i * block_n;
        const int64_t nb = std::min(block_n, N - n0);
        if (i == begin) prefetch_scales(sz, n0, nb, N, groups);
        if (i + 1 < end) prefetch_scales(sz, n0 + block_n, std::min(block_n, N - n0 - block_n), N, groups);
        const uint8_t* block = src + n0 * K / 2;
        if (split && nb == 64 && M <= kFusedPairRows) {
          for (int64_t r = 0; r < M; r += 2) {  // two rows a pass (their sums fill 16 registers)
            const uint32_t* xr = xp + r * K / 2;
            const float* xs = xsum.data() + r * groups;
            if (M - r == 1)
              fused_block64_bf16<1>(xr, xs, K, block, sz, n0, N, group_size, dst + r * N + n0, N);
            else
              fused_block64_bf16<2>(xr, xs, K, block, sz, n0, N, group_size, dst + r * N + n0, N);
          }
          continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
          const int64_t k1 = std::min(K, k0 + kc);
          pair_panel(block, sz, n0, nb, split && nb == block_n, N, k0, k1, group_size, panel, sp, zp);
          pair_panel_times_rows(PairChunk{xp, xsum.data(), M, K / 2, groups, k0 / 2, (k1 - k0) / 2, group_size / 2,
                                          panel, sp, zp, nb, total, dst + n0, N});
        }
      }
    });
  };
  switch (scales_and_zeros.scalar_type()) {
    case at::kBFloat16: run(scales_and_zeros.const_data_ptr<c10::BFloat16>()); break;
    case at::kFloat: run(scales_and_zeros.const_data_ptr<float>()); break;
    default: TORCH_CHECK(false, "int4_linear_bf16: unsupported scales dtype ", scales_and_zeros.scalar_type());
  }
  return out;
#else
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(controlplane_cpu, m) {
  m.def(
      "int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, int block_n, bool split) -> "
      "Tensor");
  m.def(
      "int4_linear_bf16(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, int block_n, bool split) "
      "-> Tensor");
  m.def("bf16_dot_supported() -> bool", &bf16_dot_supported);
}

TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_bf16", &int4_linear_bf16);
}
