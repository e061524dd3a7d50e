"""The Hugging Face model of an exported LM: ``modeling_ssmcraft.py`` of an ``--format hf`` folder.

Part of ssmcraft (imported only where ``transformers`` is installed) and copied into the folder,
where its imports of ssmcraft's export runtime become relative imports of the exported module
beside it (``ssmcraft.export.hf``): the layers, the recurrence and its kernels are the exported
module's, this file only adapts them to ``transformers``:

- ``SsmcraftForCausalLM``: ``PreTrainedModel`` + ``GenerationMixin`` around the exported
  ``Model`` (``self.model``); ``forward`` runs the prompt in one parallel pass (``prefill``)
  and every later token through the recurrent ``step``, carrying an ``SsmcraftCache``.
- ``SsmcraftCache``: every layer's cache (an objective mixer's convolution window and recurrent
  states, an attention layer's keys and values) and the number of tokens it has seen.
- ``from_pretrained`` checks ``model.safetensors`` against the SHA-256 the config records and the
  config's objective against the module's before it loads anything.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import cached_file

from ssmcraft.errors import SsmcraftError
from ssmcraft.fileio import file_sha256
from ssmcraft.export.hf_configuration import SsmcraftConfig
from ssmcraft.export.runtime import EXPORT, WEIGHTS_FILE
from ssmcraft.export.runtime_lm import Model

HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def check_objective(config: SsmcraftConfig) -> None:
    """The config names the objective (IR hash) this module was exported with."""
    got = (config.objective or {}).get("ir_hash")
    if got != EXPORT.get("ir_hash"):
        raise SsmcraftError(f"config.json: objective.ir_hash {got!r} is not the IR this module was exported with "
                            f"({EXPORT.get('objective')}, IR {EXPORT.get('ir_hash')})")


class SsmcraftCache:
    """Every layer's cache after ``seen`` tokens, as the exported ``Model`` lays it out (recurrent states and
    convolution windows, attention keys and values): not a ``transformers.Cache``, whose layers hold keys and
    values only, so ``generate`` makes none and takes this one from the model's outputs."""

    is_compileable = False
    is_croppable = False

    def __init__(self, states: list, seen: int):
        self.states = states
        self.seen = seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Keep the sequences ``beam_idx`` picks (beam search): row ``i`` of every state becomes row
        ``beam_idx[i]``."""
        self.states = [select_rows(state, beam_idx) for state in self.states]


def select_rows(value, index: torch.Tensor):
    """``value`` (a layer's cache: dataclasses, tuples and dicts of tensors ``[B, ...]``) with the rows
    ``index`` of every batched tensor; a position (an int or a 0-dim tensor) is shared by the batch."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device)) if value.dim() > 0 else value
    if isinstance(value, (tuple, list)):
        return type(value)(select_rows(v, index) for v in value)
    if isinstance(value, dict):
        return {k: select_rows(v, index) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: select_rows(getattr(value, f.name), index)
                                             for f in dataclasses.fields(value)})
    if isinstance(value, int):
        return value
    raise SsmcraftError(f"SsmcraftCache: cannot reorder a {type(value).__name__} of a layer's cache")


