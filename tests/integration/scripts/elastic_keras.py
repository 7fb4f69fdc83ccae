"""Horovod's elastic Keras shape on Sluice (`import sluice.tensorflow.keras as hvd`): fit with the state callbacks.

Each worker fits its shard (rows rank::size) of a fixed data set, committing after every batch
(CommitStateCallback, after UpdateEpochStateCallback and UpdateBatchStateCallback, as Horovod's
example orders them); the learning rate is 0.05 x size, set again by a reset callback. Workers start
from different weights: the elastic state gives them rank 0's (or the newest commit's).
Prints `ELASTIC_START {generation, size, epoch, batch, lr, digest, rank, pid, directory}` when a
generation starts training, `ELASTIC_COMMIT {...}` (rank 0) after the commit the lost worker dies
after, and `ELASTIC_RESULT {rank, size, epoch, digest}` at the end; `digest` is a hash of the
model's and optimizer's variables but the learning rate.
--die-epoch E --die-batch B --die-rank R: in generation 0, worker R SIGKILLs itself right after every worker's
commit of batch B of epoch E (a worker lost).
--reference: then every worker runs, deliberately, what the job did with as many workers throughout: a
new model from rank 0's start of generation 0, fit stopped after batch B of epoch E, and fit again from
there; prints `ELASTIC_REFERENCE {rank, start, digest}` (start: the digest it started from).
"""

import argparse
import contextlib
import hashlib
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import sluice.tensorflow.keras as hvd

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--die-epoch", type=int, default=-1)
parser.add_argument("--die-batch", type=int, default=-1)
parser.add_argument("--die-rank", type=int, default=-1)
parser.add_argument("--reference", action="store_true")
args = parser.parse_args()


def generation() -> int:
    """The job's generation now (a survivor of a worker replaced in place goes on to the next one)."""
    return int(os.environ.get("SLUICE_ELASTIC_GENERATION", "0"))


def build() -> keras.Model:
    made = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
    made.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    return made


hvd.init()
keras.utils.set_random_seed(100 + hvd.rank() + 10 * generation())  # every worker starts different
model = build()
rng = np.random.default_rng(0)
x = rng.standard_normal((96, 8)).astype(np.float32)
y = (x[:, :4].argmax(1)).astype(np.int64)
state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def set_lr() -> None:
    model.optimizer.learning_rate = 0.05 * hvd.size()


state.register_reset_callbacks([set_lr])


def digest(of: keras.Model = model) -> str:
    values = [v.numpy() for v in of.variables] + [v.numpy() for v in of.optimizer.variables
                                                     if "learning_rate" not in v.path]
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in values)).hexdigest()[:16]


def say(what: str, **fields: object) -> None:
    print(f"{what} {json.dumps(fields)}", flush=True)


class Die(keras.callbacks.Callback):
    """After the commit of batch B of epoch E, in generation 0: rank 0 says what it committed, rank R dies."""

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if generation() == 0 and state.epoch == args.die_epoch and batch == args.die_batch:
            if hvd.rank() == 0:
                say("ELASTIC_COMMIT", epoch=state.epoch, batch=state.batch, digest=digest())
            # every rank has committed this batch before R dies: else, under load, rank 0's commit could notice
            # R's death first and raise HostsUpdatedInterrupt before this callback said what it committed
            hvd.barrier()
            if hvd.rank() == args.die_rank:
                os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state: hvd.elastic.KerasState) -> None:
    say("ELASTIC_START", generation=generation(), size=hvd.size(), epoch=state.epoch, batch=state.batch,
        lr=float(model.optimizer.learning_rate.numpy()), digest=digest(), rank=hvd.rank(), pid=os.getpid(),
        directory=os.environ.get("SLUICE_ELASTIC_DIR", ""))
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state), Die()]
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], batch_size=8, epochs=args.epochs - state.epoch,
              shuffle=False, verbose=0, callbacks=callbacks)


class Stop(Exception):
    pass


class StopAfterDie(keras.callbacks.Callback):
    """Stop fit after batch B of epoch E, where the lost worker died."""

    def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if self.epoch == args.die_epoch and batch == args.die_batch:
            raise Stop


def reference() -> None:
    keras.utils.set_random_seed(100)  # rank 0's start in generation 0, which every worker took
    ref = build()
    ref.optimizer.build(ref.trainable_variables)  # as the elastic state builds it: its slots in the digest
    start = digest(ref)
    shard = {"x": x[hvd.rank()::hvd.size()], "y": y[hvd.rank()::hvd.size()], "batch_size": 8, "shuffle": False,
             "verbose": 0}
    with contextlib.suppress(Stop):
        ref.fit(**shard, epochs=args.epochs, callbacks=[StopAfterDie()])
    ref.fit(**shard, epochs=args.epochs - args.die_epoch)  # as fit starts again from the commit, its epoch anew
    say("ELASTIC_REFERENCE", rank=hvd.rank(), start=start, digest=digest(ref))


train(state)
say("ELASTIC_RESULT", rank=hvd.rank(), size=hvd.size(), epoch=state.epoch, batch=state.batch, digest=digest())
if args.reference:
    reference()
hvd.shutdown()
