// int4_linear_bf16: torch's packed int4 weight (as int4_linear.cpp reads it) times bf16
// activations through AVX512-BF16 dot products, for CPUs that have them (Zen 4, Sapphire
// Rapids); engine.bf16_dot chooses it over int4_linear.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16_dot.h"
#include "int4_common.h"

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace controlplane::int4;

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
// and is used at once by every row of x (making the pairs costs little: a panel for so few rows
// cost more). 4 rows of a 1.1B Llama's 2048 -> 11264 ran at 0.73x torch's kernel's speed
// through the panel, 1.16x in two passes of two rows; one pass of four does the nibbles once.
constexpr int64_t kFusedPairRows = 4;

// How far ahead of its nibbles the few-row path asks for the weight bytes (one 64-byte line a
// pair of K rows). A decode step reads its weights from memory, 0.5-2 MB a call, too short a
// stream for the hardware prefetcher to get ahead of: SmolLM2's 120 int4 linears, cycled
// through, took 5.7-6.6 ms at one row and 12.4 ms at four without it, 3.6-4.0 and 7.1-7.5 at
// 2 KB ahead (4 KB about the same, 8 KB worse; 2-core Xeon with AMX, benchmarks/quant_kernels
// shapes). Past the buffer's end a prefetch is a no-op, not a fault.
constexpr int64_t kFusedPrefetchBytes = 2048;

// Folds group g's partial sums (part[r][j]: row r, columns 16 j .. 16 j + 15 of a 64-column
// block) into the running totals, the same arithmetic in every path:
//     total = fma(xsum[g], z, fma(partial, s, total)), from 0 at g = 0.
// The totals stay in `regs` when IN_REGISTERS, else in `total` (ROWS x 64 floats, aligned).
template <int ROWS, bool IN_REGISTERS, typename ST>
CP_BF16 inline void fold_group(const __m512 (&part)[ROWS][4], const ST* sz, int64_t g, int64_t n0, int64_t N,
                               const float* xsum, int64_t groups, __m512 (&regs)[IN_REGISTERS ? ROWS : 1][4],
                               float* total) {
  __m512 vs[4], vz[4];
  group_scales64(sz + g * N * 2 + n0 * 2, vs, vz);
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) {
    const __m512 xs = _mm512_set1_ps(xsum[r * groups + g]);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      float* t = total + r * 64 + 16 * j;
      __m512 acc = g == 0 ? _mm512_setzero_ps() : IN_REGISTERS ? regs[r][j] : _mm512_load_ps(t);
      acc = _mm512_fmadd_ps(xs, vz[j], _mm512_fmadd_ps(part[r][j], vs[j], acc));
      if constexpr (IN_REGISTERS) {
        regs[r][j] = acc;
      } else {
        _mm512_store_ps(t, acc);
      }
    }
  }
}

// The totals of ROWS rows x 64 columns out as bf16 (rows `ldo` apart).
template <int ROWS, bool IN_REGISTERS>
CP_BF16 inline void store_totals(const __m512 (&regs)[IN_REGISTERS ? ROWS : 1][4], float* total,
                                 c10::BFloat16* out, int64_t ldo) {
  if constexpr (IN_REGISTERS)
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) _mm512_store_ps(total + r * 64 + 16 * j, regs[r][j]);
  for (int r = 0; r < ROWS; ++r) at::vec::convert(total + r * 64, out + r * ldo, 64);
}

// ROWS rows of x (bf16 pairs, row stride K / 2) against a full split block of 64 rows, all of
// K: the same chains as the panel path. A group's partial sums stay in registers (16 at 4
// rows), and so do the running totals up to 2 rows (3% faster there than in L1); from 3 rows
// they live in `total` (ROWS x 64 floats, 64-byte aligned). 5 or 6 rows in one pass spilled
// and ran slower than the panel.
template <int ROWS, typename ST>
CP_BF16 void fused_block64_bf16(const uint32_t* x, const float* xsum, int64_t K, const uint8_t* src, const ST* sz,
                                int64_t n0, int64_t N, int64_t group, float* total, c10::BFloat16* out,
                                int64_t ldo) {
  const __m512i table = nibble_table();
  const int64_t groups = K / group;
  constexpr bool kInRegisters = ROWS <= 2;
  __m512 totals[kInRegisters ? ROWS : 1][4];
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[ROWS][4];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
      __m512i pairs[4];
      _mm_prefetch(reinterpret_cast<const char*>(src + k * 32 + kFusedPrefetchBytes), _MM_HINT_T0);
      q_pairs64(src + k * 32, table, pairs);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * (K / 2) + k / 2])));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) part[r][j] = _mm512_dpbf16_ps(part[r][j], reinterpret_cast<__m512bh>(pairs[j]), a);
      }
    }
    fold_group<ROWS, kInRegisters>(part, sz, g, n0, N, xsum, groups, totals, total);
  }
  store_totals<ROWS, kInRegisters>(totals, total, out, ldo);
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
      _mm_prefetch(reinterpret_cast<const char*>(src + k * 32 + kFusedPrefetchBytes), _MM_HINT_T0);
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

