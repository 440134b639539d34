// The library's Python module (kernels/cpu_fused.py loads it): each source adds its ops here as
// plain functions, called straight through pybind11. The same ops are registered with torch's
// dispatcher too (torch.ops.loraplex_cpu), whose parsing of the arguments against the schema cost
// ~2.5 us a call; a decode step makes ~300 such calls (a pybind11 call: ~0.3 us). Every binding
// releases the GIL while its kernel runs, as the dispatcher's ops do, so a server thread goes on.
#pragma once

#include <torch/extension.h>

namespace loraplex_bind {

// the GIL released for the call
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

void add_lora_ops(pybind11::module_& m);              // lora_cpu.cpp
void add_attention_ops(pybind11::module_& m);         // attention_cpu.cpp
void add_prefill_attention_ops(pybind11::module_& m);  // prefill_attention_cpu.cpp
void add_layer_ops(pybind11::module_& m);             // layer_cpu.cpp
void add_quant_ops(pybind11::module_& m);             // quant_cpu.cpp

}  // namespace loraplex_bind
