"""Each private torch hook (``reader.torch_hooks``), hidden as a torch release renaming it would hide it:
the reader still imports, and reads the same batches through its public fallback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as dataloader_module

from reader import PackedDataset, make_loader, torch_hooks

ROOT = Path(__file__).resolve().parents[2]

# Each case: the torch attributes a release might rename, and the hook detect() must then report missing.
HIDDEN = {
    "storage_use_count": [(torch._C, "_storage_Use_Count")],
    "new_shared_storage": [(torch.UntypedStorage, "_new_shared")],
    "multiprocessing_iterator": [(dataloader_module._MultiProcessingDataLoaderIter, "_try_get_data")],
    "cross_epoch_iterator": [(DataLoader, "_index_sampler")],
}


def _missing(hook: str) -> torch_hooks.TorchHooks:
    """What ``detect()`` finds in a torch without ``hook``'s attributes (put back afterwards)."""
    with pytest.MonkeyPatch.context() as patch:
        for owner, name in HIDDEN[hook]:
            if isinstance(owner, type):  # where the attribute is defined, perhaps a base class
                owner = next(base for base in owner.__mro__ if name in vars(base))
            patch.delattr(owner, name)
        return torch_hooks.detect()


def _epochs(path: Path, workers: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Two epochs (the second cut short, then a third) of batches, copied out of their buffers."""
    loader = make_loader(PackedDataset(path), 3, num_workers=workers, order="random",
                         multiprocessing_context="fork" if workers else None)
    epochs = []
    for epoch, limit in ((0, None), (1, 2), (2, None)):
        loader.set_epoch(epoch)
        batches = []
        for images, labels in loader:
            batches.append((images.clone(), labels.clone()))
            if limit is not None and len(batches) == limit:
                break
        epochs.append(batches)
    return epochs


def test_every_hook_is_found_in_the_tested_torch():
    found = torch_hooks.detect()
    assert found.storage_use_count is not None and found.new_shared_storage is not None
    assert found.multiprocessing_iterator is dataloader_module._MultiProcessingDataLoaderIter
    assert found.cross_epoch_iterator


@pytest.mark.parametrize("hook", [*HIDDEN, "all"])
def test_reading_without_a_hook_gives_the_same_batches(raw_path, monkeypatch, hook):
    expected = {workers: _epochs(raw_path, workers) for workers in (0, 2)}
    hooks = [*HIDDEN] if hook == "all" else [hook]
    missing = {name: getattr(_missing(name), name) for name in hooks}
    assert not any(missing.values())
    monkeypatch.setattr(torch_hooks, "hooks", torch_hooks.TorchHooks(**{**vars(torch_hooks.hooks), **missing}))
    for workers in (0, 2):
        got = _epochs(raw_path, workers)
        assert [len(batches) for batches in got] == [len(batches) for batches in expected[workers]]
        for batches, expected_batches in zip(got, expected[workers]):
            for (images, labels), (want_images, want_labels) in zip(batches, expected_batches):
                assert torch.equal(labels, want_labels) and torch.equal(images, want_images)


def test_the_reader_imports_when_torch_has_none_of_the_hooks():
    hide = "; ".join([
        "import torch, torch.utils.data.dataloader as d",
        "del torch._C._storage_Use_Count",
        "del torch.storage._StorageBase._new_shared",
        "del d._MultiProcessingDataLoaderIter",
        "del d.DataLoader._index_sampler",
        "import reader.loader, reader.torch_hooks as h",
        "print(h.hooks)",
    ])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == ("TorchHooks(storage_use_count=None, new_shared_storage=None, "
                           "multiprocessing_iterator=None, cross_epoch_iterator=False)")
