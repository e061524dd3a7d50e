"""The slots of a ``rankr`` update by name (``u{l}``, ``v{r}``, ``p{r}``, ``c{r}{l}``: the glossary is
``ssmcraft.ops.common.slots``), read the same way off the IR (``ssmcraft.compiler.ir.UpdateIR``) and off
an exported module's view of its JSON form (``ssmcraft.export.runtime.IRView``). It needs no sympy,
so an exported module carries it."""
from __future__ import annotations


class SlotNames:
    """The views of ``self.slots`` (slot name -> coefficient name) that the rank-r families read."""

    slots: dict

    def ranks(self) -> tuple[int, int]:
        """``rankr``: (L, R), the numbers of ``u`` and ``v`` vectors."""
        return (sum(1 for s in self.slots if s[0] == "u" and s[1:].isdigit()),
                sum(1 for s in self.slots if s[0] == "v" and s[1:].isdigit()))

    def input_slots(self) -> list[str]:
        """``rankr``: the slots ``p{r}`` of ``B = sum_r p_r v_r^T`` present, in order."""
        return [s for s in self.slots if len(s) == 2 and s[0] == "p" and s[1].isdigit()]

    def erase_slots(self) -> list[str]:
        """``rankr``: the slots ``c{r}{l}`` present (nonzero row factors), in order."""
        return [s for s in self.slots if len(s) == 3 and s[0] == "c" and s[1:].isdigit()]
