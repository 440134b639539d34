"""The matmul plan: measured per CPU at start-up, forced by --matmul-path, fixed where there is
nothing to choose (fp32 models, CUDA); the engine runs on it and says which path it took."""

from __future__ import annotations

import json

import pytest
import torch

from inference.config import LORA_KERNEL_CHOICES, MATMUL_PATH_CHOICES, ConfigError, EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.layers import matmul_plan
from inference.layers.matmul_plan import (
    FP32_CACHED,
    NATIVE,
    NATIVE_PACKED,
    PATHS,
    SHAPE_CLASSES,
    MatmulPlan,
    choose_plan,
    forced_plan,
    native_needs_packing,
    with_lora_kernel,
)
from inference.layers.onednn_weight import packing_unavailable
from inference.models.loader import load_model
from kernels import cpu_fused
from tests.inference.models.tiny_llama import write_tiny_checkpoint, write_word_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan")
    hf = write_tiny_checkpoint(path)
    write_word_tokenizer(path, hf.config.vocab_size)
    return path


def test_the_config_knows_every_path_the_plan_has():
    assert MATMUL_PATH_CHOICES == ("auto", *PATHS)
    with pytest.raises(ConfigError, match="matmul_path: expected one of auto, native, fp32-upcast, fp32-cached"):
        EngineConfig(matmul_path="fastest")
    with pytest.raises(ConfigError, match="INFERENCE_MATMUL_PATH: expected one of"):
        EngineConfig.from_env({"INFERENCE_MATMUL_PATH": "bf16"})
    assert EngineConfig.from_env({"INFERENCE_MATMUL_PATH": "fp32-cached"}).matmul_path == FP32_CACHED


def test_nothing_to_choose_for_fp32_models_or_cuda(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.float32, progress=False)
    for dtype, device, requested in ((torch.float32, "cpu", "auto"), (torch.float32, "cpu", FP32_CACHED),
                                     (torch.bfloat16, "cuda", "auto")):  # fmt: skip
        plan = choose_plan(model, dtype, torch.device(device), requested)
        assert plan.source == "fixed" and set(plan.paths.values()) == {NATIVE} and not plan.timings


@pytest.mark.parametrize("path", PATHS)
def test_a_forced_path_serves_every_shape_class(path):
    plan = forced_plan(path, torch.bfloat16)
    assert plan.source == "forced" and plan.paths == {c: path for c in SHAPE_CLASSES}
    # fp32 products upcast anyway: LoRA stacks in fp32 are converted once, not every step
    assert plan.lora_dtype == (torch.bfloat16 if path == NATIVE else torch.float32)
    with pytest.raises(ValueError, match="matmul path must be one of"):
        forced_plan("bf16", torch.bfloat16)


