import pytest

from inference.engine.block_manager import BlockManager
from inference.engine.sequence import Sequence


def make_seq(n_prompt: int, rid: str = "r") -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(range(n_prompt)), params=None, max_model_len=4096)


def test_allocate_rounds_up_to_whole_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(9)
    assert bm.can_allocate(seq, 9)
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 7
    assert len(set(seq.block_table)) == 3


def test_append_takes_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(8)
    bm.allocate(seq, 8)
    seq.num_computed_tokens = 7  # one token of the prompt still to compute: fits
    assert bm.can_append(seq)
    bm.append(seq)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8  # next token starts block 3
    bm.append(seq)
    assert len(seq.block_table) == 3


def test_cannot_allocate_beyond_free_blocks_and_allocate_refuses():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(9)
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_free_returns_blocks_and_resets_progress():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(8, "a"), make_seq(8, "b")
    bm.allocate(a, 8)
    bm.allocate(b, 8)
    assert bm.num_free_blocks == 0 and bm.usage == 1.0
    a.num_computed_tokens = 8
    bm.free(a)
    assert bm.num_free_blocks == 2 and a.block_table == [] and a.num_computed_tokens == 0
    assert set(b.block_table).isdisjoint(range(0)) and bm.usage == 0.5


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0, "block_size": 4}, {"num_blocks": 4, "block_size": 0}])
def test_bad_sizes_are_rejected(kwargs):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(**kwargs)
