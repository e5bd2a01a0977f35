"""Picks the attention backend for a device: Triton kernels on GPUs, the reference on CPU."""

from __future__ import annotations

import logging

import torch

from llmfleet.models.attention.backend import AttentionBackend
from llmfleet.models.attention.reference import TorchReferenceBackend

logger = logging.getLogger(__name__)


def select_backend(device: torch.device | str) -> AttentionBackend:
    if torch.device(device).type == "cuda":
        from llmfleet.models.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchReferenceBackend()
