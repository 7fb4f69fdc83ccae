"""Worker functions for test_keras_api.py: every name of horovod.keras and horovod.tensorflow.keras on Sluice.

Run in forked workers (TF and Keras are imported there only); each check's outcome goes into the
returned dict, which the test compares with Horovod's semantics. The lists below are the names
Horovod's `__init__.py` files export (and its callbacks and elastic modules).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.integration.tf_jobs import _tf

#: horovod/keras/__init__.py's public names
KERAS = ["Adasum", "Average", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "Sum",
         "allgather", "allreduce", "broadcast", "broadcast_global_variables", "callbacks", "ccl_built", "cross_rank",
         "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "init",
         "is_initialized", "load_model", "local_rank", "local_size", "mpi_built", "mpi_enabled",
         "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "rocm_built", "shutdown", "size",
         "start_timeline", "stop_timeline"]
#: horovod/tensorflow/keras/__init__.py's: no Adasum or PartialDistributedOptimizer, process sets instead
TF_KERAS = sorted({*KERAS, "ProcessSet", "add_process_set", "remove_process_set"}
                  - {"Adasum", "PartialDistributedOptimizer"})
CALLBACKS = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
             "LearningRateWarmupCallback", "MetricAverageCallback"]
KERAS_ELASTIC = ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
TF_ELASTIC = ["ObjectState", "TensorFlowKerasState", "TensorFlowState", "run"]


def _raises(fn: Any) -> str:
    """The name of what fn() raised ("" if nothing), "(ValueError)" added for a subclass of it."""
    try:
        fn()
    except Exception as exc:
        subclass = isinstance(exc, ValueError) and type(exc) is not ValueError
        return type(exc).__name__ + ("(ValueError)" if subclass else "")
    return ""


def _list(value: Any) -> Any:
    return np.asarray(value).tolist()


def _missing() -> dict[str, list[str]]:
    import sluice.keras
    import sluice.keras.callbacks
    import sluice.keras.elastic
    import sluice.tensorflow.compression
    import sluice.tensorflow.elastic
    import sluice.tensorflow.functions
    import sluice.tensorflow.keras
    import sluice.tensorflow.keras.callbacks
    import sluice.tensorflow.keras.elastic

    modules = {"sluice.keras": (sluice.keras, KERAS), "sluice.tensorflow.keras": (sluice.tensorflow.keras, TF_KERAS),
               "sluice.keras.callbacks": (sluice.keras.callbacks, CALLBACKS),
               "sluice.tensorflow.keras.callbacks": (sluice.tensorflow.keras.callbacks, CALLBACKS),
               "sluice.keras.elastic": (sluice.keras.elastic, KERAS_ELASTIC),
               "sluice.tensorflow.keras.elastic": (sluice.tensorflow.keras.elastic, KERAS_ELASTIC),
               "sluice.tensorflow.elastic": (sluice.tensorflow.elastic, TF_ELASTIC),
               # what programs import from Horovod's TF submodules (`from horovod.tensorflow.mpi_ops import Sum`)
               "sluice.tensorflow.mpi_ops": (sluice.tensorflow.mpi_ops, ["Sum", "Average", "allreduce", "size"]),
               "sluice.tensorflow.compression": (sluice.tensorflow.compression, ["Compression"]),
               "sluice.tensorflow.functions": (sluice.tensorflow.functions,
                                               ["broadcast_variables", "broadcast_object", "allgather_object"])}
    return {name: [n for n in names if not hasattr(module, n)] for name, (module, names) in modules.items()}


def _values(tf: Any, hvd: Any, tfk: Any, rank: int, folder: str) -> dict[str, Any]:
    """The value functions, the queries, process sets, the timeline; errors, each followed by a collective."""
    out: dict[str, Any] = {}
    queries = [hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size(), hvd.cross_rank(),
               hvd.is_initialized(), hvd.mpi_enabled(), hvd.mpi_built(), hvd.gloo_enabled(), hvd.gloo_built(),
               hvd.nccl_built(), hvd.ddl_built(), hvd.ccl_built(), hvd.cuda_built(), hvd.rocm_built()]
    out["queries"] = [int(q) for q in queries]
    out["queries_same"] = [tfk.size(), tfk.rank()] == queries[:2]
    out["mpi_threads_supported"] = _raises(hvd.mpi_threads_supported)
    hvd.start_timeline(str(Path(folder) / "timeline.json"))
    out["average"] = _list(hvd.allreduce([1.0 + rank, 2.0]))
    out["sum"] = _list(hvd.allreduce(np.float32(1.0 + rank), average=False))
    hvd.stop_timeline()
    out["op_with_average"] = _raises(lambda: hvd.allreduce([1.0], op=hvd.Sum))  # average=True is horovod.keras's
    out["after_error"] = _list(hvd.allreduce([float(rank)], op=hvd.Sum, average=None))
    out["tf_keras_sum"] = _list(tfk.allreduce([float(rank)], op=tfk.Sum))  # average=None is horovod.tensorflow.keras's
    out["adasum"] = _list(hvd.allreduce([1.0 - rank, float(rank)], op=hvd.Adasum, average=None))  # orthogonal: the sum
    half = hvd.allreduce([0.5 + rank], compression=hvd.Compression.fp16, average=None, op=hvd.Average)
    out["fp16"] = [half.dtype.name, float(half.numpy()[0])]
    out["allgather"] = _list(tfk.allgather([[rank]] * (2 - rank)))
    out["broadcast"] = _list(hvd.broadcast([rank + 5.0], root_rank=1))
    out["reducescatter"] = _list(hvd.reducescatter([[1.0], [2.0], [3.0], [4.0]]))
    out["reducescatter_sum"] = _list(tfk.reducescatter(np.full((4, 1), rank + 1.0), op=tfk.Sum))
    out["root_disagrees"] = _raises(lambda: hvd.broadcast([1.0], root_rank=rank))
    out["after_disagreement"] = _list(tfk.allreduce([1.0], op=tfk.Sum))
    out["broadcast_global_variables"] = _raises(lambda: tfk.broadcast_global_variables(0))
    out["global_set"] = [hvd.global_process_set.size(), tfk.global_process_set.process_set_id]
    out["version_check"] = [tfk.is_version_greater_equal_than("2.21.0", "2.4.0"),
                            tfk.is_version_greater_equal_than("2.3.1", "2.4.0"),
                            _raises(lambda: tfk.is_version_greater_equal_than("2.3", "2.4"))]
    solo = tfk.add_process_set(tfk.ProcessSet([0]))
    out["process_set"] = [solo.size(), solo.included(), tfk.remove_process_set(solo), solo.process_set_id]
    name = "timeline.json" if rank == 0 else "timeline.rank1.json"
    out["timeline"] = isinstance(json.loads((Path(folder) / name).read_text()), list | dict)
    return out


def _model(keras: Any, seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def _recorder(keras: Any) -> Any:
    """A callback that keeps the weights training begins with (after the broadcast) and each batch's rate."""
    class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.start: list[Any] = []
            self.rates: list[float] = []

        def on_train_begin(self, logs: Any = None) -> None:
            self.start = [w.tolist() for w in self.model.get_weights()]

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.rates.append(float(self.model.optimizer.learning_rate.numpy()))

    return Recorder()


