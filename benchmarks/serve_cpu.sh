#!/usr/bin/env bash
# The serve benchmark on this machine's CPUs: a private Ray cluster, `serve run rayinfer.app:build`,
# then `python -m rayinfer.bench serve`. Extra arguments go to the bench (e.g. --num-prompts 32).
#   APP_ARGS="decode.max_num_seqs=64" bash benchmarks/serve_cpu.sh --max-concurrency 16
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAY_USAGE_STATS_ENABLED=0 OMP_NUM_THREADS=1
TMP=$(mktemp -d /tmp/rsb-XXXX)
read -r RAY_PORT HTTP_PORT DASH_PORT AGENT_PORT AGENT_GRPC METRICS_PORT CLIENT_PORT < <(python3 -c '
import socket
s = [socket.socket() for _ in range(7)]
[x.bind(("127.0.0.1", 0)) for x in s]
print(*[x.getsockname()[1] for x in s])')
export RAY_ADDRESS="127.0.0.1:$RAY_PORT"
# Its own token: with ~/.ray/auth_token present Ray enables token auth and clients need the token.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN="$(python3 -c 'import uuid; print(uuid.uuid4().hex * 2)')"
SERVE_PID=""
cleanup() {
  set +e  # best effort: one failed step must not skip the rest
  [ -n "$SERVE_PID" ] && kill "$SERVE_PID" 2>/dev/null || true
  serve shutdown -y --address "http://127.0.0.1:$DASH_PORT" >/dev/null 2>&1 || true
  # Stop only this cluster's processes, never other Ray clusters: those naming its temp dir or
  # holding its private token (this shell too, so skip it), and their children (Ray's agents).
  local roots pids
  roots=$({ grep -lsxz "RAY_AUTH_TOKEN=$RAY_AUTH_TOKEN" /proc/[0-9]*/environ
            grep -lsF -- "$TMP" /proc/[0-9]*/cmdline; } | cut -d/ -f3 | grep -vx "$$" | sort -u)
  pids="$roots $(for pid in $roots; do pgrep -P "$pid"; done)"
  for signal in TERM KILL; do
    for pid in $pids; do kill -s "$signal" "$pid" 2>/dev/null || true; done
    sleep 3
  done
  rm -rf "$TMP"
}
trap cleanup EXIT
ray start --head --temp-dir="$TMP" --port="$RAY_PORT" --num-cpus="${NUM_CPUS:-4}" --num-gpus=0 \
  --dashboard-port="$DASH_PORT" --dashboard-agent-listen-port="$AGENT_PORT" \
  --dashboard-agent-grpc-port="$AGENT_GRPC" --metrics-export-port="$METRICS_PORT" \
  --ray-client-server-port="$CLIENT_PORT" --disable-usage-stats >"$TMP/ray_start.log" 2>&1 || { tail -30 "$TMP/ray_start.log"; exit 1; }
serve start --http-port "$HTTP_PORT" >"$TMP/serve_start.log" 2>&1 || { cat "$TMP/ray_start.log" "$TMP/serve_start.log" | grep -v "^ *File\|^  *\^" | tail -60; exit 1; }
# shellcheck disable=SC2086
serve run rayinfer.app:build ${APP_ARGS:-} >"$TMP/serve_run.log" 2>&1 &
SERVE_PID=$!
for _ in $(seq 240); do
  grep -q "is ready at" "$TMP/serve_run.log" && break
  kill -0 "$SERVE_PID" 2>/dev/null || { tail -40 "$TMP/serve_run.log"; exit 1; }
  sleep 1
done
python3 -m rayinfer.bench serve --url "http://127.0.0.1:$HTTP_PORT" "$@"
