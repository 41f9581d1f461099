"""The trainer's forward, computed the way a deterministic server computes it: with
--enable-deterministic-inference the server's logits are batch-invariant, so a trainer that runs
grctl's own Qwen3 (grctl.model.qwen3) over the same checkpoint through `server_logits` gets them
bit for bit: the same logprobs, ratios exactly 1 on the first epoch (true on-policy).

    model = Qwen3ForCausalLM(ModelConfig.from_hf(config)); load the checkpoint into it
    model.set_batch_invariant(True)
    rows = server_logits(model, prompt_ids, output_ids)       # differentiable, [n, vocab]
    logprobs = token_logprobs(rows, output_ids)               # == the reply's, bitwise, with
                                                              # return_original_logprob

One teacher-forced pass over prompt + output (the last output token is not fed), differentiable
when the model's parameters require grad. Each row is computed as the server computes it: the
prompt's tokens as a prefill (causal batch-invariant attention over the prompt), each output
token as a decode step (batch-invariant attention over the prompt's KV, merged by log-sum-exp
with attention over the beam's own earlier output tokens); row 0 is the prefill's
log_softmax(logits), the later rows the decode logits, as the server's search receives them.
"""

from __future__ import annotations

import torch

from grctl.model import attention, batch_invariant
from grctl.model.qwen3 import Qwen3ForCausalLM
from grctl.model.rope import rope_cos_sin


def server_logits(
    model: Qwen3ForCausalLM, prompt: torch.Tensor, output_ids: torch.Tensor
) -> torch.Tensor:
    """prompt [L], output_ids [n] token ids -> [n, vocab] float32: row t is what the server's
    search scored output token t from (log_softmax for t = 0, the logits after)."""
    if not model.invariant:
        raise ValueError("call model.set_batch_invariant(True) first: the server's way is that")
    dev, dtype, cfg = (
        model.embed_tokens.weight.device,
        model.embed_tokens.weight.dtype,
        model.config,
    )
    num_prompt, n = int(prompt.numel()), int(output_ids.numel())
    tokens = torch.cat((prompt, output_ids[:-1])).to(dev)
    positions = torch.arange(num_prompt + n - 1, device=dev)
    # the server prefills the prompt in one call of its length, decodes one token at a time
    seq_lens = torch.cat((torch.full((num_prompt,), num_prompt), positions[num_prompt:].cpu() + 1))
    cos, sin = rope_cos_sin(positions, cfg, seq_lens.to(dev))
    cos, sin = cos.to(dtype), sin.to(dtype)
    h = model.embed_tokens(tokens)
    kv, g = cfg.num_kv_heads, cfg.num_attention_heads // cfg.num_kv_heads
    for layer in model.layers:
        q, k, v = layer.pre_attention(h, cos, sin)  # [rows, H or KV, D]
        kc = k[:num_prompt].transpose(0, 1).contiguous()
        vc = v[:num_prompt].transpose(0, 1).contiguous()
        outs = [batch_invariant.attention(q[:num_prompt], kc, vc, positions[:num_prompt])[0]]
        outs = [outs[0].to(dtype).flatten(1)]
        if n > 1:
            qd = q[num_prompt:]  # [n - 1, H, D]
            o_ctx, lse_ctx = batch_invariant.attention(qd, kc, vc)
            o_ctx = o_ctx.view(n - 1, kv, g, -1)
            lse_ctx = lse_ctx.view(n - 1, kv, g)
            kt, vt = k[num_prompt:].transpose(0, 1), v[num_prompt:].transpose(0, 1)  # [KV, n-1, D]
            for t in range(n - 1):  # decode step t attends to output tokens 0 .. t
                q_t = qd[t : t + 1].view(1, kv, g, -1)
                o_t, lse_t = attention.tail_attention_with_lse(
                    q_t, kt[None, :, : t + 1], vt[None, :, : t + 1]
                )
                out = attention.merge(o_ctx[t : t + 1], lse_ctx[t : t + 1], o_t, lse_t)[0]
                outs.append(out.to(q.dtype).reshape(1, -1))
        h = layer.post_attention(h, torch.cat(outs))
    rows = torch.cat((h[num_prompt - 1 : num_prompt], h[num_prompt:]))
    logits = model.logits(rows)
    return torch.cat((torch.log_softmax(logits[:1], dim=-1), logits[1:]))


def token_logprobs(rows: torch.Tensor, output_ids: torch.Tensor) -> torch.Tensor:
    """The model's log-probability of each output token from `server_logits`' rows, computed
    as the server computes it for return_original_logprob (log_softmax, no temperature, no
    catalog mask): [n]. The behaviour policy's (tempered, masked, filtered) is the catalog
    replay's (grctl.rl.replay) over the same rows."""
    peak = rows.amax(-1, keepdim=True)
    peak = peak.masked_fill(~torch.isfinite(peak), 0.0)
    lse = (rows - peak).exp().sum(-1).log() + peak[:, 0]
    ids = output_ids.to(rows.device)
    return rows[torch.arange(rows.shape[0], device=rows.device), ids] - lse
