"""Configuration dataclasses of the mixers and the LM; each round-trips through a JSON dict.

``from_mapping`` refuses unknown keys and names the offending key, so a typo in an
experiment spec (``model.mixer.stat_size``) is an error, not a silently ignored setting.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from ssmcraft.config_check import ABSENT, REQUIRED, Checker, Field
from ssmcraft.errors import SpecError


@dataclass
class ObjectiveMixerConfig:
    """The Mamba/Longhorn block around a compiled objective.

    objective: a library name (``longhorn``), a path, YAML text or the spec mapping itself.
    heads: H; the value dim per head is ``d = expand * d_model / H``. state_size: m.
    conv_kernel: the depthwise causal conv width (<= 1: no conv).
    value_input: the ``[d]`` input fed the conv output directly (Mamba's ``x``); ``auto``
    picks the only ``[d]`` input with no constraint or activation, ``none`` projects all.
    low_rank: rank of the projections of constrained ``[d]`` inputs (step sizes, gates:
    Mamba's ``dt_rank``); ``auto`` = ceil(d_model / 16).
    dt_min, dt_max: softplus-activated inputs start at values log-uniform in this range
    (Mamba's dt initialisation, via the projection bias).
    plain_activation: elementwise function of unconstrained non-value inputs (keys, queries).
    input_bias: per-input constant for the projection bias (pre-activation), overriding the
    defaults (dt init for softplus, 0 otherwise).
    skip: the ``D * x`` skip; gate: ``y * silu(z)``.
    """

    objective: Any = "longhorn"
    heads: int = 1
    state_size: int = 16
    expand: int = 2
    conv_kernel: int = field(default=4, metadata={"min": 0})
    value_input: str = "auto"
    low_rank: Any = "auto"
    dt_min: float = 1e-3
    dt_max: float = 0.1
    plain_activation: str = "identity"
    input_bias: dict = field(default_factory=dict)
    skip: bool = True
    gate: bool = True
    kind: str = "objective"


@dataclass
class AttentionConfig:
    """Causal softmax attention with rotary position embeddings (the baseline mixer).

    window: sliding-window attention over the last ``window`` tokens (the token itself
    included); 0 is full causal attention.
    """

    heads: int = 4
    rope_base: float = 10000.0
    window: int = field(default=0, metadata={"min": 0})
    kind: str = "attention"


@dataclass
class ModuleMixerConfig:
    """Any ``nn.Module`` as the mixer (``ssmcraft.layers.module_mixer``).

    module: ``package.module:name`` of a factory (a class or function) called as
    ``factory(**{d_model_arg: d_model}, **options)``; it returns a module mapping
    ``[B, T, d_model] -> [B, T, d_model]`` (or a tuple whose first item is that, as FLA's layers).
    Importing the module runs its code: the spec's author chose to run it.
    state_elements: numbers of state one sequence carries (iso-state accounting); null: the
    module's own ``state_elements()`` method, else unknown.
    """

    module: str
    options: dict = field(default_factory=dict)
    d_model_arg: str = "d_model"
    state_elements: Any = None
    kind: str = "module"


MIXER_KINDS = {"objective": ObjectiveMixerConfig, "attention": AttentionConfig, "module": ModuleMixerConfig}


@dataclass
class LMConfig:
    """The small LM: embedding, ``n_layers`` x (RMSNorm, mixer, RMSNorm, gated MLP), tied head.

    mlp_ratio: hidden size of the gated MLP over d_model (0: no MLP, Mamba-style blocks).
    mixer: a mapping with ``kind`` (``objective``, ``attention`` or ``module``) and that kind's fields:
    the mixer of every layer that ``layers`` does not place another one at.
    layers: placement rules of a hybrid stack (``layer_mixers``); empty: every layer is ``mixer``.
    """

    vocab_size: int
    d_model: int = 64
    n_layers: int = 2
    mlp_ratio: float = field(default=4.0, metadata={"min": 0})
    mixer: dict = field(default_factory=lambda: {"kind": "objective"})
    norm_eps: float = 1e-5
    init_std: float = 0.02
    layers: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<config>", key: str = "model") -> "LMConfig":
        cfg = from_mapping(cls, data, source, key)
        mixer_config(cfg.mixer, source, f"{key}.mixer")   # validate early
        layer_mixers(cfg, source, key)
        return cfg


def from_mapping(cls, data: Mapping[str, Any], source: str, key: str):
    """``cls(**data)`` refusing unknown keys, missing required ones and ill-typed values (as
    ``SpecError``): the dataclass's fields read as a ``config_check`` section (``fields_of``)."""
    return cls(**Checker(source, key).section("", data, fields_of(cls)))


def fields_of(cls) -> dict[str, Field]:
    """A config dataclass's fields as a ``config_check`` table: required where the dataclass has
    no default; a field not given is left to the dataclass's default."""
    return {f.name: Field(_value_check(f), REQUIRED if f.default is dataclasses.MISSING
                          and f.default_factory is dataclasses.MISSING else ABSENT)
            for f in dataclasses.fields(cls)}


def number_or_same(value: Any) -> Any:
    """``"3e-3"`` -> 0.003: YAML 1.1 reads exponents without a dot as strings."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def _value_check(f: dataclasses.Field):
    """The check of a field's value against its annotation: ``int`` an integer >= ``metadata["min"]``
    (1 by default: sizes and counts), ``float`` a finite number > 0 (>= ``metadata["min"]`` when
    given; ``"3e-3"`` read as a number), ``bool`` / ``str`` / ``dict`` their type; ``Any``
    unchecked (read by the field's own user)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    lo = f.metadata.get("min")

    def check(c: Checker, key: str, v: Any) -> Any:
        if kind == "int":
            least = 1 if lo is None else lo
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                c.fail(key, f"expected an integer >= {least}, got {v!r}")
        elif kind == "float":
            v = number_or_same(v)
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or (v < lo if lo is not None else v <= 0):
                c.fail(key, f"expected a finite number {'>= ' + str(lo) if lo is not None else '> 0'}, got {v!r}")
        elif kind in ("bool", "str", "dict", "list"):
            if not isinstance(v, {"bool": bool, "str": str, "dict": Mapping, "list": list}[kind]):
                c.fail(key, f"expected a {'mapping' if kind == 'dict' else kind}, got {v!r}")
        return v
    return check


def mixer_kind(data: Mapping[str, Any]) -> Any:
    """A mixer mapping's ``kind``: as given, else ``module`` when it names a ``module``, else ``objective``."""
    return data.get("kind", "module" if "module" in data else "objective")


def mixer_config(data: Mapping[str, Any], source: str = "<config>", key: str = "model.mixer"):
    """The mixer config dataclass for a mapping with a ``kind``."""
    data = Checker(source, key).mapping("", data)
    kind = mixer_kind(data)
    if kind not in MIXER_KINDS:
        raise SpecError(source, f"{key}.kind", f"unknown mixer kind {kind!r}; known: {', '.join(MIXER_KINDS)}")
    return from_mapping(MIXER_KINDS[kind], {**data, "kind": kind}, source, key)


RULE_KINDS = ("attention", "module")    # what a placement rule may put at a layer (objective layers use model.mixer)


def layer_mixers(cfg: "LMConfig", source: str = "<config>", key: str = "model") -> list[tuple[str, dict]]:
    """``(where, mixer mapping)`` of each of the ``n_layers`` layers of a (hybrid) stack; ``where``
    is the mixer's key under the model section (``mixer`` or ``layers[r].mixer``).

    ``cfg.layers`` is a list of placement rules, each ``{at: i | [i, ...], mixer: {...}}``
    (0-based layer indices; negative ones count from the end) or ``{every: n, offset: o,
    mixer: {...}}`` (layers ``o, o + n, o + 2n, ...``; ``offset`` defaults to ``n - 1``, so
    ``every: 3`` is every third layer counting from one). Every layer no rule places gets
    ``cfg.mixer``. A rule's mixer is an ``attention`` mixer (``window: w`` for sliding-window
    attention) or a ``module`` mixer; objective layers share ``cfg.mixer``'s objective. A rule
    that places no layer, an index out of range or a layer two rules place is a ``SpecError``
    naming the rule's key.
    """
    n = cfg.n_layers
    out: list[tuple[str, dict]] = [("mixer", dict(cfg.mixer)) for _ in range(n)]
    placed: dict[int, str] = {}
    for r, rule in enumerate(cfg.layers):
        rkey = f"{key}.layers[{r}]"
        if not isinstance(rule, Mapping):
            raise SpecError(source, rkey, f"expected a mapping {{at: [...] or every: n, mixer: {{...}}}}, got {rule!r}")
        Checker(source, rkey).mapping("", rule, ("at", "every", "mixer", "offset"))
        if ("at" in rule) == ("every" in rule):
            raise SpecError(source, rkey, "give exactly one of at: [layer indices] or every: n")
        if "mixer" not in rule:
            raise SpecError(source, f"{rkey}.mixer", "missing (required): the mixer to place, e.g. {kind: attention}")
        mixer = rule["mixer"]
        kind = mixer_kind(mixer) if isinstance(mixer, Mapping) else None
        if isinstance(mixer, Mapping) and kind not in RULE_KINDS:
            raise SpecError(source, f"{rkey}.mixer.kind", f"a rule places {' or '.join(RULE_KINDS)} mixers, got "
                            f"{kind!r} (objective layers are {key}.mixer)")
        mixer_config(mixer, source, f"{rkey}.mixer")
        indices = _rule_layers(rule, n, source, rkey)
        if not indices:
            raise SpecError(source, rkey, f"places no layer of the {n}")
        for i in indices:
            if i in placed:
                raise SpecError(source, rkey, f"layer {i} is placed by {placed[i]} already")
            placed[i] = rkey
            out[i] = (f"layers[{r}].mixer", dict(mixer))
    return out


def _rule_layers(rule: Mapping, n: int, source: str, rkey: str) -> list[int]:
    """The 0-based layers one placement rule names (checked against ``n`` layers)."""
    def integer(k, v, lo=None):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
            raise SpecError(source, f"{rkey}.{k}", f"expected an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")
        return v

    if "at" in rule:
        if "offset" in rule:
            raise SpecError(source, f"{rkey}.offset", "applies to every: n only")
        at = rule["at"] if isinstance(rule["at"], list) else [rule["at"]]
        out = []
        for i in at:
            i = integer("at", i)
            if not -n <= i < n:
                raise SpecError(source, f"{rkey}.at", f"layer {i} is out of range for {n} "
                                f"layer{'s' if n != 1 else ''} (0..{n - 1}, or negative from the end)")
            out.append(i % n)
        if len(set(out)) != len(out):
            raise SpecError(source, f"{rkey}.at", f"names a layer twice: {at}")
        return sorted(out)
    every = integer("every", rule["every"], 1)
    offset = integer("offset", rule.get("offset", every - 1), 0)
    if offset >= every:
        raise SpecError(source, f"{rkey}.offset", f"must be below every = {every}, got {offset}")
    return list(range(offset, n, every))
