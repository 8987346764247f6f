"""The docs stay true to the code: the README's settings table is settings.py's, every
relative link and ``docs/ops.md §x.y`` citation resolves, and .ci/run finds the README's
install and test commands."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import gen_settings_table  # noqa: E402

DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
CITATION = re.compile(r"docs/ops\.md\s+§\s*(\d+(?:\.\d+)*)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set:
    out, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = HEADING.match(line)
        if m and not fenced:
            out.add(_slug(m.group(1)))
    return out


def _ops_sections() -> set:
    """The section numbers of docs/ops.md's headings ("2.3.1", "1.5", "4")."""
    out = set()
    for line in (ROOT / "docs" / "ops.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^#{2,6}\s+(\d+(?:\.\d+)*)\.?\s", line)
        if m:
            out.add(m.group(1))
    return out


def test_readme_settings_table_is_generated_from_settings_py():
    _, have, _ = gen_settings_table.split((ROOT / "README.md").read_text(encoding="utf-8"))
    assert have == gen_settings_table.table(), "run: python docs/gen_settings_table.py --write"


def test_settings_table_has_one_row_per_setting():
    from lycoris_ops import settings

    rows = [line for line in gen_settings_table.table().splitlines()[2:]]
    assert [r.split("`")[1] for r in rows] == list(settings.SETTINGS)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: link to {target} (no such file)"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name}: link to {target} (no such heading)"


def test_ops_md_citations_name_existing_sections():
    sections = _ops_sections()
    assert {"0", "1.3", "1.5", "2.1.5", "2.8", "3.11", "4.4", "8"} <= sections
    bad = []
    for folder in ("lycoris_ops", "csrc", "tests", "bench", "docs", "examples"):
        for f in (ROOT / folder).rglob("*"):
            if f.suffix not in (".py", ".md", ".h", ".cpp", ".sh") or f.name == "RESULTS.md":
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                bad += [f"{f.relative_to(ROOT)}:{n}: §{s}" for s in CITATION.findall(line) if s not in sections]
    assert not bad, "citations of missing docs/ops.md sections:\n" + "\n".join(bad)


def test_ci_finds_one_install_and_one_test_command():
    # the awk of .ci/run's block(): the lines of the fenced block after the marker
    awk = r"""$0==m{f=1;next} f&&/^```/{if(c++)exit;next} f&&c==1{print}"""
    for marker, needle in (("install", "pip install"), ("test", "pytest")):
        out = subprocess.run(["awk", "-v", f"m=<!-- {marker} -->", awk, str(ROOT / "README.md")],
                             capture_output=True, text=True, check=True).stdout
        lines = [line for line in out.splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], f"README's <!-- {marker} --> block: {out!r}"
