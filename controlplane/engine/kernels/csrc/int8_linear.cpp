// int8_linear: y = (x @ w.T) * scales for an int8 weight [N, K] (one scale per output row),
// float32 out. Written for the lm_head of a decode step (SmolLM2: 49152 x 576, 28 MB of int8,
// 1 to 32 rows): each weight row is read from memory once per call whatever the row count,
// converted to float32 in registers and multiplied into every row of x. torch's
// `_weight_int8pack_mm` reads it again for every few rows (its cost per call grows with the
// rows: 16 rows took 7x one row's time on a Xeon, ours 5.9x) and rounds its sums to bf16.
//
// Each output is one float32 dot product: per-lane FMA chains over k in vectors, the lanes
// reduced in a fixed tree, the K tail added after, then times the row's scale. The order never
// depends on M, so a row's result does not depend on what shares its call (batch invariance:
// a sequence's logits are the same alone or in a batch).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "bf16_dot.h"
#include "prefetch.h"
#include "tiles.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <type_traits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
// Weight rows converted together, x rows per pass over them: accumulators (kRows x kW) plus
// the kW converted weight vectors and one x vector fit the register file (32 zmm; 16 ymm).
constexpr int kW = 4;
constexpr int kRows = kLanes == 16 ? 6 : 2;

// kLanes int8 weights as float32 (exact: |q| <= 127).
inline Vec load_int8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float f[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// ROWS rows of x (float32, row stride K) against W weight rows starting at w (row stride K).
template <int ROWS, int W>
void tile(const float* x, int64_t K, const int8_t* w, const float* scales, float* out, int64_t ldo) {
  const int64_t kv = K - K % kLanes;
  Vec acc[ROWS][W];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = Vec(0.0f);
  for (int64_t k = 0; k < kv; k += kLanes) {
    Vec wv[W];
    for (int j = 0; j < W; ++j) wv[j] = load_int8(w + j * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const Vec a = Vec::loadu(x + r * K + k);
      for (int j = 0; j < W; ++j) acc[r][j] = at::vec::fmadd(a, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < W; ++j) {
      float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][j]);
      for (int64_t k = kv; k < K; ++k) sum += x[r * K + k] * static_cast<float>(w[j * K + k]);
      out[r * ldo + j] = scales ? sum * scales[j] : sum;
    }
  }
}

// Every row of x against W weight rows: tiles of kRows rows, then the last rows.
template <int W>
void rows_against(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, float* out,
                  int64_t ldo) {
  controlplane::over_row_tiles<kRows>(M, [&](int64_t m, auto rows) {
    tile<decltype(rows)::value, W>(x + m * K, K, w, scales, out + m * ldo, ldo);
  });
}

// Weight rows per parallel task: 64 x 576 bytes (36 KB) stay in L2 while every row block of x
// passes over them.
constexpr int64_t kTaskRows = 64;
// How far ahead (weight rows) the next rows' bytes are prefetched.
constexpr int64_t kPrefetchRows = 8;

// The scales as float32 (held alive by `held`), or nullptr without them.
const float* checked_scales(const c10::optional<at::Tensor>& scales, int64_t N, at::Tensor& held) {
  if (!scales.has_value()) return nullptr;
  held = scales->to(at::kFloat).contiguous();
  TORCH_CHECK(held.dim() == 1 && held.size(0) == N, "scales: [", N, "] (one per output row), got ", scales->sizes());
  return held.const_data_ptr<float>();
}

