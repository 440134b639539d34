// The library's Python module (kernels/cpu_fused.py loads it): the entry points of ops.h as plain
// functions, called straight through pybind11. The same ops are registered with torch's dispatcher
// too (torch.ops.loraplex_cpu), whose parsing of the arguments against the schema cost ~1.5-2.5
// us a call (a pybind11 call: ~0.3 us), and a decode step makes ~300 such calls. Every function
// releases the GIL while its kernel runs, as the dispatcher's ops do, so a server thread goes on.
// Only this source includes torch/extension.h (pybind11 and Python's headers): the kernels'
// sources build as fast as before.
#include <torch/extension.h>

#include "ops.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace {

using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

// One projection's stacks bound once, for the engine's per-call path from Python
// (kernels/lora_ops.add_lora_cpu_fused): a call then passes only what changes per call. A
// one-token call 8.4 -> 2.7 us with add_lora_cpu's Python checks gone too (2-core AMD EPYC, Zen
// 4); a decode step makes 120 such calls. Every call still runs add_lora_fused's checks on
// everything it reads.
class BoundStacks {
 public:
  BoundStacks(at::Tensor a_t, std::vector<at::Tensor> b_t, std::vector<int64_t> slices, std::vector<int64_t> offsets,
              bool paired, int64_t tile_rows)
      : a_t_(std::move(a_t)),
        b_t_(std::move(b_t)),
        slices_(std::move(slices)),
        offsets_(std::move(offsets)),
        paired_(paired),
        tile_rows_(tile_rows) {}

  void add(at::Tensor out, const at::Tensor& x, const at::Tensor& token_ids, const at::Tensor& segments) const {
    loraplex_ops::add_lora_fused(std::move(out), x, a_t_, b_t_, slices_, offsets_, token_ids, segments,
                                 paired_, tile_rows_);
  }

 private:
  at::Tensor a_t_;
  std::vector<at::Tensor> b_t_;
  std::vector<int64_t> slices_, offsets_;
  bool paired_;
  int64_t tile_rows_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pybind11::literals;
  namespace ops = loraplex_ops;
  pybind11::class_<BoundStacks>(m, "BoundStacks")
      .def(pybind11::init<at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, bool, int64_t>(),
           "a_t"_a, "b_t"_a, "slices"_a, "offsets"_a, "paired"_a = false, "tile_rows"_a = 0)
      .def("add", &BoundStacks::add, "out"_a, "x"_a, "token_ids"_a, "segments"_a, NoGil());
  m.def("pairs_bf16", &ops::pairs_bf16);
  m.def("tiles_bf16", &ops::tiles_bf16);
  m.def("write_paired_slot", &ops::write_paired_slot, "a_t"_a, "b_t"_a, "slot"_a, "a"_a, "b"_a, NoGil());
  m.def("read_paired_slot", &ops::read_paired_slot, "a_t"_a, "b_t"_a, "slot"_a, "rank"_a, "a"_a, "b"_a, NoGil());
  m.def("paged_decode_attention", &ops::paged_decode_attention, "out"_a, "q"_a, "k_cache"_a, "v_cache"_a, "rows"_a,
        "block_tables"_a, "context_lens"_a, "scale"_a, NoGil());
  m.def("paged_prefill_attention", &ops::paged_prefill_attention, "out"_a, "q"_a, "k_cache"_a, "v_cache"_a,
        "starts"_a, "query_lens"_a, "block_tables"_a, "context_lens"_a, "scale"_a, NoGil());
  m.def("rms_norm", &ops::rms_norm, "x"_a, "weight"_a, "eps"_a, NoGil());
  m.def("add_rms_norm", &ops::add_rms_norm, "x"_a, "delta"_a, "weight"_a, "eps"_a, NoGil());
  m.def("rope", &ops::rope, "qkv"_a, "cos"_a, "sin"_a, "heads"_a, NoGil());
  m.def("silu_mul", &ops::silu_mul, "gate_up"_a, NoGil());
  m.def("q4_linear", &ops::q4_linear, "x"_a, "qs"_a, "scales"_a, "mins"_a, NoGil());
  m.def("q8_linear", &ops::q8_linear, "x"_a, "qw"_a, "scales"_a, NoGil());
}
