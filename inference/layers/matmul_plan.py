"""Which matmul formulation is fastest on this CPU, measured at start-up, per shape class.

CPUs disagree by 4-8x in both directions. Without bf16 units (AVX2 only) torch's bf16 GEMM
crawls (~1.2 GFLOP/s measured) and an fp32 product wins; with AVX512-BF16 or AMX, oneDNN's bf16
kernels beat fp32 by up to 4x on prefill-sized products. So nothing is hard-coded: the engine
times the candidates on the model's own projection shapes when it starts (tens to hundreds of
milliseconds) and every Linear follows the plan:

    native       F.linear in the model dtype (bf16 straight into oneDNN where it has kernels)
    fp32-upcast  x upcast once, the weight upcast a slab at a time (the slab stays in cache
                 for its GEMM, so memory traffic stays that of bf16), one rounding at the end
    fp32-cached  x upcast, against an fp32 copy of the weight kept beside it (twice the weight
                 memory; only chosen when it wins and the copy fits, see FP32_CACHE_MAX_SHARE)

per shape class of the product's row count T (native timed on the plain weights and, where the
dense weights may then be prepacked for oneDNN (dense_layout.py), on packed ones too: it counts
at the faster layout, and a class that wins only packed makes the engine pack):

    decode   T <= 4         a few streams decoding: bound by reading the weight once
    batch    5 <= T < 64    batched decode
    prefill  T >= 64        prefill chunks

and, for the LoRA delta (kernels/lora_ops.py), the dtype its stacked A/B are kept and
multiplied in: the model dtype, or fp32 (converted once at slot fill, not per step); and the
kernel that computes it: torch ops, or the fused C++ kernel built for this CPU
(kernels/cpu_fused.py), timed against each other on the model's projections where it builds
(`--lora-kernel`, env INFERENCE_LORA_KERNEL, forces one). Where the fused kernel wins on bf16
stacks and the CPU has AMX (kernels/cpu_stacks.py: tiles), "amx" is that kernel with every run
of at least `lora_tile_rows` tokens of one adapter multiplied on AMX tiles, the threshold timed
too: tiles won 1.6-1.7x on prefill and lost 0.7-0.9x at 1-2 tokens an adapter (2-core Intel
Xeon with AMX).

fp32 models, and CUDA, have nothing to choose: every class is native. `--matmul-path` (env
INFERENCE_MATMUL_PATH) forces one path for every class (tests run the oracles under each).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from inference.layers.onednn_weight import OneDnnWeight, packing_unavailable
from kernels import cpu_fused
from kernels.cpu_stacks import CpuStacks, cpu_stacks, pairs_rows
from kernels.lora_ops import add_lora_cpu
from kernels.metadata import build_lora_metadata

NATIVE, FP32_UPCAST, FP32_CACHED = "native", "fp32-upcast", "fp32-cached"
PATHS = (NATIVE, FP32_UPCAST, FP32_CACHED)
# native on weights prepacked for oneDNN (inference/layers/dense_layout.py): timed beside plain
# native where packing may follow, since that is the layout native products would then run on
NATIVE_PACKED = "native-onednn"
MATMUL_PATH_CHOICES = ("auto", *PATHS)
TORCH_KERNEL, FUSED_KERNEL, AMX_KERNEL = "torch", "fused", "amx"  # the CPU's LoRA kernels (CUDA runs Triton's)
FUSED_KERNELS = (FUSED_KERNEL, AMX_KERNEL)  # the C++ kernel: "amx" puts runs of tokens on tiles
LORA_KERNEL_CHOICES = ("auto", FUSED_KERNEL, AMX_KERNEL, TORCH_KERNEL)
# Tokens of one adapter the tile products are timed at, from the most down (see _tile_rows)
TILE_ROWS_TIMED = (16, 8, 4, 2, 1)
SHAPE_CLASSES = ("decode", "batch", "prefill")
BATCH_MIN_ROWS = 5
PREFILL_MIN_ROWS = 64
# Rows timed for each class: a typical member; prefill at its smallest, because on an AVX2 CPU
# one bf16 prefill product of the layer takes ~0.1 s (calibration must stay short).
CLASS_ROWS = {"decode": 1, "batch": 16, "prefill": 64}
UPCAST_SLAB_ROWS = 512
# fp32-cached copies every projection's weight at 4 bytes a parameter; auto mode takes it only
# while the copy stays under this share of the memory available at start-up.
FP32_CACHE_MAX_SHARE = 0.25
# Timing: ROUNDS interleaved rounds; a fast candidate repeats within a round up to
# ROUND_SECONDS; one slower than GIVE_UP_FACTOR x the best after two rounds is not timed again.
ROUNDS = 5
# Another path replaces the one picked so far only when it takes under this share of its time:
# fp32 paths convert on every call, and fp32-cached doubles the weights' memory, so it must win
# clearly (a one-row product is ~0.1 ms, where a busy start-up alone makes 15% differences).
SWITCH_FACTOR = {FP32_UPCAST: 0.9, FP32_CACHED: 0.75}
ROUND_SECONDS = 0.002
GIVE_UP_FACTOR = 3.0
# The LoRA race's decode stacks in all (at fp32): past the caches, as the engine's are; bounds
# the race's memory and time on large models (see _lora_delta).
LORA_RACE_BYTES = 64 << 20


@dataclass(frozen=True)
class MatmulPlan:
    """The path per shape class, the LoRA dtype, and how they were chosen (for logs, /v1/base_model,
    the metrics)."""

    paths: dict[str, str]  # shape class -> path
    lora_dtype: torch.dtype  # the LoRA stacks' dtype and compute dtype
    source: str  # "measured", "forced" or "fixed" (fp32 model, CUDA: nothing to choose)
    # shape class -> path -> best seconds for the class's products (the LoRA class: dtype name;
    # "lora_kernel": kernel name)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    lora_kernel: str = TORCH_KERNEL  # "torch", "fused" or "amx" on the CPU, "triton" on CUDA
    # "amx": runs of at least this many tokens of one adapter multiply on AMX tiles (else 0)
    lora_tile_rows: int = 0
    # how decode rows attend on the CPU: "torch" or "fused" (inference/layers/attention_plan.py)
    attention_kernel: str = TORCH_KERNEL
    # how prefill chunks attend on the CPU: "torch" or "fused" (inference/layers/attention_plan.py)
    prefill_attention_kernel: str = TORCH_KERNEL
    # what multiplies quantised weights (--weights-dtype int8/int4): "torch" or "fused"
    # (inference/layers/quant_plan.py)
    quant_kernel: str = TORCH_KERNEL
    # how dense bf16/fp16 weights lie on the CPU: "plain" or "onednn" (prepacked;
    # inference/layers/dense_layout.py)
    dense_layout: str = "plain"

    def __post_init__(self) -> None:
        # path by row count as a tuple, for the per-call lookup in Linear.forward
        object.__setattr__(self, "_by_class", tuple(self.paths[c] for c in SHAPE_CLASSES))

    def path_for(self, rows: int) -> str:
        return self._by_class[0 if rows < BATCH_MIN_ROWS else 1 if rows < PREFILL_MIN_ROWS else 2]

    @property
    def caches_fp32(self) -> bool:
        return FP32_CACHED in self.paths.values()

    def describe(self) -> dict:
        """JSON-ready: what /v1/base_model shows and the start-up log line prints."""
        return {
            "source": self.source,
            "paths": dict(self.paths),
            "lora_dtype": str(self.lora_dtype).removeprefix("torch."),
            "lora_kernel": self.lora_kernel,
            "lora_tile_rows": self.lora_tile_rows,
            "attention_kernel": self.attention_kernel,
            "prefill_attention_kernel": self.prefill_attention_kernel,
            "quant_kernel": self.quant_kernel,
            "dense_layout": self.dense_layout,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "timings_us": {c: {p: round(s * 1e6, 1) for p, s in t.items()} for c, t in self.timings.items()},
        }


def native_plan(dtype: torch.dtype, source: str = "fixed") -> MatmulPlan:
    return MatmulPlan({c: NATIVE for c in SHAPE_CLASSES}, dtype, source)


def capability_plan() -> MatmulPlan:
    """The plan before anything is measured (a Linear built outside the engine): native where
    oneDNN has bf16 kernels (AVX512-BF16, AMX), else fp32 slabs from BATCH_MIN_ROWS rows on."""
    try:
        bf16_units = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16_units = False
    if bf16_units:
        return native_plan(torch.float32)
    return MatmulPlan({"decode": NATIVE, "batch": FP32_UPCAST, "prefill": FP32_UPCAST}, torch.float32, "fixed")


def forced_plan(path: str, dtype: torch.dtype) -> MatmulPlan:
    """Every class on one path; LoRA in fp32 unless the path is native."""
    if path not in PATHS:
        raise ValueError(f"matmul path must be one of {', '.join(PATHS)}, got {path!r}")
    if dtype == torch.float32:
        return native_plan(dtype, "fixed")
    return MatmulPlan({c: path for c in SHAPE_CLASSES}, dtype if path == NATIVE else torch.float32, "forced")


def choose_plan(
    model: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    requested: str = "auto",
    max_rows: int = CLASS_ROWS["prefill"],
    lora_kernel: str = TORCH_KERNEL,
    may_pack: bool = False,
) -> MatmulPlan:
    """The plan for this model on this machine: forced, fixed, or measured (see module doc);
    `lora_kernel` (LORA_KERNEL_CHOICES) picks the CPU's LoRA kernel (with_lora_kernel).
    `may_pack`: the dense weights may be prepacked for oneDNN afterwards (the dense layout is
    not forced plain), so native is timed on packed weights too where this CPU packs them."""
    if device.type != "cpu":
        return replace(native_plan(dtype), lora_kernel="triton")
    weights, projections = _sample_weights(model), _lora_projections(model)
    copies = _lora_race_copies(model, projections)
    if dtype == torch.float32 or any(w.numel() == 0 for w in weights):
        # fp32 has nothing to choose; quantised projections (--weights-dtype) run their own kernels
        plan = native_plan(dtype)
    elif requested != "auto":
        plan = forced_plan(requested, dtype)
    else:
        plan = calibrate(weights, dtype, max_rows=max_rows, allow_cache=_fp32_copy_fits(model),
                         lora_projections=projections, lora_copies=copies,
                         packed_native=may_pack and packing_unavailable(dtype) is None)  # fmt: skip
    return with_lora_kernel(plan, lora_kernel, projections, dtype, copies=copies)


def with_lora_kernel(
    plan: MatmulPlan, requested: str, projections: list[tuple[int, list[int]]], dtype: torch.dtype,
    rank: int = 16, copies: int = 1,
) -> MatmulPlan:
    """`plan` with its CPU LoRA kernel: "torch"; "fused" (RuntimeError where it cannot be built
    here, the reason given); "amx" (the fused kernel with every run of tokens on AMX tiles, on
    bf16 stacks: RuntimeError where this CPU or its OS has no tiles, or the model is not bf16);
    or "auto": the faster of torch and fused on `projections` (in_features, output slices) with
    x in `dtype` and the stacks in the plan's LoRA dtype, and the fused one with model-dtype
    stacks too (taking that dtype when it wins), then amx where it wins from some run length
    (_with_tiles); torch where the fused kernel cannot be built (its first build here takes
    ~15-35 s, then it is cached). `copies`: see _lora_delta."""
    if requested not in LORA_KERNEL_CHOICES:
        raise ValueError(f"lora kernel must be one of {', '.join(LORA_KERNEL_CHOICES)}, got {requested!r}")
    if requested == TORCH_KERNEL:
        return replace(plan, lora_kernel=TORCH_KERNEL)
    op = cpu_fused.fused_op()
    if requested in FUSED_KERNELS and op is None:
        raise RuntimeError(f"lora kernel {requested}: cannot be built here ({cpu_fused.unavailable_reason()})")
    if requested == FUSED_KERNEL:
        return replace(plan, lora_kernel=FUSED_KERNEL)
    if requested == AMX_KERNEL:
        if not cpu_fused.tiles_bf16():
            raise RuntimeError("lora kernel amx: no AMX-BF16 tiles here (the CPU lacks them, or the OS refused them)")
        if dtype != torch.bfloat16:
            raise RuntimeError(f"lora kernel amx: takes a bfloat16 model, not {str(dtype).removeprefix('torch.')}")
        return replace(plan, lora_kernel=AMX_KERNEL, lora_dtype=dtype, lora_tile_rows=1)
    if op is None or (dtype, plan.lora_dtype) not in cpu_fused.DTYPES:
        return replace(plan, lora_kernel=TORCH_KERNEL)
    candidates = {kernel: _lora_delta(projections, dtype, plan.lora_dtype, rank, kernel, copies)
                  for kernel in (TORCH_KERNEL, FUSED_KERNEL)}  # fmt: skip
    # The fused kernel widens model-dtype weights in registers, under fp32 products too, so
    # model-dtype stacks (half fp32's bytes, read every step) are a candidate even where the
    # plan kept fp32 stacks for the torch path's sake.
    narrow = f"{FUSED_KERNEL}-{str(dtype).removeprefix('torch.')}"
    if plan.lora_dtype != dtype and {(dtype, dtype), (torch.float32, dtype)} <= cpu_fused.DTYPES:
        candidates[narrow] = _lora_delta(projections, dtype, dtype, rank, FUSED_KERNEL, copies)
    seconds = race(candidates)
    best = min(seconds, key=seconds.get)
    timings = {**plan.timings, "lora_kernel": seconds}
    lora_dtype = dtype if best == narrow else plan.lora_dtype
    kernel = FUSED_KERNEL if best == narrow else best
    return _with_tiles(replace(plan, lora_kernel=kernel, lora_dtype=lora_dtype, timings=timings), projections, rank)


def _with_tiles(plan: MatmulPlan, projections: list[tuple[int, list[int]]], rank: int) -> MatmulPlan:
    """`plan` as is, or, where its fused kernel runs on bf16 stacks that would be paired and the
    library has AMX tiles, "amx" from the fewest tokens of one adapter at which the tiles win
    (_tile_rows), when they win at all."""
    tiled = [(in_features, sizes) for in_features, sizes in projections
             if pairs_rows(plan.lora_dtype, in_features, rank)]  # fmt: skip
    if plan.lora_kernel != FUSED_KERNEL or not tiled or not cpu_fused.tiles_bf16():
        return plan
    rows, seconds = _tile_rows(tiled, rank)
    timings = {**plan.timings, "lora_tile_rows": seconds}
    if not rows:
        return replace(plan, timings=timings)
    return replace(plan, lora_kernel=AMX_KERNEL, lora_tile_rows=rows, timings=timings)


def _tile_rows(projections: list[tuple[int, list[int]]], rank: int) -> tuple[int, dict[str, float]]:
    """(the fewest tokens of one adapter from which the fused kernel's AMX tile products beat its
    vdpbf16ps passes, 0 where they lose at TILE_ROWS_TIMED's most; the timings): 8 adapters'
    runs of each length in TILE_ROWS_TIMED, most first, until the tiles lose. A tile multiply
    costs about the same at 1 row as at 16, so they win on prefill chunks and lose on a few
    tokens an adapter."""
    timings: dict[str, float] = {}
    rows_won, slots = 0, 8
    stacks = [_race_stacks(slots, rank, in_features, sizes, torch.bfloat16, True) for in_features, sizes in projections]
    for rows in TILE_ROWS_TIMED:
        seconds = race({"pairs": _tile_delta(stacks, rank, rows, 0), "tiles": _tile_delta(stacks, rank, rows, 1)})
        timings[f"pairs@{rows}"], timings[f"tiles@{rows}"] = seconds["pairs"], seconds["tiles"]
        if seconds["tiles"] >= seconds["pairs"]:
            break
        rows_won = rows
    return rows_won, timings


def _tile_delta(stacks: list[CpuStacks], rank: int, rows: int, tile_rows: int) -> Callable[[], object]:
    """The fused kernel on `stacks` (paired bf16) with `rows` tokens of each slot, interleaved as
    a decode batch's are, `tile_rows` as CpuStacks takes it."""
    slots = stacks[0].max_loras
    meta = build_lora_metadata(torch.arange(slots * rows) % slots, torch.full((slots,), rank))
    calls = []
    for s in stacks:
        x = torch.randn(meta.num_tokens, s.in_features).to(torch.bfloat16)
        out = torch.zeros(meta.num_tokens, s.out_features, dtype=torch.bfloat16)
        calls.append((out, x, replace(s, tile_rows=tile_rows), meta, FUSED_KERNEL))
    return lambda: [add_lora_cpu(*call) for call in calls]


def calibrate(
    weights: list[torch.Tensor], dtype: torch.dtype, *, max_rows: int = CLASS_ROWS["prefill"],
    allow_cache: bool = True, lora_projections: list[tuple[int, list[int]]] | None = None,
    lora_rank: int = 16, lora_copies: int = 1, packed_native: bool = False,
) -> MatmulPlan:
    """Time each path on `weights` (the model's projection weights [out, in], in `dtype`) for each
    shape class; the fastest wins. The LoRA delta is timed on `lora_projections` (in_features,
    output slices; default: each weight as one slice). Timings are best-of-N so a busy machine
    slows all alike. `packed_native`: native is also timed on the weights prepacked for oneDNN
    (NATIVE_PACKED), and counts at the faster of its two layouts."""
    lora_projections = lora_projections or [(w.shape[1], [w.shape[0]]) for w in weights]
    cached = [w.float() for w in weights] if allow_cache else []
    packed = [OneDnnWeight(w) for w in weights] if packed_native else []
    paths, timings = {}, {}
    for cls, rows in CLASS_ROWS.items():
        rows = min(rows, max_rows)
        xs = [torch.randn(rows, w.shape[1]).to(dtype) for w in weights]
        candidates: dict[str, Callable[[], object]] = {
            NATIVE: lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
            FP32_UPCAST: lambda xs=xs: [linear_fp32(x.float(), w, None) for x, w in zip(xs, weights, strict=True)],
        }
        if allow_cache:
            candidates[FP32_CACHED] = lambda xs=xs: [F.linear(x.float(), w) for x, w in zip(xs, cached, strict=True)]
        if packed:
            candidates[NATIVE_PACKED] = lambda xs=xs: [w.linear(x) for x, w in zip(xs, packed, strict=True)]
        timings[cls] = race(candidates)
        paths[cls] = _winner(timings[cls])
    # The LoRA stacks take the model dtype only where every product is native and that measures
    # faster; an fp32 product would have to upcast them every step.
    timings["lora"] = race({str(d).removeprefix("torch."): _lora_delta(lora_projections, dtype, d, lora_rank,
                                                                       copies=lora_copies)
                             for d in (dtype, torch.float32)})  # fmt: skip
    native_lora = timings["lora"][str(dtype).removeprefix("torch.")] <= timings["lora"]["float32"]
    lora_dtype = dtype if native_lora and set(paths.values()) == {NATIVE} else torch.float32
    return MatmulPlan(paths, lora_dtype, "measured", timings)


def _winner(seconds: dict[str, float]) -> str:
    """native (at the faster of its layouts, where packed was timed) unless a path in PATHS order
    measures under its SWITCH_FACTOR x the pick so far, so a near tie (or noise) keeps the
    simpler, smaller path."""
    pick, best = NATIVE, min(seconds[NATIVE], seconds.get(NATIVE_PACKED, float("inf")))
    for path in PATHS[1:]:
        if path in seconds and seconds[path] < SWITCH_FACTOR[path] * best:
            pick, best = path, seconds[path]
    return pick


def native_needs_packing(plan: MatmulPlan) -> bool:
    """Whether a shape class runs natively only because native was timed on packed weights: with
    the plain layout that class would have taken an fp32 path, so the weights must be packed."""
    for cls, path in plan.paths.items():
        seconds = plan.timings.get(cls, {})
        if path == NATIVE and NATIVE_PACKED in seconds:
            if _winner({p: s for p, s in seconds.items() if p != NATIVE_PACKED}) != NATIVE:
                return True
    return False


def linear_fp32(
    x32: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight32: torch.Tensor | None = None
) -> torch.Tensor:
    """x32 [T, in] fp32 @ weight.T -> [T, out] fp32, unrounded. With `weight32` (the fp32 copy) one
    GEMM; else the weight is upcast UPCAST_SLAB_ROWS output rows at a time."""
    if weight32 is not None:
        return F.linear(x32, weight32, None if bias is None else bias.float())
    out = x32.new_empty(x32.shape[0], weight.shape[0])  # [T, out] fp32
    for i in range(0, weight.shape[0], UPCAST_SLAB_ROWS):
        slab = weight[i : i + UPCAST_SLAB_ROWS].float()  # [rows, in]
        torch.matmul(x32, slab.t(), out=out[:, i : i + UPCAST_SLAB_ROWS])
    if bias is not None:
        out += bias
    return out


def _lora_delta(
    projections: list[tuple[int, list[int]]], x_dtype: torch.dtype, stack_dtype: torch.dtype, rank: int,
    kernel: str = TORCH_KERNEL, copies: int = 1,
) -> Callable[[], object]:
    """The engine's own LoRA delta (kernels.lora_ops.add_lora_cpu with `kernel`) on the model's
    projections (in_features, output slices), added into their output in `x_dtype`: 16 decode
    tokens over 4 adapters (the padded batch) and a 256-token prefill chunk of one adapter, the
    stacks in `stack_dtype` (fp32 stacks under bf16 activations convert x and out per call).
    The decode step runs over `copies` distinct stacks per projection, as the engine's decode
    step runs over every layer's: there they come from memory each step, so fp32 stacks (twice
    the bytes) cost up to twice what one copy, in cache, shows (2-core Xeon: fused kernel 8.0 ms
    a step on bf16 stacks, 11.3 on fp32, where one copy in cache timed them 430 vs 416 us)."""
    slots = 4
    decode = build_lora_metadata(torch.arange(16) // 4, torch.full((slots,), rank))
    prefill = build_lora_metadata(torch.zeros(256, dtype=torch.long), torch.full((slots,), rank))
    calls = []
    for in_features, sizes in projections:
        # in the layout the engine's stacks take for this kernel (LoRALinear.create_slots)
        paired = kernel == FUSED_KERNEL and pairs_rows(stack_dtype, in_features, rank)
        stacks = [_race_stacks(slots, rank, in_features, sizes, stack_dtype, paired) for _ in range(max(1, copies))]
        for meta, used in ((decode, stacks), (prefill, stacks[:1])):
            x = torch.randn(meta.num_tokens, in_features).to(x_dtype)
            out = torch.zeros(meta.num_tokens, sum(sizes), dtype=x_dtype)
            calls += [(out, x, s, meta, kernel) for s in used]
    return lambda: [add_lora_cpu(*call) for call in calls]


def _race_stacks(
    slots: int, rank: int, in_features: int, sizes: list[int], dtype: torch.dtype, paired: bool
) -> CpuStacks:
    stacks, _, _ = cpu_stacks(slots, rank, in_features, sizes, dtype, paired)
    stacks.a_t.normal_(std=0.01)
    for bt in stacks.b_t:
        bt.normal_(std=0.01)
    return stacks


def _lora_race_copies(model: torch.nn.Module, projections: list[tuple[int, list[int]]], rank: int = 16) -> int:
    """How many layers' stacks the LoRA race's decode step reads: the model's layer count, up
    to LORA_RACE_BYTES of fp32 stacks over 4 slots."""
    per_layer = sum(4 * rank * (in_features * len(sizes) + sum(sizes)) * 4 for in_features, sizes in projections)
    return max(1, min(len(model.layers), LORA_RACE_BYTES // max(1, per_layer)))


def race(candidates: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> dict[str, float]:
    """Best seconds per call of each candidate over interleaved rounds (after one warm-up call,
    which also builds oneDNN's primitives for the shape). A round of a fast candidate repeats
    it up to ROUND_SECONDS; one still GIVE_UP_FACTOR x slower than the best after two rounds
    sits out the rest. Best-of-rounds: a machine busy with other work slows every candidate,
    and the minimum is the figure least touched by it."""
    best: dict[str, float] = {}
    for fn in candidates.values():
        fn()
    for i in range(rounds):
        fastest = min(best.values(), default=float("inf"))
        for name, fn in candidates.items():
            if i >= 2 and best[name] > GIVE_UP_FACTOR * fastest:
                continue
            best[name] = min(best.get(name, float("inf")), _seconds_per_call(fn))
    return best


def _seconds_per_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    repeats = min(int(ROUND_SECONDS / max(first, 1e-6)), 20)
    if repeats < 2:
        return first
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return min(first, (time.perf_counter() - start) / repeats)


def _sample_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Two of the first layer's weights, in its dtype: a projection from the hidden size
    (qkv_proj) and the one into it (down_proj), the two inner dimensions the step multiplies."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    return [attn.qkv_proj.weight, mlp.down_proj.weight]


def _lora_projections(model: torch.nn.Module) -> list[tuple[int, list[int]]]:
    """The first layer's fused projections, (in_features, output slices): q/k/v and gate/up."""
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    return [(qkv.in_features, qkv.output_sizes), (gate_up.in_features, gate_up.output_sizes)]


def _fp32_copy_fits(model: torch.nn.Module) -> bool:
    # every projection (a Linear: it names its output slices) would get an fp32 copy
    params = sum(m.weight.numel() for m in model.modules() if hasattr(m, "output_sizes"))
    return params * 4 <= FP32_CACHE_MAX_SHARE * _available_memory()


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