// AMX (Sapphire Rapids on): TDPBF16PS multiplies a tile of up to 16 rows of x (32 bf16 values
// each: one group of 32) by a tile of 32 x 16 weights (the pair panel's VNNI layout, as
// VDPBF16PS reads it) into 16 x 16 float32 sums: 16 times a VDPBF16PS's multiply-adds in one
// instruction. Its sums are not VDPBF16PS's bit for bit (46 of 51,200 outputs differed on one
// group, relative 8.6e-5: the tile unit adds its products in another order), so where it
// serves it serves every row count (`amx`, chosen once per module: batch invariance), and each
// output is still
//     total = 0; for each group g: partial = the TDPBF16PS chain over its 32-value tiles, from 0;
//                                  total = fma(partial, s, total); total = fma(xsum[g], z, total)
// whatever the row count or the tile of rows it falls in: a tile's rows never meet.

#define CP_AMX __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

// Tile numbers: partial sums of four groups in C0..C3, x and the weights in two pairs of
// tiles used in turn, so that a load need not wait for the product before it. (Macros: GCC's
// tile intrinsics paste the number into their assembly.)
#define CP_TILE_A0 4
#define CP_TILE_B0 5
#define CP_TILE_A1 6
#define CP_TILE_B1 7

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// `rows` rows of x and of the sums a tile (1 to 16), 64 bytes a row everywhere. Tile A1 holds x
// only in steps of more than 16 rows (so 16 rows of it), a third tile of weights in fewer.
inline TileConfig amx_config(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
  for (int t : {0, 1, 2, 3, CP_TILE_A0}) c.rows[t] = static_cast<uint8_t>(rows);
  for (int t : {CP_TILE_B0, CP_TILE_A1, CP_TILE_B1}) c.rows[t] = 16;
  return c;
}

struct AmxChunk {  // one m-tile of x against one K chunk of one 64-column pair panel
  const uint32_t* a;  // x's pairs: the tile's first row, the chunk's first pair
  int64_t lda;        // bytes from one row of x to the next
  const float* xsum;  // the tile's first row, the chunk's first group; row stride `groups`
  int64_t groups;
  const uint32_t* panel;  // [chunk pairs, 64]
  const float* sp;        // [chunk groups, 64]
  const float* zp;
  int64_t chunk_groups, tiles_per_group;  // group / 32 tiles a group
  bool first;
  float* total;  // [16, 64] running sums of the tile's rows
};

// Group `g`'s partial sums of columns 16 j .. 16 j + 15 into tile C (zeroed first), stored to
// `part` (16 x 16 floats).
#define CP_AMX_GROUP(C, A, B, g)                                                            \
  do {                                                                                      \
    _tile_zero(C);                                                                          \
    for (int64_t s = 0; s < c.tiles_per_group; ++s) {                                       \
      const int64_t p = ((g) * c.tiles_per_group + s) * 16;                                 \
      _tile_loadd(A, c.a + p, c.lda);                                                       \
      _tile_loadd(B, c.panel + p * 64 + 16 * j, 256);                                       \
      _tile_dpbf16ps(C, A, B);                                                              \
    }                                                                                       \
    _tile_stored(C, part[C], 64);                                                           \
  } while (0)

