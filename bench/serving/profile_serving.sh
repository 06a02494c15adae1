#!/usr/bin/env bash
# Where does the CPU go under load? Starts `distserve serve` (disaggregated unless MODE=colocated),
# drives it with vLLM's client (CLIENT=vllm, the default) or distbench (CLIENT=distbench) at RATE
# req/s (128 in / 64 out, ignore_eos, streaming), and samples every process with py-spy for SECONDS
# (SPY=0: no py-spy, only the CPU accounting). Prints CPU milliseconds per request of each process
# (user+sys from /proc/PID/stat over the whole client run, sys in brackets) and the top functions
# by self time per process. py-spy counts a process preempted inside send() as busy there: read
# the /proc figures for CPU, py-spy for where the Python time goes.
#   RATE=20 SECONDS_TO_SAMPLE=10 bench/profile_serving.sh
#   CLIENT=distbench SPY=0 RATE=20 bench/profile_serving.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; ROOT="$(cd "$HERE/../.." && pwd)"
RATE="${RATE:-20}"; SECS="${SECONDS_TO_SAMPLE:-10}"; MODE="${MODE:-disaggregated}"
MODEL_DIR="${MODEL_DIR:-/tmp/distserve_peer_model}"; VLLM_PY="${VLLM_VENV:-/tmp/vllmcpu}/bin/python"
CLIENT="${CLIENT:-vllm}"; SPY="${SPY:-1}"; NPROMPTS=$((RATE * (SECS + 8)))
OUT="${OUT_DIR:-$(mktemp -d)}"; mkdir -p "$OUT"; export DISTSERVE_ADMIN_TOKEN=profile
"$ROOT/.venv/bin/python" -m pip install -q py-spy >/dev/null 2>&1 || true
setsid "$ROOT/.venv/bin/distserve" serve --model "$MODEL_DIR" --mode "$MODE" --port 0 --ready-file "$OUT/ready.json" \
    >"$OUT/serve.log" 2>&1 & SERVE=$!
trap 'kill -TERM -- -$SERVE 2>/dev/null || true; wait $SERVE 2>/dev/null || true' EXIT
for _ in $(seq 600); do [[ -f "$OUT/ready.json" ]] && break; sleep 0.2; done
URL=$(python3 -c "import json;print(json.load(open('$OUT/ready.json'))['url'])"); PORT=${URL##*:}
PIDS=$(curl -s -H "Authorization: Bearer profile" "$URL/v1/workers" | python3 -c \
  "import json,sys; print(' '.join(f\"{w['worker_id']}:{w['pid']}\" for w in json.load(sys.stdin)['workers']))")
ROUTER=$(pgrep -f "server.cli router" -P $SERVE || true)
cpu() { awk '{print $14, $15}' "/proc/$1/stat"; }  # utime stime, in clock ticks
for wp in router:$ROUTER $PIDS; do cpu "${wp#*:}" >"$OUT/${wp%%:*}.cpu0"; done
if [[ "$CLIENT" == distbench ]]; then
  "$ROOT/.venv/bin/distbench" run --url "$URL" --request-rate "$RATE" --num-prompts "$NPROMPTS" --prompt-len 128 \
      --output-len 64 --slo ttft:250ms,tpot:50ms --save-result "$OUT/distbench.json" >"$OUT/client.log" 2>&1 & CPID=$!
else
  "$VLLM_PY" "$HERE/vllm_client.py" --backend openai --endpoint /v1/completions --host 127.0.0.1 --port "$PORT" \
      --model "$MODEL_DIR" --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 128 \
      --random-output-len 64 --ignore-eos --temperature 0 --num-prompts "$NPROMPTS" \
      --request-rate "$RATE" --disable-tqdm >"$OUT/client.log" 2>&1 & CPID=$!
fi
SPIES=""
if [[ "$SPY" == 1 ]]; then
  sleep 5
  for wp in router:$ROUTER $PIDS; do
    "$ROOT/.venv/bin/py-spy" record --nonblocking -r 200 -d "$SECS" -p "${wp#*:}" -f raw -o "$OUT/${wp%%:*}.txt" >/dev/null 2>&1 &
    SPIES="$SPIES $!"
  done
fi
wait $CPID || true
for wp in router:$ROUTER $PIDS; do cpu "${wp#*:}" >"$OUT/${wp%%:*}.cpu1"; done
[[ -z "$SPIES" ]] || wait $SPIES || true  # not a bare `wait`: the server is a background job too
TICK=$(getconf CLK_TCK)
for wp in router:$ROUTER $PIDS; do
  read -r u0 s0 <"$OUT/${wp%%:*}.cpu0"; read -r u1 s1 <"$OUT/${wp%%:*}.cpu1"
  python3 -c "n=$NPROMPTS; t=$TICK; print(f'{\"${wp%%:*}\"}: {1000*($u1-$u0+$s1-$s0)/t/n:.2f} ms CPU per request ({1000*($s1-$s0)/t/n:.2f} sys)')"
done
for f in $(ls "$OUT"/*.txt 2>/dev/null); do
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
