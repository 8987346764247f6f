"""The benchmark harness keeps working: ``bench/bench.py --smoke`` in-process on CPU.

Every spec of bench/specs.py runs at tiny sizes (fp32 and bf16): its eager formula
and our op agree (output and gradients), the CSV and the summary are written, the
table is printed. No timing claims.
"""
import csv
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def bench_script(filename: str, name: str):
    """bench/<filename> loaded as module ``name`` (``bench`` alone could resolve to the bench/
    directory as a namespace package); the scripts put bench/ on sys.path for specs/timing."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_modules():
    """bench/bench.py loaded under its own name (``bench_script``)."""
    module = bench_script("bench.py", "lycoris_bench_main")
    yield module, module.S


def test_bench_smoke(tmp_path, capsys, bench_modules):
    bench_main, specs = bench_modules
    rc = bench_main.main(["--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "smoke: OK" in out
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "bench-*.csv"))[0])))
    ran = {(r["spec"], r["dtype"]) for r in rows if r["kind"] == "time" and r["column"] == "op-torch"}
    assert ran == {(s.name, d) for s in specs.SPECS for d in ("fp32", "bf16")}
    assert all(not r["error"] for r in rows if r["kind"] == "time")
    assert (tmp_path / "summary.md").exists() and (tmp_path / "RESULTS.md").exists()
    # the table is the last thing printed (before the file notes)
    assert out.rfind("targets") < out.rfind("smoke: OK")


def test_specs_geometry(bench_modules):
    _, specs = bench_modules
    assert specs.kron_near_square(3072) == (48, 64) and specs.kron_near_square(4096) == (64, 64)
    assert specs.kron_big_side(3072) == (12, 256) and specs.kron_big_side(4096) == (16, 256)
    for D in (3072, 4096, 64):
        m, nb, s = specs.boft_geometry(D)
        assert nb * s == D and s % 2 == 0 and 2 ** (m - 1) == nb
    assert specs.boft_geometry(3072)[2] == 24 and specs.boft_geometry(4096)[2] == 32
    names = [s.name for s in specs.SPECS]
    assert len(names) == len(set(names)) == 15


@pytest.mark.parametrize("script", sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.py"))))
def test_bench_scripts_compile(script):
    """Every bench script (several only run on a GPU: gpu_tuning, sweep_lora, mm_host, ...)
    at least byte-compiles here, so a CPU-only CI still catches a broken one."""
    path = os.path.join(BENCH, script)
    with open(path, encoding="utf-8") as f:
        compile(f.read(), path, "exec")


@pytest.mark.parametrize("script", sorted(os.path.basename(p) for p in glob.glob(os.path.join(BENCH, "*.sh"))))
def test_bench_shell_scripts_parse(script):
    """The GPU call's shell scripts (gpu_check.sh, gpu_tilelang.sh, pack_tilelang.sh, ...) parse
    (``bash -n``): a syntax error would only show on the device, after its start."""
    proc = subprocess.run(["bash", "-n", os.path.join(BENCH, script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("family,args,pattern", [
    ("lokr", ["--a", "16", "--c", "16"], r"tokens 1 warps 4 stages 1: _bypass_bwd_kernel (\d+) registers, "
                                          r"spill stores (\d+) B"),
    ("lokr-fwd", ["--tokens", "64", "--a", "4", "--c", "160"], r"default \(.*\): _bypass_fwd_kernel (\d+) registers, "
                                                                r"spill stores (\d+) B"),
    ("oft", ["--tokens", "256", "--width", "64"], r"fwd neumann stages 3: _oft_fwd_kernel (\d+) registers, "
                                                   r"spill stores (\d+) B"),
    ("boft", ["--tokens", "256", "--width", "192", "--block", "48"], r"fwd split16: _boft_seg_fwd (\d+) registers, "
                                                                     r"spill stores (\d+) B"),
], ids=["lokr", "lokr-fwd", "oft", "boft"])
def test_ptxas_smoke(family, args, pattern):
    """``bench/ptxas.py <family> --smoke`` (the interpreter off, as the script needs): one
    config of the family built for sm_90 and its ptxas register report read back."""
    from lycoris_ops.backends.triton.common import ptxas_path

    if ptxas_path(90) is None:
        pytest.skip("triton's ptxas is unavailable")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "ptxas.py"), family, "--smoke", *args],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    m = re.search(pattern, proc.stdout)
    assert m and 0 < int(m[1]) <= 255 and int(m[2]) == 0, proc.stdout


@pytest.mark.parametrize("family", ["loha", *(pytest.param(f, marks=pytest.mark.slow)  # 5 to 80 s each
                                              for f in ("tucker", "boft", "oft", "lokr", "lokr_merge"))])
def test_variants_smoke(family, capsys):
    """``bench/experiments/variants.py <family> --smoke``: every launch variant of the A/B script still runs
    (CPU, Triton's interpreter, tiny sizes); the numerics column shows which variants round
    differently from base (BOFT: tf32x3 against the base's bf16x3 does; a forward's position
    split and the Cayley launch's warps do not)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        module = bench_script("experiments/variants.py", "lycoris_bench_variants")
        assert module.main([family, "--smoke"]) == 0
        out = capsys.readouterr().out
    else:  # a GPU machine: this process's Triton compiles, so the interpreter needs a process of its own
        proc = subprocess.run([sys.executable, os.path.join(BENCH, "experiments", "variants.py"), family, "--smoke"],
                              env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        out = proc.stdout
    assert "failed" not in out, out
    rows = [re.match(r"\s+(\w+) (.+?)\s+[\d.]+ ms .* rel diff (\S+)$", line)
            for line in out.splitlines() if "of base" in line]
    assert len(rows) >= 6 and all(rows), out
    if family == "boft":
        diff = {(r[1], r[2]): float(r[3]) for r in rows}
        assert diff[("fwd", "tf32x3")] > 0 and diff[("fwd", "split 4")] == 0 == diff[("fwd", "cayley 1 warps")]


def _agreeing_rows(capsys, module, argv, prefixes, count, tol=1e-6):
    """``module.main(["--smoke", *argv])`` exits 0 and prints ``count`` table rows starting
    with ``prefixes``, none failed, each within ``tol`` of the first row's results."""
    assert module.main(["--smoke", *argv]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(prefixes)]  # not TileLang's log lines
    assert "failed" not in out and len(rows) == count, out
    assert all(float(row.split()[-1]) < tol for row in rows), out


@pytest.mark.slow
def test_tilelang_stream_variants_smoke(capsys):
    """``bench/experiments/tilelang_stream_variants.py --smoke``: every split of the IA3 backward and every
    DoRA row tile run and agree with the first (TileLang's CPU twins, fp32, tiny sizes; the
    variants differ there)."""
    pytest.importorskip("tilelang")
    module = bench_script("experiments/tilelang_stream_variants.py", "lycoris_bench_tl_stream")
    _agreeing_rows(capsys, module, [], ("large ", "small "), 2 * len(module.VARIANTS), tol=1e-5)
    _agreeing_rows(capsys, module, ["--op", "dora"], ("large ", "small "), 2 * len(module.DORA_VARIANTS), tol=1e-5)


def test_kernel_profile_smoke(capsys):
    """``bench/kernel_profile.py --smoke``: every spec's forward (and backward op, where it has
    one) is profiled and listed, each phase with its op rows (CPU tensors, tiny shape)."""
    module = bench_script("kernel_profile.py", "lycoris_bench_kernel_profile")
    names = [s.name for s in module.specs.SPECS]
    assert module.main(["--smoke", "--specs", ",".join(names), "--top", "3"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.split(" ", 1)[0] in names and " torch " in line]
    want = sum(1 + (s.bwd is not None) for s in module.specs.SPECS)
    assert len(heads) == want, out
    assert all(" in " in h and (" ops," in h) for h in heads), heads


@pytest.mark.slow
@pytest.mark.nvcc
def test_tilelang_build_profile_smoke(tmp_path):
    """``bench/tilelang_build_profile.py add 0``: one real sm_90a build (nvcc), its seconds split
    into nvcc, TileLang's passes and macro parsing; the parts stay within the total."""
    pytest.importorskip("tilelang")
    out = subprocess.run([sys.executable, os.path.join(BENCH, "tilelang_build_profile.py"), "add", "0",
                          "--cache", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    total = float(re.search(r"for sm_90a: ([\d.]+) s", out.stdout).group(1))
    nvcc = float(re.search(r"subprocess nvcc\s+([\d.]+) s", out.stdout).group(1))
    passes = float(re.search(r"passes \(top level\)\s+([\d.]+) s", out.stdout).group(1))
    assert 0 < nvcc < total and 0 < passes < total and nvcc + passes <= total, out.stdout
    assert "tl.LowerTileOp" in out.stdout, out.stdout


@pytest.mark.slow
def test_tilelang_compile_sweep_lists_shortlists():
    """``bench/tilelang_compile_sweep.py --list``: the kernels of LoKr's bypass cases with the
    fixed configs, then with the tuner's shortlists too (a superset, with more kernels: the
    configs a tuned first call builds). A subprocess: the sweep points the launchers at an
    sm_90a GPU for the whole process."""
    pytest.importorskip("tilelang")
    def listed(*extra):
        r = subprocess.run([sys.executable, os.path.join(BENCH, "tilelang_compile_sweep.py"), "--list",
                            "--ops", "lokr_bypass_fwd", "--dtypes", "bf16", *extra],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return {line for line in r.stdout.splitlines() if "_kernel(" in line}
    fixed, tuned = listed(), listed("--shortlists")
    assert fixed and fixed < tuned, (len(fixed), len(tuned))


@pytest.mark.slow
def test_lokr_stepdown_forms_smoke(capsys):
    """``bench/experiments/lokr_stepdown_forms.py`` on the CPU (256 tokens): each form, eager and
    compiled, within bf16 rounding of the fp32 reference."""
    module = bench_script("experiments/lokr_stepdown_forms.py", "lycoris_bench_lokr_forms")
    assert module.main(["--device", "cpu", "--shapes", "f-1-3072"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("f-1-3072")]
    assert [(r[1], r[2]) for r in rows] == [(f, m) for f in ("matmul", "einsum", "formula") for m in ("eager", "compile")]
    assert all(float(e) < 2e-2 for r in rows if r[1] != "formula" for e in r[-2:]), rows

