"""Scheduler decisions with adapters, without tensors: a request waits while its adapter is
loading or every slot is busy with other adapters, others overtake it meanwhile, a failed
adapter finishes its request alone, and slot references follow preemption and finishing."""

from inference.engine.block_manager import BlockManager
from inference.engine.scheduler import Scheduler, SchedulerConfig
from inference.engine.sequence import FinishReason, Sequence, SequenceStatus


class FakeSlots:
    """Slots for adapters named by string; `ready` says which have loaded, `failed` which never will."""

    def __init__(self, num_slots: int) -> None:
        self.slots: list[str | None] = [None] * num_slots
        self.ready: set[str] = set()
        self.failed: dict[str, str] = {}
        self.refs: dict[str, int] = {}  # adapter -> sequences holding its slot
        self.unbound: list[str] = []  # adapters of finished sequences, in order

    def load_error(self, name: str) -> str | None:
        return self.failed.get(name)

    def acquire(self, name: str) -> int | None:
        if name not in self.ready:
            return None
        if name not in self.slots:
            free = [s for s, held in enumerate(self.slots) if held is None or not self.refs.get(held)]
            if not free:
                return None
            self.slots[free[0]] = name
        self.refs[name] = self.refs.get(name, 0) + 1
        return self.slots.index(name)

    def release(self, slot: int) -> None:
        name = self.slots[slot]
        self.refs[name] -= 1
        if not self.refs[name]:
            del self.refs[name]

    def unbind(self, name: str) -> None:
        self.unbound.append(name)

    def cache_id(self, name: str) -> str | None:
        return f"id-{name}" if name in self.ready else None


def make_seq(rid: str, n_prompt: int, adapter: str | None = None) -> Sequence:
    seq = Sequence(request_id=rid, prompt_token_ids=[1] * n_prompt, params=None, max_model_len=4096)
    seq.adapter = adapter
    return seq


def make_scheduler(slots: FakeSlots, num_blocks: int = 64, budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        BlockManager(num_blocks=num_blocks, block_size=4),
        adapters=slots,
    )


def step(sched: Scheduler):
    out = sched.schedule()
    sched.on_step_done(out.scheduled)
    for s in out.scheduled:
        if s.samples:
            s.seq.output_token_ids.append(7)
    return out


def ids(out) -> list[str]:
    return [s.seq.request_id for s in out.scheduled]


def test_request_for_a_loading_adapter_waits_while_others_run():
    slots = FakeSlots(2)
    sched = make_scheduler(slots)
    sched.add(make_seq("cold", 4, adapter="x"))
    sched.add(make_seq("base", 4))
    sched.add(make_seq("warm", 4, adapter="y"))
    slots.ready.add("y")
    assert ids(step(sched)) == ["base", "warm"]
    assert sched.get("cold").status is SequenceStatus.WAITING and sched.get("cold").adapter_slot == -1
    assert sched.get("warm").adapter_slot == 0 and sched.get("base").adapter_slot == -1
    slots.ready.add("x")
    assert ids(step(sched)) == ["base", "warm", "cold"]


def test_never_more_distinct_adapters_than_slots():
    slots = FakeSlots(2)
    slots.ready |= {"x", "y", "z"}
    sched = make_scheduler(slots)
    for i, name in enumerate("xyzxyz"):
        sched.add(make_seq(f"r{i}", 4, adapter=name))
    out = step(sched)
    assert {s.seq.adapter for s in out.scheduled} == {"x", "y"} and len(out.scheduled) == 4
    for seq in list(sched.running):
        sched.finish(seq, FinishReason.STOP)
    assert {s.seq.adapter for s in step(sched).scheduled} == {"z"}


def test_failed_adapter_finishes_its_request_alone_with_the_reason():
    slots = FakeSlots(2)
    slots.failed["bad"] = "adapter 'bad': contains nan values"
    sched = make_scheduler(slots)
    sched.add(make_seq("doomed", 4, adapter="bad"))
    sched.add(make_seq("fine", 4))
    out = step(sched)
    assert ids(out) == ["fine"]
    [seq] = out.failed
    assert seq.request_id == "doomed" and seq.finish_reason is FinishReason.ERROR
    assert seq.error == "adapter 'bad': contains nan values" and seq.is_finished
    assert sched.get("doomed") is None and slots.unbound == ["bad"]
    assert sched.block_manager.num_free_blocks == 64 - 1  # only "fine" holds KV


def test_preemption_releases_the_slot_and_readmission_takes_it_again():
    slots = FakeSlots(1)
    slots.ready.add("x")
    sched = make_scheduler(slots, num_blocks=3, budget=64)
    sched.add(make_seq("old", 4, adapter="x"))
    sched.add(make_seq("new", 4, adapter="x"))
    step(sched)  # both prefilled: one block each
    for _ in range(4):  # growing past a block each: "new" is preempted
        out = step(sched)
        if out.preempted:
            break
    assert [s.request_id for s in out.preempted] == ["new"]
    assert sched.get("new").adapter_slot == -1 and slots.refs == {"x": 1}
    sched.finish(sched.get("old"), FinishReason.STOP)
    assert slots.refs == {} and slots.unbound == ["x"]
    assert ids(step(sched)) == ["new"] and slots.refs == {"x": 1}


def test_aborting_a_waiting_adapter_request_unbinds_it():
    slots = FakeSlots(1)
    sched = make_scheduler(slots)
    sched.add(make_seq("w", 4, adapter="x"))  # loading: stays waiting
    step(sched)
    sched.abort("w")
    assert slots.unbound == ["x"] and slots.refs == {}
