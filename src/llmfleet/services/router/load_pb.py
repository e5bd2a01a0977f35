"""A worker's load report between protobuf (`LoadReport`) and the registry's `Load`."""

from __future__ import annotations

from llmfleet.services.router.registry import Load
from llmfleet.v1 import common_pb2


def load_from_pb(pb: common_pb2.LoadReport) -> Load:
    return Load(
        num_running=pb.num_running,
        num_waiting=pb.num_waiting,
        num_free_blocks=pb.num_free_blocks,
        num_total_blocks=pb.num_total_blocks,
        num_active_leases=pb.num_active_leases,
        num_queued_prompt_tokens=pb.num_queued_prompt_tokens,
        step_seconds=pb.step_seconds,
        prefill_seconds_per_token=pb.prefill_seconds_per_token,
        fetch_seconds_per_token=pb.fetch_seconds_per_token,
        step_seconds_per_seq=pb.step_seconds_per_seq,
        max_num_batched_tokens=pb.max_num_batched_tokens,
    )


def load_to_pb(load: Load) -> common_pb2.LoadReport:
    return common_pb2.LoadReport(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        num_active_leases=load.num_active_leases,
        num_queued_prompt_tokens=load.num_queued_prompt_tokens,
        step_seconds=load.step_seconds,
        prefill_seconds_per_token=load.prefill_seconds_per_token,
        fetch_seconds_per_token=load.fetch_seconds_per_token,
        step_seconds_per_seq=load.step_seconds_per_seq,
        max_num_batched_tokens=load.max_num_batched_tokens,
    )
