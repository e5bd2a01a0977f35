"""The draft-model proposer: a second, smaller model of the target's vocabulary drafts greedily.

The draft model keeps its own paged KV cache (its own `BlockManager` and `ModelRunner`, sized
by draft_kv.py; CUDA graphs for its decode steps on a GPU). Per request it remembers how many
of the request's tokens its cache holds (`num_real`) and which drafts it fed after them
(`fed`). `propose`:

  1. catch-up: the cache is valid up to the first fed draft the target did not accept, so
     the request's tokens from there on (the whole prompt on first sight; after a verified
     step the bonus token, and the last draft if every draft was accepted) run through the
     draft model in one varlen batch (chunked by `max_num_batched_tokens`; a steady
     catch-up of a token or two a request replays the decode graphs, a row a token); the
     logits of each request's last token give draft 1;
  2. k - 1 batched greedy decode steps give drafts 2..k (each feeds the previous draft).

Rejected drafts' KV is never read again: the next catch-up overwrites their slots. A greedy
request's drafts are the argmax (q one-hot, proposer.py); a sampled request's are drawn from
the draft's logits processed as the sampler processes the target's (temperature, min_p, top_k,
top_p; from the request's generator when seeded), and that distribution is `last_draft_probs`,
so rejection sampling keeps the target's distribution exactly and a draft close to the target
keeps most drafts. The draft's blocks go back in `release`; a request whose blocks cannot be
allocated gets no drafts this step.

A layer-truncated draft runs only a model's first N layers, then its final norm and LM head
(`TruncatedDecoder`); with the target's own checkpoint, the target's modules serve as the
draft (no second copy of the weights), so "the target as its own draft" costs only the cache.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.model_runner import ModelRunner, StepInputs, kv_bytes_per_block
from llmfleet.engine.request import Request
from llmfleet.engine.spec_decode.draft_kv import draft_num_blocks, max_model_len
from llmfleet.engine.spec_decode.drafting import pick_tokens, stacked_probs
from llmfleet.engine.spec_decode.proposer import Proposer
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.checkpoint_files import resolve_model_path
from llmfleet.models.decoder import DecoderForCausalLM
from llmfleet.models.loader import LoadedModel, ModelSpec, load_model
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


class TruncatedDecoder(nn.Module):
    """The first `num_layers` layers of `model`, then its final norm and LM head: a
    layer-truncated (early-exit) draft sharing `model`'s weights."""

    def __init__(self, model: DecoderForCausalLM, num_layers: int) -> None:
        super().__init__()
        self.inner = model
        self.num_layers = num_layers
        self.backend = model.backend

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        kv_caches: list[torch.Tensor],  # num_layers of them
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (T, hidden)
        m = self.inner
        h = m.embed_tokens(input_ids)
        rope = m.rotary_emb.at(positions)
        residual: torch.Tensor | None = None
        for layer, kv in zip(m.layers[: self.num_layers], kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv, meta)
        h, _ = m.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None):
        return self.inner.compute_logits(hidden, out)


def _same_checkpoint(a: str | None, b: str | None) -> bool:
    try:
        return resolve_model_path(a).resolve() == resolve_model_path(b).resolve()
    except Exception:  # noqa: BLE001 (an unresolvable path is simply not the same one)
        return False


