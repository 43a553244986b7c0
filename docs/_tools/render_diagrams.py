"""Render the site's Mermaid diagrams to SVG files that are committed beside their sources.

The pages show ``NAME.svg`` as an image: it renders offline, from ``file://`` and on GitHub, with
no script and no CDN, and building the site needs no Node. Each SVG starts with a comment
naming the sha256 of the ``NAME.mmd`` it was rendered from; ``tests/test_docs.py`` fails when a
source changed and its SVG was not rendered again.

    python3 docs/_tools/render_diagrams.py

Needs Node (``npx`` fetches mermaid-cli :data:`MERMAID_CLI` from the npm registry, or set
``MMDC`` to an installed ``mmdc``) and a Chromium (``CHROMIUM``, default Debian's
``/usr/bin/chromium``). The look is ``mermaid.json`` beside this file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).resolve().parent / "mermaid.json"
MERMAID_CLI = "@mermaid-js/mermaid-cli@11.17.0"
STAMP = "<!-- rendered from {name} (sha256 {digest}) by docs/_tools/render_diagrams.py -->\n"


def stamp(source: Path) -> str:
    """The first line of ``source``'s SVG: its name and the sha256 (hex) of its bytes."""
    return STAMP.format(name=source.name, digest=hashlib.sha256(source.read_bytes()).hexdigest())


def sources() -> list[Path]:
    """Every ``.mmd`` file under ``docs/`` (not the build output)."""
    return sorted(p for p in DOCS.rglob("*.mmd") if "_build" not in p.parts)


def render(source: Path, mmdc: list[str], puppeteer_config: Path) -> None:
    """Render ``source`` to ``source.with_suffix('.svg')`` and stamp it.

    Raises:
        subprocess.CalledProcessError: mmdc failed (a syntax error in the diagram, no Chromium).
    """
    svg = source.with_suffix(".svg")
    subprocess.run([*mmdc, "-i", str(source), "-o", str(svg), "-c", str(CONFIG),
                    "-p", str(puppeteer_config), "-b", "white", "-q"], check=True, timeout=300,
                   env={**os.environ, "PUPPETEER_SKIP_DOWNLOAD": "1"})  # Chromium is given
    svg.write_text(stamp(source) + svg.read_text())


def main() -> int:
    mmdc = shlex.split(os.environ.get("MMDC", f"npx --yes {MERMAID_CLI}"))
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    with tempfile.TemporaryDirectory() as tmp:
        puppeteer_config = Path(tmp) / "puppeteer.json"
        # --no-sandbox: CI and this project's machines run as root, where Chromium's sandbox
        # refuses to start
        puppeteer_config.write_text(json.dumps({"executablePath": chromium,
                                                "args": ["--no-sandbox", "--headless=new"]}))
        for source in sources():
            render(source, mmdc, puppeteer_config)
            print(f"rendered {source.relative_to(DOCS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
