"""Rollouts: sample G completions per prompt with HF `generate`, mask them, and score their tokens' log-probs.

Two details decide whether the trainer sees the same distribution the sampler drew from:
  * prompts are left-padded, so position ids must come from the attention mask (cumsum - 1), as `generate`
    derives them; a plain arange would shift every padded row's positions;
  * log-probs are taken at the sampling temperature: logits / temperature, then log-softmax.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

import rewards
from base.errors import UserError


@dataclass
class Rollout:
    """One batch of completions. It lives on the host (CPU) whatever device sampled it: the verifier, the metrics and
    every rank's bookkeeping read it there, and the update moves the rows it scores to the policy's device."""
    prompt_ids: Tensor  # (B, Lp) left-padded
    prompt_mask: Tensor  # (B, Lp)
    completion_ids: Tensor  # (B, T) right-padded (whatever follows the first EOS)
    completion_mask: Tensor  # (B, T) 1 up to and including the first EOS
    truncated: Tensor  # (B,) no EOS within max_new_tokens
    sampler_logp: Tensor | None = None  # (B, T) log mu(y_t), mu the distribution generate sampled from (not greedy)
    sampler_entropy: Tensor | None = None  # (B, T) entropy of those same distributions

    @property
    def input_ids(self) -> Tensor:  # (B, Lp + T)
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # (B, Lp + T); tokens after EOS are attended but never scored
        return torch.cat([self.prompt_mask, torch.ones_like(self.completion_ids)], dim=1)

    @property
    def lengths(self) -> Tensor:  # (B,) |y_i|
        return self.completion_mask.sum(-1)

    def _map(self, fn) -> "Rollout":
        return Rollout(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                          for f in fields(self)})

    def to(self, device) -> "Rollout":
        return self._map(lambda t: t.to(device))

    def select(self, idx: Tensor) -> "Rollout":
        return self._map(lambda t: t[idx])

    @staticmethod
    def concat(parts: list["Rollout"], pad_id: int) -> "Rollout":
        """Join rollouts of different widths: prompts padded on the left, completions on the right."""
        lp = max(p.prompt_ids.shape[1] for p in parts)
        t = max(p.completion_ids.shape[1] for p in parts)
        left = lambda x, v: F.pad(x, (lp - x.shape[1], 0), value=v)  # noqa: E731
        right = lambda x, v: F.pad(x, (0, t - x.shape[1]), value=v)  # noqa: E731
        kept = all(p.sampler_logp is not None for p in parts)
        return Rollout(
            torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
            torch.cat([left(p.prompt_mask, 0) for p in parts]),
            torch.cat([right(p.completion_ids, pad_id) for p in parts]),
            torch.cat([right(p.completion_mask, 0) for p in parts]),
            torch.cat([p.truncated for p in parts]),
            torch.cat([right(p.sampler_logp, 0.0) for p in parts]) if kept else None,
            torch.cat([right(p.sampler_entropy, 0.0) for p in parts]) if kept else None,
        )


def completion_mask(completion_ids: Tensor, stop_ids: list[int]) -> tuple[Tensor, Tensor]:
    """(mask, truncated): mask is 1 up to and including the first stop token (any EOS id); a row without one is
    truncated.

    Works when pad == eos: only the first stop counts, so the padding generate writes after it is masked out.
    """
    is_eos = torch.isin(completion_ids, completion_ids.new_tensor(stop_ids))  # (B, T)
    seen_before = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # a stop strictly before this position
    return (~seen_before).long(), ~is_eos.any(dim=1)


class SamplerLogprobs:
    """A logits processor (generate calls it with the input ids and the next token's scores) that records
    log mu(y_t) and the entropy of mu, the distribution `generate` samples each token from (its logits /
    temperature: the only processor, see model.prepare), one step at a time. Called at step t+1 with the token drawn
    at step t as the last input id, it keeps one (B, V) row of log-probs between calls instead of generate's whole
    (B, T, V) logits. Custom processors run before generate's temperature warper, hence the division here (the test
    against the stacked raw logits checks that order)."""

    def __init__(self, temperature: float):
        self.temperature, self.pending, self.logp, self.entropy = temperature, None, [], []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # (B, L), (B, V)
        self.take(input_ids[:, -1])
        x = scores.float() / self.temperature  # (B, V)
        logz = torch.logsumexp(x, dim=-1, keepdim=True)  # (B, 1)
        self.pending = x - logz  # log mu(. | y_<t)
        self.entropy.append(logz.squeeze(-1) - (torch.softmax(x, dim=-1) * x).sum(-1))  # H = log Z - E_mu[logit]
        return scores

    def take(self, drawn: Tensor) -> None:  # (B,) the tokens drawn from the pending distribution
        if self.pending is not None:
            self.logp.append(self.pending.gather(-1, drawn.unsqueeze(-1)).squeeze(-1))
            self.pending = None

    def result(self, completion: Tensor) -> tuple[Tensor, Tensor]:  # (B, T) each
        self.take(completion[:, -1])
        return torch.stack(self.logp, dim=1), torch.stack(self.entropy, dim=1)


TEMPLATE_DATE = "26 Jul 2024"  # for templates that write a date (Llama 3.x): the same prompts on every day


def format_prompt(tokenizer, prompt: str, answer_format: str = "tags", enable_thinking: bool = False) -> str:
    """A model with a chat template gets the prompt as a user turn, told where the verifier will look for the
    answer (rewards.INSTRUCTIONS), with thinking off unless asked (Qwen3's template thinks by default, and a chain
    of thought outgrows the usual budgets) and a fixed date; a model without one sees the bare prompt, after its BOS
    if its tokenizer adds one (rollout.generate tokenizes without special tokens). The embedded model has neither."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{prompt}\n{rewards.INSTRUCTIONS[answer_format]}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking, date_string=TEMPLATE_DATE)
    bos = tokenizer.bos_token
    if bos and tokenizer("1")["input_ids"][:1] == [tokenizer.bos_token_id] and not prompt.startswith(bos):
        return bos + prompt
    return prompt


