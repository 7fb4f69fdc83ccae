"""Horovod's elastic Keras shape on Sluice (`import sluice.tensorflow.keras as hvd`): fit with the state callbacks.

Each worker fits its shard (rows rank::size) of a fixed data set, committing after every batch
(CommitStateCallback, after UpdateEpochStateCallback and UpdateBatchStateCallback, as Horovod's
example orders them); the learning rate is 0.05 x size, set again by a reset callback. Workers start
from different weights: the elastic state gives them rank 0's (or the newest commit's).
Prints `ELASTIC_START {generation, size, epoch, batch, lr, digest}` when a generation starts training,
`ELASTIC_COMMIT {...}` (rank 0) after the commit the lost worker dies after, and `ELASTIC_RESULT {rank,
size, epoch, digest}` at the end; `digest` is a hash of the model's and optimizer's variables but the
learning rate.
--die-epoch E --die-batch B --die-rank R: in generation 0, worker R SIGKILLs itself right after its
commit of batch B of epoch E (a worker lost).
"""

import argparse
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
args = parser.parse_args()

hvd.init()
generation = int(os.environ.get("SLUICE_ELASTIC_GENERATION", "0"))
keras.utils.set_random_seed(100 + hvd.rank() + 10 * generation)  # every worker starts different
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
rng = np.random.default_rng(0)
x = rng.standard_normal((96, 8)).astype(np.float32)
y = (x[:, :4].argmax(1)).astype(np.int64)
state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def set_lr() -> None:
    model.optimizer.learning_rate = 0.05 * hvd.size()


state.register_reset_callbacks([set_lr])


def digest() -> str:
    values = [v.numpy() for v in model.variables] + [v.numpy() for v in model.optimizer.variables
                                                        if "learning_rate" not in v.path]
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in values)).hexdigest()[:16]


def say(what: str, **fields: object) -> None:
    print(f"{what} {json.dumps(fields)}", flush=True)


class Die(keras.callbacks.Callback):
    """After the commit of batch B of epoch E, in generation 0: rank 0 says what it committed, rank R dies."""

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        if generation == 0 and state.epoch == args.die_epoch and batch == args.die_batch:
            if hvd.rank() == 0:
                say("ELASTIC_COMMIT", epoch=state.epoch, batch=state.batch, digest=digest())
            if hvd.rank() == args.die_rank:
                os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state: hvd.elastic.KerasState) -> None:
    say("ELASTIC_START", generation=generation, size=hvd.size(), epoch=state.epoch, batch=state.batch,
        lr=float(model.optimizer.learning_rate.numpy()), digest=digest())
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state), Die()]
    model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()], batch_size=8, epochs=args.epochs - state.epoch,
              shuffle=False, verbose=0, callbacks=callbacks)


train(state)
say("ELASTIC_RESULT", rank=hvd.rank(), size=hvd.size(), epoch=state.epoch, batch=state.batch, digest=digest())
hvd.shutdown()
