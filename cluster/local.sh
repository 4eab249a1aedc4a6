#!/usr/bin/env bash
# A multi-node Ray cluster on one machine for development: head + 2 worker nodes, each a separate
# `ray start` with its own custom resource (head_node / draft / target), so levels can be pinned to nodes.
#
#   cluster/local.sh up       start it (prints the address for ray.init / RAY_ADDRESS)
#   cluster/local.sh status   nodes and resources
#   cluster/local.sh down     stop it by PID (never `ray stop`, which would kill other users' clusters)
#
# The cluster lives in its own temp dir (/tmp/srl-*), so its processes are found by that path in their
# command line; the Ray client server is found by its GCS port. Python twin: specray/serve/localcluster.py.
# Env: SPECRAY_RAY_PORT (default 6380), SPECRAY_CLUSTER_STATE (default /tmp/specray-cluster-$USER.env).
set -euo pipefail

export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
PORT=${SPECRAY_RAY_PORT:-6380}
STATE=${SPECRAY_CLUSTER_STATE:-/tmp/specray-cluster-${USER:-$(id -u)}.env}
HERE=$(cd "$(dirname "$0")/.." && pwd)
RAY=${RAY:-$([ -x "$HERE/.venv/bin/ray" ] && echo "$HERE/.venv/bin/ray" || command -v ray)}
COMMON=(--object-store-memory=100000000 --disable-usage-stats)

cluster_pids() {  # every live process whose command line names our temp dir or GCS port (client server)
  local tmp=$1 port=$2 roots pid
  roots=$(ps -eo pid=,args= | awk -v t="$tmp" -v p=":$port" -v me=$$ '
    $1 != me && (index($0, t "/") || index($0, "--temp-dir=" t) ||
      ($0 ~ /ray\.util\.client\.server/ && index($0, "--address=") && index($0, p " "))) {print $1}')
  for pid in $roots; do  # plus descendants (agents, workers)
    echo "$pid"; pgrep -P "$pid" 2>/dev/null || true
  done | sort -un
}

up() {
  if [[ -f $STATE ]]; then
    # shellcheck disable=SC1090
    source "$STATE"
    if [[ -n $(cluster_pids "$TEMP_DIR" "$PORT") ]]; then echo "already up: 127.0.0.1:$PORT ($STATE)"; return; fi
  fi
  TEMP_DIR=$(mktemp -d /tmp/srl-XXXXXXXX)
  printf 'PORT=%s\nTEMP_DIR=%s\n' "$PORT" "$TEMP_DIR" > "$STATE"
  "$RAY" start --head --port="$PORT" --ray-client-server-port=$((PORT + 1)) --num-cpus=1 \
    --resources='{"head_node": 1}' --memory=2000000000 --include-dashboard=false --temp-dir="$TEMP_DIR" \
    "${COMMON[@]}" >"$TEMP_DIR/head.out" 2>&1 || { cat "$TEMP_DIR/head.out"; down; exit 1; }
  # one node at a time: started in parallel on a 2-core box, a raylet timed out registering with the GCS
  "$RAY" start --address="127.0.0.1:$PORT" --num-cpus=1 --resources='{"draft": 2}' --memory=2000000000 \
    --temp-dir="$TEMP_DIR" "${COMMON[@]}" >"$TEMP_DIR/draft.out" 2>&1 || { cat "$TEMP_DIR/draft.out"; down; exit 1; }
  "$RAY" start --address="127.0.0.1:$PORT" --num-cpus=1 --resources='{"target": 2}' --memory=3000000000 \
    --temp-dir="$TEMP_DIR" "${COMMON[@]}" >"$TEMP_DIR/target.out" 2>&1 || { cat "$TEMP_DIR/target.out"; down; exit 1; }
  echo "up: ray.init(address=\"127.0.0.1:$PORT\")  (temp dir $TEMP_DIR)"
}

down() {
  [[ -f $STATE ]] || { echo "no cluster recorded in $STATE"; return; }
  # shellcheck disable=SC1090
  source "$STATE"
  local pids raylets
  pids=$(cluster_pids "$TEMP_DIR" "$PORT")
  raylets=$(for p in $pids; do ps -o args= -p "$p" 2>/dev/null | grep -q '/raylet/raylet ' && echo "$p"; done || true)
  [[ -n $raylets ]] && kill -TERM $raylets 2>/dev/null || true   # agents and workers exit with their raylet
  sleep 2
  pids=$(cluster_pids "$TEMP_DIR" "$PORT")
  [[ -n $pids ]] && kill -TERM $pids 2>/dev/null || true          # gcs, log monitors, client server, ...
  sleep 2
  pids=$(cluster_pids "$TEMP_DIR" "$PORT")
  [[ -n $pids ]] && kill -KILL $pids 2>/dev/null || true          # the autoscaler monitor ignores SIGTERM
  if [[ -f /tmp/ray/ray_current_cluster ]] && grep -q ":$PORT\$" /tmp/ray/ray_current_cluster; then
    rm -f /tmp/ray/ray_current_cluster
  fi
  rm -rf "$TEMP_DIR" "$STATE"
  echo "down"
}

status() {
  [[ -f $STATE ]] || { echo "no cluster recorded in $STATE"; return 1; }
  # shellcheck disable=SC1090
  source "$STATE"
  echo "address 127.0.0.1:$PORT, temp dir $TEMP_DIR, $(cluster_pids "$TEMP_DIR" "$PORT" | wc -l) processes"
  "$RAY" status --address="127.0.0.1:$PORT"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
