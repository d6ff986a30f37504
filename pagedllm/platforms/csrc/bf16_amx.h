// AMX-BF16 product of x's bf16 pairs with one bf16 panel (bf16_tile.h's layout), for CPUs with tile
// registers (Sapphire Rapids and later): bf16_tile.h's rows_out() calls it where usable().
// Layout: the panel [K2, 48, 2] is already AMX's B operand: 16 k pairs x 16 columns x 2 bf16 = one
// 16 x 64-byte tile, three side by side (row stride 192 bytes). x pairs [rows, K2] (K2 a multiple of
// 16, rows 64-byte aligned) give A tiles of 16 rows x 16 pairs. Accumulators: fp32 C tiles of 16 x 16,
// 3 per 16 rows of x, in tile registers for the whole k loop.
// ISA: compiled only with AMX-TILE + AMX-BF16 (-march=native on such a CPU: PAGEDLLM_AMX is 1, the one
// test callers branch on); elsewhere usable() is false and there are no kernels. usable() adds the kernel's consent: Linux gives a process the tile data
// state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM), so a CPU with AMX under a kernel that refuses
// keeps the AVX512-BF16 path.
#pragma once
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

inline bool usable() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h, the xstate component
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// eight 16-row x 64-byte tiles on the calling thread (the shape every kernel here uses); tile state is
// per thread, so each worker loads it before its first tile instruction. The configuration is a constant in
// memory: GCC does not treat ldtilecfg as reading its operand, and stores to a local one were moved past it.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline constexpr TileConfig kTiles8x16x64 = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

inline void configure() { _tile_loadconfig(&kTiles8x16x64); }

// out[0 : 16T, 0 : 48] (ldo floats apart) = 16T rows of x pairs (ldx pairs apart) . panel, over K2 pairs
// (a multiple of 16). T = 2: C tiles 0-5, A in tile 6, B in tile 7, ordered so each A or B load feeds two
// products where it can (7 loads per 6 products). T = 1: C 0-2, A 6, B 3-5.
template <int T>
inline void rows(const uint32_t* xp, int64_t ldx, int64_t K2, const uint16_t* panel, float* out, int64_t ldo) {
  constexpr int64_t kPanelStride = 48 * 2 * 2;  // bytes per k pair of the panel
  const int64_t sa = ldx * 4, so = ldo * 4;
  if constexpr (T == 2) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
    for (int64_t k = 0; k < K2; k += 16) {
      const uint16_t* pk = panel + k * 96;
      const uint32_t* a0 = xp + k;
      const uint32_t* a1 = xp + 16 * ldx + k;
      _tile_loadd(7, pk, kPanelStride);
      _tile_loadd(6, a0, sa);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(6, a1, sa);
      _tile_dpbf16ps(3, 6, 7);
      _tile_loadd(7, pk + 32, kPanelStride);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(6, a0, sa);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(7, pk + 64, kPanelStride);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(6, a1, sa);
      _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(0, out, so); _tile_stored(1, out + 16, so); _tile_stored(2, out + 32, so);
    _tile_stored(3, out + 16 * ldo, so); _tile_stored(4, out + 16 * ldo + 16, so);
    _tile_stored(5, out + 16 * ldo + 32, so);
  } else {
    static_assert(T == 1, "rows<T>: 1 or 2 tiles of 16 rows");
    _tile_zero(0); _tile_zero(1); _tile_zero(2);
    for (int64_t k = 0; k < K2; k += 16) {
      const uint16_t* pk = panel + k * 96;
      _tile_loadd(6, xp + k, sa);
      _tile_loadd(3, pk, kPanelStride);
      _tile_loadd(4, pk + 32, kPanelStride);
      _tile_loadd(5, pk + 64, kPanelStride);
      _tile_dpbf16ps(0, 6, 3);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(2, 6, 5);
    }
    _tile_stored(0, out, so); _tile_stored(1, out + 16, so); _tile_stored(2, out + 32, so);
  }
}

}  // namespace amx

#else
#define PAGEDLLM_AMX 0

namespace amx {
inline bool usable() { return false; }  // not built for this CPU
}  // namespace amx

#endif
