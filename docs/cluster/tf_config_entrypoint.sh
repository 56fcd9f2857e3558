#!/bin/sh
# Entrypoint of a Kubernetes worker pod (docs/cluster/kubernetes.yaml, jobset.yaml): builds
# TF_CONFIG for this pod, then runs `python train.py "$@"` in its place (exec: the signals
# Kubernetes sends, SIGTERM first, reach train.py).
#
# Worker i is the pod of an Indexed Job whose JOB_COMPLETION_INDEX is i. Its hostname ends
# in "-i" (a Job's pods are <job>-i, a JobSet's <jobset>-<replicated job>-<job index>-i),
# and with the pod template's `subdomain` naming a headless Service, every pod reaches it
# at <hostname>.<subdomain>:<port>. Worker 0 is the chief.
#
# Environment:
#   JOB_COMPLETION_INDEX  this pod's index, set by Kubernetes in an Indexed Job
#   WORKERS               the number of workers: the Job's completions and parallelism
#   SUBDOMAIN             the headless Service's name (the pod template's spec.subdomain)
#   TF_PORT               the port every worker listens on (default 2222)
#   WORKER_ADDRESSES      optional: every worker's host:port, comma-separated, in index
#                         order, instead of the names above (outside Kubernetes)
#   TF_CONFIG             if already set (TFJob, Vertex AI), it is kept as it is
#   PYTHON, TRAIN_SCRIPT  what runs (default: python, train.py beside this script)
set -eu

fail() {
  echo "tf_config_entrypoint.sh: $*" >&2
  exit 2
}

here=$(dirname "$0")
if [ -z "${TF_CONFIG:-}" ]; then
  index=${JOB_COMPLETION_INDEX:?set JOB_COMPLETION_INDEX to this worker\'s index (an Indexed Job sets it)}
  case $index in '' | *[!0-9]*) fail "JOB_COMPLETION_INDEX must be a worker index (0, 1, ...), not '$index'." ;; esac
  if [ -n "${WORKER_ADDRESSES:-}" ]; then
    addresses=$(printf '%s' "$WORKER_ADDRESSES" | tr ',' ' ')
  else
    host=${HOSTNAME:-$(hostname)}
    prefix=${host%-"$index"}
    [ "$prefix-$index" = "$host" ] || fail "the hostname '$host' does not end in -$index: run this in an Indexed Job's pod (its hostname is <job name>-<index>), or set WORKER_ADDRESSES."
    [ -n "${SUBDOMAIN:-}" ] || fail "set SUBDOMAIN to the headless Service's name (the pod template's spec.subdomain)."
    count=${WORKERS:?set WORKERS to the Job\'s completions (the number of workers)}
    case $count in '' | *[!0-9]* | 0) fail "WORKERS must be the number of workers (1, 2, ...), not '$count'." ;; esac
    addresses=""
    i=0
    while [ "$i" -lt "$count" ]; do
      addresses="$addresses $prefix-$i.$SUBDOMAIN:${TF_PORT:-2222}"
      i=$((i + 1))
    done
  fi
  workers=""
  n=0
  for address in $addresses; do
    workers="$workers${workers:+, }\"$address\""
    n=$((n + 1))
  done
  if [ -n "${WORKERS:-}" ] && [ "$WORKERS" != "$n" ]; then
    fail "WORKERS=$WORKERS, but WORKER_ADDRESSES names $n workers: give one address per worker."
  fi
  [ "$index" -lt "$n" ] || fail "JOB_COMPLETION_INDEX=$index, but there are $n workers (0 ... $((n - 1)))."
  TF_CONFIG="{\"cluster\": {\"worker\": [$workers]}, \"task\": {\"type\": \"worker\", \"index\": $index}}"
  export TF_CONFIG
fi
echo "TF_CONFIG=$TF_CONFIG" >&2
exec "${PYTHON:-python}" "${TRAIN_SCRIPT:-$here/train.py}" "$@"
