#pragma once
#include <torch/types.h>

#include <tuple>
#include <vector>

// out[:T] = attention of q's T rows over the paged pool (attention.cpp); k_scale, v_scale [NB, BS, KVH]
// bf16 and lut [256] fp32 (the format's values: e4m3fn's or e5m2's, which the op widens from the bits) are given for
// fp8 pools (stored as uint8); sinks [H] fp32: each head's attention
// sink (a logit in the softmax's denominator with no value: gpt-oss), or none
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor q_start, torch::Tensor q_len,
                     torch::Tensor ctx_len, double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                     c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> lut,
                     c10::optional<torch::Tensor> sinks);

// Rotary embedding (rotate-half) in place on the leading num_heads heads of each qkv row; cos, sin [T, D/2]
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim);

// One layer's attention from its fused qkv rows [T, (H + 2 KVH) D]: rope on q and k (in place), the T new
// K/V rows written to slots of an fp32 or bf16 pool, then the first num_paged rows attended over the pool
// (block tables etc. as paged_attention's, given when num_paged > 0). Returns out [T, H, D]; rows from
// num_paged on are left for the caller (fresh prompts) unless chunk_* describe them (attend_chunks).
torch::Tensor attention_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, int64_t num_paged,
                            c10::optional<torch::Tensor> block_tables, c10::optional<torch::Tensor> row_seq,
                            c10::optional<torch::Tensor> q_start, c10::optional<torch::Tensor> q_len,
                            c10::optional<torch::Tensor> ctx_len, double scale, int64_t window,
                            c10::optional<torch::Tensor> chunk_tables, c10::optional<torch::Tensor> chunk_q_start,
                            c10::optional<torch::Tensor> chunk_q_len, c10::optional<torch::Tensor> chunk_ctx_len,
                            c10::optional<torch::Tensor> chunk_scratch, c10::optional<torch::Tensor> sinks);

// Prefill chunks over a bf16, fp8 or q8_0 / q4_0 pool on bf16 dot products, or over an fp32 pool on fp32 tiles
// (attention_chunks.cpp): chunk i's q_len[i]
// rows from q_start[i] are the last of its ctx_len[i] positions, its keys in the blocks of block_tables[i]; writes
// those rows of out [T, H, D]. scratch: a uint8 tensor the op grows to what it needs and leaves so (pass the
// same one to every layer of a step: its pages are touched once). k_scale, v_scale and lut as paged_attention's
// (fp8 pools only).
void attend_chunks(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor block_tables, torch::Tensor q_start, torch::Tensor q_len, torch::Tensor ctx_len,
                   double scale, int64_t window, torch::Tensor scratch, c10::optional<torch::Tensor> sinks,
                   c10::optional<torch::Tensor> k_scale = c10::nullopt,
                   c10::optional<torch::Tensor> v_scale = c10::nullopt,
                   c10::optional<torch::Tensor> lut = c10::nullopt);

// Keys [0, P) of one KV head that the rows of several sequences share (the same blocks in their tables),
// gathered once (attention_chunks.cpp) into a buffer of shared_keys_bytes: K rows [P + 32, D], V as key pairs
// [D, ldv]. P even.
struct SharedKeys {
  const uint16_t* k;
  const uint32_t* v;
  int64_t P, ldv;
};
int64_t shared_keys_bytes(int64_t P, int64_t D);
SharedKeys gather_shared_keys(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const int64_t* table,
                              int64_t kh, int64_t P, void* buf);
// The floats of scratch attend_shared needs
int64_t shared_work_floats(int64_t P, int64_t D);
// n <= 48 / G query rows (q row indices rows[0 : n], q_stride floats apart, heads contiguous) over the shared
// keys, the G heads of KV head kh, as the chunk kernel computes: per (row i, head h) at [i * H + h], the max
// over these keys and floor (its other keys' max) into mx, the sum of p = exp(s - mx) into sum, and the V sum
// of p (unnormalized) into out's row rows[i] ([rows, H, D])
void attend_shared(const SharedKeys& sk, int64_t kh, const int64_t* rows, int64_t n, int64_t H, int64_t G, int64_t D,
                   const float* q, int64_t q_stride, float scale, const float* floor, float* mx, float* sum, float* out,
                   float* work);

// The groups paged_attention forms over a bf16 pool (rows whose sequences share leading blocks): per group
// (P, its rows), P = the keys attended once for all of them; heads_per_kv = H / KVH
std::vector<std::tuple<int64_t, std::vector<int64_t>>> shared_prefix_groups(
    torch::Tensor block_tables, torch::Tensor row_seq, torch::Tensor q_len, torch::Tensor ctx_len,
    int64_t block_size, int64_t heads_per_kv);
