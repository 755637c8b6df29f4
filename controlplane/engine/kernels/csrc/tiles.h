// Dispatch over row tiles, shared by the int4 and int8 kernels: each tile shape is its own
// template instance (its accumulators in registers), chosen at run time by the row count.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>

namespace controlplane {

// f(m, rows) for the last `rest` rows from m, `rows` a compile-time count below R + 1.
template <int R, typename F>
inline void last_rows(int64_t rest, int64_t m, const F& f) {
  if constexpr (R > 0) {
    if (rest == R)
      f(m, std::integral_constant<int, R>{});
    else
      last_rows<R - 1>(rest, m, f);
  } else {
    TORCH_CHECK(false, "internal row split: ", rest, " rows left");
  }
}

// f(m, rows) for tiles of TILE rows from m = 0, then the last rows (fewer than TILE), `rows` a
// compile-time count (std::integral_constant); only the shapes a TILE can leave are built.
template <int TILE, typename F>
inline void over_row_tiles(int64_t M, const F& f) {
  int64_t m = 0;
  for (; m + TILE <= M; m += TILE) f(m, std::integral_constant<int, TILE>{});
  if (M > m) last_rows<TILE - 1>(M - m, m, f);
}

}  // namespace controlplane
