"""The ``packer`` command line: a thin layer over ``packer.pack``, ``packer.info`` and ``packer.verify``.

Errors the user can fix (bad input files, options, destination, a damaged dataset, a file-system error)
print as one line and exit with status 1, without a traceback; SIGINT exits with 130 and SIGTERM with 143,
after the command removed its temporaries. Both are mapped in one place, ``_Packer.invoke``. Text that
came from a dataset or a source (class names, file names, skipped paths, manifest fields) is printed
through ``say``, which escapes what a terminal would obey.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import click

from packer.appending import append
from packer.errors import PackError
from packer.image.resampling import RESAMPLERS
from packer.image.transforms import TransformSpec
from packer.joining import join_datasets
from packer.merging import merge_parts
from packer.options import PackOptions
from packer.packing import ON_ERROR, pack
from packer.run.cleanup import Terminated, sigterm_raises
from packer.run.partitions import Part, parse_part
from packer.run.ray_runner import ray_runner
from packer.source.labels_file import declare_field
from packer.source.scan import LABEL_KINDS
from packer.tools.inspection import DatasetInfo, class_counts, describe_transform, info
from packer.tools.showing import show
from packer.tools.verification import verify
from packer.version import __version__
from reader.format import ENCODINGS, MANIFEST_NAME, STORAGES, FormatError, Manifest, load_manifest
from reader.format.fields import FieldSpec, printable

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SHOWN_SKIPPED = 10


class ByteSize(click.ParamType):
    """A byte count with an optional unit: ``1000000``, ``512MB``, ``1.5GiB`` (KB = 1000, KiB = 1024)."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else ""
        if not match or unit not in _UNITS:
            self.fail(f"{value!r} is not a size such as 512MB, 1GiB or 1000000", param, ctx)
        return int(float(match.group(1)) * _UNITS[unit])


class ImageSize(click.ParamType):
    """``N`` (one number) or ``WxH``, width first as image tools write sizes; converted to the Python
    API's ``(height, width)``."""

    name = "N|WxH"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.name

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | tuple[int, int]:
        if isinstance(value, (int, tuple)):
            return value
        text = str(value).strip().lower()
        if re.fullmatch(r"[1-9]\d*", text):
            return int(text)
        match = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", text)
        if not match:
            self.fail(f"{value!r} is not a size: give N or WxH, e.g. 256 or 320x240", param, ctx)
        return int(match.group(2)), int(match.group(1))


class PartOption(click.ParamType):
    """``I/N`` or ``slurm`` (``packer.run.partitions.parse_part``), checked before anything is read."""

    name = "I/N|slurm"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> Part:
        if isinstance(value, Part):
            return value
        try:
            return parse_part(str(value))
        except PackError as e:
            self.fail(str(e), param, ctx)


class CommaSeparated(click.ParamType):
    """A comma-separated list of values of the ``item`` type, e.g. ``1,2,4``."""

    def __init__(self, item: click.ParamType) -> None:
        self.item = item
        self.name = f"{item.name}[,...]"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> list:
        if isinstance(value, list):
            return value
        items = [item.strip() for item in str(value).split(",") if item.strip()]
        if not items:
            self.fail(f"{value!r} names no {self.item.name}", param, ctx)
        return [self.item.convert(item, param, ctx) for item in items]


class FieldDeclaration(click.ParamType):
    """``NAME:TYPE``, ``NAME:vector:LENGTH`` or ``NAME:labels:CLASS,...`` (``packer.source.labels_file``)."""

    name = "NAME:TYPE"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> FieldSpec:
        if isinstance(value, FieldSpec):
            return value
        try:
            return declare_field(str(value))
        except PackError as e:
            self.fail(str(e), param, ctx)


class _Packer(click.Group):
    """The command group; every command's errors become one line here, the only place (``_one_line``)."""

    def invoke(self, ctx: click.Context) -> object:
        with sigterm_raises():
            try:
                return super().invoke(ctx)
            except (Terminated, KeyboardInterrupt) as e:
                signal_name = str(e) or "SIGINT"
                click.echo(f"Error: interrupted ({signal_name}); no temporary file was left: rerun the same "
                           "command to resume", err=True)
                raise SystemExit(130 if isinstance(e, KeyboardInterrupt) else 143) from None
            except (PackError, FormatError, OSError, UnicodeError) as e:
                raise click.ClickException(_one_line(e)) from None


