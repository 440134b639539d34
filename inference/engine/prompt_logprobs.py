"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

The hidden state at prompt position p predicts the token at p + 1, so a prefill chunk covering
positions [start, end) scores prompt tokens start + 1 .. end (the last prompt position predicts
the first output token instead: that row is the sampled one). Logprobs are the log-softmax of
the raw float32 logits (no penalties, no temperature), as vLLM's prompt_logprobs; the vocab-wide
logits are made a slice of rows at a time so a long prompt never holds [prompt, vocab] at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference.engine.outputs import TokenLogprob

# Rows turned into [rows, vocab] float32 logits at once (256 x 49152 x 4 B = 48 MiB).
ROWS_PER_SLICE = 256


@torch.inference_mode()
def score_prompt_tokens(
    hidden: torch.Tensor,
    targets: list[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    num_top: int,
) -> list[TokenLogprob]:
    """hidden [R, hidden]: the rows predicting `targets` (R token ids). Returns one TokenLogprob
    per target: its logprob, its rank (1 = the most likely token) and the `num_top` most likely
    tokens with their logprobs, best first."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), ROWS_PER_SLICE):
        hi = min(lo + ROWS_PER_SLICE, len(targets))
        logprobs = torch.log_softmax(compute_logits(hidden[lo:hi]).float(), dim=-1)  # [rows, vocab]
        ids = torch.tensor(targets[lo:hi], dtype=torch.long, device=logprobs.device)  # [rows]
        chosen = logprobs.gather(1, ids[:, None])  # [rows, 1]
        ranks = (logprobs > chosen).sum(dim=1) + 1  # [rows]
        top_values = top_ids = None
        if num_top:
            top = logprobs.topk(num_top, dim=-1)  # [rows, num_top] each
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for row, (token_id, value, rank) in enumerate(
            zip(targets[lo:hi], chosen[:, 0].tolist(), ranks.tolist(), strict=True)
        ):
            alternatives = tuple(zip(top_ids[row], top_values[row], strict=True)) if num_top else ()
            out.append(TokenLogprob(token_id, value, alternatives, rank))
    return out
