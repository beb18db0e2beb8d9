"""The DETR-class criterion (visiondist/models/detr_criterion.py, detr_matching.py): the batched
assignment against scipy's on 1,000 random cost matrices, the RT-DETR and RF-DETR losses against
transformers' on the same outputs, D-FINE's against a direct transcription of the original
implementation's equations (GO-LSD union matching, FGL, DDF), and a step's host synchronisations
counted."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

pytest.importorskip("transformers")
pytest.importorskip("scipy")

from host_reads import HostReads
from scipy.optimize import linear_sum_assignment

from visiondist.models import detr_matching
from visiondist.models.detr_library import build_detr
from visiondist.models.detr_matching import assign_batched, go_union


def test_assignment_equals_scipy_on_1000_random_cost_matrices():
    """Batches of padded problems (ties from small integer costs, images without targets, more
    targets than queries, query groups) solved in one transfer give exactly scipy's assignment of
    each unpadded matrix."""
    rng = np.random.default_rng(0)
    solved = 0
    while solved < 1000:
        batch, groups, queries = (
            int(rng.integers(1, 5)),
            int(rng.choice([1, 1, 3])),
            int(rng.integers(1, 10)),
        )
        counts = [int(rng.integers(0, queries + 4)) for _ in range(batch)]
        most = max(max(counts), 1)
        if rng.random() < 0.5:  # ties
            cost = rng.integers(0, 3, size=(batch * groups, queries, most)).astype(np.float32)
        else:
            cost = rng.standard_normal((batch * groups, queries, most)).astype(np.float32)
        cost[..., :] += 0  # padded columns hold values the assignment must never read: poison them
        for p in range(batch * groups):
            cost[p, :, counts[p // groups] :] = -1e6
        (result,) = assign_batched([torch.from_numpy(cost)], counts)
        for p, (rows, cols) in enumerate(result):
            n = counts[p // groups]
            want_rows, want_cols = linear_sum_assignment(cost[p, :, :n]) if n else ([], [])
            assert rows.tolist() == list(want_rows) and cols.tolist() == list(want_cols)
            assert len(rows) == min(queries, n)
            solved += 1


def test_go_union_keeps_each_querys_most_frequent_target():
    layers = [
        (np.array([0, 1, 2]), np.array([0, 1, 2])),  # last layer
        # query 1 -> target 2 once, query 3 -> target 2
        (np.array([0, 1, 3]), np.array([0, 2, 2])),
        (np.array([0, 1]), np.array([0, 2])),
    ]  # query 1 -> target 2 again: its most frequent
    rows, cols = go_union(layers)
    assert dict(zip(rows.tolist(), cols.tolist())) == {0: 0, 1: 2, 2: 2, 3: 2}


def _cfg(arch, **kw):
    base = {
        "name": arch,
        "arch": arch,
        "num_classes": 3,
        "img_size": 64,
        "kwargs": {},
        "num_queries": 16,
        "weights": None,
        "multi_scale": None,
    }
    return OmegaConf.create({**base, **kw})


TARGETS = [
    {"boxes": torch.tensor([[4.0, 6.0, 40.0, 50.0]]), "labels": torch.tensor([3]), "image_id": 1},
    {
        "boxes": torch.tensor(
            [[10.0, 10.0, 30.0, 20.0], [0.0, 0.0, 64.0, 64.0], [30.0, 30.0, 60.0, 50.0]]
        ),
        "labels": torch.tensor([1, 2, 2]),
        "image_id": 2,
    },
    {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long), "image_id": 3},
]


def _outputs(arch, seed=0, device="cpu"):
    """A training step's raw outputs as the model hands them to its loss function (with denoising
    groups where the family has them), and the criterion installed on it."""
    torch.manual_seed(seed)
    model = build_detr(_cfg(arch)).to(device).train()
    # past the initialisation, where D-FINE's layers all predict the same edges (zero heads)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bbox_embed" in name or "class_embed" in name:
                param.add_(torch.randn_like(param) * 0.05)
    criterion = model.model.loss_function
    captured = {}

    def capture(*args, **kwargs):
        captured.update(args=args, kwargs=kwargs)
        return criterion(*args, **kwargs)

    model.model.loss_function = capture
    targets = [
        {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()}
        for t in TARGETS
    ]
    model([torch.rand(3, 64, 64, device=device) for _ in TARGETS], targets)
    _outputs.model = model
    return criterion, captured["args"], captured["kwargs"]


@pytest.mark.parametrize("arch", ["rtdetr_v2_r18", "rfdetr_nano"])
def test_losses_equal_transformers_where_they_agree(arch):
    """RT-DETRv2 (varifocal, every layer and the encoder matched apart, denoising groups) and
    RF-DETR (IoU-aware BCE, 13 query groups matched apart): the same total as transformers' loss on
    the same outputs, and the same gradient."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    criterion, args, kwargs = _outputs(arch)
    theirs_fn = LOSS_MAPPING[
        {"rtdetr_v2_r18": "RTDetrV2ForObjectDetection", "rfdetr_nano": "RfDetrForObjectDetection"}[
            arch
        ]
    ]
    if arch == "rtdetr_v2_r18":
        assert kwargs["denoising_meta_values"] is not None
        # the denoising queries' assignment built on the host equals the model's own positive
        # indices
        meta, counts = kwargs["denoising_meta_values"], [len(t["labels"]) for t in TARGETS]
        groups, most = meta["dn_num_group"], max(counts)
        for i, n in enumerate(counts):
            want = [g * 2 * most + j for g in range(groups) for j in range(n)]
            assert meta["dn_positive_idx"][i].tolist() == want
    leaves = [p for p in _outputs.model.parameters() if p.requires_grad]
    ours, terms, _ = criterion(*args, **kwargs)
    theirs = theirs_fn(*args, **kwargs)[0]
    assert len(terms) > 6
    # sums of its terms in other orders
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grads_ours = torch.autograd.grad(ours, leaves, retain_graph=True, allow_unused=True)
    grads_theirs = torch.autograd.grad(theirs, leaves, allow_unused=True)
    for a, b in zip(grads_ours, grads_theirs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------------ D-FINE: the original's
# equations, directly
def _original_dfine(args, kwargs, config):
    """Peterande/D-FINE's `DFINECriterion.forward` on one process, transcribed from its equations:
    each head matched by the Hungarian matcher (the RT-DETR matcher's costs, as the original's), the
    GO-LSD union of the last layer's, the other layers', the pre-decoder and the encoder's matchings
    for the box and localisation terms, varifocal classification, FGL and DDF."""
    from transformers.loss.loss_d_fine import bbox2distance
    from transformers.loss.loss_for_object_detection import box_iou, generalized_box_iou
    from transformers.loss.loss_rt_detr import RTDetrHungarianMatcher

    def xyxy(b):
        cx, cy, w, h = b.unbind(-1)
        return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)

    labels = args[1]
    cls, coord = args[5], args[6]
    corners, refs, meta = (
        kwargs["predicted_corners"],
        kwargs["initial_reference_points"],
        kwargs["denoising_meta_values"],
    )
    split = meta["dn_num_split"]
    dn_cls, cls = cls.split(split, 2)
    dn_coord, coord = coord.split(split, 2)
    dn_corners, corners = corners.split(split, 2)
    dn_refs, refs = refs.split(split, 2)
    layers = corners.shape[1]

    def outputs(c, b, k, r, i, teacher=True):  # decoder layer i (0-based)
        out = {
            "logits": c[:, i + 1],
            "pred_boxes": b[:, i + 1],
            "pred_corners": k[:, i],
            "ref_points": r[:, i],
        }
        if teacher:
            out.update(teacher_corners=k[:, -1], teacher_logits=c[:, -1])
        return out

    last = outputs(cls, coord, corners, refs, layers - 1, teacher=False)
    aux = [outputs(cls, coord, corners, refs, i) for i in range(layers - 1)]
    pre = {"logits": cls[:, 0], "pred_boxes": coord[:, 0]}
    enc = {"logits": kwargs["enc_topk_logits"], "pred_boxes": kwargs["enc_topk_bboxes"]}
    dn = [
        outputs(dn_cls, dn_coord, dn_corners, dn_refs, i, teacher=i < layers - 1)
        for i in range(layers)
    ]
    dn_pre = {"logits": dn_cls[:, 0], "pred_boxes": dn_coord[:, 0]}

    matcher = RTDetrHungarianMatcher(config)
    indices = matcher(last, labels)
    aux_indices = [matcher(a, labels) for a in aux]
    pre_indices = matcher(pre, labels)
    enc_indices = matcher(enc, labels)
    go = []
    for b in range(len(labels)):  # the union: each query's most frequent target (stable ties)
        pairs = torch.cat(
            [
                torch.stack([ix[b][0], ix[b][1]], 1)
                for ix in [indices, *aux_indices, pre_indices, enc_indices]
            ]
        )
        unique, counts = torch.unique(pairs, return_counts=True, dim=0)
        kept = {}
        for row, col in unique[torch.argsort(counts, descending=True, stable=True)].tolist():
            kept.setdefault(row, col)
        go.append(
            (
                torch.tensor(list(kept), dtype=torch.long),
                torch.tensor(list(kept.values()), dtype=torch.long),
            )
        )
    num_boxes = max(sum(len(t["class_labels"]) for t in labels), 1)
    num_go = max(sum(len(r) for r, _ in go), 1)
    groups = meta["dn_num_group"]
    dn_indices = [
        (p, torch.arange(len(t["class_labels"])).tile(groups))
        for p, t in zip(meta["dn_positive_idx"], labels)
    ]
    alpha, gamma, bins = config.focal_loss_alpha, config.focal_loss_gamma, config.max_num_bins
    w = {
        "vfl": config.weight_loss_vfl,
        "bbox": config.weight_loss_bbox,
        "giou": config.weight_loss_giou,
        "fgl": config.weight_loss_fgl,
        "ddf": config.weight_loss_ddf,
    }

    def src(ix):
        return (
            torch.cat([torch.full_like(s, i) for i, (s, _) in enumerate(ix)]),
            torch.cat([s for s, _ in ix]),
        )

    def tgt(ix, key):
        return torch.cat([t[key][j] for t, (_, j) in zip(labels, ix)])

    def vfl(out, ix, n):
        idx = src(ix)
        ious = torch.diag(box_iou(xyxy(out["pred_boxes"][idx].detach()), xyxy(tgt(ix, "boxes")))[0])
        logits = out["logits"]
        classes = torch.full(logits.shape[:2], logits.shape[-1], dtype=torch.long)
        classes[idx] = tgt(ix, "class_labels")
        target = F.one_hot(classes, logits.shape[-1] + 1)[..., :-1]
        score = torch.zeros(logits.shape[:2])
        score[idx] = ious
        score = score[..., None] * target
        weight = alpha * logits.sigmoid().detach().pow(gamma) * (1 - target) + score
        loss = F.binary_cross_entropy_with_logits(logits, score, weight=weight, reduction="none")
        return loss.mean(1).sum() * logits.shape[1] / n

    def boxes(out, ix, n):
        idx = src(ix)
        pred, target = out["pred_boxes"][idx], tgt(ix, "boxes")
        giou = torch.diag(generalized_box_iou(xyxy(pred), xyxy(target)))
        return (
            w["bbox"] * F.l1_loss(pred, target, reduction="sum") / n
            + w["giou"] * (1 - giou).sum() / n
        )

    state = {}

    def local(out, ix, n, is_dn):
        idx = src(ix)
        target = tgt(ix, "boxes")
        pred = out["pred_corners"][idx].reshape(-1, bins + 1)
        goal, w_right, w_left = bbox2distance(
            out["ref_points"][idx].detach(),
            xyxy(target),
            bins,
            config.reg_scale,
            torch.tensor([config.up]),
        )
        ious = torch.diag(box_iou(xyxy(out["pred_boxes"][idx]), xyxy(target))[0])
        weight = ious.unsqueeze(-1).repeat(1, 1, 4).reshape(-1).detach()
        left = goal.long()
        dfl = F.cross_entropy(pred, left, reduction="none") * w_left.reshape(-1) + F.cross_entropy(
            pred, left + 1, reduction="none"
        ) * w_right.reshape(-1)
        total = w["fgl"] * (dfl * weight).sum() / n
        if "teacher_corners" in out:
            pred = out["pred_corners"].reshape(-1, bins + 1)
            teacher = out["teacher_corners"].reshape(-1, bins + 1)
            weight = out["teacher_logits"].sigmoid().max(dim=-1)[0]
            mask = torch.zeros_like(weight, dtype=torch.bool)
            mask[idx] = True
            mask = mask.unsqueeze(-1).repeat(1, 1, 4).reshape(-1)
            weight[idx] = ious.reshape_as(weight[idx]).to(weight.dtype)
            weight = weight.unsqueeze(-1).repeat(1, 1, 4).reshape(-1).detach()
            kl = (
                weight
                * 25
                * torch.nn.KLDivLoss(reduction="none")(
                    F.log_softmax(pred / 5, 1), F.softmax(teacher.detach() / 5, 1)
                ).sum(-1)
            )
            if not is_dn:
                scale = 32 / out["pred_boxes"].shape[0]
                state["pos"], state["neg"] = (
                    (mask.sum() * scale) ** 0.5,
                    ((~mask).sum() * scale) ** 0.5,
                )
            pos = kl[mask].mean() if mask.any() else 0
            neg = kl[~mask].mean() if (~mask).any() else 0
            total = total + w["ddf"] * (pos * state["pos"] + neg * state["neg"]) / (
                state["pos"] + state["neg"]
            )
        return total

    total = (
        w["vfl"] * vfl(last, indices, num_boxes)
        + boxes(last, go, num_go)
        + local(last, go, num_go, False)
    )
    for out, ix in zip(aux, aux_indices):
        total = (
            total
            + w["vfl"] * vfl(out, ix, num_boxes)
            + boxes(out, go, num_go)
            + local(out, go, num_go, False)
        )
    total = total + w["vfl"] * vfl(pre, pre_indices, num_boxes) + boxes(pre, go, num_go)
    total = total + w["vfl"] * vfl(enc, enc_indices, num_boxes) + boxes(enc, go, num_go)
    n_dn = num_boxes * groups
    for out in dn:
        total = (
            total
            + w["vfl"] * vfl(out, dn_indices, n_dn)
            + boxes(out, dn_indices, n_dn)
            + local(out, dn_indices, n_dn, True)
        )
    return total + w["vfl"] * vfl(dn_pre, dn_indices, n_dn) + boxes(dn_pre, dn_indices, n_dn)


