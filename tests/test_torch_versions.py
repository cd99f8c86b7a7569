"""What differs between the supported torch releases (2.13 in CI; 2.14.1 and 2.15.0 with scripts/check_torch.sh).

Each test runs, and means something, on every supported version: it checks a fact the package relies on there, or
exercises a path whose failure mode some version makes worse. The timeline under torch's per-direction / per-edge
communicators is tested in test_timeline.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_pipe._step.pipeline import StageModule, StagePipeline
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import SCHEDULES, schedule_spec

WIDTH, ROWS, MICROBATCHES = 8, 8, 4


def test_the_stage_keyword_is_not_one_of_step_and_evals_own():
    """Every stage gets the batch rows of its microbatch as a keyword argument of ``step``/``eval``, which torch
    hands to the stages only if it does not take that keyword itself (2.14 added ``arg_mbs``, ``kwarg_mbs``,
    ``target_mbs``, 2.15 ``finalize_gradients``)."""
    stage_keywords = {
        name for name, p in inspect.signature(StageModule.forward).parameters.items() if p.kind is p.KEYWORD_ONLY
    }
    assert stage_keywords == {"lp_rows"}
    for name in SCHEDULES:
        cls = get_schedule_class(name)
        for method in (cls.step, cls.eval):
            parameters = inspect.signature(method).parameters
            assert not stage_keywords & set(parameters), (name, method.__name__)
            assert any(p.kind is p.VAR_KEYWORD for p in parameters.values()), (name, method.__name__)
        assert {"target", "return_outputs"} <= set(inspect.signature(cls.step).parameters), name


# ------------------------------------------------------------------------------------------ a step that fails
class FailingStage(nn.Module):
    """A stage as :class:`StagePipeline` runs it (the input of the stage, ``lp_rows`` the batch rows of the
    microbatch); its forward raises at call number ``fail_at``. With a ``target``, the last stage's forward returns the
    microbatch's loss, as the program's does in training."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(ROWS, WIDTH) if first else None
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0
        self.fail_at: int | None = None
        self.target: torch.Tensor | None = None

    def forward(self, *inputs: torch.Tensor, lp_rows: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("stage failed")
        hidden = self.embed(inputs[0]) if self.embed is not None else inputs[0]
        out = torch.tanh(self.linear(hidden))
        return out if self.target is None else (out - self.target[lp_rows]).pow(2).mean()


@pytest.fixture
def one_process_group() -> Iterator[None]:
    if dist.is_initialized():  # left by an in-process Trainer of an earlier test (Lightning keeps it): one process
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_a_schedule_whose_step_failed_is_rebuilt(schedule: str, one_process_group: None):
    """Both stages on one process, as with ``devices=1``. Evaluation runs (torch's ``eval()`` cannot hand a stage's
    output to the next stage on the same process). After a step that raised in the middle, stepping the same torch
    stages again fails (Interleaved1F1B) or loses gradients (ZBVZeroBubble) on every torch version, and 2.15 keeps
    receive buffers owned by the failed step: the pipeline builds new ones, which give the same results."""
    torch.manual_seed(0)
    stages = {0: FailingStage(first=True), 1: FailingStage(first=False)}
    spec = schedule_spec(schedule)
    pipeline = StagePipeline(
        stages, StageLayout(((0, 1), (1, 2)), 1, spec.placement), spec, MICROBATCHES, dist.group.WORLD,
        torch.device("cpu"), probe=lambda stage, rows, received: (((len(rows), WIDTH), torch.float32),),
    )
    params = [p for stage in stages.values() for p in stage.parameters()]
    target = torch.randn(ROWS, WIDTH)
    sample = torch.arange(ROWS // MICROBATCHES)

    def train() -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        stages[1].target = target
        try:
            pipeline.train_step(sample, ROWS, MICROBATCHES)
        finally:
            stages[1].target = None
        assert all(p.grad is not None for p in params)
        return [p.grad.clone() for p in params]

    def evaluate() -> list[torch.Tensor]:
        output = pipeline.eval_step(sample, ROWS, MICROBATCHES)
        assert output is not None
        return [output]

    def fails(run) -> None:
        stages[1].fail_at = stages[1].calls + 2  # the last stage's second microbatch
        with pytest.raises(RuntimeError) as raised:
            run()
        assert "stage failed" in (str(raised.value), str(raised.value.__cause__)), raised.value
        stages[1].fail_at = None

    with torch.no_grad():  # evaluation through torch's schedule is the plain forward
        rows = torch.arange(ROWS)
        direct = stages[1](stages[0](rows, lp_rows=rows), lp_rows=rows)
    torch.testing.assert_close(evaluate()[0], direct)
    for run, training in ((train, True), (evaluate, False)):
        expected = run()
        failed_schedule = pipeline._schedule_for(pipeline._key_for(sample, ROWS, MICROBATCHES, training))
        fails(run)
        assert pipeline._schedule_for(pipeline._key_for(sample, ROWS, MICROBATCHES, training)) is not failed_schedule
        got = run()
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected)), (schedule, run)
