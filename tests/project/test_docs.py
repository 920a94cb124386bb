"""The documents run: every ```python, ```bash, ```sh and ```console block of README.md and docs/*.md is
executed, in the order it appears, against a small dataset made here, so that a renamed argument or
command fails the suite instead of misleading a user.

Each document runs in a fresh copy of one prepared working directory (made once per module):

- ``images/``: an ImageFolder tree (classes ``cat``, ``dog``, ``fish``) of small photo-like JPEGs;
- ``new-images/``: a few more (``cat``, ``bird``), to append;
- ``photos/`` with ``labels.csv`` (``path,label``) and ``meta.jsonl`` (``path``, ``label``, a 4-number
  ``emb`` and a ``tags`` list), for the labels-file examples;
- ``shard-000000.tar``: a WebDataset-style tar (``NAME.jpg`` + ``NAME.cls`` members).

Blocks of one document share that directory (a later block may read what an earlier one packed), so
every document reads as a walk-through. ``packer`` on PATH is this checkout's (``python -m packer``) and
``python`` is this interpreter. A block is skipped when the line right before its fence is
``<!-- skip: REASON -->``; blocks that need CUDA, Slurm or a cluster are marked so. Blocks that only show
output or a file are ```text (or another language that is not run). Consecutive Python blocks run in one
interpreter, each as ``__main__`` with fresh globals (torch is imported once for them, not per block).
Every block has a timeout that fails the test.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = {"python": "python", "bash": "bash", "sh": "bash", "console": "console"}
BLOCK_TIMEOUT_S = 180
_FENCE = re.compile(r"^```(\S*)\s*$")
_SKIP = re.compile(r"^<!--\s*skip:\s*(\S.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its document, first line (1-based, the fence's), language, code and the
    reason it is skipped (None when it runs)."""

    document: Path
    line: int
    language: str
    code: str
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def blocks_of(document: Path) -> list[Block]:
    """Every fenced block of ``document``; an unclosed fence or a fence without a language is an error
    (an illustration is marked ```text, so nothing is left unrun by accident)."""
    lines = document.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, language = i, match.group(1)
        if not language:
            raise ValueError(f"{document.relative_to(REPO)}:{i + 1}: a code block without a language "
                             "(use ```text for output or an illustration)")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{document.relative_to(REPO)}:{i + 1}: the code block is never closed")
        skip = _SKIP.match(lines[start - 1].strip()) if start > 0 else None
        found.append(Block(document, start + 1, language, "\n".join(lines[start + 1:end]) + "\n",
                           skip.group(1) if skip else None))
        i = end + 1
    return found


def runnable(document: Path) -> list[Block]:
    return [b for b in blocks_of(document) if b.language in RUN]


def _jpeg(path: Path, width: int, height: int, seed: int) -> None:
    """A smooth photo-like JPEG (gradient plus soft noise), so that resizes and crops see real content."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(40, 200, 3) + 50 * np.sin(x[..., None] / (7 + seed % 5)) * np.cos(y[..., None] / 9)
    pixels = np.clip(base + rng.normal(0, 6, (height, width, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, "RGB").save(path, quality=90)


def _prepare(root: Path) -> None:
    seed = 0
    for name in ("cat", "dog", "fish"):
        for i in range(8):
            _jpeg(root / "images" / name / f"{i:03d}.jpg", 96 + 4 * i, 72 + 3 * i, seed)
            seed += 1
    for name in ("cat", "bird"):
        for i in range(3):
            _jpeg(root / "new-images" / name / f"new-{i:03d}.jpg", 90, 70, seed)
            seed += 1
    rows, meta = ["path,label"], []
    for i in range(12):
        _jpeg(root / "photos" / f"p{i:03d}.jpg", 100, 80, seed)
        seed += 1
        label = ("beach", "forest", "city")[i % 3]
        rows.append(f"p{i:03d}.jpg,{label}")
        meta.append({"path": f"p{i:03d}.jpg", "label": label, "emb": [i / 10, 0.5, 1.0, -1.0],
                     "tags": ["day"] if i % 2 else ["day", "people"]})
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    (root / "meta.jsonl").write_text("".join(json.dumps(m) + "\n" for m in meta))
    with tarfile.open(root / "shard-000000.tar", "w") as tar:
        for i in range(6):
            image = io.BytesIO()
            _jpeg(root / "tmp.jpg", 64, 48, seed)
            seed += 1
            image.write((root / "tmp.jpg").read_bytes())
            for name, data in ((f"s{i:04d}.jpg", image.getvalue()), (f"s{i:04d}.cls", str(i % 2).encode())):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    (root / "tmp.jpg").unlink()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory every document starts from (module docstring), made once."""
    root = tmp_path_factory.mktemp("docs-base")
    _prepare(root)
    return root


