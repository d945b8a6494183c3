"""`ds4-mlx bench load`: many streaming clients at once against one server, some aborting at random.

`N` threads, each an `openai` SDK client, send streamed temperature-0 chat requests drawn from a set of
conversations (half share a long system prompt, half have their own; some are multi-turn) for `M`
minutes. About `abort_rate` of them abort: in the prefill (the client gives up before the first token
comes) or in the decode (it closes the stream after a random number of tokens). Then every conversation
is sent alone to a fresh server, and each completed answer must equal that answer.

Reported: requests, aborted (in prefill, in decode), errors (any status >= 500 or unexpected status, a
hang, a broken stream: one that ends without a finish reason), mismatches (completed answers that
differ from the lone answer), p50/p99 time to first token, the largest gap between two tokens of one
stream, and the server's peak RSS.

`--hostile`: the clients never abort (they are the well-behaved streams), and while they run, the
server (loopback only, every attack bounded in count and time) gets a 64 MiB body (once with its
length announced, once chunked), `SLOW_CONNECTIONS` connections that drip one header line a second
and never finish their request head, and `ABORTED_REQUESTS` requests whose client leaves right after
sending them; a prober times `/health` all along. Reported besides: what each attack got back,
`/health` latency p50/p99 and failures, and the server's peak RSS above its idle RSS (Linux).
"""

import http.client
import json
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

MODEL = "deepseek-v4-flash"
HANG_S = 120.0  # a request with no byte for this long is hung
NEEDS_OPENAI = "bench load needs the openai package: pip install 'ds4-mlx[test]' (or pip install openai)"
BIG_BODY_BYTES = 64 * 2**20
SLOW_CONNECTIONS = 1000
SLOW_SECONDS = 25.0  # how long the slow connections drip (the server closes them after 15 s)
ABORTED_REQUESTS = 100


def require_openai():
    try:
        import openai  # noqa: F401
    except ImportError:
        raise RuntimeError(NEEDS_OPENAI) from None


