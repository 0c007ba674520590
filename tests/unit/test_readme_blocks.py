"""The README's blocks parse and carry only the tags tests/e2e/test_readme.py knows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.readme_blocks import output_shape, sections

README = Path(__file__).resolve().parents[2] / "README.md"
#: language -> the tags its blocks may carry (tests/readme_blocks.py says what each means).
KNOWN = {
    "": set(),
    "bash": {"terminal", "ci"},
    "python": {"sketch"},
    "json": set(),
    "text": set(),
}


def test_every_block_has_a_known_language_and_tags() -> None:
    blocks = [b for s in sections(README) for b in s.blocks]
    assert blocks
    for b in blocks:
        assert b.lang in KNOWN, (b.line, b.lang)
        assert b.tags <= KNOWN[b.lang], (b.line, b.tags)
    assert sum("ci" in b.tags for b in blocks) == 1


def test_a_terminal_is_followed_in_its_section_by_what_uses_it() -> None:
    for section in sections(README):
        terminals = [i for i, b in enumerate(section.blocks) if b.terminal]
        if terminals:
            assert any(b.runs and not b.terminal for b in section.blocks[terminals[-1] + 1 :]), (
                section.title
            )


def test_sections_blocks_and_shapes(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text(
        "# t\n\n```\npicture\n```\n## A\n\n```bash terminal\nserve\n```\n\n```bash\ncurl x\n```\n"
        "```text\nv1    full 2 kB\n...\npublished 12 versions\n```\n"
        "## B\n\n```python sketch\nx\n```\n"
    )
    a, b = sections(page)[1:]
    assert a.title == "A" and [x.lang for x in a.blocks] == ["bash", "bash", "text"]
    assert a.blocks[0].terminal and a.blocks[0].runs and a.blocks[0].line == 8
    assert a.blocks[1].text == "curl x\n" and not a.blocks[1].terminal
    assert not b.blocks[0].runs
    assert output_shape(a.blocks[2].text) == ["vN", "published"]


def test_an_unclosed_block_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text("## A\n```bash\nrm -rf /\n")
    with pytest.raises(ValueError, match="line 2"):
        sections(page)
