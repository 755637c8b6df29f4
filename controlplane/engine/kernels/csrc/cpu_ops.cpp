// CPU kernels of our own, built by controlplane/engine/kernels/cpu_ops.py (torch's
// cpp_extension, with the vector ISA flags inductor picks for this machine).
//
// paged_decode_attention: attention of single-token queries over the paged KV cache, read in
// place through each row's block table: no gather into a contiguous copy, no padding mask,
// no per-bucket SDPA call. The query heads of a KV group share every K/V row loaded (GQA
// without expansion). Scores, softmax and the weighted sum run in float32 whatever the
// storage, but for bf16 queries on a bf16 cache where the CPU has AVX512-BF16: their scores
// come from bf16 dot products (vdpbf16ps: exact products, float32 sums) and so does the
// weighted sum of V, the probabilities rounded to bf16 for it (1.6x the float path on
// SmolLM2's 16 rows of 200 tokens, 250 against 420 us a layer). 8-bit caches (int8, fp8
// e4m3) apply their per-(slot, head) scales to the score (K) and to the probability (V), so
// the dequantized cache is never materialized. A row's context is cut into partitions of
// kPartition tokens, one work item each (flash-decoding: a long row uses every thread),
// merged in a fixed order; how a row is cut depends on its own length only, so its output
// does not depend on which other rows share the step (batch invariance).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_dot.h"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// One row of D stored values -> float32 (vectorizes for float / bf16 / half / int8).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bf16 -> float is a 16-bit shift; spelled out so that it vectorizes (c10's conversion did
// not: a bf16 cache ran 2x slower than an int8 one).
template <>
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

constexpr int64_t kTile = 16;  // tokens scored together (a multiple of the vector width)
static_assert(kTile % kLanes == 0, "kTile must be a multiple of the vector width");
constexpr int64_t kChunk = 4;  // V rows accumulated per load and store of the accumulator
// Context tokens per work item: a row longer than this is split over threads. 128 rather than
// 256: one conversation of 129-256 tokens then uses both cores of a 2-core Zen 4 (one row of
// 200-250 tokens, medians of three runs: 11-18 against 13-27 us a layer), 16 rows the same.
constexpr int64_t kPartition = 128;

// y += sum over j < c of w[j] * x[j * stride : j * stride + n]  (c <= kChunk).
inline void weighted_sum(const float* w, const float* x, int64_t stride, int64_t c, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec a = Vec::loadu(y + i);
    for (int64_t j = 0; j < c; ++j) a = at::vec::fmadd(Vec(w[j]), Vec::loadu(x + j * stride + i), a);
    a.store(y + i);
  }
  for (; i < n; ++i)
    for (int64_t j = 0; j < c; ++j) y[i] += w[j] * x[j * stride + i];
}

