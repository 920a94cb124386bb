"""Cold reads from a slow disk: every epoch against the disk's own sequential rate, measured in the same run.

    python scripts/bench_cold.py run --mnt MNT SET [SET ...] [--ffcv BETON [--ffcv-orders random,quasi_random]]
        [--epochs 1] [--orders quasi_random,random]
        [--before CHECKOUT] [--mem SIZE [--hold MB] [--grow MB]] [--start-method fork|spawn|forkserver]
        [--ranks N] [--workers 2]

Each ``SET`` is a packed dataset on the slow disk (``scripts/slowdisk up``: 100 MB/s, 200 read IOPS, on
cgroup v1 or v2; ``SLOWDISK`` names another such tool), written ``[LABEL=]PATH``. For each set: ``cat``
of its shard files under ``slowdisk run`` (the page cache dropped first): the disk's sequential rate;
then, per order, a loader (batch 256, ``--workers`` processes: 2 unless told, the setting the cold
figures in BENCHMARKS.md are taken with) reading ``--epochs`` epochs under ``slowdisk run``.
``--before CHECKOUT`` runs another checkout's reader on the same set right after (that checkout first on
``PYTHONPATH``); ``--ffcv`` adds FFCV 1.0.2's loader (as many threads; ``--ffcv-orders``: ``RANDOM``
with ``os_cache=True`` and ``QUASI_RANDOM``, its two cold settings; from ``--ffcv-python``, a venv of
its own, never a dependency of this project) over a ``.beton`` on the same disk; ``--mem`` runs the
readers with ``SLOW_MEM`` (memory and page cache capped: a set larger than that is read from the disk
every epoch); ``--hold MB`` makes each of our readers hold that much memory of its own first (as a CUDA
context and a model would), ``--grow MB`` right after its first batch (as memory a training job takes
once it runs would: a model moved to the GPU after the loader was made, CUDA's context started by the
first batch's ``.cuda()``); ``--start-method`` starts the loaders' workers so (``make_loader``'s
``multiprocessing_context``; spawned workers import torch themselves, memory the loader sees only once
they run); ``--ranks N`` runs each of our readers as N DDP ranks on this machine under torchrun (over
gloo), the ``--workers`` shared between them (at least one each), every rank reading its share of each
epoch and all-reducing a number after each batch, as DDP's gradient sync keeps ranks in step: the
figures are the job's (all ranks' images over the slowest rank's time, the last rank's first batch;
``--hold`` and ``--grow`` taken by each rank).

Reported per epoch: img/s, seconds, the first batch's wait, what the disk served during the epoch
(bytes, the number and mean size of its IOs: ``slowdisk counters``, the block throttle's counters for
the slow disk's device, read by the reader's process as each epoch starts and ends: the loader reads
the next epoch's first window while an epoch ends, so an epoch's bytes can exceed the set's), MB/s, the
disk's own rate (``cat``, below), the images per CPU-second of the reader's processes (the main one and
its workers, the workers' start included in the first epoch; FFCV: its one process) and the CPU-seconds
of the main process alone (the training process: what it spends there is taken from the training
step), and the epoch's time against the *payload bound*:
the payload bytes at the rate ``cat`` measured (``1.00x`` = the disk streamed nothing but payloads).
The disk's rate is the faster of ``CAT_ROUNDS`` cold ``cat`` runs: one run was seen 10% slow, which
flatters every ratio against it. For a JPEG set also the *decode bound*, the other physical limit: the
set's records at the rate its loader's number of processes decode them alone (the first 3,000 payloads,
each process decoding them all with the reader's decoder into one reused buffer, placed as the reader
places a batch's images; page cache warm), measured right before and right after each reader's run,
the faster of the two kept: a VM's speed moves by a quarter within an hour (6,300-9,900 img/s on one
day), so a bound taken once can be off for the run beside it. ``x bound`` is the epoch against the
slower of the two bounds, what the machine allows. Prints a markdown table; ``--json`` also writes the
rows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BATCH = 256  # as bench_ffcv's loaders
WORKERS = 2  # each reader's loader processes (FFCV: threads) unless --workers says
CAT_ROUNDS = 2  # cold cats of a set's shards; the fastest is the disk's rate (module docstring)
HERE = Path(__file__).resolve()
SLOWDISK = os.environ.get("SLOWDISK", str(HERE.parent / "slowdisk"))  # scripts/slowdisk: cgroup v1 or v2
CAT = ["sh", "-c", 'cat "$@" > /dev/null', "cat"]  # the files follow
START_METHODS = ("fork", "spawn", "forkserver")  # make_loader's multiprocessing_context
FFCV_ORDERS = {"random": "RANDOM os_cache", "quasi_random": "QUASI_RANDOM"}


def read_epochs(dataset: str, order: str, epochs: int, workers: int, hold_mb: int = 0,
                grow_mb: int = 0, start_method: str | None = None, ranked: bool = False) -> list[dict]:
    """Per-epoch figures of ``make_loader`` over a packed dataset (the reader on ``sys.path``). On a machine
    with CUDA the loader pins its batches, and CUDA is started first, as a training script's model is
    on the GPU before its first batch: else the first batch's wait would include CUDA's start. With
    ``hold_mb`` the process first holds that much memory of its own (written, so resident), as a CUDA
    context and a model would, before the loader is made; with ``grow_mb`` it takes that much more
    once it has received its first batch (``GrowsAtFirstBatch``); ``start_method`` is the loader's
    ``multiprocessing_context``. ``ranked``: this process is one rank under torchrun (``--ranks``); it
    reads its share, and the figures are the job's (``_whole_job``)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from bench_ffcv import _epochs, worker_pids

    from reader import PackedDataset, make_loader

    if ranked:
        dist.init_process_group("gloo")
    held = np.ones(hold_mb << 20, np.uint8)
    if torch.cuda.is_available():
        torch.empty(1).pin_memory()
    loader = make_loader(PackedDataset(dataset), BATCH, num_workers=workers, order=order,
                         multiprocessing_context=start_method)
    grown = InLockstep(GrowsAtFirstBatch(loader, grow_mb)) if ranked else GrowsAtFirstBatch(loader, grow_mb)
    rows = _epochs(grown, epochs, set_epoch=True, pids=lambda: worker_pids(loader), disk=epoch_disk())
    del held, grown  # held through the epochs
    if ranked:
        rows = _whole_job(rows)
        dist.destroy_process_group()
    return rows


