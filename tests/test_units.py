import pytest

from lms_core.units import parse_bytes


@pytest.mark.parametrize("text, size", [
    ("16GiB", 16 * 2**30), ("16G", 16 * 2**30), ("16GB", 16 * 10**9), ("80 GB", 80 * 10**9),
    ("1.5TiB", int(1.5 * 2**40)), ("512MiB", 512 * 2**20), ("4096", 4096), (2**30, 2**30), ("1e9", 10**9),
])
def test_sizes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["sixteen", "16XB", "-1GiB", "0", "", "GiB"])
def test_bad_sizes_name_the_text(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)
