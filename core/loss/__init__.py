"""Losses: the CSA indexer KL (direct, row machinery, streamed) and the LM cross-entropy.

Modules: indexer_kl (given scores), indexer_kl_rows (teacher rows, KL rows, block scans),
indexer_kl_streamed (per query block: scores, top-k, teacher and KL together), lm (direct and
chunked next-token loss).
May import: core.ops and below.
"""
