"""CUDAPrefetcher over a small in-memory loader of real PNG images: outputs, epochs, early break;
stream behaviour and memory on CUDA when present."""
from __future__ import annotations

import gc
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import torch
from hostile_helpers import subprocess_env
from PIL import Image

from reader.gpu.augment import BatchAugment
from reader.gpu.prefetcher import CUDAPrefetcher

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def png_images(folder: Path, count: int, height: int = 16, width: int = 20) -> torch.Tensor:
    """``count`` random RGB images written as PNG and read back, as uint8 [count, 3, H, W]."""
    rng = np.random.default_rng(0)
    images = []
    for i in range(count):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        with Image.open(folder / f"{i}.png") as img:
            images.append(torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1))
    return torch.stack(images)


class ListLoader:
    """The loader interface the prefetcher needs: ``len``, ``set_epoch``, iteration over batches.

    Labels are the sample indices. Each iteration yields fresh tensors (so a test can watch them
    die) and counts the iterations that were closed."""

    def __init__(self, images: torch.Tensor, batch_size: int, channels_last: bool = False) -> None:
        self.images, self.batch_size, self.channels_last = images, batch_size, channels_last
        self.epochs_set: list[int] = []
        self.closed_iterations = 0
        self.produced: list[weakref.ref] = []

    def __len__(self) -> int:
        return -(-len(self.images) // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epochs_set.append(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        try:
            for start in range(0, len(self.images), self.batch_size):
                images = self.images[start : start + self.batch_size].clone()
                if self.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                labels = torch.arange(start, start + len(images))
                self.produced += [weakref.ref(images), weakref.ref(labels)]
                yield images, labels
        finally:
            self.closed_iterations += 1


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    return png_images(tmp_path_factory.mktemp("png"), 10)


def normalized(images: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    return (images.double() / 255 - mean.double()) / std.double()


def test_cpu_outputs_equal_reference(images: torch.Tensor) -> None:
    prefetcher = CUDAPrefetcher(ListLoader(images, 4, channels_last=True), MEAN, STD, device="cpu")
    assert len(prefetcher) == 3
    got_images, got_labels = zip(*prefetcher)
    torch.testing.assert_close(torch.cat(got_images).double(), normalized(images), atol=1e-5, rtol=0)
    assert torch.equal(torch.cat(got_labels), torch.arange(10))
    assert all(labels.dtype == torch.int64 for labels in got_labels)


def test_every_sample_once_per_epoch_and_reiterable(images: torch.Tensor) -> None:
    loader = ListLoader(images, 3)
    prefetcher = CUDAPrefetcher(loader, (0.0,) * 3, (1.0,) * 3, device="cpu", flip=True, crop=(8, 8))
    for epoch in range(3):
        prefetcher.set_epoch(epoch)
        batches = list(prefetcher)
        assert len(batches) == len(prefetcher) == 4
        assert all(batch.shape[1:] == (3, 8, 8) for batch, _ in batches)
        labels = torch.cat([labels for _, labels in batches])
        assert sorted(labels.tolist()) == list(range(10))
    assert loader.epochs_set == [0, 1, 2]


def test_augmentation_seeded_and_different_across_epochs(images: torch.Tensor) -> None:
    def run(seed: int) -> list[torch.Tensor]:
        prefetcher = CUDAPrefetcher(
            ListLoader(images, 5), MEAN, STD, device="cpu", flip=True, random_resized_crop=8, seed=seed
        )
        return [torch.cat([batch for batch, _ in prefetcher]) for _ in range(2)]

    first, again, other = run(0), run(0), run(1)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], first[1]), "each epoch draws anew"
    assert not torch.equal(first[0], other[0]), "the seed matters"


def test_early_break_leaks_nothing(images: torch.Tensor) -> None:
    loader = ListLoader(images, 2)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cpu")
    for batch, labels in prefetcher:
        break
    out = weakref.ref(batch)
    del batch, labels
    assert loader.closed_iterations == 1, "the loader's iterator is closed at once on break"
    assert out() is None
    assert all(ref() is None for ref in loader.produced), "no input batch is still referenced"
    gc.collect()
    assert all(ref() is None for ref in loader.produced)



