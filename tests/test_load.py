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
        records = run_clients(bg.url, convs, clients=8, requests=104, abort_rate=0.3, seed=1)
    figures = summary(records, lone_answers(convs, fresh_server))
    assert figures["requests"] == 104 and figures["aborted_in_prefill"] > 0 and figures["aborted_in_decode"] > 0
    assert figures["errors"] == 0, figures["error_kinds"]
    assert figures["completed"] >= 50 and figures["mismatches"] == 0, figures
