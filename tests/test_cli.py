"""The command line: bad input exits 2 with the key named, starts nothing and leaves no run directory;
--dry-run prints the resolved recipe and every rank's command and environment."""
from __future__ import annotations

import subprocess

import pytest

from launcher import cli
from launcher.launch import spawn
from tests.fixtures import RECIPES, lms_launch_argv


@pytest.fixture
def no_spawn(monkeypatch):
    """Fails the test if anything would be started."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(spawn, "run_ranks", refuse)


@pytest.mark.parametrize("args, message", [
    (["--set", "train.batch_size=0"], "train.batch_size: must be >= 1"),
    (["--set", "train.steps=-1"], "train.steps: must be >= 1"),
    (["--set", "model.name=alexnet"], "model.name: must be one of resnet50, unet3d"),
    (["--set", "trian.steps=3"], "did you mean 'train'"),
    (["--set", "lms.sync_mode=5"], "lms.sync_mode"),
    (["--set", "lms.swapout_threshold=0"], "lms.swapout_threshold"),
    (["--np", "0"], "distributed.np: must be >= 1"),
    (["--np", "3", "-H", "localhost:2"], "distributed.np: 3 ranks but the hosts"),
    (["-H", "node1"], "distributed.hosts: 'node1' is not host:slots"),
    (["--hostfile", "/nonexistent/hosts"], "distributed.hostfile: /nonexistent/hosts does not exist"),
    (["--backend", "nccl"], "argument --backend: invalid choice"),
    (["--ssh-port", "0"], "distributed.ssh_port: must be a port number 1..65535; got 0"),
    (["--start-timeout", "0"], "distributed.start_timeout: must be >= 1 second; got 0"),
    (["--ssh-identity-file", "/nonexistent/key"], "distributed.ssh_identity_file: /nonexistent/key is not a file"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_exits_2_names_the_problem_and_leaves_nothing(tmp_path, capsys, no_spawn, args, message):
    run_dir = tmp_path / "run"
    status = cli.main([str(RECIPES / "resnet50-cpu.yaml"), "--run-dir", str(run_dir), *args])
    assert status == 2
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


def test_missing_recipe_file(capsys, tmp_path, no_spawn):
    assert cli.main([str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such recipe file" in capsys.readouterr().err


def test_yaml_syntax_error_exits_2_with_the_line(tmp_path, capsys, no_spawn):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name: resnet50\n  input_shape: [64, 64\n")
    assert cli.main([str(recipe), "--run-dir", str(tmp_path / "run")]) == 2
    assert "r.yaml:4:1: YAML syntax error" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_run_dir_with_files_is_not_overwritten(tmp_path, capsys, no_spawn):
    (tmp_path / "summary.json").write_text("{}")
    assert cli.main([str(RECIPES / "resnet50-cpu.yaml"), "--run-dir", str(tmp_path)]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert (tmp_path / "summary.json").read_text() == "{}"


def test_dry_run_prints_recipe_command_and_rank_environments_and_starts_nothing(tmp_path, capsys, no_spawn):
    run_dir = tmp_path / "run"
    status = cli.main([str(RECIPES / "resnet50-cpu.yaml"), "--np", "2", "--set", "train.steps=9",
                       "--run-dir", str(run_dir), "--dry-run"])
    out = capsys.readouterr().out
    assert status == 0 and not run_dir.exists()
    assert "steps: 9" in out  # the resolved recipe, with the override applied
    command = out.split("# command\n")[1].splitlines()[0]
    assert "horovodrun --gloo -np 2 -H localhost:2" in command
    assert command.endswith(f"--run-dir {run_dir.resolve()} --set train.steps=9 --set distributed.np=2")
    assert "rank 1 on localhost (local rank 1):" in out and "HOROVOD_RANK=1" in out


def test_flags_override_the_recipe_and_set(capsys, no_spawn):
    cli.main([str(RECIPES / "resnet50-cpu.yaml"), "--set", "distributed.np=4", "--np", "1", "--dry-run"])
    out = capsys.readouterr().out
    assert "np: 1" in out and "(local rank 0, no launcher)" in out


def test_ssh_and_network_flags_beat_set_and_reach_the_command(tmp_path, capsys, no_spawn):
    key = tmp_path / "id_test"
    key.write_text("not read by a dry run")
    cli.main([str(RECIPES / "resnet50-cpu.yaml"), "-H", "node1:1,node2:1", "--set", "distributed.ssh_port=2200",
              "--set", "distributed.start_timeout=5", "--ssh-port", "2222", "--ssh-identity-file", str(key),
              "--network-interface", "ib0", "--start-timeout", "60", "--dry-run"])
    out = capsys.readouterr().out
    command = out.split("# command\n")[1].splitlines()[0]
    assert (f"-H node1:1,node2:1 --network-interfaces ib0 --ssh-port 2222 --ssh-identity-file {key} "
            f"--start-timeout 60 ") in command
    assert "ssh_port: 2222" in out and "start_timeout: 60" in out  # the resolved recipe says the same


def test_the_installed_command_exits_2_on_a_bad_recipe(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(lms_launch_argv(str(RECIPES / "unet3d-cpu.yaml"), "--set", "train.batch_size=0",
                                          "--run-dir", str(run_dir)), capture_output=True, text=True)
    assert done.returncode == 2
    assert "train.batch_size: must be >= 1; got 0" in done.stderr
    assert not run_dir.exists()


# --- a command line that explains itself ---------------------------------------------------------------

def command_parsers():
    """Every parser a user meets, by the command that prints it."""
    from launcher.bench.command import parser as bench_parser
    from launcher.bundle.pack import parser as bundle_parser
    from launcher.lms.plan_command import parser as plan_parser
    from launcher.rank.data.convert import parser as tfrecord_parser

    return {"lms-launch": cli.train_parser(), "plan": plan_parser(), "bench": bench_parser(),
            "tfrecord": tfrecord_parser(), "bundle": bundle_parser()}


def help_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:  # argparse exits once it has printed the help
        cli.main(list(argv))
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_command_with_one_line_and_help_says_the_same(capsys):
    text = help_of(capsys, "--help")
    lines = text.splitlines()
    for command in [*cli.SUBCOMMANDS, "help", "RECIPE"]:
        assert sum(line.startswith(f"  {command} ") for line in lines) == 1, command
    assert cli.main(["help"]) == 0 and capsys.readouterr().out == text
    assert "--version" in text and "--set KEY=VALUE" in text and text.count("usage:") == 1


@pytest.mark.parametrize("command", ["plan", "bench", "tfrecord", "bundle"])
def test_help_of_each_command_prints_its_usage_once(capsys, command):
    assert cli.main(["help", command]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: lms-launch {command}") and text.count("usage:") == 1
    assert text.count(f"`lms-launch {command} ") == 0  # no second synopsis from the module's docstring


def test_every_option_of_every_command_has_help_and_no_word_of_our_own_machines():
    for name, parser in command_parsers().items():
        for action in parser._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help text"
        text = parser.format_help().lower()
        for word in ("lent", "device tool", "this project's", "workplace"):
            assert word not in text, f"{name} --help speaks of {word!r}"


def test_version_and_a_help_for_no_such_command(capsys):
    import platform

    from launcher import __version__

    assert cli.main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"lms-launch {__version__} (Python {platform.python_version()}; tensorflow")
    assert cli.main(["help", "bogus"]) == 2
    assert "help: no command 'bogus'; the commands are plan, bench, tfrecord, bundle" in capsys.readouterr().err
    assert cli.main([]) == 2 and "commands:" in capsys.readouterr().err  # no recipe: what there is to run
