"""README.md's code blocks run as written: every ```python block executes (on the CPU, in order,
each in a fresh namespace) and prints what its comments say, and every command of a ```bash block
parses its arguments -- train.py's config and ``--set`` overrides are loaded and checked, a
``python -m k3jax.X`` command goes through that module's own argument parser (which stops there),
a ``make`` target exists in the Makefile."""

import argparse
import re
import runpy
import shlex
from pathlib import Path

import pytest

from k3jax.config.experiment import apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)


def _commands() -> list[list[str]]:
    """Each bash line as argv (continuations joined, comments dropped)."""
    out = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


class _Parsed(Exception):
    pass


def _parse_only(monkeypatch, module: str, args: list[str]) -> argparse.Namespace:
    """Runs ``python -m module args`` up to its argument parsing, then stops it."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        raise _Parsed(real(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr("sys.argv", [module, *args])
    with pytest.raises(_Parsed) as parsed:
        runpy.run_module(module, run_name="__main__")
    return parsed.value.args[0]


def test_the_readme_has_the_blocks_this_test_reads():
    assert README.startswith("# k3jax\n\n```bash\nmake train")
    assert len(_blocks("python")) >= 2
    assert {"train.py", "k3jax.data", "k3jax.evaluate", "k3jax.plot", "k3jax.accounting"} <= {
        a for argv in _commands() for a in argv}


def _shown(block: str) -> list[str]:
    """The comment after each ``print(...)`` of a block: what the README says it prints."""
    return [line.split("#", 1)[1].strip() for line in block.splitlines()
            if line.startswith("print(") and "#" in line]


def _check_shown(said: str, printed: str) -> None:
    """``said`` is the printed line (a literal starting with ``(``), possibly ending in ``< X``
    for the last number printed; other comments describe the values and are not compared."""
    if not said.startswith("("):
        return
    literal, _, bound = said.partition("<")
    assert printed.startswith(literal.strip()), (said, printed)
    if bound:
        assert float(printed.split()[-1]) < float(bound), (said, printed)


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs(index, monkeypatch, tmp_path, capsys):
    block = _blocks("python")[index]
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(block)
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out.strip().splitlines()
    said = _shown(block)
    assert len(printed) >= len(said)
    for comment, line in zip(said, printed[-len(said):] if said else []):
        _check_shown(comment, line)


# runpy warns when the module was imported before (by another test): harmless for a parse.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
@pytest.mark.parametrize("argv", _commands(), ids=lambda argv: " ".join(argv[:3]))
def test_bash_command_parses(argv, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    if argv[0] == "make":
        makefile = (ROOT / "Makefile").read_text()
        targets = re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE)
        assert set(argv[1:]) <= set(targets), f"{argv}: no such Makefile target"
        return
    assert argv[0] in ("python", "python3"), f"{argv}: not a python command"
    if argv[1] == "train.py":
        import train

        args = train.parse_args(argv[2:])
        apply_overrides(load_config(args.config), args.overrides)
    else:
        assert argv[1] == "-m", argv
        _parse_only(monkeypatch, argv[2], argv[3:])
