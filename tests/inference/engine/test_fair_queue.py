"""FairQueue (weighted fair queuing between tenants, VTC): FCFS without tenants, no starvation,
weights, no credit banked while idle, push_front, remove, bad weights, bounded state."""

import random
from collections import Counter

import pytest

from inference.engine.fair_queue import FairQueue
from inference.engine.sampling_params import SamplingParams
from inference.engine.scheduler import FcfsQueue
from inference.engine.sequence import Sequence

PARAMS = SamplingParams(max_tokens=8)


def make_seq(
    rid: str, tenant: str | None = None, weight: float = 1.0, n_prompt: int = 10
) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=[1] * n_prompt,
        params=PARAMS,
        max_model_len=4096,
        tenant=tenant,
        weight=weight,
    )


def admit(q: FairQueue, n: int, cost: int | None = None) -> list[Sequence]:
    """What the scheduler does: take the first in admission order, charge its prompt."""
    out = []
    for _ in range(n):
        seq = next(iter(q))
        q.remove(seq)
        q.charge(seq, seq.num_prompt_tokens if cost is None else cost)
        out.append(seq)
    return out


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


@pytest.mark.parametrize("seed", range(20))
def test_without_tenants_it_is_exactly_fcfs(seed):
    rng = random.Random(seed)
    fair, fcfs = FairQueue(), FcfsQueue()
    outside: list[Sequence] = []  # popped/removed, may come back with push_front
    for step in range(300):
        op = rng.choice(["push", "push", "push_front", "pop", "remove", "charge", "peek"])
        if op == "push":
            seq = make_seq(
                f"r{step}", n_prompt=rng.randint(1, 50), weight=rng.choice([0.5, 1.0, 3.0])
            )
            fair.push(seq)
            fcfs.push(seq)
        elif op == "push_front" and outside:
            seq = outside.pop(rng.randrange(len(outside)))
            fair.push_front(seq)
            fcfs.push_front(seq)
        elif op == "pop" and len(fcfs):
            seq = fcfs.pop()
            assert fair.pop() is seq
            outside.append(seq)
        elif op == "peek" and len(fcfs):
            assert fair.peek() is fcfs.peek()
        elif op == "remove" and len(fcfs):
            seq = rng.choice(list(fcfs))
            fair.remove(seq)
            fcfs.remove(seq)
            outside.append(seq)
        elif op == "charge" and outside:
            fair.charge(rng.choice(outside), rng.randint(1, 30))
        assert len(fair) == len(fcfs)
        assert ids(fair) == ids(fcfs)


def test_a_flooding_tenant_cannot_starve_another():
    q = FairQueue()
    for i in range(100):
        q.push(make_seq(f"a{i}", "A"))
    admit(q, 10)  # A has been served for a while before B shows up
    for i in range(5):
        q.push(make_seq(f"b{i}", "B"))
    nxt = ids(admit(q, 10))
    assert [r for r in nxt if r.startswith("b")] == ["b0", "b1", "b2", "b3", "b4"]
    assert nxt.index("b4") < 10  # interleaved with A, not after A's 90 remaining
    # __iter__ predicts the same interleaving from a fresh state
    q2 = FairQueue()
    for i in range(100):
        q2.push(make_seq(f"a{i}", "A"))
    for i in range(5):
        q2.push(make_seq(f"b{i}", "B"))
    assert ids(q2)[:10] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]


def test_iter_is_admission_order_with_prompt_charges_on_a_copy():
    q = FairQueue()
    q.push(make_seq("a-big", "A", n_prompt=30))
    for i in range(3):
        q.push(make_seq(f"b{i}", "B", n_prompt=10))
    q.push(make_seq("a-small", "A", n_prompt=10))
    # A's 30-token prompt buys B three 10-token prompts before A's next
    assert ids(q) == ["a-big", "b0", "b1", "b2", "a-small"]  # b2 ties A at 30 and was queued first
    assert q.counter("A") == q.counter("B") == 0.0  # iterating charged nothing
    assert q.peek().request_id == "a-big"


