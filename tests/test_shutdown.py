"""`ds4-mlx serve` as a process: SIGINT or SIGTERM, idle or while a stream runs, ends it with exit code 0
and no crash; the streaming client gets a final error event and the end of the stream."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from ds4_mlx.tools.testing import serve_process

MODEL = "deepseek-v4-flash"


def stop(process, sig) -> tuple[int, str]:
    process.send_signal(sig)
    try:
        output = process.communicate(timeout=60)[0]  # a hang guard, not a speed check
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("the server did not stop: " + process.communicate()[0]) from None
    return process.returncode, output


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_streaming_ends_the_stream_and_the_process_cleanly(sig):
    process, url = serve_process("--ctx", "4096")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 100000,
            "temperature": 0, "stream": True}
    plain = {}
    waiting = threading.Thread(target=lambda: plain.update(response=requests.post(
        url + "/v1/chat/completions", timeout=60, json={**body, "stream": False, "messages": [
            {"role": "user", "content": "another"}]})))
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]  # the stream is running
        waiting.start()
        while sum(s["busy"] for s in requests.get(url + "/health", timeout=10).json()["slots"]) < 2:
            time.sleep(0.05)  # and so is a non-streamed request
        code, output = None, None
        try:
            code, output = stop(process, sig)
        finally:
            rest = [line for line in lines]
    assert code == 0, output
    assert "terminate called" not in output and "Traceback" not in output, output
    # the log says what happened: the shutdown, and each request cut off by it with what its slot kept
    assert f"{sig.name}: shutting down" in output and output.rstrip().endswith("stopped"), output
    cut = re.findall(r"chat cut off by the shutdown after (\d+) of (\d+) prompt tokens and (\d+) answer", output)
    assert len(cut) == 2 and "finish error" not in output, output
    streaming = [c for c in cut if int(c[2]) > 0]  # the stream was decoding: its prompt was all computed
    assert streaming and streaming[0][0] == streaming[0][1], cut
    events = [line for line in received + rest if line]
    assert b"shutting down" in events[-2] and events[-1] == b"data: [DONE]", events[-3:]
    waiting.join()
    assert plain["response"].status_code == 503 and "shutting down" in plain["response"].json()["error"]["message"]


def test_a_signal_while_idle_ends_the_process_cleanly():
    process, url = serve_process("--ctx", "4096")
    requests.post(url + "/v1/chat/completions", timeout=60,
                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    code, output = stop(process, signal.SIGINT)
    assert code == 0 and "terminate called" not in output and "Traceback" not in output, output
    assert "SIGINT: shutting down" in output, output


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_model_load_exits_0_with_a_message(tmp_path, sig):
    model = tmp_path / "model.gguf"
    os.mkfifo(model)  # opening it blocks until a writer comes: a load that lasts until the signal
    process = subprocess.Popen([sys.executable, "-m", "ds4_mlx.cli", "serve", "-m", str(model), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = process.stdout.readline()
    assert "loading the model" in first, first
    code, output = stop(process, sig)
    assert code == 0 and f"{sig.name} during the model load: stopped without serving" in output, first + output
