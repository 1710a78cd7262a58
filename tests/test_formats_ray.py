"""Copies between weight formats with real Ray actors and gloo (realloc/plan/formats.py): a bf16
trainer into a block-FP8 generator (converted by the senders: the wire carries FP8), from an FSDP
trainer (the receivers convert), FP8 back to bf16 (dequantized), staged copies of both kinds, and
HF import of an FP8 checkpoint, every shard checked against the oracle's own quantizer applied to
the full tensors; a worker killed while converting leaves the generator serving its old weights."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from simulated import simulated_cluster, wait_for_dead_workers

from actors import Fleet, ModelGroup, ReallocationError
from realloc.boxes import box_index
from realloc.ckpt.hf import save_hf_dir
from realloc.layout import Layout
from realloc.spec import decoder_spec

try:
    from tests import oracle
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

SPEC = decoder_spec("fmt", hidden=256, intermediate=512, layers=2, heads=2, kv_heads=2, head_dim=128, vocab=100)


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=4) as c:
        yield c


def expected_fp8(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors of the block-FP8 model, quantized by the oracle (scales under their own names)."""
    out = {}
    for name, t in full.items():
        if name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = oracle.fp8_block_quantize(t)
        else:
            out[name] = t
    return out


def holds(group: ModelGroup, full: dict[str, torch.Tensor]) -> None:
    """Every box every worker of ``group`` holds is that box of ``full``, bit for bit."""
    for rank, boxes in group.shard_boxes(list(range(group.num_workers))).items():
        for param, offsets, sizes, tensor in boxes:
            want = full[param][box_index(offsets, sizes)].contiguous()
            assert tensor.dtype == want.dtype and torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), (
                rank,
                param,
            )


def test_bf16_trainer_into_fp8_generator_and_back(cluster, tmp_path):
    trainer = ModelGroup.create(SPEC, "tp=2,pp=2", name="fmt-trainer")
    gen = ModelGroup.create(SPEC, "dp=2", name="fmt-gen", weight_format="fp8_block128")
    back = ModelGroup.create(SPEC, "tp=2", name="fmt-back")
    try:
        trainer.init_synthetic(3)
        full = trainer.state_dict()
        stats = trainer.copy_to(gen)
        assert stats.conversion == "source"  # tp=2 ranks hold whole blocks: FP8 on the wire
        fp8 = expected_fp8(full)
        holds(gen, fp8)
        bf16_bytes = sum(t.numel() * t.element_size() for t in full.values())
        wire = stats.bytes_inter_node + stats.bytes_intra_node + stats.bytes_local
        assert wire < 0.6 * 2 * bf16_bytes  # two replicas, each about half the bf16 bytes
        stats = gen.copy_to(back)  # dequantized by the receivers
        assert stats.conversion == "destination"
        dequantized = {
            n: oracle.fp8_block_dequantize(fp8[n], fp8[n + "_scale_inv"], torch.bfloat16)
            if n + "_scale_inv" in fp8
            else t
            for n, t in full.items()
        }
        holds(back, dequantized)
        with pytest.raises(ValueError, match="a delta or a blend needs one format"):
            trainer.copy_to(gen, eta=0.5)
        # staged (async RL): the FP8 generator serves its weights while the next ones arrive
        trainer.init_synthetic(4)
        update = trainer.copy_to(gen, stage=True)
        stats = update.wait()
        assert stats.conversion == "source"
        holds(gen, fp8)  # not switched yet: the serving buffers are untouched
        update.commit()
        holds(gen, expected_fp8(trainer.state_dict()))
        trainer.init_synthetic(8)  # a fleet of FP8 replicas staged from the bf16 trainer
        fleet = Fleet([gen])
        fleet_update = fleet.stage(trainer)
        assert fleet_update.wait()[gen.name].conversion == "source"
        assert fleet_update.commit(at="now") == [gen.name]
        holds(gen, expected_fp8(trainer.state_dict()))
        with pytest.raises(ValueError, match="differ"):  # a replica is seeded from another: one format
            fleet.join(back)
        with pytest.raises(ValueError, match="node-local checkpoints and HF exports hold a model's own dtypes"):
            gen.checkpoint_manager(root=str(tmp_path / "ckpt"), jump=1, factor=2).save(1)
        # DeepSeek-V3's published format (e4m3 + weight_scale_inv, several files) imports into the
        # FP8 generator as written, and into the bf16 group dequantized
        save_hf_dir(fp8, tmp_path / "hf", max_shard_bytes=300_000)
        gen.checkpoint_manager(root=str(tmp_path / "ckpt"), jump=1, factor=2).import_hf(tmp_path / "hf")
        holds(gen, fp8)
        back.checkpoint_manager(root=str(tmp_path / "ckpt2"), jump=1, factor=2).import_hf(tmp_path / "hf")
        holds(back, dequantized)
        with pytest.raises(ValueError, match="reallocate keeps the format"):
            gen.reallocate(Layout(SPEC, gen.topology))
    finally:
        for g in (trainer, gen, back):
            g.shutdown()


