# SlurmClusterResolver on a node without GPUs: one task of `srun -n 2`. Without SLURM, set
# the variables that srun sets for task 0 of 2 tasks on one node:
#   SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NODELIST=localhost \
#   SLURM_STEP_TASKS_PER_NODE=2 python slurm_resolver_without_gpus.py
import tensorflow as tf

# gpus_per_node=None (the default) would count GPUs with nvidia-smi; say there are none.
resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(gpus_per_node=0)
gpus_per_task = resolver.num_accelerators()["GPU"]  # 0 // 2 tasks per node
strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
# ValueError: range() arg 3 must not be zero
