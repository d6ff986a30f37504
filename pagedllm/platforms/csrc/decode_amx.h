// One decode row's attention over a bf16 pool on AMX-BF16 tiles (attention.cpp's attend_item_amx calls these
// for the rows of a long context: both products would otherwise run on vdpbf16ps at 1/16 of the tiles' rate).
//
// Layout: the pool is [NB, BS, KVH, D] bf16, a slot row KVH x D values (row_stride apart). Query heads
// h = kh * G + g (G = H / KVH <= 16).
//   Scores, S^T = K . Q^T per 16 keys: A = 16 slot rows straight from the pool (32 d a tile, rows a slot row
//   apart, so a block's 16 consecutive slots are one tile load; other block sizes are copied into a staging
//   tile), B = q^T as bf16 pairs [16 d pairs, 16 heads], block-diagonal: the columns of a column group's
//   16 / G * G heads, each nonzero only in its own KV head's d range, so one C tile [16 keys, 16 heads]
//   collects every head of the group over the slot row's KVH x D values. The C tile is transposed into the
//   scores' [H, ld] rows by gathers.
//   Values, O = P . V per KV head and 32 keys: A = the p of 16 heads from kh * G (bf16 pairs of consecutive
//   keys, rows of the pairs buffer; rows past the group are other heads' and their C rows are not read),
//   B = V re-laid as pairs of keys [16 key pairs, 16 d] (two slot rows interleaved by vpermt2w, keys outside
//   the item zero), C = [16 heads, 16 d] accumulators, four at a time, kept in tiles over a stretch of keys.
// The math is the decode op's over a bf16 pool: q and p rounded to bf16 (p by the caller's softmax_rows), products
// exact, sums in fp32 (in the tiles' order: results differ from the vector kernel's by fp32 rounding only).
// ISA: AMX-TILE + AMX-BF16 with AVX512-BF16 (the gathers, the conversions); callers check amx::usable() and
// configure the tiles (bf16_amx.h: eight tiles of 16 rows x 64 bytes) on the calling thread first.
#pragma once
#include "bf16_amx.h"
#include "vec16.h"

#if PAGEDLLM_AMX && defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace decode_amx {

struct Geometry {
  int64_t H, KVH, D, BS, row_stride;  // row_stride: bf16 values of a slot row
  int64_t G() const { return H / KVH; }
  int64_t group_heads() const { return 16 / G() * G(); }  // heads per column group (whole KV heads)
  int64_t groups() const { return (H + group_heads() - 1) / group_heads(); }
};

// Whether these shapes run here: whole 32-value tiles of d, and a KV head's query heads in one A tile
inline bool fits(int64_t H, int64_t KVH, int64_t D) { return D % 32 == 0 && KVH > 0 && H % KVH == 0 && H / KVH <= 16; }

// q [H, D] fp32 -> B tiles [groups][KV heads of a group][D / 32] of [16 d pairs][16 columns] bf16 pairs
inline void q_tiles(const Geometry& g, const float* q, std::vector<uint32_t>& out) {
  const int64_t GH = g.group_heads(), KPG = GH / g.G(), DC = g.D / 32;
  out.assign(g.groups() * KPG * DC * 256, 0u);
  for (int64_t h = 0; h < g.H; ++h) {
    const int64_t cg = h / GH, col = h % GH, khl = (h / g.G()) % KPG;
    uint32_t* base = out.data() + (cg * KPG + khl) * DC * 256;
    for (int64_t d = 0; d < g.D; d += 16) {  // d pair i -> tile i / 16, row i % 16
      const vec::v16u b = vec::bf16_bits(vec::load16(q + h * g.D + d)) >> 16;
      for (int j = 0; j < 8; ++j) {
        const int64_t i = d / 2 + j;
        base[(i / 16) * 256 + (i % 16) * 16 + col] = b[2 * j] | (b[2 * j + 1] << 16);
      }
    }
  }
}

