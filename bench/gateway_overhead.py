"""Gateway overhead: the same streaming workload straight to an inference worker and through the
portal's gateway (auth, model resolution, quotas, routing, SSE relay, ledger), in one run.

    DATABASE_URL=postgres://... REDIS_URL=redis://... .venv/bin/python bench/gateway_overhead.py \
        [--concurrency 32] [--requests 64] [--max-tokens 16] [--rounds 2] [--worker-url URL]

Starts (unless --worker-url) a SmolLM2 worker, and the portal under uvicorn (portal.asgi, one
process) pointed at it; creates a throwaway tenant + key (enterprise plan: quotas are checked
but do not bind) and deletes it afterwards. Each round runs the workload directly, then through
the gateway (alternating, so drift in machine load hits both). A request is a chat completion
streamed with ignore_eos (every request makes exactly --max-tokens tokens); TTFT is the time to
the first content chunk as the client sees it. Printed: TTFT p50/p99 and tokens/s for each path,
the added ms at p50/p99 and the throughput ratio gateway/direct.

The gateway's own cost per streamed request (issue 16: goal <= 5 ms), read from the portal's
/metrics: loraplex_gateway_overhead_seconds (portal.gateway.observe: arrival -> upstream send,
plus the relay's CPU per chunk, summed) over --probe requests sent one at a time (nothing else
in flight, so the wall part is the request's own), p50/p95 interpolated within the histogram's
buckets as Prometheus' histogram_quantile does; and the portal process's CPU seconds
(process_cpu_seconds_total) over the concurrent gateway phases per request (uvicorn, the HTTP
client, parsing: everything the process did). Printed with the CPU model and torch's CPU capability.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_line  # noqa: E402

BASE = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready in {timeout}s")


def start_worker(log_dir: Path) -> tuple[str, subprocess.Popen]:
    from inference.models.fetch import default_model_path

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    env["INFERENCE_ALLOW_RUNTIME_LORA_UPDATING"] = "true"  # as deployed: the portal stages adapters
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--model", str(default_model_path()), "--served-model-name", BASE, "--dtype", "float32",
         "--kv-cache-memory", "256MiB", "--max-num-seqs", "64", "--max-waiting-requests", "256"],
        cwd=ROOT, stdout=open(log_dir / "worker.log", "wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/ready", proc)
    return url, proc


def start_portal(worker_url: str, log_dir: Path, profile: str | None = None) -> tuple[str, subprocess.Popen]:
    port = free_port()
    # --profile: the event loop's thread under cProfile, written when the portal stops (SIGINT)
    profiler = [sys.executable, "-m", "cProfile", "-o", profile] if profile else [sys.executable]
    env = {**os.environ, "INFERENCE_URLS": worker_url, "LOG_LEVEL": "WARNING", "DEBUG": "false",
           "ALLOWED_HOSTS": "127.0.0.1,localhost"}
    proc = subprocess.Popen(
        [*profiler, "-m", "uvicorn", "portal.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--no-access-log", "--log-level", "warning"],
        cwd=ROOT, stdout=open(log_dir / "portal.log", "wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/metrics", proc)  # not /healthz: without collectstatic it answers 503
    return url, proc


def make_key() -> tuple[object, str]:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    from django.core.management import call_command

    from portal.keys.services import api_key_create
    from portal.tenants.services import tenant_create

    call_command("migrate", verbosity=0)
    tenant = tenant_create(slug=f"bench-{uuid.uuid4().hex[:8]}", name="Gateway bench")
    tenant.plan = "enterprise"
    tenant.save(update_fields=["plan"])
    _, plaintext = api_key_create(tenant=tenant, name="bench")
    return tenant, plaintext


async def one(client: httpx.AsyncClient, url: str, headers: dict, body: dict) -> tuple[float, int]:
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else time.perf_counter() - start, tokens


async def phase(url: str, headers: dict, args, seed: int) -> tuple[list[float], int, float]:
    """--requests streams, --concurrency at a time; returns TTFTs, tokens, wall seconds."""
    semaphore = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def run(i: int):
            body = {"model": BASE, "messages": [{"role": "user", "content": f"Story number {seed}-{i}, please."}],
                    "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with semaphore:
                return await one(client, url, headers, body)

        start = time.perf_counter()
        results = await asyncio.gather(*[run(i) for i in range(args.requests)])
        wall = time.perf_counter() - start
    return [r[0] for r in results], sum(r[1] for r in results), wall


METRIC_LINE = re.compile(r'^(?P<name>[a-z_:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def scrape(url: str) -> dict[tuple[str, str], float]:
    """/metrics as {(name, labels text): value}."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = METRIC_LINE.match(line)
        if m:
            out[(m["name"], m["labels"] or "")] = float(m["value"])
    return out


def overhead_buckets(before: dict, after: dict, part: str) -> tuple[list[tuple[float, float]], float, float]:
    """([(upper bound, cumulative count)], count, sum) of loraplex_gateway_overhead_seconds{part}
    between two scrapes."""
    buckets = []
    for (name, labels), value in after.items():
        if name == "loraplex_gateway_overhead_seconds_bucket" and f'part="{part}"' in labels:
            le = re.search(r'le="([^"]+)"', labels)[1]
            buckets.append((float(le), value - before.get((name, labels), 0.0)))
    key = lambda n: (n, f'part="{part}"')  # noqa: E731
    count = after.get(key("loraplex_gateway_overhead_seconds_count"), 0) - before.get(
        key("loraplex_gateway_overhead_seconds_count"), 0)
    total = after.get(key("loraplex_gateway_overhead_seconds_sum"), 0) - before.get(
        key("loraplex_gateway_overhead_seconds_sum"), 0)
    return sorted(buckets), count, total


