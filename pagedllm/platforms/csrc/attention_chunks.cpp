// Attention of prefill chunks (fresh prompts and long mid-sequence chunks) over a bf16, fp8 or q8_0 / q4_0 paged
// pool, on bf16 dot products, or over an fp32 pool on fp32 tiles (namespace fp32, below): the matrix-product half
// of attention, where the decode op (attention.cpp) goes a row at a time.
//
// Layout: q rows [T, H, D] fp32 with heads contiguous (rows q_stride floats apart: the qkv buffer), the pool
// [NB, BS, KVH, D] bf16 for K and for V, or uint8 rows of fp8 values (a bf16 scale per slot and KV head) or of
// llama.cpp's q8_0 / q4_0 blocks (K and V each in its own; attention.cpp's layout), out [T, H, D] fp32. A chunk's
// q_len rows are the last of its ctx_len positions; its row i attends keys [lo, hi): hi = ctx_len - q_len + i + 1,
// lo = hi - window with a window.
//
// Once per (chunk, KV head): its K rows gathered contiguous [ctx, D] (d pairs along a row: the broadcast
// operand of bf16::tile), its V transposed to key pairs [D, ctx / 2] (the P.V reduction runs over keys); fp8 and
// integer heads are widened there and rounded to bf16, so the products never see the pool's own format.
// Work item = (chunk, KV head, 48 / G query rows), whose rows x the G query heads of the KV head (GQA) fill
// the 48 lanes of bf16::tile's panel:
//   S^T [keys, 48] = K . Q^T, 8 keys broadcast at a time against the q panel [D / 2, 48, 2] (q rounded to bf16);
//   the exact max of each lane over all its keys, p = exp(s - max), the lane's sum of p in fp32, and p rounded
//   to bf16 into a panel [keys / 2, 48, 2] written over S^T (pair i's rows 2i, 2i+1 are read before row i is
//   written, and row i < 2i was read earlier);
//   O^T [D, 48] = V^T . P, 8 dims broadcast at a time against the p panel; out = O / sum.
// This is the decode op's math for a bf16 pool (q and p rounded alike, p from the exact max, the sum of p
// unrounded, the same exp16), so a prompt attended here, chunked, or decoded row by row differs in the order
// of fp32 sums only. Items go largest first to the threads from one counter (causal rows are uneven).
// The same math serves keys that several sequences share (attend_shared, for attention.cpp's grouped decode
// rows): lanes from any rows, every lane over all the shared keys, its max floored by its own keys' max.
// ISA: both products on AMX-BF16 tiles where the CPU has them (bf16_amx.h: S^T 32 keys a call, O^T 32 dims;
// head_dim a multiple of 32), else bf16::tile (vdpbf16ps with AVX512-BF16, widened FMAs with AVX512F, loops
// the compiler vectorizes elsewhere); the softmax on vec16.h's 16-float vectors.
#include "attention.h"
#include "bf16_tile.h"
#include "f32_tile.h"
#include "ggml_blocks.h"
#include "kv_formats.h"
#include "vec16.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

using vec::v16f;
using vec::v16u;

constexpr int64_t NL = bf16::NR;  // lanes: (query row, head) pairs of an item
static_assert(f32::NR == NL, "the fp32 path's panels hold the same 48 lanes");
constexpr int NV = NL / 16;       // their vectors
constexpr int KT = 8;             // keys (S^T) or head dims (O^T) per tile call
constexpr int64_t kPad = 32;      // zero K rows after ctx, and zero V pairs after a row: what a tile over-reads

struct Chunk {
  const int64_t* table;
  int64_t q_start, q_len, ctx;
  // gathered: bf16 pools K [ctx + kPad, D] (zero rows after ctx), V [D, ldv] key pairs ((ctx + 1) / 2 of them, then
  // kPad / 2 zero pairs); fp32 pools K [ctx, D], V^T [D, ldv] (ldv = ctx)
  const void* k;
  const void* v;
  int64_t ldv;
};

struct Item {
  int64_t chunk, kh, r0, cost;
};

// Scratch of one worker: q panel [D / 2, 48], S^T (then P) [keys + 2 kPad, 48], O^T [D, 48]
struct Work {
  uint32_t* qpanel;
  float *sbuf, *ot;
};

