"""This project's loader and FFCV 1.0.2 side by side, in one run, on the same pre-cropped images.

    python scripts/bench_ffcv.py prepare DATA --ffcv-python PY [--set raw-lmdb] [--encodings jpeg,raw]
        # .npy export of DATA/SET's pixels + FFCV .betons of them
    python scripts/bench_ffcv.py compare DATA --ffcv-python PY [--rounds 3] [--epochs 3] [--cold-root MNT]
        [--before CHECKOUT]   # also run another checkout's loader in every round (before/after)

FFCV lives in its own virtual environment (``--ffcv-python``: its interpreter), never as a
dependency of this project: the script calls it through a subprocess, and runs this project's loader
in a subprocess of its own, so each reader starts with fresh worker processes. ``DATA`` holds the
packed sets ``raw-lmdb`` and ``jpeg-lmdb`` (``scripts/bench_read`` makes them, ``--resize 256 --crop
224``); ``prepare`` exports the pixels (the pre-cropped images) and labels of the set ``--set`` (default
``raw-lmdb``; a JPEG set's records decoded) to ``.npy`` and writes FFCV's ``.beton``s of the
``--encodings`` from them: ``jpeg.beton`` with ``RGBImageField(write_mode="jpg", jpeg_quality=90,
max_resolution=224)`` and ``raw.beton`` with ``write_mode="raw"``.

``compare`` alternates rounds (ours, FFCV, ours, FFCV, ...) so that load from other processes falls
on both, and prints per encoding the median warm img/s (epochs 2 and later, page cache warm), the
ratio, the epoch-2 first batch, and the decode bound: simplejpeg decoding every record of the packed
JPEG set on one core, times the cores used. With ``--cold-root`` (a ``slowdisk`` mount holding copies
of ``jpeg-lmdb`` and ``jpeg.beton``) each round also reads one cold epoch of each under
``slowdisk run``. Both readers: batch 256, 2 workers (FFCV: 2 threads), random order for FFCV
(``OrderOption.RANDOM``, ``os_cache=True``), ``quasi_random`` (the default) for ours.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH = 256


def run_ours(dataset: str, epochs: int, workers: int, threads: int | None) -> list[dict]:
    """Per-epoch figures of ``make_loader`` over a packed dataset (runs in this project's venv)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from reader import PackedDataset, make_loader

    kwargs = {} if threads is None else {"decode_threads": threads}
    loader = make_loader(PackedDataset(dataset, **kwargs), BATCH, num_workers=workers)
    return _epochs(loader, epochs, set_epoch=True, pids=lambda: worker_pids(loader))


def run_ffcv(beton: str, epochs: int, workers: int, order: str = "random", disk=None) -> list[dict]:
    """Per-epoch figures of FFCV's Loader over a .beton (runs in FFCV's venv): ``order`` "random"
    (``OrderOption.RANDOM``, ``os_cache=True``) or "quasi_random" (``QUASI_RANDOM``, which FFCV allows
    only with ``os_cache=False``: its own page-sized reads and memory)."""
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor

    quasi = order == "quasi_random"
    loader = Loader(beton, batch_size=BATCH, num_workers=workers,
                    order=OrderOption.QUASI_RANDOM if quasi else OrderOption.RANDOM,
                    os_cache=not quasi, drop_last=False,
                    pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()],
                               "label": [IntDecoder(), ToTensor()]})
    return _epochs(loader, epochs, set_epoch=False, pids=lambda: [], disk=disk)


def _epochs(loader, epochs: int, *, set_epoch: bool, pids, disk=None) -> list[dict]:
    """Per epoch: img/s, the first batch's wait, this process's peak RSS, and the CPU seconds that
    this process and ``pids()`` (the reader's worker processes) spent per image, which load from other
    processes on a shared machine disturbs far less than img/s, and this process's own CPU seconds
    (the work that competes with the training step). With ``disk`` (a callable returning the bytes and
    IOs a disk has served so far: ``bench_cold.disk_reads``) also what it served during each epoch,
    ``read_bytes`` and ``ios``: whether every epoch of a set larger than RAM was read from it again."""
    rows = []
    served = disk() if disk else None  # an epoch's end is the next one's start: no read falls between
    for epoch in range(epochs):
        if set_epoch:
            loader.set_epoch(epoch)
        cpu_start, main_start = _cpu_seconds([os.getpid(), *pids()]), _cpu_seconds([os.getpid()])
        start = time.perf_counter()
        first = None
        images = 0
        for batch in loader:
            if first is None:
                first = time.perf_counter() - start
            images += len(batch[1])
        seconds = time.perf_counter() - start
        cpu = _cpu_seconds([os.getpid(), *pids()]) - cpu_start
        rows.append({"epoch": epoch + 1, "images": images, "img_s": images / seconds,
                     "img_per_cpu_s": images / cpu if cpu > 0 else 0.0,
                     "main_cpu_s": _cpu_seconds([os.getpid()]) - main_start,
                     "first_batch_ms": 1000 * first, "max_rss_mb": _max_rss_mb()})
        if served is not None:
            now = disk()
            rows[-1].update(read_bytes=now[0] - served[0], ios=now[1] - served[1])
            served = now
    return rows


