"""`trainer.precision=16`: fp16 autocast with dynamic loss scaling (torch's GradScaler) and one
skip-or-step decision for the whole job.

- Against fp32, under ddp (dp2, with gradient accumulation), tp2, pp2 and fsdp (dp2): losses,
  gradient norms (which must be the unscaled ones: a scale left in would make them 65536 times too
  large) and evaluations within fp16 tolerance, and not within fp32 round-off (the run did compute
  in fp16).
- An inf planted in one TP rank's gradient only skips the step on every rank (the default
  `on_nonfinite=raise` does not raise), halves the scale on every rank and is counted; the replicas
  stay identical. A NaN loss is counted apart.
- The scale and its growth tracker survive a stop + resume exactly; a run resumed from an fp32
  checkpoint starts at the initial scale.

The multi-rank runs use the real Trainer, several runs per launch (`fp16_ranks`).
"""

import fp16_ranks
import pytest
import torch
from helpers import evals_of, losses_of, spawn_ranks, train_args

INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default, which trainer.precision=16 keeps


# relative: fp16 rounds to 4.9e-4; 3 steps of the tiny model stay within 1.6e-4 of fp32 (measured)
FP16_TOL = 1e-3


# every layout matches one process in fp32 within this (tests/multirank/test_tensor_parallel.py,
# ...)
FP32_ROUND_OFF = 1e-5


# Defaults otherwise (clip_grad=1.0, AdamW, the loader's settings but workers off, as in every tiny
# run of helpers: the loader is the same whatever the precision); the EMA is on so that its
# evaluation is compared too.
COMMON = ["model.num_heads=2", "trainer.max_steps=3", "trainer.ema_decay=0.9"]


LAYOUTS = {
    "ddp2+accum2": ["parallel.dp=2", "trainer.grad_accum=2"],
    "tp2": ["parallel=tp2"],
    "pp2": ["parallel=pp2"],
    "fsdp2": ["parallel=fsdp"],
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, tiny_shapes):
    """An fp32 ddp2 run (which every layout matches to fp32 round-off), then fp16 under each
    layout."""
    root = tmp_path_factory.mktemp("fp16")
    cases = [(train_args(tiny_shapes, root / "fp32", *COMMON, "parallel.dp=2"), 0)]
    cases += [
        (train_args(tiny_shapes, root / name, *COMMON, *layout, "trainer.precision=16"), 0)
        for name, layout in LAYOUTS.items()
    ]
    results = spawn_ranks(fp16_ranks.runs, 2, cases, timeout=240)
    return root, {name: results[0][i] for i, name in enumerate(["fp32", *LAYOUTS])}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp16_trains_like_fp32(layout_runs, name):
    root, results = layout_runs
    ref, run = root / "fp32", root / name
    losses, ref_losses = losses_of(run), losses_of(ref)
    assert sorted(losses) == [1, 2, 3]
    norms, ref_norms = _column(run, "grad_norm"), _column(ref, "grad_norm")
    errors = []
    for step in losses:
        assert losses[step] == pytest.approx(ref_losses[step], rel=FP16_TOL), step
        # unscaled before the norm
        assert norms[step] == pytest.approx(ref_norms[step], rel=FP16_TOL), step
        errors += [_rel(losses[step], ref_losses[step]), _rel(norms[step], ref_norms[step])]
    evals, ref_evals = (
        evals_of(run, "val_loss", "val_ema_loss")[3],
        evals_of(ref, "val_loss", "val_ema_loss")[3],
    )
    # evaluation under fp16 autocast, model and EMA
    assert evals == pytest.approx(ref_evals, rel=FP16_TOL)
    errors += [_rel(a, b) for a, b in zip(evals, ref_evals)]
    assert max(errors) > FP32_ROUND_OFF  # it did run in fp16
    summary = results[name]["summary"]
    assert (
        summary["fp16 loss scale"] == INIT_SCALE and "skipped steps (fp16 overflow)" not in summary
    )
    assert "fp16 loss scale" not in results["fp32"]["summary"]
    assert results[name]["adam_steps"] == [3.0]


def _column(run, key: str) -> dict[int, float]:
    from visiondist.observe.metrics import read_metrics

    return {
        int(r["step"]): r[key] for r in read_metrics(run / "metrics.csv") if r.get(key) is not None
    }


TP2 = ["model.num_heads=2", "parallel=tp2", "trainer.precision=16", "trainer.max_steps=5"]


