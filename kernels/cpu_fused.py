"""The CPU's fused C++ kernels, built on this machine for this machine, in one library:

  - the multi-LoRA delta as one call per projection (kernels/csrc/lora_cpu.cpp, fused_op());
  - the paged decode attention as one call per step's decode rows (kernels/csrc/attention_cpu.cpp,
    attention_op(): the KV blocks read in place, an online softmax over each row's exact
    context; the torch path gathers the blocks into a padded buffer for a masked SDPA), and
    the prefill attention as one call per step's prefill chunks
    (kernels/csrc/prefill_attention_cpu.cpp, prefill_attention_op(); the torch path calls SDPA
    per chunk);
  - products with int4 / int8 weights on int8 activations (kernels/csrc/quant_cpu.cpp), and a
    decoder layer's RMSNorm, residual add, RoPE and the MLP's silu(gate) * up in one call each
    (kernels/csrc/layer_cpu.cpp):
    layer_ops().

The library is a Python module too (kernels/csrc/bindings.cpp): the functions these hand out are
the ops of torch.ops.loraplex_cpu called through pybind11, not torch's dispatcher (its parsing
of the arguments cost ~1.5-2.5 us of each of a decode step's ~300 calls), and the engine's LoRA
calls go through stacks bound once (bind_stacks). Every one releases the GIL while it runs.

The torch path (kernels/lora_ops.add_lora_cpu) spends ~10 small ops per projection: gathers,
one shrink and one expand product per slice, conversions, the adds back into out. Each op costs
a few microseconds of dispatch and threading whatever its FLOPs, and each reads or writes a
temporary. The fused kernel instead takes blocks of up to 8 tokens of one adapter and does it
all in registers:
  - the shrink for every slice at once;
  - each slice's expand, added into out and rounded once;
  - bf16 weights converted as they load.
Tokens are read and written by index, so a scattered batch needs no gather or scatter.

It is built with torch.utils.cpp_extension (g++ and ninja) with -march=native: the compiler
lowers the kernel's GCC vector types to this CPU's AVX2 or AVX-512, and where the CPU has
AVX512-BF16 (Zen 4, Sapphire Rapids) bf16 on bf16 runs on vdpbf16ps pair dot products: twice the
multiply-adds per instruction, no widening of the activations (1.3-1.7x faster with the stacks
in cache on a 2-core AMD EPYC), on stacks that keep their rows in pairs for it (pairs_bf16(),
kernels/cpu_stacks.py); where it has AMX-BF16 too (Sapphire Rapids), runs of tokens of one
adapter multiply on AMX tiles (tiles_bf16(); 1.6-1.7x faster on prefill than the pair passes on
a 2-core Intel Xeon). So a build serves only the machine it was made on, and the cache key
includes the CPU's flags. `python -m kernels.cpu_fused` builds it (`make run` and `make test`
run it; 16-65 s on 2 cores) into torch's extension cache (~/.cache/torch_extensions, or
$TORCH_EXTENSIONS_DIR). `fused_op()` loads it, building it first
if needed. Without a compiler it returns None and says why (`unavailable_reason()`), and the
torch path serves instead.

Which of the two runs is the engine's matmul plan's choice, measured at start-up: for the LoRA
delta in inference/layers/matmul_plan.py (INFERENCE_LORA_KERNEL forces one), for the decode
attention in inference/layers/attention_plan.py (INFERENCE_ATTENTION_KERNEL).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["ATTENTION_DTYPES", "DTYPES", "PAIRED_DTYPES", "attention_op", "bind_stacks", "fused_op", "layer_ops",
           "pairs_bf16", "prefill_attention_op", "slot_ops", "tiles_bf16", "unavailable_reason", "vector_width"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
# every kernel above, built into one library
SOURCES = [_CSRC / "lora_cpu.cpp", _CSRC / "attention_cpu.cpp", _CSRC / "prefill_attention_cpu.cpp",
           _CSRC / "quant_cpu.cpp", _CSRC / "layer_cpu.cpp", _CSRC / "pairs_cpu.cpp", _CSRC / "bindings.cpp"]
HEADERS = [_CSRC / "ops.h", _CSRC / "cpu_vec.h", _CSRC / "paged_attention.h"]  # what they include: part of the build key too
# -fopenmp: at::parallel_for is inline OpenMP; the library links libgomp.so.1, which resolves to
# the copy torch already loaded (one OpenMP runtime, torch's thread count).
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

# dtypes (the cache's, q's, out's) paged_decode_attention takes, head sizes a multiple of 16 up to
# 256 (the AVX2 build: of 8 up to 128), at most 16 query heads per kv head; others take the torch path
ATTENTION_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

# (activations' dtype, stacks' dtype) the kernel takes; others take the torch path
DTYPES = frozenset({
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32), (torch.float16, torch.float16),
})  # fmt: skip
# ... and on stacks with their rows paired (kernels/cpu_stacks.py), where pairs_bf16()
PAIRED_DTYPES = frozenset({(torch.bfloat16, torch.bfloat16)})

_lock = threading.Lock()
_state: dict[str, object] = {}  # "op": the loaded op, or "error": why there is none


def fused_op() -> Callable[..., None] | None:
    """torch.ops.loraplex_cpu.add_lora_fused, built and loaded on first use; None where it
    cannot be built here (see unavailable_reason)."""
    with _lock:
        if not _state:
            try:
                _state["op"] = _load()
            except Exception as exc:  # noqa: BLE001 (any build failure means: the torch path)
                lines = str(exc).strip().splitlines() or [""]  # a compiler's log: its last line
                _state["error"] = f"{type(exc).__name__}: {lines[-1]}"
                log.warning("fused CPU LoRA kernel unavailable, the torch path serves: %s", _state["error"])
        return _state.get("op")  # type: ignore[return-value]


def bind_stacks(
    a_t: torch.Tensor, b_t: Sequence[torch.Tensor], slices: Sequence[int], offsets: Sequence[int],
    paired: bool = False, tile_rows: int = 0,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """add_lora_fused with its stacks arguments bound once: `bound(out, x, token_ids, segments)`
    does what `add_lora_fused(out, x, a_t, b_t, slices, offsets, token_ids, segments, paired,
    tile_rows)` does, checks included, called straight through pybind11 rather than the
    dispatcher (~0.3 vs ~2.8 us a call). None where fused_op() has not loaded the library; never
    builds."""
    module = _state.get("module")
    if module is None:
        return None
    return module.BoundStacks(a_t, list(b_t), list(slices), list(offsets), paired, tile_rows).add


def slot_ops():
    """The library's write_paired_slot and read_paired_slot (kernels/csrc/pairs_cpu.cpp: an
    adapter's rows into and out of a slot of paired stacks, one call a projection) where
    fused_op() has loaded it, else None; never builds."""
    return _state.get("module")


def tiles_bf16() -> bool:
    """Whether the loaded library multiplies paired bf16 stacks on AMX tiles where asked
    (`tile_rows` > 0): its build has the AMX-BF16 path and Linux let this process use the tiles.
    False where fused_op() has not loaded it; never builds."""
    module = _state.get("module")
    return module is not None and module.tiles_bf16()


def pairs_bf16() -> bool:
    """Whether the loaded library takes paired bf16 stacks (kernels/cpu_stacks.py: its build has
    the AVX512-BF16 path); False where fused_op() has not loaded it; never builds."""
    module = _state.get("module")
    return module is not None and module.pairs_bf16()


def attention_op() -> Callable[..., None] | None:
    """The library's paged_decode_attention (layer_ops()) where fused_op() has loaded it, else
    None; never builds (the per-step check).

    op(out [T, Hq, D], q [T, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
       rows [n], block_tables [n, max_blocks], context_lens [n], scale): out[rows[i]] = the
    decode attention of q[rows[i]] over the first context_lens[i] positions of its blocks."""
    ops = layer_ops()
    return None if ops is None else ops.paged_decode_attention


def prefill_attention_op() -> Callable[..., None] | None:
    """The library's paged_prefill_attention (layer_ops()) where fused_op() has loaded it, else
    None; never builds (the per-step check).

    op(out [T, Hq, D], q [T, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
       starts [n], query_lens [n], block_tables [n, max_blocks], context_lens [n], scale): rows
    starts[i] .. starts[i] + query_lens[i] of out = the causal attention of chunk i's queries
    over the first context_lens[i] positions of its blocks (its cached prefix, then itself)."""
    ops = layer_ops()
    return None if ops is None else ops.paged_prefill_attention


def layer_ops():
    """The library's ops where fused_op() has loaded it, else None; never builds (the per-call
    check): the functions of torch.ops.loraplex_cpu, with the same arguments. Its rms_norm,
    add_rms_norm, rope and silu_mul (kernels/csrc/layer_cpu.cpp) do a decoder layer's small ops
    in one call each; its q4_linear and q8_linear (kernels/csrc/quant_cpu.cpp) multiply
    quantised weights; its paged_decode_attention and paged_prefill_attention: see
    attention_op() and prefill_attention_op()."""
    if "op" not in _state:
        return None
    # the library's Python module: its functions are the dispatcher's ops, called without it
    # (kernels/csrc/bindings.cpp); torch.ops where the library was loaded without one
    return _state.get("module") or torch.ops.loraplex_cpu


def unavailable_reason() -> str | None:
    """Why fused_op() returned None (None: it has not, or it loaded)."""
    return _state.get("error")  # type: ignore[return-value]


def _load() -> Callable[..., None]:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    start = time.perf_counter()
    # a Python module too (csrc/bindings.cpp): its functions (layer_ops()) and BoundStacks
    # (bind_stacks) skip the dispatcher on the hot path
    _state["module"] = cpp_extension.load(
        name=f"loraplex_lora_cpu_{_build_key()}",
        sources=[str(source) for source in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        is_python_module=True,
        verbose=False,
    )
    log.info("fused CPU LoRA kernel ready in %.1f s", time.perf_counter() - start)
    return torch.ops.loraplex_cpu.add_lora_fused


def _build_key() -> str:
    """The source, the flags, torch's version and this CPU's instruction set: a build made for
    another CPU (or another torch) is never loaded."""
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def vector_width() -> int:
    """Floats per vector in a build for this CPU (cpu_vec.h's V): 16 with AVX-512, else 8. The
    attention kernel takes head sizes in multiples of it."""
    return 16 if "avx512f" in _cpu_flags().split() else 8


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() + torch.backends.cpu.get_cpu_capability()


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel puts it in the venv's bin, which is not on
    PATH when the venv's python is run directly."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI wheel: requirements
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def main() -> None:
    """`python -m kernels.cpu_fused`: build (or find) the kernel for this machine; exit 0 either
    way (without a compiler the torch path serves), printing which."""
    start = time.perf_counter()
    op = fused_op()
    if op is None:
        print(f"fused CPU LoRA kernel not built ({unavailable_reason()}); the torch path will serve")
    else:
        print(f"fused CPU LoRA kernel ready ({time.perf_counter() - start:.1f} s)")
    sys.exit(0)


if __name__ == "__main__":
    main()
