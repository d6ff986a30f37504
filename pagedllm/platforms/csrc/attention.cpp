// Attention that reads K/V straight from the paged pool (no gathered copy of the context).
//
// Layout: the pool of a layer is [NB, BS, KVH, D] for K and for V (fp32, bf16 bits, or fp8 bits with a
// bf16 scale per slot and KV head), or [NB, BS, KVH, D / 32 x bytes] of llama.cpp's q8_0 (34 bytes: an fp16
// scale, 32 int8) or q4_0 (18: the scale, 16 bytes of nibble pairs) blocks, K and V each in its own format
// (a uint8 pool's last dimension says which: D fp8, D / 32 x 34 q8_0, D / 32 x 18 q4_0); query rows are
// [T, H, D] fp32, heads contiguous. Query row r of
// sequence s attends to keys [lo, hi): hi = ctx_len - q_len + i + 1 (causal, i = r's index in its
// chunk), lo = hi - window when a sliding window is set.
//
// Work item = one query row and a range of its keys (all keys when there are at least as many rows as
// threads; with fewer, each row's keys are split and the ranges merged by their maxima: flash-decoding).
// Within an item the keys go by tiles of KT (16; 8 for head dims over 64) in slot order, each slot row
// (all KV heads) read once per pass and widened to fp32 once (fp32 rows are read in place); per KV head,
// the GB query heads that share it (GQA) at once:
//   pass 1: per head, KT q.k products as 16-lane vectors, summed by a shuffle tree into one vector of KT
//           scores (no horizontal sum per key), q held in registers;
//   pass 2: max, exp, sum over each head's scores;
//   pass 3: the weighted V sum, GB x D accumulators in registers across a tile's keys.
// Measured against the previous kernel (one query head at a time, a horizontal sum per score, the V
// accumulators in memory), alternated runs of docs/bench/attention_microbench.py: SmolLM2's shape (9 heads,
// 3 KV heads, D 64), one decode row over 576 keys 31-45 -> 19-31 us a layer, 64 rows 976-1294 -> 630-934 us;
// Llama-3-8B's (32 / 8, D 128) 64 rows 5190-6380 -> 3230-5340 us, one row no slower.
//
// A bf16 pool's math: q and p rounded to bf16 (round-to-nearest-even), p from the exact max of the row's
// keys, the sum of unrounded p: the chunk kernel's (attention_chunks.cpp), so a prompt attended there or
// here row by row differs in the order of fp32 sums only; a row whose keys are split across threads (below)
// goes in two phases so that its p are rounded against the row's max too.
//
// ISA: GCC vector extensions of 16 floats, so one code path compiles to AVX-512 where -march=native
// has it and to pairs of AVX2 (or SSE) registers elsewhere; bf16 is widened by a 16-bit shift, fp8
// through its fp16 bits (kv_formats.h), q8_0 / q4_0 by converting 16 int8 (or nibbles less 8) at a time,
// times the scale. Head dims that are not a multiple of 16 go through zero-padded buffers.
// Without AVX-512 (16 ymm registers, which those tiles overflow), an fp32 pool with D in {32, 64, 128, 256}
// runs attend_item_f32_avx2: the same math in tiles sized for AVX2.
// With AVX512-BF16, a bf16 pool with D in {32, 64, 96, 128, 256} runs attend_item_bf16 instead: vdpbf16ps on the
// pool's rows as stored (no widening), 2-2.4x the widening path at 64 rows (docs/bench/attention_microbench.py:
// 9/3 heads D 64 over 576 keys 974-980 -> 376-408 us a layer; one row 17.5-20.5 -> 9.2-14.7 us; Qwen3.5's and
// Gemma 3's D 256, 16/4 heads, one row on a Zen 4: over 1k keys 549 -> 178 us, over 32k 13.7 -> 9.3 ms).
// D 256 takes two query heads a pass for the scores, and four for the V sum in quarters of the head (their
// accumulators fill 16 registers; two heads by halves where G is not a multiple of 4). The scores go a q chunk
// against the tile's KT keys at a time (KT independent sums, not one chain of dependent products a key), and the
// V sum broadcasts each key pair's p from a bf16 copy of the row (one load, no scalar packing): 16/4 heads D 256,
// one row over 32k scattered keys, alternated runs on the AMX Xeon with AMX masked (the Zen 4 build's path),
// 12.1-15.6 -> 10.9-12.1 ms a layer; 32/8 D 128 eight rows over 2k 4.4 -> 3.5 ms; D 64 and 32 unchanged.
// Where a KV head serves a multiple of 4 query heads at D 128 or 256, the scores go four heads against half a tile
// of keys: each K chunk loaded once for the four, not once per pair (bit for bit the same sums; docs/benchmarks.md).
// Each tile prefetches the slot rows of the tile two ahead into L2 (sweep_tiles' ahead), a KV head's share before
// that head's products, so the prefetches interleave with them: 16/4 heads D 256, one row over 32k keys in blocks
// scattered over the pool, alternated runs on a Zen 4: 8.4 / 10.6 -> 7.8 / 8.9 ms a layer.
// On AVX-512, fp8 / q8_0 / q4_0 pools with 4k query heads a KV head and D of 128 or 256 run attend_item_quant: each
// 16 values widened once into a register for 4 heads' products, not a widened row read back once per head
// (1.1-1.8x).
// On AMX-BF16 (Sapphire Rapids and later), a bf16 pool's rows over 128 keys or more with D of 128 or 256 run
// attend_item_amx instead: both products on tiles (decode_amx.h), 1.1-1.3x the vdpbf16ps kernel; over 32k keys
// (16/4 heads, D 256, one row) 11.0 -> 8.4 ms a layer, where a plain read of the pool takes 6.2 ms.
// Shared prefixes: over a bf16 pool, rows whose sequences start with the same blocks (prefix caching's system
// prompt, or n samples of a prompt) are grouped (prefix_groups); the keys they share are gathered once per KV
// head and attended by 48 / G rows at a time in the chunk kernel's math (attend_shared: AMX tiles where the
// CPU has them), and only each row's own keys go row by row, in two phases around the merged max so that p
// is still rounded against the row's max. docs/bench/shared_prefix_microbench.py: 64 decode rows behind 512
// shared keys, one layer, 2.5 -> 0.8-1.0 ms (2.5-3x) on the AMX Xeon.
// Also here: rotary embedding, and attention_qkv (rope + the K/V write + attention in one call per layer).
#include "attention.h"
#include "bf16_tile.h"
#include "decode_amx.h"
#include "kv_formats.h"
#include "vec16.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using kvfmt::fp8_row;
using kvfmt::half_to_float;
using vec::load16;
using vec::store16;
using vec::v16f;
using vec::v16h;
using vec::v16u;

typedef int8_t v16c __attribute__((vector_size(16)));
typedef uint8_t v16b __attribute__((vector_size(16)));

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The 16 lanes of a and b summed in pairs: lanes 0-7 from a, 8-15 from b (order kept)
inline v16f pair_sum(v16f a, v16f b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// pair_sum's tree two levels deep over p[0..3]: each lane the sum of 4 lanes of one p (lanes 0-3 from p[0], ...,
// 12-15 from p[3]): the first two levels of reduce_keys over 4 keys
inline v16f pair_tree2(const v16f (&p)[4]) { return pair_sum(pair_sum(p[0], p[1]), pair_sum(p[2], p[3])); }

// Lane j < KT = the sum of p[j]'s lanes (KT = 16 or 8; with 8, lanes 8-15 repeat 0-7)
template <int KT>
inline v16f reduce_keys(const v16f (&p)[KT]) {
  v16f l1[KT / 2], l2[KT / 4];
  for (int i = 0; i < KT / 2; ++i) l1[i] = pair_sum(p[2 * i], p[2 * i + 1]);
  for (int i = 0; i < KT / 4; ++i) l2[i] = pair_sum(l1[2 * i], l1[2 * i + 1]);
  if constexpr (KT == 16) return pair_sum(pair_sum(l2[0], l2[1]), pair_sum(l2[2], l2[3]));
  const v16f l3 = pair_sum(l2[0], l2[1]);
  return pair_sum(l3, l3);
}

// One tile's KT scores of one head: dot(j) is key j's 16 partial products, summed by reduce_keys (keys from
// cnt on score 0)
template <int KT, class Dot>
inline v16f tile_scores(int cnt, Dot&& dot) {
  v16f p[KT];
  for (int j = 0; j < KT; ++j) p[j] = j < cnt ? dot(j) : v16f{0};
  return reduce_keys<KT>(p);
}

// Every cache line of `bytes` from p into L2 (the next tile's slot rows: sweep_tiles' ahead)
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
}

#if defined(__AVX512F__)
// Values 16 h .. 16 h + 15 of the q8_0 (dtype 3) or q4_0 (4) block at blk as fp32, before its scale: the int8
// sign-extended, or the nibbles less 8 (values 16-31 in the high nibbles)
inline __m512 block_half16(const uint8_t* blk, int dtype, int h) {
  if (dtype == 3)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h))));
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
  const __m128i n = _mm_and_si128(h ? _mm_srli_epi16(x, 4) : x, _mm_set1_epi8(15));
  return _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n)), _mm512_set1_ps(8.f));
}
#endif