class InLockstep:
    """A rank's epochs with one all-reduce after each batch, as DDP's gradient sync makes every step
    wait for the slowest rank."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        import torch
        import torch.distributed as dist

        step = torch.zeros(1)
        for batch in self.loader:
            yield batch
            dist.all_reduce(step)


def _whole_job(rows: list[dict]) -> list[dict]:
    """Each rank's per-epoch rows made the job's: the images of all ranks over the slowest rank's time,
    the first batch the last rank's, images per CPU-second of all the ranks' processes, and the main
    processes' CPU-seconds summed; the same rows on every rank."""
    import torch
    import torch.distributed as dist

    for row in rows:
        images, seconds = row["images"], row["images"] / row["img_s"]
        cpu = images / row["img_per_cpu_s"] if row["img_per_cpu_s"] else float("nan")  # unknown: none
        summed = torch.tensor([images, cpu, row["main_cpu_s"]], dtype=torch.float64)
        slowest = torch.tensor([seconds, row["first_batch_ms"]], dtype=torch.float64)
        dist.all_reduce(summed)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        images, cpu = int(summed[0]), float(summed[1])
        row.update(images=images, img_s=images / float(slowest[0]), first_batch_ms=float(slowest[1]),
                   img_per_cpu_s=images / cpu if cpu > 0 else 0.0, main_cpu_s=float(summed[2]))
    return rows


class GrowsAtFirstBatch:
    """A loader's epochs, taking ``grow_mb`` MB of memory (written, so resident) once its first batch is
    received: the memory a training job takes after its loader started reading."""

    def __init__(self, loader, grow_mb: int) -> None:
        self.loader = loader
        self.grow_mb = grow_mb
        self.held = None

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self):
        import numpy as np

        for batch in self.loader:
            yield batch
            if self.held is None and self.grow_mb:
                self.held = np.ones(self.grow_mb << 20, np.uint8)


def _python_path(checkout: str | Path) -> str:
    """``PYTHONPATH`` for a child reading with ``checkout``'s reader: the checkout first, then whatever the
    caller's ``PYTHONPATH`` holds (dependencies installed there, as on a machine without a venv)."""
    return os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))


def _output(command: list[str], env: dict[str, str]) -> str:
    """``command``'s stdout; its stderr passed on (a reader's warnings); where it fails, also its exit
    status, then exit."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode:
        raise SystemExit(f"bench_cold: {' '.join(command)} exited with status {done.returncode}")
    return done.stdout


COUNTERS_ENV = "BENCH_COLD_COUNTERS"  # set by ``measured`` for its reader: the slow disk's mount point


def epoch_disk():
    """In a reader run by ``measured`` (``COUNTERS_ENV`` set), the callable that gives the disk's counters
    at each epoch's start and end (``bench_ffcv._epochs``); None elsewhere."""
    mnt = os.environ.get(COUNTERS_ENV)
    return (lambda: disk_reads(mnt)) if mnt else None


