"""Turns a `SchedulerOutput` into one flattened forward pass and the logits to sample.

The batch has no padding: the new tokens of every scheduled request laid end to end, with
their positions and slots in the paged cache. Only the rows that reach their request's last
token go through the LM head.

Speculative decoding: a request with d drafts brings its last known token at position p and
its drafts at p + 1 .. p + d, and all d + 1 rows go through the LM head. A step of decoding
sequences (one known token each, drafts or not) stays a pure decode step: row i of a sequence
decodes position p + i over the sequence's block table with context length p + i + 1 (each
layer writes every row's KV before attending, so a draft row sees the rows before it), so it
replays the decode graphs like any decode step, drafts costing no extra graphs. In a step with
prompt chunks, the varlen attention takes the d + 1 tokens as one multi-token query. With
`capture_layers` set (an EAGLE proposer's target layers), every step runs eagerly and returns
the model's captured hidden states of all its input tokens.

On CUDA, after `capture_decode_graphs`, a pure-decode step (one new token per sequence) of at
most the captured batch size replays a CUDA graph instead (see cuda_graphs.py): padded to a
captured size, every row through the LM head, the padding rows' logits dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmfleet.engine.block_manager import BlockManager
from llmfleet.engine.cuda_graphs import DecodeGraphs, PaddedDecoder
from llmfleet.engine.mm_inputs import MultimodalInputs
from llmfleet.engine.request import Request
from llmfleet.engine.scheduler import SchedulerOutput
from llmfleet.models.attention.metadata import AttentionMetadata
from llmfleet.models.loader import ModelSpec

logger = logging.getLogger(__name__)


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * spec.num_kv_heads * spec.head_dim * elem * spec.num_layers


@dataclass
class StepInputs:
    """An eager step's batch as flat lists: sequence i brings query_lens[i] new tokens (laid
    end to end in input_ids / positions) and ends at seq_lens[i]; only the tokens at flat
    indices `sample_tokens` go through the LM head. A tensor-parallel rank 0 sends exactly
    this to the other ranks (tp_step.py)."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_tokens: list[int]


@dataclass
class StepOutput:
    # (num_sampling_rows, vocab) float32; after a graph replay a view of the graphs' static
    # buffer, valid until the next step
    logits: torch.Tensor
    sampling_rows: list[int]  # index into scheduled of each logits row (d + 1 with drafts)
    replayed: bool = False  # a decode step through the captured graphs (`decode_graphs`)
    # With `ModelRunner.capture_layers`: (num_input_tokens, width) captured hidden states of
    # the eager step's flat batch, and the flat index of each scheduled request's first input.
    aux_hidden: torch.Tensor | None = None
    token_starts: list[int] | None = None


