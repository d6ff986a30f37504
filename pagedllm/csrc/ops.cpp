// CPU kernels for the fp32 hot paths: attention that reads K/V straight from the paged pool (no
// gathered copy of the context), a linear over panel-packed weights, fused RMSNorm (+ residual
// add), rotary embedding, silu_and_mul, and a row argmax (grammar masks: mask_rows.cpp).
//
// Attention: one work item = one query token, all heads (with fewer tokens than threads, one item =
// a range of a token's keys, merged by their maxima: flash-decoding): each K/V slot row (all KV heads, contiguous) is read
// once and serves every query head (GQA: head h uses KV head h / G). Measured 2x faster than one
// item per (token, KV head), which read the same rows in three strided passes. Scores go to a
// thread-local buffer: pass 1 q.k and the max, pass 2 exp and the sum, pass 3 the weighted V sum.
// Query row r of sequence s attends to keys [lo, hi): hi = ctx_len - q_len + i + 1 (causal, i = r's
// index in its chunk), lo = hi - window when a sliding window is set.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "linear_bf16.h"
#include "linear_ggml.h"
#include "mask_rows.h"
#include "row_tiles.h"

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  v8f a0 = {0}, a1 = {0};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    a0 += load8(a + k) * load8(b + k);
    a1 += load8(a + k + 8) * load8(b + k + 8);
  }
  for (; k + 8 <= n; k += 8) a0 += load8(a + k) * load8(b + k);
  a0 += a1;
  float s = a0[0] + a0[1] + a0[2] + a0[3] + a0[4] + a0[5] + a0[6] + a0[7];
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }

constexpr int64_t NR = 48;  // output columns per weight panel: three 16-float vectors

// An R x 48 tile of y = x w^T + b: w is packed once at load time as panels [P, K, 48] (column block
// p of w^T, zero-padded), so the inner loop streams one contiguous panel and does 3R FMAs per 3
// vector loads and R broadcasts of x, with the 3R accumulators in registers and no horizontal
// sums. Measured on SmolLM2's shapes: ~205-215 GFLOP/s at 64..2048 rows where MKL's sgemm on the
// plain [O, K] weights gives 130-190, and weight-streaming speed at one row.
template <int R>
static inline void linear_tile(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t O,
                               int64_t cols) {
  v16f acc[R][3];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 3; ++j) acc[i][j] = bias ? load16(bias + j * 16) : v16f{0};
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = panel + k * NR;
    const v16f w0 = load16(pk), w1 = load16(pk + 16), w2 = load16(pk + 32);
    for (int i = 0; i < R; ++i) {
      const float xv = x[i * K + k];
      acc[i][0] += xv * w0;
      acc[i][1] += xv * w1;
      acc[i][2] += xv * w2;
    }
  }
  for (int i = 0; i < R; ++i) {
    if (cols == NR) {
      for (int j = 0; j < 3; ++j) store16(y + i * O + j * 16, acc[i][j]);
    } else {  // the last, partial panel
      float tmp[NR];
      for (int j = 0; j < 3; ++j) store16(tmp + j * 16, acc[i][j]);
      for (int64_t c = 0; c < cols; ++c) y[i * O + c] = tmp[c];
    }
  }
}

// y [M, O] = x [M, K] w^T + b, with w packed [P, K, 48] and b padded to P * 48. One task = one panel.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == NR && x.size(1) == w.size(1) && w.is_contiguous(),
              "packed_linear: expects x [M, K] and a packed weight [P, K, 48]");
  TORCH_CHECK(O <= w.size(0) * NR, "packed_linear: more outputs than panels");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0);
  auto out = torch::empty({M, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * NR;
      const float* pb = bp ? bp + p * NR : nullptr;
      const int64_t c0 = p * NR, cols = std::min(NR, O - c0);
      for_row_tiles(0, M, [&](int64_t m, auto R) {
        linear_tile<decltype(R)::value>(xp + m * K, K, panel, pb, op + m * O + c0, O, cols);
      });
    }
  });
  return out;
}


template <int ND>
static inline float dot16(const float* a, const float* b) {
  v16f acc = load16(a) * load16(b);
  for (int j = 1; j < ND; ++j) acc += load16(a + 16 * j) * load16(b + 16 * j);
  const v8f h = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  return h[0] + h[1] + h[2] + h[3] + h[4] + h[5] + h[6] + h[7];
}

template <int ND>
static inline void axpy16(float* y, float p, const float* x) {
  for (int j = 0; j < ND; ++j) store16(y + 16 * j, load16(y + 16 * j) + p * load16(x + 16 * j));
}

