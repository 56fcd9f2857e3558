"""Train with k micro-batches per update on one machine, a SLURM job or a TF_CONFIG cluster.

    python train.py --check                             # this machine alone
    srun python train.py --backup-dir /shared/run-1      # every task of a SLURM job step
    TF_CONFIG='{...}' python train.py --backup-dir ...   # every worker (Kubernetes, by hand)

Which cluster: a `TF_CONFIG` in the environment (its `cluster` and `task`); else a SLURM
job step of two or more tasks (`srun`: SLURM's `SLURM_*` variables); else this machine
alone (its GPUs, or two logical CPUs). `--backup-dir` (on a file system every worker
sees) backs up after every batch and resumes there when the job runs again. On SIGTERM
it finishes the batch, every worker backs up after the same batch, and the process exits
with status 42, which slurm.sbatch answers by requeueing the job.
The chief (worker 0) prints the progress and writes the TensorBoard logs (`--logdir`):
loss, learning rate, loss scale, skipped micro-batches and updates. `--check` trains a
small synthetic problem and ends by comparing the weights with the same training on one
device; every worker prints `cluster check passed`. docs/cluster.md explains it all.

It imports only TensorFlow, Keras, NumPy, the standard library and distgrad. Replace
`load_data` and `build_model` with your own.
"""
import argparse
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import distgrad

PREEMPTED = 42  # BackupAndRestore's exit status after SIGTERM: run me again, I resume


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixed", action="store_true", help="mixed_float16 with a loss scale")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accumulation-steps", type=int, default=4, help="k micro-batches/update")
    p.add_argument("--micro-batch", type=int, default=8, help="examples per replica")
    p.add_argument("--learning-rate", type=float, default=0.01, help="after the warm-up")
    p.add_argument("--warmup-updates", type=int, default=2)
    p.add_argument("--backup-dir", help="backup after every batch; resume from it")
    p.add_argument("--collective-timeout", type=float, default=300.0,
                   help="seconds an all-reduce waits for the other workers (> a backup)")
    p.add_argument("--logdir", help="TensorBoard logs (the chief's)")
    p.add_argument("--log-every", type=int, default=1, help="updates between progress lines")
    p.add_argument("--port", type=int, help="SLURM: first port of a node's workers "
                   "(default 20000 + job id mod 10000)")
    p.add_argument("--throttle", type=float, default=0.0,
                   help="seconds to wait after each batch: to watch a run, or preempt it")
    p.add_argument("--check", action="store_true", help="compare with one device at the end")
    return p.parse_args()


def slurm_resolver(port):
    """SLURM's resolver, also on nodes without GPUs. `SlurmClusterResolver` lays tasks out
    with `range(0, gpus_per_node, gpus_per_task)`: with no GPUs that step is 0 (ValueError;
    `gpus_per_node=None` runs nvidia-smi instead, FileNotFoundError). So it gets one GPU
    per task for the layout, and the strategy gets this task's real count (SLURM's
    `--gpus-per-task` already set CUDA_VISIBLE_DEVICES)."""
    gpus = len(tf.config.list_physical_devices("GPU"))
    tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
    slurm = tf.distribute.cluster_resolver.SlurmClusterResolver(
        port_base=port, gpus_per_node=max(gpus, 1) * tasks, gpus_per_task=max(gpus, 1),
        auto_set_gpu=False)
    spec = slurm.cluster_spec()  # sets task_type and task_id
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type=slurm.task_type, task_id=slurm.task_id,
        num_accelerators={"GPU": gpus}, rpc_layer="grpc")


