"""Run read-side operations on (possibly damaged) datasets, printing each outcome as one JSON line.

Run in a subprocess by ``hostile_helpers.probe`` so that a crash (SIGBUS, SIGSEGV) or a hang of the
code under test fails a test instead of killing pytest; one subprocess runs many jobs, so torch is
imported once. Usage: ``hostile_probe.py JOBS_JSON`` with a list of ``[ACTION, PATH]``, ACTION one of
``read`` (PackedDataset, every record), ``read-full`` (the same with ``verify="full"``), ``verify``,
``verify-deep``, ``info``. Outcome: ``{"outcome": "ok", ...}`` or ``{"outcome": <exception class>,
"message": ...}``.
"""
from __future__ import annotations

import json
import sys

import xxhash


def read_all(path: str, verify: str = "tables") -> dict:
    """Every record's label and an xxh3 digest of its pixels, through ``PackedDataset``."""
    from reader import PackedDataset

    # no keyword for the default, so that the probe also runs on code from before the option
    ds = PackedDataset(path) if verify == "tables" else PackedDataset(path, verify=verify)
    labels, digests = [], []
    for start in range(0, len(ds), 4):
        images, batch_labels = ds.read_batch(list(range(start, min(start + 4, len(ds)))))
        labels += batch_labels.tolist()
        digests += [xxhash.xxh3_64_hexdigest(image.contiguous().numpy().tobytes()) for image in images]
    return {"labels": labels, "digests": digests}


def run(action: str, path: str) -> dict:
    import packer

    if action == "read":
        return read_all(path)
    if action == "read-full":
        return read_all(path, verify="full")
    if action in ("verify", "verify-deep"):
        report = packer.verify(path, deep=action == "verify-deep", progress=False)
        return {"problems": report.problems}
    if action == "info":
        return {"records": packer.info(path).records}
    raise SystemExit(f"unknown action {action}")


def main() -> None:
    for action, path in json.loads(sys.argv[1]):
        try:
            result = {"outcome": "ok", **run(action, path)}
        except Exception as e:  # the test decides which classes are acceptable
            result = {"outcome": type(e).__name__, "message": str(e)}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
