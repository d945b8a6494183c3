"""The FP8 E4M3 and FP4 E2M1 round trips of quant_sim, against values worked out by hand."""

import math

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.models.kernels import fp4_rounding
from ds4_mlx.models.numerics import fp4_e2m1_round, fp4_e2m1_sim, fp8_e4m3_sim, hadamard


def test_fp8_block_scale_and_ties_to_even():
    # amax 448 -> scale 2^ceil(log2(1)) = 1: values are rounded on the E4M3 grid itself.
    # [1, 2) has step 1/8: 1.0625 ties to 1.0 (even mantissa), 1.1875 ties to 1.25;
    # [256, 448] has step 32: 300 -> 288; 2^-9 * 1.5 ties between subnormals 2^-9 and 2^-8 -> 2^-8.
    block = np.zeros(64, np.float32)
    block[:5] = [448.0, 1.0625, 1.1875, 300.0, 1.5 * 2**-9]
    out = np.array(fp8_e4m3_sim(mx.array(block[None])))[0]
    assert out[:5].tolist() == [448.0, 1.0, 1.25, 288.0, 2**-8]
    assert (out[5:] == 0).all()


def test_fp8_scale_is_a_power_of_two_from_the_block_max():
    # amax 1000 -> scale 2^ceil(log2(1000/448)) = 4; 1000/4 = 250 -> 256 (step 16 in [128, 256)) -> 1024;
    # 10/4 = 2.5 exact -> 10. A second block with amax 1e-6 uses the 1e-4 floor: scale 2^-22.
    x = np.zeros((1, 128), np.float32)
    x[0, 0], x[0, 1] = 1000.0, 10.0
    x[0, 64] = 1e-6
    out = np.array(fp8_e4m3_sim(mx.array(x)))[0]
    assert out[0] == 1024.0 and out[1] == 10.0
    scale = 2.0 ** math.ceil(math.log2(1e-4 / 448))
    assert out[64] == 4.0 * scale  # 1e-6 / 2^-22 = 4.19 -> E4M3 4.0 (step 0.5 in [4, 8))


def test_fp8_rounds_only_the_first_width_features():
    # a KV row: the first `width` features rounded in their own blocks, the rest (RoPE's) kept exactly;
    # widths whose blocks tile the row (a select) and whose blocks do not (slices): the same rule
    for width, row in ((128, 192), (24, 32)):
        x = np.full((2, row), 1.0625, np.float32)  # ties to 1.0 on the E4M3 grid (amax 1.0625: scale 1)
        x[:, width:] = 1.0 + 2.0**-20  # kept: not representable in E4M3, nor on float16's grid
        out = np.array(fp8_e4m3_sim(mx.array(x), width=width))
        assert out.dtype == np.float32
        assert (out[:, :width] == 1.0).all() and (out[:, width:] == x[:, width:]).all()
    for width, row in ((96, 128), (None, 96)):  # features to round that whole blocks do not tile: an error
        with pytest.raises(ValueError, match="do not tile"):
            fp8_e4m3_sim(mx.zeros((2, row)), width=width)


def test_fp4_grid_and_ties():
    v = mx.array([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, -0.75, -6.0])
    assert np.array(fp4_e2m1_round(v)).tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -6.0]


def test_fp4_block_scale():
    # amax 12 -> scale 2^ceil(log2(12/6)) = 2: 12 -> 6*2, 5 -> 2.5 -> tie between 2 and 3 -> 2 -> 4, 0.9 -> 0.45 -> 0.5 -> 1.0
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [12.0, 5.0, 0.9]
    out = np.array(fp4_e2m1_sim(mx.array(x)))[0]
    assert out[:3].tolist() == [12.0, 4.0, 1.0]


def test_hadamard_is_orthonormal_before_rounding():
    # one-hot input: the normalised Hadamard spreads it to +-1/sqrt(n); FP4 then keeps +-(1/sqrt(n)) rounded
    # on its grid with scale 2^ceil(log2((1/4)/6)) = 2^-4: 0.25 / 2^-4 = 4 exactly -> 0.25.
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 1.0
    out = np.array(fp4_rounding(hadamard(mx.array(x))))[0]
    assert np.allclose(np.abs(out), 0.25)
