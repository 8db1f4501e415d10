"""The repository says what each file is (issue 41, item 2): scripts/ holds what users and CI run, measurement
tools and their outputs live under benchmarks/, docs/ is prose and the pictures it shows, nothing generated
sits at the root, and README's layout names every top-level folder. Read from `git ls-files`, so untracked
local output does not fail it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS_MAX = 6
ROOT_FILES = {"README.md", "pyproject.toml", ".gitignore", "configs", "conftest.py"}
IMAGES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp"}
DATA = {".json", ".jsonl", ".csv", ".yaml", ".yml", ".log", ".txt"}
RESULT_NAME = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9.-]*")


def tracked() -> list[PurePosixPath]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [PurePosixPath(p) for p in out.decode().split("\0") if p]


def test_scripts_holds_only_what_users_and_ci_run():
    entries = sorted({p.parts[1] for p in tracked() if p.parts[0] == "scripts" and len(p.parts) > 1})
    assert len(entries) <= SCRIPTS_MAX, (
        f"scripts/ has {len(entries)} entries ({', '.join(entries)}), at most {SCRIPTS_MAX}: measurement tools "
        "go to benchmarks/ (router, scenarios, gpu)")


def test_docs_is_prose_and_pictures():
    wrong = []
    for p in tracked():
        if p.parts[0] != "docs":
            continue
        if len(p.parts) == 2 and p.suffix not in {".md"} | IMAGES:
            wrong.append(str(p))
        elif len(p.parts) > 2 and p.suffix.lower() in DATA:
            wrong.append(str(p))
    assert not wrong, f"data in docs/ (results go to benchmarks/results/<date>-<name>/): {wrong}"


def test_nothing_generated_at_the_root():
    files = {p.parts[0] for p in tracked() if len(p.parts) == 1}
    assert files <= ROOT_FILES, f"files at the repository root beyond {sorted(ROOT_FILES)}: {sorted(files - ROOT_FILES)}"


def test_results_are_dated_folders():
    names = {p.parts[2] for p in tracked() if p.parts[:2] == ("benchmarks", "results") and len(p.parts) > 3}
    loose = [str(p) for p in tracked() if p.parts[:2] == ("benchmarks", "results") and len(p.parts) == 3]
    assert not loose, f"a result is a folder benchmarks/results/<date>-<name>/, not a file: {loose}"
    assert all(RESULT_NAME.fullmatch(n) for n in names), sorted(n for n in names if not RESULT_NAME.fullmatch(n))


def test_readme_layout_names_every_top_level_folder():
    folders = {p.parts[0] for p in tracked() if len(p.parts) > 1}
    layout = (ROOT / "README.md").read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    missing = sorted(f for f in folders | {"configs"} if not re.search(rf"^{re.escape(f)}/?\s", layout, re.M))
    assert not missing, f"README's Layout section does not list: {missing}"


ROUTER_CLASS_MAX = 200      # issue 41: a turn's bookkeeping no longer piles up in one router class
FILE_MAX = 500


def _classes(path: Path):
    import ast
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_router_class_over_200_lines():
    big = [(str(f.relative_to(ROOT)), name, n) for f in (ROOT / "pdserve" / "router").rglob("*.py")
           for name, n in _classes(f) if n > ROUTER_CLASS_MAX]
    assert not big, big


def test_no_product_or_test_file_over_500_lines():
    big = [(str(f.relative_to(ROOT)), n) for top in ("pdserve", "tests", "benchmarks", "scripts")
           for f in (ROOT / top).rglob("*.py") if (n := len(f.read_text().splitlines())) > FILE_MAX]
    assert not big, big


def test_the_python_floor_is_the_routers():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"      # the router uses asyncio.Runner (3.11)