@pytest.fixture(scope="module")
def tools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment blocks run in: ``packer`` and ``python`` on PATH are this checkout and interpreter."""
    bin_dir = tmp_path_factory.mktemp("docs-bin")
    for name, command in (("packer", f'"{sys.executable}" -m packer "$@"'), ("python", f'"{sys.executable}" "$@"')):
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\nexec {command}\n")
        script.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["TQDM_DISABLE"] = "1"
    return env


# Runs the Python blocks given as files, each as ``__main__`` with fresh globals, in one interpreter (so
# torch is imported once per run of consecutive blocks, not once per block); names each before it runs.
_PYTHON_RUNNER = """
import runpy, sys
for script in sys.argv[1:]:
    print(f"=== {script}", file=sys.stderr, flush=True)
    runpy.run_path(script, run_name="__main__")
"""


def _groups(blocks: list[Block]) -> list[list[Block]]:
    """The blocks to run, consecutive Python blocks together (one interpreter), others one by one."""
    groups: list[list[Block]] = []
    for block in blocks:
        python = RUN[block.language] == "python"
        if python and groups and RUN[groups[-1][-1].language] == "python":
            groups[-1].append(block)
        else:
            groups.append([block])
    return groups


def _command(group: list[Block], workdir: Path) -> list[str]:
    block = group[0]
    if RUN[block.language] == "python":
        scripts = []
        for each in group:
            script = _script(each, workdir)
            script.write_text(each.code)
            scripts.append(str(script))
        return [sys.executable, "-c", _PYTHON_RUNNER, *scripts]
    code = block.code
    if RUN[block.language] == "console":  # only the "$ command" lines; the rest is output
        code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ ")) + "\n"
    return ["bash", "-euo", "pipefail", "-c", code]


def _script(block: Block, workdir: Path) -> Path:
    return workdir / f".block-{block.document.stem}-{block.line}.py"


def _failed_block(group: list[Block], workdir: Path, stderr: str) -> Block:
    """The block of ``group`` that was running when it failed: the last one the runner named."""
    named = [line[4:] for line in stderr.splitlines() if line.startswith("=== ")]
    return next((b for b in group if named and str(_script(b, workdir)) == named[-1]), group[0])


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_document_blocks_run(document: Path, prepared: Path, tools: dict[str, str], tmp_path: Path) -> None:
    """Every runnable block of ``document`` exits 0, in order, in one copy of the prepared directory."""
    workdir = tmp_path / "work"
    shutil.copytree(prepared, workdir)
    for group in _groups([b for b in runnable(document) if b.skip is None]):
        timeout = BLOCK_TIMEOUT_S * len(group)
        try:
            done = subprocess.run(_command(group, workdir), cwd=workdir, env=tools, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            where = ", ".join(b.where for b in group)
            pytest.fail(f"{where}: ran past {timeout} s; its output:\n{e.stderr!r}")
        if done.returncode != 0:
            block = _failed_block(group, workdir, done.stderr)
            pytest.fail(f"{block.where}: the {block.language} block exited {done.returncode}:\n{block.code}\n"
                        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


def test_blocks_are_marked() -> None:
    """Every document has blocks to run; a skipped block gives its reason; ```text marks what is not run."""
    every = [b for d in DOCUMENTS for b in blocks_of(d)]
    for document in DOCUMENTS:
        assert runnable(document), f"{document.relative_to(REPO)} has no block to run"
    for block in every:
        if block.skip is not None:
            assert block.language in RUN, f"{block.where}: a skip marker on a block that is not run anyway"
            assert len(block.skip) > 8, f"{block.where}: say why the block is skipped"
    assert {"docs/packing.md", "docs/reading.md", "docs/gpu.md", "docs/clusters.md", "docs/format.md"} <= {
        str(d.relative_to(REPO)) for d in DOCUMENTS}


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve() -> None:
    """Every relative link of the documents names a file of the checkout, and every #anchor a heading."""
    pages = [*DOCUMENTS, REPO / "BENCHMARKS.md", REPO / "CONTRIBUTING.md"]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
