// Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and MXFP4 weights repacked once at load into groups of 16 output rows, the
// layout that lets AVX-512 VNNI keep one output row per 32-bit lane (the idea of ggml's repacked
// Q4_0x8 gemv). Per group and 32-weight chunk g (the rows' blocks side by side; a last group's extra
// rows zero): the rows' scales, then the quants as 64-byte vectors, byte 4r + i of vector t being
//   Q4_0 / Q4_1 / Q4_K / MXFP4: nibble byte 4t + i of row r (low nibble: weight 4t + i, high: 16 + 4t + i), t < 4;
//   Q8_0 / Q6_K: weight 4t + i of row r as a byte, t < 8.
// Scales: Q4_0 [16 x fp16 d], Q4_1 + [16 x fp16 m], Q8_0 [16 x fp16 d], MXFP4 [16 x e8m0]; K-quants keep d (and dmin) in a
// header per 256-weight superblock and their sub-block scales as bytes in each chunk (kQ4KChunk,
// kQ6KChunk). Bytes per weight: as the file for Q4_0 / Q4_1 / Q8_0, Q4_K +3%, Q6_K +30% (6-bit quants
// as bytes).
// Decode (M < 16 rows of x): activations as int16 per 32 (X16Act), one output row per 32-bit lane.
//   Q4_0 / Q4_1 / Q4_K: each activation as two bytes (qa = 256 hi + lo), the nibbles as bytes, one vpdpbusd per
//     byte and 4-byte group of x: four products a lane, 16 a chunk, 12 ops of unpacking (int16 pairs took 16
//     vpdpwssd and 28 ops; the integer sums, and so the outputs, are the same bits).
//   Q8_0 / Q6_K / MXFP4: per chunk 16 vpdpwssd, each on a vector of int16 weight pairs (even / odd bytes of the
//     4-byte groups) and a broadcast activation pair (MXFP4's nibbles first through a 16-entry table to their int8
//     values). Q8_0 split into bytes as above (its weights + 128 against the high bytes) was no faster: it has no
//     nibbles to unpack.
// Offsets (-8 * sum(qa) for Q4_0, -32 * sum per half for Q6_K) seed the accumulators, Q4_1 / Q4_K mins add
// m * da * sum(qa); one fma per chunk applies d * da.
// Weights are streamed once; about 0.1 instructions per weight at one row of x.
// Prefill: a 48-row bf16 panel is 3 groups; each k of 16 rows is one shift, mask, convert and fma, each pair of k one
// convert to bf16 and one interleave, the chunk's 16 scales a few vector loads.
// ISA paths (compile-time):
//   AVX512F + BW + VNNI: every type above as described (the panels' fast path: + AVX512-BF16);
//   AVX2 + FMA + F16C: Q4_0 / Q4_1 / Q8_0, the same bytes read as two halves of 8 rows (bytes 0-31 of each 64-byte
//     vector: rows 0-7; 32-63: rows 8-15), one row per 32-bit lane of a ymm register. Activations int8 (X16Act.q8);
//     per chunk and half, a nibble vector's low and high nibbles each go through one vpmaddubsw with a broadcast
//     4-value group of x, 8 of them summed in int16 (15 * 127 * 2 * 8 < 2^15), one vpmaddwd to int32 (Q8_0: the
//     sign trick, |w| with x's signs flipped, to int32 per vector; with AVX-VNNI, one vpdpbusd each instead of
//     the three), one fma applies d * da: ~0.2 instructions per
//     weight, where the file layout's dot needs scalar scale loads and a horizontal sum per row. Prompt rows take
//     fp32 panels [K, 48] (AVX2 has no bf16 arithmetic): each k of 8 rows one shift, mask, convert and fma;
//   elsewhere x16_supported() is false and the file's layout is used (linear_ggml.cpp).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "bf16_tile.h"
#include "f32_tile.h"
#include "huge_pages.h"
#include "ggml_blocks.h"
#include "linear_x16.h"

