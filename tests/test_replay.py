"""A follow-up turn replays the previous answer as the tokens it was sampled as, so the live session is a
hit: in non-thinking mode the prompt computes only the new turn. Random weights write token sequences
that re-tokenize differently almost every time, which is what made every follow-up recompute the answer.
Where the recompute is right (the template drops an earlier turn's reasoning), the log says so."""

import logging

from ds4_mlx.chat import render_next_user_turn
from ds4_mlx.tools.testing import DEMO_MODEL_ID as MODEL

SERVER_OPTIONS = {"max_tokens": 24}


def new_turn_tokens(bg, text: str, thinking=False) -> int:
    return len(bg.server.worker.tokenizer.encode(render_next_user_turn(text, thinking=thinking)))


def test_a_follow_up_computes_only_the_new_turn(bg, oai, claude):
    messages = [{"role": "user", "content": "Tell me a story."}]
    for turn in range(4):
        done = oai.chat.completions.create(model="deepseek-chat", messages=messages, seed=turn)
        figures = done.usage.model_extra["ds4_mlx"]
        if turn:
            assert figures["computed_tokens"] <= new_turn_tokens(bg, messages[-1]["content"]) + 1, figures
        messages += [{"role": "assistant", "content": done.choices[0].message.content},
                     {"role": "user", "content": f"And then ({turn})?"}]
    messages = [{"role": "user", "content": "Another one."}]
    for turn in range(2):
        message = claude.messages.create(model=MODEL, max_tokens=24, messages=messages)
        if turn:
            computed = message.usage.input_tokens - message.usage.cache_read_input_tokens
            assert computed <= new_turn_tokens(bg, messages[-1]["content"]) + 1, message.usage
        messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "Go on."}]


def test_a_dropped_reasoning_is_named_as_the_cause(bg, oai, caplog):
    caplog.set_level(logging.INFO, logger="ds4_mlx.server")
    messages = [{"role": "user", "content": "Think first."}]
    # a bias on </think> ends the reasoning at once, so the answer is whole and remembered
    think_end = bg.server.worker.tokenizer.id_of("</think>")
    done = oai.chat.completions.create(model=MODEL, messages=messages, seed=1, logit_bias={str(think_end): 100},
                                       max_tokens=3)
    message = done.choices[0].message
    messages += [{"role": "assistant", "content": message.content, "reasoning_content": (message.model_extra or {}).get("reasoning_content")},
                 {"role": "user", "content": "Why?"}]
    oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert "messages[1] is written from its text, not the tokens sampled: the template drops an earlier turn's " \
           "reasoning" in caplog.text
