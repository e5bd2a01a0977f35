"""Online FP8 quantization: decoder projections served as W8A8 FP8 (`--quantization fp8`).

A 16-bit checkpoint is loaded as usual; then every linear projection of the decoder layers
(fused qkv_proj, o_proj, fused gate_up_proj, down_proj) is replaced by an `Fp8Linear`:

    weight        (out, in) float8_e4m3fn   W / weight_scale[:, None], rounded to e4m3
    weight_scale  (out,)    float32         max(|W[row, :]|) / 448, one per output channel

Its forward quantizes the activation per token (dynamic scales, kernels/quant.py) and runs the
scaled FP8 GEMM (kernels/scaled_mm.py): y = (x_q @ weight^T) * x_scale * weight_scale + bias.
Both go through kernels/dispatch.py: Triton on a GPU, the PyTorch reference (dequantize and
matmul) elsewhere, which CPU unit tests use for the layer math. Embeddings, norms, the output
head, MoE routers and experts stay in the model's dtype: the head and router decide tokens and
routes directly, and the experts are stacked tensors of the fused MoE kernel.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmfleet.models.layers import row_parallel_group, rowwise_linear
from llmfleet.models.parallel import TensorParallel
from llmfleet.shared.core.errors import ValidationError

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)
# The projections of a decoder layer that FP8 serves; absent ones (an MoE layer's dense MLP)
# and ones already packed otherwise (Int4Linear from GGUF Q4) are left alone.
FP8_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# FP8 tensor-core instructions: Ada (sm_89) and Hopper (sm_90) onward.
MIN_FP8_CAPABILITY = (8, 9)


class Fp8Linear(nn.Module):
    """y = x W^T + b with W held in FP8 e4m3 plus one float32 scale per output channel.

    Invariants: `weight` is (out, in) float8_e4m3fn and unit-stride along `in`; `weight_scale`
    is (out,) float32 > 0; `out_dtype` is the dtype of the outputs and of `bias`.

    Under tensor parallelism a row-parallel projection (o_proj, down_proj: `tp` set) holds this
    rank's input columns, quantized with scales over those columns alone; its partial outputs
    are summed over the group, then the bias is added once (layers.RowParallelLinear). A
    column-parallel one holds whole rows, so its scales are TP=1's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        out_dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype = out_dtype
        self.tp = tp  # row-parallel: sum the partial outputs over the group
        w = torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device)
        self.register_buffer("weight", w)
        self.register_buffer("weight_scale", torch.ones(out_features, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device))
            if bias
            else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """The FP8 form of `linear` (same device; the output dtype is its weight's dtype)."""
        from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

        w = linear.weight.detach()
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            out_dtype=w.dtype,
            device=w.device,
            tp=row_parallel_group(linear),
        )
        # Per-row quantization of W is per-token quantization of a (out, in) matrix.
        q, scale = dispatch.per_token_quant(w.contiguous())
        with torch.no_grad():
            new.weight.copy_(q)
            new.weight_scale.copy_(scale.reshape(-1))
            if linear.bias is not None and new.bias is not None:
                new.bias.copy_(linear.bias)
        return new

    def dequantized_weight(self) -> torch.Tensor:
        """(out, in) float32: the weight this layer multiplies by."""
        return self.weight.float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        from llmfleet.kernels import dispatch  # Triton is only needed on GPUs

        def matmul(x2: torch.Tensor) -> torch.Tensor:
            return dispatch.fp8_linear(x2, self.weight, self.weight_scale, self.out_dtype)

        return rowwise_linear(x, self.out_features, self.bias, matmul, self.tp)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, out_dtype={self.out_dtype}"
            + (f", row-parallel over {self.tp.size} ranks" if self.tp is not None else "")
        )


def check_quantization(
    quantization: str | None, device: str | torch.device, dtype: torch.dtype
) -> None:
    """Raise ValidationError('quantization') unless the model can be served so."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValidationError("quantization", f"must be fp8 or unset, got {quantization!r}")
    dev = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValidationError(
            "quantization", f"fp8 needs dtype bfloat16 or float16 (the model is {dtype})"
        )
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValidationError(
            "quantization", f"fp8 needs a CUDA device with FP8 support (sm_89+), got {dev}"
        )
    cap = torch.cuda.get_device_capability(dev)
    if cap < MIN_FP8_CAPABILITY:
        raise ValidationError(
            "quantization",
            f"fp8 needs a CUDA device with FP8 support (sm_89+); {dev} is sm_{cap[0]}{cap[1]}",
        )


def use_fp8_linears(model: nn.Module) -> list[str]:
    """Replace each decoder layer's FP8_PROJECTIONS that are 16-bit nn.Linear by Fp8Linear,
    one at a time (the 16-bit weight is dropped as its FP8 copy appears, so the peak is the
    16-bit model plus one projection). Returns the module names replaced."""
    replaced = []
    for i, layer in enumerate(model.get_submodule("layers")):
        for name in FP8_PROJECTIONS:
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name)
            old = getattr(parent, attr, None)
            if not isinstance(old, nn.Linear):  # already quantized (FP8 or INT4)
                continue
            setattr(parent, attr, Fp8Linear.from_linear(old))
            replaced.append(f"layers.{i}.{name}")
    logger.info(
        "%d linear layers quantized to FP8 (e4m3, per-channel weight scales)", len(replaced)
    )
    return replaced
