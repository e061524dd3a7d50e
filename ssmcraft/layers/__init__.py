"""Layers: the objective mixer (Mamba/Longhorn block over any compiled objective), the
softmax-attention baseline, and the small LM that stacks them."""
from __future__ import annotations

from ssmcraft.layers.attention import AttentionMixer
from ssmcraft.layers.config import AttentionConfig, LMConfig, ObjectiveMixerConfig, mixer_config
from ssmcraft.layers.lm import LM, GatedMLP, RMSNorm, build_mixer
from ssmcraft.layers.mitigation import Mitigation
from ssmcraft.layers.mixer import ObjectiveMixer, RecurrentCache

__all__ = ["AttentionMixer", "AttentionConfig", "LMConfig", "ObjectiveMixerConfig", "mixer_config", "LM",
           "GatedMLP", "RMSNorm", "build_mixer", "Mitigation", "ObjectiveMixer", "RecurrentCache"]
