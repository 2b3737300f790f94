"""Every hookspec is documented in docs/plugins.md and exercised by a test; a hook
added without both fails here."""

from __future__ import annotations

import re
from pathlib import Path

from sexpgpu import hookspecs

from .pluginkit import REPO

DOCS = REPO / "docs" / "plugins.md"


def hook_names() -> set[str]:
    """The hooks as pluggy sees them (the HookspecMarker's attribute)."""
    marker = f"{hookspecs.PROJECT}_spec"
    return {name for name, obj in vars(hookspecs).items() if hasattr(obj, marker)}


def test_hooks_are_found_and_prefixed() -> None:
    names = hook_names()
    assert {"sexpgpu_storage_backends", "sexpgpu_cli_commands", "sexpgpu_unavailable"} <= names
    # the prefix convention holds both ways: every spec is prefixed, every prefixed
    # function is a spec (a helper named sexpgpu_* would confuse plugin authors)
    prefixed = {
        n for n, obj in vars(hookspecs).items() if n.startswith("sexpgpu_") and callable(obj)
    }
    assert names == prefixed


def test_every_hook_has_a_docstring() -> None:
    for name in hook_names():
        doc = getattr(hookspecs, name).__doc__ or ""
        assert "Returns" in doc and "Called" in doc, (
            f"{name}: say what it returns and when it is called"
        )


def test_every_hook_has_a_section_in_docs_plugins() -> None:
    headings = set(re.findall(r"^## (sexpgpu_\w+)\s*$", DOCS.read_text(), flags=re.M))
    assert hook_names() - headings == set(), "hooks without a `## <hook>` section"
    assert headings - hook_names() == set(), "sections for hooks that do not exist"


def test_every_hook_is_mentioned_by_a_test() -> None:
    me = Path(__file__).resolve()
    text = "\n".join(
        p.read_text() for p in sorted((REPO / "tests").rglob("test_*.py")) if p.resolve() != me
    )
    untested = {name for name in hook_names() if not re.search(rf"\b{name}\b", text)}
    assert untested == set(), "hooks no test exercises"
