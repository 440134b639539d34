import pytest
import torch

from inference.engine.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingBatch,
    _cut_by_histogram,
    _cut_in_sorted,
    _draw_among,
    _draw_from_vocab,
    apply_penalties,
    make_generator,
)
from inference.engine.sampling_params import SamplingParams

sampler = Sampler()


def build(params, vocab_size, prompts=None, outputs=None, generators=None):
    n = len(params)
    return SamplingBatch.build(
        params=params,
        prompt_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=generators if generators is not None else [None] * n,
        vocab_size=vocab_size,
        device="cpu",
    )


def random_logits(n, v, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


# -- greedy ----------------------------------------------------------------------------------


def test_all_greedy_is_argmax_and_skips_every_other_stage():
    logits = random_logits(8, 1000)
    batch = build([SamplingParams(temperature=0)] * 8, 1000)
    assert batch.random is None and batch.penalties is None and batch.num_top_logprobs == 0
    out = sampler(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = random_logits(6, 500)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, top_p=0.5) for i in range(6)]
    out = sampler(logits, build(params, 500))
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))


# -- penalties (hand-computed) ---------------------------------------------------------------

RAW = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])  # [1, 5]
PROMPT = [[0, 1]]
OUTPUT = [[3, 3, 2]]  # token 3 twice, token 2 once


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # seen = prompt ∪ output = {0, 1, 2, 3}; positive / 2, negative * 2; token 4 unseen
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, 1.5, -0.5]),
        # output counts only (prompt tokens 0, 1 untouched): 2 -> 0.5 - 0.5, 3 -> 3 - 2 * 0.5
        ({"frequency_penalty": 0.5}, [2.0, -1.0, 0.0, 2.0, -0.5]),
        # once per distinct output token
        ({"presence_penalty": 0.5}, [2.0, -1.0, 0.0, 2.5, -0.5]),
        # negative = encourage repeats
        ({"frequency_penalty": -1.0}, [2.0, -1.0, 1.5, 5.0, -0.5]),
        # repetition first, then 3: 1.5 - 2 * 0.5 - 0.25, 2: 0.25 - 0.5 - 0.25
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
            [1.0, -2.0, -0.5, 0.25, -0.5],
        ),
    ],
)
def test_penalty_against_hand_computed_example(kwargs, expected):
    batch = build([SamplingParams(**kwargs)], 5, PROMPT, OUTPUT)
    raw = RAW.clone()
    penalised = apply_penalties(raw, batch)
    assert torch.equal(raw, RAW)  # the input is not modified
    assert torch.allclose(penalised, torch.tensor([expected]))


def test_penalties_only_touch_their_rows_and_change_the_greedy_choice():
    logits = RAW.repeat(3, 1)  # [3, 5]
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=1.0),
        SamplingParams(temperature=0, repetition_penalty=4.0),
    ]
    batch = build(params, 5, PROMPT * 3, OUTPUT * 3)
    penalised = apply_penalties(logits, batch)
    assert torch.equal(penalised[0], RAW[0])  # no penalty: bit for bit the raw row
    assert torch.allclose(penalised[1], torch.tensor([2.0, -1.0, -0.5, 1.0, -0.5]))
    assert torch.allclose(penalised[2], torch.tensor([0.5, -4.0, 0.125, 0.75, -0.5]))
    # argmax: raw 3 -> 0 with the frequency penalty; 0.75 (token 3) with the repetition one
    assert sampler(logits, batch).token_ids.tolist() == [3, 0, 3]


def test_first_step_without_output_penalises_only_prompt_tokens_for_repetition():
    params = [SamplingParams(frequency_penalty=1.0, presence_penalty=1.0, repetition_penalty=2.0)]
    penalised = apply_penalties(RAW, build(params, 5, PROMPT, [[]]))
    assert torch.equal(penalised, torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.5]]))
    assert torch.equal(apply_penalties(RAW, build(params, 5, [[]], [[]])), RAW)


def test_no_penalty_means_no_penalty_tensors():
    batch = build([SamplingParams(), SamplingParams(top_k=3)], 5, PROMPT * 2, OUTPUT * 2)
    assert batch.penalties is None
    only_presence = build([SamplingParams(presence_penalty=1)], 5, PROMPT, OUTPUT).penalties
    assert only_presence.repetition is None
    assert only_presence.positions.tolist() == [2, 3]  # sparse: only the output's tokens


