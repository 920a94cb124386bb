"""BatchStream: the same batches with or without advice ahead, each batch advised one lookahead early,
and make_loader wiring the dataset's advice in only where it can help."""
from __future__ import annotations

import os
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from reader_helpers import SMALL_RAW_COUNT as COUNT

import reader.loader
from reader import PackedDataset, make_loader
from reader.batch_stream import TABLE_LEAD, BatchStream, Samples
from reader.lookahead import LOOKAHEAD_WINDOWS, lookahead_samples
from reader.sampler import ShardSampler
from reader.streamed_blocks import StreamPosition

BATCH = 4


class Stream:
    """A quasi-random BatchStream over the dataset and the (step, indices) of every advise call, where
    step is how many batches the stream had yielded when the call came."""

    def __init__(self, path: Path, lookahead: Samples, drop_last: bool = False, in_flight: int = 0) -> None:
        self.sampler = ShardSampler(PackedDataset(path), seed=3, buffer_blocks=2)
        self.calls: list[tuple[int, list[int]]] = []
        self.yielded = 0
        self.stream = BatchStream(self.sampler, BATCH, drop_last, advise=self.advise,
                                  lookahead=lookahead, in_flight=in_flight)
        self.positions: list[StreamPosition] = []

    @property
    def passes(self) -> list[int]:
        return [at.pass_number for at in self.positions]

    def advise(self, indices: np.ndarray, at: StreamPosition) -> None:
        assert isinstance(indices, np.ndarray)
        self.calls.append((self.yielded, indices.tolist()))
        self.positions.append(at)

    def take(self, n: int) -> list[list[int]]:
        batches = []
        for batch in islice(self.stream.endless(), n):
            batches.append(batch)
            self.yielded += 1
        return batches


def plain_batches(sampler: ShardSampler, n: int, drop_last: bool = False) -> list[list[int]]:
    return list(islice(BatchStream(sampler, BATCH, drop_last).endless(), n))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("lookahead", [1, BATCH, 3 * BATCH, 2 * COUNT])
def test_advice_changes_no_batch(raw_path, lookahead, drop_last):
    stream = Stream(raw_path, lookahead, drop_last)
    stream.sampler.set_epoch(2)
    stream.sampler.start = 5
    expected = plain_batches(stream.sampler, 40, drop_last)
    assert stream.take(40) == expected
    assert all(isinstance(i, int) for batch in expected for i in batch)


def test_each_batch_is_advised_one_lookahead_before_it_is_yielded(raw_path):
    ahead = 3  # batches: a lookahead of 2.5 batches rounds up
    stream = Stream(raw_path, lookahead=int(2.5 * BATCH))
    batches = stream.take(25)
    advised = [indices for _, indices in stream.calls]
    assert advised[:25] == batches
    for k, (step, _) in enumerate(stream.calls):
        assert step == max(0, k - ahead)


def test_a_lookahead_that_changes_as_the_stream_runs(raw_path):
    """A callable lookahead (a streamed loader's follows the free memory) is asked at every batch. When it
    shrinks, the batches beyond it are yielded at once; when it grows, batches are advised before the
    next is yielded. Every batch is the same as without advice and advised before it is yielded, and
    the last batch yielded on each answer leaves exactly that many batches advised beyond it."""
    plan = [3, 3, 3, 0, 0, 5, 5, 5, 5, 5, 5, 1, 2, 4, 4, 4, 4, 0, 6, 6, 6, 6, 6, 6, 6, 2]
    answers: list[int] = []

    def lookahead() -> int:
        answers.append(plan[len(answers)] if len(answers) < len(plan) else 2)
        return answers[-1] * BATCH

    stream = Stream(raw_path, lookahead=lookahead)
    yields: list[tuple[int, int]] = []  # per yielded batch: the answer it was yielded on, batches advised beyond it
    for k, _ in enumerate(islice(stream.stream.endless(), 40)):
        yields.append((len(answers) - 1, len(stream.calls) - (k + 1)))
        stream.yielded += 1
    assert [indices for _, indices in stream.calls][:40] == plain_batches(stream.sampler, 40)
    assert all(step <= k for k, (step, _) in enumerate(stream.calls))  # advised before it was yielded
    assert all(beyond >= answers[asked] for asked, beyond in yields)
    last_on_each_answer = {asked: beyond for asked, beyond in yields}
    assert all(beyond == answers[asked] for asked, beyond in last_on_each_answer.items())
    assert 0 in last_on_each_answer.values() and 6 in last_on_each_answer.values()


