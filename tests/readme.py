"""The code blocks of README.md, for the tests that run them (so that the README stays true)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(heading: str, language: str) -> list[str]:
    """The ```language blocks of the README section whose "## " heading starts with `heading`."""
    sections = re.split(r"^## ", README.read_text(encoding="utf-8"), flags=re.MULTILINE)
    matching = [s for s in sections if s.startswith(heading)]
    assert len(matching) == 1, f"README.md has {len(matching)} sections '## {heading}...'"
    blocks = re.findall(rf"^```{language}\n(.*?)^```", matching[0], flags=re.MULTILINE | re.DOTALL)
    assert blocks, f"README.md's section '## {heading}' has no {language} block"
    return blocks
