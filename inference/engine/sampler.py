"""Pick the next token of every sequence in a step, vectorised over the batch.

Pipeline per row (vLLM / OpenAI semantics); a stage is skipped when no row needs it, because
this runs on every step:

    logits                  raw model output [N, V] float32 (never modified; logprobs use it)
    grammar mask            structured-output rows: tokens their grammar forbids -> -inf
    logit_bias              rows with a bias: logit[token] += bias
    repetition penalty      tokens in prompt or output: logit > 0 -> logit / r, else logit * r
    frequency, presence     logit -= f * count_in_output + p * (count_in_output > 0)
    greedy rows             token = argmax(penalised logits)   (temperature 0)
    random rows:
      temperature           logits / t
      top_k                 keep logits >= the k-th largest
      top_p                 keep the smallest most-likely set whose probability (renormalised
                            after top_k) sums to >= top_p; the most likely token always stays
      min_p                 drop tokens with prob < min_p * max prob
      sample                inverse CDF over the kept tokens in vocabulary order: one uniform
                            u per row, token = first whose cumulative probability > u * total

Ties: top_k and top_p cut at a value (the k-th logit, the last kept probability), so tokens tied
with the last kept one are kept too; the kept set is then a function of the row's values alone.

Where the work goes (N x V is large: 64 x 49152 floats is 12 MiB, and every full pass over it
costs milliseconds on a CPU):
- Penalties are sparse: only the (row, token) pairs seen in a prompt or output are gathered and
  scattered back, through their flat index row * V + token.
- Rows with top_k never leave their candidates: one partial topk of the logits, then
  temperature, top_p, min_p and the draw on [rows, k] (in float64).
- Other random rows take one softmax over the vocabulary. A top_p row whose nucleus lies within
  its TOP_P_CANDIDATES most likely tokens (the usual case) is drawn from those; the rest draw
  from the whole vocabulary with a two-level inverse CDF (block sums, then one block). Nothing
  sorts the whole vocabulary: a flat row's top_p cut comes from histograms of the float bits.
- The draw needs one random number per row (not V, as the exponential race argmax(p / q) with
  q ~ Exp(1) does: drawing 64 x 49152 of those alone took ~40-90 ms per step on this CPU).

Per-request seeds: a row with a torch.Generator draws its uniform from that generator alone,
one per step, so its tokens do not depend on the batch's size, order or other rows (which path
a row takes depends on its own parameters and logits only). Rows without a generator share one
draw from the default generator.

Logprobs (like vLLM's default "raw_logprobs"): log_softmax of the RAW logits, i.e. the model's
own distribution before the grammar mask, logit_bias, penalties, temperature and filtering, at
the chosen token and the top k.

Logits processors (the grammar mask and logit_bias) come first, as in vLLM, and touch only the
rows that use them: the others are copied bit for bit, so an unconstrained request samples the
same tokens whatever shares its batch. The mask arrives as llguidance's packed bitmask
[C, ceil(V / 32)] int32 for the C constrained rows, is unpacked to [C, V] of 0 / -inf by one
table lookup per byte and added to those rows with one index_add_; the biases are one
index_add_ over the flat (row * V + token) positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from inference.engine.sampling_params import SamplingParams, SamplingType

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "apply_logits_processors",
    "apply_penalties",
    "make_generator",
]

# top_p rows (without top_k) look for their cut among their TOP_P_CANDIDATES most likely tokens
# (a partial topk is far cheaper than sorting the vocabulary); a row whose nucleus is larger
# (a very flat distribution) finds it with _cut_by_histogram instead.
TOP_P_CANDIDATES = 256
# Full-vocabulary draws: block sums first, then the cumulative sum of one block.
_BLOCK = 256


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for a seeded request; keep it for the request's whole life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class _Penalties:
    positions: torch.Tensor  # [K] long, row * V + token of every (row, token) a penalty touches
    repetition: torch.Tensor | None  # [K] float32 the pair's row's penalty; None = unused
    subtract: torch.Tensor | None  # [K] float32 f * count + p * (count > 0); None = unused


@dataclass(frozen=True)
class _TokenMask:
    rows: torch.Tensor  # [C] long, the constrained rows
    bitmask: torch.Tensor  # [C, W] int32, bit j of word w allows token 32 * w + j


@dataclass(frozen=True)
class _LogitBias:
    positions: torch.Tensor  # [K] long, row * V + token
    values: torch.Tensor  # [K] float32


@dataclass(frozen=True)
class _Group:
    """Random rows that take the same path, with their settings as [G, 1] columns."""

    positions: torch.Tensor | None  # [G] long positions among the random rows; None = all
    temperature: torch.Tensor | None  # [G, 1] float32; None = all 1.0
    top_k: torch.Tensor | None  # [G, 1] long in 1..V-1 (top_k group only)
    top_k_max: int  # largest top_k in the group (top_k group only)
    top_p: torch.Tensor | None  # [G, 1] float32, inf = off; None = no row uses top_p
    min_p: torch.Tensor | None  # [G, 1] float32, 0 = off; None = no row uses min_p

    def select(self, rows: torch.Tensor) -> _Group:
        """The settings of a subset of the group's rows ([S] long positions in the group)."""

        def pick(column: torch.Tensor | None) -> torch.Tensor | None:
            return None if column is None else column[rows]

        return _Group(
            positions=None,
            temperature=pick(self.temperature),
            top_k=pick(self.top_k),
            top_k_max=self.top_k_max,
            top_p=pick(self.top_p),
            min_p=pick(self.min_p),
        )


