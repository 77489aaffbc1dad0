"""posenc's own exp, log, pow and sin/cos (csrc/portable/libm.h), through the ops that use them, against mpmath at
300 bits: every configuration value is the correctly rounded value of its formula, and float64 sin/cos (and the
float32 ones of angles past the fast reduction) are correctly rounded for any angle. Together with
test_capabilities.py (the same bits on every CPU) this is what makes the frequencies machine-independent."""
import math
import random

import mpmath
import pytest
import torch

import posenc
from posenc import functional as PF

mpmath.mp.prec = 300


def nearest_double(x):
    return float(x)  # mpmath rounds to nearest


def nearest_float(x):
    with mpmath.workprec(24):
        return float(+x)


def assert_all_equal(actual, expected, what):
    different = [(i, a, e) for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
    assert not different, f"{what}: {len(different)} of {len(expected)} differ, first {different[:3]}"


@pytest.mark.parametrize("dim,base,shift", [(130, 10000.0, 0), (1024, 10000.0, 1), (64, 10000.5, 0), (7, 1.25, 1),
                                            (256, 1e30, 0)])
def test_sinusoidal_frequencies_are_correctly_rounded(dim, base, shift):
    pairs = dim // 2
    expected = [nearest_double(mpmath.power(base, -mpmath.mpf(i) / (pairs - shift))) for i in range(pairs)]
    assert_all_equal(posenc.frequencies.sinusoidal(dim, base, shift).tolist(), expected, "sinusoidal")


@pytest.mark.parametrize("rotary_dim,base", [(128, 10000.0), (128, 500000.0), (96, 1e6 + 0.5), (2, 3.0)])
def test_rope_frequencies_are_correctly_rounded(rotary_dim, base):
    expected = [nearest_double(mpmath.power(base, -mpmath.mpf(2 * i) / rotary_dim)) for i in range(rotary_dim // 2)]
    assert_all_equal(posenc.frequencies.rope(rotary_dim, base)[0].tolist(), expected, "rope default")


def test_ntk_and_dynamic_frequencies_are_the_correctly_rounded_formula():
    r, theta = 128, 10000.0
    alpha = mpmath.mpf(1000)
    base = theta * alpha ** (mpmath.mpf(r) / (r - 2))
    expected = [nearest_double(base ** (-mpmath.mpf(2 * i) / r)) for i in range(r // 2)]
    got = posenc.frequencies.rope(r, theta, {"rope_type": "ntk", "alpha": 1000.0})[0]
    assert_all_equal(got.tolist(), expected, "ntk")
    factor, context = mpmath.mpf(2.5), 2048
    for length in (2049, 5000, 10 ** 6):
        base = theta * (factor * length / context - (factor - 1)) ** (mpmath.mpf(r) / (r - 2))
        expected = [nearest_double(base ** (-mpmath.mpf(2 * i) / r)) for i in range(r // 2)]
        scaling = {"rope_type": "dynamic", "factor": 2.5, "max_position_embeddings": context}
        got = posenc.frequencies.rope(r, theta, scaling, length)[0]
        assert_all_equal(got.tolist(), expected, f"dynamic at {length}")
        # The length-as-tensor op (what modules and traced code call) gives the same bits.
        rope_type, keywords = posenc.frequencies.rope_arguments(scaling)
        for_length = torch.ops.posenc.rope_inv_freq_for_length(torch.tensor(length), r, theta, rope_type, **keywords)
        assert torch.equal(for_length, got)


def test_scales_are_the_correctly_rounded_formula():
    _, yarn = posenc.frequencies.rope(64, 10000.0, {"rope_type": "yarn", "factor": 40.0,
                                                    "original_max_position_embeddings": 4096})
    # 0.1 * 1 * ln(40) + 1 in float64 steps, the log correctly rounded
    assert yarn == 0.1 * 1.0 * nearest_double(mpmath.log(40)) + 1.0


def test_alibi_slopes_are_correctly_rounded():
    for n in list(range(1, 70)) + [100, 1000]:
        power = 2 ** int(math.floor(math.log2(n)))
        exponents = [mpmath.mpf(-8 * k) / power for k in range(1, power + 1)]
        exponents += [mpmath.mpf(-4 * (2 * j - 1)) / power for j in range(1, n - power + 1)]
        expected = [nearest_double(mpmath.power(2, e)) for e in exponents]
        assert_all_equal(PF.alibi_slopes(n, torch.float64).tolist(), expected, f"alibi_slopes({n})")


def angles():
    """Angles of every size, the closest a float64 comes to a multiple of pi/2 among them."""
    rng = random.Random(7)
    values = [0.0, -0.0, 1e-300, 0.5, math.pi / 4, 1.0, 2.0 ** 26, 2.0 ** 26 + 0.5, 6381956970095103 * 2.0 ** 797,
              1.7e308, -1e22]
    for scale in (1.0, 1e3, 2.0 ** 30, 2.0 ** 60, 1e200):
        values += [rng.uniform(-scale, scale) for _ in range(40)]
    return values


def sin_cos(values, dtype):
    """sin and cos of each value: position 1 times inv_freq = the value."""
    out = PF.sinusoidal(torch.ones(1, dtype=torch.float64), torch.tensor(values, dtype=torch.float64), "half", dtype)
    return out[0, :len(values)].tolist(), out[0, len(values):].tolist()


def test_float64_sin_and_cos_are_correctly_rounded_for_any_angle():
    values = angles()
    sin, cos = sin_cos(values, torch.float64)
    assert_all_equal(sin, [nearest_double(mpmath.sin(v)) for v in values], "sin")
    assert_all_equal(cos, [nearest_double(mpmath.cos(v)) for v in values], "cos")


def test_float32_sin_and_cos_past_the_fast_reduction_are_correctly_rounded():
    values = [v for v in angles() if abs(v) > 2.0 ** 26]
    sin, cos = sin_cos(values, torch.float32)
    assert_all_equal(sin, [nearest_float(mpmath.sin(v)) for v in values], "sin")
    assert_all_equal(cos, [nearest_float(mpmath.cos(v)) for v in values], "cos")
