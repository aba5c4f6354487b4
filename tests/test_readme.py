"""The README and the documentation site run top to bottom (``tests/docs_blocks.py`` says how: once per session,
``SCRUBNET_TINY=1``, a page's blocks in order)."""
from __future__ import annotations

from tests.docs_blocks import ROOT, readme_blocks, runnable, site_pages


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


def test_site_pages_are_found():
    pages = site_pages()
    assert ROOT / "docs" / "getting-started.md" in pages and all(p.is_file() for p in pages)


def test_readme_runs_top_to_bottom(docs_run):
    assert len(docs_run.readme) >= 3
    for run in docs_run.readme:
        assert run.failure() is None, run.failure()


def test_site_runs_top_to_bottom(docs_run):
    assert docs_run.site
    for run in docs_run.site:
        assert run.failure() is None, run.failure()
