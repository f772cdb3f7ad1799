#!/usr/bin/env python3
"""Hostile and careless traffic against a running mlarun HTTP API.

Measures what a normal client sees while slow clients, chunked-body floods,
oversized bodies, disconnecting streams and unauthenticated clients hit the
same server, and what that costs the server's memory:

  quiet     normal completions alone: latency p50/p99
  attacked  the same requests while the attackers run: latency, /health
  churn     N requests, each on a new connection: server RSS before/after

Every normal answer is checked against the one the quiet phase got for the
same seed (nothing lost, duplicated or changed). Standard library only.

  bench/http_front_door.py --url http://127.0.0.1:8000 --pid PID \
      [--token T] [--slow 2000] [--floods 4] [--churn 10000] [--check]

--check exits non-zero when a bound fails (p99 under attack beyond 10x the
quiet p99 plus 50 ms, /health unanswered, a normal answer wrong or missing,
RSS after churn beyond --rss-slack-mb of its start).
"""
import argparse
import http.client
import json
import resource
import socket
import statistics
import sys
import threading
import time
import urllib.parse


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


class Target:
    def __init__(self, url, token):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.token = token

    def headers(self, auth=True):
        h = {"Content-Type": "application/json"}
        if auth and self.token:
            h["Authorization"] = "Bearer " + self.token
        return h

    def completion(self, seed, conn=None):
        body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 8, "seed": seed, "temperature": 1.0})
        own = conn is None
        conn = conn or http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, self.headers())
            r = conn.getresponse()
            data = r.read()
            if r.status != 200:
                return r.status, None
            return 200, json.loads(data)["choices"][0]["text"]
        finally:
            if own:
                conn.close()

    def health(self, timeout=5):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except OSError:
            return -1
        finally:
            conn.close()


def normal_round(t, seeds, reference, lat, errors):
    for s in seeds:
        start = time.perf_counter()
        try:
            status, text = t.completion(s)
        except OSError as e:
            errors.append(f"seed {s}: {e}")
            continue
        lat.append(time.perf_counter() - start)
        if status != 200:
            errors.append(f"seed {s}: HTTP {status}")
        elif text != reference[s]:
            errors.append(f"seed {s}: text {text!r} != {reference[s]!r}")


