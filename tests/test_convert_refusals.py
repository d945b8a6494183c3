"""Mistakes a new user makes with `convert` and `-m`: refused at once, in one line, nothing written."""

import os

import pytest

from ds4_mlx import cli
from ds4_mlx.demo import random_gguf_tensors
from ds4_mlx.tools import testing
from ds4_mlx.tokenizer import BOS, EOS


@pytest.fixture
def gguf_without_tokenizer(tmp_path):
    args = testing.tiny_args(0)
    return testing.write_gguf(tmp_path / "tiny.gguf", testing.gguf_metadata(args), random_gguf_tensors(args))


def small_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({BOS: 0, EOS: 1, "hello": 2, "world": 3, "?": 4}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def run(capsys, *argv):
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err.strip()


def test_a_gguf_without_tokenizer_is_refused_unless_one_is_given(tmp_path, gguf_without_tokenizer, capsys):
    out = tmp_path / "out"
    before = set(os.listdir(tmp_path))
    rc, err = run(capsys, "convert", str(gguf_without_tokenizer), str(out), "--quiet")
    assert rc == 1 and len(err.splitlines()) == 1
    assert "carries no tokenizer" in err and "--tokenizer DIR" in err
    rc, err = run(capsys, "convert", str(gguf_without_tokenizer), str(out), "--quiet", "--tokenizer", str(tmp_path))
    assert rc == 1 and "no tokenizer.json in this folder" in err
    from ds4_mlx.demo import _tokenizer_dir  # the real V4 tokenizer: 129k tokens for a 512-token model

    rc, err = run(capsys, "convert", str(gguf_without_tokenizer), str(out), "--quiet", "--tokenizer", str(_tokenizer_dir()))
    assert rc == 1 and "more than the model's 512" in err
    assert set(os.listdir(tmp_path)) == before

    import ds4_mlx

    rc, err = run(capsys, "convert", str(gguf_without_tokenizer), str(out), "--quiet",
                  "--tokenizer", str(small_tokenizer(tmp_path / "tok")))
    assert rc == 0, err
    _, tokenizer = ds4_mlx.load(out)
    assert tokenizer.encode("hello world") == [2, 3] and tokenizer.bos_id == 0


def test_a_conversion_ends_with_a_summary_line(tmp_path, gguf_without_tokenizer, capsys):
    out = tmp_path / "out"
    assert cli.main(["convert", str(gguf_without_tokenizer), str(out), "--quiet",
                     "--tokenizer", str(small_tokenizer(tmp_path / "tok"))]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"converted {gguf_without_tokenizer} to {out}: ") and line.endswith(" s")


def test_a_folder_that_is_not_a_model_says_so(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    rc, err = run(capsys, "generate", "-m", str(tmp_path), "-p", "Hi")
    assert rc == 1
    assert err == (f"ds4-mlx generate: error: {tmp_path}: not a model folder (no config.json); give a .gguf file "
                   "or a folder made by `ds4-mlx convert`")