def conversations(count: int, *, words: int = 300, max_tokens: tuple = (8, 32)) -> list[dict]:
    """`count` chat requests: even ones share a system prompt of about `words` words, odd ones have
    their own; every third one continues an earlier exchange; answers of `max_tokens` (low, high) tokens."""
    shared = "Rules: " + " ".join(f"rule{i}" for i in range(words))
    low, high = max_tokens
    out = []
    for i in range(count):
        system = shared if i % 2 == 0 else f"Assistant {i}: " + " ".join(f"note{i}x{j}" for j in range(words // 2))
        messages = [{"role": "system", "content": system}]
        if i % 3 == 2:
            messages += [{"role": "user", "content": f"earlier question {i}"},
                         {"role": "assistant", "content": f"earlier answer {i}"}]
        messages.append({"role": "user", "content": f"question {i}: " + " ".join(f"w{i}{j}" for j in range(i % 5 * 8))})
        out.append({"messages": messages, "max_tokens": low + (high - low) * i // max(1, count - 1)})
    return out


@dataclass
class Record:
    conversation: int
    abort: str | None  # None, "prefill" or "decode": what the client meant to do
    outcome: str = ""  # completed, aborted, error
    error: str = ""
    text: str = ""
    ttft_s: float | None = None
    gaps: list = field(default_factory=list)


def run_clients(url: str, convs: list[dict], *, clients: int, seconds: float | None = None,
                requests: int | None = None, abort_rate: float = 0.3, seed: int = 0) -> list[Record]:
    """Run `clients` threads until `seconds` have passed or `requests` were sent; one Record each."""
    from openai import OpenAI, Timeout  # the SDK's own timeout type (its HTTP library's, whichever it is)

    records, lock = [], threading.Lock()
    deadline = time.monotonic() + seconds if seconds else None

    def take_turn() -> bool:
        with lock:
            if requests is not None and len(records) >= requests:
                return False
            return deadline is None or time.monotonic() < deadline

    def client_loop(index: int):
        rng = random.Random(seed * 1000 + index)
        client = OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        while take_turn():
            i = rng.randrange(len(convs))
            abort = None
            if rng.random() < abort_rate:
                abort = rng.choice(["prefill", "decode"])
            record = Record(i, abort)
            with lock:
                records.append(record)
            read_s = rng.uniform(0.02, 1.0) if abort == "prefill" else HANG_S
            stop_after = rng.randint(1, convs[i]["max_tokens"] - 1) if abort == "decode" else None
            one_request(client, convs[i], record, Timeout(HANG_S, read=read_s), stop_after)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def one_request(client, conv: dict, record: Record, timeout, stop_after: int | None):
    import openai

    start = last = time.monotonic()
    tokens, finish = 0, None
    try:
        stream = client.chat.completions.create(model=MODEL, messages=conv["messages"], max_tokens=conv["max_tokens"],
                                                temperature=0, stream=True, timeout=timeout)
        with stream:
            for chunk in stream:
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                text = (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
                if text:
                    now = time.monotonic()
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.gaps.append(now - last)
                    last = now
                    record.text += text
                    tokens += 1
                finish = chunk.choices[0].finish_reason or finish
                if stop_after is not None and tokens >= stop_after:
                    record.outcome = "aborted"
                    return
        if finish is None:
            record.outcome, record.error = "error", "broken stream: no finish reason"
        else:
            record.outcome = "completed"
    except openai.APITimeoutError:
        if record.abort == "prefill":
            record.outcome = "aborted"
        else:
            record.outcome, record.error = "error", "hang"
    except openai.APIStatusError as e:
        record.outcome, record.error = "error", f"status {e.status_code}"
    except Exception as e:  # noqa: BLE001 - a connection dropped by the server, a malformed stream
        record.outcome, record.error = "error", f"{type(e).__name__}: {e}"


def lone_answers(convs: list[dict], start_server) -> list[str]:
    """Each conversation sent alone to a fresh server (`start_server()` -> (url, stop))."""
    from openai import OpenAI

    answers = []
    for conv in convs:
        url, stop = start_server()
        try:
            client = OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
            done = client.chat.completions.create(model=MODEL, messages=conv["messages"],
                                                  max_tokens=conv["max_tokens"], temperature=0)
            message = done.choices[0].message
            answers.append((getattr(message, "reasoning_content", None) or "") + (message.content or ""))
        finally:
            stop()
    return answers


def summary(records: list[Record], answers: list[str]) -> dict:
    completed = [r for r in records if r.outcome == "completed"]
    aborted = [r for r in records if r.outcome == "aborted"]
    errors = [r for r in records if r.outcome == "error"]
    ttfts = sorted(r.ttft_s for r in completed if r.ttft_s is not None)
    gaps = [g for r in records for g in r.gaps]
    return {
        "requests": len(records), "completed": len(completed), "aborted": len(aborted),
        "aborted_in_prefill": sum(r.ttft_s is None for r in aborted),
        "aborted_in_decode": sum(r.ttft_s is not None for r in aborted),
        "errors": len(errors), "error_kinds": sorted({r.error for r in errors}),
        "mismatches": sum(r.text != answers[r.conversation] for r in completed),
        "ttft_p50_s": _quantile(ttfts, 0.5), "ttft_p99_s": _quantile(ttfts, 0.99),
        "max_gap_s": max(gaps, default=None), "median_gap_s": statistics.median(gaps) if gaps else None,
    }


def _quantile(sorted_values: list[float], q: float):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# ---------------------------------------------------------------- `ds4-mlx bench load`


def _serve(sessions: int, ctx: int, batch: int):
    """`ds4-mlx serve` on the demo model in a child process; (url, process) once it answers."""
    import requests

    from ds4_mlx.tools.testing import free_ports

    port = free_ports()
    process = subprocess.Popen([sys.executable, "-m", "ds4_mlx.cli", "serve", "--port", str(port), "--ctx", str(ctx),
                                "--sessions", str(sessions), "--batch", str(batch)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:  # 503 while the model loads
                return url, process
        except (requests.ConnectionError, requests.ReadTimeout):  # not up yet, or busy loading
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start within 300 s")


def _stop(process) -> int:
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def bench_load(a) -> dict:
    """Many streaming clients with random aborts against one server: errors, mismatches, latency, RSS."""
    require_openai()
    convs = conversations(a.conversations)
    url, process = _serve(a.sessions, a.ctx, a.batch)
    hostile = None
    try:
        if a.hostile:
            hostile = Hostile(url, process.pid)
            hostile.start()
        records = run_clients(url, convs, clients=a.clients, seconds=a.minutes * 60,
                              abort_rate=0.0 if a.hostile else a.abort_rate, seed=a.seed)
    finally:
        if hostile is not None:
            hostile.finish()
        code = _stop(process)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the server is the only child so far
    peak_rss_mb = rss / 2**20 if sys.platform == "darwin" else rss / 2**10

    def fresh():
        url, process = _serve(1, a.ctx, 1)  # each request alone: the reference answers
        return url, lambda: _stop(process)

    figures = {"clients": a.clients, "minutes": a.minutes, "sessions": a.sessions, "batch": a.batch,
               **summary(records, lone_answers(convs, fresh)), "peak_rss_mb": peak_rss_mb, "server_exit_code": code,
               **({"hostile": hostile.figures()} if hostile is not None else {})}
    print(f"{figures['requests']} requests from {a.clients} clients in {a.minutes:g} min "
          f"({a.sessions} sessions): {figures['completed']} completed, {figures['aborted']} aborted "
          f"({figures['aborted_in_prefill']} in prefill, {figures['aborted_in_decode']} in decode)", file=sys.stderr)
    print(f"errors {figures['errors']} {figures['error_kinds'] or ''}, mismatches {figures['mismatches']} "
          f"(against each conversation alone on a fresh server)", file=sys.stderr)
    print(f"time to first token p50 {_s(figures['ttft_p50_s'])}, p99 {_s(figures['ttft_p99_s'])}; "
          f"largest gap between tokens {_s(figures['max_gap_s'])} (median {_s(figures['median_gap_s'])})", file=sys.stderr)
    print(f"server peak RSS {peak_rss_mb:.0f} MB, exit code {code}", file=sys.stderr)
    if hostile is not None:
        h = figures["hostile"]
        print(f"hostile: 64 MiB bodies got {h['big_body']}; {h['slow_connections']} slow-header connections: "
              f"{h['slow_closed_by_server']} closed by the server, {h['slow_refused']} refused; "
              f"{h['aborted_requests']} aborted requests", file=sys.stderr)
        print(f"/health during the attacks: {h['health_probes']} probes, p50 {_s(h['health_p50_s'])}, "
              f"p99 {_s(h['health_p99_s'])}, max {_s(h['health_max_s'])}, {h['health_failures']} failed; server RSS "
              f"{_mb(h['idle_rss_mb'])} idle, peak {_mb(h['peak_rss_above_idle_mb'])} above it", file=sys.stderr)
    return figures


def _mb(value) -> str:
    return "-" if value is None else f"{value:.0f} MB"


class Hostile:
    """The attacks of `--hostile` and the /health prober, each in its own thread, all bounded."""

    def __init__(self, url: str, server_pid: int):
        self.host, self.port = url.removeprefix("http://").split(":")
        self.port = int(self.port)
        self.pid = server_pid
        self.idle_rss_mb = _rss_mb(server_pid, "VmRSS")
        self.done = threading.Event()
        self.big_body, self.aborted = [], 0
        self.slow_closed = self.slow_refused = self.slow_opened = 0
        self.health_s, self.health_failures = [], 0
        self.threads = [threading.Thread(target=f, daemon=True) for f in
                        (self._probe_health, self._big_bodies, self._slow_headers, self._aborted_requests)]

    def start(self):
        _raise_open_files_limit(SLOW_CONNECTIONS + 256)
        for thread in self.threads:
            thread.start()

    def finish(self):
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=SLOW_SECONDS + 60)
        self.peak_rss_mb = _rss_mb(self.pid, "VmHWM")  # the server's high-water mark, before it stops

    def figures(self) -> dict:
        health = sorted(self.health_s)
        above = (self.peak_rss_mb - self.idle_rss_mb) if self.peak_rss_mb and self.idle_rss_mb else None
        return {"big_body": self.big_body, "slow_connections": self.slow_opened,
                "slow_closed_by_server": self.slow_closed, "slow_refused": self.slow_refused,
                "aborted_requests": self.aborted, "health_probes": len(health),
                "health_p50_s": _quantile(health, 0.5), "health_p99_s": _quantile(health, 0.99),
                "health_max_s": health[-1] if health else None, "health_failures": self.health_failures,
                "idle_rss_mb": self.idle_rss_mb, "peak_rss_above_idle_mb": above}

    def _connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=HANG_S)

    def _probe_health(self):
        while not self.done.wait(0.1):
            start = time.monotonic()
            try:
                connection = http.client.HTTPConnection(self.host, self.port, timeout=HANG_S)
                connection.request("GET", "/health")
                ok = connection.getresponse().status == 200
                connection.close()
            except OSError:
                ok = False
            self.health_s.append(time.monotonic() - start)
            self.health_failures += not ok

    def _big_bodies(self):
        """64 MiB of JSON, announced by its length and then sent chunked: answered without reading it all."""
        chunk = b" " * 2**20
        for chunked in (False, True):
            connection = http.client.HTTPConnection(self.host, self.port, timeout=HANG_S)
            headers = {"Content-Type": "application/json"}
            if chunked:
                body = (chunk for _ in range(BIG_BODY_BYTES // len(chunk)))
            else:
                body = b"{" + b" " * (BIG_BODY_BYTES - 2) + b"}"
            try:
                connection.request("POST", "/v1/chat/completions", body=body, headers=headers,
                                   encode_chunked=chunked)
                self.big_body.append(connection.getresponse().status)
            except OSError as e:  # the server answered and closed while the body was still going out
                self.big_body.append(f"closed ({type(e).__name__})")
            finally:
                connection.close()

    def _slow_headers(self):
        """Connections that send a request line and then one header line a second, never the end."""
        sockets = []
        for _ in range(SLOW_CONNECTIONS):
            try:
                sock = self._connect()
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                sockets.append(sock)
            except OSError:
                self.slow_refused += 1
        self.slow_opened = len(sockets)
        deadline = time.monotonic() + SLOW_SECONDS
        while sockets and time.monotonic() < deadline and not self.done.wait(1.0):
            for sock in list(sockets):
                try:
                    sock.sendall(b"X-Drip: 1\r\n")
                except OSError:  # closed by the server
                    self.slow_closed += 1
                    sockets.remove(sock)
                    sock.close()
        for sock in sockets:
            sock.close()

    def _aborted_requests(self):
        """Whole streamed requests whose client closes the connection after the first bytes of the answer."""
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 64,
                           "stream": True}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        for _ in range(ABORTED_REQUESTS):
            if self.done.is_set():
                return
            try:
                with self._connect() as sock:
                    sock.sendall(head + body)
                    sock.recv(1)  # the answer has begun (or the request waits in the queue): leave
                self.aborted += 1
            except OSError:
                pass


def _rss_mb(pid: int, field: str) -> float | None:
    """A process's resident memory from /proc (VmRSS now, VmHWM its peak); None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _raise_open_files_limit(wanted: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard),
                                                    hard))


def _s(value) -> str:
    return "-" if value is None else f"{value:.3f} s"


def bench_load_options(q):
    q.add_argument("--minutes", type=float, default=1.0)
    q.add_argument("--clients", type=int, default=8)
    q.add_argument("--sessions", type=int, default=4, help="the server's live sessions")
    q.add_argument("--batch", type=int, default=4, help="the server's --batch: streams decoded in one forward")
    q.add_argument("--conversations", type=int, default=16)
    q.add_argument("--abort-rate", type=float, default=0.3)
    q.add_argument("--ctx", type=int, default=8192)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--hostile", action="store_true",
                   help="the clients never abort; meanwhile a 64 MiB body, 1,000 slow-header connections and 100 "
                        "aborted requests hit the server (loopback only), and /health is timed")
