"""Every error code the project uses has its row in docs/errors.md, and every row
there is a code the project uses."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.helpers import REPO

CODE = re.compile(r"E-[A-Z]+-[0-9]{3}")
ROW = re.compile(r"^\| `(E-[A-Z]+-[0-9]{3})` \|", re.MULTILINE)
SOURCE_FOLDERS = ("core", "plugins", "storage_backends", "cli")
ERRORS_MD = REPO / "docs" / "errors.md"


def codes_in(paths: list[Path], root: Path = REPO) -> dict[str, list[str]]:
    """Each code found in the files, with the files (relative to ``root``) it is in."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for code in sorted(set(CODE.findall(path.read_text(errors="replace")))):
            found.setdefault(code, []).append(str(path.relative_to(root)))
    return found


def source_files() -> list[Path]:
    files = [
        p
        for folder in SOURCE_FOLDERS
        for p in sorted((REPO / folder).rglob("*"))
        if p.is_file() and p.suffix in (".py", ".sx", ".md", ".txt", ".toml", ".json")
    ]
    docs = [p for p in sorted((REPO / "docs").glob("*.md")) if p != ERRORS_MD]
    return files + docs


def documented() -> set[str]:
    return set(ROW.findall(ERRORS_MD.read_text()))


def undocumented(used: dict[str, list[str]]) -> dict[str, list[str]]:
    """The codes in ``used`` without a row in docs/errors.md, with where they are."""
    rows = documented()
    return {code: where for code, where in used.items() if code not in rows}


def test_every_code_in_the_source_and_docs_has_a_row_in_errors_md():
    used = codes_in(source_files())
    # The scan itself works: codes from each kind of place are found.
    for sure in ("E-CKPT-002", "E-DATA-001", "E-STORAGE-004", "E-CHOICE-001", "E-DP-002"):
        assert sure in used, sure
    missing = undocumented(used)
    assert not missing, f"codes used but not in docs/errors.md: {missing}"


def test_every_row_in_errors_md_is_a_code_the_project_uses():
    used = codes_in(source_files())
    stale = sorted(documented() - set(used))
    assert not stale, f"docs/errors.md lists codes nothing uses: {stale}"


def test_each_code_has_exactly_one_row():
    rows = ROW.findall(ERRORS_MD.read_text())
    assert len(rows) == len(set(rows)), sorted(c for c in rows if rows.count(c) > 1)
    assert len(rows) >= 20


def test_the_scan_would_see_a_new_code(tmp_path):
    # A code only in a new file is reported missing: the check cannot pass vacuously.
    new = tmp_path / "backend.py"
    new.write_text('raise StorageError("...", code="E-NEWTHING-001")  # E-CKPT-002\n')
    assert undocumented(codes_in([new], tmp_path)) == {"E-NEWTHING-001": ["backend.py"]}
