"""Broken third-party plugins, installed as real distributions (a .dist-info with entry points on PYTHONPATH,
as tests/example_plugin is): each failure is one line naming the plugin, the architecture and the original
error (the file:line of the raise), in `zoo run`, `zoo serve`, `zoo inspect` and `zoo parity` alike; `zoo list`
shows a status per architecture; `zoo --help` survives a broken command. The commands of one environment run in one
subprocess (calling zoo.cli.main in turn, a fresh registry each) to keep this cheap."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLUGINS = {  # module -> source; the line numbers of the raises are asserted below
    "zoo_exit_plugin": "import sys\nsys.exit(3)\n",
    "zoo_exit_cmd": "import sys\nsys.exit(4)\n",
    "zoo_norun_cmd": '"""A command without run()."""\ndef add_arguments(parser):\n    pass\n',
    "zoo_bad_models": textwrap.dedent('''\
        from plugins.llama import LLAMA_RULES, LlamaForCausalLM
        from registry import ArchSpec, hookimpl


        class RaisingForCausalLM(LlamaForCausalLM):
            def __init__(self, config, prefix=""):
                raise ValueError("boom in the constructor")


        def validate_badly(config):
            return {}["no_such_field"]


        @hookimpl
        def register_architectures(register):
            register(ArchSpec(("MissingForCausalLM",), "zoo_missing_models:Nope", "dense", rules=LLAMA_RULES))
            register(ArchSpec(("RaisingForCausalLM",), "zoo_bad_models:RaisingForCausalLM", "dense",
                              rules=LLAMA_RULES))
            register(ArchSpec(("DivideForCausalLM",), "zoo_divides:Model", "dense", rules=LLAMA_RULES))
            register(ArchSpec(("CheckingForCausalLM",), "plugins.llama:LlamaForCausalLM", "dense", rules=LLAMA_RULES,
                              validate=validate_badly))
        '''),
    "zoo_divides": "x = 1\ny = x / 0\n",
    "zoo_evil": textwrap.dedent('''\
        from registry import ArchSpec, hookimpl


        @hookimpl
        def register_architectures(register):
            register(ArchSpec(("LlamaForCausalLM",), "plugins.llama:LlamaForCausalLM", "dense"))
        '''),
}
ENTRY_POINTS = textwrap.dedent('''\
    [zoo]
    exits = zoo_exit_plugin
    bad = zoo_bad_models
    evil = zoo_evil

    [zoo.commands]
    brokencmd = zoo_no_such_cmd_module
    exitcmd = zoo_exit_cmd
    norun = zoo_norun_cmd
    ''')

# Runs each [argv, env] in turn in this process with a fresh registry; prints one JSON line of
# [exit status or "raised: <traceback>", stdout, stderr] per case.
RUNNER = textwrap.dedent('''\
    import contextlib, io, json, os, sys, traceback
    import registry.manager
    from zoo.cli import main
    results = []
    for argv, env in json.loads(sys.argv[1]):
        os.environ.pop("ZOO_PLUGINS", None)
        os.environ.update(env)
        registry.manager._default = None
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else f"SystemExit({e.code!r})"
            except BaseException:
                code = "raised: " + traceback.format_exc()
        results.append([code, out.getvalue(), err.getvalue()])
    print(json.dumps(results))
    ''')


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A directory of installed-looking broken plugins and checkpoints that name their architectures."""
    from test_cli_run import save_chat_model

    root = tmp_path_factory.mktemp("plugin-site")
    for module, source in PLUGINS.items():
        (root / f"{module}.py").write_text(source)
    info = root / "zoo_broken_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zoo-broken-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    base = save_chat_model(root / "llama")
    ckpts = {"llama": base}
    for arch in ("MissingForCausalLM", "RaisingForCausalLM", "DivideForCausalLM", "CheckingForCausalLM"):
        ckpt = shutil.copytree(base, root / arch)
        cfg = json.loads((base / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
        ckpts[arch] = ckpt
    return root, ckpts


def run_cases(root, cases):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (argv, _), (code, out, err) in zip(cases, results):
        assert not str(code).startswith("raised"), f"{argv}: {code}"
        assert "Traceback" not in out + err, (argv, out, err)
    return results


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


BAD = {"ZOO_PLUGINS": "exits,bad,nosuch"}
EVIL = {"ZOO_PLUGINS": "evil"}
USES = ("MissingForCausalLM", "RaisingForCausalLM", "DivideForCausalLM", "CheckingForCausalLM")
COMMANDS = (("run", ["--prompt", "w1", "--max-tokens", "1"]), ("serve", ["--port", "0"]), ("inspect", []),
            ("parity", ["--quiet", "--scenario", "prefill"]))


@pytest.fixture(scope="module")
def results(site):
    """Every case of both tests in one subprocess (a Python start with torch costs seconds here)."""
    root, ck = site
    cases = [
        (["--help"], BAD), (["brokencmd"], BAD), (["exitcmd"], BAD), (["norun"], BAD), (["list"], BAD),
        *[([cmd, str(ck[arch]), *extra], BAD) for arch in USES for cmd, extra in COMMANDS],
        (["list"], EVIL), (["run", str(ck["llama"]), "--prompt", "w1"], EVIL),
        (["run", str(ck["llama"]), "--prompt", "w1", "--max-tokens", "1"], {"ZOO_PLUGINS": ""}),
    ]
    return run_cases(root, cases)


def test_broken_plugins_are_one_line_errors_in_every_command(results):
    (help_, broken, exits, norun, listing, *uses) = results[:5 + len(COMMANDS) * len(USES)]
    assert help_[0] == 0 and "list" in help_[1]
    text = " ".join(help_[1].split())  # (argparse wraps the help column)
    assert "brokencmd (broken: does not load: ModuleNotFoundError: No module named 'zoo_no_such_cmd_module')" in text
    assert "exitcmd (broken: does not load: called sys.exit(4) (at " in text and "norun (broken: has no run())" in text
    assert broken[0] == 2 and last_line(broken[2]) == (
        "zoo: error: command 'brokencmd' (entry point brokencmd = zoo_no_such_cmd_module in group zoo.commands) "
        "does not load: ModuleNotFoundError: No module named 'zoo_no_such_cmd_module'")
    assert exits[0] == 2 and "does not load: called sys.exit(4) (at " in exits[2] and "zoo_exit_cmd.py:2)" in exits[2]
    assert norun[0] == 2 and "has no run()" in norun[2]

    code, out, err = listing
    assert code == 0
    assert "zoo: warning: ZOO_PLUGINS names 'nosuch', but no installed package has an entry point 'nosuch'" in err
    assert "(installed: bad, evil, exits)" in err
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "ForCausalLM" in line.split()[0]}
    assert rows["MissingForCausalLM"][1:] == ["dense", "bad", "zoo_missing_models:Nope", "import", "error"]
    assert rows["DivideForCausalLM"][-2:] == ["import", "error"]
    assert rows["RaisingForCausalLM"][-1] == "ok" and rows["LlamaForCausalLM"][-1] == "ok"
    assert ("import error: plugin 'bad', architecture 'DivideForCausalLM': model 'zoo_divides:Model' does not import: "
            "ZeroDivisionError: division by zero (at ") in out and "zoo_divides.py:2)" in out
    assert "plugin 'exits' failed to load: called sys.exit(3) (at " in out and "zoo_exit_plugin.py:2)" in out
    assert "plugin 'nosuch' failed to load: LookupError: ZOO_PLUGINS names 'nosuch'" in out

    wanted = {
        "MissingForCausalLM": "plugin 'bad', architecture 'MissingForCausalLM': model 'zoo_missing_models:Nope' "
                              "does not import: ModuleNotFoundError: No module named 'zoo_missing_models'",
        "RaisingForCausalLM": "plugin 'bad', architecture 'RaisingForCausalLM': the model constructor "
                              "RaisingForCausalLM(config) raised ValueError: boom in the constructor (at ",
        "DivideForCausalLM": "does not import: ZeroDivisionError: division by zero (at ",
        "CheckingForCausalLM": "plugin 'bad', architecture 'CheckingForCausalLM': validate(config) raised "
                               "KeyError: 'no_such_field' (at ",
    }
    where = {"RaisingForCausalLM": "zoo_bad_models.py:7)", "DivideForCausalLM": "zoo_divides.py:2)",
             "CheckingForCausalLM": "zoo_bad_models.py:11)"}
    n = len(COMMANDS)
    for i, arch in enumerate(wanted):
        for (code, out, err), (cmd, _) in zip(uses[n * i:n * i + n], COMMANDS):
            line = last_line(out if cmd == "inspect" else err)  # (zoo inspect reports on stdout)
            assert code == 2, (arch, cmd, out, err)
            assert line.startswith(f"zoo {cmd}: ") and wanted[arch] in line, (arch, cmd, line)
            assert where.get(arch, "") in line, (arch, cmd, line)


def test_a_third_party_claim_on_a_builtin_is_a_conflict_with_its_way_out(results):
    (listing, run, fixed) = results[5 + len(COMMANDS) * len(USES):]
    code, out, err = listing
    assert code == 0 and err == ""
    row = next(line for line in out.splitlines() if line.startswith("LlamaForCausalLM "))
    assert row.split()[-1] == "conflict"
    conflict = ("architecture 'LlamaForCausalLM' is claimed by two plugins: 'plugins.llama' and 'evil', so neither "
                "serves it; to resolve, set override=True in the ArchSpec of the one that should serve it")
    assert f"conflict: {conflict}" in out
    code, out, err = run
    assert code == 2 and conflict in last_line(err) and err.count("error") == 1  # (after the progress lines)
    assert fixed[0] == 0, fixed  # without the plugin, the built-in serves
