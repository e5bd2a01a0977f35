"""The EAGLE / EAGLE-3 proposer: a draft head over the target's hidden states (models/eagle.py).

Head sequence. The head's position t pairs the target's feature at t (its captured layers for
the token at sequence index t) with the token at t + 1, and predicts the token at t + 2. So
once the target has computed positions .. n - 2 of a request of n tokens (the last token is
the one just sampled), the head can run every position up to n - 2, and its output there gives
draft 1 (for position n). Drafts 2..k each feed the previous draft with the head's own
predicted feature (EAGLE-1: its output; EAGLE-3: its output before the final norm).

`observe` runs the head over the rows each target step computed (prompt chunks and verified
tokens alike: `Computed.hidden`), writing the head's KV at those positions and keeping the
last row's draft and feature; `propose` then runs the k - 1 further head steps. Drafts are
the argmax for greedy requests and drawn as the sampler draws for sampled ones, their
distributions exposed as `last_draft_probs` (drafting.py). The head's KV
written by a previous round's drafts sits at positions the next `observe` overwrites with the
verified features, so rejected drafts need no rollback.

The head's paged cache (draft_kv.py sizes it) is indexed from the first position it observed
(`offset`): positions the target never computed here (a prefix-cache hit, KV handed over by
a prefill worker) have no features, so the head attends over what it saw from there on, the
rotary positions staying the true ones. A gap in what it observes starts it afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.request import Request
from llmfleet.engine.spec_decode.draft_kv import draft_num_blocks, kv_block_bytes, max_model_len
from llmfleet.engine.spec_decode.drafting import pick_tokens, stacked_probs
from llmfleet.engine.spec_decode.proposer import Computed, Proposer
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.attention.selector import select_backend
from llmfleet.models.decoder import DecoderForCausalLM
from llmfleet.models.eagle import EagleHead, load_eagle_head
from llmfleet.models.loader import LoadedModel
from llmfleet.shared.core.config import EngineConfig
from llmfleet.shared.core.errors import ModelLoadError, ValidationError
from llmfleet.shared.core.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class _HeadState:
    offset: int  # the first position the head observed: its cache index 0
    frontier: int  # positions offset .. frontier - 1 are in the head's cache
    next_token: torch.Tensor | None = None  # (1,) int64: draft 1, from the last observed row
    next_feature: torch.Tensor | None = None  # (1, H): the head's feature predicted with it
    next_q: torch.Tensor | None = None  # (V,): the distribution draft 1 was drawn from


class EagleProposer(Proposer):
    def __init__(
        self,
        head: EagleHead,
        target: DecoderForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_len: int,
    ) -> None:
        self.head = head
        self.target = target
        self.hidden_layers = head.cfg.capture_layers(len(target.layers))
        self.max_len = max_len  # the target's context limit
        param = next(head.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        cfg = head.cfg
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in head.layers
        ]
        self._embed = head.embed_tokens if head.embed_tokens is not None else target.embed_tokens
        self._states: dict[str, _HeadState] = {}

    @classmethod
    def build(
        cls, config: SpeculativeConfig, target: LoadedModel, engine_config: EngineConfig
    ) -> EagleProposer:
        ec = engine_config.resolved()
        model = target.model
        if not isinstance(model, DecoderForCausalLM) or model.tp.size > 1:
            raise ValidationError(
                "speculative.method",
                "eagle needs a decoder-only target on one rank (its hidden states and embeddings)",
            )
        device = torch.device(ec.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        limit = max_model_len(ec, target)
        try:
            head = load_eagle_head(
                str(config.model),
                dtype=ec.torch_dtype,
                device=device,
                backend=select_backend(device),
                max_position=limit + MAX_SPECULATIVE_TOKENS,
            )
        except (ModelLoadError, FileNotFoundError, KeyError) as exc:
            raise ValidationError("speculative.model", f"not a usable EAGLE head: {exc}") from exc
        cfg = head.cfg
        try:
            cfg.capture_layers(len(model.layers))
        except ModelLoadError as exc:
            raise ValidationError("speculative.model", str(exc)) from exc
        if cfg.vocab_size != target.spec.vocab_size:
            raise ValidationError(
                "speculative.model",
                f"the EAGLE head's vocabulary ({cfg.vocab_size}) differs from the target's "
                f"({target.spec.vocab_size})",
            )
        width = cfg.hidden_size if cfg.version == 1 else cfg.target_hidden_size
        if width != target.spec.hidden_size:
            raise ValidationError(
                "speculative.model",
                f"the EAGLE head reads hidden states of width {width}, the target's are "
                f"{target.spec.hidden_size}",
            )
        block_bytes = kv_block_bytes(
            len(head.layers), cfg.num_kv_heads, cfg.head_dim, ec.block_size, ec.torch_dtype
        )
        logger.info("EAGLE-%d head %s on %s", cfg.version, config.model, device)
        return cls(
            head,
            model,
            num_blocks=draft_num_blocks(ec, target, block_bytes, device),
            block_size=ec.block_size,
            max_len=limit,
        )

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self.bm.free_owner(request_id)

    # ---- feeding the head the target's features -------------------------------------------
    @torch.inference_mode()
    def observe(self, computed: Sequence[Computed]) -> None:
        rows: list[tuple[Request, _HeadState, int, int]] = []  # (req, state, start, count)
        hidden: list[torch.Tensor] = []
        for c in computed:
            req = c.request
            if c.hidden is None or c.num_kept < 1:
                continue
            st = self._states.get(req.request_id)
            if st is None or not st.offset <= c.start <= st.frontier:
                self.release(req.request_id)  # first sight, or a gap: start afresh here
                st = self._states[req.request_id] = _HeadState(c.start, c.start)
            count = min(c.num_kept, req.num_tokens - 1 - c.start)  # each row needs its token
            if count < 1:
                continue
            if not self.bm.allocate_slots(req, c.start + count - st.offset):
                self.release(req.request_id)
                continue
            st.frontier = c.start + count
            rows.append((req, st, c.start, count))
            hidden.append(c.hidden[:count])
        if not rows:
            return
        ids: list[int] = []
        positions: list[int] = []
        for req, _, start, count in rows:
            ids.extend(req.all_token_ids[start + 1 : start + 1 + count])
            positions.extend(range(start, start + count))
        feats = torch.cat(hidden).to(self.device, self.dtype)  # (T, width)
        feats = self.target.norm(feats) if self.head.cfg.version == 1 else self.head.project(feats)
        out = self._run(
            [r[0] for r in rows],
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            feats,
            positions,
            [r[3] for r in rows],
        )
        last = torch.tensor(
            [sum(r[3] for r in rows[: i + 1]) - 1 for i in range(len(rows))], device=self.device
        )
        for _, st, _, _ in rows:
            st.next_token = st.next_feature = st.next_q = None
        # Draft 1 only where the head reached the request's last token (not mid-prompt).
        ready = [i for i, (req, st, _, _) in enumerate(rows) if st.frontier == req.num_tokens - 1]
        if not ready:
            return
        features = out[last[torch.tensor(ready, device=self.device)]]  # (R, H)
        q: list[list[torch.Tensor]] = [[] for _ in ready]
        logits = self.head.draft_logits(features, self.target.compute_logits)
        tokens = pick_tokens(logits, [rows[i][0] for i in ready], q, range(len(ready)))
        for r, i in enumerate(ready):
            st = rows[i][1]
            st.next_token, st.next_feature = tokens[r : r + 1], features[r : r + 1]
            st.next_q = q[r][0] if q[r] else None

    def _run(
        self,
        reqs: list[Request],
        token_ids: torch.Tensor,  # (T,) int64 on the device
        features: torch.Tensor,  # (T, H)
        positions: list[int],  # (T,) true positions, request by request
        counts: list[int],  # tokens per request (each request's run ends at its frontier)
    ) -> torch.Tensor:  # (T, H)
        seq_lens = [
            self._states[r.request_id].frontier - self._states[r.request_id].offset for r in reqs
        ]
        tables = [self.bm.block_ids(r.request_id) for r in reqs]
        meta = AttentionMetadata.build(counts, seq_lens, tables, self.bm.block_size, self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        embeds = self._embed(token_ids).to(self.dtype)
        return self.head(embeds, features, pos, self.kv_caches, meta)

    # ---- drafting ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], k: int) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        rows: list[tuple[int, Request, _HeadState, int]] = []
        for i, req in enumerate(reqs):
            st = self._states.get(req.request_id)
            n = req.num_tokens
            k_i = min(k, self.max_len - n)
            if st is None or st.next_token is None or st.frontier != n - 1 or k_i < 1:
                continue  # the head has not seen this request up to its last token
            if not self.bm.allocate_slots(req, n - 1 + k_i - 1 - st.offset):
                self.release(req.request_id)
                continue
            rows.append((i, req, st, k_i))
        if not rows:
            return out
        rows.sort(key=lambda r: -r[3])  # most drafts first: each step runs a prefix of rows
        tokens = torch.cat([r[2].next_token for r in rows])  # (R,)
        feats = torch.cat([r[2].next_feature for r in rows])  # (R, H)
        q = [[r[2].next_q] if r[2].next_q is not None else [] for r in rows]
        drafts = [tokens]
        for j in range(1, rows[0][3]):
            m = sum(1 for r in rows if r[3] > j)
            active = rows[:m]
            positions = [r[1].num_tokens - 2 + j for r in active]
            for r, p in zip(active, positions, strict=True):
                r[2].frontier = p + 1  # (the next observe rewinds it to the verified rows)
            feats = self._run(
                [r[1] for r in active], tokens[:m], feats[:m], positions, [1] * m
            )  # (m, H)
            logits = self.head.draft_logits(feats, self.target.compute_logits)
            tokens = pick_tokens(logits, [r[1] for r in active], q, range(m))
            drafts.append(tokens)
        lists = [d.tolist() for d in drafts]
        for r, (i, req, st, k_i) in enumerate(rows):
            out[i] = [lists[j][r] for j in range(k_i)]
            st.frontier = req.num_tokens - 1  # (draft 1 and its feature stay valid until then)
        self.last_draft_probs = stacked_probs(q, [(r[0], r[3]) for r in rows], len(reqs))
        return out