namespace {

inline float fp16_at(const uint8_t* p) { return ggml::fp16(p); }

struct Layout {
  int64_t block_bytes, quant_at, chunk_bytes;  // a block in the file; a group chunk: its quants' offset, its stride
  bool has_min, is_q8, kquant, q6;
  bool fp4 = false;  // MXFP4: a scale byte (e8m0) per row, nibbles as fp4 codes
};

Layout layout(int64_t type) {
  switch (type) {
    case 2: return {18, 32, 288, false, false, false, false};  // Q4_0
    case 3: return {20, 64, 320, true, false, false, false};   // Q4_1
    case 8: return {34, 32, 544, false, true, false, false};   // Q8_0
    case 12: return {144, 32, 296, true, false, true, false};  // Q4_K: 2368 B a superblock of 8 chunks (296 on average)
    case 14: return {210, 32, 548, false, false, true, true};  // Q6_K: 4384 B a superblock (548 on average)
    case 39: return {17, 16, 272, false, false, false, false, true};  // MXFP4
    default: TORCH_CHECK(false, "x16: ggml type ", type, " is not repacked (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, MXFP4)");
  }
  return {};
}

// Q4_K: per group and 256-weight superblock, a 64 B header [16 x fp16 d][16 x fp16 dmin] and 8 chunks of
// 288 B [16 x u8 scale][16 x u8 min][256 B nibbles]: w = d * scale * q - dmin * min, exactly as ggml.
// Q6_K: a 32 B header [16 x fp16 d] and 8 chunks of 544 B [16 x int8 scale of weights 0-15][16 x int8
// scale of 16-31][8 x 64 B of quants 0..63 as bytes]: w = d * scale * (q - 32) (+30% bytes: 6 bits in 8).
constexpr int64_t kQ4KChunk = 288, kQ4KHeader = 64, kQ6KChunk = 544, kQ6KHeader = 32;

inline int64_t kchunk(const Layout& L) { return L.q6 ? kQ6KChunk : kQ4KChunk; }
inline int64_t kheader(const Layout& L) { return L.q6 ? kQ6KHeader : kQ4KHeader; }

inline const uint8_t* chunk_ptr(const uint8_t* wp, const Layout& L, int64_t nch, int64_t grp, int64_t g) {
  if (!L.kquant) return wp + (grp * nch + g) * L.chunk_bytes;
  return wp + grp * nch * L.chunk_bytes + (g / 8) * (kheader(L) + 8 * kchunk(L)) + kheader(L) + (g % 8) * kchunk(L);
}

// scale d and offset m of row `lane`'s weights in half h (0: weights 0-15, 1: 16-31) of a chunk: w = d q + m
inline void chunk_scale(const uint8_t* c, const Layout& L, int64_t g, int lane, int h, float* d, float* m) {
  if (L.kquant) {
    const uint8_t* hdr = c - kheader(L) - (g % 8) * kchunk(L);
    if (L.q6) {
      *d = fp16_at(hdr + 2 * lane) * static_cast<float>(static_cast<int8_t>(c[16 * h + lane]));
      *m = -32.f * *d;
      return;
    }
    *d = fp16_at(hdr + 2 * lane) * static_cast<float>(c[lane]);
    *m = -(fp16_at(hdr + 32 + 2 * lane) * static_cast<float>(c[16 + lane]));
    return;
  }
  if (L.fp4) {  // the row's e8m0 byte, read as a block's first byte (scales() writes both halves' d and m)
    float dd[2], mm[2];
    ggml::MXFP4::scales(c + lane, 0, dd, mm);
    *d = dd[0];
    *m = 0.f;
    return;
  }
  *d = fp16_at(c + 2 * lane);
  *m = L.has_min ? fp16_at(c + 32 + 2 * lane) : L.is_q8 ? 0.f : -8.f * *d;
}

#if defined(__AVX512F__)
// chunk_scale of the chunk's 16 rows at once, per half: the same values (the fp16 conversions are exact either way).
// Per lane the scalar calls cost more than the panel's own dequantization (~1.5 instructions a weight)
inline __m512 fp16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline __m512 i8x16(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }

inline void chunk_scales16(const uint8_t* c, const Layout& L, int64_t g, __m512* d, __m512* m) {
  if (L.kquant) {
    const uint8_t* hdr = c - kheader(L) - (g % 8) * kchunk(L);
    if (L.q6) {
      for (int h = 0; h < 2; ++h) {
        d[h] = _mm512_mul_ps(fp16x16(hdr), i8x16(c + 16 * h));
        m[h] = _mm512_mul_ps(d[h], _mm512_set1_ps(-32.f));
      }
      return;
    }
    d[0] = d[1] = _mm512_mul_ps(fp16x16(hdr), u8x16(c));
    const __m512 mn = _mm512_mul_ps(fp16x16(hdr + 32), u8x16(c + 16));  // negated by its sign bit, as -x is
    m[0] = m[1] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mn), _mm512_set1_epi32(INT32_MIN)));
    return;
  }
  if (L.fp4) {  // ggml's e8m0 half (MXFP4::scales): 2^(e - 128) as bits, e < 2 as a subnormal
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    d[0] = d[1] = _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, sub));
    m[0] = m[1] = _mm512_setzero_ps();
    return;
  }
  d[0] = d[1] = fp16x16(c);
  m[0] = m[1] = L.has_min ? fp16x16(c + 32) : L.is_q8 ? _mm512_setzero_ps() : _mm512_mul_ps(d[0], _mm512_set1_ps(-8.f));
}
#endif

// weight k (0..31) of row `lane` in a group chunk, as its quant (Q4: 0..15; Q6: 0..63; Q8: -128..127)
inline int quant_at(const uint8_t* qs, const Layout& L, int lane, int k) {
  if (L.is_q8) return static_cast<int8_t>(qs[(k / 4) * 64 + 4 * lane + k % 4]);
  if (L.q6) return qs[(k / 4) * 64 + 4 * lane + k % 4];
  const int kk = k % 16;
  const uint8_t b = qs[(kk / 4) * 64 + 4 * lane + kk % 4];
  const int nib = k < 16 ? (b & 0x0f) : (b >> 4);
  return L.fp4 ? ggml::MXFP4::kValues[nib] : nib;
}

// weight k of row `lane` of group grp's chunk g, dequantized as ggml does
inline float weight_at(const uint8_t* wp, const Layout& L, int64_t nch, int64_t grp, int64_t g, int lane, int k) {
  const uint8_t* c = chunk_ptr(wp, L, nch, grp, g);
  float d, m;
  chunk_scale(c, L, g, lane, k / 16, &d, &m);
  return d * static_cast<float>(quant_at(c + L.quant_at, L, lane, k)) + m;
}

}  // namespace

bool x16_supported(int64_t type) {
#if PAGEDLLM_X16_VNNI512
  return type == 2 || type == 3 || type == 8 || type == 12 || type == 14 || type == 39;
#elif PAGEDLLM_X16_AVX2
  return type == 2 || type == 3 || type == 8;
#else
  (void)type;
  return false;
#endif
}

