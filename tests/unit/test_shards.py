"""Packed shards: tools/data.py pack's output (WebDataset tars, wids-format shard list, byte-offset
index), reading it from a directory and from a loopback HTTP server (bytes fetched, checksums,
retries, the cache's limit), and the train sampler's shard-aware order."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pytest
from shard_server import serve

from visiondist.data.sampler import TrainBatchSampler, shard_streams
from visiondist.data.shards import ShardError, ShardSplit, ShardStore
from visiondist.data.shards import pack as packing
from visiondist.data.shards.pack import PackError, PackOptions, pack_image_folder

CLASSES = ["cat", "dog", "eel"]


def _tree(root: Path, train: int = 12, val: int = 4) -> Path:
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for c in CLASSES:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                image = rng.integers(0, 255, (40 + i, 60, 3), dtype=np.uint8)
                ext = ".png" if i == 0 else ".jpg"
                cv2.imwrite(str(root / split / c / f"{i}{ext}"), image)
    return root


def _options(**kw) -> PackOptions:
    return PackOptions(**{"shard_mb": 0.02, "workers": 2, "progress": False, **kw})


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    source = _tree(tmp_path_factory.mktemp("tree"))
    out = tmp_path_factory.mktemp("shards")
    meta = pack_image_folder(source, ["train", "val"], out, _options())
    return source, out, meta


@pytest.mark.smoke
def test_pack_holds_every_image_once_as_webdataset_tars(packed):
    source, out, meta = packed
    assert meta["classes"] == CLASSES and meta["splits"]["train"]["samples"] == 36
    assert meta["splits"]["train"]["shards"] > 3  # cut by size: several shards
    for split in ("train", "val"):
        entry = json.loads((out / f"{split}.json").read_text())
        assert entry["wids_version"] == 1 and sum(s["nsamples"] for s in entry["shardlist"]) == len(
            list((source / split).rglob("*.*"))
        )
        expected = sorted(
            (CLASSES.index(p.parent.name), p.read_bytes()) for p in (source / split).rglob("*.*")
        )
        found, keys = [], []
        for s in entry["shardlist"]:
            with tarfile.open(out / s["url"]) as tar:
                members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
            for name, data in members.items():
                key, ext = name.split(".", 1)
                if ext != "cls":
                    keys.append(int(key))
                    found.append((int(members[f"{key}.cls"]), data))
        assert sorted(found) == expected and sorted(keys) == list(range(len(expected)))
        split_set = ShardSplit(ShardStore(str(out)), split)
        assert (
            sorted(
                (int(split_set.targets[i]), split_set.image_bytes(i)) for i in range(len(split_set))
            )
            == expected
        )
    train = ShardSplit(ShardStore(str(out)), "train")
    classes_per_shard = [
        len(set(train.targets[train.packed.shard == k].tolist())) for k in range(3)
    ]
    assert max(classes_per_shard) > 1  # shuffled before cutting: a shard is not one class


def test_pack_refuses_a_finished_output_and_continues_an_interrupted_one(tmp_path, monkeypatch):
    source = _tree(tmp_path / "tree")
    out = tmp_path / "shards"
    real = packing.write_index
    monkeypatch.setattr(
        packing, "write_index", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):  # stopped after the shards, before the index
        pack_image_folder(source, ["train", "val"], out, _options())
    assert not (out / "dataset.json").exists()
    monkeypatch.setattr(packing, "write_index", real)
    first = sorted(out.glob("train-*.tar"))
    (first[1]).unlink()
    times = {p.name: p.stat().st_mtime_ns for p in first if p.exists()}
    pack_image_folder(source, ["train", "val"], out, _options())
    assert first[1].is_file()  # the missing shard written again, the others left as they were
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in times.items())
    assert not (out / ".pack").exists() and (out / "dataset.json").is_file()
    with pytest.raises(PackError, match="overwrite=true"):
        pack_image_folder(source, ["train", "val"], out, _options())
    again = pack_image_folder(source, ["train", "val"], out, _options(overwrite=True))
    assert again["splits"]["train"]["samples"] == 36


def test_reencoded_pack_bounds_the_longer_side(tmp_path):
    source = _tree(tmp_path / "tree")
    meta = pack_image_folder(
        source, ["train", "val"], tmp_path / "small", _options(max_side=32, quality=85)
    )
    split = ShardSplit(ShardStore(str(tmp_path / "small")), "val")
    assert meta["reencoded"] == {"max_side": 32, "quality": 85}
    for i in range(len(split)):
        image, _ = split[i]
        assert max(image.shape[:2]) == 32 and split.image_bytes(i)[:2] == b"\xff\xd8"


def _break(source: Path) -> dict[Path, bytes]:
    """Four unreadable images of four kinds, in three shards' worth of the tree; returns their good
    bytes."""
    broken = {
        source / "train" / "dog" / "3.jpg": b"",  # empty
        source / "val" / "cat" / "2.jpg": None,  # truncated: no end marker
        source / "train" / "cat" / "5.jpg": b"not an image at all",  # text
        # a valid header and end marker around a broken stream
        source / "train" / "eel" / "7.jpg": None,
    }
    good = {path: path.read_bytes() for path in broken}
    broken[source / "val" / "cat" / "2.jpg"] = good[source / "val" / "cat" / "2.jpg"][:300]
    body = bytearray(good[source / "train" / "eel" / "7.jpg"])
    body[200:-200] = bytes(len(body) - 400)
    broken[source / "train" / "eel" / "7.jpg"] = bytes(body)
    for path, data in broken.items():
        path.write_bytes(data)
    return good


def test_one_pack_names_every_unreadable_image_and_a_fixed_tree_writes_only_their_shards(tmp_path):
    """A pack decodes every image as the loaders will: all four unreadable images of the tree
    (empty, truncated, not an image, a broken stream between a valid header and end marker) are
    named in one error with their reasons, with no Python object in the text; the shards without
    them are written. Fixed in place, the same call writes only the shards that held them and
    finishes."""
    source = _tree(tmp_path / "tree")
    good = _break(source)
    out = tmp_path / "out"
    with pytest.raises(PackError) as error:
        pack_image_folder(source, ["train", "val"], out, _options())
    text = str(error.value)
    assert text.startswith("4 of 48 images cannot be read: ") and "object at 0x" not in text, text
    for path, reason in (
        (source / "train" / "dog" / "3.jpg", "the file is empty"),
        (source / "val" / "cat" / "2.jpg", "truncated JPEG"),
        (source / "train" / "cat" / "5.jpg", "not an image OpenCV or Pillow can read"),
        (source / "train" / "eel" / "7.jpg", ""),
    ):
        assert f"{path}: {reason}" in text, (path, text)
    # four: named above
    assert not (out / "dataset.json").exists() and not (out / packing.UNREADABLE).exists()
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    assert written
    for path, data in good.items():
        path.write_bytes(data)
    meta = pack_image_folder(source, ["train", "val"], out, _options())
    assert meta["splits"]["train"]["samples"] == 36 and meta["splits"]["val"]["samples"] == 12
    again = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    assert {name: again[name] for name in written} == written  # kept, not written again
    assert 1 <= len(set(again) - set(written)) <= 4


def test_more_than_ten_unreadable_images_are_listed_in_a_file(tmp_path):
    source = _tree(tmp_path / "tree")
    bad = sorted((source / "train").rglob("*.jpg"))[:12]
    for path in bad:
        path.write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(
        PackError,
        match=rf"12 of 48 images cannot be read: .* and 2 more \(all 12 in "
        rf"{out / packing.UNREADABLE}\)",
    ):
        pack_image_folder(source, ["train", "val"], out, _options())
    listed = (out / packing.UNREADABLE).read_text().splitlines()
    assert listed == [f"{path}\tthe file is empty" for path in bad]


@pytest.mark.smoke
def test_http_shards_read_as_the_directory_and_count_the_bytes_fetched(packed, tmp_path):
    _, out, _ = packed
    local = ShardSplit(ShardStore(str(out)), "train")
    with serve(out) as url:
        store = ShardStore(url, cache_dir=str(tmp_path / "cache"))
        remote = ShardSplit(store, "train")
        index_bytes = store.fetched.value
        assert index_bytes == (out / "train-index.npz").stat().st_size
        first_shard = np.flatnonzero(remote.packed.shard == 0)
        assert [remote.image_bytes(int(i)) for i in first_shard] == [
            local.image_bytes(int(i)) for i in first_shard
        ]
        # one shard, fetched once
        assert store.fetched.value - index_bytes == remote.packed.shards[0]["filesize"]
        assert [remote.image_bytes(i) for i in range(len(remote))] == [
            local.image_bytes(i) for i in range(len(local))
        ]
        assert store.fetched.value == index_bytes + sum(s["filesize"] for s in remote.packed.shards)
        # another rank of the node: the cache serves it
        again = ShardStore(url, cache_dir=str(tmp_path / "cache"))
        ShardSplit(again, "train").image_bytes(0)
        assert again.fetched.value == 0


def test_a_pack_copied_in_part_is_refused_before_launch_naming_the_fix(packed, tmp_path):
    """A directory pack with a shard missing or cut short (an interrupted copy) is refused as the
    run is configured, naming the file and the fix, not at the shard's first read an epoch
    later."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    _, out, _ = packed
    entry = json.loads((out / "train.json").read_text())
    shard = entry["shardlist"][-1]["url"]
    for name, damage, said in (
        (shard, lambda p: p.unlink(), f"{shard}: missing, the index lists it"),
        (
            shard,
            lambda p: p.write_bytes(p.read_bytes()[:5000]),
            f"{shard}: 5000 bytes, the index says",
        ),
        # the file a pack writes last, not copied yet
        ("dataset.json", lambda p: p.unlink(), "holds shards: the pack was cut short, or its"),
    ):
        copy = tmp_path / f"copy-{said[-4:]}"
        shutil.copytree(out, copy)
        damage(copy / name)
        args = ["data=imagenet", "data.format=shards", f"data.root={copy}", "data.batch_size=4"]
        with pytest.raises(ConfigError, match=re.escape(said)) as refused:
            load_config(REPO / "configs", args, "train")
        assert "copy the whole folder again" in str(refused.value)


