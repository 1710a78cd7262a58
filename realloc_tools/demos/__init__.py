"""The Ray-backed demos: ``realloc demo`` (:mod:`.demo`: layout changes on simulated nodes, every
shard verified) and ``realloc ckpt-demo`` (:mod:`.ckpt_demo`: save, lose a node, restore, reshard)."""