// Slot `slot` of a pool as an fp32 row of n = KVH * D values: fp32 rows are read in place; bf16 rows
// (the top half of an fp32) and fp8 rows (a 256-entry decode table times the slot's bf16 scale per
// KV head) are widened into a small thread-local buffer, so compact pools stream fewer bytes
// through the same loops.
struct Fp8Pool {
  const float* lut = nullptr;        // [256]: fp8 bit pattern -> value
  const uint16_t* scale = nullptr;   // [NB * BS, KVH] bf16
  int64_t kvh = 0, d = 0;
};

static inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

static inline const float* as_float(const float* pool, int64_t slot, int64_t n, float*, const Fp8Pool&) {
  return pool + slot * n;
}

static inline const float* as_float(const uint16_t* pool, int64_t slot, int64_t n, float* buf, const Fp8Pool&) {
  const uint16_t* src = pool + slot * n;
  for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_float(src[i]);
  return buf;
}

static inline const float* as_float(const uint8_t* pool, int64_t slot, int64_t n, float* buf, const Fp8Pool& f) {
  const uint8_t* src = pool + slot * n;
  for (int64_t h = 0; h < f.kvh; ++h) {
    const float sc = bf16_to_float(f.scale[slot * f.kvh + h]);
    for (int64_t i = h * f.d; i < (h + 1) * f.d; ++i) buf[i] = f.lut[src[i]] * sc;
  }
  return buf;
}