@torch.no_grad()  # not inference_mode: autocast's weight cache is off there
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
             greedy: bool = False) -> Rollout:
    """One completion per prompt string (repeat a prompt G times to get a group).

    A sampled rollout keeps the log-probs and entropies of its tokens under mu, the distribution the sampler drew
    from (SamplerLogprobs): pi_old itself when the update takes it from the sampler (--old-logprobs sampler), and
    what the recomputed pi_old is compared with otherwise (train-inference mismatch, rollout correction).
    """
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    stops = model.generation_config.eos_token_id  # every id that ends a completion (model.prepare)
    sampling = {} if greedy else dict(temperature=temperature, top_p=1.0, top_k=0)  # the only processor: temperature
    recorder = None if greedy else SamplerLogprobs(temperature)
    # bf16 (model.compute_in): one autocast region over every decode step, so autocast casts each fp32 weight to bf16
    # once per rollout and keeps the copy, instead of once per token (the cache holds under no_grad only)
    dtype = getattr(model, "autocast_dtype", None)
    with torch.autocast(model.device.type, dtype=dtype) if dtype else contextlib.nullcontext():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=not greedy, **sampling,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=stops,
                             logits_processor=[recorder] if recorder else None,
                             return_dict_in_generate=True, synced_gpus=False)
    completion = out.sequences[:, enc["input_ids"].shape[1]:]  # (B, T)
    mask, truncated = completion_mask(completion, stops)
    ro = Rollout(enc["input_ids"], enc["attention_mask"], completion, mask, truncated)
    if recorder is not None:
        ro.sampler_logp, ro.sampler_entropy = recorder.result(completion)
    return ro.to("cpu")  # host-side from here on (see Rollout)