// A pool's slot row (KVH heads of D values) as fp32 with each head at a multiple of W = 16 * ND floats:
// fp32 rows of whole 16-float chunks are read in place, others are widened into buf (whose padding the
// caller zeroed). On AVX-512, fp8 / q8_0 / q4_0 heads widen 16 values an instruction (kvfmt::fp8_16;
// vpmovsxbd / vpmovzxbd of the bytes or nibbles and vcvtdq2ps): GCC 12 turned the vector-extension conversions
// of the generic path into a byte-by-byte shift and extract, and a 32k-key row over q8_0 took 27 ms a layer (one row,
// 16 / 4 heads D 256, two threads; bf16 7), 16 ms with these
struct Pool {
  const void* data;
  int dtype;  // 0 fp32, 1 bf16, 2 fp8, 3 q8_0, 4 q4_0
  int64_t row_stride, kvh, d;  // row_stride: elements of a slot row (bytes for uint8 pools)
  const uint16_t* scale = nullptr;  // fp8: [NB * BS, KVH] bf16
  bool e5m2 = false;                // fp8: e5m2, else e4m3fn

  // fp8: the factor of slot's KV head kh that turns kvfmt::fp8_half_bits' values into the stored values times the
  // scale
  float fp8_scale(int64_t slot, int64_t kh) const {
    return bf16_to_float(scale[slot * kvh + kh]) * kvfmt::fp8_unbias(e5m2);
  }

  int64_t row_bytes() const { return row_stride * (dtype == 0 ? 4 : dtype == 1 ? 2 : 1); }
  const void* row_at(int64_t slot) const { return static_cast<const char*>(data) + slot * row_bytes(); }
  // slot's KV head kh into L2 (sweep_tiles' ahead)
  void prefetch_head(int64_t slot, int64_t kh) const {
    const int64_t hb = row_bytes() / kvh;
    prefetch_row(static_cast<const char*>(row_at(slot)) + kh * hb, hb);
  }

  template <int ND, bool TAIL>
  inline const float* row(int64_t slot, float* buf) const {
    constexpr int W = 16 * ND;
    const int64_t off = slot * row_stride;
    if (dtype == 0 && !TAIL) return static_cast<const float*>(data) + off;
    for (int64_t kh = 0; kh < kvh; ++kh) {
      float* dst = buf + kh * W;
      if (dtype == 0) {
        std::memcpy(dst, static_cast<const float*>(data) + off + kh * d, d * sizeof(float));
      } else if (dtype == 1) {
        const uint16_t* src = static_cast<const uint16_t*>(data) + off + kh * d;
        if (TAIL) {
          for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_float(src[i]);
        } else {
          for (int c = 0; c < ND; ++c) {  // 16 at a time: zero-extend and shift into the top half
            v16h h;
            std::memcpy(&h, src + 16 * c, sizeof(h));
            const v16u u = __builtin_convertvector(h, v16u) << 16;
            v16f f;
            std::memcpy(&f, &u, sizeof(f));
            store16(dst + 16 * c, f);
          }
        }
      } else if (dtype == 2) {
        const uint8_t* src = static_cast<const uint8_t*>(data) + off + kh * d;
        fp8_row(src, d, e5m2, fp8_scale(slot, kh), dst);
      } else {  // q8_0 / q4_0 blocks of 32 (d a multiple of 32)
        const int64_t bb = dtype == 3 ? 34 : 18;
        const uint8_t* src = static_cast<const uint8_t*>(data) + off + kh * (d / 32) * bb;
        for (int64_t b = 0; b < d / 32; ++b) {
          const uint8_t* blk = src + b * bb;
          uint16_t hs;
          std::memcpy(&hs, blk, sizeof(hs));
          const float sc = half_to_float(hs);
#if defined(__AVX512F__)  // 16 values an op
          for (int h = 0; h < 2; ++h)
            _mm512_storeu_ps(dst + 32 * b + 16 * h, _mm512_mul_ps(block_half16(blk, dtype, h), _mm512_set1_ps(sc)));
#else
          for (int c = 0; c < 2; ++c) {
            v16f f;
            if (dtype == 3) {
              v16c x;
              std::memcpy(&x, blk + 2 + 16 * c, sizeof(x));
              f = __builtin_convertvector(x, v16f);
            } else {
              v16b x;
              std::memcpy(&x, blk + 2, sizeof(x));
              const v16b n = c ? v16b(x >> 4) : v16b(x & 15);  // values 16-31 in the high nibbles
              f = __builtin_convertvector(n, v16f) - 8.f;
            }
            store16(dst + 32 * b + 16 * c, f * sc);
          }
#endif
        }
      }
    }
    return buf;
  }
};

struct Item {  // one query row's keys [lo, hi) and where its per-head (max, sum, V sum) go
  const float* q;  // [H, D] of the row
  const int64_t* table;
  int64_t lo, hi;
  float *mx, *sum, *acc;  // [H], [H], [H, D]
  // A split row over a bf16 pool goes in two phases, so that its p are rounded against the row's max:
  // 1 the scores (into `scores`, [H, ld], kept) and their max (mx); 2 from those scores and the row's max
  // (mx, given), the softmax and V. 0: all at once.
  int phase = 0;
  float* scores = nullptr;
};

// A head's attention sink (gpt-oss): one more logit in the softmax's denominator, with no value; its weight
// against the max m the row's sums were taken from (0 without sinks)
inline float sink_weight(const float* sinks, int64_t h, float m) { return sinks ? std::exp(sinks[h] - m) : 0.f; }

inline int64_t score_ld(int64_t n) { return (n + 15) / 16 * 16 + 16; }  // + one store of slack

struct Scratch {
  std::vector<float> scores, tile, qpad, acc;
  std::vector<int64_t> slots;
  std::vector<uint32_t> q_tiles;        // AMX: q as B tiles
  std::vector<uint16_t> stage, pairs, vt;  // AMX: staged K rows, p by key pairs, V as key pairs
};

// Pass 2 of an item: each head's n scores (rows of sc, ld apart, ld >= 16 ceil(n / 16) + 16) -> the softmax
// numerators from the exact max, summed unrounded, stored rounded to bf16 if `round`; the slack after them 0
// (a key pair may read one past the last key)
// (phase 1 stops after the max; phase 2 takes it.mx as the max)
void softmax_rows(const Item& it, float* sc, int64_t H, int64_t n, int64_t ld, bool round) {
  const int64_t nv = (n + 15) / 16;
  for (int64_t h = 0; h < H; ++h) {
    float* sg = sc + h * ld;
    std::fill(sg + n, sg + 16 * nv, vec::kMasked);
    v16f mv = v16f{} + vec::kMasked;
    for (int64_t c = 0; c < nv; ++c) {
      const v16f x = load16(sg + 16 * c);
      mv = x > mv ? x : mv;
    }
    if (it.phase == 1) {
      it.mx[h] = vec::hmax(mv);
      continue;
    }
    const float m = it.phase == 2 ? it.mx[h] : vec::hmax(mv);
    v16f total = v16f{};
    for (int64_t c = 0; c < nv; ++c) {
      const v16f e = vec::exp16(load16(sg + 16 * c) - m);
      total += e;
      store16(sg + 16 * c, round ? vec::round_bf16(e) : e);
    }
    std::fill(sg + 16 * nv, sg + 16 * nv + 16, 0.f);
    it.mx[h] = m;
    it.sum[h] = vec::hsum(total);
  }
}

// The tiles of KT keys of an item in slot order: row(j, slot) for each key j of the tile, then group(t0, cnt,
// kh, h0) for each KV head kh and each of its groups of GB query heads h0 ..
// ahead(slot) is called for the keys of the tile two after this one (a prefetch: blocks are scattered over the pool,
// so the hardware's stream prefetchers lose the trail at every block edge, and without it a long context's
// rows arrive while the dot products wait instead of during them)
template <int KT, int GB, class Row, class Group, class Ahead>
inline void sweep_tiles(const Item& it, int64_t KVH, int64_t G, int64_t BS, Row&& row, Group&& group, Ahead&& ahead) {
  for (int64_t t0 = it.lo; t0 < it.hi; t0 += KT) {
    const int cnt = static_cast<int>(std::min<int64_t>(KT, it.hi - t0));
    for (int j = 0; j < cnt; ++j) {
      const int64_t t = t0 + j;
      row(j, it.table[t / BS] * BS + t % BS);
    }
    int64_t next[KT];
    int nn = 0;
    for (int64_t t = t0 + 2 * KT; t < std::min<int64_t>(t0 + 3 * KT, it.hi); ++t) next[nn++] = it.table[t / BS] * BS + t % BS;
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int j = 0; j < nn; ++j) ahead(next[j], kh);
      for (int64_t h0 = kh * G; h0 < (kh + 1) * G; h0 += GB) group(t0, cnt, kh, h0);
    }
  }
}

template <int KT, int GB, class Row, class Group>
inline void sweep_tiles(const Item& it, int64_t KVH, int64_t G, int64_t BS, Row&& row, Group&& group) {
  sweep_tiles<KT, GB>(it, KVH, G, BS, row, group, [](int64_t, int64_t) {});
}

