#!/usr/bin/env bash
# The raw HTTP of `clshard serve`, driven with curl (run by with_server.sh, which sets
# CLSHARD_URL, CLSHARD_MODEL and CLSHARD_API_KEY): status lines, headers, the exact shape of
# server-sent events, and the OpenAI-shaped error bodies.
set -uo pipefail
url=$CLSHARD_URL
model=$CLSHARD_MODEL
auth="Authorization: Bearer $CLSHARD_API_KEY"
failures=0
checks=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

check() {  # check NAME CONDITION...
  local name=$1
  shift
  checks=$((checks + 1))
  if ! "$@"; then
    echo "FAIL: $name"
    failures=$((failures + 1))
  fi
}
contains() { grep -qF -- "$2" "$1"; }
first_line_is() { [ "$(head -n 1 "$1" | tr -d '\r')" = "$2" ]; }

# curl -i: status line and headers, then the body; --max-time bounds every call.
post() {  # post PATH BODY OUT [extra curl args]
  curl -sS -i -N --max-time 30 -H "Content-Type: application/json" "${@:4}" \
    -d "$2" "$url$1" >"$3"
}

# Health and models.
curl -sS -i --max-time 10 "$url/health" >"$tmp/health"
check "GET /health is 200" first_line_is "$tmp/health" "HTTP/1.1 200 OK"
check "/health body" contains "$tmp/health" '{"status":"ok"}'
curl -sS -i --max-time 10 -H "$auth" "$url/v1/models" >"$tmp/models"
check "GET /v1/models is 200" first_line_is "$tmp/models" "HTTP/1.1 200 OK"
check "/v1/models lists the model" contains "$tmp/models" "{\"id\":\"$model\",\"object\":\"model\""

# A streamed completion: chunked text/event-stream, data: events, [DONE] last.
body='"prompt":"Hello","max_tokens":6,"stream":true,"stream_options":{"include_usage":true}'
post /v1/completions "{\"model\":\"$model\",$body}" "$tmp/stream" -H "$auth"
check "stream is 200" first_line_is "$tmp/stream" "HTTP/1.1 200 OK"
check "stream content type" contains "$tmp/stream" "Content-Type: text/event-stream"
check "stream is chunked" contains "$tmp/stream" "Transfer-Encoding: chunked"
# The body after the headers, without keep-alive comments (sent after a second of silence).
sed -n '/^\r$/,$p' "$tmp/stream" | tail -n +2 >"$tmp/body"
check "every line is a data: event, a keep-alive comment or blank" \
  bash -c "! grep -vE '^(data: .+|: keep-alive)?$' '$tmp/body'"
grep '^data: ' "$tmp/body" >"$tmp/events"
first='^data: {"id":"cmpl-[0-9a-f]\{24\}","object":"text_completion"'
check "first event is a text_completion chunk" bash -c "head -n 1 '$tmp/events' | grep -q '$first'"
usage='"choices":\[\],"usage":\{"prompt_tokens":[0-9]+,'
usage+='"completion_tokens":6,"total_tokens":[0-9]+\}'
check "the usage chunk before [DONE]" \
  bash -c "tail -n 2 '$tmp/events' | head -n 1 | grep -qE '$usage'"
check "[DONE] last" bash -c "[ \"\$(tail -n 1 '$tmp/events')\" = 'data: [DONE]' ]"
check "the body ends with [DONE] and a blank line" \
  bash -c "tail -c 14 '$tmp/body' | cmp -s - <(printf 'data: [DONE]\\n\\n')"
check "one finish_reason" bash -c "[ \$(grep -c '\"finish_reason\":\"length\"' '$tmp/events') = 1 ]"

# A chat completion, whole.
body='"messages":[{"role":"user","content":"Hi"}],"max_tokens":4'
post /v1/chat/completions "{\"model\":\"$model\",$body}" "$tmp/chat" -H "$auth"
check "chat is 200" first_line_is "$tmp/chat" "HTTP/1.1 200 OK"
check "chat is JSON" contains "$tmp/chat" "Content-Type: application/json"
check "chat.completion object" contains "$tmp/chat" '"object":"chat.completion"'
check "assistant message" contains "$tmp/chat" '"message":{"role":"assistant","content":'

# Errors in OpenAI's shape.
post /v1/completions "{\"model\":\"$model\",\"prompt\":\"x\"}" "$tmp/noauth"
check "no key: 401" first_line_is "$tmp/noauth" "HTTP/1.1 401 Unauthorized"
check "401 body" contains "$tmp/noauth" '"code":"invalid_api_key"'
post /v1/completions "{\"model\":\"$model\",\"prompt\":\"x\",\"temperature\":\"hot\"}" \
  "$tmp/bad" -H "$auth"
check "bad field: 400" first_line_is "$tmp/bad" "HTTP/1.1 400 Bad Request"
error='{"error":{"message":"temperature: expected a number >= 0, got \"hot\"",'
error+='"type":"invalid_request_error","param":"temperature","code":null}}'
check "400 names the field" contains "$tmp/bad" "$error"
post /v1/completions '{"model":"nope","prompt":"x"}' "$tmp/model" -H "$auth"
check "other model: 404" first_line_is "$tmp/model" "HTTP/1.1 404 Not Found"
check "404 code" contains "$tmp/model" '"param":"model","code":"model_not_found"'
post /v1/completions "not json" "$tmp/notjson" -H "$auth"
check "not JSON: 400" first_line_is "$tmp/notjson" "HTTP/1.1 400 Bad Request"

# Metrics.
curl -sS --max-time 10 "$url/metrics" >"$tmp/metrics"
check "metrics: running gauge" contains "$tmp/metrics" "# TYPE clshard_requests_running gauge"
check "metrics: TTFT histogram" contains "$tmp/metrics" \
  '# TYPE clshard_time_to_first_token_seconds histogram'
check "metrics: 401 counted" contains "$tmp/metrics" \
  'clshard_requests_rejected_total{reason="unauthorized"} 1'
check "metrics: pages back" contains "$tmp/metrics" "clshard_kv_pages_used 0"

echo "raw http (curl): $((checks - failures))/$checks checks passed"
[ $failures = 0 ]
