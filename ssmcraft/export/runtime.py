"""The standalone runtime of an exported model: what replaces the compiler at run time.

This file is part of ssmcraft (importable and tested there) and is also copied, like the
layers, into every exported module (see ``ssmcraft.export.assemble``). It must not use
anything an exported module lacks: only the standard library, torch, safetensors, and the
names of the other bundled ssmcraft modules (imported below from ssmcraft; in the bundle they are
defined earlier in the same file). ``triton`` is imported only when a CUDA tensor meets
a module that carries Triton kernels.

- ``Objective``: what ``ssmcraft.compile`` returns, minus the compiler: the spec's
  declarations, the derived recurrence (``Recurrence``), the IR as data, and the same
  call contract (``obj(inputs, params, initial_state, output_final_state)``); it picks
  the path at run time (``"triton"`` on CUDA when kernels are inline, else
  ``"torch-vectorised"``) and records it in ``obj.backend`` (and logs a change).
- ``load_safetensors`` / ``save_safetensors``: weights through the ``safetensors`` library
  (which refuses malformed headers, overlapping or out-of-range offsets), its errors as one
  ``SsmcraftError`` line naming the file; ssmcraft writes exports with the same function.
- ``check_tokens`` / ``check_hidden`` / ``check_cache`` / ``check_count``: the public entry
  points' input checks, one ``SsmcraftError`` line each instead of a torch error deep inside.
- ``Mixer``: the objective mixer with the exported configuration, fresh or from weights.

Placeholders (``OBJECTIVE``, ``MODEL_CONFIG``, ``EXPORT``) are set by the generated last
section of an exported module; in ssmcraft itself they stay empty.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import numbers
import os
import sys
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from ssmcraft.compiler.slot_names import SlotNames
from ssmcraft.errors import SsmcraftError
from ssmcraft.fileio import write_bytes, write_text
from ssmcraft.ops.common.reference import (empty_trace, layout, reference_loop, sliding_window, state_shapes,
                                           traced_state, validate)
from ssmcraft.layers.config import LMConfig, layer_mixers, mixer_config
from ssmcraft.layers.mixer import ObjectiveMixer
from ssmcraft.runtime.dispatch import PREFER, backend_name, run_fast, triton_mode

runtime_log = logging.getLogger(__name__)

OBJECTIVE = None          # set by the generated section: this module's Objective
MODEL_CONFIG: dict = {}   # set by the generated section: the model config it was exported with
EXPORT: dict = {}         # set by the generated section: provenance (run, trial, objective)

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


# -- the compiled objective, standalone ------------------------------------------------------
class IRRecord:
    """One coefficient or reduction of ``IRView`` (expressions as text)."""

    def __init__(self, data: dict):
        self.__dict__.update(data)
        self.dims = tuple(data.get("dims", ()))

    def __repr__(self):
        return f"IRRecord({self.__dict__!r})"


class IRView(SlotNames):
    """The derived update's IR as data (``UpdateIR.to_json()``), read through the attribute
    names and views of ``ssmcraft.compiler.ir.UpdateIR`` that the runtime and the kernel
    families use (``kind``, ``dims``, ``inputs``, ``params``, ``slots``, ``spec_name``,
    ``readout``, ``coefficient(slot)``, the rank-r slot views of ``SlotNames``, ...). Expressions are text."""

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
        if self.prefer not in PREFER:
            raise SsmcraftError(f"SSM_BACKEND={self.prefer!r} is not a backend; choose one of {', '.join(PREFER)} "
                                "(or leave it unset: auto)")
        self._kernels = None
        self._kernel_error: str | None = None
        self._paths: dict = {}           # call signature -> runner (ssmcraft.runtime.dispatch)

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
        """The path ``prefer`` picks on these tensors (``ssmcraft.runtime.dispatch``, as ssmcraft's own
        objective); ``self.backend`` says which ran."""
        if self.prefer not in PREFER:
            raise SsmcraftError(f"backend {self.prefer!r} unknown; choose one of {', '.join(PREFER)}")
        y, S, backend = run_fast(self, inputs, params, initial_state, output_final_state)
        self._note(backend)
        return y, S

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
    def _mode(self, inputs) -> tuple[str | None, str]:
        return triton_mode(inputs, self.prefer, os.environ.get("TRITON_INTERPRET") == "1")

    def why_not_triton(self, inputs, params=None, initial_state=None) -> str:
        if self.triton_source is None:
            return "this module was exported without Triton kernels"
        mode, why = self._mode(inputs)
        if mode is None:
            return why
        dtype = validate(self.ir, self.spec, inputs, params, initial_state).dtype
        if dtype != torch.float32:
            return f"the kernels compute in float32; these inputs ask for {dtype}"
        self._load_kernels()
        return self._kernel_error or "unknown"

    def triton_runner(self, inputs, params=None, initial_state=None):
        """``specialise(obj, lay) -> runner`` of the inline kernel module when it can run on these
        inputs (``dispatch.triton_mode``: CUDA tensors with ``prefer`` auto/triton, CPU tensors under
        ``TRITON_INTERPRET=1`` with ``prefer == "interpret"``, as ssmcraft's own dispatch), else None.
        The runner calls the family's ``forward(obj, lay, co, output_final_state)``."""
        mode, _ = self._mode(inputs)
        if self.triton_source is None or mode is None or \
                validate(self.ir, self.spec, inputs, params, initial_state).dtype != torch.float32:
            return None
        kernels = self._load_kernels()
        if kernels is None:
            return None
        name = backend_name(mode, getattr(kernels, "BACKEND_NAME", getattr(kernels, "FAMILY", "kernels").replace("_", "-")))

        def specialise(obj, lay):
            def run(obj, inputs, params, initial_state, output_final_state):
                lay = layout(obj.ir, obj.spec, inputs, params, initial_state)
                co = obj.module.coefficients(lay.env, lay.d, lay.m)
                y, S = kernels.forward(obj, lay, co, output_final_state)
                return y.to(lay.out_dtype), (S if output_final_state else None), name
            run.backend = name
            return run
        specialise.backend = name
        return specialise

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
                    write_text(path, self.triton_source)
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


# -- weights -------------------------------------------------------------------------------------
def load_safetensors(path, device="cpu") -> dict:
    """name -> tensor from a ``.safetensors`` file (the ``safetensors`` library, which checks the
    header, dtypes and that every tensor's byte range lies inside the file without overlap)."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise SsmcraftError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write ``tensors`` (name -> tensor) as safetensors (contiguous CPU copies), atomically
    (``write_bytes``: a reader never sees half a file)."""
    try:
        data = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                    metadata={str(k): str(v) for k, v in (metadata or {}).items()})
        write_bytes(path, data)
    except (SafetensorError, OSError, ValueError) as e:
        raise SsmcraftError(f"{path}: cannot write the weights ({' '.join(str(e).split())[:200]})") from None