def _one_line(error: Exception) -> str:
    """What the user reads for an error: its message, with the dataset's text made printable (``say``).
    An ``OSError`` is named by its file and reason."""
    if isinstance(error, OSError) and error.filename is not None:
        where = error.filename if isinstance(error.filename, (str, bytes)) else str(error.filename)
        return printable(f"{os.fsdecode(where)}: {error.strerror or error}")
    return printable(str(error))


def say(text: str = "", err: bool = False) -> None:
    """Print one line for people: characters a terminal would obey (escapes, newlines, bidi overrides)
    in text that came from a dataset or a source are shown escaped (``printable``)."""
    click.echo(printable(text), err=err)


@click.group(cls=_Packer)
@click.version_option(__version__, prog_name="packer")
def main() -> None:
    """Pack an image folder once into LMDB or HDF5 shards; inspect and verify packed datasets."""


@main.command("pack")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--labels", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="CSV of path,label[,FIELD...] rows or a .jsonl file (paths relative to SRC) instead of class "
              "sub-folders; other columns or keys become each record's fields.")
@click.option("--field", "fields", type=FieldDeclaration(), multiple=True,
              help="Declare a labels-file field's type instead of inferring it: NAME:int|float|str|labels|boxes, "
              "NAME:vector:LENGTH, NAME:labels:CLASS,CLASS,... (repeatable).")
@click.option("--format", "storage", type=click.Choice(STORAGES), default=PackOptions.storage, show_default=True,
              help="Shard container.")
@click.option("--resize", type=ImageSize(), help="Shorter side to N (aspect kept), or exactly WxH.")
@click.option("--crop", type=ImageSize(), help="Center crop to N x N or WxH, after the resize.")
@click.option("--encoding", type=click.Choice(ENCODINGS), default=PackOptions.encoding, show_default=True,
              help="raw: uint8 CHW pixels; jpeg: baseline JPEG.")
@click.option("--quality", type=click.IntRange(1, 100), default=PackOptions.quality, show_default=True,
              help="JPEG quality (only with --encoding jpeg).")
@click.option("--shard-size", type=ByteSize(), default=PackOptions.shard_size, show_default="512MiB",
              help="Payload bytes per shard, e.g. 512MB or 1GiB.")
@click.option("--workers", type=click.IntRange(min=0), help="Processes [default: all cores; 0 = in-process].")
@click.option("--on-error", type=click.Choice(ON_ERROR), default="fail", show_default=True,
              help="fail: stop at the first unreadable image; skip: leave it out and list it.")
@click.option("--force", is_flag=True, help="Overwrite a finished dataset, or pack into a non-empty DST.")
@click.option("--max-pixels", type=click.IntRange(min=1), default=PackOptions.max_pixels, show_default=True,
              help="Images with more pixels are refused as decompression bombs.")
@click.option("--max-file-size", "max_file_bytes", type=ByteSize(), default=PackOptions.max_file_bytes,
              show_default="1GiB",
              help="Source files larger than this are refused (a per-file error).")
@click.option("--label-kind", type=click.Choice(LABEL_KINDS), default="auto", show_default=True,
              help="CSV labels: index (integers 0..N-1), name (class names), auto (refuses a mix).")
@click.option("--partitions", type=click.IntRange(min=1),
              help="Cut the plan into this many partitions [default: from the plan alone, at least ~32 MiB "
              "of records each: docs/packing.md, Partitions].")
@click.option("--part", type=PartOption(),
              help="Pack only task I's share of the partitions (I/N, 0-based), or `slurm` to read "
              "SLURM_ARRAY_TASK_ID/_COUNT/_MIN; then `packer merge DST` once every task is done.")
@click.option("--ray", "ray_address", type=str, is_flag=False, flag_value="local", metavar="[ADDRESS]",
              help="Pack the partitions as Ray tasks: on a local Ray instance (no ADDRESS; --workers CPUs), or "
              "on the cluster at ADDRESS (auto, host:port, ray://host:port). Needs the ray extra.")
