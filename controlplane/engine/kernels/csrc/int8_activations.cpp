// Linears whose activations are rounded to int8 per 32 values on the way in and whose dot
// products are summed in integers (engine.quantize_activations): GGUF's Q8_1 activations,
// the scheme llama.cpp decodes one token with.
//
// Why: torch's int4 CPU kernel and our int8 one widen every weight and every activation to
// float32 and multiply in float FMAs; for one row on a 2-core AVX2 EPYC they were bound by that
// arithmetic, not by memory (5-7 GB/s of its 14). Here a group of 32 weights against 32 int8
// activations is two integer instructions (maddubs, madd; one vpdpbusd with VNNI) and one
// float FMA.
//
// Activations, per row and group of 32: x ~ d * xq, d = max|x| / 127, xq = round(x / d) (half
// to even), int8. A row's result never depends on how many rows share the call: integer sums
// are exact and the float ones run in a fixed order (batch invariance).
//
// w4a8_linear: a 4-bit weight, [N, K / 2] bytes: for group g of row n, bytes 16g .. 16g + 15
// hold the values of k = 32g + j in their low nibble and k = 32g + 16 + j in their high nibble
// (as GGUF's Q4_1 blocks do). Its value is q * scale + min, scale and min float16 [N, K / 32]
// each (a GGUF Q4_1 file's own numbers, exactly). Then
//   y[m, n] = sum_g scale[n, g] d[m, g] (sum_j q xq) + min[n, g] (d[m, g] sum_j xq).
// w8a8_linear: an int8 weight [N, K] with one float32 scale per row (our lm_head):
//   y[m, n] = scale[n] sum_g d[m, g] (sum_j w xq).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "prefetch.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
// Rows of x per pass over a weight row: each unpacked group is used this many times.
constexpr int kRows = 4;
// Weight rows per pass: 4 x 2 accumulators, 2 unpacked groups and the constants fit 16 ymm.
constexpr int kW = 2;
// Weight rows per parallel task.
constexpr int64_t kTaskRows = 16;
// How far ahead (weight rows) the next rows' bytes are prefetched.
constexpr int64_t kPrefetchRows = 8;

// One row of x as int8 per group, its groups' d and d * sum(xq).
void quantize_row(const float* x, int64_t K, int8_t* xq, float* d, float* dsum) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < kGroup; ++j) {
      amax = std::max(amax, std::fabs(xg[j]));
      finite = finite && std::isfinite(xg[j]);
    }
    // A NaN or infinite activation makes its row's outputs NaN, as a float matmul would: a
    // broken model shows as NaN, not as plausible logits rounded from it.
    const float dg = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const float id = finite && dg > 0.0f ? 1.0f / dg : 0.0f;
    int sum = 0;
    for (int j = 0; j < kGroup; ++j) {
      const int v = static_cast<int>(std::nearbyint(xg[j] * id));
      xq[g * kGroup + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[g] = dg;
    dsum[g] = dg * static_cast<float>(sum);
  }
}

#if defined(__AVX2__)
// Sum of the products of 4 unsigned bytes of u with 4 signed bytes of s, per int32 lane. With
// VNNI (AVX512-VNNI or AVX-VNNI) one vpdpbusd; else maddubs + madd, exact here too: a pair of
// products stays within int16 (W4A8: 2 * 15 * 127; W8A8: 2 * 128 * 127).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// AVX512 with VNNI: the kernels below take two groups a 512-bit vector (lanes 0-7 group g,
// 8-15 group g + 1), one vpdpbusd for 64 products.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define CONTROLPLANE_TWO_GROUPS 1

// p[0] in lanes 0-7, p[1] in lanes 8-15: a per-group number for two groups.
inline __m512 per_group_pair(const float* p) {
  return _mm512_insertf32x8(_mm512_set1_ps(p[0]), _mm256_set1_ps(p[1]), 1);
}