def disk_reads(mnt: str) -> tuple[int, int]:
    """(bytes, IOs) the throttled group has read from the slow disk at ``mnt`` so far (``slowdisk
    counters``: the blkio or io controller's counters of that device)."""
    out = _output([SLOWDISK, "counters"], {**os.environ, "MNT": mnt})
    fields = out.split()
    if len(fields) != 3 or not (fields[1].isdigit() and fields[2].isdigit()):
        raise SystemExit(f"{SLOWDISK} counters printed {out!r}, not 'MAJ:MIN BYTES IOS'")
    return int(fields[1]), int(fields[2])


def measured(command: list[str], mnt: str, mem: str | None = None) -> tuple[float, int, int, str]:
    """Run ``command`` under ``slowdisk run``: (seconds, bytes read, IOs, stdout)."""
    env = {**os.environ, "MNT": mnt, COUNTERS_ENV: mnt}
    env.pop("SLOW_MEM", None)
    if mem:
        env["SLOW_MEM"] = mem
    before = disk_reads(mnt)
    start = time.perf_counter()
    out = _output([SLOWDISK, "run", *command], env)
    seconds = time.perf_counter() - start
    after = disk_reads(mnt)
    return seconds, after[0] - before[0], after[1] - before[1], out


def payload_bytes(dataset: Path) -> tuple[int, int, list[Path]]:
    """(payload bytes, shard file bytes, shard files) of a packed dataset, from its tables."""
    sys.path.insert(0, str(HERE.parents[1]))
    from reader.format import container, load_manifest

    manifest = load_manifest(dataset)
    files = [dataset / shard.file for shard in manifest.shards]
    payload = sum(int(container(manifest.storage).read_table(f, f, compressed=shard.compressed)["nbytes"].sum())
                  for f, shard in zip(files, manifest.shards))
    return payload, manifest.total_bytes, files