class SsmcraftForCausalLM(PreTrainedModel, GenerationMixin):
    """The exported language model for ``transformers``: ``input_ids [B, T]`` -> logits ``[B, T, V]``."""

    config_class = SsmcraftConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True
    _no_split_modules = ["Block"]

    def __init__(self, config: SsmcraftConfig):
        super().__init__(config)
        check_objective(config)
        # built on the CPU even where transformers builds on the meta device (from_pretrained): some
        # parameters' initial values are computed from numbers read off tensors; the checkpoint then
        # replaces every value
        with torch.device("cpu"):
            self.model = Model(config.ssmcraft, "config.json")
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False          # the model makes its own cache (SsmcraftCache) on the first forward

    def _init_weights(self, module):
        """Nothing: the layers initialise themselves as ssmcraft does, and a checkpoint fills every weight."""

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained``, after checking that ``model.safetensors`` is the file
        the config records (its SHA-256) and the config's objective is this module's."""
        hub = {k: kwargs[k] for k in HUB_ARGUMENTS if kwargs.get(k) is not None}
        config = kwargs.get("config")
        # the config AutoModel passes comes from its own copy of configuration_ssmcraft: not this module's class
        if getattr(config, "model_type", None) != SsmcraftConfig.model_type:
            config = SsmcraftConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        check_objective(config)
        weights = cached_file(pretrained_model_name_or_path, WEIGHTS_FILE, _raise_exceptions_for_missing_entries=False,
                              **hub)
        if weights is None:
            raise SsmcraftError(f"{pretrained_model_name_or_path}: no {WEIGHTS_FILE}")
        got = file_sha256(weights)
        if got != config.weights_sha256:
            raise SsmcraftError(f"{weights}: SHA-256 {got} is not the weights_sha256 config.json records "
                                f"({config.weights_sha256}); the weights were changed after export, refusing them")
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, then config.json records the SHA-256 of the weights it wrote
        (what ``from_pretrained`` checks): one ``model.safetensors``, saved before any upload."""
        if kwargs.get("push_to_hub"):
            raise SsmcraftError("SsmcraftForCausalLM.save_pretrained: push_to_hub would upload config.json before it "
                                "records the new weights' hash; save, then upload the folder")
        super().save_pretrained(save_directory, *args, **kwargs)
        weights = os.path.join(save_directory, WEIGHTS_FILE)
        if not os.path.isfile(weights):
            raise SsmcraftError(f"{save_directory}: no single {WEIGHTS_FILE} was written (sharded or not "
                                "safetensors), whose hash from_pretrained checks; save without max_shard_size")
        self.config.weights_sha256 = file_sha256(weights)
        self.config.save_pretrained(save_directory)

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, use_cache=None, **kwargs):
        """The prompt on the first call, then only the tokens the cache has not seen."""
        if cache is not None:
            input_ids = input_ids[:, cache.seen:]
        return {"input_ids": input_ids, "cache": cache, "use_cache": use_cache,
                "attention_mask": attention_mask if cache is None else None}

    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, labels=None,
                inputs_embeds=None, logits_to_keep=0, return_dict=None, **kwargs):
        """``input_ids [B, T]`` -> logits ``[B, T, V]``: without ``cache`` one parallel pass (``prefill``
        when ``use_cache``, which returns the cache), with it ``T`` recurrent steps from it.
        ``attention_mask`` may only pad on the right, and only without a cache (a recurrent state
        cannot skip a token); ``labels`` give the shifted cross-entropy ``loss``."""
        if inputs_embeds is not None:
            raise SsmcraftError("SsmcraftForCausalLM: inputs_embeds is not supported; pass input_ids")
        if use_cache is None:        # training needs no cache: the plain parallel pass
            use_cache = self.config.use_cache and not self.training
        self._check_mask(attention_mask, use_cache or cache is not None)
        if cache is None and use_cache:
            logits, states = self.model.prefill(input_ids)
            cache = SsmcraftCache(states, input_ids.shape[1])
        elif cache is None:
            logits = self.model(input_ids)
        else:
            steps, states = [], cache.states
            for t in range(input_ids.shape[1]):
                logits_t, states = self.model.step(input_ids[:, t], states)
                steps.append(logits_t)
            logits = torch.stack(steps, 1)
            cache.states, cache.seen = states, cache.seen + input_ids.shape[1]
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
        return out if return_dict is not False else out.to_tuple()

    @staticmethod
    def _check_mask(mask, recurrent: bool) -> None:
        if mask is None or bool(mask.all()):
            return
        if recurrent:
            raise SsmcraftError("SsmcraftForCausalLM: padding (zeros in attention_mask) with a cache: a recurrent "
                                "state cannot skip tokens; generate one sequence at a time (batch size 1), or pass "
                                "use_cache=False to score right-padded sequences")
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise SsmcraftError("SsmcraftForCausalLM: attention_mask pads on the left or has gaps; a recurrent "
                                "model reads every token before a position, so only right padding is allowed")