class BlockRead:
    """KV blocks on their way to the host (`ModelRunner.start_read`): `payload` is the pinned
    (nb, num_layers, 2, block_size, num_kv_heads, head_dim) tensor (or a device tensor, read
    with `to_host` False), valid once `done`."""

    def __init__(self, payload: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        self.payload = payload
        self._copied = copied  # None: copied already (off CUDA)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes

    def done(self) -> bool:
        return self._copied is None or self._copied.query()

    def wait(self) -> torch.Tensor:
        """The payload, once copied (blocks this thread until then)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self.payload


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        spec: ModelSpec,
        block_manager: BlockManager,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.spec = spec
        self.bm = block_manager
        self.device = device
        bs = block_manager.block_size
        shape = (2, block_manager.num_blocks, bs, spec.num_kv_heads, spec.head_dim)
        # One cache tensor per layer: (2, num_blocks, block_size, num_kv_heads, head_dim).
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            block_manager.num_blocks,
            bs,
            block_manager.num_blocks * kv_bytes_per_block(spec, bs, dtype) / 2**20,
        )
        # The captured decode graphs (in CPU tests: the same padded path, run eagerly).
        self.decode_graphs: PaddedDecoder | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: KV reads to the host
        # The latest eager step's (num_tokens, hidden) final-norm hidden states, kept only when
        # it ran an embedding's tokens (`keep_hidden`), for the engine's pooler; else None.
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # Target layers whose outputs every step captures (models/decoder.py), for an EAGLE
        # proposer; () captures none. Set with `set_capture_layers`.
        self.capture_layers: tuple[int, ...] = ()
        self._last_aux: torch.Tensor | None = None
        # Images (vision-language models: encoder runs, input embeddings, M-RoPE positions);
        # set by forward_pass.py.
        self.mm: MultimodalInputs | None = None

    def set_capture_layers(self, layers: tuple[int, ...]) -> None:
        """Capture these target layers' outputs in every (then eager) step."""
        self.capture_layers = tuple(layers)
        self.model.capture_layers = self.capture_layers

    def capture_decode_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        """Capture CUDA graphs for decode batches of up to `max_batch_size` sequences whose
        contexts stay within `max_model_len`; later pure-decode steps that fit replay them.
        A model whose attention backend is not graph-safe keeps running eagerly."""
        backend = getattr(self.model, "backend", None)
        if not getattr(backend, "cuda_graph_safe", False):
            logger.warning(
                "attention backend %r cannot run inside CUDA graphs: decode steps run eagerly",
                getattr(backend, "name", type(backend).__name__),
            )
            return
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            vocab_size=self.spec.vocab_size,
        )
        graphs.capture()
        self.decode_graphs = graphs

    # ---- KV block copies (export, import, lease transfer) ------------------------------------
    # A payload is (nb, num_layers, 2, block_size, num_kv_heads, head_dim): block-major, so
    # payload[i] is one block's wire frame; the cache is layer-major with blocks on dim 1.
    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy blocks out of the cache to a contiguous CPU tensor (see the layout above);
        waits for the copy."""
        return self.start_read(block_ids).wait()

    @torch.inference_mode()
    def start_read(self, block_ids: list[int], *, to_host: bool = True) -> BlockRead:
        """Start copying blocks to the host and return at once. On CUDA the copy runs on a side
        stream, after the steps queued so far (so it reads what they wrote) and beside the ones
        queued later, into pinned memory: the engine never waits for it. The caller keeps the
        blocks from being rewritten until the read is done (they are held, or pinned).
        `to_host` False (CUDA): the payload stays on the device, a fresh contiguous tensor
        (for a device-to-device transfer, shared/wire/cuda_ipc.py)."""
        if self.device.type != "cuda":
            return BlockRead(self._payload(block_ids).contiguous(), None)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        written = torch.cuda.Event()
        written.record()
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(written)
            staged = self._payload(block_ids).contiguous()
            out = staged
            if to_host:
                out = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
                out.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return BlockRead(out, done)

    def _payload(self, block_ids: list[int]) -> torch.Tensor:
        """What `start_read` copies to the host: (nb, L, 2, bs, H, D) on the device."""
        return self.cache_blocks(block_ids)

    def cache_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's cache of the blocks: (nb, L, 2, bs, H, D) on the device."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        per_layer = [kv.index_select(1, idx) for kv in self.kv_caches]  # L x (2, nb, bs, H, D)
        return torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5)  # (nb, L, 2, bs, H, D)

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Copy a payload (nb, L, 2, bs, H, D) into cache blocks `block_ids`, in order."""
        self.check_payload(block_ids, payload)
        self.write_cache(block_ids, payload)

    def check_payload(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """ValueError unless `payload` is (len(block_ids), *block_shape)."""
        if payload.shape[0] != len(block_ids) or tuple(payload.shape[1:]) != self.block_shape:
            raise ValueError(
                f"payload shape {tuple(payload.shape)} does not match "
                f"({len(block_ids)}, {', '.join(map(str, self.block_shape))})"
            )

    def write_cache(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Copy (nb, L, 2, bs, H, D) into this rank's cache blocks (H: its own heads)."""
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        # From pinned memory the copy is asynchronous (the engine thread does not wait for it;
        # the cache writes below follow it on the same stream).
        src = payload.to(self.device, self.kv_caches[0].dtype, non_blocking=payload.is_pinned())
        src = src.permute(1, 2, 0, 3, 4, 5)  # (L, 2, nb, bs, H, D)
        for layer, kv in enumerate(self.kv_caches):
            kv.index_copy_(1, idx, src[layer])

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's payload shape: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
        kv = self.kv_caches[0]
        return (len(self.kv_caches), 2, kv.shape[2], kv.shape[3], kv.shape[4])

    def close(self) -> None:
        """Release what the runner holds beyond its tensors (tensor parallelism: its ranks)."""

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepOutput:
        self.keep_hidden = any(s.request.pooling is not None for s in sched.scheduled)
        # Steps with image rows or shifted (M-RoPE) positions run eagerly.
        mm = sched if self.mm is not None and self.mm.involved(sched) else None
        graphable = not self.keep_hidden and all(
            s.num_new_tokens - len(s.spec_token_ids) == 1 for s in sched.scheduled
        )
        graphable = graphable and mm is None and not self.capture_layers
        if self.decode_graphs is not None and graphable:
            step = self._replay_decode(sched, self.decode_graphs)
            if step is not None:
                return step
        batch = StepInputs([], [], [], [], [], [])
        sampling_rows: list[int] = []
        token_starts: list[int] = []
        # A step of decoding sequences (one known token each) stays a pure decode step, the
        # drafts as decode rows (see the module docstring).
        rows = mm is None and all(
            s.num_new_tokens - len(s.spec_token_ids) == 1 for s in sched.scheduled
        )
        for j, s in enumerate(sched.scheduled):
            req, n, drafts = s.request, s.num_new_tokens, s.spec_token_ids
            start = req.num_computed_tokens
            token_starts.append(len(batch.input_ids))
            batch.input_ids.extend(req.all_token_ids[start : start + n - len(drafts)])
            batch.input_ids.extend(drafts)
            batch.positions.extend(range(start, start + n))
            if rows:
                batch.query_lens.extend([1] * n)
                batch.seq_lens.extend(range(start + 1, start + n + 1))
                batch.block_tables.extend([self.bm.block_ids(req.request_id)] * n)
            else:
                batch.query_lens.append(n)
                batch.seq_lens.append(start + n)
                batch.block_tables.append(self.bm.block_ids(req.request_id))
            if s.samples:  # the last known token's row, and each draft's
                end = len(batch.input_ids)
                batch.sample_tokens.extend(range(end - 1 - len(drafts), end))
                sampling_rows.extend([j] * (1 + len(drafts)))
        logits = self.run(batch, mm)
        if not self.capture_layers:
            return StepOutput(logits, sampling_rows)
        return StepOutput(
            logits, sampling_rows, aux_hidden=self._last_aux, token_starts=token_starts
        )

    @torch.inference_mode()
    def run(self, batch: StepInputs, mm: SchedulerOutput | None = None) -> torch.Tensor:
        """The forward pass of `batch` and its (len(sample_tokens), vocab) float32 logits;
        `mm`: the step's schedule, when it has images or M-RoPE positions (mm_inputs.py)."""
        meta = AttentionMetadata.build(
            batch.query_lens, batch.seq_lens, batch.block_tables, self.bm.block_size, self.device
        )
        ids_t = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        if mm is not None and self.mm is not None:
            embeds, pos_t = self.mm.inputs(mm, ids_t, pos_t)  # (T, hidden) | None, (T,) | (3, T)
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta, inputs_embeds=embeds)
        else:
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta)  # (num_tokens, hidden)
        self.last_hidden = hidden if self.keep_hidden else None
        self._last_aux = getattr(self.model, "aux_hidden", None) if self.capture_layers else None
        sample_tokens = batch.sample_tokens
        if not sample_tokens:
            return hidden.new_empty((0, self.spec.vocab_size))
        if len(sample_tokens) != hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_tokens, device=self.device)]
        return self.model.compute_logits(hidden)  # (num_sampling_rows, vocab) float32

    def _replay_decode(self, sched: SchedulerOutput, graphs: PaddedDecoder) -> StepOutput | None:
        """A decode step through a captured graph, a sequence's drafts as rows after its token
        (see the module docstring); None when the batch does not fit."""
        requests: list[Request] = []
        token_ids: list[int] = []
        positions: list[int] = []
        kept: list[int] = []  # the logits rows of the sequences that sample
        rows: list[int] = []  # their index into scheduled
        for j, s in enumerate(sched.scheduled):
            req, p = s.request, s.request.num_computed_tokens
            tokens = [req.all_token_ids[p], *s.spec_token_ids]
            if s.samples:
                kept.extend(range(len(token_ids), len(token_ids) + len(tokens)))
                rows.extend([j] * len(tokens))
            requests.extend([req] * len(tokens))
            token_ids.extend(tokens)
            positions.extend(range(p, p + len(tokens)))
        logits = self._replay(graphs, requests, token_ids, positions)  # (rows, vocab)
        if logits is None:
            return None
        if len(kept) != len(token_ids):
            logits = logits[torch.tensor(kept, device=self.device)]
        return StepOutput(logits, rows, replayed=True)

    @torch.inference_mode()
    def execute_chained(
        self, requests: list[Request], token_ids: torch.Tensor
    ) -> StepOutput | None:
        """A decode step whose inputs are not on the host yet: request i decodes
        `token_ids[i]` (int64, on the device: the previous step's samples) at position
        `requests[i].num_tokens`, the slot after its last known token, through the captured
        graphs. Its blocks must already hold that slot. None when the batch does not fit the
        graphs (or there are none); the caller then waits and runs an ordinary step."""
        if self.decode_graphs is None:
            return None
        positions = [r.num_tokens for r in requests]
        logits = self._replay(self.decode_graphs, requests, token_ids, positions)
        if logits is None:
            return None
        return StepOutput(logits, list(range(len(requests))), replayed=True)

    def _replay(
        self,
        graphs: PaddedDecoder,
        requests: list[Request],
        token_ids: list[int] | torch.Tensor,
        positions: list[int],
    ) -> torch.Tensor | None:
        """(n, vocab) logits of request i decoding token_ids[i] at positions[i] through the
        graphs; None when the batch does not fit them."""
        tables = [self.bm.block_ids(r.request_id) for r in requests]
        if not graphs.fits(positions, tables):
            return None
        return self._run_graphs(graphs, token_ids, positions, tables)

    def _run_graphs(
        self,
        graphs: PaddedDecoder,
        token_ids: list[int] | torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """One decode step that fits `graphs` (tensor parallelism: on every rank)."""
        return graphs.run(token_ids, positions, tables)
