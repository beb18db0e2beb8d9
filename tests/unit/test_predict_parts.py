"""tools/predict.py's parts in process: what each kind of source resolves to (and what is refused),
how the parts of a stopped prediction are read and merged, and the batches that make the files
independent of the ranks. The tool itself, run as a user runs it:
tests/multirank/test_predict.py."""

import json
from pathlib import Path

import numpy as np
import pytest

from visiondist.config import ConfigError
from visiondist.inference.outputs import PartWriter, batches, done, drawn_name, merged, remaining
from visiondist.inference.sources import resolve_source


@pytest.fixture
def tree(tmp_path):
    """b/2.png, a/1.JPG, a/deep/3.webp, and files that are not images."""
    for name in ("b/2.png", "a/1.JPG", "a/deep/3.webp", "a/notes.txt", "c/clip.json"):
        path = tmp_path / "images" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    return tmp_path / "images"


def test_a_folder_is_searched_recursively_for_images_in_sorted_order(tree):
    source = resolve_source(str(tree))
    assert source.kind == "folder" and len(source) == 3
    assert [source.name(i) for i in range(3)] == ["a/1.JPG", "a/deep/3.webp", "b/2.png"]


def test_a_glob_a_list_and_one_image(tree, tmp_path):
    source = resolve_source(f"{tree}/**/*.png")
    assert source.kind == "glob" and source.paths == [str(tree / "b" / "2.png")]
    listed = tmp_path / "paths.txt"
    listed.write_text(
        f"# the photos\nimages/b/2.png\n\n{tree / 'a' / '1.JPG'}\nimages/missing.jpg\n"
    )
    source = resolve_source(str(listed))
    # in the list's order, relative to its folder; a missing file is the rank's to name
    assert source.kind == "list"
    assert source.paths == [
        str(tmp_path / "images/b/2.png"),
        str(tree / "a" / "1.JPG"),
        str(tmp_path / "images/missing.jpg"),
    ]
    # the outputs name each entry as the list gives it (docs/prediction.md: "as given")
    assert [source.name(i) for i in range(3)] == [
        "images/b/2.png",
        str(tree / "a" / "1.JPG"),
        "images/missing.jpg",
    ]
    one = resolve_source(str(tree / "a" / "1.JPG"))
    assert one.kind == "image" and len(one) == 1


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("nowhere", "no such file or folder"),
        ("images/a/notes.txt", "the list names no image"),
        ("images/c/clip.json", "not an image"),
        ("images/c", "the folder holds no images"),
        ("images/*.gif", "the glob matches no images"),
        ("", "give source=<path>"),
    ],
)
def test_what_is_refused_names_the_fix(tree, monkeypatch, spec, expected):
    monkeypatch.chdir(tree.parent)
    (tree / "a" / "notes.txt").write_text("# nothing listed\n")
    with pytest.raises(ConfigError, match=expected):
        resolve_source(spec)


def test_a_video_gives_every_strided_frame(tmp_path):
    import cv2

    video = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 5, (32, 24))
    for k in range(7):
        writer.write(np.full((24, 32, 3), 30 * k, dtype=np.uint8))
    writer.release()
    source = resolve_source(str(video), vid_stride=3)
    assert source.kind == "video" and source.frames == [0, 3, 6] and source.size == (32, 24)
    assert [source.name(i) for i in range(3)] == ["clip.mp4#0", "clip.mp4#3", "clip.mp4#6"]
    from visiondist.inference.sources import VideoFrames

    frames = VideoFrames(str(video))
    means = [int(frames.read(f).mean()) for f in (0, 3, 6, 2)]  # in order, then a jump back
    frames.close()
    assert (
        abs(means[0] - 0) <= 3
        and abs(means[1] - 90) <= 3
        and abs(means[2] - 180) <= 3
        and abs(means[3] - 60) <= 3
    )
    with pytest.raises(ConfigError, match="vid_stride=0"):
        resolve_source(str(video), vid_stride=0)