// exp(x - m) in place over n floats; returns their sum.
inline float exp_sum(float* x, float m, int64_t n) {
  int64_t i = 0;
  const Vec mv(m);
  Vec acc(0.f);
  for (; i + kLanes <= n; i += kLanes) {
    Vec e = (Vec::loadu(x + i) - mv).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float s = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

// Ask for the cache rows of tokens [from, to) ahead of their use: a row's tokens jump from
// block to block, which the hardware prefetcher does not follow. LOCALITY: __builtin_prefetch's
// (3: into L1; 2: into L2, for rows read a while later).
template <int LOCALITY = 3, typename CT, typename SlotOf>
inline void prefetch_rows(const CT* base, const SlotOf& slot_of, int64_t from, int64_t to, int64_t slot_len) {
  for (int64_t t = from; t < to; ++t) {
    const char* p = reinterpret_cast<const char*>(base + slot_of(t) * slot_len);
    for (int64_t b = 0; b < slot_len * static_cast<int64_t>(sizeof(CT)); b += 64) __builtin_prefetch(p + b, 0, LOCALITY);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 queries on a bf16 cache, where the CPU has AVX512-BF16 (checked at run time: the build's
// flags stop at AVX512-VNNI, so these functions compile under CP_BF16, csrc/bf16_dot.h).

// Lane j of the result: the sum of a[j]'s 16 lanes (a transpose and add in four rounds, 45
// instructions for 16 horizontal sums).
CP_BF16 inline __m512 sum_lanes_16(const __m512 (&a)[16]) {
  __m512 s[8], u[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: a[2k] lanes 0+2, a[2k+1] 0+2, a[2k] 1+3, ...
    s[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: its partial sum of a[4k + e] in element e
    const __m512d x = _mm512_castps_pd(s[2 * k]), y = _mm512_castps_pd(s[2 * k + 1]);
    u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Then the four 128-bit lanes' partials of each u[k], summed into 128-bit lane k.
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// Unscaled scores of one bf16 query head against the bf16 K rows (KV head g) of up to 16 tokens
// at `slots`: vdpbf16ps takes the stored bytes as they are, two dims a lane, with no widening
// to float32 and no transpose (the float path's work per token, 3x the instructions).
template <int64_t DIM>
CP_BF16 inline __m512 bf16_scores(const c10::BFloat16* qh, const c10::BFloat16* k_cache, const int64_t* slots, int m,
                                  int64_t g, int64_t slot_len) {
  constexpr int kC = DIM / 32;
  __m512bh qv[kC];
  for (int c = 0; c < kC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qh + 32 * c);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    if (j >= m) continue;
    const c10::BFloat16* kr = k_cache + slots[j] * slot_len + g * DIM;
    for (int c = 0; c < kC; ++c) acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
  }
  return sum_lanes_16(acc);
}

// Scaled scores of every query head of a row (`qr`: heads x DIM) against `len` tokens at
// `slots`, 16 tokens at a time, into scores[h * kPartition + t].
// The next tile's K rows are asked for ahead (the hardware prefetcher does not follow a row's
// blocks), and its V rows too, into L2, for bf16_partition_values to find there.
template <int64_t DIM>
CP_BF16 void bf16_partition_scores(const c10::BFloat16* qr, const c10::BFloat16* k_cache,
                                   const c10::BFloat16* v_cache, const int64_t* slots, int64_t len, int64_t kv_heads,
                                   int64_t group, int64_t slot_len, float scale, float* scores) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, len - t0));
    const auto slot_of = [slots](int64_t t) { return slots[t]; };
    prefetch_rows(k_cache, slot_of, t0 + 16, std::min(t0 + 32, len), slot_len);
    prefetch_rows<2>(v_cache, slot_of, t0 + 16, std::min(t0 + 32, len), slot_len);
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const __m512 sc = _mm512_mul_ps(bf16_scores<DIM>(qr + h * DIM, k_cache, slots + t0, m, g, slot_len), sv);
        _mm512_mask_storeu_ps(scores + h * kPartition + t0, static_cast<__mmask16>((1u << m) - 1), sc);
      }
  }
}

// acc[h] = sum over tokens t < len of p[h][t] * V[t] (KV head g's DIM values) for NH query heads,
// by bf16 dot products: two tokens a lane pair, so each vdpbf16ps does 32 multiply-adds on the
// stored V bytes as they are (the float path widens every V row to float32 first, then 16 FMAs
// an instruction). Two V rows interleaved by unpacklo/hi give the pairs; that puts the dims in
// the order (0-3, 8-11, ...) / (4-7, 12-15, ...) per 32, undone once at the end. The NH x DIM/16
// sums stay in registers for the whole partition. `pb`: NH rows of `stride` bf16 probabilities,
// zero past len (an odd tail pairs the last row with itself, times zero).
template <int64_t DIM, int NH>
CP_BF16 inline void bf16_weighted_sum(const uint16_t* pb, int64_t stride, const c10::BFloat16* v_cache,
                                      const int64_t* slots, int64_t len, int64_t g, int64_t slot_len, float* out) {
  constexpr int kC = DIM / 32;
  __m512 acc[NH][2 * kC];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 2 * kC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 2) {
    if (t + 8 < len) {  // the hardware prefetcher does not follow a row's blocks
      const char* ahead = reinterpret_cast<const char*>(v_cache + slots[t + 8] * slot_len + g * DIM);
      for (int b = 0; b < DIM * 2; b += 64) __builtin_prefetch(ahead + b);
    }
    const c10::BFloat16* v0 = v_cache + slots[t] * slot_len + g * DIM;
    const c10::BFloat16* v1 = t + 1 < len ? v_cache + slots[t + 1] * slot_len + g * DIM : v0;
    __m512bh lo[kC], hi[kC];
    for (int c = 0; c < kC; ++c) {
      const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int h = 0; h < NH; ++h) {
      uint32_t pair;
      std::memcpy(&pair, pb + h * stride + t, sizeof(pair));
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < kC; ++c) {
        acc[h][2 * c] = _mm512_dpbf16_ps(acc[h][2 * c], pp, lo[c]);
        acc[h][2 * c + 1] = _mm512_dpbf16_ps(acc[h][2 * c + 1], pp, hi[c]);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kC; ++c) {
      _mm512_storeu_ps(out + h * DIM + 32 * c, _mm512_permutex2var_ps(acc[h][2 * c], first, acc[h][2 * c + 1]));
      _mm512_storeu_ps(out + h * DIM + 32 * c + 16, _mm512_permutex2var_ps(acc[h][2 * c], second, acc[h][2 * c + 1]));
    }
}

// The unnormalized outputs (heads x DIM, into acc) of a partition whose exp(score - max) are in
// scores[h * kPartition + t]: the probabilities rounded to bf16 (as flash attention rounds P
// before its P.V product: 2^-9 relative at most), then bf16_weighted_sum per KV head, its query
// heads in register-sized runs (24 sums at most). `pb`: heads x (kPartition + 16) scratch.
template <int64_t DIM>
CP_BF16 void bf16_partition_values(const float* scores, uint16_t* pb, const c10::BFloat16* v_cache,
                                   const int64_t* slots, int64_t len, int64_t kv_heads, int64_t group,
                                   int64_t slot_len, float* acc) {
  constexpr int64_t stride = kPartition + 16;
  for (int64_t h = 0; h < kv_heads * group; ++h)
    for (int64_t t = 0; t < len; t += 16) {  // 16 at a time, zeros past len
      const __mmask16 k = static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1);
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, scores + h * kPartition + t));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + h * stride + t), (__m256i)b);
    }
  constexpr int kMax = std::max<int>(1, 24 / (DIM / 16));
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t h = g * group; h < (g + 1) * group;) {
      const int64_t nh = std::min<int64_t>(kMax, (g + 1) * group - h);
      const uint16_t* p = pb + h * stride;
      float* o = acc + h * DIM;
      switch (nh) {
#define CP_HEADS(N)                                                                       \
  case N:                                                                                 \
    if constexpr (N <= kMax) bf16_weighted_sum<DIM, N>(p, stride, v_cache, slots, len, g, slot_len, o); \
    break;
        CP_HEADS(1) CP_HEADS(2) CP_HEADS(3) CP_HEADS(4) CP_HEADS(5) CP_HEADS(6)
#undef CP_HEADS
      }
      h += nh;
    }
}
#endif

