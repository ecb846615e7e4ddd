"""What reaches a terminal or a shell: consoles as wide as the terminal, quoted command lines."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

from rich.console import (
    Console,
    ConsoleOptions,
    ConsoleRenderable,
    RenderableType,
    RenderHook,
    RenderResult,
)
from rich.segment import Segment

#: width when the output is no terminal (a file, a pipe, a CI log) and COLUMNS is not set
FALLBACK_WIDTH = 100


def make_console(stderr: bool = False) -> Console:
    """A rich console that follows the terminal's width (read at each print, so a resized
    window is followed); elsewhere ``COLUMNS``, else ``FALLBACK_WIDTH``. Emoji codes are off:
    a study named ``:x:`` prints as typed (markup in user text is escaped by the callers)."""
    console = Console(stderr=stderr, emoji=False)
    console.push_render_hook(_TerminalSafe())
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console.width = FALLBACK_WIDTH
    return console


def shell_line(parts: Sequence[str]) -> str:
    """One command line a user can paste into a shell: every part quoted; a part with control
    characters (a name another tool stored) as bash's ``$'...'``, so that the terminal shows
    escapes and the shell still reads the exact name back."""
    return " ".join(shlex.quote(p) if p.isprintable() else _ansi_c(p) for p in parts)


def _ansi_c(part: str) -> str:
    inner = "".join(
        c if c.isprintable() and c not in "'\\" else ("\\" + c if c in "'\\" else _escape(c))
        for c in part
    )
    return f"$'{inner}'"


def _escape(c: str) -> str:
    code = ord(c)
    return (
        f"\\x{code:02x}"
        if code < 0x80
        else f"\\u{code:04x}"
        if code < 0x10000
        else (f"\\U{code:08x}")
    )


def printable(text: str) -> str:
    """``text`` on one line: control characters (newlines too) written as escapes."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def terminal_text(text: str) -> str:
    """``text`` as a terminal may receive it: lines and tabs kept, every other control
    character (ESC of an OSC or CSI sequence, C1 controls, BEL) written as an escape."""
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


class _SafeRenderable:
    """A renderable whose text segments pass ``terminal_text`` (rich's own control segments,
    a progress bar's cursor moves, pass as they are)."""

    def __init__(self, inner: RenderableType) -> None:
        self.inner = inner

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for segment in console.render(self.inner, options):
            if segment.control:
                yield segment
            else:
                yield Segment(terminal_text(segment.text), segment.style)


class _TerminalSafe(RenderHook):
    """Every renderable a console prints, made terminal-safe: a study name or a model file's
    name stored by another tool never sets the clipboard or the window title."""

    def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
        return [_SafeRenderable(r) for r in renderables]
