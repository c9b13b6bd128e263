"""Tensor parallelism over `torch.distributed`: the process group of an engine's ranks (`group`),
the collectives the sharded layers run (`comm`), the vocabulary-parallel embedding and LM head
(`layers`), which shard of every weight a rank holds (`shard`), and rank 0's step commands to the
other ranks (`commands`). Starting and following ranks is the engine's (`engine.launch`)."""
