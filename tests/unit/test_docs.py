"""The README and docs/ point only at what exists, and read as documentation, not as a work log.

Checked in README.md and docs/*.md: every relative markdown link (and its #anchor, against the target's
headings); every repository path written in the text, in prose or in code blocks (`benchmarks/bench_serve.py`,
`tests/ray/test_faults.py`; `serve_config.yaml` at the root); every `specray.module` / `specray.module:attr`
reference; every configuration field documented against specray/config.py; and no history (work sessions,
issue numbers, dated measurements).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Pages other branches add; a link to one is checked as soon as the file exists.
PENDING_PAGES = {"docs/metrics.md", "docs/migration.md"}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# A repository path: starts with a top-level folder of the repository, not inside a URL or a longer path.
TOP = ("specray", "tests", "benchmarks", "cluster", "scripts", "docs", r"\.ci")
REPO_PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(TOP) + r")/[\w./-]*[\w/])")
# A file named in backticks without a folder (`serve_config.yaml`): one at the repository's root.
BARE_FILE = re.compile(r"`([\w.-]+\.(?:yaml|yml|toml|md|py|sh|json|txt))`")
MODULE_REF = re.compile(r"(?<![\w./-])(specray(?:\.\w+)+)(?::(\w+))?")
HISTORY = [
    re.compile(r"\b(?:sessions?|issues?|work periods?|PR)\s*#?\d", re.I),
    re.compile(r"(?<![\w&/])#\d+\b"),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),  # dated measurements
    re.compile(r"\.\./shared|shared notes", re.I),
]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)}


def _module_file(dotted: list[str]) -> Path | None:
    base = ROOT.joinpath(*dotted)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _defines(source: Path, name: str) -> bool:
    pat = rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]"
    return re.search(pat, source.read_text(), flags=re.M) is not None


def test_docs_found():
    names = {_rel(p) for p in DOCS}
    assert {"README.md", "docs/configuration.md", "docs/serving.md", "docs/architecture.md"} <= names


def _broken_links(md: Path, text: str) -> list[str]:
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if ROOT not in dest.parents:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            if _rel(dest) not in PENDING_PAGES:
                bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading '#{anchor}' in {_rel(dest)}")
    return bad


def _missing_paths(text: str) -> list[str]:
    named = set(REPO_PATH.findall(text)) | set(BARE_FILE.findall(text))
    return sorted(p for p in named if not (ROOT / p).exists() and p not in PENDING_PAGES)


def _bad_module_refs(text: str) -> list[str]:
    bad = []
    for dotted, attr in MODULE_REF.findall(text):
        parts = dotted.split(".")
        # the longest prefix that is a module; what follows are attributes of it (at most one: a class or function)
        source, n = None, len(parts)
        while n > 1 and (source := _module_file(parts[:n])) is None:
            n -= 1
        names = parts[n:] + ([attr] if attr else [])
        if source is None or len(names) > 1 or (names and not _defines(source, names[0])):
            bad.append(dotted + (f":{attr}" if attr else ""))
    return sorted(set(bad))


def _history(text: str) -> list[str]:
    return [f"line {i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
            if any(p.search(line) for p in HISTORY)]


@pytest.mark.parametrize("md", DOCS, ids=_rel)
def test_relative_links_exist(md: Path):
    bad = _broken_links(md, md.read_text())
    assert not bad, f"{_rel(md)}: broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("md", DOCS, ids=_rel)
def test_repository_paths_exist(md: Path):
    missing = _missing_paths(md.read_text())
    assert not missing, f"{_rel(md)} names paths that are not in the repository: {missing}"


@pytest.mark.parametrize("md", DOCS, ids=_rel)
def test_module_references_exist(md: Path):
    bad = _bad_module_refs(md.read_text())
    assert not bad, f"{_rel(md)} names modules or attributes that do not exist: {bad}"


@pytest.mark.parametrize("md", DOCS, ids=_rel)
def test_no_work_log_history(md: Path):
    hits = _history(md.read_text())
    assert not hits, f"{_rel(md)} reads like a work log (sessions, issue numbers, dates):\n" + "\n".join(hits)


def test_the_checks_catch_what_they_are_for():
    """Each check finds a planted defect and passes the correct form of the same reference."""
    readme = ROOT / "README.md"
    assert _broken_links(readme, "[a](docs/nope.md) [b](docs/serving.md#no-such-heading) [c](../../etc/passwd)") \
        == ["docs/nope.md: no such file", "docs/serving.md#no-such-heading: no heading '#no-such-heading' in "
            "docs/serving.md", "../../etc/passwd: outside the repository"]
    assert _broken_links(readme, "[a](docs/serving.md#failure-behaviour) [b](https://x.org/a.md)") == []
    assert _missing_paths("`benchmarks/bench_nope.py`, tests/ray/test_faults.py, `serve_config.yaml`, `nope.yaml`") \
        == ["benchmarks/bench_nope.py", "nope.yaml"]
    assert _missing_paths("https://example.org/docs/x.md and ~/.cache/specray/x") == []
    assert _bad_module_refs("specray.engine.vllm_nope, specray.serve.app:build_nope, specray.serve.app:build_app") \
        == ["specray.engine.vllm_nope", "specray.serve.app:build_nope"]
    for line in ("measured in session 11", "see issue #12", "run of 2026-11-23", "(see shared notes)"):
        assert _history(line), line
    for line in ("section 4", "`prompt_lookup_max`", "K 8 / 16", "[x](serving.md#autoscaling-by-regime)"):
        assert not _history(line), line


def test_every_config_field_documented():
    from pydantic import BaseModel

    from specray import config

    text = (ROOT / "docs" / "configuration.md").read_text()
    models = [m for m in vars(config).values()
              if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == config.__name__]
    missing = [f"{m.__name__}.{name}" for m in models for name in m.model_fields
               if not any(form in text for form in (f"`{name}`", f"`{name}.", f".{name}`"))]  # `placement.strategy`
    assert models and not missing, f"docs/configuration.md does not document: {missing}"