// E: pool element, float, uint16_t (bf16 bits) or uint8_t (fp8); ND = D / 16 for 16-wide dots (0: any D)
template <typename E, int ND>
static void paged_attention_impl(torch::Tensor out,           // [T, H, D] fp32
                     torch::Tensor q,             // [T, H, D] fp32
                     torch::Tensor k_cache,       // [NB, BS, KVH, D] fp32, bf16 or fp8
                     torch::Tensor v_cache,       // [NB, BS, KVH, D]
                     torch::Tensor block_tables,  // [S, MAXB] int64
                     torch::Tensor row_seq,       // [T] int64: sequence of each query row
                     torch::Tensor q_start,       // [S] int64: first row of each sequence
                     torch::Tensor q_len,         // [S] int64
                     torch::Tensor ctx_len,       // [S] int64
                     double scale, int64_t window, const Fp8Pool& kf, const Fp8Pool& vf) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH, MAXB = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const E* kp = reinterpret_cast<const E*>(k_cache.data_ptr());
  const E* vp = reinterpret_cast<const E*>(v_cache.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* ql = q_len.data_ptr<int64_t>();
  const int64_t* cl = ctx_len.data_ptr<int64_t>();
  const int64_t row_stride = KVH * D;  // between consecutive slots of the pool
  const float fscale = static_cast<float>(scale);

  TORCH_CHECK(H <= 128, "at most 128 heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "q rows must hold their heads contiguously");
  const int64_t q_stride = q.stride(0);
  // Keys [lo, hi) of row r for all heads: per-head max mx, sum of exp and the unnormalized V sum acc
  auto attend = [&](int64_t r, int64_t s, int64_t lo, int64_t hi, float* mx, float* sum, float* ac,
                    std::vector<float>& scores, float* kbuf, float* vbuf) {
    const int64_t n = hi - lo;
    scores.resize(H * n);
    float* __restrict sc = scores.data();
    const int64_t* table = bt + s * MAXB;
    const float* qrow = qp + r * q_stride;
    for (int64_t h = 0; h < H; ++h) mx[h] = -std::numeric_limits<float>::max();
    for (int64_t t0 = lo - lo % BS; t0 < hi; t0 += BS) {
      const int64_t slot0 = table[t0 / BS] * BS - t0;
      const int64_t a = std::max(t0, lo), b = std::min(t0 + BS, hi);
      for (int64_t t = a; t < b; ++t) {
        const float* krow = as_float(kp, slot0 + t, row_stride, kbuf, kf);
        for (int64_t h = 0; h < H; ++h) {
          const float v = (ND ? dot16<ND>(qrow + h * D, krow + (h / G) * D) : dot(qrow + h * D, krow + (h / G) * D, D)) * fscale;
          sc[h * n + (t - lo)] = v;
          mx[h] = v > mx[h] ? v : mx[h];
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      float total = 0.f;
      float* sg = sc + h * n;
      const float m = mx[h];
      for (int64_t j = 0; j < n; ++j) {
        sg[j] = std::exp(sg[j] - m);
        total += sg[j];
      }
      sum[h] = total;
    }
    std::fill(ac, ac + H * D, 0.f);
    for (int64_t t0 = lo - lo % BS; t0 < hi; t0 += BS) {
      const int64_t slot0 = table[t0 / BS] * BS - t0;
      const int64_t a = std::max(t0, lo), b = std::min(t0 + BS, hi);
      for (int64_t t = a; t < b; ++t) {
        const float* __restrict vrow = as_float(vp, slot0 + t, row_stride, vbuf, vf);
        for (int64_t h = 0; h < H; ++h) {
          const float p = sc[h * n + (t - lo)];
          const float* __restrict vh = vrow + (h / G) * D;
          float* __restrict ag = ac + h * D;
          if (ND)
            axpy16<ND>(ag, p, vh);
          else
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vh[d];
        }
      }
    }
  };
  auto keys = [&](int64_t r, int64_t* lo, int64_t* hi) {
    const int64_t s = rs[r];
    *hi = cl[s] - ql[s] + (r - qs[s]) + 1;
    *lo = window > 0 ? std::max<int64_t>(0, *hi - window) : 0;
    return s;
  };
  const int64_t threads = at::get_num_threads();
  if (T >= threads) {
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc(H * D), kbuf(row_stride), vbuf(row_stride);
      float mx[128], sum[128];
      for (int64_t r = begin; r < end; ++r) {
        int64_t lo, hi;
        const int64_t s = keys(r, &lo, &hi);
        attend(r, s, lo, hi, mx, sum, acc.data(), scores, kbuf.data(), vbuf.data());
        float* orow = op + r * H * D;
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) orow[h * D + d] = acc[h * D + d] / sum[h];
      }
    });
    return;
  }
  // Fewer rows than threads (one stream decoding): split each row's keys into ranges of at least 128
  // (flash-decoding), one item per (row, range), merged with their maxima: out = sum_j e^(m_j - m) acc_j
  // / sum_j e^(m_j - m) l_j
  const int64_t per_row = (threads + T - 1) / T;  // items beyond a row's splits are empty: keep them few
  std::vector<float> part_m(T * per_row * H), part_l(T * per_row * H), part_acc(T * per_row * H * D);
  std::vector<int64_t> nsplit(T);
  for (int64_t r = 0; r < T; ++r) {
    int64_t lo, hi;
    keys(r, &lo, &hi);
    nsplit[r] = std::max<int64_t>(1, std::min<int64_t>(per_row, (hi - lo) / 128));
  }
  at::parallel_for(0, T * per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, kbuf(row_stride), vbuf(row_stride);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / per_row, j = item % per_row;
      if (j >= nsplit[r]) continue;
      int64_t lo, hi;
      const int64_t s = keys(r, &lo, &hi);
      const int64_t n = hi - lo, a = lo + n * j / nsplit[r], b = lo + n * (j + 1) / nsplit[r];
      attend(r, s, a, b, part_m.data() + item * H, part_l.data() + item * H, part_acc.data() + item * H * D, scores,
             kbuf.data(), vbuf.data());
    }
  });
  for (int64_t r = 0; r < T; ++r) {
    float* orow = op + r * H * D;
    for (int64_t h = 0; h < H; ++h) {
      float m = -std::numeric_limits<float>::max();
      for (int64_t j = 0; j < nsplit[r]; ++j) m = std::max(m, part_m[(r * per_row + j) * H + h]);
      float l = 0.f;
      for (int64_t d = 0; d < D; ++d) orow[h * D + d] = 0.f;
      for (int64_t j = 0; j < nsplit[r]; ++j) {
        const int64_t item = r * per_row + j;
        const float w = std::exp(part_m[item * H + h] - m);
        l += w * part_l[item * H + h];
        const float* pa = part_acc.data() + (item * H + h) * D;
        for (int64_t d = 0; d < D; ++d) orow[h * D + d] += w * pa[d];
      }
      for (int64_t d = 0; d < D; ++d) orow[h * D + d] /= l;
    }
  }
}

