"""Tensor (and sequence) parallelism on gloo ranks against the single-process run: losses, global
grad norms and every gathered parameter after 3 AdamW steps (in fp32, and in bf16 within bf16's
round-off); per-rank parameter counts and TP traffic against their analytic values; the check itself
fails on a naive fused-qkv shard; TP peers load the same samples. The tests marked `layouts` also
run with the ranks on a GPU (tests/devices.py)."""

import math

import pytest
import torch
import tp_ranks
from helpers import spawn_ranks
from tp_ranks import BATCH, TINY

TOL = 1e-5
# each parameter after 3 AdamW steps, relative to its norm: the layouts sum in another order, and
# AdamW divides every gradient element by its own running magnitude, which turns near-cancelling
# sums' round-off into more than TOL (up to 3.3e-5, tp4 + SP, measured on a 2-core CPU where TOL
# failed); a wrong gradient moves weights by whole steps (lr), over 1e-2 of such a tensor's norm
PARAM_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _round_off_only(name: str) -> bool:
    """The key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by all
    keys): from its zero init AdamW moves it by round-off alone, different in every layout. It must
    stay that small; it cannot match."""
    return name.endswith("attn.k.bias")


def assert_matches(got: dict, ref: dict) -> None:
    """The acceptance check: losses, grad norms and logits within TOL (relative) of the reference,
    every parameter within PARAM_TOL. A parameter may instead be within a thousandth of one AdamW
    step everywhere: AdamW divides each gradient element by its own running magnitude, so an element
    whose gradient is a near-cancelling sum (a LayerNorm bias, say) turns the layouts' different
    summation order into a relative difference above the tolerance, while a wrong gradient moves the
    weights by a whole step (lr)."""
    assert got["losses"] == pytest.approx(ref["losses"], rel=TOL)
    assert got["norms"] == pytest.approx(ref["norms"], rel=TOL)
    assert rel_err(got["logits"], ref["logits"]) <= TOL
    assert got["state"].keys() == ref["state"].keys()
    for name, value in ref["state"].items():
        assert got["state"][name].shape == value.shape, name
        if _round_off_only(name):
            limit = 1e-2 * tp_ranks.OPTIM.lr  # a hundredth of one step
            assert value.abs().max() < limit and got["state"][name].abs().max() < limit, name
            continue
        step_fraction = (got["state"][name] - value).abs().max().item() / tp_ranks.OPTIM.lr
        assert rel_err(got["state"][name], value) <= PARAM_TOL or step_fraction <= 1e-3, (
            name,
            rel_err(got["state"][name], value),
            step_fraction,
        )


@pytest.fixture(scope="module")
def reference():
    ref = tp_ranks.train_reference()
    assert ref["norms"][0] > tp_ranks.CLIP  # clipping is active, so a wrong global norm would show
    return ref


@pytest.fixture(scope="module")
def two_ranks():
    # the third: each block under torch.compile; the fourth: under bf16 autocast
    cases = [(1, 2, False), (1, 2, True), (1, 2, False, True), (1, 2, False, False, True)]
    return spawn_ranks(tp_ranks.run, 2, cases, {"naive_tp": 2, "vitdet_tp": 2, "native_tp": 2})


@pytest.fixture(scope="module")
def four_ranks(tiny_shapes):
    cases = [(1, 4, False), (1, 4, True), (2, 2, False), (2, 2, True)]
    return spawn_ranks(tp_ranks.run, 4, cases, {"loader": (str(tiny_shapes), 2, 2)})


def _cases(
    results: dict, dp: int, tp: int, sp: bool, compile: bool = False, bf16: bool = False
) -> list[dict]:
    found = [
        c
        for r in results.values()
        for c in r["cases"]
        if (c["dp"], c["tp"], c["sp"], c["compile"], c["bf16"]) == (dp, tp, sp, compile, bf16)
    ]
    assert len(found) == dp * tp
    return found


@pytest.mark.smoke
@pytest.mark.layouts
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_matches_one_process(two_ranks, reference, sp):
    for case in _cases(two_ranks, 1, 2, sp):  # every rank gathers the same full model
        assert_matches(case, reference)


