"""The ImageFolder index in arrays and its cached listing: the same paths and labels as a plain
listing, a listing reused while the tree is unchanged and rebuilt when a file comes or goes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import visiondist.data.index as index_module
from visiondist.data.imagefolder import ImageFolder, scan_image_folder
from visiondist.data.index import PathIndex, list_image_folder


def _tree(root, names=("b", "a", "Ä"), per=3):
    for c in names:
        (root / c).mkdir(parents=True)
        for i in range(per):
            (root / c / f"{i}-é.jpg").write_bytes(b"x")
    (root / "a" / "notes.txt").write_text("not an image")
    old = time.time_ns() - 60_000_000_000  # a tree last changed a minute ago: its listing is kept
    for c in names:
        os.utime(root / c, ns=(old, old))
    return root


def test_path_index_gives_back_every_path():
    # a non-UTF-8 byte too
    names = ["cat/1.jpg", "dög/ü.JPEG", "x/" + "long" * 50 + ".png", "bad/\udcff.jpg"]
    index = PathIndex("/data/train", names)
    assert len(index) == 4 and [index.relative(i) for i in range(4)] == names
    assert index[1] == "/data/train/dög/ü.JPEG"
    assert index.nbytes == sum(len(n.encode("utf-8", "surrogateescape")) for n in names) + 8 * 5


def test_listing_is_sorted_labelled_and_cached_until_the_tree_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _tree(tmp_path / "train")
    classes, paths, labels = list_image_folder(root)
    assert classes == ["a", "b", "Ä"]  # code-point order, as torchvision's ImageFolder
    assert [paths[i] for i in range(len(paths))] == [
        str(root / c / f"{i}-é.jpg") for c in classes for i in range(3)
    ]
    assert labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2] and labels.dtype == np.int64
    assert scan_image_folder(root) == (classes, [(paths[i], int(labels[i])) for i in range(9)])

    def listed_again(*_):
        raise AssertionError("the tree was listed again")

    monkeypatch.setattr(index_module, "_scan", listed_again)
    again = list_image_folder(root)  # from the cache: nothing listed
    assert (
        again[0] == classes
        and np.array_equal(again[1].buffer, paths.buffer)
        and np.array_equal(again[2], labels)
    )
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (root / "b" / "new.jpg").write_bytes(b"x")  # a file comes: its folder's time stamp changes
    _, paths, labels = list_image_folder(root)
    assert (
        len(paths) == 10
        and paths[6] == str(root / "b" / "new.jpg")
        and labels.tolist().count(1) == 4
    )


def test_a_tree_changed_just_now_is_not_cached_and_a_broken_cache_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fresh = tmp_path / "fresh"
    for c in ("a", "b"):
        (fresh / c).mkdir(parents=True)
        (fresh / c / "1.jpg").write_bytes(b"x")
    list_image_folder(fresh)
    assert not (tmp_path / "cache" / "visiondist" / "listings").exists()
    root = _tree(tmp_path / "train")
    list_image_folder(root)
    (cached,) = (tmp_path / "cache" / "visiondist" / "listings").glob("*.npz")
    cached.write_bytes(b"not a zip file")
    assert len(list_image_folder(root)[1]) == 9


def test_the_dataset_reads_through_the_index(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _tree(tmp_path / "train")
    data = ImageFolder(root, reader=lambda path: path)  # the "image" is the path it was read from
    assert len(data) == 9 and data[4] == (str(root / "b" / "1-é.jpg"), 1)
    assert data.samples[4] == (str(root / "b" / "1-é.jpg"), 1)
    with pytest.raises(FileNotFoundError, match="holds no images"):
        (root / "empty").mkdir()
        ImageFolder(root)