def make_strategy(args):
    # An all-reduce that waits longer than the timeout fails (DeadlineExceededError)
    # instead of hanging forever on a worker that is alive but stuck. It must exceed the
    # longest pause between two all-reduces: a backup (BackupTimer below watches it).
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=args.collective_timeout)
    several = "TF_CONFIG" in os.environ or int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1
    if not several:  # alone: this machine's GPUs, or two logical CPUs where it has none
        cpu = tf.config.list_physical_devices("CPU")[0]
        if not (tf.config.list_physical_devices("GPU")
                or tf.config.get_logical_device_configuration(cpu)):
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        return tf.distribute.MirroredStrategy(
            tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU"))
    for gpu in tf.config.list_physical_devices("GPU"):  # allocate as needed
        tf.config.experimental.set_memory_growth(gpu, True)
    if "TF_CONFIG" in os.environ:
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    port = args.port or 20000 + int(os.environ["SLURM_JOB_ID"]) % 10000  # under srun
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=slurm_resolver(port), communication_options=options)


def load_data(global_batch, batches):
    """`batches` global batches of a synthetic regression, in a fixed order (a resumed
    job must read them in the same order: shuffle with a seed, once, if you shuffle)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * global_batch, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) / 4).astype("float32")
    return x, y


def build_model(model_class=keras.Model):
    keras.utils.set_random_seed(7)  # the same initial weights on every worker
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    return model_class(inputs, keras.layers.Dense(1, dtype="float32")(hidden))


class TrainingModel(distgrad.ResumableFit, distgrad.MultiWorkerFit, keras.Model):
    """`fit` works on several workers (`MultiWorkerFit`) and hands `BackupAndRestore` its
    data and arguments (`ResumableFit`: Keras gives callbacks none)."""


def make_schedule(args, updates):  # counted in updates: the inner optimizer's iterations
    return keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=updates - args.warmup_updates, warmup_target=args.learning_rate,
        warmup_steps=args.warmup_updates)


class BackupTimer(keras.callbacks.Callback):
    """Listed around BackupAndRestore: times its backups, the longest pause between two
    all-reduces, and says when one comes near the collective timeout."""

    def __init__(self, timeout, start=None):
        super().__init__()
        self.timeout, self.start, self.longest = timeout, start, 0.0

    def on_train_batch_end(self, batch, logs=None):
        if self.start is not None:  # the one before BackupAndRestore: the backup begins
            self.start.began = time.monotonic()
            return
        seconds = time.monotonic() - self.began
        if seconds > self.timeout / 2 and seconds > self.longest:  # once per new longest
            print(f"warning: a backup took {seconds:.2f} s, over half the collective "
                  f"timeout ({self.timeout:g} s): raise --collective-timeout", flush=True)
        self.longest = max(self.longest, seconds)


class Chief(keras.callbacks.Callback):
    """On the chief only: progress lines and TensorBoard scalars, once per update."""

    def __init__(self, args, schedule, updates):
        super().__init__()
        self.args, self.schedule, self.updates = args, schedule, updates
        self.writer = tf.summary.create_file_writer(args.logdir) if args.logdir else None
        self.done = None

    def on_train_begin(self, logs=None):  # after BackupAndRestore restored its backup
        self.done = int(self.model.optimizer.iterations.numpy())  # updates so far
        print(f"starting at update {self.done}"
              + (" (resumed from the backup)" if self.done else ""), flush=True)

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer  # with --mixed, the loss scale around the rest
        accumulating = optimizer.inner_optimizer if self.args.mixed else optimizer
        done = int(optimizer.iterations.numpy())
        if done == self.done:
            return
        self.done = done
        values = {"loss": float(logs["loss"]),  # the epoch's mean so far
                  "learning_rate": float(self.schedule(done - 1)),
                  "skipped_updates": int(accumulating.skipped_updates.numpy())}
        if self.args.mixed:
            values["loss_scale"] = float(optimizer.dynamic_scale.numpy())
            values["skipped_micro_batches"] = int(optimizer.skipped_steps.numpy())
        if self.writer:
            with self.writer.as_default(step=done):
                for name, value in values.items():
                    tf.summary.scalar(name, value)
        if done % self.args.log_every == 0 or done == self.updates:
            print(f"update {done}/{self.updates} " + " ".join(
                f"{name}={value:.4g}" for name, value in values.items()), flush=True)
        if self.args.throttle:
            time.sleep(self.args.throttle)


class Throttle(keras.callbacks.Callback):  # the other workers: wait as long as the chief
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def main():
    args = parse_args()
    strategy = make_strategy(args)  # before any other TensorFlow work
    # SIGTERM: BackupAndRestore's handler, installed when fit starts (after the strategy,
    # which replaces the process' handler), backs up at the same batch on every worker.
    assert PREEMPTED == distgrad.PREEMPTED_EXIT_CODE
    tf.config.experimental.enable_tensor_float_32_execution(False)  # float32 for the check
    if args.mixed:
        keras.mixed_precision.set_global_policy("mixed_float16")
    chief = strategy.extended.should_checkpoint  # worker 0, or this machine alone
    k, replicas = args.accumulation_steps, strategy.num_replicas_in_sync
    global_batch = args.micro_batch * replicas
    batches = 6 * k  # per epoch: a multiple of k, so that no micro-batch is left over
    updates = args.epochs * batches // k
    x, y = load_data(global_batch, batches)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    schedule = make_schedule(args, updates)
    with strategy.scope():
        model = build_model(TrainingModel)  # fit on several workers, resumable
        optimizer = distgrad.AccumulatingOptimizer(keras.optimizers.Adam(schedule), k)
        if args.mixed:  # skips a micro-batch that overflows on any replica of any worker
            optimizer = distgrad.AllReplicasFiniteLossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss="mse")
    start = [w.numpy() for w in model.weights]
    callbacks = []
    if args.backup_dir:
        timer = BackupTimer(args.collective_timeout)
        callbacks += [BackupTimer(args.collective_timeout, start=timer),
                      distgrad.BackupAndRestore(args.backup_dir, save_freq=1), timer]
    callbacks.append(Chief(args, schedule, updates) if chief else Throttle(args.throttle))
    if chief:
        several = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        print(f"{replicas} replicas, {k} micro-batches of {global_batch} per update, "
              f"{updates} updates, collective timeout " + (
                  f"{args.collective_timeout:g} s" if several else "none (one machine)"),
              flush=True)
    model.fit(data, epochs=args.epochs, verbose=0, callbacks=callbacks, shuffle=False)
    if args.backup_dir and chief:
        print(f"longest backup {callbacks[-2].longest:.2f} s", flush=True)
    if args.check:
        check(args, model, start, x, y, k * global_batch, updates)


def check(args, model, start, x, y, big_batch, updates):
    """The same training on one device, no strategy: one big batch of k micro-batches per
    update, the same schedule. float32: equal to 1e-6; mixed_float16: within float16's
    rounding of the same mixed training (compute in float16, a loss scale)."""
    reference = build_model()
    reference.compile(optimizer=keras.optimizers.Adam(make_schedule(args, updates)),
                      loss="mse")  # under mixed_float16 compile adds the loss scale
    reference.fit(x, y, batch_size=big_batch, epochs=args.epochs, shuffle=False, verbose=0)
    n = 29 + big_batch  # float16 roundings in a row: 4 + 16 terms, 9 ops, the batch's sum
    bound = 2 * n * 2**-11 / (1 - n * 2**-11) if args.mixed else 0  # two float16 orders
    for ours, one_device, first in zip(model.get_weights(), reference.get_weights(), start,
                                       strict=True):
        tolerance = 1e-6 + bound * np.abs(one_device - first).max()  # float32: 1e-6
        np.testing.assert_allclose(ours, one_device, rtol=1e-6, atol=tolerance)
    print(f"cluster check passed: {model.distribute_strategy.num_replicas_in_sync} replicas, "
          f"{updates} updates", flush=True)


if __name__ == "__main__":
    sys.exit(main())
