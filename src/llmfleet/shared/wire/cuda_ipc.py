"""KV that moves between two processes' GPUs on one host by CUDA IPC instead of through host
memory: the sender describes a tensor in its GPU memory as a `CudaIpcBuffer` (a protobuf: the
allocation's IPC handle, the storage's place in it, shape and dtype) and the receiver maps that
memory into its own process and copies from it, device to device (over NVLink between GPUs,
within the GPU when both share one).

    buf = export_buffer(tensor)          # sender; keeps `tensor` until the receiver is done
    src = open_buffer(buf)               # receiver: a tensor on the sender's GPU
    dst.copy_(src); synchronize; del src # then acknowledge: the sender may free it

Handles and reference counting are torch's own (`torch.multiprocessing.reductions`), carried
field by field, never pickled. `open_buffer` raises IpcUnavailable when the buffer cannot be
mapped here: another host, a GPU this process cannot see, no CUDA; the sender then falls back
to host staging.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from llmfleet.shared.core.errors import LLMFleetError
from llmfleet.shared.core.host import device_uuid, host_id
from llmfleet.v1 import dataplane_pb2

ERROR_PREFIX = "cuda-ipc: "  # how a receiver's refusal reads in its KVTransferAck.error


class IpcUnavailable(LLMFleetError):
    """This buffer cannot be mapped in this process (the message says why)."""

    def __str__(self) -> str:
        return ERROR_PREFIX + super().__str__()


def export_buffer(t: torch.Tensor) -> dataplane_pb2.CudaIpcBuffer:
    """Describe CUDA tensor `t` for another process on this host. The caller keeps `t` (and
    does not write it) until the receiver has finished reading."""
    if not t.is_cuda:
        raise ValueError(f"CUDA IPC needs a CUDA tensor, not one on {t.device}")
    _, args = reduce_tensor(t)
    (_, shape, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _,
     ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    return dataplane_pb2.CudaIpcBuffer(
        host_id=host_id(),
        device_uuid=device_uuid(device),
        handle=handle,
        storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=bool(event_sync),
        shape=list(shape),
        stride=list(stride),
        offset=offset,
        dtype=str(dtype).removeprefix("torch."),
    )


def local_index(uuid: str) -> int:
    """This process's index of the GPU `uuid`; IpcUnavailable when it sees no such GPU."""
    if not torch.cuda.is_available():
        raise IpcUnavailable("this process has no CUDA device")
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise IpcUnavailable(f"GPU {uuid} is not visible to this process")


def open_buffer(buf: dataplane_pb2.CudaIpcBuffer) -> torch.Tensor:
    """The sender's tensor, mapped into this process (on the sender's GPU). Drop it once read:
    the sender's memory stays allocated while it lives."""
    if not buf.host_id or buf.host_id != host_id():
        raise IpcUnavailable(f"the buffer is on host {buf.host_id or '?'}, this is {host_id()}")
    dtype = getattr(torch, buf.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {buf.dtype!r}")
    index = local_index(buf.device_uuid)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(buf.shape), tuple(buf.stride), buf.offset,
            torch.storage.TypedStorage, dtype, index, buf.handle, buf.storage_size_bytes,
            buf.storage_offset_bytes, False, buf.ref_counter_handle, buf.ref_counter_offset,
            buf.event_handle or None, buf.event_sync_required,
        )  # fmt: skip
    except RuntimeError as e:  # cudaIpcOpenMemHandle refused (peer access, permissions)
        raise IpcUnavailable(f"cannot map the buffer: {e}") from None
