"""Stand-in for docs/cluster/train.py in tests/test_kubernetes.py: what the entrypoint
execs. With `--print-config` it prints TF_CONFIG and its arguments as JSON and stops
(no TensorFlow); otherwise it builds `MultiWorkerMirroredStrategy` from TF_CONFIG, runs
one all-reduce (worker i contributes i + 1) and prints the cluster it saw and the sum."""

import json
import os
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["--print-config"]:
        print(json.dumps({"tf_config": json.loads(os.environ["TF_CONFIG"]),
                          "argv": sys.argv[1:]}))
        sys.exit(0)
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=120)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    resolver = strategy.cluster_resolver
    mine = float(resolver.task_id + 1)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM,
                            strategy.run(lambda: tf.constant(mine)), axis=None)
    print(json.dumps({"cluster": resolver.cluster_spec().as_dict(),
                      "task": [resolver.task_type, resolver.task_id],
                      "replicas": strategy.num_replicas_in_sync, "sum": float(total),
                      "argv": sys.argv[1:]}), flush=True)
    os._exit(0)  # every worker printed: skip the collective teardown
