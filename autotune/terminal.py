"""What reaches a terminal or a shell: consoles as wide as the terminal, quoted command lines."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

from rich.console import Console

#: width when the output is no terminal (a file, a pipe, a CI log) and COLUMNS is not set
FALLBACK_WIDTH = 100


def make_console(stderr: bool = False) -> Console:
    """A rich console that follows the terminal's width (read at each print, so a resized
    window is followed); elsewhere ``COLUMNS``, else ``FALLBACK_WIDTH``. Emoji codes are off:
    a study named ``:x:`` prints as typed (markup in user text is escaped by the callers)."""
    console = Console(stderr=stderr, emoji=False)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console.width = FALLBACK_WIDTH
    return console


def shell_line(parts: Sequence[str]) -> str:
    """One command line a user can paste into a POSIX shell: every part quoted."""
    return shlex.join(parts)


def printable(text: str) -> str:
    """``text`` on one line: control characters (newlines too) written as escapes."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
