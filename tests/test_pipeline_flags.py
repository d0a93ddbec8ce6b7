"""Pipeline parallelism behind the flags: `zoo parity --pipeline-parallel-size N` (the served scenario through the
pipelined engine against transformers: passes on a dense, a MoE and a hybrid model, and fails when a bug lives only
in stage 1's process) and `zoo serve --pipeline-parallel-size N` / `--tensor-parallel-size N` (the same greedy text
as one process). torchrun's launches are in tests/test_tp_multinode.py.

Each pipeline spawns one interpreter per stage past the first (~8 s of this 2-core machine), so the cases are few.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from test_cli_run import save_chat_model, words
from tiny import save_tiny
from tiny_configs import save_arch
from parity.harness import run_parity
from parity.taps import SAMPLED
from zoo import LLM, SamplingParams
from zoo.cli import main


@pytest.fixture(scope="module")
def llama5(tmp_path_factory):  # 5 layers: 3 + 2 over two stages (layer 1 on stage 0)
    return save_tiny("LlamaForCausalLM", tmp_path_factory.mktemp("llama5"), randomize=True, initializer_range=0.2,
                     num_hidden_layers=5)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):  # 2 layers, one a stage; a word-level tokenizer (zoo serve and zoo run need one)
    return save_chat_model(tmp_path_factory.mktemp("chat"), max_position_embeddings=256, initializer_range=0.2)


def test_zoo_parity_pipeline_parallel(llama5, tmp_path, capsys, monkeypatch):
    """`zoo parity --pipeline-parallel-size 2`: the served scenario by default, said in the summary and the JSON
    report; the logits of every sampled row and the greedy tokens equal transformers'. The prompts' 70 tokens make
    the prefill step two micro-batches, prompt 0 cut between them (its rows joined back to one step's)."""
    from zoo.runtime import pipeline

    cuts = []
    split = pipeline.micro_batches
    monkeypatch.setattr(pipeline, "micro_batches", lambda *a: cuts.append(split(*a)) or cuts[-1])  # (recorded)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[(7 * i) % 100 + 5 for i in range(40)], [(11 * i) % 90 + 7 for i in range(30)]]))
    report = tmp_path / "r.json"
    assert main(["parity", str(llama5), "--pipeline-parallel-size", "2", "--prompts", str(prompts), "--json",
                 str(report), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "pipeline parallel size 2 (gloo): compared the served scenario" in out and out.rstrip().endswith("PASS")
    data = json.loads(report.read_text())
    assert list(data["scenarios"]) == ["served"] and data["meta"]["pipeline_parallel"]["size"] == 2
    served = data["scenarios"]["served"]
    assert served["passed"] and served["info"]["fused_steps"] == 0 and served["info"]["steps"] == 4
    assert all(len(tokens) == 4 for tokens in served["info"]["generated"].values())
    assert [[(s.request.request_id, s.num_new_tokens) for s in mb] for mb in cuts[0]] == [[("0", 35)],
                                                                                          [("0", 5), ("1", 30)]]


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "JambaForCausalLM"])
def test_parity_pipeline_parallel_moe_and_hybrid(arch, tmp_path):
    """A MoE (experts on both stages) and a hybrid (Mamba1 states, attention and MoE layers split over the stages):
    the served scenario over two stages passes against transformers, and generates what one process does; the built
    constants are every stage's (the whole model's, read on the meta device), as one process checks them."""
    path = str(save_arch(arch, tmp_path / arch))
    result = run_parity(path, pipeline_parallel_size=2)
    served = result.scenarios["served"]
    assert list(result.scenarios) == ["served"] and result.passed, (served.failures, served.first_divergence)
    assert served.comparison.logit_taps[SAMPLED].summary(served.tol)["top1"] == 1.0
    assert result.meta["pipeline_parallel"]["size"] == 2
    one = run_parity(path, scenarios=("served",))
    assert served.info["generated"] == one.scenarios["served"].info["generated"]
    assert result.constants == one.constants and len(one.constants["checked"]) > 10


def test_parity_pipeline_times_tensor_parallel(llama5, capsys):
    """`zoo parity --pipeline-parallel-size 2 --tensor-parallel-size 2`: two stages of two ranks (4 processes), the
    served scenario passes against transformers."""
    argv = ["parity", str(llama5), "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pipeline parallel size 2 x tensor parallel size 2 (gloo): compared the served scenario" in out
    assert out.rstrip().endswith("PASS")


MUTANT = """
# A planted bug (tests/mutants.py: gate and up swapped in decoder layer 1's MLP), installed as an entry-point plugin
# on this directory: the processes that load their plugins with it on sys.path serve the mutant.
from mutants import MutantPlugin

register_architectures = MutantPlugin("gate_up_swapped").register_architectures
"""


def test_parity_pipeline_parallel_finds_a_bug_on_the_last_stage(chat, tmp_path, monkeypatch):
    """The bug only in stage 1's process: a plugin installed on sys.path after this process built its registry, so
    stage 0 (here) builds the real Llama and the spawned stage 1 (its sys.path this one's) the mutant, whose layer 1
    is stage 1's. Parity over the pipeline sees what the last stage computed: the served scenario, which passes
    without the plugin, diverges."""
    from registry import get_registry

    assert get_registry().get("LlamaForCausalLM").plugin.startswith("plugins.")  # built before the plugin is there
    site = tmp_path / "site"
    info = site / "zoo_pp_mutant-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zoo-pp-mutant\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[zoo]\npp_mutant = zoo_pp_mutant\n")
    (site / "zoo_pp_mutant.py").write_text(textwrap.dedent(MUTANT))
    assert run_parity(str(chat), pipeline_parallel_size=2).passed  # the control: no plugin, every stage right
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("ZOO_PLUGINS", raising=False)
    assert str(Path(__file__).parent) in sys.path  # (`mutants` imports in the stage: its sys.path is this one's)
    result = run_parity(str(chat), pipeline_parallel_size=2)
    served = result.scenarios["served"]
    assert not result.passed and not served.passed
    assert served.first_divergence["tap"] == SAMPLED, served.first_divergence
    assert any(f.startswith("sampled_logits: KL max") for f in served.failures), served.failures


def test_parity_pipeline_parallel_refusals(chat, tmp_path, capsys):
    """What cannot run over a pipeline is one line naming the flags, exit 2, before anything spawns."""
    base = ["parity", str(chat), "--pipeline-parallel-size", "2", "--quiet"]
    cases = [
        (base + ["--scenario", "served", "--scenario", "prefill"],
         "--scenario prefill with --pipeline-parallel-size 2: these scenarios tap every module"),
        (base + ["--image", str(tmp_path / "x.png")], "--image with --pipeline-parallel-size 2: image parity"),
        (["parity", str(chat), "--pipeline-parallel-size", "0"], "--pipeline-parallel-size 0: expected 1 or more"),
        (["parity", str(chat), "--pipeline-parallel-size", "3", "--quiet"],
         "pipeline parallel size 3: the model has 2 decoder layers, fewer than the stages"),
    ]
    for argv, said in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size", "--tensor-parallel-size"])
def test_zoo_serve_over_two_processes_gives_one_process_text(chat, flag):
    """`zoo serve FLAG 2`: completions (one, then four at once: batched steps) and a streamed chat give the greedy
    text LLM.generate gives in one process."""
    import concurrent.futures

    openai = pytest.importorskip("openai")
    from test_serve import KEY, NAME, serving

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [words(6), words(3, 40), words(9, 7), words(2, 90)]
    messages = [{"role": "user", "content": words(4, 10)}]
    one = LLM(str(chat))
    try:
        want = [o.text for o in one.generate(prompts, greedy)]
        chat_want = one.generate([one.apply_chat_template(messages)], greedy)[0].text
    finally:
        one.close()
    assert len(set(want)) == len(want) and all(t.strip() for t in want)
    kw = dict(model=NAME, temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    with serving(chat, flag, "2") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert client.completions.create(prompt=prompts[0], **kw).choices[0].text == want[0]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
        assert got == want
        chunks = client.chat.completions.create(messages=messages, stream=True, **kw)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_want


def test_zoo_serve_refuses_a_parallel_size_below_one(chat, capsys):
    assert main(["serve", str(chat), "--port", "0", "--pipeline-parallel-size", "0"]) == 2
    assert "zoo serve: error: --pipeline-parallel-size 0: expected 1 or more" in capsys.readouterr().err