@dataclass(frozen=True)
class _RandomRows:
    rows: torch.Tensor | None  # [R] long rows of the batch sampled at random; None = all rows
    top_k_group: _Group | None  # rows with top_k: they sample among their candidates only
    vocab_group: _Group | None  # the others: one softmax over the whole vocabulary
    seeded: tuple[tuple[int, torch.Generator], ...]  # (position in R, the row's generator)
    unseeded: torch.Tensor | None  # [U] long positions in R without one; None = all of R


@dataclass(frozen=True)
class SamplingBatch:
    """Everything the sampler needs for one step, built once per step from the requests."""

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor | None  # [G] long; None = no greedy row
    random: _RandomRows | None  # None = every row is greedy
    penalties: _Penalties | None  # None = no row uses a penalty
    wants_logprobs: bool  # some row asked for logprobs (0 counts: the chosen token's)
    num_top_logprobs: int  # largest `logprobs` in the batch; 0 = no top_logprobs
    token_mask: _TokenMask | None = None  # None = no row is constrained by a grammar
    logit_bias: _LogitBias | None = None  # None = no row has a logit_bias

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        constrained_rows: Sequence[int] = (),
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """constrained_rows / token_bitmask: the rows a grammar constrains and their allowed
        tokens, [len(constrained_rows), W] int32 packed bits (W * 32 may differ from vocab_size:
        bits past vocab_size are ignored, tokens past W * 32 are forbidden)."""
        n = len(params)
        for name, value in (
            ("prompt_ids", prompt_ids),
            ("output_ids", output_ids),
            ("generators", generators),
        ):
            if len(value) != n:
                raise ValueError(f"{name} must have one entry per row ({n}), got {len(value)}")
        if n == 0:
            raise ValueError("params must not be empty")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = torch.device(device)

        types = [p.sampling_type for p in params]
        greedy = [i for i, t in enumerate(types) if t is SamplingType.GREEDY]
        random = [i for i, t in enumerate(types) if t is not SamplingType.GREEDY]
        for i in random:
            g = generators[i]
            if types[i] is SamplingType.RANDOM_SEEDED and g is None:
                raise ValueError(f"generators[{i}]: a request with a seed needs its own generator")
            if g is not None and torch.device(g.device).type != device.type:
                raise ValueError(f"generators[{i}] is on {g.device}, the batch on {device}")

        random_rows = None
        if random:
            random_rows = _build_random(
                [params[i] for i in random],
                [generators[i] for i in random],
                _rows(random, n, device),
                vocab_size,
                device,
            )
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            greedy_rows=_rows(greedy, n, device) if greedy else None,
            random=random_rows,
            penalties=_build_penalties(params, prompt_ids, output_ids, vocab_size, device),
            wants_logprobs=any(p.logprobs is not None for p in params),
            num_top_logprobs=max((p.logprobs or 0 for p in params), default=0),
            token_mask=_build_token_mask(constrained_rows, token_bitmask, n, device),
            logit_bias=_build_logit_bias(params, vocab_size, device),
        )


