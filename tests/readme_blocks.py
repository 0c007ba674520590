"""The README's fenced blocks, as `tests/e2e/test_readme.py` runs them.

A block's info string is its language and then tags (GitHub shows only the language):

    bash           a command a user types: run, and it must exit 0
    bash terminal  a command that keeps running in a terminal of its own: started, and stopped
                   (SIGTERM) when its section ends; the next block waits for its first line
    bash ci        the test command, which CI runs (`.ci/run`): checked to be CI's command
    python         a snippet run as written with the virtualenv's python
    python sketch  a sketch of a user's own code (their names, their store): not run
    json, text     what the block before it printed: its shape is checked

A command or snippet after a terminal block in the same section may need that terminal's
server to be up: it is retried until it succeeds, as a person would try again. Sections are the
README's `## ` headings; they run in order and share one shell's exported variables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "Section", "output_shape", "sections"]

_FENCE = re.compile(r"^```(\S*)((?: [^\s`]+)*)\s*$")
_NUMBER = re.compile(r"\d[\d,.]*")


@dataclass(frozen=True)
class Block:
    lang: str
    tags: frozenset[str]
    text: str
    line: int  # the opening fence's line, 1-based

    @property
    def runs(self) -> bool:
        return (self.lang == "bash" and "ci" not in self.tags) or (
            self.lang == "python" and "sketch" not in self.tags
        )

    @property
    def terminal(self) -> bool:
        return "terminal" in self.tags


@dataclass(frozen=True)
class Section:
    title: str
    blocks: tuple[Block, ...]


def sections(readme: Path) -> list[Section]:
    """The README's `## ` sections with their fenced blocks, in order."""
    found: list[Section] = []
    title, blocks = "", list[Block]()
    lines = readme.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            found.append(Section(title, tuple(blocks)))
            title, blocks = line[3:].strip(), []
        elif fence := _FENCE.match(line):
            start = i
            i += 1
            while i < len(lines) and lines[i] != "```":
                i += 1
            if i == len(lines):
                raise ValueError(f"README line {start + 1}: a block that is never closed")
            text = "\n".join(lines[start + 1 : i]) + "\n"
            tags = frozenset(fence.group(2).split())
            blocks.append(Block(fence.group(1), tags, text, start + 1))
        i += 1
    found.append(Section(title, tuple(blocks)))
    return [s for s in found if s.blocks]


def output_shape(text: str) -> list[str]:
    """Each line's first word with its numbers masked: what a documented output promises."""
    words = (
        line.split(maxsplit=1)[0] for line in text.splitlines() if line.strip() not in ("", "...")
    )
    return [_NUMBER.sub("N", w) for w in words]
