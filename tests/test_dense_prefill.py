"""Quantized dense layers: a prefill chunk's product through the weight dequantized once equals the
quantized product (mx.quantized_matmul / gather_qmm) within float rounding; the rule that picks it. The
float projections held transposed."""

import mlx.core as mx
import pytest

from ds4_mlx.models import linear

FORMATS = [(32, 8, "affine"), (64, 4, "affine"), (64, 2, "affine"), (32, 4, "mxfp4")]


def quantized_linear(inp, out, fmt, key):
    group, bits, mode = fmt
    layer = linear.Linear(inp, out).to_quantized(group_size=group, bits=bits, mode=mode)
    layer.weight, layer.scales, *biases = mx.quantize(mx.random.normal((out, inp), key=key) / inp**0.5, group, bits,
                                                      mode=mode)
    if biases:
        layer.biases = biases[0]
    return layer


def quantized_grouped(groups, inp, out, fmt, key):
    group, bits, mode = fmt
    layer = linear.GroupedLinear(groups, inp, out).to_quantized(group_size=group, bits=bits, mode=mode)
    layer.weight, layer.scales, *biases = mx.quantize(mx.random.normal((groups, out, inp), key=key) / inp**0.5,
                                                      group, bits, mode=mode)
    if biases:
        layer.biases = biases[0]
    return layer


def both_paths(monkeypatch, layer, x):
    out = {}
    for path in linear.DENSE_PATHS:
        monkeypatch.setenv("DS4_MLX_DENSE_PATH", path)
        out[path] = layer(x)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f[2]}{f[1]}g{f[0]}")
def test_a_chunk_through_the_dequantized_weight_equals_the_quantized_product(monkeypatch, fmt):
    k1, k2, k3, k4 = mx.random.split(mx.random.key(0), 4)
    layer = quantized_linear(256, 192, fmt, k1)
    x = mx.random.normal((300, 256), key=k2)
    out = both_paths(monkeypatch, layer, x)
    want = mx.quantized_matmul(x, layer.weight, layer.scales, layer.get("biases"), transpose=True,
                               group_size=fmt[0], bits=fmt[1], mode=fmt[2])
    assert out["quantized"].shape == out["dequantize"].shape == (300, 192)
    assert float(mx.abs(out["quantized"] - want).max()) == 0
    assert float(mx.abs(out["dequantize"] - want).max()) < 1e-5 * float(mx.abs(want).max())

    grouped = quantized_grouped(4, 128, 64, fmt, k3)
    x = mx.random.normal((70, 4, 128), key=k4)
    out = both_paths(monkeypatch, grouped, x)
    w = mx.dequantize(grouped.weight, grouped.scales, grouped.get("biases"), group_size=fmt[0], bits=fmt[1],
                      mode=fmt[2])
    # each group's rows through mx.quantized_matmul of that group's matrix
    want = mx.stack([mx.quantized_matmul(x[:, j], grouped.weight[j], grouped.scales[j],
                                         None if grouped.get("biases") is None else grouped.biases[j],
                                         transpose=True, group_size=fmt[0], bits=fmt[1], mode=fmt[2])
                     for j in range(4)], axis=1)
    scale = float(mx.abs(want).max())
    for path in linear.DENSE_PATHS:
        assert out[path].shape == (70, 4, 64)
        assert float(mx.abs(out[path] - want).max()) < 1e-5 * scale, path
    assert float(mx.abs(linear.GroupedLinear(4, 128, 64).update({"weight": w})(x) - want).max()) < 1e-5 * scale


def test_the_rule_dequantizes_chunks_on_cuda_only(monkeypatch):
    monkeypatch.delenv("DS4_MLX_DENSE_PATH", raising=False)
    assert not linear.dequantizes(2048)  # the CPU keeps quantized_matmul
    monkeypatch.setattr(linear, "backend", lambda: "cuda")
    threshold = linear.DEQUANTIZE_FROM_ROWS["cuda"]
    assert not linear.dequantizes(1) and not linear.dequantizes(threshold - 1)
    assert linear.dequantizes(threshold) and linear.dequantizes(2048)
    monkeypatch.setenv("DS4_MLX_DENSE_PATH", "quantized")
    assert not linear.dequantizes(2048)
    monkeypatch.setenv("DS4_MLX_DENSE_PATH", "dequantise")
    with pytest.raises(ValueError, match="DS4_MLX_DENSE_PATH must be one of quantized, dequantize"):
        linear.dequantizes(2048)


