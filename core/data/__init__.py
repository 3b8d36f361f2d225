"""Training and evaluation data: sources and tokenizers, packed batches, the data identity.

Modules: sources (embedded, local files, hub datasets; tokenizers), batches (packing, resumable
position), identity (a cheap fingerprint of the documents for resume checks), prefetch (batches
read ahead on a thread).
May import: core.parallel and below (in practice: config and errors).
"""