def test_weight_two_gets_about_twice_the_service():
    q = FairQueue()
    for i in range(200):
        q.push(make_seq(f"h{i}", "heavy", weight=2.0, n_prompt=7))
        q.push(make_seq(f"l{i}", "light", weight=1.0, n_prompt=7))
    served = Counter()
    for _ in range(150):  # admit, then decode a few tokens each, like the engine
        (seq,) = admit(q, 1)
        for _ in range(3):
            q.charge(seq, 1)
        served[seq.tenant] += seq.num_prompt_tokens + 3
    assert served["heavy"] / served["light"] == pytest.approx(2.0, rel=0.05)


def test_an_idle_tenant_does_not_bank_credit():
    q = FairQueue()
    q.push(make_seq("b0", "B"))
    q.push(make_seq("a0", "A"))
    admit(q, 2)
    for i in range(50):  # B is idle while A is served 500 tokens
        q.push(make_seq(f"a{i + 1}", "A"))
    admit(q, 30)
    assert q.counter("A") == 310.0
    for i in range(10):
        q.push(make_seq(f"b{i + 1}", "B"))
    assert q.counter("B") == q.counter("A")  # lifted to the active minimum, not left at 10
    nxt = ids(admit(q, 10))
    assert sum(r.startswith("b") for r in nxt) == 5  # shares from here on, no catch-up burst


def test_a_tenant_returning_to_an_empty_queue_is_lifted_to_the_last_floor():
    q = FairQueue()
    q.push(make_seq("a0", "A"))
    q.push(make_seq("a1", "A"))
    admit(q, 2)
    floor = q.floor
    assert floor == 10.0  # A's counter when its last waiting request left
    q.push(make_seq("b0", "B"))
    assert q.counter("B") == floor


def test_push_front_puts_a_preempted_request_first_within_its_tenant():
    q = FairQueue()
    for i in range(3):
        q.push(make_seq(f"a{i}", "A"))
        q.push(make_seq(f"b{i}", "B"))
    a0, b0 = admit(q, 2)
    q.charge(a0, 5)
    q.push_front(a0)  # preempted: recomputes later, goes back ahead of a1
    order = ids(q)
    assert order.index("a0") < order.index("a1")
    assert [r for r in order if r.startswith("a")] == ["a0", "a1", "a2"]
    # B is behind on service (A was charged 15), so B's head still goes first
    assert order[0] == "b1"


def test_push_front_without_tenants_goes_to_the_very_front():
    q = FairQueue()
    seqs = [make_seq(f"r{i}") for i in range(4)]
    for s in seqs:
        q.push(s)
    first = q.pop()
    q.push_front(first)
    assert ids(q) == ["r0", "r1", "r2", "r3"]


def test_remove_of_arbitrary_sequences():
    q = FairQueue()
    seqs = {f"{t}{i}": make_seq(f"{t}{i}", t.upper()) for t in "ab" for i in range(4)}
    for s in seqs.values():
        q.push(s)
    q.remove(seqs["a2"])  # middle of a tenant
    q.remove(seqs["b0"])  # head of a tenant
    q.remove(seqs["b3"])  # tail
    assert len(q) == 5 and sorted(ids(q)) == ["a0", "a1", "a3", "b1", "b2"]
    with pytest.raises(ValueError, match="not in the waiting queue"):
        q.remove(seqs["a2"])
    for rid in ("b1", "b2"):  # B's queue empties: B is no longer backlogged
        q.remove(seqs[rid])
    assert ids(q) == ["a0", "a1", "a3"]
    for rid in ("a0", "a1", "a3"):
        q.remove(seqs[rid])
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.peek()
    with pytest.raises(IndexError):
        q.pop()


