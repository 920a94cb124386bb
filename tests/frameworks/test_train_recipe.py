"""scripts/train_classification.py (the torchvision classification recipe, ported) under torchrun with
2 CPU processes: 2 epochs of a tiny model, stopped mid-epoch by ``--max-steps`` and resumed from its
checkpoint; every epoch trains every sample once in all and evaluation counts each sample once."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from ddp_helpers import run_job, subprocess_env, torchrun
from reader_helpers import make_images, write_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_classification.py"
TRAIN, VAL = 40, 13  # 20 a rank in batches of 4: 5 steps an epoch; 13 validation samples pad to 14
JOB_TIMEOUT_S = 300


def test_recipe_stops_mid_epoch_and_resumes(tmp_path):
    datasets = {name: write_dataset(tmp_path / name, make_images(count, [(8, 8)], seed=seed),
                                    [i % 3 for i in range(count)], storage="lmdb", encoding="raw", records_per_shard=8)
                for name, count, seed in (("train", TRAIN, 0), ("val", VAL, 1))}
    common = ["--train", str(datasets["train"]), "--val", str(datasets["val"]), "--output-dir", str(tmp_path / "out"),
              "--epochs", "2", "-b", "4", "-j", "1", "--width", "4", "--print-freq", "100", "--device", "cpu"]

    stopped = run_job(torchrun(str(SCRIPT), *common, "--max-steps", "3"), timeout_s=JOB_TIMEOUT_S)
    assert stopped.returncode == 0, stopped.stdout
    assert "Epoch: [0] trained 24 samples in this run, batches 0.." in stopped.stdout, stopped.stdout
    assert "stopped after 3 steps (--max-steps)" in stopped.stdout

    resumed = run_job(torchrun(str(SCRIPT), *common, "--resume", str(tmp_path / "out" / "checkpoint.pth")),
                      timeout_s=JOB_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stdout
    trained = re.findall(r"Epoch: \[(\d)\] trained (\d+) samples in this run, batches (\d+)\.\.", resumed.stdout)
    assert trained == [("0", "16", "3"), ("1", "40", "0")], resumed.stdout
    assert resumed.stdout.count(f"Test: evaluated {VAL} samples") == 2, resumed.stdout


def test_cuda_with_fewer_gpus_than_processes_is_one_line(tmp_path):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {**subprocess_env(), "LOCAL_WORLD_SIZE": str(gpus + 1), "LOCAL_RANK": "0"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--train", str(tmp_path), "--val", str(tmp_path),
                          "--output-dir", str(tmp_path / "out"), "--device", "cuda"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 1
    advice = (f"run one process per GPU (torchrun --nproc_per_node={gpus}) or pass --device cpu" if gpus
              else "pass --device cpu, or install a CUDA build of torch")
    assert run.stderr.strip().splitlines() == [
        f"--device cuda: {gpus + 1} process(es) on this node but torch sees {gpus} GPU(s); {advice}"]
