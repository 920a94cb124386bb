"""Helpers for the packer's tests: smooth test images, and reading a packed dataset's records directly."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
from PIL import Image
from process_tree import children_of

from reader.format import container, load_manifest


def smooth_rgb(width: int, height: int, seed: int) -> np.ndarray:
    """A smooth, photo-like ``(height, width, 3)`` uint8 image (gradients plus a soft blob), seeded."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    cx, cy = rng.uniform(0, width), rng.uniform(0, height)
    blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (0.1 * (width * height)))
    channels = [
        rng.uniform(0, 120) + rng.uniform(0, 100) * x / width + rng.uniform(0, 100) * y / height + 30 * blob
        for _ in range(3)
    ]
    return np.clip(np.stack(channels, axis=-1), 0, 255).astype(np.uint8)


def reference_pixels(
    path: Path, resize: int, crop: int, draft: bool = False, fused: bool = True
) -> np.ndarray:
    """The documented transform written out with plain PIL calls: torchvision's shorter-side size and
    center-crop rounding, bilinear. ``fused`` resamples only the crop's source box, as the packer
    does; ``fused=False`` is the textbook resize-then-crop. ``draft`` asks PIL for the JPEG draft."""
    img = Image.open(path)
    width, height = img.size
    if width <= height:
        size = (resize, int(resize * height / width))
    else:
        size = (int(resize * width / height), resize)
    if draft:
        img.draft("RGB", size)
    img = img.convert("RGB")
    left, top = int(round((size[0] - crop) / 2.0)), int(round((size[1] - crop) / 2.0))
    if not fused:
        return np.asarray(img.resize(size, Image.BILINEAR).crop((left, top, left + crop, top + crop)))
    sx, sy = img.width / size[0], img.height / size[1]
    box = (left * sx, top * sy, (left + crop) * sx, (top + crop) * sy)
    return np.asarray(img.resize((crop, crop), Image.BILINEAR, box=box))


def read_packed_records(dst: Path) -> list[tuple[bytes, int, int, int]]:
    """Every record of a packed dataset as ``(payload, label, height, width)``, in dataset order,
    read straight from the shard files at the record tables' offsets (independent of the reader)."""
    manifest = load_manifest(dst)
    records = []
    for shard in manifest.shards:
        table = container(manifest.storage).read_table(dst / shard.file, dst / shard.file,
                                                          compressed=shard.compressed)
        fd = os.open(dst / shard.file, os.O_RDONLY)
        try:
            for row in table:
                payload = os.pread(fd, int(row["nbytes"]), int(row["offset"]))
                records.append((payload, int(row["label"]), int(row["height"]), int(row["width"])))
        finally:
            os.close(fd)
    return records


def raw_pixels(record: tuple[bytes, int, int, int]) -> np.ndarray:
    """A raw record's payload as ``(H, W, 3)`` uint8, for comparison with PIL images."""
    payload, _, height, width = record
    return np.frombuffer(payload, np.uint8).reshape(3, height, width).transpose(1, 2, 0)


def holder_of(path: Path) -> int | None:
    """The process that has ``path`` open (the worker writing that shard), if any."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in fds):
                return int(pid)
        except OSError:
            continue
    return None


def kill_a_writer(dst: Path, killed: list[str], deadline: float) -> None:
    """Wait for a shard being written in ``dst``, and SIGKILL the process writing it; ``killed`` gets
    its command line."""
    while time.monotonic() < deadline and not killed:
        for tmp in dst.glob("*.tmp") if dst.is_dir() else []:
            pid = holder_of(tmp.resolve())
            if pid is not None and pid != os.getpid():
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                os.kill(pid, signal.SIGKILL)
                killed.append(command)
                return
        time.sleep(0.002)


KILL_EVENTS = ("shard", "part", "any")


def kill_a_worker(pack: subprocess.Popen, dst: Path, event: str, delay: float, deadline: float) -> int | None:
    """SIGKILL one worker process of the running ``pack`` (a ``packer pack --workers N`` command) at a
    file-system event in ``dst``, ``delay`` seconds after it: ``"shard"`` once a shard is being written
    (the worker writing it is killed), ``"part"`` once a partition's part record is saved (the worker
    is sending it or starting its next partition), ``"any"`` once the workers exist. Returns the killed
    pid, or None when the pack ended (or ``deadline`` passed) first."""
    while pack.poll() is None and time.monotonic() < deadline:
        names = os.listdir(dst) if dst.is_dir() else []
        shards = [dst / name for name in names if "-shard-" in name and name.endswith(".tmp")]
        parts = [name for name in names if name.startswith(".part-") and name.endswith(".json")]
        workers = children_of(pack.pid)
        if workers and {"shard": shards, "part": parts, "any": workers}[event]:
            time.sleep(delay)
            writers = [pid for pid in workers if _holds(pid, shards)]
            victim = (writers or workers)[0]
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return victim
        time.sleep(0.001)
    return None


def _holds(pid: int, paths: list[Path]) -> bool:
    """Whether process ``pid`` has one of ``paths`` open."""
    wanted = {str(path.resolve()) for path in paths}
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False
