"""The DeepSeek V4 tokenizer: a byte-level BPE run by the `tokenizers` library.

Built from a tokenizer.json, or from GGUF metadata (`tokenizer.ggml.tokens` + `merges`, pre-tokenizer
`joyai-llm`). Added tokens (BOS, EOS, `<｜User｜>`, `<think>`, `｜DSML｜`, ...) are matched by their
strings anywhere in the text, before the BPE, and no BOS is added: callers render prompts themselves.
"""

import json
import re
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# `joyai-llm`, as in DeepSeek V4's own tokenizer.json: digits in runs of at most 3, CJK runs, then
# words, punctuation runs (keeping trailing newlines) and whitespace, isolated; then bytes -> chars.
_JOYAI_SPLITS = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_PRE_TOKENIZERS = {
    "joyai-llm": {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in _JOYAI_SPLITS),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_chars():
    """GPT-2's printable stand-ins for the 256 bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _encode(tok: _HFTokenizer, text: str) -> list:
    # encode_batch releases the GIL (encode holds it: 3 s for 3 MiB), so a server thread tokenizing a
    # long prompt leaves the event loop running
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, config: dict = None):
        self._tok = tok
        self.config = config or {}
        self.bos_id = self.id_of(BOS)
        self.eos_id = self.id_of(EOS)

    @classmethod
    def from_file(cls, path):
        path = Path(path)
        cfg_path = path.with_name("tokenizer_config.json")
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        return cls(_HFTokenizer.from_file(str(path)), config)

    @classmethod
    def from_gguf(cls, metadata: dict):
        """The tokenizer in GGUF metadata, or None when the file carries none."""
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            return None
        model = metadata.get("tokenizer.ggml.model", "gpt2")
        pre = metadata.get("tokenizer.ggml.pre", "joyai-llm")
        if model != "gpt2" or pre not in _PRE_TOKENIZERS:
            raise ValueError(f"unsupported GGUF tokenizer {model!r} with pre-tokenizer {pre!r}")
        merges = list(metadata.get("tokenizer.ggml.merges", []))
        types = metadata.get("tokenizer.ggml.token_type")
        # The BPE vocabulary is the 256 byte characters plus every merge product; any other token
        # (specials, <think>, ｜DSML｜, placeholders) is an added token, matched by its string.
        bpe_tokens = _byte_chars() | {m.replace(" ", "", 1) for m in merges}
        vocab, added = {}, []
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)  # every id in the model vocab, so `tokenizers` keeps added ids as given
            if t not in bpe_tokens:
                special = types[i] == _CONTROL if types is not None else t in (BOS, EOS)
                added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": not special, "special": special})
        spec = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": _PRE_TOKENIZERS[pre], "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": merges},
        }
        config = {"add_bos_token": False, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
                  "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast"}
        if metadata.get("tokenizer.chat_template"):
            config["chat_template"] = metadata["tokenizer.chat_template"]
        return cls(_HFTokenizer.from_str(json.dumps(spec)), config)

    def encode(self, text: str) -> list:
        """Token ids of `text`. A rendered `ds4_mlx.chat.Prompt` maps control-token strings to their ids
        only inside the template's spans (client text that spells one stays plain text) and gives a
        sampled answer its sampled ids; any other string maps them wherever they occur, as the official
        encoder does."""
        spans = getattr(text, "template_spans", None)
        if spans is None:
            return _encode(self._tok, text)
        # a sampled answer (`ds4_mlx.chat.Sampled`) is the ids the model sampled, not its text re-encoded
        boundaries = sorted([(start, end, None) for start, end in spans] + list(text.sampled_spans))
        ids, plain_from = [], 0
        for start, end, sampled_ids in boundaries:
            if sampled_ids is not None:
                ids += self._encode_plain(text[plain_from:start]) + list(sampled_ids)
                plain_from = end
                continue
            for match in self._control_pattern.finditer(text, start, end):
                ids += self._encode_plain(text[plain_from:match.start()])
                ids.append(self._control_ids[match.group()])
                plain_from = match.end()
        return ids + self._encode_plain(text[plain_from:])

    def _encode_plain(self, text: str) -> list:
        return _encode(self._plain, text) if text else []

    @cached_property
    def _control_ids(self) -> dict:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    @cached_property
    def _control_pattern(self):
        # longest first: at one position the longest control string wins, as in `tokenizers`
        return re.compile("|".join(re.escape(t) for t in sorted(self._control_ids, key=len, reverse=True)))

    @cached_property
    def _plain(self) -> _HFTokenizer:
        """The same tokenizer without added tokens: byte-level BPE only, which never yields a control id."""
        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = []
        return _HFTokenizer.from_str(json.dumps(spec))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_of(self, token: str):
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer.json text (for libraries that build their own view, such as llguidance)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def save(self, folder):
        folder = Path(folder)
        self._tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, ensure_ascii=False))
