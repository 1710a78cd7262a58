"""A rank's buffers as torch tensors: shard stores addressed by boxes, the copies that pack,
unpack and blend them, views and fused views of a rank's shards, module binding, and the
in-process executor. (``copy_program``, ``synthetic`` and ``dtensor`` are imported by module.)"""

from realloc.shards.bind import BindReport, bind_module, layer_name_map
from realloc.shards.copies import (
    SMALL_COPY_BYTES,
    Copies,
    blend_into,
    check_eta,
    copy_boxes,
    copy_local,
    grouped_copies,
    local_copies,
    pack,
    pack_copies,
    piece_view,
    stack_runs,
    unpack,
    unpack_copies,
    weight_kind,
)
from realloc.shards.fused import FUSED_CONVENTIONS, FUSED_PARTS, fused_views, megatron_fused_views
from realloc.shards.local_executor import execute_in_process
from realloc.shards.store import (
    TORCH_DTYPES,
    Address,
    ShardIndex,
    ShardStore,
    allocate_buffers,
    buffers_nbytes,
    local_tensor,
    zero_padding,
)
from realloc.shards.views import check_buffers, flat_views, fused_view, shard_views

__all__ = [
    "FUSED_CONVENTIONS",
    "FUSED_PARTS",
    "SMALL_COPY_BYTES",
    "TORCH_DTYPES",
    "Address",
    "BindReport",
    "Copies",
    "ShardIndex",
    "ShardStore",
    "allocate_buffers",
    "bind_module",
    "blend_into",
    "buffers_nbytes",
    "check_buffers",
    "check_eta",
    "copy_boxes",
    "copy_local",
    "execute_in_process",
    "flat_views",
    "fused_view",
    "fused_views",
    "grouped_copies",
    "layer_name_map",
    "local_copies",
    "local_tensor",
    "megatron_fused_views",
    "pack",
    "pack_copies",
    "piece_view",
    "shard_views",
    "stack_runs",
    "unpack",
    "unpack_copies",
    "weight_kind",
    "zero_padding",
]
