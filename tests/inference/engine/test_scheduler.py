"""Scheduler decisions, without tensors: admission, chunked prefill, preemption, abort."""

import pytest

from inference.engine.block_manager import BlockManager
from inference.engine.scheduler import Scheduler, SchedulerConfig
from inference.engine.sequence import FinishReason, Sequence, SequenceStatus


def make_seq(rid: str, n_prompt: int) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=[1] * n_prompt, params=None, max_model_len=4096)


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        BlockManager(num_blocks=num_blocks, block_size=block_size),
    )


def run_step(sched: Scheduler, sample_token: int = 7):
    """What the engine does after the model ran: mark computed, append sampled tokens."""
    out = sched.schedule()
    sampled = [s.seq for s in out.scheduled if s.samples]
    sched.on_step_done(out.scheduled)
    for seq in sampled:
        seq.output_token_ids.append(sample_token)
    return out


def test_fcfs_admission_and_decode_together():
    sched = make_scheduler()
    sched.add(make_seq("a", 10))
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 10)]
    sched.add(make_seq("b", 5))
    out = run_step(sched)
    # a decodes one token while b prefills, in the same step
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    sched = make_scheduler(budget=16)
    sched.add(make_seq("long", 40))
    chunks = []
    for _ in range(3):
        out = run_step(sched)
        chunks.append(out.scheduled[0].num_new_tokens)
        assert out.num_batched_tokens <= 16
    assert chunks == [16, 16, 8]
    seq = sched.get("long")
    assert seq.num_computed_tokens == 40 and seq.output_token_ids == [7]  # sampled only at the end


def test_budget_is_shared_between_decodes_and_new_prefill():
    sched = make_scheduler(budget=12)
    for rid in ("a", "b"):
        sched.add(make_seq(rid, 4))
    run_step(sched)
    sched.add(make_seq("c", 30))
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1), ("c", 10)]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add(make_seq(rid, 3))
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["a", "b"]
    assert len(sched.waiting) == 1


def test_without_chunked_prefill_a_too_long_prompt_waits_for_a_full_budget():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False),
        BlockManager(num_blocks=64, block_size=4),
    )
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 8))
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["a"]  # b would need 8 > 6 left


def test_newest_sequence_is_preempted_when_kv_runs_out_and_recomputed_later():
    # 4 blocks of 4 tokens = 16 token slots.
    sched = make_scheduler(num_blocks=4, block_size=4)
    sched.add(make_seq("old", 7))
    sched.add(make_seq("new", 8))
    run_step(sched)  # old: 2 blocks, new: 2 blocks -> full
    # old needs an 8th slot (fits in its block 2), new needs a 9th -> a third block
    out = run_step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["old"]
    assert [s.request_id for s in out.preempted] == ["new"]
    new = sched.get("new")
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and sched.waiting.peek() is new
    assert new.output_token_ids == [7]  # keeps what it generated; recompute covers it
    # once old finishes, new is readmitted and recomputes prompt + output (9 tokens)
    sched.finish(sched.get("old"), FinishReason.STOP)
    out = run_step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("new", 9)]


def test_a_sequence_that_cannot_fit_alone_preempts_itself():
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add(make_seq("a", 8))
    run_step(sched)  # 8 tokens, 2 blocks, full; next token needs block 3
    out = run_step(sched)
    assert out.scheduled == [] and [s.request_id for s in out.preempted] == ["a"]


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    sched.add(make_seq("run", 8))
    sched.add(make_seq("wait", 4))
    run_step(sched)
    free_before = sched.block_manager.num_free_blocks
    seq = sched.abort("run")
    assert seq.finish_reason is FinishReason.ABORT and seq.is_finished
    assert sched.block_manager.num_free_blocks == free_before + 2
    assert sched.abort("wait").finish_reason is FinishReason.ABORT
    assert sched.abort("unknown") is None
    assert not sched.has_unfinished()


def test_duplicate_request_id_and_oversized_prompt_are_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add(make_seq("a", 3))
    with pytest.raises(ValueError, match="already"):
        sched.add(make_seq("a", 3))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(make_seq("big", 9))
    assert sched.num_unfinished == 1


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
