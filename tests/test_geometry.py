"""The cache geometry's definitions against a direct enumeration of V4's blocks, and the config check."""

import pytest

from ds4_mlx.cache import geometry as g
from ds4_mlx.models.args import ModelArgs


@pytest.mark.parametrize("m", [4, 128])
def test_blocks_rows_and_frontier_follow_the_block_definition(m):
    for p in range(0, 3 * m + 2):
        blocks = [b for b in range(p // m + 2) if (b + 1) * m - 1 <= p]  # blocks whose last position is <= p
        assert g.rows_visible(p, m) == len(blocks) == g.rows_done(p + 1, m)
        assert g.block_of(p, m) * m <= p < (g.block_of(p, m) + 1) * m
        # the open block's inputs (and the previous block's, with overlap) are what pooling will read
        open_start = g.block_of(p, m) * m
        start = max(0, open_start - m) if m == 4 else open_start
        assert g.frontier_start(p, m) == start and g.frontier_needs(p, m) == p - start
    assert g.compressor_reach(4) == 7 and g.compressor_reach(128) == 127 and g.window_reach(128) == 127
    assert g.lane_every([0, 0, 4, 128]) == 128 and g.lane_every([0, 0]) is None


@pytest.mark.parametrize("ratios,message", [
    ([0, 4], "2 entries for 3 layers"),
    ([0, 4, 128, 4], "4 entries for 3 layers"),
    ([0, 2, 1], r"\[1, 2\] are not DeepSeek V4's"),  # V4.1's codes must not become heavy layers
    ([0, 4, 6], r"\[6\] are not"),
    ([4, 16, 128], r"\[16, 128\] are not"),
])
def test_model_args_refuse_ratios_that_are_not_v4s(ratios, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs(num_hidden_layers=3, compress_ratios=ratios)
    if len(ratios) <= 3:  # a config file's list may have one more entry (the MTP block's), cut off when read
        with pytest.raises(ValueError, match=message):
            ModelArgs.from_dict({"num_hidden_layers": 3, "compress_ratios": ratios})
