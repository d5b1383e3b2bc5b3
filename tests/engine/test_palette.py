"""class_palette keeps classes distinguishable: perceived differences (CIELAB delta E, converted here from the sRGB
and CIELAB definitions, checked against published values) between any two colours and between neighbouring class
ids, for few and many classes; white stays the ignore colour."""
import numpy as np
import pytest

from linvit.engine.plots import IGNORE_COLOUR, class_palette


def lab(rgb) -> np.ndarray:
    """sRGB uint8 [N, 3] -> CIELAB D65 [N, 3] (IEC 61966-2-1 linearisation, CIE 1976 L*a*b*)."""
    c = np.asarray(rgb, dtype=np.float64) / 255
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    x = (0.4124 * c[:, 0] + 0.3576 * c[:, 1] + 0.1805 * c[:, 2]) / 0.95047
    y = 0.2126 * c[:, 0] + 0.7152 * c[:, 1] + 0.0722 * c[:, 2]
    z = (0.0193 * c[:, 0] + 0.1192 * c[:, 1] + 0.9505 * c[:, 2]) / 1.08883

    def f(t):
        return np.where(t > 216 / 24389, np.cbrt(t), (24389 / 27 * t + 16) / 116)
    return np.stack([116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))], axis=1)


def test_the_lab_conversion_of_this_test_gives_the_published_values():
    expected = [[53.24, 80.09, 67.20], [87.73, -86.18, 83.18], [32.30, 79.19, -107.86], [100, 0, 0], [0, 0, 0]]
    got = lab([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255], [0, 0, 0]])
    np.testing.assert_allclose(got, expected, atol=0.05)


def smallest_differences(palette: np.ndarray):
    """(the smallest delta E between any two colours, between the colours of class ids i and i + 1)."""
    points = lab(palette)
    pairwise = np.linalg.norm(points[:, None] - points[None], axis=-1)
    np.fill_diagonal(pairwise, np.inf)
    return pairwise.min(), np.linalg.norm(points[1:] - points[:-1], axis=-1).min()


@pytest.mark.parametrize('classes, any_two, neighbours', [(5, 40, 60), (11, 27, 50), (21, 16, 24), (100, 16, 18),
                                                          (256, 13, 18)])
def test_classes_are_far_apart_in_perceived_colour(classes, any_two, neighbours):
    # delta E 2.3 is just noticeable; the old palette gave classes 8 and 27 grey 127 and 128 (delta E 0.4)
    closest, closest_neighbours = smallest_differences(class_palette(classes))
    assert closest >= any_two and closest_neighbours >= neighbours


def test_many_classes_stay_distinct_and_never_take_the_ignore_colour():
    palette = class_palette(5000)
    assert len({tuple(colour) for colour in palette.tolist()}) == 5000
    assert IGNORE_COLOUR not in {tuple(colour) for colour in palette.tolist()}
    background = lab(np.array([IGNORE_COLOUR]))
    assert np.linalg.norm(lab(class_palette(256)) - background, axis=-1).min() >= 13   # nor near-white
