"""The inference server under 32 concurrent streaming clients over 8 adapters, against the
same workload through the offline engine, in one run.

    .venv/bin/python bench/serve_vs_offline.py [--quick] [--clients 32] [--adapters 8]

Server: `python -m inference serve` as its own process on loopback, with the adapters given as
--lora-modules (loaded before timing); each client is an `openai.AsyncOpenAI` chat stream with
`stream_options.include_usage`, greedy, ignore_eos, a fixed output length. Measured per stream:
time to first token (TTFT), inter-token latency (gaps between content chunks), and the total
output tokens over the wall time of the whole burst. Offline: the same prompts, adapters and
lengths submitted at once to an LLMEngine with the same settings in this process.

Goal: served / offline throughput >= 0.9. Prints the numbers and the ratio; no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import WORDS  # noqa: E402
from bench.lora_adapters import base_config, write_random_adapters  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def questions(n: int, seed: int = 0) -> list[str]:
    """n user messages of 5..60 words (mixed prompt lengths)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(5 + (55 * i) // max(1, n - 1))) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, adapters: list[Path], port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "inference", "serve", "--model", args.model, "--port", str(port),
        "--dtype", args.dtype, "--max-num-seqs", str(args.clients), "--max-loras", str(args.adapters),
        "--max-cpu-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
        "--kv-cache-memory", "512MiB", "--lora-modules",
        *[f"bench-{i}={path}" for i, path in enumerate(adapters)],
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server not ready after 300 s")


async def one_stream(client, model: str, text: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, inter-token gaps, completion tokens) of one streamed chat completion."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    ttft, last, gaps, tokens = None, None, [], 0
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = now - start
            elif last is not None:
                gaps.append(now - last)
            last = now
    return ttft or 0.0, gaps, tokens


async def served(port: int, models: list[str], texts: list[str], max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
    start = time.perf_counter()
    results = await asyncio.gather(*(one_stream(client, m, t, max_tokens) for m, t in zip(models, texts, strict=True)))
    wall = time.perf_counter() - start
    await client.close()
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    return {"wall": wall, "tokens": tokens, "ttft": ttfts, "itl": gaps}


def offline(args, adapters: list[Path], texts: list[str], loras: list[str | None]) -> dict:
    config = EngineConfig(
        model=args.model, dtype=args.dtype, max_num_seqs=args.clients, max_loras=args.adapters,
        max_cpu_loras=args.adapters, max_lora_rank=args.rank, kv_cache_memory="512MiB",
    )  # fmt: skip
    engine = LLMEngine(config, progress=False)
    for i, path in enumerate(adapters):
        engine.add_adapter(f"bench-{i}", path)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Warm every adapter into a slot, as the server's warm-up request does.
    engine.run_until_done([engine.add_request("hi", SamplingParams(max_tokens=1), lora=f"bench-{i}")
                           for i in range(len(adapters))])  # fmt: skip
    start = time.perf_counter()
    ids = [engine.add_request(messages=[{"role": "user", "content": t}], params=params, lora=lora)
           for t, lora in zip(texts, loras, strict=True)]  # fmt: skip
    done = engine.run_until_done(ids)
    wall = time.perf_counter() - start
    engine.shutdown()
    return {"wall": wall, "tokens": sum(o.usage.completion_tokens for o in done.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="16 output tokens")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens = 16

    texts = questions(args.clients)
    names = [f"bench-{i % args.adapters}" for i in range(args.clients)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_random_adapters(Path(tmp), base_config(args.model), args.adapters, rank=args.rank)
        port = free_port()
        proc = start_server(args, adapters, port)
        try:
            asyncio.run(served(port, names[: args.adapters], texts[: args.adapters], 1))  # warm adapters into slots
            serve = asyncio.run(served(port, names, texts, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        off = offline(args, adapters, texts, names)

    serve_tps = serve["tokens"] / serve["wall"]
    off_tps = off["tokens"] / off["wall"]
    ms = 1000
    print(f"{args.clients} streaming clients over {args.adapters} adapters (rank {args.rank}, all projections), "
          f"{args.max_tokens} output tokens each, {args.dtype}")  # fmt: skip
    print(f"  served : {serve['tokens']} tokens in {serve['wall']:.2f} s = {serve_tps:.1f} tok/s")
    print(f"           TTFT p50 {percentile(serve['ttft'], 50) * ms:.0f} ms, p99 {percentile(serve['ttft'], 99) * ms:.0f} ms")
    if serve["itl"]:
        print(f"           inter-token p50 {percentile(serve['itl'], 50) * ms:.0f} ms, "
              f"p99 {percentile(serve['itl'], 99) * ms:.0f} ms, mean {statistics.fmean(serve['itl']) * ms:.0f} ms")  # fmt: skip
    print(f"  offline: {off['tokens']} tokens in {off['wall']:.2f} s = {off_tps:.1f} tok/s")
    print(f"  served / offline throughput = {serve_tps / off_tps:.2f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