inline int64_t work_floats(int64_t keys, int64_t D) { return (D / 2) * NL + (keys + 2 * kPad) * NL + D * NL; }

inline Work work_at(float* base, int64_t keys, int64_t D) {
  return Work{reinterpret_cast<uint32_t*>(base), base + (D / 2) * NL, base + (D / 2) * NL + (keys + 2 * kPad) * NL};
}

// V key pairs per gathered row of ctx keys: its (ctx + 1) / 2 pairs, then kPad / 2 zero pairs
inline int64_t v_ld(int64_t ctx) { return (ctx + 1) / 2 + kPad / 2; }

// out [n, 48] (48 floats apart) = n rows of x pairs (ldx apart) . panel [K2, 48, 2]. On AMX tiles (where
// built, granted and K2 is whole tiles) in 16- and 32-row tiles: rows past n are read (the callers pad them
// with zeros) and written (out has room for them); else bf16::tile, KT rows a call.
void product(const uint32_t* x, int64_t n, int64_t ldx, int64_t K2, const uint16_t* panel, float* out, bool amx) {
#if PAGEDLLM_AMX
  if (amx) {
    amx::configure();
    int64_t j = 0;
    for (; j + 16 < n; j += 32) amx::rows<2>(x + j * ldx, ldx, K2, panel, out + j * NL, NL);
    if (j < n) amx::rows<1>(x + j * ldx, ldx, K2, panel, out + j * NL, NL);
    return;
  }
#endif
  (void)amx;
  for (int64_t j = 0; j < n; j += KT) bf16::tile<KT>(x + j * ldx, ldx, K2, panel, out + j * NL);
}

// Where an item's lanes come from and what bounds their keys: lane l < lanes is query row row(l / G) (a
// q row index) and head kh * G + l % G, over keys [lo[l], hi[l]) of the gathered K / V (keys [klo, khi) span
// them all); floor[l] is a max the lane's softmax must not go below (keys the lane attends elsewhere), or
// kMasked
struct Lanes {
  int64_t lanes, kh, klo, khi;
  const int32_t *lo, *hi;
  const float* floor;
};

// S [nk, 48] (row j: key klo + j) times scale, keys outside a lane's [lo, hi) set to kMasked; mx: each lane's max,
// from its floor, 0 for a lane without keys (its p are then exp(kMasked) = 0). Lanes past ln.lanes are padding:
// their scores (q = 0) are left as they are, and nothing reads their results. The masked keys are each lane's
// few at the ends of the item's range (causal rows, a window's edge), set one by one: a 16-lane compare per key
// is scalar code on AVX2.
inline void scale_mask_max(float* S, int64_t nk, int64_t klo, const Lanes& ln, float scale, v16f* mx) {
  for (int64_t j = 0; j < nk; ++j)
    for (int v = 0; v < NV; ++v) vec::store16(S + j * NL + 16 * v, vec::load16(S + j * NL + 16 * v) * scale);
  alignas(64) float fl[NL];
  for (int64_t l = 0; l < NL; ++l) {
    fl[l] = l < ln.lanes && ln.floor ? ln.floor[l] : vec::kMasked;
    if (l >= ln.lanes) continue;
    const int64_t lo = std::min<int64_t>(ln.lo[l] - klo, nk), hi = std::max<int64_t>(ln.hi[l] - klo, lo);
    for (int64_t j = 0; j < lo; ++j) S[j * NL + l] = vec::kMasked;
    for (int64_t j = hi; j < nk; ++j) S[j * NL + l] = vec::kMasked;
  }
  for (int v = 0; v < NV; ++v) mx[v] = vec::load16(fl + 16 * v);
  for (int64_t j = 0; j < nk; ++j)
    for (int v = 0; v < NV; ++v) mx[v] = vec::max16(mx[v], vec::load16(S + j * NL + 16 * v));
  for (int v = 0; v < NV; ++v) mx[v] = mx[v] > vec::kMasked ? mx[v] : v16f{};
}

