"""The reasoning-effort preambles of the two releases' templates: the original ("legacy") release puts
its Think Max preamble before a `max` effort's thinking prompt; V4 Flash 0731's template puts a new one
there and the original one before `high` (llama.cpp PR 26398, DeepSeek's 0731 encoder). Which applies
is read from the model file."""

import pytest

from ds4_mlx.chat import release_of, render

B, U, A = "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
# the preambles as the releases' encoders write them, typed out here rather than imported
ORIGINAL_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
NEW_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n")
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}]

# (release, effort) -> the preamble between BOS and the system block
EXPECTED = {
    ("legacy", "max"): ORIGINAL_MAX, ("legacy", "high"): "", ("legacy", None): "", ("legacy", "low"): "",
    ("0731", "max"): NEW_MAX, ("0731", "high"): ORIGINAL_MAX, ("0731", None): "", ("0731", "low"): "",
}


@pytest.mark.parametrize("release,effort", list(EXPECTED), ids=lambda v: str(v))
def test_each_release_puts_its_preamble_before_the_system_block(release, effort):
    assert render(ASK, reasoning_effort=effort, release=release) == \
        f"{B}{EXPECTED[release, effort]}Be brief.{U}q{A}<think>"
    # not in chat mode, nor with thinking turned off by the effort
    assert render(ASK, reasoning_effort=effort, release=release, thinking=False) == f"{B}Be brief.{U}q{A}</think>"
    assert render(ASK, reasoning_effort="none", release=release) == f"{B}Be brief.{U}q{A}</think>"


def test_the_original_release_is_the_default_and_an_unknown_one_is_refused():
    assert render(ASK, reasoning_effort="max") == render(ASK, reasoning_effort="max", release="legacy")
    with pytest.raises(ValueError, match="unknown chat template release '0801'"):
        render(ASK, release="0801")


# the part of each release's jinja template that writes the preamble (llama.cpp's, abridged)
LEGACY_TEMPLATE = ("{{ bos_token }}{%- if thinking and reasoning_effort == 'max' -%}Reasoning Effort: Absolute "
                   "maximum with no shortcuts permitted.\n...{%- endif -%}")
TEMPLATE_0731 = ("{{ bos_token }}{%- if reasoning_effort == 'max' -%}Reasoning Effort: Beyond maximum — exhaustive, "
                 "relentless, and uncompromising.\n...{%- elif reasoning_effort == 'high' -%}Reasoning Effort: "
                 "Absolute maximum with no shortcuts permitted.\n...{%- endif -%}")


def test_the_release_is_read_from_the_file():
    assert release_of(TEMPLATE_0731) == "0731"
    assert release_of(LEGACY_TEMPLATE) == "legacy"
    assert release_of(LEGACY_TEMPLATE, "ds4f-q2-0731.gguf") == "legacy"  # the template is what counts
    assert release_of(None, "/models/ds4f-q2-q4-0731.gguf") == "0731"  # a file without a template: its name
    assert release_of("", "DeepSeek V4 Flash 0731") == "0731"
    assert release_of(None, "/models/ds4f-q2.gguf") == release_of(None) == "legacy"


def test_serve_renders_with_the_gguf_files_release(tmp_path):
    """`ds4-mlx serve -m FILE` reads the release from the chat template the file carries: a `high`
    effort's prompt is the one 0731's template renders (the legacy default's has no preamble)."""
    import requests

    from ds4_mlx.demo import _tokenizer_dir, demo_args, load_for_cli, random_gguf_tensors
    from ds4_mlx.tools import testing

    args = demo_args()  # the real tokenizer's vocabulary, tiny widths
    path = testing.write_gguf(tmp_path / "m.gguf",
                              {**testing.gguf_metadata(args), "tokenizer.chat_template": TEMPLATE_0731},
                              random_gguf_tensors(args), tokenizer_json=_tokenizer_dir() / "tokenizer.json")
    messages = [{"role": "user", "content": "q"}]
    want = len(load_for_cli(None)[1].encode(render(messages, reasoning_effort="high", release="0731")))
    process, url = testing.serve_process("-m", str(path), "--ctx", "4096")
    try:
        reply = requests.post(url + "/v1/chat/completions", timeout=60,
                              json={"messages": messages, "reasoning_effort": "high", "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == want
    finally:
        process.terminate()
        process.communicate(timeout=60)


def test_every_chat_endpoint_renders_with_the_servers_release():
    """The chat completions, responses and messages endpoints render with `ServerInfo.chat_release`
    (set on load from the file): a 0731 server's `high` effort prompt holds the original release's
    Think Max preamble, a legacy server's nothing more."""
    import requests

    from ds4_mlx.chat import THINK_MAX_PREFIX
    from ds4_mlx.demo import load_for_cli
    from ds4_mlx.tools.testing import served

    preamble = len(load_for_cli(None)[1].encode(THINK_MAX_PREFIX))
    bodies = {
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": "q"}], "reasoning_effort": "high"},
                                 lambda r: r["usage"]["prompt_tokens"]),
        "/v1/responses": ({"input": "q", "reasoning": {"effort": "high"}}, lambda r: r["usage"]["input_tokens"]),
        "/v1/messages": ({"messages": [{"role": "user", "content": "q"}], "thinking": {"type": "enabled"},
                          "output_config": {"effort": "high"}}, lambda r: r["usage"]["input_tokens"]),
    }
    with served() as (bg, _):
        for path, (body, prompt_tokens) in bodies.items():
            counts = {}
            for release in ("legacy", "0731"):
                bg.server.info.chat_release = release
                reply = requests.post(bg.url + path, json={"model": "deepseek-v4-flash", "max_tokens": 1, **body},
                                   timeout=60)
                assert reply.status_code == 200, reply.text
                counts[release] = prompt_tokens(reply.json())
            assert counts["0731"] - counts["legacy"] == preamble, (path, counts)
