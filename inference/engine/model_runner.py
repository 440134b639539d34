"""Turns the scheduler's decision into one forward pass over a flattened batch.

Every scheduled sequence contributes its new tokens back to back:

    tokens       [T]  seq0's chunk | seq1's decode token | seq2's chunk | ...
    positions    [T]  where each token sits in its sequence
    token_slots  [T]  adapter slot per token (-1: base model), host-side

Two pieces of per-step metadata are built here once and passed down the model's forward to
every layer: the attention metadata (block tables, slot mapping, masks) and the LoRA batch
metadata (the tokens grouped by adapter slot; None when no token has an adapter). Only
sequences whose chunk reaches their end are sampled, so logits are computed for those rows
alone: [num_sampled, vocab]. A sequence asking for prompt logprobs also hands back the hidden
rows of its chunk that predict prompt tokens (prompt_logprobs.py turns them into logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.engine.scheduler import ScheduledSeq
from inference.layers.attention import KVCache
from inference.layers.attention_metadata import AttentionMetadata, build_attention_metadata
from inference.lora.slots import LoRASlots
from kernels.metadata import LoRABatchMetadata


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_meta: AttentionMetadata
    lora_meta: LoRABatchMetadata | None  # None: no token of this step has an adapter
    sample_rows: torch.Tensor  # [num_sampled] long: index into T of each sampled sequence's last token
    # index into `scheduled` -> (first row in T, row count): the rows of a prompt-logprobs
    # sequence's chunk at prompt positions start .. min(end, prompt_len - 1) - 1, each predicting
    # the prompt token after it.
    prompt_rows: dict[int, tuple[int, int]]


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor  # [num_sampled, vocab] float32, in `scheduled` order
    prompt_hidden: dict[int, torch.Tensor]  # index into `scheduled` -> [rows, hidden] (BatchInputs.prompt_rows)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        block_size: int,
        device: torch.device,
        lora_slots: LoRASlots | None = None,
        decode_kernel: str = "torch",
        prefill_kernel: str = "torch",
    ) -> None:
        self.model = model
        self.decode_kernel = decode_kernel  # how decode rows attend (AttentionMetadata.decode_kernel)
        self.prefill_kernel = prefill_kernel  # how prefill chunks attend (build_attention_metadata)
        self.lora_slots = lora_slots
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    def prepare(self, scheduled: list[ScheduledSeq]) -> BatchInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        block_tables: list[list[int]] = []
        last_row: dict[int, int] = {}  # index into `scheduled` -> row of its last token
        prompt_rows: dict[int, tuple[int, int]] = {}
        # Tokens are laid out grouped by adapter slot (stable: base-only first, then slot 0, 1,
        # ...), so each adapter's tokens form one contiguous run the LoRA layers multiply in
        # place; the sampled rows still come back in `scheduled` order.
        layout = sorted(range(len(scheduled)), key=lambda i: scheduled[i].seq.adapter_slot)
        for i in layout:
            s = scheduled[i]
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                prompt_rows[i] = (len(input_ids), min(end, seq.num_prompt_tokens - 1) - start)
            input_ids += seq.token_ids_slice(start, end)
            positions += range(start, end)
            token_slots += [seq.adapter_slot] * s.num_new_tokens
            seq_lens.append(end)
            query_lens.append(s.num_new_tokens)
            block_tables.append(seq.block_table)
            last_row[i] = len(input_ids) - 1
        sample_rows = [last_row[i] for i, s in enumerate(scheduled) if s.samples]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return BatchInputs(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            attn_meta=build_attention_metadata(
                seq_lens, query_lens, block_tables, self.block_size, self.device, self.decode_kernel,
                self.prefill_kernel,
            ),
            lora_meta=self._lora_metadata(token_slots),
            sample_rows=tensor(sample_rows),
            prompt_rows=prompt_rows,
        )

    def _lora_metadata(self, token_slots: list[int]) -> LoRABatchMetadata | None:
        if self.lora_slots is None:
            return None
        return self.lora_slots.batch_metadata(torch.tensor(token_slots, dtype=torch.long))  # [T] host

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        """Run the model; return float32 logits [num_sampled, vocab] in `scheduled` order, and
        the prompt-logprob rows' hidden states."""
        batch = self.prepare(scheduled)
        hidden = self.model(
            batch.input_ids, batch.positions, self.kv_caches, batch.attn_meta, batch.lora_meta
        )  # [T, hidden]
        return StepResult(
            logits=self.model.compute_logits(hidden[batch.sample_rows]),  # [num_sampled, vocab]
            prompt_hidden={i: hidden[row : row + n] for i, (row, n) in batch.prompt_rows.items()},
        )
