"""Fairness benchmark: a flooding tenant against a light one, FCFS vs FairQueue, no model.

    .venv/bin/python bench/fairness.py [--steps 4000] [--overload 2.0] [--ratio 10] [--seed 0]

Drives the real Scheduler + BlockManager step by step with fake sequences (a "sampled"
token is appended whenever a chunk reaches the end of a sequence; a request finishes after
`--output` tokens). Tenant A sends `--ratio` times as many requests as tenant B (Poisson
arrivals, one trace shared by both policies) and together they ask for `--overload` times
what the engine can serve, so a queue builds up. Printed for each policy, measured in this
one run: each tenant's share of the tokens computed, B's waiting time (steps from arrival to
admission: mean, p50, p99, max), how many of B's requests were admitted, the scheduler's
time per step; then the ratios FCFS / FairQueue. No assertions: the numbers are read.

B asks for 1/(ratio+1) of the load, less than its fair half, so under fair queuing B should
get everything it asks for at once (share ~ its demand, waits ~ 0) while FCFS makes it queue
behind A's backlog (share ~ its fraction of arrivals among the requests served, waits grow).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.engine.block_manager import BlockManager  # noqa: E402
from inference.engine.fair_queue import FairQueue  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.engine.scheduler import FcfsQueue, Scheduler, SchedulerConfig  # noqa: E402
from inference.engine.sequence import FinishReason, Sequence  # noqa: E402


class ChargeCounting:
    """Forwards the waiting-queue protocol and counts charge() calls, so the bench charges
    the queue itself only if this checkout's Scheduler.on_step_done does not yet."""

    def __init__(self, inner: FcfsQueue | FairQueue) -> None:
        self.inner = inner
        self.charges = 0

    def push(self, seq: Sequence) -> None:
        self.inner.push(seq)

    def push_front(self, seq: Sequence) -> None:
        self.inner.push_front(seq)

    def peek(self) -> Sequence:
        return self.inner.peek()

    def pop(self) -> Sequence:
        return self.inner.pop()

    def remove(self, seq: Sequence) -> None:
        self.inner.remove(seq)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.inner)

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        self.charges += 1
        self.inner.charge(seq, num_tokens)


