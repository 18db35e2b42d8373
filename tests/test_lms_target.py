"""What a rank plans for: which link wins when several settings could name one (launcher.lms.target),
and the settings parsed once into bytes and rates when the config is made."""
from __future__ import annotations

import pytest

from launcher.lms.target import choose_link
from launcher.recipe import RecipeError, load_recipe, recipe_from_dict, recipe_to_dict
from lms_core.config import LMSConfig
from lms_core.link import LinkRates, link_named
from lms_core.nvml import GpuInfo
from tests.fixtures import RECIPES

MEASURED = LinkRates("measured", 20e9, 18e9, "timed copies")
NVML_LINK = LinkRates("pcie4x16", 24e9, 24e9, "NVML: PCIe gen4 x16")
GPU = GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=80 << 30, link=NVML_LINK)


@pytest.mark.parametrize("settings, rank, gpu, measure, chosen, says", [
    # lms.rank_links beats everything, by rank (rank 3 of two entries takes the second).
    ({"rank_links": ["pcie3", "nvlink2"], "link": "c2c", "measure_link": True}, 3, GPU, MEASURED, "nvlink2",
     "lms.rank_links"),
    # On a GPU with lms.measure_link, the timed rates beat the named link and NVML.
    ({"link": "c2c", "measure_link": True}, 0, GPU, MEASURED, "measured", "measured"),
    # A named link beats NVML; without a GPU to time, measure_link says why it was not used.
    ({"link": "c2c", "measure_link": True}, 0, None, None, "c2c", "needs a GPU to time copies"),
    ({"link": "c2c"}, 0, GPU, None, "c2c", "c2c"),
    # By default a GPU rank times its link where the recipe says auto, not over a link it names.
    ({"link": "auto"}, 0, GPU, MEASURED, "measured", "measured"),
    ({"link": "c2c"}, 0, GPU, MEASURED, "c2c", "c2c"),
    ({"link": "auto", "measure_link": False}, 0, GPU, MEASURED, "pcie4x16", "(detected)"),
    # auto: what NVML reports, else the fallback, saying which and why.
    ({"link": "auto"}, 0, GPU, None, "pcie4x16", "(detected)"),
    ({"link": "auto", "link_fallback": "pcie5"}, 0, None, None, "pcie5", "no GPU, so the recipe's lms.link_fallback"),
    ({"link": "auto", "link_fallback": 30}, 0, GpuInfo(0, "GPU", 1 << 30, link=None), None, "30GB/s",
     "NVML could not tell"),
])
def test_the_link_is_chosen_in_one_order(settings, rank, gpu, measure, chosen, says):
    link, line = choose_link(LMSConfig(**settings), rank, gpu, (lambda: measure) if measure else None)
    assert link.name == chosen
    assert says in line


def test_sizes_and_links_are_parsed_once_when_the_config_is_made():
    lms = LMSConfig(device_memory="16GiB", host_memory="1.5TB", link="25", link_fallback="pcie4",
                    rank_links=["nvlink2", 12])
    assert lms.device_memory_bytes == 16 * 2**30 and lms.host_memory_bytes == 1.5e12
    assert lms.link_rates.h2d_bytes_per_s == 25e9
    assert lms.link_fallback_rates is link_named("pcie4")
    assert [r.name for r in lms.rank_link_rates] == ["nvlink2", "12GB/s"]
    assert LMSConfig().link_rates is None  # auto: decided per rank


def test_the_resolved_recipe_holds_what_was_written_and_loads_back_the_same():
    recipe = load_recipe(RECIPES / "resnet50.yaml", ["lms.device_memory=12GiB", "lms.link=nvlink2"])
    written = recipe_to_dict(recipe)
    assert written["lms"]["device_memory"] == "12GiB" and written["lms"]["link"] == "nvlink2"
    assert "device_memory_bytes" not in written["lms"]  # what was parsed is not part of the recipe
    assert recipe_from_dict(written) == recipe


def test_a_parsed_value_is_not_a_recipe_key():
    with pytest.raises(RecipeError, match="unknown key 'lms.device_memory_bytes'"):
        load_recipe(RECIPES / "resnet50.yaml", ["lms.device_memory_bytes=1"])