def test_a_model_in_the_q2_layout_prefills_and_decodes_alike_on_both_paths(monkeypatch):
    """The published q2 layout (8-bit projections, shared experts, head; grouped output projection),
    float32: a prefill in chunks and decoded tokens give the same logits whichever path the dense
    products take (each model traces its compiled parts under its own setting)."""
    from ds4_mlx.tools.random_model import published_model
    from ds4_mlx.session import Session
    from ds4_mlx.tools.testing import tiny_args

    prompt = [int(t) for t in mx.random.randint(0, 512, (90,), key=mx.random.key(1)).tolist()]
    logits = {}
    for path in linear.DENSE_PATHS:
        monkeypatch.setenv("DS4_MLX_DENSE_PATH", path)
        session = Session(published_model(tiny_args(moe_intermediate_size=64), "q2", native=False), max_chunk=32)
        steps = [session.sync(prompt)]
        for _ in range(3):
            steps.append(session.step(int(mx.argmax(steps[-1]))))
        logits[path] = mx.stack(steps)
    scale = float(mx.abs(logits["quantized"]).max())
    assert float(mx.abs(logits["dequantize"] - logits["quantized"]).max()) < 1e-5 * scale


@pytest.fixture
def on_cuda():
    if not mx.cuda.is_available():
        pytest.skip("needs MLX's CUDA backend")
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(previous)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_on_cuda_the_chosen_chunk_path_equals_the_quantized_product(on_cuda, monkeypatch, dtype):
    """Real widths (an 8-bit g32 projection of 4096 -> 4096, the grouped output projection 8 x 4096 ->
    1024), a 2048-token chunk: the path the rule picks on CUDA against mx.quantized_matmul on the GPU."""
    monkeypatch.delenv("DS4_MLX_DENSE_PATH", raising=False)
    assert linear.dequantizes(2048)
    k1, k2, k3, k4 = mx.random.split(mx.random.key(0), 4)
    layer = quantized_linear(4096, 4096, (32, 8, "affine"), k1)
    grouped = quantized_grouped(8, 4096, 1024, (32, 8, "affine"), k3)
    for m in (layer, grouped):
        m.scales, m.biases = m.scales.astype(dtype), m.biases.astype(dtype)
    x = mx.random.normal((2048, 4096), key=k2).astype(dtype)
    xg = mx.random.normal((2048, 8, 4096), key=k4).astype(dtype)
    qmm = dict(transpose=True, group_size=32, bits=8)
    cases = [(layer(x), mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, **qmm)),
             (grouped(xg), mx.stack([mx.quantized_matmul(xg[:, j], grouped.weight[j], grouped.scales[j],
                                                         grouped.biases[j], **qmm) for j in range(8)], axis=1))]
    # float32: CUDA's float32 matrix products run on TF32 tensor cores (inputs rounded to 10-bit
    # mantissas), as every float32 GEMM there; bfloat16: one rounding of each weight and of the output
    tolerance = 2e-3 if dtype == mx.float32 else 2e-2
    for got, want in cases:
        assert got.dtype == want.dtype == dtype
        want = want.astype(mx.float32)
        assert float(mx.abs(got.astype(mx.float32) - want).max()) < tolerance * float(mx.abs(want).max())


def test_the_products_bench_times_both_paths_at_each_row_count(capsys):
    import json

    from ds4_mlx import cli

    assert cli.main(["bench", "dense", "--rows", "1,40", "--repeats", "1", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    rows = figures["results"]
    assert [(r["product"], r["rows"]) for r in rows[:2]] == [("q_a", 1), ("q_a", 40)] and len(rows) == 16
    assert all(r[k] > 0 for r in rows for k in ("quantized_ms", "dequantize_ms", "dequantize_weight_ms",
                                                "kept_copy_ms"))


def test_a_transposed_linear_is_nn_linear_without_its_view():
    """Loaded from a file's [out, in] weight, `TransposedLinear` gives nn.Linear's numbers bit for bit, in one
    node (nn.Linear's product is two: a transposed view of the weight, then the product); quantized, it is
    nn.Linear's quantized layer (the file's layout)."""
    import mlx.nn as nn

    from ds4_mlx.tools.bench_graph import count_nodes

    k1, k2 = mx.random.split(mx.random.key(3))
    w, x = mx.random.normal((24, 64), key=k1), mx.random.normal((5, 64), key=k2)
    reference = nn.Linear(64, 24, bias=False)
    reference.weight = w
    for dtype in (mx.float32, mx.bfloat16):
        layer = linear.TransposedLinear(64, 24)
        layer.load_weights(list(linear.held_transposed(layer, {"weight": w.astype(dtype)}).items()), strict=True)
        reference.set_dtype(dtype)
        rows = x.astype(dtype)
        mx.eval(layer.parameters(), reference.parameters(), rows)
        assert mx.array_equal(layer(rows), reference(rows)).item()
        assert count_nodes([layer(rows)]) == {"Matmul": 1}
    for name, array in reference.to_quantized(32, 8).parameters().items():
        assert mx.array_equal(layer.to_quantized(32, 8)[name], array).item(), name
