// Row tiling shared by the panel-packed linears (ops.cpp fp32, linear_bf16.cpp bf16): full tiles of
// 8 rows, then one tile of the 1..7 rows left, each with its row count as a compile-time constant so
// the micro-kernel's accumulators stay in registers.
#pragma once
#include <cstdint>
#include <type_traits>

// tile(m, R) for m = lo, lo + 8, ... over [lo, hi); R is std::integral_constant<int, rows>
template <typename F>
inline void for_row_tiles(int64_t lo, int64_t hi, F&& tile) {
  int64_t m = lo;
  for (; m + 8 <= hi; m += 8) tile(m, std::integral_constant<int, 8>{});
  switch (hi - m) {
    case 7: tile(m, std::integral_constant<int, 7>{}); break;
    case 6: tile(m, std::integral_constant<int, 6>{}); break;
    case 5: tile(m, std::integral_constant<int, 5>{}); break;
    case 4: tile(m, std::integral_constant<int, 4>{}); break;
    case 3: tile(m, std::integral_constant<int, 3>{}); break;
    case 2: tile(m, std::integral_constant<int, 2>{}); break;
    case 1: tile(m, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}