def test_a_pass_closed_early_frees_the_loader_without_the_collector(images: torch.Tensor) -> None:
    """A pass closed by a break leaves no reference cycle holding the prefetcher and its loader. Held by
    one, a DataLoader's iterator was freed by the collector, which closes its index queues before the
    iterator's ``__del__`` can send its workers their stop: each worker was then waited for 5 s and
    killed (16 workers: 80 s between two bench_gpu modes on an H200)."""
    loader = ListLoader(images, 2)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cpu")
    watched = weakref.ref(loader)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in prefetcher:
            break
        del prefetcher, loader, _
        assert watched() is None, "the loader outlived its prefetcher: something holds it in a cycle"
    finally:
        if was_enabled:
            gc.enable()

@needs_cuda
def test_cuda_outputs_equal_reference_on_another_stream(images: torch.Tensor) -> None:
    prefetcher = CUDAPrefetcher(ListLoader(images, 4), MEAN, STD, device="cuda", channels_last=True)
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        got = [(batch.double() * 1, labels * 1) for batch, labels in prefetcher]
    torch.cuda.synchronize()
    assert all(batch.device.type == "cuda" for batch, _ in got)
    torch.testing.assert_close(torch.cat([b for b, _ in got]).cpu(), normalized(images), atol=1e-5, rtol=0)
    assert torch.equal(torch.cat([labels for _, labels in got]).cpu(), torch.arange(10))


@needs_cuda
def test_cuda_every_sample_once_with_augmentation(images: torch.Tensor) -> None:
    prefetcher = CUDAPrefetcher(ListLoader(images, 3), (0.0,) * 3, (1.0,) * 3, device="cuda", crop=(8, 8))
    for _ in range(2):
        labels = torch.cat([labels for _, labels in prefetcher]).cpu()
        assert sorted(labels.tolist()) == list(range(10))


