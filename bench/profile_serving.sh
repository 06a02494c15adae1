#!/usr/bin/env bash
# Where does the CPU go under load? Starts `distserve serve` (disaggregated unless MODE=colocated),
# drives it with vLLM's client at RATE req/s (128 in / 64 out), and samples every process with
# py-spy for SECONDS. Prints the top functions by self time per process.
#   RATE=20 SECONDS=10 bench/profile_serving.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; ROOT="$(dirname "$HERE")"
RATE="${RATE:-20}"; SECS="${SECONDS_TO_SAMPLE:-10}"; MODE="${MODE:-disaggregated}"
MODEL_DIR="${MODEL_DIR:-/tmp/distserve_peer_model}"; VLLM_PY="${VLLM_VENV:-/tmp/vllmcpu}/bin/python"
OUT="${OUT_DIR:-$(mktemp -d)}"; mkdir -p "$OUT"; export DISTSERVE_ADMIN_TOKEN=profile
"$ROOT/.venv/bin/python" -m pip install -q py-spy >/dev/null 2>&1 || true
setsid "$ROOT/.venv/bin/distserve" serve --model "$MODEL_DIR" --mode "$MODE" --port 0 --ready-file "$OUT/ready.json" \
    >"$OUT/serve.log" 2>&1 & SERVE=$!
trap 'kill -TERM -- -$SERVE 2>/dev/null || true; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 600); do [[ -f "$OUT/ready.json" ]] && break; sleep 0.2; done
URL=$(python3 -c "import json;print(json.load(open('$OUT/ready.json'))['url'])"); PORT=${URL##*:}
"$VLLM_PY" "$HERE/vllm_client.py" --backend openai --endpoint /v1/completions --host 127.0.0.1 --port "$PORT" \
    --model "$MODEL_DIR" --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 128 \
    --random-output-len 64 --ignore-eos --temperature 0 --num-prompts $((RATE * (SECS + 8))) \
    --request-rate "$RATE" --disable-tqdm >"$OUT/client.log" 2>&1 & CLIENT=$!
sleep 5
PIDS=$(curl -s -H "Authorization: Bearer profile" "$URL/v1/workers" | python3 -c \
  "import json,sys; print(' '.join(f\"{w['worker_id']}:{w['pid']}\" for w in json.load(sys.stdin)['workers']))")
ROUTER=$(pgrep -f "server.cli router" -P $SERVE || true)
for wp in router:$ROUTER $PIDS; do
  "$ROOT/.venv/bin/py-spy" record --nonblocking -r 200 -d "$SECS" -p "${wp#*:}" -f raw -o "$OUT/${wp%%:*}.txt" >/dev/null 2>&1 &
done
wait $CLIENT || true; wait || true
for f in "$OUT"/*.txt; do
  echo "== $(basename "$f" .txt)"
  python3 - "$f" <<'PY'
import collections, sys
self_t, tot = collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    frames = stack.split(";"); n = int(n); tot += n
    self_t[frames[-1].split(" (")[0] + " (" + frames[-1].split(" (")[-1]] += n
print(f"samples: {tot}")
for k, v in self_t.most_common(12): print(f"{100*v/tot:5.1f}%  {k}")
PY
done
tail -25 "$OUT/client.log"