def test_penalties_in_a_wide_batch_touch_only_seen_pairs():
    vocab = 1000
    logits = random_logits(4, vocab, seed=5)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4)] * 4
    prompts = [[i, 500 + i] for i in range(4)]
    outputs = [[10 * i + 1, 10 * i + 1, 999] for i in range(4)]
    penalised = apply_penalties(logits, build(params, vocab, prompts, outputs))
    expected = logits.clone()
    for i in range(4):
        for t in {*prompts[i], *outputs[i]}:
            x = expected[i, t]
            x = x / 1.3 if x > 0 else x * 1.3
            expected[i, t] = x - 0.4 * outputs[i].count(t)
    assert torch.allclose(penalised, expected)
    assert (penalised != logits).sum() == 4 * 4  # 4 distinct seen tokens per row


# -- filters never leave their allowed set ---------------------------------------------------

DRAWS = 4000
V = 50


def draw(logits_row, params):
    """DRAWS samples from one logits row (the row repeated; unseeded rows share one draw)."""
    out = sampler(logits_row.expand(DRAWS, -1).contiguous(), build([params] * DRAWS, V))
    return set(out.token_ids.tolist())


def allowed_top_p(probs, top_p):
    p, order = probs.double().sort(descending=True)
    before = p.cumsum(0) - p
    assert ((before - top_p).abs() > 1e-4).all()  # the example is not on a rounding boundary
    return set(order[before < top_p].tolist())


@pytest.fixture(scope="module")
def row():
    return random_logits(1, V, seed=7, scale=1.5)[0]  # [V]


def test_top_k_samples_only_the_k_most_likely(row):
    allowed = set(row.topk(5).indices.tolist())
    assert draw(row, SamplingParams(top_k=5)) == allowed  # inside, and every one is reachable


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.full((V,), -5.0)
    logits[:5] = torch.tensor([5.0, 4.0, 4.0, 4.0, 1.0])
    assert draw(logits, SamplingParams(top_k=2, temperature=2.0)) == {0, 1, 2, 3}


def test_top_p_samples_only_the_smallest_set_reaching_p(row):
    allowed = allowed_top_p(torch.softmax(row, 0), 0.6)
    assert 2 < len(allowed) < V
    assert draw(row, SamplingParams(top_p=0.6)) == allowed


def test_top_p_tiny_keeps_the_most_likely_token(row):
    assert draw(row, SamplingParams(top_p=1e-6)) == {int(row.argmax())}


def test_min_p_drops_tokens_below_fraction_of_max(row):
    probs = torch.softmax(row.double(), 0)
    ratio = probs / probs.max()
    assert ((ratio - 0.1).abs() > 1e-4).all()
    allowed = set(torch.nonzero(ratio >= 0.1).flatten().tolist())
    assert 2 < len(allowed) < V
    assert draw(row, SamplingParams(min_p=0.1)) == allowed


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(min_p=0.1, top_k=20),  # the top_k path
        SamplingParams(min_p=0.1, top_p=0.95),  # the top_p path, nucleus in the head
    ],
    ids=["with_top_k", "with_top_p"],
)
def test_min_p_combined_with_top_k_or_top_p(row, params):
    probs = torch.softmax(row.double(), 0)
    allowed = set(torch.nonzero(probs / probs.max() >= 0.1).flatten().tolist())
    # top_k 20 / top_p 0.95 are looser than min_p 0.1 here: min_p alone decides the set
    assert allowed <= set(row.topk(20).indices.tolist())
    assert allowed <= allowed_top_p(probs, 0.95)
    assert draw(row, params) == allowed


def test_temperature_then_top_k_then_top_p(row):
    # top_p acts on the distribution renormalised after temperature and top_k
    top10 = row.topk(10).indices
    probs = torch.zeros(V, dtype=torch.float64)
    probs[top10] = torch.softmax(row[top10].double() / 0.7, 0)
    allowed = allowed_top_p(probs, 0.8)
    assert 1 < len(allowed) < 10
    assert draw(row, SamplingParams(temperature=0.7, top_k=10, top_p=0.8)) == allowed


