"""The screenshots in docs/: each picture exists, is referenced by docs/observability.md with the
command that makes it, and that command's Chromium call renders a page (a local file here)."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import pytest

from realloc_tools.observe import screenshots

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "observability.md"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_every_picture_is_in_the_docs_beside_its_command():
    text = DOC.read_text()
    pictures = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\)", text)
    assert set(pictures) == {"img/ray_dashboard_actors.png", "img/prometheus_bytes_by_kind.png"}, pictures
    assert "python -m realloc_tools.observe.screenshots" in text
    for picture in pictures:
        width, height = png_size(DOC.parent / picture)
        assert width >= 1000 and height >= 800, (picture, width, height)


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(b) for b in screenshots.BROWSERS), reason="no chromium here (.ci/services.py installs it)"
)
def test_chromium_renders_a_page_into_a_png(tmp_path):
    page = tmp_path / "page.html"
    page.write_text("<html><body style='background:#123456'><h1>realloc:policy:rank0</h1></body></html>")
    out = screenshots.screenshot(page.as_uri(), tmp_path / "shot.png", size="800,600", wait_ms=1000)
    assert png_size(out) == (800, 600)
    with pytest.raises(RuntimeError, match="no screenshot"):
        screenshots.screenshot(page.as_uri(), tmp_path / "missing" / "shot.png", size="800,600", wait_ms=1000)
