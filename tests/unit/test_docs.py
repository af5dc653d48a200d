"""The benchmark records and their summary: every record in docs/benchmarks/ carries its header and
command and its links resolve, docs/benchmarks.md links every record, the summary's headline
figures stand in no other page, and no page spells out a recipe's flags instead of naming it."""

import glob
import os
import re

import pytest

from megatron.patchset import recipes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
SUMMARY = os.path.join(DOCS, "benchmarks.md")
RECORD_DIR = os.path.join(DOCS, "benchmarks")
RECORDS = sorted(glob.glob(os.path.join(RECORD_DIR, "*.md")))

RECORD_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-[a-z0-9]+(?:-[a-z0-9]+)*\.md$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FIGURE = re.compile(r"(?<![\d.])(\d+\.\d+) ?(?:x|ms|GiB|MiB)(?![\w])")


def read(path):
    with open(path) as handle:
        return handle.read()


def local_links(path):
    """The files a Markdown page links or shows, as paths (web addresses and anchors left out)."""
    found = []
    for target in LINK.findall(read(path)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        found.append(os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0])))
    return found


def section(text, title):
    """The body of the ``## title`` section of a Markdown page."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section '## {title}'"
    return match.group(1)


def table_rows(text):
    """The body rows of the Markdown tables in ``text`` (no header or separator rows)."""
    rows, in_table = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
        elif not in_table:
            in_table = True  # the header row
        elif not re.fullmatch(r"[|\s:-]+", line):
            rows.append(line)
    return rows


def headline_figures():
    """The decimal figures with a unit (``85.5 ms``, ``3.62x``, ``76.20 GiB``) of the summary's
    headline and production-layout tables, as bare numbers."""
    text = read(SUMMARY)
    body = section(text, "Headline") + section(text, "Production layout (emulated)")
    return sorted({figure for row in table_rows(body) for figure in FIGURE.findall(row)})


def pages():
    """Every documentation page but the summary, the records and the generated recipes page,
    with README.md (CHANGELOG.md is history and keeps its figures)."""
    found = [os.path.join(ROOT, "README.md")]
    for path in sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)):
        if path in (SUMMARY, os.path.join(DOCS, "recipes.md")):
            continue
        if os.path.dirname(path) == RECORD_DIR:
            continue
        found.append(path)
    return found


def launcher_headers():
    """The comment block at the top of each launcher in examples/ (after the shebang)."""
    headers = {}
    scripts = glob.glob(os.path.join(ROOT, "examples", "*.sh"))
    scripts += glob.glob(os.path.join(ROOT, "examples", "slurm", "*.sbatch"))
    for path in sorted(scripts):
        block = []
        for line in read(path).splitlines()[1:]:
            if not line.startswith("#"):
                break
            block.append(line.lstrip("#"))
        headers[path] = "\n".join(block)
    return headers


def flat(text):
    """``text`` as one line of words: no backquotes, line continuations or line breaks."""
    return " ".join(text.replace("`", " ").replace("\\\n", " ").split())


def recipe_runs(length=3):
    """Every run of ``length`` consecutive flags (each with its values) of each recipe's default
    flags, as the text a page that spells them would hold."""
    runs = {}
    for recipe in recipes.all_recipes():
        groups = []
        for word in recipe.flags():
            if word.startswith("--") or not groups:
                groups.append([word])
            else:
                groups[-1].append(word)
        for start in range(len(groups) - length + 1):
            run = " ".join(" ".join(group) for group in groups[start : start + length])
            runs[run] = recipe.name
    return runs


def test_there_are_records():
    assert len(RECORDS) >= 5, RECORDS


@pytest.mark.parametrize("path", RECORDS, ids=os.path.basename)
def test_record_has_its_header_and_command(path):
    name = os.path.basename(path)
    match = RECORD_NAME.match(name)
    assert match, f"{name}: not <YYYY-MM-DD>-<slug>.md"
    lines = read(path).splitlines()
    assert lines[0].startswith("# ") and lines[0][2:].strip(), f"{name}: no '# title' first"
    assert f"- Date: {match.group(1)}" in lines, f"{name}: no '- Date: {match.group(1)}' line"
    for key in ("- Device: ", "- Software: "):
        found = [line for line in lines if line.startswith(key)]
        assert found and found[0][len(key) :].strip(), f"{name}: no '{key.strip()}' line"
    command = next(
        (i for i, line in enumerate(lines) if line.startswith("Command, from the repository root")),
        None,
    )
    assert command is not None, f"{name}: no 'Command, from the repository root' line"
    fence = next(i for i in range(command + 1, len(lines)) if lines[i].startswith("```"))
    assert lines[fence] == "```bash", f"{name}: the command is not a bash block"
    end = next(i for i in range(fence + 1, len(lines)) if lines[i] == "```")
    assert any(line.strip() for line in lines[fence + 1 : end]), f"{name}: empty command"


@pytest.mark.parametrize("path", [SUMMARY, *RECORDS], ids=os.path.basename)
def test_links_and_images_exist(path):
    missing = [target for target in local_links(path) if not os.path.exists(target)]
    assert not missing, f"{os.path.basename(path)} names missing files: {missing}"


def test_summary_links_every_record():
    linked = set(local_links(SUMMARY))
    missing = [os.path.basename(record) for record in RECORDS if record not in linked]
    assert not missing, f"docs/benchmarks.md does not link: {missing}"


def test_headline_figures_stand_only_in_the_summary_and_the_records():
    figures = headline_figures()
    assert len(figures) >= 10, figures
    found = []
    for path in pages():
        text = read(path)
        for figure in figures:
            if re.search(rf"(?<![\d.]){re.escape(figure)}(?!\d)", text):
                found.append(f"{os.path.relpath(path, ROOT)}: {figure}")
    assert not found, "headline figures outside docs/benchmarks.md and its records:\n" + "\n".join(
        found
    )


def test_no_page_spells_out_a_recipe():
    runs = recipe_runs()
    texts = {path: read(path) for path in pages()}
    texts.update(launcher_headers())
    found = [
        f"{os.path.relpath(path, ROOT)}: {name} ({run})"
        for path, text in texts.items()
        for run, name in runs.items()
        if run in flat(text)
    ]
    assert not found, "name the recipe (docs/recipes.md) instead of its flags:\n" + "\n".join(found)