def _rows(indices: list[int], n: int, device: torch.device) -> torch.Tensor | None:
    # None when the subset is the whole batch: the stage then runs on the tensor as is, no gather.
    if len(indices) == n:
        return None
    return torch.tensor(indices, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [rows, 1]


def _build_random(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    rows: torch.Tensor | None,
    vocab_size: int,
    device: torch.device,
) -> _RandomRows:
    with_top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size]
    without = [i for i, p in enumerate(params) if not 0 < p.top_k < vocab_size]
    seeded = tuple((pos, g) for pos, g in enumerate(generators) if g is not None)
    unseeded = [pos for pos, g in enumerate(generators) if g is None]
    return _RandomRows(
        rows=rows,
        top_k_group=_build_group(params, with_top_k, True, device) if with_top_k else None,
        vocab_group=_build_group(params, without, False, device) if without else None,
        seeded=seeded,
        unseeded=(
            torch.tensor(unseeded, dtype=torch.long, device=device) if seeded and unseeded else None
        ),
    )


def _build_group(
    params: list[SamplingParams], members: list[int], with_top_k: bool, device: torch.device
) -> _Group:
    sub = [params[i] for i in members]
    temps = [p.temperature for p in sub]
    top_ks = [p.top_k for p in sub]
    top_k = None
    if with_top_k:
        top_k = torch.tensor(top_ks, dtype=torch.long, device=device).unsqueeze(1)
    top_p = None
    if any(p.top_p < 1 for p in sub):
        # top_p = 1 is stored as inf so that a cumulative sum rounding to a hair above 1 can
        # never cut a tail token from a row that did not ask for top_p.
        top_p = _column([p.top_p if p.top_p < 1 else float("inf") for p in sub], device)
    return _Group(
        positions=_rows(members, len(params), device),
        temperature=_column(temps, device) if any(t != 1.0 for t in temps) else None,
        top_k=top_k,
        top_k_max=max(top_ks) if with_top_k else 0,
        top_p=top_p,
        min_p=_column([p.min_p for p in sub], device) if any(p.min_p > 0 for p in sub) else None,
    )


def _build_token_mask(
    rows: Sequence[int], bitmask: torch.Tensor | None, n: int, device: torch.device
) -> _TokenMask | None:
    if bitmask is None:
        if rows:
            raise ValueError("token_bitmask is required with constrained_rows")
        return None
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != len(rows):
        raise ValueError(
            f"token_bitmask must be [{len(rows)}, W] int32, got {list(bitmask.shape)} {bitmask.dtype}"
        )
    if not rows:
        return None
    if not all(0 <= r < n for r in rows) or len(set(rows)) != len(rows):
        raise ValueError(f"constrained_rows must be distinct rows in [0, {n}), got {list(rows)}")
    return _TokenMask(
        rows=torch.tensor(list(rows), dtype=torch.long, device=device),
        bitmask=bitmask.to(device, non_blocking=True),
    )