def load_draft(
    config: SpeculativeConfig, target: LoadedModel, engine_config: EngineConfig
) -> tuple[nn.Module, ModelSpec]:
    """The draft model (shared with the target when it is the target's own checkpoint on one
    rank) and its spec; ValidationError when its vocabulary differs from the target's."""
    tm = target.model
    shared = (
        _same_checkpoint(config.model, engine_config.model)
        and isinstance(tm, DecoderForCausalLM)
        and tm.tp.size == 1
    )
    if shared:
        model, spec = tm, target.spec
    else:
        if config.model is None or not Path(config.model).expanduser().exists():
            raise ValidationError("speculative.model", f"no draft checkpoint at {config.model}")
        loaded = load_model(
            config.model,
            dtype=engine_config.torch_dtype,
            device=engine_config.device,
            progress=False,
            load_format=engine_config.load_format,
        )
        model, spec = loaded.model, loaded.spec
    if spec.vocab_size != target.spec.vocab_size:
        raise ValidationError(
            "speculative.model",
            f"the draft's vocabulary ({spec.vocab_size}) differs from the target's "
            f"({target.spec.vocab_size}): a draft model must share the target's tokenizer",
        )
    n = config.draft_layers
    if n is not None:
        if not isinstance(model, DecoderForCausalLM) or not 1 <= n <= spec.num_layers:
            raise ValidationError(
                "speculative.draft_layers",
                f"must be in [1, {spec.num_layers}] for a decoder-only draft, got {n}",
            )
        model = TruncatedDecoder(model, n)
        spec = dataclasses.replace(spec, num_layers=n)
    logger.info(
        "draft model %s: %d layers%s",
        spec.model_id,
        spec.num_layers,
        " (the target's weights)" if shared else "",
    )
    return model, spec