// Scores of keys [lo, hi) (positions; table maps blocks to pages) into sc [H, ld] at t - lo, times scale
inline void scores(const Geometry& g, const uint16_t* pool, const int64_t* table, int64_t lo, int64_t hi, const float* q,
                   float scale, float* sc, int64_t ld, std::vector<uint32_t>& qt, std::vector<uint16_t>& stage) {
  q_tiles(g, q, qt);
  const int64_t GH = g.group_heads(), KPG = GH / g.G(), DC = g.D / 32, RB = g.row_stride * 2;
  const bool direct = g.BS % 16 == 0;  // a position-aligned 16 keys are one block's consecutive slots
  if (!direct) stage.resize(2 * 16 * g.row_stride);
  alignas(64) float cbuf[2][256];
  const __m512i col_idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale);
  auto rows_of = [&](int64_t t0, int u) -> const uint16_t* {  // the A rows of keys t0 .. t0 + 15
    if (direct) return pool + (table[t0 / g.BS] * g.BS + t0 % g.BS) * g.row_stride;
    uint16_t* dst = stage.data() + u * 16 * g.row_stride;
    for (int r = 0; r < 16; ++r) {
      const int64_t t = t0 + r;
      if (t >= lo && t < hi)
        std::memcpy(dst + r * g.row_stride, pool + (table[t / g.BS] * g.BS + t % g.BS) * g.row_stride, RB);
      else
        std::memset(dst + r * g.row_stride, 0, RB);
    }
    return dst;
  };
  for (int64_t t0 = lo / 16 * 16; t0 < hi; t0 += 32) {
    const bool two = t0 + 16 < hi;
    const uint16_t* a0 = rows_of(t0, 0);
    const uint16_t* a1 = two ? rows_of(t0 + 16, 1) : nullptr;
    for (int64_t cg = 0; cg < g.groups(); ++cg) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t khl = 0; khl < KPG && cg * KPG + khl < g.KVH; ++khl) {
        const int64_t off = (cg * KPG + khl) * g.D;
        const uint32_t* qb = qt.data() + (cg * KPG + khl) * DC * 256;
        for (int64_t c = 0; c < DC; ++c) {
          _tile_loadd(4, qb + c * 256, 64);
          _tile_loadd(2, a0 + off + 32 * c, RB);
          _tile_dpbf16ps(0, 2, 4);
          if (two) {
            _tile_loadd(3, a1 + off + 32 * c, RB);
            _tile_dpbf16ps(1, 3, 4);
          }
        }
      }
      _tile_stored(0, cbuf[0], 64);
      if (two) _tile_stored(1, cbuf[1], 64);
      for (int u = 0; u < (two ? 2 : 1); ++u) {
        const int64_t base = t0 + 16 * u - lo;  // scores index of the tile's first key (may be below 0)
        uint32_t m = 0xffffu;
        if (base < 0) m &= 0xffffu << (-base);
        if (base + 16 > hi - lo) m &= 0xffffu >> (base + 16 - (hi - lo));
        for (int64_t col = 0; col < GH && cg * GH + col < g.H; ++col) {
          const __m512 v = _mm512_i32gather_ps(col_idx, cbuf[u] + col, 4);  // key r's score in lane r
          _mm512_mask_storeu_ps(sc + (cg * GH + col) * ld + base, static_cast<__mmask16>(m), _mm512_mul_ps(v, vscale));
        }
      }
    }
  }
}