@pytest.mark.layouts
@pytest.mark.parametrize(
    "dp,tp,sp",
    [(1, 4, False), (1, 4, True), (2, 2, False), (2, 2, True)],
    ids=["tp4", "tp4-sp", "dp2xtp2", "dp2xtp2-sp"],
)
def test_tp4_and_dp2xtp2_match_one_process(four_ranks, reference, dp, tp, sp):
    for case in _cases(four_ranks, dp, tp, sp):
        assert_matches(case, reference)


@pytest.mark.layouts
def test_compiled_blocks_under_tp2_match_one_process(two_ranks, reference):
    """`trainer.compile`: every block under torch.compile, sharded by TP, its collectives inside the
    graph."""
    for case in _cases(two_ranks, 1, 2, False, compile=True):
        assert_matches(case, reference)


# bf16's stated tolerance: the layouts sum partial products in another order, each rounded to bf16's
# 8-bit mantissa. Measured on 2 CPU cores: losses within 2.6e-4 of one process under the same
# autocast, grad norms 1.6e-3, logits 4.6e-3 (about what bf16 itself is from fp32 here: 2.9e-4,
# logits 5.3e-3); the tolerances are 4-8x those figures. (Parameters are not compared: AdamW divides
# each gradient element by its own magnitude, so a bf16 rounding that flips a tiny gradient's sign
# moves that element by up to two steps in either run.)
BF16_LOSS, BF16_NORM, BF16_LOGITS = 2e-3, 1e-2, 2e-2


@pytest.mark.layouts
def test_tp2_in_bf16_matches_one_process_within_bf16_round_off(two_ranks):
    """Under bf16 autocast the row-parallel outputs are reduced in bf16: 3 steps' losses, grad norms
    and the logits within bf16's stated tolerance of one process under the same autocast."""
    ref = tp_ranks.train_reference(bf16=True)
    for case in _cases(two_ranks, 1, 2, False, bf16=True):
        assert case["losses"] == pytest.approx(ref["losses"], rel=BF16_LOSS)
        assert case["norms"] == pytest.approx(ref["norms"], rel=BF16_NORM)
        assert rel_err(case["logits"], ref["logits"]) <= BF16_LOGITS


def test_naive_fused_qkv_shard_fails_the_check(two_ranks, reference):
    """Cutting timm's fused qkv into contiguous pieces raises nothing; the equivalence check catches
    it."""
    for result in two_ranks.values():
        naive = result["naive_logits"]
        assert torch.isfinite(naive).all()
        assert rel_err(naive, reference["logits"]) > 100 * TOL
        with pytest.raises(AssertionError):
            assert_matches({**result["cases"][0], "logits": naive}, reference)