// The lanes' softmax over their keys and its V sum, unnormalized: ot [D, 48] (= w.ot), the lanes' max mx and
// sum of p (48 each); q rows from q (q_stride floats apart, heads contiguous)
template <class Row>
void attend_lanes(const Chunk& c, const Lanes& ln, Row&& row, int64_t G, int64_t D, const float* q, int64_t q_stride,
                  float scale, const Work& w, float* mx_out, float* sum_out) {
  const int64_t D2 = D / 2, lanes = ln.lanes;
  const int64_t klo = ln.klo & ~int64_t{1};  // whole key pairs
  const int64_t nk = ln.khi - klo, np = (nk + 1) / 2;
  // q panel [D / 2, 48, 2]
  uint32_t* qpanel = w.qpanel;
  std::fill(qpanel, qpanel + D2 * NL, 0u);
  for (int64_t l = 0; l < lanes; ++l) {
    const float* qr = q + row(l / G) * q_stride + (ln.kh * G + l % G) * D;
    for (int64_t k = 0; k < D2; ++k)
      qpanel[k * NL + l] = static_cast<uint32_t>(bf16::to_bf16(qr[2 * k])) |
                           static_cast<uint32_t>(bf16::to_bf16(qr[2 * k + 1])) << 16;
  }
  float* S = w.sbuf;  // [keys, 48], row j = key klo + j
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qpanel);
  const uint32_t* kp = reinterpret_cast<const uint32_t*>(c.k);
  const bool amx = amx::usable() && D2 % 16 == 0;
  product(kp + klo * D2, nk, D2, D2, qp, S, amx);
  v16f mx[NV];
  scale_mask_max(S, nk, klo, ln, scale, mx);
  if (nk % 2)  // the last pair's second key
    for (int v = 0; v < NV; ++v) vec::store16(S + nk * NL + 16 * v, v16f{} + vec::kMasked);
  // p = exp(s - max), summed in key order; the p panel over S^T
  v16f sum[NV] = {};
  uint32_t* P = reinterpret_cast<uint32_t*>(S);
  for (int64_t i = 0; i < np; ++i)
    for (int v = 0; v < NV; ++v) {
      const v16f p0 = vec::exp16(vec::load16(S + 2 * i * NL + 16 * v) - mx[v]);
      const v16f p1 = vec::exp16(vec::load16(S + (2 * i + 1) * NL + 16 * v) - mx[v]);
      sum[v] += p0;
      sum[v] += p1;
      const v16u pair = (vec::bf16_bits(p0) >> 16) | vec::bf16_bits(p1);
      std::memcpy(P + i * NL + 16 * v, &pair, sizeof(pair));
    }
  // O^T [D, 48] = V^T . P over the item's key pairs (on AMX, whole tiles of 16 pairs: P's extra pairs zero)
  const int64_t npt = amx ? (np + 15) / 16 * 16 : np;
  std::fill(P + np * NL, P + npt * NL, 0u);
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(P);
  product(static_cast<const uint32_t*>(c.v) + klo / 2, D, c.ldv, npt, pp, w.ot, amx);
  for (int v = 0; v < NV; ++v) {
    vec::store16(mx_out + 16 * v, mx[v]);
    vec::store16(sum_out + 16 * v, sum[v]);
  }
}

// One item's lanes: rows [r0, r0 + 48 / G) of chunk c (fewer at its end) x the G heads of KV head kh, each row over
// its causal keys (and window)
struct ItemLanes {
  int64_t lanes, klo, khi;
  alignas(64) int32_t lo[NL], hi[NL];

  ItemLanes(const Chunk& c, int64_t r0, int64_t G, int64_t window) {
    const int64_t rows = std::min(NL / G, c.q_len - r0);
    lanes = rows * G;
    klo = c.ctx;
    khi = 0;
    for (int64_t l = 0; l < lanes; ++l) {
      hi[l] = static_cast<int32_t>(c.ctx - c.q_len + r0 + l / G + 1);
      lo[l] = window > 0 ? std::max<int32_t>(0, hi[l] - static_cast<int32_t>(window)) : 0;
      klo = std::min<int64_t>(klo, lo[l]);
      khi = std::max<int64_t>(khi, hi[l]);
    }
  }
  Lanes of(int64_t kh) const { return Lanes{lanes, kh, klo, khi, lo, hi, nullptr}; }
};

