# SPDX-License-Identifier: Apache-2.0
"""Drafter training (`dflash-trt train-drafter`) and the small causal-LM trainer behind `tiny`.

  forward.py     the objective: anchors, the block mask, labels/weights, the training forward, the loss
  data.py        JSONL chat/text records, text files and directories -> tokenised samples
  regenerate.py  --regenerate: answers written by the target itself, cached
  trainer.py     the loop: frozen target features, AdamW + cosine, checkpoints, --resume, final tau
  target_lm.py   a plain next-token trainer (how the `tiny` target is made)
  corpus.py      the Python standard library's source as a corpus, with a held-out split
Nothing here is imported by `import dflash_trt`.
"""