torch::Tensor repack_x16(torch::Tensor w, int64_t type) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "repack_x16: w must be [O, row_bytes] uint8");
  const Layout L = layout(type);
  const int64_t O = w.size(0), nblk = w.size(1) / L.block_bytes, G = (O + 15) / 16;
  const int64_t nch = L.kquant ? nblk * 8 : nblk;
  TORCH_CHECK(w.size(1) == nblk * L.block_bytes, "repack_x16: rows are not whole blocks");
  auto out = zeros_on_huge_pages({G, nch, L.chunk_bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t grp = lo; grp < hi; ++grp)
      for (int r = 0; r < 16 && grp * 16 + r < O; ++r) {
        const uint8_t* row = src + (grp * 16 + r) * w.size(1);
        for (int64_t g = 0; g < nch; ++g) {
          uint8_t* c = const_cast<uint8_t*>(chunk_ptr(dst, L, nch, grp, g));
          uint8_t q[16];  // this chunk's nibble bytes as Q4_0 orders them (low: weight j, high: j + 16)
          if (L.q6) {
            const uint8_t* b = row + (g / 8) * L.block_bytes;
            const int sub = static_cast<int>(g % 8);
            if (sub == 0) std::memcpy(c - kQ6KHeader + 2 * r, b + 208, 2);  // d
            c[r] = b[192 + 2 * sub];           // scale of weights 0-15
            c[16 + r] = b[192 + 2 * sub + 1];  // of 16-31
            uint8_t w32[32];
            ggml::Q6_K::quants(b, sub, w32);
            for (int64_t j = 0; j < 32; ++j) c[L.quant_at + (j / 4) * 64 + 4 * r + j % 4] = w32[j];
            continue;
          }
          if (L.kquant) {
            const uint8_t* b = row + (g / 8) * L.block_bytes;
            const int sub = static_cast<int>(g % 8);
            if (sub == 0) {
              std::memcpy(c - 64 + 2 * r, b, 2);       // d
              std::memcpy(c - 64 + 32 + 2 * r, b + 2, 2);  // dmin
            }
            float sc, mn;
            ggml::scale_min_k4(b + 4, sub, &sc, &mn);
            c[r] = static_cast<uint8_t>(sc);
            c[16 + r] = static_cast<uint8_t>(mn);
            uint8_t w32[32];
            ggml::Q4_K::quants(b, sub, w32);
            for (int j = 0; j < 16; ++j) q[j] = static_cast<uint8_t>(w32[j] | (w32[j + 16] << 4));
          } else if (L.fp4) {
            const uint8_t* b = row + g * L.block_bytes;
            c[r] = b[0];  // e8m0
            std::memcpy(q, b + 1, 16);
          } else {
            const uint8_t* b = row + g * L.block_bytes;
            std::memcpy(c + 2 * r, b, 2);                          // d
            if (L.has_min) std::memcpy(c + 32 + 2 * r, b + 2, 2);  // m
            const uint8_t* qs = b + (L.has_min ? 4 : 2);
            if (L.is_q8) {
              for (int64_t j = 0; j < 32; ++j) c[L.quant_at + (j / 4) * 64 + 4 * r + j % 4] = qs[j];
              continue;
            }
            std::memcpy(q, qs, 16);
          }
          for (int64_t j = 0; j < 16; ++j) c[L.quant_at + (j / 4) * 64 + 4 * r + j % 4] = q[j];
        }
      }
  });
  return out;
}

X16Act x16_quantize(const float* x, int64_t M, int64_t K) {
  X16Act a;
  a.K = K;
  a.nch = K / 32;
#if PAGEDLLM_X16_AVX2
  constexpr bool kInt8 = true;
  a.q8.resize(M * K);
#else
  constexpr bool kInt8 = false;
  a.q.resize(M * K);
  a.lo.resize(M * K);
  a.hi.resize(M * K);
#endif
  a.d.resize(M * a.nch);
  a.s.resize(M * a.nch);
  a.sum.resize(M * a.nch);
  a.sum16.resize(M * a.nch * 2);
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m)
      for (int64_t g = 0; g < a.nch; ++g) {
        const float* xs = x + m * K + 32 * g;
        float id;
        const float d = ggml::block_scale(xs, kInt8 ? 127.f : 32767.f, &id);
        int32_t half[2] = {0, 0};
        if (kInt8) {
          ggml::quantize32(xs, id, a.q8.data() + m * K + 32 * g, half, half + 1);
        } else {
          for (int i = 0; i < 32; ++i) {
            const int16_t v = static_cast<int16_t>(std::nearbyint(xs[i] * id));
            a.q[m * K + 32 * g + (i & ~3) + (i & 1) * 2 + (i & 2) / 2] = v;  // in 4s: [0, 2, 1, 3]
            a.lo[m * K + 32 * g + i] = static_cast<uint8_t>(v & 0xff);  // v = 256 hi + lo, in order
            a.hi[m * K + 32 * g + i] = static_cast<int8_t>(v >> 8);
            half[i / 16] += v;
          }
        }
        const int32_t sum = half[0] + half[1];
        a.sum16[(m * a.nch + g) * 2] = half[0];
        a.sum16[(m * a.nch + g) * 2 + 1] = half[1];
        a.d[m * a.nch + g] = d;
        a.sum[m * a.nch + g] = sum;
        a.s[m * a.nch + g] = d * static_cast<float>(sum);
      }
  });
  return a;
}

