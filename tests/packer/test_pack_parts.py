"""Packing part by part (``--part I/N``, ``--part slurm``) and ``packer merge DST``, as a Slurm array does."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from packer.cli import main
from packer.errors import PackError
from packer.run.partitions import Part, parse_part
from reader.format import MANIFEST_NAME

PACK = ("--resize", "16", "--crop", "16", "--partitions", "5", "--shard-size", "2KB", "--quiet")
TASK_TIMEOUT_S = 120  # a task here packs in about a second; a hung one fails the test


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def src(tmp_path: Path, make_image_folder: Callable[..., Path]) -> Path:
    return make_image_folder(tmp_path / "src", classes=("a", "b", "c"), per_class=4)  # 12 images


def test_part_by_part_then_merge_equals_a_one_shot_pack(tmp_path: Path, src: Path) -> None:
    one_shot = tmp_path / "one-shot"
    assert run("pack", src, one_shot, *PACK, "--workers", "2")[0] == 0
    dst = tmp_path / "parts"
    for task in (2, 0, 1):  # any order
        code, out = run("pack", src, dst, *PACK, "--part", f"{task}/3", "--workers", "0")
        assert code == 0, out
        assert out == f"packed part {task}/3 at {dst}; run `packer merge {dst}` once every part is done\n"
    assert not (dst / MANIFEST_NAME).exists()
    code, out = run("merge", dst)
    assert code == 0, out
    assert out.startswith("packed 12 images into 7 lmdb shards")  # 5 partitions of 2-3 records, 2 a shard
    assert tree(dst) == tree(one_shot)


def test_merge_refuses_a_missing_part_naming_it(tmp_path: Path, src: Path) -> None:
    dst = tmp_path / "parts"
    for task in (0, 2):
        assert run("pack", src, dst, *PACK, "--part", f"{task}/3", "--workers", "0")[0] == 0
    code, out = run("merge", dst)
    assert code == 1
    assert out == (
        f"Error: {dst}: cannot merge, 2 of 5 parts are missing or broken (part 1 (records 2-3): not finished "
        "(no .part-00001.json); part 4 (records 9-11): not finished (no .part-00004.json)); "
        "rerun the pack for those parts\n"
    )
    assert not (dst / MANIFEST_NAME).exists()
    assert run("pack", src, dst, *PACK, "--part", "1/3", "--workers", "0")[0] == 0
    assert run("merge", dst)[0] == 0


def test_merge_refuses_a_part_whose_shard_changed(tmp_path: Path, src: Path) -> None:
    dst = tmp_path / "parts"
    assert run("pack", src, dst, *PACK, "--part", "0/1", "--workers", "0")[0] == 0
    shard = dst / "part-00003-shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    code, out = run("merge", dst)
    assert code == 1
    assert "1 of 5 parts are missing or broken (part 3 (records 7-8): part-00003-shard-00000.lmdb does not " \
           "match its recorded size and checksum)" in out
    (dst / "part-00003-shard-00000.lmdb").unlink()
    assert "part-00003-shard-00000.lmdb is missing" in run("merge", dst)[1]


def test_merge_names_a_part_record_that_cannot_be_read(tmp_path: Path, src: Path) -> None:
    """A truncated or edited .part-NNNNN.json was reported as "no .part-NNNNN.json" though the file is there."""
    dst = tmp_path / "parts"
    assert run("pack", src, dst, *PACK, "--part", "0/1", "--workers", "0")[0] == 0
    (dst / ".part-00001.json").write_text("{")
    (dst / ".part-00002.json").write_text("[]")
    code, out = run("merge", dst)
    assert code == 1
    assert out == (
        f"Error: {dst}: cannot merge, 2 of 5 parts are missing or broken (part 1 (records 2-3): not finished "
        "(.part-00001.json cannot be read); part 2 (records 4-6): not finished (.part-00002.json cannot be read)); "
        "rerun the pack for those parts\n"
    )


def test_merge_of_a_directory_without_a_started_pack(tmp_path: Path) -> None:
    code, out = run("merge", tmp_path)
    assert code == 1
    assert out == f"Error: {tmp_path}: no readable .pack-plan.json, so no partitioned pack was started here\n"


def test_part_slurm_reads_the_array_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert parse_part("slurm") == Part(1, 3)
    monkeypatch.delenv("SLURM_ARRAY_TASK_MIN")  # then task ids count from 0
    with pytest.raises(PackError, match=r"--part 5/3: need 0 <= I < N"):
        parse_part("slurm")
    monkeypatch.delenv("SLURM_ARRAY_TASK_COUNT")
    with pytest.raises(PackError, match="--part slurm: SLURM_ARRAY_TASK_COUNT is not set"):
        parse_part("slurm")


def test_part_i_of_n() -> None:
    assert parse_part("2/3") == Part(2, 3)
    assert Part(1, 3).select(list(range(8))) == [1, 4, 7]  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["3/3", "1", "a/b", "-1/2"])
def test_a_bad_part_is_refused(text: str) -> None:
    with pytest.raises(PackError, match=r"--part"):
        parse_part(text)


def test_a_part_leaves_the_other_tasks_files_alone(tmp_path: Path, src: Path) -> None:
    """Tasks share DST: one task starting (or restarting) must not delete what another is writing."""
    dst = tmp_path / "parts"
    assert run("pack", src, dst, *PACK, "--part", "0/2", "--workers", "0")[0] == 0
    (dst / "part-00001-shard-00000.lmdb.tmp").write_bytes(b"task 1 is writing this")
    assert run("pack", src, dst, *PACK, "--part", "0/2", "--workers", "0")[0] == 0
    assert (dst / "part-00001-shard-00000.lmdb.tmp").read_bytes() == b"task 1 is writing this"


def test_the_sbatch_script_packs_one_array_task_each(tmp_path: Path, src: Path) -> None:
    """scripts/pack.sbatch run as Slurm would run it: once per array task (ids 1-2 of an --array=1-2),
    with a ``packer`` command on PATH; then merge."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "packer").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m packer "$@"\n')
    (shim / "packer").chmod(0o755)
    dst = tmp_path / "parts"
    script = Path(__file__).resolve().parents[2] / "scripts" / "pack.sbatch"
    for task in ("1", "2"):
        env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": task,
               "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "2"}
        subprocess.run(["bash", str(script), str(src), str(dst), *PACK], env=env, check=True, capture_output=True,
                       timeout=TASK_TIMEOUT_S)
    assert run("merge", dst)[0] == 0
    one_shot = tmp_path / "one-shot"
    assert run("pack", src, one_shot, *PACK, "--workers", "0")[0] == 0
    assert tree(dst) == tree(one_shot)


def test_tasks_started_at_the_same_moment_share_dst_safely(tmp_path: Path, src: Path) -> None:
    """Three real processes, as an array's tasks start, each writing the plan and its partitions."""
    dst = tmp_path / "parts"
    command = [sys.executable, "-m", "packer", "pack", str(src), str(dst), *PACK, "--workers", "0"]
    tasks = [subprocess.Popen([*command, "--part", f"{i}/3"], stderr=subprocess.PIPE) for i in range(3)]
    codes = [task.wait(timeout=TASK_TIMEOUT_S) for task in tasks]
    assert codes == [0, 0, 0], [task.stderr.read() for task in tasks if task.stderr]
    (dst / ".pack-plan.json.node7-4242").write_text("{}")  # a copy left by a task killed while staging it
    (dst / "part-00009-shard-00000.lmdb").write_text("")  # files of an older plan with more partitions
    (dst / ".part-00009.json").write_text("{}")
    assert run("merge", dst)[0] == 0
    one_shot = tmp_path / "one-shot"
    assert run("pack", src, one_shot, *PACK, "--workers", "0")[0] == 0
    assert tree(dst) == tree(one_shot)