// Each two-group accumulator folded into its 8-lane one (group g's lanes plus g + 1's).
template <int R, int W>
inline void fold_pairs(const __m512 (&acc2)[R][W], __m256 (&acc)[R][W]) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j)
      acc[r][j] = _mm256_add_ps(_mm512_castps512_ps256(acc2[r][j]), _mm512_extractf32x8_ps(acc2[r][j], 1));
}
#endif

// W weight rows' scales and mins as float32, [W][G] each.
template <int W>
void load_scales(const at::Half* scale, const at::Half* mins, int64_t G, float* sc, float* mn) {
  for (int w = 0; w < W; ++w) {
    int64_t g = 0;
#if defined(__F16C__)
    for (; g + 8 <= G; g += 8) {
      _mm256_storeu_ps(sc + w * G + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + w * G + g))));
      _mm256_storeu_ps(mn + w * G + g, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + w * G + g))));
    }
#endif
    for (; g < G; ++g) {
      sc[w * G + g] = static_cast<float>(scale[w * G + g]);
      mn[w * G + g] = static_cast<float>(mins[w * G + g]);
    }
  }
}

// R rows of x (their int8 groups xq, d, dsum; row strides K and G) against W weight rows w
// (row stride K / 2) whose scales and mins are sc, mn ([W][G] float32). out: [R][W], stride ldo.
template <int R, int W>
void tile(const uint8_t* w, const float* sc, const float* mn, const int8_t* xq, const float* d, const float* dsum,
          int64_t K, float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
#if defined(__AVX2__)
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t g = 0;
#if defined(CONTROLPLANE_TWO_GROUPS)
  // Two groups a vector: one vpdpbusd, then one multiply and one FMA, each lane scaled by
  // its group's d * scale.
  {
    __m512 acc2[R][W];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < W; ++j) acc2[r][j] = _mm512_setzero_ps();
    const __m256i low4x2 = _mm256_set1_epi8(0x0F);
    for (; g + 2 <= G; g += 2) {
      __m512i q[W];
      __m512 s[W];
      for (int j = 0; j < W; ++j) {
        // 32 bytes: group g's 16 then group g + 1's; each byte two features (low: k, high: k + 16).
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * (K / 2) + g * (kGroup / 2)));
        const __m256i lo = _mm256_and_si256(b, low4x2);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4x2);
        // [lo g, lo g+1, hi g, hi g+1] -> [lo g, hi g, lo g+1, hi g+1]: features in order.
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        q[j] = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
        s[j] = per_group_pair(sc + j * G + g);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_loadu_si512(xq + r * K + g * kGroup);
        const __m512 dr = per_group_pair(d + r * G + g);
        for (int j = 0; j < W; ++j) {
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q[j], a));
          acc2[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dr), s[j], acc2[r][j]);
        }
      }
    }
    fold_pairs(acc2, acc);
  }
#endif
  for (; g < G; ++g) {
    __m256i q[W];
    for (int j = 0; j < W; ++j) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * (K / 2) + g * (kGroup / 2)));
      q[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
    }
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * kGroup));
      const __m256 dr = _mm256_broadcast_ss(d + r * G + g);
      for (int j = 0; j < W; ++j) {
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(q[j], a));
        acc[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(dot, dr), _mm256_broadcast_ss(sc + j * G + g), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < W; ++j) {
      __m256 m = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= G; g += 8)
        m = _mm256_fmadd_ps(_mm256_loadu_ps(mn + j * G + g), _mm256_loadu_ps(dsum + r * G + g), m);
      float tail = 0.0f;
      for (; g < G; ++g) tail += mn[j * G + g] * dsum[r * G + g];
      out[r * ldo + j] = hsum(acc[r][j]) + hsum(m) + tail;
    }
  }
#else
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < W; ++j) {
      float total = 0.0f;
      float m = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int dot = 0;
        for (int i = 0; i < kGroup / 2; ++i) {
          const uint8_t b = w[j * (K / 2) + g * (kGroup / 2) + i];
          dot += (b & 15) * xq[r * K + g * kGroup + i] + (b >> 4) * xq[r * K + g * kGroup + 16 + i];
        }
        total += static_cast<float>(dot) * d[r * G + g] * sc[j * G + g];
        m += mn[j * G + g] * dsum[r * G + g];
      }
      out[r * ldo + j] = total + m;
    }
  }