@click.option("--resampler", type=click.Choice(RESAMPLERS),
              help="Who resizes [default: pil with pillow-simd, torch with plain Pillow].")
@click.option("--append", is_flag=True,
              help="Add SRC's images to the finished dataset DST as new shards, with DST's own settings "
              "(classes extended by name, the manifest swapped atomically).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def pack_command(src: Path, dst: Path, labels: Path | None, fields: tuple[FieldSpec, ...], storage: str,
                 resize: int | tuple[int, int] | None, crop: int | tuple[int, int] | None,
                 encoding: str, quality: int, shard_size: int, workers: int | None, on_error: str,
                 force: bool, max_pixels: int, max_file_bytes: int, label_kind: str,
                 partitions: int | None, part: Part | None, ray_address: str | None, resampler: str | None,
                 append: bool, quiet: bool) -> None:
    """Pack the images under SRC (one sub-folder per class, or --labels) into the dataset DST."""
    if append:
        _append_command(src, dst, labels, label_kind, workers, on_error, shard_size, max_file_bytes, quiet)
        return
    source = click.get_current_context().get_parameter_source("quality")
    if source == click.core.ParameterSource.COMMANDLINE and encoding != "jpeg":
        raise click.UsageError("--quality sets the JPEG quality: it needs --encoding jpeg")
    names = [field.name for field in fields]
    repeated = [name for name in names if names.count(name) > 1]
    if repeated:
        raise click.BadParameter(f"field {repeated[0]!r} is declared twice", param_hint="'--field'")
    options = PackOptions(storage=storage, resize=resize, crop=crop, encoding=encoding, quality=quality,
                          shard_size=shard_size, max_pixels=max_pixels, max_file_bytes=max_file_bytes,
                          resampler=resampler)
    manifest = pack(src, dst, options, labels=labels, workers=workers, on_error=on_error, force=force,
                    progress=not quiet, label_kind=label_kind, partitions=partitions, part=part,
                    fields={field.name: field for field in fields},
                    runner=None if ray_address is None else ray_runner(ray_address, workers or None))
    if manifest is None:
        say(f"packed part {part} at {dst}; run `packer merge {dst}` once every part is done")
    else:
        _print_pack_summary(dst, manifest)


@main.command("merge")
@click.argument("dst", type=click.Path(path_type=Path))
@click.argument("inputs", nargs=-1, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="With datasets to join (deprecated form): see `packer join`.")
def merge_command(dst: Path, inputs: tuple[Path, ...], force: bool) -> None:
    """Finish DST, packed part by part with `pack --part`: check every part, then write the manifest.
    (`merge OUT A B ...`, the old spelling of `packer join OUT A B ...`, still works, with a note.)"""
    if not inputs:
        _print_pack_summary(dst, merge_parts(dst))
        return
    click.echo("note: `packer merge OUT A B ...` is now `packer join OUT A B ...`; this form will go", err=True)
    _join(dst, inputs, force)


@main.command("join")
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite a finished dataset at OUT.")
def join_command(out: Path, inputs: tuple[Path, ...], force: bool) -> None:
    """Join the finished datasets INPUTS (same pre-transform) into the new dataset OUT: shards are
    hard-linked where they can be (no bytes copied), classes are united by name."""
    _join(out, inputs, force)


def _join(out: Path, inputs: tuple[Path, ...], force: bool) -> None:
    report = join_datasets(out, list(inputs), force=force)
    manifest = report.manifest
    how = f"{report.linked} hard-linked (no bytes copied), {report.copied} copied"
    say(f"joined {len(inputs)} datasets into {out}: {manifest.num_records} images in "
        f"{len(manifest.classes)} classes, {len(manifest.shards)} shards ({how})")


@main.command("info")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--classes", "with_classes", is_flag=True,
              help="Also list every class with its number of records (reads the record tables).")
