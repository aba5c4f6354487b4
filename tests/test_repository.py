"""The repository holds source: no tracked binary over 1 MB unless it is a declared fixture.

A declared fixture is a path listed in ``tests/fixtures/LARGE_FILES.txt`` (one path a line, ``#`` comments), with
the reason it must be a binary of that size. Anything else that large (a wheel, a checkpoint, a data set) belongs
to a package index, a download step or a generator script, never to the tree.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1 << 20
DECLARED = ROOT / "tests" / "fixtures" / "LARGE_FILES.txt"


def tracked_files() -> list[Path]:
    """Every file git tracks (a checkout without git: every file outside the ignored build folders)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", "site", "build", "dist", "runs"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def is_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB, or bytes that are not UTF-8 text."""
    head = path.read_bytes()[:8192]
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 4   # a multi-byte character cut at the 8 KiB edge is still text
    return False


def declared() -> set[str]:
    if not DECLARED.exists():
        return set()
    return {ln.split("#")[0].strip() for ln in DECLARED.read_text().splitlines() if ln.split("#")[0].strip()}


def large_binaries(files: list[Path], allowed: set[str], root: Path = ROOT) -> list[str]:
    """The paths (relative to ``root``) of the binaries over :data:`LIMIT` that ``allowed`` does not name."""
    return sorted(str(p.relative_to(root)) for p in files
                  if p.is_file() and p.stat().st_size > LIMIT and is_binary(p)
                  and str(p.relative_to(root)) not in allowed)


def test_no_tracked_binary_over_1_mb_unless_declared():
    bad = large_binaries(tracked_files(), declared())
    assert not bad, f"tracked binaries over 1 MB that are not declared in {DECLARED.name}: {bad}"


def test_the_check_finds_a_large_binary_and_lets_text_and_declared_files_pass(tmp_path):
    wheel, text, fixture = tmp_path / "tool.whl", tmp_path / "big.txt", tmp_path / "fix.npz"
    wheel.write_bytes(b"PK\x03\x04" + bytes(range(256)) * (LIMIT // 256 + 1))
    text.write_text("a line of text\n" * (LIMIT // 10))
    fixture.write_bytes(b"\x93NUMPY" + b"\0" * (LIMIT + 1))
    small = tmp_path / "small.bin"
    small.write_bytes(b"\0" * 100)
    files = [wheel, text, fixture, small]
    assert large_binaries(files, set(), tmp_path) == ["fix.npz", "tool.whl"]
    assert large_binaries(files, {"fix.npz"}, tmp_path) == ["tool.whl"]
