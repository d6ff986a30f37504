// K/V rows written into a paged pool of llama.cpp's integer cache types, or of fp8, quantized on the way in.
//
// Layout: x [T, KVH, D] fp32 (rows x.stride(0) floats apart, heads contiguous; D a multiple of 32), the pool
// [NB, BS, KVH, D / 32 x bytes] uint8, its row length saying the format: q8_0 (34 bytes a block of 32 values:
// an fp16 scale d, 32 int8 q, x = d q) or q4_0 (18: d, 16 bytes whose low nibbles hold values 0-15 of the
// block and high nibbles 16-31, x = d (n - 8)). Row t goes to slot slots[t] = block * BS + offset. An fp8 pool is
// [NB, BS, KVH, D] bytes (e4m3fn or e5m2) with a bf16 scale per slot and KV head beside it ([NB, BS, KVH]): x = q s.
//
// The quantizers are ggml's reference ones (quantize_row_q8_0_ref / quantize_row_q4_0_ref) and give the bytes
// kv_quant.quantize_int gives, bit for bit: the scale's divisions and the products that round to the grid are
// scalar SSE instructions (builtins the compiler cannot reassociate or contract under -ffast-math), q4_0's
// x / d + 8.5 in double (the product of two floats is exact there). fp8 heads are kv_quant.quantize's bytes, bit for
// bit, with c10's roundings (torch's own). ISA: scalar; x86's SSE for those steps,
// plain C++ elsewhere (where -ffast-math may move the last bit of a scale).
#include "kv_quant.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

inline float div_exact(float a, float b) {
#if defined(__SSE2__)
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));
#else
  return a / b;
#endif
}

inline float mul_exact(float a, float b) {
#if defined(__SSE2__)
  return _mm_cvtss_f32(_mm_mul_ss(_mm_set_ss(a), _mm_set_ss(b)));
#else
  return a * b;
#endif
}

inline float add_exact(float a, float b) {
#if defined(__SSE2__)
  return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(a), _mm_set_ss(b)));
#else
  return a + b;
#endif
}

inline void put_scale(uint8_t* blk, float d) {
  const uint16_t h = c10::Half(d).x;  // round to nearest even, as torch's .to(float16)
  std::memcpy(blk, &h, sizeof(h));
}

void quantize_q8_0(const float* x, uint8_t* blk) {  // 32 values -> 34 bytes
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = div_exact(amax, 127.f), id = d != 0.f ? div_exact(1.f, d) : 0.f;
  put_scale(blk, d);
  for (int i = 0; i < 32; ++i) {
    const float v = mul_exact(x[i], id);
    const float r = std::floor(add_exact(std::fabs(v), 0.5f));  // round half away from zero
    blk[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(v < 0.f ? -r : r)));
  }
}

void quantize_q4_0(const float* x, uint8_t* blk) {  // 32 values -> 18 bytes
  float amax = 0.f, mx = 0.f;  // the value of largest magnitude, the first of them
  for (int i = 0; i < 32; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      mx = x[i];
    }
  const float d = div_exact(mx, -8.f), id = d != 0.f ? div_exact(1.f, d) : 0.f;
  put_scale(blk, d);
  uint8_t n[32];
  for (int i = 0; i < 32; ++i) {
    const double v = std::trunc(static_cast<double>(x[i]) * static_cast<double>(id) + 8.5);
    n[i] = static_cast<uint8_t>(std::min(v, 15.0));
  }
  for (int i = 0; i < 16; ++i) blk[2 + i] = static_cast<uint8_t>(n[i] | (n[i + 16] << 4));
}

inline bool is_nan(float f) {  // by its bits: -ffast-math may fold f != f away
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return (u & 0x7fffffffu) > 0x7f800000u;
}