# -- input checks ----------------------------------------------------------------------------------
def _shape(x) -> str:
    return f"shape {list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def check_count(value, where: str, low: int = 1) -> int:
    """An integer argument (a batch size, a token count; a numpy integer too) that must be >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise SsmcraftError(f"{where}: expected an integer >= {low}, got {value!r}")
    return int(value)


def check_tokens(tokens, vocab_size: int, device, where: str, layout: str = "[B, T]") -> None:
    """Token ids: an int64/int32 tensor on ``device`` of ``layout`` (``[B, T]`` or ``[B]``), not
    empty, every id in ``[0, vocab_size)``."""
    ndim = layout.count(",") + 1
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        raise SsmcraftError(f"{where}: expected token ids as an int64 or int32 tensor {layout}, got {_shape(tokens)}")
    if tokens.dim() != ndim or tokens.numel() == 0:
        raise SsmcraftError(f"{where}: expected token ids {layout} with every size >= 1, got shape "
                            f"{list(tokens.shape)}")
    if tokens.device != torch.device(device):
        raise SsmcraftError(f"{where}: the token ids are on {tokens.device}, the model on {device}")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise SsmcraftError(f"{where}: token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})")


def check_hidden(h, d_model: int, weight: torch.Tensor, where: str, layout: str = "[B, T, d_model]") -> None:
    """Hidden states: a floating tensor of ``layout`` (last size ``d_model``), not empty, on the
    device of ``weight`` (the layer's) and, outside autocast, in its dtype."""
    ndim = layout.count(",") + 1
    if not isinstance(h, torch.Tensor) or not h.is_floating_point():
        raise SsmcraftError(f"{where}: expected a floating-point tensor {layout}, got {_shape(h)}")
    if h.dim() != ndim or h.shape[-1] != d_model or h.numel() == 0:
        raise SsmcraftError(f"{where}: expected {layout.replace('d_model', str(d_model))} with every size >= 1, "
                            f"got shape {list(h.shape)}")
    if h.device != weight.device or (h.dtype != weight.dtype and not torch.is_autocast_enabled(h.device.type)):
        raise SsmcraftError(f"{where}: got {h.dtype} on {h.device}; the layer's weights are {weight.dtype} on "
                            f"{weight.device} (move one to the other)")


def check_cache(mixer, cache, batch_size: int, where: str) -> None:
    """One mixer's recurrent cache (``init_cache``'s shapes: every declared state, a square one
    ``[B, H, m, m]``; a mini-batch objective's chunk start) for ``batch_size`` sequences."""
    w = mixer.in_proj.weight
    conv = tuple(mixer.conv.init_state(batch_size, torch.device("meta"), w.dtype).shape)
    want = [tuple(s) for s in state_shapes(mixer.obj.ir, batch_size, mixer.H, mixer.d, mixer.m).values()]
    got_conv, got_state = getattr(cache, "conv", None), getattr(cache, "state", None)
    start = getattr(got_state, "start", got_state)      # a mini-batch objective's cache: its chunk's start
    states = start if isinstance(start, tuple) else (start,)
    ok = (isinstance(got_conv, torch.Tensor) and tuple(got_conv.shape) == conv and len(states) == len(want)
          and all(isinstance(S, torch.Tensor) and tuple(S.shape) == shape for S, shape in zip(states, want)))
    if not ok:
        shapes = (f"conv {_shape(got_conv)}, state {', '.join(_shape(S) for S in states)}"
                  if got_conv is not None else type(cache).__name__)
        raise SsmcraftError(f"{where}: expected a cache from init_cache({batch_size}) (conv {list(conv)}, "
                            f"state(s) {', '.join(str(list(x)) for x in want)}), got {shapes}")


def read_config(path) -> dict:
    """``path/config.json`` of an export, checked against this module's objective."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise SsmcraftError(f"{path}: no {CONFIG_FILE} (not an exported model folder)")
    try:
        with open(file, "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        raise SsmcraftError(f"{file}: not a readable JSON file ({' '.join(str(e).split())[:200]})") from None
    model, objective = (config.get("model"), config.get("objective")) if isinstance(config, dict) else (None, None)
    if not isinstance(model, dict) or not isinstance(model.get("mixer"), dict) or not isinstance(objective, dict):
        raise SsmcraftError(f"{file}: expected an export's config (a JSON object with 'model', 'model.mixer' "
                            "and 'objective' mappings)")
    want = EXPORT.get("ir_hash")
    got = objective.get("ir_hash")
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
    ``y_t, cache = m.step(h_t, cache)`` with ``h_t [B, d_model]`` and a constant-size cache;
    ``y, cache = m.prefill(h)`` runs a prompt in parallel and returns the cache ``step`` continues.
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
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise SsmcraftError(f"{path}: layer {layer!r} out of range; the model has {n} layers")
        layout = layer_mixers(LMConfig.from_dict(model, "config.json", "model"), "config.json")
        if layout[layer][0] != "mixer":
            objective_layers = [i for i, (where, _) in enumerate(layout) if where == "mixer"]
            raise SsmcraftError(f"{path}: layer {layer} is not an objective mixer ({layout[layer][1].get('kind')}, "
                                f"model.{layout[layer][0]}); the objective mixers are layers {objective_layers}")
        mixer = cls(model.get("d_model"), **model["mixer"])
        prefix = f"blocks.{layer}.mixer."
        weights = {k[len(prefix):]: v for k, v in load_safetensors(os.path.join(path, WEIGHTS_FILE)).items()
                   if k.startswith(prefix)}
        load_weights(mixer, weights, path)
        return mixer.to(device).eval()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h ``[B, T, d_model]`` -> ``[B, T, d_model]`` (parallel mode)."""
        check_hidden(h, self.d_model, self.in_proj.weight, "Mixer: h")
        return super().forward(h)

    def init_cache(self, batch_size: int):
        return super().init_cache(check_count(batch_size, "Mixer.init_cache: batch_size"))

    def prefill(self, h: torch.Tensor, cache=None):
        """A prompt h ``[B, T, d_model]`` in one parallel pass, continuing ``cache`` (fresh when
        None) -> (``[B, T, d_model]``, the cache after its last token)."""
        check_hidden(h, self.d_model, self.in_proj.weight, "Mixer.prefill: h")
        if cache is not None:
            check_cache(self, cache, h.shape[0], "Mixer.prefill: cache")
        return super().prefill(h, cache)

    def step(self, h_t: torch.Tensor, cache):
        """One token: h_t ``[B, d_model]`` -> (``[B, d_model]``, the next cache)."""
        check_hidden(h_t, self.d_model, self.in_proj.weight, "Mixer.step: h_t", "[B, d_model]")
        check_cache(self, cache, h_t.shape[0], "Mixer.step: cache")
        return super().step(h_t, cache)


def load_weights(module: torch.nn.Module, weights: dict, path) -> None:
    """``module.load_state_dict(weights, strict=True)``, a mismatch as one line naming the folder."""
    try:
        module.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise SsmcraftError(f"{os.path.join(path, WEIGHTS_FILE)} does not fit {CONFIG_FILE} "
                            f"({' '.join(str(e).split())[:300]})") from None
