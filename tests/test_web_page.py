"""The web page at `/` and the `/v1/sessions` endpoint it reads, against a server on the demo model.

The browser tests drive Debian's headless chromium through Playwright (no browser is downloaded). Every
request the page makes to anywhere but the server is blocked and recorded, so the page is shown to work
offline. Under CI (CI=true) they fail, rather than skip, when no browser can be started. A screenshot
goes to .ci-artifacts/ (or $DS4_MLX_ARTIFACTS), and its path is printed.
"""

import os
from dataclasses import replace
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from ds4_mlx.generate import GenerationChunk, stream_generate
from ds4_mlx.server.build import BackgroundServer
from ds4_mlx.tools.testing import demo_server
from ds4_mlx.server.middleware import Access

MODEL = "deepseek-v4-flash"
CHROMIUM = os.environ.get("DS4_MLX_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("DS4_MLX_ARTIFACTS", Path(__file__).parent.parent / ".ci-artifacts"))

# A prompt holding MARKER gets MARKUP as the start of its answer, before the model's own text: output a
# page must show as text. The rest (prefill, session, figures) is the real generation.
MARKER = "show me some markup"
MARKUP = ['<script>document.title = "pwned"</script>\n\n', '<img src=x onerror="document.title = \'pwned\'">',
          " <b>bold tag</b> and **real bold**\n\n", "- <b>item</b>\n\n", "```html\n<script>alert(1)</script>\n```\n",
          "[run](javascript:alert(1)) [docs](https://example.com/docs)\n"]


def generate_with_markup(session, tokenizer, prompt_ids, **kwargs):
    # greedy: the page sends no temperature, and the demo model sampled ends its answers early, as a real
    # model does; the first test needs an answer that is still streaming when it clicks Stop
    kwargs["sampling"] = replace(kwargs["sampling"], temperature=0)
    chunks = stream_generate(session, tokenizer, prompt_ids, **kwargs)
    if MARKER in tokenizer.decode(prompt_ids):
        first = next(chunks)  # the prefill runs here, so the session's figures are this request's
        yield from (GenerationChunk(text) for text in MARKUP)
        yield first
    yield from chunks


@pytest.fixture(scope="module")
def server():
    server = demo_server(sessions=2, generate=generate_with_markup)
    with BackgroundServer(server) as bg:
        yield bg


# ---------------------------------------------------------------- without a browser


def test_page_and_its_files_are_served_with_a_strict_policy(server):
    page = requests.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    policy = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    for name, kind in [("app.js", "javascript"), ("style.css", "text/css")]:
        reply = requests.get(f"{server.url}/web/{name}", timeout=10)
        assert reply.status_code == 200 and kind in reply.headers["Content-Type"]
    assert "http" not in page.text.replace('href="data:,"', "")  # nothing from elsewhere
    assert requests.get(server.url + "/web/../pyproject.toml", timeout=10).status_code in (403, 404)


def test_sessions_report_the_figures_of_each_request_and_no_text(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    secret = "zebraquokka"
    words = " ".join(f"word{i}" for i in range(300))  # long enough for the slot policy to keep a resend
    messages = [{"role": "user", "content": f"Remember the word {secret} among {words}."}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    figures = usage.model_extra["ds4_mlx"]  # the extension rides along the OpenAI usage object
    assert figures["reused_tokens"] + figures["replayed_tokens"] + figures["computed_tokens"] == usage.prompt_tokens
    assert figures["completion_tokens"] == usage.completion_tokens == 4
    assert figures["decode_tokens_per_second"] > 0 and figures["prefill_tokens_per_second"] > 0

    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    reply = requests.get(server.url + "/v1/sessions", timeout=10)
    assert reply.status_code == 200 and secret not in reply.text
    snapshot = reply.json()
    last = snapshot["requests"][-1]
    assert last["prompt_tokens"] == again.usage.prompt_tokens and last["finish_reason"] == "length"
    assert last["reused_tokens"] == again.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    slot = snapshot["slots"][last["slot"]]
    assert slot["last_request"] == {k: v for k, v in last.items() if k != "finished_at"}
    assert slot["tokens"] >= last["prompt_tokens"] and slot["bytes"] > 0 and slot["idle_seconds"] >= 0
    assert "/v1/sessions" in requests.get(server.url + "/openapi.json", timeout=10).json()["paths"]


# ---------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def browser():
    playwright = None
    try:
        from playwright.sync_api import sync_playwright

        playwright = sync_playwright().start()
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
    except Exception as e:  # noqa: BLE001 - no browser is a skip here, and a failure under CI
        if playwright is not None:
            playwright.stop()
        if os.environ.get("CI") == "true":
            pytest.fail(f"no browser: {type(e).__name__}: {e}")
        pytest.skip(f"no browser ({CHROMIUM}): {type(e).__name__}: {e}")
    yield browser
    browser.close()
    playwright.stop()


@pytest.fixture
def page(browser, server):
    """A page with every request not to the server blocked; those attempted are checked to be none."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    elsewhere = []

    def only_the_server(route):
        if route.request.url.startswith(server.url + "/"):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    context.route("**/*", only_the_server)
    page = context.new_page()
    dialogs, errors = [], []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(server.url + "/")
    page.wait_for_selector("#slots tbody tr")  # the script ran and read /v1/sessions
    yield page
    context.close()
    assert elsewhere == [] and dialogs == [] and errors == []


def send(page, text, *, thinking, max_tokens=None):
    page.set_checked("#thinking", thinking)
    page.fill("#max-tokens", str(max_tokens or ""))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def answers(page):
    return page.locator(".turn.assistant")


def save_screenshot(page, capsys, name):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    with capsys.disabled():
        print(f"\nweb page screenshot: {path}")


def test_chat_streams_stops_and_the_next_message_reuses_the_session(page, capsys):
    long_message = "Summarize these items: " + " ".join(f"item{i}" for i in range(300))
    send(page, long_message, thinking=False)
    first = answers(page).nth(0)
    page.wait_for_function("() => document.querySelector('.turn.assistant .content').textContent.length > 40")
    assert first.get_attribute("data-state") == "streaming" and page.is_enabled("#stop")

    page.click("#stop")
    page.wait_for_selector('.turn.assistant[data-state="stopped"]')
    stopped_text = first.locator(".content").text_content()
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.wait_for_timeout(500)
    assert first.locator(".content").text_content() == stopped_text  # nothing streams after the stop

    send(page, "And the first one?", thinking=False, max_tokens=6)
    second = answers(page).nth(1)
    page.wait_for_selector('.turn.assistant[data-state="done"]', timeout=60_000)
    cost = second.locator(".figures").text_content()
    reused = int(cost.split(" tokens: ")[1].split(" reused")[0])
    stopped, resent = requests.get(page.url + "v1/sessions", timeout=10).json()["requests"][-2:]
    assert stopped["finish_reason"] == "abort" and resent["reused_tokens"] == reused
    assert reused >= stopped["prompt_tokens"] > 300  # the first prompt, kept through the stop, came from the cache
    assert "6 generated at" in cost and "computed" in cost and "prefill" in cost

    # the table reads the same figures from /v1/sessions
    page.wait_for_function("""() => [...document.querySelectorAll('#slots td[data-field="reused"]')]
                                    .some(cell => Number(cell.textContent) > 300)""")
    assert page.locator("#chart rect.reused").count() >= 2
    save_screenshot(page, capsys, "web-chat.png")
    page.set_viewport_size({"width": 1280, "height": 800})  # a laptop's window: the table fits its panel
    assert page.evaluate("() => { const s = document.querySelector('#sessions'); return s.scrollWidth <= s.clientWidth; }")
    page.set_viewport_size({"width": 1400, "height": 900})

    send(page, "Think first, then answer.", thinking=True, max_tokens=5)
    page.wait_for_selector('.turn.assistant[data-state="done"] >> nth=1')
    thinking = answers(page).nth(2).locator("details.thinking")
    assert thinking.is_visible() and thinking.get_attribute("open") is None  # folded
    assert answers(page).nth(2).locator(".reasoning").text_content()  # the demo's 5 reasoning tokens

    page.click("#new-chat")
    assert answers(page).count() == 0


def test_model_output_markup_is_shown_as_text(page, capsys):
    send(page, MARKER, thinking=False, max_tokens=3)
    page.wait_for_selector('.turn.assistant[data-state="done"]', timeout=60_000)
    content = answers(page).nth(0).locator(".content")
    text = content.text_content()
    assert '<script>document.title = "pwned"</script>' in text
    assert "<img src=x onerror=\"document.title = 'pwned'\">" in text and "<b>bold tag</b>" in text
    assert content.locator("li").text_content() == "<b>item</b>"
    assert content.locator("code").text_content() == "<script>alert(1)</script>"  # a fenced block
    assert content.locator("strong").text_content() == "real bold"  # Markdown still renders
    assert "[run](javascript:alert(1))" in text  # only http(s) links become links
    assert [a.get_attribute("href") for a in content.locator("a").all()] == ["https://example.com/docs"]
    assert page.locator("#messages img, #messages script, #messages b").count() == 0
    assert page.title() == "ds4-mlx"

    send(page, MARKER, thinking=True, max_tokens=3)  # in thinking mode the markup lands in the reasoning
    page.wait_for_selector('.turn.assistant[data-state="done"] >> nth=1', timeout=60_000)
    reasoning = answers(page).nth(1).locator(".reasoning").text_content()
    assert reasoning.startswith('<script>document.title = "pwned"</script>')
    assert page.locator("#messages img, #messages script, #messages b").count() == 0
    assert page.title() == "ds4-mlx"
    save_screenshot(page, capsys, "web-markup.png")


def test_with_an_api_key_the_page_asks_for_it_once_and_keeps_it_for_the_tab(browser):
    key = "page-key"
    with BackgroundServer(demo_server(access=Access(api_keys=(key,)))) as bg:
        context = browser.new_context()
        page = context.new_page()
        asked = []
        page.on("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept(key)))
        page.goto(bg.url + "/")
        page.wait_for_selector("#slots tbody tr")  # /v1/sessions answered with the key
        send(page, "Hello", thinking=False, max_tokens=3)
        page.wait_for_selector('.turn.assistant[data-state="done"]', timeout=60_000)
        assert len(asked) == 1 and page.evaluate("sessionStorage.getItem('ds4-mlx-api-key')") == key
        context.close()
