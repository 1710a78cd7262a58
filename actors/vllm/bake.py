"""What a vLLM worker holds, learnt from the worker's own weight loaders (runs in a vLLM worker).

vLLM decides where each byte of a checkpoint tensor lands on a worker inside the model's
``load_weights`` and its parameters' ``weight_loader`` s (fused ``qkv_proj``/``gate_up_proj``,
replicated kv heads, the padded vocabulary, ``FusedMoE`` ``w13``/``w2``, quantization scales).
Rather than restating those rules, :func:`bake` runs ``load_weights`` once over stand-ins of
every checkpoint tensor that hold no data, as vLLM's ``sharded_rdt`` backend bakes its plans
(vllm/distributed/weight_transfer/sharded_rdt_engine.py ``_bake``, ``_install_recording_stamps``,
``_restore_after_dry_run``; the stand-in is ``FakeRDTTensor`` of sharded_rdt_fake.py, reused
as is). Each ``copy_`` a loader makes is recorded as a :class:`Scatter`: the box of the
checkpoint tensor it reads (the loader's view ops replayed on a meta tensor: :func:`chain_box`)
and the strided region of the model-format parameter it writes.

The boxes are the worker's layout as the engine itself defines it: the driver checks them
against realloc's vLLM conventions (``Layout(vocab_pad_rule="vllm", expert_order="vllm")``)
before any byte moves, and the commit (:mod:`actors.vllm.engine`) replays the scatters from the
staged shards. :func:`describe_experts` says how the worker's ``FusedMoE`` layers hold the routed
experts (expert parallelism, its rank and size, the placement), which the driver lays the engine
out by. The layerwise-reload names used here are private to vLLM 0.32 (pinned:
:mod:`actors.vllm.plugin`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from realloc.shards.store import TORCH_DTYPES


@dataclass(frozen=True)
class Scatter:
    """One copy a loader makes: checkpoint tensor ``name``'s box (``offsets``, ``sizes``) into
    the model-format parameter ``param`` of module ``module`` (its qualified name), at the
    strided region ``(shape, stride, offset)`` of the parameter's storage."""

    module: str
    param: str
    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Bake:
    """Every copy the worker's loaders make for the checkpoint names they were given; the names
    they read nothing of, and the loadable tensors no copy reached (``module.param``)."""

    scatters: tuple[Scatter, ...]
    unread: tuple[str, ...]  # checkpoint names no loader copied from (a tied head; other EP ranks' experts)
    missing: tuple[str, ...]  # the model's loadable tensors no copy reached

    def boxes(self) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        """Checkpoint name -> the boxes of it this worker reads, sorted, without repeats."""
        out: dict[str, set] = {}
        for s in self.scatters:
            out.setdefault(s.name, set()).add((s.offsets, s.sizes))
        return {n: sorted(b) for n, b in sorted(out.items())}