torch::Tensor x16_dequantize(int64_t type, const torch::Tensor& w, int64_t rows, int64_t K, const torch::Tensor& ids) {
  const Layout L = layout(type);
  const int64_t nch = w.size(1);
  TORCH_CHECK(K == nch * 32, "x16_dequantize: the weight holds ", nch * 32, " columns, not ", K);
  const bool all = !ids.defined() || ids.numel() == 0;
  const int64_t R = all ? rows : ids.numel();
  auto idx = all ? torch::Tensor() : ids.to(torch::kInt64).contiguous();
  const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < (all ? 0 : R); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "x16_dequantize: row ", ip[i], " out of range");
  auto out = torch::empty({R, K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r = all ? i : ip[i], grp = r / 16;
      const int lane = static_cast<int>(r % 16);
      for (int64_t g = 0; g < nch; ++g)
        for (int k = 0; k < 32; ++k) op[i * K + 32 * g + k] = weight_at(wp, L, nch, grp, g, lane, k);
    }
  });
  return out;
}

#if PAGEDLLM_X16_VNNI512
namespace {


// T activation rows t0 .. t0 + T - 1 against the groups [g_lo, g_hi). Each 32-bit lane holds two
// int16 weights of its row (the even and the odd bytes of a 4-byte group, split by a mask and a
// shift) and vpdpwssd adds their products with the broadcast activation pair.
template <int TYPE, int T>
void dot_groups(const uint8_t* wp, int64_t nch, int64_t g_lo, int64_t g_hi, int64_t rows, const X16Act& a,
                int64_t t0, const float* bias, float* y, int64_t O) {
  constexpr bool kQK = TYPE == 12, kQ6 = TYPE == 14, kMin = TYPE == 3 || kQK, kQ8 = TYPE == 8, kFP4 = TYPE == 39;
  constexpr int64_t CB = TYPE == 2 ? 288 : TYPE == 3 ? 320 : TYPE == 8 ? 544 : TYPE == 12 ? 296 : TYPE == 39 ? 272 : 548;
  constexpr int64_t QAT = TYPE == 3 ? 64 : TYPE == 39 ? 16 : 32;
  const __m512i fp4 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ggml::MXFP4::kValues)));
  const int64_t K = a.K;
  for (int64_t grp = g_lo; grp < g_hi; ++grp) {
    __m512 acc[T], off[T];
    for (int t = 0; t < T; ++t) acc[t] = off[t] = _mm512_setzero_ps();
    const uint8_t* ahead = wp + grp * nch * CB + ggml::kStreamAhead;
    for (int64_t g = 0; g < nch; ++g) {
      // the bytes kStreamAhead past this chunk's, one line at a time (ggml_blocks.h)
      for (int64_t l = g * CB; l < (g + 1) * CB; l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
      const uint8_t* c;
      __m512 dv, mv = _mm512_setzero_ps(), dv_hi = _mm512_setzero_ps();
      if constexpr (kQ6) {  // d * scale for weights 0-15 (dv) and 16-31 (dv_hi)
        c = wp + grp * nch * CB + (g / 8) * (kQ6KHeader + 8 * kQ6KChunk) + kQ6KHeader + (g % 8) * kQ6KChunk;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c - kQ6KHeader - (g % 8) * kQ6KChunk)));
        dv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)))));
        dv_hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)))));
      } else if constexpr (kQK) {  // d * scale, -(dmin * min) per row, from the superblock header and the chunk's bytes
        c = wp + grp * nch * CB + (g / 8) * (kQ4KHeader + 8 * kQ4KChunk) + kQ4KHeader + (g % 8) * kQ4KChunk;
        const uint8_t* hdr = c - kQ4KHeader - (g % 8) * kQ4KChunk;
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
        dv = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr))), sc);
        mv = _mm512_sub_ps(_mm512_setzero_ps(),
                           _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hdr + 32))), mn));
      } else if constexpr (kFP4) {  // 2^(e - 128) from each row's e8m0 byte (e < 2: ggml's subnormals)
        c = wp + (grp * nch + g) * CB;
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
        dv = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
      } else {
        c = wp + (grp * nch + g) * CB;
        dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
        if constexpr (kMin) mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32)));
      }
      if constexpr (TYPE == 2 || TYPE == 3 || kQK) {
        // Q4_0 / Q4_1 / Q4_K: each int16 activation as a signed high byte and an unsigned low byte (x = 256 hi + lo), so
        // that the nibbles go through vpdpbusd as bytes, four products a lane, against each byte in turn: half
        // the dot instructions of the int16 pairs and a third of their unpacking, and the same integer sums.
        // wl / wh[t]: lane r holds row r's weights 4t .. 4t + 3 (low nibbles) and 16 + 4t .. 16 + 4t + 3 (high)
        __m512i wl[4], wh[4];
        for (int t = 0; t < 4; ++t) {
          const __m512i raw = _mm512_loadu_si512(c + QAT + 64 * t);
          wl[t] = _mm512_and_si512(raw, _mm512_set1_epi8(0x0f));
          wh[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0f));
        }
