#!/usr/bin/env python3
"""Several llama-servers behind one front (nginx, HAProxy or Caddy), for loopclient: a front's file for
your own servers, or two demo servers behind each front this machine has, in one command (standard
library only).

    dev/fronts.py write KIND --server ADDRESS:SLOTS [--server ...] [--port 8080] [--timeout 60] [--balance session]
    dev/fronts.py demo [--port 8081]     two demo servers behind each front installed here; they keep running
    dev/fronts.py stop-demo              stop them

``write`` prints KIND's file (nginx, haproxy or caddy) with nothing left to fill in: each ``ADDRESS`` is
``unix:/path/llama.sock`` or ``HOST:PORT``, ``SLOTS`` the server's slots (its ``-np``); the front listens
on 127.0.0.1:PORT, and ``--timeout`` is its idle timeout toward the servers, in seconds (above your
longest gap between two tokens; HAProxy's queue waits as long for a free slot).  The files in dev/fronts
are what it writes for the reference's example:

    dev/fronts.py write nginx --server unix:/run/llama/a.sock:2 --server 10.0.0.2:8080:4 > dev/fronts/nginx.conf

Run nginx with ``nginx -c FILE -p DIR`` (DIR a directory of its own: pid, log and temporary files),
HAProxy with ``haproxy -f FILE -db``, Caddy with ``caddy run --config FILE --adapter caddyfile`` (with
``HOME`` and ``XDG_DATA_HOME`` pointing at a directory of its own).

Every file routes each turn of a conversation to its server by ``X-Session-Id`` (``--balance least`` or
``rr``: by least connections or in turn), lets no server have more generations at a time than it has
slots (429 when every one is full), names the server that answered in the response header
``X-Llama-Server``, and sends a request that carries that header (a resumable stream's lookup, replay and
``DELETE``, the thinking cap's control call) to that server: dev/REFERENCE.md, "Several servers".

``demo`` starts two demo servers (``dev/llama-server.sh demo``, 2 slots each, in ``$LOOPCLIENT_LLAMA_RUN_DIR``,
default /tmp/loopclient-llama) and each front found, from the files ``write`` makes, on ports PORT, PORT+1,
... (0: free ones); it prints one line per front, ``KIND URL``, and keeps them running.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

DEV = os.path.dirname(os.path.abspath(__file__))
KINDS = ("nginx", "haproxy", "caddy")
FILES = {"nginx": "nginx.conf", "haproxy": "haproxy.cfg", "caddy": "Caddyfile"}
HEADER = "X-Llama-Server"
#: the generations: what a front holds to each server's slots
GENERATION = r"^/(v1/)?(chat/completions|completions?|responses|messages|infill|embeddings?|rerank(ing)?)$"

NGINX = """\
# nginx in front of llama-servers, for loopclient, written by dev/fronts.py: a conversation's turns go to one
# server (by X-Session-Id), no server gets more generations at a time than it has slots (429 when every one is
# full), and a stream's own requests go to the server that answered it (X-Llama-Server).  Run it as
# nginx -c FILE -p DIR, DIR a directory of nginx's own (its pid, log and temporary files).
daemon off;
worker_processes 1;
pid nginx.pid;
error_log error.log warn;
events {
    worker_connections 512;
}
http {
    access_log off;
    client_body_temp_path client_body;
    proxy_temp_path proxy;
    fastcgi_temp_path fastcgi;
    uwsgi_temp_path uwsgi;
    scgi_temp_path scgi;
    client_max_body_size 16m;  # long prompts (the default, 1 MB, answers 413)

    map $upstream_addr $llama_server {  # the server that answered, by its name here (the last one tried)
@ANSWERED@
    }
    map $http_x_llama_server $llama_named {  # a request that names a server (a stream's own) goes to it
        default llama;
@NAMED@
    }

    upstream llama_slots {  # generations: no server gets more at a time than it has slots
        @BALANCE@
        zone llama_slots 64k;  # the counts, shared by every worker
@SLOT_SERVERS@
        keepalive 8;
        keepalive_timeout 4s;  # under llama-server's own (5 s): never reuse a connection it has closed
    }

    upstream llama {  # everything else (/slots, /health, a stream's replay, ...): never held back
        @BALANCE@
@SERVERS@
        keepalive 8;
        keepalive_timeout 4s;
    }

@EACH@

    server {
        listen 127.0.0.1:@PORT@;

        proxy_http_version 1.1;            # keep-alive and chunked streams to the server
        proxy_set_header Connection "";
        proxy_buffering off;               # stream each event as it comes
        proxy_request_buffering off;
        proxy_read_timeout @TIMEOUT@s;            # between two reads from the server; a queued request reads nothing
        proxy_send_timeout 60s;
        proxy_next_upstream error;         # another server only when this one cannot be reached
        add_header X-Llama-Server $llama_server always;

        location ~ @GENERATION@ {
            proxy_pass http://llama_slots;
            error_page 502 = @full;
        }

        location = /v1/stream {            # a replay that names no server: the next one on a 404
            proxy_pass http://$llama_named;
            proxy_next_upstream error http_404;
            error_page 502 = @by_key;
        }

        location / {
            proxy_pass http://$llama_named;
            error_page 502 = @by_key;      # the server it names cannot be reached: by the key instead
        }

        location @by_key {
            proxy_pass http://llama;
        }

        location @full {                   # nginx has no queue: every server's slots taken is "no live upstreams"
            if ($upstream_addr ~ "(^|, )llama_slots$") {
                add_header Retry-After 1 always;
                return 429 "every llama-server behind this front is busy\\n";
            }
            return 502;                    # a server that cannot be reached stays a 502
        }
    }
}
"""

HAPROXY = """\
# HAProxy in front of llama-servers, for loopclient, written by dev/fronts.py: a conversation's turns go to one
# server (by X-Session-Id), no server gets more generations at a time than it has slots (the rest wait here,
# then 429), and a stream's own requests go to the server that answered it (X-Llama-Server).  Run it as
# haproxy -f FILE -db.
global
    maxconn 512

