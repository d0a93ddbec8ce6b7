"""The registry: built-ins through the public hook, entry points, conflicts, and clear errors."""
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import registry
from registry import ArchSpec, Registry, RegistryError, UnsupportedArchitecture, hookimpl
from registry import hookspecs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = Path(__file__).parent / "example_plugin"


class Claims:
    """A plugin object registering the given specs."""

    def __init__(self, *specs):
        self.specs = specs

    @hookimpl
    def register_architectures(self, register):
        for s in self.specs:
            register(s)


def spec(arch="FooForCausalLM", **kw):
    return ArchSpec((arch,), "plugins.llama:LlamaForCausalLM", "dense", **kw)


def test_builtins_register_through_the_public_hook():
    reg = Registry(entry_points=False)
    assert not reg.failures, reg.failures
    llama = reg.get("LlamaForCausalLM")
    assert llama.plugin == "plugins.llama" and llama.family == "dense"
    assert llama.model_class().__name__ == "LlamaForCausalLM"
    # every built-in plugin module carries the same hookimpl a third party writes
    for name, plugin in reg.pm.list_name_plugin():
        assert reg.pm.get_hookcallers(plugin), name


def test_two_claims_on_one_architecture_name_both_plugins():
    reg = Registry(builtins=False, entry_points=False)
    reg.register_plugin(Claims(spec()), name="first")
    with pytest.raises(RegistryError, match=r"'FooForCausalLM' is claimed by two plugins: 'first' and 'second'"):
        reg.register_plugin(Claims(spec()), name="second")
    assert reg.get("FooForCausalLM").plugin == "first"  # the failed plugin left nothing behind
    assert "second" not in dict(reg.pm.list_name_plugin())


def test_override_is_the_explicit_way_out_and_unregistering_restores():
    reg = Registry(builtins=False, entry_points=False)
    reg.register_plugin(Claims(spec()), name="first")
    reg.register_plugin(Claims(spec(override=True)), name="second")
    assert reg.get("FooForCausalLM").plugin == "second"
    reg.unregister_plugin("second")
    assert reg.get("FooForCausalLM").plugin == "first"


def test_unknown_architecture_lists_supported_and_the_import_error():
    reg = Registry(builtins=False, entry_points=False)
    reg.register_plugin(Claims(spec("BarForCausalLM")), name="bar")
    reg._import_and_register("zoo_no_such_plugin_module", name="broken")
    with pytest.raises(UnsupportedArchitecture) as err:
        reg.resolve({"architectures": ["NopeForCausalLM"]})
    text = str(err.value)
    assert "NopeForCausalLM" in text and "supported: BarForCausalLM" in text
    assert "plugin 'broken' failed to load: ModuleNotFoundError" in text and "\n" not in text
    assert isinstance(err.value.failures["broken"], ModuleNotFoundError)


def test_a_broken_plugin_is_kept_as_a_failure_and_spoils_nothing():
    class Broken:
        @hookimpl
        def register_architectures(self, register):
            register(ArchSpec(("X",), "m:C", "densest"))  # raises inside the hook

    reg = Registry(builtins=False, entry_points=False)
    reg._load("broken", Broken)
    assert isinstance(reg.failures["broken"], ValueError) and "densest" in str(reg.failures["broken"])
    assert reg.pm.get_plugin("broken") is None  # nothing half-registered: the same name registers again
    reg.register_plugin(Claims(spec()), name="broken")
    assert reg.get("FooForCausalLM").plugin == "broken"


def test_two_entry_points_claiming_one_architecture_make_it_ambiguous():
    reg = Registry(builtins=False, entry_points=False)
    reg._load("first", lambda: Claims(spec(), spec("OtherForCausalLM")))
    reg._load("second", lambda: Claims(spec()))
    assert reg.get("OtherForCausalLM").plugin == "first"  # the rest of the first plugin still serves
    with pytest.raises(UnsupportedArchitecture, match="claimed by two plugins: 'first' and 'second'"):
        reg.resolve({"architectures": ["FooForCausalLM"]})


def test_misspelt_hook_fails_at_registration():
    class Typo:
        @hookimpl
        def register_architecture(self, register):  # missing "s"
            pass

    reg = Registry(builtins=False, entry_points=False)
    with pytest.raises(RegistryError, match="register_architecture"):
        reg.register_plugin(Typo(), name="typo")


def test_bad_spec_fields_are_named():
    with pytest.raises(ValueError, match="family 'densest'"):
        ArchSpec(("X",), "m:C", "densest")
    with pytest.raises(ValueError, match="'module:Class'"):
        ArchSpec(("X",), "plugins.llama.LlamaForCausalLM", "dense")
    reg = Registry(builtins=False, entry_points=False)
    with pytest.raises(RegistryError, match="not an ArchSpec"):
        reg.register_plugin(Claims({"architectures": "X"}), name="dicty")


def test_resolve_falls_back_to_model_type():
    reg = Registry(entry_points=False)
    assert reg.resolve({"model_type": "llama"}).architectures == ("LlamaForCausalLM",)
    assert reg.resolve({"architectures": ["Nope", "LlamaForCausalLM"]}).architectures == ("LlamaForCausalLM",)


def _zoo(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "zoo.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_zoo_list_finds_a_third_party_plugin_through_its_entry_point():
    out = _zoo("list")
    assert out.returncode == 0, out.stderr
    row = next(l for l in out.stdout.splitlines() if l.startswith("ExampleLlamaForCausalLM"))
    assert row.split()[1:] == ["dense", "example", "zoo_example_plugin:ExampleLlamaForCausalLM", "ok"]
    assert re.search(r"^LlamaForCausalLM\s+dense\s+plugins\.llama\s", out.stdout, re.M)


def test_zoo_plugins_allowlist_restricts_entry_points():
    out = _zoo("list", env_extra={"ZOO_PLUGINS": "someone_else"})
    assert out.returncode == 0, out.stderr
    assert "ExampleLlamaForCausalLM" not in out.stdout
    assert "LlamaForCausalLM" in out.stdout  # built-ins are not entry points and always load


def test_every_hook_is_documented_in_the_readme_with_its_signature():
    readme = (ROOT / "README.md").read_text()
    hooks = [(n, f) for n, f in vars(hookspecs).items() if callable(f) and hasattr(f, "zoo_spec")]
    assert hooks
    for name, fn in hooks:
        sig = f"{name}{inspect.signature(fn)}".replace("'", "")
        assert sig in readme, f"README.md lacks the hook signature `{sig}`"
        assert fn.__doc__, f"hook {name} has no docstring"