// DIM: the head dim when it is a compile-time constant (64, 128: the loops over it unroll;
// 1.1-1.3x here), 0 for any other.
template <typename QT, typename CT, int64_t DIM>
void decode_attention(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                      const float* k_scale, const float* v_scale, const at::Tensor& block_table,
                      const at::Tensor& context_lens, int64_t block_size, double sm_scale,
                      const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                      const std::optional<at::Tensor>& slots, bool allow_bf16, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = DIM ? DIM : q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t width = block_table.size(1), slot_len = kv_heads * dim;
  const QT* qp = q.const_data_ptr<QT>();
  const CT* kp = k_cache.const_data_ptr<CT>();
  const CT* vp = v_cache.const_data_ptr<CT>();
  const int64_t* tables = block_table.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  QT* op = out.data_ptr<QT>();
  const float scale = static_cast<float>(sm_scale);
  // bf16 queries on a bf16 cache, on a CPU with AVX512-BF16: scores and the weighted sum by
  // bf16 dot products (bf16_partition_scores, bf16_partition_values).
  constexpr bool kBf16Types = std::is_same_v<QT, c10::BFloat16> && std::is_same_v<CT, c10::BFloat16> &&
                              DIM != 0 && DIM % 32 == 0;
  const bool bf16_dot = kBf16Types && allow_bf16 && controlplane::bf16_dot_supported();
  if (k_new.has_value()) {  // the rows' own K/V first (16/32-bit caches: a cast and a copy)
    const QT* kn = k_new->const_data_ptr<QT>();
    const QT* vn = v_new->const_data_ptr<QT>();
    const int64_t* sp = slots->const_data_ptr<int64_t>();
    CT* kw = k_cache.data_ptr<CT>();
    CT* vw = v_cache.data_ptr<CT>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < slot_len; ++j) {
        kw[sp[i] * slot_len + j] = static_cast<CT>(static_cast<float>(kn[i * slot_len + j]));
        vw[sp[i] * slot_len + j] = static_cast<CT>(static_cast<float>(vn[i * slot_len + j]));
      }
  }

  // Work items: (row, partition of kPartition tokens). A partition reads each slot's K (then
  // V) row of every KV head once, in slot order. (Items of (row, KV head) read a slot's heads
  // in separate sweeps: with 30 layers' caches out of L3, 3x slower here.) Partitions let one
  // long row use every thread; their number depends on the row's own length only, so a row's
  // output stays the same whatever else is in the step.
  std::vector<int64_t> first_item(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(lens[i] >= 1, "context_lens: at least 1 (the row's own token)");
  for (int64_t i = 0; i < n; ++i) first_item[i + 1] = first_item[i] + (lens[i] + kPartition - 1) / kPartition;
  const int64_t items = first_item[n];
  // A split row's partitions leave (max, sum, unnormalized output) per head, merged below.
  std::vector<float> part_max(items * heads), part_sum(items * heads), part_acc(items * heads * dim);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(heads * dim), scores(heads * kPartition);
    // The float path's query, widened rows and transposed tile; the bf16 path's probabilities
    // and the partition's slots.
    std::vector<float> qf(bf16_dot ? 0 : heads * dim), rows(bf16_dot ? 0 : kTile * slot_len);
    std::vector<float> kt(bf16_dot ? 0 : dim * kTile);
    std::vector<uint16_t> pb(bf16_dot ? heads * (kPartition + 16) : 0);
    std::vector<int64_t> slots_p(bf16_dot ? kPartition : 0);
    int64_t i = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (first_item[i + 1] <= item) ++i;
      const int64_t p = item - first_item[i];
      const int64_t lo = p * kPartition, hi = std::min(lens[i], lo + kPartition), len = hi - lo;
      const bool split = first_item[i + 1] - first_item[i] > 1;
      const int64_t* table = tables + i * width;
      auto slot_of = [&](int64_t t) { return table[t / block_size] * block_size + t % block_size; };
      if (bf16_dot) {
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (kBf16Types) {
          for (int64_t t = 0; t < len; ++t) slots_p[t] = slot_of(lo + t);
          bf16_partition_scores<DIM>(qp + i * heads * DIM, kp, vp, slots_p.data(), len, kv_heads, group, slot_len, scale,
                                     scores.data());
        }
#endif
      } else {
        to_float(qp + i * heads * dim, qf.data(), heads * dim);
        for (float& x : qf) x *= scale;
        // Scores, kTile tokens at a time, as a small GEMM: each KV head's K rows of the tile
        // are transposed to [dim][kTile] (tokens across the vector lanes), so a query head's
        // scores for the whole tile are dim broadcast FMAs with no horizontal sums, and the
        // transpose is shared by the group's query heads. (Per-token dot products ended each
        // in a horizontal sum: 1.5-3x slower at 3 and 8 query heads per KV head.)
        for (int64_t t0 = 0; t0 < len; t0 += kTile) {
          const int m = static_cast<int>(std::min(kTile, len - t0));
          int64_t slots_t[kTile];
          for (int j = 0; j < m; ++j) {
            slots_t[j] = slot_of(lo + t0 + j);
            to_float(kp + slots_t[j] * slot_len, rows.data() + j * slot_len, slot_len);
          }
          prefetch_rows(kp, slot_of, lo + t0 + kTile, std::min(lo + t0 + 2 * kTile, hi), slot_len);
          for (int64_t g = 0; g < kv_heads; ++g) {
            at::vec::transpose_mxn<float>(rows.data() + g * dim, slot_len, kt.data(), kTile, m, static_cast<int>(dim));
            float ks[kTile];
            for (int j = 0; j < kTile; ++j) ks[j] = (k_scale && j < m) ? k_scale[slots_t[j] * kv_heads + g] : 1.f;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              Vec sum[kTile / kLanes];
              for (auto& x : sum) x = Vec(0.f);
              const float* qh = qf.data() + h * dim;
              for (int64_t d = 0; d < dim; ++d) {
                const Vec qd(qh[d]);
                for (int64_t v = 0; v < kTile / kLanes; ++v)
                  sum[v] = at::vec::fmadd(qd, Vec::loadu(kt.data() + d * kTile + v * kLanes), sum[v]);
              }
              // Lanes past m hold stale columns of kt; they are never stored.
              for (int64_t v = 0; v < kTile / kLanes && v * kLanes < m; ++v) {
                if (k_scale) sum[v] = sum[v] * Vec::loadu(ks + v * kLanes);
                sum[v].store(scores.data() + h * kPartition + t0 + v * kLanes, std::min<int64_t>(kLanes, m - v * kLanes));
              }
            }
          }
        }
      }
      float* pmax = part_max.data() + item * heads;
      float* psum = part_sum.data() + item * heads;
      for (int64_t h = 0; h < heads; ++h) {
        float* s = scores.data() + h * kPartition;
        pmax[h] = *std::max_element(s, s + len);
        psum[h] = exp_sum(s, pmax[h], len);
      }
      if (bf16_dot) {
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (kBf16Types)
          bf16_partition_values<DIM>(scores.data(), pb.data(), vp, slots_p.data(), len, kv_heads, group, slot_len,
                                     acc.data());
#endif
      } else {
        // Weighted sum of V, kChunk tokens at a time: each head's accumulator is loaded and
        // stored once per chunk rather than once per token.
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t0 = 0; t0 < len; t0 += kChunk) {
          const int64_t c = std::min(kChunk, len - t0);
          int64_t slots_c[kChunk];
          float w[kChunk];
          for (int64_t j = 0; j < c; ++j) {
            slots_c[j] = slot_of(lo + t0 + j);
            to_float(vp + slots_c[j] * slot_len, rows.data() + j * slot_len, slot_len);
          }
          prefetch_rows(vp, slot_of, lo + t0 + 4 * kChunk, std::min(lo + t0 + 5 * kChunk, hi), slot_len);
          for (int64_t g = 0; g < kv_heads; ++g)
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              for (int64_t j = 0; j < c; ++j)
                w[j] = scores[h * kPartition + t0 + j] * (v_scale ? v_scale[slots_c[j] * kv_heads + g] : 1.f);
              weighted_sum(w, rows.data() + g * dim, slot_len, c, acc.data() + h * dim, dim);
            }
        }
      }
      if (split) {
        std::copy(acc.begin(), acc.end(), part_acc.begin() + item * heads * dim);
        continue;
      }
      QT* o = op + i * heads * dim;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = static_cast<QT>(acc[h * dim + d] / psum[h]);
    }
  });

  // Merge the partitions of split rows, in partition order.
  std::vector<float> acc(dim);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = first_item[i], b = first_item[i + 1];
    if (b - a < 2) continue;
    for (int64_t h = 0; h < heads; ++h) {
      float m = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t it = a; it < b; ++it) m = std::max(m, part_max[it * heads + h]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t it = a; it < b; ++it) {
        const float w = std::exp(part_max[it * heads + h] - m);
        total += w * part_sum[it * heads + h];
        const float* pa = part_acc.data() + (it * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * pa[d];
      }
      QT* o = op + (i * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<QT>(acc[d] / total);
    }
  }
}

