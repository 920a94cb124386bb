"""JPEG decode time by where the destination starts: on a 32-byte boundary, or 16 bytes past one.

    python scripts/bench_decode_placement.py DATASET [--records 768] [--rounds 8]

libjpeg-turbo's x86 colour conversion writes a row that starts on a 32-byte boundary with non-temporal
stores, and any other row with ordinary ones (``reader.format.jpeg_decode``, "Where the pixels go");
``PackedDataset`` decodes a batch's images 16 bytes past such a boundary. This measures both placements
in one process: the first ``--records`` JPEG payloads of DATASET (one image size, rows of a multiple of
32 bytes, so that every row starts as labelled) decoded with the reader's decoder into one batch-like
buffer, starting on a page or 16 bytes past it, for its fast and accurate paths, the placements
alternating round by round (a VM's speed drifts); it prints the median and best CPU microseconds a
record.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reader import PackedDataset  # noqa: E402
from reader.format.jpeg_decode import STORE_ALIGNMENT, STORE_OFFSET, decode_jpeg_into  # noqa: E402

PLACEMENTS = {"on a 32-byte boundary": 0, f"{STORE_OFFSET} bytes past one (the reader's)": STORE_OFFSET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--records", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    source = PackedDataset(args.dataset, decode=False)
    if source.manifest.encoding != "jpeg" or source.manifest.shape is None:
        raise SystemExit(f"{args.dataset}: needs a JPEG dataset of one image size")
    _, height, width = source.manifest.shape
    if 3 * width % STORE_ALIGNMENT:
        raise SystemExit(f"{args.dataset}: rows of {3 * width} bytes start at varying offsets; this compares "
                         f"images whose rows are a multiple of {STORE_ALIGNMENT} bytes")
    payloads, _ = source.read_batch(np.arange(min(args.records, len(source))))
    arrays = [payload.numpy().tobytes() for payload in payloads]
    image = 3 * height * width
    memory = np.zeros(len(arrays) * image + 2 * 4096, np.uint8)
    page = (-memory.ctypes.data) % 4096

    def destination(offset: int) -> np.ndarray:
        start = page + offset
        return memory[start:start + len(arrays) * image].reshape(len(arrays), height, width, 3)

    for fast in (True, False):
        timings: dict[str, list[float]] = {name: [] for name in PLACEMENTS}
        for _ in range(args.rounds + 1):  # the first round warms up and is not kept
            for name, offset in PLACEMENTS.items():
                out = destination(offset)
                started = time.process_time()
                for k, array in enumerate(arrays):
                    decode_jpeg_into(memoryview(array), out[k], fast=fast)
                timings[name].append(1e6 * (time.process_time() - started) / len(arrays))
        print(f"{'fast' if fast else 'accurate'} decode, {len(arrays)} records of {width}x{height}, "
              f"{args.rounds} rounds (rows of {3 * width} bytes; {STORE_ALIGNMENT}-byte boundary):")
        for name, values in timings.items():
            kept = values[1:]
            print(f"  {name}: median {statistics.median(kept):.0f} us a record, best {min(kept):.0f} us")


if __name__ == "__main__":
    main()
