// int4_linear: y = x @ w.T for torch's CPU int4 weight (as `_convert_weight_to_int4pack_for_cpu`
// packs it), bit for bit what `_weight_int4pack_mm_for_cpu` returns, several times faster on
// many rows.
//
// Why: torch's kernel dequantizes a 64-column panel of the weight again for every 4 rows of
// activations, so a 512-token prompt chunk pays for 128 dequantizations of each weight. Here
// each panel is dequantized once per call, to float32 in a per-thread buffer that stays in L2,
// and every row block reuses it. No resident copy of the weight (int4_dense_copy keeps one,
// 4x the int4 bytes), no transient one either.
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

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kMaxBlock = 64;
// Rows per micro-kernel call: accumulators (rows x vectors of a 64-column panel) plus the
// panel's vectors and one broadcast must fit the register file (32 zmm; 16 ymm).
constexpr int kRows = kLanes == 16 ? 6 : 2;

template <typename ST>
inline float scalar(const ST& v) {
  return static_cast<float>(v);
}

// The block's weights as float32, [K, nb] row-major, dequantized as torch's kernel does.
template <typename ST>
void dequantize_panel(const uint8_t* src, const ST* sz, int64_t n0, int64_t nb, bool split, int64_t N,
                      int64_t K, int64_t group, float* panel) {
  alignas(64) float scale[kMaxBlock];
  alignas(64) float zero[kMaxBlock];
  alignas(64) float q[kMaxBlock];
  const int64_t half = nb / 2;
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const ST* g = sz + (g0 / group) * N * 2 + n0 * 2;
    for (int64_t n = 0; n < nb; ++n) {
      scale[n] = scalar(g[2 * n]);
#if defined(CPU_CAPABILITY_AVX512) || !defined(CPU_CAPABILITY_AVX2)
      zero[n] = scalar(g[2 * n + 1]);
#else
      zero[n] = std::fma(scale[n], -8.0f, scalar(g[2 * n + 1]));  // AVX2: the -8 in the zero
#endif
    }
    for (int64_t k = g0; k < g0 + group; ++k) {
      const uint8_t* b = src + k * half;
      for (int64_t j = 0; j < half; ++j) {
        q[split ? j : 2 * j] = static_cast<float>(b[j] & 15);
        q[split ? j + half : 2 * j + 1] = static_cast<float>(b[j] >> 4);
      }
      float* w = panel + k * nb;
#if defined(CPU_CAPABILITY_AVX512) || !defined(CPU_CAPABILITY_AVX2)
      for (int64_t n = 0; n < nb; ++n) w[n] = std::fma(q[n] - 8.0f, scale[n], zero[n]);
#else
      for (int64_t n = 0; n < nb; ++n) w[n] = std::fma(q[n], scale[n], zero[n]);
#endif
    }
  }
}

// ROWS rows of x (float32) times a panel of VECS vectors of columns: one FMA chain per output,
// k in order, then rounded to bf16.
template <int ROWS, int VECS>
void micro_kernel(const float* x, int64_t K, const float* panel, c10::BFloat16* out, int64_t ldo) {
  Vec acc[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = Vec(0.0f);
  constexpr int64_t nb = VECS * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    Vec w[VECS];
    for (int v = 0; v < VECS; ++v) w[v] = Vec::loadu(panel + k * nb + v * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const Vec a(x[r * K + k]);
      for (int v = 0; v < VECS; ++v) acc[r][v] = at::vec::fmadd(a, w[v], acc[r][v]);
    }
  }
  alignas(64) float tmp[nb];
  for (int r = 0; r < ROWS; ++r) {
    for (int v = 0; v < VECS; ++v) acc[r][v].store(tmp + v * kLanes);
    at::vec::convert(tmp, out + r * ldo, nb);
  }
}

template <int VECS>
void panel_rows(const float* x, int64_t M, int64_t K, const float* panel, c10::BFloat16* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) micro_kernel<kRows, VECS>(x + m * K, K, panel, out + m * ldo, ldo);
  switch (M - m) {  // the last rows, fewer than kRows
    case 0: break;
    case 1: micro_kernel<1, VECS>(x + m * K, K, panel, out + m * ldo, ldo); break;
#if defined(CPU_CAPABILITY_AVX512)
    case 2: micro_kernel<2, VECS>(x + m * K, K, panel, out + m * ldo, ldo); break;
    case 3: micro_kernel<3, VECS>(x + m * K, K, panel, out + m * ldo, ldo); break;
    case 4: micro_kernel<4, VECS>(x + m * K, K, panel, out + m * ldo, ldo); break;
    case 5: micro_kernel<5, VECS>(x + m * K, K, panel, out + m * ldo, ldo); break;
#endif
    default: TORCH_CHECK(false, "int4_linear: internal row split");
  }
}

void panel_times_rows(const float* x, int64_t M, int64_t K, const float* panel, int64_t nb, c10::BFloat16* out,
                      int64_t ldo) {
  switch (nb / kLanes) {
    case 1: return panel_rows<1>(x, M, K, panel, out, ldo);
    case 2: return panel_rows<2>(x, M, K, panel, out, ldo);
    case 3: return panel_rows<3>(x, M, K, panel, out, ldo);
    case 4: return panel_rows<4>(x, M, K, panel, out, ldo);
    default: TORCH_CHECK(false, "int4_linear: a block of ", nb, " rows");
  }
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                       int64_t group_size, int64_t block_n, bool split) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed: contiguous uint8 [N, K / 2]");
  const int64_t N = packed.size(0);
  const int64_t K = packed.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              "x: bf16 [rows, ", K, "] (the weight's in_features)");
  TORCH_CHECK(scales_and_zeros.dim() == 3 && scales_and_zeros.is_contiguous() && scales_and_zeros.size(1) == N &&
                  scales_and_zeros.size(2) == 2,
              "scales_and_zeros: contiguous [K / group_size, N, 2]");
  TORCH_CHECK(group_size > 0 && K % group_size == 0 && scales_and_zeros.size(0) == K / group_size,
              "group_size ", group_size, " does not divide K = ", K, " into ", scales_and_zeros.size(0), " groups");
  TORCH_CHECK((block_n == 32 || block_n == 64) && N % 16 == 0, "block_n: 32 or 64; N: a multiple of 16");
  const int64_t M = x.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = xf.const_data_ptr<float>();
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  const int64_t blocks = (N + block_n - 1) / block_n;
  auto run = [&](auto* sz) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> panel(K * block_n);  // 147 KB at K = 576: stays in L2 across rows
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n0 = i * block_n;
        const int64_t nb = std::min(block_n, N - n0);
        dequantize_panel(src + n0 * K / 2, sz, n0, nb, split && nb == block_n, N, K, group_size, panel.data());
        panel_times_rows(xp, M, K, panel.data(), nb, dst + n0, N);
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

TORCH_LIBRARY_FRAGMENT(controlplane_cpu, m) {
  m.def(
      "int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group_size, int block_n, bool split) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) { m.impl("int4_linear", &int4_linear); }