// out rows of the item's lanes = ot [D, 48] / (sum + the head's sink)
void write_item(const Chunk& c, const ItemLanes& il, int64_t kh, int64_t r0, int64_t G, int64_t H, int64_t D,
                const float* sinks, const float* ot, const float* mx, const float* sum, float* out) {
  for (int64_t l = 0; l < il.lanes; ++l) {
    const float total = sum[l] + (sinks ? std::exp(sinks[kh * G + l % G] - mx[l]) : 0.f);
    const float inv = 1.f / (total > 0.f ? total : 1.f);
    float* o = out + ((c.q_start + r0 + l / G) * H + kh * G + l % G) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = ot[d * NL + l] * inv;
  }
}

// One item: rows [r0, r0 + rows) of chunk c, the G heads of KV head kh
void attend(const Chunk& c, int64_t kh, int64_t r0, int64_t G, int64_t H, int64_t D, const float* q, int64_t q_stride,
            float scale, int64_t window, const float* sinks, float* out, const Work& w) {
  const ItemLanes il(c, r0, G, window);
  alignas(64) float mx[NL], sum[NL];
  attend_lanes(c, il.of(kh), [&](int64_t i) { return c.q_start + r0 + i; }, G, D, q, q_stride, scale, w, mx, sum);
  write_item(c, il, kh, r0, G, H, D, sinks, w.ot, mx, sum, out);
}

// A pool's K or V heads as the products read them: bf16 rows in place; q8_0 / q4_0 blocks widened
// (ggml_blocks.h: a head is a row of ggml's Q8_0 / Q4_0 blocks) or fp8 values times their slot's scale
// (kv_formats.h), rounded to bf16: the chunk's one copy of them
struct Heads {
  const uint8_t* data;
  int fmt;  // 0 bf16, 1 q8_0, 2 q4_0, 3 fp8
  int64_t row_bytes, head_bytes, D;
  const uint16_t* scale = nullptr;  // fp8: [NB * BS, KVH] bf16
  bool e5m2 = false;                // fp8: e5m2, else e4m3fn

  // slot's head kh: in place, or in tmp [D] (wide [D]: room for the fp32 values)
  const uint16_t* head(int64_t slot, int64_t kh, uint16_t* tmp, float* wide) const {
    const uint8_t* p = data + slot * row_bytes + kh * head_bytes;
    if (fmt == 0) return reinterpret_cast<const uint16_t*>(p);
    if (fmt == 3) {
      const int64_t kvh = row_bytes / head_bytes;
      kvfmt::fp8_row(p, D, e5m2, bf16::from_bf16(scale[slot * kvh + kh]) * kvfmt::fp8_unbias(e5m2), wide);
    } else {
      fmt == 1 ? ggml::dequantize_row<ggml::Q8_0>(p, D, wide) : ggml::dequantize_row<ggml::Q4_0>(p, D, wide);
    }
    for (int64_t d = 0; d < D; ++d) tmp[d] = bf16::to_bf16(wide[d]);
    return tmp;
  }
};

// The fp8 format a lut [256] names (kvfmt::fp8_format_of: 1 e5m2, 0 e4m3fn), or -1 without one
int fp8_format(const c10::optional<torch::Tensor>& lut) {
  if (!lut) return -1;
  TORCH_CHECK(lut->scalar_type() == torch::kFloat32 && lut->is_contiguous() && lut->numel() == 256,
              "attend_chunks: the lut must be a 256-entry fp32 tensor");
  const int format = kvfmt::fp8_format_of(lut->data_ptr<float>());
  TORCH_CHECK(format >= 0, "attend_chunks: the lut must hold e4m3fn's or e5m2's 256 values");
  return format;
}

