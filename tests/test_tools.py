"""The checks CI runs on the compiled kernels: tools/ci/ptx_stores.py must flag a
16-byte store split into 32-bit ones, and only that. And tools/ci/host_overhead.py
runs, with fusedops' autograd kernels and with torch's, and tools/ci/norm_offgrid.py
runs the shapes it is given."""
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "ci"))
import ptx_stores  # noqa: E402

HEAD = "//\n.version 9.0\n.target sm_90a\n.address_size 64\n"


def kernel(name, body):
    return f"\n.visible .entry {name}(\n\t.param .u64 p\n)\n{{\n{body}\n}}\n"


SPLIT = "\n".join(f"\tst.global.u32 \t[%rd7{'+' + str(o) if o else ''}], %r{o};" for o in (0, 4, 8, 12))
VECTOR = "\tst.global.v4.b32 \t[%rd7], {%r1, %r2, %r3, %r4};"
SCATTERED = "\n".join(f"\tst.global.f32 \t[%rd{7 + i}+{4 * i}], %f{i};" for i in range(4))


def test_split_store_found():
    ptx = HEAD + kernel("_Z1av", VECTOR) + kernel("_Z1bv", SPLIT + "\n" + SPLIT)
    assert ptx_stores.split_stores(ptx) == [("_Z1bv", 2)]


def test_vector_and_unrelated_stores_pass():
    assert ptx_stores.split_stores(HEAD + kernel("_Z1av", VECTOR + "\n" + SCATTERED)) == []


def test_main_fails_unless_allowed(tmp_path, capsys):
    bad = tmp_path / "bad.ptx"
    bad.write_text(HEAD + kernel("_Z1bv", SPLIT))
    assert ptx_stores.main([str(bad)]) == 1
    assert "b(): 1 16-byte stores split" in capsys.readouterr().err  # the kernel, demangled
    ok = tmp_path / "ok.ptx"
    ok.write_text(HEAD + kernel("_Z1av", VECTOR))
    assert ptx_stores.main([str(ok)]) == 0


def test_host_overhead_runs_with_either_autograd_kernel():
    """Both registrations give every op a working forward+backward (the tool
    runs each); FUSEDOPS_TORCH_AUTOGRAD=1 switches to torch's kernel."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "ci" / "host_overhead.py"
    for env, kernel in (("0", "fusedops' register_autograd"), ("1", "torch.library.register_autograd")):
        out = subprocess.run([sys.executable, str(tool), "--calls", "3", "--rounds", "1"], check=True,
                             capture_output=True, text=True,
                             env={**os.environ, "FUSEDOPS_TORCH_AUTOGRAD": env}).stdout
        assert f"autograd kernels: {kernel}" in out
        rows = [line for line in out.splitlines() if line.startswith("| ") and "no_grad" not in line]
        assert len(rows) == 11 and all(len(r.split("|")) == 8 for r in rows), out


def test_host_overhead_breakdown_names_the_ops_each_function_runs():
    """--breakdown: each function beside the ops it runs, replayed below
    autograd, no_grad and fwd+bwd; the fusedops ops a call runs named."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "ci" / "host_overhead.py"
    out = subprocess.run([sys.executable, str(tool), "--calls", "3", "--rounds", "1", "--breakdown", "--clock",
                          "thread", "--op", "layer_norm", "--op", "cross_entropy"], check=True,
                         capture_output=True, text=True).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "kind" not in line]
    assert [(r[0], r[1]) for r in rows] == [("| layer_norm", "no_grad"), ("| layer_norm", "fwd+bwd"),
                                            ("| cross_entropy", "no_grad"), ("| cross_entropy", "fwd+bwd")], out
    assert rows[0][-1] == "fusedops.add_norm_fwd |" and "fusedops.add_norm_bwd" in rows[1][-1], out
    # cross_entropy's mean is the kernel's: one op forward, no torch op after it
    assert rows[2][-1] == "fusedops.xent_fwd |" and "fusedops.xent_bwd" in rows[3][-1], out
    assert all(float(x) > 0 for r in rows for x in r[2:7]), out


def test_norm_offgrid_runs_the_shapes_given(tmp_path):
    """tools/ci/norm_offgrid.py runs the suite's norm cases at the shapes it is
    given, in place of the suite's own."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "ci" / "norm_offgrid.py"
    proc = subprocess.run([sys.executable, str(tool), "--shapes", "6x7,5x2050", "--out", str(tmp_path),
                           "--no-compile"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert {r["shape"] for r in rows} == {"6x7", "5x2050"}
    assert {r["impl"] for r in rows} == {"fusedops", "eager"}


def test_markdown_links_resolve(tmp_path, monkeypatch):
    """tools/ci/check_links.py: every relative link in the repository's markdown
    names a tracked file (and a heading, for #anchors); and it flags one that does not."""
    import check_links
    assert check_links.broken_links() == []
    (tmp_path / "a.md").write_text("# Top\n[ok](#top) [gone](ANCHORS.md) [nohead](a.md#nowhere) [web](https://x.org)\n"
                                   "```\n[in code](missing.md)\n```\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "a.md"], cwd=tmp_path, check=True)
    monkeypatch.setattr(check_links, "ROOT", tmp_path)
    assert check_links.broken_links() == ["a.md: ANCHORS.md (no such tracked file)",
                                          "a.md: a.md#nowhere (no such heading)"]
