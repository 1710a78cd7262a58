"""The Ray-backed subcommands of the ``realloc`` CLI (registered lazily by realloc.cli)."""

from __future__ import annotations

from typing import Any


def register(subparsers: Any) -> None:
    from actors.demo import add_demo_parser

    add_demo_parser(subparsers)
    try:
        from actors.bench import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(subparsers)
    try:
        from actors.ckpt_demo import add_ckpt_demo_parser
    except ImportError:
        pass
    else:
        add_ckpt_demo_parser(subparsers)
