"""Speculative decoding through the server: the same greedy answers as without, turn after turn."""

from ds4_mlx.speculative import Speculation, server_generate
from ds4_mlx.tools.drafters import LookaheadDrafter, RandomDrafter
from ds4_mlx.tools.testing import DEMO_MODEL_ID, answer_text, served

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours."}],
]


def answers(**options):
    """Each conversation's greedy answer, then a second turn on top of it (the session reused)."""
    out = []
    with served(**options) as (_, client):
        for messages in CONVERSATIONS:
            first = answer_text(client.chat.completions.create(model=DEMO_MODEL_ID, messages=messages, max_tokens=24,
                                                               temperature=0))
            follow = messages + [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
            second = answer_text(client.chat.completions.create(model=DEMO_MODEL_ID, messages=follow, max_tokens=16,
                                                                temperature=0))
            out.append((first, second))
    return out


def test_server_answers_are_the_plain_answers():
    plain = answers()
    rounds = []

    def make(drafter):
        def speculation(model):
            rounds.append(Speculation(drafter, draft_tokens=4, schedule=False))
            return rounds[-1]
        return speculation

    assert answers(generate=server_generate(make(LookaheadDrafter(4)))) == plain
    assert sum(s.stats.accepted for s in rounds) > 0  # multi-token rounds did run
    assert answers(generate=server_generate(make(RandomDrafter(4)))) == plain