// All heads of one item: key tiles of KT in order (K in pass 1, V in pass 3, each slot row read once and
// sequentially); within a tile, per KV head its G query heads GB at a time
template <int ND, int GB, bool TAIL>
void attend_item(const Item& it, int64_t H, int64_t KVH, const Pool& K, const Pool& V, int64_t BS, float scale,
                 Scratch& s) {
  constexpr int W = 16 * ND;            // padded head dim
  // keys per tile: KT products + GB * ND q vectors in registers
  constexpr int KT = ND <= 4 && vec::kRegs >= 32 ? 16 : 8;
  const int64_t D = K.d, G = H / KVH, n = it.hi - it.lo, ld = score_ld(n);
  if (!it.scores) s.scores.resize(H * ld);
  if (TAIL)  // the widened rows' padding must read as zeros; whole chunks are always written
    s.tile.assign(KT * KVH * W, 0.f);
  else
    s.tile.resize(KT * KVH * W);
  s.acc.assign(H * W, 0.f);
  float* sc = it.scores ? it.scores : s.scores.data();
  float* acc_mem = s.acc.data();
  const float* q = it.q;
  const bool rq = K.dtype == 1;  // bf16 pool: q and p rounded to bf16 as in the chunk kernel's dot products
  if (TAIL || rq) {
    s.qpad.assign(H * W, 0.f);
    for (int64_t h = 0; h < H; ++h) std::copy(it.q + h * D, it.q + (h + 1) * D, s.qpad.data() + h * W);
    if (rq)
      for (int64_t i = 0; i < H * W; i += 16) store16(s.qpad.data() + i, vec::round_bf16(load16(s.qpad.data() + i)));
    q = s.qpad.data();
  }
  const float* rows[KT];
  // the item's tiles (sweep_tiles), each slot row of pool P widened once
  auto sweep = [&](const Pool& P, auto&& group) {
    sweep_tiles<KT, GB>(it, KVH, G, BS, [&](int j, int64_t slot) {
      rows[j] = P.row<ND, TAIL>(slot, s.tile.data() + j * KVH * W);
    }, group, [&](int64_t slot, int64_t kh) { P.prefetch_head(slot, kh); });
  };
  // pass 1: scores, KT keys of GB heads at a time, summed across lanes by the shuffle tree
  if (it.phase != 2) sweep(K, [&](int64_t t0, int cnt, int64_t kh, int64_t h0) {
    v16f qr[GB][ND];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < ND; ++c) qr[g][c] = load16(q + (h0 + g) * W + 16 * c) * scale;
    for (int g = 0; g < GB; ++g)
      store16(sc + (h0 + g) * ld + (t0 - it.lo), tile_scores<KT>(cnt, [&](int j) {
                const float* kr = rows[j] + kh * W;
                v16f a = qr[g][0] * load16(kr);
                for (int c = 1; c < ND; ++c) a += qr[g][c] * load16(kr + 16 * c);
                return a;
              }));
  });
  softmax_rows(it, sc, H, n, ld, rq);
  if (it.phase == 1) return;
  // pass 3: V sums, GB x ND accumulators in registers for a tile's keys
  sweep(V, [&](int64_t t0, int cnt, int64_t kh, int64_t h0) {
    v16f acc[GB][ND];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < ND; ++c) acc[g][c] = load16(acc_mem + (h0 + g) * W + 16 * c);
    for (int j = 0; j < cnt; ++j) {
      const float* vr = rows[j] + kh * W;
      for (int g = 0; g < GB; ++g) {
        const float pr = sc[(h0 + g) * ld + (t0 - it.lo) + j];
        for (int c = 0; c < ND; ++c) acc[g][c] += pr * load16(vr + 16 * c);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < ND; ++c) store16(acc_mem + (h0 + g) * W + 16 * c, acc[g][c]);
  });
  for (int64_t h = 0; h < H; ++h) std::copy(acc_mem + h * W, acc_mem + h * W + D, it.acc + h * D);
}

using ItemFn = void (*)(const Item&, int64_t, int64_t, const Pool&, const Pool&, int64_t, float, Scratch&);

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The V sum of NH (<= 3) query heads that share a KV head, D = 8 * ND: out[g] = sum_t p[g][t] V[slot t], each V
// row's chunk of 4 vectors loaded once for the NH heads (NH x 4 accumulators: independent chains, so the fmas
// run at the port's rate, where one head's 8 accumulators waited on each one's previous key)
template <int ND, int NH>
inline void v_sum_avx2(const float* vh, const int64_t* slot, int64_t n, const float* p, int64_t ld, float* out,
                       int64_t D) {
  constexpr int CH = ND < 4 ? ND : 4;
  for (int c0 = 0; c0 < ND; c0 += CH) {
    __m256 acc[NH][CH];
    for (int g = 0; g < NH; ++g)
      for (int c = 0; c < CH; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const float* vr = vh + slot[t] + 8 * c0;
      for (int g = 0; g < NH; ++g) {
        const __m256 pr = _mm256_broadcast_ss(p + g * ld + t);
        for (int c = 0; c < CH; ++c) acc[g][c] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vr + 8 * c), acc[g][c]);
      }
    }
    for (int g = 0; g < NH; ++g)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(out + g * D + 8 * (c0 + c), acc[g][c]);
  }
}

// An fp32 pool's item on AVX2, D = 8 * ND: attend_item's math (scores of the q scaled first, softmax_rows, the V
// sum) with tiles sized for 16 ymm registers, the pool's rows read in place. Per query head: q in ND registers,
// 4 keys' products at a time summed by two hadd levels and one add of the 128-bit halves (no horizontal sum
// per key); the V sum by v_sum_avx2, a KV head's query heads up to 3 at a time. attend_item's
// AVX-512 tiles (KT products of 16 floats, GB * ND q vectors) spill to the stack on AVX2.
template <int ND>
void attend_item_f32_avx2(const Item& it, int64_t H, int64_t KVH, const Pool& K, const Pool& V, int64_t BS, float scale,
                          Scratch& s) {
  const int64_t D = K.d, G = H / KVH, n = it.hi - it.lo, ld = score_ld(n), stride = K.row_stride;
  if (!it.scores) s.scores.resize(H * ld);
  float* sc = it.scores ? it.scores : s.scores.data();
  s.slots.resize(n);
  for (int64_t t = 0; t < n; ++t) s.slots[t] = (it.table[(it.lo + t) / BS] * BS + (it.lo + t) % BS) * stride;
  const int64_t* slot = s.slots.data();
  const float* kp = static_cast<const float*>(K.data);
  const float* vp = static_cast<const float*>(V.data);
  if (it.phase != 2) {
    for (int64_t h = 0; h < H; ++h) {
      const float* kh = kp + (h / G) * D;
      __m256 qv[ND];
      for (int c = 0; c < ND; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(it.q + h * D + 8 * c), _mm256_set1_ps(scale));
      for (int64_t t = 0; t < n; t += 4) {
        __m256 p[4];
        for (int j = 0; j < 4; ++j) {
          p[j] = _mm256_setzero_ps();
          if (t + j < n) {
            const float* kr = kh + slot[t + j];
            for (int c = 0; c < ND; ++c) p[j] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + 8 * c), p[j]);
          }
        }
        // [key j's sum over the low 128 bits of its products | over the high], then the halves added
        const __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
        _mm_storeu_ps(sc + h * ld + t, _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1)));
      }
    }
  }
  softmax_rows(it, sc, H, n, ld, false);
  if (it.phase == 1) return;
  for (int64_t kh = 0; kh < KVH; ++kh)
    for (int64_t h0 = kh * G; h0 < (kh + 1) * G; h0 += 3) {
      const int64_t nh = std::min<int64_t>(3, (kh + 1) * G - h0);
      const float* vh = vp + kh * D;
      if (nh == 3) v_sum_avx2<ND, 3>(vh, slot, n, sc + h0 * ld, ld, it.acc + h0 * D, D);
      if (nh == 2) v_sum_avx2<ND, 2>(vh, slot, n, sc + h0 * ld, ld, it.acc + h0 * D, D);
      if (nh == 1) v_sum_avx2<ND, 1>(vh, slot, n, sc + h0 * ld, ld, it.acc + h0 * D, D);
    }
}

ItemFn pick_f32(int64_t D) {
  switch (D) {
    case 32: return attend_item_f32_avx2<4>;
    case 64: return attend_item_f32_avx2<8>;
    case 128: return attend_item_f32_avx2<16>;
    case 256: return attend_item_f32_avx2<32>;
    default: return nullptr;
  }
}

// One KV head of one slot row of a bf16, fp8, q8_0 or q4_0 pool widened to D fp32 values (8 at a time)
inline void widen_head_avx2(const Pool& P, int64_t slot, int64_t kh, float* dst) {
  const int64_t D = P.d;
  const uint8_t* row = static_cast<const uint8_t*>(P.data);
  switch (P.dtype) {
    case 1: {  // bf16: zero-extend and shift into the top half
      const uint16_t* src = reinterpret_cast<const uint16_t*>(row) + slot * P.row_stride + kh * D;
      for (int64_t i = 0; i < D; i += 8) {
        const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
      }
      break;
    }
    case 2: {  // fp8: its fp16 bits widened, times the slot's scale
      const uint8_t* src = row + slot * P.row_stride + kh * D;
      fp8_row(src, D, P.e5m2, P.fp8_scale(slot, kh), dst);
      break;
    }
    case 3: {  // q8_0: 32 int8 times the block's fp16 scale
      const uint8_t* src = row + slot * P.row_stride + kh * (D / 32) * 34;
      for (int64_t b = 0; b < D / 32; ++b, src += 34) {
        uint16_t hs;
        std::memcpy(&hs, src, sizeof(hs));
        const __m256 sc = _mm256_set1_ps(half_to_float(hs));
        for (int c = 0; c < 4; ++c) {
          const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + 8 * c)));
          _mm256_storeu_ps(dst + 32 * b + 8 * c, _mm256_mul_ps(_mm256_cvtepi32_ps(x), sc));
        }
      }
      break;
    }
    default: {  // q4_0: values 0-15 in the low nibbles, 16-31 in the high ones, less 8, times the scale
      const uint8_t* src = row + slot * P.row_stride + kh * (D / 32) * 18;
      const __m128i lo4 = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
      for (int64_t b = 0; b < D / 32; ++b, src += 18) {
        uint16_t hs;
        std::memcpy(&hs, src, sizeof(hs));
        const __m256 sc = _mm256_set1_ps(half_to_float(hs));
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2));
        const __m128i half[2] = {_mm_sub_epi8(_mm_and_si128(x, lo4), eight),
                                 _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(x, 4), lo4), eight)};
        for (int c = 0; c < 4; ++c) {
          const __m128i h = c & 1 ? _mm_srli_si128(half[c / 2], 8) : half[c / 2];
          _mm256_storeu_ps(dst + 32 * b + 8 * c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h)), sc));
        }
      }
    }
  }
}

