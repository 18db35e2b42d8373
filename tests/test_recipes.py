"""Recipe loading is strict: every shipped recipe validates, and every kind of mistake names its key."""
from __future__ import annotations

import pytest

from launcher.config import Recipe
from launcher.recipe import RecipeError, load_recipe, parse_override, recipe_from_dict, recipe_to_dict
from tests.fixtures import RECIPES

SHIPPED = sorted(RECIPES.glob("*.yaml"))


def test_the_project_ships_the_paper_and_cpu_recipes():
    assert {p.name for p in SHIPPED} >= {"resnet50.yaml", "unet3d.yaml", "resnet50-cpu.yaml", "unet3d-cpu.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    assert recipe.model.name in ("resnet50", "unet3d", "seq2seq")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
@pytest.mark.parametrize("override, key", [
    ("train.batch_size=0", "train.batch_size"),
    ("train.steps=-3", "train.steps"),
    ("model.name=vgg16", "model.name"),
    ("lms.swapout_threshold=0", "lms.swapout_threshold"),
    ("lms.sync_mode=9", "lms.sync_mode"),
    ("distributed.backend=nccl", "distributed.backend"),
    ("train.batch_sise=4", "train.batch_sise"),
    ("model.input_shape=[64]", "model.input_shape"),
])
def test_a_broken_field_in_every_recipe_fails_with_its_key_path(path, override, key):
    with pytest.raises(RecipeError) as err:
        load_recipe(path, [override])
    assert key in str(err.value)


def test_the_paper_recipes_match_the_papers():
    resnet = load_recipe(RECIPES / "resnet50.yaml")
    assert resnet.model.input_shape == [224, 224, 3] and resnet.model.classes == 1000
    assert resnet.train.optimizer == "sgd" and resnet.train.momentum == 0.9 and resnet.train.warmup_steps > 0
    assert resnet.train.scale_lr_by_ranks
    unet = load_recipe(RECIPES / "unet3d.yaml")  # Isensee et al. 2017 as TFLMS trained it (DESIGN.md)
    assert unet.model.input_shape == [192, 192, 192, 4] and unet.train.batch_size == 1
    assert (unet.model.labels, unet.model.levels, unet.model.base_filters, unet.model.dropout) == (3, 5, 16, 0.3)
    assert unet.train.optimizer == "adam" and unet.train.learning_rate == 5e-4 and unet.train.precision == "float32"
    assert unet.data.source == "synthetic" and resnet.data.source == "synthetic"


def test_the_seq2seq_recipes_are_the_nmt_network_and_its_cpu_twin():
    paper, cpu = load_recipe(RECIPES / "seq2seq.yaml"), load_recipe(RECIPES / "seq2seq-cpu.yaml")
    model = paper.model  # Meng et al.'s case at NMT scale: 4 encoder layers, 1024 units, 32k tokens
    assert (model.vocabulary, model.embedding, model.units, model.encoder_layers) == (32000, 512, 1024, 4)
    assert model.input_shape == [50, 50] and paper.lms.enabled
    assert cpu.model.name == "seq2seq" and cpu.model.encoder_layers >= 2  # a bidirectional layer and one more
    assert cpu.lms.enabled and cpu.distributed.np == 2


@pytest.mark.parametrize("override, key", [
    ("model.units=63", "model.units"),  # the bidirectional first layer splits the units in two
    ("model.vocabulary=2", "model.vocabulary"),
    ("model.encoder_layers=0", "model.encoder_layers"),
    ("model.classes=10", "model.classes"),
    ("model.softmax_samples=-1", "model.softmax_samples"),
    ("model.softmax_samples=999", "model.softmax_samples"),  # of 1000 words: 998 at most, the target aside
    ("model.steps_per_loop=-1", "model.steps_per_loop"),
    ("model.steps_per_loop=4", "model.steps_per_loop"),  # 24 target steps: 6 decoder loops, 5 at most
])
def test_a_broken_seq2seq_field_names_its_key(override, key):
    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPES / "seq2seq-cpu.yaml", [override, "data.path=/nowhere"] if "data." in override
                    else [override])
    assert key in str(err.value)


def test_the_cpu_unet_is_the_paper_network_smaller_with_all_three_supervised_levels():
    paper, cpu = load_recipe(RECIPES / "unet3d.yaml"), load_recipe(RECIPES / "unet3d-cpu.yaml")
    assert cpu.model.name == paper.model.name and cpu.model.labels == paper.model.labels
    assert cpu.model.input_shape[-1] == paper.model.input_shape[-1] == 4
    assert cpu.model.levels >= 4  # deep supervision sums decoder levels 2, 1 and 0
    assert cpu.lms.enabled and cpu.lms.mode == "auto" and cpu.distributed.np == 2


def test_each_networks_own_keys_take_its_defaults_and_the_others_are_refused(recipe_file):
    resnet = load_recipe(recipe_file("model:\n  name: resnet50\n"))
    assert resnet.model.classes == 1000 and resnet.model.labels is resnet.model.levels is None
    unet = load_recipe(recipe_file("model:\n  name: unet3d\n  input_shape: [32, 32, 32, 4]\n"))
    assert (unet.model.labels, unet.model.levels, unet.model.base_filters, unet.model.dropout) == (3, 5, 16, 0.3)
    assert unet.model.classes is None
    with pytest.raises(RecipeError, match=r"model\.classes: applies to resnet50 only; remove it for model.name unet3d "
                                          r"\(its outputs are model\.labels\)"):
        load_recipe(recipe_file("model:\n  name: unet3d\n  input_shape: [32, 32, 32, 4]\n  classes: 4\n"))
    with pytest.raises(RecipeError, match=r"model\.levels: applies to unet3d only"):
        load_recipe(recipe_file("model:\n  name: resnet50\n  levels: 4\n"))