// The pool's format from its dtype and row length: bf16 [.., D], uint8 fp8 [.., D] (with its bf16 scales [NB, BS,
// KVH] and fp8_format's answer for the lut), or uint8 q8_0 / q4_0 [.., D / 32 x 34 | 18]
Heads heads_of(const torch::Tensor& pool, int64_t D, const c10::optional<torch::Tensor>& scale = c10::nullopt,
               int fp8 = -1) {
  const int64_t n = pool.size(3), kvh = pool.size(2);
  const auto* data = static_cast<const uint8_t*>(pool.data_ptr());
  if (pool.scalar_type() == torch::kBFloat16 && n == D) return Heads{data, 0, kvh * D * 2, D * 2, D};
  if (pool.scalar_type() == torch::kUInt8 && n == D) {
    TORCH_CHECK(scale && fp8 >= 0 && scale->scalar_type() == torch::kBFloat16 && scale->is_contiguous() &&
                    scale->numel() == pool.numel() / D,
                "attend_chunks: an fp8 pool needs its bf16 scales [NB, BS, KVH] and a 256-entry fp32 lut");
    return Heads{data, 3, kvh * D, D, D, reinterpret_cast<const uint16_t*>(scale->data_ptr()), fp8 == 1};
  }
  TORCH_CHECK(pool.scalar_type() == torch::kUInt8 && D % 32 == 0 && (n == D / 32 * 34 || n == D / 32 * 18),
              "attend_chunks: a pool must be bf16, fp8, or q8_0 / q4_0 blocks of the query's head_dim");
  return Heads{data, n == D / 32 * 34 ? 1 : 2, kvh * n, n, D};
}

// One (chunk, KV head)'s keys [0, ctx): K rows gathered into kd [ctx + kPad, D], V as key pairs into vd [D, ldv].
// Keys before `first` (past every row's window) are zeros: a sliding-window group has freed their blocks (its table
// holds NULL_BLOCK there), and an item's first key pair may start one key early, multiplied by p = 0.
void gather(const Heads& K, const Heads& V, const int64_t* table, int64_t BS, int64_t kh, int64_t D, int64_t ctx,
            int64_t first, uint16_t* kd, uint32_t* vd, int64_t ldv) {
  const int64_t pairs = (ctx + 1) / 2;
  const bool widen = K.fmt != 0 || V.fmt != 0;  // bf16 pools are read in place: no buffers
  std::vector<uint16_t> tmp(widen ? 2 * D : 0);
  std::vector<float> wide(widen ? D : 0);
  auto slot = [&](int64_t t) { return table[t / BS] * BS + t % BS; };
  std::fill(kd, kd + first * D, uint16_t{0});
  for (int64_t t = first; t < ctx; ++t) {
    const uint16_t* k = K.head(slot(t), kh, kd + t * D, wide.data());
    if (k != kd + t * D) std::memcpy(kd + t * D, k, D * sizeof(uint16_t));
  }
  std::fill(kd + ctx * D, kd + (ctx + kPad) * D, uint16_t{0});
  for (int64_t d = 0; d < D; ++d) std::fill(vd + d * ldv + pairs, vd + (d + 1) * ldv, 0u);
  for (int64_t d = 0; d < D; ++d) std::fill(vd + d * ldv, vd + d * ldv + first / 2, 0u);
  for (int64_t p = first / 2; p < pairs; ++p) {
    const uint16_t* v0 = 2 * p >= first ? V.head(slot(2 * p), kh, tmp.data(), wide.data()) : nullptr;
    const uint16_t* v1 = 2 * p + 1 < ctx ? V.head(slot(2 * p + 1), kh, tmp.data() + D, wide.data()) : nullptr;
    for (int64_t d = 0; d < D; ++d)
      vd[d * ldv + p] = (v0 ? static_cast<uint32_t>(v0[d]) : 0u) | (v1 ? static_cast<uint32_t>(v1[d]) << 16 : 0u);
  }
}