def test_a_data_set_packed_again_at_the_same_address_is_fetched_again(packed, tmp_path):
    """Packed again and served where the first pack was (same shard names and sizes, other
    bytes, a new index): a node that cached the first pack reads the new images, not its old
    copies; the first pack's copies, which the new index does not name, are not read."""
    _, out, _ = packed
    served = tmp_path / "served"
    shutil.copytree(out, served)
    with serve(served) as url:
        first = ShardSplit(ShardStore(url, cache_dir=str(tmp_path / "cache")), "train")
        old = first.image_bytes(0)
        # the second pack: shard 0 with one byte of its first image changed, and its index
        shard = served / first.packed.shards[0]["url"]
        data = bytearray(shard.read_bytes())
        data[int(first.packed.offset[0]) + 100] ^= 0xFF
        shard.write_bytes(bytes(data))
        entry = json.loads((served / "train.json").read_text())
        entry["shardlist"][0]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
        (served / "train.json").write_text(json.dumps(entry))
        again = ShardStore(url, cache_dir=str(tmp_path / "cache"))
        new = ShardSplit(again, "train").image_bytes(0)
        assert new != old and new == bytes(data[first.packed.offset[0] :][: len(old)])
        assert again.fetched.value == entry["shardlist"][0]["filesize"]


