"""The Hungarian matching of the DETR criterion (`detr_criterion.py`), batched: every problem's cost
matrix goes to the host in one transfer, scipy's `linear_sum_assignment` solves each, and the
indices come back in one asynchronous copy; D-FINE's GO-LSD union of the layers' matchings is taken
on the host."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch
from torch import Tensor


def to_host(values: Tensor) -> np.ndarray:
    """The step's one device-to-host transfer (a synchronisation on CUDA)."""
    return values.detach().to("cpu").numpy()


def to_device(values: np.ndarray, device: torch.device) -> Tensor:
    """Host indices onto the device: pinned and asynchronous on CUDA, so no synchronisation."""
    host = torch.from_numpy(values)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def solve(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The minimum-cost assignment of a (rows, columns) cost matrix: scipy's `linear_sum_assignment`
    (the Hungarian algorithm the originals use), min(rows, columns) pairs, rows ascending."""
    from scipy.optimize import linear_sum_assignment  # noqa: PLC0415 (the optional extra [detr])

    if cost.shape[0] == 0 or cost.shape[1] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows, cols = linear_sum_assignment(cost)
    return rows.astype(np.int64), cols.astype(np.int64)


def assign_batched(
    costs: list[Tensor], counts: list[int], seconds: Optional[dict] = None
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Each cost tensor (P, Q, T_max) holds P = images x groups problems (image `p // groups`),
    targets padded to the batch's most; image b's problem is its (Q, counts[b]) slice. All of them
    go to the host in one transfer. Returns per tensor, per problem, (rows, columns); `seconds` gets
    the wait for the transfer and the solving."""
    if not costs:
        return []
    sizes = [c.numel() for c in costs]
    start_time = time.perf_counter()
    flat = (
        to_host(torch.cat([c.reshape(-1).float() for c in costs]))
        if sum(sizes)
        else np.zeros(0, np.float32)
    )
    solved_time = time.perf_counter()
    out, start, batch = [], 0, len(counts)
    for cost, size in zip(costs, sizes):
        block = flat[start : start + size].reshape(cost.shape)
        start += size
        groups = cost.shape[0] // batch
        out.append([solve(block[p, :, : counts[p // groups]]) for p in range(cost.shape[0])])
    if seconds is not None:
        seconds["wait"] += solved_time - start_time
        seconds["solve"] += time.perf_counter() - solved_time
    return out


def go_union(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """D-FINE's GO-LSD matching for one image: the (query, target) pairs of every layer's matching
    pooled; each query keeps the target it is matched to most often (ties: the smaller target index,
    then as the pairs sort)."""
    rows = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0, np.int64)
    cols = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0, np.int64)
    if rows.size == 0:
        return rows, cols
    unique, counts = np.unique(np.stack([rows, cols], 1), axis=0, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    seen, keep = set(), []
    for i in order:
        if unique[i, 0] not in seen:
            seen.add(unique[i, 0])
            keep.append(i)
    chosen = unique[np.array(keep, dtype=np.int64)]
    return chosen[:, 0].astype(np.int64), chosen[:, 1].astype(np.int64)
