#!/usr/bin/env bash
# Writes the seed corpus of every fuzz target into OUT/<target>/: the hand-made seeds of
# tests/fuzz/corpus, every crasher kept in tests/fuzz/regressions, and the repository's real files
# in each entry point's input format (tests/fuzz/fuzz_entries.h). Used by scripts/fuzz.sh and by the
# suite's replay (tests/test_fuzz_regressions.cpp).
#   bash tests/fuzz/seeds.sh OUT
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$1"
targets=(safetensors model_config tokenizer chat_template deploy_yaml job_lines api_request json_schema)
for t in "${targets[@]}"; do
  mkdir -p "$out/$t"
  for d in "$root/tests/fuzz/corpus/$t" "$root/tests/fuzz/regressions/$t"; do
    [ -d "$d" ] && find "$d" -maxdepth 1 -type f -exec cp {} "$out/$t/" \;
  done
done
n=0
# A chat-template seed from a tokenizer_config.json: its template, NUL, a conversation.
chat_seed() {
  command -v python3 > /dev/null || return 0
  python3 - "$1" "$2" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
tmpl = cfg.get("chat_template")
if isinstance(tmpl, str):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"}]
    open(sys.argv[2], "wb").write(tmpl.encode() + b"\0" + json.dumps(msgs).encode())
PY
}
# Real checkpoints' headers (the first 64 KiB of a safetensors file hold the whole header of a small
# one; a cut-off data section is itself a good seed), configs, tokenizers and templates.
while IFS= read -r -d '' f; do
  n=$((n + 1))
  { printf '\x00'; head -c 65536 "$f"; } > "$out/safetensors/repo_$n"
done < <(find "$root/configs" -name '*.safetensors' -print0)
while IFS= read -r -d '' f; do
  n=$((n + 1))
  # DeepSeek-V3 readers take byte 1, Eagle3's byte 2; Llama 3 configs are hand seeds (byte 0).
  if grep -q '"Eagle3' "$f"; then sel='\x02'; else sel='\x01'; fi
  { printf "$sel"; cat "$f"; } > "$out/model_config/repo_$n"
done < <(find "$root/configs" -name '*config.json' ! -name 'tokenizer_config.json' -print0)
while IFS= read -r -d '' f; do
  n=$((n + 1))
  { cat "$f"; printf '\x00'; printf 'The quick brown fox, 12 años — ok?\n'; } > "$out/tokenizer/repo_$n"
  cfg="$(dirname "$f")/tokenizer_config.json"
  [ -f "$cfg" ] && chat_seed "$cfg" "$out/chat_template/repo_$n"
done < <(find "$root/configs" -name 'tokenizer.json' -print0)
# The real Llama 3 and DeepSeek-V3 chat templates, when ../shared is beside the clone.
shared="${CLSHARD_SHARED_DIR:-$root/../shared}"
for cfg in "$shared"/tokenizers/*/tokenizer_config.json; do
  [ -f "$cfg" ] || continue
  n=$((n + 1))
  chat_seed "$cfg" "$out/chat_template/repo_$n"
done
for f in "$root"/configs/*.yaml "$root"/configs/bench/*.yaml; do
  [ -f "$f" ] && cp "$f" "$out/deploy_yaml/repo_$(basename "$f")"
done
for f in "$root"/configs/prompts/*.jsonl; do
  [ -f "$f" ] && head -c 16384 "$f" > "$out/job_lines/repo_$(basename "$f")"
done
# The prompt files' job lines as request bodies (an OpenAI batch line's "body", or clshard's own
# shape less its "id", with a model): chat completions (byte 1) when they hold messages.
for f in "$root"/configs/prompts/*.jsonl; do
  [ -f "$f" ] && command -v python3 > /dev/null || continue
  python3 - "$f" "$out/api_request/repo_$(basename "$f")" <<'PY'
import json, sys
for i, line in enumerate(open(sys.argv[1], encoding="utf-8")):
    if i == 4: break
    try: j = json.loads(line)
    except ValueError: continue
    body = j.get("body", j) if isinstance(j, dict) else None
    if isinstance(body, dict):
        body = dict(body)
        body.pop("id", None)
        body.setdefault("model", "m")
        endpoint = b"\1" if "messages" in body else b"\0"
        open(sys.argv[2] + "_" + str(i), "wb").write(endpoint + json.dumps(body).encode())
PY
done
exit 0