def test_top_p_with_a_nucleus_larger_than_the_candidate_head():
    # a flat distribution: the 0.9 nucleus holds far more than TOP_P_CANDIDATES tokens, so the
    # cut is found by the full-sort fallback; a peaked row in the same batch uses the head only
    vocab = 2000
    flat = random_logits(1, vocab, seed=3, scale=0.3)[0]
    peaked = random_logits(1, vocab, seed=4, scale=4.0)[0]
    allowed_flat = allowed_top_p(torch.softmax(flat, 0), 0.9)
    allowed_peaked = allowed_top_p(torch.softmax(peaked, 0), 0.9)
    assert len(allowed_flat) > 4 * TOP_P_CANDIDATES and len(allowed_peaked) < TOP_P_CANDIDATES
    n = 2000
    logits = torch.stack([flat, peaked]).repeat(n, 1)  # [2n, V]
    out = sampler(logits, build([SamplingParams(top_p=0.9)] * (2 * n), vocab))
    tokens = out.token_ids.view(n, 2)
    flat_drawn = set(tokens[:, 0].tolist())
    assert flat_drawn <= allowed_flat
    ranks = torch.argsort(torch.argsort(flat, descending=True))  # rank of each token
    assert max(ranks[t] for t in flat_drawn) > TOP_P_CANDIDATES  # beyond the candidate head
    assert set(tokens[:, 1].tolist()) <= allowed_peaked


def test_histogram_cut_equals_the_cut_on_the_sorted_row():
    # rows: flat, peaked, with ties at many values, with zeros (filtered tokens)
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.softmax(torch.randn(5000, generator=g) * 0.5, 0),
        torch.softmax(torch.randn(5000, generator=g) * 4, 0),
        torch.softmax(torch.randint(0, 40, (5000,), generator=g).float() / 8, 0),
        torch.softmax(torch.randn(5000, generator=g), 0) * (torch.rand(5000, generator=g) > 0.5),
    ]
    probs = torch.stack(rows)  # [4, 5000]
    for top_p in (0.05, 0.3, 0.5, 0.9, 0.99):
        column = torch.full((4, 1), top_p)
        reference = _cut_in_sorted(probs.sort(dim=-1, descending=True).values, column)
        cut = _cut_by_histogram(probs, column)
        # the same drawable set (zeros are never drawn; the last row's mass is only ~0.5, so
        # for top_p above that both cuts keep every positive probability)
        assert torch.equal((probs >= cut) & (probs > 0), (probs >= reference) & (probs > 0))
        assert torch.equal(cut[:3], reference[:3]), top_p


@pytest.mark.parametrize("vocab", [5, 600, 768])  # one short block; 2 blocks + a tail; 3 blocks
def test_draws_never_pick_a_zero_probability_token_even_at_the_extremes_of_u(vocab):
    probs = torch.zeros(3, vocab)
    probs[0, [1, 2]] = torch.tensor([0.3, 0.7])  # zeros before and after
    probs[1, [0, vocab - 2]] = 0.5  # the last kept token sits in the last block
    probs[2, vocab // 2] = 1.0
    for u, expected in ((0.0, [1, 0, vocab // 2]), (1 - 2**-53, [2, vocab - 2, vocab // 2])):
        u = torch.full((3, 1), u, dtype=torch.float64)
        assert _draw_from_vocab(probs, u).tolist() == expected
        ids = torch.arange(vocab).expand(3, -1)
        assert _draw_among(probs, ids, probs > 0, u, vocab).tolist() == expected


def test_a_draw_among_candidates_picks_what_the_vocabulary_draw_picks_for_the_same_u():
    # Candidates in any order (topk's, after filtering) are laid out in vocabulary order, so
    # for one u the compact draw and the full-vocabulary draw agree. Dyadic probabilities: no
    # rounding in either sum.
    vocab = 600
    ids = torch.tensor([[590, 3, 300, 257, 42, 511, 100, 7]])
    weights = torch.tensor([[1, 2, 4, 8, 16, 32, 64, 128]], dtype=torch.float32) / 256
    probs = torch.zeros(1, vocab).scatter_(1, ids, weights)
    keep = torch.ones_like(ids, dtype=torch.bool)
    for u in torch.linspace(0, 1 - 2**-20, 97, dtype=torch.float64):
        u = u.view(1, 1)
        assert _draw_among(weights, ids, keep, u, vocab) == _draw_from_vocab(probs, u)


def test_full_vocabulary_draw_matches_softmax_across_blocks():
    # V = 600: two blocks of 256 and a short one; the likely tokens sit in all three
    torch.manual_seed(99)
    vocab, n = 600, 20_000
    logits = torch.full((vocab,), -4.0)
    logits[[3, 255, 256, 300, 511, 512, 599]] = torch.tensor([1.0, 0.5, 0.0, 1.5, -0.5, 0.8, 1.2])
    out = sampler(logits.expand(n, -1).contiguous(), build([SamplingParams()] * n, vocab))
    freq = torch.bincount(out.token_ids, minlength=vocab).double() / n
    assert (freq - torch.softmax(logits.double(), 0)).abs().max() < 0.016


def test_filtered_rows_and_unfiltered_rows_share_a_batch(row):
    params = [SamplingParams(top_k=3), SamplingParams(), SamplingParams(top_p=0.3)] * 1000
    out = sampler(row.expand(len(params), -1).contiguous(), build(params, V))
    tokens = out.token_ids.view(-1, 3)
    assert set(tokens[:, 0].tolist()) == set(row.topk(3).indices.tolist())
    assert len(set(tokens[:, 1].tolist())) > 10  # no filter leaked onto the plain row
    assert set(tokens[:, 2].tolist()) == allowed_top_p(torch.softmax(row, 0), 0.3)


# -- the sampled distribution ----------------------------------------------------------------


LOGITS10 = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0, 1.5, 0.0])


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(temperature=1.0), range(10)),  # full vocabulary draw
        (SamplingParams(temperature=0.5), range(10)),
        (SamplingParams(temperature=0.7, top_k=4), [5, 8, 0, 1]),  # the top_k path
        (SamplingParams(top_p=0.8), [5, 8, 0, 1, 6]),  # the top_p path (head)
    ],
    ids=["t1", "t0.5", "top_k", "top_p"],
)
def test_empirical_frequencies_match_softmax(params, kept):
    torch.manual_seed(1234)  # unseeded rows use the default generator: keep the test exact
    n = 20_000
    out = sampler(LOGITS10.expand(n, -1).contiguous(), build([params] * n, 10))
    freq = torch.bincount(out.token_ids, minlength=10).double() / n
    kept = torch.tensor(list(kept))
    expected = torch.zeros(10, dtype=torch.float64)
    expected[kept] = torch.softmax(LOGITS10[kept].double() / params.temperature, 0)
    if params.top_p < 1:  # the nucleus: softmax mass of the kept set just reaches top_p
        full = torch.softmax(LOGITS10.double(), 0)
        assert full[kept].sum() >= params.top_p > full[kept[:-1]].sum()
    # binomial std <= sqrt(0.25 / 20000) = 0.0035; allow ~4.5 sigma
    assert (freq - expected).abs().max() < 0.016


