"""Where a model comes from, and what is checked before its weights are read: `--tokenizer` (another
directory's tokenizer), `--revision` (a hub id's branch / tag / commit, offline from the huggingface_hub cache),
and the checks that need no weight (config, architecture, tokenizer, chat template, images) failing in one line
before a checkpoint whose weights would fail the load is touched."""
import hashlib
import http.server
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from test_cli_run import save_chat_model, save_word_tokenizer, words
from test_loader_sources import make_hub_cache
from tiny import save_tiny
from zoo import LLM, SamplingParams
from zoo.cli import main

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PROMPT = ["--prompt", words(4), "--max-tokens", "5", "--ignore-eos"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("src") / "m", max_position_embeddings=64)


def weights_only(src, dst):
    """A copy of the model without its tokenizer files."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    return dst


def run(capsys, *argv):
    code = main(["run", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line]


def test_tokenizer_from_another_directory(chat_model, tmp_path, capsys):
    bare = weights_only(chat_model, tmp_path / "bare")
    tok_dir = save_word_tokenizer(tmp_path / "tok")  # a tokenizer alone: no config.json
    assert not (tok_dir / "config.json").exists()
    code, want, _ = run(capsys, chat_model, *PROMPT)
    assert code == 0
    code, got, _ = run(capsys, bare, "--tokenizer", tok_dir, *PROMPT)
    assert code == 0 and got == want  # the same tokens, and the chat template came with the tokenizer
    llm = LLM(str(bare), tokenizer=str(tok_dir))
    assert llm.generate(words(4), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].text \
        == LLM(str(chat_model)).generate(words(4), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].text
    code, _, err = run(capsys, bare, "--tokenizer", tmp_path / "nowhere", *PROMPT)
    assert code == 2 and len(errors(err)) == 1 and "--tokenizer" in err and "nowhere" in err
    code, _, err = run(capsys, bare, "--tokenizer", tmp_path / "bare", *PROMPT)  # a directory without one
    assert code == 2 and "--tokenizer" in err and "no tokenizer files" in err
    code = main(["serve", str(bare), "--port", "0", "--tokenizer", str(tmp_path / "nowhere")])
    assert code == 2 and "--tokenizer" in capsys.readouterr().err


@pytest.fixture
def hub(chat_model, tmp_path, monkeypatch):
    """A huggingface_hub cache holding org/tiny at main (commit a...) and at the tag v1 (commit b..., other
    weights); HF_HUB_OFFLINE=1 (conftest)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    main_snap = make_hub_cache(cache, "org/tiny", chat_model, "a" * 40)
    other = save_word_tokenizer(save_tiny("LlamaForCausalLM", tmp_path / "v1", seed=1, max_position_embeddings=64))
    v1 = cache / "models--org--tiny" / "snapshots" / ("b" * 40)
    shutil.copytree(other, v1)
    (cache / "models--org--tiny" / "refs" / "v1").write_text("b" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return main_snap, v1


def test_revision_resolves_through_the_hub_cache(hub, capsys):
    main_snap, v1 = hub
    assert LLM("org/tiny").files.path == main_snap
    assert LLM("org/tiny", revision="v1").files.path == v1
    assert LLM("org/tiny", revision="b" * 40).files.path == v1  # a commit
    code, at_v1, _ = run(capsys, "org/tiny", "--revision", "v1", *PROMPT)
    assert code == 0
    assert (run(capsys, v1, *PROMPT)[1], run(capsys, "org/tiny", *PROMPT)[1]) == (at_v1, run(capsys, main_snap,
                                                                                             *PROMPT)[1])
    assert at_v1 != run(capsys, main_snap, *PROMPT)[1]  # (the two revisions do differ)
    code, _, err = run(capsys, "org/tiny", "--revision", "v9", *PROMPT)
    (line,) = errors(err)
    assert code == 2 and "revision 'v9'" in line and "`hf download org/tiny --revision v9`" in line
    code, _, err = run(capsys, main_snap, "--revision", "v1", *PROMPT)
    assert code == 2 and "a revision applies to hub ids" in err


# -- checks that need no weight run before any weight is read --------------------------------------------------

def hostile_weights(model_dir):
    """Cut model.safetensors after its header: the header reads, but every tensor's data lies past the end of
    the file, so any load of it is a finding (exit 1). A check that fires first shows it ran before the load."""
    f = model_dir / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(raw[:8 + n])


def edit_config(model_dir, **changes):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def broken(chat_model, tmp_path):
    d = shutil.copytree(chat_model, tmp_path / "broken")
    hostile_weights(d)
    return d


def test_the_hostile_weights_are_found_when_loaded(broken, capsys):
    code, _, err = run(capsys, broken, *PROMPT)
    assert code == 1 and "does not load strictly" in err


@pytest.mark.parametrize("case, argv, words_in_err", [
    ("architecture", [], ["NoSuchForCausalLM"]),
    ("config", [], ["num_attention_heads=0"]),
    ("tokenizer", [], ["has no tokenizer files", "--tokenizer"]),
    ("chat", ["--chat", "--tokenizer", "TOK"], ["--chat", "no chat template"]),
    ("image", ["--image", "IMG"], ["--image", "takes no images"]),
])
def test_checks_that_need_no_weight_come_first(broken, tmp_path, capsys, case, argv, words_in_err):
    if case == "architecture":
        edit_config(broken, architectures=["NoSuchForCausalLM"])
    elif case == "config":
        edit_config(broken, num_attention_heads=0)
    elif case == "tokenizer":
        for f in TOKENIZER_FILES:
            (broken / f).unlink(missing_ok=True)
    tok = save_word_tokenizer(tmp_path / "tok")
    for f in ("chat_template.jinja",):
        (tok / f).unlink(missing_ok=True)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    argv = [str(tok) if a == "TOK" else str(broken / "config.json") if a == "IMG" else a for a in argv]
    code, out, err = run(capsys, broken, *PROMPT, *argv)
    lines = errors(err)
    assert code == 2 and len(lines) == 1 and all(w in lines[0] for w in words_in_err), err
    assert "does not load strictly" not in err and out == ""


def test_llm_refuses_an_unknown_architecture_before_the_weights(broken):
    from registry import UnsupportedArchitecture

    edit_config(broken, architectures=["NoSuchForCausalLM"])
    with pytest.raises(UnsupportedArchitecture, match="NoSuchForCausalLM"):
        LLM(str(broken))


# -- with network: huggingface_hub downloads it (a local HTTP stand-in for the hub; nothing leaves the machine) ----

class Hub:
    """A local stand-in for the hub's HTTP API (what snapshot_download asks): repo info and file downloads."""
    def __init__(self, repo, files: dict, sha="c" * 40):
        self.repo, self.files, self.sha, self.got, self.asked = repo, files, sha, [], []
        hub = self
        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a): pass
            def _file(self, head):
                hub.asked.append(self.path)
                path = self.path.split("?")[0]
                prefix = f"/{hub.repo}/resolve/"
                if path.startswith(f"/api/models/{hub.repo}/revision/"):
                    body = json.dumps({"id": hub.repo, "sha": hub.sha, "siblings": [{"rfilename": f} for f in hub.files]}).encode()
                    self.send_response(200); self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body))); self.end_headers()
                    if not head: self.wfile.write(body)
                    return
                if path.startswith(f"/api/models/{hub.repo}/tree/"):
                    body = json.dumps([{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                       for f, d in hub.files.items()]).encode()
                    self.send_response(200); self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body))); self.end_headers()
                    if not head: self.wfile.write(body)
                    return
                if path.startswith(prefix):
                    rev, _, name = path[len(prefix):].partition("/")
                    data = hub.files.get(name)
                    if data is None:
                        self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers(); return
                    if not head: hub.got.append(name)
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", hub.sha)
                    self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                    self.send_header("Content-Length", str(len(data))); self.end_headers()
                    if not head: self.wfile.write(data)
                    return
                self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
            def do_GET(self): self._file(False)
            def do_HEAD(self): self._file(True)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_hub_id_downloads_through_huggingface_hub_with_its_progress_bar(tmp_path):
    """HF_HUB_OFFLINE=0 and HF_ENDPOINT at a local stand-in for the hub: `zoo run org/tiny --revision v1` goes
    through huggingface_hub's snapshot_download (its "Fetching" progress bars on stderr) and fetches the small
    files, then only the shards the index names: not a consolidated copy, not a pickle."""
    d = save_word_tokenizer(save_tiny("LlamaForCausalLM", tmp_path / "m", max_shard_size="40KB",
                                      max_position_embeddings=64))
    files = {f.name: f.read_bytes() for f in d.iterdir()}
    assert "model.safetensors.index.json" in files
    files |= {"consolidated.safetensors": b"not fetched", "pytorch_model.bin": b"not fetched"}
    hub = Hub("org/tiny", files)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"),
           "HF_HUB_DISABLE_XET": "1", "PYTHONPATH": str(ROOT)}
    try:
        r = subprocess.run([sys.executable, "-m", "zoo.cli", "run", "org/tiny", "--revision", "v1", "--no-chat",
                            "--prompt", words(3), "--max-tokens", "3"], env=env, capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    finally:
        hub.server.shutdown()
    assert r.returncode == 0, r.stderr
    assert "Fetching" in r.stderr and "loaded org/tiny" in r.stderr
    shards = sorted(set(json.loads(files["model.safetensors.index.json"])["weight_map"].values()))
    assert len(shards) > 1 and set(shards) <= set(hub.got)
    assert "consolidated.safetensors" not in hub.got and "pytorch_model.bin" not in hub.got
    assert any("/revision/v1" in a for a in hub.asked)
