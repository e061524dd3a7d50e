"""``ssmcraft eval DIR [--extrapolate N] [--passkey] [--mitigate retention=R,insertion=I | window=W]``."""
from __future__ import annotations

import argparse

from ssmcraft.errors import SsmcraftError


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SsmcraftError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SsmcraftError(f"expected comma-separated numbers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="DIR", help="a run directory written by `ssmcraft train`")
    parser.add_argument("--extrapolate", type=int, default=4, metavar="N",
                        help="evaluate out to N x the training length (default 4)")
    parser.add_argument("--passkey", action="store_true", help="passkey retrieval heatmap (byte-level models)")
    parser.add_argument("--passkey-lengths", metavar="T1,T2,..", help="context lengths (default L, 2L, .., N*L)")
    parser.add_argument("--passkey-depths", default="0,0.25,0.5,0.75,1", metavar="D1,D2,..",
                        help="needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
    parser.add_argument("--passkey-trials", type=int, default=8, help="random keys per cell (default 8)")
    parser.add_argument("--mitigate", metavar="SPEC",
                        help="training-free mitigation: retention=R,insertion=I or window=W")
    parser.add_argument("--batches", type=int, default=4, help="validation batches for the loss curve")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--explosion-factor", type=float, default=3.0,
                        help="flag a state statistic growing past this factor x its max within the training "
                             "length (squared for the variance; default 3)")
    parser.add_argument("--state-points", type=int, default=256, help="time points kept per state trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--out", help="output directory (default DIR/eval)")
    parser.add_argument("--quiet", action="store_true", help="warnings only")


def run(args: argparse.Namespace) -> int:
    from ssmcraft.layers import Mitigation
    from ssmcraft.train.commands import setup_logging
    from ssmcraft.train.eval_run import EvalOptions, eval_run

    setup_logging(args.quiet)
    options = EvalOptions(
        extrapolate=args.extrapolate, batches=args.batches, batch_size=args.batch_size, seed=args.seed,
        state_points=args.state_points, explosion_factor=args.explosion_factor, passkey=args.passkey,
        passkey_lengths=_ints(args.passkey_lengths) if args.passkey_lengths else None,
        passkey_depths=_floats(args.passkey_depths), passkey_trials=args.passkey_trials,
        mitigation=Mitigation.parse(args.mitigate) if args.mitigate else None, device=args.device)
    summary = eval_run(args.run_dir, options, args.out)
    key = f"extrapolation_loss_{args.extrapolate}x"
    line = [f"loss_within_train_len={_fmt(summary['loss_within_train_len'])}", f"{key}={_fmt(summary[key])}"]
    state = summary["state"]
    if "plain" in state:
        line += [f"state_explosion[{label}]={v['exploded']}" for label, v in state.items()]
    if "passkey" in summary:
        line += [f"passkey[{label}]={v:.3f}" for label, v in summary["passkey"].items()]
    print(" ".join(line))
    print(f"wrote {args.out or args.run_dir + '/eval'}")
    return 0


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"