@pytest.mark.parametrize("seed", [0, 1])
def test_dfine_loss_equals_the_original_implementations_equations(seed):
    """D-FINE as its paper and code train it (transformers' DFineLoss differs: each layer its own
    matching, no FGL on the last layer, its aux layers paired with the next layer's corners): equal
    to the transcription, and not to transformers'."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    criterion, args, kwargs = _outputs("dfine_n", seed)
    ours, terms, _ = criterion(*args, **kwargs)
    assert {"fgl_last", "ddf_layer0", "ddf_dn_layer0", "giou_pre", "class_enc"} <= set(terms)
    original = _original_dfine(args, kwargs, criterion.config)
    # sums of its terms in other orders
    torch.testing.assert_close(ours, original, rtol=1e-5, atol=1e-5)
    transformers_total = LOSS_MAPPING["DFineForObjectDetection"](*args, **kwargs)[0]
    assert abs(float(transformers_total.detach()) - float(ours.detach())) > 1e-3
    assert all(float(terms[k].detach()) > 0 for k in ("fgl_last", "ddf_layer0", "ddf_dn_layer0"))


@pytest.mark.parametrize("arch", ["rtdetr_v2_r18", "dfine_n", "rfdetr_nano"])
def test_a_step_reads_the_device_once(arch, monkeypatch):
    """Every layer's, the encoder's and the denoising groups' matching in one transfer to the host
    and one back, and no other host read in the loss and its backward (the CUDA step is checked by
    the GPU test)."""
    criterion, args, kwargs = _outputs(arch)
    transfers = {"to_host": 0, "to_device": 0}
    to_host, to_device = detr_matching.to_host, detr_matching.to_device

    def counted_host(values):
        transfers["to_host"] += 1
        return to_host(values)

    def counted_device(values, device):
        transfers["to_device"] += 1
        return to_device(values, device)

    monkeypatch.setattr(detr_matching, "to_host", counted_host)
    monkeypatch.setattr(detr_matching, "to_device", counted_device)
    with HostReads() as reads:
        total, _, _ = criterion(*args, **kwargs)
        total.backward()
    assert transfers == {"to_host": 1, "to_device": 1}
    assert reads.seen == []


def test_the_host_read_check_sees_what_it_should():
    """The stand-in above counts the reads that sync a CUDA step: .item(), bool(), torch.equal, mask
    indexing."""
    x = torch.rand(5)
    with HostReads() as reads:
        x.sum().item()
        bool(x.max() > 0)
        torch.equal(x, x)
        _ = x[x > 0.5]
    assert len(reads.seen) >= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["rtdetr_v2_r18", "dfine_n", "rfdetr_nano"])
def test_a_cuda_step_synchronises_once(arch, monkeypatch):
    """On the GPU, under CUDA's sync debug mode set to fail on any synchronisation: the loss and its
    backward run with the one transfer of the cost matrices as their only synchronisation (50 steps'
    worth of calls)."""
    criterion, args, kwargs = _outputs(arch, device="cuda")
    to_host, transfers = detr_matching.to_host, []

    def allowed(values):
        torch.cuda.set_sync_debug_mode(0)
        try:
            transfers.append(values.numel())
            return to_host(values)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(detr_matching, "to_host", allowed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(50):
            total, _, _ = criterion(*args, **kwargs)
            total.backward(retain_graph=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(transfers) == 50
    assert torch.isfinite(total)
