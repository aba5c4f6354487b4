"""The documentation's code blocks: found, and run once each.

The README and the site's pages (in the order of ``mkdocs.yml``'s navigation) run top to bottom with
``SCRUBNET_TINY=1`` (every command's default sizes shrink; the numbers mean nothing). The README runs in one
temporary directory; the site's pages all in a second one (a page may use what an earlier page's blocks wrote, as
a reader following the site would). The run happens once per test session (:func:`run_docs`, behind the
``docs_run`` fixture of ``tests/conftest.py``): the tests that check a page's outputs read them from that run
instead of running its blocks again. A block identical to one already run in the same directory is not run
twice.

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

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def site_pages() -> list[Path]:
    """The pages of ``mkdocs.yml``'s navigation, in order (``.md`` paths under ``docs/``)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return [ROOT / "docs" / m for m in re.findall(r"(?m)^\s+-\s+(?:[^:\n]+:\s+)?(\S+\.md)\s*$", nav)]


@dataclasses.dataclass
class BlockRun:
    """One block's run: ``page`` (relative to the repository), ``line`` (of the fence), ``code``, ``returncode``
    (None: not run, an earlier block failed), ``stdout``, ``stderr``, ``repeat_of`` (the earlier identical block
    whose run stands for this one)."""
    page: str
    line: int
    kind: str
    code: str
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    repeat_of: str | None = None

    def failure(self) -> str | None:
        """None if the block ran and exited 0; else what went wrong, with the end of its output."""
        if self.returncode == 0:
            return None
        if self.returncode is None:
            return f"{self.page} block at line {self.line} did not run: an earlier block failed"
        return (f"{self.page} block at line {self.line} ({self.kind}) failed with exit code {self.returncode}:\n"
                f"{self.code}\n--- stderr ---\n{self.stderr[-3000:]}\n--- stdout ---\n{self.stdout[-1500:]}")


def run_pages(pages: list[Path], where: Path) -> list[BlockRun]:
    """Run the blocks of ``pages`` in order in ``where``; stop at the first failure (later blocks may need its
    outputs); an exact repeat of an earlier block is not run again."""
    env = {**os.environ, "SCRUBNET_TINY": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MPLBACKEND": "Agg", "PYTHONWARNINGS": "ignore",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # the commands run at a clone's root: the example files they name come along
    shutil.copytree(ROOT / "examples", where / "examples", dirs_exist_ok=True)
    runs, seen, failed = [], {}, False
    for page in pages:
        name = str(page.relative_to(ROOT))
        for b in runnable(readme_blocks(page.read_text())):
            run = BlockRun(name, b["line"], b["kind"], b["code"])
            runs.append(run)
            if failed:
                continue
            key = (b["kind"], b["code"])
            if key in seen:
                first = seen[key]
                run.returncode, run.stdout, run.stderr = first.returncode, first.stdout, first.stderr
                run.repeat_of = f"{first.page}:{first.line}"
                continue
            cmd = ["bash", "-euo", "pipefail", "-c", b["code"]] if b["kind"] == "bash" else [sys.executable, "-c", b["code"]]
            r = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
            run.returncode, run.stdout, run.stderr = r.returncode, r.stdout, r.stderr
            seen[key] = run
            failed = r.returncode != 0
    return runs


@dataclasses.dataclass
class DocsRun:
    """The session's run of the documentation: the README's blocks in ``readme_dir``, the site's in ``site_dir``."""
    readme_dir: Path
    site_dir: Path
    readme: list[BlockRun]
    site: list[BlockRun]

    def block(self, page: str, contains: str) -> BlockRun:
        """The site or README block of ``page`` whose code contains ``contains`` (the first)."""
        for run in self.readme + self.site:
            if run.page == page and contains in run.code:
                return run
        raise KeyError(f"no block of {page} contains {contains!r}")


def run_docs(base: Path) -> DocsRun:
    """Run the README in ``base/readme`` and the site's pages in ``base/site``, once."""
    readme_dir, site_dir = base / "readme", base / "site"
    readme_dir.mkdir(parents=True)
    site_dir.mkdir(parents=True)
    return DocsRun(readme_dir, site_dir, run_pages([ROOT / "README.md"], readme_dir), run_pages(site_pages(), site_dir))