def info_command(dataset: Path, as_json: bool, with_classes: bool) -> None:
    """Show what the packed DATASET holds and how it was made."""
    summary = info(dataset)
    counts = class_counts(dataset) if with_classes else None
    if as_json:
        click.echo(json.dumps({**summary.to_dict(), **({"class_counts": counts} if with_classes else {})}, indent=2))
        return
    _print_info(summary)
    for name, count in (counts or {}).items():
        say(f"  class {name}: {count}")


@main.command("show", context_settings={"ignore_unknown_options": True})  # -1: an index (the last), not an option
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("indices", nargs=-1, required=True, type=int)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
              help="Folder to write the PNG files into.")
@click.option("--sheet", is_flag=True, help="One contact sheet (sheet.png) instead of one PNG per record.")
def show_command(dataset: Path, indices: tuple[int, ...], out: Path, sheet: bool) -> None:
    """Write records INDICES of DATASET as PNG files, with their label, source path and fields.

    A negative index counts from the end (-1 is the last record)."""
    for record in show(dataset, list(indices), out, sheet=sheet):
        fields = f" {json.dumps(record.fields)}" if record.fields else ""
        say(f"{record.index}: {record.label if record.label is not None else '(no label)'} "
            f"{record.source or '(source not stored)'}{fields} -> {record.file}")


@main.command("verify")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--deep", is_flag=True, help="Also read back and decode every record.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def verify_command(dataset: Path, deep: bool, quiet: bool) -> None:
    """Check every shard of DATASET against its manifest (checksums, record tables; --deep: records)."""
    report = verify(dataset, deep=deep, progress=not quiet)
    for problem in report.problems:
        say(f"error: {problem}", err=True)
    checked = f"{report.shards} shards, {report.records} records, {_megabytes(report.bytes)}"
    if not report.ok:
        raise click.ClickException(f"{dataset}: {len(report.problems)} problems in {checked}")
    say(f"ok: {dataset}: {checked}{' (deep: every record read back)' if deep else ''}")


@main.command("bench")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--baseline", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The original image folder: also time an ImageFolder-style reader on it.")
@click.option("--orders", type=CommaSeparated(click.STRING), default="quasi_random", show_default=True,
              help="Comma-separated orders to time: sequential, random, quasi_random.")
@click.option("--workers", "workers", type=CommaSeparated(click.IntRange(min=0)), default="2", show_default=True,
              help="Comma-separated loader worker counts to time.")
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--model-ms", type=click.FloatRange(min=0), help="Simulate a training step of this many ms "
              "and report the share of each step spent waiting for data.")
@click.option("--cold", is_flag=True, help="Drop the page cache before every epoch (root only).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a bar chart of images/s to this PNG (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def bench_command(dataset: Path, baseline: Path | None, orders: list[str], workers: list[int], batch_size: int,
                  epochs: int, model_ms: float | None, cold: bool, plot: Path | None,
                  as_json: bool) -> None:
    """Time reading DATASET per epoch: images/s, MB/s, first-batch latency, worker memory."""
    from packer.tools import bench

    # Checked before any epoch is timed: time.sleep fails on inf/nan only after the first batch, and a
    # plot's missing folder only after the whole run.
    if model_ms is not None and not math.isfinite(model_ms):
        raise click.BadParameter(f"{model_ms} is not a finite number of ms", param_hint="'--model-ms'")
    if plot is not None and not plot.parent.is_dir():
        raise click.BadParameter(f"{plot.parent} is not a directory, so {plot} cannot be written",
                                 param_hint="'--plot'")
    settings = bench.Settings(batch_size=batch_size, epochs=epochs, model_ms=model_ms, cold=cold)
    try:
        results = bench.bench_packed(dataset, settings, orders=orders, workers=workers)
        if baseline is not None:
            spec = TransformSpec.from_description(load_manifest(dataset).transform)
            results += bench.bench_folder(baseline, spec, settings, workers=workers)
        if plot is not None:
            bench.plot(results, plot, title=f"packer bench {dataset.name} (batch {batch_size})")
    except (RuntimeError, ValueError) as e:  # from torch and matplotlib: a bad setting for this machine
        raise click.ClickException(_one_line(e)) from None
    if as_json:
        click.echo(json.dumps(bench.as_json_rows(results), indent=2))
    else:
        click.echo(bench.format_table(results))


