"""`python -m mstar_attn demo|bench`: the summary, the progress bar, refusals and exit codes."""

import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

from mstar_attn.__main__ import main  # noqa: E402


def test_cli(capsys):
    assert main(["demo", "--requests", "3", "--layers", "2", "--hidden", "128", "--backend", "reference", "--device", "cpu"]) == 0
    cap = capsys.readouterr()
    assert "matches transformers: yes" in cap.out and "tokens/s" in cap.out and "build_plan + commit" in cap.out
    assert "3/3 requests" in cap.err  # the progress bar goes to stderr
    assert "decode step" not in cap.out  # graphs off: no step-time comparison


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA messages")
def test_cli_refuses_gpu_paths_without_cuda(capsys):
    assert main(["demo", "--backend", "flashinfer"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert main(["demo", "--graphs"]) == 2
    assert "--graphs needs a GPU backend" in capsys.readouterr().err
    assert main(["demo", "--backend", "flashinfer_ragged"]) == 2
    assert "serves only prefill steps" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_bench_on_cpu_exits_2_with_a_message(capsys):
    assert main(["bench"]) == 2  # mstar_attn.tuning.bench_main: no CUDA
    assert "mstar-attn bench:" in capsys.readouterr().err


def test_bench_forwards_its_arguments_and_exit_code(monkeypatch):
    seen = []
    fake = types.ModuleType("mstar_attn.tuning")
    fake.bench_main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "mstar_attn.tuning", fake)
    assert main(["bench", "--help", "--shapes", "decode", "-x"]) == 7
    assert seen == [["--help", "--shapes", "decode", "-x"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("args", [[], ["--backend", "auto", "--requests", "4", "--no-graphs"]])
def test_cli_on_gpu(capsys, args):
    pytest.importorskip("flashinfer")
    assert main(["demo", *args]) == 0
    out = capsys.readouterr().out
    assert "matches transformers: yes" in out and "flashinfer" in out
    assert ("decode step: graphs" in out) == (not args)  # the CUDA default: FlashInfer with graphs on


def test_cli_gemma2(capsys):
    args = ["demo", "--model", "gemma2", "--window", "6", "--requests", "3", "--layers", "2", "--hidden", "128",
            "--backend", "reference", "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Gemma 2 (sliding window 6" in out and "matches transformers: yes" in out
