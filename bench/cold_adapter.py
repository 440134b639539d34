"""Cold adapter: the extra time to first token when a request's adapter is on disk vs resident.

    .venv/bin/python bench/cold_adapter.py [--quick] [--model PATH] [--runs 9]

Each run uses a new adapter (rank 16, all seven projections, bf16, its own content so nothing
is cached by id) that was written, fsync'ed and dropped from the OS page cache
(posix_fadvise DONTNEED), so "cold" means a real disk read, validation and copy into a slot.
Per run, the same 64-token prompt (max_tokens=1) is sent alone three ways:

  cold:     lora=LoRARequest(new name, path)      the adapter is on disk
  resident: lora=<that name> right after          the adapter is now in a device slot
  base:     no adapter

TTFT is measured from before add_request to the step that returns the first token (and the
engine's own RequestOutput.time_to_first_token is printed alongside). Every request has a cache
salt of its own, so each one prefills all 64 tokens: with the prefix cache on, the resident and
base requests would otherwise reuse the KV of the request before them and compute one token.
Between requests the engine does what the server's engine thread does when it runs out of
requests (LLMEngine.do_idle_work: a loaded adapter's host copy handed to its slot). The
process CPU time of each request is printed too: on a shared machine the wall times
swing with the neighbours, the cold request's extra CPU (loading it) much less. Goal: median(cold) −
median(resident) <= 50 ms. The first run is a discarded warm-up. No assertions.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora_adapters import adapter_nbytes, base_config, median, write_random_adapter  # noqa: E402
from bench.machine import machine_line  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.lora.request import LoRARequest  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402


def drop_from_page_cache(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ttft(engine: LLMEngine, prompt: list[int], lora, salt: str) -> tuple[float, float, float]:
    """(seconds from add_request to the first token, the engine's time_to_first_token, CPU
    seconds the whole process spent meanwhile: the loader thread's included); `salt` keeps the
    prompt's KV from being shared with any other request's."""
    start, cpu = time.perf_counter(), time.process_time()
    rid = engine.add_request(
        prompt, SamplingParams(max_tokens=1, temperature=0.0), lora=lora, cache_salt=salt
    )
    while True:
        for out in engine.step():
            if out.request_id == rid and (out.token_ids or out.finished):
                seconds = time.perf_counter() - start
                if out.finish_reason == "error":
                    raise SystemExit(f"request failed: {out.error}")
                cpu = time.process_time() - cpu
                if not out.finished:
                    engine.run_until_done([rid])
                engine.do_idle_work()  # as the server's engine thread does once it runs out of requests
                return seconds, out.time_to_first_token or float("nan"), cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="3 runs")
    args = ap.parse_args()
    if args.quick:
        args.runs = 3

    cfg = base_config(args.model)
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, max_loras=4, max_cpu_loras=8, max_lora_rank=args.rank),
        progress=False,
    )
    prompt = [1 + (7 * j) % 1000 for j in range(args.prompt_tokens)]
    print(machine_line())
    print(f"model {engine.model_name}, {args.dtype}; adapters rank {args.rank}, all seven projections "
          f"({adapter_nbytes(cfg, args.rank) / 2**20:.1f} MiB each); prompt {len(prompt)} tokens; "
          f"{args.runs} runs after a warm-up")
    cold, resident, base, engine_cold, engine_resident, cold_cpu, resident_cpu = [], [], [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        dirs = [write_random_adapter(Path(tmp) / f"cold-{i:03d}", cfg, rank=args.rank, seed=1000 + i)
                for i in range(args.runs + 1)]
        for d in dirs:
            drop_from_page_cache(d)
        for i, d in enumerate(dirs):
            c, ec, cc = ttft(engine, prompt, LoRARequest(d.name, d), f"cold-{i}")
            r, er, rc = ttft(engine, prompt, d.name, f"resident-{i}")
            b, _, _ = ttft(engine, prompt, None, f"base-{i}")
            if i == 0:
                continue  # warm-up
            cold.append(c)
            resident.append(r)
            base.append(b)
            engine_cold.append(ec)
            engine_resident.append(er)
            cold_cpu.append(cc)
            resident_cpu.append(rc)
            print(f"  run {i}: cold {c * 1e3:7.1f} ms   resident {r * 1e3:7.1f} ms   base {b * 1e3:7.1f} ms")
        stats = engine.lora_stats()
    loads = stats["load_seconds"][-args.runs:]
    print(f"\nmedian TTFT: cold {median(cold) * 1e3:.1f} ms, resident {median(resident) * 1e3:.1f} ms, "
          f"base {median(base) * 1e3:.1f} ms")
    print(f"engine's time_to_first_token medians: cold {median(engine_cold) * 1e3:.1f} ms, "
          f"resident {median(engine_resident) * 1e3:.1f} ms")
    if loads:
        print(f"background load time (lora_stats load_seconds) median {median(loads) * 1e3:.1f} ms; "
              f"loads {stats['loads']}, evictions {stats['evictions']}")
    print(f"process CPU per request medians: cold {median(cold_cpu) * 1e3:.1f} ms, resident "
          f"{median(resident_cpu) * 1e3:.1f} ms: a cold adapter costs {(median(cold_cpu) - median(resident_cpu)) * 1e3:.1f} ms "
          f"of CPU more (load, checks, hash, slot copy; what its wall time comes to on an idle machine "
          f"with OMP_NUM_THREADS=1)")
    print(f"\nextra TTFT cold vs resident = {(median(cold) - median(resident)) * 1e3:.1f} ms   (goal <= 50 ms)")
    print(f"resident adapter vs base TTFT = {median(resident) / median(base):.3f}x")


if __name__ == "__main__":
    main()
