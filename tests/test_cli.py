from mlaq import __version__
from mlaq.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_subcommands(capsys):
    assert main([]) == 0
    assert "bench-bmm" in capsys.readouterr().out


def test_module_entry_point(mlaq_cli):
    out = mlaq_cli("--help", check=True)
    assert "usage: mlaq" in out.stdout


def test_help_does_not_import_torch():
    # every subcommand module keeps heavy imports inside run(): `mlaq --help` stays instant
    import subprocess
    import sys

    from conftest import SRC

    code = "import sys; from mlaq.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)}
    )
    assert out.stdout.strip() == "False", out.stderr