// A bf16, fp8, q8_0 or q4_0 pool's item on AVX2, D = 8 * ND: tiles of TK keys, each key's slot row (all KV
// heads) widened once into a buffer of TK x KVH x D floats (L1 / L2), then attend_item_f32_avx2's math for each
// query head (4 keys' products summed by hadd; the V sum in registers across the tile's keys). attend_item widens
// the same rows 16 floats at a time into 16-float vectors, which AVX2's 16 ymm registers cannot hold as tiles:
// at 4,096 keys (9 / 3 heads, D 64, one row) it took 1.3 ms a layer over bf16 and 3.2 over q8_0.
// A bf16 pool rounds q and p to bf16 as attend_item does.
template <int ND>
void attend_item_widened_avx2(const Item& it, int64_t H, int64_t KVH, const Pool& K, const Pool& V, int64_t BS,
                              float scale, Scratch& s) {
  constexpr int64_t D = 8 * ND;
  const int64_t G = H / KVH, n = it.hi - it.lo, ld = score_ld(n), row = KVH * D;
  const int64_t TK = std::clamp<int64_t>(16384 / row / 4 * 4, 4, 64);  // a tile of at most 64 KB
  if (!it.scores) s.scores.resize(H * ld);
  float* sc = it.scores ? it.scores : s.scores.data();
  s.tile.resize(TK * row);
  float* tile = s.tile.data();
  const bool rq = K.dtype == 1;
  // widen keys [t0, t0 + cnt) of pool P into tile, [cnt, KVH, D]
  auto widen = [&](const Pool& P, int64_t t0, int64_t cnt) {
    for (int64_t j = 0; j < cnt; ++j) {
      const int64_t t = it.lo + t0 + j, slot = it.table[t / BS] * BS + t % BS;
      for (int64_t kh = 0; kh < KVH; ++kh) widen_head_avx2(P, slot, kh, tile + j * row + kh * D);
    }
  };
  if (it.phase != 2) {
    s.qpad.resize(H * D);  // q times the scale (rounded to bf16 first over a bf16 pool)
    for (int64_t i = 0; i < H * D; i += 16) {
      const v16f x = load16(it.q + i);
      store16(s.qpad.data() + i, (rq ? vec::round_bf16(x) : x) * scale);
    }
    for (int64_t t0 = 0; t0 < n; t0 += TK) {
      const int64_t cnt = std::min(TK, n - t0);
      widen(K, t0, cnt);
      for (int64_t h = 0; h < H; ++h) {
        const float* kh = tile + (h / G) * D;
        __m256 qv[ND];
        for (int c = 0; c < ND; ++c) qv[c] = _mm256_loadu_ps(s.qpad.data() + h * D + 8 * c);
        for (int64_t t = 0; t < cnt; t += 4) {
          __m256 p[4];
          for (int j = 0; j < 4; ++j) {
            p[j] = _mm256_setzero_ps();
            if (t + j < cnt) {
              const float* kr = kh + (t + j) * row;
              for (int c = 0; c < ND; ++c) p[j] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + 8 * c), p[j]);
            }
          }
          const __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
          _mm_storeu_ps(sc + h * ld + t0 + t, _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1)));
        }
      }
    }
  }
  softmax_rows(it, sc, H, n, ld, rq);
  if (it.phase == 1) return;
  // accumulators a pass, a divisor of ND: D 96's 12 chunks go as two passes of 6 (passes of 8 ran past the head's
  // D, into the next head's sums and past the last one's)
  constexpr int CH = ND % 8 == 0 ? 8 : ND % 6 == 0 ? 6 : ND % 4 == 0 ? 4 : ND;
  static_assert(ND % CH == 0 && CH <= 8, "a pass's accumulators must tile the head and fit the registers");
  std::fill(it.acc, it.acc + H * D, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += TK) {
    const int64_t cnt = std::min(TK, n - t0);
    widen(V, t0, cnt);
    for (int64_t h = 0; h < H; ++h) {
      const float* ph = sc + h * ld + t0;
      const float* vh = tile + (h / G) * D;
      for (int c0 = 0; c0 < ND; c0 += CH) {
        float* out = it.acc + h * D + 8 * c0;
        __m256 acc[CH];
        for (int c = 0; c < CH; ++c) acc[c] = _mm256_loadu_ps(out + 8 * c);
        for (int64_t t = 0; t < cnt; ++t) {
          const __m256 pr = _mm256_broadcast_ss(ph + t);
          const float* vr = vh + t * row + 8 * c0;
          for (int c = 0; c < CH; ++c) acc[c] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vr + 8 * c), acc[c]);
        }
        for (int c = 0; c < CH; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
      }
    }
  }
}

ItemFn pick_widened(int64_t D) {
  switch (D) {
    case 32: return attend_item_widened_avx2<4>;
    case 64: return attend_item_widened_avx2<8>;
    case 96: return attend_item_widened_avx2<12>;
    case 128: return attend_item_widened_avx2<16>;
    case 256: return attend_item_widened_avx2<32>;
    default: return nullptr;
  }
}
#else
ItemFn pick_f32(int64_t) { return nullptr; }  // attend_item's tiles fit AVX-512's 32 registers
ItemFn pick_widened(int64_t) { return nullptr; }
#endif

#if defined(__AVX512F__)
// One KV head of a slot row in an fp8, q8_0 or q4_0 pool, found once a tile: its bytes and their scales as fp32 (the
// slot's for fp8, a block's for q8_0 / q4_0), so that widening a chunk of 16 values is a load, a few converts and a
// multiply: the products Pool::row makes (the same values)
struct QuantHead {
  const uint8_t* p;
  float sc[8];  // fp8: sc[0]; q8_0 / q4_0: blocks of 32 (D <= 256)

  void at(const Pool& P, int64_t slot, int64_t kh) {
    if (P.dtype == 2) {
      p = static_cast<const uint8_t*>(P.data) + slot * P.row_stride + kh * P.d;
      sc[0] = P.fp8_scale(slot, kh);
      return;
    }
    const int64_t bb = P.dtype == 3 ? 34 : 18;
    p = static_cast<const uint8_t*>(P.data) + slot * P.row_stride + kh * (P.d / 32) * bb;
    for (int64_t b = 0; b < P.d / 32; ++b) {
      uint16_t hs;
      std::memcpy(&hs, p + b * bb, sizeof(hs));
      sc[b] = half_to_float(hs);
    }
  }
};

// Chunk c (16 values) of a head of pool P
inline __m512 widen16(const QuantHead& h, const Pool& P, int c) {
  if (P.dtype == 2) return _mm512_mul_ps(kvfmt::fp8_16(h.p + 16 * c, P.e5m2), _mm512_set1_ps(h.sc[0]));
  const __m512 x = block_half16(h.p + (P.dtype == 3 ? 34 : 18) * (c / 2), P.dtype, c % 2);
  return _mm512_mul_ps(x, _mm512_set1_ps(h.sc[c / 2]));
}

// Lane j < 4 = the sum of p[j]'s lanes
inline v16f reduce4(const v16f (&p)[4]) {
  const v16f l2 = pair_tree2(p);
  const v16f l3 = pair_sum(l2, l2);
  return pair_sum(l3, l3);
}

// An fp8 / q8_0 / q4_0 pool's item on AVX-512, D = 16 * ND (K and V each in its own format): attend_item's math with
// each 16 values of a key widened once into a register and used by 4 query heads of its KV head. attend_item
// widens whole slot rows into a buffer and reads them back once per query head, one load per FMA at D 256: over
// 32k keys of q8_0 (16 / 4 heads, one row, two threads on a Zen 4) 13.5-16.1 ms a layer against 9.1-9.3 here, and
// 377 -> 298 ns a key on cache-resident keys (bf16's vdpbf16ps kernel: 184). Still FMA-bound: fp32 products at
// 16 a cycle, where bf16 pools take 32. Scores: 4 heads x 4 keys of accumulators, q chunks from L1; V sums: a chunk
// of 4 heads' accumulators at a time, each key's p broadcast once a tile.
template <int ND>
void attend_item_quant(const Item& it, int64_t H, int64_t KVH, const Pool& K, const Pool& V, int64_t BS, float scale,
                       Scratch& s) {
  constexpr int GB = 4, KT = 4;  // 16 accumulators, 4 widened chunks, a q chunk
  constexpr int64_t D = 16 * ND;
  const int64_t G = H / KVH, n = it.hi - it.lo, ld = score_ld(n);
  if (!it.scores) s.scores.resize(H * ld);
  float* sc = it.scores ? it.scores : s.scores.data();
  s.qpad.resize(H * D);
  for (int64_t i = 0; i < H * D; i += 16) store16(s.qpad.data() + i, load16(it.q + i) * scale);
  const float* q = s.qpad.data();
  int64_t slots[KT];
  QuantHead heads[KT];
  auto row = [&](int j, int64_t slot) { slots[j] = slot; };
  if (it.phase != 2)
    sweep_tiles<KT, GB>(it, KVH, G, BS, row, [&](int64_t t0, int cnt, int64_t kh, int64_t h0) {
      v16f p[GB][KT];
      for (int g = 0; g < GB; ++g)
        for (int j = 0; j < KT; ++j) p[g][j] = v16f{0};
      for (int j = 0; j < cnt; ++j) heads[j].at(K, slots[j], kh);
#pragma GCC unroll 16
      for (int c = 0; c < ND; ++c) {
        v16f kv[KT];
        for (int j = 0; j < KT; ++j) kv[j] = j < cnt ? (v16f)widen16(heads[j], K, c) : v16f{0};
        for (int g = 0; g < GB; ++g) {
          const v16f qv = load16(q + (h0 + g) * D + 16 * c);
          for (int j = 0; j < KT; ++j) p[g][j] += qv * kv[j];
        }
      }
      for (int g = 0; g < GB; ++g) store16(sc + (h0 + g) * ld + (t0 - it.lo), reduce4(p[g]));
    }, [&](int64_t slot, int64_t kh) { K.prefetch_head(slot, kh); });
  softmax_rows(it, sc, H, n, ld, false);
  if (it.phase == 1) return;
  s.acc.assign(H * D, 0.f);
  float* acc = s.acc.data();
  sweep_tiles<KT, GB>(it, KVH, G, BS, row, [&](int64_t t0, int cnt, int64_t kh, int64_t h0) {
    v16f pb[GB][KT];
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < KT; ++j) pb[g][j] = v16f{} + sc[(h0 + g) * ld + (t0 - it.lo) + j];
    for (int j = 0; j < cnt; ++j) heads[j].at(V, slots[j], kh);
#pragma GCC unroll 16
    for (int c = 0; c < ND; ++c) {
      v16f a[GB];
      for (int g = 0; g < GB; ++g) a[g] = load16(acc + (h0 + g) * D + 16 * c);
      for (int j = 0; j < cnt; ++j) {
        const v16f vv = (v16f)widen16(heads[j], V, c);
        for (int g = 0; g < GB; ++g) a[g] += pb[g][j] * vv;
      }
      for (int g = 0; g < GB; ++g) store16(acc + (h0 + g) * D + 16 * c, a[g]);
    }
  }, [&](int64_t slot, int64_t kh) { V.prefetch_head(slot, kh); });
  std::copy(acc, acc + H * D, it.acc);
}