#pragma GCC unroll 1
        for (int t = 0; t < T; ++t) {
          const int64_t r = t0 + t;
          const int32_t* pl = reinterpret_cast<const int32_t*>(a.lo.data() + r * K + 32 * g);  // 8 groups of 4
          const int32_t* ph = reinterpret_cast<const int32_t*>(a.hi.data() + r * K + 32 * g);
          __m512i l0 = _mm512_set1_epi32(kMin ? 0 : -8 * a.sum[r * a.nch + g]), l1 = _mm512_setzero_si512();
          __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
          for (int u = 0; u < 4; ++u) {  // vpdpbusd: unsigned bytes first, signed second
            l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(pl[u]), wl[u]);
            h0 = _mm512_dpbusd_epi32(h0, wl[u], _mm512_set1_epi32(ph[u]));
            l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(pl[4 + u]), wh[u]);
            h1 = _mm512_dpbusd_epi32(h1, wh[u], _mm512_set1_epi32(ph[4 + u]));
          }
          const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
          const __m512 da = _mm512_set1_ps(a.d[r * a.nch + g]);
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, da), acc[t]);
          if constexpr (kMin) off[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[r * a.nch + g]), off[t]);
        }
        continue;
      }
      // Q8_0 / Q6_K / MXFP4: w[j], int16 pairs of weights; the activation pair each needs is int32 p[j] of the
      // reordered row chunk (Q8: j in order; MXFP4: j = 4t + {0, 1} take 2t + {0, 1}, 4t + {2, 3} take 8 + 2t + {0, 1})
      __m512i w[16];
      if constexpr (kQ6) {  // bytes 0..63: even and odd bytes as int16 without sign extension
        for (int t = 0; t < 8; ++t) {
          const __m512i raw = _mm512_loadu_si512(c + QAT + 64 * t);
          w[2 * t] = _mm512_and_si512(raw, _mm512_set1_epi32(0x00ff00ff));
          w[2 * t + 1] = _mm512_srli_epi16(raw, 8);
        }
      } else if constexpr (kQ8) {
        for (int t = 0; t < 8; ++t) {
          const __m512i raw = _mm512_loadu_si512(c + QAT + 64 * t);
          w[2 * t] = _mm512_srai_epi16(_mm512_slli_epi16(raw, 8), 8);  // bytes 0, 2: weights 4t + {0, 2}
          w[2 * t + 1] = _mm512_srai_epi16(raw, 8);                    // bytes 1, 3: 4t + {1, 3}
        }
      } else if constexpr (kFP4) {  // each nibble's int8 value through the table, then as Q8_0's bytes
        for (int t = 0; t < 4; ++t) {
          const __m512i raw = _mm512_loadu_si512(c + QAT + 64 * t);
          const __m512i lo = _mm512_shuffle_epi8(fp4, _mm512_and_si512(raw, _mm512_set1_epi8(0x0f)));
          const __m512i hi = _mm512_shuffle_epi8(fp4, _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0f)));
          w[4 * t] = _mm512_srai_epi16(_mm512_slli_epi16(lo, 8), 8);      // weights 4t + {0, 2}
          w[4 * t + 1] = _mm512_srai_epi16(lo, 8);                        // 4t + {1, 3}
          w[4 * t + 2] = _mm512_srai_epi16(_mm512_slli_epi16(hi, 8), 8);  // 16 + 4t + {0, 2}
          w[4 * t + 3] = _mm512_srai_epi16(hi, 8);                        // 16 + 4t + {1, 3}
        }
      }
#pragma GCC unroll 1  // rows one after another: unrolled, their chains spill the 16 weight registers
      for (int t = 0; t < T; ++t) {
        const int64_t r = t0 + t;
        const int32_t* p = reinterpret_cast<const int32_t*>(a.q.data() + r * K + 32 * g);  // 16 pairs
        if constexpr (kQ6) {  // two halves with their own scales: q - 32 through each half's sum of activations
          __m512i lo0 = _mm512_set1_epi32(-32 * a.sum16[(r * a.nch + g) * 2]), lo1 = _mm512_setzero_si512();
          __m512i hi0 = _mm512_set1_epi32(-32 * a.sum16[(r * a.nch + g) * 2 + 1]), hi1 = _mm512_setzero_si512();
          for (int j = 0; j < 8; j += 2) {
            lo0 = _mm512_dpwssd_epi32(lo0, w[j], _mm512_set1_epi32(p[j]));
            lo1 = _mm512_dpwssd_epi32(lo1, w[j + 1], _mm512_set1_epi32(p[j + 1]));
            hi0 = _mm512_dpwssd_epi32(hi0, w[8 + j], _mm512_set1_epi32(p[8 + j]));
            hi1 = _mm512_dpwssd_epi32(hi1, w[9 + j], _mm512_set1_epi32(p[9 + j]));
          }
          const __m512 da = _mm512_set1_ps(a.d[r * a.nch + g]);
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo0, lo1)), _mm512_mul_ps(dv, da), acc[t]);
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(hi0, hi1)), _mm512_mul_ps(dv_hi, da), acc[t]);
          continue;
        }
        constexpr int NC = 4;  // independent chains: vpdpwssd's latency, not its throughput, bounds one of 16
        __m512i i[NC];
        for (int n = 0; n < NC; ++n) i[n] = _mm512_setzero_si512();
        for (int j = 0; j < 16; ++j) {
          const int pj = kQ8 ? j : (j % 4 < 2 ? 2 * (j / 4) + j % 4 : 8 + 2 * (j / 4) + j % 4 - 2);
          i[j % NC] = _mm512_dpwssd_epi32(i[j % NC], w[j], _mm512_set1_epi32(p[pj]));
        }
        __m512i isum = i[0];
        for (int n = 1; n < NC; ++n) isum = _mm512_add_epi32(isum, i[n]);
        const __m512 da = _mm512_set1_ps(a.d[r * a.nch + g]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, da), acc[t]);
      }
    }
    const int64_t n0 = grp * 16, live = std::min<int64_t>(16, rows - n0);
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
    for (int t = 0; t < T; ++t) {
      __m512 out = _mm512_add_ps(acc[t], off[t]);
      if (bias) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, bias + n0));
      _mm512_mask_storeu_ps(y + (t0 + t) * O + n0, mask, out);
    }
  }
}

}  // namespace
#elif PAGEDLLM_X16_AVX2
namespace {

// The 8 rows of half h of a group's chunk against T activation rows t0 .. t0 + T - 1, one row per 32-bit lane.
// Q4_0 / Q4_1: vector t's lane holds nibble bytes 4t .. 4t + 3 of its row, so its low nibbles are weights
// 4t .. 4t + 3 (times x's int32 group t) and its high nibbles 16 + 4t .. (times group 4 + t).
template <int TYPE, int T>
inline void half_chunk(const uint8_t* c, int h, const X16Act& a, int64_t t0, int64_t g, __m256* acc) {
  constexpr bool kQ8 = TYPE == 8, kMin = TYPE == 3;
  constexpr int64_t QAT = TYPE == 3 ? 64 : 32;
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * h)));
  const int64_t K = a.K, nch = a.nch;
  if constexpr (kQ8) {  // |w| times x with w's signs: int16 pairs up to 2 * 128 * 127, so to int32 each vector
    __m256i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {  // weights 4j .. 4j + 3 of each row, read once for the T rows of x
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + QAT + 64 * j + 32 * h));
      const __m256i mag = _mm256_sign_epi8(raw, raw);
      for (int t = 0; t < T; ++t) {
        const int32_t pj = reinterpret_cast<const int32_t*>(a.q8.data() + (t0 + t) * K + 32 * g)[j];
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(pj), raw);
#if defined(__AVXVNNI__)
        isum[t] = _mm256_dpbusd_avx_epi32(isum[t], mag, xs);
