"""The standalone runtime of an exported model: what replaces the compiler at run time.

This file is part of ssmcraft (importable and tested there) and is also copied, like the
layers, into every exported module (see ``ssmcraft.export.assemble``). It must not use
anything an exported module lacks: only the standard library, torch, and the names of
the other bundled ssmcraft modules (imported below from ssmcraft; in the bundle they are
defined earlier in the same file). ``triton`` is imported only when a CUDA tensor meets
a module that carries Triton kernels.

- ``Objective``: what ``ssmcraft.compile`` returns, minus the compiler: the spec's
  declarations, the derived recurrence (``Recurrence``), the IR as data, and the same
  call contract (``obj(inputs, params, initial_state, output_final_state)``); it picks
  the path at run time (``"triton"`` on CUDA when kernels are inline, else
  ``"torch-vectorised"``) and records it in ``obj.backend`` (and logs a change).
- ``load_safetensors`` / ``save_safetensors``: the safetensors format with torch alone
  (8-byte little-endian header length, JSON header, raw little-endian tensor bytes), so
  an exported model needs no ``safetensors`` package (and ssmcraft writes exports with
  the same code, so the two cannot disagree).
- ``Mixer``: the objective mixer with the exported configuration, fresh or from weights.

Placeholders (``OBJECTIVE``, ``MODEL_CONFIG``, ``EXPORT``) are set by the generated last
section of an exported module; in ssmcraft itself they stay empty.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile

import torch

from ssmcraft.errors import SsmcraftError
from ssmcraft.kernels.reference import (empty_trace, layout, reference_loop, sliding_window, traced_state,
                                        vectorised)
from ssmcraft.layers.config import mixer_config
from ssmcraft.layers.mixer import ObjectiveMixer

runtime_log = logging.getLogger(__name__)

OBJECTIVE = None          # set by the generated section: this module's Objective
MODEL_CONFIG: dict = {}   # set by the generated section: the model config it was exported with
EXPORT: dict = {}         # set by the generated section: provenance (run, trial, objective)

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
BACKENDS = ("auto", "torch", "reference", "triton", "interpret")


# -- the compiled objective, standalone ------------------------------------------------------
class IRRecord:
    """One coefficient or reduction of ``IRView`` (expressions as text)."""

    def __init__(self, data: dict):
        self.__dict__.update(data)
        self.dims = tuple(data.get("dims", ()))

    def __repr__(self):
        return f"IRRecord({self.__dict__!r})"


class IRView:
    """The derived update's IR as data (``UpdateIR.to_json()``), read through the attribute
    names and views of ``ssmcraft.compiler.ir.UpdateIR`` that the runtime and the kernel
    families use (``kind``, ``dims``, ``inputs``, ``params``, ``slots``, ``spec_name``,
    ``readout``, ``coefficient(slot)``, ...). Expressions are text."""

    def __init__(self, data: dict, content_hash: str | None = None):
        self.data = dict(data)
        self.__dict__.update(data)
        self.spec_name = data["spec"]
        self.dims = tuple(data["dims"])
        self.inputs = {k: tuple(v) for k, v in data["inputs"].items()}
        self.params = {k: tuple(v) for k, v in data["params"].items()}
        self.slots = dict(data.get("slots", {}))
        self.states = tuple(data.get("states", ()))            # several states (absent with one)
        # states of several shapes (absent with one shape): name -> (r, c), name -> c of c I at t = 0
        self.state_shapes = {x: tuple(v) for x, v in data.get("state_shapes", {}).items()}
        self.inits = {x: v["identity"] for x, v in data.get("inits", {}).items()}
        for key in ("coefficients", "reductions", "state_reductions", "readout_reductions"):
            setattr(self, key, tuple(IRRecord(r) for r in data.get(key, ())))
        self._hash = content_hash

    def coefficient(self, slot: str):
        name = self.slots.get(slot)
        return next((c for c in self.coefficients if c.name == name), None)

    @property
    def state_names(self) -> tuple:
        return self.states or (self.data["state"],)

    def shape_of(self, state: str) -> tuple:
        return self.state_shapes.get(state, self.dims)

    def is_per_head_step(self) -> bool:
        c = self.coefficient("c")
        return c is not None and not c.dims

    def content_hash(self) -> str | None:
        return self._hash


class Objective:
    """A derived recurrence with its paths (the call contract of ``ssmcraft.compile``).

    ``inputs``: spec input name -> ``[B, T, H, n]`` (``[B, T, H]`` for a scalar input);
    ``params``: name -> ``[H, *shape]``; ``initial_state`` and the returned state
    ``[B, H, d, m]``; output ``y [B, T, H, d]``.

    ``prefer``: ``auto`` (Triton on CUDA tensors when this module carries kernels and
    triton imports, else the vectorised PyTorch path), ``torch``, ``reference`` (the plain
    per-step loop), ``triton`` (raise when it cannot run) or ``interpret`` (the kernels on
    CPU tensors under ``TRITON_INTERPRET=1``). Default from the environment variable
    ``SSM_BACKEND``. Backend names as ssmcraft's: ``triton:<kernel>``, ``torch-vectorised``.
    """

    def __init__(self, spec, ir: dict, recurrence, triton_source: str | None = None, update: str = "",
                 ir_hash: str | None = None):
        self.spec = spec
        self.ir = IRView(ir, ir_hash)
        self.module = recurrence
        self.triton_source = triton_source
        self.update = update
        self.backend: str | None = None
        self.prefer = os.environ.get("SSM_BACKEND", "auto")
        self._kernels = None
        self._kernel_error: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def structure_kind(self) -> str:
        return self.ir.kind

    def __repr__(self):
        return f"Objective({self.name!r}, kind={self.ir.kind!r}, backend={self.backend!r})"

    def _note(self, backend: str) -> None:
        if backend != self.backend:
            runtime_log.info("%s: recurrence backend %s", self.name, backend)
        self.backend = backend

    # -- paths ---------------------------------------------------------------------------
    def reference(self, inputs, params=None, initial_state=None, output_final_state: bool = True):
        """The plain per-step loop of the derived update (float64-capable)."""
        lay = layout(self.ir, self.spec, inputs, params, initial_state)
        y, S, _ = reference_loop(self.module, lay)
        return y.to(lay.out_dtype), (S if output_final_state else None)

    def __call__(self, inputs, params=None, initial_state=None, output_final_state: bool = True):
        """The path ``prefer`` picks on these tensors; ``self.backend`` says which ran."""
        if self.prefer not in BACKENDS:
            raise SsmcraftError(f"backend {self.prefer!r} unknown; choose one of {', '.join(BACKENDS)}")
        if self.prefer == "reference":
            out = self.reference(inputs, params, initial_state, output_final_state)
            self._note("reference-loop")
            return out
        lay = layout(self.ir, self.spec, inputs, params, initial_state)
        kernels = self.kernels(inputs, lay) if self.prefer in ("auto", "triton", "interpret") else None
        if kernels is not None:   # the kernel family's contract: forward(obj, lay, co, output_final_state)
            co = self.module.coefficients(lay.env, lay.d, lay.m)
            y, S = kernels.forward(self, lay, co, output_final_state)
            name = getattr(kernels, "BACKEND_NAME", getattr(kernels, "FAMILY", "kernels").replace("_", "-"))
            self._note(f"{'triton' if _first(inputs).is_cuda else 'triton-interpret'}:{name}")
            return y.to(lay.out_dtype), (S if output_final_state else None)
        if self.prefer in ("triton", "interpret"):
            raise SsmcraftError(f"{self.name}: backend {self.prefer!r} was asked for but cannot run here "
                                f"({self.why_not_triton(inputs, lay)})")
        y, S = vectorised(self.module, self.ir, lay)
        self._note("torch-vectorised")
        return y.to(lay.out_dtype), (S if output_final_state else None)

    def trace(self, inputs, params=None, initial_state=None, every: int = 1):
        """States over time ``[B, T // every, H, d, m]`` (reference loop); with several states of
        the one the output reads (``traced_state``)."""
        lay = layout(self.ir, self.spec, inputs, params, initial_state)
        traced = self.ir.state_names.index(traced_state(self.ir))
        _, S, states = reference_loop(self.module, lay, every=max(1, int(every)), traced=traced)
        return empty_trace(S, lay) if states is None else states

    def sliding_window(self, inputs, params=None, window: int = 256, initial_state=None):
        lay = layout(self.ir, self.spec, inputs, params, initial_state)
        return sliding_window(self.module, self.ir, lay, int(window)).to(lay.out_dtype)

    def mitigated(self, retention: float = 1.0, insertion: float = 1.0):
        raise SsmcraftError("retention/insertion mitigations re-derive the update and need ssmcraft; "
                            "the exported module runs the trained recurrence as it is")

    # -- Triton kernels carried inline -----------------------------------------------------
    def why_not_triton(self, inputs, lay=None) -> str:
        if self.triton_source is None:
            return "this module was exported without Triton kernels"
        first = _first(inputs)
        if first is None:
            return "no input tensors"
        if first.is_cuda and self.prefer == "interpret":
            return "prefer='interpret' runs CPU tensors under TRITON_INTERPRET=1; use 'triton' on CUDA"
        if not first.is_cuda and not (os.environ.get("TRITON_INTERPRET") == "1" and self.prefer == "interpret"):
            return "CPU tensors: the kernels run them only under TRITON_INTERPRET=1 with prefer='interpret'"
        if lay is not None and lay.dtype != torch.float32:
            return f"the kernels compute in float32; these inputs ask for {lay.dtype}"
        self._load_kernels()
        return self._kernel_error or "unknown"

    def kernels(self, inputs, lay=None):
        """The inline kernel module when it can run on these inputs, else None: CUDA tensors
        with ``prefer`` auto/triton, CPU tensors under ``TRITON_INTERPRET=1`` with
        ``prefer == "interpret"`` (as ssmcraft's own dispatch)."""
        first = _first(inputs)
        if self.triton_source is None or first is None:
            return None
        if first.is_cuda:
            ok = self.prefer in ("auto", "triton")
        else:
            ok = self.prefer == "interpret" and os.environ.get("TRITON_INTERPRET") == "1"
        if not ok or (lay is not None and lay.dtype != torch.float32):
            return None
        return self._load_kernels()

    def _load_kernels(self):
        """Write ``triton_source`` to a file (Triton reads ``@triton.jit`` source from files)
        next to this module, or in the temp folder when that is read-only, and import it."""
        if self._kernels is not None or self._kernel_error is not None:
            return self._kernels
        try:
            import triton  # noqa: F401  (the kernels need it; say so clearly when it is missing)
        except ImportError as e:
            self._kernel_error = f"triton is not installed ({e})"
            runtime_log.info("%s: Triton kernels unavailable: %s", self.name, self._kernel_error)
            return None
        digest = hashlib.sha256(self.triton_source.encode()).hexdigest()[:16]
        name = f"_ssm_kernels_{self.name}_{digest}"
        if name in sys.modules:
            self._kernels = sys.modules[name]
            return self._kernels
        here = os.path.dirname(os.path.abspath(__file__))
        for folder in (os.path.join(here, "__ssm_kernels__"),
                       os.path.join(tempfile.gettempdir(), f"ssm_kernels_{os.getuid() if hasattr(os, 'getuid') else 0}")):
            path = os.path.join(folder, name + ".py")
            try:
                os.makedirs(folder, exist_ok=True)
                if not os.path.exists(path) or open(path, encoding="utf-8").read() != self.triton_source:
                    tmp = f"{path}.{os.getpid()}.tmp"
                    with open(tmp, "w", encoding="utf-8") as f:
                        f.write(self.triton_source)
                    os.replace(tmp, path)
                break
            except OSError:
                continue
        else:
            self._kernel_error = "no writable folder for the kernel file"
            return None
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except Exception as e:  # a broken kernel must not take the CPU path down with it
            sys.modules.pop(name, None)
            self._kernel_error = f"the inline Triton kernels failed to load: {type(e).__name__}: {e}"
            runtime_log.warning("%s: %s", self.name, self._kernel_error)
            return None
        self._kernels = module
        return module


def _first(inputs):
    return next((t for t in inputs.values() if isinstance(t, torch.Tensor)), None)


def compile_objective(ref):
    """The objective of this exported module (it was compiled when the module was written;
    there is no compiler here). ``ref`` must name the same objective."""
    if OBJECTIVE is None:
        raise SsmcraftError("this module carries no compiled objective")
    name = ref.get("name") if isinstance(ref, dict) else ref
    if name not in (None, OBJECTIVE.name):
        raise SsmcraftError(f"this module was exported for objective {OBJECTIVE.name!r} and cannot compile "
                            f"{name!r} (that needs ssmcraft)")
    return OBJECTIVE


# -- safetensors with torch alone -------------------------------------------------------------
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def load_safetensors(path, device="cpu") -> dict:
    """name -> tensor from a ``.safetensors`` file, with torch only.

    Format: ``u64`` little-endian header size N, N bytes of JSON
    (``name -> {"dtype", "shape", "data_offsets": [begin, end]}`` plus optional
    ``__metadata__``), then the tensors' bytes, little-endian, row-major.
    """
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise SsmcraftError(f"{path}: not a safetensors file (too short)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise SsmcraftError(f"{path}: not a safetensors file (header size {n} > file size)")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    if sys.byteorder != "little":
        raise SsmcraftError("reading safetensors on a big-endian machine is not supported here")
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise SsmcraftError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader does not know")
        begin, end = info["data_offsets"]
        shape = list(info["shape"])
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != numel * itemsize or base + end > len(data):
            raise SsmcraftError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {info['dtype']}")
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=dtype).reshape(shape)
        out[name] = t.to(device)
    return out


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a tensor, row-major (``ctypes`` copy: fast, no numpy)."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write ``tensors`` (name -> tensor) in the safetensors format, with torch only; readable
    by ``load_safetensors`` and by the ``safetensors`` package. Written to a temporary file
    and renamed, so a reader never sees half a file."""
    if sys.byteorder != "little":
        raise SsmcraftError("writing safetensors on a big-endian machine is not supported here")
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in names:
            raise SsmcraftError(f"tensor {name!r}: dtype {t.dtype} cannot be written as safetensors here")
        blob = tensor_bytes(t)
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)                     # align the data to 8 bytes, as safetensors does
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def read_config(path) -> dict:
    """``path/config.json`` of an export, checked against this module's objective."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise SsmcraftError(f"{path}: no {CONFIG_FILE} (not an exported model folder)")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    want = EXPORT.get("ir_hash")
    got = config.get("objective", {}).get("ir_hash")
    if want and got and want != got:
        raise SsmcraftError(f"{file}: its objective ({config['objective'].get('name')}, IR {got}) is not the one "
                            f"this module was exported with ({EXPORT.get('objective')}, IR {want})")
    return config


def default_dir() -> str:
    """The folder this module lives in (where ``export`` put config.json and the weights)."""
    return os.path.dirname(os.path.abspath(__file__))


# -- the mixer on its own ---------------------------------------------------------------------
class Mixer(ObjectiveMixer):
    """The exported objective mixer: ``h [B, T, d_model] -> [B, T, d_model]``.

    ``Mixer()`` is a freshly initialised layer with the exported configuration;
    ``Mixer(d_model=256, heads=2)`` changes the width or any mixer setting (state_size,
    expand, conv_kernel, ...); ``Mixer.from_pretrained(path, layer=0)`` loads the trained
    weights of one layer. Recurrent use: ``cache = m.init_cache(B)``;
    ``y_t, cache = m.step(h_t, cache)`` with ``h_t [B, d_model]`` and a constant-size cache.
    """

    def __init__(self, d_model: int | None = None, **overrides):
        settings = {**MODEL_CONFIG.get("mixer", {}), **overrides}
        settings.setdefault("objective", OBJECTIVE.name if OBJECTIVE is not None else None)
        super().__init__(mixer_config(settings, "Mixer", "mixer"),
                         int(d_model or MODEL_CONFIG.get("d_model") or 0), compile_objective(settings["objective"]))

    @classmethod
    def from_pretrained(cls, path: str | None = None, layer: int = 0, device="cpu") -> "Mixer":
        """Layer ``layer``'s trained mixer from an export folder (default: this module's)."""
        path = path or default_dir()
        config = read_config(path)
        model = config["model"]
        n = model.get("n_layers", 0)
        if not 0 <= layer < n:
            raise SsmcraftError(f"{path}: layer {layer} out of range; the model has {n} layers")
        mixer = cls(model["d_model"], **model["mixer"])
        prefix = f"blocks.{layer}.mixer."
        weights = {k[len(prefix):]: v for k, v in load_safetensors(os.path.join(path, WEIGHTS_FILE)).items()
                   if k.startswith(prefix)}
        mixer.load_state_dict(weights, strict=True)
        return mixer.to(device).eval()
