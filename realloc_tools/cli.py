"""The ``realloc`` command line (console script): the pure commands of :mod:`realloc_tools.offline.plan`
(``plan``, ``presets``) plus the Ray-backed ``demo``, ``bench``, ``bench-gpu`` and ``ckpt-demo``.

Importing the Ray-side commands brings in ray, torch and the ``actors`` package (seconds), so
:func:`main` only does it when the command word is not one of ``realloc_tools.offline.plan.BUILTIN_COMMANDS``
(or there is none, as for the top-level ``--help``, which lists them all): ``realloc plan``
starts as fast as ``python -m realloc_tools.offline.plan plan``. Errors are handled by ``realloc_tools.offline.plan.run``:
exit status 2 and one line ``realloc: error: <message>`` on stderr for invalid input.

Global options, before the command: ``--log-level LEVEL`` (or ``-v``: INFO, ``-vv``: DEBUG) sends
the library's log records (:mod:`realloc.progress`: each operation's start and end with bytes and
seconds at INFO, plans and phases at DEBUG) to stderr; without them nothing is configured.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from realloc_tools.offline.plan import BUILTIN_COMMANDS, AddParser, build_parser, command_of, run

#: What ``--log-level`` accepts (the :mod:`logging` level names).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the full ``realloc`` command line and return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        level, argv = log_options(argv)
    except ValueError as exc:
        print(f"realloc: error: {exc}", file=sys.stderr)
        return 2
    if level is not None:
        configure_logging(level)
    extra = ray_commands() if command_of(argv) not in BUILTIN_COMMANDS else []
    parser = build_parser(extra=extra)
    add_log_options(parser)  # for --help; main() takes them out of argv before parsing
    return run(parser, argv)


def log_options(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """The log level the global options before the command ask for (``None``: none) and the rest of ``argv``.

    Example:
        >>> log_options(["-vv", "bench", "--json"])
        ('DEBUG', ['bench', '--json'])
        >>> log_options(["--log-level", "info", "plan", "-v"])
        ('INFO', ['plan', '-v'])
    """
    argv, level, verbose, i = list(argv), None, 0, 0
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        if word in ("-v", "-vv"):
            verbose += len(word) - 1
        elif word == "--log-level" or word.startswith("--log-level="):
            if word == "--log-level":
                if i + 1 == len(argv):
                    raise ValueError(f"--log-level needs a level: one of {', '.join(LOG_LEVELS)}")
                value = argv.pop(i + 1)
            else:
                value = word.split("=", 1)[1]
            if value.upper() not in LOG_LEVELS:
                raise ValueError(f"--log-level {value!r}: expected one of {', '.join(LOG_LEVELS)}")
            level = value.upper()
        else:
            i += 1  # another option (--help): argparse's
            continue
        argv.pop(i)
    if level is None and verbose:
        level = "INFO" if verbose == 1 else "DEBUG"
    return level, argv


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """The global log options, shown by ``realloc --help``."""
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.upper,
        help="log this project's records at this level and above to stderr (INFO: each operation's start "
        "and end with bytes and seconds; DEBUG: plans and phases too; other libraries: WARNING); before the command",
    )
    parser.add_argument("-v", action="count", help="-v: --log-level INFO, -vv: DEBUG; before the command")


#: The loggers ``--log-level`` sets: this project's packages (other libraries, Ray's own, stay at WARNING).
OWN_LOGGERS = ("realloc", "actors", "realloc_tools")


def configure_logging(level: str) -> None:
    """Records of ``level`` and above from this project's loggers, WARNING and above from the
    others (Ray's own), to stderr, one line each."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr, force=True)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(getattr(logging, level))


def ray_commands() -> list[AddParser]:
    """The ``add_<name>_parser`` functions of the Ray-backed commands (imports ray and torch).

    An import error here is a broken installation and is raised as such: a command must never
    silently vanish from the CLI.
    """
    from realloc_tools.bench import add_bench_parser
    from realloc_tools.bench.gpu import add_bench_gpu_parser
    from realloc_tools.bench.scale import add_bench_scale_parser
    from realloc_tools.demos.ckpt_demo import add_ckpt_demo_parser
    from realloc_tools.demos.demo import add_demo_parser

    return [add_demo_parser, add_bench_parser, add_bench_gpu_parser, add_ckpt_demo_parser, add_bench_scale_parser]


if __name__ == "__main__":
    sys.exit(main())