defaults
    mode http
    timeout connect 2s
    timeout client 10m                  # the client is silent while its answer streams
    timeout server @TIMEOUT@s                  # between two reads from the server; a queued request reads nothing
    timeout queue @TIMEOUT@s                   # at the front, for a free slot: then 429 (every server busy)
    timeout http-request 10s
    option http-keep-alive
    option redispatch                   # a server that cannot be reached: another one

frontend llama_front
    bind 127.0.0.1:@PORT@
    acl generation path -m reg @GENERATION@
    use_backend llama_slots if generation
    default_backend llama
    http-after-response set-header X-Llama-Server %[srv_name] if { srv_name -m found }  # the server that answered

backend llama_slots                     # generations: no server gets more at a time than it has slots; the rest wait here
    @BALANCE@
    stick-table type string len 128 size 100k expire 1h  # the server each conversation ran on
    http-error status 503 content-type text/plain lf-string "every llama-server behind this front is %[be_conn_free,bool,iif(unreachable,busy)]"
    http-after-response set-status 429 if { status 503 } { be_conn_free eq 0 }  # every slot taken: busy, not away
    http-after-response set-header Retry-After 1 if { status 429 }
@SLOT_SERVERS@

backend llama                           # everything else (/slots, /health, a stream's replay, ...): never held back,
    balance hdr(X-Session-Id)           # sent to the server it names (X-Llama-Server: a stream's own requests),
    hash-type consistent                # else to the server the conversation ran on
    stick match req.hdr(X-Session-Id) table llama_slots
@SERVERS@
"""

CADDY = """\
# Caddy in front of llama-servers, for loopclient, written by dev/fronts.py: a conversation's turns go to one
# server (by X-Session-Id), no server gets more generations at a time than it has slots (429 when every one is
# full), and a stream's own requests go to the server that answered it (X-Llama-Server).  Run it as
# caddy run --config FILE --adapter caddyfile, with HOME and XDG_DATA_HOME pointing at a directory of its own.
{
    admin off
    auto_https off
}

(llama) {                               # what every reverse_proxy below does
    flush_interval -1                   # stream each event as it comes
    header_down X-Llama-Server {llama_server}
    transport http {
        response_header_timeout @TIMEOUT@s
    }
}

http://:@PORT@ {
    bind 127.0.0.1
    map {http.reverse_proxy.upstream.hostport} {llama_server} {  # the server that answered, by its name here
@ANSWERED@
    }
    @generation path_regexp @GENERATION@
    handle @generation {
        reverse_proxy @SERVERS@ {
            lb_policy @BALANCE@
            unhealthy_request_count @SLOTS@  # no server gets more at a time than it has slots (the fewest: one count for all)
            max_fails 1                       # Caddy 2.6 needs it beside the count, or no server is ever chosen
            import llama
        }
    }
