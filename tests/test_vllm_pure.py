"""The vLLM backend's pure parts, without vLLM: the box a loader's view chain reads
(:func:`actors.vllm.bake.chain_box`, against an independent oracle: the chain replayed on a real
tensor of element indices), the driver's check of a derived layout against realloc's vLLM
conventions (:func:`actors.driver.vllm.check_derived`), and the payloads both ends read."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.driver.vllm import check_derived, vllm_layout
from actors.vllm import decode, encode, stage_payload
from actors.vllm.bake import chain_box
from realloc.spec import decoder_spec


@st.composite
def box_chains(draw):
    """A shape and a chain of the view ops vLLM's loaders use that keep a box (narrow, slicing,
    chunk or unbind with the index that picks one part, select of one index)."""
    dims = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(dims))
    chain, now = [], list(shape)
    for _ in range(draw(st.integers(0, 4))):
        live = [d for d, n in enumerate(now) if n >= 1]
        d = draw(st.sampled_from(live))
        kind = draw(st.sampled_from(["narrow", "slice", "chunk", "select"]))
        n = now[d]
        if kind == "narrow":
            start = draw(st.integers(0, n - 1))
            length = draw(st.integers(1, n - start))
            chain.append(("narrow", (d, start, length), ()))
            now[d] = length
        elif kind == "slice":
            start = draw(st.integers(0, n - 1))
            stop = draw(st.integers(start + 1, n))
            index = tuple([slice(None)] * d + [slice(start, stop)])
            chain.append(("__getitem__", (index,), ()))
            now[d] = stop - start
        elif kind == "chunk":
            parts = draw(st.integers(1, n))
            pieces = torch.empty(now).chunk(parts, d)
            i = draw(st.integers(0, len(pieces) - 1))
            chain.append(("chunk", (parts, d), ()))
            chain.append(("__getitem__", (i,), ()))
            now[d] = pieces[i].shape[d]
        elif len(now) > 1:  # select drops the dimension
            i = draw(st.integers(0, n - 1))
            chain.append(("select", (d, i), ()))
            now.pop(d)
    return shape, tuple(chain)


def replay(t: torch.Tensor, chain: tuple) -> torch.Tensor:
    for op, args, kwargs in chain:
        t = getattr(t, op)(*args, **dict(kwargs))
    return t


@settings(max_examples=300, deadline=None)
@given(box_chains())
def test_chain_box_is_the_box_the_chain_reads(case):
    shape, chain = case
    full = torch.arange(math.prod(shape)).reshape(shape)
    offsets, sizes = chain_box(shape, torch.float32, chain)
    read = replay(full, chain)
    box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert torch.equal(box.reshape(-1), read.reshape(-1)), (shape, chain, offsets, sizes)


@pytest.mark.parametrize(
    "chain, why",
    [
        ((("t", (), ()),), "not the tensor's own, in order"),
        ((("transpose", (0, 1), ()),), "not the tensor's own, in order"),
        ((("view", (torch.int32,), ()),), "changes the dtype"),
        ((("__getitem__", ((slice(None), slice(0, 4, 2)),), ()),), "not the tensor.s own"),  # every other column
    ],
)
def test_a_chain_that_is_no_box_is_refused_naming_it(chain, why):
    with pytest.raises(ValueError, match=why):
        chain_box((6, 8), torch.float32, chain)


def _spec():
    return decoder_spec(
        "tiny-vllm", hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, vocab=100, dtype="float32"
    )


def _workers(layout, tp):
    out = []
    for r in range(tp):
        boxes = {}
        for s in layout.shards(r):
            boxes.setdefault(s.param, []).append([list(s.offsets), list(s.sizes)])
        out.append({"index": r, "tp_rank": r, "tp_size": tp, "boxes": boxes, "unread": [], "missing": []})
    return out


def test_the_derived_layout_check_passes_what_the_conventions_say_and_names_a_difference():
    spec, tp = _spec(), 2
    layout = vllm_layout(spec, tp)
    check_derived(layout, _workers(layout, tp), spec)  # the conventions themselves: no difference
    # vLLM pads 100 rows to 128, 64 per rank: rank 1 reads 36 real rows
    assert _workers(layout, tp)[1]["boxes"]["model.embed_tokens.weight"] == [[[64, 0], [36, 64]]]
    wrong = _workers(layout, tp)
    wrong[1]["boxes"]["model.layers.0.self_attn.k_proj.weight"] = [[[0, 0], [16, 64]]]  # rank 0's kv head
    with pytest.raises(ValueError, match=r"vLLM worker 1 \(tp rank 1 of 2\) reads model.layers.0.self_attn.k_proj"):
        check_derived(layout, wrong, spec)
    missing = _workers(layout, tp)
    missing[0]["missing"] = ["model.layers.0.mlp.extra.weight"]
    with pytest.raises(ValueError, match="holds .*model.layers.0.mlp.extra.weight.* the trainer's model does not send"):
        check_derived(layout, missing, spec)
    unread = _workers(layout, tp)
    for w in unread:
        w["unread"] = ["lm_head.weight"]
    with pytest.raises(ValueError, match=r"reads nothing of \['lm_head.weight'\]"):
        check_derived(layout, unread, spec)


def test_a_stage_payload_carries_the_share_as_text_and_back():
    share = ({"plan": [1, 2, 3]}, ("peers",))
    payload = stage_payload("u1", 7, "w1", "10.0.0.1", 1234, 3, 5, share, base=6, keep_base=True)
    assert all(isinstance(v, (str, int, bool)) for v in payload.values())  # JSON for the HTTP front end
    assert decode(payload["share"]) == share and payload["base"] == 6 and payload["keep_base"] is True
    assert decode(encode(None)) is None


def test_a_round_whose_stage_thread_posted_but_has_not_exited_yet_commits():
    """Found by a suite run: a worker's stage thread posts its outcome and only then exits; the
    driver reads the outcome and commits at once, and the commit saw the thread still alive and
    refused a fully staged round ("its transfer is still running"). A staged round commits."""
    pytest.importorskip("vllm")
    import threading

    from actors.vllm.engine import ReallocWeightTransferEngine, _Round

    finishing = threading.Event()
    thread = threading.Thread(target=finishing.wait, daemon=True)  # a stage thread between its post and its exit
    thread.start()
    try:
        engine = object.__new__(ReallocWeightTransferEngine)
        engine.layout, engine.index, engine.committed, engine.held, engine.held_rank = object(), 0, 3, None, None
        committed = []
        engine._commit = committed.append
        engine.round = _Round(update_id="u", version=4, thread=thread, shadow="the shadow set", staged=True)
        engine.finish_weight_update()
        assert committed == ["the shadow set"] and engine.committed == 4 and engine.round is None
    finally:
        finishing.set()


class _FailingCommit:
    """A weight-sync client whose commit (``finish_weight_update``) fails, as a vLLM worker does
    when processing a module's weights raises partway through the switch."""

    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, *args, **kwargs):
        self.calls.append("init")

    def start_weight_update(self, *args, **kwargs):
        self.calls.append("start")

    def update_weights(self, *args, **kwargs):
        self.calls.append("update")

    def finish_weight_update(self, *args, **kwargs):
        self.calls.append("finish")
        raise RuntimeError("process_weights_after_loading failed in layer 3")


def test_after_a_failed_commit_no_error_says_the_engine_is_untouched():
    """A commit that fails may leave the engine's workers with different weights (vLLM switches
    module by module). The error says so, and so does every later failure, until an update
    commits: it used to say, on the next update's failure, that the engine served its last
    version "untouched" (found in review, 2026-11-28)."""
    from actors.driver.vllm import VLLMEngine
    from actors.errors import ReallocationError

    engine = VLLMEngine(_FailingCommit(), name="gen")
    engine.version = 4
    with pytest.raises(ReallocationError, match="commit of version 5 failed .* workers may differ") as err:
        engine.switch(5, ("trainer", 5))
    said = str(engine.failed(err.value, "trainer"))
    assert "untouched" not in said and "weights are not known since the commit of version 5 failed" in said
    later = str(engine.failed(RuntimeError("the next update could not start"), "trainer"))
    assert "untouched" not in later and "reload them" in later and engine.version == 4
    assert engine.serving().startswith("gen's weights are not known")  # what a worker's timeout says too
