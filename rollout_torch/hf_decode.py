"""One prefill per prompt, then the answers' decodes: transformers' Qwen2.5-VL driven step by step.

``generate`` repeats every prompt once per answer, so a group of G answers vision-encodes its image G
times and prefills its prompt G times. Here each distinct prompt of a chunk is prefilled once (vision tower,
M-RoPE positions, prompt KV), its KV cache is then repeated to its answers' rows (a copy per answer, as
``generate``'s cache holds), and the rows decode together. The model calls are the ones ``generate`` makes
(same positions: text positions from the attention mask plus ``get_rope_index``'s 3-D ones, extended by one
per decoded token; ``logits_to_keep=1``; fp32 scores), so parity with the JAX actor stays checkable.

Rows whose answer has ended (a stop token) leave the batch: the cache keeps only the live rows, so a step
costs what its unfinished answers need. Sampling stays per answer (``sample_step``: each row's own seeded
generator, advanced once per step it decodes), so an answer does not depend on the rows beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

# (scores [rows, V] fp32 raw logits, live row indices [rows]) -> (tokens [rows], their log-probs [rows]: of the
# distribution the trainer trains on, softmax(scores / T): ``hf_engine.sample_step``)
StepFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def prompt_positions(model, kw: dict) -> torch.Tensor:
    """[4, rows, L] position ids as ``generate`` builds them: the text positions (from the attention mask; used
    for the causal mask) stacked over the 3-D M-RoPE positions of ``get_rope_index``."""
    mask = kw["attention_mask"]
    text = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if kw.get("image_grid_thw") is None and kw.get("video_grid_thw") is None:
        rope = text[None].expand(3, -1, -1)
    else:
        rope, _ = model.model.get_rope_index(
            kw["input_ids"], image_grid_thw=kw.get("image_grid_thw"), video_grid_thw=kw.get("video_grid_thw"),
            attention_mask=mask, second_per_grid_ts=kw.get("second_per_grid_ts"),
            mm_token_type_ids=kw["mm_token_type_ids"])
    return torch.cat([text[None], rope], dim=0)


def prefill(model, kw: dict) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
    """One forward over the distinct prompts of ``kw``: (last-position fp32 logits [P, V], cache, positions)."""
    pos = prompt_positions(model, kw)
    cache = DynamicCache()
    out = model(**kw, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1, return_dict=True)
    return out.logits[:, -1].float(), cache, pos[..., -1:]


def decode(model, kw: dict, answers_of: torch.Tensor, step: StepFn, max_new_tokens: int,
           stop_ids: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [rows, T] and their log-probs [rows, T] (T = steps until every row stopped or max_new_tokens;
    after a row's stop token: ``pad_id`` and 0), where row r answers prompt ``answers_of[r]`` of ``kw``."""
    logits, cache, pos = prefill(model, kw)
    device = logits.device
    rows = len(answers_of)
    answers_of = answers_of.to(device)
    cache.batch_select_indices(answers_of)  # each answer's own copy of its prompt's KV
    logits, pos, mask = logits[answers_of], pos[:, answers_of], kw["attention_mask"][answers_of]
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    live = torch.arange(rows, device=device)
    steps = 0
    for t in range(max_new_tokens):
        tok, lp = step(logits, live)
        tokens[live, t], logps[live, t] = tok, lp
        steps = t + 1
        keep = ~torch.isin(tok, stop_ids)
        if t + 1 == max_new_tokens or not bool(keep.any()):
            break
        if not bool(keep.all()):  # finished answers leave the batch
            idx = keep.nonzero()[:, 0]
            live, tok, pos, mask = live[idx], tok[idx], pos[:, idx], mask[idx]
            cache.batch_select_indices(idx)
        pos = pos + 1
        mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                    logits_to_keep=1, return_dict=True)
        logits = out.logits[:, -1].float()
        del out
    return tokens[:, :steps], logps[:, :steps]
