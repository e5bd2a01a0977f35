"""The launcher (`Fleet`, `llmfleet up`) with stand-in services (tests/cli/fake_service.py).

The stand-ins run as real child processes on loopback and serve gRPC health through the real
`Service` shell, so these tests exercise what the launcher itself does: ports and flags passed
to each child, start order and health waits, failure reports, and the ordered shutdown. One test
uses the real tokenizer service. The end-to-end fleet (real router and workers) is tested
where those services live.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmfleet.cli.fleet_plan import FleetSpec, FleetStartError, pick_free_ports, plan
from llmfleet.cli.launcher import Fleet
from llmfleet.cli.main import main
from llmfleet.shared.core.errors import ValidationError

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent
FAKE = {kind: "fake_service" for kind in ("kvstore", "tokenizer", "router", "worker")}


def _spec(tmp_path: Path, **kwargs: Any) -> FleetSpec:
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "FAKEFLEET_LOG": str(tmp_path / "events.jsonl"),
        **kwargs.pop("env", {}),
    }
    defaults: dict[str, Any] = {
        "port": 0,
        "modules": FAKE,
        "env": env,
        "log_dir": str(tmp_path / "logs"),
        "startup_timeout_s": 60.0,
        "stop_grace_s": 10.0,
    }
    return FleetSpec(**{**defaults, **kwargs})


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _argv(events: list[dict[str, Any]], name: str) -> list[str]:
    return next(e["argv"] for e in events if e["event"] == "start" and e["name"] == name)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    return status == health_pb2.HealthCheckResponse.SERVING


def test_aggregated_fleet_starts_at_once_wires_addresses_and_stops_in_reverse(tmp_path):
    with Fleet(_spec(tmp_path, workers=2, routing_policy="least_load")) as fleet:
        names = [c.name for c in fleet.children]
        assert names == ["kvstore", "tokenizer", "router", "worker-0", "worker-1"]
        assert fleet.endpoint == fleet.router_address
        assert len(set(c.address for c in fleet.children)) == 5
        assert all(_serving(c.address) for c in fleet.children)
        assert fleet.worker_addresses == [
            fleet.child("worker-0").address,
            fleet.child("worker-1").address,
        ]
        events = _events(tmp_path)
    starts = [e["name"] for e in events if e["event"] == "start"]
    assert sorted(starts) == sorted(names)  # all at once, every port chosen beforehand

    router = _argv(events, "router")
    assert _flag(router, "--tokenizer") == fleet.tokenizer_address
    assert _flag(router, "--mode") == "aggregated"
    assert _flag(router, "--routing-policy") == "least_load"
    assert f"{_flag(router, '--host')}:{_flag(router, '--port')}" == fleet.endpoint
    worker = _argv(events, "worker-1")
    assert _flag(worker, "--role") == "unified"
    # workers register on the router's internal port, not its public one
    registry = f"{_flag(router, '--internal-host')}:{_flag(router, '--internal-port')}"
    assert _flag(worker, "--router") == registry == fleet.registry_address != fleet.endpoint
    assert _flag(worker, "--kvstore") == fleet.kvstore_address
    kv = _argv(events, "kvstore")
    assert _flag(worker, "--kvstore-endpoint") == f"tcp://127.0.0.1:{_flag(kv, '--data-port')}"
    # the router watches the store too, for routing
    assert _flag(router, "--kvstore") == fleet.kvstore_address
    events_endpoint = f"tcp://127.0.0.1:{_flag(kv, '--events-port')}"
    assert _flag(router, "--kvstore-events") == _flag(worker, "--kvstore-events") == events_endpoint
    metrics = [int(_flag(_argv(events, n), "--metrics-port")) for n in names]
    assert len(set(metrics)) == len(names) and all(m > 0 for m in metrics)

    stops = [e["name"] for e in _events(tmp_path) if e["event"] == "stop"]
    assert set(stops[:2]) == {"worker-0", "worker-1"}
    assert stops[2:] == ["router", "tokenizer", "kvstore"]
    assert set(fleet.exit_codes().values()) == {0}


def test_disaggregated_fleet_without_kvstore(tmp_path):
    spec = _spec(tmp_path, disaggregated=True, prefill_workers=1, decode_workers=2, kvstore=False)
    with Fleet(spec) as fleet:
        assert [(c.name, c.role) for c in fleet.workers] == [
            ("prefill-0", "prefill"),
            ("decode-0", "decode"),
            ("decode-1", "decode"),
        ]
        assert fleet.kvstore_address is None
        events = _events(tmp_path)
    assert _flag(_argv(events, "router"), "--mode") == "disaggregated"
    assert "--kvstore" not in _argv(events, "router")
    decode = _argv(events, "decode-1")
    assert _flag(decode, "--role") == "decode" and "--kvstore" not in decode
    assert "kvstore" not in [e["name"] for e in events]


def test_child_that_exits_early_fails_the_start_naming_it_with_its_output(tmp_path):
    fleet = Fleet(_spec(tmp_path, env={"FAKEFLEET_FAIL": "worker-0"}))
    with pytest.raises(FleetStartError) as info:
        fleet.start()
    message = str(info.value)
    assert message.startswith("worker-0 exited with status 3")
    assert "fake failure in worker-0: cannot load anything" in message
    assert "fake failure" in (tmp_path / "logs" / "worker-0.log").read_text()
    # Everything already started was stopped again.
    assert all(code is not None for code in fleet.exit_codes().values())
    stopped = {e["name"] for e in _events(tmp_path) if e["event"] == "stop"}
    assert stopped == {"kvstore", "tokenizer", "router"}


def test_child_that_never_serves_times_out_naming_it(tmp_path):
    spec = _spec(tmp_path, env={"FAKEFLEET_HANG": "tokenizer"}, startup_timeout_s=2.0)
    fleet = Fleet(spec)
    with pytest.raises(FleetStartError, match=r"^tokenizer was not SERVING within 2 s"):
        fleet.start()
    assert all(code is not None for code in fleet.exit_codes().values())


def test_picked_ports_are_free_distinct_and_below_the_ephemeral_range():
    """A child binds its port after the launcher chose it: below the ephemeral range no
    outgoing connection (the fleet's services dialling each other) can take it meanwhile."""
    from llmfleet.cli.fleet_plan import _ephemeral_range

    lo, _ = _ephemeral_range()
    ports = pick_free_ports(40)
    assert len(set(ports)) == 40
    assert all(10000 <= p < lo for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # a later call never hands out a port again (its child may not have bound it yet)
    assert not set(pick_free_ports(40)) & set(ports)


def test_busy_public_port_is_reported_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        fleet = Fleet(_spec(tmp_path, port=port))
        with pytest.raises(FleetStartError, match=f"port {port} on 127.0.0.1 is in use"):
            fleet.start()
    assert fleet.children == []


def test_real_tokenizer_service_starts_under_the_launcher(tmp_path):
    modules = {k: v for k, v in FAKE.items() if k != "tokenizer"}
    with Fleet(_spec(tmp_path, modules=modules, kvstore=False)) as fleet:
        assert _serving(fleet.tokenizer_address)
    assert fleet.exit_codes()["tokenizer"] == 0


def test_run_prints_the_endpoint_and_stops_everything_on_sigint(tmp_path):
    spec = _spec(tmp_path, echo=True)
    code = (
        "import sys\n"
        "from llmfleet.cli.fleet_plan import FleetSpec\n"
        "from llmfleet.cli.up import run\n"
        f"sys.exit(run(FleetSpec(**{_spec_kwargs(spec)!r})))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("llmfleet: serving on 127.0.0.1:"), proc.stderr.read()
        endpoint = line.rsplit(" ", 1)[1].strip()
        assert _serving(endpoint)
        # then each child's Prometheus endpoint, one line each, in start order
        listed = [proc.stdout.readline().split() for _ in range(4)]
        assert [words[:4] for words in listed] == [
            ["llmfleet:", "metrics", "of", name] for name in NAMES
        ]
        for words in listed:
            with urllib.request.urlopen(words[-1], timeout=10) as resp:
                assert resp.status == 200 and b"python_info" in resp.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out == ""  # nothing after those
    assert "[router]" in err  # children's logs are echoed with their names
    events = _events(tmp_path)
    started = {e["name"] for e in events if e["event"] == "start"}
    stopped = [e["name"] for e in events if e["event"] == "stop"]
    assert set(stopped) == started and stopped[-1] == "kvstore"


NAMES = ["kvstore", "tokenizer", "router", "worker-0"]


def _spec_kwargs(spec: FleetSpec) -> dict[str, Any]:
    return {
        "port": spec.port,
        "modules": dict(spec.modules),
        "env": dict(spec.env),
        "log_dir": spec.log_dir,
        "echo": spec.echo,
    }


def test_run_exits_1_when_the_fleet_does_not_start(tmp_path, capsys):
    from llmfleet.cli.up import run

    assert run(_spec(tmp_path, env={"FAKEFLEET_FAIL": "router"})) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "the fleet did not start: router exited with status 3" in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--workers", "0"],
        ["up", "--disaggregated", "--workers", "2"],
        ["up", "--prefill-workers", "2"],
        ["up", "--routing-policy", "random"],
        ["up", "--port", "x"],
        ["up", "--tp-join", "127.0.0.1:29500", "--tp-rank", "1"],  # a worker's own flags
    ],
)
def test_up_rejects_bad_arguments_with_status_2(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2
    assert capsys.readouterr().err


def test_spec_validation_names_the_field():
    with pytest.raises(ValidationError, match="^decode_workers"):
        FleetSpec(disaggregated=True, decode_workers=0)
    with pytest.raises(ValidationError, match="^extra_args"):
        FleetSpec(extra_args={"scheduler": ["--x"]})


def test_metrics_port_base_lays_out_every_services_port(tmp_path):
    base = pick_free_ports(1)[0] // 2 + 1024  # away from the ephemeral range's busy end
    spec = FleetSpec(
        port=0, disaggregated=True, decode_workers=2, gateway=True, http_port=0,
        metrics_port_base=base,
    )  # fmt: skip
    children = [c for tier in plan(spec, tmp_path) for c in tier]
    ports = {c.name: int(_flag(c.argv, "--metrics-port")) for c in children}
    assert ports == {
        "kvstore": base, "tokenizer": base + 1, "router": base + 2, "gateway": base + 3,
        "prefill-0": base + 4, "decode-0": base + 5, "decode-1": base + 6,
    }  # fmt: skip
    with pytest.raises(ValidationError, match="^metrics_port_base"):
        FleetSpec(workers=3, metrics_port_base=65530)
    with socket.socket() as s:  # one of them taken: the plan names it
        s.bind(("127.0.0.1", base + 2))
        s.listen()
        with pytest.raises(FleetStartError, match=f"metrics port {base + 2} on 127.0.0.1"):
            plan(spec, tmp_path)


def _threads(spec: FleetSpec, tmp_path) -> list[str | None]:
    """Each worker's --num-threads, as planned."""
    workers = plan(spec, tmp_path)[2]
    return [
        c.argv[c.argv.index("--num-threads") + 1] if "--num-threads" in c.argv else None
        for c in workers
    ]


def test_tensor_parallel_gpu_workers_get_gpus_of_their_own(tmp_path):
    def devices(spec: FleetSpec) -> list[str]:
        return [c.argv[c.argv.index("--device") + 1] for c in plan(spec, tmp_path)[2]]

    tp2 = {"tensor_parallel_size": 2}
    assert devices(FleetSpec(port=0, workers=2, device="cuda", engine=tp2)) == ["cuda:0", "cuda:2"]
    split = FleetSpec(port=0, disaggregated=True, device="cuda:4", engine=tp2)
    assert devices(split) == ["cuda:4", "cuda:6"]  # the prefill worker's ranks, the decode's
    assert devices(FleetSpec(port=0, workers=2, device="cuda")) == ["cuda", "cuda"]  # shared
    # --worker-devices: prefill on GPU 0, decode on GPU 1
    pd = FleetSpec(port=0, disaggregated=True, device="cuda", worker_devices=("cuda:0", "cuda:1"))
    assert devices(pd) == ["cuda:0", "cuda:1"]
    with pytest.raises(ValidationError) as e:
        FleetSpec(port=0, disaggregated=True, worker_devices=("cuda:0",))
    assert e.value.field == "worker_devices"


def test_cpu_workers_split_the_cores_and_explicit_threads_stand(tmp_path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert _threads(FleetSpec(port=0, workers=2), tmp_path) == ["4", "4"]
    assert _threads(FleetSpec(port=0, workers=3), tmp_path) == ["2", "2", "2"]
    assert _threads(FleetSpec(port=0, workers=1), tmp_path) == [None]  # torch's default
    explicit = FleetSpec(port=0, workers=2, engine={"num_threads": 3})
    assert _threads(explicit, tmp_path) == ["3", "3"]
    tp = FleetSpec(port=0, workers=2, engine={"tensor_parallel_size": 2})  # 4 rank processes
    assert _threads(tp, tmp_path) == ["2", "2"]
    assert _threads(FleetSpec(port=0, workers=1, engine={"tensor_parallel_size": 2}), tmp_path) == [
        "4"
    ]
    simulated = FleetSpec(port=0, workers=2, engine={"simulate": True})
    assert _threads(simulated, tmp_path) == [None, None]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert _threads(FleetSpec(port=0, workers=4), tmp_path) == ["1"] * 4