@pytest.fixture(scope="module")
def overflow_runs(tmp_path_factory, tiny_shapes):
    """Under tp2, TP rank 1 alone finds an inf in a gradient at step 2 (`fp16_ranks._fit`): five
    steps straight; the same stopped after step 3 and resumed; an fp32 run stopped after step 1,
    resumed under fp16 (on_nonfinite=skip) with the same overflow at step 2 and a NaN loss on TP
    rank 1 at step 3."""
    root = tmp_path_factory.mktemp("overflow")
    fp32 = ["model.num_heads=2", "parallel=tp2", "trainer.max_steps=3"]
    cases = [
        (train_args(tiny_shapes, root / "straight", *TP2), 2),
        (train_args(tiny_shapes, root / "split", *TP2, "trainer.stop_at_step=3"), 2),
        (train_args(tiny_shapes, root / "split", *TP2), 2),  # resume=auto
        (train_args(tiny_shapes, root / "fp32", *fp32, "trainer.stop_at_step=1"), 0),
        (
            train_args(
                tiny_shapes,
                root / "from_fp32",
                *fp32,
                "trainer.precision=16",
                "trainer.on_nonfinite=skip",
                f"trainer.resume={root / 'fp32' / 'checkpoints' / 'step_1'}",
            ),
            2,
            3,
        ),
    ]
    results = spawn_ranks(fp16_ranks.runs, 2, cases, timeout=240)
    return root, [
        dict(zip(("straight", "stopped", "resumed", "fp32", "from_fp32"), results[r]))
        for r in (0, 1)
    ]


def test_an_overflow_on_one_tp_rank_skips_the_step_on_every_rank(overflow_runs):
    root, ranks = overflow_runs
    first, second = (r["straight"] for r in ranks)
    assert {first["tp_rank"], second["tp_rank"]} == {0, 1}
    for name, value in first["replicated"].items():  # the replicas did the same thing at every step
        assert torch.equal(value, second["replicated"][name]), name
    # 5 steps, step 2 skipped on both ranks
    assert first["adam_steps"] == second["adam_steps"] == [4.0]
    assert first["scaler"] == second["scaler"]
    # halved, 3 since
    assert (first["scaler"]["scale"], first["scaler"]["_growth_tracker"]) == (INIT_SCALE / 2, 3)
    summary = first["summary"]  # trainer.on_nonfinite=raise (the default): an overflow is no error
    assert summary["steps"] == 5 and summary["skipped steps (fp16 overflow)"] == 1
    assert (
        summary["fp16 loss scale"] == INIT_SCALE / 2 and "skipped steps (non-finite)" not in summary
    )
    assert (
        "fp16 gradient overflow at step 2: optimizer step skipped on every rank"
        in (root / "straight" / "train.log").read_text()
    )


def test_the_loss_scale_survives_a_stop_and_resume(overflow_runs):
    from safetensors.torch import load_file

    from visiondist.checkpoint.files import read_trainer_state

    root, ranks = overflow_runs
    saved = read_trainer_state(root / "split" / "checkpoints" / "step_3")["grad_scaler"]
    assert (saved["scale"], saved["_growth_tracker"]) == (INIT_SCALE / 2, 1)
    for rank in ranks:
        assert rank["resumed"]["scaler"] == rank["straight"]["scaler"]
    straight, split = losses_of(root / "straight"), losses_of(root / "split")
    assert sorted(split) == [1, 2, 3, 4, 5] and [split[s] for s in (4, 5)] == [
        straight[s] for s in (4, 5)
    ]
    a, b = (
        load_file(root / "straight" / "model.safetensors"),
        load_file(root / "split" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_resumed_from_an_fp32_checkpoint_starts_at_the_initial_scale(overflow_runs):
    """... and a non-finite loss is counted as such, not as an overflow (both skip and back off)."""
    root, ranks = overflow_runs
    # the initial scale, halved by the overflow at step 2 and by the NaN loss at step 3
    for rank in ranks:
        result = rank["from_fp32"]
        assert (result["scaler"]["scale"], result["scaler"]["_growth_tracker"]) == (
            INIT_SCALE / 4,
            0,
        )
        assert result["adam_steps"] == [1.0]  # step 1 in fp32; steps 2 and 3 skipped
    summary = ranks[0]["from_fp32"]["summary"]  # on_nonfinite=skip
    assert (
        summary["skipped steps (fp16 overflow)"] == 1 and summary["skipped steps (non-finite)"] == 1
    )
    assert (
        "the checkpoint is not from an fp16 run: the loss scale starts at 65536"
        in (root / "from_fp32" / "train.log").read_text()
    )
