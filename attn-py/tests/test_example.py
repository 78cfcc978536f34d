"""examples/python/train_gpt.py runs as its docstring says, with a spec and with --sdpa, and
refuses bad input with exit code 2."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "python" / "train_gpt.py"
SMALL = ["--steps", "4", "--log-every", "2", "--dim", "32", "--heads", "2", "--seq", "32",
         "--batch", "2"]


def run(*args):
    return subprocess.run([sys.executable, str(EXAMPLE), str(ROOT / "README.md"), *args],
                          capture_output=True, text=True, timeout=300)


def losses(stdout):
    return [float(line.split("loss")[1].split()[0]) for line in stdout.splitlines() if "loss" in line]


def test_train_gpt_with_a_spec_and_with_sdpa(tmp_path):
    ours = run("--spec", "mask = causal", "--csv", str(tmp_path / "curve.csv"), *SMALL)
    sdpa = run("--sdpa", *SMALL)
    assert ours.returncode == 0 and sdpa.returncode == 0, ours.stderr + sdpa.stderr
    assert "tokens/s" in ours.stdout
    # The same seed and weights: the same loss curve as SDPA's causal attention.
    assert len(losses(ours.stdout)) == 2
    for a, b in zip(losses(ours.stdout), losses(sdpa.stdout)):
        assert abs(a - b) < 1e-3, (ours.stdout, sdpa.stdout)
    rows = (tmp_path / "curve.csv").read_text().splitlines()
    assert rows[0] == "step,loss,tokens_per_s" and len(rows) == 3


def test_train_gpt_refuses_bad_input_with_exit_code_2():
    bad = run("--spec", "mask = causl", *SMALL)
    assert bad.returncode == 2 and "^^^^^" in bad.stderr and "spec rejected" in bad.stderr
    assert run(*SMALL, "--heads", "3").returncode == 2  # 32 dims over 3 heads
    missing = subprocess.run([sys.executable, str(EXAMPLE), "/nonexistent/text"],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "cannot read" in missing.stderr