class GatedLoader:
    """Two big batches (pinned where CUDA is); the second is handed over only once ``release`` is set
    (or after 20 s, noted in ``timed_out``)."""

    def __init__(self) -> None:
        self.big = self._pinned(torch.randint(0, 256, (128, 3, 512, 512), dtype=torch.uint8))
        self.release, self.second_asked, self.timed_out = threading.Event(), threading.Event(), False

    @staticmethod
    def _pinned(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield self.big, self._pinned(torch.zeros(128, dtype=torch.int64))
        self.second_asked.set()
        self.timed_out = not self.release.wait(20)
        yield self.big, self._pinned(torch.ones(128, dtype=torch.int64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_next_returns_while_the_next_batch_is_still_pulled_and_prepared(device: str) -> None:
    """``next()`` hands over batch 0 without waiting for batch 1, whose pull (and on CUDA its copy and
    conversion) goes on behind it on the preparing thread."""
    loader = GatedLoader()
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device=device)
    iterator = iter(prefetcher)
    first, labels = next(iterator)
    assert loader.second_asked.wait(20) and not loader.release.is_set()
    loader.release.set()
    second, second_labels = next(iterator)
    assert not loader.timed_out, "next() waited for the batch after the one it returned"
    expected = normalized(loader.big[:2])
    torch.testing.assert_close(first[:2].double().cpu(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(second[:2].double().cpu(), expected, atol=1e-5, rtol=0)
    assert labels.sum().item() == 0 and second_labels.sum().item() == 128
    iterator.close()


@needs_cuda
def test_cuda_reserved_memory_stable_across_epochs(images: torch.Tensor) -> None:
    loader = ListLoader(images.repeat(4, 1, 1, 1), 8)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cuda", random_resized_crop=12, flip=True)
    reserved = []
    for _ in range(5):
        for batch, _ in prefetcher:
            batch.sum().item()
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[1] == reserved[4], f"reserved bytes per epoch: {reserved}"


@needs_cuda
def test_cuda_early_break_leaks_nothing(images: torch.Tensor) -> None:
    loader = ListLoader(images, 2)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cuda")
    assert len(list(prefetcher)) == len(loader)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for batch, labels in prefetcher:
        break
    del batch, labels
    torch.cuda.synchronize()
    assert loader.closed_iterations == 2
    assert torch.cuda.memory_allocated() == before, "the batch in flight was released"


def test_end_to_end_on_a_packed_dataset(tmp_path: Path) -> None:
    from reader_helpers import chw, make_images, write_dataset

    from reader import PackedDataset

    sources = make_images(7, [(16, 20)])
    write_dataset(tmp_path, sources, [i % 3 for i in range(7)], storage="hdf5", encoding="raw", records_per_shard=3)
    dataset = PackedDataset(tmp_path)
    loader = [dataset.read_batch(list(range(start, min(start + 3, 7)))) for start in range(0, 7, 3)]
    got = list(CUDAPrefetcher(loader, MEAN, STD))
    expected = normalized(torch.from_numpy(np.stack([chw(image) for image in sources])))
    torch.testing.assert_close(torch.cat([b for b, _ in got]).cpu().double(), expected, atol=1e-5, rtol=0)
    assert torch.cat([labels for _, labels in got]).tolist() == [i % 3 for i in range(7)]


class StatefulListLoader(ListLoader):
    """A ``ListLoader`` with the state methods the prefetcher's resume needs; it records the states loaded."""

    def __init__(self, images: torch.Tensor, batch_size: int) -> None:
        super().__init__(images, batch_size)
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"position": 0}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"seed": None}, TypeError, "seed must be an int, got None"),
        ({"seed": 1.5}, TypeError, "seed must be an int, got 1.5"),
        ({"rank": -1}, ValueError, "rank must be 0 or more, got -1"),
        ({"rank": "a"}, TypeError, "rank must be an int, got 'a'"),
    ],
)
def test_bad_seed_or_rank_is_refused_naming_it(images: torch.Tensor, options: dict, error: type, message: str) -> None:
    """A seed of None or a rank of -1 failed inside numpy at the first batch; a seed of 1.5 was truncated."""
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        CUDAPrefetcher(ListLoader(images, 4), MEAN, STD, device="cpu", **options)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (None, TypeError, "load_state_dict takes the dict state_dict() returned, got NoneType"),
        ({"drop": "loader"}, ValueError, "saved state has no loader (loading it needs epoch, batches, seed, loader), "
         "got keys ['batches', 'epoch', 'seed']"),
        ({"epoch": "x"}, TypeError, "saved epoch must be an int, got 'x'"),
        ({"batches": -1}, ValueError, "saved batches must be 0 or more, got -1"),
        ({"batches": 1.5}, TypeError, "saved batches must be an int, got 1.5"),
        ({"seed": None}, TypeError, "saved seed must be an int, got None"),
    ],
)
def test_a_corrupted_state_is_refused_before_the_loader_is_touched(
    images: torch.Tensor, change: dict | None, error: type, message: str
) -> None:
    saver = CUDAPrefetcher(StatefulListLoader(images, 4), MEAN, STD, device="cpu", seed=2)
    next(iter(saver))
    state: dict | None = None
    if change is not None:
        state = {**saver.state_dict(), **{k: v for k, v in change.items() if k != "drop"}}
        state.pop(change.get("drop", ""), None)
    loader = StatefulListLoader(images, 4)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cpu", seed=2)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        prefetcher.load_state_dict(state)  # type: ignore[arg-type]
    assert loader.loaded == [] and prefetcher.state_dict()["batches"] == 0
    with pytest.raises(TypeError, match=r"^epoch must be an int, got 'a'$"):
        prefetcher.set_epoch("a")  # type: ignore[arg-type]


class WatchedLoader:
    """A loader whose batches take ``pull_s`` to come, which records any call made while a pull is
    under way (another thread using it at the same time)."""

    def __init__(self, batches: int = 4, pull_s: float = 0.05) -> None:
        self.batches, self.pull_s = batches, pull_s
        self.pulling = 0
        self.overlaps: list[str] = []
        self.epoch = 0

    def _check(self, call: str) -> None:
        if self.pulling:
            self.overlaps.append(call)

    def __len__(self) -> int:
        return self.batches

    def state_dict(self) -> dict:
        self._check("state_dict")
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self._check("load_state_dict")

    def set_epoch(self, epoch: int) -> None:
        self._check("set_epoch")
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._check("iter")
        for k in range(self.batches):
            self.pulling += 1
            time.sleep(self.pull_s)
            self.pulling -= 1
            yield torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([k, k])


