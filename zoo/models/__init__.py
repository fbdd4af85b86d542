"""The model registry: `config.model.name` -> (Linen module, task it solves)."""
from zoo.models import cnn, encoder_decoder, mlp, resnet, transformer_lm, vit

# name -> (module class, task). A task names the data a model consumes: see zoo.data.
MODELS = {
    'mlp': (mlp.MLP, mlp.TASK),
    'cnn': (cnn.CNN, cnn.TASK),
    'resnet': (resnet.ResNet, resnet.TASK),
    'vit': (vit.ViT, vit.TASK),
    'transformer_lm': (transformer_lm.TransformerLM, transformer_lm.TASK),
    'encoder_decoder': (encoder_decoder.EncoderDecoder, encoder_decoder.TASK),
}


def build(model_config, **data_fields):
  """The model named by `model_config.name`, with its fields plus the data's (e.g. num_classes)."""
  cls, _ = MODELS[model_config.name]
  fields = {k: v for k, v in model_config.items() if k != 'name'}
  return cls(**fields, **data_fields)