// acc [H, D] = sum over keys [lo, hi) of p (sc [H, ld] at t - lo: bf16 values, 0 past hi - lo up to its slack)
// times V. Buffers: pairs (p as bf16 by key), vt (V as key pairs), acc_t (the tiles' accumulators)
inline void values(const Geometry& g, const uint16_t* pool, const int64_t* table, int64_t lo, int64_t hi,
                   const float* sc, int64_t ld, float* acc, std::vector<uint16_t>& pairs, std::vector<uint16_t>& vt,
                   std::vector<float>& acc_t) {
  const int64_t t0 = lo / 32 * 32, shift = lo - t0, n = hi - lo;
  const int64_t L = (shift + n + 31) / 32 * 32 + 32;  // a pairs row: keys from t0, 0 before lo and after hi
  const int64_t G = g.G(), D = g.D, DC = D / 16;
  pairs.assign((g.H + 16) * L, 0);  // 16 more rows: a KV head's A tile reads 16 rows from its first head
  const int64_t nv = (n + 15) / 16;
  for (int64_t h = 0; h < g.H; ++h)
    for (int64_t c = 0; c < nv; ++c)  // sc is 0 from n to 16 nv
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs.data() + h * L + shift + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc + h * ld + 16 * c)));
  acc_t.assign(g.KVH * 16 * D, 0.f);  // [KVH][16 heads from kh * G][D]
  constexpr int64_t S = 64;  // keys per stretch: a KV head's V re-laid for them (L1-sized), accumulators in tiles
  vt.resize((S / 32) * DC * 512);  // [32-key chunk][16 d][16 pairs][32 bf16]
  alignas(64) static const uint16_t zeros[512] = {};
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const uint16_t* rows[S];
  for (int64_t s0 = t0; s0 < hi; s0 += S) {
    const int64_t chunks = std::min<int64_t>(S, hi - s0 + 31) / 32;
    for (int64_t k = 0; k < 32 * chunks; ++k) {
      const int64_t t = s0 + k;
      rows[k] = t >= lo && t < hi ? pool + (table[t / g.BS] * g.BS + t % g.BS) * g.row_stride : nullptr;
    }
    for (int64_t kh = 0; kh < g.KVH; ++kh) {
      for (int64_t j = 0; j < chunks; ++j)
        for (int64_t i = 0; i < 16; ++i) {  // keys 2i, 2i + 1 of chunk j
          uint16_t* dst = vt.data() + j * DC * 512 + i * 32;
          const uint16_t* v0 = rows[32 * j + 2 * i] ? rows[32 * j + 2 * i] + kh * D : zeros;
          const uint16_t* v1 = rows[32 * j + 2 * i + 1] ? rows[32 * j + 2 * i + 1] + kh * D : zeros;
          for (int64_t c = 0; c < D / 32; ++c) {
            const __m512i x = _mm512_loadu_si512(v0 + 32 * c), y = _mm512_loadu_si512(v1 + 32 * c);
            _mm512_storeu_si512(dst + (2 * c) * 512, _mm512_permutex2var_epi16(x, lo_idx, y));
            _mm512_storeu_si512(dst + (2 * c + 1) * 512, _mm512_permutex2var_epi16(x, hi_idx, y));
          }
        }
      float* at = acc_t.data() + kh * 16 * D;
      const uint16_t* pa = pairs.data() + kh * G * L + (s0 - t0);
      for (int64_t d0 = 0; d0 < DC; d0 += 4) {  // four C tiles: d 16 d0 .. 16 d0 + 63
        const int nd = static_cast<int>(std::min<int64_t>(4, DC - d0));
        _tile_loadd(0, at + 16 * d0, D * 4);
        if (nd > 1) _tile_loadd(1, at + 16 * (d0 + 1), D * 4);
        if (nd > 2) _tile_loadd(2, at + 16 * (d0 + 2), D * 4);
        if (nd > 3) _tile_loadd(3, at + 16 * (d0 + 3), D * 4);
        for (int64_t j = 0; j < chunks; ++j) {
          const uint16_t* b = vt.data() + (j * DC + d0) * 512;
          _tile_loadd(4, pa + 32 * j, L * 2);
          _tile_loadd(5, b, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (nd > 1) {
            _tile_loadd(6, b + 512, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (nd > 2) {
            _tile_loadd(7, b + 1024, 64);
            _tile_dpbf16ps(2, 4, 7);
          }
          if (nd > 3) {
            _tile_loadd(5, b + 1536, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
        }
        _tile_stored(0, at + 16 * d0, D * 4);
        if (nd > 1) _tile_stored(1, at + 16 * (d0 + 1), D * 4);
        if (nd > 2) _tile_stored(2, at + 16 * (d0 + 2), D * 4);
        if (nd > 3) _tile_stored(3, at + 16 * (d0 + 3), D * 4);
      }
    }
  }
  for (int64_t h = 0; h < g.H; ++h) {
    const int64_t kh = h / G;
    std::memcpy(acc + h * D, acc_t.data() + (kh * 16 + h - kh * G) * D, D * sizeof(float));
  }
}

}  // namespace decode_amx

#endif
