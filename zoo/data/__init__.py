"""The dataset registry: `config.data.name` -> its DataSource (loader, task, checks).

Adding a dataset: a file in this package ending with `SOURCE = DataSource(...)` (see
dataset.py), and one line here. Datasets live in host memory or are read per process;
zoo.data.feed turns their rows into global arrays on the devices.
"""
import ml_collections

from zoo.data import digits, npz, preference, prompts, records, seq, text, tokens
from zoo.data.dataset import DataSource, Dataset

DATASETS: dict[str, DataSource] = {
    'digits': digits.SOURCE,
    'text': text.SOURCE,
    'seq': seq.SOURCE,
    'npz': npz.SOURCE,
    'tokens': tokens.SOURCE,
    'records': records.SOURCE,
    'preference': preference.SOURCE,
    'prompts': prompts.SOURCE,
}


def load(data_config: ml_collections.ConfigDict, seed: int, plan: bool = False) -> Dataset:
  """The dataset named by `data_config.name`; for a `plan` (shapes only), its source's
  `plan_load` where it has one."""
  source = DATASETS[data_config.name]
  return (source.plan_load if plan and source.plan_load else source.load)(data_config, seed)
