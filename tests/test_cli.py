"""The ``realloc`` command line (``realloc_tools.cli``, on top of the pure ``realloc_tools.offline.plan``), in-process
through ``main`` and as a real subprocess; and that ``realloc/`` never imports the Ray layer."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import realloc.shards.local_executor
import realloc_tools.offline.plan
from realloc.layout import Topology
from realloc.plan import Placement, plan_reallocation
from realloc.spec import ModelSpec
from realloc_tools.cli import main

LLAMA_7B = ["plan", "--model", "llama-7b", "--src", "dp=2,tp=4,pp=2", "--dst", "dp=8,tp=2,pp=1", "--gpus-per-node", "8"]
REQUIRED_KEYS = {
    "plan_seconds",
    "bytes_total",
    "bytes_intra_node",
    "bytes_inter_node",
    "lower_bound_inter_node_bytes",
    "max_node_egress_bytes",
    "max_node_ingress_bytes",
    "num_steps",
    "estimated_seconds",
    "model",
    "src",
    "dst",
    "world_size",
    "num_nodes",
}
TABLES = {"node_egress_bytes", "node_ingress_bytes", "rank_send_bytes", "rank_recv_bytes"}
ROOT = Path(__file__).resolve().parent.parent
#: Top-level packages that ``realloc/`` (the pure layer) must never import, not even lazily.
RAY_LAYER = ("actors", "realloc_tools", "ray")
#: The layers of ``realloc/`` below the executors (docs/architecture.md): no tensors, so no torch.
TORCH_FREE = ("realloc.spec", "realloc.layout", "realloc.plan", "realloc.sim")


def run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    status = main(argv + ["--json"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1, "--json prints exactly one line"
    return status, json.loads(out)


def test_plan_summary(capsys):
    assert main(LLAMA_7B) == 0
    out = capsys.readouterr().out
    for label in (
        "model",
        "source",
        "destination",
        "ranks",
        "bytes moved",
        "inter-node lower bound",
        "max node egress",
        "max node ingress",
        "steps",
        "estimated time",
        "plan time",
    ):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert "llama-7b" in out and "dp=2,tp=4,pp=2" in out and "dp=8,tp=2,pp=1" in out
    assert "16 on 2 nodes (8 per node)" in out


def test_plan_json_keys_and_consistency(capsys):
    status, report = run_json(capsys, LLAMA_7B)
    assert status == 0
    assert REQUIRED_KEYS <= set(report)
    assert not TABLES & set(report), "per-rank/per-node tables only with --full-stats"
    assert (report["model"], report["src"], report["dst"]) == ("llama-7b", "dp=2,tp=4,pp=2", "dp=8,tp=2,pp=1")
    assert (report["world_size"], report["num_nodes"]) == (16, 2)
    assert report["bytes_inter_node"] == report["lower_bound_inter_node_bytes"] > 0
    assert report["bytes_total"] == report["bytes_intra_node"] + report["bytes_inter_node"]
    assert report["num_steps"] > 0 and report["estimated_seconds"] > 0 and report["plan_seconds"] > 0
    # The same numbers as planning directly.
    spec = ModelSpec.preset("llama-7b")
    plan = plan_reallocation(spec, Topology(dp=2, tp=4, pp=2), Topology(dp=8, tp=2), Placement.blocks(16, 8))
    for key in ("bytes_total", "bytes_inter_node", "max_node_egress_bytes", "num_steps", "estimated_seconds"):
        assert report[key] == plan.stats[key], key


def test_full_stats_tables_add_up(capsys):
    _, report = run_json(capsys, LLAMA_7B + ["--full-stats"])
    assert TABLES <= set(report)
    assert sum(report["node_egress_bytes"].values()) == report["bytes_inter_node"]
    assert max(report["node_ingress_bytes"].values()) == report["max_node_ingress_bytes"]
    assert sum(report["rank_send_bytes"].values()) == report["bytes_total"]


def test_bandwidth_and_bucket_options(capsys):
    _, base = run_json(capsys, LLAMA_7B)
    _, slow = run_json(capsys, LLAMA_7B + ["--inter-gbps", "4.5", "--intra-gbps", "30"])
    assert slow["bandwidths"]["inter_node"] == 4.5e9 and slow["bandwidths"]["intra_node"] == 30e9
    assert slow["estimated_seconds"] == pytest.approx(10 * base["estimated_seconds"], rel=0.05)
    _, small = run_json(capsys, LLAMA_7B + ["--bucket-mb", "16"])
    assert small["bucket_bytes"] == 16 << 20
    assert small["num_buckets"] > base["num_buckets"]
    assert small["bytes_total"] == base["bytes_total"]


def test_hf_config_directory_as_model(capsys, tmp_path):
    config = {
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "vocab_size": 999,
        "tie_word_embeddings": True,
    }
    (tmp_path / "my-qwen3").mkdir()
    (tmp_path / "my-qwen3" / "config.json").write_text(json.dumps(config))
    status, report = run_json(
        capsys,
        [
            "plan",
            "--model",
            str(tmp_path / "my-qwen3"),
            "--src",
            "tp=2,dp=2",
            "--dst",
            "tp=4",
            "--gpus-per-node",
            "2",
            "--verify",
        ],
    )
    assert status == 0 and report["verified"] is True
    assert report["model"] == "my-qwen3" and report["num_nodes"] == 2


@pytest.mark.parametrize(
    "src, dst, extra",
    [
        ("dp=3,tp=4", "dp=2,tp=6", []),  # 12 heads / 2 kv heads: tp 4 -> 6
        ("dp=2,tp=4,pp=2", "dp=8,tp=2,pp=1", []),
        ("tp=2,pp=4", "dp=4,tp=2", ["--gpus-per-node", "4"]),  # tied head on a separate last stage
        ("tp=12", "dp=3,tp=4", ["--gpus-per-node", "4"]),  # kv heads replicated 6 ways
        ("dp=2,tp=2", "tp=4", ["--vocab-pad-multiple", "8", "--bucket-mb", "0.01", "--gpus-per-node", "1"]),
    ],
)
def test_verify_tiny(capsys, src, dst, extra):
    status, report = run_json(capsys, ["plan", "--model", "tiny", "--src", src, "--dst", dst, "--verify", *extra])
    assert status == 0
    assert report["verified"] is True and report["mismatched_shards"] == 0
    assert report["verified_shards"] > 0
    assert report["executed_bytes_moved"] == report["bytes_total"]


@pytest.mark.parametrize(
    "src, dst, extra",
    [
        ("fsdp=8", "dp=2,tp=4", ["--gpus-per-node", "4"]),  # FSDP2 -> vLLM-style tp
        ("dp=2,fsdp=2,tp=2", "tp=4,pp=2", ["--gpus-per-node", "2"]),  # HSDP x tp -> tp x pp
        ("tp=2,pp=2", "dp=2,fsdp=2", ["--gpus-per-node", "4", "--bucket-mb", "0.01"]),  # back to HSDP
        ("fsdp=3,pp=2", "dp=3,tp=2", ["--gpus-per-node", "3"]),  # uneven chunks, 3 nodes
    ],
)
def test_verify_fsdp_and_hsdp(capsys, src, dst, extra):
    status, report = run_json(capsys, ["plan", "--model", "tiny", "--src", src, "--dst", dst, "--verify", *extra])
    assert status == 0, report
    assert report["verified"] is True and report["mismatched_shards"] == 0 and report["verified_shards"] > 0
    assert report["executed_bytes_moved"] == report["bytes_total"]
    assert report["bytes_inter_node"] == report["lower_bound_inter_node_bytes"]
    assert (report["src"], report["dst"]) == (str(Topology.parse(src)), str(Topology.parse(dst)))


@pytest.mark.parametrize("rule", ["vllm", "megatron"])
def test_verify_vocab_pad_rules(capsys, rule):
    argv = [
        "plan",
        "--model",
        "tiny",
        "--src",
        "dp=2,tp=2,pp=2",
        "--dst",
        "dp=2,tp=4",
        "--verify",
        "--vocab-pad-multiple",
        "64",
        "--vocab-pad-rule",
        rule,
    ]
    status, report = run_json(capsys, argv)
    assert status == 0 and report["verified"] is True and report["mismatched_shards"] == 0


@pytest.mark.parametrize("src", ["fsdp=4", "fsdp=4,fsdp_split=zero3", "fsdp=2,tp=2,fsdp_split=zero3"])
def test_fsdp_with_vocab_padding_verifies(capsys, src):
    """FSDP2 / ZeRO-3 of Megatron's padded vocabulary shard (docs/conventions.md)."""
    argv = ["plan", "--model", "tiny", "--src", src, "--dst", "tp=4", "--vocab-pad-multiple", "8", "--verify"]
    status, report = run_json(capsys, argv + ["--gpus-per-node", "2"])
    assert status == 0 and report["verified"] is True and report["mismatched_shards"] == 0