def test_the_loader_is_never_used_by_two_threads_at_once() -> None:
    """The preparing thread pulls while the loop runs; a new pass, set_epoch, state_dict and
    load_state_dict from the loop wait for it first."""
    loader = WatchedLoader(pull_s=0.2)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cpu")
    peeked = iter(prefetcher)
    next(peeked)  # a pass left open, its next pull under way
    time.sleep(0.05)
    assert len(list(prefetcher)) == 4  # another pass
    for _ in prefetcher:
        time.sleep(0.05)  # the next pull is under way
        prefetcher.set_epoch(3)
        prefetcher.load_state_dict(prefetcher.state_dict())
    assert loader.overlaps == []
    del peeked


def _finishes(target: Callable[[], None], timeout_s: float = 20.0) -> bool:
    done = threading.Event()
    threading.Thread(target=lambda: (target(), done.set()), daemon=True).start()
    return done.wait(timeout_s)


def test_a_pass_collected_on_the_preparing_thread_does_not_wait_for_itself() -> None:
    """An abandoned pass in a reference cycle, freed by a collection that runs on the preparing thread
    (any allocation there can start one), must not wait there for that thread's own work."""

    class CollectingLoader(WatchedLoader):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for k, batch in enumerate(super().__iter__()):
                if k == 1:
                    gc.collect()
                yield batch

    def scenario() -> None:
        prefetcher = CUDAPrefetcher(CollectingLoader(pull_s=0.01), MEAN, STD, device="cpu")

        class Holder:
            pass

        holder = Holder()
        holder.cycle, holder.batches = holder, iter(prefetcher)
        next(holder.batches)  # the pull of batch 1, which collects, is under way
        del holder
        time.sleep(0.5)
        assert len(list(prefetcher)) == 4

    thresholds = gc.get_threshold()
    gc.set_threshold(0)  # only the loader's explicit collection frees the abandoned pass
    try:
        assert _finishes(scenario), "deadlocked: the preparing thread waits for itself"
    finally:
        gc.set_threshold(*thresholds)


class Interrupted(Exception):
    pass


@pytest.mark.timeout(method="thread")  # the test's own SIGALRM would replace pytest-timeout's signal
def test_an_interrupt_while_waiting_does_not_wait_for_the_loader() -> None:
    """Ctrl-C while the loop waits for the preparing thread, stuck in a loader that does not answer,
    reaches the caller at once."""

    class StuckLoader(WatchedLoader):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            yield torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([0, 0])
            time.sleep(3.0)
            yield torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([1, 1])

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    started = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            for _ in CUDAPrefetcher(StuckLoader(), MEAN, STD, device="cpu"):
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - started < 2.0


def test_a_new_pass_closes_the_open_one() -> None:
    loader = WatchedLoader(pull_s=0.01)
    prefetcher = CUDAPrefetcher(loader, MEAN, STD, device="cpu")
    first = iter(prefetcher)
    next(first)
    second = iter(prefetcher)
    assert len(list(second)) == 4
    with pytest.raises(StopIteration):
        next(first)
    assert loader.overlaps == []


def test_a_failed_batch_is_not_kept() -> None:
    """An error in preparing a batch (out of memory, say) reaches the caller once; nothing keeps the
    failed batch's tensors (the error's traceback holds them) once the caller lets the error go."""
    inputs: list[weakref.ref] = []

    class FailingAugment(BatchAugment):
        def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
            inputs.append(weakref.ref(images))
            if len(inputs) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
            return super().__call__(images, generator)

    prefetcher = CUDAPrefetcher(WatchedLoader(pull_s=0.0), augment=FailingAugment(MEAN, STD), device="cpu")
    with pytest.raises(torch.OutOfMemoryError):
        for _ in prefetcher:
            pass
    gc.collect()
    assert inputs[1]() is None


def test_the_process_exits_with_a_pass_left_open(tmp_path: Path) -> None:
    """A pass left open at exit, its next batch still being pulled: the process ends (the preparing
    thread is a daemon, waited for a few seconds at exit), it does not hang."""
    script = tmp_path / "left_open.py"
    script.write_text(textwrap.dedent("""
        import time, torch
        from reader.gpu.prefetcher import CUDAPrefetcher
        class Slow:
            def __len__(self): return 3
            def __iter__(self):
                for k in range(3):
                    yield torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.tensor([k, k])
                    time.sleep(1.0)
        batches = iter(CUDAPrefetcher(Slow(), (0.5,) * 3, (0.25,) * 3, device="cpu"))
        next(batches)
        print("left open")
        """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env=subprocess_env())
    assert run.returncode == 0 and run.stdout == "left open\n", run.stderr