def test_top_p_keeps_tokens_tied_with_the_last_kept_one():
    # LOGITS10 sorted: 5, 8, 0, 1, 6, then 2 and 9 tie (logit 0.0); top_p 0.85 is reached at 2
    n = 2000
    out = sampler(LOGITS10.expand(n, -1).contiguous(), build([SamplingParams(top_p=0.85)] * n, 10))
    assert set(out.token_ids.tolist()) == {5, 8, 0, 1, 6, 2, 9}


def test_seeded_rows_draw_every_token_with_softmax_frequencies():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    gens = [make_generator(s) for s in range(5000)]  # each row its own stream
    out = sampler(
        logits.expand(5000, -1).contiguous(),
        build([SamplingParams(seed=1)] * 5000, 4, generators=gens),
    )
    freq = torch.bincount(out.token_ids, minlength=4).double() / 5000
    assert (freq - torch.softmax(logits.double(), 0)).abs().max() < 0.03


# -- seeded reproducibility across batch compositions -------------------------------------------

VOCAB = 1001  # odd on purpose: rows of the batch are not vector-aligned
STEPS = 6
TARGETS = [
    SamplingParams(seed=1234, temperature=1.0),
    SamplingParams(seed=99, temperature=0.8, top_k=40),
    SamplingParams(seed=7, top_p=0.9, min_p=0.02),
    SamplingParams(seed=2**40, temperature=1.3, repetition_penalty=1.2, frequency_penalty=0.5),
]
OTHERS = [
    SamplingParams(),
    SamplingParams(temperature=0),
    SamplingParams(seed=5, top_p=0.5),
    SamplingParams(top_k=3, presence_penalty=1.0),
    # the same seed as a target, with other params
    SamplingParams(seed=1234, temperature=0.4, top_k=100),
    SamplingParams(min_p=0.3, repetition_penalty=0.8),
]


TARGET_PROMPT = [5, 17, 17, 400, 999, 3]


