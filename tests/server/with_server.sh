#!/usr/bin/env bash
# Runs a command against a live `clshard serve` on loopback, for the server tests in ctest:
#   with_server.sh CLSHARD WORKDIR -- COMMAND [ARGS...]
# Makes a random llama3-tiny checkpoint under WORKDIR (once), writes a deployment with an API key,
# starts the server on a free port, waits for /health (each wait has a deadline and says what it
# waited for), runs COMMAND with CLSHARD_URL, CLSHARD_MODEL and CLSHARD_API_KEY set, then stops
# the server with SIGTERM and expects exit status 0. Exits with COMMAND's status, or 1.
set -uo pipefail
clshard=$1
work=$2
shift 3
mkdir -p "$work"
model="$work/llama3-tiny"
if [ ! -f "$model/config.json" ]; then
  "$clshard" make-model --preset llama3-tiny --out "$model" >"$work/make-model.log" 2>&1 ||
    { echo "with_server: make-model failed:"; cat "$work/make-model.log"; exit 1; }
fi
cat >"$work/serve.yaml" <<YAML
model: {path: llama3-tiny}
devices: {type: cpu}
kv_cache: {page_size: 16, pages: 512}
batch: {max_batch_size: 16, max_batch_input_tokens: 1024}
sampling: {temperature: 0.0, max_tokens: 16}
serve: {port: 0, max_waiting: 16, api_key: sk-clshard-test, shutdown_deadline_s: 10}
YAML
rm -f "$work/port"
"$clshard" serve "$work/serve.yaml" --port-file "$work/port" 2>"$work/serve.log" &
pid=$!
trap 'kill -9 $pid 2>/dev/null' EXIT

fail() {
  echo "with_server: $*"
  echo "--- server log ($work/serve.log):"
  cat "$work/serve.log"
  exit 1
}
# The port file appears once the server listens (before the model has loaded).
for _ in $(seq 1 300); do
  [ -f "$work/port" ] && break
  kill -0 $pid 2>/dev/null || fail "clshard serve exited before listening"
  sleep 0.1
done
[ -f "$work/port" ] || fail "no port file within 30 s"
port=$(cat "$work/port")
url="http://127.0.0.1:$port"
ready=0
for _ in $(seq 1 600); do
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url/health" || true)
  [ "$code" = 200 ] && { ready=1; break; }
  kill -0 $pid 2>/dev/null || fail "clshard serve exited while loading"
  sleep 0.1
done
[ $ready = 1 ] || fail "/health did not answer 200 within 60 s"
# The warm-up (runtime/engine/warm_up.h) ran within this deployment's limits before "ready".
grep -q "clshard serve: warming up: prompts of 1-128 tokens, batches of 2-16 requests" \
  "$work/serve.log" || fail "no warm-up plan for prompts of 1-128 tokens, batches of 2-16"
awk '/clshard serve: warmed up in/ { w = NR } /clshard serve: ready:/ { r = NR }
     END { exit !(w && r && w < r) }' "$work/serve.log" ||
  fail "no 'warmed up in' line before the 'ready' line"

export CLSHARD_URL=$url CLSHARD_MODEL=llama3-tiny CLSHARD_API_KEY=sk-clshard-test
"$@"
rc=$?

kill -TERM $pid
for _ in $(seq 1 300); do
  kill -0 $pid 2>/dev/null || break
  sleep 0.1
done
kill -0 $pid 2>/dev/null && fail "clshard serve still running 30 s after SIGTERM"
wait $pid
server_rc=$?
trap - EXIT
[ $server_rc = 0 ] || fail "clshard serve exited with status $server_rc after SIGTERM (expected 0)"
grep -q "clshard serve: stopped" "$work/serve.log" || fail "no 'stopped' line in the server log"
exit $rc
