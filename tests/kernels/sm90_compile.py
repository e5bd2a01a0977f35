"""Compile kernels for an sm_90 GPU (H100/H200) without one: Triton's front end, its
optimizer and ptxas, as a GPU run would at its first launch. The interpreter runs the kernels'
Python, which accepts code the compiler rejects (a type that differs between the branches of
a constexpr `if`, for one), so CI compiles the specializations the GPU serves as well. Run by
test_sm90_compile.py in a process of its own: TRITON_INTERPRET must be off before triton is
imported (triton_utils.py says why). Prints one line per compiled specialization."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from llmfleet.kernels import (  # noqa: E402
    all_reduce,
    argmax,
    gemv,
    paged_attention_decode,
    rotary_kv_write,
    shard_embedding,
    skinny_gemm,
)

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(kernel, params: dict[str, object], num_warps: int) -> int:
    """Compile `kernel` with `params` in its parameters' order: a str is a runtime argument's
    Triton type ("*bf16", "i32", ...), anything else a constexpr's value. Returns PTX bytes."""
    names = kernel.arg_names
    if list(params) != names:
        raise ValueError(f"parameters {list(params)} are not the kernel's {names}")
    signature = {n: (v if isinstance(v, str) else "constexpr") for n, v in params.items()}
    constexprs = {(i,): v for i, (n, v) in enumerate(params.items()) if not isinstance(v, str)}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=SM90, options={"num_warps": num_warps})
    return len(compiled.asm["ptx"])


def all_reduce_cases():
    for dtype in ("bf16", "fp16", "fp32"):
        empty, standin = all_reduce.EMPTY[4 if dtype == "fp32" else 2]
        for norm, residual in ((False, False), (True, False), (True, True)):
            pushed = norm and dtype == "bf16"  # a pushing GEMV's call (one row, 16-bit)
            yield (
                f"all_reduce {dtype} norm={norm} residual={residual} pushed={pushed}",
                all_reduce._all_reduce_kernel,
                dict(
                    x_ptr=f"*{dtype}",
                    stride_x="i32",
                    data_ptrs="*i64",
                    seq_ptr="*i32",
                    res_ptr=f"*{dtype}",
                    stride_res="i32",
                    w_ptr=f"*{dtype}",
                    out_ptr=f"*{dtype}",
                    sum_ptr=f"*{dtype}",
                    eps="fp32",
                    RANK=1,
                    WORLD=2,
                    H=4096,
                    BLOCK=4096,
                    ROW_ELEMS=all_reduce.ROW_BYTES // (4 if dtype == "fp32" else 2),
                    MAX_ROWS=all_reduce.MAX_ROWS,
                    WIDE=dtype == "fp32",
                    EMPTY=empty,
                    STANDIN=standin,
                    HAS_RESIDUAL=residual,
                    NORM=norm,
                    PUSHED=pushed,
                    PDL=True,
                    EARLY=pushed,  # (a parameter's norm weight, read before the wait)
                ),  # fmt: skip
                16,
            )


def gemv_cases():
    """Plain (float32 logits out, weight read before the wait or after), gated, and pushing
    its bf16 row into an all-reduce's cells (a row-parallel projection's)."""
    empty, standin = all_reduce.EMPTY[2]
    cases = [(False, False, False), (False, True, False), (True, False, False), (True, True, False)]
    for gated, early, push in cases + [(False, True, True)]:
        wide = not gated and not push
        yield (
            f"gemv gated={gated} early={early} push={push}",
            gemv._gemv_kernel,
            dict(
                x_ptr="*bf16",
                w_ptr="*bf16",
                bias_ptr="*bf16",
                out_ptr="*fp32" if wide else "*bf16",
                N="i32",
                K="i32",
                stride_wn="i32",
                HAS_BIAS=False,
                EVEN_K=True,
                GATED=gated,
                ROUND=wide,
                BLOCK_N=4,
                BLOCK_K=512,
                PDL=True,
                EARLY=early,
                data_ptrs="*i64" if push else None,
                seq_ptr="*i32" if push else None,
                PUSH=push,
                RANK=1,
                WORLD=2,
                ROW_ELEMS=all_reduce.ROW_BYTES // 2,
                MAX_ROWS=all_reduce.MAX_ROWS,
                EMPTY=empty,
                STANDIN=standin,
            ),  # fmt: skip
            4,
        )


def argmax_cases():
    yield (
        "argmax pieces",
        argmax._piece_kernel,
        dict(
            x_ptr="*fp32",
            val_ptr="*fp32",
            idx_ptr="*i32",
            V="i32",
            stride_x="i32",
            P="i32",
            CHUNK=argmax.CHUNK,
            PDL=True,
        ),  # fmt: skip
        4,
    )
    yield (
        "argmax rows",
        argmax._rows_kernel,
        dict(val_ptr="*fp32", idx_ptr="*i32", out_ptr="*i64", P="i32", BLOCK_P=64, PDL=True),
        4,
    )


