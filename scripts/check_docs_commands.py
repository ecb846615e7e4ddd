"""Check the commands that README.md and docs/ quote: every ``autotune ...`` line must parse with
the CLI's own parser (an unknown option, a bad value or a missing argument fails), and the
commands that produce the documents' figures must still run.

    python scripts/check_docs_commands.py          # parse every command, run the fast ones
    python scripts/check_docs_commands.py --slow   # also run the slow ones (studies, benchmarks)
    python scripts/check_docs_commands.py --list   # what would run, fast and slow

A command is complete where it stands on a line of its own in a code block (it must parse as
it is), a fragment where it is quoted inside a sentence (``autotune run --ladder``: its options
must exist and take their values, a required option it leaves out is not an error).
Placeholders (``NAME``, ``N``, ``FILE`` ...) are given a value of their kind; lines with
alternatives or elisions (``[--json]``, ``a|b``, ``...``) are not commands and are skipped.

Fast (run by ``tests/test_docs_commands.py``): ``autotune estimate`` lines and the benchmark
scripts that answer in seconds. Slow (``--slow``): studies (``autotune run``, ``make run``,
``make demo``) and the longer benchmarks. Commands that need a GPU, a cluster or an existing
study are parsed only. Each runs in a fresh folder linked to the repository's files, so a study
it makes is its own.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: placeholder words of the documents, and a value of their kind
PLACEHOLDERS = {
    "N": "2",
    "NAME": "study",
    "FILE": "out.json",
    "DIR": "out",
    "URL": "sqlite:///other.db",
    "MIN:MAX": "8:64",
    "SIZE": "1GB",
}
#: not commands: alternatives, elisions, diagrams
SKIP = re.compile(r"\.\.\.|\[|\||->|\bCOMMAND\b| / ")
#: the benchmark commands that answer in seconds (others train real trials or walk many seeds)
FAST_SCRIPTS = (
    "python benchmarks/speed_calibration.py",
    "python benchmarks/estimator_accuracy.py --measured-table",
)
#: what can't run here: a GPU, a cluster, other nodes
NEEDS_ELSEWHERE = ("--backend cuda", "--launcher slurm", "--gpus", "--nodes", "postgresql://")
#: subcommands that read an existing study
NEEDS_STUDY = ("show", "resume", "export", "report", "worker")


@dataclass(frozen=True)
class Quoted:
    path: str  # relative to the repository
    line: int
    text: str  # the command as quoted, placeholders replaced
    complete: bool

    @property
    def words(self) -> list[str]:
        try:
            return shlex.split(self.text)
        except ValueError:  # an unclosed quote: the words as written, for parse() to refuse
            return self.text.split()

    def kind(self) -> str:
        """``fast``, ``slow`` or ``parse`` (parsed, never run)."""
        w = self.words
        if not self.complete:
            return "parse"
        if w[0] == "autotune":
            if any(x in self.text for x in NEEDS_ELSEWHERE) or w[1] in NEEDS_STUDY:
                return "parse"
            return "fast" if w[1] == "estimate" else "slow"
        if w[0] == "python":
            return "fast" if self.text in FAST_SCRIPTS else "slow"
        return "slow"  # make run, make demo


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _fill(text: str) -> str:
    words = text.split()
    return " ".join(PLACEHOLDERS.get(w, w) for w in words)


def quoted(root: Path = ROOT) -> list[Quoted]:
    """Every command the documents quote."""
    out: list[Quoted] = []
    for path in documents(root):
        text = path.read_text()
        rel = str(path.relative_to(root))
        lines = text.splitlines()
        in_fence = False
        i = 0
        while i < len(lines):
            raw = lines[i]
            if raw.strip().startswith("```"):
                in_fence = not in_fence
            block = in_fence or raw.startswith("    ")
            line = raw.strip()
            start = i + 1
            while block and line.endswith("\\") and i + 1 < len(lines):  # continued lines
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            line = re.sub(r"^time\s+", "", line.split(" #")[0].strip())
            if not block or SKIP.search(line):
                continue
            if line.startswith(("autotune ", "python benchmarks/", "make run", "make demo")):
                out.append(Quoted(rel, start, _fill(line), True))
        for m in re.finditer(r"`((?:autotune|python benchmarks/[^\s`]+)(?:\s[^`]*)?)`", text):
            span = " ".join(m.group(1).split())
            if SKIP.search(span) or span.startswith("autotune -") or " " not in span:
                continue
            number = text.count("\n", 0, m.start()) + 1
            complete = span.startswith("python ")
            out.append(Quoted(rel, number, _fill(span), complete))
    return out


def parse(q: Quoted) -> str:
    """'' when the command parses with the CLI's own parser, else the parser's complaint."""
    import click

    from autotune.cli import main

    w = q.words
    if w[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        return "" if w[1] in targets else f"no such make target: {w[1]}"
    if w[0] != "autotune":
        script = ROOT / w[1]
        return "" if script.is_file() else f"no such script: {w[1]}"
    try:
        with main.make_context("autotune", w[1:2]) as ctx:
            command = main.get_command(ctx, w[1])
            if command is None:
                return f"no such command: {w[1]}"
            if q.complete:
                command.make_context(w[1], w[2:], parent=ctx)
            else:  # a fragment: its options must exist and their values convert
                sub = click.Context(command, info_name=w[1], parent=ctx)
                values, _, _ = command.make_parser(sub).parse_args(w[2:])
                for param in command.get_params(sub):
                    if param.name in values:
                        param.type_cast_value(sub, values[param.name])
    except click.BadOptionUsage as exc:
        if not q.complete and "requires an argument" in exc.format_message():
            return ""  # a fragment naming an option, e.g. `autotune export --format`
        return exc.format_message()
    except click.ClickException as exc:
        return exc.format_message()
    return ""


def run(q: Quoted, timeout: float) -> tuple[int, str]:
    """Run the command in a fresh folder linked to the repository's files; (exit code, output)."""
    with tempfile.TemporaryDirectory(prefix="docs-command-") as tmp:
        for item in ROOT.iterdir():
            if item.name in {".git", "autotune_runs", "autotune_report"} or item.suffix == ".db":
                continue
            os.symlink(item, Path(tmp) / item.name)
        w = q.words
        if w[0] == "autotune":
            argv = [sys.executable, "-m", "autotune.cli", *w[1:]]
        elif w[0] == "python":
            argv = [sys.executable, *w[1:]]
        else:
            argv = w
        env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
        proc = subprocess.run(
            argv,
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
        return proc.returncode, proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow", action="store_true", help="also run the slow commands")
    parser.add_argument("--list", action="store_true", help="list the commands and their kind")
    parser.add_argument("--timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    failed = 0
    commands = quoted()
    ran: set[str] = set()  # a command quoted twice runs once
    for q in commands:
        kind = q.kind()
        where = f"{q.path}:{q.line}"
        if args.list:
            print(f"{kind:5}  {where}  {q.text}")
            continue
        why = parse(q)
        if why:
            failed += 1
            print(f"FAIL parse  {where}  {q.text}\n    {why}")
            continue
        if (kind == "fast" or (kind == "slow" and args.slow)) and q.text not in ran:
            ran.add(q.text)
            code, output = run(q, args.timeout)
            if code != 0:
                failed += 1
                tail = "\n    ".join(output.splitlines()[-5:])
                print(f"FAIL run    {where}  {q.text}\n    exit {code}\n    {tail}")
                continue
            print(f"ok   ran    {where}  {q.text}")
        else:
            print(f"ok   parsed {where}  {q.text}")
    print(f"{len(commands)} commands, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
