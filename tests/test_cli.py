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
