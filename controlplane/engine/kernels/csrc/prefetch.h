// Software prefetch of the weight rows a kernel reads next.
//
// A decode step's weights come from memory, not a cache (the whole model is read once per
// step), and with several streams per call (int4 bytes, scales, mins) the hardware prefetcher
// fell behind: asking for the bytes some rows ahead took our W4A8 kernel on SmolLM2's
// 576 -> 3072 linear from 105 to 67 us at one row (2-core Xeon,
// benchmarks/int8_activations.py, weights cycled through 1 GB).
#pragma once

#include <algorithm>
#include <cstdint>

namespace controlplane {

// Ask for `count` elements from `p` (not past `end`) to be brought into the cache.
template <typename T>
inline void prefetch(const T* p, int64_t count, const T* end) {
  const char* c = reinterpret_cast<const char*>(std::min(p, end));
  const char* e = reinterpret_cast<const char*>(std::min(p + count, end));
  for (; c < e; c += 64) __builtin_prefetch(c, 0, 3);
}

}  // namespace controlplane