def test_batches_do_not_depend_on_the_ranks():
    assert [list(b) for b in batches(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_a_stopped_prediction_continues_from_its_complete_batches(tmp_path):
    """Two attempts' parts: a half-written last line is not counted, a batch with a missing item is
    predicted again, and the merge gives each item once, in order, the first attempt's line
    winning."""
    first = PartWriter(tmp_path, 0)
    first.write([{"index": 0, "file": "a", "v": 1}, {"index": 1, "file": "b", "v": 1}])
    first.write([{"index": 2, "file": "c", "v": 1}])
    first.file.write('{"index": 3, "fi')  # killed mid-line
    first.close()
    other = PartWriter(tmp_path, 1)
    other.write([{"index": 6, "file": "g", "v": 1}])
    other.close()
    seen = done(tmp_path, 7)
    assert seen.tolist() == [True, True, True, False, False, False, True]
    todo = remaining(batches(7, 2), seen)
    assert [list(b) for b in todo] == [[2, 3], [4, 5]]
    again = PartWriter(tmp_path, 0)
    assert again.path.name == "rank0-1.jsonl"  # a new attempt's part: the first stays as it was
    again.write([{"index": 2, "file": "c", "v": 2}, {"index": 3, "file": "d", "v": 2}])
    again.write([{"index": 4, "file": "e", "v": 2}, {"index": 5, "file": "f", "v": 2}])
    again.close()
    records = list(merged(tmp_path))
    assert [r["index"] for r in records] == list(range(7))
    assert [r["v"] for r in records] == [1, 1, 1, 2, 2, 2, 1]
    assert (
        json.loads((tmp_path / "parts" / "rank0-0.jsonl").read_text().splitlines()[0])["file"]
        == "a"
    )


def test_drawn_names_keep_the_position_and_the_folder():
    assert drawn_name(12, "cat/0042.jpg") == "000012_cat_0042.jpg"
    assert drawn_name(3, "/abs/path/x.png") == "000003_path_x.jpg"
    assert drawn_name(0, "clip.mp4#25") == "000000_clip_frame25.jpg"


def test_drawn_images_keep_their_sources_size_with_labels_scaled_to_it():
    """A thumbnail and a photo-sized image come back at their own size (no enlargement), boxes and
    labels drawn on them, the label's letters taller on the larger image."""
    import numpy as np

    from visiondist.inference.outputs import draw

    heights = {}
    for width, height in ((64, 42), (451, 300), (320, 240)):
        image = np.full((height, width, 3), 30, np.uint8)
        box = [0.1 * width, 0.3 * height, 0.6 * width, 0.9 * height]
        found = {"detections": [{"box": box, "label": 1, "name": "circle", "score": 0.9}]}
        out = draw(image, found)
        assert out.shape == image.shape
        changed = (out != image).any(-1)
        assert changed.any()
        # the label's band, filled in the box's colour inside its top-left corner: the rows changed
        # in a column just inside the box's left edge
        column = changed[:, round(box[0]) + 4]
        heights[width] = int(column[round(box[1]) : round(box[3]) - 2].sum())
    assert 0 < heights[64] < heights[451], heights


def test_weights_without_class_names_and_no_class_count_are_refused_naming_the_key(tmp_path):
    """Prediction reads no data to count the classes: a weights file that records no names (a
    plain state dict) with data=imagenet's unset count is one line naming data.num_classes."""
    import torch
    from safetensors.torch import save_file

    from visiondist.api.predict_job import prediction_job_config

    weights = tmp_path / "plain.safetensors"
    save_file({"head.weight": torch.zeros(6, 4)}, str(weights))
    with pytest.raises(ConfigError, match=r"records no class names: .* data\.num_classes=<N>"):
        prediction_job_config(
            None, weights, None, ["model=vit_tiny", "data=imagenet"], {"source": "x.jpg"}
        )


def test_detections_of_weights_with_no_data_root_are_numbered_by_position(tree):
    """Predicted from an exported file with data=detection and no data.root (nothing to evaluate
    against): results.json numbers the images by position, as for any folder, rather than failing
    on the unset data.root once every image was predicted."""
    from omegaconf import OmegaConf

    from visiondist.config import compose
    from visiondist.inference.finish import _val_image_ids

    configs = Path(__file__).resolve().parents[2] / "configs"
    cfg = compose(configs, ["model=fasterrcnn_mobilenet_v3", "data=detection"])
    assert OmegaConf.is_missing(cfg.data, "root")
    assert _val_image_ids(cfg, resolve_source(str(tree))) == {}