def _build_logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> _LogitBias | None:
    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not biased:
        return None
    positions, values = [], []
    for i, bias in biased:
        for token_id, value in bias.items():
            if token_id >= vocab_size:
                raise ValueError(f"logit_bias: token id {token_id} is outside [0, {vocab_size})")
            positions.append(i * vocab_size + token_id)
            values.append(value)
    return _LogitBias(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> _Penalties | None:
    counted = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
    if not counted and not repeated:
        return None
    uses = sorted(set(counted) | set(repeated))

    # Output tokens of every row with a penalty; prompt tokens only where repetition needs them.
    out_keys = _flat_keys(uses, output_ids, "output_ids", vocab_size, device)  # [T_out]
    out_positions, out_counts = torch.unique(out_keys, return_counts=True)  # [K_out] sorted
    positions, counts = out_positions, out_counts.float()
    if repeated:
        prompt_keys = _flat_keys(repeated, prompt_ids, "prompt_ids", vocab_size, device)
        positions, inverse = torch.unique(
            torch.cat([out_positions, prompt_keys]), return_inverse=True
        )  # [K]; inverse maps each input key to its slot
        counts = torch.zeros(positions.numel(), dtype=torch.float32, device=device)
        counts[inverse[: out_positions.numel()]] = out_counts.float()  # prompt-only pairs: 0
    row = positions // vocab_size  # [K] batch row of each pair

    def per_pair(field: str) -> torch.Tensor:  # [K] the field's value in each pair's row
        column = torch.tensor([getattr(p, field) for p in params], device=device)
        return column.float()[row]

    subtract = None
    if counted:
        subtract = per_pair("frequency_penalty") * counts + per_pair("presence_penalty") * (
            counts > 0
        )
    return _Penalties(
        positions=positions,
        repetition=per_pair("repetition_penalty") if repeated else None,
        subtract=subtract,
    )


def _flat_keys(
    rows: list[int],
    ids: Sequence[Sequence[int]],
    name: str,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[T] long: row * V + token for every token of the given rows (ragged rows, no padding)."""
    lengths = [len(ids[i]) for i in rows]
    flat = torch.tensor(list(chain.from_iterable(ids[i] for i in rows)), dtype=torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        for i in rows:
            bad = next((t for t in ids[i] if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}[{i}] has token id {bad} outside [0, {vocab_size})")
    offsets = torch.tensor(rows, dtype=torch.long).repeat_interleave(torch.tensor(lengths))
    return (offsets * vocab_size + flat).to(device)


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    # [N] float32 log-softmax of the raw logits at token_ids; None when no row asked for logprobs
    logprobs: torch.Tensor | None
    # (ids [N, k] long, values [N, k] float32), k = the batch's largest `logprobs`, sorted
    # descending per row; a row uses its own first params.logprobs columns. None when k == 0.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


class Sampler:
    """Stateless; `Sampler()(logits, batch)` once per step."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits must be [{batch.num_rows}, {batch.vocab_size}], got {list(logits.shape)}"
            )
        raw = logits.float()  # [N, V]; never modified in place
        processed = apply_logits_processors(raw, batch)  # [N, V]; `raw` itself when none apply
        penalised = apply_penalties(processed, batch)  # [N, V]; its input itself when no penalties

        if batch.random is None:
            token_ids = penalised.argmax(dim=-1)  # [N]
        elif batch.greedy_rows is None:
            token_ids = _sample(penalised, batch.random, owned=penalised is not raw)
        else:
            token_ids = torch.empty(batch.num_rows, dtype=torch.long, device=raw.device)
            token_ids[batch.greedy_rows] = penalised[batch.greedy_rows].argmax(dim=-1)
            token_ids[batch.random.rows] = _sample(
                penalised[batch.random.rows], batch.random, owned=True
            )

        chosen = top = None
        if batch.wants_logprobs:
            logprobs = torch.log_softmax(raw, dim=-1)  # [N, V]
            chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [N]
            if batch.num_top_logprobs > 0:
                values, ids = logprobs.topk(batch.num_top_logprobs, dim=-1)  # [N, k] descending
                top = (ids, values)
        return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=top)


# Unpacking the grammar bitmask by bytes: row b = what byte value b adds to its 8 tokens' logits
# (bit i set: 0, allowed; clear: -inf). [256, 8] float32.
_BYTE_TO_ADD = torch.where(
    ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, -torch.inf
)