// The arguments of decode_attention, as dispatch_cache and paged_decode_attention name them.
#define ARGS q, k, v, ks, vs, bt, lens, bs, scale, k_new, v_new, slots, bf16_dot, out
template <typename QT, typename CT>
void with_dim(const at::Tensor& q, at::Tensor& k, at::Tensor& v, const float* ks, const float* vs,
              const at::Tensor& bt, const at::Tensor& lens, int64_t bs, double scale,
              const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
              const std::optional<at::Tensor>& slots, bool bf16_dot, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return decode_attention<QT, CT, 64>(ARGS);
    case 128: return decode_attention<QT, CT, 128>(ARGS);
    default: return decode_attention<QT, CT, 0>(ARGS);
  }
}

template <typename QT>
void dispatch_cache(const at::Tensor& q, at::Tensor& k, at::Tensor& v, const float* ks,
                    const float* vs, const at::Tensor& bt, const at::Tensor& lens, int64_t bs,
                    double scale, const std::optional<at::Tensor>& k_new,
                    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& slots,
                    bool bf16_dot, at::Tensor& out) {
  switch (k.scalar_type()) {
    case at::kFloat: return with_dim<QT, float>(ARGS);
    case at::kBFloat16: return with_dim<QT, c10::BFloat16>(ARGS);
    case at::kHalf: return with_dim<QT, c10::Half>(ARGS);
    case at::kChar: return with_dim<QT, int8_t>(ARGS);
    case at::kFloat8_e4m3fn: return with_dim<QT, c10::Float8_e4m3fn>(ARGS);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported KV cache dtype ", k.scalar_type());
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, at::Tensor& k, at::Tensor& v,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale, const at::Tensor& bt,
                                  const at::Tensor& lens, int64_t bs, double scale,
                                  const std::optional<at::Tensor>& k_new,
                                  const std::optional<at::Tensor>& v_new,
                                  const std::optional<at::Tensor>& slots, bool bf16_dot) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k_cache, v_cache: 3-D");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k_cache and v_cache differ");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0, "head shapes");
  TORCH_CHECK(bt.scalar_type() == at::kLong && bt.dim() == 2 && bt.is_contiguous() && bt.size(0) == q.size(0),
              "block_table: int64 [rows, blocks]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == q.size(0) && lens.is_contiguous(),
              "context_lens: int64 [rows]");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "k_scale and v_scale: both or neither");
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (k_scale.has_value()) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous() && v_scale->is_contiguous(),
                "scales: contiguous float32 [slots, kv heads]");
    ks = k_scale->const_data_ptr<float>();
    vs = v_scale->const_data_ptr<float>();
  }
  TORCH_CHECK(k_new.has_value() == v_new.has_value() && k_new.has_value() == slots.has_value(),
              "k_new, v_new and slot_mapping: all or none");
  if (k_new.has_value()) {
    TORCH_CHECK(!k_scale.has_value(), "an 8-bit cache is written by KVCache.write, not here");
    for (const at::Tensor* t : {&*k_new, &*v_new})
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type() && t->dim() == 3 &&
                      t->size(0) == q.size(0) && t->size(1) == k.size(1) && t->size(2) == k.size(2),
                  "k_new, v_new: contiguous [rows, kv heads, head dim] in q's dtype");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->numel() == q.size(0),
                "slot_mapping: int64 [rows]");
  }
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(ARGS); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(ARGS); break;
    case at::kHalf: dispatch_cache<c10::Half>(ARGS); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

