"""Turns one step's logits into one token per sequence, with optional logprobs.

The engine calls `Sampler()(logits, rows)` once per step with the rows that need a token.
`logits` is `(B, V)` float32, row `i` belonging to `rows[i]`; the caller's tensor is never
written to. For every row the pipeline is, in this order:

1. repetition penalty (HF): over the set of prompt + output tokens, a positive logit is
   divided by `repetition_penalty` and a negative one multiplied by it;
2. presence / frequency penalties (OpenAI): over output tokens,
   `logit -= presence_penalty * (count > 0) + frequency_penalty * count`;
3. min_tokens: while `len(output_token_ids) < min_tokens` the row's `stop_token_ids` are set to
   `-inf`;
4. `temperature == 0`: the argmax of the logits so far (greedy; ties go to the lowest id);
5. otherwise `softmax(logits / temperature)`, then
   - min_p: drop tokens whose probability is below `min_p * max probability`;
   - top_k (`0`/`-1` disable it): keep the `top_k` most likely tokens, plus any tied with the
     k-th;
   - top_p: on the distribution renormalized after min_p and top_k, keep the smallest set of
     most likely tokens whose cumulative probability is `>= top_p` (plus any tied with the
     least likely member); the most likely token is always kept;
6. one token drawn from the renormalized remainder by the exponential race
   `argmax(p / E)`, `E ~ Exp(1)` i.i.d. per token, which picks token `i` with probability
   `p_i / sum(p)` exactly (the `p / E` are scaled competing exponential clocks).

Randomness: a row with a `generator` draws its `E` from that generator alone (`V` draws per
sampled step, none for a greedy step), so the same seed gives the same tokens whatever else is
in the batch; the generator must live on the logits' device and its state is the request's.
Rows without one share one batched draw from the global RNG.

Logprobs describe the model, not the sampling: they come from `log_softmax` of the logits as
given, before penalties, min_tokens masking and temperature. A structured-output row's logits
arrive with the grammar's disallowed tokens at -inf (engine/structured.py), so its logprobs are
those of the grammar-masked distribution, as vLLM reports them. `rank` is 1 + the number of
tokens strictly more likely than the sampled one.

Cost: when every row is greedy with no penalty, no active min_tokens mask and no logprobs, a
step is one `argmax` over the batch. Penalties build their `(P, V)` count tensors with one
`scatter_add_` over the rows that use them; the sort needed by top_p (or a `topk` for top_k
alone) runs only on the sampled rows, and only when some row asks for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmfleet.engine.request import Request
from llmfleet.shared.core.outputs import TokenLogprobs
from llmfleet.shared.core.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence to sample for; the sampler reads it and never keeps it."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded per request; None: the global RNG
    prompt_token_ids: Sequence[int]  # repetition_penalty (with the output)
    output_token_ids: Sequence[int]  # presence/frequency penalties and min_tokens
    stop_token_ids: frozenset[int]  # eos ids (unless ignore_eos) + params.stop_token_ids

    @classmethod
    def of(cls, req: Request) -> SamplingRow:
        """The row of a sequence as it stands (its own lists, not copies)."""
        return cls(
            params=req.params,
            generator=req.generator,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            stop_token_ids=req.stop_token_ids,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row, in the order of the rows
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


class Sampler:
    """Stateless; one instance serves every step (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return _output(logits.float(), self.sample_ids(logits, rows), rows)

    def sample_ids(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """`(B,)` int64 token ids on the logits' device, nothing read back to the host.

        For rows that `device_only` accepts this also never waits for the device, so a step
        launched ahead (async_scheduling.py) can sample while the previous one still computes.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be (B={len(rows)}, V), got {tuple(logits.shape)}")
        if all(_is_plain_greedy(row) for row in rows):
            return greedy_ids(logits)
        logits = logits.float()  # no copy when already float32
        processed = process_logits(logits, rows)
        sampled = [i for i, row in enumerate(rows) if row.params.temperature != 0.0]
        if len(sampled) == len(rows):
            return _sample(processed, rows)
        ids = greedy_ids(processed)  # (B,)
        if sampled:
            index = small_tensor(sampled, logits.device)
            ids[index] = _sample(processed[index], [rows[i] for i in sampled])
        return ids


def device_only(
    params: SamplingParams,
    num_output_tokens: int,
    has_stop_ids: bool,
    *,
    masked_ahead: bool = False,
) -> bool:
    """Whether a row samples from its logits alone: no penalty (they count the output tokens
    on the host), no logprobs (read back), no min_tokens mask at this output length, no
    structured output (its grammar mask follows the latest token) unless `masked_ahead` (the
    caller fills the mask once that token is read: async_scheduling.py). Such rows can sample
    before their latest token is known on the host."""
    return (
        params.logprobs is None
        and (params.structured_output is None or masked_ahead)
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and (num_output_tokens >= params.min_tokens or not has_stop_ids)
    )


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,) int64
    """Each row's argmax, ties to the lowest id; on a GPU the two-pass Triton argmax, which a
    batch-1 row over a 128K vocabulary takes in a few microseconds instead of torch's ~27."""
    if logits.is_cuda:
        from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

        return dispatch.argmax(logits)
    return logits.argmax(dim=-1)


def small_tensor(values: Sequence[float] | Sequence[int], device: torch.device) -> torch.Tensor:
    """A short host list on `device` without waiting for the device: a plain
    `torch.tensor(..., device="cuda")` synchronizes the stream, which would stall a step
    launched ahead. On CUDA the list goes through pinned memory, copied asynchronously (the
    caching host allocator keeps the buffer until the copy has run)."""
    t = torch.tensor(values)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def select_rows(t: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """`t[rows]`: a view when `rows` are consecutive (no host-to-device copy, no kernel: a
    speculating sequence's logits rows usually are), else a gather."""
    if rows and list(rows) == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0] : rows[0] + len(rows)]
    return t[small_tensor(rows, t.device)]


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 1-3 of the pipeline (penalties, then min_tokens masking) on `(B, V)` logits.

    Returns a new tensor, or `logits` itself when no row needs any of these steps; the
    argument is never written to.
    """
    vocab_size = logits.shape[1]
    penalized: list[int] = []
    mask_rows: list[int] = []
    mask_cols: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            penalized.append(i)
        if row.stop_token_ids and len(row.output_token_ids) < p.min_tokens:
            for t in row.stop_token_ids:
                if t < vocab_size:  # an id past the vocabulary can never be sampled anyway
                    mask_rows.append(i)
                    mask_cols.append(t)
    if not penalized and not mask_rows:
        return logits
    out = logits.clone()
    if penalized:
        _apply_penalties(out, [rows[i] for i in penalized], penalized)
    if mask_rows:
        out[mask_rows, mask_cols] = float("-inf")
    return out


def _is_plain_greedy(row: SamplingRow) -> bool:
    return row.params.temperature == 0.0 and device_only(
        row.params, len(row.output_token_ids), bool(row.stop_token_ids)
    )


def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """`(P, V)` float32 counts of each token id in each row's list, by one scatter_add."""
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    if flat.numel():
        # Flat indices into counts, built on the CPU and sent in one copy.
        lengths = torch.tensor([len(t) for t in token_lists])
        row_of = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
        linear = (row_of * vocab_size + flat).to(device, non_blocking=True)
        counts.view(-1).scatter_add_(0, linear, torch.ones(flat.numel(), device=device))
    return counts


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], index: list[int]) -> None:
    """Penalize `logits[index]` in place; `rows` are the rows at those positions."""
    device = logits.device
    vocab_size = logits.shape[1]
    idx = torch.tensor(index, device=device)
    sub = logits[idx]  # (P, V), a copy
    counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)  # (P, V)

    rep = [r.params.repetition_penalty for r in rows]
    if any(x != 1.0 for x in rep):
        # Prompt tokens only matter to rows with a repetition penalty; skip the others' prompts.
        prompts = [r.prompt_token_ids if x != 1.0 else () for r, x in zip(rows, rep, strict=True)]
        seen = (counts > 0) | (_token_counts(prompts, vocab_size, device) > 0)
        rep_t = torch.tensor(rep, device=device).unsqueeze(1)  # (P, 1)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep_t, sub * rep_t), sub)

    presence = [r.params.presence_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    if any(presence) or any(frequency):
        presence_t = torch.tensor(presence, device=device).unsqueeze(1)  # (P, 1)
        frequency_t = torch.tensor(frequency, device=device).unsqueeze(1)
        sub = sub - presence_t * (counts > 0) - frequency_t * counts
    logits[idx] = sub


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Draw one token per row of `(R, V)` processed logits; every row has temperature > 0."""
    return race(probabilities(logits, rows), [r.generator for r in rows])


def probabilities(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Step 5 of the pipeline: `(R, V)` float32 probabilities, unnormalized after the filters
    (the distribution a row samples from is each row divided by its sum), of `(R, V)` processed
    logits; every row has temperature > 0."""
    device = logits.device
    vocab_size = logits.shape[1]
    temperature = small_tensor([r.params.temperature for r in rows], device)
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)  # (R, V)

    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        threshold = small_tensor(min_p, device).unsqueeze(1) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)

    top_k = [r.params.top_k if 0 < r.params.top_k < vocab_size else 0 for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(x < 1.0 for x in top_p):
        probs = _top_k_top_p(probs, top_k, top_p)
    elif any(top_k):
        values = probs.topk(max(top_k), dim=-1).values  # (R, max_k), descending
        probs = probs.masked_fill(probs < _kth(values, top_k), 0.0)
    return probs


def race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Step 6: `(R,)` int64 draws, row i's token with probability probs[i] / sum(probs[i]);
    row i's noise comes from generators[i] alone (V draws), or from the global RNG if None."""
    device = probs.device
    vocab_size = probs.shape[1]
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws i with probability p_i / sum(p).
    noise = torch.empty_like(probs)  # (R, V)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        noise.exponential_()
    else:
        for i in seeded:
            noise[i].exponential_(generator=generators[i])
        if len(seeded) < len(generators):
            unseeded = [i for i, g in enumerate(generators) if g is None]
            fresh = torch.empty(len(unseeded), vocab_size, device=device).exponential_()
            noise[small_tensor(unseeded, device)] = fresh
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a zero draw would make 0 / 0
    return (probs / noise).argmax(dim=-1)


def _kth(values: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """`(R, 1)` probability of the k-th most likely token, 0 where top_k is off.

    `values` holds each row's probabilities in descending order, at least `max(top_k)` of them.
    """
    k = small_tensor(top_k, values.device).unsqueeze(1)  # (R, 1)
    kth = values.gather(1, (k - 1).clamp_min(0))
    return kth.masked_fill(k == 0, 0.0)


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Apply top_k, then top_p on the renormalized result, to `(R, V)` probabilities.

    Both filters keep a prefix of the descending order, so each reduces to a probability
    cutoff; the cutoffs are applied to `probs` in vocabulary order, which keeps ties together.
    """
    sorted_probs = probs.sort(dim=-1, descending=True).values  # (R, V)
    kth = _kth(sorted_probs, top_k)  # (R, 1)
    sorted_probs = sorted_probs.masked_fill(sorted_probs < kth, 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    # A row with top_p = 1 keeps everything: comparing with inf avoids rounding in the cumsum
    # dropping its least likely tokens.
    p = small_tensor([x if x < 1.0 else float("inf") for x in top_p], probs.device)
    # Keep position j when the mass before it is still short of top_p of the (renormalized)
    # total: that is the smallest prefix reaching top_p, and always includes position 0.
    keep = (cumulative - sorted_probs) < p.unsqueeze(1) * cumulative[:, -1:]
    num_kept = keep.sum(dim=-1, keepdim=True)  # (R, 1), >= 1
    cutoff = torch.maximum(sorted_probs.gather(1, num_kept - 1), kth)
    return probs.masked_fill(probs < cutoff, 0.0)


def _output(logits: torch.Tensor, ids: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Package `(B,)` token ids, with logprobs from the raw `(B, V)` logits where asked."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    token_ids = ids.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return SamplerOutput(token_ids, logprobs)

    if len(wanted) == len(rows):
        raw, chosen = logits, ids
    else:
        index = torch.tensor(wanted, device=logits.device)
        raw, chosen = logits[index], ids[index]
    logp = torch.log_softmax(raw, dim=-1)  # (L, V)
    chosen_logp = logp.gather(1, chosen.unsqueeze(1))  # (L, 1)
    ranks = ((logp > chosen_logp).sum(dim=-1) + 1).tolist()
    num_top = min(max(rows[i].params.logprobs or 0 for i in wanted), logp.shape[1])
    top_values, top_ids = logp.topk(num_top, dim=-1)  # (L, num_top), descending
    top_values_l, top_ids_l = top_values.tolist(), top_ids.tolist()
    for j, (i, lp, rank) in enumerate(
        zip(wanted, chosen_logp.squeeze(1).tolist(), ranks, strict=True)
    ):
        n = rows[i].params.logprobs or 0
        logprobs[i] = TokenLogprobs(
            token_id=token_ids[i],
            logprob=lp,
            rank=rank,
            top_token_ids=top_ids_l[j][:n],
            top_logprobs=top_values_l[j][:n],
        )
    return SamplerOutput(token_ids, logprobs)
