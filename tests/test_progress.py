"""Progress bars and operation logs (realloc/progress.py) and the CLI's log options; no Ray."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest

from realloc.progress import PROGRESS_ENV, Progress, bars_enabled, phase_summary
from realloc_tools.cli import log_options

LOG = logging.getLogger("test.progress")
END = re.compile(r"^(?P<what>.+): done, (?P<bytes>\d+) bytes in (?P<seconds>[\d.]+) s \((?P<gbps>[\d.]+) GB/s\)")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def records(caplog, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name and r.levelno == level]


def test_bars_are_off_when_the_stream_is_not_a_terminal(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    stream = io.StringIO()
    with Progress(LOG, "copy", total=100, stream=stream) as p:
        p.advance(60)
        p.advance(40)
    assert not p.enabled and stream.getvalue() == ""
    assert p.count == 100 and p.steps == [("copy", 100)]


def test_bars_are_on_for_a_terminal_and_when_forced(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    terminal = Terminal()
    with Progress(LOG, "to a terminal", total=10, unit="file", stream=terminal) as p:
        p.advance(10)
    assert p.enabled and "to a terminal" in terminal.getvalue() and "10/10" in terminal.getvalue()

    monkeypatch.setenv(PROGRESS_ENV, "1")
    forced = io.StringIO()
    with Progress(LOG, "forced", stream=forced) as p:
        p.step("read", total=3 << 20)
        for _ in range(3):
            p.advance(1 << 20)
        bar = p.bar
        assert bar.n == 3 << 20 == bar.total  # the bar counts exactly what was advanced
        p.step("write", total=5)
        p.advance(5)
    text = forced.getvalue()
    assert "forced: read" in text and "3.00M/3.00M" in text and "forced: write" in text
    assert p.count == (3 << 20) + 5 and p.steps == [("read", 3 << 20), ("write", 5)]

    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert not bars_enabled(Terminal())


def test_a_bad_setting_of_the_variable_is_named(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{PROGRESS_ENV}='maybe'"):
        bars_enabled()


def test_start_and_end_records_carry_bytes_and_seconds(caplog):
    caplog.set_level(logging.INFO, logger=LOG.name)
    with Progress(LOG, "export 2 files", total=2048, enabled=False) as p:
        p.advance(2048)
        p.nbytes = 2048
        p.detail = "2 files"
    start, end = records(caplog)
    assert start == "export 2 files: started"
    m = END.match(end)
    assert m and m["what"] == "export 2 files" and int(m["bytes"]) == 2048 and end.endswith("; 2 files")
    assert float(m["seconds"]) == pytest.approx(p.seconds, abs=1e-3) and p.seconds > 0


def test_an_operation_without_bytes_reports_its_count(caplog):
    caplog.set_level(logging.INFO, logger=LOG.name)
    with Progress(LOG, "bench", total=4, unit="round trip", enabled=False) as p:
        p.advance(4)
    assert p.nbytes is None and p.count == 4
    assert re.match(r"bench: done, 4 round trips in [\d.]+ s$", records(caplog)[-1])


def test_a_failing_operation_logs_its_failure_and_reraises(caplog):
    caplog.set_level(logging.INFO, logger=LOG.name)
    with pytest.raises(OSError, match="disk full"):
        with Progress(LOG, "save iteration 7", total=100, enabled=False) as p:
            p.advance(30)
            raise OSError("disk full")
    assert records(caplog) == ["save iteration 7: started"]  # no end record
    (warning,) = records(caplog, logging.WARNING)
    assert re.match(r"save iteration 7: failed after [\d.]+ s \(30 B done\): OSError: disk full$", warning)
    p.end()  # only the first end or failure logs
    assert len(records(caplog)) == 1


def test_an_estimated_total_may_be_exceeded(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "1")
    stream = io.StringIO()
    with Progress(LOG, "write rank files", stream=stream) as p:
        p.step("write", total=100)  # tensor bytes; the files add their headers
        p.advance(104)
    assert p.steps == [("write", 104)] and "104/104" in stream.getvalue()
    with pytest.raises(ValueError, match="forward"):
        p.advance(-1)


def test_phase_summary_names_the_slowest_worker_and_skips_what_is_not_seconds():
    assert phase_summary([None, {"prepare": 0.5, "note": "x", "ok": True}, {"prepare": 0.25}]) == (
        "prepare 0.500 s (worker 1)"
    )
    assert phase_summary([None, None]) == ""


def test_cli_log_options():
    assert log_options(["-v", "-v", "bench"]) == ("DEBUG", ["bench"])
    assert log_options(["--log-level=warning", "--help"]) == ("WARNING", ["--help"])
    assert log_options(["bench", "-v"]) == (None, ["bench", "-v"])  # after the command: the command's
    with pytest.raises(ValueError, match="needs a level"):
        log_options(["--log-level"])
    with pytest.raises(ValueError, match="'loud'"):
        log_options(["--log-level", "loud", "bench"])


def test_cli_logging_shows_this_projects_records_and_only_warnings_of_others():
    code = (
        "import logging; from realloc_tools.cli import configure_logging; configure_logging('DEBUG'); "
        "logging.getLogger('actors.driver.checkpoint').debug('ours at debug'); "
        "logging.getLogger('ray').info('ray at info'); logging.getLogger('ray').warning('ray at warning')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "DEBUG actors.driver.checkpoint: ours at debug" in proc.stderr and "ray at warning" in proc.stderr
    assert "ray at info" not in proc.stderr