def apply_logits_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> logits with the grammar masks (forbidden -> -inf) and logit_bias applied
    to the rows that have them [N, V]. Returns `logits` itself when no row has either, else a
    new tensor (the input untouched; the other rows copied unchanged)."""
    mask, bias = batch.token_mask, batch.logit_bias
    if mask is None and bias is None:
        return logits
    out = logits.clone()  # [N, V]
    if mask is not None:
        out.index_add_(0, mask.rows, _unpack_bitmask(mask.bitmask, out.shape[1]))
    if bias is not None:
        out.view(-1).index_add_(0, bias.positions, bias.values)
    return out


def _unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[C, W] int32 packed -> [C, vocab_size] float32 to add to the logits: 0 where allowed,
    -inf elsewhere (tokens past W * 32 too). One table lookup per byte: the int32 words are
    little-endian (x86, CUDA), so byte k of word w holds tokens 32 * w + 8 * k + 0..7."""
    rows, words = bitmask.shape
    table = _BYTE_TO_ADD.to(bitmask.device)
    add = torch.nn.functional.embedding(bitmask.view(torch.uint8).int(), table)  # [C, 4W, 8]
    add = add.view(rows, words * 32)
    if words * 32 >= vocab_size:
        return add[:, :vocab_size]
    pad = torch.full((rows, vocab_size - words * 32), -torch.inf, device=bitmask.device)
    return torch.cat([add, pad], dim=1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [N, V] -> repetition, frequency and presence penalised logits [N, V].

    Returns `logits` itself when no row has a penalty, else a new tensor (the input untouched).
    """
    pen = batch.penalties
    if pen is None:
        return logits
    out = logits.clone()  # [N, V]
    flat = out.view(-1)  # [N * V]
    x = flat[pen.positions]  # [K] the touched logits
    if pen.repetition is not None:
        x = torch.where(x > 0, x / pen.repetition, x * pen.repetition)
    if pen.subtract is not None:
        x = x - pen.subtract
    flat[pen.positions] = x
    return out


def _sample(logits: torch.Tensor, rnd: _RandomRows, owned: bool) -> torch.Tensor:
    """logits [R, V] (penalised; `owned` = ours to modify in place) -> sampled token ids [R]."""
    u = _uniforms(rnd, logits.shape[0], logits.device)  # [R, 1] float64 in [0, 1)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for group, sample_group in (
        (rnd.top_k_group, _sample_top_k),
        (rnd.vocab_group, _sample_vocab),
    ):
        if group is None:
            continue
        if group.positions is None:
            return sample_group(logits, group, u, owned)
        tokens[group.positions] = sample_group(
            logits[group.positions], group, u[group.positions], True
        )
    return tokens


def _sample_top_k(logits: torch.Tensor, g: _Group, u: torch.Tensor, owned: bool) -> torch.Tensor:
    """Rows with top_k: logits [G, V] -> token ids [G], working on the candidates only."""
    vocab = logits.shape[1]
    # One candidate beyond the largest k shows whether a row's k-th value is tied with tokens
    # past the candidates; such rows (ties to keep that were not fetched) take all V.
    tokens, spill = _sample_candidates_top_k(logits, g, u, min(g.top_k_max + 1, vocab))
    if spill is not None:
        tokens[spill] = _sample_candidates_top_k(logits[spill], g.select(spill), u[spill], vocab)[0]
    return tokens


def _sample_candidates_top_k(
    logits: torch.Tensor, g: _Group, u: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (token ids [G], [S] rows whose tie at the k-th value may reach past k, or None)."""
    values, ids = logits.topk(k, dim=-1)  # [G, k] descending
    kth = values.gather(1, g.top_k - 1)  # [G, 1]
    keep = values >= kth  # [G, k]
    spill = None
    if k < logits.shape[1]:
        tied_to_end = (values[:, -1] == kth[:, 0]).nonzero().squeeze(1)
        spill = tied_to_end if tied_to_end.numel() else None
    # Temperature on k values instead of V: dividing by t > 0 does not reorder the logits.
    scaled = values.double()
    if g.temperature is not None:
        scaled = scaled / g.temperature.double()
    probs = torch.softmax(scaled.masked_fill(~keep, -torch.inf), dim=-1)  # [G, k] descending
    if g.top_p is not None:
        keep &= probs >= _cut_in_sorted(probs, g.top_p)
    if g.min_p is not None:
        keep &= probs >= g.min_p.double() * probs[:, :1]
    return _draw_among(probs, ids, keep, u, logits.shape[1]), spill


def _sample_vocab(logits: torch.Tensor, g: _Group, u: torch.Tensor, owned: bool) -> torch.Tensor:
    """Rows without top_k: logits [G, V] -> token ids [G]."""
    if g.temperature is not None:
        logits = logits.div_(g.temperature) if owned else logits / g.temperature
    probs = torch.softmax(logits, dim=-1)  # [G, V]
    if g.top_p is None:
        if g.min_p is not None:
            probs.masked_fill_(probs < g.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return _draw_from_vocab(probs, u)

    head, head_ids = probs.topk(min(TOP_P_CANDIDATES, probs.shape[1]), dim=-1)  # [G, c] desc
    cut = _cut_in_sorted(head, g.top_p)  # [G, 1]; 0 where top_p is off
    uses_top_p = torch.isfinite(g.top_p).squeeze(1)  # [G]
    fits = uses_top_p  # [G] the nucleus lies within the head
    if head.shape[1] < probs.shape[1]:
        # The head's last value below the cut: the cut is inside and no tie runs past it.
        fits = fits & (head[:, -1] < cut[:, 0])
        spill = _where(uses_top_p & ~fits)  # the nucleus is larger than the head
        if spill is None:
            cut = _cut_by_histogram(probs, g.top_p)
        elif spill is not _NONE:
            cut[spill] = _cut_by_histogram(probs[spill], g.top_p[spill])

    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    rows = _where(fits)
    if rows is not _NONE:  # draw among the head
        head, head_ids, head_cut = _take(head, rows), _take(head_ids, rows), _take(cut, rows)
        keep = head >= head_cut  # [F, c]
        if g.min_p is not None:
            keep &= head >= _take(g.min_p, rows) * head[:, :1]
        picked = _draw_among(head, head_ids, keep, _take(u, rows), probs.shape[1])
        if rows is None:
            return picked
        tokens[rows] = picked
    rows = _where(~fits)
    if rows is not _NONE:  # draw from the whole vocabulary
        rest = _take(probs, rows)  # [W, V] ours: `probs` itself or a copy of its rows
        rest.masked_fill_(rest < _take(cut, rows), 0.0)
        if g.min_p is not None:
            rest.masked_fill_(rest < _take(g.min_p, rows) * rest.amax(dim=-1, keepdim=True), 0.0)
        picked = _draw_from_vocab(rest, _take(u, rows))
        if rows is None:
            return picked
        tokens[rows] = picked
    return tokens


_NONE = torch.empty(0, dtype=torch.long)  # _where's answer for "no row"


def _where(mask: torch.Tensor) -> torch.Tensor | None:
    """[G] bool -> None when every row is set (no gather needed), _NONE when none is, else the
    [S] long indices."""
    if bool(mask.all()):
        return None
    if not bool(mask.any()):
        return _NONE
    return mask.nonzero().squeeze(1)


def _take(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def _cut_in_sorted(values: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """values [G, k] descending -> [G, 1] the last value top_p keeps (the smallest set reaching
    top_p: keep while the mass of the more likely values is < top_p; the first always stays).
    Rows with top_p off (inf) get 0: keep everything."""
    # float64 running sum: it must not drift over thousands of tiny probabilities
    before = values.cumsum(dim=-1, dtype=torch.float64) - values  # [G, k]
    kept = (before < top_p).sum(dim=-1, keepdim=True)  # [G, 1] in 1..k
    return values.gather(1, kept - 1).masked_fill(~torch.isfinite(top_p), 0.0)


# (shift, width) of the bit fields of a float32 the histogram levels look at: 12 exponent and
# top mantissa bits, the next 12, the last 7. Sign bit: probabilities are >= 0.
_HISTOGRAM_LEVELS = ((19, 12), (7, 12), (0, 7))


def _cut_by_histogram(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [S, V] (>= 0), top_p [S, 1] finite -> [S, 1] the top_p cut, as _cut_in_sorted
    would find it on the sorted row, without sorting (a full sort of 64 x 49152 is ~0.4 s here).

    The cut is the smallest value v with mass(p > v) < top_p. For p >= 0 the float32 bit
    pattern read as an int orders like the value, so narrow it down field by field: per level,
    histogram the mass of the candidates by the next bit field, take the lowest non-empty bin
    whose mass above (plus all mass above the candidates) is < top_p, and keep only that bin.
    After the last level the bin is one exact float value: the cut."""
    rows = probs.shape[0]
    # Big temporaries are allocated once and reused across levels: fresh multi-MiB buffers cost
    # page faults on every step. scatter_add_ wants int64 bins, so widen the bits once.
    bits = probs.view(torch.int32).long()  # [S, V]
    key = torch.empty_like(bits)  # [S, V] bin of each token at this level
    mass = torch.empty_like(probs)  # [S, V] probability of the tokens still in the running
    prefix = torch.zeros(rows, 1, dtype=torch.long, device=probs.device)  # bits chosen so far
    above = torch.zeros(rows, 1, dtype=torch.float64, device=probs.device)
    for level, (shift, width) in enumerate(_HISTOGRAM_LEVELS):
        if level:  # keep only the tokens in the bin chosen so far
            in_bin = torch.bitwise_right_shift(bits, shift + width, out=key) == prefix
            torch.mul(probs, in_bin, out=mass)
        torch.bitwise_right_shift(bits, shift, out=key).bitwise_and_((1 << width) - 1)
        bins = torch.zeros(rows, 1 << width, device=probs.device)
        bins = bins.scatter_add_(1, key, mass if level else probs).double()  # [S, bins]
        # Mass strictly above each bin. An empty bin below the cut's bin has all the mass of
        # the cut's bin above it, so it never qualifies (unless the whole row holds < top_p:
        # then the cut ends near 0 and everything is kept, as it should be).
        higher = above + bins.flip(-1).cumsum(-1).flip(-1) - bins  # [S, bins]
        chosen = (higher < top_p).byte().argmax(dim=-1, keepdim=True)  # [S, 1] the lowest
        above = higher.gather(1, chosen)
        prefix = (prefix << width) | chosen
    return prefix.int().view(torch.float32)


def _uniforms(rnd: _RandomRows, rows: int, device: torch.device) -> torch.Tensor:
    """[R, 1] float64 in [0, 1): seeded rows from their own generator, the rest in one draw."""
    if not rnd.seeded:
        return torch.rand(rows, 1, dtype=torch.float64, device=device)
    u = torch.empty(rows, 1, dtype=torch.float64, device=device)
    for pos, generator in rnd.seeded:
        u[pos] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)
    if rnd.unseeded is not None:
        u[rnd.unseeded] = torch.rand(rnd.unseeded.numel(), 1, dtype=torch.float64, device=device)
    return u


def _draw_among(
    probs: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, u: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Inverse CDF among candidates: probs [G, k] (unnormalised), ids [G, k], keep [G, k]
    (at least one per row), u [G, 1] -> token ids [G].

    Kept candidates are laid out in vocabulary order first, so the draw does not depend on how
    many candidates were fetched or how topk ordered ties."""
    order = torch.where(keep, ids, ids + vocab).argsort(dim=-1)  # [G, k] kept first, by id
    weights = probs.double().masked_fill(~keep, 0.0).gather(1, order)
    return ids.gather(1, order).gather(1, _inverse_cdf(weights, u)).squeeze(1)


def _draw_from_vocab(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the whole vocabulary: probs [G, V] (unnormalised, >= 0) -> ids [G].

    Two levels, so that no [G, V] cumulative sum is built: pick the block by the cumulative
    sum of block sums, then the token by the cumulative sum within that block."""
    rows, vocab = probs.shape
    full = vocab // _BLOCK * _BLOCK
    sums = [probs[:, :full].unflatten(1, (-1, _BLOCK)).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(probs[:, full:].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=1).double().cumsum(dim=-1)  # [G, blocks]
    target = u * block_cdf[:, -1:]  # [G, 1]
    block = torch.searchsorted(block_cdf, target, right=True)  # [G, 1] its block sum is > 0
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    index = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)  # [G, B]
    inside = index < vocab  # the last block may be short
    weights = probs.gather(1, index.clamp(max=vocab - 1)).double().masked_fill(~inside, 0.0)
    # The block sum was added in float32: keep the residual inside the block's exact total.
    within = weights.cumsum(dim=-1)  # [G, B]
    total = within[:, -1:]
    residual = torch.minimum(target - before, torch.nextafter(total, torch.zeros_like(total)))
    offset = torch.searchsorted(within, residual.clamp(min=0.0), right=True)  # [G, 1]
    return (block * _BLOCK + offset).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [G, k] float64 (>= 0, some > 0), u [G, 1] in [0, 1) -> [G, 1] positions.

    The position is the first i with cdf[i] > u * total. Then cdf[i - 1] <= u * total < cdf[i],
    so cdf grows at i: a weight of 0 (a filtered-out token) is never chosen. u <= 1 - 2**-53
    (float64 rand) makes u * total < total exactly, so some i exists."""
    cdf = weights.cumsum(dim=-1)  # [G, k]
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
