"""The real agent clients, Claude Code (`claude -p`) and Codex (`codex exec`), through whole tool loops
against the server on the scripted model: the model calls a shell command, then reads a file, then
answers; the client runs each tool and sends its result back. Every request after the first must
compute at most its new tokens plus 128: the live session is reused across agent turns.

The clients are installed at pinned versions by `.ci/run` into `.clients/` (npm); without them these
tests skip, except under CI (CI=true), where they fail. Each client runs with HOME in a temporary
folder and talks to nothing but the local server.
"""

import os
import subprocess
from pathlib import Path

import pytest

from ds4_mlx.tools.scripted import ScriptedModel, Turn
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.tools.testing import demo_server

BIN = Path(__file__).resolve().parent.parent / ".clients" / "node_modules" / ".bin"
REUSE_SLACK = 128
SECRET = "The launch code is 7781."
ANSWER = "The notes say the launch code is 7781."


def client(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        message = f"{path} is missing: `.ci/run` installs the pinned agent clients"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture
def workdir(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(SECRET + "\n")
    home = tmp_path / "home"
    home.mkdir()
    return work, home


def serve(model: ScriptedModel):
    server = demo_server(ctx=32768, sessions=2, budget_bytes=2**33, generate=model.generate)
    return BackgroundServer(server)


def clean_env(home: Path, **extra) -> dict:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {**keep, "HOME": str(home), "NO_PROXY": "127.0.0.1", **extra}


def loop_figures(model: ScriptedModel) -> list[dict]:
    """The tool loop's requests (those with tools), each with its new tokens: how much longer its prompt
    is than the previous request's prompt and output together."""
    loop = [s for s in model.served if s.tools]
    figures, previous = [], None
    for s in loop:
        new = s.prompt_tokens if previous is None else s.prompt_tokens - previous.prompt_tokens - previous.output_tokens
        figures.append({"prompt": s.prompt_tokens, "new": new, "reused": s.reused, "replayed": s.replayed,
                        "computed": s.computed})
        previous = s
    return figures


def check_loop(model: ScriptedModel, name: str):
    figures = loop_figures(model)
    print(f"\n{name} per turn:", *figures, sep="\n  ")
    assert len(figures) >= 3
    for turn in figures[1:]:
        assert turn["computed"] + turn["replayed"] <= turn["new"] + REUSE_SLACK, figures


def test_claude_code_runs_a_tool_loop_reusing_the_cache(workdir):
    claude = client("claude")
    work, home = workdir
    model = ScriptedModel([
        Turn(reasoning="List the files first.", text="Let me look.",
             calls=[("Bash", {"command": "ls", "description": "List files"})]),
        Turn(reasoning="There is notes.txt.", calls=[("Read", {"file_path": str(work / "notes.txt")})]),
        Turn(reasoning="Got it.", text=ANSWER),
    ])
    with serve(model) as bg:
        env = clean_env(home, ANTHROPIC_BASE_URL=bg.url, ANTHROPIC_API_KEY="sk-local", DISABLE_TELEMETRY="1",
                        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
        done = subprocess.run([str(claude), "-p", "What do the notes in this folder say?",
                               "--allowedTools", "Bash,Read"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSWER in done.stdout
    loop = [s for s in model.served if s.tools]
    assert "notes.txt" in loop[1].prompt_text and SECRET in loop[2].prompt_text  # the tools really ran
    check_loop(model, "claude")


CODEX_CONFIG = """
model = "deepseek-v4-flash"
model_provider = "ds4"
check_for_update_on_startup = false

[model_providers.ds4]
name = "ds4-mlx"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "DS4_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false
"""


def test_codex_runs_a_tool_loop_reusing_the_cache(workdir):
    codex = client("codex")
    work, home = workdir
    model = ScriptedModel([
        Turn(reasoning="List the files first.", calls=[("exec_command", {"cmd": "ls"})]),
        Turn(reasoning="There is notes.txt.", text="Reading it.", calls=[("exec_command", {"cmd": "cat notes.txt"})]),
        Turn(reasoning="Got it.", text=ANSWER),
    ])
    with serve(model) as bg:
        (home / ".codex").mkdir()
        (home / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=bg.url))
        env = clean_env(home, CODEX_HOME=str(home / ".codex"), DS4_API_KEY="sk-local")
        done = subprocess.run([str(codex), "exec", "--skip-git-repo-check",
                               "--dangerously-bypass-approvals-and-sandbox",
                               "What do the notes in this folder say?"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSWER in done.stdout
    loop = [s for s in model.served if s.tools]
    assert "notes.txt" in loop[1].prompt_text and SECRET in loop[2].prompt_text
    check_loop(model, "codex")
