"""The training loop built alone, with stand-in parts and recording hooks: which hook sees what and
when, how a hook ends the loop, where a resumed run starts its epoch, and what a failing step still
closes. The loop's parts and hooks are handed in (`visiondist.engine.run.build_trainer` hands in the
real ones), so nothing here trains."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from visiondist.engine.state import LoopState, Resumed
from visiondist.engine.trainer import Hook, Trainer


class Sampler:
    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch
        self.epochs: list[tuple[int, int]] = []

    def set_epoch(self, epoch: int, start: int) -> None:
        self.epochs.append((epoch, start))


class Step:
    """Stands in for `OptimizerStep`: each step takes one batch and returns its loss; `fail_at`
    raises there."""

    def __init__(self, state: LoopState, fail_at: int = 0, step_s: float = 0.0):
        self.state, self.fail_at, self.batches, self.settled = state, fail_at, [], 0
        self.step_s = step_s

    def train_step(self, batches):
        if self.state.step + 1 == self.fail_at:
            raise RuntimeError(f"step {self.fail_at} failed")
        self.batches.append(next(batches))
        time.sleep(self.step_s)
        return torch.tensor(float(self.state.step + 1)), torch.tensor(1.0)

    def settle(self) -> None:
        self.settled += 1


class Recorder(Hook):
    """Records every call as (its name, the method, the step the loop state holds); `stop_after`
    ends the loop."""

    def __init__(self, name: str, calls: list, stop_after: int = 0):
        self.name, self.calls, self.stop_after = name, calls, stop_after

    def before_train(self, trainer):
        self.calls.append((self.name, "before_train", trainer.state.step))

    def step_context(self, trainer):
        @contextlib.contextmanager
        def around():
            self.calls.append((self.name, "enter", trainer.state.step))
            yield
            self.calls.append((self.name, "exit", trainer.state.step))

        return around()

    def after_step(self, trainer, loss, grad_norm):
        self.calls.append((self.name, "after_step", trainer.state.step))
        assert loss.item() == trainer.state.step  # the loss of the step just counted
        return trainer.state.step == self.stop_after

    def after_train(self, trainer, complete):
        self.calls.append((self.name, f"after_train complete={complete}", trainer.state.step))

    def close(self, trainer):
        self.calls.append((self.name, "close", trainer.state.step))


def _trainer(
    hooks,
    total=5,
    steps_per_epoch=2,
    stop_at_step=0,
    resumed_step=0,
    fail_at=0,
    batch_s=0.0,
    step_s=0.0,
) -> Trainer:
    sampler = Sampler(steps_per_epoch)

    def train_batches(device):  # the epoch's batches, numbered from 100 x the epochs set before it
        first = 100 * (len(sampler.epochs) - 1)
        for batch in range(first, first + 100):
            time.sleep(batch_s)
            yield batch

    task = SimpleNamespace(train_batches=train_batches, data=SimpleNamespace(train_sampler=sampler))
    parts = SimpleNamespace(task=task, data=task.data, total_steps=total)
    state = LoopState.starting_from(Resumed(step=resumed_step), steps_per_epoch)
    cfg = OmegaConf.create({"trainer": {"stop_at_step": stop_at_step}})
    layout = SimpleNamespace(device=torch.device("cpu"))
    return Trainer(
        cfg,
        layout,
        Path("unused"),
        parts,
        state,
        Step(state, fail_at, step_s),
        checkpoints=None,
        validation=None,
        metrics=None,
        utilisation=None,
        hooks=hooks,
    )


def test_every_hook_sees_every_step_in_order_and_the_epochs_follow_the_sampler():
    calls: list = []
    trainer = _trainer([Recorder("a", calls), Recorder("b", calls)], total=5, steps_per_epoch=2)
    assert trainer.train() is True
    # 5 steps of 2 a epoch: the third epoch is under way
    assert trainer.state.step == 5 and trainer.state.epoch == 2
    sampler = trainer.parts.data.train_sampler
    assert sampler.epochs == [(0, 0), (1, 0), (2, 0)]
    # each epoch's own batches, from their first
    assert trainer.optimizer_step.batches == [0, 1, 100, 101, 200]
    assert calls[:2] == [("a", "before_train", 0), ("b", "before_train", 0)]
    per_step = [
        ("a", "enter", 0),
        ("b", "enter", 0),
        ("b", "exit", 0),
        ("a", "exit", 0),
        ("a", "after_step", 1),
        ("b", "after_step", 1),
    ]
    assert calls[2:8] == per_step
    assert len(calls) == 2 + 6 * 5 + 4
    assert calls[-4:] == [
        ("a", "close", 5),
        ("b", "close", 5),
        ("a", "after_train complete=True", 5),
        ("b", "after_train complete=True", 5),
    ]
    # the verdicts still in flight, acted on before the hooks end
    assert trainer.optimizer_step.settled == 1


def test_a_hook_ends_the_loop_after_its_step_and_the_hooks_after_it_do_not_see_that_step():
    calls: list = []
    trainer = _trainer(
        [Recorder("a", calls), Recorder("stop", calls, stop_after=3), Recorder("c", calls)], total=8
    )
    assert trainer.train() is False
    assert trainer.state.step == 3
    after = [(name, step) for name, what, step in calls if what == "after_step"]
    assert after == [
        ("a", 1),
        ("stop", 1),
        ("c", 1),
        ("a", 2),
        ("stop", 2),
        ("c", 2),
        ("a", 3),
        ("stop", 3),
    ]
    assert ("c", "after_train complete=False", 3) in calls


def test_stop_at_step_and_a_resumed_run_start_and_end_where_they_should():
    trainer = _trainer([], total=9, steps_per_epoch=4, stop_at_step=7, resumed_step=5)
    assert trainer.train() is False
    assert trainer.state.step == 7
    # epoch 1, its first step done before the stop
    assert trainer.parts.data.train_sampler.epochs == [(1, 1)]
    assert trainer.optimizer_step.batches == [0, 1]


def test_a_failing_step_closes_every_hook_and_ends_no_run():
    calls: list = []
    trainer = _trainer([Recorder("a", calls)], total=5, fail_at=3)
    with pytest.raises(RuntimeError, match="step 3 failed"):
        trainer.train()
    assert calls[-1] == ("a", "close", 2)
    assert not [c for c in calls if c[1].startswith("after_train")]


def test_untimed_work_is_not_training_time():
    class Slow(Hook):
        def after_step(self, trainer, loss, grad_norm):
            with trainer.untimed():
                time.sleep(0.2)

    trainer = _trainer([Slow()], total=3)
    trainer.train()
    assert trainer.state.timer.total_seconds < 0.2  # three untimed 0.2 s pauses left out


class WaitReader(Hook):
    """Reads the share of training time spent waiting for batches at the last step, as the log
    line does (paused first)."""

    def __init__(self, last: int):
        self.last, self.wait = last, None

    def after_step(self, trainer, loss, grad_norm):
        if trainer.state.step == self.last:
            trainer.state.timer.pause()
            self.wait = trainer.state.timer.data_wait


@pytest.mark.parametrize(
    "batch_s, step_s, low, high",
    [(0.05, 0.0, 0.9, 1.0), (0.0, 0.05, 0.0, 0.1), (0.04, 0.04, 0.3, 0.7)],
)
def test_the_time_the_step_waits_for_its_batches_is_its_share_of_training_time(
    batch_s, step_s, low, high
):
    """A loader slower than the step shows as waiting (the devices idle), one that keeps up hardly
    at all; evaluations and checkpoints (untimed) count in neither share."""

    class Untimed(Hook):
        def after_step(self, trainer, loss, grad_norm):
            with trainer.untimed():
                time.sleep(0.05)

    reader = WaitReader(last=6)
    trainer = _trainer(
        [Untimed(), reader], total=6, steps_per_epoch=4, batch_s=batch_s, step_s=step_s
    )
    trainer.train()
    assert low <= reader.wait <= high, reader.wait


def test_the_evaluation_cadence_every_epoch_every_n_steps_or_only_at_the_end():
    """trainer.eval_every: 0 evaluates after each epoch's last step, N after every N-th step, -1
    after no step of the loop (only the end of the run's evaluation, `EvalHook.after_train`)."""
    from visiondist.engine.hooks.results import EvalHook

    trainer = _trainer([], total=9, steps_per_epoch=4)

    def evaluated(every):
        trainer.cfg = OmegaConf.create({"trainer": {"eval_every": every}})
        due = []
        for step in range(1, 10):
            trainer.state.step = step
            due += [step] if EvalHook.due(trainer) else []
        return due

    assert evaluated(0) == [4, 8]
    assert evaluated(3) == [3, 6, 9]
    assert evaluated(-1) == []


def test_eval_every_below_minus_one_is_refused_naming_the_values():
    from visiondist.config import ConfigError, compose
    from visiondist.config.validate import validate

    cfg = compose(Path(__file__).resolve().parents[2] / "configs", ["trainer.eval_every=-1"])
    validate(cfg)
    cfg.trainer.eval_every = -2
    with pytest.raises(
        ConfigError,
        match=r"trainer.eval_every=-2: give the optimizer steps .* 0 "
        r"\(every epoch\) or -1 \(only at the end of the run\)",
    ):
        validate(cfg)
