"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict``, its Python blocks run, its
result tables come from the pipeline's reference set, and no user-facing text tells the project's history.

- Python blocks: every ```python block of docs/**/*.md runs in a fresh interpreter (tests/doc_blocks.py), except
  one whose opening fence has ``<!-- no-run -->`` on the line above it — allowed only for a block that needs a GPU
  or a download, which this file checks.
- Result tables are included, never pasted: a page shows the pipeline's tables with
  ``--8<-- "tables/NAME.md"`` (pymdownx.snippets, base path ``results/reference``). A Markdown table in docs/ or the
  README with a cell that is a number fails here unless the line above it is ``<!-- not-results: why -->`` (the
  papers' values, published constants).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from doc_blocks import ROOT, blocks, run_block

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
USER_FACING = [ROOT / "README.md", *PAGES]
BLOCKS = [b for page in PAGES for b in blocks(page)]
INCLUDE = re.compile(r'^--8<--\s+"([^"]+)"\s*$', flags=re.M)
NOT_RESULTS = re.compile(r"^<!-- not-results: \S.*-->$")
UNITS = re.compile(r"\b(MiB|GiB|KiB|MB|GB|ms|s|pt|img/s|tokens/s)\b")
NUMBER_ONLY = re.compile(r"[\d\s.,:;%×+\-−–→…/()\[\]~≈*]+")


def _numeric(cell: str) -> bool:
    """A cell that is a figure: digits with units and punctuation only (``3827``, ``−27 %``, ``1.33×``)."""
    c = UNITS.sub("", cell.replace("`", "").replace("*", ""))
    return bool(re.search(r"\d", c)) and NUMBER_ONLY.fullmatch(c) is not None


