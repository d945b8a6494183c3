"""The scripted model served from a JSON script (`python -m ds4_mlx.tools.scripted`), through the OpenAI SDK:
a request with tools gets the turn numbered by its tool results, one without tools the side answer."""

import json
import subprocess

import openai

from ds4_mlx.tools.testing import serve_process

TOOL = {"type": "function", "function": {"name": "Bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}


def test_a_script_file_drives_a_tool_loop(tmp_path):
    script = {"turns": [{"reasoning": "Look first.", "calls": [["Bash", {"command": "ls"}]]},
                        {"text": "There is one file."}], "side": "A title"}
    (tmp_path / "script.json").write_text(json.dumps(script))
    process, url = serve_process(str(tmp_path / "script.json"), "--ctx", "4096", "--sessions", "1",
                                 command=("-m", "ds4_mlx.tools.scripted"), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "What is here?"}]
        first = client.chat.completions.create(model="deepseek-v4-flash", messages=messages, tools=[TOOL])
        message = first.choices[0].message
        assert message.reasoning_content == "Look first." and first.choices[0].finish_reason == "tool_calls"
        [call] = message.tool_calls
        assert call.function.name == "Bash" and json.loads(call.function.arguments) == {"command": "ls"}
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "notes.txt"}]
        second = client.chat.completions.create(model="deepseek-v4-flash", messages=messages, tools=[TOOL])
        assert second.choices[0].message.content == "There is one file."
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + \
            first.usage.completion_tokens - 1  # all but the EOS the scripted answer ended with
        side = client.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "Title?"}])
        assert side.choices[0].message.content == "A title"
    finally:
        process.terminate()
        process.wait(timeout=30)