// The item for fp8 / q8_0 / q4_0 pools (K and V: each widens by its own format) where a KV head has a multiple of 4
// query heads and D is 128 or 256: where it was measured faster (fp8 over 32k keys, 16 / 4 heads x 256, one row:
// 13.9-17.0 -> 11.8-13.4 ms a layer; 457 -> 315 ns a key in cache). With fewer heads to share a widened chunk it was
// not (9 / 3 heads x 64, one row over 576 keys: 32 -> 35-44 us; 64 rows the same).
ItemFn pick_quant(int64_t D, int64_t G) {
  if (G % 4 != 0) return nullptr;
  return D == 128 ? attend_item_quant<8> : D == 256 ? attend_item_quant<16> : nullptr;
}
#else
ItemFn pick_quant(int64_t, int64_t) { return nullptr; }  // AVX2: attend_item_widened_avx2
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// A bf16 pool's item on bf16 dot products, D = 32 * NC: q (rounded to bf16) against the pool's K rows as they
// are (pairs of d), and V by pairs of keys (rows j, j+1 interleaved by unpack: within each 128-bit lane,
// unpacklo holds d 0-3 and unpackhi d 4-7 of that lane's 8, so the accumulators hold d in that order until the
// end). The same math as attend_item's for this pool (products of bf16 values are exact in fp32).
template <int NC, int GB, int GV = GB>
void attend_item_bf16(const Item& it, int64_t H, int64_t KVH, const Pool& K, const Pool& V, int64_t BS, float scale,
                      Scratch& s) {
  constexpr int KT = NC <= 2 ? 16 : 8;
  constexpr int ND = 2 * NC;  // 16-float accumulators per head
  const int64_t D = K.d, G = H / KVH, n = it.hi - it.lo, ld = score_ld(n);
  if (!it.scores) s.scores.resize(H * ld);
  s.acc.assign(H * D, 0.f);
  float* sc = it.scores ? it.scores : s.scores.data();
  float* acc_mem = s.acc.data();  // [H, D] in the unpack order
  s.qpad.resize(H * D / 2 + 16);
  uint32_t* qb = reinterpret_cast<uint32_t*>(s.qpad.data());  // q as bf16 pairs [H, D / 2]
  for (int64_t i = 0; i < H * D; i += 32) {
    const v16u lo = vec::bf16_bits(load16(it.q + i)) >> 16, hi = vec::bf16_bits(load16(it.q + i + 16)) >> 16;
    for (int j = 0; j < 8; ++j) {  // pairs (2j, 2j + 1) of the 32
      qb[i / 2 + j] = lo[2 * j] | (lo[2 * j + 1] << 16);
      qb[i / 2 + 8 + j] = hi[2 * j] | (hi[2 * j + 1] << 16);
    }
  }
  const uint16_t* kp = static_cast<const uint16_t*>(K.data);
  const uint16_t* vp = static_cast<const uint16_t*>(V.data);
  const uint16_t* rows[KT + 1];
  static const uint16_t zeros[256] = {};
  if (it.phase != 2)
    sweep_tiles<KT, GB>(it, KVH, G, BS, [&](int j, int64_t slot) { rows[j] = kp + slot * K.row_stride; },
                        [&](int64_t t0, int cnt, int64_t kh, int64_t h0) {
    auto dots = [&](auto whole) {  // whole: a tile of KT keys (no per-key bound)
      if constexpr (GB == 4 && KT == 8) {
        // four heads against half a tile (4 keys) at a time, 16 accumulators: each K chunk is loaded once for the
        // four heads (not once per pair of heads) and each q chunk once for the four keys; the halves' sums meet
        // in reduce_keys<8>'s tree, so the scores are the other path's bit for bit
        v16f first[4];  // per head: keys 0-3 summed to the tree's second level
        for (int half = 0; half < 2; ++half) {
          v16f p[4][4];
          for (int g = 0; g < 4; ++g)
            for (int j = 0; j < 4; ++j) p[g][j] = v16f{0};
          for (int c = 0; c < NC; ++c) {
            __m512bh qv[4];
            for (int g = 0; g < 4; ++g) qv[g] = (__m512bh)_mm512_loadu_si512(qb + (h0 + g) * D / 2 + 16 * c);
            for (int j = 0; j < 4; ++j)
              if (whole || 4 * half + j < cnt) {
                const __m512bh kv = (__m512bh)_mm512_loadu_si512(rows[4 * half + j] + kh * D + 32 * c);
                for (int g = 0; g < 4; ++g) p[g][j] = (v16f)_mm512_dpbf16_ps((__m512)p[g][j], qv[g], kv);
              }
          }
          for (int g = 0; g < 4; ++g) {
            const v16f l2 = pair_tree2(p[g]);
            if (half == 0) {
              first[g] = l2;
            } else {
              const v16f l3 = pair_sum(first[g], l2);
              store16(sc + (h0 + g) * ld + (t0 - it.lo), pair_sum(l3, l3) * scale);
            }
          }
        }
      } else {
        // q of the GB heads in registers; a chunk of q against every key of the tile before the next chunk: KT
        // independent sums in flight instead of one chain of NC dependent products a key (each key's products
        // still summed in chunk order)
        __m512bh qr[GB][NC];
        for (int g = 0; g < GB; ++g)
          for (int c = 0; c < NC; ++c) qr[g][c] = (__m512bh)_mm512_loadu_si512(qb + (h0 + g) * D / 2 + 16 * c);
        for (int g = 0; g < GB; ++g) {
          v16f p[KT];
          for (int j = 0; j < KT; ++j) p[j] = v16f{0};
          for (int c = 0; c < NC; ++c)
            for (int j = 0; j < KT; ++j)
              if (whole || j < cnt)
                p[j] = (v16f)_mm512_dpbf16_ps((__m512)p[j], qr[g][c], (__m512bh)_mm512_loadu_si512(rows[j] + kh * D + 32 * c));
          store16(sc + (h0 + g) * ld + (t0 - it.lo), reduce_keys<KT>(p) * scale);
        }
      }
    };
    if (cnt == KT) dots(std::true_type{});
    else dots(std::false_type{});
  }, [&](int64_t slot, int64_t kh) { prefetch_row(kp + slot * K.row_stride + kh * D, D * 2); });
  softmax_rows(it, sc, H, n, ld, true);
  if (it.phase == 1) return;
  // p as bf16 in key order [H, ld] (already rounded: exact): a key pair's two p are one 32-bit word, broadcast by a
  // load
  s.pairs.resize(H * ld);
  for (int64_t i = 0; i < H * ld; i += 16)  // ld is a multiple of 16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.pairs.data() + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc + i)));
  const uint16_t* pb = s.pairs.data();
  // the V sum in parts of the head dims where GV heads' accumulators would not fit 16 registers (D 256, 4 heads:
  // four parts, each a pass over the tile's V rows, which are in L1 by then)
  constexpr int SPLIT = [] {  // the fewest parts of whole 32-wide chunks whose accumulators fit
    for (int p = 1; p < NC; ++p)
      if (NC % p == 0 && GV * ND / p <= 16) return p;
    return NC;
  }();
  constexpr int NCS = NC / SPLIT;
  sweep_tiles<KT, GV>(it, KVH, G, BS, [&](int j, int64_t slot) { rows[j] = vp + slot * K.row_stride; },
                      [&](int64_t t0, int cnt, int64_t kh, int64_t h0) {
    for (int part = 0; part < SPLIT; ++part) {
      const int c0 = part * NCS;
      __m512 acc[GV][2 * NCS];
      for (int g = 0; g < GV; ++g)
        for (int c = 0; c < 2 * NCS; ++c) acc[g][c] = _mm512_loadu_ps(acc_mem + (h0 + g) * D + 16 * (2 * c0 + c));
      for (int j = 0; j < cnt; j += 2) {
        const uint16_t* v0 = rows[j] + kh * D;
        const uint16_t* v1 = j + 1 < cnt ? rows[j + 1] + kh * D : zeros;  // its p is 0 (masked past hi)
        for (int cc = 0; cc < NCS; ++cc) {
          const int c = c0 + cc;
          const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
          const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
          for (int g = 0; g < GV; ++g) {
            int32_t w;
            std::memcpy(&w, pb + (h0 + g) * ld + (t0 - it.lo) + j, 4);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32(w);
            acc[g][2 * cc] = _mm512_dpbf16_ps(acc[g][2 * cc], lo, pp);
            acc[g][2 * cc + 1] = _mm512_dpbf16_ps(acc[g][2 * cc + 1], hi, pp);
          }
        }
      }
      for (int g = 0; g < GV; ++g)
        for (int c = 0; c < 2 * NCS; ++c) _mm512_storeu_ps(acc_mem + (h0 + g) * D + 16 * (2 * c0 + c), acc[g][c]);
    }
  }, [&](int64_t slot, int64_t kh) { prefetch_row(vp + slot * K.row_stride + kh * D, D * 2); });
  for (int64_t h = 0; h < H; ++h)  // undo the unpack order: vector 2c + u, lane i -> d = 32c + 8 (i / 4) + 4u + i % 4
    for (int64_t c = 0; c < ND; ++c)
      for (int i = 0; i < 16; ++i)
        it.acc[h * D + 32 * (c / 2) + 8 * (i / 4) + 4 * (c % 2) + i % 4] = acc_mem[h * D + 16 * c + i];
}