def _tables(text: str):
    """(line number, the line above the table, body rows as lists of cells) for every Markdown table."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$",
                                                                                   lines[i + 1]):
            start, j = i, i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            rows = [[c.strip() for c in row.strip().strip("|").split("|")] for row in lines[start + 2:j]]
            yield start + 1, (lines[start - 1].strip() if start else ""), rows
            i = j
        else:
            i += 1


def test_the_helpers_see_what_they_should():
    assert _numeric("3827") and _numeric("−27 %") and _numeric("1.33×") and _numeric("5334 → 3716")
    assert not _numeric("✓ 5 norms; 2 acts") and not _numeric("`k` (16), `seed`") and not _numeric("ReGELU2")
    table = "text\n<!-- not-results: constants -->\n| a | b |\n|---|---|\n| x | 3.5 |\n\n| c |\n|---|\n| 7 MiB |\n"
    found = list(_tables(table))
    assert [(above, rows) for _, above, rows in found] == [("<!-- not-results: constants -->", [["x", "3.5"]]),
                                                           ("", [["7 MiB"]])]
    md = "<!-- no-run -->\n```python\nimport torch\n```\n\n```python\nx = 1\n```\n"
    page = DOCS / "_probe.md"
    try:
        page.write_text(md)
        assert [(b.line, b.run) for b in blocks(page)] == [(2, False), (6, True)]
    finally:
        page.unlink()


def test_no_result_table_is_pasted():
    pasted = []
    for page in USER_FACING:
        for line, above, rows in _tables(page.read_text()):
            if any(_numeric(c) for row in rows for c in row) and not NOT_RESULTS.match(above):
                pasted.append(f"{page.relative_to(ROOT)}:{line}")
    assert not pasted, ("tables of figures pasted by hand (include the pipeline's own from results/reference/ with "
                        f'--8<-- "tables/NAME.md", or mark the papers\' values <!-- not-results: why -->): {pasted}')


def test_included_tables_are_the_reference_set():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    snippets = next(e["pymdownx.snippets"] for e in config["markdown_extensions"]
                    if isinstance(e, dict) and "pymdownx.snippets" in e)
    assert snippets["base_path"] == ["results/reference"]
    included = [(page, m.group(1)) for page in PAGES for m in INCLUDE.finditer(page.read_text())]
    assert len(included) >= 4, "the reproductions page includes the reference tables"
    for page, target in included:
        path = target.split(":", 1)[0]
        assert path.startswith(("tables/", "evidence/", "benchmarks/")) and path.endswith(".md"), (page, target)
        assert (ROOT / "results" / "reference" / path).is_file(), (page, target)


HISTORY = re.compile(r"issue #?\d+|this session|the old code|earlier (?:session|machine)s?\b|(?-i:DESIGN)(?:\.md| §)",
                     flags=re.I)


def test_no_user_facing_text_tells_the_history():
    """The docs, the library, and what a user reads beside them: configs, the experiments, the pipeline, the
    benchmarks, the notebooks and the CI scripts (their comments and help texts included)."""
    beside = [f for folder in ("config", "experiments", "workflow", "benchmarks", "notebooks", ".ci")
              for f in sorted((ROOT / folder).rglob("*"))
              if f.is_file() and f.suffix in {".py", ".smk", ".yaml", ".json", ".sh", ".ipynb", ".md", ".rst", ""}]
    files = USER_FACING + sorted((ROOT / "lowmembp").rglob("*.py")) + beside + [ROOT / "Snakefile"]
    found = [f"{f.relative_to(ROOT)}: {m.group(0)!r}" for f in files for m in HISTORY.finditer(f.read_text())]
    assert not found, f"development history belongs in CHANGELOG.md: {found}"


def test_design_pointers_resolve():
    design = (DOCS / "design.md").read_text()
    anchors = set(re.findall(r"\{#([a-z0-9-]+)\}", design))
    assert {"approx-act", "ms-norms", "mesa", "tokentune", "papers", "record", "fake-tensors"} <= anchors
    pointers = []
    for folder in ("lowmembp", "experiments", "workflow", "benchmarks", "tests"):
        for f in (ROOT / folder).rglob("*"):
            if f.is_file() and f.suffix in {".py", ".yaml", ".json", ".sh"}:
                pointers += [(f, a) for a in re.findall(r"docs/design\.md#([a-z0-9-]+)", f.read_text())]
    assert pointers, "the code's docstrings point into docs/design.md"
    missing = sorted({f"{f.relative_to(ROOT)}#{a}" for f, a in pointers if a not in anchors})
    assert not missing, missing


def test_no_run_blocks_need_a_gpu_or_a_download():
    skipped = [b for b in BLOCKS if not b.run]
    wrong = [b.name for b in skipped if not re.search(r"cuda|from_pretrained\(|pretrained=True|download", b.code)]
    assert not wrong, f"<!-- no-run --> is for blocks that need a GPU or a download: {wrong}"
    assert len(skipped) <= len(BLOCKS) // 4, "most blocks must run"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.run], ids=lambda b: b.name)
def test_docs_block_runs(block, tmp_path):
    run_block(block, tmp_path)


def _included(target: str) -> str:
    """The text a ``--8<--`` include brings: the whole file, its lines ``:start:end``, or its section ``:name``."""
    path, _, sel = target.partition(":")
    text = (ROOT / "results" / "reference" / path).read_text()
    if re.fullmatch(r"[a-z][-_0-9a-z]*", sel):
        start, end = f"<!-- --8<-- [start:{sel}] -->", f"<!-- --8<-- [end:{sel}] -->"
        assert start in text and end in text, f"{target}: no section {sel!r}"
        return text.split(start, 1)[1].split(end, 1)[0]
    if sel:
        first, _, last = sel.partition(":")
        lines = text.splitlines()
        return "\n".join(lines[int(first) - 1:int(last) if last else None])
    return text


def test_a_section_include_brings_only_its_part():
    text = _included("tables/peers.md:velora")
    assert "velora" in text and "cce (vs baseline)" not in text
    assert _included("tables/peers.md:3:3").startswith("Machine: ")


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    # the included reference tables are in the built pages, row for row
    for page in PAGES:
        html_page = site / page.relative_to(DOCS).with_suffix("") / "index.html"
        if page.name == "index.md":
            html_page = site / page.relative_to(DOCS).parent / "index.html"
        html = html_page.read_text() if html_page.is_file() else ""
        for m in INCLUDE.finditer(page.read_text()):
            for _, _, rows in _tables(_included(m.group(1))):
                for row in rows:
                    assert f"<td>{row[0]}</td>" in html or f">{row[0]}<" in html, (page.name, row[0])


TEST_PATH = re.compile(r"tests/[A-Za-z0-9_/]*?test_[A-Za-z0-9_]+\.py")


def test_the_test_files_named_exist():
    """A reader told to run ``pytest tests/.../test_x.py`` finds that file: every test path the docs, the README, the
    library, the experiments, the pipeline and the configs name exists."""
    files = USER_FACING + [f for folder in ("lowmembp", "experiments", "workflow", "benchmarks", "config", ".ci")
                           for f in sorted((ROOT / folder).rglob("*")) if f.is_file() and f.suffix in {".py", ".yaml",
                                                                                                      ".smk", ".md"}]
    missing = sorted({f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files for m in TEST_PATH.finditer(f.read_text())
                      if not (ROOT / m.group(0)).is_file()})
    assert not missing, f"test files named but not there (tests mirror the package: tests/<room>/): {missing}"


def test_the_citation_the_license_and_the_release_agree():
    """CITATION.cff, the BibTeX of docs/citing.md, LICENSE and pyproject.toml say the same: the version, the first
    release's date and year, MIT, and the two papers' arXiv numbers."""
    import tomllib

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d\d-\d\d)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases, "CHANGELOG.md names its releases as '## [x.y.z] - YYYY-MM-DD'"
    first_date = releases[-1][1]  # the oldest release is the last
    assert cff["cff-version"] == "1.2.0" and cff["license"] == project["license"] == "MIT"
    assert cff["version"] == project["version"] and str(cff["date-released"]) == dict(releases)[project["version"]]
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and f"Copyright (c) {first_date[:4]} the lowmembp authors" in \
        license_text
    bib = (DOCS / "citing.md").read_text()
    arxiv = sorted(i["value"].split(":", 1)[1] for r in cff["references"] for i in r["identifiers"])
    assert arxiv == ["2406.16282", "2501.18824"]
    assert sorted(re.findall(r"eprint\s*=\s*\{([\d.]+)\}", bib)) == arxiv
    assert re.search(rf"version\s*=\s*\{{{re.escape(project['version'])}\}}", bib)