// The chunk for ROWS rows of the tile, one 16-column slice at a time: the slice's running
// totals stay in registers across the chunk's groups (ROWS of them), four groups' products in
// flight in C0..C3.
template <int ROWS>
CP_AMX void amx_chunk(const AmxChunk& c) {
  alignas(64) float part[4][16 * 16];
  for (int j = 0; j < 4; ++j) {
    __m512 t[ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) t[r] = c.first ? _mm512_setzero_ps() : _mm512_load_ps(c.total + r * 64 + 16 * j);
    for (int64_t g = 0; g < c.chunk_groups; g += 4) {
      const int64_t n = std::min<int64_t>(4, c.chunk_groups - g);
      CP_AMX_GROUP(0, CP_TILE_A0, CP_TILE_B0, g);
      if (n > 1) CP_AMX_GROUP(1, CP_TILE_A1, CP_TILE_B1, g + 1);
      if (n > 2) CP_AMX_GROUP(2, CP_TILE_A0, CP_TILE_B0, g + 2);
      if (n > 3) CP_AMX_GROUP(3, CP_TILE_A1, CP_TILE_B1, g + 3);
      for (int64_t i = 0; i < n; ++i) {
        const __m512 s = _mm512_load_ps(c.sp + (g + i) * 64 + 16 * j);
        const __m512 z = _mm512_load_ps(c.zp + (g + i) * 64 + 16 * j);
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; ++r) {
          t[r] = _mm512_fmadd_ps(_mm512_load_ps(part[i] + 16 * r), s, t[r]);
          t[r] = _mm512_fmadd_ps(_mm512_set1_ps(c.xsum[r * c.groups + g + i]), z, t[r]);
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) _mm512_store_ps(c.total + r * 64 + 16 * j, t[r]);
  }
}
#undef CP_AMX_GROUP

template <int... R>
void amx_chunk_rows(int rows, const AmxChunk& c, std::integer_sequence<int, R...>) {
  ((rows == R + 1 ? amx_chunk<R + 1>(c) : void()), ...);
}

// Steps of up to 16 rows (one tile of x): the weights' bf16 pairs built one 32-value tile at a
// time into four B tiles (1 KB each, a ring of two in L1) and used at once, so that building
// the next tile's pairs overlaps this one's products (built two tiles ahead, with a group's
// fold after the next build, a decode step's 120 SmolLM2 linears took 1.19-1.20x the
// VDPBF16PS time at one row instead of 1.11-1.13x). The same products and sums as
// amx_chunk's, in the same order. ROWS running totals a column vector: in registers up to 4
// rows, in `total` (ROWS x 64 floats) beyond.
template <int ROWS, typename ST>
CP_AMX void amx_block_few_rows(const uint32_t* x, int64_t K2, const float* xsum, int64_t groups,
                               const uint8_t* src, const ST* sz, int64_t n0, int64_t N, int64_t group,
                               float* total, c10::BFloat16* out, int64_t ldo) {
  const __m512i table = nibble_table();
  alignas(64) uint32_t b[2][4][16 * 16];
  alignas(64) float part[4][16 * 16];
  constexpr bool kInRegisters = ROWS <= 4;
  __m512 totals[kInRegisters ? ROWS : 1][4];
  const int64_t tiles_per_group = group / 32;
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t s = 0; s < tiles_per_group; ++s) {
      const int64_t tile = g * tiles_per_group + s;
      uint32_t(*bt)[16 * 16] = b[tile & 1];
      const uint8_t* rows = src + tile * 32 * 32;  // 32 K rows of 32 bytes
#pragma GCC unroll 2
      for (int p = 0; p < 16; ++p) {
        __m512i pairs[4];
        _mm_prefetch(reinterpret_cast<const char*>(rows + p * 64 + kFusedPrefetchBytes), _MM_HINT_T0);
        q_pairs64(rows + p * 64, table, pairs);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) _mm512_store_si512(bt[j] + p * 16, pairs[j]);
      }
      if (s == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      _tile_loadd(CP_TILE_A0, x + tile * 16, K2 * 4);
      _tile_loadd(CP_TILE_B0, bt[0], 64);
      _tile_dpbf16ps(0, CP_TILE_A0, CP_TILE_B0);
      _tile_loadd(CP_TILE_B1, bt[1], 64);
      _tile_dpbf16ps(1, CP_TILE_A0, CP_TILE_B1);
      _tile_loadd(CP_TILE_A1, bt[2], 64);  // weights too here (see amx_config)
      _tile_dpbf16ps(2, CP_TILE_A0, CP_TILE_A1);
      _tile_loadd(CP_TILE_B0, bt[3], 64);
      _tile_dpbf16ps(3, CP_TILE_A0, CP_TILE_B0);
    }
    _tile_stored(0, part[0], 64);
    _tile_stored(1, part[1], 64);
    _tile_stored(2, part[2], 64);
    _tile_stored(3, part[3], 64);
    __m512 sums[ROWS][4];
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_load_ps(part[j] + 16 * r);
    fold_group<ROWS, kInRegisters>(sums, sz, g, n0, N, xsum, groups, totals, total);
  }
  store_totals<ROWS, kInRegisters>(totals, total, out, ldo);
}