// The work of a call, whatever the pool: each (chunk, KV head)'s keys gathered into kv_bytes(ctx, D) bytes of the
// scratch (gather(s, kh, buf) in parallel), then the items, largest first, from one counter, each worker with
// work_floats(keys, D) floats of its own (attend(item, chunk, work)). The scratch is the caller's, grown here and
// kept for the step's other layers: no page faults per call.
template <class Gather, class Attend>
void run_items(int64_t n, int64_t KVH, int64_t G, int64_t D, const int64_t* bt, int64_t MAXB, int64_t BS,
               const int64_t* qs, const int64_t* ql, const int64_t* cl, int64_t window, torch::Tensor& scratch,
               int64_t (*kv_bytes)(int64_t, int64_t), int64_t (*work_floats)(int64_t, int64_t), Gather&& gather,
               Attend&& attend) {
  std::vector<int64_t> off(n * KVH + 1, 0);
  for (int64_t i = 0; i < n * KVH; ++i) {
    const int64_t ctx = cl[i / KVH];
    TORCH_CHECK(ql[i / KVH] >= 1 && ql[i / KVH] <= ctx && ctx <= MAXB * BS, "attend_chunks: bad chunk lengths");
    off[i + 1] = off[i] + (kv_bytes(ctx, D) + 63) / 64 * 64;
  }
  const int64_t rows_per = NL / G;
  std::vector<Item> items;
  int64_t max_keys = 0;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t r0 = 0; r0 < ql[s]; r0 += rows_per) {
      const int64_t last = cl[s] - ql[s] + std::min(r0 + rows_per, ql[s]);  // the item's furthest key
      const int64_t span = window > 0 ? std::min(last, window + rows_per) : last;
      max_keys = std::max(max_keys, span + 1);  // + 1: the first key pair may start one early
      for (int64_t kh = 0; kh < KVH; ++kh) items.push_back(Item{s, kh, r0, span});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  const int64_t per_worker = work_floats(max_keys, D);
  const int64_t need = off.back() + workers * per_worker * 4;
  TORCH_CHECK(scratch.scalar_type() == torch::kUInt8 && scratch.is_contiguous(), "attend_chunks: scratch must be uint8");
  if (scratch.numel() < need) scratch.resize_({need});
  uint8_t* base = scratch.data_ptr<uint8_t>();
  float* work = reinterpret_cast<float*>(base + off.back());
  std::vector<Chunk> chunks(n * KVH);
  at::parallel_for(0, n * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / KVH;
      // the chunk's first row attends keys from this one on (a window's start); none before it is read
      const int64_t first = window > 0 ? std::max<int64_t>(0, cl[s] - ql[s] + 1 - window) : 0;
      chunks[i] = gather(bt + s * MAXB, i % KVH, cl[s], first, base + off[i]);
      chunks[i].table = bt + s * MAXB;
      chunks[i].q_start = qs[s];
      chunks[i].q_len = ql[s];
      chunks[i].ctx = cl[s];
    }
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t wid, int64_t) {
    float* w = work + wid * per_worker;
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++)
      attend(items[i], chunks[items[i].chunk * KVH + items[i].kh], w, max_keys);
  });
}

// bf16 (and widened) pools: K rows then V key pairs
int64_t kv_bytes_bf16(int64_t ctx, int64_t D) { return (ctx + kPad) * D * 2 + D * v_ld(ctx) * 4; }

// ---- fp32 pools: the same items on fp32 tiles (f32_tile.h), no rounding anywhere ----
//   S^T [keys, 48] = K . Q^T: f32::rows with the keys as rows against the q panel [D, 48];
//   the exact max of each lane, p = exp(s - max) in fp32 into a p panel [keys, 48] (f32 panel layout), the
//   lanes' sums of p;
//   O^T [D, 48] = V^T . P: f32::rows with V^T's head dims as rows against the p panel; out = O / sum.
// This is the fp32 decode op's math (exact max, exp16, fp32 sums); the sums run in another order. Where it
// runs: the backend sends an fp32 pool's prompts here on CPUs without native bf16 dot products (an AVX2-only
// host's fp32 pool: the 6 x 16 FMA tile on both products), against SDPA per sequence.
namespace fp32 {

int64_t kv_bytes(int64_t ctx, int64_t D) { return 2 * ctx * D * 4; }

// q panel [D, 48], S^T [keys, 48], p panel [keys, 48], O^T [D, 48]
int64_t work_floats(int64_t keys, int64_t D) { return 2 * D * NL + 2 * keys * NL; }

// keys before first are zeros, as the bf16 gather's
Chunk gather(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int64_t* table, int64_t kh, int64_t ctx,
             int64_t first, uint8_t* buf) {
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), D = k_cache.size(3);
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* kd = reinterpret_cast<float*>(buf);  // [ctx, D]
  float* vt = kd + ctx * D;                   // [D, ctx]
  std::fill(kd, kd + first * D, 0.f);
  for (int64_t d = 0; d < D; ++d) std::fill(vt + d * ctx, vt + d * ctx + first, 0.f);
  for (int64_t t = first; t < ctx; ++t) {
    const int64_t row = ((table[t / BS] * BS + t % BS) * KVH + kh) * D;
    std::memcpy(kd + t * D, kp + row, D * sizeof(float));
    for (int64_t d = 0; d < D; ++d) vt[d * ctx + t] = vp[row + d];
  }
  return Chunk{nullptr, 0, 0, ctx, kd, vt, ctx};
}