def bucket_quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """histogram_quantile: linear within the bucket holding rank q * count."""
    rank, lower, below = q * count, 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            width = cumulative - below
            return lower + (upper - lower) * ((rank - below) / width if width else 1.0)
        lower, below = upper, cumulative
    return lower


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="per phase")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--probe", type=int, default=24,
                        help="requests sent one at a time for the gateway's own time per request")
    parser.add_argument("--worker-url")
    parser.add_argument("--profile", help="write a cProfile of the portal process here (pstats format)")
    args = parser.parse_args()
    log_dir = ROOT / "var" / "bench"
    log_dir.mkdir(parents=True, exist_ok=True)

    procs = []
    tenant = None
    try:
        worker_url = args.worker_url
        if worker_url is None:
            worker_url, proc = start_worker(log_dir)
            procs.append(proc)
        tenant, key = make_key()
        portal_url, proc = start_portal(worker_url, log_dir, profile=args.profile)
        procs.append(proc)
        targets = {"direct": (worker_url, {}), "gateway": (portal_url, {"authorization": f"Bearer {key}"})}
        # warm both paths (connections, the portal's first queries)
        for url, headers in targets.values():
            asyncio.run(phase(url, headers, argparse.Namespace(**{**vars(args), "requests": 4}), seed=-1))
        print(machine_line(), flush=True)
        portal_headers = targets["gateway"][1]
        before = scrape(portal_url)
        asyncio.run(phase(portal_url, portal_headers, argparse.Namespace(
            **{**vars(args), "requests": args.probe, "concurrency": 1}), seed=-2))
        probe = scrape(portal_url)
        cpu_seconds, cpu_requests = 0.0, 0
        stats = {name: {"ttft": [], "tokens": 0, "wall": 0.0} for name in targets}
        for r in range(args.rounds):
            for name, (url, headers) in targets.items():
                cpu_before = scrape(portal_url).get(("process_cpu_seconds_total", ""), 0.0)
                ttfts, tokens, wall = asyncio.run(phase(url, headers, args, seed=r))
                if name == "gateway":
                    cpu_seconds += scrape(portal_url).get(("process_cpu_seconds_total", ""), 0.0) - cpu_before
                    cpu_requests += args.requests
                stats[name]["ttft"] += ttfts
                stats[name]["tokens"] += tokens
                stats[name]["wall"] += wall
                print(f"round {r + 1} {name:8s} ttft p50 {percentile(ttfts, .5) * 1000:8.1f} ms  "
                      f"{tokens / wall:8.1f} tok/s", flush=True)
        print(f"\n{args.requests} streams per phase x {args.rounds} rounds, {args.concurrency} concurrent, "
              f"{args.max_tokens} tokens each")
        summary = {}
        for name, s in stats.items():
            p50, p99 = percentile(s["ttft"], .5) * 1000, percentile(s["ttft"], .99) * 1000
            tput = s["tokens"] / s["wall"]
            summary[name] = (p50, p99, tput)
            print(f"{name:8s} TTFT p50 {p50:8.1f} ms  p99 {p99:8.1f} ms  mean {statistics.mean(s['ttft']) * 1000:8.1f} ms"
                  f"  throughput {tput:8.1f} tok/s")
        d, g = summary["direct"], summary["gateway"]
        print(f"added by the gateway: TTFT p50 {g[0] - d[0]:+.1f} ms, p99 {g[1] - d[1]:+.1f} ms; "
              f"throughput ratio gateway/direct {g[2] / d[2]:.3f}")
        print(f"\ngateway's own time per streamed request, server-side ({args.probe} requests one at a time, "
              f"{args.max_tokens} tokens each; goal <= 5 ms):")
        for part in ("to_upstream", "relay", "total"):
            buckets, count, total = overhead_buckets(before, probe, part)
            if not count:
                print(f"  {part:11s} not reported (a portal without loraplex_gateway_overhead_seconds)")
                continue
            p50, p95 = bucket_quantile(buckets, count, .5) * 1000, bucket_quantile(buckets, count, .95) * 1000
            goal = f"   goal <= 5 ms: {'met' if p50 <= 5 else 'not met'}" if part == "total" else ""
            print(f"  {part:11s} p50 {p50:6.2f} ms  p95 {p95:6.2f} ms  mean {total / count * 1000:6.2f} ms{goal}")
        if cpu_requests:
            print(f"portal process CPU per request under load ({args.concurrency} concurrent, everything the "
                  f"process did): {cpu_seconds / cpu_requests * 1000:.2f} ms")
        print(machine_line())
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGINT if args.profile and proc is procs[-1] else signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if tenant is not None:
            from portal.usage.models import UsageRecord

            UsageRecord.objects.filter(tenant=tenant).delete()
            tenant.delete()


if __name__ == "__main__":
    main()