def decode(tokenizer, ro: Rollout) -> list[str]:
    """Each completion's text up to and including its first EOS (special tokens dropped)."""
    valid = ro.completion_ids * ro.completion_mask + tokenizer.pad_token_id * (1 - ro.completion_mask)
    return tokenizer.batch_decode(valid, skip_special_tokens=True)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """log softmax(logits / temperature) at `targets`: (B, T, V), (B, T) -> (B, T).

    Taken as logit - logsumexp, one row (T, V) at a time: no full-vocabulary float32 copy of the whole batch is made
    (at a 151,936-token vocabulary one row of 256 tokens is 0.16 GB; the batch's copies would be B times that). With
    `with_entropy`, also the per-token entropy (B, T) of the tempered distribution, without gradient ("grad": with).
    """
    logp, entropy = [], []
    for row, target in zip(logits, targets):  # (T, V), (T,)
        row = row.float() / temperature  # (T, V)
        logz = torch.logsumexp(row, dim=-1)  # (T,)
        logp.append(row.gather(-1, target.unsqueeze(-1)).squeeze(-1) - logz)
        if with_entropy == "grad":  # the entropy bonus differentiates it
            entropy.append(logz - (torch.softmax(row, dim=-1) * row).sum(-1))  # H = log Z - E_p[logit]
        elif with_entropy:
            with torch.no_grad():
                entropy.append(logz - (torch.softmax(row, dim=-1) * row).sum(-1))
    if not with_entropy:
        return torch.stack(logp)
    return torch.stack(logp), torch.stack(entropy)


