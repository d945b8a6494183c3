"""`-m` on a folder that is not a ds4-mlx model: one line saying what the folder is and what to give
instead, never MLX's list of every parameter name."""

import json

import mlx.core as mx
import pytest

from ds4_mlx import cli
from ds4_mlx.tools import testing


def generate_error(capsys, folder):
    capsys.readouterr()  # what came before (transformers' progress bar)
    rc = cli.main(["generate", "-m", str(folder), "-p", "Hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and len(err) < 400, err[:2000]
    return err


def test_a_transformers_checkpoint_is_named_and_refused(tmp_path, capsys):
    pytest.importorskip("transformers")
    testing.hf_tiny_model(testing.tiny_args(0)).save_pretrained(tmp_path / "hf")
    err = generate_error(capsys, tmp_path / "hf")
    assert "a Hugging Face transformers checkpoint (DeepseekV4ForCausalLM)" in err
    assert "give the model's .gguf file, or a folder made from it by `ds4-mlx convert MODEL.gguf OUT_DIR`" in err


def test_a_folder_whose_weights_do_not_fit_says_so_in_one_line(tmp_path, capsys):
    args = testing.tiny_args(0)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**args.to_dict(), "quantization": {}}))
    mx.save_safetensors(str(folder / "model.safetensors"), {f"foreign.{i}.weight": mx.zeros((2,)) for i in range(500)})
    err = generate_error(capsys, folder)
    assert "the weights do not fit the model" in err and "more" in err


def test_a_config_that_is_not_ours_is_refused(tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert "config.json is not a ds4-mlx model's" in generate_error(capsys, folder)
    (folder / "config.json").write_text("{not json")
    assert "not JSON" in generate_error(capsys, folder)