def run_steps(params, position, target_logits, seed_for_others):
    """STEPS steps of a batch with the target row at `position`; the target row's tokens.

    The target row always has TARGET_PROMPT and its own logits; the other rows get other
    prompts and logits drawn from `seed_for_others`. Outputs feed back (penalties see them).
    """
    n = len(params)
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    prompts = [[(7 * i + j) % VOCAB for j in range(20)] for i in range(n)]
    prompts[position] = TARGET_PROMPT
    outputs = [[] for _ in range(n)]
    other = torch.Generator().manual_seed(seed_for_others)
    for step in range(STEPS):
        logits = torch.randn(n, VOCAB, generator=other) * 3
        logits[position] = target_logits[step]
        out = sampler(logits, build(params, VOCAB, prompts, outputs, gens))
        for i, t in enumerate(out.token_ids.tolist()):
            outputs[i].append(t)
    return outputs[position]


@pytest.mark.parametrize("target", TARGETS, ids=lambda p: f"seed{p.seed}")
def test_seeded_row_gives_same_tokens_alone_and_anywhere_in_a_batch(target):
    target_logits = random_logits(STEPS, VOCAB, seed=target.seed % 1000, scale=2.0)
    alone = run_steps([target], 0, target_logits, seed_for_others=0)
    assert len(set(alone)) > 1  # really random, not a constant

    others = (OTHERS * 3)[:15]
    for position, seed_for_others in ((0, 1), (9, 2), (15, 3)):
        batch = others[:position] + [target] + others[position:]  # 16 rows
        assert run_steps(batch, position, target_logits, seed_for_others) == alone, position


def test_different_seeds_give_different_sequences():
    logits = random_logits(STEPS, VOCAB, seed=3, scale=1.0)
    runs = {tuple(run_steps([SamplingParams(seed=s)], 0, logits, 0)) for s in range(4)}
    assert len(runs) == 4


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_chosen_and_top_ids():
    logits = random_logits(6, 300, seed=11)
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0),
        SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(logprobs=5, frequency_penalty=2.0, top_k=4),
        SamplingParams(logprobs=1, seed=3),
        SamplingParams(logprobs=2, temperature=0, presence_penalty=-2.0),
    ]
    outputs = [[1, 2, 3, int(logits[i].argmax())] for i in range(6)]
    batch = build(
        params, 300, [[4, 5]] * 6, outputs, [None, None, None, None, make_generator(3), None]
    )
    out = sampler(logits, batch)
    expected = torch.log_softmax(logits.double(), -1)  # raw: before penalties and temperature
    chosen = expected.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs.double(), chosen, atol=1e-5)

    ids, values = out.top_logprobs
    assert ids.shape == values.shape == (6, 5)  # k = the largest request in the batch
    assert torch.equal(ids, expected.topk(5).indices)
    assert torch.allclose(values.double(), expected.gather(1, ids), atol=1e-5)
    assert (values[:, :-1] >= values[:, 1:]).all()  # sorted descending


def test_no_logprobs_unless_requested():
    logits = random_logits(2, 50)
    out = sampler(logits, build([SamplingParams(), SamplingParams(temperature=0)], 50))
    assert out.logprobs is None and out.top_logprobs is None


def test_no_top_logprobs_unless_requested():
    logits = random_logits(2, 50)
    assert (
        sampler(logits, build([SamplingParams(), SamplingParams(logprobs=0)], 50)).top_logprobs
        is None
    )


# -- bad input -----------------------------------------------------------------------------------


def test_build_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="^generators"):
        SamplingBatch.build([SamplingParams()] * 2, [[]] * 2, [[]] * 2, [None], 10, "cpu")
    with pytest.raises(ValueError, match="^output_ids"):
        SamplingBatch.build([SamplingParams()] * 2, [[]] * 2, [[]], [None] * 2, 10, "cpu")


def test_build_requires_a_generator_for_a_seeded_row():
    with pytest.raises(ValueError, match=r"^generators\[1\]"):
        build([SamplingParams(), SamplingParams(seed=1)], 10)


def test_build_rejects_token_ids_outside_the_vocab():
    with pytest.raises(ValueError, match=r"^output_ids\[1\]"):
        build([SamplingParams(), SamplingParams(frequency_penalty=1)], 10, outputs=[[1], [3, 10]])
    with pytest.raises(ValueError, match=r"^prompt_ids\[0\]"):
        build([SamplingParams(repetition_penalty=1.1)], 10, prompts=[[-1]])


def test_sampler_rejects_logits_of_the_wrong_shape():
    with pytest.raises(ValueError, match="^logits"):
        sampler(torch.zeros(2, 11), build([SamplingParams()] * 2, 10))
