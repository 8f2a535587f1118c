"""global_batch = micro_batch x accumulation x dp: derivation and errors."""

import pytest

from hybrid.config import BatchSizes, ConfigError, config_from_dict, resolve_batch


@pytest.mark.parametrize("micro,accum,glob,dp,expected", [
    (2, 4, 64, 8, (2, 4, 64)),          # all three, consistent
    (2, 4, None, 8, (2, 4, 64)),        # global derived
    (2, None, 64, 8, (2, 4, 64)),       # accumulation derived
    (None, 4, 64, 8, (2, 4, 64)),       # micro derived
    (None, None, 64, 8, (8, 1, 64)),    # only global: accumulation 1
    (3, None, None, 2, (3, 1, 6)),      # only micro: accumulation 1
    (None, 5, None, 2, (None, 5, None)),  # only accumulation: sizes unknown
    (None, None, None, 4, (None, 1, None)),
])
def test_any_two_determine_the_third(micro, accum, glob, dp, expected):
    got = resolve_batch(micro, accum, glob, dp)
    assert (got.micro_batch_size, got.gradient_accumulation_steps, got.global_batch_size) == expected
    assert got.dp_size == dp
    if None not in expected:
        assert expected[0] * expected[1] * dp == expected[2]


def test_config_method_uses_its_keys():
    cfg = config_from_dict({"micro_batch_size": 2, "global_batch_size": 32})
    assert cfg.resolve_batch(4) == BatchSizes(2, 4, 32, 4)


@pytest.mark.parametrize("micro,accum,glob,dp,match", [
    (2, 4, 48, 8, r"global_batch_size 48 != micro_batch_size x gradient_accumulation_steps x data-parallel size "
                  r"= 2 x 4 x 8 = 64 \(micro_batch_size=2, gradient_accumulation_steps=4, global_batch_size=48, "
                  r"data-parallel size=8\)"),
    (3, None, 64, 8, r"global_batch_size 64 is not divisible by micro_batch_size x data-parallel size = 3 x 8 = 24"),
    (None, 3, 64, 8, r"global_batch_size 64 is not divisible by gradient_accumulation_steps x data-parallel size "
                     r"= 3 x 8 = 24"),
    (None, None, 12, 8, r"global_batch_size 12 is not divisible by gradient_accumulation_steps x data-parallel "
                        r"size = 1 x 8 = 8"),
    (0, None, None, 1, r"micro_batch_size must be an integer >= 1, got 0"),
    (2, None, None, 0, r"data-parallel size must be an integer >= 1, got 0"),
])
def test_mismatch_and_indivisible_cases_name_all_values(micro, accum, glob, dp, match):
    with pytest.raises(ConfigError, match=match):
        resolve_batch(micro, accum, glob, dp)
