"""dsv4 core: the JAX implementation of DeepSeek-V4 Compressed Sparse Attention training.

Nothing here prints or parses argv; functions return plain values (DESIGN.md, "Layout").

Einsum alphabet, used in every contraction and as tensor-name suffixes (`q_bthd`, `kv_bwd`):
  b batch            t query position       s raw key position     w compressed block
  r tokens per block h query heads          i indexer heads        d head dim
  m model dim        f FFN hidden           e experts              k top-k slot
  v vocab            n mHC copies
"""