#else
        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), _mm256_set1_epi16(1)));
#endif
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m256 da = _mm256_set1_ps(a.d[(t0 + t) * nch + g]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(dv, da), acc[t]);
    }
    return;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256i w[8];  // [t]: weights 4t .. 4t + 3 of each row; [4 + t]: 16 + 4t ..
  for (int t = 0; t < 4; ++t) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + QAT + 64 * t + 32 * h));
    w[t] = _mm256_and_si256(raw, low4);
    w[4 + t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
  }
  const __m256 mv = kMin ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 + 16 * h)))
                         : _mm256_setzero_ps();
  for (int t = 0; t < T; ++t) {
    const int64_t r = t0 + t;
    const int32_t* p = reinterpret_cast<const int32_t*>(a.q8.data() + r * K + 32 * g);
#if defined(__AVXVNNI__)  // vpdpbusd: each lane's 4 products summed into int32 in one instruction
    __m256i i0 = _mm256_set1_epi32(kMin ? 0 : -8 * a.sum[r * nch + g]), i1 = _mm256_setzero_si256();  // Q4_0: q - 8
    for (int j = 0; j < 8; j += 2) {
      i0 = _mm256_dpbusd_avx_epi32(i0, w[j], _mm256_set1_epi32(p[j]));
      i1 = _mm256_dpbusd_avx_epi32(i1, w[j + 1], _mm256_set1_epi32(p[j + 1]));
    }
    const __m256i isum = _mm256_add_epi32(i0, i1);
#else
    // int16 lanes: two products of <= 15 * 127 each, 8 vectors of them summed: < 2^15
    __m256i s0 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(p[0]));
    __m256i s1 = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(p[1]));
    for (int j = 2; j < 8; j += 2) {
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(p[j])));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[j + 1], _mm256_set1_epi32(p[j + 1])));
    }
    __m256i isum = _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
    if constexpr (!kMin) isum = _mm256_add_epi32(isum, _mm256_set1_epi32(-8 * a.sum[r * nch + g]));  // Q4_0: q - 8
#endif
    const __m256 da = _mm256_set1_ps(a.d[r * nch + g]);
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dv, da), acc[t]);
    if constexpr (kMin) acc[t] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[r * nch + g]), acc[t]);  // m * da * sum(qa)
  }
}

// T activation rows against the groups [g_lo, g_hi). Up to 2 rows of x, both halves of a chunk together (2T
// accumulators); more rows, the halves one after the other (the second finds the group's chunks in L1 / L2), as
// 4T accumulators and the unpacked weights would spill
template <int TYPE, int T>
void dot_groups(const uint8_t* wp, int64_t nch, int64_t g_lo, int64_t g_hi, int64_t rows, const X16Act& a,
                int64_t t0, const float* bias, float* y, int64_t O) {
  static_assert(TYPE == 2 || TYPE == 3 || TYPE == 8, "the AVX2 repacked dot runs Q4_0, Q4_1 and Q8_0");
  constexpr int64_t CB = TYPE == 2 ? 288 : TYPE == 3 ? 320 : 544;
  constexpr int kTogether = T <= 2 ? 2 : 1;  // halves a pass
  for (int64_t grp = g_lo; grp < g_hi; ++grp) {
    const uint8_t* gw = wp + grp * nch * CB;
    for (int h0 = 0; h0 < 2; h0 += kTogether) {
      if (grp * 16 + 8 * h0 >= rows) break;
      __m256 acc[kTogether][T];
      for (int h = 0; h < kTogether; ++h)
        for (int t = 0; t < T; ++t) acc[h][t] = _mm256_setzero_ps();
      for (int64_t g = 0; g < nch; ++g) {
        const uint8_t* c = gw + g * CB;
        // the first pass streams the group kStreamAhead ahead; a second pass (its chunks in L1 / L2) fetches the
        // next group's, so that memory stays busy while it computes
        const int64_t ahead = h0 == 0 ? ggml::kStreamAhead : nch * CB;
        for (int64_t l = 0; l < CB; l += 64) _mm_prefetch(reinterpret_cast<const char*>(c + l + ahead), _MM_HINT_T0);
        for (int h = 0; h < kTogether; ++h) half_chunk<TYPE, T>(c, h0 + h, a, t0, g, acc[h]);
      }
      for (int h = 0; h < kTogether; ++h) {
        const int64_t n0 = grp * 16 + 8 * (h0 + h), live = std::min<int64_t>(8, rows - n0);
        for (int t = 0; t < T; ++t) {
          alignas(32) float out[8];
          _mm256_store_ps(out, acc[h][t]);
          float* yr = y + (t0 + t) * O + n0;
          for (int64_t i = 0; i < live; ++i) yr[i] = out[i] + (bias ? bias[n0 + i] : 0.f);
        }
      }
    }
  }
}

}  // namespace
#endif