// body(n, W) for the weight rows n .. n + W - 1 of every task of kTaskRows rows (W = kW, then
// single rows at a task's end), tasks in parallel, the next rows' bytes prefetched.
template <typename Body>
void over_weight_rows(const int8_t* wp, int64_t N, int64_t K, const Body& body) {
  at::parallel_for(0, (N + kTaskRows - 1) / kTaskRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n1 = std::min(N, (t + 1) * kTaskRows);
      int64_t n = t * kTaskRows;
      for (; n + kW <= n1; n += kW) {
        controlplane::prefetch(wp + (n + kPrefetchRows) * K, kW * K, wp + N * K);
        body(n, std::integral_constant<int, kW>{});
      }
      for (; n < n1; ++n) body(n, std::integral_constant<int, 1>{});
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "weight: contiguous int8 [N, K]");
  const int64_t N = weight.size(0);
  const int64_t K = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x: [rows, ", K, "] (the weight's in_features), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x: float32, bfloat16 or float16, got ", x.scalar_type());
  at::Tensor held;
  const float* sp = checked_scales(scales, N, held);
  const int64_t M = x.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.const_data_ptr<float>();
  const int8_t* wp = weight.const_data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  over_weight_rows(wp, N, K, [&](int64_t n, auto w) {
    rows_against<decltype(w)::value>(xp, M, K, wp + n * K, sp ? sp + n : nullptr, op + n, N);
  });
  return out;
}

// int8_linear_bf16: the same, for bf16 x on a CPU with AVX512-BF16. The int8 values are exact
// in bf16 (|q| <= 127: 7 significant bits), so 32 of a weight row's values against 32 of x's go
// into one VDPBF16PS (exact products, float32 sums in 16 lanes), twice the float32 FMA's work
// a vector. Each output: its lanes' chains over k in steps of 32, reduced in a fixed order, the
// K tail added after, times the row's scale; as above, never dependent on M.
#if defined(CPU_CAPABILITY_AVX512)

// 32 int8 weights as 32 bf16, in order.
CP_BF16 inline __m512bh load_int8_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values in the low half
}

// The sums of 4 vectors' 16 lanes (4 outputs), in one tree for every output whatever sits beside
// it: lanes i + (i + 8), then + 4, then (0 + 2) + (1 + 3). Transposing 4 outputs through it
// takes ~4 instructions an output; reducing each vector alone took ~10, a third of the lm_head's
// time at 16 rows.
CP_BF16 inline void reduce4(__m512 v0, __m512 v1, __m512 v2, __m512 v3, float (&sums)[4]) {
  // i + (i + 8): outputs 0 and 1 in one vector, 8 lanes each; 2 and 3 in another.
  const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  // + 4: output k in 128-bit block k.
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  // (0 + 2), (1 + 3), then their sum, in each block's lane 0.
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_ps(c, c, 0x4E));
  const __m512 e = _mm512_add_ps(d, _mm512_shuffle_ps(d, d, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, e);
  for (int k = 0; k < 4; ++k) sums[k] = lanes[4 * k];
}

template <int ROWS, int W>
CP_BF16 void tile_bf16(const c10::BFloat16* x, int64_t K, const int8_t* w, const float* scales, float* out,
                       int64_t ldo) {
  const int64_t kv = K - K % 32;
  __m512 acc[ROWS][W];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kv; k += 32) {
    __m512bh wv[W];
    for (int j = 0; j < W; ++j) wv[j] = load_int8_bf16(w + j * K + k);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * K + k));
      for (int j = 0; j < W; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], a);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float sums[4];
    if constexpr (W == 4)
      reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], sums);
    else
      reduce4(acc[r][0], acc[r][0], acc[r][0], acc[r][0], sums);  // one output: the same tree
    for (int j = 0; j < W; ++j) {
      float sum = sums[j];
      for (int64_t k = kv; k < K; ++k) sum += static_cast<float>(x[r * K + k]) * static_cast<float>(w[j * K + k]);
      out[r * ldo + j] = scales ? sum * scales[j] : sum;
    }
  }
}

template <int W>
void rows_against_bf16(const c10::BFloat16* x, int64_t M, int64_t K, const int8_t* w, const float* scales, float* out,
                       int64_t ldo) {
  controlplane::over_row_tiles<6>(M, [&](int64_t m, auto rows) {
    tile_bf16<decltype(rows)::value, W>(x + m * K, K, w, scales, out + m * ldo, ldo);
  });
}
#endif

at::Tensor int8_linear_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales) {
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(controlplane::bf16_dot_supported(), "int8_linear_bf16: this CPU has no AVX512-BF16");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "weight: contiguous int8 [N, K]");
  const int64_t N = weight.size(0);
  const int64_t K = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "x: bf16 [rows, ", K, "] (the weight's in_features), got ", x.scalar_type(), " ", x.sizes());
  at::Tensor held;
  const float* sp = checked_scales(scales, N, held);
  const int64_t M = x.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
  const int8_t* wp = weight.const_data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  over_weight_rows(wp, N, K, [&](int64_t n, auto w) {
    rows_against_bf16<decltype(w)::value>(xp, M, K, wp + n * K, sp ? sp + n : nullptr, op + n, N);
  });
  return out;
#else
  TORCH_CHECK(false, "int8_linear_bf16: not built for AVX512 here");
  return at::Tensor();
#endif
}

}  // namespace


TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_bf16", &int8_linear_bf16);
}