def test_a_resolved_unet_recipe_loads_back_the_same(recipe_file):
    recipe = load_recipe(RECIPES / "unet3d-cpu.yaml")
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe


def test_unknown_key_suggests_the_closest_valid_one(recipe_file):
    path = recipe_file("train:\n  batchsize: 8\n")
    with pytest.raises(RecipeError, match=r"unknown key 'train\.batchsize'; did you mean 'train\.batch_size'\?"):
        load_recipe(path)


def test_unknown_section_is_named(recipe_file):
    with pytest.raises(RecipeError, match=r"unknown key 'optimiser'"):
        load_recipe(recipe_file("optimiser:\n  name: sgd\n"))


def test_yaml_syntax_error_shows_the_line(recipe_file):
    path = recipe_file("model:\n  name: resnet50\ntrain:\n  batch_size: [8\n  steps: 3\n")
    with pytest.raises(RecipeError, match=r"recipe\.yaml:\d+:\d+: YAML syntax error"):
        load_recipe(path)


@pytest.mark.parametrize("text, message", [
    ("train:\n  steps: ten\n", "train.steps: expected an integer, got str 'ten'"),
    ("train:\n  batch_size: 8.5\n", "train.batch_size: expected an integer"),
    ("lms:\n  enabled: 1\n", "lms.enabled: expected true or false"),
    ("model: resnet50\n", "model: expected a mapping of keys"),
    ("model:\n  input_shape: 224\n", "model.input_shape: expected a list"),
    ("model:\n  input_shape: [224, x, 3]\n", "model.input_shape[1]: expected an integer"),
    ("data:\n  source: tfrecord\n", "data.path: is required when data.source is tfrecord"),
    ("model:\n  name: unet3d\n  input_shape: [30, 32, 32, 4]\n  levels: 3\n",
     "model.input_shape: D, H and W must be multiples of 2^(levels-1) = 4"),
    ("model:\n  name: unet3d\n  input_shape: [24, 24, 24, 4]\n", "multiples of 2^(levels-1) = 16 so that"),
    ("model:\n  name: unet3d\n  input_shape: [32, 32, 32, 4]\n  levels: 1\n", "model.levels: must be >= 2"),
    ("model:\n  name: unet3d\n  input_shape: [32, 32, 32, 4]\n  dropout: 1.0\n", "model.dropout: must be in [0, 1)"),
    ("model:\n  name: unet3d\n  input_shape: [32, 32, 32, 4]\n  labels: 0\n", "model.labels: must be >= 1"),
    ("model:\n  name: unet3d\n  input_shape: [32, 32, 32, 4]\n  depth: 4\n", "unknown key 'model.depth'"),
    ("model:\n  name: resnet50\n  batch_norm: true\n", "model.batch_norm: expected a string, got bool True"),
    ("distributed:\n  hosts: a:1\n  hostfile: h.txt\n", "distributed.hosts: give hosts or hostfile, not both"),
    ("train:\n  steps: 3\nlogging:\n  skip_steps: 3\n", "logging.skip_steps: must be below train.steps"),
])
def test_wrong_types_and_values_name_the_key_and_the_rule(recipe_file, text, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe_file(text))
    assert message in str(err.value)


def test_precedence_defaults_then_recipe_then_command_line(recipe_file):
    path = recipe_file("train:\n  batch_size: 16\n  steps: 50\n")
    recipe = load_recipe(path, ["train.steps=7", "lms.enabled=true"])
    assert recipe.train.batch_size == 16  # from the recipe
    assert recipe.train.steps == 7  # the command line wins over the recipe
    assert recipe.lms.enabled is True  # a section the recipe did not have
    assert recipe.train.momentum == 0.9  # default


def test_later_overrides_win(recipe_file):
    recipe = load_recipe(recipe_file(""), ["distributed.np=2", "distributed.np=4"])
    assert recipe.distributed.np == 4


@pytest.mark.parametrize("item, expected", [
    ("train.batch_size=64", ("train.batch_size", 64)),
    ("lms.enabled=true", ("lms.enabled", True)),
    ("model.input_shape=[32, 32, 3]", ("model.input_shape", [32, 32, 3])),
    ("distributed.hosts=a:2,b:2", ("distributed.hosts", "a:2,b:2")),
])
def test_override_values_are_parsed_as_yaml(item, expected):
    assert parse_override(item) == expected


def test_override_without_equals_is_an_error():
    with pytest.raises(RecipeError, match="expected key.path=value"):
        parse_override("train.batch_size")


def test_override_below_a_value_is_an_error(recipe_file):
    with pytest.raises(RecipeError, match="train.steps is a value, not a section"):
        load_recipe(recipe_file("train:\n  steps: 4\n"), ["train.steps.x=1"])


def test_exponent_without_dot_is_a_number_where_a_float_is_expected(recipe_file):
    # YAML 1.1 (PyYAML) reads 1e-3 as a string; users mean the number.
    recipe = load_recipe(recipe_file("train:\n  learning_rate: 1e-3\n"), ["train.momentum=5e-1"])
    assert recipe.train.learning_rate == pytest.approx(1e-3)
    assert recipe.train.momentum == pytest.approx(0.5)


def test_ints_are_accepted_for_floats():
    recipe = recipe_from_dict({"train": {"learning_rate": 1}})
    assert recipe.train.learning_rate == 1.0 and isinstance(recipe.train.learning_rate, float)
