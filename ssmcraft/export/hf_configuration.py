"""The Hugging Face config of an exported model: ``configuration_ssmcraft.py`` of an ``--format hf`` folder.

Part of ssmcraft (imported only where ``transformers`` is installed: ``ssmcraft export --format
hf`` and its tests) and copied as it is into the folder, which ``transformers`` imports with
``trust_remote_code=True``. It imports nothing but ``transformers``.

The fields are data: ``ssmcraft`` holds the model config the exported module builds its layers
from (``MODEL_CONFIG`` of ``ssmcraft.export.runtime``), ``objective`` the objective's name and
IR hash, ``module`` the file of the exported module, ``weights_sha256`` the hash of
``model.safetensors`` that the model checks before it loads the weights.
"""
from __future__ import annotations

from transformers import PretrainedConfig

# The SHA-256 of the exported module this config goes with (an export writes it into its copy). transformers
# maps a config class to the first model class loaded for it, so exports whose modules differ must not
# share one config class: with their own hash in it, their configuration files are different modules.
MODULE_SHA256: str | None = None


class SsmcraftConfig(PretrainedConfig):
    """An exported ssmcraft language model: the model config, the objective and the weights' hash."""

    model_type = "ssmcraft"
    ssmcraft: dict | None = None
    objective: dict | None = None
    module: str | None = None
    weights_sha256: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = True