// The decode step that a compiled graph's attention reads (step_attention), set around each
// compiled forward by CpuPagedAttention.begin_step. Per thread: the decode step compiles on a
// thread of its own while the step thread serves. Why not the Python custom op
// (attention.paged_attention): with it, attention took 0.63 ms of SmolLM2's batch-1 step
// around 0.32 ms of kernel, 30 calls; with this op the step went from 7.25 to 6.34 ms.
struct DecodeStep {
  std::vector<at::Tensor> k, v;  // every layer's cache
  at::Tensor block_table, context_lens, slots;
  int64_t block_size;
  double scale;
  bool bf16_dot;
};
thread_local std::optional<DecodeStep> t_step;

void set_decode_step(at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                     const at::Tensor& context_lens, const at::Tensor& slot_mapping, int64_t block_size,
                     double sm_scale, bool bf16_dot) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "k_caches and v_caches: one per layer each");
  t_step = DecodeStep{k_caches.vec(), v_caches.vec(), block_table, context_lens, slot_mapping, block_size,
                      sm_scale, bf16_dot};
}

void clear_decode_step() { t_step.reset(); }

// One layer's decode attention for this thread's step: the rows' K/V written, then read back.
at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer) {
  TORCH_CHECK(t_step.has_value(), "step_attention called outside a decode step (set_decode_step)");
  DecodeStep& s = *t_step;
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(s.k.size()), "layer ", layer, " of ", s.k.size());
  const auto dtype = q.scalar_type();
  return paged_decode_attention(q.contiguous(), s.k[layer], s.v[layer], std::nullopt, std::nullopt, s.block_table,
                                s.context_lens, s.block_size, s.scale, k.to(dtype).contiguous(),
                                v.to(dtype).contiguous(), s.slots, s.bf16_dot);
}

}  // namespace

// The schemas are in engine/kernels/ops.py (every op's, with its fake); here the kernels.
// No tensor to dispatch on (or only lists): one catch-all kernel whatever the device.
TORCH_LIBRARY_FRAGMENT(controlplane_cpu, m) {
  m.impl("set_decode_step", &set_decode_step);
  m.impl("clear_decode_step", &clear_decode_step);
}

TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("step_attention", &step_attention);
}