def test_a_changed_shard_is_refused_and_a_dead_server_named(packed, tmp_path):
    _, out, _ = packed
    served = tmp_path / "served"
    served.mkdir()
    for p in out.iterdir():
        os.link(p, served / p.name) if p.name != "train-000000.tar" else None
    data = bytearray((out / "train-000000.tar").read_bytes())
    data[600] ^= 0xFF  # one byte of an image, size unchanged
    (served / "train-000000.tar").write_bytes(bytes(data))
    with serve(served) as url:
        split = ShardSplit(ShardStore(url, cache_dir=str(tmp_path / "cache"), retries=1), "train")
        with pytest.raises(
            ShardError, match=r"train-000000\.tar: its SHA-256 .* differs from the index's"
        ):
            split.image_bytes(int(np.flatnonzero(split.packed.shard == 0)[0]))
        kept = [p.name for p in (tmp_path / "cache").rglob("train-000000*") if p.suffix != ".lock"]
        assert not kept  # nothing half-kept
    with pytest.raises(
        ShardError, match=rf"cannot fetch {url}/train-000001\.tar .* after 2 attempts"
    ):
        split.image_bytes(int(np.flatnonzero(split.packed.shard == 1)[0]))


def test_the_cache_keeps_under_its_limit(packed, tmp_path):
    _, out, _ = packed
    with serve(out) as url:
        entry = json.loads((out / "train.json").read_text())
        limit = 2.5 * max(s["filesize"] for s in entry["shardlist"])
        store = ShardStore(url, cache_dir=str(tmp_path / "cache"), cache_gb=limit / 1e9)
        split = ShardSplit(store, "train")
        for i in range(len(split)):
            split.image_bytes(i)
            held = sum(
                p.stat().st_size for p in store.cache.iterdir() if p.suffix in (".tar", ".npz")
            )
            assert held <= limit
        # it had to fetch some twice
        assert store.fetched.value > sum(s["filesize"] for s in entry["shardlist"])