def _analytic_rank_params(tp: int) -> int:
    c, h, p, k = (
        TINY["embed_dim"],
        int(TINY["embed_dim"] * TINY["mlp_ratio"]),
        TINY["patch_size"],
        TINY["num_classes"],
    )
    tokens = (TINY["img_size"] // p) ** 2 + 1
    # q, k, v (w + b), proj w, fc1 (w + b), fc2 w
    sharded = 3 * (c * c + c) + c * c + (h * c + h) + c * h
    replicated = 2 * c + 4 * c  # proj and fc2 biases (added after the reduce), two LayerNorms
    # patch embed, cls, pos, norm, head
    outside = (3 * p * p * c + c) + c + tokens * c + 2 * c + (c * k + k)
    return TINY["depth"] * (sharded // tp + replicated) + outside


def test_rank_parameter_count_is_analytic(two_ranks, four_ranks, reference):
    full = sum(v.numel() for v in reference["state"].values())
    assert _analytic_rank_params(1) == full
    for results, tp in ((two_ranks, 2), (four_ranks, 4), (four_ranks, 2)):
        for case in (c for r in results.values() for c in r["cases"] if c["tp"] == tp):
            assert case["rank_params"] == _analytic_rank_params(tp)


def _analytic_traffic(dp: int, tp: int, sp: bool, bf16: bool = False) -> tuple[dict, dict]:
    """Megatron's count for one step (forward + backward) of this layout, fp32 (`bf16`: without SP
    under autocast, whose row-parallel outputs are bf16 while the gradients stay fp32): (payload
    bytes, calls) per kind."""
    b, c, depth = BATCH // dp, TINY["embed_dim"], TINY["depth"]
    tokens = (TINY["img_size"] // TINY["patch_size"]) ** 2 + 1
    # per block: an all-reduce after attention and after the MLP, forward; their mirror images
    # backward
    if not sp:
        forward = 2 if bf16 else 4
        return {"all_reduce": 2 * depth * b * tokens * c * (forward + 4)}, {"all_reduce": 4 * depth}
    padded = math.ceil(tokens / tp) * tp
    act = b * padded * c * 4
    # per block 2 forward + 2 backward, plus entering (backward) and leaving (forward) blocks
    gathers = 4 * depth + 2
    # gradients of norm1, norm2 (w + b) and the proj / fc2 biases, summed once per step
    partial = depth * 6 * c * 4
    payload = {
        "all_gather": gathers * act,
        "reduce_scatter": 4 * depth * act,
        "all_reduce": partial,
    }
    return payload, {"all_gather": gathers, "reduce_scatter": 4 * depth, "all_reduce": 1}


def test_tp_traffic_counter_is_megatrons_count(two_ranks, four_ranks):
    for results in (two_ranks, four_ranks):
        for case in (c for r in results.values() for c in r["cases"]):
            payload, calls = _analytic_traffic(case["dp"], case["tp"], case["sp"], case["bf16"])
            assert case["traffic"] == {"payload": payload, "calls": calls}, (
                case["dp"],
                case["tp"],
                case["sp"],
            )


def test_tp_peers_load_the_same_samples_dp_ranks_different(four_ranks):
    by_rank = [r["loader"] for r in four_ranks.values()]
    for dp_rank in (0, 1):
        peers = [r for r in by_rank if r["dp_rank"] == dp_rank]
        assert len(peers) == 2 and {r["tp_rank"] for r in peers} == {0, 1}
        assert peers[0]["indices"] == peers[1]["indices"]
        assert (
            peers[0]["checksum"] == peers[1]["checksum"]
            and peers[0]["first_pixels"] == peers[1]["first_pixels"]
        )
    dp0 = next(r for r in by_rank if r["dp_rank"] == 0)
    dp1 = next(r for r in by_rank if r["dp_rank"] == 1)
    for a, b in zip(dp0["indices"], dp1["indices"]):
        assert len(a) == len(b) == 4 and not set(a) & set(b)  # global batch 8 split over 2 DP ranks
    assert dp0["checksum"] != dp1["checksum"]


@pytest.mark.layouts
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_vitdet_backbone_under_tp_gives_the_single_process_features(two_ranks, sp):
    """The same plan shards the ViT inside a detector: every pyramid level and every gradient match
    one process."""
    features, grads, model = tp_ranks.vitdet_reference()
    for result in two_ranks.values():
        got = result["vitdet"][sp]
        assert got["features"].keys() == features.keys() == {"0", "1", "2", "3", "pool"}
        for name, value in features.items():
            assert rel_err(got["features"][name], value) <= TOL, name
        for name, _ in model.named_parameters():
            if _round_off_only(name):
                continue
            assert rel_err(got["grads"][name], grads[name]) <= TOL, name
        assert got["state_keys"] == sorted(n for n, _ in model.named_parameters())
        assert got["params"] < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_native_resolution_sequences_under_tp_match_one_process(two_ranks, sp):
    """Images at their own sizes, packed two to a sequence, attention kept inside each image: the
    logits and every gradient under tp2 (and SP, which splits the masked sequence) are one
    process's."""
    logits, grads = tp_ranks.native_reference()
    assert logits.shape == (4, tp_ranks.TINY["num_classes"])
    for result in two_ranks.values():
        got = result["native"][sp]
        assert rel_err(got["logits"], logits) <= TOL
        assert got["grads"].keys() == grads.keys()
        for name, value in grads.items():
            if _round_off_only(name):
                continue
            assert rel_err(got["grads"][name], value) <= TOL, name
