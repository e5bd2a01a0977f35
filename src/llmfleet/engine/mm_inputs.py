"""Images inside the engine: admission checks, the encoder runs of a step, and the step's input
embeddings and positions.

    mm = MultimodalInputs(model, device, cache_bytes)   # model: any CausalLM
    mm.check(prompt, images, pixels)        # intake: ValidationError / MissingPixels
    mm.attach(req, pixels)                  # admission: pins, M-RoPE positions
    embeds, pos = mm.inputs(sched, ids, pos)  # model runner, per step with images
    mm.release(req)                         # the request ended

A step's flat batch holds request j's tokens [start_j, end_j) at rows [base_j, base_j + n_j).
Every image whose placeholder run [offset, offset + length) intersects a scheduled chunk and
whose encoder output is not cached is encoded in ONE `encode_images` call for the whole step
(across requests, each distinct content hash once); its rows enter the encoder cache. Then:

    embeds = embed_input_ids(ids)                                 # (T, hidden)
    embeds[base_j + lo - start_j : base_j + hi - start_j] = rows[lo - offset : hi - offset]
        for lo, hi = max(start_j, offset), min(end_j, offset + length)

so a chunk boundary inside a placeholder run takes just its slice, and an image wholly inside
a prefix-cache hit is never encoded. Positions: M-RoPE requests take their prompt tokens'
(3, L) positions from `rope_positions` and later tokens i + rope_delta; when no token of the
step needs distinct axes the positions stay (T,).

A request pins its images' cache entries from admission until it ends, so a request that came
without pixels (its image was cached) finds them at every step, recompute after preemption
included. Pixels a request brought are dropped once encoded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from llmfleet.engine.encoder_cache import EncoderCache
from llmfleet.engine.request import Request
from llmfleet.engine.scheduler import SchedulerOutput
from llmfleet.models.multimodal import MultimodalCausalLM
from llmfleet.shared.core.errors import ValidationError
from llmfleet.shared.core.multimodal import ImageRef, PixelInput, check_images


class MissingPixels(ValidationError):
    """A request's images are neither in the encoder cache nor supplied: `hashes` lack pixels
    (the worker fetches them and admits again)."""

    def __init__(self, hashes: Sequence[str]) -> None:
        self.hashes = list(hashes)
        shown = ", ".join(h[:12] for h in self.hashes)
        super().__init__("images", f"no pixels for image(s) {shown}")


class MultimodalInputs:
    """One engine's image state (owned by the engine thread); counters for metrics."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        cache_bytes: int,
        *,
        tensor_parallel: bool = False,
    ) -> None:
        vlm = isinstance(model, MultimodalCausalLM)
        self.model = model if vlm and not tensor_parallel else None
        # Why a request with images is refused (when it is).
        self.unsupported = (
            "images need tensor_parallel_size 1" if vlm else "the served model takes no images"
        )
        self.device = device
        self.cache = EncoderCache(cache_bytes)
        self.num_hits = 0  # images found encoded when a request first needed them
        self.num_misses = 0  # images encoded
        self.num_encoder_runs = 0
        self.encoder_seconds = 0.0  # summed wall time of the encoder runs
        # (request id, seconds) of requests whose images are all encoded, for metrics (drained)
        self.finished_encodes: list[tuple[str, float]] = []
        self._seen: dict[str, set[int]] = {}  # request id -> indexes of images counted

    @property
    def enabled(self) -> bool:
        return self.model is not None

    # ---- admission ---------------------------------------------------------------------------
    def check(
        self,
        prompt: Sequence[int],
        images: Sequence[ImageRef],
        pixels: Mapping[str, PixelInput] | None,
    ) -> None:
        """ValidationError naming `images` unless this model takes them, each run lies in the
        prompt on placeholder tokens, and (unless `pixels` is None: the prompt's KV comes
        computed) each image is cached or has its pixels (MissingPixels: the hashes to fetch)."""
        if not images:
            return
        if self.model is None:
            raise ValidationError("images", self.unsupported)
        try:
            check_images(images, len(prompt))
        except ValueError as e:
            raise ValidationError("images", str(e)) from None
        token = self.model.image_token_id
        for i, im in enumerate(images):
            if any(t != token for t in prompt[im.offset : im.end]):
                raise ValidationError(
                    f"images[{i}]",
                    f"tokens [{im.offset}, {im.end}) are not all the image placeholder {token}",
                )
        if pixels is None:
            return
        missing = {im.content_hash for im in images} - set(pixels)
        missing = [h for h in missing if h not in self.cache]
        if missing:
            raise MissingPixels(sorted(missing))

    def attach(self, req: Request, pixels: Mapping[str, PixelInput]) -> None:
        """Admit `req`'s images (its `images` set, `check` passed): pin their cache entries,
        keep the pixels the cache lacks, compute its M-RoPE positions."""
        if not req.images or self.model is None:
            return
        hashes = [im.content_hash for im in req.images]
        self.cache.pin(req.request_id, hashes)
        req.pixels = {h: pixels[h] for h in hashes if h in pixels and h not in self.cache}
        req.rope_positions, req.rope_delta = self.model.rope_positions(
            req.prompt_token_ids, req.images
        )
        if req.rope_positions is not None:
            req.rope_positions = req.rope_positions.to("cpu", torch.long)

    def release(self, req: Request) -> None:
        """`req` ended: its pins go (its entries become evictable)."""
        if req.images:
            self.cache.unpin(req.request_id)
            req.pixels = {}
            if self._seen.pop(req.request_id, None) is not None:
                self.finished_encodes.append((req.request_id, req.encoder_seconds))

    # ---- a step ------------------------------------------------------------------------------
    def involved(self, sched: SchedulerOutput) -> bool:
        """Whether the step needs `inputs`: a chunk reaches an image's placeholders or takes
        M-RoPE positions (a decode step of a LLaVA request does not: it may replay graphs)."""
        if self.model is None:
            return False
        for s in sched.scheduled:
            req = s.request
            if not req.images:
                continue
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            if req.rope_delta or (req.rope_positions is not None and start < req.num_prompt_tokens):
                return True
            if any(im.offset < end and im.end > start for im in req.images):
                return True
        return False

    def drop_lacking(self, sched: SchedulerOutput) -> list[Request]:
        """Take out of `sched` and return the requests with an image this step needs that is
        neither cached nor supplied (a decode worker's recompute after its prompt blocks were
        evicted); the caller ends them."""
        if not self.involved(sched):
            return []
        out = []
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            for im in req.images:
                if im.offset < end and im.end > start:
                    h = im.content_hash
                    if h not in self.cache and h not in req.pixels:
                        out.append(req)
                        break
        if out:
            sched.scheduled = [s for s in sched.scheduled if s.request not in out]
        return out

    def inputs(
        self, sched: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's (T, hidden) input embeddings (None: no image row in it) and positions
        ((T,) or (3, T)), given the flat batch's (T,) ids and sequence-index positions."""
        assert self.model is not None  # `involved` said so
        chunks = []  # (request, start, end, base row)
        base = 0
        for s in sched.scheduled:
            start = s.request.num_computed_tokens
            chunks.append((s.request, start, start + s.num_new_tokens, base))
            base += s.num_new_tokens
        rows = self._encode(chunks)
        embeds = None
        if rows:
            embeds = self.model.embed_input_ids(input_ids)  # (T, hidden)
            for req, start, end, base in chunks:
                for im in req.images:
                    lo, hi = max(start, im.offset), min(end, im.end)
                    if lo < hi:
                        src = rows[im.content_hash][lo - im.offset : hi - im.offset]
                        embeds[base + lo - start : base + hi - start] = src
        return embeds, self._positions(chunks, positions)

    def _encode(self, chunks: list[tuple[Request, int, int, int]]) -> dict[str, torch.Tensor]:
        """Encoder rows of every image the chunks touch, encoding the uncached ones at once."""
        assert self.model is not None
        rows: dict[str, torch.Tensor] = {}
        todo: dict[str, PixelInput] = {}
        waiting: dict[str, list[Request]] = {}  # hash -> requests whose rows it brings
        for req, start, end, _ in chunks:
            seen = self._seen.setdefault(req.request_id, set()) if req.images else set()
            for i, im in enumerate(req.images):
                if not (im.offset < end and im.end > start):
                    continue
                h = im.content_hash
                cached = rows.get(h)
                if cached is None and h not in todo:
                    cached = self.cache.get(h)
                if cached is not None:
                    rows[h] = cached
                    req.pixels.pop(h, None)
                    if i not in seen:
                        self.num_hits += 1
                else:
                    if h not in todo:
                        todo[h] = req.pixels[h]
                    waiting.setdefault(h, []).append(req)
                    if i not in seen:
                        self.num_misses += 1
                seen.add(i)
        if not todo:
            return rows
        t0 = time.perf_counter()
        hashes = list(todo)
        outs = self.model.encode_images([todo[h] for h in hashes])
        for h, out in zip(hashes, outs, strict=True):
            rows[h] = out
            self.cache.put(h, out)
        seconds = time.perf_counter() - t0
        self.num_encoder_runs += 1
        self.encoder_seconds += seconds
        for h, reqs in waiting.items():
            for req in dict.fromkeys(reqs):
                req.encoder_seconds += seconds / len(waiting)
                req.pixels.pop(h, None)
        return rows

    def _positions(
        self, chunks: list[tuple[Request, int, int, int]], positions: torch.Tensor
    ) -> torch.Tensor:
        """(T,) sequence indices -> the model's positions (see the module docstring)."""
        three = any(
            req.rope_positions is not None and start < req.num_prompt_tokens
            for req, start, _, _ in chunks
        )
        if not three and not any(req.rope_delta for req, _, _, _ in chunks):
            return positions
        out = positions.to("cpu").repeat(3, 1) if three else positions.to("cpu").clone()
        for req, start, end, base in chunks:
            if req.rope_positions is None:
                continue
            n_prompt = min(end, req.num_prompt_tokens) - start  # prompt tokens in the chunk
            if n_prompt > 0:
                out[:, base : base + n_prompt] = req.rope_positions[:, start : start + n_prompt]
            rest = slice(base + max(n_prompt, 0), base + end - start)
            out[..., rest] += req.rope_delta
        return out.to(self.device)
