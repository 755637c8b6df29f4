// int4_dequantize: torch's CPU int4 weight (as `_convert_weight_to_int4pack_for_cpu` packs it)
// back to a bf16 matrix, transposed: [K, N], ready for one oneDNN GEMM over many rows.
//
// Why: `_weight_int4pack_mm_for_cpu` dequantizes its weight again for every 4 rows of
// activations, so a 512-token prompt chunk pays for 128 dequantizations of each weight. One
// dequantization per call, then a bf16 GEMM, costs a transient [K, N] bf16 buffer instead
// of the resident bf16 copy `int4_dense_copy` keeps (4x the int4 bytes).
//
// torch's packed layout (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack):
// rows in blocks of `block_n` (64 under AVX512, 32 otherwise), each block [K, nb / 2] bytes.
// A full block under AVX512 / AVX2 is "split": for each k, the low nibbles of its nb / 2
// bytes are rows 0 .. nb/2 - 1 in order and the high nibbles rows nb/2 .. nb - 1 (torch
// interleaves its 128-bit lanes so that this comes out in order). Partial blocks, and every
// block of the scalar build, pair neighbours: byte j holds row 2j low, row 2j + 1 high.
// The Python side checks the layout against the unpacked values once per weight, so a torch
// that packs differently turns this path off instead of computing garbage.
//
// w[n, k] = (q - 8) * scale[k / group, n] + zero[k / group, n], in float32, rounded to bf16
// once (what the dense copy holds).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>

namespace {

// A group's (scale, zero) pairs for NB rows, as floats, the -8 folded into the zero.
template <int64_t NB, typename ST>
inline void load_group(const ST* g, float* scale, float* zero) {
  for (int64_t n = 0; n < NB; ++n) {
    scale[n] = static_cast<float>(g[2 * n]);
    zero[n] = static_cast<float>(g[2 * n + 1]) - 8.0f * scale[n];
  }
}

// One block of NB rows, portable C++ (the paired layouts, and a build without AVX2).
template <int64_t NB, bool SPLIT, typename ST>
void dequantize_block(const uint8_t* src, const ST* sz, int64_t n0, int64_t N, int64_t K, int64_t group,
                      c10::BFloat16* out) {
  alignas(64) float q[NB];
  alignas(64) float w[NB];
  alignas(64) float scale[NB];
  alignas(64) float zero[NB];
  constexpr int64_t half = NB / 2;
  int64_t next_group = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (k == next_group) {  // (a modulo per k cost more than the rest of the loop)
      load_group<NB>(sz + (k / group) * N * 2 + n0 * 2, scale, zero);
      next_group += group;
    }
    const uint8_t* b = src + k * half;
    for (int64_t j = 0; j < half; ++j) {
      q[SPLIT ? j : 2 * j] = static_cast<float>(b[j] & 15);
      q[SPLIT ? j + half : 2 * j + 1] = static_cast<float>(b[j] >> 4);
    }
    for (int64_t n = 0; n < NB; ++n) w[n] = q[n] * scale[n] + zero[n];
    at::vec::convert(w, out + k * N + n0, NB);
  }
}

// The split layouts in intrinsics: the portable loop above compiles to half-width
// conversions through a stack array (store-forwarding stalls): 0.6 ns a weight on one
// AVX512 core, where this runs at ALL_NS.
#if defined(CPU_CAPABILITY_AVX512)
inline __m256i to_bf16(__m512 x) {  // round to nearest even, as c10::BFloat16
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
  return at::vec::cvtfp32_bf16(x);
#endif
}