#if PAGEDLLM_X16_VNNI512 || PAGEDLLM_X16_AVX2
namespace {

template <int TYPE>
void dot_range(const uint8_t* wp, int64_t nch, int64_t rows, const X16Act& a, int64_t M, const float* bias, float* y,
               int64_t O, int64_t lo, int64_t hi) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) dot_groups<TYPE, 4>(wp, nch, lo, hi, rows, a, t, bias, y, O);
  switch (M - t) {
    case 3: dot_groups<TYPE, 3>(wp, nch, lo, hi, rows, a, t, bias, y, O); break;
    case 2: dot_groups<TYPE, 2>(wp, nch, lo, hi, rows, a, t, bias, y, O); break;
    case 1: dot_groups<TYPE, 1>(wp, nch, lo, hi, rows, a, t, bias, y, O); break;
    default: break;
  }
}

template <int TYPE>
void dot_all(const uint8_t* wp, int64_t nch, int64_t rows, const X16Act& a, int64_t M, const float* bias, float* y,
             int64_t O) {
  const int64_t G = (rows + 15) / 16;
  at::parallel_for(0, G, 1, [&](int64_t lo, int64_t hi) { dot_range<TYPE>(wp, nch, rows, a, M, bias, y, O, lo, hi); });
}

}  // namespace
#endif

void x16_dot_groups(int64_t type, const torch::Tensor& w, int64_t rows, const X16Act& a, int64_t M, const float* bias,
                    float* y, int64_t O, int64_t g_lo, int64_t g_hi) {
#if PAGEDLLM_X16_VNNI512 || PAGEDLLM_X16_AVX2
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (type == 2) dot_range<2>(wp, a.nch, rows, a, M, bias, y, O, g_lo, g_hi);
  if (type == 3) dot_range<3>(wp, a.nch, rows, a, M, bias, y, O, g_lo, g_hi);
  if (type == 8) dot_range<8>(wp, a.nch, rows, a, M, bias, y, O, g_lo, g_hi);
#if PAGEDLLM_X16_VNNI512
  if (type == 12) dot_range<12>(wp, a.nch, rows, a, M, bias, y, O, g_lo, g_hi);
  if (type == 14) dot_range<14>(wp, a.nch, rows, a, M, bias, y, O, g_lo, g_hi);
  if (type == 39) dot_range<39>(wp, a.nch, rows, a, M, bias, y, O, g_lo, g_hi);
#endif
#else
  (void)type; (void)w; (void)rows; (void)a; (void)M; (void)bias; (void)y; (void)O; (void)g_lo; (void)g_hi;
#endif
}

void x16_dot(int64_t type, const torch::Tensor& w, int64_t rows, const X16Act& a, int64_t M, const float* bias,
             float* y, int64_t O) {
  TORCH_CHECK(x16_supported(type), "x16_dot: not compiled for this CPU");
  TORCH_CHECK(w.size(1) == a.nch, "linear_ggml: x [", M, ", ", a.K, "] does not match a repacked weight of ", w.size(1) * 32,
              " columns");
#if PAGEDLLM_X16_VNNI512 || PAGEDLLM_X16_AVX2
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (type == 2) dot_all<2>(wp, a.nch, rows, a, M, bias, y, O);
  if (type == 3) dot_all<3>(wp, a.nch, rows, a, M, bias, y, O);
  if (type == 8) dot_all<8>(wp, a.nch, rows, a, M, bias, y, O);
#if PAGEDLLM_X16_VNNI512
  if (type == 12) dot_all<12>(wp, a.nch, rows, a, M, bias, y, O);
  if (type == 14) dot_all<14>(wp, a.nch, rows, a, M, bias, y, O);
  if (type == 39) dot_all<39>(wp, a.nch, rows, a, M, bias, y, O);
#endif
#else
  (void)w; (void)rows; (void)a; (void)M; (void)bias; (void)y; (void)O;
#endif
}