template <int NC>
ItemFn pick_bf16_group(int64_t G) {
  constexpr int ND = 2 * NC;
  // D 128 / 256 with four heads a group: the scores four heads by half tiles; the V sum of four heads by quarters
  // of the head at D 256 (each V pair unpacked once for the four), of two at D 128 (four by halves measured no
  // faster than two whole). Else the scores of two heads at D 256 (q in 16 registers), V of two by halves.
  if (NC == 8 && G % 4 == 0) return attend_item_bf16<NC, 4, 4>;
  if (NC == 4 && G % 4 == 0) return attend_item_bf16<NC, 4, 2>;
  if (NC == 8 && G % 2 == 0) return attend_item_bf16<NC, 2>;
  if (G % 4 == 0 && 4 * ND <= 16) return attend_item_bf16<NC, 4>;
  if (G % 3 == 0 && 3 * ND <= 16) return attend_item_bf16<NC, 3>;
  if (G % 2 == 0 && 2 * ND <= 16) return attend_item_bf16<NC, 2>;
  return attend_item_bf16<NC, 1>;
}

ItemFn pick_bf16(int64_t D, int64_t G) {
  switch (D) {
    case 32: return pick_bf16_group<1>(G);
    case 64: return pick_bf16_group<2>(G);
    case 96: return pick_bf16_group<3>(G);
    case 128: return pick_bf16_group<4>(G);
    case 256: return pick_bf16_group<8>(G);
    default: return nullptr;
  }
}
#else
ItemFn pick_bf16(int64_t, int64_t) { return nullptr; }  // bf16 pools widen to fp32 (attend_item)
#endif

#if PAGEDLLM_AMX && defined(__AVX512BF16__)
// Fewer keys than this, or heads under 128 values, go to the vdpbf16ps kernel: the tiles' setup (q as B tiles, the
// pairs buffer) is not paid back (alternated runs on the AMX Xeon, one layer: 16/4 heads D 256 one row 128 keys
// 56 -> 43 us, 32k keys 11.0 -> 8.4 ms; 32/8 D 128 eight rows 2k keys 5.2 -> 4.4 ms; but 9/3 D 64 one row of
// 32-64 keys 0.84-0.94x, eight rows of 2k 0.88x)
constexpr int64_t kAmxMinKeys = 128;

// A bf16 pool's item on AMX tiles (decode_amx.h), in the phases of attend_item_bf16
void attend_item_amx(const Item& it, int64_t H, int64_t KVH, const Pool& K, const Pool& V, int64_t BS, float scale,
                     Scratch& s) {
  const int64_t D = K.d, n = it.hi - it.lo, ld = score_ld(n);
  if (n < kAmxMinKeys) return pick_bf16(D, H / KVH)(it, H, KVH, K, V, BS, scale, s);
  amx::configure();
  const decode_amx::Geometry g{H, KVH, D, BS, K.row_stride};
  if (!it.scores) s.scores.resize(H * ld);
  float* sc = it.scores ? it.scores : s.scores.data();
  if (it.phase != 2)
    decode_amx::scores(g, static_cast<const uint16_t*>(K.data), it.table, it.lo, it.hi, it.q, scale, sc, ld, s.q_tiles,
                       s.stage);
  softmax_rows(it, sc, H, n, ld, true);
  if (it.phase == 1) return;
  decode_amx::values(g, static_cast<const uint16_t*>(V.data), it.table, it.lo, it.hi, sc, ld, it.acc, s.pairs, s.vt,
                     s.acc);
}

// The AMX item where the CPU and the kernel grant the tiles and the shapes fit (the vector kernel for short ranges)
ItemFn pick_amx(int64_t D, int64_t H, int64_t KVH) {
  return amx::usable() && D >= 128 && pick_bf16(D, H / KVH) && decode_amx::fits(H, KVH, D) ? attend_item_amx : nullptr;
}
#else
ItemFn pick_amx(int64_t, int64_t, int64_t) { return nullptr; }
#endif

template <int ND, bool TAIL>
ItemFn pick_group(int64_t G) {
  // the most heads per pass that divide the group and keep GB * ND accumulators in half the registers
  constexpr int budget = vec::kRegs / 2;
  if (G % 4 == 0 && 4 * ND <= budget) return attend_item<ND, 4, TAIL>;
  if (G % 3 == 0 && 3 * ND <= budget) return attend_item<ND, 3, TAIL>;
  if (G % 2 == 0 && 2 * ND <= budget) return attend_item<ND, 2, TAIL>;
  return attend_item<ND, 1, TAIL>;
}

template <int ND>
ItemFn pick(int64_t G, bool tail) {
  return tail ? pick_group<ND, true>(G) : pick_group<ND, false>(G);
}

ItemFn pick_kernel(int64_t D, int64_t G) {
  const bool tail = D % 16 != 0;
  switch ((D + 15) / 16) {
    case 1: return pick<1>(G, tail);
    case 2: return pick<2>(G, tail);
    case 3: return pick<3>(G, tail);
    case 4: return pick<4>(G, tail);
    case 5: return pick<5>(G, tail);
    case 6: return pick<6>(G, tail);
    case 7: return pick<7>(G, tail);
    case 8: return pick<8>(G, tail);
    case 16: return pick<16>(G, tail);
    default: return nullptr;
  }
}

// Rows whose sequences share their first keys' blocks (a system prompt under prefix caching, or the
// samples of one prompt): those keys, P of them, gathered once per KV head and attended by up to 48 / G
// rows at a time in the chunk kernel's math (attend_shared), where the decode op would read and multiply
// them once per row; each row's other keys go through the decode op as before, in two phases around the
// merged max, so its p are rounded against its max as on every other path.
struct PrefixGroup {
  const int64_t* table;
  int64_t P;
  std::vector<int64_t> rows;
};

constexpr int64_t kMinShared = 64;  // keys; fewer are not worth a gather

// rows of a slice: their lanes (row, query head of the KV head) fill the chunk kernel's 48
inline int64_t slice_rows(int64_t G) { return std::max<int64_t>(1, 48 / G); }

// The groups of the T rows. Sequences in the lexicographic order of their block tables (the blocks holding keys
// all their rows attend), so those sharing the most blocks are neighbours; a run of neighbours is a group whose P
// is the keys every member attends in blocks all of them hold (even, at least kMinShared). A neighbour joins
// unless that would leave under kMinShared or halve the P of a run of two or more (two system prompts that only
// begin alike form two groups, not one over their common first block). A group needs two sequences; it keeps its
// whole slices of rows_per rows and a last one at least half full (its exps run over all 48 lanes); the other
// rows go row by row.
std::vector<PrefixGroup> prefix_groups(int64_t T, const int64_t* rs, const int64_t* ql, const int64_t* cl,
                                       const int64_t* bt, int64_t MAXB, int64_t BS, int64_t G) {
  const int64_t rows_per = slice_rows(G), min_rows = (rows_per + 1) / 2;
  if (G > 48) return {};
  auto hi_min = [&](int64_t s) { return cl[s] - ql[s] + 1; };  // keys every row of s attends
  auto blocks = [&](int64_t s) { return (hi_min(s) + BS - 1) / BS; };
  std::vector<int64_t> seqs;  // in order of first appearance
  std::unordered_set<int64_t> seen;
  for (int64_t r = 0; r < T; ++r)
    if (seen.insert(rs[r]).second && hi_min(rs[r]) >= kMinShared) seqs.push_back(rs[r]);
  std::stable_sort(seqs.begin(), seqs.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(bt + a * MAXB, bt + a * MAXB + blocks(a), bt + b * MAXB, bt + b * MAXB + blocks(b));
  });
  auto lcp = [&](int64_t a, int64_t b) {
    int64_t k = 0;
    for (const int64_t n = std::min(blocks(a), blocks(b)); k < n && bt[a * MAXB + k] == bt[b * MAXB + k];) ++k;
    return k;
  };
  std::vector<PrefixGroup> runs;
  std::vector<std::vector<int64_t>> members;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t s = seqs[i];
    if (!runs.empty()) {
      PrefixGroup& run = runs.back();
      const int64_t p = std::min({run.P, hi_min(s), lcp(seqs[i - 1], s) * BS});
      if (p >= kMinShared && (members.back().size() < 2 || 2 * p >= run.P)) {
        run.P = p;
        members.back().push_back(s);
        continue;
      }
    }
    runs.push_back(PrefixGroup{bt + s * MAXB, hi_min(s), {}});
    members.push_back({s});
  }
  std::unordered_map<int64_t, size_t> group_of;  // sequence -> run with two or more sequences
  for (size_t g = 0; g < runs.size(); ++g) {
    runs[g].P &= ~int64_t{1};
    if (members[g].size() >= 2 && runs[g].P >= kMinShared)
      for (const int64_t s : members[g]) group_of.emplace(s, g);
  }
  for (int64_t r = 0; r < T; ++r) {
    const auto it = group_of.find(rs[r]);
    if (it != group_of.end()) runs[it->second].rows.push_back(r);
  }
  std::vector<PrefixGroup> kept;
  for (PrefixGroup& g : runs) {
    const int64_t n = static_cast<int64_t>(g.rows.size());
    const int64_t whole = n / rows_per * rows_per, keep = n - whole >= min_rows ? n : whole;
    g.rows.resize(keep);
    if (keep > 0) kept.push_back(std::move(g));
  }
  return kept;
}

