"""``ssmcraft derive SPEC``: print every compiler stage (or the IR as JSON, or the code)."""
from __future__ import annotations

import json
import time

import sympy


def add_arguments(p):
    p.add_argument("spec", help="an objective spec: a path, or a library name such as longhorn")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="print the IR as JSON")
    g.add_argument("--code", action="store_true", help="print the generated reference source")
    g.add_argument("--kernel", action="store_true",
                   help="print the generated Triton kernels of the family that runs it on the GPU")


def stages(spec_arg) -> dict:
    """Run the pure stages one by one and return their printable results."""
    from ssmcraft.compiler import blockrank1
    from ssmcraft.compiler.api import generate_reference
    from ssmcraft.compiler.ir import UpdateIR
    from ssmcraft.compiler.codegen import coefficient_lines, update_formula
    from ssmcraft.compiler.updates import compose_stages, derive_stages, derive_update
    from ssmcraft.compiler.metric import show
    from ssmcraft.compiler.spec import load_spec
    from ssmcraft.compiler.structure import classify, classify_states
    from ssmcraft.compiler.symbolic import symbolic_objective

    t0 = time.perf_counter()
    spec = load_spec(spec_arg)
    so = symbolic_objective(spec)
    per_state = {}
    block = None
    if spec.states:     # several states: each stage's own update, then composed (previous states only)
        own = derive_stages(so)
        composed = compose_stages(so, own)
        ir = classify_states(so, composed)
        block = blockrank1.find(so, ir, composed)
        ir = block if isinstance(block, UpdateIR) else ir
        F = tuple(e for _, e in composed)
        per_state = {x: (show(so.algebra, L), show(so.algebra, e)) for (x, L), (_, e) in zip(so.losses, own)}
    else:
        F = derive_update(so)
        ir = classify(so, F)
    derived = time.perf_counter() - t0
    import torch  # noqa: F401  (not timed: the generated module imports it; after the spec, so errors stay fast)

    t1 = time.perf_counter()
    _, source = generate_reference(ir)
    seconds = (derived, time.perf_counter() - t1)
    alg = so.algebra
    return {"spec": spec, "symbolic": so, "update": F, "ir": ir, "source": source, "seconds": seconds,
            "objective_sum": sympy.sstr(alg.expand(so.loss)), "per_state": per_state,
            "update_sum": sympy.sstr(alg.expand(F)) if not spec.states else None,
            "formula": update_formula(ir), "coefficients": coefficient_lines(ir),
            "block": None if block is None else blockrank1.describe(ir, block if isinstance(block, str) else None)}


