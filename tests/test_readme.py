"""The README and the documentation site run top to bottom: their ``bash`` and ``python`` blocks, in order, with
``SCRUBNET_TINY=1`` (every command's default sizes shrink; the numbers mean nothing). The README runs in one
temporary directory; the site's pages run in the order of ``mkdocs.yml``'s navigation, all in a second one (a
page may use what an earlier page's blocks wrote, as a reader following the site would).

Conventions (docs/decisions/conventions.md, "README test"):

* a block whose last non-blank line before the opening fence is ``<!-- readme-test: skip -->`` is not run
  (it needs the user's data, or it is the test suite itself);
* the set-up prefix ``python3 -m venv .venv && . .venv/bin/activate && pip install … &&`` is dropped: the test
  runs in the environment that is already installed;
* other fences (``text``, ``toml``, none) are documentation, not run.

Every other block runs as written: it must not collide with an earlier block's outputs and must use only
files that an earlier block (or itself) creates.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
SKIP = "<!-- readme-test: skip -->"
RUN_LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
INSTALL_PREFIX = re.compile(r"python3 -m venv \.venv && \. \.venv/bin/activate && pip install [^&]*&& ")


def readme_blocks(text: str) -> list[dict]:
    """Every fenced block: ``{"lang", "code", "line" (1-based line of the fence), "skip"}``."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2).lower(), i
        prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        j = i + 1
        while j < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[j]):
            j += 1
        code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j]) + "\n"
        blocks.append({"lang": lang, "code": code, "line": start + 1, "skip": prev == SKIP})
        i = j + 1
    return blocks


def runnable(blocks: list[dict]) -> list[dict]:
    """The blocks the test runs, with the set-up prefix dropped."""
    out = []
    for b in blocks:
        if b["skip"] or b["lang"] not in RUN_LANGS:
            continue
        out.append({**b, "kind": RUN_LANGS[b["lang"]], "code": INSTALL_PREFIX.sub("", b["code"])})
    return out


def test_block_parser_and_conventions():
    text = ("intro\n```bash\necho a\n```\n\n<!-- readme-test: skip -->\n\n```bash\nexit 1\n```\n"
            "```python\nprint(1)\n```\n```\nplain\n```\n```toml\nx = 1\n```\n"
            "```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install -e . && scrubnet run\n```\n")
    blocks = readme_blocks(text)
    assert [(b["lang"], b["skip"], b["line"]) for b in blocks] == [
        ("bash", False, 2), ("bash", True, 8), ("python", False, 11), ("", False, 14), ("toml", False, 17),
        ("bash", False, 20)]
    run = runnable(blocks)
    assert [b["code"] for b in run] == ["echo a\n", "print(1)\n", "scrubnet run\n"]


def site_pages() -> list[Path]:
    """The pages of ``mkdocs.yml``'s navigation, in order (``.md`` paths under ``docs/``)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return [ROOT / "docs" / m for m in re.findall(r"(?m)^\s+-\s+(?:[^:\n]+:\s+)?(\S+\.md)\s*$", nav)]


def test_site_pages_are_found():
    pages = site_pages()
    assert ROOT / "docs" / "getting-started.md" in pages and all(p.is_file() for p in pages)


def run_blocks(blocks: list[dict], where: Path, name: str) -> None:
    env = {**os.environ, "SCRUBNET_TINY": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MPLBACKEND": "Agg", "PYTHONWARNINGS": "ignore",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # the commands run at a clone's root: the example files they name come along
    shutil.copytree(ROOT / "examples", where / "examples", dirs_exist_ok=True)
    for b in blocks:
        if b["kind"] == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", b["code"]]
        else:
            cmd = [sys.executable, "-c", b["code"]]
        r = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
        if r.returncode != 0:
            pytest.fail(f"{name} block at line {b['line']} ({b['kind']}) failed with exit code {r.returncode}:\n"
                        f"{b['code']}\n--- stderr ---\n{r.stderr[-3000:]}\n--- stdout ---\n{r.stdout[-1500:]}")


def test_readme_runs_top_to_bottom(tmp_path):
    blocks = runnable(readme_blocks((ROOT / "README.md").read_text()))
    assert len(blocks) >= 3
    run_blocks(blocks, tmp_path, "README")


def test_site_runs_top_to_bottom(tmp_path):
    for page in site_pages():
        run_blocks(runnable(readme_blocks(page.read_text())), tmp_path, str(page.relative_to(ROOT)))