def worker_pids(loader) -> list[int]:
    """The pids of a DataLoader's running workers, for their CPU time (a private attribute: fine in a
    benchmark, not in the reader)."""
    return [w.pid for w in getattr(loader._iterator, "_workers", [])]


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes, all their threads, from ``/proc``."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def decode_bound(dataset: str) -> float:
    """simplejpeg decoding every record of a packed JPEG set on one core (img/s), best of 3 passes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import simplejpeg

    from reader import PackedDataset

    data = PackedDataset(dataset)
    payloads = []
    for shard, meta in enumerate(data.manifest.shards):
        blob = (Path(dataset) / meta.file).read_bytes()
        starts = data._shard_starts
        for record in range(starts[shard], starts[shard] + meta.records):
            offset, nbytes = int(data._offsets[record]), int(data._nbytes[record])
            payloads.append(blob[offset:offset + nbytes])
    out = np.empty((224, 224, 3), np.uint8)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for payload in payloads:
            simplejpeg.decode_jpeg(payload, colorspace="RGB", fastdct=True, fastupsample=True,
                                   buffer=out)
        best = max(best, len(payloads) / (time.perf_counter() - start))
    return best


def export_npy(data: Path, source: str) -> None:
    """The pixels of the packed set ``data/source`` as ``images.npy`` (N, 224, 224, 3) and ``labels.npy``
    (runs in our venv)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np

    from reader import PackedDataset

    dataset = PackedDataset(data / source)
    images = np.lib.format.open_memmap(data / "images.npy", "w+", np.uint8, (len(dataset), 224, 224, 3))
    for start in range(0, len(dataset), BATCH):
        batch, _ = dataset.read_batch(list(range(start, min(start + BATCH, len(dataset)))))
        images[start:start + len(batch)] = batch.permute(0, 2, 3, 1).numpy()
    images.flush()
    np.save(data / "labels.npy", dataset.targets.astype(np.int64))


def write_betons(data: Path, encodings: list[str]) -> None:
    """FFCV's .betons of the exported images, JPEG q90 and/or raw (runs in FFCV's venv)."""
    import numpy as np
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    images = np.load(data / "images.npy", mmap_mode="r")
    labels = np.load(data / "labels.npy")

    class Pairs:
        def __len__(self) -> int:
            return len(labels)

        def __getitem__(self, i: int):
            return np.ascontiguousarray(images[i]), int(labels[i])

    for name, mode in (("jpeg", "jpg"), ("raw", "raw")):
        if name not in encodings:
            continue
        writer = DatasetWriter(str(data / f"{name}.beton"), {
            "image": RGBImageField(write_mode=mode, jpeg_quality=90, max_resolution=224),
            "label": IntField()}, num_workers=2)
        writer.from_indexed_dataset(Pairs())


