"""A fleet of simulated workers on a virtual clock: routing at 8 or 32 workers on one CPU.

    shape = FleetShape(workers=32, disaggregated=False, kvstore=True)
    fleet = VirtualFleet(shape, Calibration(), "predicted_ttft", load_for(config))
    done = fleet.run(requests)      # SimRequests (arrival s, prompt, max_tokens), as they end

What runs is the fleet's own code:
  - each worker is the real engine (`LLMEngine` with the simulated forward pass, whose steps
    take their step-time model's duration on the virtual clock instead of sleeping), its own
    scheduler, block manager, prefix cache and KV events;
  - it reports load as a worker does (`outputs.load_report`, with the `StepTimeModel` it learns
    from its own steps and its measured kvstore fetch cost);
  - the router's routing is the router's: the policies, `routed_load.RoutedLoad` over those load
    reports plus what the router sent since, the `KVIndex` fed by the engines' KV events;
  - with the kvstore, the kvstore's `BlockStore` (LRU) and the router's view of it (its events);
  - disaggregated, the router's handoff order: prefill worker by the policy, at most
    `max_prefills_per_worker` handoffs each, decode worker by `DecodeHeadroom` (predicted_ttft)
    or least load, a KV reservation there (a full decode worker is waited for), prefill on P, the
    KV pushed to D, the first token answered, decode on D.
What is modelled: time (an event queue: a step's outputs arrive after its simulated duration,
load reports and KV events with them), and moving KV: a kvstore fetch and a prefill→decode push
take `tokens × fetch_ms_per_token`, one at a time per receiving worker. RPC latencies are 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from virtual_parts import Calibration, Clock, FleetShape, SimRequest

from llmfleet.engine.engine import LLMEngine
from llmfleet.engine.request import RequestOutput
from llmfleet.models.loader import LoadedModel
from llmfleet.services.kvstore.store import BlockStore
from llmfleet.services.router.registry import Load
from llmfleet.services.router.routed_load import RoutedLoad
from llmfleet.services.router.routing import (
    DecodeHeadroom,
    LeastLoad,
    Policy,
    PredictedTTFT,
    RouteDecision,
    fetched_tokens,
    make_policy,
    uncached_tokens,
)
from llmfleet.services.router.server import load_from_pb
from llmfleet.services.worker.outputs import load_report
from llmfleet.shared.core.block_hash import HashContext, hash_block_chain
from llmfleet.shared.core.errors import CapacityError
from llmfleet.shared.core.kv_index import KVEvents, KVIndex, KVSnapshot
from llmfleet.shared.core.sampling_params import SamplingParams
from llmfleet.shared.core.step_model import StepTimeModel, mix

__all__ = ["Calibration", "Clock", "FleetShape", "SimRequest", "VirtualFleet", "VirtualWorker"]

_STORE = "kvstore"
_LAYOUT = "sim"


class VirtualWorker:
    def __init__(self, worker_id: str, engine: LLMEngine, fleet: VirtualFleet) -> None:
        self.id = worker_id
        self.engine = engine
        self.fleet = fleet
        self.step_model = StepTimeModel()
        self.fetch_s_per_token = 0.0
        self.num_fetches = 0
        self.link_free_at = 0.0  # KV arriving here moves one transfer at a time
        self.busy = False
        self.kv_seq = 0
        self.load = Load()
        self.requests: dict[str, SimRequest] = {}
        self.prefills_in_flight = 0
        self.slot_waiters: deque[SimRequest] = deque()
        self.capacity_waiters: list[SimRequest] = []
        self._took = 0.0
        engine.runner.sleep = self._took_seconds  # type: ignore[attr-defined]
        engine.kv.drain_events()  # from here on, the block manager records KV events

    def _took_seconds(self, seconds: float) -> None:
        self._took = seconds

    def report(self) -> None:
        """The load report and KV events of the step that just ended reach the router."""
        engine = self.engine
        self.load = load_from_pb(
            load_report(
                engine,
                self.step_model,
                num_queued_prompt_tokens=engine.scheduler.num_queued_prompt_tokens,
                fetch_s_per_token=self.fetch_s_per_token if self.num_fetches else None,
            )
        )
        stored, removed = engine.kv.drain_events()
        if stored or removed:
            self.kv_seq += 1
            self.fleet.index.apply(KVEvents(self.id, self.kv_seq, tuple(stored), tuple(removed)))

    def receive(self, num_tokens: int, then: Callable[[], None]) -> None:
        """`num_tokens` of KV arrive over this worker's link (after those already coming)."""
        clock, calib = self.fleet.clock, self.fleet.calib
        start = max(clock.now, self.link_free_at)
        self.link_free_at = start + num_tokens * calib.fetch_ms_per_token / 1e3
        clock.at(self.link_free_at, then)

    def admit(self, r: SimRequest, *, prefill_only: bool = False) -> None:
        """AddRequest (or Prefill): with a kvstore, first fetch the part of the prompt's chain
        the store holds beyond the local prefix cache."""
        self.requests[r.rid] = r
        store = self.fleet.store
        if store is not None:
            # as KVStoreSync.fetch_prefix: the store's part of the chain, if longer than ours
            local = self.engine.kv.num_cached_prefix_blocks(r.hashes)
            held = store.lookup(_LAYOUT, r.hashes)
            if held > local:
                asked = self.fleet.clock.now
                chain = r.hashes[:held]
                num_got = len(store.get(_LAYOUT, chain))
                self.fleet.store_changed()

                def fetched() -> None:
                    seconds = self.fleet.clock.now - asked
                    tokens = num_got * self.fleet.calib.block_size
                    self.fetch_s_per_token = mix(
                        self.fetch_s_per_token, seconds / tokens, self.num_fetches
                    )
                    self.num_fetches += 1
                    payload = torch.zeros((num_got, *self.engine.kv.block_shape))
                    self.engine.kv.import_cached_blocks(chain[:num_got], payload)
                    self._add(r, prefill_only)

                self.receive(num_got * self.fleet.calib.block_size, fetched)
                return
        self._add(r, prefill_only)

    def _add(self, r: SimRequest, prefill_only: bool) -> None:
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        self.engine.add_request(r.rid, r.prompt, params, prefill_only=prefill_only)
        self.kick()

    def kick(self) -> None:
        """Start the engine's next step unless one is running."""
        if self.busy or not self.engine.has_unfinished():
            return
        self._took = 0.0
        outs = self.engine.step()
        seconds, work = self._took, self.engine.last_step_work
        if seconds == 0.0 and not outs:
            return  # nothing it can schedule now; an admission or a freed block kicks again
        self.busy = True

        def done() -> None:
            self.busy = False
            if seconds:
                self.step_model.observe(seconds, prefill_tokens=work[0], decode_seqs=work[1])
            self.report()
            for out in outs:
                self.fleet.on_output(self, out)
            self.kick()

        self.fleet.clock.at(self.fleet.clock.now + seconds, done)


