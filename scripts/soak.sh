#!/usr/bin/env bash
# Soak and faults for the batch job (not part of CI: minutes of work). On the tiny model:
#  1. N requests (default 5000) with random sampling settings (seeded, so reruns are exact) under
#     a KV budget small enough that requests are preempted all the time: the reference run.
#  2. The same job killed with SIGKILL at K random moments (default 20), resumed each time, then
#     run to the end: the output must hold exactly the reference's records.
#  3. The disk full while writing (ulimit -f): a clear error, no torn record, and the rerun
#     completes with the reference's records.
#   bash scripts/soak.sh [REQUESTS] [KILLS]
set -euo pipefail
cd "$(dirname "$0")/.."
requests="${1:-5000}" kills="${2:-20}"
clshard=build/clshard
[ -x "$clshard" ] || { echo "soak: build first (cmake --build build)" >&2; exit 2; }
work=build/soak && rm -rf "$work" && mkdir -p "$work"
"$clshard" make-model --preset llama3-tiny --out "$work/model" > /dev/null
python3 - "$requests" > "$work/prompts.jsonl" <<'PY'
import json, random, sys
rng = random.Random(2026)
words = "the a of to and in is it that for on with as was at by an be this from or".split()
for i in range(int(sys.argv[1])):
    line = {"id": f"r{i}", "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(1, 60))),
            "max_tokens": rng.randint(1, 40), "seed": rng.randint(0, 2**31)}
    if rng.random() < 0.7:
        line.update(temperature=round(rng.uniform(0.2, 1.5), 2), top_k=rng.choice([-1, 5, 50]),
                    top_p=round(rng.uniform(0.5, 1.0), 2), min_p=rng.choice([0.0, 0.05]))
    else:
        line["temperature"] = 0.0
    print(json.dumps(line))
PY
deploy() {  # $1: output file
  cat > "$work/deploy-$2.yaml" <<YAML
model: {path: model}
devices: {type: cpu}
kv_cache: {page_size: 16, pages: 24}     # a few requests' worth: constant preemption
batch: {max_batch_size: 16, max_batch_input_tokens: 256}
job: {input: prompts.jsonl, output: $1}
YAML
  echo "$work/deploy-$2.yaml"
}
sorted() { python3 -c 'import json,sys; [print(json.dumps(r, sort_keys=True)) for r in sorted((json.loads(l) for l in open(sys.argv[1])), key=lambda r: r["id"])]' "$1"; }

start=$(date +%s)
"$clshard" run "$(deploy reference.jsonl ref)" 2> "$work/reference.log"
ref_s=$(( $(date +%s) - start ))
echo "soak: reference run of $requests requests: ${ref_s}s, $(wc -l < "$work/reference.jsonl") records"

job="$(deploy killed.jsonl killed)"
# Each kill lands at a random moment of a run that lasts, on average, well under the reference's
# share per kill (a resumed run skips the finished records, so runs go faster than the share), so
# that every kill hits a running job; a kill that finds the job finished is counted apart.
mid_job=0
for k in $(seq 1 "$kills"); do
  "$clshard" run "$job" 2>> "$work/killed.log" &
  pid=$!
  sleep "$(python3 -c "import random; print(round(random.uniform(0.3, max(0.6, 0.8 * $ref_s / ($kills + 1))), 2))")"
  # A process that has exited but is not yet reaped is a zombie ("Z"): kill would still succeed.
  if [ "$(awk '{print $3}' "/proc/$pid/stat" 2> /dev/null)" != Z ] && kill -9 "$pid" 2> /dev/null; then
    mid_job=$((mid_job + 1)); state="killed mid-job"
  else
    state="had already finished"
  fi
  wait "$pid" 2> /dev/null || true
  echo "soak: kill $k: $state, $(wc -l < "$work/killed.jsonl" 2> /dev/null || echo 0) records so far"
done
echo "soak: $mid_job of $kills kills hit a running job"
"$clshard" run "$job" 2>> "$work/killed.log"
if diff <(sorted "$work/reference.jsonl") <(sorted "$work/killed.jsonl") > "$work/killed.diff"; then
  echo "soak: killed $kills times and resumed: all $requests records equal the reference's"
else
  echo "soak: FAILED: killed run differs from the reference ($work/killed.diff)" >&2; exit 1
fi

job="$(deploy full.jsonl full)"
set +e
( ulimit -f 64; "$clshard" run "$job" ) 2> "$work/full.log"  # 64 blocks of 512 bytes: 32 KiB
rc=$?
set -e
echo "soak: disk full: exit $rc, message: $(grep -m1 -i 'error\|no space\|too large\|limit' "$work/full.log" || tail -1 "$work/full.log")"
[ "$rc" -ne 0 ] || { echo "soak: FAILED: the job did not notice the full disk" >&2; exit 1; }
python3 -c 'import json,sys; [json.loads(l) for l in open(sys.argv[1])]' "$work/full.jsonl" \
  || { echo "soak: FAILED: a torn record after the full disk" >&2; exit 1; }
"$clshard" run "$job" 2>> "$work/full.log"
diff <(sorted "$work/reference.jsonl") <(sorted "$work/full.jsonl") > "$work/full.diff" \
  || { echo "soak: FAILED: the rerun after the full disk differs ($work/full.diff)" >&2; exit 1; }
echo "soak: disk full then rerun: all $requests records equal the reference's"
