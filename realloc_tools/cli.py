"""The ``realloc`` command line (console script): the pure commands of :mod:`realloc_tools.plan_cli`
(``plan``, ``presets``) plus the Ray-backed ``demo``, ``bench``, ``bench-gpu`` and ``ckpt-demo``.

Importing the Ray-side commands brings in ray, torch and the ``actors`` package (seconds), so
:func:`main` only does it when the command word is not one of ``realloc_tools.plan_cli.BUILTIN_COMMANDS``
(or there is none, as for the top-level ``--help``, which lists them all): ``realloc plan``
starts as fast as ``python -m realloc_tools.plan_cli plan``. Errors are handled by ``realloc_tools.plan_cli.run``:
exit status 2 and one line ``realloc: error: <message>`` on stderr for invalid input.
"""

from __future__ import annotations

import sys
from typing import Sequence

from realloc_tools.plan_cli import BUILTIN_COMMANDS, AddParser, build_parser, command_of, run


def main(argv: Sequence[str] | None = None) -> int:
    """Run the full ``realloc`` command line and return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = ray_commands() if command_of(argv) not in BUILTIN_COMMANDS else []
    return run(build_parser(extra=extra), argv)


def ray_commands() -> list[AddParser]:
    """The ``add_<name>_parser`` functions of the Ray-backed commands (imports ray and torch).

    An import error here is a broken installation and is raised as such: a command must never
    silently vanish from the CLI.
    """
    from realloc_tools.bench import add_bench_parser
    from realloc_tools.ckpt_demo import add_ckpt_demo_parser
    from realloc_tools.demo import add_demo_parser
    from realloc_tools.gpu_bench import add_bench_gpu_parser
    from realloc_tools.scale_bench import add_bench_scale_parser

    return [add_demo_parser, add_bench_parser, add_bench_gpu_parser, add_ckpt_demo_parser, add_bench_scale_parser]


if __name__ == "__main__":
    sys.exit(main())
