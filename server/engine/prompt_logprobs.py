"""Prompt logprobs (vLLM's prompt_logprobs; OpenAI's `echo` with `logprobs`): the log-probability of every
prompt token given the tokens before it, its rank in the vocabulary, and the top-k alternatives at each
position.

One contiguous causal forward over the prompt when the request is added, outside the paged step: a prefix
served from the prefix cache has no logits, and the scheduler and runner stay unaware of the feature. It
costs one extra prefill of the prompt, paid only by requests that ask, and it runs on the engine's thread
between steps: the prompt is at most max_num_batched_tokens long (EngineCore.add_request; the API refuses
longer ones with a 400), the forward the server's memory and its other streams' step times were sized for.
"""

from __future__ import annotations

import torch

from server.engine.outputs import PromptTokenLogprobs

ROWS_PER_CHUNK = 512  # lm_head rows at a time: bounds the (rows, vocab) fp32 logits


@torch.inference_mode()
def prompt_logprobs(model, prompt_token_ids: list[int], k: int) -> list[PromptTokenLogprobs | None]:
    """-> one entry per prompt token: None for the first (nothing precedes it), then (logprob, rank,
    top-k); the rank is the number of tokens at least as likely as it (vLLM's: a tie takes the last place
    of its group, a masked token the vocabulary's size)."""
    ids = torch.tensor(prompt_token_ids, dtype=torch.int32, device=model.device)  # (T,)
    positions = torch.arange(len(prompt_token_ids), dtype=torch.int32, device=model.device)
    hidden = model(ids, positions)  # (T, H): contiguous attention, no KV cache
    out: list[PromptTokenLogprobs | None] = [None]
    for start in range(0, len(prompt_token_ids) - 1, ROWS_PER_CHUNK):
        end = min(start + ROWS_PER_CHUNK, len(prompt_token_ids) - 1)
        logprobs = model.compute_logits(hidden[start:end]).log_softmax(dim=-1)  # (R, V): row t predicts t+1
        chosen = logprobs.gather(1, ids[start + 1 : end + 1, None].long())  # (R, 1)
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()  # (R,)
        chosen = chosen.squeeze(1).tolist()
        if k:
            top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # (R, k)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(),
                                                                  strict=True)]
        else:
            tops = [[] for _ in chosen]
        out.extend(zip(chosen, ranks, tops, strict=True))
    return out
