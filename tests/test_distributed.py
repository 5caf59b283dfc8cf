"""examples/train.py under torchrun on the CPU: 2 processes, gloo, the tiny
Llama preset (fp32, global batch 4 x 32 tokens, 16 steps), patched with
fusedops and trained with FusedAdamW.

One launch of this file as a script (`torchrun --nproc_per_node 2
tests/test_distributed.py OUT`) runs every case below through train.main, in
one process group, so that torch and transformers are imported once; the tests
read the summaries it writes:

  single     one process over the global batches (no torch.distributed)
  ddp        DistributedDataParallel, each process half of every batch
  fsdp       FSDP2 (fully_shard), saving after step 8: a DCP folder and the
             full state (.pt)
  resume     FSDP2 from the DCP folder, steps 9-16
  adamw      one process, plain model and torch.optim.AdamW, from the FSDP2
             run's full state; saves after step 12 (DCP and full)
  adamw_dcp  the same from the FSDP2 run's DCP folder (resharded: 2 -> 1)
  back_full  FSDP2 + FusedAdamW from torch AdamW's full state, steps 13-16
  back_dcp   the same from its DCP folder (resharded: 1 process -> 2)
  micro      one process, each batch in 2 micro-batches (DDP's arithmetic)
  ddp_micro, fsdp_micro
             DDP / FSDP2 with each process's half in 2 micro-batches
             (gradients reduced with the last only: no_sync,
             set_requires_gradient_sync)
  single_ckpt, ddp_ckpt, fsdp_ckpt
             one process, DDP, FSDP2 with activation checkpointing per
             decoder layer (--checkpoint: torch.utils.checkpoint,
             non-reentrant, on the patched layers)

Tolerance: the loss curves agree within LOSS_ATOL at every step. The runs
differ by the order of floating-point sums only (a process's half-batch mean
and an average of two, sharded gradient reductions, torch's AdamW against the
fused kernel): measured on a 2-core x86-64 VM, at most 5e-7. A restored
optimizer state with its step count off by one moves the curve by 5e-4, one
not restored at all by 2e-2. The DCP resume on the same sharding repeats the
same arithmetic, so its curve must be the uninterrupted run's exactly; so
must a checkpointed run, whose recomputed layers run the ops of the forward
again, on the same values.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
LOSS_ATOL = 1e-5
SAVE_AT, RESAVE_AT = 8, 12


def _cases(out):
    """(name, train.main arguments, whether every process runs it) in order."""
    base = ["--device", "cpu", "--preset", "tiny", "--runs", "fusedops"]
    ckpt = ["--ckpt-format", "dcp,full"]
    micro = ["--micro-batches", "2"]
    ac = ["--checkpoint"]
    cases = [("single", base + ["--dist", "none"], False),
             ("ddp", base + ["--dist", "ddp"], True),
             ("single_ckpt", base + ["--dist", "none"] + ac, False),
             ("ddp_ckpt", base + ["--dist", "ddp"] + ac, True),
             ("micro", base + ["--dist", "none"] + micro, False),
             ("ddp_micro", base + ["--dist", "ddp"] + micro, True)]
    if _has_fsdp2():
        fsdp = base + ["--dist", "fsdp"]
        adamw_ckpt = out / "adamw" / f"pytorch-step{RESAVE_AT}"
        cases += [("fsdp", fsdp + ["--save-at", str(SAVE_AT)] + ckpt, True),
                  ("resume", fsdp + ["--resume", str(out / "fsdp" / f"fusedops-step{SAVE_AT}")], True),
                  ("adamw", ["--device", "cpu", "--preset", "tiny", "--runs", "pytorch", "--dist", "none",
                             "--resume", str(out / "fsdp" / f"fusedops-step{SAVE_AT}.pt"),
                             "--save-at", str(RESAVE_AT)] + ckpt, False),
                  ("adamw_dcp", ["--device", "cpu", "--preset", "tiny", "--runs", "pytorch", "--dist", "none",
                                 "--resume", str(out / "fsdp" / f"fusedops-step{SAVE_AT}")], False),
                  ("back_full", fsdp + ["--resume", f"{adamw_ckpt}.pt"], True),
                  ("back_dcp", fsdp + ["--resume", str(adamw_ckpt)], True),
                  ("fsdp_micro", fsdp + micro, True),
                  ("fsdp_ckpt", fsdp + ac, True)]
    return [(name, argv + ["--out", str(out / name)], every) for name, argv, every in cases]


def _has_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def _train_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("example_train", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _driver(out):
    """Run under torchrun: every case in one gloo group; cases for one process
    run on rank 0 while the other waits."""
    import torch.distributed as dist
    import torch.utils.checkpoint
    dist.init_process_group("gloo")
    train = _train_module()
    checkpoint, calls = torch.utils.checkpoint.checkpoint, []

    def counted(*args, **kwargs):  # (examples/train.py imports it when it checkpoints)
        calls.append(1)
        return checkpoint(*args, **kwargs)
    torch.utils.checkpoint.checkpoint = counted
    for name, argv, every in _cases(out):
        calls.clear()
        if every or dist.get_rank() == 0:
            train.main(argv)
            if dist.get_rank() == 0:
                (out / name / "checkpoint_calls").write_text(str(len(calls)))
        dist.barrier()
    dist.destroy_process_group()
    train.exit_skipping_teardown()


# --------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("transformers")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{log}")

    def losses(name):
        path = out / name / "summary.json"
        assert path.exists(), f"{name}: no {path}\n{log}"
        summary = json.loads(path.read_text())
        (run,) = summary["runs"]
        return run["first_step"], torch.tensor(run["losses"], dtype=torch.float64), summary
    losses.out = out  # each case's folder, its summary.json and checkpoint_calls in it
    return losses


def _max_diff(a, b):
    assert len(a) == len(b) and len(a) > 0
    return (a - b).abs().max().item()


def test_ddp_matches_one_process(runs):
    first, single, _ = runs("single")
    _, ddp, summary = runs("ddp")
    assert summary["dist"] == "ddp" and summary["processes"] == 2 and first == 0
    assert single[-3:].mean() < single[0] - 0.3, f"did not train: {single.tolist()}"
    d = _max_diff(ddp, single)
    assert d <= LOSS_ATOL, f"DDP loss curve differs from one process's by {d:.3g}"


def test_micro_batches_match_one_batch(runs):
    """Gradients accumulated over micro-batches, on one process and under DDP
    (synchronised with the last only), follow the whole-batch curve."""
    _, single, _ = runs("single")
    for name, dist in (("micro", "none"), ("ddp_micro", "ddp")):
        _, curve, summary = runs(name)
        assert summary["dist"] == dist and summary["micro_batches"] == 2
        d = _max_diff(curve, single)
        assert d <= LOSS_ATOL, f"{name}: loss curve differs from one process's by {d:.3g}"


def _needs_fsdp2():
    if not _has_fsdp2():
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")


def test_fsdp_matches_one_process(runs):
    """FSDP2, and FSDP2 with each process's half in 2 micro-batches."""
    _needs_fsdp2()
    _, single, _ = runs("single")
    for name, micro in (("fsdp", 1), ("fsdp_micro", 2)):
        _, fsdp, summary = runs(name)
        assert summary["dist"] == "fsdp" and summary["processes"] == 2 and summary["micro_batches"] == micro
        d = _max_diff(fsdp, single)
        assert d <= LOSS_ATOL, f"{name}: FSDP2 loss curve differs from one process's by {d:.3g}"


