"""``packer pack --append``: new images as new shards of a finished dataset, classes extended by name,
the manifest swapped atomically (a reader racing the append sees the old or the new dataset)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import PIL
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import packer
from packer.cli import main
from packer.errors import PackError
from reader import PackedDataset

ROOT = Path(__file__).resolve().parents[2]


def folder(root: Path, classes: dict[str, int], seed: int, size: tuple[int, int] = (14, 18)) -> Path:
    """An ImageFolder tree: ``count`` PNGs per class, pixels from ``seed``."""
    rng = np.random.default_rng(seed)
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for k in range(count):
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / name / f"{seed}-{k}.png")
    return root


def test_append_then_read_verify_and_append_again(tmp_path: Path) -> None:
    first = folder(tmp_path / "a", {"cat": 3, "dog": 2}, seed=1)
    packer.pack(first, tmp_path / "ds", resize=12, crop=10, encoding="jpeg", workers=0, progress=False)
    before = PackedDataset(tmp_path / "ds")
    old = [(before[i][0].clone(), before[i][1], before.source(i)) for i in range(len(before))]

    second = folder(tmp_path / "b", {"dog": 2, "fox": 2}, seed=2)
    manifest = packer.append(second, tmp_path / "ds", workers=2, progress=False)
    assert manifest.classes == ["cat", "dog", "fox"]  # extended by name: dog keeps id 1, fox gets 2
    kept = [s.file for s in before.manifest.shards]
    assert [s.file for s in manifest.shards[:len(kept)]] == kept
    assert all(s.file.startswith("append-0001-") for s in manifest.shards[len(kept):])
    ds = PackedDataset(tmp_path / "ds")
    assert len(ds) == 9
    for i, (pixels, label, source) in enumerate(old):
        assert torch.equal(ds[i][0], pixels) and ds[i][1] == label and ds.source(i) == source
    assert [ds.classes[ds[i][1]] for i in range(5, 9)] == ["dog", "dog", "fox", "fox"]
    assert ds.source(7) == "fox/2-0.png" and ds[7][0].shape == (3, 10, 10)
    assert packer.verify(tmp_path / "ds", deep=True, progress=False).ok
    assert manifest.source["files"] == 9 and manifest.source["appended"][0]["packed"] == 4
    assert not any(p.name.startswith(".append") for p in (tmp_path / "ds").iterdir())

    third = folder(tmp_path / "c", {"ant": 1}, seed=3)
    manifest = packer.append(third, tmp_path / "ds", workers=0, progress=False)
    assert manifest.classes == ["cat", "dog", "fox", "ant"] and manifest.shards[-1].file.startswith("append-0002-")
    assert PackedDataset(tmp_path / "ds").source(9) == "ant/3-0.png"
    assert packer.verify(tmp_path / "ds", deep=True, progress=False).ok


def test_append_refusals_name_the_problem(tmp_path: Path, make_packed_dataset: Callable[..., Path]) -> None:
    first = folder(tmp_path / "a", {"cat": 2}, seed=1)
    packer.pack(first, tmp_path / "ds", resize=12, workers=0, progress=False)
    with pytest.raises(PackError, match=r"--append: .*no manifest.json"):
        packer.append(first, tmp_path / "nothing", progress=False)
    labels = tmp_path / "a" / "extra.jsonl"
    labels.write_text(json.dumps({"path": "cat/1-0.png", "label": "cat", "note": "x"}) + "\n")
    with pytest.raises(PackError, match=r"extra\.jsonl: fields note differ from .*ds's \(none\); an appended "):
        packer.append(tmp_path / "a", tmp_path / "ds", labels=labels, workers=0, progress=False)
    numbered = tmp_path / "a" / "numbered.csv"
    numbered.write_text("path,label\ncat/1-0.png,0\n")
    with pytest.raises(PackError, match=r"numbered\.csv: its labels are class indices, but the classes of .*ds are "
                                        r"names \(cat\); write the class names, or pass --label-kind name"):
        packer.append(tmp_path / "a", tmp_path / "ds", labels=numbered, workers=0, progress=False)
    result = CliRunner().invoke(main, ["pack", str(first), str(tmp_path / "ds"), "--append", "--resize", "20"])
    assert result.exit_code == 2 and "--append packs with DST's own settings: leave out --resize" in result.stderr
    assert len(PackedDataset(tmp_path / "ds")) == 2  # unchanged by the refused appends
    appended = packer.append(tmp_path / "a", tmp_path / "ds", labels=numbered, label_kind="name", workers=0,
                             progress=False)
    assert appended.classes == ["cat", "0"] and appended.num_records == 3


def test_an_interrupted_append_leaves_the_old_dataset_and_a_rerun_finishes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = folder(tmp_path / "a", {"cat": 2}, seed=1)
    packer.pack(first, tmp_path / "ds", workers=0, progress=False)
    second = folder(tmp_path / "b", {"dog": 3}, seed=2)
    real_replace = os.replace

    def crash_after_one_move(source, target):  # the first staged shard moves in, then the process "dies"
        real_replace(source, target)
        raise KeyboardInterrupt

    monkeypatch.setattr(packer.appending.os, "replace", crash_after_one_move)
    with pytest.raises(KeyboardInterrupt):
        packer.append(second, tmp_path / "ds", workers=0, shard_size=1, progress=False)
    assert len(PackedDataset(tmp_path / "ds")) == 2  # the old dataset, intact
    monkeypatch.setattr(packer.appending.os, "replace", real_replace)
    manifest = packer.append(second, tmp_path / "ds", workers=0, shard_size=1, progress=False)
    assert manifest.num_records == 5 and PackedDataset(tmp_path / "ds").source(4) == "dog/2-2.png"
    assert packer.verify(tmp_path / "ds", progress=False).ok


READER = """
import sys, time
from reader import PackedDataset
from reader.format import FormatError
seen = set()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    ds = PackedDataset(sys.argv[1])
    n = len(ds)
    assert n in (4, 10), n
    assert [ds[i][1] for i in range(n)] == [0, 0, 1, 1] + [1, 1, 1, 2, 2, 2][: n - 4], n
    seen.add(n)
    if n == 10:
        break
