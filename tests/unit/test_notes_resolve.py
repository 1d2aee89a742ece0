"""Every ``[Note: ...]`` a comment, docstring or document points to exists: a note renamed or
removed leaves its references pointing at nothing, and a reader who follows one finds no
explanation. A note is written where its text begins, at the start of a line (after the
comment or docstring marker); a reference is the same tag anywhere else."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TAG = re.compile(r"\[Note: ([^\]]+)\]")
SOURCES = ("infinity", "native", "tools", "tests", "docs")


def _files() -> list[Path]:
    found = [p for d in SOURCES for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".c", ".h", ".md")]
    this = Path(__file__).resolve()     # its own examples are not notes
    return [p for p in found if p.resolve() != this] + sorted(ROOT.glob("*.md"))


def notes_and_references(files: list[Path]) -> tuple[set[str], list[tuple[str, str]]]:
    """(names written at a line's start, (name, file:line) of every other mention)."""
    written: set[str] = set()
    mentioned: list[tuple[str, str]] = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            start = line.strip().lstrip("#/*\"' ").strip()
            for match in TAG.finditer(line):
                name = " ".join(match.group(1).split())
                if start.startswith(match.group(0)):
                    written.add(name)
                else:
                    mentioned.append((name, f"{path}:{number}"))
    return written, mentioned


def test_every_note_referred_to_exists() -> None:
    written, mentioned = notes_and_references(_files())
    assert len(written) > 40 and len(mentioned) > 100, "the scan found no notes: paths moved?"
    missing = sorted(f"[Note: {name}] at {where}" for name, where in mentioned
                     if name not in written)
    assert not missing, "references to notes that no file writes:\n" + "\n".join(missing)


def test_a_reference_to_a_missing_note_is_found(tmp_path) -> None:
    source = tmp_path / "m.py"
    source.write_text("# [Note: real]\n# text\nx = 1   # see [Note: real] and [Note: gone]\n")
    written, mentioned = notes_and_references([source])
    assert written == {"real"}
    assert [name for name, _ in mentioned] == ["real", "gone"]
