"""Prefix caching without tensors: which blocks a request shares, with whom it never shares them
(another adapter, another cache salt), what is evicted, and a property test that reference
counts and block contents stay right over random schedule / abort / finish sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.engine.block_manager import BlockManager, PrefixKey
from inference.engine.scheduler import Scheduler, SchedulerConfig
from inference.engine.sequence import FinishReason, Sequence, SequenceStatus

BS = 4  # tokens per block in every test here


def make_seq(
    tokens: list[int], rid: str = "r", adapter: str | None = None, salt: str | None = None
) -> Sequence:
    seq = Sequence(request_id=rid, prompt_token_ids=list(tokens), params=None, max_model_len=4096)
    seq.adapter = adapter
    seq.cache_salt = salt
    return seq


def keyed(seq: Sequence, adapter_id: str | None = None) -> Sequence:
    seq.prefix_key = PrefixKey(adapter_id, seq.cache_salt)
    return seq


def run_prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` the way the scheduler does, compute all its tokens; returns the blocks it shared."""
    cached = bm.find_cached(seq)
    bm.allocate(seq, seq.num_tokens - len(cached) * BS, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed(seq)
    return cached


# -- the block manager ------------------------------------------------------------------------


def test_a_repeated_prompt_shares_its_full_blocks_and_computes_only_the_rest():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = keyed(make_seq(list(range(10)), "a"))
    assert run_prefill(bm, a) == []
    b = keyed(make_seq(list(range(10)) + [77, 78], "b"))
    shared = run_prefill(bm, b)
    assert shared == a.block_table[:2]  # 8 of 10 tokens: the partial third block is not cached
    assert b.block_table[:2] == shared and b.block_table[2] != a.block_table[2]
    assert [bm.ref_count(x) for x in shared] == [2, 2]
    assert bm.num_free_blocks == 16 - 3 - 1


def test_the_last_token_is_always_computed_so_a_shared_block_is_never_written():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = keyed(make_seq(list(range(8)), "a"))
    run_prefill(bm, a)
    b = keyed(make_seq(list(range(8)), "b"))  # the same two full blocks
    cached = bm.find_cached(b)
    assert cached == a.block_table[:1]  # the block holding the last token is recomputed
    bm.allocate(b, 4, cached)
    assert b.num_computed_tokens == 4 and b.num_cached_blocks == 1
    assert b.block_table[1] != a.block_table[1]


def test_a_prefix_that_ends_mid_block_reuses_only_the_whole_blocks_before_it():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    run_prefill(bm, keyed(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")))
    b = keyed(make_seq([1, 2, 3, 4, 5, 6, 0, 0, 0], "b"))  # diverges inside block 2
    assert len(bm.find_cached(b)) == 1


def test_same_tokens_after_a_different_prefix_are_not_a_hit():
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    run_prefill(bm, keyed(make_seq([1, 1, 1, 1, 2, 2, 2, 2, 9], "a")))
    b = keyed(make_seq([3, 3, 3, 3, 2, 2, 2, 2, 9], "b"))  # block 2 alike, its parent not
    assert bm.find_cached(b) == []


@pytest.mark.parametrize(
    ("first", "second", "hits"),
    [
        ((None, None), (None, None), 2),
        (("adapter-x", None), ("adapter-x", None), 2),
        (("adapter-x", None), ("adapter-y", None), 0),  # KV under one adapter is wrong for another
        ((None, None), ("adapter-x", None), 0),
        ((None, "tenant-a"), (None, "tenant-b"), 0),  # one tenant never hits another's blocks
        ((None, "tenant-a"), (None, None), 0),
        (("adapter-x", "tenant-a"), ("adapter-x", "tenant-a"), 2),
    ],
)
def test_blocks_are_shared_only_under_the_same_adapter_id_and_salt(first, second, hits):
    bm = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_seq(list(range(12)), "a", salt=first[1])
    run_prefill(bm, keyed(a, first[0]))
    b = make_seq(list(range(12)), "b", salt=second[1])
    assert len(bm.find_cached(keyed(b, second[0]))) == hits


def test_freed_cached_blocks_stay_hittable_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = keyed(make_seq([1] * 9, "a"))  # blocks: 2 full + 1 partial
    run_prefill(bm, a)
    a_full = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    assert all(bm.is_cached(x) for x in a_full)
    # A newcomer takes never-cached blocks first: 4 of them, the cache survives.
    c = keyed(make_seq([5] * 16, "c"))
    bm.allocate(c, 16)
    assert not set(c.block_table) & set(a_full) and bm.num_cached_blocks == 2
    # One more block: the least recently freed cached one goes, which is a's *second* block
    # (a sequence's tail is freed first), so a's first block still hits.
    d = keyed(make_seq([6] * 4, "d"))
    bm.allocate(d, 4)
    assert d.block_table == [a_full[1]] and not bm.is_cached(a_full[1])
    again = keyed(make_seq([1] * 9, "again"))
    assert bm.find_cached(again) == [a_full[0]]


def test_a_cached_block_in_use_is_never_evicted():
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    a = keyed(make_seq([1] * 5, "a"))
    run_prefill(bm, a)  # holds 2 blocks, the first cached
    b = keyed(make_seq([2] * 8, "b"))
    assert not bm.can_allocate(b, 8)  # one block free: the cached one is held by a
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 8)
    assert bm.is_cached(a.block_table[0]) and bm.ref_count(a.block_table[0]) == 1


def test_sharing_a_free_cached_block_takes_it_out_of_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    a = keyed(make_seq([1] * 9, "a"))
    run_prefill(bm, a)
    bm.free(a)  # 2 cached + 1 plain, all free
    b = keyed(make_seq([1] * 8 + [3, 3, 3, 3, 3], "b"))  # shares 2, needs 2 more: 4 > 3
    cached = bm.find_cached(b)
    assert len(cached) == 2
    assert not bm.can_allocate(b, 5, cached)
    assert bm.can_allocate(b, 4, cached)  # 2 shared + 1 new


def test_retain_adapters_forgets_an_unloaded_adapters_blocks_and_reuses_them_first():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    x = make_seq(list(range(9)), "x")
    run_prefill(bm, keyed(x, "adapter-x"))
    base = make_seq(list(range(9)), "base")
    run_prefill(bm, keyed(base))
    x_blocks, base_blocks = x.block_table[:2], base.block_table[:2]
    bm.free(x)
    bm.free(base)
    assert (
        bm.retain_adapters({"adapter-y"}) == 2
    )  # x's two cached blocks (base blocks have no adapter)
    assert bm.find_cached(keyed(make_seq(list(range(9)), "x2"), "adapter-x")) == []
    assert bm.find_cached(keyed(make_seq(list(range(9)), "b2"))) == base_blocks
    fresh = keyed(make_seq([9] * 8, "fresh"))
    bm.allocate(fresh, 8)
    assert set(fresh.block_table) == set(x_blocks)  # reclaimed before anything else
    assert bm.num_cached_blocks == 2


def test_disabled_cache_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    run_prefill(bm, keyed(make_seq(list(range(9)), "a")))
    assert bm.num_cached_blocks == 0
    assert bm.find_cached(keyed(make_seq(list(range(9)), "b"))) == []


# -- the scheduler ----------------------------------------------------------------------------


class ReadySlots:
    """Adapters named by string, all loaded; ids are 'id-<name>'."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.names: list[str] = []

    def load_error(self, name):
        return None

    def acquire(self, name):
        if name not in self.names:
            self.names.append(name)
        slot = self.names.index(name)
        self.refs[slot] = self.refs.get(slot, 0) + 1
        return slot

    def release(self, slot):
        self.refs[slot] -= 1

    def unbind(self, name):
        pass

    def cache_id(self, name):
        return f"id-{name}"


def make_scheduler(num_blocks: int = 32, budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=True),
        adapters=ReadySlots(),
    )


def step(sched: Scheduler):
    out = sched.schedule()
    to_sample = [s.seq for s in out.scheduled if s.samples]  # before the step marks tokens computed
    sched.on_step_done(out.scheduled)
    for seq in to_sample:
        seq.output_token_ids.append(7)
    return out


def test_scheduler_runs_only_the_uncached_tokens_and_spends_budget_on_them_alone():
    sched = make_scheduler(budget=16)
    sched.add(make_seq(list(range(20)), "first"))
    while sched.get("first").num_computed_tokens < 20:
        step(sched)
    sched.add(make_seq(list(range(20)) + [50, 51, 52], "second"))
    sched.add(make_seq(list(range(100, 112)), "third"))
    out = step(sched)
    new = {s.seq.request_id: s.num_new_tokens for s in out.scheduled}
    assert new["second"] == 3  # 20 tokens (5 blocks) from the cache
    assert sched.get("second").num_cached_tokens == 20
    assert new["third"] == 12  # the budget left after 1 decode + 3 is enough for all of it
    assert [s.request_id for s in out.admitted] == ["second", "third"]


def test_a_request_arriving_mid_prefill_reuses_the_chunks_already_done():
    sched = make_scheduler(budget=12)
    sched.add(make_seq(list(range(30)), "long"))
    step(sched)
    step(sched)  # 24 tokens computed: 6 full blocks cached
    sched.add(make_seq(list(range(30)), "copy"))
    out = step(sched)  # long's last 6 tokens, and copy's 6 beyond the cached 24
    assert {s.seq.request_id: s.num_new_tokens for s in out.scheduled} == {"long": 6, "copy": 6}
    assert sched.get("copy").num_cached_tokens == 24


def test_adapter_requests_never_share_with_another_adapter_or_the_base():
    sched = make_scheduler()
    prompt = list(range(13))
    sched.add(make_seq(prompt, "x1", adapter="x"))
    step(sched)
    for rid, adapter in (("y", "y"), ("base", None), ("x2", "x")):
        sched.add(make_seq(prompt, rid, adapter=adapter))
    step(sched)
    assert sched.get("y").num_cached_tokens == 0
    assert sched.get("base").num_cached_tokens == 0
    assert sched.get("x2").num_cached_tokens == 12


def test_a_preempted_request_readmits_over_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=6, budget=64)
    sched.add(make_seq([1] * 11, "old"))
    sched.add(make_seq([2] * 11, "new"))
    step(sched)  # 3 blocks each: all 6 used
    for _ in range(2):
        step(sched)  # old needs a 4th block at token 12: the newest (new) is preempted
    new = sched.get("new")
    assert new.status is SequenceStatus.WAITING and new.num_preemptions == 1
    sched.finish(sched.get("old"), FinishReason.STOP)
    out = step(sched)
    assert new.status is SequenceStatus.RUNNING
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(new, new.num_tokens - 1 - 8)]
    assert new.num_cached_tokens == 0  # usage counts prompt hits only, not its own recompute


# -- the property test ------------------------------------------------------------------------

# Few prefixes and keys, so that requests often share blocks; few blocks, so that they get
# evicted and running requests preempted.
PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9])
NUM_BLOCKS = 8


@st.composite
def requests(draw):
    tokens = list(draw(st.sampled_from(PREFIXES))) + draw(st.lists(st.integers(0, 2), max_size=6))
    if not tokens:
        tokens = [0]
    return (
        tokens,
        draw(st.sampled_from([None, "x"])),
        draw(st.sampled_from([None, "t1"])),
        draw(st.integers(1, 14)),  # output tokens before it finishes
    )


OPS = st.one_of(
    st.tuples(st.just("add"), requests()),
    st.tuples(st.just("step"), st.none()),
    st.tuples(st.just("step"), st.none()),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, min_size=10, max_size=80), st.integers(4, 12))
def test_reference_counts_and_block_contents_stay_right_over_random_schedules(ops, budget):
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget),
        BlockManager(num_blocks=NUM_BLOCKS, block_size=BS, enable_prefix_caching=True),
        adapters=ReadySlots(),
    )
    bm = sched.block_manager
    # What each block's rows hold, as the model runner would have written them:
    # (token id, position, adapter id, salt) per row.
    content: dict[int, dict[int, tuple]] = {}
    wanted: dict[str, int] = {}
    ids: list[str] = []

    for i, (op, arg) in enumerate(ops):
        if op == "add":
            tokens, adapter, salt, max_out = arg
            rid = f"r{i}"
            sched.add(make_seq(tokens, rid, adapter=adapter, salt=salt))
            wanted[rid] = max_out
            ids.append(rid)
        elif op == "abort" and ids:
            sched.abort(ids[arg % len(ids)])
        elif op == "step":
            out = sched.schedule()
            for s in out.scheduled:
                seq = s.seq
                assert s.num_new_tokens >= 1  # at least the last token is computed
                for pos in range(
                    seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens
                ):
                    block = seq.block_table[pos // BS]
                    # Writes go only to a block this sequence alone holds and nobody can hit.
                    assert bm.ref_count(block) == 1 and not bm.is_cached(block)
                    key = seq.prefix_key
                    content.setdefault(block, {})[pos % BS] = (
                        seq.token_id_at(pos),
                        pos,
                        key.adapter_id,
                        key.salt,
                    )
            to_sample = [s.seq for s in out.scheduled if s.samples]
            sched.on_step_done(out.scheduled)
            for seq in to_sample:
                seq.output_token_ids.append(sum(seq.prompt_token_ids) % 4)
                if (
                    seq.num_output_tokens >= wanted[seq.request_id]
                    or seq.num_tokens >= bm.capacity_tokens
                ):
                    sched.finish(seq, FinishReason.LENGTH)
        check_invariants(sched, content)

    for rid in ids:
        sched.abort(rid)
    assert bm.num_free_blocks == NUM_BLOCKS
    assert all(bm.ref_count(b) == 0 for b in range(NUM_BLOCKS))


def check_invariants(sched: Scheduler, content: dict[int, dict[int, tuple]]) -> None:
    bm = sched.block_manager
    holders = [0] * bm.num_blocks
    for seq in sched.running:
        assert len(set(seq.block_table)) == len(seq.block_table)
        assert len(seq.block_table) * BS >= seq.num_computed_tokens
        for block in seq.block_table:
            holders[block] += 1
        # Every computed position's KV is this sequence's own token under its own key.
        key = seq.prefix_key
        for pos in range(seq.num_computed_tokens):
            row = content[seq.block_table[pos // BS]][pos % BS]
            assert row == (seq.token_id_at(pos), pos, key.adapter_id, key.salt)
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == holders
    assert bm.num_free_blocks == holders.count(0)
