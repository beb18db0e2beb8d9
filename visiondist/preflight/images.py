"""The images of a data tree, checked in the launching process before any rank starts
(`visiondist.preflight.check_inputs` calls these): none missing from a class, at least one global
batch to train on, every val image readable, and the categories of a COCO file read from its tail.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from visiondist.config import ConfigError
from visiondist.config.schema import DETECTION_FORMATS
from visiondist.utils.logs import say
from visiondist.utils.text import counted

_TAIL = 1 << 20  # COCO files end with their categories: the last MB holds them
# a COCO training file up to this size is read whole to count its usable images
_SMALL_COCO = 32 << 20


def reads_masks(model_cfg) -> bool:
    """Whether the model trains on instance masks (its data must hold them).

    Args:
        model_cfg: the model config (`model`).
    """
    from visiondist.models.detection import has_masks  # noqa: PLC0415 (reader)

    return has_masks(model_cfg)


def check_images(
    d, root: Path, purpose: str = "train", masks: bool = False, resized: bool = True
) -> None:
    """What the ranks' datasets would refuse, said before they start: a class folder without images
    (in each split read), train and val class folders that differ, and for training a split with
    fewer images than one global batch (`data.batch_size`): no optimizer step could be drawn from
    it. COCO: the usable training images (at least one box left after the dataset's rules), both
    splits' categories and boxes, and (`resized`: the detector resizes by data.min_size) how far
    data.min_size scales small images up."""
    if d.format in DETECTION_FORMATS:
        if purpose == "train":
            _check_coco_batch(d, masks, resized)
        _check_coco_val(d, masks)
        return
    need = int(d.batch_size) if purpose == "train" else 0
    classes = {}
    for split in [d.train_split, d.val_split] if purpose == "train" else [d.val_split]:
        classes[split], images = _count_images(
            d, root, split, need if split == d.train_split else 0
        )
        if split == d.train_split and images < need:
            raise ConfigError(
                f"data.root={d.root}: the training split {split}/ has {images} images, fewer than "
                f"one global batch data.batch_size={need}: lower data.batch_size (e.g. "
                f"data.batch_size={fitting_batch(images)}) or add images"
            )
    if purpose == "train" and classes[d.train_split] != classes[d.val_split]:
        train, val = set(classes[d.train_split]), set(classes[d.val_split])
        differ = "; ".join(
            f"only in {split}/: {_some(names)}"
            for split, names in ((d.train_split, train - val), (d.val_split, val - train))
            if names
        )
        raise ConfigError(
            f"data.root={d.root}: the class folders of {d.val_split}/ and {d.train_split}/ differ "
            f"({differ}): give both splits the same class folders (the labels are their sorted "
            "order)"
        )


def _count_images(d, root: Path, split: str, need: int) -> tuple[list[str], int]:
    """(the split's class folders, its images counted up to `need`): each class folder is listed
    until its first image, and further only while fewer than `need` images were seen. A class folder
    without any is an error."""
    from visiondist.data.imagefolder import IMG_EXTENSIONS  # noqa: PLC0415 (reader)

    split_dir = root / split
    with os.scandir(split_dir) as entries:
        classes = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    total = 0
    for name in classes:
        found = 0
        with os.scandir(split_dir / name) as entries:
            for e in entries:
                if e.name.lower().endswith(IMG_EXTENSIONS) and e.is_file():
                    found += 1
                    if total + found >= need:
                        break
        if not found:
            raise ConfigError(
                f"data.root={d.root}: class folder {split}/{name} holds no images "
                f"({', '.join(IMG_EXTENSIONS)}): add images or remove the folder"
            )
        total += found
    return classes, total


def check_val_readable(d, root: Path) -> None:
    """Every image of the val split (a folder tree's, or each one a COCO annotation file lists)
    readable, from its size, header and end marker (`unreadable_reason`; no decoding): one error
    naming the unreadable ones and their reasons, before any rank starts, since each val image is
    scored. Once a machine (`LOCAL_RANK` unset or 0: under torchrun one process a node checks, and
    its exit stops the others); a rank checks its share again before step 1
    (`visiondist.engine.build.check_val_images`)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from visiondist.data.robust import name_bad, unreadable_reason  # noqa: PLC0415 (reader)

    paths = _val_paths(d, root) if _val_present(d, root) else []
    if not paths:
        return
    workers = min(32, 4 * (os.cpu_count() or 1))  # the reads wait on the disk, not the CPU
    with ThreadPoolExecutor(workers) as pool:
        reasons = list(pool.map(unreadable_reason, paths, chunksize=64))
    bad = [(str(path), reason) for path, reason in zip(paths, reasons) if reason is not None]
    if bad:
        them = "it" if len(bad) == 1 else "them"
        coco = (
            "; remove an image's entry from the annotation file too"
            if d.format in DETECTION_FORMATS
            else ""
        )
        raise ConfigError(
            f"{len(bad)} of {len(paths)} val images cannot be read: {name_bad(bad)}: fix or remove "
            f"{them} (every val image is scored{coco})"
        )


def _val_present(d, root: Path) -> bool:
    """The val split's listing is there (a built-in set's may not be generated yet)."""
    if d.format in DETECTION_FORMATS:
        from visiondist.data import coco_paths  # noqa: PLC0415 (reader)

        return coco_paths(d, d.val_split)[1].is_file()
    return (root / d.val_split).is_dir()


def _val_paths(d, root: Path) -> list[Path]:
    """The val split's image files: a folder tree's listing, or the `images` of a COCO annotation
    file."""
    if d.format in DETECTION_FORMATS:
        from visiondist.data import coco_paths  # noqa: PLC0415 (reader)
        from visiondist.data.coco_records import safe_image_path  # noqa: PLC0415 (reader)

        images_dir, annotations = coco_paths(d, d.val_split)
        try:
            entries = json.loads(annotations.read_text()).get("images", ())
            return [safe_image_path(images_dir, str(e["file_name"])) for e in entries]
        # the dataset's own error says what
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
    from visiondist.data.index import list_image_folder  # noqa: PLC0415 (reader)

    _, index, _ = list_image_folder(root / d.val_split)
    return [Path(index[i]) for i in range(len(index))]


def check_builtin_batch(d, num_classes: int) -> None:
    """A built-in set's training images (as `data.synthetic` generates them) against one global
    batch.

    Args:
        d: the data config.
        num_classes: the set's classes.
    """
    images = int(d.synthetic.train_per_class) * num_classes if d.format == "imagefolder" else None
    key = "data.synthetic.train_per_class" if images is not None else "data.synthetic.train_images"
    if images is None:
        # an upper bound: images without objects are left out of training
        images = int(d.synthetic.train_images)
    if images < d.batch_size:
        raise ConfigError(
            f"data={d.name}: {key} gives {images} training images, fewer than one global batch "
            f"data.batch_size={d.batch_size}: lower data.batch_size (e.g. "
            f"data.batch_size={fitting_batch(images)}) or raise {key}"
        )


def _check_coco_batch(d, masks: bool = False, resized: bool = True) -> None:
    """A COCO training split with at least one global batch of usable images; for a mask model,
    the instances left out for want of a valid segmentation said in one line, before any rank
    starts."""
    read = _small_coco(d, d.train_split, masks, train=True)
    if read is None:
        return
    records, counts, annotations, _ = read
    if counts.without_mask and _speaks():
        one = counts.without_mask == 1
        say(
            f"{annotations.name}: {counted(counts.without_mask, 'instances')} without a valid "
            f"segmentation {'is' if one else 'are'} left out of training, as detectron2 leaves "
            f"{'it' if one else 'them'} out ({counts.named_without_mask()})"
        )
    if _speaks():
        _say_reshaped(annotations, counts)
        _say_clipped(annotations, counts, "training clips them to it")
        if resized:
            _say_upscaled(d, records)
    batch, usable = int(d.batch_size), len(records)
    # (an aspect group smaller than a batch is batched with the other: data.sampler)
    fits = fitting_batch(usable)
    if usable < batch:
        raise ConfigError(
            f"data.root={d.root}: the training split {d.train_split} has {usable} images with a "
            f"usable box ({counts.images_without_boxes} without), fewer than one global batch "
            f"data.batch_size={batch}: lower data.batch_size (e.g. data.batch_size={fits}) or add "
            "images"
        )


def _check_coco_val(d, masks: bool = False) -> None:
    """The val split's annotations read as the ranks will read them, before any rank starts: an
    annotation of a category the file does not list is refused here, as in the training split;
    boxes that reach past their image are said (COCO's scoring reads them as written), and
    annotation ids that scoring numbers anew."""
    from visiondist.data.coco_records import renumbering_line  # noqa: PLC0415 (reader)

    read = _small_coco(d, d.val_split, masks, train=False)
    if read is not None and _speaks():
        _, counts, annotations, coco = read
        _say_reshaped(annotations, counts)
        _say_clipped(
            annotations, counts, "the evaluation scores them as written, as COCO's scoring does"
        )
        renumbered = renumbering_line(annotations, coco.dataset.get("annotations", []))
        if renumbered:
            say(renumbered)


def _small_coco(d, split: str, masks: bool, train: bool):
    """(records, counts, annotation file, its pycocotools COCO) of a split whose COCO file is small
    enough to read here (None otherwise); a file the dataset would refuse is refused in one line."""
    from visiondist.data import coco_paths  # noqa: PLC0415 (reader)

    images_dir, annotations = coco_paths(d, split)
    if not annotations.is_file() or annotations.stat().st_size > _SMALL_COCO:
        return None
    from visiondist.data.coco_records import load_coco, read_records  # noqa: PLC0415 (reader)

    try:
        coco = load_coco(annotations)
        coco.dataset["_file"] = str(annotations)
        records, _, counts = read_records(coco, images_dir, train=train, masks=masks)
    except (ValueError, KeyError, TypeError) as exc:
        said = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        # a message that names the file already is not prefixed with it again
        raise ConfigError(said if str(annotations) in said else f"{annotations}: {said}") from None
    return records, counts, annotations, coco


def _speaks() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def _say_reshaped(annotations: Path, counts) -> None:
    if counts.reshaped:
        say(
            f"{annotations.name}: {counts.reshaped} polygon segmentation"
            f"{'s are' if counts.reshaped > 1 else ' is'} written as [x, y] points or as one "
            f"unwrapped list (the first: {counts.reshaped_first}): read as COCO's "
            "[[x1, y1, x2, y2, ...]], for training and scoring alike (plain pycocotools reads only "
            "COCO's form)"
        )


def _say_clipped(annotations: Path, counts, then: str) -> None:
    if counts.clipped_boxes:
        say(
            f"{annotations.name}: {counts.clipped_boxes} box"
            f"{'es reach' if counts.clipped_boxes > 1 else ' reaches'} 1 px or more past its "
            f"image (the first: {counts.clipped_first}): {then}"
        )


# a detector's data.min_size this many times its training images' median shorter side is said
UPSCALED = 2.0


def _say_upscaled(d, records: list) -> None:
    """A detector whose data.min_size resizes small images far up (data=detection keeps COCO's 800
    px): each step computes (min_size / side)^2 times their pixels, which on a CPU turns minutes
    into hours; one line naming the sizes that train them as they are."""
    if not records or "min_size" not in d:
        return
    shorter = sorted(min(r.width, r.height) for r in records)
    longer = max(max(r.width, r.height) for r in records)
    median = shorter[len(shorter) // 2]
    factor = int(d.min_size) / median
    if factor < UPSCALED:
        return
    say(
        f"data.min_size={d.min_size} resizes the training images (shorter side {shorter[0]}-"
        f"{shorter[-1]} px, median {median}) {factor:.1f}x up, {factor**2:.0f}x their pixels a "
        f"step; to train them at about their own size: data.min_size={median} "
        f"data.max_size={max(longer, median)} (docs/data.md, small sets)"
    )


def fitting_batch(images: int) -> int:
    """A global batch the images fill: the largest power of two up to their count (it splits over
    2^k ranks)."""
    return 1 << max(0, images.bit_length() - 1)


def _some(names: set) -> str:
    shown = sorted(names)
    return ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")


def coco_categories(path: Path) -> list[dict[str, Any]]:
    """The `categories` of a COCO annotation file without parsing its images and annotations: COCO's
    files end with them, so the last MB is searched first; a file laid out otherwise is parsed
    whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - _TAIL))
        tail = f.read().decode("utf-8", errors="ignore")
    start = tail.rfind('"categories"')
    if start >= 0:
        try:
            value, _ = json.JSONDecoder().raw_decode(tail[tail.index(":", start) + 1 :].lstrip())
            if isinstance(value, list):
                return value
        except ValueError:
            pass
    try:
        return json.loads(path.read_text())["categories"]
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            f"{path} is not a COCO annotation file ({type(exc).__name__}: {exc})"
        ) from None


def say_patch_rounding(cfg) -> None:
    """A ViT's input is a whole number of patches: a data.img_size that is not one is read at the
    multiple of the patch below it (model.img_size, `patch_multiple`), said in one line rather
    than found in the summary's resolution row."""
    m, d = cfg.model, cfg.data
    if m.family != "vit" or d.get("resolution", "square") != "square" or "img_size" not in m:
        return
    size, asked, patch = int(m.img_size), int(d.img_size), int(m.patch_size)
    if size == asked:
        return
    say(
        f"data.img_size={asked} is not a multiple of model={m.name}'s {patch} px patch: the ViT "
        f"reads {size} px images (model.img_size={size}); data.img_size={size} or "
        f"{size + patch} to choose"
    )


def say_upscaled_pack(d) -> None:
    """`_say_upscaled` for a packed detection set: its training split's packed annotation file
    (fetched into the node's cache from a URL, as the ranks would) gives the images' sizes."""
    from types import SimpleNamespace  # noqa: PLC0415 (a pack's)

    from visiondist.data.shards import ShardError, open_store  # noqa: PLC0415 (reader)

    if "min_size" not in d or not _speaks():
        return
    try:
        store = open_store(d)
        entry = json.loads(store.read_small(f"{d.train_split}.json"))
        if "annotations" not in entry:
            return
        path = store.local(
            entry["annotations"], entry["annotations_sha256"], entry["annotations_size"]
        )
        images = json.loads(path.read_text()).get("images", [])
    except (ShardError, OSError, ValueError, KeyError):  # the run's own checks say what
        return
    _say_upscaled(
        d,
        [
            SimpleNamespace(width=int(i["width"]), height=int(i["height"]))
            for i in images
            if "width" in i and "height" in i
        ],
    )
