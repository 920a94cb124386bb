"""Lightning's ``Trainer`` (CPU; 1 process, and 2 DDP processes) stopped mid-epoch by ``max_steps`` and
by an exception after a checkpoint, resumed each time with ``fit(ckpt_path=...)``: every record of
the interrupted epochs is trained exactly once, and the epochs after them are whole.

Lightning restores the loader's ``state_dict()`` and counts ``batch_idx`` on from the restored
position, taking ``len(loader)`` as the epoch's length: that is why ``len()`` is the whole epoch's
(``reader.loader.PackedLoader``). The run is ``lightning_resume_job.py``: in this process for one
rank, under torchrun (bounded in time) for two (``strategy="ddp"``, ``devices=2``).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from ddp_helpers import run_job, torchrun
from reader_helpers import make_images, write_dataset

pytest.importorskip("lightning")
import lightning_resume_job  # noqa: E402  (after the import check)

JOB = Path(__file__).resolve().parents[1] / "lightning_resume_job.py"
COUNT = 20  # batches of 3: 7 a epoch on one rank (the last of 2), 4 on each of two (the last of 1)
EPOCHS = 3
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``COUNT`` raw 4x4 records, record ``i`` labelled ``i`` (one class per record)."""
    return write_dataset(tmp_path_factory.mktemp("lightning-resume") / "ids", make_images(COUNT, [(4, 4)]),
                         list(range(COUNT)), storage="lmdb", encoding="raw", records_per_shard=6,
                         classes=[f"record{i}" for i in range(COUNT)])


@pytest.mark.parametrize("world", [1, 2])
def test_resumed_epochs_train_every_record_once(dataset, tmp_path, world):
    if world == 1:  # in this process: Lightning is imported already
        lightning_resume_job.main(str(dataset), tmp_path, world)
    else:
        done = run_job(torchrun(str(JOB), str(dataset), str(tmp_path), str(world), ranks=world),
                       timeout_s=JOB_TIMEOUT_S)
        assert done.returncode == 0, done.stdout
    run = json.loads((tmp_path / "seen.json").read_text())
    assert run["crash"] == "stopped on purpose"
    steps = run["steps_per_epoch"]
    assert steps == -(-(COUNT // world) // 3)
    assert run["global_step"] == EPOCHS * steps, "as many steps as an uninterrupted run"
    per_epoch: dict[int, list[int]] = {}
    for epoch, ids in run["seen"]:
        per_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(per_epoch) == list(range(EPOCHS))
    for epoch, ids in per_epoch.items():
        repeated = {i: n for i, n in Counter(ids).items() if n > 1}
        missed = sorted(set(range(COUNT)) - set(ids))
        assert not repeated and not missed, f"epoch {epoch}: trained twice {repeated}, never {missed}"
    if world > 1:
        assert (tmp_path / "early.txt").read_text().startswith(
            "this loader was built before torch.distributed was initialised, so it reads the whole dataset as "
            "rank 0 of 1, and so would each of the 2 ranks: build it after init_process_group (with Lightning: in "
            "the train_dataloader() hook")
