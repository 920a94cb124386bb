"""``pack --ray``: the partitions as tasks on a real local Ray instance (2 CPUs), one of them killed."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from click.testing import CliRunner
from pack_helpers import kill_a_writer

import packer
from packer.cli import main
from packer.run.ray_runner import ray_runner

ray = pytest.importorskip("ray")

OPTIONS = {"resize": 96, "crop": 96, "partitions": 6, "progress": False, "resampler": "pil"}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=80 << 20)
    yield
    ray.shutdown()


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_ray_pack_survives_a_killed_task_and_equals_a_local_pack(
    tmp_path: Path, make_image_folder: Callable[..., Path], local_ray: None
) -> None:
    src = make_image_folder(tmp_path / "src", classes=("a", "b", "c"), per_class=16, size=(480, 360), ext="jpg")
    local = tmp_path / "local"
    packer.pack(src, local, workers=2, **OPTIONS)

    dst = tmp_path / "ray"
    killed: list[str] = []
    killer = threading.Thread(target=kill_a_writer, args=(dst, killed, time.monotonic() + 60))
    killer.start()
    progress: list[int] = []
    run_on_ray = ray_runner()

    def counting_runner(tasks, on_records):  # type: ignore[no-untyped-def]
        return run_on_ray(tasks, progress.append)

    manifest = packer.pack(src, dst, runner=counting_runner, **OPTIONS)
    killer.join()
    assert killed, "no shard was seen being written, so no task was killed"
    assert killed[0].startswith("ray::_pack_on_a_node"), killed
    assert manifest is not None and manifest.num_records == 48
    assert sum(progress) == 48
    assert tree(dst) == tree(local)


def test_a_bad_image_fails_the_ray_pack_naming_it(
    tmp_path: Path, make_image_folder: Callable[..., Path], local_ray: None
) -> None:
    src = make_image_folder(tmp_path / "src", per_class=4)
    (src / "dog" / "002.png").write_text("not a png")
    with pytest.raises(packer.PackError, match=r"dog/002\.png: not an image"):
        packer.pack(src, tmp_path / "out", runner=ray_runner(), **{**OPTIONS, "partitions": 2})


def test_the_cli_packs_on_ray(tmp_path: Path, make_image_folder: Callable[..., Path], local_ray: None) -> None:
    """``packer pack --ray`` (here on the already started local instance, which it leaves running)."""
    src = make_image_folder(tmp_path / "src", per_class=4)
    args = [str(src), "--resize", "16", "--partitions", "3", "--resampler", "pil", "--quiet"]
    result = CliRunner().invoke(main, ["pack", *args[:1], str(tmp_path / "ray"), *args[1:], "--ray"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("packed 8 images into 3 lmdb shards")
    assert ray.is_initialized()
    assert CliRunner().invoke(main, ["pack", *args[:1], str(tmp_path / "local"), *args[1:]]).exit_code == 0
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")
