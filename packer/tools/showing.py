"""``show()``: records of a packed dataset written as PNG files (or one contact sheet) for people to look at.

Each PNG holds the record's pixels exactly as the reader returns them (``PackedDataset[i]``), and in
its text chunks the record's index, label, source path and fields (JSON), so a bad sample found in
training can be traced back to its file. A contact sheet tiles several records on a grey grid, each
with its index and label written under it, and lists every record's metadata in its text chunks.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageDraw
from PIL.PngImagePlugin import PngInfo

from packer.errors import PackError

_CAPTION = 14  # pixels of caption under each tile of a contact sheet
_GAP = 4
_GREY = (96, 96, 96)
_MIN_CELL = 64  # room for the caption under a small image


@dataclass(frozen=True)
class ShownRecord:
    """One record as shown: where it went, and what it is."""

    index: int
    label: str | None
    source: str | None
    fields: dict[str, Any]
    file: Path

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "label": self.label, "source": self.source, "fields": self.fields}


def show(
    dataset: str | os.PathLike, indices: Sequence[int], out: str | os.PathLike, sheet: bool = False
) -> list[ShownRecord]:
    """Write records ``indices`` of ``dataset`` as ``out/record-NNNNNNNN.png`` (or, with ``sheet``,
    all of them into ``out/sheet.png``); return what was written. Bad indices are a ``PackError``."""
    from reader import PackedDataset

    ds = PackedDataset(dataset)
    bad = [i for i in indices if not -len(ds) <= i < len(ds)]
    if bad or not indices:
        raise PackError(f"{dataset}: index {bad[0]} is out of range for {len(ds)} records" if bad
                        else f"{dataset}: give at least one record index")
    out = Path(out)
    if out.is_symlink() and not out.exists():
        raise PackError(f"{out}: a symlink to {os.readlink(out)!r}, which does not exist; --out must be a folder")
    if out.exists() and not out.is_dir():
        raise PackError(f"{out}: not a folder; --out must be a folder to write the PNG files into")
    out.mkdir(parents=True, exist_ok=True)
    records, images = [], []
    for index in (i % len(ds) for i in indices):
        pixels, label = ds[index]
        image = Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()), "RGB")
        name = ds.classes[label] if ds.manifest.labelled else None
        file = out / ("sheet.png" if sheet else f"record-{index:08d}.png")
        records.append(ShownRecord(index, name, ds.source(index), ds.fields(index), file))
        images.append(image)
    if sheet:
        metadata = _text({"records": [r.describe() for r in records]})
        _contact_sheet(images, records).save(records[0].file, pnginfo=metadata)
    else:
        for image, record in zip(images, records):
            image.save(record.file, pnginfo=_text(record.describe()))
    return records


def _contact_sheet(images: list[Image.Image], records: list[ShownRecord]) -> Image.Image:
    """The images on a grid of equal cells (the largest image's size), each captioned by index and label."""
    columns = max(1, int(np.ceil(np.sqrt(len(images)))))
    rows = -(-len(images) // columns)
    cell_w = max(_MIN_CELL, *(i.width for i in images)) + _GAP
    cell_h = max(i.height for i in images) + _CAPTION + _GAP
    sheet = Image.new("RGB", (columns * cell_w + _GAP, rows * cell_h + _GAP), _GREY)
    draw = ImageDraw.Draw(sheet)
    for k, (image, record) in enumerate(zip(images, records)):
        x, y = _GAP + (k % columns) * cell_w, _GAP + (k // columns) * cell_h
        sheet.paste(image, (x, y))
        draw.text((x, y + image.height + 1), f"#{record.index} {record.label or ''}"[:40], fill=(255, 255, 255))
    return sheet


def _text(data: dict[str, Any]) -> PngInfo:
    info = PngInfo()
    for key, value in data.items():
        info.add_itxt(key, value if isinstance(value, str) else json.dumps(value))
    return info