def run(args: argparse.Namespace) -> None:
    mnt = args.mnt
    rows = []
    per_rank = max(1, args.workers // args.ranks)  # the loader processes of each rank
    decoders = per_rank * args.ranks  # the decode bound's processes: as many as read
    for item in args.sets:
        label, _, path = item.rpartition("=")
        dataset = Path(path)
        label = label or dataset.name
        payload, shard_bytes, files = payload_bytes(dataset)
        seconds, nbytes, ios, _ = min(measured(CAT + [str(f) for f in files], mnt) for _ in range(CAT_ROUNDS))
        rate = shard_bytes / seconds
        bound = payload / rate
        print(f"{label}: payload {payload / 1e6:,.1f} MB, shards {shard_bytes / 1e6:,.1f} MB "
              f"({shard_bytes / payload:.3f}x); cat cold {seconds:.2f} s = {rate / 1e6:.1f} MB/s "
              f"({ios} IOs of {nbytes / max(ios, 1) / 1024:.0f} KiB; fastest of {CAT_ROUNDS}); "
              f"payload bound {bound:.2f} s", flush=True)
        readers = [(f"{label}", sys.executable, None)]
        if args.before:
            readers.append((f"{label} before", sys.executable, args.before))
        for name, python, checkout in readers:
            for order in args.orders.split(","):
                launcher, ranked = _launcher(args.ranks)
                command = ["env", f"PYTHONPATH={_python_path(checkout or HERE.parents[1])}", python,
                           *launcher, str(HERE), "read", str(dataset), *ranked, "--order", order,
                           "--epochs", str(args.epochs), "--workers", str(per_rank),
                           "--hold", str(args.hold), "--grow", str(args.grow),
                           *(["--start-method", args.start_method] if args.start_method else [])]
                decoding = _decode_bound(dataset, decoders)
                run_rows = _row(f"{name}, {order}", command, mnt, args.mem, payload, rate)
                after = _decode_bound(dataset, decoders)
                rows.extend(_against_decoding(run_rows, decoding, after, bound))
    if args.ffcv:
        beton = Path(args.ffcv)
        size = beton.stat().st_size
        seconds, nbytes, ios, _ = min(measured(CAT + [str(beton)], mnt) for _ in range(CAT_ROUNDS))
        print(f"{beton.name}: {size / 1e6:,.1f} MB; cat cold {size / seconds / 1e6:.1f} MB/s (fastest of {CAT_ROUNDS})",
              flush=True)
        if not args.ffcv_python:
            raise SystemExit("--ffcv needs --ffcv-python (or FFCV_PYTHON): the interpreter of FFCV's own venv")
        for order in args.ffcv_orders.split(","):
            command = [args.ffcv_python, str(HERE), "ffcv", str(beton), "--epochs", str(args.epochs),
                       "--order", order, "--workers", str(args.workers)]
            # its bound: the whole file at the rate cat read it (the JPEG payloads and FFCV's index)
            rows.extend(_row(f"FFCV 1.0.2, {FFCV_ORDERS[order]}", command, mnt, args.mem, size, size / seconds))
    print("\n| reader, order | epoch | img/s | s | first batch s | read MB | IOs | mean IO KiB | MB/s | cat MB/s "
          "| x payload bound | x decode bound | x bound | img per CPU-s | main process CPU-s |\n" + "|---" * 15 + "|")
    for row in rows:
        print(f"| {row['name']} | {row['epoch']} | {row['img_s']:,.0f} | {row['seconds']:.2f} | "
              f"{row['first_batch_s']:.2f} | {row['read_mb']} | {row['ios']} | {row['io_kib']} | "
              f"{row['mb_s']} | {row['cat_mb_s']} | {row['x_payload']} | {row.get('x_decode', '')} | "
              f"{row.get('x_bound', row['x_payload'])} | {row['img_cpu_s']:,.0f} | {row['main_cpu_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


def _launcher(ranks: int) -> tuple[list[str], list[str]]:
    """What runs a reader as ``ranks`` DDP ranks on this machine (torchrun, over gloo), and the flag
    that tells the reader so; nothing for one."""
    if ranks == 1:
        return [], []
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"], ["--ranked"]


def _against_decoding(rows: list[dict], before: float | None, after: float | None, payload_bound: float) -> list[dict]:
    """``rows`` with each epoch against the decode bound (the faster of the two taken around the run) and
    against the slower of that and the payload bound; unchanged for a set that stores pixels (its bound
    is the payload bound)."""
    if before is None or after is None:
        return rows
    decoding = min(before, after)
    print(f"    decode bound {decoding:.2f} s (before {before:.2f}, after {after:.2f})", flush=True)
    for row in rows:
        row["x_decode"] = f"{row['seconds'] / decoding:.2f}x"
        row["x_bound"] = f"{row['seconds'] / max(decoding, payload_bound):.2f}x"
    return rows


def _decode_bound(dataset: Path, workers: int) -> float | None:
    """Seconds the set's records take to decode alone, at the rate ``workers`` processes reach (module
    docstring); None for a set that stores pixels."""
    out = _output([sys.executable, str(HERE), "decode", str(dataset), "--workers", str(workers)],
                  {**os.environ, "PYTHONPATH": _python_path(HERE.parents[1])})
    figures = json.loads(out.strip().splitlines()[-1])
    if figures is None:
        return None
    print(f"  decode alone, {workers} processes: {figures['img_s']:,.0f} img/s; decode bound "
          f"{figures['records'] / figures['img_s']:.2f} s", flush=True)
    return figures["records"] / figures["img_s"]


def decode_alone(dataset: str, workers: int, count: int = 3000) -> dict | None:
    """``{"img_s", "records"}``: ``workers`` forked processes each decode the set's first ``count`` JPEG
    payloads with the reader's decoder into one reused buffer, started together; img/s of all of them.
    None for a set that stores pixels."""
    import multiprocessing

    import numpy as np
    import simplejpeg

    from reader import PackedDataset
    from reader.format import load_manifest
    from reader.format.jpeg_decode import decode_jpeg_into, placed_room, placed_span

    if load_manifest(Path(dataset)).encoding != "jpeg":
        return None
    source = PackedDataset(dataset, decode=False)
    payloads, _ = source.read_batch(np.arange(min(count, len(source))))
    arrays = [payload.numpy().tobytes() for payload in payloads]
    sizes = [simplejpeg.decode_jpeg_header(array)[:2] for array in arrays]
    start = multiprocessing.get_context("fork").Barrier(workers + 1)

    def placed(height: int, width: int) -> np.ndarray:  # where the reader's batches put an image
        flat = np.empty(placed_room(3 * height * width), np.uint8)
        return flat[placed_span(flat.ctypes.data, 3 * height * width)].reshape(height, width, 3)

    def decode_all() -> None:
        buffers = {size: placed(*size) for size in set(sizes)}
        start.wait()
        for array, size in zip(arrays, sizes):
            decode_jpeg_into(memoryview(array), buffers[size], fast=source.fast_decode)

    processes = [multiprocessing.get_context("fork").Process(target=decode_all) for _ in range(workers)]
    for process in processes:
        process.start()
    start.wait()
    began = time.perf_counter()
    for process in processes:
        process.join()
    return {"img_s": workers * len(arrays) / (time.perf_counter() - began), "records": len(source)}


def _row(name: str, command: list[str], mnt: str, mem: str | None, payload: int, rate: float) -> list[dict]:
    """Run one reader (all its epochs in one process): a row per epoch, with what the disk served during
    that epoch (the reader reads the counters itself) and the disk's rate ``rate`` (``cat``'s)."""
    seconds, nbytes, ios, out = measured(command, mnt, mem)
    rows = []
    for epoch in json.loads(out.strip().splitlines()[-1]):
        took, served, count = epoch["images"] / epoch["img_s"], epoch["read_bytes"], epoch["ios"]
        rows.append({"name": name, "epoch": epoch["epoch"], "img_s": epoch["img_s"], "seconds": took,
                     "first_batch_s": epoch["first_batch_ms"] / 1000, "read_mb": f"{served / 1e6:,.0f}",
                     "ios": count, "io_kib": f"{served / max(count, 1) / 1024:,.0f}",
                     "mb_s": f"{served / took / 1e6:.0f}", "cat_mb_s": f"{rate / 1e6:.1f}",
                     "payload_bound_s": payload / rate, "x_payload": f"{took / (payload / rate):.2f}x",
                     "img_cpu_s": epoch["img_per_cpu_s"], "main_cpu_s": epoch["main_cpu_s"]})
        print(f"  {name} epoch {epoch['epoch']}: {epoch['img_s']:,.0f} img/s, {took:.2f} s "
              f"({rows[-1]['x_payload']} the payload bound), first batch {rows[-1]['first_batch_s']:.2f} s, "
              f"disk {rows[-1]['read_mb']} MB in {count} IOs, {epoch['img_per_cpu_s']:,.0f} img per CPU-s "
              f"({epoch['main_cpu_s']:.2f} CPU-s in the main process)", flush=True)
    print(f"    disk, the whole run ({seconds:.1f} s, the dataset's open and the workers' start included): "
          f"{nbytes / 1e6:,.0f} MB in {ios} IOs", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("sets", nargs="+")
    p.add_argument("--mnt", required=True)
    p.add_argument("--orders", default="quasi_random")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--before")
    p.add_argument("--ffcv")
    p.add_argument("--ffcv-python", default=os.environ.get("FFCV_PYTHON"),
                   help="FFCV's venv interpreter [$FFCV_PYTHON]")
    p.add_argument("--ffcv-orders", default="random,quasi_random",
                   help="FFCV's orders: random (RANDOM, os_cache), quasi_random (QUASI_RANDOM)")
    p.add_argument("--mem")
    p.add_argument("--hold", type=int, default=0, help="MB each reader holds before its loader")
    p.add_argument("--grow", type=int, default=0, help="MB each reader takes after its first batch")
    p.add_argument("--start-method", choices=START_METHODS, help="how the loaders start workers")
    p.add_argument("--ranks", type=int, default=1,
                   help="DDP ranks per reader, under torchrun: the --workers shared (at least one each)")
    p.add_argument("--workers", type=int, default=WORKERS,
                   help=f"loader processes per reader (FFCV: threads; the decoder alone: processes) [{WORKERS}]")
    p.add_argument("--json")
    for name in ("read", "ffcv", "decode"):
        p = sub.add_parser(name)
        p.add_argument("path")
        p.add_argument("--order", default="quasi_random")
        p.add_argument("--epochs", type=int, default=1)
        p.add_argument("--workers", type=int, default=WORKERS)
        p.add_argument("--hold", type=int, default=0)
        p.add_argument("--grow", type=int, default=0)
        p.add_argument("--start-method", choices=START_METHODS)
        p.add_argument("--ranked", action="store_true", help="this process is a rank under torchrun")
    args = parser.parse_args()
    if args.command == "run":
        if args.ranks < 1 or args.workers < 1:
            parser.error(f"--ranks and --workers must be at least 1, not {args.ranks} and {args.workers}")
        run(args)
    elif args.command == "read":
        rows = read_epochs(args.path, args.order, args.epochs, args.workers, args.hold, args.grow,
                           args.start_method, args.ranked)
        if not args.ranked or os.environ["RANK"] == "0":  # under torchrun every rank has the job's rows
            print(json.dumps(rows))
    elif args.command == "decode":
        print(json.dumps(decode_alone(args.path, args.workers)))
    else:
        from bench_ffcv import run_ffcv
        print(json.dumps(run_ffcv(args.path, args.epochs, args.workers, args.order, disk=epoch_disk())))


if __name__ == "__main__":
    main()
