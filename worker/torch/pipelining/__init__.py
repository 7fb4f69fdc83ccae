"""Pipeline parallelism for torch over Sluice (as torch.distributed.pipelining): stages, schedules, splits.

    import sluice.torch as hvd
    from sluice.worker.torch.pipelining import PipelineStage, Schedule1F1B, split_model

    hvd.init()
    parts = split_model(model, stages=2)                 # every worker builds the model, keeps its part
    stage = PipelineStage(parts[hvd.rank() % 2], None, 2)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    schedule.step(x) / schedule.step(target=y, losses=losses) / schedule.step()
    optimizer.step()                                     # the stage's own parameters

Interleaved: `parts = split_model(model, stages=2 * V)`, `PipelineStage(parts[rank % 2::2], None, 2)` (V chunks,
chunk c being virtual stage 2c + rank % 2), `ScheduleInterleaved1F1B` or `ScheduleInterleavedZeroBubble`.
"""

from sluice.worker.pipeline.layout import StagePlace
from sluice.worker.torch.pipelining.schedules import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    get_schedule_class,
)
from sluice.worker.torch.pipelining.split import split_model, split_points
from sluice.worker.torch.pipelining.stage import PipelineStage

__all__ = ["PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "StagePlace", "get_schedule_class", "split_model", "split_points"]
