"""The cluster simulator (realloc/sim, ``realloc simulate``): exact seconds on hand-made plans, the
binding resource when one resource is crippled, monotonicity and floors on random plans, and
clusters that refuse bad fields. Pure and fast: no Ray, no torch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from realloc import ModelSpec, Placement, Topology, plan_reallocation
from realloc.plan import Plan, Route, Segment, StepTable
from realloc.sim import Cluster, cluster_preset, simulate
from realloc.sim.engine import list_sizes
from realloc_tools.offline.plan import main

MIB = 1 << 20


def plain(**changes) -> Cluster:
    """A cluster with round numbers and no costs but what a test turns on."""
    fields = dict(
        name="test",
        gpus_per_node=2,
        nic_gbps=10.0,
        nics_per_node=2,
        nvlink_gbps=100.0,
        copy_gbps=1000.0,
        step_latency_s=0.0,
        message_latency_s=0.0,
        buckets_in_flight=1,
        host_route_s=0.0,
        host_message_s=0.0,
        driver_s_per_worker=0.0,
    )
    fields.update(changes)
    return Cluster(**fields)


def one_route_plan(nodes=("a", "b"), nbytes=4 * MIB, bucket_bytes=MIB) -> Plan:
    seg = Segment("w", (0,), (nbytes // 4,), "float32")
    return Plan([seg], [(0,)], [], [[Route(0, 1, 0)]], bucket_bytes, nodes)


def test_two_workers_seconds_are_bytes_over_bandwidth_plus_latencies_exactly():
    plan = one_route_plan()
    c = plain(step_latency_s=1e-5, message_latency_s=1e-5, buckets_in_flight=3, driver_s_per_worker=1e-5)
    r = simulate(plan, c)
    messages = 4  # one 4 MiB piece over 1 MiB buckets: four buckets, one message each
    assert list_sizes(plan)[1].tolist() == [messages]
    expected = 1e-5 + 4 * MIB / 10e9 + math.ceil(messages / 3) * 1e-5 + 2 * 1e-5
    assert r.seconds == pytest.approx(expected, rel=1e-12)
    assert r.binding == "receiver NIC"
    assert r.receiver_nic_floor_seconds == pytest.approx(4 * MIB / 10e9)
    assert r.bytes_inter_node == 4 * MIB and r.bytes_intra_node == 0
    json.dumps(r.to_json())


def test_same_node_route_uses_the_link_and_local_copies_come_first():
    seg = Segment("w", (0,), (MIB,), "float32")
    plan = Plan([seg], [(0,)], [(0, 0)], [[Route(0, 1, 0)]], 64 * MIB, ("a", "a"))
    r = simulate(plan, plain())
    assert r.seconds == pytest.approx(4 * MIB / 1000e9 + 4 * MIB / 100e9)
    assert r.binding == "NVLink"
    assert r.critical_path["local copy"] == pytest.approx(4 * MIB / 1000e9)


@pytest.mark.parametrize(
    "crippled, binding",
    [
        (dict(nic_gbps=0.001), "receiver NIC"),
        (dict(host_route_s=10.0), "host"),
        (dict(step_latency_s=10.0), "latency"),
        (dict(message_latency_s=10.0), "latency"),
        (dict(driver_s_per_worker=10.0), "host"),
    ],
)
def test_the_crippled_resource_binds(crippled, binding):
    assert simulate(one_route_plan(), plain(**crippled)).binding == binding


def test_a_shared_sender_nic_binds():
    # workers 0 and 1 share node a's one NIC and send in the same step to b and c (a NIC each)
    seg = Segment("w", (0,), (MIB,), "float32")
    plan = Plan([seg], [(0,)], [], [[Route(0, 2, 0), Route(1, 3, 0)]], 64 * MIB, ("a", "a", "b", "c"))
    r = simulate(plan, plain(nics_per_node=1))
    assert r.binding == "sender NIC"
    assert r.seconds == pytest.approx(2 * 4 * MIB / 10e9)
    assert r.floors["sender NIC"] == pytest.approx(r.seconds)


def test_the_nvlink_binds_when_crippled():
    seg = Segment("w", (0,), (MIB,), "float32")
    plan = Plan([seg], [(0,)], [], [[Route(0, 1, 0)]], 64 * MIB, ("a", "a"))
    assert simulate(plan, plain(nvlink_gbps=0.001)).binding == "NVLink"


def test_the_shared_machine_binds_when_it_is_slowest():
    r = simulate(one_route_plan(), plain(machine_inter_gbps=0.5, machine_copy_gbps=1.0))
    assert r.binding == "host"
    assert r.seconds == pytest.approx(4 * MIB / 0.5e9)


def test_a_worker_waits_for_its_peer_no_barrier():
    # step 0: 0 -> 1 (slow, inter-node); step 1: 2 -> 3 (same node c) does not wait for it,
    # step 2: 1 -> 3 waits for both
    seg = Segment("w", (0,), (MIB,), "float32")
    steps = [[Route(0, 1, 0)], [Route(2, 3, 0)], [Route(1, 3, 0)]]
    plan = Plan([seg], [(0,)], [], steps, 64 * MIB, ("a", "b", "c", "c"))
    r = simulate(plan, plain())
    inter, intra = 4 * MIB / 10e9, 4 * MIB / 100e9
    assert r.seconds == pytest.approx(2 * inter)
    assert r.slowest_worker["worker"] in (1, 3)
    assert r.critical_path_routes == 2
    assert r.idle["workers"] > 0
    assert r.schedule_floor_seconds == pytest.approx(inter + inter)  # worker 1 receives, then sends
    assert intra < inter


def test_step_table_and_lists_agree():
    spec = ModelSpec.preset("tiny")
    plan = plan_reallocation(spec, Topology(dp=2, tp=2), Topology(tp=4), Placement.blocks(4, 2))
    src = [r.src for s in plan.steps for r in s]
    dst = [r.dst for s in plan.steps for r in s]
    lists = [r.segment_list for s in plan.steps for r in s]
    starts = np.cumsum([0] + [len(s) for s in plan.steps])
    tabled = Plan(
        plan.segments,
        plan.segment_lists,
        plan.local_copies,
        StepTable(src, dst, lists, starts),
        plan.bucket_bytes,
        plan.nodes,
        plan.forward_from,
    )
    c = cluster_preset("h100")
    assert simulate(tabled, c).to_json() == simulate(plan, c).to_json()


def test_bytes_agree_with_the_plan_statistics():
    spec = ModelSpec.preset("tiny")
    plan = plan_reallocation(spec, Topology(tp=2, pp=2), Topology(dp=4), Placement.blocks(4, 2))
    r = simulate(plan, cluster_preset("h100"))
    for key in ("bytes_inter_node", "bytes_intra_node", "bytes_local_copy"):
        assert getattr(r, key) == plan.stats[key]
    assert r.num_steps == plan.stats["num_steps"] and r.num_routes == plan.stats["num_routes"]


# -- random plans --------------------------------------------------------------------------------

SPEC = ModelSpec.preset("tiny")


@st.composite
def moves(draw):
    world = draw(st.sampled_from([2, 4, 6, 8]))
    dims = [(dp, tp, world // (dp * tp)) for dp in range(1, world + 1) for tp in (1, 2, 4) if world % (dp * tp) == 0]
    src, dst = draw(st.sampled_from(dims)), draw(st.sampled_from(dims))
    assume(src != dst)
    per = draw(st.integers(1, world))
    try:
        plan = plan_reallocation(
            SPEC,
            Topology(*src),
            Topology(*dst),
            Placement.blocks(world, per),
            bucket_bytes=draw(st.sampled_from([4096, 1 << 16])),
        )
    except ValueError:
        assume(False)
    return plan, per


FIELDS = ("nic_gbps", "nvlink_gbps", "copy_gbps")
COSTS = ("step_latency_s", "message_latency_s", "host_route_s", "host_message_s", "driver_s_per_worker")


@settings(max_examples=40, deadline=None)
@given(moves(), st.sampled_from(FIELDS + COSTS), st.floats(1.5, 10), st.sampled_from(["h100", "cpu"]))
def test_faster_hardware_never_slows_a_move_and_no_floor_is_beaten(move, name, factor, preset):
    plan, per = move
    base = cluster_preset(preset, gpus_per_node=per, nics_per_node=per)
    r = simulate(plan, base)
    better = base.replace(**{name: getattr(base, name) * (factor if name in FIELDS else 1 / factor)})
    worse = base.replace(**{name: getattr(base, name) / factor if name in FIELDS else getattr(base, name) * factor})
    assert simulate(plan, better).seconds <= r.seconds * (1 + 1e-12)
    assert simulate(plan, worse).seconds >= r.seconds * (1 - 1e-12)
    assert all(r.seconds >= f for f in r.floors.values())
    assert r.seconds >= r.schedule_floor_seconds * (1 - 1e-12)
    assert r.binding in ("receiver NIC", "sender NIC", "NVLink", "local copy", "host", "latency")
    assert sum(r.critical_path.values()) <= r.seconds * (1 + 1e-9)
    assert all(0 <= v <= 1 for v in r.idle.values())


# -- the cluster's own checks ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(nic_gbps=0), "nic_gbps"),
        (dict(nvlink_gbps=-1.0), "nvlink_gbps"),
        (dict(copy_gbps=float("nan")), "copy_gbps"),
        (dict(gpus_per_node=0), "gpus_per_node"),
        (dict(nics_per_node=16), "nics_per_node"),
        (dict(buckets_in_flight=0), "buckets_in_flight"),
        (dict(step_latency_s=-1e-6), "step_latency_s"),
        (dict(host_route_s=float("inf")), "host_route_s"),
        (dict(machine_inter_gbps=1.0), "machine_inter_gbps"),
        (dict(name=""), "name"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_invalid_cluster_fields_raise_naming_the_field(change, named):
    with pytest.raises(ValueError, match=named):
        cluster_preset("h100").replace(**change)


def test_presets_and_json_round_trip():
    for name in ("h100", "h200", "h20", "cpu"):
        c = cluster_preset(name)
        assert Cluster.from_json(json.loads(json.dumps(c.to_json()))) == c
    with pytest.raises(ValueError, match="preset"):
        cluster_preset("tpu")
    with pytest.raises(ValueError, match="lacks"):
        Cluster.from_json({"name": "x"})


def test_a_plan_with_more_workers_on_a_node_than_the_cluster_has_gpus():
    with pytest.raises(ValueError, match="gpus_per_node"):
        simulate(one_route_plan(nodes=("a", "a")), plain(gpus_per_node=1, nics_per_node=1))


def test_from_bench_takes_the_measured_rates():
    t = dict(
        gloo_p2p_gbps=2.5,
        gloo_aggregate_gbps=4.0,
        memcpy_1core_gbps=9.0,
        memcpy_cores_gbps=12.0,
        memcpy_aggregate_gbps=30.0,
    )
    c = Cluster.from_bench(t, 8, 2)
    assert (c.nic_gbps, c.machine_inter_gbps, c.copy_gbps, c.machine_copy_gbps) == (2.5, 4.0, 9.0, 18.0)
    with pytest.raises(ValueError, match="memcpy_1core_gbps"):
        Cluster.from_bench({"gloo_p2p_gbps": 1.0, "gloo_aggregate_gbps": 1.0}, 8, 2)


def test_cli_simulates_one_move(capsys):
    assert main(["simulate", "--model", "tiny", "--src", "tp=2", "--dst", "dp=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == 2 and out["seconds"] > 0 and out["binding"]
    assert (
        main(
            [
                "simulate",
                "--model",
                "tiny",
                "--src",
                "tp=2",
                "--dst",
                "dp=2",
                "--dst-workers",
                "2",
                "--set",
                "nic_gbps=1",
            ]
        )
        == 0
    )
    assert "receiver-NIC floor" in capsys.readouterr().out
    assert main(["simulate", "--model", "tiny", "--src", "tp=2", "--dst", "dp=2", "--set", "nic_gbps=0"]) == 2
    assert "nic_gbps" in capsys.readouterr().err


def test_cli_simulates_a_fleet_that_relays_between_replicas(capsys):
    """``--replicas R``: the trainer's copy into one replica, then ceil(log2 R) rounds of the
    replica-to-replica copy (each simulated on its own here, as the oracle), the trainer's egress
    once against R times when it stages each replica itself."""
    cluster = ["--set", "gpus_per_node=2", "--set", "nics_per_node=2"]  # one node per replica
    move = ["simulate", "--model", "tiny", "--dst", "tp=2", "--dst-workers", "2", *cluster, "--json"]

    def run(*extra: str) -> dict:
        assert main(move + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    copy, relay = run("--src", "dp=2"), run("--src", "tp=2")
    for replicas, rounds in ((1, 0), (2, 1), (4, 2), (5, 3), (8, 3)):
        fleet = run("--src", "dp=2", "--replicas", str(replicas))["fleet"]
        assert fleet["relay_rounds"] == rounds
        assert fleet["seconds"] == pytest.approx(copy["seconds"] + rounds * relay["seconds"])
        assert fleet["seconds_trainer_sends_each"] == pytest.approx(replicas * copy["seconds"])
        assert fleet["trainer_egress_bytes"] == copy["bytes_inter_node"] > 0
        assert fleet["trainer_egress_bytes_trainer_sends_each"] == replicas * copy["bytes_inter_node"]
        assert fleet["relay_bytes_inter_node"] == (replicas - 1) * relay["bytes_inter_node"]
        assert fleet["ratio_to_receiver_nic_floor"] == pytest.approx(
            fleet["seconds"] / copy["receiver_nic_floor_seconds"]
        )
    assert main(move + ["--src", "dp=2", "--replicas", "0"]) == 2
    assert "--replicas 0" in capsys.readouterr().err
    no_workers = ["simulate", "--model", "tiny", "--src", "dp=2", "--dst", "tp=2", *cluster, "--replicas", "2"]
    assert main(no_workers) == 2
    assert "needs --dst-workers" in capsys.readouterr().err
    assert main(["simulate", "--anchors", "--replicas", "2"]) == 2
    assert "--replicas" in capsys.readouterr().err


def test_the_anchor_models_have_their_published_sizes():
    # Kimi-K2: 1.03T parameters (DeepSeek-V3's architecture, 384 experts); Qwen3-235B-A22B: 235B
    from realloc.spec import load_spec
    from realloc_tools.offline.simulate import ANCHORS, CONFIGS

    counts = {}
    for name in ("Kimi-K2-Instruct", "Qwen3-235B-A22B", "DeepSeek-V3"):
        spec = load_spec(str(CONFIGS / f"{name}.json"))
        counts[name] = sum(p.numel for p in spec.params if not p.buffer)
    assert counts["Kimi-K2-Instruct"] == 1_026_408_209_408
    assert counts["Qwen3-235B-A22B"] == 235_093_634_560
    assert all((CONFIGS / a.config).is_file() for a in ANCHORS)


@pytest.mark.parametrize("option", ["--bench", "--cluster-json"])
@pytest.mark.parametrize(
    "content, complaint",
    [
        (None, "no such file"),  # missing
        ("DIR", "not a file"),
        ("not json", "not JSON"),
        ("[1, 2]", "got list"),
        ('{"a": 1}', "a"),
    ],
)
def test_simulate_files_of_the_wrong_kind_exit_2_naming_the_option(tmp_path, capsys, option, content, complaint):
    """A missing file, a folder, not JSON or JSON of another shape: exit 2 with one line naming the
    option (it was a traceback and exit 1)."""
    path = tmp_path / "input.json"
    if content == "DIR":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    argv = ["simulate", option, str(path)]
    if option == "--cluster-json":
        argv += ["--model", "tiny", "--src", "tp=2", "--dst", "dp=2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"realloc: error: {option} {path}") and complaint in err and err.count("\n") == 1


def test_simulate_bench_file_with_a_malformed_move_exits_2(tmp_path, capsys):
    bench = {"model": "tiny", "workers": 2, "nodes": 1, "transport": {}, "bucket_bytes": 1 << 20, "directions": [1]}
    (tmp_path / "b.json").write_text(json.dumps(bench))
    assert main(["simulate", "--bench", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "--bench" in err and "not a 'realloc bench --json' output" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "extra",
    [
        ["--model", "tiny", "--src", "tp=2", "--dst", "dp=2"],
        ["--cluster", "h20"],
        ["--set", "nic_gbps=1"],
        ["--bench", "bench.json"],
    ],
)
def test_anchors_refuse_the_options_of_one_move(capsys, extra):
    """--anchors simulates its own workloads: --model/--src/--dst (or a cluster) beside it were ignored."""
    assert main(["simulate", "--anchors", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("realloc: error: --anchors") and "do" in err and "go" in err and err.count("\n") == 1