@EACH@
    @read {                                   # the client's polls (/slots, /props, /health): each server
        method GET                            # spelled apart (unix//dir/./x.sock, tcp/host:port), so that
        not path /v1/stream                   # Caddy does not count them against the generations
    }
    handle @read {
        reverse_proxy @READ_SERVERS@ {
            lb_policy @BALANCE@
            import llama
        }
    }
    handle {                                  # everything else (a stream's lookup, replay, DELETE, ...)
        reverse_proxy @SERVERS@ {
            lb_policy @BALANCE@
            import llama
        }
    }
    handle_errors {
        @busy expression {err.status_code} == 503  # "no upstreams available": every server's slots taken
        header @busy Retry-After 1
        respond @busy "every llama-server behind this front is busy" 429
    }
}
"""

BALANCE = {
    "nginx": {"session": "hash $http_x_session_id consistent;", "least": "least_conn;", "rr": ""},
    "haproxy": {
        "session": "balance leastconn\n    stick store-request req.hdr(X-Session-Id)",
        "least": "balance leastconn",
        "rr": "balance roundrobin",
    },
    "caddy": {"session": "header X-Session-Id", "least": "least_conn", "rr": "round_robin"},
}


class Server:
    """One llama-server of ``--server ADDRESS:SLOTS``: ``unix:/path/llama.sock`` or ``HOST:PORT``."""

    def __init__(self, text, number):
        address, _, slots = text.rpartition(":")
        if not address or not slots.isdigit() or int(slots) < 1:
            raise ValueError("--server %s: write ADDRESS:SLOTS, as unix:/run/llama.sock:2 or 10.0.0.2:8080:4" % text)
        self.slots, self.name = int(slots), "s%d" % number
        self.path = address[5:] if address.startswith("unix:") else None
        if self.path is not None and (not self.path.startswith("/") or re.search(r"[\s;{}#\"']", self.path)):
            raise ValueError("--server %s: a socket's path is absolute, without spaces or quotes" % text)
        host, _, port = address.rpartition(":")
        if self.path is None and (not host or not port.isdigit() or re.search(r"[\s;{}#/\"']", host)):
            raise ValueError("--server %s: a TCP server is HOST:PORT, a socket unix:/path" % text)
        self.host, self.port = host, port

    def spelled(self, kind, apart=False):
        """How ``kind`` names the server; ``apart``: Caddy's second spelling of it, counted on its own."""
        if self.path is not None:
            head, tail = os.path.split(self.path)
            path = "%s/./%s" % (head, tail) if apart else self.path
            return {"nginx": "unix:", "haproxy": "unix@", "caddy": "unix/"}[kind] + path
        return ("tcp/" if apart else "") + "%s:%s" % (self.host, self.port)

    def answered(self):
        """The addresses nginx's ``$upstream_addr`` says for it: its IP addresses (a name is resolved now)."""
        if self.path is not None:
            return ["unix:" + self.path]
        host = self.host.strip("[]")  # an IPv6 address is written in brackets
        found = sorted({info[4][0] for info in socket.getaddrinfo(host, int(self.port), type=socket.SOCK_STREAM)})
        return [("[%s]:%s" if ipaddress.ip_address(ip).version == 6 else "%s:%s") % (ip, self.port) for ip in found]


def write(kind, servers, port=8080, timeout=60, balance="session"):
    """The file of ``kind`` for ``servers`` (``--server`` values), listening on 127.0.0.1:``port``."""
    each = [Server(text, i) for i, text in enumerate(servers)]
    if not each:
        raise ValueError("name at least one --server")
    fill = {"@PORT@": str(port), "@TIMEOUT@": str(timeout), "@BALANCE@": BALANCE[kind][balance]}
    fill.update(globals()["_" + kind](each))
    text = {"nginx": NGINX, "haproxy": HAPROXY, "caddy": CADDY}[kind].replace("@GENERATION@", GENERATION)
    for name, value in fill.items():
        text = text.replace(name, value)
    return text.replace("        \n", "")  # an empty @BALANCE@ leaves no line