template <typename ST>
void dequantize_split64(const uint8_t* src, const ST* sz, int64_t n0, int64_t N, int64_t K, int64_t group,
                        c10::BFloat16* out) {
  alignas(64) float scale[64];
  alignas(64) float zero[64];
  __m512 vs[4], vz[4];
  const __m256i low = _mm256_set1_epi8(15);
  int64_t next_group = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (k == next_group) {
      load_group<64>(sz + (k / group) * N * 2 + n0 * 2, scale, zero);
      next_group += group;
      for (int j = 0; j < 4; ++j) vs[j] = _mm512_load_ps(scale + 16 * j), vz[j] = _mm512_load_ps(zero + 16 * j);
    }
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k * 32));
    const __m256i lo = _mm256_and_si256(bytes, low);                         // rows 0 .. 31
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);  // rows 32 .. 63
    const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                             _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    c10::BFloat16* row = out + k * N + n0;
    for (int j = 0; j < 4; ++j) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part[j]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16 * j),
                          to_bf16(_mm512_fmadd_ps(q, vs[j], vz[j])));
    }
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
template <typename ST>
void dequantize_split32(const uint8_t* src, const ST* sz, int64_t n0, int64_t N, int64_t K, int64_t group,
                        c10::BFloat16* out) {
  alignas(64) float scale[32];
  alignas(64) float zero[32];
  __m256 vs[4], vz[4];
  const __m128i low = _mm_set1_epi8(15);
  int64_t next_group = 0;
  for (int64_t k = 0; k < K; ++k) {
    if (k == next_group) {
      load_group<32>(sz + (k / group) * N * 2 + n0 * 2, scale, zero);
      next_group += group;
      for (int j = 0; j < 4; ++j) vs[j] = _mm256_load_ps(scale + 8 * j), vz[j] = _mm256_load_ps(zero + 8 * j);
    }
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * 16));
    const __m128i lo = _mm_and_si128(bytes, low);                      // rows 0 .. 15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);  // rows 16 .. 31
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    c10::BFloat16* row = out + k * N + n0;
    for (int j = 0; j < 4; ++j) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[j]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 8 * j),
                       at::vec::cvtfp32_bf16(_mm256_fmadd_ps(q, vs[j], vz[j])));
    }
  }
}
#endif

template <typename ST>
void dequantize_rows(const uint8_t* src, const ST* sz, int64_t n0, int64_t nb, bool split, int64_t N,
                     int64_t K, int64_t group, c10::BFloat16* out) {
  // Full blocks are 64 (AVX512) or 32 rows; a partial block (16, 32 or 48 rows) pairs rows.
#if defined(CPU_CAPABILITY_AVX512)
  if (split && nb == 64) return dequantize_split64(src, sz, n0, N, K, group, out);
#elif defined(CPU_CAPABILITY_AVX2)
  if (split && nb == 32) return dequantize_split32(src, sz, n0, N, K, group, out);
#endif
  if (split && nb == 64) return dequantize_block<64, true>(src, sz, n0, N, K, group, out);
  if (split && nb == 32) return dequantize_block<32, true>(src, sz, n0, N, K, group, out);
  switch (nb) {
    case 64: return dequantize_block<64, false>(src, sz, n0, N, K, group, out);
    case 48: return dequantize_block<48, false>(src, sz, n0, N, K, group, out);
    case 32: return dequantize_block<32, false>(src, sz, n0, N, K, group, out);
    case 16: return dequantize_block<16, false>(src, sz, n0, N, K, group, out);
    default: TORCH_CHECK(false, "int4_dequantize: a block of ", nb, " rows (expected 16, 32, 48 or 64)");
  }
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& scales_and_zeros, int64_t group_size,
                           int64_t block_n, bool split) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed: contiguous uint8 [N, K / 2]");
  const int64_t N = packed.size(0);
  const int64_t K = packed.size(1) * 2;
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.is_contiguous() && scales_and_zeros.size(1) == N &&
                  scales_and_zeros.size(2) == 2,
              "scales_and_zeros: contiguous [K / group_size, N, 2]");
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && scales_and_zeros.size(0) == K / group_size,
              "group_size ", group_size, " does not divide K = ", K, " into ", scales_and_zeros.size(0), " groups");
  TORCH_CHECK((block_n == 32 || block_n == 64) && N % 16 == 0, "block_n: 32 or 64; N: a multiple of 16");
  at::Tensor out = at::empty({K, N}, packed.options().dtype(at::kBFloat16));
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  const int64_t blocks = (N + block_n - 1) / block_n;
  auto run = [&](auto* sz) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n0 = i * block_n;
        const int64_t nb = std::min(block_n, N - n0);
        dequantize_rows(src + n0 * K / 2, sz, n0, nb, split && nb == block_n, N, K, group_size, dst);
      }
    });
  };
  switch (scales_and_zeros.scalar_type()) {
    case at::kFloat: run(scales_and_zeros.const_data_ptr<float>()); break;
    case at::kBFloat16: run(scales_and_zeros.const_data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(scales_and_zeros.const_data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "int4_dequantize: unsupported scales dtype ", scales_and_zeros.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(controlplane_cpu, m) {
  m.def("int4_dequantize(Tensor packed, Tensor scales_and_zeros, int group_size, int block_n, bool split) -> Tensor");
}

TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) { m.impl("int4_dequantize", &int4_dequantize); }