def run(args) -> int:
    from ssmcraft.compiler.codegen import element_index
    if args.kernel:              # derives through ssmcraft.compile: the stages below would be thrown away
        return _print_kernel(args.spec)
    st = stages(args.spec)
    if args.json:
        print(json.dumps(st["ir"].to_json(), indent=2))
        return 0
    if args.code:
        print(st["source"], end="")
        return 0
    spec, ir = st["spec"], st["ir"]
    d, m = spec.dims
    print(f"{spec.name}: {' '.join(spec.summary.split())}")
    print(f"source: {spec.source}")
    print("\n[1] spec")
    if spec.states:
        decls = [f"{x}: [{', '.join(spec.shape_of(x))}]" + ("" if spec.init_of(x) is None else f" = {spec.init_of(x):g} I at t = 0")
                 for x in spec.states]
        print(f"  states {', '.join(decls)}   (X_prev = previous value of X; "
              "updated in this order, each with the earlier ones at their new values)")
    else:
        print(f"  state  {spec.state}: [{d}, {m}]   (S_prev = previous state)")
    for n, i in spec.inputs.items():
        flags = [f for f in ("positive", "bounded", "normalize") if getattr(i, f)] + ([f"activation={i.activation}"] if i.activation else [])
        print(f"  input  {n}: [{', '.join(i.shape)}] {' '.join(flags)}")
    for n, p in spec.params.items():
        print(f"  param  {n}: [{', '.join(p.shape)}] init={p.init}{'' if p.trainable else ' (fixed)'}")
    for n, t in spec.let:
        print(f"  let    {n} = {t}")
    if spec.states:
        for x, text, upd in zip(spec.states, spec.objectives, spec.updates):
            print(f"  objective  L_{x} = {text}   (update: {upd})")
        if spec.minibatch:
            print(f"  approximation: {{minibatch: {spec.minibatch}}}: each loss's data gradient at the values of "
                  "every state before the token's chunk (_X_c)")
        print(f"  output: y = {spec.output}")
    else:
        print(f"  objective  L = {spec.objective}")
        approx = f"{{minibatch: {spec.minibatch}}}" if spec.minibatch else spec.approximation
        print(f"  update: {spec.update}, approximation: {approx}, output: y = {spec.output}")
    hidden = "".join(f", {a} indexes {h}" for a, (h, _, _) in zip("abc", spec.hidden))
    print("\n[2] symbolic objective (i indexes " + d + ", j indexes " + m + hidden + ")")
    if spec.states:
        for x, (loss, _) in st["per_state"].items():
            print(f"  L_{x} = {loss}")
        print("\n[3] derived update, state by state (block-coordinate, in declaration order)")
        for (x, (_, own)), upd in zip(st["per_state"].items(), spec.updates):
            if x in spec.square_states():
                print(f"  {x}_t = {own}   ({upd}: the minimiser, a low-rank change; carried by its inverse "
                      f"_inv_{x}, updated by {'Sherman-Morrison' if own.count('outer(') == 1 else 'Woodbury'})")
                continue
            print(f"  {x}_t[{element_index(spec, x)}] = {own}   ({upd})")
        print("  composed (each in the previous states only): see [4]")
    else:
        print(f"  L = {st['objective_sum']}")
        print(f"\n[3] derived update ({spec.update}{', exact' if spec.approximation == 'exact' else ''})")
        if spec.minibatch:
            print(f"  mini-batch of {spec.minibatch}: the terms that read S_prev at the running state, the data loss's "
                  "gradient at _S_c, the state before the token's chunk")
        print(f"  S_t[i,j] = {st['update_sum']}")
    print(f"\n[4] structure: {ir.kind}" + (" (diagonal approximation)" if spec.approximation == "diagonal" else ""))
    for line in st["formula"].splitlines():
        print(f"  {line}")
    print("  where")
    for line in st["coefficients"]:
        print(f"    {line}")
    for line in st["block"] or ():
        print(f"  {line}")
    if ir.factored:
        print("  reductions factored (a sum over one dimension of a body that also varies over the other, "
              "split over the body's terms):")
        for f in ir.factored:
            print(f"    sum_{f.over} {sympy.sstr(f.body)} = {sympy.sstr(f.expr)}")
    print(f"\n[5] code: reference module cached (IR {ir.content_hash()}); `--code` prints it, `--json` the IR")
    print(f"derived in {st['seconds'][0] * 1000:.0f} ms, reference generated and loaded in {st['seconds'][1] * 1000:.0f} ms")
    return 0


def _print_kernel(spec_arg) -> int:
    """``--kernel``: the family that runs the objective on CUDA tensors, and the source generated for it."""
    import ssmcraft
    from ssmcraft.ops import registry
    from ssmcraft.runtime import select as triton_backend
    obj = ssmcraft.compile(spec_arg)
    fam, sources = triton_backend.kernel_source(obj)
    print(f"# {obj.name}: family {fam!r} runs it on the GPU ({registry.family(fam).path})")
    if not sources:
        print("# its kernels are written by hand and specialised by constexpr modes: no per-objective source")
    for what, source in sources:
        if what == "note":
            print(f"# {source}")
            continue
        note = " (the interpreter runs tl.exp where it has libdevice)" if "libdevice" in source else ""
        print(f"# generated {what}, as the GPU compiles it{note}:")
        print(source, end="" if source.endswith("\n") else "\n")
    return 0