def _decode_params(single: bool, rope: bool) -> dict[str, object]:
    """`_decode_partial_kernel`'s arguments as the launcher passes them for Llama-3-8B (32 / 8
    heads of 128, 16-token blocks, bf16): without ROPE its rotary arguments are placeholders
    (q's and seq_lens' pointers, zero strides)."""
    return dict(
        q_ptr="*bf16",
        kv_ptr="*bf16",
        block_tables_ptr="*i32",
        seq_lens_ptr="*i32",
        out_ptr="*bf16",
        part_acc_ptr="*fp32",
        part_ml_ptr="*fp32",
        arrived_ptr="*i32",
        k_ptr="*bf16",
        v_ptr="*bf16",
        pos_ptr="*i64" if rope else "*i32",
        cos_sin_ptr="*fp32" if rope else "*bf16",
        slot_ptr="*i64" if rope else "*i32",
        qk_scale="fp32",
        min_partition="i32",
        num_parts="i32",
        stride_ml="i32",
        stride_q_seq="i32",
        stride_q_head="i32",
        stride_o_seq="i32",
        stride_o_head="i32",
        stride_c_kv="i64",
        stride_c_block="i32",
        stride_c_off="i32",
        stride_c_head="i32",
        stride_bt_seq="i32",
        stride_k_seq="i32",
        stride_k_head="i32",
        stride_v_seq="i32",
        stride_v_head="i32",
        NUM_HEADS=32,
        GROUP=4,
        BLOCK_G=16,
        HEAD_DIM=128,
        CACHE_BLOCK=16,
        BLOCK_N=64,
        SINGLE_PARTITION=single,
        REDUCE_LAST=not single,
        REDUCE_PARTS=4,
        ROPE=rope,
        HALF=64 if rope else 0,
        PDL=True,
    )


def decode_step_cases():
    """Decode attention (one partition, and split with the last program combining; without
    and with the rotary and cache write folded in), the rotary + KV cache write, and the
    skinny GEMM (split-K, gated): a Llama-3-8B layer's."""
    for rope in (False, True):
        for single in (True, False):
            yield (
                f"decode attention single_partition={single} rope={rope}",
                paged_attention_decode._decode_partial_kernel,
                _decode_params(single, rope),
                4,
            )
    yield (
        "rotary + KV cache write",
        rotary_kv_write._rotary_kv_write_kernel,
        dict(
            pos_ptr="*i64",
            q_ptr="*bf16",
            k_ptr="*bf16",
            v_ptr="*bf16",
            cos_sin_ptr="*fp32",
            cache_ptr="*bf16",
            slot_ptr="*i64",
            stride_q_tok="i32",
            stride_q_head="i32",
            stride_k_tok="i32",
            stride_k_head="i32",
            stride_v_tok="i32",
            stride_v_head="i32",
            stride_c_kv="i64",
            stride_c_block="i32",
            stride_c_off="i32",
            stride_c_head="i32",
            NUM_Q_HEADS=32,
            NUM_KV_HEADS=8,
            HEAD_DIM=128,
            HALF=64,
            BLOCK_SIZE=16,
            BLOCK_HQ=32,
            BLOCK_HK=8,
            BLOCK_R=64,
            BLOCK_REST=0,
            BLOCK_D=128,
            PDL=True,
        ),  # fmt: skip
        4,
    )
    for gated in (False, True):
        yield (
            f"skinny GEMM split-K gated={gated}",
            skinny_gemm._skinny_gemm_kernel,
            dict(
                x_ptr="*bf16",
                w_ptr="*bf16",
                bias_ptr="*bf16",
                out_ptr="*bf16",
                ws_ptr="*fp32",
                cnt_ptr="*i32",
                M="i32",
                N="i32",
                K="i32",
                stride_xm="i32",
                stride_wn="i32",
                stride_om="i32",
                k_per_split="i32",
                split_k="i32",
                HAS_BIAS=False,
                EVEN_K=True,
                SPLIT=True,
                GATED=gated,
                ROUND=False,
                UPCAST=False,
                BLOCK_M=16,
                BLOCK_N=64,
                BLOCK_K=128,
                PDL=True,
            ),  # fmt: skip
            4,
        )


def embedding_cases():
    yield (
        "vocabulary-parallel embedding",
        shard_embedding._shard_embedding_kernel,
        dict(
            ids_ptr="*i64",
            w_ptr="*bf16",
            out_ptr="*bf16",
            start="i32",
            rows="i32",
            H="i32",
            stride_w="i32",
            BLOCK=shard_embedding.BLOCK,
            PDL=True,
        ),  # fmt: skip
        4,
    )


def main() -> int:
    cases = (
        *all_reduce_cases(), *gemv_cases(), *argmax_cases(), *decode_step_cases(),
        *embedding_cases(),
    )  # fmt: skip
    for name, kernel, params, warps in cases:
        print(f"compiled {name}: {compile_sm90(kernel, params, warps)} bytes of PTX", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