#endif
}

// All M rows of x against W weight rows.
template <int W>
void rows_against(const uint8_t* w, const at::Half* scale, const at::Half* mins, const int8_t* xq, const float* d,
                  const float* dsum, int64_t M, int64_t K, float* out, int64_t ldo, float* sc, float* mn) {
  const int64_t G = K / kGroup;
  load_scales<W>(scale, mins, G, sc, mn);
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows)
    tile<kRows, W>(w, sc, mn, xq + m * K, d + m * G, dsum + m * G, K, out + m * ldo, ldo);
  for (; m < M; ++m) tile<1, W>(w, sc, mn, xq + m * K, d + m * G, dsum + m * G, K, out + m * ldo, ldo);
}

// R rows of x (row strides K and G) against W int8 weight rows w (row stride K), scaled by
// scales[0 .. W). out: [R][W], stride ldo.
template <int R, int W>
void tile8(const int8_t* w, const float* scales, const int8_t* xq, const float* d, int64_t K, float* out,
           int64_t ldo) {
  const int64_t G = K / kGroup;
#if defined(__AVX2__)
  __m256 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) acc[r][j] = _mm256_setzero_ps();
  int64_t g = 0;
#if defined(CONTROLPLANE_TWO_GROUPS)
  // Two groups a vector, as in tile(): |w| against x negated where w is negative.
  {
    __m512 acc2[R][W];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < W; ++j) acc2[r][j] = _mm512_setzero_ps();
    for (; g + 2 <= G; g += 2) {
      __m512i wabs[W];
      __mmask64 neg[W];
      for (int j = 0; j < W; ++j) {
        const __m512i wv = _mm512_loadu_si512(w + j * K + g * kGroup);
        wabs[j] = _mm512_abs_epi8(wv);  // |-128| = 128 as an unsigned byte
        neg[j] = _mm512_movepi8_mask(wv);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_loadu_si512(xq + r * K + g * kGroup);
        const __m512 dr = per_group_pair(d + r * G + g);
        for (int j = 0; j < W; ++j) {
          const __m512i sa = _mm512_mask_sub_epi8(a, neg[j], _mm512_setzero_si512(), a);
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs[j], sa));
          acc2[r][j] = _mm512_fmadd_ps(dot, dr, acc2[r][j]);
        }
      }
    }
    fold_pairs(acc2, acc);
  }
#endif
  for (; g < G; ++g) {
    __m256i wv[W], wabs[W];
    for (int j = 0; j < W; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + g * kGroup));
      wabs[j] = _mm256_sign_epi8(wv[j], wv[j]);  // |w| as unsigned bytes (|-128| = 128)
    }
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * kGroup));
      const __m256 dr = _mm256_broadcast_ss(d + r * G + g);
      for (int j = 0; j < W; ++j) {
        // |w| * (x with w's sign) == w * x.
        const __m256i dot = dot_u8s8(wabs[j], _mm256_sign_epi8(a, wv[j]));
        acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dr, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < W; ++j) out[r * ldo + j] = hsum(acc[r][j]) * scales[j];
#else
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < W; ++j) {
      float total = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        int dot = 0;
        for (int i = 0; i < kGroup; ++i) dot += w[j * K + g * kGroup + i] * xq[r * K + g * kGroup + i];
        total += static_cast<float>(dot) * d[r * G + g];
      }
      out[r * ldo + j] = total * scales[j];
    }
  }
#endif
}

struct Quantized {
  at::Tensor xq, d, dsum;
};

// x [M, K] (any float dtype) as int8 groups of 32 (see the top of the file).
Quantized quantize_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x: [rows, ", K, "] (the weight's in_features), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x: float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t M = x.size(0);
  const int64_t G = K / kGroup;
  at::Tensor xf = x.to(at::kFloat).contiguous();
  Quantized q{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, G}, x.options().dtype(at::kFloat)),
              at::empty({M, G}, x.options().dtype(at::kFloat))};
  const float* xp = xf.const_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xp + m * K, K, q.xq.data_ptr<int8_t>() + m * K, q.d.data_ptr<float>() + m * G,
                 q.dsum.data_ptr<float>() + m * G);
  return q;
}

