"""Family ``mlp_minibatch_chunk``: the MLP memory (``ssmcraft.ops.mlp_memory``) with mini-batches of 16
to 64 tokens, every chunk's steps as matrix products at its anchors on tensor cores (``chunk.py``);
tried before ``mlp_memory``, which runs the other mini-batches and the per-token steps."""
from ssmcraft.ops.family import KernelFamily, recorded_match
from ssmcraft.ops.mlp_minibatch_chunk import chunk

# exported with the roles ``chunk.match`` reads off the IR recorded as data
FAMILY = KernelFamily(name="mlp_minibatch_chunk", backend=chunk.BACKEND_NAME, module=chunk, supports=chunk.supports,
                      prepare=chunk.prepare, forward=chunk.forward,
                      export_exclude=frozenset({"prepare", "supports", "match"}),
                      export_tail=recorded_match(chunk.match, "the MLP memory's mini-batch kernels"), varlen=None)