def p(q, xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ---- Attackers (each a thread; all stop when `stop` is set) ----

def slow_clients(t, n, stop, opened):
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection((t.host, t.port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        except OSError:
            break
    opened.append(len(socks))
    while not stop.is_set():
        for i, s in enumerate(socks):
            try:
                s.send(b"X")
            except OSError:
                try:
                    s.close()
                    socks[i] = socket.create_connection((t.host, t.port), timeout=5)
                    socks[i].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                except OSError:
                    pass
        stop.wait(1.0)
    for s in socks:
        s.close()


def chunked_flood(t, stop, auth, counts):
    chunk = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
    while not stop.is_set():
        try:
            s = socket.create_connection((t.host, t.port), timeout=10)
            head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            if auth and t.token:
                head += f"Authorization: Bearer {t.token}\r\n"
            s.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
            for _ in range(300 * 16):  # up to 300 MB
                if stop.is_set():
                    break
                s.sendall(chunk)
        except OSError:
            pass
        try:
            status = s.recv(64).split(b" ")[1].decode()
            counts[status] = counts.get(status, 0) + 1
        except Exception:
            counts["reset"] = counts.get("reset", 0) + 1
        s.close()


def disconnecting_streams(t, stop, counts):
    body = json.dumps({"prompt": "hello", "max_tokens": 200, "stream": True}).encode()
    while not stop.is_set():
        try:
            s = socket.create_connection((t.host, t.port), timeout=10)
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n")
            if t.token:
                head += f"Authorization: Bearer {t.token}\r\n"
            s.sendall(head.encode() + b"\r\n" + body)
            s.recv(256)
            s.close()
            counts["disconnected"] = counts.get("disconnected", 0) + 1
        except OSError:
            pass
        stop.wait(0.05)


def run_attackers(t, args, stop):
    threads, stats, opened = [], {}, []
    threads.append(threading.Thread(target=slow_clients, args=(t, args.slow, stop, opened)))
    for i in range(args.floods):
        threads.append(threading.Thread(target=chunked_flood, args=(t, stop, i % 2 == 0, stats)))
    threads.append(threading.Thread(target=disconnecting_streams, args=(t, stop, stats)))
    for th in threads:
        th.daemon = True
        th.start()
    return threads, stats, opened


def churn(t, n):
    failures = 0
    for i in range(n):
        try:
            status, _ = t.completion(100000 + i % 50)
            failures += status != 200
        except OSError:
            failures += 1
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--pid", type=int, required=True, help="the server process (RSS)")
    ap.add_argument("--token", default="")
    ap.add_argument("--requests", type=int, default=200, help="normal requests per phase")
    ap.add_argument("--slow", type=int, default=2000)
    ap.add_argument("--floods", type=int, default=4)
    ap.add_argument("--churn", type=int, default=10000)
    ap.add_argument("--rss-slack-mb", type=float, default=50)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.slow + 1024)), hard))
    t = Target(args.url, args.token)
    seeds = list(range(args.requests))

    # Warm up (first tokenizations, first connections), then the quiet phase.
    churn(t, 50)
    rss_start = rss_mb(args.pid)
    reference = {}
    for s in seeds:
        status, text = t.completion(s)
        reference[s] = text if status == 200 else None
    quiet, errors = [], []
    normal_round(t, seeds, reference, quiet, errors)

    stop = threading.Event()
    threads, stats, opened = run_attackers(t, args, stop)
    time.sleep(3)  # the slow clients connect, the floods get going
    attacked, health = [], []
    normal_round(t, seeds, reference, attacked, errors)
    for _ in range(5):
        start = time.perf_counter()
        health.append((t.health(), time.perf_counter() - start))
    rss_attack = rss_mb(args.pid)
    stop.set()
    for th in threads:
        th.join(timeout=30)
    time.sleep(1)
    rss_after_attack = rss_mb(args.pid)

    churn_failures = churn(t, args.churn)
    time.sleep(1)
    rss_end = rss_mb(args.pid)

    row = {
        "quiet_p50_ms": 1e3 * statistics.median(quiet),
        "quiet_p99_ms": 1e3 * p(0.99, quiet),
        "attacked_p50_ms": 1e3 * statistics.median(attacked) if attacked else float("nan"),
        "attacked_p99_ms": 1e3 * p(0.99, attacked),
        "slow_connections": opened[0] if opened else 0,
        "floods": stats,
        "health": [h[0] for h in health],
        "health_max_ms": 1e3 * max(h[1] for h in health),
        "normal_errors": len(errors),
        "rss_mb": {"before": round(rss_start, 1), "attacked": round(rss_attack, 1),
                   "after_attack": round(rss_after_attack, 1), f"after_{args.churn}_requests": round(rss_end, 1)},
        "churn_failures": churn_failures,
    }
    print(json.dumps(row, indent=1))
    for e in errors[:10]:
        print("normal client:", e, file=sys.stderr)
    if not args.check:
        return 0
    bad = []
    if errors:
        bad.append(f"{len(errors)} normal requests failed or were wrong")
    if len(attacked) != len(seeds):
        bad.append("normal requests went missing")
    if row["attacked_p99_ms"] > 10 * row["quiet_p99_ms"] + 50:
        bad.append("p99 under attack beyond 10x quiet")
    if any(h[0] != 200 for h in health):
        bad.append("/health unanswered under attack")
    if rss_end - rss_start > args.rss_slack_mb:
        bad.append(f"RSS grew {rss_end - rss_start:.1f} MB over churn")
    if churn_failures:
        bad.append(f"{churn_failures} churn requests failed")
    for b in bad:
        print("FAILED:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