def test_fsdp_trainer_converts_on_the_receivers_and_a_kill_keeps_the_old_weights(cluster):
    trainer = ModelGroup.create(SPEC, "fsdp=2", name="fmt-fsdp")
    gen = ModelGroup.create(SPEC, "tp=2", name="fmt-gen2", weight_format="fp8_block128", zero_copy=False)
    try:
        trainer.init_synthetic(5)
        stats = trainer.copy_to(gen)
        assert stats.conversion == "destination"  # FSDP chunks are no serving layout: bf16 travels
        before = expected_fp8(trainer.state_dict())
        holds(gen, before)
        trainer.init_synthetic(6)
        victim = 1
        ray.get(gen.actors[victim].inject_fault.remote("exit_in_convert", 0))
        with pytest.raises(ReallocationError) as err:
            trainer.copy_to(gen)
        assert err.value.dead == [gen.actor_names[victim]]
        wait_for_dead_workers(gen)
        survivor = [r for r in range(gen.num_workers) if r != victim]
        for rank, boxes in gen.shard_boxes(survivor).items():  # the survivor serves the old weights
            for param, offsets, sizes, tensor in boxes:
                want = before[param][box_index(offsets, sizes)].contiguous()
                assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), (rank, param)
        assert gen.replace_dead_workers() == [victim]
        trainer.copy_to(gen)
        holds(gen, expected_fp8(trainer.state_dict()))
        gen.init_synthetic(9)  # a group of another format fills and checks its own format
        assert gen.verify_synthetic(9) == {} and gen.verify_synthetic(10) != {}
        trainer.init_synthetic(7)  # staged, converted on the receivers into their shadow sets
        update = trainer.copy_to(gen, stage=True)
        assert update.wait().conversion == "destination"
        update.commit()
        held = expected_fp8(trainer.state_dict())
        holds(gen, held)
        # a blend between two FP8 groups: refused before any traffic, not failed on every worker
        # after the move (torch has no float8 mul_; found in review, 2026-12-07)
        peer = ModelGroup.create(SPEC, "dp=1", name="fmt-fp8-peer", weight_format="fp8_block128")
        try:
            peer.init_synthetic(11)
            with pytest.raises(ValueError, match=r"a blend of block-FP8 weights would mix quantized values"):
                gen.copy_to(peer, eta=0.5)
            assert peer.verify_synthetic(11) == {}
            holds(gen, held)
        finally:
            peer.shutdown()
    finally:
        trainer.shutdown()
        gen.shutdown()


def converted_on(trace) -> list[str]:
    """The workers of ``trace`` whose timeline has a ``convert`` span: a receiver's phase, or a
    sender's messages converted as they were packed."""
    return [
        w.name
        for w in trace.workers
        if w.record["convert"] or any(name == "convert" for name, _, _ in w.record["phases"])
    ]


def test_a_staged_conversion_is_on_the_staged_trace_not_on_the_previous_move(cluster):
    """Issue 36: a staged copy between weight formats marked its ``convert`` span on the timeline
    of the worker's previous move (``last_trace()``), and the staged trace had none. Both sides:
    the senders convert (tp=2 -> FP8 dp=2), then the receivers (fsdp=2 -> FP8 tp=2)."""
    trainer = ModelGroup.create(SPEC, "fsdp=2", name="fmt-trace-train")
    gen = ModelGroup.create(SPEC, "tp=2", name="fmt-trace-gen", weight_format="fp8_block128", zero_copy=False)
    try:
        trainer.init_synthetic(11)
        trainer.reallocate("tp=2")  # the trainer's last move: nothing converted
        assert converted_on(trainer.last_trace()) == []
        gen.reallocate("dp=2")  # the generator's last move: nothing converted
        assert converted_on(gen.last_trace()) == []
        update = trainer.copy_to(gen, stage=True)
        assert update.wait().conversion == "source"
        assert converted_on(update.trace()) == trainer.actor_names  # the senders converted
        assert converted_on(trainer.last_trace()) == []  # not on the trainer's previous move
        update.commit()
        holds(gen, expected_fp8(trainer.state_dict()))
        trainer.reallocate("fsdp=2")
        gen.reallocate("tp=2")
        trainer.init_synthetic(12)
        update = trainer.copy_to(gen, stage=True)
        assert update.wait().conversion == "destination"
        assert converted_on(update.trace()) == gen.actor_names  # the receivers converted
        assert converted_on(gen.last_trace()) == []  # not on the generator's previous move
        update.commit()
        holds(gen, expected_fp8(trainer.state_dict()))
        # a plain (not staged) converting copy stays on its own move's trace
        trainer.init_synthetic(13)
        trainer.copy_to(gen)
        assert converted_on(gen.last_trace()) == gen.actor_names
    finally:
        trainer.shutdown()
        gen.shutdown()