def chain_box(shape: tuple[int, ...], dtype: torch.dtype, chain: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of a ``shape`` tensor that the view ops ``chain`` (``FakeRDTTensor``'s op chain:
    ``(op, args, kwargs)`` each) select, as ``(offsets, sizes)``; ``ValueError`` for a chain
    that is no box in the tensor's own dimension order (a transpose, a reshape across rows, a
    dtype view), naming the chain."""
    base = torch.empty(shape, dtype=dtype, device="meta")
    r = base
    for op, args, kwargs in chain:
        r = getattr(r, op)(*args, **dict(kwargs))
    why = None
    if r.dtype != base.dtype:
        why = f"it changes the dtype ({base.dtype} -> {r.dtype})"
    offsets, sizes = [0] * base.dim(), [1] * base.dim()
    if why is None:
        # the contiguous base's storage offset, dimension by dimension: an empty box past the last
        # row (a tp rank of a padded vocabulary with no real rows: vLLM's loader narrows to
        # [org_vocab_size, org_vocab_size)) starts at row n, which ``% n`` would read as row 0
        rest = r.storage_offset()
        for d, (n, st) in enumerate(zip(base.shape, base.stride())):
            if n > 1:
                offsets[d], rest = divmod(rest, st)
        used = -1
        for n, st in zip(r.shape, r.stride()):
            if n == 1:
                continue
            dims = [d for d in range(base.dim()) if base.stride(d) == st and base.shape[d] > 1]
            if len(dims) != 1 or dims[0] <= used:
                why = "its dimensions are not the tensor's own, in order"
                break
            used = dims[0]
            sizes[used] = n
    if why is None:
        view = base[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        if view.storage_offset() != r.storage_offset() or view.numel() != r.numel():
            why = "it is not one box of the tensor"
    if why is not None:
        raise ValueError(f"a loader reads a tensor of shape {tuple(shape)} through {chain}: {why}; realloc moves boxes")
    return tuple(offsets), tuple(sizes)


def _layer_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    return get_layer_tensors(module)


def bake(model: torch.nn.Module, params: list[tuple[str, tuple[int, ...], str]], device: torch.device) -> Bake:
    """Run ``model.load_weights`` over data-less stand-ins of ``params`` (checkpoint ``(name,
    shape, dtype)``) and record every copy; the model is as before afterwards. ``ValueError``
    for a copy that is no box (naming it)."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
        _place_kernel_tensors,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    names = {m: n for n, m in model.named_modules()}
    sink = BakeSink()
    stamped: list[tuple[torch.Tensor, Any, bool]] = []

    def stamp(module, pname, inner):
        @functools.wraps(inner)
        def stamped_loader(*args, **kwargs):
            sink.current = (module, pname)
            try:
                return inner(*args, **kwargs)
            finally:
                sink.current = None

        return stamped_loader

    with torch.device(device):
        initialize_layerwise_reload(model)
        try:
            for module in model.modules():
                for pname, t in _layer_tensors(module).items():
                    original = getattr(t, "weight_loader", None)
                    added = original is None
                    inner = default_weight_loader if added else _get_original_loader(t)
                    stamped.append((t, original, added))
                    t.weight_loader = stamp(module, pname, inner)
            current: list = [None]

            def fakes():
                for n, shape, dtype in params:
                    current[0] = (n, shape, dtype)
                    yield n, FakeRDTTensor(n, torch.Size(shape), TORCH_DTYPES[dtype], torch.device(device), sink=sink)

            try:
                model.load_weights(fakes())
            except Exception as err:
                n, shape, dtype = current[0] or ("(none)", (), "")
                raise ValueError(
                    f"the model's loader refuses {n} of shape {list(shape)} ({dtype}): {type(err).__name__}: {err}"
                ) from err
        finally:
            for t, original, added in stamped:
                if added:
                    del t.weight_loader
                else:
                    t.weight_loader = original
            for layer in model.modules():
                info = LAYERWISE_INFO.get(layer)
                if info is not None and info.can_load():
                    if info.kernel_tensors is not None:
                        _place_kernel_tensors(layer, info)
                    info.reset()
    shapes = {n: (tuple(shape), TORCH_DTYPES[dtype]) for n, shape, dtype in params}
    scatters, reached = [], set()
    for layer, copies in sink.copies_by_layer.items():
        tensors = _layer_tensors(layer)
        for c in copies:
            name, chain = c.src
            offsets, sizes = chain_box(*shapes[name], chain)
            if math.prod(sizes) != math.prod(c.shape):
                raise ValueError(f"{name}: the loader copies {c.shape} from a box of {sizes}")
            scatters.append(Scatter(names[layer], c.param_name, name, offsets, sizes, c.shape, c.stride, c.offset))
            reached.add(id(tensors[c.param_name]))
    # what a commit would leave wrong: in a module that receives copies, a tensor none reaches
    # (it would be rebuilt empty), and a parameter of a module that receives none (it would keep
    # the weights vLLM loaded: the trainer does not send it)
    written = {id(layer) for layer in sink.copies_by_layer}
    missing = tuple(
        f"{names[m]}.{p}" if names[m] else p
        for m in model.modules()
        for p, t in _layer_tensors(m).items()
        if p not in SKIP_LOAD_TENSORS
        and id(t) not in reached
        and (id(m) in written or isinstance(t, torch.nn.Parameter))
    )
    return Bake(tuple(scatters), tuple(sorted(set(shapes) - sink.copied_names)), missing)


def describe_experts(model: torch.nn.Module, parallel_config: Any = None) -> dict[str, Any]:
    """How the worker holds the routed experts, read from vLLM's own ``FusedMoE`` layers (each
    ``RoutedExperts`` of ``model``), for the driver to lay the engine out by:

    * ``expert_parallel``: the layers hold whole experts split over ranks (``enable_expert_parallel``;
      vllm/model_executor/layers/fused_moe/config.py ``FusedMoEParallelConfig.make``: ``use_ep``,
      where the expert tp size becomes 1 and ``ep_size``/``ep_rank`` the flattened tp's);
    * ``ep_size``, ``ep_rank``, ``expert_tp_size`` (``moe_parallel_config.tp_size``: the tp size
      of one expert's matrices, 1 under expert parallelism);
    * ``expert_placement``: the placement the layers use (routed_experts.py ``RoutedExperts.
      expert_placement_strategy``, which expert_map_manager.py ``ExpertMapManager`` resolves from
      vllm/config/parallel.py ``expert_placement_strategy``: a ``"round_robin"`` it cannot serve
      falls back to ``"linear"``, ``determine_expert_placement_strategy``), ``None`` without
      expert parallelism; ``expert_placement_config``: the engine's setting;
    * ``eplb``: expert load balancing (``enable_eplb``: vLLM moves experts between ranks while it
      serves) and ``redundant_experts`` (physical experts beyond the checkpoint's).

    A model without routed experts reads as one without expert parallelism. ``ValueError`` where
    the layers disagree (naming the two)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    seen: dict[str, Any] | None = None
    first = ""
    for name, m in model.named_modules():
        if not isinstance(m, RoutedExperts):
            continue
        pc = m.moe_config.moe_parallel_config
        mine = {
            "expert_parallel": bool(pc.use_ep),
            "ep_size": int(pc.ep_size),
            "ep_rank": int(pc.ep_rank),
            "expert_tp_size": int(pc.tp_size),
            "expert_placement": str(m.expert_placement_strategy) if pc.use_ep else None,
            "eplb": bool(pc.enable_eplb),
            "redundant_experts": int(m.moe_config.num_experts - m.moe_config.num_logical_experts),
        }
        if seen is None:
            seen, first = mine, name
        elif mine != seen:
            raise ValueError(f"vLLM's MoE layers {first} and {name} hold their experts differently: {seen} vs {mine}")
    out = seen or {
        "expert_parallel": False,
        "ep_size": 1,
        "ep_rank": 0,
        "expert_tp_size": None,
        "expert_placement": None,
        "eplb": False,
        "redundant_experts": 0,
    }
    setting = getattr(parallel_config, "expert_placement_strategy", None)
    out["expert_placement_config"] = None if setting is None else str(setting)
    return out