def _nginx(each):
    s = "        server %s max_fails=0;"
    return {
        "@ANSWERED@": "\n".join(
            "        ~(^|\\s)%s$ %s;" % (re.escape(a), srv.name) for srv in each for a in srv.answered()
        ),
        "@NAMED@": "\n".join("        %s llama_%s;" % (srv.name, srv.name) for srv in each),
        "@SLOT_SERVERS@": "\n".join(
            "        server %s max_conns=%d max_fails=0;" % (srv.spelled("nginx"), srv.slots) for srv in each
        ),
        "@SERVERS@": "\n".join(s % srv.spelled("nginx") for srv in each),
        "@EACH@": "\n".join(
            "    upstream llama_%s { server %s; keepalive 2; keepalive_timeout 4s; }" % (srv.name, srv.spelled("nginx"))
            for srv in each
        ),
    }


def _haproxy(each):
    use = "    use-server %s if { req.hdr(X-Session-Id),table_server_id(llama_slots) eq %d } { srv_conn_free(%s) gt 0 }"
    return {
        "@SLOT_SERVERS@": "\n".join(
            "    server %s %s maxconn %d\n" % (srv.name, srv.spelled("haproxy"), srv.slots)
            + use % (srv.name, i + 1, srv.name)
            for i, srv in enumerate(each)
        ),
        "@SERVERS@": "\n".join(
            "    server %s %s\n    use-server %s if { req.hdr(X-Llama-Server) %s }"
            % (srv.name, srv.spelled("haproxy"), srv.name, srv.name)
            for srv in each
        ),
    }


def _caddy(each):
    named = []
    for srv in each:
        named.append(
            "    @%s header X-Llama-Server %s\n    handle @%s {\n        reverse_proxy %s {\n"
            "            import llama\n        }\n    }" % (srv.name, srv.name, srv.name, srv.spelled("caddy"))
        )
    hostports = []
    for srv in each:
        for apart in (False, True):
            spelled = srv.spelled("caddy", apart)
            hostport = spelled[5:] if spelled.startswith("unix/") else spelled.rpartition("/")[2]
            if "        %s %s" % (hostport, srv.name) not in hostports:
                hostports.append("        %s %s" % (hostport, srv.name))
    return {
        "@ANSWERED@": "\n".join(hostports),
        "@SERVERS@": " ".join(srv.spelled("caddy") for srv in each),
        "@READ_SERVERS@": " ".join(srv.spelled("caddy", True) for srv in each),
        "@EACH@": "\n".join(named),
        "@SLOTS@": str(min(srv.slots for srv in each)),
    }