def test_an_inf_in_a_weight_to_quantize_aborts_the_move_and_the_generator_keeps_its_weights(cluster):
    """One inf in a trainer weight quantized to block FP8 made its whole 128 x 128 block NaN on the
    generator, with no error. Now the move fails naming the tensor and the block, converted on the
    senders (tp=2: they finish their routes, then fail, so no peer waits) or on the receivers (FSDP),
    plain or staged, and aborts like any failed move: the generator keeps its old weights."""
    tp = ModelGroup.create(SPEC, "tp=2", name="fmt-inf-tp")
    fsdp = ModelGroup.create(SPEC, "fsdp=2", name="fmt-inf-fsdp")
    gen = ModelGroup.create(SPEC, "dp=2", name="fmt-inf-gen", weight_format="fp8_block128")
    try:
        tp.init_synthetic(3)
        tp.copy_to(gen)
        before = expected_fp8(tp.state_dict())
        name = "model.layers.1.self_attn.o_proj.weight"
        state = tp.state_dict()
        state[name][130, 5] = float("inf")
        for trainer in (tp, fsdp):
            trainer.load_state_dict(state)
        block = rf"{name}: block \(1, 0\) .* holds inf or NaN"
        for trainer in (tp, fsdp):  # converted on the senders, then on the receivers
            with pytest.raises(ReallocationError, match=block):
                trainer.copy_to(gen)
            holds(gen, before)
            with pytest.raises(ReallocationError, match=block):
                trainer.copy_to(gen, stage=True).wait()  # staged: the shadow set is dropped
            holds(gen, before)
        state[name][130, 5] = 1.0  # fixed: the next move goes through
        tp.load_state_dict(state)
        assert tp.copy_to(gen).conversion == "source"
        holds(gen, expected_fp8(state))
    finally:
        for g in (tp, fsdp, gen):
            g.shutdown()


def test_a_generator_on_the_trainers_node_reads_its_weights_where_they_are_and_converts_them(cluster):
    """A sender that converts as it sends (tp=2 ranks hold whole blocks) shares its buffers: a
    generator on its node reads them where they are and quantizes what it reads (before, every
    such route went through gloo, packed and converted by the sender). The same bits as the
    oracle's quantizer; an inf read fails the move, staged or not, and the generator keeps its
    weights."""
    # each group on one node (STRICT_PACK waits for one with room): the filler takes all 4 slots
    # of the node the trainer is not on, so the generator can only go beside the trainer
    tp = ModelGroup.create(SPEC, "tp=2", name="fmt-read-tp", strategy="STRICT_PACK")
    filler = ModelGroup.create(SPEC, "fsdp=4", name="fmt-read-filler", strategy="STRICT_PACK")
    gen = ModelGroup.create(SPEC, "dp=2", name="fmt-read-gen", weight_format="fp8_block128", strategy="STRICT_PACK")
    filler.shutdown()
    try:
        assert set(gen.placement.nodes) == set(tp.placement.nodes)
        tp.init_synthetic(5)
        stats = tp.copy_to(gen)
        assert stats.conversion == "source" and stats.bytes_inter_node == 0
        steps = [s for s in gen.last_trace().steps() if s["recv_from"] is not None]
        assert steps and all(s["link"] == "read" and ":fmt-read-tp:" in s["recv_from"] for s in steps), steps
        before = expected_fp8(tp.state_dict())
        holds(gen, before)
        state = tp.state_dict()
        name = "model.layers.0.mlp.down_proj.weight"
        state[name][3, 300] = float("-inf")
        tp.load_state_dict(state)
        for stage in (False, True):
            with pytest.raises(ReallocationError, match=rf"{name}: block \(0, 2\) .* holds inf or NaN"):
                tp.copy_to(gen, stage=True).wait() if stage else tp.copy_to(gen)
            holds(gen, before)
        state[name][3, 300] = 0.5  # fixed: a staged copy reads and converts, then switches
        tp.load_state_dict(state)
        update = tp.copy_to(gen, stage=True)
        update.wait()
        received = [s for s in update.trace().steps() if s["recv_from"] is not None]
        assert received and all(s["link"] == "read" for s in received), received
        holds(gen, before)  # serving the old weights until the switch
        update.commit()
        holds(gen, expected_fp8(state))
    finally:
        tp.shutdown()
        gen.shutdown()