def _shard_starts(sizes):
    return np.concatenate([[0], np.cumsum(sizes)])


def test_stream_order_is_the_same_for_any_ranks_and_splits_the_shards_between_them():
    sizes = [50] * 40
    starts, shard_of = _shard_starts(sizes), np.repeat(np.arange(40), 50)
    kw = dict(seed=3, streams=8, shard_starts=starts)
    one = TrainBatchSampler(2000, 64, 0, 1, **kw)
    assert (
        one.steps_per_epoch == (2000 // 8) // 8
        and one.dropped_per_epoch == 2000 - one.steps_per_epoch * 64
    )
    batches = one.global_batches(1)
    seen = np.concatenate(batches)
    assert len(set(seen.tolist())) == len(seen)  # no sample twice in an epoch
    assert not np.array_equal(np.concatenate(one.global_batches(2)), seen)
    for ranks in (2, 4, 8):
        samplers = [TrainBatchSampler(2000, 64, r, ranks, **kw) for r in range(ranks)]
        for s in samplers:
            s.set_epoch(1)
        per_rank = [np.array([i for micro in s for i, _ in micro]) for s in samplers]
        assert np.array_equal(
            np.concatenate([p.reshape(-1, 64 // ranks) for p in per_rank], axis=1).reshape(-1), seen
        )  # rank r's slice of every global batch: the one-process batches
        touched = [len(set(shard_of[p].tolist())) for p in per_rank]
        # its part of the shards, plus the boundaries
        assert max(touched) <= 40 / ranks + 2, touched
    with pytest.raises(ValueError, match="data.batch_size=60 is not divisible by data.streams=8"):
        TrainBatchSampler(2000, 60, 0, 1, **kw)
    # data.streams=-1 (the default): the largest divisor of the batch up to 8, so a small batch
    # reads a pack without a setting
    assert [shard_streams(-1, b) for b in (256, 60, 8, 6, 4, 5)] == [8, 6, 8, 6, 4, 5]
    assert shard_streams(4, 256) == 4


def test_s3_shards_read_as_the_directory(packed, tmp_path, monkeypatch):
    """s3:// through boto3 against moto's S3-compatible server: the same bytes, each shard fetched
    once."""
    from shard_server import serve_s3

    _, out, _ = packed
    local = ShardSplit(ShardStore(str(out)), "val")
    with serve_s3(out, monkeypatch) as url:
        store = ShardStore(url, cache_dir=str(tmp_path / "cache"))
        remote = ShardSplit(store, "val")
        assert [remote.image_bytes(i) for i in range(len(remote))] == [
            local.image_bytes(i) for i in range(len(local))
        ]
        shards = sum(s["filesize"] for s in remote.packed.shards)
        assert store.fetched.value == (out / "val-index.npz").stat().st_size + shards
        # not retried
        with pytest.raises(ShardError, match=rf"cannot fetch {url}/nothing\.tar: .*NoSuchKey"):
            store.local("nothing.tar", "0" * 64, 10)
        # a node with no credentials: said at once, with where they go (not retried as a network
        # fault)
        import visiondist.data.shards.fetch as fetch_module

        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(key)
        for key in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
            monkeypatch.setenv(key, str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setattr(fetch_module, "_S3_CLIENTS", {})
        import boto3

        monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # it holds the credentials it found
        bare = ShardStore(url, cache_dir=str(tmp_path / "bare"), retries=3)
        with pytest.raises(ShardError, match="give this node S3 credentials"):
            bare.read_small("dataset.json")


def test_a_node_with_the_shards_cached_trains_on_while_the_server_is_away(
    packed, tmp_path, caplog, monkeypatch
):
    """The val split read once: with the server gone it is read from the cache, and the one line
    that says so counts what the cache holds of each split (none of train's)."""
    from visiondist.data.shards.store import SERVER_AWAY

    _, out, _ = packed
    cache = str(tmp_path / "cache")
    with serve(out) as url:
        first = ShardSplit(ShardStore(url, cache_dir=cache), "val")
        expected = [first.image_bytes(i) for i in range(len(first))]
    # the store sets it once it finds the server away: restored after the test
    monkeypatch.setenv(SERVER_AWAY, "")
    with caplog.at_level("WARNING"):
        again = ShardSplit(ShardStore(url, cache_dir=cache, retries=0), "val")  # the server is gone
    assert [
        again.image_bytes(i) for i in range(len(again))
    ] == expected and again.store.fetched.value == 0
    splits = json.loads((out / "dataset.json").read_text())["splits"]
    (said,) = [r.getMessage() for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert said.endswith(
        f": train 0 of {splits['train']['shards']}, val {splits['val']['shards']} of "
        f"{splits['val']['shards']} shards cached; a shard not cached stops the run where it is "
        "first read"
    ), said
    with pytest.raises(
        ShardError, match=r"cannot fetch .*dataset\.json .* check that the server is up"
    ):
        ShardSplit(ShardStore(url, cache_dir=str(tmp_path / "empty"), retries=0), "val")


def test_a_tree_config_on_a_pack_and_shards_on_a_tree_say_what_to_change(packed):
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    source, out, _ = packed
    configs = Path(__file__).resolve().parents[2] / "configs"
    with pytest.raises(
        ConfigError, match=rf"data.root={out} holds packed shards .*: add data.format=shards"
    ):
        load_config(configs, ["data=imagenet", f"data.root={out}"], inputs="train")
    with pytest.raises(
        ConfigError,
        match=r"with data.format=shards, data.root is a directory `tools/data.py pack` "
        r"wrote .*or read the tree with data.format=imagefolder for class folders",
    ):
        load_config(
            configs, ["data=imagenet", "data.format=shards", f"data.root={source}"], inputs="train"
        )
    # a detection config on a pack: named as a pack, not as a folder of no format known
    with pytest.raises(
        ConfigError, match=rf"data.root={out} holds packed shards .*: add data.format=shards"
    ):
        load_config(
            configs,
            ["model=fasterrcnn_mobilenet_v3", "data=detection", f"data.root={out}"],
            "train",
        )


def test_a_pack_one_folder_down_or_cut_short_is_named_before_launch(packed, tmp_path):
    """data.root at the pack's parent names the pack below it; a split whose shard list is missing
    (a pack cut short) is refused before any rank starts, naming the pack command, not "pack it
    first"."""
    import shutil

    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    _, out, _ = packed
    configs = Path(__file__).resolve().parents[2] / "configs"
    outer = tmp_path / "outer"
    shutil.copytree(out, outer / "shards")
    shards = ["data=imagenet", "data.format=shards"]
    with pytest.raises(
        ConfigError,
        match=rf"data.root={outer} holds no pack, but {outer / 'shards'} does: "
        rf"set data.root={outer / 'shards'}$",
    ):
        load_config(configs, [*shards, f"data.root={outer}"], inputs="train")
    (outer / "shards" / "val.json").unlink()
    for purpose in ("train", "eval"):
        with pytest.raises(ConfigError, match=r"val\.json does not exist, .* cut short"):
            load_config(configs, [*shards, f"data.root={outer / 'shards'}"], inputs=purpose)


def test_the_pack_command_names_every_unreadable_image_in_one_run(capsys, tmp_path):
    """`python tools/data.py pack data=imagenet data.root=<tree> out=<dir>` on a tree with four
    unreadable images: one error line naming all four, exit 2; fixed in place, the same command
    finishes the pack."""
    from helpers import call_tool

    source = _tree(tmp_path / "tree")
    good = _break(source)
    command = [
        "pack",
        "data=imagenet",
        f"data.root={source}",
        f"out={tmp_path / 'out'}",
        "workers=2",
        "shard_mb=0.02",  # shards of a few images: a pack that stops part way
    ]
    code, out, lines = call_tool(capsys, "data", *command)
    errors = [line for line in lines if line.startswith("error:")]
    assert (
        code == 2
        and len(errors) == 1
        and errors[0].startswith("error: 4 of 48 images cannot be read: ")
    ), lines
    assert (
        all(str(path) in errors[0] for path in good) and "the finished ones are kept" in errors[0]
    ), lines
    for path, data in good.items():
        path.write_bytes(data)
    code, out, err = call_tool(capsys, "data", *command)
    assert code == 0 and (tmp_path / "out" / "dataset.json").is_file(), (out, err)
    assert re.search(
        r"(\d+) of (\d+) shards were written by an earlier run of this pack: writing the other "
        r"[1-4]\b",
        out,
    ), out


@pytest.mark.parametrize("workers", [1, 2])
def test_corrupt_jpegs_that_decode_are_packed_and_libjpegs_warnings_name_them(
    capfd, tmp_path, workers
):
    """libjpeg prints "Corrupt JPEG data: ..." to the process's stderr itself, naming no file: the
    pack's workers put the file's path in front of each; the images are packed (the loaders decode
    them the same way). Two corrupt files: one worker meets both (each warning named, the second
    too); two workers fork from a process that has decoded under the capture before (as an earlier
    one-worker pack in it does), and each captures into its own file."""
    from helpers import call_tool

    from visiondist.data.decode import decoder_messages_named

    with decoder_messages_named("an earlier image"):
        pass
    source = _tree(tmp_path / "tree", train=4, val=2)
    corrupt = [source / "train" / "dog" / "2.jpg", source / "train" / "cat" / "3.jpg"]
    for path in corrupt:
        data = path.read_bytes()
        # the scan cut short, the end marker kept
        path.write_bytes(data[: len(data) // 2] + b"\xff\xd9")
    command = [
        "pack",
        "data=imagenet",
        f"data.root={source}",
        f"out={tmp_path / 'out'}",
        f"workers={workers}",
    ]
    code, _, lines = call_tool(capfd, "data", *command)
    assert code == 0, lines
    warned = sorted(line for line in lines if "Corrupt JPEG data" in line)
    assert warned == sorted(
        f"{p}: Corrupt JPEG data: premature end of data segment" for p in corrupt
    ), lines


def test_each_decoder_message_of_a_process_is_named_after_its_file(capfd):
    """What libjpeg writes to the process's stderr (file descriptor 2) while each file decodes comes
    out with that file's path in front, the second file's as the first's (the capture file is
    emptied and written from its start)."""
    import os

    from visiondist.data.decode import decoder_messages_named

    for name in ("a.jpg", "b.jpg", "c.jpg"):
        with decoder_messages_named(name):
            os.write(2, b"Corrupt JPEG data: premature end of data segment\n")
    assert capfd.readouterr().err.splitlines() == [
        f"{name}: Corrupt JPEG data: premature end of data segment"
        for name in ("a.jpg", "b.jpg", "c.jpg")
    ]


@pytest.mark.parametrize(
    "data",
    [
        ["data=imagenet"],
        ["data=shapes_coco", "model=fcos_r50"],
        ["data=detection", "model=fcos_r50"],
    ],
)
def test_a_url_without_data_format_shards_is_refused_naming_it(tmp_path, monkeypatch, data):
    """data.root=http://... under a tree or a built-in set's config: one line naming
    data.format=shards, and nothing written (a built-in set was generated into ./http:/...)."""
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    monkeypatch.chdir(tmp_path)
    configs = Path(__file__).resolve().parents[2] / "configs"
    with pytest.raises(
        ConfigError, match=r"a URL is read as packed shards .*: add data.format=shards"
    ):
        load_config(configs, [*data, "data.root=http://127.0.0.1:9/set"], inputs="train")
    assert not list(tmp_path.iterdir())


def test_a_shard_missing_from_the_server_is_named_as_such(packed, tmp_path):
    """The index lists a shard the server's copy lacks (a copy cut short): the error names the
    shard and the incomplete copy, not a wrong data.root."""
    import shutil

    _, out, _ = packed
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    gone = sorted(copy.glob("val-*.tar"))[-1]
    gone.unlink()
    with serve(copy) as url:
        split = ShardSplit(ShardStore(url, cache_dir=str(tmp_path / "cache"), retries=0), "val")
        with pytest.raises(
            ShardError,
            match=rf"cannot fetch {url}/{gone.name}: .*404.*: the data set's index lists it, the "
            r"server's copy does not hold it: copy the whole folder",
        ):
            for i in range(len(split)):
                split.image_bytes(i)


@pytest.mark.parametrize(
    "root, said",
    [
        (
            "http://127.0.0.1:8765/dataset.json",
            "names the pack's dataset.json: give the folder or URL that holds it, "
            "data.root=http://127.0.0.1:8765",
        ),
        (
            "127.0.0.1:8765",
            "reads as a server's address: give its URL, data.root=http://127.0.0.1:8765",
        ),
    ],
)
def test_a_root_that_is_almost_a_packs_address_names_the_one_meant(root, said):
    with pytest.raises(ShardError) as refused:
        ShardStore(root)
    assert str(refused.value) == f"data.root={root} {said}"


def test_a_small_set_packs_into_shards_of_at_least_a_megabyte(tmp_path):
    """The automatic shard size is a 64th of the split, but at least 1 MB: a set of a few hundred
    KB is one shard a split, not a tar (padded to 10 KiB) and a request for every image."""
    source = _tree(tmp_path / "tree")
    meta = pack_image_folder(
        source, ["train", "val"], tmp_path / "out", PackOptions(workers=1, progress=False)
    )
    assert meta["splits"]["train"]["samples"] == 36
    assert meta["splits"]["train"]["shards"] == meta["splits"]["val"]["shards"] == 1


def test_a_detection_packs_printed_command_names_a_detector_and_is_taken(tmp_path, capsys):
    """`tools/data.py pack` of a COCO set prints a train command whose model is a detector (the
    default model is a classifier, which a detection pack refuses): that command's config loads
    and its preflight passes as printed; a classifier on the pack is told to use a detector."""
    import shlex

    from helpers import REPO, call_tool

    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    root, out = tmp_path / "coco", tmp_path / "packed"
    small = [
        "data.synthetic.train_images=8",
        "data.synthetic.val_images=4",
        "data.synthetic.image_size=32",
    ]
    code, said, err = call_tool(
        capsys, "data", "pack", "data=shapes_coco", f"data.root={root}", *small, f"out={out}"
    )
    assert code == 0, err
    line = next(line for line in said.splitlines() if "train from it" in line)
    assert line.startswith("6 categories; train from it: python "), line
    printed = shlex.split(line.split("train from it: ", 1)[1])[2:]  # after python tools/train.py
    assert printed == [
        "model=fasterrcnn_mobilenet_v3",
        "data=shapes_coco",
        "data.format=shards",
        f"data.root={out}",
    ]
    load_config(REPO / "configs", [*printed, "data.batch_size=4"], "train")
    # the pack's annotation file gives the images' sizes, as the tree's does: 24-32 px images
    # resized up to data.min_size are said before launch
    assert "resizes the training images (shorter side 24-32 px, median" in capsys.readouterr().out
    with pytest.raises(
        ConfigError, match=r"train a detector \(e.g. model=fasterrcnn_mobilenet_v3\)"
    ):
        load_config(REPO / "configs", printed[1:], "train")
