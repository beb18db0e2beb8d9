"""Real photographs at ImageNet's sizes, for measuring the input path (no download: scikit-image ships the
sources). `build_photos(root, count)` writes an ImageFolder tree <root>/train/<photo>/NNNNN.JPEG."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "stereo_motorcycle")


def build_photos(root: Path, count: int, seed: int = 0) -> dict:
    """`count` JPEGs cut from scikit-image's photographs into <root>/train/<photo>/: ~440 x 390 px, quality 90-95."""
    from skimage import data

    rng = np.random.default_rng(seed)
    sources = {}
    for name in PHOTOS:
        image = getattr(data, name)()
        image = image[0] if name == "stereo_motorcycle" else image
        scale = max(1.0, 440 / min(image.shape[:2]))  # every source at least 440 px on its short side
        sources[name] = cv2.resize(image, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC) if scale > 1 else image
    sizes = []
    for i in range(count):
        name = PHOTOS[i % len(PHOTOS)]
        source = sources[name]
        h, w = int(rng.integers(340, 421)), int(rng.integers(400, 501))
        h, w = min(h, source.shape[0]), min(w, source.shape[1])
        y, x = int(rng.integers(0, source.shape[0] - h + 1)), int(rng.integers(0, source.shape[1] - w + 1))
        crop = np.ascontiguousarray(source[y:y + h, x:x + w])
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        folder = root / "train" / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:05d}.JPEG"
        cv2.imwrite(str(path), cv2.cvtColor(crop, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(90, 96))])
        sizes.append((w, h, path.stat().st_size))
    w, h, b = (float(np.mean(v)) for v in zip(*sizes))
    return {"images": count, "mean_width": round(w), "mean_height": round(h), "mean_kb": round(b / 1024, 1)}