def arrivals(args: argparse.Namespace) -> list[list[tuple[str, int]]]:
    """Per step, the (tenant, prompt length) of the requests arriving then; same for both runs."""
    rng = random.Random(args.seed)
    # capacity in requests/step: every seat busy for ~output steps per request
    capacity = args.max_num_seqs / args.output
    rate_b = args.overload * capacity / (args.ratio + 1)
    rates = {"A": rate_b * args.ratio, "B": rate_b}
    trace = []
    for _ in range(args.steps):
        step = []
        for tenant, rate in rates.items():
            # Poisson(rate) by counting exponential inter-arrival gaps within one step
            t = rng.expovariate(rate)
            while t < 1.0:
                step.append((tenant, rng.randint(args.prompt // 2, args.prompt * 3 // 2)))
                t += rng.expovariate(rate)
        trace.append(step)
    return trace


def simulate(policy: str, trace: list[list[tuple[str, int]]], args: argparse.Namespace) -> dict:
    queue = ChargeCounting(FairQueue() if policy == "fair" else FcfsQueue())
    blocks = args.max_num_seqs * -(-(args.prompt * 2 + args.output) // 16)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget),
        BlockManager(num_blocks=blocks, block_size=16),
        waiting=queue,  # type: ignore[arg-type]
    )
    params = SamplingParams(max_tokens=args.output)
    arrived: dict[str, int] = {}
    admitted_at: dict[str, int] = {}
    tokens: Counter[str] = Counter()
    sched_seconds = 0.0
    n = 0
    for step, new in enumerate(trace):
        for tenant, n_prompt in new:
            seq = Sequence(
                request_id=f"{tenant}{n}",
                prompt_token_ids=[1] * n_prompt,
                params=params,
                max_model_len=4096,
                tenant=tenant,
            )
            n += 1
            arrived[seq.request_id] = step
            sched.add(seq)
        t0 = time.perf_counter()
        out = sched.schedule()
        sched_seconds += time.perf_counter() - t0
        sampled = [s.seq for s in out.scheduled if s.samples]
        before = queue.charges
        sched.on_step_done(out.scheduled)
        if queue.charges == before:  # this Scheduler does not charge yet: do it as it will
            for s in out.scheduled:
                queue.charge(s.seq, s.num_new_tokens)
        for s in out.scheduled:
            tokens[s.seq.tenant] += s.num_new_tokens
            admitted_at.setdefault(s.seq.request_id, step)
        for seq in sampled:  # the "model" emits one token per finished chunk
            seq.output_token_ids.append(7)
            if seq.num_output_tokens >= args.output:
                sched.finish(seq, FinishReason.LENGTH)
    total = sum(tokens.values())
    b_ids = [r for r in arrived if r.startswith("B")]
    # waiting time of B's requests; those never admitted count with the time they waited so far
    b_waits = sorted(admitted_at.get(r, args.steps) - arrived[r] for r in b_ids)
    return {
        "share": {t: tokens[t] / total for t in ("A", "B")},
        "b_wait_mean": statistics.fmean(b_waits),
        "b_wait_p50": b_waits[len(b_waits) // 2],
        "b_wait_p99": b_waits[min(len(b_waits) - 1, int(len(b_waits) * 0.99))],
        "b_wait_max": b_waits[-1],
        "b_admitted": sum(r in admitted_at for r in b_ids),
        "b_arrived": len(b_ids),
        "us_per_step": sched_seconds / len(trace) * 1e6,
        "waiting_at_end": len(queue),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--overload", type=float, default=2.0, help="offered load / capacity")
    ap.add_argument("--ratio", type=float, default=10.0, help="A's request rate / B's")
    ap.add_argument(
        "--prompt", type=int, default=64, help="mean prompt tokens (uniform 0.5x..1.5x)"
    )
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    trace = arrivals(args)
    arrived = Counter(t for step in trace for t, _ in step)
    print(
        f"{args.steps} steps, offered load {args.overload}x capacity, A:B requests = "
        f"{arrived['A']}:{arrived['B']}, prompt ~{args.prompt}, output {args.output}, "
        f"{args.max_num_seqs} seats, budget {args.budget} tokens/step"
    )
    results = {p: simulate(p, trace, args) for p in ("fcfs", "fair")}
    print(f"{'':24}{'FCFS':>12}{'FairQueue':>12}")
    rows = [
        ("A share of tokens", lambda r: f"{r['share']['A']:.1%}"),
        ("B share of tokens", lambda r: f"{r['share']['B']:.1%}"),
        ("B admitted / arrived", lambda r: f"{r['b_admitted']}/{r['b_arrived']}"),
        ("B wait mean (steps)", lambda r: f"{r['b_wait_mean']:.1f}"),
        ("B wait p50 (steps)", lambda r: f"{r['b_wait_p50']}"),
        ("B wait p99 (steps)", lambda r: f"{r['b_wait_p99']}"),
        ("B wait max (steps)", lambda r: f"{r['b_wait_max']}"),
        ("waiting at end", lambda r: f"{r['waiting_at_end']}"),
        ("schedule() us/step", lambda r: f"{r['us_per_step']:.0f}"),
    ]
    for name, fmt in rows:
        print(f"{name:24}{fmt(results['fcfs']):>12}{fmt(results['fair']):>12}")
    fc, fa = results["fcfs"], results["fair"]
    print(
        f"ratios FCFS/FairQueue: B mean wait {fc['b_wait_mean'] / max(fa['b_wait_mean'], 1e-9):.1f}x, "
        f"B p99 wait {fc['b_wait_p99'] / max(fa['b_wait_p99'], 1):.1f}x; "
        f"B token share FairQueue/FCFS {fa['share']['B'] / fc['share']['B']:.2f}x; "
        f"schedule() cost FairQueue/FCFS {fa['us_per_step'] / fc['us_per_step']:.2f}x"
    )


if __name__ == "__main__":
    main()
