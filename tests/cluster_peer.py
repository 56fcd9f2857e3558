"""A worker of tests/test_cluster.py's dead-or-stuck experiment (run as a script, with
TF_CONFIG): two workers all-reduce once; then worker 1 dies (`dead`, once worker 0 has
its sum) or sleeps in its main thread (`stuck`: alive, TensorFlow's own threads go on,
heartbeats included) before the second all-reduce. `python cluster_peer.py FAULT
TIMEOUT_S STUCK_S`, TIMEOUT_S 0 for no collective timeout. Worker 0 prints what its second
all-reduce did, as a RESULT line."""
import json
import os
import sys
import time

import tensorflow as tf

fault, timeout, stuck_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout or None)
strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
task = strategy.cluster_resolver.task_id
all_reduce = tf.function(lambda: strategy.reduce(
    "SUM", strategy.run(lambda: tf.constant(1.0)), axis=None))
first = float(all_reduce())  # both workers here
if task == 0:
    open("first-all-reduce-done", "w").close()  # in the folder both workers run in
if task == 1 and fault == "dead":
    # Not before worker 0 has its result: worker 1's part of the all-reduce can be done
    # while worker 0 still reads it, and dying then fails worker 0's first all-reduce.
    deadline = time.monotonic() + 60
    while not os.path.exists("first-all-reduce-done") and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(1)
if task == 1 and fault == "stuck":
    time.sleep(stuck_s)  # the main thread only: TensorFlow's threads (heartbeats) go on
    if timeout:
        os._exit(0)
start, value, error = time.monotonic(), None, None
try:
    value = float(all_reduce())
except Exception as err:  # what the waiting worker sees is the result
    error = f"{type(err).__name__}: {str(err)[:300]}"
print("RESULT " + json.dumps({"task": task, "first": first, "value": value, "error": error,
                              "seconds": round(time.monotonic() - start, 1)}), flush=True)
if task == 1:
    # Worker 1 may finish the all-reduce before worker 0 has received its last part; exiting
    # then closes the socket worker 0 reads ("Socket closed"). The test kills it once
    # worker 0 has reported.
    time.sleep(600)
os._exit(0)  # not the coordination service's shutdown barrier: the peer may be gone