// The rows of a step with at least as many rows as threads: the groups' slices (their shared keys once,
// then each row's own keys) and the other rows one by one, from one counter, slices first
template <class Keys>
void attend_grouped(const std::vector<PrefixGroup>& groups, int64_t T, int64_t H, int64_t KVH, int64_t D,
                    const Pool& K, const Pool& V, int64_t BS, float scale, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& q, float* op, Keys&& keys, ItemFn fn,
                    const float* sinks) {
  const float* qp = q.data_ptr<float>();
  const int64_t q_stride = q.stride(0), G = H / KVH, rows_per = slice_rows(G), NG = static_cast<int64_t>(groups.size());
  std::vector<int64_t> key_off(NG * KVH + 1, 0);
  int64_t max_p = 0;
  for (int64_t i = 0; i < NG * KVH; ++i) {
    key_off[i + 1] = key_off[i] + shared_keys_bytes(groups[i / KVH].P, D);
    max_p = std::max(max_p, groups[i / KVH].P);
  }
  auto key_buf = bf16::aligned<uint8_t>(key_off.back());
  std::vector<SharedKeys> shared(NG * KVH);
  at::parallel_for(0, NG * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      shared[i] = gather_shared_keys(k_cache, v_cache, groups[i / KVH].table, i % KVH, groups[i / KVH].P,
                                     key_buf.get() + key_off[i]);
  });
  struct Task {
    int64_t group, r0, n;  // group < 0: row r0 alone
  };
  std::vector<Task> tasks;
  std::vector<char> in_group(T, 0);
  for (int64_t g = 0; g < NG; ++g) {
    const int64_t n = static_cast<int64_t>(groups[g].rows.size());
    for (int64_t r0 = 0; r0 < n; r0 += rows_per) tasks.push_back(Task{g, r0, std::min(rows_per, n - r0)});
    for (const int64_t r : groups[g].rows) in_group[r] = 1;
  }
  for (int64_t r = 0; r < T; ++r)
    if (!in_group[r]) tasks.push_back(Task{-1, r, 1});
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch s;
    std::vector<float> mx(rows_per * H), sum(rows_per * H), own_mx(rows_per * H), own_sum(rows_per * H),
        own_acc(rows_per * H * D), scores;
    std::vector<Item> own(rows_per);
    auto work = bf16::aligned<float>(max_p > 0 ? shared_work_floats(max_p, D) : 1);
    for (int64_t ti = next++; ti < static_cast<int64_t>(tasks.size()); ti = next++) {
      const Task& task = tasks[ti];
      if (task.group < 0) {
        const int64_t r = task.r0;
        Item it{qp + r * q_stride, nullptr, 0, 0, mx.data(), sum.data(), op + r * H * D};
        it.table = keys(r, &it.lo, &it.hi);
        fn(it, H, KVH, K, V, BS, scale, s);
        for (int64_t h = 0; h < H; ++h) {
          const float inv = 1.f / (sum[h] + sink_weight(sinks, h, mx[h]));
          for (int64_t d = 0; d < D; ++d) it.acc[h * D + d] *= inv;
        }
        continue;
      }
      const PrefixGroup& g = groups[task.group];
      const int64_t* rows = g.rows.data() + task.r0;
      const int64_t n = task.n;
      // phase 1 over each row's own keys [P, hi): their scores kept, their max
      int64_t total = 0;
      for (int64_t i = 0; i < n; ++i) {
        Item& it = own[i];
        it = Item{qp + rows[i] * q_stride, nullptr, 0, 0, own_mx.data() + i * H, own_sum.data() + i * H,
                  own_acc.data() + i * H * D};
        it.table = keys(rows[i], &it.lo, &it.hi);
        it.lo = g.P;
        total += it.hi > it.lo ? H * score_ld(it.hi - it.lo) : 0;
      }
      scores.resize(std::max<int64_t>(total, 1));
      total = 0;
      for (int64_t i = 0; i < n; ++i) {
        Item& it = own[i];
        if (it.hi <= it.lo) {
          std::fill(it.mx, it.mx + H, vec::kMasked);
          continue;
        }
        it.phase = 1;
        it.scores = scores.data() + total;
        total += H * score_ld(it.hi - it.lo);
        fn(it, H, KVH, K, V, BS, scale, s);
      }
      // the shared keys, a KV head at a time, each lane's max floored by its own keys' max
      for (int64_t kh = 0; kh < KVH; ++kh)
        attend_shared(shared[task.group * KVH + kh], kh, rows, n, H, G, D, qp, q_stride, scale, own_mx.data(),
                      mx.data(), sum.data(), op, work.get());
      // phase 2 of the own keys against the merged max; out = (both V sums) / (both sums of p)
      for (int64_t i = 0; i < n; ++i) {
        Item& it = own[i];
        const bool has_own = it.hi > it.lo;
        if (has_own) {
          it.phase = 2;
          std::copy(mx.data() + i * H, mx.data() + (i + 1) * H, it.mx);
          fn(it, H, KVH, K, V, BS, scale, s);
        }
        float* o = op + rows[i] * H * D;
        for (int64_t h = 0; h < H; ++h) {
          const float inv = 1.f / (sum[i * H + h] + (has_own ? it.sum[h] : 0.f) + sink_weight(sinks, h, mx[i * H + h]));
          for (int64_t d = 0; d < D; ++d) o[h * D + d] = (o[h * D + d] + (has_own ? it.acc[h * D + d] : 0.f)) * inv;
        }
      }
    }
  });
}

}  // namespace

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor q_start, torch::Tensor q_len,
                     torch::Tensor ctx_len, double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                     c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> lut,
                     c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: K and V pools must be contiguous and of one dtype");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kUInt8,
              "paged_attention: the pool must be float32, bfloat16, or fp8 / q8_0 / q4_0 (as uint8)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 && out.is_contiguous(),
              "paged_attention: q and out must be fp32, out contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MAXB = block_tables.size(1);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "paged_attention: q rows must hold their heads contiguously");
  auto format_of = [&](const torch::Tensor& pool) {  // a uint8 pool's row length says its format
    const int64_t n = pool.size(3);
    if (dt != torch::kUInt8) return n == D ? (dt == torch::kBFloat16 ? 1 : 0) : -1;
    return n == D ? 2 : D % 32 == 0 && n == D / 32 * 34 ? 3 : D % 32 == 0 && n == D / 32 * 18 ? 4 : -1;
  };
  const int dtype = format_of(k_cache), vtype = format_of(v_cache);
  TORCH_CHECK(H % KVH == 0 && dtype >= 0 && vtype >= 0 && v_cache.size(2) == KVH,
              "paged_attention: heads and pool do not match");
  const bool fp8 = dtype == 2 || vtype == 2;
  ItemFn own = dt == torch::kBFloat16 ? pick_bf16(D, H / KVH) : dt == torch::kFloat32 ? pick_f32(D) : nullptr;
  if (const ItemFn tiles = dt == torch::kBFloat16 ? pick_amx(D, H, KVH) : nullptr) own = tiles;
  if (!own && dt == torch::kUInt8) own = pick_quant(D, H / KVH);
  if (!own && dt != torch::kFloat32) own = pick_widened(D);
  const ItemFn fn = own ? own : pick_kernel(D, H / KVH);
  TORCH_CHECK(fn != nullptr, "paged_attention: head_dim ", D, " is not supported (at most 128, or 256)");
  Pool K{k_cache.data_ptr(), dtype, KVH * k_cache.size(3), KVH, D};
  Pool V{v_cache.data_ptr(), vtype, KVH * v_cache.size(3), KVH, D};
  if (fp8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && lut.has_value() && lut->numel() == 256 &&
                    k_scale->scalar_type() == torch::kBFloat16 && k_scale->is_contiguous() && v_scale->is_contiguous(),
                "paged_attention: an fp8 pool needs bf16 k_scale / v_scale and a 256-entry lut");
    // The lut names the fp8 format; the kernels widen the bits themselves (kv_formats.h)
    const int format = lut->scalar_type() == torch::kFloat32 && lut->is_contiguous()
                           ? kvfmt::fp8_format_of(lut->data_ptr<float>())
                           : -1;
    TORCH_CHECK(format >= 0, "paged_attention: the lut must be fp32 and hold e4m3fn's or e5m2's 256 values");
    K.e5m2 = V.e5m2 = format == 1;
    K.scale = reinterpret_cast<const uint16_t*>(k_scale->data_ptr());
    V.scale = reinterpret_cast<const uint16_t*>(v_scale->data_ptr());
  }
  TORCH_CHECK(!sinks || (sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() && sinks->numel() == H),
              "paged_attention: sinks must be fp32 [H]");
  const float* sk = sinks ? sinks->data_ptr<float>() : nullptr;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx_len.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  auto keys = [&](int64_t r, int64_t* lo, int64_t* hi) {
    const int64_t s = rs[r];
    *hi = cl[s] - ql[s] + (r - qs[s]) + 1;
    *lo = window > 0 ? std::max<int64_t>(0, *hi - window) : 0;
    return bt + s * MAXB;
  };
  const int64_t threads = at::get_num_threads();
  if (T >= threads) {
    // bf16 pools: the shared keys in the chunk kernel's math, which rounds as this pool's decode op does
    std::vector<PrefixGroup> groups;
    if (dtype == 1 && window == 0 && D % 8 == 0) groups = prefix_groups(T, rs, ql, cl, bt, MAXB, BS, H / KVH);
    attend_grouped(groups, T, H, KVH, D, K, V, BS, fscale, k_cache, v_cache, q, op, keys, fn, sk);
    return;
  }
  // Fewer rows than threads (one stream decoding): each row's keys in ranges of at least 128, one item
  // per (row, range), merged with their maxima: out = sum_j e^(m_j - m) acc_j / sum_j e^(m_j - m) l_j
  const int64_t per_row = (threads + T - 1) / T;  // items beyond a row's splits are empty: keep them few
  std::vector<float> part_m(T * per_row * H), part_l(T * per_row * H), part_acc(T * per_row * H * D);
  std::vector<int64_t> nsplit(T);
  for (int64_t r = 0; r < T; ++r) {
    int64_t lo, hi;
    keys(r, &lo, &hi);
    nsplit[r] = std::max<int64_t>(1, std::min<int64_t>(per_row, (hi - lo) / 128));
  }
  // over a bf16 pool in two phases, the row's max between them (Item::phase): p rounded as unsplit
  const bool two_phase = dtype == 1;
  std::vector<int64_t> score_off(T * per_row + 1, 0);
  auto item_of = [&](int64_t item) {
    const int64_t r = item / per_row, j = item % per_row;
    int64_t lo, hi;
    const int64_t* table = keys(r, &lo, &hi);
    const int64_t n = hi - lo;
    return Item{qp + r * q.stride(0), table, lo + n * j / nsplit[r], lo + n * (j + 1) / nsplit[r],
                part_m.data() + item * H, part_l.data() + item * H, part_acc.data() + item * H * D};
  };
  for (int64_t item = 0; item < T * per_row; ++item) {
    const Item it = item_of(item);
    const bool used = two_phase && item % per_row < nsplit[item / per_row];
    score_off[item + 1] = score_off[item] + (used ? H * score_ld(it.hi - it.lo) : 0);
  }
  std::vector<float> scores(score_off.back());
  auto run = [&](int phase) {
    at::parallel_for(0, T * per_row, 1, [&](int64_t begin, int64_t end) {
      Scratch s;
      for (int64_t item = begin; item < end; ++item) {
        if (item % per_row >= nsplit[item / per_row]) continue;
        Item it = item_of(item);
        it.phase = phase;
        if (phase) it.scores = scores.data() + score_off[item];
        fn(it, H, KVH, K, V, BS, fscale, s);
      }
    });
  };
  if (!two_phase) {
    run(0);
  } else {
    run(1);
    for (int64_t r = 0; r < T; ++r)  // every range of a row gets the row's max
      for (int64_t h = 0; h < H; ++h) {
        float m = -std::numeric_limits<float>::max();
        for (int64_t j = 0; j < nsplit[r]; ++j) m = std::max(m, part_m[(r * per_row + j) * H + h]);
        for (int64_t j = 0; j < nsplit[r]; ++j) part_m[(r * per_row + j) * H + h] = m;
      }
    run(2);
  }
  for (int64_t r = 0; r < T; ++r) {
    float* orow = op + r * H * D;
    for (int64_t h = 0; h < H; ++h) {
      float m = -std::numeric_limits<float>::max();
      for (int64_t j = 0; j < nsplit[r]; ++j) m = std::max(m, part_m[(r * per_row + j) * H + h]);
      float l = 0.f;
      std::fill(orow + h * D, orow + (h + 1) * D, 0.f);
      for (int64_t j = 0; j < nsplit[r]; ++j) {
        const int64_t item = r * per_row + j;
        const float w = std::exp(part_m[item * H + h] - m);
        l += w * part_l[item * H + h];
        const float* pa = part_acc.data() + (item * H + h) * D;
        for (int64_t d = 0; d < D; ++d) orow[h * D + d] += w * pa[d];
      }
      const float inv = 1.f / (l + sink_weight(sk, h, m));
      for (int64_t d = 0; d < D; ++d) orow[h * D + d] *= inv;
    }
  }
}
// Rotary embedding (rotate-half form) in place on the q and k heads at the start of each qkv row:
// x[i], x[i + D/2] <- x[i] c[i] - x[i + D/2] s[i], x[i + D/2] c[i] + x[i] s[i], where cos/sin are
// [T, D/2] tables of the rows' positions.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= num_heads * head_dim, "rope_: bad qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) * 2 == head_dim, "rope_: bad tables");
  const int64_t T = qkv.size(0), half = head_dim / 2, stride = qkv.stride(0);
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x = xp + t * stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