class VirtualFleet:
    def __init__(
        self, shape: FleetShape, calib: Calibration, policy: str, loaded: LoadedModel
    ) -> None:
        self.shape, self.calib = shape, calib
        self.clock = Clock()
        self.policy: Policy = make_policy(policy, clock=lambda: self.clock.now)
        self.decode_policy: Policy = (
            DecodeHeadroom() if policy == PredictedTTFT.name else LeastLoad()
        )
        self.index = KVIndex(self._snapshot)
        self.store: BlockStore | None = BlockStore(calib.store_blocks) if shape.kvstore else None
        self.store_view = KVIndex(self._snapshot)
        self._store_seq = 0
        config = calib.engine_config()
        workers = [
            VirtualWorker(f"w{i:02d}", LLMEngine(config, loaded), self)
            for i in range(shape.workers)
        ]
        self.context = HashContext(workers[0].engine.spec.model_id)
        num_prefill = shape.workers // 2 if shape.disaggregated else shape.workers
        self.serving = workers[:num_prefill]  # unified, or prefill
        self.decoding = workers[num_prefill:]
        self.by_id = {w.id: w for w in workers}
        for w in workers:
            self.index.add_publisher(w.id)
        if self.store is not None:
            self.store_view.add_publisher(_STORE)
        self.routed = RoutedLoad()  # the router's own counts, as Placement keeps them
        self.done: list[SimRequest] = []

    def _snapshot(self, publisher: str) -> None:
        """A publisher's snapshot, as its GetKVSnapshot would answer (a fresh index asks)."""
        if publisher == _STORE:
            assert self.store is not None
            held = tuple(self.store.held_hashes())
            self.store_view.apply_snapshot(KVSnapshot(publisher, self._store_seq, held))
            return
        w = self.by_id[publisher]
        held = tuple(w.engine.kv.cached_block_hashes())
        self.index.apply_snapshot(KVSnapshot(publisher, w.kv_seq, held))

    def store_changed(self) -> None:
        assert self.store is not None
        changes = self.store.drain_changes()
        if changes.stored or changes.removed:
            self._store_seq += 1
            ev = KVEvents(_STORE, self._store_seq, tuple(changes.stored), tuple(changes.removed))
            self.store_view.apply(ev)

    # ---- the router ------------------------------------------------------------------------
    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        """Serve `requests` (sorted by arrival) to the end; returns them as they finished."""
        for r in requests:
            self.clock.at(r.arrival, lambda r=r: self._arrive(r))
        self.clock.run()
        return self.done

    def _arrive(self, r: SimRequest) -> None:
        r.hashes = hash_block_chain(r.prompt, self.calib.block_size, self.context)
        self._route(r)

    def _choose(
        self, policy: Policy, workers: list[VirtualWorker], r: SimRequest
    ) -> tuple[VirtualWorker, RouteDecision, int]:
        """The worker `policy` picks for `r`, its decision, and the prompt tokens it will
        compute there (as the router's placement counts them)."""
        hashes = r.hashes if policy.needs_prefix else []
        store = self.store_view.matched_prefix(_STORE, hashes) if self.store and hashes else 0
        cands = [
            self.routed.candidate(
                w.id,
                w.load,
                prefix_blocks=self.index.matched_prefix(w.id, hashes) if hashes else 0,
                store_blocks=store,
            )
            for w in workers
        ]
        decision = policy.choose(cands, self.calib.block_size, len(r.prompt))
        pick = next(c for c in cands if c.worker_id == decision.worker_id)
        uncached = uncached_tokens(pick, self.calib.block_size, len(r.prompt))
        if policy is self.policy:
            r.fetched_tokens = fetched_tokens(pick, self.calib.block_size, len(r.prompt))
        return self.by_id[decision.worker_id], decision, uncached

    def _route(self, r: SimRequest) -> None:
        w, decision, r.uncached_tokens = self._choose(self.policy, self.serving, r)
        if r.predicted_ttft is None:
            r.predicted_ttft = decision.predicted_ttft_s
        if not self.shape.disaggregated:
            self.routed.sent(w.id, 1)
            self._prefilling(w, r, 1)
            w.admit(r)
            return
        self._prefilling(w, r, 1)  # (its wait for a prefill slot included, as the router's)
        w.slot_waiters.append(r)
        self._handoffs(w)

    def _prefilling(self, w: VirtualWorker, r: SimRequest, sign: int) -> None:
        """`r`'s prompt enters (1) or leaves (-1) `w`'s queue as the router counts it."""
        self.routed.prefill(w.id, sign * r.uncached_tokens, sign, sign * r.fetched_tokens)

    def _handoffs(self, p: VirtualWorker) -> None:
        """Start the handoffs waiting for `p`'s prefill slots while it has free ones."""
        while p.slot_waiters and p.prefills_in_flight < self.calib.max_prefills_per_worker:
            self._handoff(p, p.slot_waiters.popleft())

    def _handoff(self, p: VirtualWorker, r: SimRequest) -> None:
        """A prefill slot on `p` is `r`'s: lease KV on a decode worker, then prefill."""
        d, _, _ = self._choose(self.decode_policy, self.decoding, r)
        try:
            d.engine.kv.reserve(_lease(r), len(r.prompt))
        except CapacityError:  # wait for the decode worker to free KV, then route again
            self._prefilling(p, r, -1)
            d.capacity_waiters.append(r)
            return
        p.prefills_in_flight += 1
        r.decode_worker_id = d.id
        self.routed.sent(d.id, 1)
        self.routed.transfer(d.id, len(r.prompt))
        p.admit(r, prefill_only=True)

    def on_output(self, w: VirtualWorker, out: RequestOutput) -> None:
        r = w.requests[out.request_id]
        if r.first_token_at is None and out.new_token_ids:
            r.num_cached_tokens = out.num_cached_tokens
            if self.store is not None:  # the worker puts the prompt's blocks
                self.store.put(_LAYOUT, r.hashes, [b"\0"] * len(r.hashes))
                self.store_changed()
            if r.decode_worker_id:
                self._push(w, r, out.new_token_ids[0])
                return
            self._prefilling(w, r, -1)
            r.first_token_at = self.clock.now
        r.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            self._finished(w, r)

    def _push(self, p: VirtualWorker, r: SimRequest, first_token: int) -> None:
        """Disaggregated: P pushes the prompt's KV to D, answers the first token, D decodes."""
        d = self.by_id[r.decode_worker_id]

        def pushed() -> None:
            self.routed.transfer(d.id, -len(r.prompt))
            p.engine.kv.release_pinned(r.rid)
            del p.requests[r.rid]
            self._prefilling(p, r, -1)
            p.prefills_in_flight -= 1
            self._handoffs(p)
            r.first_token_at = self.clock.now
            r.num_output_tokens = 1
            d.requests[r.rid] = r
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            d.engine.start_decode(_lease(r), r.rid, r.prompt, first_token, params)
            if not d.engine.has_request(r.rid):  # its first token was its last
                self._finished(d, r)
            p.kick()
            d.kick()

        d.receive(len(r.prompt), pushed)

    def _finished(self, w: VirtualWorker, r: SimRequest) -> None:
        r.finished_at = self.clock.now
        del w.requests[r.rid]
        r.prompt, r.hashes = [], []  # (memory: tens of thousands of requests in a run)
        self.done.append(r)
        self._ended(w)

    def _ended(self, w: VirtualWorker) -> None:
        """A request left `w`: the router's count drops, and whoever waits for its KV tries
        again."""
        self.routed.sent(w.id, -1)
        waiters, w.capacity_waiters = w.capacity_waiters, []
        for r in waiters:
            self._route(r)


def _lease(r: SimRequest) -> str:
    """The owner of `r`'s KV reservation on its decode worker."""
    return f"lease/{r.rid}"
