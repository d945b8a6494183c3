"""A short load test: 8 streaming clients, 100+ requests with random aborts in prefill and decode against
one server on the demo model. No errors, and every completed answer equals the same request sent alone
to a fresh server."""

from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.tools.bench_load import conversations, lone_answers, run_clients, summary
from ds4_mlx.tools.testing import demo_server


def background_server(sessions):
    server = demo_server(sessions=sessions)
    return BackgroundServer(server)


def fresh_server():
    bg = background_server(1).__enter__()
    return bg.url, lambda: bg.__exit__(None, None, None)


def test_eight_clients_with_random_aborts_get_no_errors_and_exact_answers():
    convs = conversations(4, words=12, max_tokens=(2, 4))
    with background_server(2) as bg:
        records = run_clients(bg.url, convs, clients=8, requests=64, abort_rate=0.3, seed=1)
    figures = summary(records, lone_answers(convs, fresh_server))
    assert figures["requests"] == 64 and figures["aborted_in_prefill"] > 0 and figures["aborted_in_decode"] > 0
    assert figures["errors"] == 0, figures["error_kinds"]
    assert figures["completed"] >= 30 and figures["mismatches"] == 0, figures


def test_hostile_attacks_are_answered_and_bounded(monkeypatch):
    """`bench load --hostile`'s attacks at a small scale: each is answered as designed, /health never fails."""
    import os

    from ds4_mlx.tools import bench_load as load_bench

    monkeypatch.setattr(load_bench, "SLOW_CONNECTIONS", 20)
    monkeypatch.setattr(load_bench, "SLOW_SECONDS", 60.0)  # a bound: the server closes them after 1 s
    monkeypatch.setattr(load_bench, "ABORTED_REQUESTS", 5)
    with BackgroundServer(demo_server(idle_timeout_s=1.0)) as bg:
        hostile = load_bench.Hostile(bg.url, os.getpid())
        hostile.start()
        for thread in hostile.threads[1:]:  # the attacks end by themselves; then the prober stops
            thread.join()
        hostile.finish()
    figures = hostile.figures()
    assert all(status == 413 or str(status).startswith("closed") for status in figures["big_body"]), figures
    assert 413 in figures["big_body"]
    assert figures["slow_connections"] == figures["slow_closed_by_server"] == 20, figures
    assert figures["aborted_requests"] == 5 and figures["health_failures"] == 0 and figures["health_probes"] > 0