torch::Tensor attention_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, int64_t num_paged,
                            c10::optional<torch::Tensor> block_tables, c10::optional<torch::Tensor> row_seq,
                            c10::optional<torch::Tensor> q_start, c10::optional<torch::Tensor> q_len,
                            c10::optional<torch::Tensor> ctx_len, double scale, int64_t window,
                            c10::optional<torch::Tensor> chunk_tables, c10::optional<torch::Tensor> chunk_q_start,
                            c10::optional<torch::Tensor> chunk_q_len, c10::optional<torch::Tensor> chunk_ctx_len,
                            c10::optional<torch::Tensor> chunk_scratch, c10::optional<torch::Tensor> sinks) {
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK((dt == torch::kFloat32 || dt == torch::kBFloat16) && v_cache.scalar_type() == dt &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "attention_qkv: the pools must be contiguous fp32 or bf16 (fp8 pools are written by KVCache.write)");
  const int64_t T = qkv.size(0), H = num_heads, KVH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (H + 2 * KVH) * D,
              "attention_qkv: qkv must be fp32 [T, (H + 2 KVH) D] with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == T && slots.is_contiguous(),
              "attention_qkv: one int64 slot per row");
  rope_(qkv, cos, sin, H + KVH, D);
  const int64_t n = KVH * D, stride = qkv.stride(0), num_slots = k_cache.size(0) * k_cache.size(1);
  const float* xp = qkv.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "attention_qkv: slot ", sp[t], " outside the pool");
  const bool f32 = dt == torch::kFloat32;
  float* kf = f32 ? k_cache.data_ptr<float>() : nullptr;
  float* vf = f32 ? v_cache.data_ptr<float>() : nullptr;
  c10::BFloat16* kb = f32 ? nullptr : k_cache.data_ptr<c10::BFloat16>();
  c10::BFloat16* vb = f32 ? nullptr : v_cache.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* k = xp + t * stride + H * D;
      const float* v = k + n;
      if (f32) {
        std::memcpy(kf + sp[t] * n, k, n * sizeof(float));
        std::memcpy(vf + sp[t] * n, v, n * sizeof(float));
      } else {  // round to nearest even, as torch's .to(bfloat16)
        c10::BFloat16* kd = kb + sp[t] * n;
        c10::BFloat16* vd = vb + sp[t] * n;
        for (int64_t i = 0; i < n; ++i) {
          kd[i] = c10::BFloat16(k[i]);
          vd[i] = c10::BFloat16(v[i]);
        }
      }
    }
  });
  auto out = torch::empty({T, H, D}, qkv.options());
  if (num_paged > 0) {
    TORCH_CHECK(num_paged <= T && block_tables && row_seq && q_start && q_len && ctx_len,
                "attention_qkv: paged rows need their block tables and lengths");
    const auto q = qkv.narrow(1, 0, H * D).view({T, H, D}).narrow(0, 0, num_paged);  // [n, H, D], rows strided
    paged_attention(out.narrow(0, 0, num_paged), q, k_cache, v_cache, *block_tables, *row_seq, *q_start, *q_len,
                    *ctx_len, scale, window, c10::nullopt, c10::nullopt, c10::nullopt, sinks);
  }
  if (chunk_tables) {
    TORCH_CHECK(chunk_q_start && chunk_q_len && chunk_ctx_len && chunk_scratch,
                "attention_qkv: chunks need their lengths and a scratch tensor");
    attend_chunks(out, qkv.narrow(1, 0, H * D).view({T, H, D}), k_cache, v_cache, *chunk_tables, *chunk_q_start,
                  *chunk_q_len, *chunk_ctx_len, scale, window, *chunk_scratch, sinks);
  }
  return out;
}

std::vector<std::tuple<int64_t, std::vector<int64_t>>> shared_prefix_groups(
    torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor q_len, torch::Tensor ctx_len,
    int64_t block_size, int64_t heads_per_kv) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && block_tables.scalar_type() == torch::kInt64,
              "shared_prefix_groups: block_tables must be contiguous int64 [S, MAXB]");
  TORCH_CHECK(heads_per_kv >= 1 && block_size >= 1, "shared_prefix_groups: bad geometry");
  const auto groups = prefix_groups(row_seq.numel(), row_seq.data_ptr<int64_t>(), q_len.data_ptr<int64_t>(),
                                    ctx_len.data_ptr<int64_t>(),
                                    block_tables.data_ptr<int64_t>(), block_tables.size(1), block_size, heads_per_kv);
  std::vector<std::tuple<int64_t, std::vector<int64_t>>> out;
  for (const auto& g : groups) out.emplace_back(g.P, g.rows);
  return out;
}