def _callbacks(keras: Any, hvd: Any, tfk: Any, rank: int, folder: str) -> dict[str, Any]:
    """fit with Horovod's callbacks; the schedules hook by hook; BestModelCheckpoint; load_model."""
    out: dict[str, Any] = {}
    rng = np.random.default_rng(rank)
    x, y = rng.standard_normal((8, 4)).astype(np.float32), (np.arange(8) % 2).astype(np.int64)
    model = _model(keras, 10 + rank)
    out["initial"] = [w.tolist() for w in model.get_weights()]
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    recorder = _recorder(keras)
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    best.filepath = str(Path(folder) / f"best{rank}.keras")
    history = model.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=model.layers[0].kernel),
        hvd.callbacks.MetricAverageCallback(), hvd.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=1,
                                                                                          end_epoch=3), best, recorder])
    out["start"], out["rates"], out["loss"] = recorder.start, recorder.rates, history.history["loss"]
    out["best_saved"] = Path(best.filepath).exists()
    out["no_filepath"] = _raises(lambda: model.fit(x, y, verbose=0, callbacks=[tfk.callbacks.BestModelCheckpoint()]))
    out["bad_local"] = _raises(lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[1.0]))
    out["no_initial_lr"] = _raises(lambda: hvd.callbacks.LearningRateScheduleCallback(None, 0.5))

    # the schedules, hook by hook: a smooth one (fractional epochs) and the warm-up, whose end rank 0 prints
    smooth = tfk.callbacks.LearningRateScheduleCallback(0.1, lambda epoch: epoch, staircase=False)
    smooth.set_model(model)
    smooth.set_params({})
    out["no_steps"] = _raises(lambda: smooth.on_train_begin())
    smooth.set_params({"steps": 4})
    smooth.on_train_begin()
    smooth.on_epoch_begin(1)
    smooth.on_train_batch_begin(2)
    out["smooth"] = float(model.optimizer.learning_rate.numpy())  # 0.1 * (1 + 2 / 4)
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1, steps_per_epoch=2, verbose=1)
    warmup.set_model(model)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        warmup.on_train_begin()
        warmup.on_epoch_begin(0)
        warmup.on_train_batch_begin(0)
        out["warmup"] = float(model.optimizer.learning_rate.numpy())  # 0.1 / 2 * (0.5 / 1 + 1)
        warmup.on_epoch_end(0, {})
    out["warmup_printed"] = printed.getvalue().strip()

    path = str(Path(folder) / f"model{rank}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    out["loaded"] = [type(loaded.optimizer).__name__, type(loaded.optimizer) is not keras.optimizers.SGD,
                     int(loaded.optimizer.iterations.numpy())]
    out["legacy_opts"] = _raises(lambda: tfk.load_model(path, legacy_opts=True))
    return out


