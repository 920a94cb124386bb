"""Helpers for the hostile-input tests: run code that may crash or hang in a subprocess, and damage
datasets in the ways a partial copy, a careless edit or a malicious author would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from reader.format.manifest import manifest_checksum

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
TIMEOUT_S = 60


def subprocess_env() -> dict[str, str]:
    """This checkout's code first on the path, whatever is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def probe(jobs: list[tuple[str, Path]]) -> list[dict]:
    """Run ``hostile_probe.py`` on ``jobs`` (``(action, dataset)`` pairs) in one subprocess; one outcome
    per job. The job running when the subprocess died gets ``{"outcome": "signal 7"}`` (or ``"hang"``,
    ``"exit N"``), the jobs after it ``{"outcome": "not run"}``."""
    argument = json.dumps([[action, str(path)] for action, path in jobs])
    try:
        done = subprocess.run([sys.executable, str(TESTS / "hostile_probe.py"), argument],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=subprocess_env())
        stdout, returncode, stderr = done.stdout, done.returncode, done.stderr
    except subprocess.TimeoutExpired as e:
        stdout, returncode, stderr = (e.stdout or b"").decode(), None, ""
    outcomes = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if len(outcomes) < len(jobs):
        died = ("hang" if returncode is None else f"signal {-returncode}" if returncode < 0
                else f"exit {returncode}")
        outcomes.append({"outcome": died, "job": jobs[len(outcomes)], "stderr": stderr[-2000:]})
        outcomes += [{"outcome": "not run"}] * (len(jobs) - len(outcomes))
    return outcomes


def run_cli(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m packer ARGS`` in a subprocess (a hang raises ``TimeoutExpired``, failing the test)."""
    return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env())


def assert_one_line_error(done: subprocess.CompletedProcess, *names: str) -> str:
    """The CLI failed with status 1 and one ``Error:`` line naming each of ``names``, no traceback."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, done.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def edit_manifest(dst: Path, edit) -> None:
    """Load ``manifest.json`` as plain JSON, change it in place with ``edit(data)`` and write it back with
    its checksum recomputed, as an author hiding the change would (so the checks behind it are tested)."""
    path = dst / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    if "checksum" in data:
        data["checksum"] = manifest_checksum(data)
    path.write_text(json.dumps(data))


def truncate_to(path: Path, fraction: float) -> int:
    """Cut ``path`` to ``fraction`` of its size (whole bytes); returns the new size."""
    size = int(path.stat().st_size * fraction)
    os.truncate(path, size)
    return size


def tables_in_containers(dst: Path) -> Path:
    """Make every shard's record table be looked up in its container (``table_offset`` null, as for
    shards from before format version 4), for tests that attack the containers' own tables and the
    readers' walk through them; ``tests/format/test_table_offset.py`` attacks the offsets."""
    edit_manifest(dst, lambda data: [shard.update(table_offset=None) for shard in data["shards"]])
    return dst


def set_manifest_bytes(dst: Path, shard: int, size: int) -> None:
    """Make the manifest agree with a damaged shard's size, as an author hiding the damage would."""
    def edit(data: dict) -> None:
        data["shards"][shard]["bytes"] = size
    edit_manifest(dst, edit)


def first_shard(dst: Path) -> Path:
    return dst / json.loads((dst / "manifest.json").read_text())["shards"][0]["file"]


def flip_bytes(path: Path, positions: np.ndarray) -> None:
    """XOR 0xFF into the bytes of ``path`` at ``positions``, keeping its modification time (bit rot)."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    for position in positions.tolist():
        data[position] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
