"""Training-free mitigations of state explosion (Stuffed Mamba), as an evaluation setting.

- retention / insertion scaling: the compiled objective's ``mitigated(retention, insertion)``
  (multiplies the decay exponent / step and the write strength by these factors);
- sliding window by state difference: the objective's ``sliding_window(inputs, params, w)``.

Both are refused by the compiled objective (``SsmcraftError``) when its structure does not
allow them; the mixer lets that error through unchanged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ssmcraft.errors import SsmcraftError


@dataclass(frozen=True)
class Mitigation:
    retention: float = 1.0
    insertion: float = 1.0
    window: int | None = None

    @property
    def scales(self) -> bool:
        return self.retention != 1.0 or self.insertion != 1.0

    @property
    def is_identity(self) -> bool:
        return not self.scales and self.window is None

    def label(self) -> str:
        if self.window is not None:
            return f"window={self.window}"
        return f"retention={self.retention:g},insertion={self.insertion:g}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, text: str) -> "Mitigation":
        """``"retention=0.5,insertion=1.0"`` or ``"window=256"`` (not both kinds at once)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in ("retention", "insertion", "window"):
                raise SsmcraftError(f"--mitigate: expected retention=R,insertion=I or window=W, got {text!r}")
            try:
                values[name] = float(value)
            except ValueError:
                raise SsmcraftError(f"--mitigate: {name} must be a number, got {value!r}") from None
        if not values:
            raise SsmcraftError(f"--mitigate: nothing to apply in {text!r}")
        if "window" in values:
            if len(values) > 1:
                raise SsmcraftError("--mitigate: window=W cannot be combined with retention/insertion")
            w = values["window"]
            if w < 1 or not float(w).is_integer():
                raise SsmcraftError(f"--mitigate: window must be a positive integer, got {w:g}")
            return cls(window=int(w))
        for name, v in values.items():
            if v <= 0:
                raise SsmcraftError(f"--mitigate: {name} must be positive, got {v:g}")
        return cls(retention=values.get("retention", 1.0), insertion=values.get("insertion", 1.0))