void attend(const Chunk& c, int64_t kh, int64_t r0, int64_t G, int64_t H, int64_t D, const float* q, int64_t q_stride,
            float scale, int64_t window, const float* sinks, float* out, float* work) {
  const ItemLanes il(c, r0, G, window);
  const Lanes ln = il.of(kh);
  const int64_t nk = il.khi - il.klo;
  float* qpanel = work;             // [D, 48]
  float* S = qpanel + D * NL;       // [nk, 48], row j = key klo + j
  float* P = S + nk * NL;           // p panel [nk, 48]
  float* ot = P + nk * NL;          // [D, 48]
  std::fill(qpanel, qpanel + D * NL, 0.f);
  for (int64_t l = 0; l < il.lanes; ++l) {
    const float* qr = q + (c.q_start + r0 + l / G) * q_stride + (kh * G + l % G) * D;
    for (int64_t k = 0; k < D; ++k) qpanel[f32::at(D, k, l)] = qr[k];
  }
  const float* kd = static_cast<const float*>(c.k);
  f32::rows(kd + il.klo * D, D, nk, D, qpanel, nullptr, S, NL, NL);  // padding lanes too: q = 0, finite scores
  v16f mx[NV], sum[NV] = {};
  scale_mask_max(S, nk, il.klo, ln, scale, mx);
  for (int64_t j = 0; j < nk; ++j)
    for (int v = 0; v < NV; ++v) {  // a 16-lane vector lies in one strip (SW is 16 or 48)
      const v16f p = vec::exp16(vec::load16(S + j * NL + 16 * v) - mx[v]);
      sum[v] += p;
      vec::store16(P + f32::at(nk, j, 16 * v), p);
    }
  const float* vt = static_cast<const float*>(c.v);
  f32::rows(vt + il.klo, c.ldv, D, nk, P, nullptr, ot, NL, il.lanes);
  alignas(64) float m[NL], z[NL];
  for (int v = 0; v < NV; ++v) {
    vec::store16(m + 16 * v, mx[v]);
    vec::store16(z + 16 * v, sum[v]);
  }
  write_item(c, il, kh, r0, G, H, D, sinks, ot, m, z, out);
}

}  // namespace fp32

}  // namespace

