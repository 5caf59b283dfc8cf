"""How far FusedAdam(W) and torch's Adam(W) implementations drift from a
float64 run of the same steps, and from each other: 100 fp32 steps of the
configurations tests/test_adam.py checks, in ulps of each quantity's largest
magnitude (the unit of the tests' parity bounds).

    python tools/reliability/adam_parity.py [--device cuda] [--steps 100]

Prints one line per configuration: each implementation's distance from the
float64 run, and ours from each of torch's."""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))

spec = importlib.util.spec_from_file_location("test_adam", Path(__file__).parents[2] / "tests" / "test_adam.py")
T = importlib.util.module_from_spec(spec)
spec.loader.exec_module(T)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    params0, grads = T.parity_data()
    print(f"{args.device}, {args.steps} steps, ulps of each quantity's largest magnitude")
    for config, (ours_cls, torch_cls, kw) in T.CONFIGS.items():
        exact = T.float64_run(torch_cls, kw, params0, grads, args.steps)
        runs = {"fusedops": T.train(ours_cls, kw, params0, grads, args.steps, args.device)}
        for impl, extra in T.TORCH_IMPLS.items():
            tkw = dict(kw, **extra)
            if isinstance(kw["lr"], torch.Tensor) and impl == "foreach":
                if args.device == "cpu":
                    continue
                tkw["capturable"] = True
            runs[impl] = T.train(torch_cls, tkw, params0, grads, args.steps, args.device)
        runs = {k: T.run_states(*v) for k, v in runs.items()}
        line = [f"{config:24s} vs f64:"] + [f"{k} {T.distance(r, exact):7.2f}" for k, r in runs.items()]
        line += ["| ours vs"] + [f"{k} {T.distance(runs['fusedops'], r):7.2f}" for k, r in runs.items()
                                 if k != "fusedops"]
        print(" ".join(line))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