print(sorted(seen))
"""


def test_a_reader_racing_an_append_sees_the_old_or_the_new_dataset(tmp_path: Path) -> None:
    first = folder(tmp_path / "a", {"cat": 2, "dog": 2}, seed=1)
    packer.pack(first, tmp_path / "ds", workers=0, progress=False)
    second = folder(tmp_path / "b", {"dog": 3, "fox": 3}, seed=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    reader = subprocess.Popen([sys.executable, "-c", READER, str(tmp_path / "ds")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the reader is opening the old dataset over and over
    packer.append(second, tmp_path / "ds", workers=2, shard_size=1, progress=False)
    out, err = reader.communicate(timeout=90)
    assert reader.returncode == 0, err
    assert out.strip() in ("[4, 10]", "[10]")


def test_a_staged_append_from_another_source_is_started_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packer.pack(folder(tmp_path / "a", {"cat": 2}, seed=1), tmp_path / "ds", workers=0, progress=False)

    def crash(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(packer.appending.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):  # staged, not moved in
        packer.append(folder(tmp_path / "b", {"dog": 2}, seed=2), tmp_path / "ds", workers=0, progress=False)
    monkeypatch.undo()
    manifest = packer.append(folder(tmp_path / "c", {"fox": 1}, seed=3), tmp_path / "ds", workers=0, progress=False)
    assert manifest.classes == ["cat", "fox"] and PackedDataset(tmp_path / "ds").source(2) == "fox/3-0.png"


def labels_csv(path: Path, header: str, *rows: str) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_an_appended_labels_file_must_have_the_dataset_s_fields_and_labels(tmp_path: Path) -> None:
    src = folder(tmp_path / "src", {"cat": 2}, seed=1)
    first = labels_csv(tmp_path / "first.csv", "path,label,tags,score",
                       'cat/1-0.png,cat,"[""a""]",1.5', 'cat/1-1.png,dog,"[""b""]",2')
    packer.pack(src, tmp_path / "ds", labels=first, fields={"tags": "labels:a,b"}, workers=0, progress=False)
    unlabelled = labels_csv(tmp_path / "unlabelled.csv", "path,score", "cat/1-0.png,1")
    packer.pack(src, tmp_path / "plain", labels=unlabelled, workers=0, progress=False)
    extra = labels_csv(tmp_path / "extra.csv", "path,label,tags,score,note", 'cat/1-0.png,cat,"[""a""]",1,x')
    refusals = [
        (tmp_path / "ds", extra, r"extra\.csv: fields tags, score, note differ from .*ds's \(tags, score\); "
         r"an appended source needs the same fields"),
        (tmp_path / "ds", labels_csv(tmp_path / "nolabel.csv", "path,tags,score", 'cat/1-0.png,"[""a""]",1'),
         r"nolabel\.csv: its images have no labels, but the records of .*ds have; an appended source must "
         r"label every image or none, as the dataset does"),
        (tmp_path / "plain", labels_csv(tmp_path / "label.csv", "path,label,score", "cat/1-0.png,cat,1"),
         r"label\.csv: its images have labels, but the records of .*plain have none; an appended source must "
         r"label every image or none, as the dataset does"),
    ]
    for dst, labels, message in refusals:
        with pytest.raises(PackError, match=message):
            packer.append(src, dst, labels=labels, workers=0, progress=False)
        assert sorted(p.name for p in dst.iterdir()) == ["manifest.json", "part-00000-shard-00000.lmdb"]
    # the same fields in another column order append, and a rerun after a refusal works
    reordered = labels_csv(tmp_path / "reordered.csv", "path,score,label,tags", 'cat/1-1.png,3,fox,"[""b""]"')
    manifest = packer.append(src, tmp_path / "ds", labels=reordered, workers=0, progress=False)
    assert [f.name for f in manifest.fields] == ["tags", "score"] and manifest.classes == ["cat", "dog", "fox"]
    ds = PackedDataset(tmp_path / "ds")
    assert ds.fields(2) == {"tags": ["b"], "score": 3.0} and ds.classes[ds[2][1]] == "fox"
    assert packer.verify(tmp_path / "ds", deep=True, progress=False).ok
    assert packer.append(src, tmp_path / "plain", labels=unlabelled, workers=0, progress=False).num_records == 2


def test_appending_to_a_read_only_dataset_is_one_line_and_leaves_it_as_it_was(
    tmp_path: Path, read_only: Callable[[bool], None]
) -> None:
    dst = tmp_path / "ro" / "ds"
    packer.pack(folder(tmp_path / "a", {"cat": 2}, seed=1), dst, workers=0, progress=False)
    second = folder(tmp_path / "b", {"dog": 2}, seed=2)
    read_only(True)
    with pytest.raises(PackError, match=r"ro/ds: cannot append: (.*ro/ds is on a read-only file system|no "
                                        r"permission to write in .*ro/ds) \(the dataset is left as it was\)"):
        packer.append(second, dst, workers=0, progress=False)
    result = CliRunner().invoke(main, ["pack", str(second), str(dst), "--append", "--workers", "0", "--quiet"])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1 and "cannot append" in result.stderr
    assert len(PackedDataset(dst)) == 2
    read_only(False)
    assert packer.append(second, dst, workers=0, progress=False).num_records == 4


def test_an_append_whose_resampler_differs_is_refused_before_packing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset resized by pillow-simd; then plain Pillow replaces it (as ``pip install torchvision``
    does): the append says which library resizes here and which resized the dataset, and packs nothing."""
    first = folder(tmp_path / "a", {"cat": 2}, seed=1)
    monkeypatch.setattr(PIL, "__version__", "12.1.1.post0")  # pillow-simd, as packer.image.resampling tells it
    packer.pack(first, tmp_path / "ds", resize=12, resampler="pil", workers=0, progress=False)
    before = sorted(os.listdir(tmp_path / "ds"))
    monkeypatch.setattr(PIL, "__version__", "12.1.1")  # plain Pillow
    more = folder(tmp_path / "b", {"dog": 2}, seed=2)
    with pytest.raises(PackError, match=r"ds: was resized by pillow-simd 12\.1\.1\.post0 \(pil resampler\), but here "
                                        r"that resampler is Pillow 12\.1\.1: the appended images would not be "
                                        r"resized the same way; append with the same install"):
        packer.append(more, tmp_path / "ds", workers=0, progress=False)
    assert sorted(os.listdir(tmp_path / "ds")) == before  # no .append-0001/