void attend_chunks(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor block_tables, torch::Tensor q_start, torch::Tensor q_len, torch::Tensor ctx_len,
                   double scale, int64_t window, torch::Tensor scratch, c10::optional<torch::Tensor> sinks,
                   c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                   c10::optional<torch::Tensor> lut) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.dim() == 4,
              "attend_chunks: the pools must be contiguous [NB, BS, KVH, row]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 && out.is_contiguous(),
              "attend_chunks: q and out must be fp32, out contiguous");
  const int64_t H = q.size(1), D = q.size(2), BS = k_cache.size(1), KVH = k_cache.size(2), MAXB = block_tables.size(1);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "attend_chunks: q rows must hold their heads contiguously");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= NL && v_cache.size(2) == KVH, "attend_chunks: heads and pool do not match");
  TORCH_CHECK(D % KT == 0, "attend_chunks: head_dim must be a multiple of ", KT);
  TORCH_CHECK(!sinks || (sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() && sinks->numel() == H),
              "attend_chunks: sinks must be fp32 [H]");
  const float* sk = sinks ? sinks->data_ptr<float>() : nullptr;
  const int64_t G = H / KVH, n = q_start.numel(), q_stride = q.stride(0);
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx_len.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (k_cache.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(v_cache.scalar_type() == torch::kFloat32 && k_cache.size(3) == D && v_cache.size(3) == D,
                "attend_chunks: an fp32 pool's K and V rows must both be fp32 of the query's head_dim");
    run_items(n, KVH, G, D, bt, MAXB, BS, qs, ql, cl, window, scratch, fp32::kv_bytes, fp32::work_floats,
              [&](const int64_t* table, int64_t kh, int64_t ctx, int64_t first, uint8_t* buf) {
                return fp32::gather(k_cache, v_cache, table, kh, ctx, first, buf);
              },
              [&](const Item& it, const Chunk& c, float* w, int64_t) {
                fp32::attend(c, it.kh, it.r0, G, H, D, qp, q_stride, fscale, window, sk, op, w);
              });
    return;
  }
  const int fp8 = fp8_format(lut);  // once a call: K and V share it
  const Heads K = heads_of(k_cache, D, k_scale, fp8), V = heads_of(v_cache, D, v_scale, fp8);
  run_items(n, KVH, G, D, bt, MAXB, BS, qs, ql, cl, window, scratch, kv_bytes_bf16, work_floats,
            [&](const int64_t* table, int64_t kh, int64_t ctx, int64_t first, uint8_t* buf) {
              uint16_t* kd = reinterpret_cast<uint16_t*>(buf);
              uint32_t* vd = reinterpret_cast<uint32_t*>(buf + (ctx + kPad) * D * 2);
              gather(K, V, table, BS, kh, D, ctx, first, kd, vd, v_ld(ctx));
              return Chunk{nullptr, 0, 0, ctx, kd, vd, v_ld(ctx)};
            },
            [&](const Item& it, const Chunk& c, float* w, int64_t max_keys) {
              attend(c, it.kh, it.r0, G, H, D, qp, q_stride, fscale, window, sk, op, work_at(w, max_keys, D));
            });
}

// Keys shared by the rows of several sequences (attention.cpp groups decode rows by shared prefix blocks):
// the same item math with lanes from any rows and every lane over all P keys, the lane's max taken with the
// max over its other keys (floor), so that its p are rounded against the row's max as everywhere else.
int64_t shared_keys_bytes(int64_t P, int64_t D) { return ((P + kPad) * D * 2 + D * v_ld(P) * 4 + 63) / 64 * 64; }

int64_t shared_work_floats(int64_t P, int64_t D) { return work_floats(P, D); }

SharedKeys gather_shared_keys(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int64_t* table,
                              int64_t kh, int64_t P, void* buf) {
  const int64_t BS = k_cache.size(1), D = k_cache.size(3), ldv = v_ld(P);
  uint16_t* kd = static_cast<uint16_t*>(buf);
  uint32_t* vd = reinterpret_cast<uint32_t*>(kd + (P + kPad) * D);
  gather(heads_of(k_cache, D), heads_of(v_cache, D), table, BS, kh, D, P, 0, kd, vd, ldv);
  return SharedKeys{kd, vd, P, ldv};
}

void attend_shared(const SharedKeys& sk, int64_t kh, const int64_t* rows, int64_t n, int64_t H, int64_t G, int64_t D,
                   const float* q, int64_t q_stride, float scale, const float* floor, float* mx, float* sum, float* out,
                   float* work) {
  TORCH_CHECK(n * G <= NL && sk.P % 2 == 0, "attend_shared: at most 48 lanes over whole key pairs");
  const Chunk c{nullptr, 0, 0, sk.P, sk.k, sk.v, sk.ldv};
  const Work w = work_at(work, sk.P, D);
  const int64_t lanes = n * G;
  alignas(64) int32_t lo[NL] = {}, hi[NL];
  alignas(64) float fl[NL], lmx[NL], lsum[NL];
  for (int64_t l = 0; l < lanes; ++l) {
    hi[l] = static_cast<int32_t>(sk.P);
    fl[l] = floor[(l / G) * H + kh * G + l % G];
  }
  attend_lanes(c, Lanes{lanes, kh, 0, sk.P, lo, hi, fl}, [&](int64_t i) { return rows[i]; }, G, D, q, q_stride, scale,
               w, lmx, lsum);
  for (int64_t l = 0; l < lanes; ++l) {
    const int64_t i = l / G, h = kh * G + l % G;
    mx[i * H + h] = lmx[l];
    sum[i * H + h] = lsum[l];
    float* o = out + (rows[i] * H + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = w.ot[d * NL + l];
  }
}