@pytest.mark.parametrize("ahead", [3, 0])
def test_each_batch_s_tables_are_asked_for_a_table_lead_before_its_advice(raw_path, ahead):
    """``read_tables`` sees the batches in order, ``TABLE_LEAD`` lookaheads before ``advise`` (a lookahead
    of at least one batch: tables are asked for ahead also where nothing is advised ahead); the batches
    and the advice to the last one are as without it."""
    events: list[tuple[str, list[int]]] = []
    sampler = ShardSampler(PackedDataset(raw_path), seed=3, buffer_blocks=2)
    stream = BatchStream(sampler, BATCH, False, advise=lambda b, _: events.append(("advise", b.tolist())),
                         read_tables=lambda b: events.append(("tables", b.tolist())), lookahead=ahead * BATCH)
    per_pass = -(-len(sampler) // BATCH)
    batches = list(islice(stream.endless(), 2 * per_pass))
    assert batches == plain_batches(sampler, 2 * per_pass)
    tables = [b for kind, b in events if kind == "tables"]
    advised = [b for kind, b in events if kind == "advise"]
    assert tables[:len(batches)] == advised[:len(batches)] == batches
    for k, (kind, batch) in enumerate(events):
        if kind == "advise":
            asked = sum(1 for kind, _ in events[:k] if kind == "tables")
            assert asked == advised.index(batch) + 1 + TABLE_LEAD * max(ahead, 1)


@pytest.mark.parametrize("ahead", [3, 0])
def test_the_first_tables_can_be_asked_for_before_the_stream_starts(raw_path, ahead):
    """``read_first_tables`` asks for the tables of exactly the batches that ``endless()`` asks for before
    its first advice, in order, and advises nothing; a stream that advises nothing asks for nothing."""
    def events_of(stream_use) -> list[tuple[str, list[int]]]:
        events: list[tuple[str, list[int]]] = []
        sampler = ShardSampler(PackedDataset(raw_path), seed=3, buffer_blocks=2)
        stream = BatchStream(sampler, BATCH, False, advise=lambda b, _: events.append(("advise", b.tolist())),
                             read_tables=lambda b: events.append(("tables", b.tolist())),
                             lookahead=ahead * BATCH)
        stream_use(stream)
        return events

    first = events_of(BatchStream.read_first_tables)
    started = events_of(lambda stream: next(stream.endless()))
    assert started[:len(first)] == first
    assert [kind for kind, _ in first] == ["tables"] * (TABLE_LEAD * max(ahead, 1) + 1)
    assert started[len(first)][0] == "advise"
    asked: list[np.ndarray] = []
    sampler = ShardSampler(PackedDataset(raw_path))
    BatchStream(sampler, BATCH, False, read_tables=asked.append, lookahead=BATCH).read_first_tables()
    assert asked == []


def test_loader_asks_for_the_first_tables_before_forking_its_workers(raw_path, monkeypatch):
    """A cold epoch's first wait starts with the record tables (``advise`` needs them): the loader asks
    for the first batches' tables before its DataLoader forks the workers, so the disk reads them while
    the workers start; the batches are the same."""
    events: list[str] = []
    ds = PackedDataset(raw_path, block_bytes=1 << 20)
    loader = make_loader(ds, BATCH, num_workers=2, buffer_blocks=2, multiprocessing_context="fork")
    real_fork, ask = os.fork, ds.read_tables_ahead
    monkeypatch.setattr(os, "fork", lambda: (events.append("fork"), real_fork())[1])
    monkeypatch.setattr(ds, "read_tables_ahead", lambda indices: (events.append("tables"), ask(indices))[1])
    yielded = [labels.tolist() for _, labels in loader]
    assert events.index("tables") < events.index("fork")
    assert sum(yielded, []) == ds.targets[loader.shard_sampler.rank_order()].tolist()


def test_a_loader_advises_no_lookahead_until_its_first_batch_is_back(raw_path, monkeypatch):
    """With real DataLoader workers: of the stream, only the ``in_flight`` batches handed to the workers
    at the start are advised before a batch comes back; when ``next()`` returns the first batch, the
    lookahead beyond them has been too, in the stream's order (the module docstring's "No lookahead at a
    stream's start"); the batches are the same."""
    events: list[str] = []
    ds = PackedDataset(raw_path, block_bytes=1 << 20)
    loader = make_loader(ds, BATCH, num_workers=2, buffer_blocks=2, multiprocessing_context="fork")
    stream = loader.batch_sampler
    advised: list[list[int]] = []
    advise, receive = stream.advise, reader.loader._received
    stream.advise = lambda batch, at: (advised.append(batch.tolist()), events.append("advise"), advise(batch, at))[2]
    monkeypatch.setattr(reader.loader, "_received", lambda *args: (events.append("received"), receive(*args))[1])
    batches = iter(loader)
    _, labels = next(batches)
    assert stream.in_flight == 4 and stream.lookahead_batches > 0
    assert events.index("received") == stream.in_flight, "the batches handed out alone before one is back"
    assert len(advised) == stream.in_flight + 1 + stream.lookahead_batches
    plain = BatchStream(loader.shard_sampler, BATCH, False)
    plain.epoch_step = stream.epoch_step
    assert advised == list(islice(plain.endless(), len(advised)))
    order = loader.shard_sampler.rank_order().tolist()
    rest = [labels.tolist() for _, labels in batches]
    assert sum(rest, labels.tolist()) == ds.targets[order].tolist()


def test_advice_names_each_batch_s_pass(raw_path):
    """A streamed view remembers its advice for one pass of the order: each batch comes with the
    number of its pass, counting from 0 at the first pass of ``endless()``."""
    stream = Stream(raw_path, lookahead=BATCH)
    per_pass = -(-len(stream.sampler) // BATCH)
    stream.take(2 * per_pass + 3)
    assert stream.passes[:3 * per_pass] == [0] * per_pass + [1] * per_pass + [2] * min(per_pass, 4)


@pytest.mark.parametrize("in_flight", [1, 3])
def test_advice_says_which_batches_the_loader_has_received(raw_path, in_flight):
    """Each advised batch carries its number in the stream, and how many batches a DataLoader holding
    ``in_flight`` batches beyond those received has received: when the stream hands out its batch ``n``,
    batches ``0 .. n - in_flight`` (``reader.streamed_blocks``)."""
    stream = Stream(raw_path, lookahead=2 * BATCH, in_flight=in_flight)
    stream.take(20)
    assert [at.batch for at in stream.positions] == list(range(len(stream.positions)))
    for (yielded, _), at in zip(stream.calls, stream.positions):
        assert at.received == max(0, yielded - in_flight + 1)
        assert at.received <= yielded
    with pytest.raises(ValueError, match="in_flight"):
        BatchStream(stream.sampler, BATCH, False, in_flight=-1)


def test_without_lookahead_each_batch_is_advised_as_it_is_handed_out(raw_path):
    """A lookahead of 0 (a streamed loader whose batches in flight already fill its budget) still shows
    every batch to ``advise``, just before it is yielded: the main process keeps track of the blocks in
    use and drops them (``reader.streamed_blocks``). Without ``advise`` there is no lookahead."""
    sampler = ShardSampler(PackedDataset(raw_path))
    assert BatchStream(sampler, BATCH, False, lookahead=8).lookahead_batches == 0
    stream = Stream(raw_path, lookahead=0, in_flight=2)
    assert stream.stream.lookahead_batches == 0
    batches = stream.take(12)
    assert batches == plain_batches(stream.sampler, 12)
    assert stream.calls == list(enumerate(batches))  # batch k advised once k batches were yielded
    with pytest.raises(ValueError, match="lookahead"):
        BatchStream(sampler, BATCH, False, advise=lambda *_: None, lookahead=-1)


@pytest.mark.parametrize("in_flight, ahead", [(4, 3), (2, 0), (1, 2)])
def test_no_lookahead_until_the_first_batch_is_back(raw_path, in_flight, ahead):
    """At a stream's start the DataLoader asks for its ``in_flight`` batches at once; each is advised as
    it is handed out and none beyond, so that a slow disk reads the first batches' blocks before any
    other (the module docstring; BENCHMARKS.md, "The first window alone"). Once the DataLoader asks for
    one more (the first batch is back), the stream advises ``ahead`` batches beyond the one it yields,
    as it does from then on. Every batch is advised before it is handed out, in order; the batches are
    the same as without advice."""
    stream = Stream(raw_path, lookahead=ahead * BATCH, in_flight=in_flight)
    batches = stream.take(in_flight + 6)
    assert batches == plain_batches(stream.sampler, in_flight + 6)
    advised = [indices for _, indices in stream.calls]
    assert advised == plain_batches(stream.sampler, len(advised))
    steps = [step for step, _ in stream.calls]
    back = in_flight + ahead + 1  # advised by the time the DataLoader has batch in_flight
    assert steps[:in_flight] == list(range(in_flight)), "each as it is handed out, none beyond"
    assert steps[in_flight:back] == [in_flight] * (ahead + 1)
    assert steps[back:] == [k - ahead for k in range(back, len(steps))]


def test_empty_stream_advises_nothing(raw_path):
    stream = Stream(raw_path, lookahead=BATCH, drop_last=True)
    stream.stream.batch_size = COUNT + 1
    assert stream.take(3) == [] and stream.calls == []


def test_make_loader_advises_with_workers_and_read_ahead_only(raw_path):
    ds = PackedDataset(raw_path, block_bytes=1 << 20)
    loader = make_loader(ds, BATCH, num_workers=2, buffer_blocks=2, multiprocessing_context="fork")
    stream = loader.batch_sampler
    assert stream.advise == loader.dataset.advise and loader.source is ds
    assert stream.read_tables == loader.dataset.read_tables_ahead
    expected = lookahead_samples(ds, 2)
    blocks = loader.view.block_groups().block_count
    assert expected == round(LOOKAHEAD_WINDOWS * 2 * COUNT / blocks)
    assert stream.lookahead_batches == -(-expected // BATCH)
    assert make_loader(ds, BATCH, num_workers=0).batch_sampler.advise is None
    no_read_ahead = PackedDataset(raw_path, readahead=False)
    assert make_loader(no_read_ahead, BATCH, num_workers=2).batch_sampler.advise is None
    yielded = [labels.tolist() for _, labels in loader]
    assert sum(yielded, []) == ds.targets[loader.shard_sampler.rank_order()].tolist()