def test_fsdp_dcp_resume_continues_the_curve(runs):
    _needs_fsdp2()
    _, fsdp, _ = runs("fsdp")
    first, resumed, _ = runs("resume")
    assert first == SAVE_AT
    assert torch.equal(resumed, fsdp[SAVE_AT:]), (
        f"resumed from DCP after step {SAVE_AT}: {resumed.tolist()} against {fsdp[SAVE_AT:].tolist()}")


def test_fsdp_state_into_torch_adamw_and_back(runs):
    """FusedAdamW's state under FSDP2 (DTensor shards), gathered to a full
    state dict, loads into torch.optim.AdamW on an unsharded model, which
    continues on the same curve (from the full .pt, and from the DCP folder
    resharded to one process); AdamW's state (full .pt, and DCP) loads back
    into FSDP2 + FusedAdamW, which continues on it too."""
    _needs_fsdp2()
    _, fsdp, _ = runs("fsdp")
    for name, what in (("adamw", "full state"), ("adamw_dcp", "DCP folder")):
        first, adamw, _ = runs(name)
        assert first == SAVE_AT
        d = _max_diff(adamw, fsdp[SAVE_AT:])
        assert d <= LOSS_ATOL, f"torch AdamW from the FSDP2 {what}: curve off by {d:.3g}"
    for name in ("back_full", "back_dcp"):
        first, back, _ = runs(name)
        assert first == RESAVE_AT
        d = _max_diff(back, fsdp[RESAVE_AT:])
        assert d <= LOSS_ATOL, f"{name}: FSDP2 + FusedAdamW from torch AdamW's state: curve off by {d:.3g}"