def _child(python: str, *args: str, slow: bool = False, script: str = __file__) -> list[dict]:
    command = [python, script, *args]
    if slow:
        slowdisk = Path(__file__).resolve().parent / "slowdisk"
        command = [os.environ.get("SLOWDISK", str(slowdisk)), "run", *command]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> None:
    data, ffcv_py, ours_py = Path(args.data), args.ffcv_python, sys.executable
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    figures: dict[str, list] = {}
    bound = max(_child(ours_py, "bound", str(data / "jpeg-lmdb")) for _ in range(2))
    for round_ in range(args.rounds):
        for encoding in args.encodings.split(","):
            ours = _child(ours_py, "ours", str(data / f"{encoding}-lmdb"), "--epochs", str(args.epochs),
                          "--workers", str(args.workers), *threads)
            peer = _child(ffcv_py, "ffcv", str(data / f"{encoding}.beton"), "--epochs", str(args.epochs),
                          "--workers", str(args.workers))
            figures.setdefault(f"{encoding} ours", []).append(ours)
            figures.setdefault(f"{encoding} ffcv", []).append(peer)
            line = (f"round {round_ + 1} {encoding}: ours " + " ".join(f"{r['img_s']:,.0f}" for r in ours)
                    + " | ffcv " + " ".join(f"{r['img_s']:,.0f}" for r in peer))
            if args.before:
                before = _child(ours_py, "ours", str(data / f"{encoding}-lmdb"), "--epochs",
                                str(args.epochs), "--workers", str(args.workers),
                                script=str(Path(args.before) / "scripts" / "bench_ffcv.py"))
                figures.setdefault(f"{encoding} before", []).append(before)
                line += " | before " + " ".join(f"{r['img_s']:,.0f}" for r in before)
            print(line, flush=True)
        if args.cold_root:
            cold = Path(args.cold_root)
            ours = _child(ours_py, "ours", str(cold / "jpeg-lmdb"), "--epochs", "1", "--workers",
                          str(args.workers), *threads, slow=True)
            peer = _child(ffcv_py, "ffcv", str(cold / "jpeg.beton"), "--epochs", "1", "--workers",
                          str(args.workers), slow=True)
            figures.setdefault("cold jpeg ours", []).append(ours)
            figures.setdefault("cold jpeg ffcv", []).append(peer)
            print(f"round {round_ + 1} cold jpeg: ours {ours[0]['img_s']:,.0f} | ffcv "
                  f"{peer[0]['img_s']:,.0f}", flush=True)
    print(f"\nbatch {BATCH}, {args.workers} workers, {args.rounds} alternating rounds of "
          f"{args.epochs} epochs; warm = median of epochs 2..{args.epochs} over all rounds")
    print(f"decode bound (simplejpeg, 1 core): {bound:,.0f} img/s; 2 cores: {2 * bound:,.0f} img/s")
    for key in ("raw", "jpeg", "cold jpeg"):
        if f"{key} ours" not in figures:
            continue
        skip = 0 if key.startswith("cold") else 1
        ours = [r["img_s"] for run in figures[f"{key} ours"] for r in run[skip:]]
        peer = [r["img_s"] for run in figures[f"{key} ffcv"] for r in run[skip:]]
        mine, theirs = statistics.median(ours), statistics.median(peer)
        rounds = zip(figures[f"{key} ours"], figures[f"{key} ffcv"])
        ratios = [statistics.median([r["img_s"] for r in a[skip:]]) / statistics.median([r["img_s"] for r in b[skip:]])
                  for a, b in rounds]
        line = (f"{key:9s} ours {mine:8,.0f} img/s  ffcv {theirs:8,.0f} img/s  ratio {mine / theirs:.2f}x"
                "  (per-round ratios " + ", ".join(f"{ratio:.2f}" for ratio in ratios) + ")")
        if key == "jpeg":
            line += f"  {mine / (2 * bound):.0%} of the 2-core decode bound"
        print(line)
        per_cpu = {who: statistics.median([r["img_per_cpu_s"] for run in figures[f"{key} {who}"]
                                           for r in run[skip:]])
                   for who in ("ours", "ffcv", "before") if f"{key} {who}" in figures}
        print("          img per CPU-second (main + workers): " + ", ".join(
            f"{who} {value:,.0f}" for who, value in per_cpu.items())
              + f"; ours/ffcv {per_cpu['ours'] / per_cpu['ffcv']:.2f}x")
        if f"{key} before" in figures:
            before = statistics.median([r["img_s"] for run in figures[f"{key} before"] for r in run[1:]])
            print(f"          before (--before checkout): {before:,.0f} img/s, ratio {before / theirs:.2f}x;"
                  f" this checkout / before: {mine / before:.2f}x")
        if not key.startswith("cold"):
            firsts = [run[1]["first_batch_ms"] for run in figures[f"{key} ours"] if len(run) > 1]
            rss = [[round(r["max_rss_mb"]) for r in run] for run in figures[f"{key} ours"]]
            print(f"          ours epoch-2 first batch ms: {', '.join(f'{f:.1f}' for f in firsts)}; "
                  f"main-process max RSS MB per epoch: {rss}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("prepare", "compare"):
        p = sub.add_parser(name)
        p.add_argument("data")
        p.add_argument("--ffcv-python", required=True)
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--workers", type=int, default=2)
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--encodings", default="jpeg,raw")
        p.add_argument("--cold-root", default=None)
        p.add_argument("--before", default=None, help="another checkout of this project, run alongside")
        if name == "prepare":
            p.add_argument("--set", default="raw-lmdb", help="the packed set under DATA whose pixels FFCV packs")
    for name in ("ours", "ffcv"):
        p = sub.add_parser(name)
        p.add_argument("path")
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--workers", type=int, default=2)
        p.add_argument("--threads", type=int, default=None)
    sub.add_parser("bound").add_argument("path")
    p = sub.add_parser("export")
    p.add_argument("data")
    p.add_argument("--set", default="raw-lmdb")
    p = sub.add_parser("betons")
    p.add_argument("data")
    p.add_argument("--encodings", default="jpeg,raw")
    args = parser.parse_args()
    if args.command == "ours":
        print(json.dumps(run_ours(args.path, args.epochs, args.workers, args.threads)))
    elif args.command == "ffcv":
        print(json.dumps(run_ffcv(args.path, args.epochs, args.workers)))
    elif args.command == "bound":
        print(json.dumps(decode_bound(args.path)))
    elif args.command == "export":
        export_npy(Path(args.data), args.set)
    elif args.command == "betons":
        write_betons(Path(args.data), args.encodings.split(","))
    elif args.command == "prepare":
        subprocess.run([sys.executable, __file__, "export", args.data, "--set", args.set], check=True)
        subprocess.run([args.ffcv_python, __file__, "betons", args.data, "--encodings", args.encodings], check=True)
    else:
        compare(args)


if __name__ == "__main__":
    main()
