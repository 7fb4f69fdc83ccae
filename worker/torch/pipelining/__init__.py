"""Pipeline parallelism for torch over Sluice (as torch.distributed.pipelining): stages, schedules, splits.

    import sluice.torch as hvd
    from sluice.worker.torch.pipelining import PipelineStage, Schedule1F1B, split_model

    hvd.init()
    parts = split_model(model, stages=2)                 # every worker builds the model, keeps its part
    stage = PipelineStage(parts[hvd.rank() % 2], None, 2)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.cross_entropy)
    schedule.step(x) / schedule.step(target=y, losses=losses) / schedule.step()
    optimizer.step()                                     # the stage's own parameters
"""

from sluice.worker.pipeline.layout import StagePlace
from sluice.worker.torch.pipelining.schedules import PipelineSchedule, Schedule1F1B, ScheduleGPipe
from sluice.worker.torch.pipelining.split import split_model, split_points
from sluice.worker.torch.pipelining.stage import PipelineStage

__all__ = ["PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe", "StagePlace", "split_model",
           "split_points"]