def test_hpz_is_refused(capsys):
    assert main(["plan", "--model", "tiny", "--src", "fsdp=4,fsdp_split=hpz", "--dst", "tp=4"]) == 2
    err = capsys.readouterr().err
    assert "hpZ" in err and "fsdp=W,fsdp_split=zero3" in err and err.count("\n") == 1


def test_verify_catches_a_broken_execution(capsys, monkeypatch):
    real = realloc.shards.local_executor.execute_in_process

    def drop_last_step(plan, src, dst):  # its routes, not the step: the plan stays valid (forward_from)
        plan.steps = [*plan.steps[:-1], []]
        return real(plan, src, dst)

    monkeypatch.setattr(realloc.shards.local_executor, "execute_in_process", drop_last_step)
    status, report = run_json(
        capsys, ["plan", "--model", "tiny", "--src", "dp=2,tp=2", "--dst", "tp=4", "--gpus-per-node", "2", "--verify"]
    )
    assert status == 1
    assert report["verified"] is False and report["mismatched_shards"] > 0 and report["mismatches"]
    assert main(["plan", "--model", "tiny", "--src", "dp=2,tp=2", "--dst", "tp=4", "--verify"]) == 1
    assert "verified" in capsys.readouterr().out


def test_verify_refuses_large_models(capsys):
    assert main(LLAMA_7B + ["--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("realloc: error: --verify") and "GiB" in err and err.count("\n") == 1


def test_presets(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "llama-7b", "llama-70b", "qwen2.5-7b", "qwen2.5-72b"):
        assert name in out
    assert "6,738,415,616" in out  # llama-7b parameters
    status, rows = run_json(capsys, ["presets"])
    by_name = {r["name"]: r for r in rows["presets"]}
    assert by_name["llama-70b"]["bytes"] == 2 * by_name["llama-70b"]["parameters"]
    assert by_name["tiny"]["kv_heads"] == 2


def test_exit_codes_of_usage(capsys):
    assert main([]) == 2
    assert main(["plan", "--model", "tiny", "--src", "tp=2"]) == 2  # --dst missing
    assert main(["plan", "--model", "tiny", "--src", "tp=2", "--dst", "dp=2", "--gpus-per-node", "x"]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in ("plan", "presets", "demo", "bench", "ckpt-demo"))


def test_pure_cli_has_only_the_pure_commands(capsys):
    # realloc_tools.offline.plan (python -m realloc_tools.offline.plan) knows plan and presets; the Ray
    # commands come from realloc_tools.cli.
    assert realloc_tools.offline.plan.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "plan" in out and "presets" in out and "demo" not in out and "bench" not in out
    assert realloc_tools.offline.plan.main(["demo"]) == 2
    assert "invalid choice: 'demo'" in capsys.readouterr().err
    assert realloc_tools.offline.plan.main(["presets", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["presets"]


def test_subprocess():
    # The console script's module, run from this checkout. -X importtime lists every module
    # imported on stderr: planning must not pull in torch, ray or the actors package.
    ok = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "realloc_tools.cli",
            "plan",
            "--model",
            "llama-70b",
            "--src",
            "dp=4,tp=8,pp=8",
            "--dst",
            "dp=32,tp=8",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["world_size"] == 256
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in ok.stderr.splitlines()}
    assert "realloc" in imported and "numpy" in imported
    assert not {"torch", "ray", "actors"} & imported, "realloc plan must not import torch, ray or actors"

    bad = subprocess.run(
        [sys.executable, "-m", "realloc_tools.cli", "plan", "--model", "tiny", "--src", "dp=2,,tp=2", "--dst", "tp=4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("realloc: error: --src: bad topology part ''") and bad.stderr.count("\n") == 1
    assert "Traceback" not in bad.stderr


def _imported_modules(tree: ast.AST):
    """(line, module) of every absolute import in ``tree``, wherever it sits (functions included),
    and of ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("import_module", "__import__")
        ):
            yield node.lineno, node.args[0].value


def test_realloc_never_imports_the_ray_layer_in_its_source():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted((ROOT / "realloc").rglob("*.py"))
        for line, module in _imported_modules(ast.parse(path.read_text(), filename=str(path)))
        if module.split(".")[0] in RAY_LAYER
    ]
    assert not offenders, "realloc/ is the pure layer; it must not import actors, tools or ray:\n" + "\n".join(
        offenders
    )


def test_realloc_never_imports_the_ray_layer_when_run():
    # Every realloc module, plus the pure CLI's top-level help (the old code loaded the Ray
    # commands there): nothing of actors/, realloc_tools/ or ray may end up in sys.modules.
    code = f"""
import contextlib, importlib, io, pkgutil, sys
import realloc
assert realloc.__file__.startswith({str(ROOT)!r}), realloc.__file__
def loaded(when, allowed=()):
    bad = sorted(m for m in sys.modules if m.split(".")[0] in {RAY_LAYER!r} and m not in allowed)
    assert not bad, f"{{when}} loaded {{len(bad)}} modules of the Ray layer: {{bad[:5]}}"
for info in pkgutil.walk_packages(realloc.__path__, "realloc."):
    importlib.import_module(info.name)
loaded("importing every realloc module")
import realloc_tools.offline.plan
with contextlib.redirect_stdout(io.StringIO()) as out:
    assert realloc_tools.offline.plan.main(["--help"]) == 0
assert "plan" in out.getvalue()
loaded(
    "realloc_tools.offline.plan.main(['--help'])",
    (
        "realloc_tools",
        "realloc_tools.offline",
        "realloc_tools.offline.plan",
        "realloc_tools.offline.simulate",
        "realloc_tools.offline.units",
    ),
)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_offline_tools_import_neither_torch_nor_ray():
    # Every module of realloc_tools/offline/ (plan, presets, simulate, plan pictures), in a fresh
    # interpreter: no torch, no ray, no actors, and of realloc_tools only the offline folder.
    code = """
import importlib, pkgutil, sys
import realloc_tools.offline
assert realloc_tools.offline.__file__.startswith(%r), realloc_tools.offline.__file__
names = [info.name for info in pkgutil.walk_packages(realloc_tools.offline.__path__, "realloc_tools.offline.")]
assert {"realloc_tools.offline.plan", "realloc_tools.offline.simulate", "realloc_tools.offline.svg"} <= set(names), names
for name in names:
    importlib.import_module(name)
bad = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("torch", "ray", "actors")
    or (m.startswith("realloc_tools.") and not m.startswith("realloc_tools.offline"))
)
assert not bad, f"importing realloc_tools.offline loaded {len(bad)} modules of torch or the Ray layer: {bad[:5]}"
""" % str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_specs_layouts_and_the_planner_import_no_torch():
    # Every module of realloc.spec, realloc.layout and realloc.plan, and the package's own face,
    # in a fresh interpreter: torch (and the Ray layer) must stay out of sys.modules.
    code = f"""
import importlib, pkgutil, sys
import realloc
for name in {TORCH_FREE!r}:
    package = importlib.import_module(name)
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        importlib.import_module(info.name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch",) + {RAY_LAYER!r})
assert not bad, f"importing {TORCH_FREE} loaded {{len(bad)}} modules of torch or the Ray layer: {{bad[:5]}}"
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_plan_between_weight_formats(capsys):
    """``--weight-format``: the plan moves FP8 when the source ranks hold whole blocks (half the
    linear layers' bytes), the source's format otherwise; a layout that splits blocks is refused."""
    args = [
        "plan",
        "--model",
        "bench-1gb",
        "--src",
        "dp=2,tp=2,pp=2",
        "--dst",
        "dp=4,tp=2",
        "--json",
        "--gpus-per-node",
        "4",
    ]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--weight-format", "fp8_block128"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["conversion"]["where"] == "source" and "conversion" not in plain
    assert fp8["bytes_inter_node"] < 0.7 * plain["bytes_inter_node"]
    assert (
        main(
            [
                "plan",
                "--model",
                "bench-1gb",
                "--src",
                "fsdp=8",
                "--dst",
                "dp=4,tp=2",
                "--json",
                "--weight-format",
                "fp8_block128",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["conversion"]["where"] == "destination"
    assert (
        main(["plan", "--model", "llama-7b", "--src", "tp=4", "--dst", "dp=4", "--src-weight-format", "fp8_block128"])
        == 2
    )
    assert "not whole 128-blocks" in capsys.readouterr().err
    assert main([*args, "--weight-format", "fp8_block128", "--verify"]) == 2  # 8 ranks of 1 GB: too large
    assert "--verify would hold" in capsys.readouterr().err


@pytest.mark.parametrize(
    "src, dst, formats, where",
    [
        ("pp=2", "dp=2", ["--src-weight-format", "fp8_block128", "--dst-weight-format", "fp8_block128"], None),
        ("dp=2", "pp=2", ["--weight-format", "fp8_block128"], "source"),  # bf16 -> FP8 on the senders
        ("tp=2", "dp=2", ["--weight-format", "fp8_block128"], "destination"),  # tp=2 splits tiny's blocks
        ("pp=2", "tp=2", ["--src-weight-format", "fp8_block128"], "source"),  # FP8 dequantized
        (
            "pp=2",
            "dp=2",
            ["--src-weight-format", "fp8_block128", "--weight-format", "fp8_block128+float32"],
            "destination",
        ),
        ("tp=2", "dp=2", ["--weight-format", "bfloat16"], "source"),
    ],
)
def test_verify_plans_between_weight_formats(capsys, src, dst, formats, where):
    """--verify of an FP8 plan: the expected destination is the seeded full weights quantized
    with the project's quantizer (realloc/shards/convert.py), every shard compared bit for bit.
    (It refused every weight format before.)"""
    argv = ["plan", "--model", "tiny", "--src", src, "--dst", dst, "--gpus-per-node", "1", "--verify", *formats]
    status, report = run_json(capsys, argv)
    assert status == 0, report
    assert report["verified"] is True and report["mismatched_shards"] == 0 and report["verified_shards"] > 0
    assert report["executed_bytes_moved"] == report["bytes_total"]
    assert (report.get("conversion") or {}).get("where") == where


def test_verify_of_an_fp8_plan_catches_a_wrong_conversion(capsys, monkeypatch):
    """A sender that quantizes wrongly (here: values cast to FP8 without dividing by their block
    scale) is caught: the check does not take the conversion's own output as the truth."""
    import torch

    from realloc.shards.convert import Converted

    real = Converted.write

    def unscaled(self, param, offsets, sizes, out):  # the senders' conversion, message by message
        if out.dtype != torch.float8_e4m3fn:
            return real(self, param, offsets, sizes, out)
        out.copy_(self.store.view(param, offsets, sizes).to(torch.float8_e4m3fn))

    monkeypatch.setattr(Converted, "write", unscaled)
    argv = ["plan", "--model", "tiny", "--src", "dp=2", "--dst", "pp=2", "--weight-format", "fp8_block128"]
    status, report = run_json(capsys, [*argv, "--gpus-per-node", "1", "--verify"])
    assert report.get("conversion", {}).get("where") == "source"
    assert status == 1 and report["verified"] is False and report["mismatched_shards"] > 0


def test_ckpt_demo_plan_only_runs_with_its_defaults(capsys):
    """``realloc ckpt-demo --plan-only`` as the README's table offers it: the demo's own placement
    (8 workers on 2 of its 3 nodes), not one node of 8 that no clique of factor 2 fits."""
    assert main(["ckpt-demo", "--plan-only"]) == 0
    out = capsys.readouterr().out
    assert "8 workers on 2 nodes" in out and "jump=4 factor=2" in out
    assert main(["ckpt-demo", "--plan-only", "--json", "--gpus-per-node", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == 4


def test_plan_reads_a_kimi_k2_config_as_deepseek_v3(capsys, tmp_path):
    """Kimi-K2's config.json (model_type kimi_k2, architectures DeepseekV3ForCausalLM): `realloc
    plan` reads it as DeepSeek-V3, as `realloc simulate` did (the rule lived in the simulate
    command only and `realloc plan` refused the model); another architecture is refused."""
    kimi = ROOT / "tests" / "data" / "configs" / "Kimi-K2-Instruct.json"
    status, report = run_json(capsys, ["plan", "--model", str(kimi), "--src", "pp=2", "--dst", "ep=2"])
    assert status == 0 and report["model"] == "Kimi-K2-Instruct"
    assert report["model_parameters"] == 1_026_408_209_408
    config = json.loads(kimi.read_text())
    (tmp_path / "other.json").write_text(json.dumps(dict(config, architectures=["KimiLinearForCausalLM"])))
    assert main(["plan", "--model", str(tmp_path / "other.json"), "--src", "tp=1", "--dst", "dp=1"]) == 2
    err = capsys.readouterr().err
    assert "kimi_k2" in err and "DeepseekV3ForCausalLM" in err and err.count("\n") == 1


def test_plan_cuts_worker_slices_only_when_asked(capsys):
    """Issue 39: ``realloc plan`` cut and pickled every worker's slice for its report on every run
    (2.5-3 s of a 2,048-rank command); now only with ``--slices``, which reports what shipping them costs."""
    argv = ["plan", "--model", "tiny", "--src", "dp=2,tp=2", "--dst", "tp=4", "--gpus-per-node", "2"]
    status, report = run_json(capsys, argv)
    assert status == 0 and "slices" not in report
    status, report = run_json(capsys, [*argv, "--slices"])
    sl = report["slices"]
    assert status == 0 and sl["max_bytes"] >= sl["mean_bytes"] > 0 and sl["max_routes"] > 0
    assert sl["plan_pickle_bytes"] > 0 and sl["slice_seconds"] >= 0 and sl["prepare_seconds"] >= 0
    assert main([*argv, "--slices"]) == 0
    assert "per-worker slices       largest" in capsys.readouterr().out


def test_a_plan_that_balances_senders_with_an_assignment_does_not_import_scipy_optimize():
    """Issue 39: the one ``linear_sum_assignment`` of a plan's sender balance imported
    ``scipy.optimize`` (0.4-0.8 s of a 2,048-rank DeepSeek-V3 command); its C module is loaded
    alone, and gives scipy's answer. Two holder nodes, two needing nodes, rows of unequal bytes."""
    code = """
import sys
import numpy as np
import realloc.plan.routing as routing
from realloc.layout import Group
from realloc.plan import Placement, plan_exchange
calls = []
solve = routing._linear_sum_assignment
routing._linear_sum_assignment = lambda: calls.append(1) or solve()
params = {"a": ((100,), "float32"), "b": ((50,), "float32")}
box = lambda n: ((n, (0,), params[n][0]),)
hold = [Group((0, 1), box("a") + box("b"))]
plan = plan_exchange(hold, [Group((2,), box("a")), Group((3,), box("b"))], Placement(("n0", "n1", "n2", "n3")), params)
assert calls and plan.stats["bytes_inter_node"] == 600, (calls, plan.stats)
assert "scipy.optimize" not in sys.modules, "the sender balance imported scipy.optimize"
cost = np.random.default_rng(0).random((7, 12))
from scipy.optimize import linear_sum_assignment
assert all((a == b).all() for a, b in zip(solve()(cost), linear_sum_assignment(cost)))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