void x16_panel(int64_t type, const torch::Tensor& w, int64_t K, int64_t p, uint16_t* panel) {
  const Layout L = layout(type);
  const int64_t nch = w.size(1), G = w.size(0);
  TORCH_CHECK(K == nch * 32, "linear_ggml: x has ", K, " columns, the repacked weight ", nch * 32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  // a last group's padded rows are zero blocks: they dequantize to 0
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512i low4 = _mm512_set1_epi32(0x0f);
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512i fp4_values = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ggml::MXFP4::kValues)));
  for (int gi = 0; gi < 3; ++gi) {
    const int64_t grp = 3 * p + gi;
    for (int64_t g = 0; g < nch; ++g) {
      uint16_t* dst = panel + (16 * g * bf16::NR + 16 * gi) * 2;  // k pair j of this chunk: + j * 48 * 2
      if (grp >= G) {
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * bf16::NR * 2, _mm512_setzero_si512());
        continue;
      }
      const uint8_t* c = chunk_ptr(wp, L, nch, grp, g);
      __m512 dvh[2], mvh[2];  // per half of the chunk (they differ for Q6_K only)
      chunk_scales16(c, L, g, dvh, mvh);
      const uint8_t* qs = c + L.quant_at;
      // the quants' kind chosen once a chunk and the k loop unrolled: with the kind tested at every k, GCC kept
      // each weight vector on the stack between the two of a pair (a store and a reload a k)
      auto pairs = [&](auto kind) {
        constexpr int K = decltype(kind)::value;  // 0: Q4 nibbles, 1: MXFP4 nibbles, 2: Q8 bytes, 3: Q6 bytes
        auto weights = [&](int k) {  // weight k of the 16 rows
          __m512i q;
          if constexpr (K == 3) {
            q = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(qs + 64 * (k / 4)), 8 * (k % 4)),
                                 _mm512_set1_epi32(0xff));
          } else if constexpr (K == 2) {  // sign-extend byte k % 4
            q = _mm512_srai_epi32(_mm512_slli_epi32(_mm512_loadu_si512(qs + 64 * (k / 4)), 24 - 8 * (k % 4)), 24);
          } else {
            const int kk = k % 16;
            q = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(qs + 64 * (kk / 4)), 8 * (kk % 4) + (k < 16 ? 0 : 4)),
                                 low4);
            if constexpr (K == 1) q = _mm512_permutexvar_epi32(q, fp4_values);  // the code's int8 value, as int32
          }
          return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), dvh[k / 16], mvh[k / 16]);
        };
#pragma GCC unroll 16
        for (int k = 0; k < 32; k += 2) {  // [w_k(row 0), w_k+1(row 0), w_k(row 1), ...]: one convert, one interleave
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(weights(k + 1), weights(k));  // [w_k | w_k+1] rows 0-15
          _mm512_storeu_si512(dst + (k / 2) * bf16::NR * 2, _mm512_permutexvar_epi16(interleave, both));
        }
      };
      if (L.q6) {
        pairs(std::integral_constant<int, 3>{});
      } else if (L.is_q8) {
        pairs(std::integral_constant<int, 2>{});
      } else if (L.fp4) {
        pairs(std::integral_constant<int, 1>{});
      } else {
        pairs(std::integral_constant<int, 0>{});
      }
    }
  }
#else  // no vcvtneps2bf16: the scalar dequantization, rounded as torch rounds
  for (int gi = 0; gi < 3; ++gi) {
    const int64_t grp = 3 * p + gi;
    for (int64_t g = 0; g < nch; ++g)
      for (int lane = 0; lane < 16; ++lane)
        for (int k = 0; k < 32; ++k) {
          const float v = grp < G ? weight_at(wp, L, nch, grp, g, lane, k) : 0.f;
          panel[(((32 * g + k) / 2) * bf16::NR + 16 * gi + lane) * 2 + k % 2] = bf16::to_bf16(v);
        }
  }
#endif
}

void x16_panel_f32(int64_t type, const torch::Tensor& w, int64_t K, int64_t p, float* panel) {
  const Layout L = layout(type);
  const int64_t nch = w.size(1), G = w.size(0);
  TORCH_CHECK(K == nch * 32, "linear_ggml: x has ", K, " columns, the repacked weight ", nch * 32);
  TORCH_CHECK(!L.kquant && !L.fp4, "x16_panel_f32: Q4_0, Q4_1 and Q8_0 only");
  const uint8_t* wp = w.data_ptr<uint8_t>();
#if PAGEDLLM_X16_AVX2
  static_assert(f32::NR == 48 && f32::SW % 8 == 0, "f32_tile.h's panel: 3 groups = 6 halves of 8 rows");
  const __m256i low4 = _mm256_set1_epi32(0x0f);
  for (int64_t hb = 0; hb < 6; ++hb) {  // half hb % 2 of group 3p + hb / 2: columns 8 hb .. 8 hb + 7
    const int64_t grp = 3 * p + hb / 2;
    const int h = static_cast<int>(hb % 2);
    for (int64_t g = 0; g < nch; ++g) {
      float* dst = panel + f32::at(K, 32 * g, 8 * hb);  // weight k of the chunk: + k * SW
      if (grp >= G) {
        for (int k = 0; k < 32; ++k) _mm256_storeu_ps(dst + k * f32::SW, _mm256_setzero_ps());
        continue;
      }
      // a last group's padded rows are zero blocks: they dequantize to 0
      const uint8_t* c = chunk_ptr(wp, L, nch, grp, g);
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * h)));
      const __m256 mv = L.has_min ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 + 16 * h)))
                      : L.is_q8   ? _mm256_setzero_ps()
                                  : _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
      for (int k = 0; k < 32; ++k) {
        __m256i q;
        if (L.is_q8) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + L.quant_at + 64 * (k / 4) + 32 * h));
          q = _mm256_srai_epi32(_mm256_sllv_epi32(v, _mm256_set1_epi32(24 - 8 * (k % 4))), 24);  // byte k % 4, signed
        } else {
          const int kk = k % 16;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + L.quant_at + 64 * (kk / 4) + 32 * h));
          q = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(8 * (kk % 4) + (k < 16 ? 0 : 4))), low4);
        }
        // d * q + m as ggml computes it: the product is exact (an fp16 scale times a quant), so one rounding either way
        _mm256_storeu_ps(dst + k * f32::SW, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), dv, mv));
      }
    }
  }
#else  // x16_supported() is false without the AVX2 dot, so no part reaches here repacked
  (void)wp; (void)G; (void)p; (void)panel;
  TORCH_CHECK(false, "x16_panel_f32: built without the AVX2 repacked dot");
#endif
}