def test_activation_checkpointing_changes_nothing(runs):
    """--checkpoint on one process, under DDP and under FSDP2: the same loss
    curve as the run without, bit for bit (the layers' recomputation saves
    what their forward saved), and the summary says it was on."""
    names = [("single", "single_ckpt"), ("ddp", "ddp_ckpt")]
    if _has_fsdp2():
        names.append(("fsdp", "fsdp_ckpt"))
    for plain, ckpt in names:
        _, want, summary = runs(plain)
        _, got, ckpt_summary = runs(ckpt)
        assert ckpt_summary["checkpoint"] and not summary["checkpoint"]
        cfg = ckpt_summary["config"]
        for name, want_calls in ((plain, 0), (ckpt, cfg["num_hidden_layers"] * cfg["steps"])):
            calls = int((runs.out / name / "checkpoint_calls").read_text())
            assert calls == want_calls, f"{name}: torch.utils.checkpoint called {calls} times, expected {want_calls}"
        assert torch.equal(got, want), (
            f"{ckpt}: off {plain}'s curve by {_max_diff(got, want):.3g}: {got.tolist()} against {want.tolist()}")


def test_dist_gpu_script_dry_run(tmp_path):
    """tools/ci/dist_gpu.sh (the 2-GPU parity, resume and throughput call) in
    its dry mode: the same steps and verdicts on the CPU, gloo and the tiny
    preset, so that a GPU call's verdict is about training, not the script."""
    pytest.importorskip("transformers")
    _needs_fsdp2()
    env = dict(os.environ, DRY="1", OUT=str(tmp_path / "out"), DIST_WORK=str(tmp_path / "work"),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "ci" / "dist_gpu.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, log
    for line in ("FSDP2 fusedops resumed from DCP, after step 8", "1 GPU torch AdamW from FSDP2 FusedAdamW's DCP",
                 "FSDP2 FusedAdamW from torch AdamW's DCP", "all PASS"):
        assert line in proc.stdout, f"no {line!r} in:\n{log}"
    assert (tmp_path / "out" / "dist.tar.gz").stat().st_size > 0



def test_scale_script_dry_run(tmp_path):
    """tools/ci/scale_gpu.py (issue 56's 1-, 2- and 4-GPU table and the DCP
    resharding) in its dry mode, on 1 and 2 CPU processes: the 2-process
    FSDP2 run follows the 1-process curve (same global batch, in 2
    micro-batches there), its checkpoint resumes on 1 process, and the table
    says so."""
    pytest.importorskip("transformers")
    _needs_fsdp2()
    env = dict(os.environ, OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "ci" / "scale_gpu.py"), "--dry", "--variants", "fusedops",
                           "--work", str(tmp_path / "work")], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, log
    for line in ("| fusedops | 1 | 2 |", "| fusedops | 2 | 1 |", "PASS (fusedops, 1 GPU) |",
                 "| fusedops-1gpu-from-2 | fusedops-2gpu (DCP) | 4 |", "all PASS"):
        assert line in proc.stdout, f"no {line!r} in:\n{log}"
    assert (tmp_path / "out" / "scale.tar.gz").stat().st_size > 0


if __name__ == "__main__":
    _driver(Path(sys.argv[1]))