// k_scale, v_scale [NB, BS, KVH] bf16 and lut [256] fp32 are given for fp8 pools (stored as uint8).
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor q_start, torch::Tensor q_len,
                     torch::Tensor ctx_len, double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                     c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> lut) {
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: K and V pools must be contiguous and of one dtype");
  const auto dt = k_cache.scalar_type();
  const bool fp8 = dt == torch::kUInt8;
  TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || fp8,
              "paged_attention: the pool must be float32, bfloat16 or fp8 (as uint8)");
  Fp8Pool kf, vf;
  if (fp8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value() && lut.has_value() && lut->numel() == 256 &&
                    k_scale->scalar_type() == torch::kBFloat16 && k_scale->is_contiguous() && v_scale->is_contiguous(),
                "paged_attention: an fp8 pool needs bf16 k_scale / v_scale and a 256-entry lut");
    const int64_t kvh = k_cache.size(2), d = k_cache.size(3);
    kf = Fp8Pool{lut->data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_scale->data_ptr()), kvh, d};
    vf = Fp8Pool{lut->data_ptr<float>(), reinterpret_cast<const uint16_t*>(v_scale->data_ptr()), kvh, d};
  }
  auto run = [&](auto nd) {
    constexpr int ND = decltype(nd)::value;
    if (fp8)
      paged_attention_impl<uint8_t, ND>(out, q, k_cache, v_cache, block_tables, row_seq, q_start, q_len, ctx_len, scale,
                                        window, kf, vf);
    else if (dt == torch::kBFloat16)
      paged_attention_impl<uint16_t, ND>(out, q, k_cache, v_cache, block_tables, row_seq, q_start, q_len, ctx_len, scale,
                                         window, kf, vf);
    else
      paged_attention_impl<float, ND>(out, q, k_cache, v_cache, block_tables, row_seq, q_start, q_len, ctx_len, scale,
                                      window, kf, vf);
  };
  switch (q.size(2)) {
    case 16: run(std::integral_constant<int, 1>{}); break;
    case 32: run(std::integral_constant<int, 2>{}); break;
    case 64: run(std::integral_constant<int, 4>{}); break;
    case 128: run(std::integral_constant<int, 8>{}); break;
    default: run(std::integral_constant<int, 0>{}); break;
  }
}

// silu(gate) * up for gate_up = [gate | up] rows: one pass instead of three (silu, chunk, mul)
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: expects [M, 2 * I]");
  gate_up = gate_up.contiguous();
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gp + m * 2 * I;
      const float* u = g + I;
      float* o = op + m * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// RMSNorm of each row of x, times w. With `residual`: residual += x first (in place), and the
// norm is taken of the sum, the pre-norm residual stream of a decoder layer in one pass.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.size(0) == x.size(1), "rms_norm: expects contiguous [M, N]");
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual must match x");
    rp = residual->data_ptr<float>();
  }
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = xp + m * N;
      if (rp) {
        float* r = rp + m * N;
        for (int64_t i = 0; i < N; ++i) r[i] += src[i];
        src = r;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < N; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / N + static_cast<float>(eps));
      float* o = op + m * N;
      for (int64_t i = 0; i < N; ++i) o[i] = src[i] * inv * wp[i];
    }
  });
  return out;
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

// Index of the first maximum of each row (torch.argmax), one row per task.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "argmax_rows: expects [M, N] with contiguous rows");
  const int64_t M = x.size(0), N = x.size(1);
  auto out = torch::empty({M}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* r = xp + m * x.stride(0);
      float best = r[0];
      int64_t idx = 0;
      for (int64_t i = 1; i < N; ++i)
        if (r[i] > best) {
          best = r[i];
          idx = i;
        }
      op[m] = idx;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mask_rows_", &mask_rows_, "logits[r, t] = -inf where bit t of bitmask[r] is clear, rows in place (fp32, CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, optionally after residual += x (fp32, CPU)");
  m.def("rope_", &rope_, "rotary embedding in place on the leading heads of qkv rows (fp32, CPU)");
  m.def("argmax_rows", &argmax_rows, "first argmax of each row (fp32, CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (fp32, CPU)");
  m.def("paged_attention", &paged_attention, "attention over a paged KV pool (fp32, bf16 or fp8 pool; fp32 math; CPU)");
  m.def("pack_bf16", &pack_bf16, "[O, K] -> bf16 panels [P, K/2, 48, 2] for linear_bf16");
  m.def("linear_bf16", &linear_bf16, "x @ w.T (+ b), w bf16 packed by pack_bf16, x and y fp32 (CPU)");
  m.def("linear_bf16_isa", &linear_bf16_isa, "the instruction set linear_bf16 was compiled for");
  m.def("linear_ggml", &linear_ggml, "x @ w.T (+ b), w in a ggml block format as GGUF stores it, x and y fp32 (CPU)");
  m.def("dequantize_ggml", &dequantize_ggml, "rows of a ggml block format (or repacked) -> fp32 [rows or ids, K]");
  m.def("ggml_repacks", &ggml_repacks, "whether this CPU runs a ggml type repacked into 16-row groups");
  m.def("repack_ggml", &repack_ggml, "[O, row_bytes] -> 16-row groups [ceil(O / 16), K / 32, bytes] (Q4_0 Q4_1 Q8_0)");
  m.def("linear_ggml_isa", &linear_ggml_isa, "the instruction set linear_ggml's integer dot was compiled for");
  m.def("packed_linear", &packed_linear, "x @ w.T (+ b) with w packed in 48-column panels (fp32, CPU)");
}