def binary(kind):
    """The front's program, where Debian puts it (nginx and haproxy in /usr/sbin); None when missing."""
    return shutil.which(kind, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def launch(kind, config, directory):
    """Start ``kind`` in the foreground of a process group of its own, from ``config``, its pid, log and
    files in ``directory`` (its output in ``front.log`` there): the process.  As root, nginx's workers run
    as root too (the default, nobody, cannot reach a socket only its owner may write to)."""
    command = {
        "nginx": ["nginx", "-c", config, "-p", directory, "-e", os.path.join(directory, "error.log")],
        "haproxy": ["haproxy", "-f", config, "-db"],
        "caddy": ["caddy", "run", "--config", config, "--adapter", "caddyfile"],
    }[kind]
    if kind == "nginx" and os.geteuid() == 0:
        command += ["-g", "user root;"]
    command[0] = binary(kind) or kind
    env = dict(os.environ, HOME=directory, XDG_DATA_HOME=directory, XDG_CONFIG_HOME=directory)
    with open(os.path.join(directory, "front.log"), "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_listening(proc, port, directory, timeout=10.0):
    """Return once the front ``proc`` accepts connections on ``port``; ``RuntimeError`` with its log when
    it exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return
            except OSError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(os.path.join(directory, "front.log"), "rb") as f:
                log = f.read()[-2000:].decode("utf-8", "replace")
            raise RuntimeError("%s did not listen on port %d (exit %s): %s" % (proc.args[0], port, proc.poll(), log))
        time.sleep(0.05)  # a process just started: nothing to wait on but its port


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_dir():
    return os.environ.get("LOOPCLIENT_LLAMA_RUN_DIR") or "/tmp/loopclient-llama"


def demo(port):
    """Two demo servers behind each front this machine has, from the files ``write`` makes."""
    run = _run_dir()
    stop_demo(servers=False)
    sockets = [os.path.join(run, "demo-%s.sock" % c) for c in "ab"]
    script = os.path.join(DEV, "llama-server.sh")
    starts = [subprocess.Popen([script, "demo", s], stdout=subprocess.DEVNULL) for s in sockets]
    if [p.wait() for p in starts] != [0, 0]:
        raise RuntimeError("a demo server did not start (its log is beside its socket in %s)" % run)
    kinds = [kind for kind in KINDS if binary(kind)]
    if not kinds:
        raise RuntimeError("none of nginx, haproxy, caddy is installed (apt-get install nginx haproxy caddy)")
    try:
        for i, kind in enumerate(kinds):
            here = port + i if port else free_port()
            directory = os.path.join(run, "fronts", kind)
            os.makedirs(directory, exist_ok=True)
            config = os.path.join(directory, FILES[kind])
            with open(config, "w", encoding="utf-8") as f:
                f.write(write(kind, ["unix:%s:2" % s for s in sockets], here))
            proc = launch(kind, config, directory)
            with open(os.path.join(directory, "front.pid"), "w", encoding="ascii") as f:
                f.write("%d\n" % proc.pid)
            wait_listening(proc, here, directory)
            print("%s http://127.0.0.1:%d" % (kind, here), flush=True)
            sys.stderr.write("fronts.py: %s at http://127.0.0.1:%d, its file %s\n" % (kind, here, config))
    except BaseException:
        stop_demo()
        raise
    missing = ", ".join(kind for kind in KINDS if kind not in kinds)
    sys.stderr.write(
        "fronts.py: two demo servers (%s) behind each front%s; they keep running: dev/fronts.py stop-demo stops them.\n"
        "Try: python3 loopclient.py --url http://127.0.0.1:%d chat \"Name three colours.\" --stop '\\n'\n"
        % (", ".join(sockets), " (not installed: %s)" % missing if missing else "", port or here)
    )


def stop_demo(servers=True):
    """Stop the demo's fronts (SIGTERM to each one's process group, SIGKILL after 5 s) and its servers."""
    run = _run_dir()
    for kind in KINDS:
        pidfile = os.path.join(run, "fronts", kind, "front.pid")
        try:
            with open(pidfile, encoding="ascii") as f:
                pid = int(f.read())
            os.remove(pidfile)
            os.killpg(pid, signal.SIGTERM)
        except (OSError, ValueError):
            continue
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    for c in "ab" if servers else "":
        subprocess.call([os.path.join(DEV, "llama-server.sh"), "stop-demo", os.path.join(run, "demo-%s.sock" % c)])


def _alive(pid):
    try:
        os.killpg(pid, 0)
    except OSError:
        return False
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="dev/fronts.py",
        description=__doc__.partition("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    one = commands.add_parser("write", help="print a front's file for your servers")
    one.add_argument("kind", choices=KINDS)
    one.add_argument(
        "--server",
        action="append",
        required=True,
        metavar="ADDRESS:SLOTS",
        help="a llama-server and its slots (-np): unix:/run/llama.sock:2 or 10.0.0.2:8080:4 (repeat it)",
    )
    one.add_argument("--port", type=int, default=8080, help="the port the front listens on, on 127.0.0.1 (8080)")
    one.add_argument("--timeout", type=int, default=60, help="the idle timeout toward the servers, in seconds (60)")
    one.add_argument(
        "--balance",
        choices=("session", "least", "rr"),
        default="session",
        help="by X-Session-Id (the default), least connections, or in turn",
    )
    commands.add_parser("demo", help="two demo servers behind each front installed here").add_argument(
        "--port", type=int, default=8081, help="the first front's port, the next ones after it (0: free ports)"
    )
    commands.add_parser("stop-demo", help="stop the demo's fronts and servers")
    args = parser.parse_args(argv)
    try:
        if args.command == "write":
            sys.stdout.write(write(args.kind, args.server, args.port, args.timeout, args.balance))
        elif args.command == "demo":
            demo(args.port)
        else:
            stop_demo()
    except (ValueError, OSError, RuntimeError) as exc:
        sys.stderr.write("fronts.py: %s\n" % exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
