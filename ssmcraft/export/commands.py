"""``ssmcraft export RUN_DIR [--trial best|N] --out EXP [--layer-only] [--format module|hf]``."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a search folder (ssmcraft search --out), or a training run folder (ssmcraft train --out)")
    parser.add_argument("--trial", default=None, metavar="best|N",
                        help="which trial of a search: 'best' (rank 1 of the leaderboard, the default) or its "
                             "number; not for a training run folder")
    parser.add_argument("--out", required=True, metavar="EXP", help="folder to write (created; must be empty)")
    parser.add_argument("--layer-only", action="store_true",
                        help="export only the mixer layer (with its kernels) and the mixers' weights")
    parser.add_argument("--name", default=None,
                        help="module name (default: <objective>_ssm, or <objective>_mixer with --layer-only)")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip importing the written module and comparing it with ssmcraft's model")
    parser.add_argument("--force", action="store_true", help="write into EXP even when it is not empty")
    parser.add_argument("--format", choices=("module", "hf"), default="module",
                        help="module: a standalone PyTorch module (the default); hf: a folder that transformers "
                             "loads with AutoModelForCausalLM.from_pretrained(EXP, trust_remote_code=True) "
                             "(needs: pip install 'ssmcraft[hf]')")


def run(args: argparse.Namespace) -> int:
    from ssmcraft.export.assemble import ExportError
    from ssmcraft.export.exporter import export

    options = {"name": args.name, "check": not args.no_verify, "overwrite": args.force}
    if args.format == "hf":
        from ssmcraft.export.hf import export_run

        if args.layer_only:
            raise ExportError("--layer-only exports a mixer layer, which transformers cannot load as a causal LM; "
                              "drop it for --format hf")
        result = export_run(args.run_dir, args.out, args.trial, **options)
    else:
        result = export(args.run_dir, args.out, args.trial, layer_only=args.layer_only, log_fn=lambda _msg: None,
                        **options)
    print(f"exported {result.source.label}{' for transformers' if args.format == 'hf' else ''}")
    print(f"  objective {result.objective} ({result.structure}); {result.n_params:,} parameters"
          f"{' (mixers only)' if result.layer_only else ''}; Triton kernels: {result.kernels}")
    for f in result.files:
        print(f"  {f}")
    if result.verified is not None:
        v = result.verified
        print(f"  verified: the written module vs ssmcraft's model, max |diff| {v['max_abs_diff']:.2g}; "
              f"step-by-step vs parallel {v['step_max_abs_diff']:.2g}; prefill + steps vs steps "
              f"{v['prefill_max_abs_diff']:.2g} (fp32, CPU, shape {v['shape']})")
        if "hf_max_abs_diff" in v:
            print(f"  verified: AutoModelForCausalLM (trust_remote_code) vs the written module, max |diff| "
                  f"{v['hf_max_abs_diff']:.2g}; greedy generate equal for {v['hf_new_tokens']} new tokens"
                  f"{'; tokenizer: ' + v['hf_tokenizer'] if v['hf_tokenizer'] else ''} (fp32, CPU, shape "
                  f"{v['hf_shape']})")
    return 0
