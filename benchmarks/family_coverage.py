"""Which family each composed objective of a seeded sample of the compose space runs on (CUDA order)."""
import itertools, random, sys, collections, time
import ssmcraft
from ssmcraft.search.compose import TERMS, check_choices, compose_objective, composed_name
from ssmcraft.ops.registry import order
from ssmcraft.errors import SsmcraftError
random.seed(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
combos = []
for prox, data, keys, step, upd, mb, mem in itertools.product(TERMS["proximity"], TERMS["data"], (1, 2), TERMS["step"],
                                                           TERMS["update"], (0, 16), ("matrix", "mlp")):
    combos.append(dict(proximity=prox, data=data, keys=keys, step=step, update=upd, minibatch=mb, memory=mem, normalize=True))
random.shuffle(combos)
n = int(sys.argv[1])
counts = collections.Counter(); torch_only = []
t0 = time.time(); tried = 0
for c in combos:
    if tried >= n: break
    try:
        spec = compose_objective(check_choices(c))
        obj = ssmcraft.compile(spec)
    except (SsmcraftError, ValueError, NotImplementedError) as e:
        continue
    tried += 1
    fam = next((f.name for f in order(obj.ir, "triton") if f.name != "decode" and f.reason(obj.ir) is None), None)
    counts[fam or "PyTorch path"] += 1
    if fam is None:
        torch_only.append((composed_name(c), obj.ir.kind))
    print(f"{composed_name(c):60s} {obj.ir.kind:16s} {fam}", flush=True)
print(counts, f"{time.time()-t0:.0f}s")
for t in torch_only: print("TORCH", *t)
