"""The documentation cannot rot: every Python block of ``README.md`` and ``docs/`` runs, every ``estimate`` output
shown is what the command prints today, the API reference covers ``lightning_zero.__all__``, and the README links
a newcomer to each topic in one click.

A Python block runs in-process in a fresh namespace, in a temporary working directory (a block that repeats an
earlier one word for word, as the README's quick starts repeat the docs', runs once). An HTML comment on the line
before its fence changes that (invisible on GitHub and on the site):

- ``<!-- docs-test: script -->``: written to ``train.py`` and run as ``python train.py`` in its own process
  group, for blocks that launch processes (Lightning and Fabric relaunch the script for the other ranks);
  ``<!-- docs-test: script, argv: 2 | 1 -->`` runs ``python train.py 2`` and then ``python train.py 1``;
- ``<!-- docs-test: slow-script -->``: the same with ``--runslow`` (the suite's budget); compiled, and its imports
  run, without;
- ``<!-- docs-test: compile-only, <why> -->``: compiled, and its imports run, for blocks that need GPUs, a cluster
  or files a reader brings (the reason is required).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import lightning_zero
from tests.test_example import finish, start

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!-- docs-test: ([\w-]+)(?:, (.+?))? -->\s*\n$")
MODES = ("run", "script", "slow-script", "compile-only")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    code: str
    mode: str
    why: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        marker = MARKER.search(before[-200:])
        mode, why = (marker.group(1), marker.group(2)) if marker else ("run", None)
        line = before.count("\n") + 1
        found.append(Block(path, line, match.group(1), match.group(2), mode, why))
    return found


PYTHON = [b for page in PAGES for b in blocks(page) if b.language == "python"]
FIRST_COPY = {b.code: b.name for b in reversed(PYTHON)}  # the README's quick starts are the docs' own, run once


def test_the_pages_hold_python_blocks_with_known_markers():
    assert len(PYTHON) >= 20, [b.name for b in PYTHON]
    for block in PYTHON:
        assert block.mode in MODES, f"{block.name}: unknown docs-test marker {block.mode!r}; expected one of {MODES}"
        if block.mode == "compile-only":
            assert block.why, f"{block.name}: a compile-only block says why it cannot run here"
    for page in PAGES:
        indented = re.findall(r"^[ \t]+```python", page.read_text(), flags=re.MULTILINE)
        assert not indented, f"{page.relative_to(ROOT)}: an indented Python block would not be tested; unindent it"


def test_the_readme_quick_starts_are_the_docs_own():
    # One script per front door, kept word for word in both places, so the suite runs each once.
    readme = [b for b in PYTHON if b.path.name == "README.md" and b.mode == "script"]
    assert len(readme) == 2, [b.name for b in readme]
    for block, page in zip(readme, ("trainer.md", "fabric.md"), strict=True):
        assert FIRST_COPY[block.code] == block.name
        copies = [b.name for b in PYTHON if b.code == block.code and b.path == DOCS / page]
        assert copies, f"{block.name} differs from the quick start of docs/{page}: keep them the same"


def _run_imports(block: Block, namespace: dict[str, object]) -> None:
    tree = ast.parse(block.code, filename=block.name)
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    exec(compile(ast.Module(body=imports, type_ignores=[]), block.name, "exec"), namespace)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.name)
def test_python_block_runs(block, tmp_path, monkeypatch, request):
    code = compile(block.code, block.name, "exec")  # every block at least compiles
    slow_skipped = block.mode == "slow-script" and not request.config.getoption("--runslow")
    if block.mode == "compile-only" or slow_skipped or FIRST_COPY[block.code] != block.name:
        _run_imports(block, {})
        return
    if block.mode in ("script", "slow-script"):
        script = tmp_path / "train.py"
        script.write_text(block.code)
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        runs = [""] if not (block.why or "").startswith("argv:") else block.why.removeprefix("argv:").split("|")
        for argv in runs:
            command = [sys.executable, str(script), *argv.split()]
            status, output = finish(start(command, tmp_path, env), timeout=200)
            assert status == 0, f"{block.name}: python train.py {argv.strip()} exited with {status}:\n{output}"
        return
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__docs__"})


# -- the output of `estimate` shown in the docs ------------------------------------------------------------------------
ESTIMATES = [
    b
    for page in PAGES
    for b in blocks(page)
    if b.language == "text" and b.code.startswith("$ python -m lightning_zero")
]


@pytest.mark.parametrize("block", ESTIMATES, ids=lambda b: b.name)
def test_estimate_output_shown_is_what_the_command_prints(block, capsys):
    from lightning_zero.__main__ import main as cli

    command, *expected = block.code.rstrip("\n").split("\n")
    assert cli(command.split()[4:]) == 0, command  # after "$ python -m lightning_zero"
    printed = capsys.readouterr().out.rstrip("\n")
    # A line "..." stands for lines left out: each part shown must appear, in order, as consecutive lines.
    parts: list[list[str]] = [[]]
    for line in expected:
        if line == "...":
            parts.append([])
        else:
            parts[-1].append(line)
    position = 0
    for part in filter(None, parts):
        shown = "\n".join(part)
        found = printed.find(shown, position)
        assert found >= 0, f"{block.name}: `{command[2:]}` no longer prints\n{shown}\n--- it prints ---\n{printed}"
        position = found + len(shown)


def test_estimate_outputs_are_checked():
    assert len(ESTIMATES) >= 2, [b.name for b in ESTIMATES]


# -- the API reference -------------------------------------------------------------------------------------------------
def test_api_reference_documents_every_public_name():
    documented = re.findall(r"^::: lightning_zero\.(\w+)\s*$", (DOCS / "api.md").read_text(), flags=re.MULTILINE)
    assert sorted(documented) == sorted(set(documented)), "a name documented twice in docs/api.md"
    missing = set(lightning_zero.__all__) - set(documented)
    extra = set(documented) - set(lightning_zero.__all__)
    assert not missing, f"public names missing from docs/api.md: {sorted(missing)}"
    assert not extra, f"docs/api.md documents names that are not in lightning_zero.__all__: {sorted(extra)}"


def test_the_trainer_page_names_every_config_field():
    import dataclasses

    from lightning_zero import ZeroConfig

    text = (DOCS / "trainer.md").read_text()
    paragraph = text.split("The fields, by what they shape:", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(\w+)`", paragraph))
    fields = {f.name for f in dataclasses.fields(ZeroConfig)}
    assert named == fields, f"docs/trainer.md misses {sorted(fields - named)}, names unknown {sorted(named - fields)}"


@pytest.mark.parametrize("page", ["README.md", "docs/trainer.md"])
def test_the_presets_table_names_every_registered_strategy(page):
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    text = (ROOT / page).read_text()
    table = text.split("| name | what |", 1)[1].split("\n\n", 1)[0]
    named = {name for row in table.splitlines()[2:] for name in re.findall(r'`"(\w+)"`', row.split("|")[1])}
    for registry in (StrategyRegistry, STRATEGY_REGISTRY):
        registered = {name for name in registry if name.startswith("zero")}
        assert named == registered, f"{page}: the presets table names {sorted(named)}, registered {sorted(registered)}"


# -- links -------------------------------------------------------------------------------------------------------------
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _local_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_at_files_that_exist(path):
    for target in _local_links(path):
        file = (path.parent / target.split("#")[0]).resolve()
        assert file.exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"


def _repository_paths(path: Path) -> list[str]:
    """The code spans of ``path`` that name a file or folder of the repository: under a top-level folder
    (``tests/test_docs.py``) or a subpackage of ``lightning_zero`` (``comm/ledger.py``, as the pages name them)."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    roots = {p.name for p in ROOT.iterdir() if p.is_dir()} | {p.name for p in (ROOT / "lightning_zero").iterdir()}
    spans = re.findall(r"`([\w.*/-]+/[\w.*/-]*)`", text)
    return [span for span in spans if span.split("/")[0] in roots - {".git", ".venv"}]


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))], ids=lambda p: p.name)
def test_files_the_pages_name_exist(path):
    for span in _repository_paths(path):
        found = [ROOT / span, ROOT / "lightning_zero" / span, ROOT / "conf" / span]  # conf/'s groups by their name
        assert any(p.exists() or list(p.parent.glob(p.name)) for p in found), (
            f"{path.relative_to(ROOT)} names `{span}`, which is not in the repository: moved or renamed?"
        )


def test_the_pages_name_many_files():
    assert sum(len(_repository_paths(p)) for p in PAGES) > 100  # the check above is not vacuous


# What a newcomer looks for first, and the page (and section) the README must link to for it.
FIRST_QUESTIONS = {
    "train with the Trainer": "docs/trainer.md",
    "train with Fabric": "docs/fabric.md",
    "offload to host memory or disk": "docs/memory-tiers.md",
    "resume at another world size": "docs/checkpoints.md#resume-at-any-world-size-or-stage",
    "fine-tune a Hugging Face model": "docs/fine-tuning.md",
}


@pytest.mark.parametrize(("question", "target"), FIRST_QUESTIONS.items(), ids=list(FIRST_QUESTIONS))
def test_readme_answers_each_first_question_in_one_click(question, target):
    readme = ROOT / "README.md"
    assert target in _local_links(readme), f"README.md has no link to {target} ({question})"
    page, _, anchor = target.partition("#")
    if anchor:
        headings = re.findall(r"^#+ (.+?)\s*$", (ROOT / page).read_text(), flags=re.MULTILINE)
        slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
        assert anchor in slugs, f"{page} has no heading for #{anchor}: {sorted(slugs)}"


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines: put the detail on the page of docs/ it belongs to"
