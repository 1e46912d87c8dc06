"""The project's files point only inside the repository: every relative markdown link of its
markdown files names a file that exists (and a heading that exists, for `file.md#anchor`);
every `*.md` file named anywhere in its text is one of the repository's; no text names a path
outside the repository (a sibling folder such as `../shared`, or an absolute path of some
machine's checkout)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCANNED = ["README.md", "Makefile", "pyproject.toml", ".ci", "docs", "bench", "src", "deploy",
           "examples", "scripts", "tests"]  # fmt: skip
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".proto", ".json",
                 ".cfg", ".ini", ".j2", ".jinja", ".pyi", ".typed", ".jsonl"}  # fmt: skip
SKIPPED_PARTS = {"__pycache__", ".venv", ".venv-vllm", "wheels"}
# Fragments that name a place outside the repository, split so that this file does not match.
OUTSIDE = ["../" + "shared", "/" + "work/", "/" + "home/", "/" + "Users/"]
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MD_NAME = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_]\.md\b")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def text_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = REPO / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in candidates:
            rel = f.relative_to(REPO)
            if not f.is_file() or f == Path(__file__).resolve():
                continue
            if SKIPPED_PARTS & set(rel.parts) or any(p.endswith(".egg-info") for p in rel.parts):
                continue
            if f.suffix in TEXT_SUFFIXES or (not f.suffix and b"\0" not in f.read_bytes()):
                files.append(f)  # text by its suffix, or a script / Makefile without one
    return files


def markdown_files() -> list[Path]:
    return [f for f in text_files() if f.suffix == ".md"]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces → '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor of a markdown file (repeats get -1, -2, … as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in read(path).splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def inside(path: Path) -> bool:
    return path == REPO or REPO in path.parents


def test_the_scan_sees_the_project():
    names = {f.relative_to(REPO).as_posix() for f in text_files()}
    assert {"README.md", "Makefile", "docs/algorithms.md", "bench/gpu_check.sh"} <= names
    assert "src/keel/algo/__init__.py" in names


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve_inside_the_repository(md):
    bad = []
    for n, line in enumerate(read(md).splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:, …
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md.resolve()
            if not inside(dest):
                bad.append(f"line {n}: {target} points outside the repository")
            elif not dest.exists():
                bad.append(f"line {n}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"line {n}: {target}: no heading with the anchor #{anchor}")
    assert not bad, f"{md.relative_to(REPO)}:\n" + "\n".join(bad)


def test_every_markdown_file_named_is_in_the_repository():
    ours = {f.resolve() for f in REPO.rglob("*.md") if ".venv" not in f.parts}
    basenames = {f.name for f in ours}
    bad = []
    for f in text_files():
        for n, line in enumerate(read(f).splitlines(), 1):
            for name in MD_NAME.findall(line):
                if name.startswith("./"):
                    name = name[2:]
                candidates = [(REPO / name).resolve(), (f.parent / name).resolve()]
                if any(c in ours for c in candidates) or ("/" not in name and name in basenames):
                    continue
                bad.append(f"{f.relative_to(REPO)}:{n}: {name}")
    assert not bad, "markdown files named but not in the repository:\n" + "\n".join(bad)


def test_no_text_names_a_path_outside_the_repository():
    bad = []
    for f in text_files():
        for n, line in enumerate(read(f).splitlines(), 1):
            for fragment in OUTSIDE:
                if fragment in line:
                    bad.append(f"{f.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)
