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

#include "int4_common.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace controlplane::int4;

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

}  // namespace


TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) { m.impl("int4_linear", &int4_linear); }