@dataclass
class _DraftState:
    num_real: int = 0  # leading tokens of the request whose KV the draft cache holds
    fed: list[int] = field(default_factory=list)  # drafts fed after them (their KV too)

    def valid(self, req: Request) -> int:
        """How many leading tokens of `req` the cache holds correctly now."""
        tokens, n = req.all_token_ids, self.num_real
        for i, t in enumerate(self.fed):
            if n + i >= len(tokens) or tokens[n + i] != t:
                return n + i
        return n + len(self.fed)


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        max_batch_tokens: int,
        graph_batch_size: int = 0,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, spec, self.bm, dtype=dtype, device=device)
        self.device = device
        self.max_len = max_len  # positions the draft may compute: < max_len
        self.max_batch_tokens = max_batch_tokens
        if device.type == "cuda" and graph_batch_size > 0:
            self.runner.capture_decode_graphs(graph_batch_size, max_len)
        self._states: dict[str, _DraftState] = {}

    @classmethod
    def build(
        cls, config: SpeculativeConfig, target: LoadedModel, engine_config: EngineConfig
    ) -> DraftModelProposer:
        ec = engine_config.resolved()
        model, spec = load_draft(config, target, ec)
        device = torch.device(ec.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        block_bytes = kv_bytes_per_block(spec, ec.block_size, ec.torch_dtype)
        # a steady catch-up brings two rows a sequence (module docstring)
        graphs = min(ec.cuda_graph_max_batch_size or 0, (ec.max_num_seqs or 0) * 2)
        return cls(
            model,
            spec,
            num_blocks=draft_num_blocks(ec, target, block_bytes, device),
            block_size=ec.block_size,
            dtype=ec.torch_dtype,
            device=device,
            max_len=min(max_model_len(ec, target), spec.max_model_len),
            max_batch_tokens=ec.max_num_batched_tokens or 2048,
            graph_batch_size=graphs,
        )

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.bm.free_owner(request_id)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], k: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        rows: list[tuple[int, Request, int, int]] = []  # (index in reqs, req, valid, k_i)
        for i, req in enumerate(reqs):
            n = req.num_tokens
            k_i = min(k, self.max_len - n)
            if k_i < 1:
                continue
            st = self._states.setdefault(req.request_id, _DraftState())
            valid = min(st.valid(req), n - 1)  # at least the last token runs: its logits
            if not self.bm.allocate_slots(req, n + k_i - 1):
                self.release(req.request_id)  # no room: no drafts, rebuilt when there is
                continue
            rows.append((i, req, valid, k_i))
        if not rows:
            return out
        rows.sort(key=lambda r: -r[3])  # most drafts first: each step runs a prefix of rows
        q: list[list[torch.Tensor]] = [[] for _ in rows]  # sampled rows: (V,) per draft
        tokens = self._catch_up([(req, valid) for _, req, valid, _ in rows], q)  # (R,) int64
        drafts = [tokens]
        for j in range(1, rows[0][3]):
            m = sum(1 for r in rows if r[3] > j)
            active = [r[1] for r in rows[:m]]
            positions = [r.num_tokens + j - 1 for r in active]
            tokens = self._decode(active, tokens[:m], positions, q)
            drafts.append(tokens)
        lists = [d.tolist() for d in drafts]  # one host read per step's drafts
        for r, (i, req, _, k_i) in enumerate(rows):
            got = [lists[j][r] for j in range(k_i)]
            out[i] = got
            self._states[req.request_id] = _DraftState(req.num_tokens, got[:-1])
        self.last_draft_probs = stacked_probs(q, [(r[0], r[3]) for r in rows], len(reqs))
        return out

    def _catch_up(
        self, rows: list[tuple[Request, int]], q: list[list[torch.Tensor]]
    ) -> torch.Tensor:
        """Run each request's tokens from index `valid` to its end; (R,) next tokens."""
        graphed = self._catch_up_graphed(rows, q)
        if graphed is not None:
            return graphed
        first = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        pending = list(enumerate(rows))
        while pending:
            batch = StepInputs([], [], [], [], [], [])
            sampled: list[int] = []
            later: list[tuple[int, tuple[Request, int]]] = []
            budget = self.max_batch_tokens
            for r, (req, start) in pending:
                n = req.num_tokens
                if budget <= 0:
                    later.append((r, (req, start)))
                    continue
                m = min(n - start, budget)
                batch.input_ids.extend(req.all_token_ids[start : start + m])
                batch.positions.extend(range(start, start + m))
                batch.query_lens.append(m)
                batch.seq_lens.append(start + m)
                batch.block_tables.append(self.bm.block_ids(req.request_id))
                if start + m == n:
                    batch.sample_tokens.append(len(batch.input_ids) - 1)
                    sampled.append(r)
                else:
                    later.append((r, (req, start + m)))
                budget -= m
            logits = self.runner.run(batch)  # (len(sampled), V)
            if sampled:
                idx = torch.tensor(sampled, dtype=torch.int64, device=self.device)
                first[idx] = pick_tokens(logits, [rows[r][0] for r in sampled], q, sampled)
            pending = later
        return first

    def _catch_up_graphed(
        self, rows: list[tuple[Request, int]], q: list[list[torch.Tensor]]
    ) -> torch.Tensor | None:
        """A steady catch-up (a token or two a request) as one replay of the decode graphs:
        each token is a row of its own (a row sees the rows before it, model_runner.py); the
        logits of each request's last row give its next token. None when it does not fit."""
        graphs = self.runner.decode_graphs
        if graphs is None or any(req.num_tokens - start > 2 for req, start in rows):
            return None
        token_ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        last: list[int] = []
        for req, start in rows:
            table = self.bm.block_ids(req.request_id)
            for p in range(start, req.num_tokens):
                token_ids.append(req.all_token_ids[p])
                positions.append(p)
                tables.append(table)
            last.append(len(token_ids) - 1)
        if not graphs.fits(positions, tables):
            return None
        logits = graphs.run(token_ids, positions, tables)
        if len(last) < len(token_ids):
            logits = logits[torch.tensor(last, dtype=torch.int64, device=self.device)]
        return pick_tokens(logits, [req for req, _ in rows], q, list(range(len(rows))))

    def _decode(
        self,
        reqs: list[Request],
        token_ids: torch.Tensor,
        positions: list[int],
        q: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        """One decode step: request i (row i of the propose batch) feeds token_ids[i] (on the
        device) at positions[i]; (n,) int64 next tokens."""
        tables = [self.bm.block_ids(r.request_id) for r in reqs]
        graphs = self.runner.decode_graphs
        rows = list(range(len(reqs)))
        if graphs is not None and graphs.fits(positions, tables):
            return pick_tokens(graphs.run(token_ids, positions, tables), reqs, q, rows)
        meta = AttentionMetadata.build(
            [1] * len(reqs), [p + 1 for p in positions], tables, self.bm.block_size, self.device
        )
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        model = self.runner.model
        hidden = model(token_ids, pos, self.runner.kv_caches, meta)  # (n, hidden)
        return pick_tokens(model.compute_logits(hidden), reqs, q, rows)
