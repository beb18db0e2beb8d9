"""Pipeline stages in one process: balanced cuts with canonical parameter names, the textbook
bubble, a schedule this torch lacks, the labels later stages read. Every schedule against one
process: tests/multirank/test_pipeline.py."""

import pp_ranks
import pytest
import torch

from visiondist.config.layout import balance
from visiondist.parallel.stages import block_ranges, build_stages


def test_balance_minimises_the_largest_stage():
    assert balance([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balance([3, 3, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="cannot cut 2 units into 3 stages"):
        balance([1, 1], 3)


def test_stages_cover_the_model_once_under_its_own_names():
    model = pp_ranks.make_model()
    ranges = block_ranges(model, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8 and all(a < b for a, b in ranges)
    assert all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
    names = [
        n
        for rank in range(2)
        for s in build_stages(model, rank, 2, 2)
        for n, _ in s.named_parameters()
    ]
    # each parameter once, canonical name
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    with pytest.raises(
        ValueError, match="9 pipeline stages need at least as many blocks; the model has 8"
    ):
        block_ranges(model, 9)


def test_bubble_of_an_ideal_gpipe_timeline_is_the_textbook_fraction(tmp_path):
    """GPipe with equal stages and free communication, drawn by hand: F of micro-batch j on rank r
    runs in slot r + j, its B (twice as long) after every forward; the bubble is (p - 1) / (m + p -
    1)."""
    from visiondist.parallel.timeline import Event, bubble_fraction, ideal_bubble, plot_timeline

    p, m, f = 4, 8, 1.0
    events = []
    for r in range(p):
        for j in range(m):
            events.append(Event(r, r, "F", j, (r + j) * f, (r + j + 1) * f))
            start = (m + p - 1) * f + (p - 1 - r + j) * 2 * f
            events.append(Event(r, r, "B", j, start, start + 2 * f))
    stats = bubble_fraction(events, p)
    assert stats["bubble"] == pytest.approx(ideal_bubble(p, m)) == pytest.approx(3 / 11)
    assert stats["span_s"] == pytest.approx(3 * (m + p - 1) * f)
    png = plot_timeline(events, tmp_path / "t.png", "gpipe")
    assert png.stat().st_size > 10_000


def test_a_schedule_missing_from_this_pytorch_is_a_clear_error(monkeypatch):
    from torch.distributed.pipelining import schedules

    from visiondist.parallel.schedules import _schedule_class

    monkeypatch.delattr(schedules, "ScheduleInterleavedZeroBubble")
    with pytest.raises(
        RuntimeError,
        match=r"zero_bubble needs .*ScheduleInterleavedZeroBubble.*use "
        r"parallel.schedule=1f1b",
    ):
        _schedule_class("zero_bubble")
    assert _schedule_class("1f1b").__name__ == "Schedule1F1B"


def test_later_stages_read_the_labels_of_the_same_samples(tiny_shapes):
    """The last stage's label batches are the first stage's, without decoding an image; a middle
    stage only gets the number of batches."""
    from omegaconf import OmegaConf

    from visiondist.data import build_classification_data

    cfg = OmegaConf.create(
        dict(
            root=str(tiny_shapes),
            train_split="train",
            val_split="val",
            num_classes=6,
            batch_size=16,
            eval_batch_size=10,
            num_workers=0,
            mean=[0.5] * 3,
            std=[0.5] * 3,
            train_crop_scale=[0.08, 1.0],
            hflip=0.5,
            crop_pct=0.875,
        )
    )
    build = lambda **kw: build_classification_data(cfg, 32, 1, 2, 1, 0, False, **kw)  # noqa: E731  dp rank 1 of 2
    full, labels, none = (
        build(),
        build(reads_images=False),
        build(reads_images=False, reads_labels=False),
    )
    for data in (full, labels, none):
        data.train_sampler.set_epoch(1)
    for a, b, c in zip(full.train_loader, labels.train_loader, none.train_loader, strict=True):
        assert b[0] is None and torch.equal(a[1], b[1]) and c == (None, None)
    for a, b in zip(full.val_loader, labels.val_loader, strict=True):
        assert torch.equal(a[1], b[1])
    assert len(none.val_loader) == len(full.val_loader) > 1