// One head of D values -> D fp8 bytes and its bf16 scale, as kv_quant.quantize gives them: scale =
// bf16(max(amax / fmax, 1e-30)), q = fp8(clamp(x / scale, -fmax, fmax)), by c10's conversions (torch's .to(): round
// to nearest even). A NaN in the head makes its scale and bytes NaN, as torch's amax does (0xFFFF and 0xFF: the bits
// torch gave on the hosts tested)
template <class F8>
void quantize_fp8(const float* x, int64_t D, float fmax, uint8_t* q, uint16_t* scale) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t d = 0; d < D; ++d) {
    nan = nan || is_nan(x[d]);
    amax = std::max(amax, std::fabs(x[d]));
  }
  if (nan) {
    *scale = 0xFFFF;
    std::memset(q, 0xFF, D);
    return;
  }
  const c10::BFloat16 sb(std::max(div_exact(amax, fmax), 1e-30f));
  *scale = sb.x;
  const float sf = static_cast<float>(sb);
  for (int64_t d = 0; d < D; ++d) {
    const float v = div_exact(x[d], sf);
    q[d] = F8(is_nan(v) ? v : std::min(std::max(v, -fmax), fmax)).x;
  }
}

// The checks both writers make: op's pool [NB, BS, KVH, row] uint8, x [T, KVH, D] fp32, one slot in the pool a row
void check_rows(const char* op, const torch::Tensor& pool, const torch::Tensor& slots, const torch::Tensor& x) {
  TORCH_CHECK(pool.scalar_type() == torch::kUInt8 && pool.dim() == 4 && pool.is_contiguous(), op,
              ": the pool must be contiguous uint8 [NB, BS, KVH, row]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), op,
              ": x must be fp32 [T, KVH, D] with contiguous heads");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.is_contiguous() && slots.numel() == x.size(0), op,
              ": one int64 slot per row of x");
  TORCH_CHECK(pool.size(2) == x.size(1), op, ": the pool and x have different KV heads");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = pool.size(0) * pool.size(1);
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, op, ": slot ", sp[t], " is outside the pool");
}

}  // namespace

void quantize_fp8_kv_(torch::Tensor pool, torch::Tensor scales, torch::Tensor slots, torch::Tensor x, bool e5m2) {
  check_rows("quantize_fp8_kv_", pool, slots, x);
  const int64_t T = x.size(0), KVH = x.size(1), D = x.size(2);
  TORCH_CHECK(pool.size(3) == D, "quantize_fp8_kv_: the pool's rows must be x's heads");
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.is_contiguous() &&
                  scales.numel() == pool.size(0) * pool.size(1) * KVH,
              "quantize_fp8_kv_: scales must be contiguous bf16 [NB, BS, KVH]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  uint8_t* pp = pool.data_ptr<uint8_t>();
  uint16_t* scp = reinterpret_cast<uint16_t*>(scales.data_ptr());
  at::parallel_for(0, T * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / KVH, kh = i % KVH, row = sp[t] * KVH + kh;
      const float* src = xp + t * x.stride(0) + kh * D;
      if (e5m2)
        quantize_fp8<c10::Float8_e5m2>(src, D, 57344.f, pp + row * D, scp + row);
      else
        quantize_fp8<c10::Float8_e4m3fn>(src, D, 448.f, pp + row * D, scp + row);
    }
  });
}

void quantize_kv_(torch::Tensor pool, torch::Tensor slots, torch::Tensor x) {
  check_rows("quantize_kv_", pool, slots, x);
  const int64_t T = x.size(0), KVH = x.size(1), D = x.size(2), row = pool.size(3);
  TORCH_CHECK(D % 32 == 0 && (row == D / 32 * 34 || row == D / 32 * 18),
              "quantize_kv_: the pool's rows must be q8_0 or q4_0 blocks of x's heads");
  const bool q8 = row == D / 32 * 34;
  const int64_t bytes = q8 ? 34 : 18;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  uint8_t* pp = pool.data_ptr<uint8_t>();
  at::parallel_for(0, T * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / KVH, kh = i % KVH;
      const float* src = xp + t * x.stride(0) + kh * D;
      uint8_t* dst = pp + (sp[t] * KVH + kh) * row;
      for (int64_t b = 0; b < D / 32; ++b)
        q8 ? quantize_q8_0(src + 32 * b, dst + b * bytes) : quantize_q4_0(src + 32 * b, dst + b * bytes);
    }
  });
}