def test_auto_measures_every_class_on_the_models_own_shapes(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.bfloat16, progress=False)
    plan = choose_plan(model, torch.bfloat16, torch.device("cpu"), "auto")
    assert plan.source == "measured" and set(plan.paths) == set(SHAPE_CLASSES)
    for cls in SHAPE_CLASSES:
        # The winner is native unless a path beat it by that path's margin; a later path must
        # beat the pick by its own margin (fp32-cached, +100% memory, needs 25%): a near tie
        # keeps the simpler path, so the pick is not always the very fastest time.
        times, pick = plan.timings[cls], plan.paths[cls]
        assert set(times) == set(PATHS)
        assert pick == NATIVE or times[pick] < matmul_plan.SWITCH_FACTOR[pick] * times[NATIVE]
        later = PATHS[PATHS.index(pick) + 1 :]
        assert not any(times[p] < matmul_plan.SWITCH_FACTOR[p] * times[pick] for p in later)
        assert times[pick] <= times[NATIVE]
    assert set(plan.timings["lora"]) == {"bfloat16", "float32"}
    if set(plan.paths.values()) != {NATIVE}:
        assert plan.lora_dtype == torch.float32
    described = json.loads(json.dumps(plan.describe()))
    assert described["source"] == "measured" and described["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert described["lora_dtype"] in ("bfloat16", "float32") and set(described["timings_us"]) == {*SHAPE_CLASSES, "lora"}


def test_no_fp32_copy_where_it_would_not_fit(tiny_dir, monkeypatch):
    monkeypatch.setattr(matmul_plan, "_available_memory", lambda: 1 << 10)  # 1 KiB free
    model = load_model(tiny_dir, dtype=torch.bfloat16, progress=False)
    plan = choose_plan(model, torch.bfloat16, torch.device("cpu"), "auto")
    assert all(FP32_CACHED not in plan.timings[c] for c in SHAPE_CLASSES)
    assert FP32_CACHED not in plan.paths.values()


def test_native_counts_at_its_faster_layout_where_the_weights_may_be_packed():
    """Under make run a one-row class timed native 164 us on plain weights against fp32-cached
    118 us, so it took the fp32 copy (and with it no packing): packed native takes ~90 us."""
    plain_only = {NATIVE: 164e-6, "fp32-upcast": 400e-6, FP32_CACHED: 118e-6}
    assert matmul_plan._winner(plain_only) == FP32_CACHED
    assert matmul_plan._winner({**plain_only, NATIVE_PACKED: 90e-6}) == NATIVE
    assert matmul_plan._winner({**plain_only, NATIVE_PACKED: 200e-6}) == FP32_CACHED  # packing no help
    # the plan then needs the packing it was timed on; a class native on plain weights does not
    won_packed = MatmulPlan({"decode": NATIVE, "batch": NATIVE, "prefill": NATIVE}, torch.bfloat16, "measured",
                            {"decode": {**plain_only, NATIVE_PACKED: 90e-6}})  # fmt: skip
    assert native_needs_packing(won_packed)
    won_plain = MatmulPlan(won_packed.paths, torch.bfloat16, "measured",
                           {"decode": {NATIVE: 100e-6, FP32_CACHED: 118e-6, NATIVE_PACKED: 90e-6}})  # fmt: skip
    assert not native_needs_packing(won_plain)


def test_auto_times_packed_native_only_where_packing_may_follow(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.bfloat16, progress=False)
    plain = choose_plan(model, torch.bfloat16, torch.device("cpu"), "auto")
    assert all(NATIVE_PACKED not in plain.timings[c] for c in SHAPE_CLASSES)  # --dense-layout plain
    may_pack = choose_plan(model, torch.bfloat16, torch.device("cpu"), "auto", may_pack=True)
    packs_here = packing_unavailable(torch.bfloat16) is None
    assert all((NATIVE_PACKED in may_pack.timings[c]) == packs_here for c in SHAPE_CLASSES)
    for cls in SHAPE_CLASSES:
        assert may_pack.paths[cls] == matmul_plan._winner(may_pack.timings[cls])


def test_a_near_tie_keeps_the_simpler_path():
    assert matmul_plan._winner({NATIVE: 100e-6, "fp32-upcast": 95e-6, FP32_CACHED: 93e-6}) == NATIVE
    assert matmul_plan._winner({NATIVE: 143e-6, "fp32-upcast": 851e-6, FP32_CACHED: 118e-6}) == NATIVE  # +100% memory
    assert matmul_plan._winner({NATIVE: 100e-6, "fp32-upcast": 50e-6, FP32_CACHED: 48e-6}) == "fp32-upcast"
    assert matmul_plan._winner({NATIVE: 100e-6, "fp32-upcast": 50e-6, FP32_CACHED: 30e-6}) == FP32_CACHED
    assert matmul_plan._winner({NATIVE: 100e-6, "fp32-upcast": 120e-6}) == NATIVE  # no cache offered


def test_the_race_takes_the_fastest_and_stops_timing_a_hopeless_candidate():
    calls = {"quick": 0, "slow": 0}

    def quick():
        calls["quick"] += 1

    def slow():
        calls["slow"] += 1
        end = matmul_plan.time.perf_counter() + 0.003
        while matmul_plan.time.perf_counter() < end:  # 3 ms of work vs none
            pass

    best = matmul_plan.race({"slow": slow, "quick": quick}, rounds=6)
    assert min(best, key=best.get) == "quick"
    assert calls["slow"] <= 3  # warm-up + two rounds, then it sits out


def test_the_engine_runs_on_its_plan_and_counts_the_fp32_copies(tiny_dir):
    def engine(path: str) -> LLMEngine:
        # the plain layout on both: prepacked dense weights add a packed copy of the tied head
        return LLMEngine(EngineConfig(model=str(tiny_dir), dtype="bfloat16", matmul_path=path, dense_layout="plain",
                                      kv_cache_memory=4 << 20), progress=False)  # fmt: skip

    native, cached = engine(NATIVE), engine(FP32_CACHED)
    assert native.matmul_plan.source == cached.matmul_plan.source == "forced"
    projections = [m for m in cached.model.modules() if getattr(m, "weight32", None) is not None]
    assert projections and all(m.plan is cached.matmul_plan for m in projections)
    fp32_bytes = sum(m.weight32.nbytes for m in projections)
    assert cached.memory_stats()["base_weights"] == native.memory_stats()["base_weights"] + fp32_bytes
    assert all(getattr(m, "weight32", None) is None for m in native.model.modules())


def test_the_config_knows_every_lora_kernel():
    assert LORA_KERNEL_CHOICES == matmul_plan.LORA_KERNEL_CHOICES
    with pytest.raises(ConfigError, match="lora_kernel: expected one of auto, fused, amx, torch"):
        EngineConfig(lora_kernel="triton")
    assert EngineConfig.from_env({"INFERENCE_LORA_KERNEL": "torch"}).lora_kernel == "torch"


def test_the_lora_kernel_is_forced_or_the_faster_one(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.bfloat16, progress=False)
    cpu = torch.device("cpu")
    assert choose_plan(model, torch.bfloat16, cpu, NATIVE).lora_kernel == "torch"  # the default
    assert choose_plan(model, torch.bfloat16, cpu, NATIVE, lora_kernel="torch").lora_kernel == "torch"
    if cpu_fused.fused_op() is None:
        pytest.skip(f"the fused kernel cannot be built here: {cpu_fused.unavailable_reason()}")
    assert choose_plan(model, torch.bfloat16, cpu, NATIVE, lora_kernel="fused").lora_kernel == "fused"
    auto = choose_plan(model, torch.float32, cpu, "auto", lora_kernel="auto")  # fp32: still raced
    timed = auto.timings["lora_kernel"]
    assert set(timed) == {"torch", "fused"} and auto.lora_kernel == min(timed, key=timed.get)
    assert json.loads(json.dumps(auto.describe()))["lora_kernel"] == auto.lora_kernel
    assert choose_plan(model, torch.bfloat16, torch.device("cuda"), lora_kernel="auto").lora_kernel == "triton"
    # Under fp32 products the torch path keeps fp32 stacks; the fused kernel may take bf16 ones
    upcast = choose_plan(model, torch.bfloat16, cpu, "fp32-upcast", lora_kernel="auto")
    timed = upcast.timings["lora_kernel"]
    assert set(timed) == {"torch", "fused", "fused-bfloat16"}
    best = min(timed, key=timed.get)
    # fused on bf16 stacks goes on to amx where the CPU has tiles and they win from some run length
    tiled = best == "fused-bfloat16" and upcast.lora_tile_rows > 0
    assert upcast.lora_kernel == ("amx" if tiled else best.split("-")[0])
    assert upcast.lora_dtype == (torch.bfloat16 if best == "fused-bfloat16" else torch.float32)


def test_without_a_fused_kernel_auto_takes_torch_and_fused_says_why(tiny_dir, monkeypatch):
    monkeypatch.setattr(cpu_fused, "_state", {"error": "RuntimeError: no C++ compiler (c++) on PATH"})
    plan = forced_plan(NATIVE, torch.bfloat16)
    projections = [(64, [64, 32, 32])]
    assert with_lora_kernel(plan, "auto", projections, torch.bfloat16).lora_kernel == "torch"
    with pytest.raises(RuntimeError, match=r"lora kernel fused: cannot be built here \(RuntimeError: no C\+\+ compiler"):
        with_lora_kernel(plan, "fused", projections, torch.bfloat16)
    with pytest.raises(ValueError, match="lora kernel must be one of auto, fused, amx, torch"):
        with_lora_kernel(plan, "fastest", projections, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"lora kernel amx: cannot be built here"):
        with_lora_kernel(plan, "amx", projections, torch.bfloat16)


def test_amx_is_forced_where_the_tiles_are_and_refused_with_the_reason_elsewhere(monkeypatch):
    if cpu_fused.fused_op() is None:
        pytest.skip(f"the fused kernel cannot be built here: {cpu_fused.unavailable_reason()}")
    plan, projections = forced_plan(NATIVE, torch.bfloat16), [(64, [64, 32, 32])]
    if cpu_fused.tiles_bf16():
        amx = with_lora_kernel(plan, "amx", projections, torch.bfloat16)
        assert (amx.lora_kernel, amx.lora_tile_rows, amx.lora_dtype) == ("amx", 1, torch.bfloat16)
        assert with_lora_kernel(plan, "fused", projections, torch.bfloat16).lora_tile_rows == 0
        with pytest.raises(RuntimeError, match="lora kernel amx: takes a bfloat16 model, not float16"):
            with_lora_kernel(plan, "amx", projections, torch.float16)
    monkeypatch.setattr(cpu_fused, "tiles_bf16", lambda: False)
    with pytest.raises(RuntimeError, match="lora kernel amx: no AMX-BF16 tiles here"):
        with_lora_kernel(plan, "amx", projections, torch.bfloat16)
    auto = with_lora_kernel(plan, "auto", projections, torch.bfloat16)
    assert auto.lora_kernel in ("torch", "fused") and auto.lora_tile_rows == 0


def test_auto_puts_runs_on_tiles_from_the_fewest_tokens_at_which_they_win():
    """Where the fused kernel wins on bf16 stacks and the CPU has tiles, the plan times tiles
    against pair passes from 16 tokens of one adapter down and takes the fewest at which they
    still win (its timings say so), or keeps the passes."""
    if cpu_fused.fused_op() is None or not cpu_fused.tiles_bf16():
        pytest.skip("no AMX-BF16 tiles here")
    plan = with_lora_kernel(forced_plan(NATIVE, torch.bfloat16), "auto", [(576, [576, 192, 192])], torch.bfloat16)
    if plan.lora_kernel == "torch":
        pytest.skip("torch ops won the LoRA race here")
    timed = plan.timings["lora_tile_rows"]
    won = 0
    for rows in matmul_plan.TILE_ROWS_TIMED:
        if f"tiles@{rows}" not in timed or timed[f"tiles@{rows}"] >= timed[f"pairs@{rows}"]:
            break
        won = rows
    assert plan.lora_tile_rows == won and plan.lora_kernel == ("amx" if won else "fused")
    assert json.loads(json.dumps(plan.describe()))["lora_tile_rows"] == won


def test_the_lora_race_reads_every_layers_stacks_up_to_a_bound(tiny_dir, monkeypatch):
    """In the engine a decode step reads each layer's stacks from memory, so the race's decode
    step reads as many distinct stacks as the model has layers (fp32 stacks then cost their
    bytes), bounded in memory for large models."""
    model = load_model(tiny_dir, dtype=torch.bfloat16, progress=False)
    projections = matmul_plan._lora_projections(model)
    assert matmul_plan._lora_race_copies(model, projections) == len(model.layers) > 1
    monkeypatch.setattr(matmul_plan, "LORA_RACE_BYTES", 1)
    assert matmul_plan._lora_race_copies(model, projections) == 1

    calls = []
    monkeypatch.setattr(matmul_plan, "add_lora_cpu", lambda *call: calls.append(call))
    matmul_plan._lora_delta(projections, torch.bfloat16, torch.bfloat16, 16, copies=3)()
    decode = [c for c in calls if c[3].num_tokens == 16]
    assert len(decode) == 3 * len(projections)
    assert len({id(c[2]) for c in decode}) == 3 * len(projections)  # each copy read once a step
    assert len([c for c in calls if c[3].num_tokens == 256]) == len(projections)  # prefill: one