# --append packs with DST's own PackOptions: every option that sets one is refused, but for those an append
# may choose (they decide how the new shards are cut, not what a record is), and so are DST-wide ones.
_APPEND_CHOOSES = ("shard_size", "max_file_bytes")
_SET_BY_DST = tuple(field.name for field in dataclasses.fields(PackOptions) if field.name not in _APPEND_CHOOSES) \
    + ("fields", "force", "partitions", "part", "ray_address")


def _append_command(src: Path, dst: Path, labels: Path | None, label_kind: str, workers: int | None,
                    on_error: str, shard_size: int, max_file_bytes: int, quiet: bool) -> None:
    """``pack --append``: refuse options that would change how DST is packed, then append."""
    ctx = click.get_current_context()
    given = [name for name in _SET_BY_DST
             if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    if given:
        option = next(p for p in ctx.command.params if p.name == given[0]).opts[0]
        raise click.UsageError(f"--append packs with DST's own settings: leave out {option}")
    before = load_manifest(dst).num_records if (dst / MANIFEST_NAME).is_file() else None
    manifest = append(src, dst, labels=labels, label_kind=label_kind, workers=workers, on_error=on_error,
                      shard_size=shard_size, progress=not quiet, max_file_bytes=max_file_bytes)
    if manifest.num_records == before:
        say(f"nothing added: {src} was appended to {dst} already (unchanged since); {dst} holds "
            f"{manifest.num_records} images")
        return
    _print_pack_summary(dst, manifest)


def _print_pack_summary(dst: Path, manifest: Manifest) -> None:
    skipped = manifest.source["skipped"]
    say(
        f"packed {manifest.num_records} images into {len(manifest.shards)} {manifest.storage} shards "
        f"({_megabytes(manifest.total_bytes)}) at {dst}"
    )
    if skipped:
        say(f"skipped {len(skipped)} files:")
        for entry in skipped[:_SHOWN_SKIPPED]:
            say(f"  {entry['path']}: {entry['reason']}")
        if len(skipped) > _SHOWN_SKIPPED:
            say(f"  ... and {len(skipped) - _SHOWN_SKIPPED} more (all listed by `packer info`)")


def _print_info(summary: DatasetInfo) -> None:
    classes = ", ".join(summary.classes[:5]) + (", ..." if len(summary.classes) > 5 else "")
    encoding = summary.encoding + (f" (quality {summary.jpeg_quality})" if summary.jpeg_quality else "")
    source = summary.source
    rows = [
        ("dataset", summary.path),
        ("records", f"{summary.records} in {len(summary.classes)} classes ({classes})" if summary.labelled
         else f"{summary.records}, unlabelled"),
        ("fields", "; ".join(FieldSpec.from_json(f, summary.path).declaration() for f in summary.fields)
         or "none"),
        ("shards", "; ".join([f"{summary.shards} {summary.storage} files, {_megabytes(summary.bytes_on_disk)} on disk",
                              *_shard_problems(summary)])),
        ("encoding", encoding),
        ("shape", "variable (no crop)" if summary.shape is None else "x".join(map(str, summary.shape))),
        ("transform", describe_transform(summary.transform)),
        ("source", f"{source.get('kind')} {source.get('root')}: {source.get('files')} files, "
                   f"{source.get('packed')} packed, {len(summary.skipped)} skipped"),
        ("tool", f"packer {summary.tool_version}, format version {summary.format_version}"),
    ]
    for key, value in rows:
        say(f"{key:<10} {value}")
    for problem in summary.damaged_shards:
        say(f"  damaged {problem}")
    for entry in summary.skipped:
        say(f"  skipped {entry['path']}: {entry['reason']}")


def _shard_problems(summary: DatasetInfo) -> list[str]:
    """What ``info`` flags in its shards row: missing shards (the first three), damaged ones (named on
    lines of their own), and where to look next."""
    missing, damaged = summary.missing_shards, summary.damaged_shards
    flags = ([f"{len(missing)} MISSING ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"]
             if missing else []) + ([f"{len(damaged)} DAMAGED (below)"] if damaged else [])
    return [*flags, "run packer verify"] if flags else []


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
