"""`serve --batch`: streams running at the same time decode in one forward, and each answer is the one the
request gets alone (greedy, the demo model: the real cache geometry), also beside a stream that aborts and
one whose slot rewinds."""

import threading

from ds4_mlx import session as session_module
from ds4_mlx.tools.testing import served

PROMPTS = ["Hello there.", "Tell me about the sea. " * 12, "Count: " + " ".join(map(str, range(90))),
           "Why is the sky blue? " * 30]
EDITED = "Why is the sky blue? " * 25 + "Say it in one word."  # leaves the last prompt's slot mid-way


def complete(client, prompt, max_tokens=24):
    return client.completions.create(model="deepseek-v4-flash", prompt=prompt, temperature=0,
                                     max_tokens=max_tokens).choices[0].text


def test_concurrent_streams_step_together_and_answer_as_alone(monkeypatch):
    with served(sessions=6, batch=1) as (_, client):
        alone = {p: complete(client, p) for p in [*PROMPTS, EDITED]}

    sizes = []
    step_together = session_module.step_together

    def recording(sessions, tokens):
        sizes.append(len(sessions))
        return step_together(sessions, tokens)

    monkeypatch.setattr(session_module, "step_together", recording)
    with served(sessions=6, batch=4) as (_, client):
        complete(client, PROMPTS[-1], max_tokens=8)  # a slot that EDITED leaves mid-way: a rewind
        answers, threads = {}, []
        for prompt in [*PROMPTS, EDITED]:
            threads.append(threading.Thread(target=lambda p=prompt: answers.__setitem__(p, complete(client, p))))

        def aborted():
            stream = client.completions.create(model="deepseek-v4-flash", prompt="Go on and on.", temperature=0,
                                               max_tokens=200, stream=True)
            for i, _ in enumerate(stream):
                if i == 3:
                    stream.close()
                    return

        threads.append(threading.Thread(target=aborted))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert answers == alone
    assert max(sizes) > 1, sizes  # streams did step together
    assert max(sizes) <= 4, sizes
