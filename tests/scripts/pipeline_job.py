"""A feature added to the step pipeline from outside the package, on 2 ranks (one case of the diagnostics job).

``StepRecorder`` is what a new feature is: a ``StepComponent`` subclass, and one line that puts it in the engine's
list (here ``engine.pipeline.add``). It records the points it is called at, and at one step rank 1 has news: the
flag it declares travels in the step's agreement and every rank reads it by name.
"""

import lightning as L
import torch.distributed as dist

from lightning_ddp_plus import DDPPlusStrategy
from lightning_ddp_plus.pipeline.component import (
    AgreedStep,
    BackwardEnd,
    BackwardStart,
    EpochEnd,
    FitStart,
    ForwardStart,
    StepComponent,
)
from tests.helpers import QUIET_TRAINER, TinyRegression

NEWS = "step recorder's news"


class StepRecorder(StepComponent):
    agreement_flags = (NEWS,)

    def __init__(self, news_at_step: int) -> None:
        self.news_at_step, self.rank, self.steps = news_at_step, -1, 0
        self.calls: list[str] = []
        self.agreed_news: dict[int, int] = {}

    def fit_starts(self, fit: FitStart) -> None:
        self.rank = dist.get_rank()
        self.calls.append("fit_starts")

    def forward_starts(self, forward: ForwardStart) -> None:
        if forward.training:
            self.calls.append(f"forward_starts {forward.step}")

    def before_backward(self, backward: BackwardStart) -> None:
        self.calls.append("before_backward")

    def after_backward(self, backward: BackwardEnd) -> None:
        self.calls.append("after_backward")

    def _has_news(self) -> bool:
        return self.rank == 1 and self.steps + 1 == self.news_at_step

    def agreement_values(self) -> dict[str, int]:
        return {NEWS: int(self._has_news())}

    def agreed(self, agreed: AgreedStep) -> None:
        self.calls.append("agreed")
        self.agreed_news[agreed.step] = agreed.flags[NEWS]

    def step_done(self, step: int) -> None:
        self.steps = step
        self.calls.append(f"step_done {step}")

    def epoch_ends(self, end: EpochEnd) -> None:
        self.calls.append(f"epoch_ends {end.step}{' training_ends' if end.training_ends else ''}")

    def fit_ends(self, failed: bool) -> None:
        self.calls.append(f"fit_ends failed={failed}")


def run_case(case: dict) -> dict:
    strategy = DDPPlusStrategy(process_group_backend="gloo")
    recorder = StepRecorder(case["news_at_step"])
    strategy.engine.pipeline.add(recorder)  # the feature's one line
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=case["steps"], max_epochs=1, **QUIET_TRAINER
    )
    trainer.fit(TinyRegression(num_samples=8 * case["steps"], batch_size=4))
    flag_exchanges = [r.step for r in strategy.engine.ledger.records if r.op.startswith("flag all_reduce")]
    return {
        "calls": recorder.calls,
        "agreed_news": {str(step): value for step, value in recorder.agreed_news.items()},
        "flag_exchanges_at_steps": flag_exchanges,
    }
