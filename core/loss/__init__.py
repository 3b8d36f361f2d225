"""Losses: the CSA indexer KL (direct, row machinery, streamed) and the LM cross-entropy.

Modules: indexer_kl (teacher rows, KL rows and block scans; the loss streamed per query block, scores,
top-k, teacher and KL together), indexer_kl_direct (the loss on given scores and a teacher built whole),
lm (direct and chunked next-token loss).
May import: core.ops and below.
"""