@pytest.mark.parametrize("weight", [0, -1.0, 0.0, float("nan"), float("inf"), "2", True, None])
def test_bad_weight_is_refused_at_push(weight):
    q = FairQueue()
    with pytest.raises(ValueError, match="weight must be"):
        q.push(make_seq("x", "A", weight=weight))
    with pytest.raises(ValueError, match="weight must be"):
        q.push_front(make_seq("y", "A", weight=weight))
    assert len(q) == 0


def test_pushing_the_same_sequence_twice_is_refused():
    q = FairQueue()
    seq = make_seq("x", "A")
    q.push(seq)
    with pytest.raises(ValueError, match="already in the waiting queue"):
        q.push(seq)


def test_state_stays_bounded_with_many_one_off_tenants():
    q = FairQueue(max_idle_tenants=8)
    q.push(make_seq("flood0", "F"))
    for i in range(1000):  # a tenant per request, each admitted and decoded a bit
        q.push(make_seq(f"f{i + 1}", "F"))
        q.push(make_seq(f"t{i}", f"tenant-{i}"))
        for seq in admit(q, 2):
            q.charge(seq, 3)
    assert q.num_tracked_tenants <= 1 + 8 + 1
    # a forgotten tenant reads as the floor, and is lifted to it when it comes back anyway
    assert q.counter("tenant-0") == q.floor


class ReferenceVtc:
    """The policy as the module docstring states it, keeping every counter forever."""

    def __init__(self):
        self.queues: dict = {}
        self.c: dict = {}
        self.last = 0.0  # the last backlogged minimum, once nothing waits

    def floor(self):
        return min((self.c[t] for t, q in self.queues.items() if q), default=self.last)

    def push(self, seq):
        if not self.queues.get(seq.tenant):
            self.c[seq.tenant] = max(self.c.get(seq.tenant, 0.0), self.floor())
        self.queues.setdefault(seq.tenant, []).append(seq)

    def admit(self):
        t = min(
            (t for t, q in self.queues.items() if q),
            key=lambda t: (self.c[t], self.queues[t][0].request_id),
        )
        seq = self.queues[t].pop(0)
        if not any(self.queues.values()):
            self.last = self.c[t]
        return seq

    def charge(self, seq, n):
        self.c[seq.tenant] = max(self.c.get(seq.tenant, 0.0), self.floor()) + n / seq.weight


def test_forgetting_idle_tenants_matches_vtc_that_remembers_everyone():
    rng = random.Random(0)
    q, ref = FairQueue(), ReferenceVtc()
    tenants = [f"t{i}" for i in range(6)]
    running: list[Sequence] = []
    tracked = []
    for step in range(3000):
        if rng.random() < 0.5 or not len(q):
            seq = make_seq(
                f"r{step:05d}",
                rng.choice(tenants),
                weight=rng.choice([1.0, 2.0]),
                n_prompt=rng.randint(1, 20),
            )
            q.push(seq)
            ref.push(seq)
        else:
            seq = ref.admit()
            assert q.peek() is seq
            q.remove(seq)
            q.charge(seq, seq.num_prompt_tokens)
            ref.charge(seq, seq.num_prompt_tokens)
            running = (running + [seq])[-3:]  # a few keep decoding
        for seq in running:
            q.charge(seq, 1)
            ref.charge(seq, 1)
        for t in tenants:
            assert q.counter(t) == pytest.approx(max(ref.c.get(t, 0.0), ref.floor()))
        tracked.append(q.num_tracked_tenants)
    assert min(tracked) < len(tenants)  # it did forget some along the way


def test_iterating_while_removing_follows_the_snapshot_order():
    q = FairQueue()
    for i in range(6):
        q.push(make_seq(f"a{i}", "A", n_prompt=5))
        q.push(make_seq(f"b{i}", "B", n_prompt=10))
    expected = ids(q)
    got = []
    for seq in q:  # what an admission loop does without copying first
        got.append(seq.request_id)
        if seq.request_id.startswith("a"):
            q.remove(seq)
    assert got == expected
    assert ids(q) == [f"b{i}" for i in range(6)]