def completion_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                        temperature: float = 1.0, with_entropy: bool | str = False, chunk: int = 0):
    """log pi(y_t | x, y_<t) of the last `num_completion` tokens at the sampling temperature: (B, T).

    One forward pass. Where chunk_positions says whole, the model computes those logits (logits_to_keep) and
    token_logprobs takes them row by row; otherwise chunked_logprobs, which holds no (B, T, V) tensor, a chunk of
    positions at a time. `with_entropy`: as in token_logprobs.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens only
    targets = input_ids[:, -num_completion:]  # (B, T)
    head, decoder = output_layers(model)
    size = chunk_positions(targets.numel(), head.out_features, chunk)
    if size and decoder is not None:
        return chunked_logprobs(model, head, decoder, input_ids, attention_mask, position_ids, targets, temperature,
                                with_entropy, size)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=num_completion + 1, use_cache=False).logits
    # position t of the kept logits predicts completion token t; the last one predicts beyond the sequence
    return token_logprobs(logits[:, :-1], targets, temperature, with_entropy)


def chunk_positions(positions: int, vocab: int, chunk: int = 0) -> int:
    """Completion positions per chunk of the log-prob path (--logprob-chunk `chunk`), or 0 where their logits are made
    whole: `chunk` -1; `positions` (B x T) within one chunk; with `chunk` 0, at most WHOLE_ENTRIES logits (all of the
    embedded model's). A chunk holds `chunk` positions, or with 0 CHUNK_ENTRIES / V. tools/memory.py reads it too."""
    size = chunk if chunk > 0 else max(1, CHUNK_ENTRIES // vocab)
    whole = chunk < 0 or size >= positions or (chunk == 0 and positions * vocab <= WHOLE_ENTRIES)
    return 0 if whole else size


def chunked_logprobs(model, head, decoder, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                     targets: Tensor, temperature: float, with_entropy: bool | str, size: int):
    """completion_logprobs without a (B, T, V) tensor: the model stops at its last hidden states (the decoder's
    output, read by a hook; the head runs on one position only) and HeadLogprobs computes the head, the log-softmax
    and the gather `size` positions at a time, again in the backward."""
    seen = []  # the decoder's output: the last hidden states, after the final norm, as the head reads them
    hook = decoder.register_forward_hook(lambda module, args, out: seen.append(out[0] if isinstance(out, tuple)
                                                                               else out.last_hidden_state))
    try:  # every layer runs; the head only on the last position (B x V logits, which check_head reads)
        last = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1,
                     use_cache=False).logits
    finally:
        hook.remove()
    hidden = seen[-1]  # (B, L, h)
    dtype = None if getattr(head, "fp32", False) else autocast_dtype(model)  # model.head_in_fp32: the head in fp32
    logit_map = LogitMap.of(model)
    check_head(head, hidden[:, -1:], last, dtype, logit_map)
    b, t = targets.shape
    logp, entropy = HeadLogprobs.apply(hidden[:, -t - 1:-1].reshape(b * t, -1), head.weight, head.bias,
                                       targets.reshape(-1), temperature, size, with_entropy, dtype, logit_map)
    logp = logp.view(b, t)
    return (logp, entropy.view(b, t)) if with_entropy else logp


WHOLE_ENTRIES = 2**26  # by default (--logprob-chunk 0) completion logits up to this many entries (256 MiB in fp32)
# are made whole: they hold little memory, and whole is faster (the chunked backward runs the head's matmul again)
CHUNK_ENTRIES = 2**24  # logit entries per chunk by default (--logprob-chunk 0): 64 MiB in fp32; 110 positions at
# Qwen's 151,936-token vocabulary, 341 at SmolLM2's 49,152
GRAD_SLICE = 2**21  # entries of the head's gradient per product in HeadLogprobs's backward: cache-sized on a CPU
# (2.9x faster than 2^24 at Qwen's widths here), and no (V, h) temporary


def causal_lm(model):
    """The causal LM inside DDP's wrapper (.module) and model.AdapterOff (.model)."""
    inner = getattr(model, "module", model)
    return inner if hasattr(inner, "get_output_embeddings") else inner.model


def output_layers(model):
    """(the head, the decoder whose output it reads) of a causal LM (causal_lm); the decoder is None where the model
    has no get_decoder."""
    inner = causal_lm(model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    return inner.get_output_embeddings(), decoder


def autocast_dtype(model):
    """The dtype model.compute_in runs `model`'s forwards in under autocast, or None (fp32)."""
    inner = getattr(model, "module", model)
    return getattr(inner, "autocast_dtype", None) or getattr(getattr(inner, "model", None), "autocast_dtype", None)


@dataclass(frozen=True)
class LogitMap:
    """What a model does to its head's output z before the softmax, as transformers writes it: Cohere multiplies by
    its logit_scale, Granite divides by its logits_scaling, Gemma 2 soft-caps, cap tanh(z / cap), with its
    final_logit_softcapping. Most decoders (Llama, Qwen, Mistral) do nothing: the identity."""
    multiply: float = 1.0
    divide: float = 1.0
    cap: float | None = None

    @staticmethod
    def of(model) -> "LogitMap":
        """The map the config of `model` (causal_lm) names; check_head verifies it."""
        config = causal_lm(model).config
        return LogitMap(getattr(config, "logit_scale", None) or 1.0, getattr(config, "logits_scaling", None) or 1.0,
                        getattr(config, "final_logit_softcapping", None))

    def __bool__(self) -> bool:  # the identity is False: the default path runs no extra operation
        return self != LogitMap()

    def __call__(self, z: Tensor) -> Tensor:
        """f(z), each operation as the model's forward writes it, so that f(z) is its logits to the bit."""
        z = z * self.multiply if self.multiply != 1.0 else z
        z = z / self.divide if self.divide != 1.0 else z
        return z if self.cap is None else torch.tanh(z / self.cap) * self.cap

    def backward_(self, g: Tensor, f: Tensor) -> Tensor:
        """dL/dz from dL/df, in place of g, given f = f(z) (overwritten): the cap's slope is 1 - (f / cap)^2, the
        derivative of tanh at z / cap, and the scales' m / d."""
        if self.cap is not None:
            g.mul_(f.div_(self.cap).square_().neg_().add_(1))
        return g.mul_(self.multiply / self.divide) if self.multiply != self.divide else g


def check_head(head, hidden: Tensor, logits: Tensor, dtype, logit_map: LogitMap = LogitMap()) -> None:
    """The chunked path reads the logits as f(head(last hidden state)), f the LogitMap the model's config names: true
    of Llama, Qwen, Mistral, Gemma, Gemma 2, Cohere and Granite. A model that changes its logits in another way
    (scales the hidden states before its head, as MiniCPM) is refused."""
    with torch.no_grad(), torch.autocast(hidden.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        mine = logit_map(head(hidden))
    if not torch.allclose(mine.float(), logits.float(), rtol=1e-3, atol=1e-3):
        raise HeadError("this model's logits are not its head applied to its last hidden states (it scales or caps "
                        "them in a way the chunked log-probs do not know): pass --logprob-chunk -1 to compute whole "
                        "logits instead")


class HeadError(UserError, ValueError):
    """A model whose logits the chunked log-probs cannot compute from its head."""


class HeadLogprobs(torch.autograd.Function):
    """log softmax(f(h W^T + b) / temperature) at the targets, and the entropy, for N positions' hidden states (N, h),
    f the model's LogitMap, `size` positions at a time; the backward computes each chunk's logits again instead of
    keeping any. Numerically token_logprobs's arithmetic (logits in the compute dtype, then fp32); d/dz of log p_y
    is onehot(y) - p, of the entropy -p (log p + H), z = f(h W^T + b) / temperature. with_entropy: False, True (no
    gradient) or "grad"."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, size, with_entropy, dtype, logit_map=LogitMap()):
        w, b = HeadLogprobs.cast(weight, bias, dtype)
        logp = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else torch.empty(0, device=hidden.device)
        for s in range(0, len(targets), size):
            z = HeadLogprobs.scores(hidden[s:s + size], w, b, temperature, logit_map)  # (n, V)
            logp_all = torch.log_softmax(z, dim=-1)  # (n, V); one fused kernel (a CPU's logsumexp is 6x slower)
            logp[s:s + size] = logp_all.gather(-1, targets[s:s + size, None]).squeeze(-1)
            if with_entropy:  # H = -sum_v p_v log p_v
                entropy[s:s + size] = -(torch.softmax(z, dim=-1) * logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.size, ctx.with_entropy, ctx.dtype = temperature, size, with_entropy, dtype
        ctx.logit_map = logit_map
        if with_entropy != "grad":
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def cast(weight, bias, dtype):
        """The head in the compute dtype, cast once (what autocast's linear would cast at every chunk)."""
        if dtype is None:
            return weight, bias
        return weight.to(dtype), None if bias is None else bias.to(dtype)

    @staticmethod
    def scores(h, w, b, temperature, logit_map):
        """z = f(head(h)) / temperature in fp32 (the head's matmul and f in w's dtype, as under the model's autocast):
        (n, V)."""
        z = logit_map(torch.nn.functional.linear(h.to(w.dtype), w, b)).float()  # the identity map runs no operation
        return z if temperature == 1.0 else z.div_(temperature)  # in place: z / 1 is z, to the bit

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        w, b = HeadLogprobs.cast(weight, bias, ctx.dtype)
        g_hidden = torch.zeros_like(hidden) if want_h else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        g_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        rows = max(1, GRAD_SLICE // weight.shape[1])  # of the head's gradient per product: no (V, h) temporary
        for s in range(0, len(targets), ctx.size):
            h = hidden[s:s + ctx.size].to(w.dtype)
            z = HeadLogprobs.scores(h, w, b, ctx.temperature, ctx.logit_map)
            p = torch.softmax(z, dim=-1)  # (n, V)
            g_z = p.mul(-g_logp[s:s + ctx.size, None])
            g_z.scatter_add_(-1, targets[s:s + ctx.size, None], g_logp[s:s + ctx.size, None])
            if ctx.with_entropy == "grad":  # - p (log p + H) g_H
                logp_all = torch.log_softmax(z, dim=-1)
                entropy = -(p * logp_all).sum(-1)
                g_z -= logp_all.add_(entropy[:, None]).mul_(p).mul_(g_entropy[s:s + ctx.size, None])
            g_raw = g_z if ctx.temperature == 1.0 else g_z.div_(ctx.temperature)
            if ctx.logit_map:  # through f (f = z x temperature; z is not read again)
                g_raw = ctx.logit_map.backward_(g_raw, z if ctx.temperature == 1.0 else z.mul_(ctx.temperature))
            g_raw = g_raw.to(w.dtype)  # the head's dtype
            if want_h:
                g_hidden[s:s + ctx.size] = torch.matmul(g_raw, w).to(hidden.dtype)
            if want_w:
                for v in range(0, len(g_weight), rows):
                    g_weight[v:v + rows] += torch.matmul(g_raw[:, v:v + rows].t(), h)
            if want_b:
                g_bias += g_raw.float().sum(0)
        g_weight = None if g_weight is None else g_weight.to(weight.dtype)
        g_bias = None if g_bias is None else g_bias.to(bias.dtype)
        return g_hidden, g_weight, g_bias, None, None, None, None, None, None


def logprobs(model, ro: Rollout, rows: Tensor, temperature: float = 1.0, with_entropy: bool | str = False,
             chunk: int = 0):
    """log pi(y_t) of the completion tokens of some rows of a rollout under `model`: (n, T) (completion_logprobs)."""
    return completion_logprobs(model, ro.input_ids[rows], ro.attention_mask[rows], ro.completion_ids.shape[1],
                               temperature, with_entropy, chunk)
