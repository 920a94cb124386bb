"""``PackOptions``: one object for the settings that decide a dataset's bytes, shared by every verb."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

import packer
from packer import PackError, PackOptions


def test_the_verbs_take_options_and_keywords_alike(tmp_path: Path, make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=2)
    options = PackOptions(resize=16, crop=12, encoding="jpeg", quality=80, storage="hdf5")
    by_object = packer.pack(src, tmp_path / "a", options, workers=0, progress=False)
    by_keywords = packer.pack(src, tmp_path / "b", resize=16, crop=12, encoding="jpeg", quality=80, storage="hdf5",
                              workers=0, progress=False)
    assert by_object is not None and by_keywords is not None
    assert by_object.transform == by_keywords.transform and by_object.jpeg_quality == 80
    assert [s.checksum for s in by_object.shards] == [s.checksum for s in by_keywords.shards]
    again = PackOptions.from_manifest(by_object)  # what --append packs with
    assert again.transform.describe() == options.transform.describe()
    assert (again.storage, again.encoding, again.quality) == ("hdf5", "jpeg", 80)


def test_a_keyword_on_top_of_options_replaces_that_setting_only(tmp_path: Path,
                                                                 make_image_folder: Callable[..., Path]) -> None:
    src = make_image_folder(tmp_path / "src", per_class=1)
    manifest = packer.pack(src, tmp_path / "out", PackOptions(resize=16, crop=12), crop=8, workers=0, progress=False)
    assert manifest is not None and manifest.shape == [3, 8, 8]
    assert manifest.transform["resize"] == {"shorter_side": 16}


@pytest.mark.parametrize(("settings", "message"), [
    ({"storage": "zip"}, "storage 'zip' is not one of"),
    ({"shard_size": 0}, "shard_size 0 must be a positive number of bytes"),
    ({"quality": 101}, "quality 101 is not between 1 and 100"),
    ({"encoding": "png"}, "encoding 'png' is not one of"),
    ({"crop": -3}, "crop"),
])
def test_a_bad_setting_is_refused_when_the_options_are_made(settings: dict, message: str) -> None:
    with pytest.raises(PackError, match=message):
        PackOptions(**settings)


def test_an_unknown_keyword_is_named_with_the_verb(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"pack_items\(\) got an unexpected keyword argument 'sharding'"):
        packer.pack_items([], tmp_path / "out", sharding=3)
