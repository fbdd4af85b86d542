"""Documents packed into training windows (`data.windows = 'documents'`, the default).

A token split is a stream of documents, each ended by the end-of-document token (EOS).
Every token of a document is a target; the input before its first token is the previous
document's EOS (a synthetic EOS before the first document), which thus also marks a
document's start, as GPT-2 and lm-evaluation-harness's rolling windows use it.

Windows tile the targets in stream order, greedily (Levanter's and t5x's packing keep
order too): a document goes whole into the window being filled if it fits; one that does
not fit but is no longer than a window starts the next window, the rest of the current one
being padding; one longer than a window fills the current window and as many more as it
takes, its pieces each a document of their own. A window's tokens are thus one contiguous
range of the stream: one read. In the window, each document (or piece) has its own
segment id (1, 2, ...; 0 marks padding) and positions from 0; attention stays inside a
segment, and the loss mask is 0 on padding.
"""
from typing import Optional

import numpy as np


def plan(ends: np.ndarray, seq_len: int) -> np.ndarray:
  """int64 [W + 1]: window w trains on targets starts[w] .. starts[w + 1] - 1 of a split
  whose documents end at `ends` (increasing; ends[-1] the split's tokens), at most
  `seq_len` targets each."""
  breaks, start, room = [np.zeros(1, np.int64)], 0, seq_len
  for end in ends.tolist():
    length = end - start
    if length <= room:       # Whole, into this window.
      room -= length
    elif length <= seq_len:  # Whole, into the next window; padding before it.
      breaks.append(np.array([start], np.int64))
      room = seq_len - length
    else:                    # Split: the rest of this window, then whole windows.
      cuts = np.arange(start + room, end, seq_len, dtype=np.int64)
      breaks.append(cuts)
      room = seq_len - int(end - cuts[-1])
    start = end
  breaks.append(np.array([start], np.int64))
  return np.concatenate(breaks)


def padding(starts: np.ndarray, seq_len: int) -> float:
  """The fraction of a plan's window tokens that are padding."""
  windows = len(starts) - 1
  return 1.0 - float(starts[-1] - starts[0]) / (windows * seq_len) if windows else 0.0


def rows(tokens: list[np.ndarray], spans: np.ndarray, ends: np.ndarray, seq_len: int,
         eos: int, loss_masks: Optional[list[np.ndarray]] = None) -> dict:
  """A batch of packed windows: spans [n, 2] are the windows' target ranges [a, b) and
  tokens[i] the stream's tokens a - 1 .. b - 1 (a == 0: a .. b - 1, the EOS before the
  first document is added here). Fields: inputs, targets, segments, positions [n, seq_len]
  int32 and mask float32 (1 on a target, 0 on padding; with `loss_masks`, the stream's
  mask of targets a .. b - 1 each, 0 where a target does not count: chat data's non-
  assistant tokens)."""
  n = len(spans)
  batch = {k: np.zeros((n, seq_len), np.int32)
           for k in ('inputs', 'targets', 'segments', 'positions')}
  batch['mask'] = np.zeros((n, seq_len), np.float32)
  starts = np.concatenate([[0], ends[:-1]])  # Each document's first target.
  for i, ((a, b), got) in enumerate(zip(spans.tolist(), tokens)):
    if a == 0:
      got = np.concatenate([[eos], got])
    length = b - a
    targets = np.arange(a, b)
    doc = np.searchsorted(ends, targets, side='right')
    batch['inputs'][i, :length] = got[:-1]
    batch['targets'][i, :length] = got[1:]
    batch['segments'][i, :length] = doc - doc[0] + 1
    batch['positions'][i, :length] = targets - np.maximum(starts[doc], a)
    batch['mask'][i, :length] = 1.0 if loss_masks is None else loss_masks[i]
  return batch


class EpochOrder:
  """Window indices by position in an endless stream of epochs, each a fresh permutation
  of `count` windows from (*seed, epoch): a single dataset's global batch of step s is
  positions s * B .. (s + 1) * B - 1, so every window is seen once per epoch, batches
  cross epoch boundaries rather than drop windows, and the step alone is the data
  position."""

  def __init__(self, count: int, seed: tuple):
    self.count, self.seed, self._cache = count, tuple(seed), {}

  def _epoch(self, epoch: int) -> np.ndarray:
    if epoch not in self._cache:
      if len(self._cache) > 1:
        self._cache.pop(min(self._cache))
      self._cache[epoch] = np.random.default_rng([*self.seed, epoch]).permutation(self.count)
    return self._cache[epoch]

  def __call__(self, positions: np.ndarray) -> np.ndarray:
    epochs, within = np.divmod(np.asarray(positions, np.int64), self.count)
    out = np.empty(len(positions), np.int64)
    for epoch in np.unique(epochs).tolist():
      here = epochs == epoch
      out[here] = self._epoch(epoch)[within[here]]
    return out
