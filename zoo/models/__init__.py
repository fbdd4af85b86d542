"""The model registry: `config.model.name` -> its ModelFamily (module, task, checks).

Adding a family: a file in this package ending with `FAMILY = ModelFamily(...)` (see
family.py), and one line here.
"""
import flax.linen as nn
import ml_collections

from zoo.models import cnn, encoder_decoder, lora, mlp, resnet, transformer_lm, vit
from zoo.models.family import ModelFamily

MODELS: dict[str, ModelFamily] = {
    'mlp': mlp.FAMILY,
    'cnn': cnn.FAMILY,
    'resnet': resnet.FAMILY,
    'vit': vit.FAMILY,
    'transformer_lm': transformer_lm.FAMILY,
    'encoder_decoder': encoder_decoder.FAMILY,
}


def build(model_config: ml_collections.ConfigDict, **data_fields) -> nn.Module:
  """The model named by `model_config.name`, with its fields plus the data's (e.g. num_classes;
  a field the config also sets, such as an imported model's vocab_size, keeps the config's;
  one it leaves None takes the data's)."""
  fields = {k: lora.of(v) if k == 'lora' else v for k, v in model_config.items()
            if k != 'name' and v is not None}  # config.model.lora: a Lora value.
  return MODELS[model_config.name].module(**{**data_fields, **fields})