template <int W>
void rows_against8(const int8_t* w, const float* scales, const int8_t* xq, const float* d, int64_t M, int64_t K,
                   float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile8<kRows, W>(w, scales, xq + m * K, d + m * G, K, out + m * ldo, ldo);
  for (; m < M; ++m) tile8<1, W>(w, scales, xq + m * K, d + m * G, K, out + m * ldo, ldo);
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "weight: contiguous int8 [N, K]");
  const int64_t N = weight.size(0);
  const int64_t K = weight.size(1);
  TORCH_CHECK(K % kGroup == 0, "in_features ", K, " is not a multiple of ", kGroup);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == N,
              "scales: contiguous float32 [", N, "], got ", scales.scalar_type(), " ", scales.sizes());
  const Quantized q = quantize_rows(x, K);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int8_t* wp = weight.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const int8_t* qp = q.xq.const_data_ptr<int8_t>();
  const float* dp = q.d.const_data_ptr<float>();
  // 64 weight rows a task (36 KB of SmolLM2's lm_head) stay in L2 while every row block passes.
  at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t begin, int64_t end) {
    const int64_t n1 = std::min(N, end * 64);
    int64_t n = begin * 64;
    for (; n + kW <= n1; n += kW) {
      controlplane::prefetch(wp + (n + kPrefetchRows) * K, kW * K, wp + N * K);
      rows_against8<kW>(wp + n * K, sp + n, qp, dp, M, K, op + n, N);
    }
    for (; n < n1; ++n) rows_against8<1>(wp + n * K, sp + n, qp, dp, M, K, op + n, N);
  });
  return out;
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous(),
              "weight: contiguous uint8 [N, K / 2]");
  const int64_t N = weight.size(0);
  const int64_t K = weight.size(1) * 2;
  TORCH_CHECK(K % kGroup == 0, "in_features ", K, " is not a multiple of ", kGroup);
  const int64_t G = K / kGroup;
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G,
                "scales and mins: contiguous float16 [", N, ", ", G, "], got ", t->scalar_type(), " ", t->sizes());
  }
  const Quantized xq = quantize_rows(x, K);
  const int64_t M = x.size(0);
  const int8_t* qp = xq.xq.const_data_ptr<int8_t>();
  const float* dp = xq.d.const_data_ptr<float>();
  const float* sp = xq.dsum.const_data_ptr<float>();

  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const uint8_t* wp = weight.const_data_ptr<uint8_t>();
  const at::Half* scp = scales.const_data_ptr<at::Half>();
  const at::Half* mnp = mins.const_data_ptr<at::Half>();
  at::parallel_for(0, (N + kTaskRows - 1) / kTaskRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(kW * G), mn(kW * G);
    const int64_t n1 = std::min(N, end * kTaskRows);
    int64_t n = begin * kTaskRows;
    for (; n + kW <= n1; n += kW) {
      controlplane::prefetch(wp + (n + kPrefetchRows) * (K / 2), kW * (K / 2), wp + N * (K / 2));
      controlplane::prefetch(scp + (n + kPrefetchRows) * G, kW * G, scp + N * G);
      controlplane::prefetch(mnp + (n + kPrefetchRows) * G, kW * G, mnp + N * G);
      rows_against<kW>(wp + n * (K / 2), scp + n * G, mnp + n * G, qp, dp, sp, M, K, op + n, N, sc.data(), mn.data());
    }
    for (; n < n1; ++n)
      rows_against<1>(wp + n * (K / 2), scp + n * G, mnp + n * G, qp, dp, sp, M, K, op + n, N, sc.data(), mn.data());
  });
  return out;
}

}  // namespace


TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) {
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w8a8_linear", &w8a8_linear);
}
