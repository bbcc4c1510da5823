"""Everything that talks to ``torch.distributed``; elsewhere ranks are plain integers."""