template <typename ST, int... R>
void amx_block_rows(int rows, std::integer_sequence<int, R...>, const uint32_t* x, int64_t K2, const float* xsum,
                    int64_t groups, const uint8_t* src, const ST* sz, int64_t n0, int64_t N, int64_t group,
                    float* total, c10::BFloat16* out, int64_t ldo) {
  ((rows == R + 1 ? amx_block_few_rows<R + 1>(x, K2, xsum, groups, src, sz, n0, N, group, total, out, ldo) : void()),
   ...);
}

// Whether this CPU has AMX-BF16 and Linux lets this process use the tiles' 8 KB of state
// (asked for once: ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;  // the permission to ask for is Linux's
#endif
  }();
  return usable;
}

CP_AMX void amx_load_config(const TileConfig& c) { _tile_loadconfig(&c); }
CP_AMX void amx_release() { _tile_release(); }
#endif

at::Tensor int4_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                            int64_t group_size, int64_t block_n, bool split, bool amx) {
  TORCH_CHECK(controlplane::bf16_dot_supported(), "int4_linear_bf16: this CPU (or this build) has no AVX512-BF16");
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(!amx || amx_usable(), "int4_linear_bf16: amx=True on a CPU (or a process) without AMX-BF16 tiles");
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
  // Full split blocks take the tiles (groups of whole 32-value tiles; the rest of a weight, the
  // VDPBF16PS paths, at every row count alike). Tiles are 16 rows of x, or all of them when
  // fewer; past 16, the last partial tile's rows are read from a copy padded to 16.
  const bool tiles = amx && split && block_n == 64 && group_size % 32 == 0;
  const int tile_rows = static_cast<int>(std::min<int64_t>(M, 16));
  const int64_t K2 = K / 2, tail = tiles && M > 16 ? M % 16 : 0;
  std::vector<uint32_t> tail_x(tail ? 16 * K2 : 0);
  if (tail) std::copy(xp + (M - tail) * K2, xp + M * K2, tail_x.begin());
  auto run = [&](auto* sz) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      if (tiles) amx_load_config(amx_config(tile_rows));
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
        if (tiles && nb == 64 && M <= 16) {
          amx_block_rows(tile_rows, std::make_integer_sequence<int, 16>{}, xp, K2, xsum.data(), groups, block, sz, n0,
                         N, group_size, total, dst + n0, N);
          continue;
        }
        if (tiles && nb == 64) {
          for (int64_t k0 = 0; k0 < K; k0 += kc) {
            const int64_t k1 = std::min(K, k0 + kc);
            pair_panel(block, sz, n0, nb, true, N, k0, k1, group_size, panel, sp, zp);
            for (int64_t m = 0; m < M; m += 16) {
              const int rows = static_cast<int>(std::min<int64_t>(16, M - m));
              const bool padded = rows < tile_rows;
              const AmxChunk c{(padded ? tail_x.data() : xp + m * K2) + k0 / 2,
                               K2 * 4,
                               xsum.data() + m * groups + k0 / group_size,
                               groups,
                               panel,
                               sp,
                               zp,
                               (k1 - k0) / group_size,
                               group_size / 32,
                               k0 == 0,
                               total + m * 64};
              amx_chunk_rows(rows, c, std::make_integer_sequence<int, 16>{});
            }
          }
          for (int64_t r = 0; r < M; ++r) at::vec::convert(total + r * 64, dst + n0 + r * N, 64);
          continue;
        }
        if (split && nb == 64 && M <= kFusedPairRows) {
          auto fused = [&](auto rows) {
            fused_block64_bf16<decltype(rows)::value>(xp, xsum.data(), K, block, sz, n0, N, group_size, total,
                                                      dst + n0, N);
          };
          switch (M) {
            case 1: fused(std::integral_constant<int, 1>{}); break;
            case 2: fused(std::integral_constant<int, 2>{}); break;
            case 3: fused(std::integral_constant<int, 3>{}); break;
            default: fused(std::integral_constant<int, 4>{}); break;
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
      if (tiles) amx_release();
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

// Whether int4_linear_bf16 can take amx=True here.
bool amx_supported() {
#if defined(CPU_CAPABILITY_AVX512)
  return controlplane::bf16_dot_supported() && amx_usable();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(controlplane_cpu, m) {
  m.impl("amx_supported", &amx_supported);
  m.impl("bf16_dot_supported", &controlplane::bf16_dot_supported);
}

TORCH_LIBRARY_IMPL(controlplane_cpu, CPU, m) { m.impl("int4_linear_bf16", &int4_linear_bf16); }
