// The library's entry points, each defined in its source and registered there with torch's
// dispatcher (torch.ops.loraplex_cpu); bindings.cpp hands the same functions to Python through
// pybind11. Shapes and meanings: kernels/cpu_fused.py and each source's header comment.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace loraplex_ops {

// lora_cpu.cpp: out[t, offsets[i]:] += x[t] . A_s[slot] . B_s[slot] for each segment's tokens;
// paired: the stacks' rows kept in pairs (what pairs_bf16(), true where the build has the
// AVX512-BF16 path, takes)
void add_lora_fused(at::Tensor out, const at::Tensor& x, const at::Tensor& a_t, std::vector<at::Tensor> b_t,
                    std::vector<int64_t> slices, std::vector<int64_t> offsets, const at::Tensor& token_ids,
                    const at::Tensor& segments, bool paired, int64_t tile_rows = 0);
bool pairs_bf16();
bool tiles_bf16();

// pairs_cpu.cpp: one adapter's rows into / out of a slot of paired stacks, every slice at once
void write_paired_slot(at::Tensor a_t, std::vector<at::Tensor> b_t, int64_t slot, std::vector<at::Tensor> a,
                       std::vector<at::Tensor> b);
void read_paired_slot(const at::Tensor& a_t, const std::vector<at::Tensor>& b_t, int64_t slot, int64_t rank,
                      std::vector<at::Tensor> a, std::vector<at::Tensor> b);

// attention_cpu.cpp, prefill_attention_cpu.cpp: attention over the paged KV cache, in place in out
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale);
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& starts, const at::Tensor& query_lens,
                             const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

// layer_cpu.cpp: a decoder layer's small ops
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
at::Tensor rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

// quant_cpu.cpp: products with int4 / int8 weights
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales);

}  // namespace loraplex_ops
