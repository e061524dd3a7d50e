"""Layers: the objective mixer (Mamba/Longhorn block over any compiled objective), the
softmax-attention baseline (full or sliding-window), any module as a mixer, and the small LM
that stacks them (one mixer everywhere, or a hybrid layout)."""
from __future__ import annotations

from ssmcraft.layers.attention import AttentionMixer
from ssmcraft.layers.config import AttentionConfig, LMConfig, ModuleMixerConfig, ObjectiveMixerConfig, mixer_config
from ssmcraft.layers.lm import LM, GatedMLP, RMSNorm, build_mixer
from ssmcraft.layers.mitigation import Mitigation
from ssmcraft.layers.mixer import ObjectiveMixer, RecurrentCache
from ssmcraft.layers.module_mixer import ModuleMixer

__all__ = ["AttentionMixer", "AttentionConfig", "LMConfig", "ModuleMixer", "ModuleMixerConfig", "ObjectiveMixerConfig",
           "mixer_config", "LM", "GatedMLP", "RMSNorm", "build_mixer", "Mitigation", "ObjectiveMixer", "RecurrentCache"]