def _elastic(tf: Any, keras: Any, hvd: Any, tfk: Any, rank: int) -> dict[str, Any]:
    """Horovod's in-memory elastic semantics (its test_elastic_state), outside an elastic job."""
    import sluice.tensorflow.elastic as tf_elastic

    out: dict[str, Any] = {}
    v = 1.0 if rank == 0 else 2.0
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, activation="softmax")])
    model.set_weights([np.full((2, 2), v, np.float32), np.full((2,), v, np.float32)])
    other = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.zeros(2, np.float32)]
    state = tfk.elastic.KerasState(model, keras.optimizers.Adam(0.001 * hvd.size()), batch=20 + rank,
                                   epoch=10 + rank)
    state.sync()
    out["synced"] = [[w.tolist() for w in model.get_weights()], state.batch, state.epoch]
    model.set_weights(other)
    state.batch, state.epoch = 21, 11
    state.restore()
    out["restored"] = [[w.tolist() for w in model.get_weights()], state.batch, state.epoch]
    model.set_weights(other)
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    out["committed"] = [[w.tolist() for w in model.get_weights()], state.batch, state.epoch]

    variable = tf.Variable([float(rank), 3.0])
    plain = tf_elastic.TensorFlowState([variable], step=rank)
    plain.sync()
    variable.assign([9.0, 9.0])
    plain.restore()
    objects = tf_elastic.ObjectState(None, None, history=[rank], note={"rank": rank})

    @hvd.elastic.run
    def train(state: Any, extra: int) -> list[Any]:
        return [state.history, state.note, extra]

    out["tensorflow_state"] = [variable.numpy().tolist(), plain.step]
    out["run"] = train(objects, 7)
    out["unbuilt"] = _raises(lambda: tf_elastic.TensorFlowKerasState(keras.Sequential([keras.layers.Dense(1)])))
    out["not_plain"] = _raises(lambda: tf_elastic.ObjectState(loader=object()))
    return out


def keras_names(folder: str) -> dict[str, Any]:
    """Every name of sluice.keras and sluice.tensorflow.keras, used; see the module."""
    tf = _tf()
    import keras

    import sluice.keras as hvd
    import sluice.tensorflow.keras as tfk

    out: dict[str, Any] = {"missing": _missing()}
    hvd.init()
    tfk.init()  # a second init does nothing
    rank = hvd.rank()
    out.update(_values(tf, hvd, tfk, rank, folder))
    out.update(_callbacks(keras, hvd, tfk, rank, folder))
    out.update(_elastic(tf, keras, hvd, tfk, rank))
    out["same_modules"] = [hvd.callbacks.MetricAverageCallback is tfk.callbacks.MetricAverageCallback,
                           hvd.elastic.KerasState is tfk.elastic.KerasState]
    out["partial"] = type(hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1))).__name__
    hvd.shutdown()
    out["after_shutdown"] = hvd.is_initialized()
    return out
