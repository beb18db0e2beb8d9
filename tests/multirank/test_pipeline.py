"""Pipeline stages: balanced cuts with canonical parameter names; every torch schedule (GPipe, 1F1B,
interleaved 1F1B, interleaved zero-bubble) on 2 and 4 gloo ranks trains exactly like one process
with the same global batch, also with the stages exchanging host tensors (as ranks sharing a GPU
over gloo do). The tests marked `layouts` also run with the ranks on a GPU (tests/devices.py)."""

import pp_ranks
import pytest
import torch
from devices import SHARED, TEST_DEVICE
from helpers import spawn_ranks

from visiondist.parallel.schedules import p2p_bytes_per_step

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]


def _skip(name: str) -> bool:
    # Attention is invariant to the key bias, so its gradient is round-off only (as in the TP tests)
    return name.endswith("attn.k.bias")


@pytest.fixture(scope="module")
def reference():
    return pp_ranks.train_reference()


def _activation_bytes() -> int:
    """One micro-batch's activation between stages: BATCH / (dp x microbatches) images x tokens x
    embed_dim fp32. Under sequence parallelism too: each stage gathers its tokens before it hands
    them on."""
    tokens = (pp_ranks.TINY["img_size"] // pp_ranks.TINY["patch_size"]) ** 2 + 1
    return pp_ranks.BATCH // pp_ranks.CHUNKS * tokens * pp_ranks.TINY["embed_dim"] * 4


def _check(results: dict, ranks: int, case: tuple, reference: dict) -> None:
    name = f"{case}"
    per_rank = [results[r][case] for r in range(ranks)]
    for r in per_rank:  # every rank reports the global loss and the global gradient norm
        # host tensors between the stages where asked, else where the ranks share a GPU over gloo
        assert r["host_boundary"] == (case[4] if len(case) > 4 else SHARED), name
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert r["norms"] == pytest.approx(reference["norms"], rel=1e-5), name
    last = [r for r in per_rank if r["is_last"]]
    assert last and all(r["logits"] is not None for r in last)
    assert all(r["logits"] is None for r in per_rank if not r["is_last"])
    for r in last:
        torch.testing.assert_close(r["logits"], reference["logits"], rtol=1e-5, atol=1e-6)
    microbatches = case[2]
    # the send counter: each activation forward and each input gradient back, of its real size
    for r in per_rank:
        expected = p2p_bytes_per_step(r["stages"], r["n_stages"], microbatches, _activation_bytes())
        assert r["p2p"] == expected, (name, r["stages"], r["p2p"], expected)
    state = {k: v for r in per_rank for k, v in r["state"].items()}
    assert state.keys() == reference["state"].keys(), name
    for key, value in reference["state"].items():
        if not _skip(key):
            torch.testing.assert_close(
                state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{name} {key}: {m}"
            )


@pytest.mark.layouts
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_one_process(pp, reference):
    """GPipe and 1F1B with one stage per rank, interleaved 1F1B and zero-bubble with two: three
    steps with an evaluation pass in between equal one process with the same micro-batching. At
    pp=2, 1F1B and zero-bubble also with the stages' tensors passed through host memory
    (`HostBoundary`: each stage copies its input in and its output out, autograd through both, the
    zero-bubble schedule's split backward included)."""
    cases = [(name, spr, pp_ranks.CHUNKS, False) for name, spr in SCHEDULES]
    if pp == 2 and TEST_DEVICE != "cuda":  # (NCCL sends device memory only)
        cases += [
            ("1f1b", 1, pp_ranks.CHUNKS, False, True),
            ("zero_bubble", 2, pp_ranks.CHUNKS, False, True),
        ]
    results = spawn_ranks(pp_ranks.run, pp, (pp, 1, 1), cases)
    for case in cases:
        _check(results, pp, case, reference)
        assert sorted(s for r in range(pp) for s in results[r][case]["stages"]) == list(
            range(pp * case[1])
        )


@pytest.mark.layouts
def test_pipeline_composes_with_tensor_and_data_parallel(reference):
    """tp2 x pp2 (with and without sequence parallelism, 1F1B and zero-bubble) and dp2 x pp2 on 4
    ranks."""
    tp_cases = [("1f1b", 1, 4, False), ("zero_bubble", 2, 4, False), ("1f1b", 1, 4, True)]
    results = spawn_ranks(pp_ranks.run, 4, (2, 1, 2), tp_cases)
    for case in tp_cases:
        _check(results, 4, case, reference)
    dp_cases = [("gpipe", 1, 2, False), ("interleaved_1f1b", 2, 2, False)]
    results = spawn_ranks(pp_ranks.run, 4, (2, 2, 1), dp_cases)
    for case in dp_cases:
        _check(results, 4, case, reference)


def test_data_parallel_mean_after_the_flush_is_exact_in_buckets():
    """The pipeline's DP average runs in buckets of a few KB here: bit-equal to the plain mean, with
    at most two buckets' buffers alive (not a copy of every gradient: 28 KB of them)."""
    from visiondist.parallel.grad import IN_FLIGHT, buckets

    limit = 4096
    sizes = [
        len(b) for b in buckets([torch.zeros(n) for n in (3, 700, 7, 2048, 25, 300, 1, 768)], limit)
    ]
    # at most 4 KB each; a gradient of 4 KB or more goes alone, reduced in place
    assert sizes == [3, 1, 3, 1]
    for result in spawn_ranks(pp_ranks.bucketed_mean, 2, limit).values():
        assert result["equal"]
        assert 0 < result["peak"] <= IN_FLIGHT * limit < result["total"]
