"""The repository explains itself (docs/testing.md "Running the tests").

* No file of the package, the tests, CI, the docs or the notes cites a document that does not
  travel with a clone: the team's design and research notes (``DESIGN``, ``spec/...``, section
  numbers with a section sign, ``anchors C10``) or paths on the team's machines (``/work/...``,
  ``shared/spec``, ``shared/tools``). Such facts belong in docs/ or are cited to their upstream.
* Every ``docs/NAME.md`` that a file names exists, and so does every section it names:
  ``docs/NAME.md "Heading"`` (several quoted headings may follow, joined by commas, "and" or
  "to"; a heading may carry a parenthetical the reference leaves out) or ``docs/NAME.md#anchor``.
* Every relative Markdown link in README.md, docs/ and notes/ resolves to a file of the
  repository, and its ``#anchor`` to a heading of the target.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["dsv4_attn", "tests", "ci", ".ci", "docs", "notes", "README.md", "pyproject.toml"]
THIS_FILE = Path(__file__).resolve()

OUTSIDE = [
    (re.compile("\u00a7"), "a section sign (cite a heading of docs/ instead)"),
    (re.compile(r"\bDESIGN\b"), "the team's design note"),
    (re.compile(r"\bspec/"), "the team's spec/ notes"),
    (re.compile(r"dsv4-semantics|anchor-measurements|dsv41-notes|\banchors\.md"), "a team research note"),
    (re.compile(r"\banchors [A-Z]\d"), "a team research note's anchor"),
    (re.compile(r"/work/|\bshared/(?:spec|tools)\b"), "a path on the team's machines"),
]
DOC_REF = re.compile(r"docs/([\w.-]+\.md)")
# what may stand between a doc (or the previous heading) and a quoted heading
JOINER = re.compile(r'(?:\s*,\s*\(?|\s+(?:to|and)\s+|\s+\(|\s+)"([^"]+)"')


def text_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in candidates:
            if "__pycache__" in p.parts or p.resolve() == THIS_FILE:
                continue
            try:
                files.append((p, p.read_text(encoding="utf-8")))
            except UnicodeDecodeError:  # binary test data
                continue
    return files


def outside_references(text: str) -> list[str]:
    """'line N: what (the line)' for every citation of a document outside the repository."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in OUTSIDE:
            if pattern.search(line):
                hits.append(f"line {n}: {what}: {line.strip()[:100]}")
    return hits


def joined(text: str) -> str:
    """The text as one line: comment markers and indentation dropped, so a reference wrapped over
    two comment or docstring lines reads as written."""
    return " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())


def doc_references(text: str) -> list[tuple[str, str | None, list[str]]]:
    """(doc name, anchor or None, [quoted headings]) for every docs/NAME.md in ``text``."""
    flat, refs = joined(text), []
    for m in DOC_REF.finditer(flat):
        end, anchor, headings = m.end(), None, []
        if flat[end:end + 1] == "#":
            anchor = re.match(r"#([\w-]+)", flat[end:]).group(1)
        else:
            while (h := JOINER.match(flat, end)) is not None:
                headings.append(h.group(1))
                end = h.end()
        refs.append((m.group(1), anchor, headings))
    return refs


def _plain(heading: str) -> str:
    return " ".join(heading.replace("`", "").split())


def headings(markdown: str) -> list[str]:
    """Markdown headings outside fenced code blocks, backticks removed."""
    found, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            found.append(_plain(m.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(markdown):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def has_heading(markdown: str, name: str) -> bool:
    name = _plain(name)
    return any(h == name or h.startswith(name + " (") for h in headings(markdown))


def test_no_file_cites_a_document_outside_the_repository():
    bad = [f"{p.relative_to(ROOT)} {hit}" for p, text in text_files() for hit in outside_references(text)]
    assert not bad, "\n".join(bad)


def test_every_named_doc_and_section_exists():
    missing, sections = [], 0
    for path, text in text_files():
        for doc, anchor, names in doc_references(text):
            target = ROOT / "docs" / doc
            if not target.is_file():
                missing.append(f"{path.relative_to(ROOT)}: docs/{doc} does not exist")
                continue
            markdown = target.read_text(encoding="utf-8")
            if anchor is not None and anchor not in anchors(markdown):
                missing.append(f"{path.relative_to(ROOT)}: docs/{doc} has no heading #{anchor}")
            for name in names:
                sections += 1
                if not has_heading(markdown, name):
                    missing.append(f'{path.relative_to(ROOT)}: docs/{doc} has no heading "{name}"')
    assert not missing, "\n".join(missing)
    assert sections >= 20, f"only {sections} named sections found: is the reference pattern still matched?"


def test_markdown_links_resolve():
    broken, links = [], 0
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notes").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            links += 1
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not dest.exists() or ROOT not in dest.parents:
                broken.append(f"{where}: no such file in the repository")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)
    assert links >= 10, f"only {links} relative links found"


@pytest.mark.parametrize("text", [
    "see spec/dsv4-semantics.md for the rows",
    "(vendor-apis \u00a71.1)",
    "every DESIGN edge case",
    "FlashMLA anchors C10",
    "Run: python x.py /work/shared/golden.pt",
    "../shared/tools/flashmla-from-vllm .flashmla",
])
def test_outside_references_are_caught(text):
    assert outside_references(text)


def test_named_sections_are_read_across_wrapped_comment_lines():
    text = '# the gather (docs/semantics.md "Cache\n# records", "FP8 dialects" to "LSE") and docs/rocm.md.\n'
    assert doc_references(text) == [("semantics.md", None, ["Cache records", "FP8 dialects", "LSE"]),
                                    ("rocm.md", None, [])]
    assert doc_references('f"(see docs/rocm.md)"') == [("rocm.md", None, [])]
    markdown = "# Top\n## Evidence (AITER main `e40`)\n```bash\n# not a heading\n```\n## `a_b` c\n"
    assert has_heading(markdown, "Evidence") and has_heading(markdown, "a_b c")
    assert not has_heading(markdown, "Evid") and not has_heading(markdown, "not a heading")
    assert anchors(markdown) == {"top", "evidence-aiter-main-e40", "a_b-c"}
